"""Preloads the scipy-openblas32 shared library before the compiled core is imported.

The core links `libscipy_openblas.so` by soname. Its build-time rpath may point into a
temporary build environment (pip's build isolation), so the run-time copy installed as a
dependency is loaded here first; the dynamic linker then resolves the core's dependency to it.
A core built without BLAS (EDGEFL_NO_BLAS=1, or no wheel for the platform) needs nothing.

The package is found, not imported: its __init__ reads its own version through
importlib.metadata, which pulls in the email package, about 40 ms of every launch (a third of
`import numpy`) for a path. Its library lives in its lib/ directory (the package's own
get_lib_dir()), named libscipy_openblas*.so (get_library()).
"""
import ctypes
import importlib.util
import os

_spec = importlib.util.find_spec("scipy_openblas32")
_dirs = list(_spec.submodule_search_locations or ()) if _spec is not None else []
# no wheel for this platform: the core was built with the C99 GEMM
_lib_dir = os.path.join(_dirs[0], "lib") if _dirs else None
if _lib_dir is not None and os.path.isdir(_lib_dir):
    for _name in sorted(os.listdir(_lib_dir)):
        if _name.startswith("libscipy_openblas") and _name.endswith(".so"):
            ctypes.CDLL(os.path.join(_lib_dir, _name), mode=ctypes.RTLD_GLOBAL)
            break
