"""edgefl: federated learning for edge boards.

`edgefl.backend` says which kernel backend loaded: "c" (the compiled core) or "numpy" (the
pure-NumPy reference). Set EDGEFL_BACKEND=numpy before import to force the reference.
"""
# the distribution's version too: pyproject.toml reads it from here without importing edgefl,
# so it stays a plain string literal
__version__ = "0.1.0"

# Load the BLAS the compiled core links before anything imports edgefl._core, whichever
# backend is selected (tests and benchmarks import the core directly for parity checks).
from . import _blas  # noqa: E402,F401
from .kernels import backend  # noqa: E402,F401

__all__ = ["__version__", "backend"]
