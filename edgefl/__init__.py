"""edgefl: federated learning for edge boards.

`edgefl.backend` says which kernel backend loaded: "c" (the compiled core) or "numpy" (the
pure-NumPy reference). Set EDGEFL_BACKEND=numpy before import to force the reference.
"""
__version__ = "0.1.0"

from .kernels import backend  # noqa: E402,F401

__all__ = ["__version__", "backend"]
