"""Preloads the scipy-openblas32 shared library before the compiled core is imported.

The core links `libscipy_openblas.so` by soname. Its build-time rpath may point into a
temporary build environment (pip's build isolation), so the run-time copy installed as a
dependency is loaded here first; the dynamic linker then resolves the core's dependency to it.
A core built without BLAS (EDGEFL_NO_BLAS=1, or no wheel for the platform) needs nothing.
"""
import ctypes
import os

try:
    import scipy_openblas32 as _ob
except ImportError:  # no wheel for this platform: the core was built with the C99 GEMM
    _ob = None

if _ob is not None:
    _path = os.path.join(_ob.get_lib_dir(), "lib" + _ob.get_library() + ".so")
    if os.path.exists(_path):
        ctypes.CDLL(_path, mode=ctypes.RTLD_GLOBAL)
