"""Declares edgefl's one compiled extension; all metadata lives in pyproject.toml.

Environment switches (read at build time):
  EDGEFL_STRICT_BUILD=1  a compile/link failure fails the install (CI sets it); without it the
                         install falls back to the pure-NumPy backend with a warning.
  EDGEFL_NO_BLAS=1       build the portable C99 GEMM even where scipy-openblas32 is available.
  EDGEFL_DEBUG=1         Cython bounds/wraparound checks on, -O0 -g.
"""
import os
import sys
from glob import glob

from setuptools import setup
from setuptools.command.build_ext import build_ext


def _flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


STRICT = _flag("EDGEFL_STRICT_BUILD")
DEBUG = _flag("EDGEFL_DEBUG")


class StrictOrOptionalBuildExt(build_ext):
    """Compile the C core; without the strict switch a failure degrades to the NumPy backend."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler/linker failure
            if STRICT:
                raise
            sys.stderr.write(f"\nedgefl: C core not built ({exc}); the NumPy backend will be used.\n\n")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            if STRICT:
                raise
            sys.stderr.write(f"\nedgefl: building {ext.name} failed ({exc}); NumPy backend only.\n\n")


def _blas_config():
    """Link scipy-openblas32 when importable (the wheel NumPy's own BLAS comes from)."""
    if _flag("EDGEFL_NO_BLAS"):
        return {}
    try:
        import scipy_openblas32 as ob
    except ImportError:
        return {}
    # Run paths, so the core finds its BLAS without edgefl/__init__'s preload (a namespace
    # package shadowing the install skips it): $ORIGIN-relative for an install into
    # site-packages (edgefl/ next to scipy_openblas32/), and the build's own copy unless it is
    # pip's temporary build environment, gone once the install ends (editable installs built
    # with --no-build-isolation, `setup.py build_ext --inplace`).
    rpath = ["$ORIGIN/../scipy_openblas32/lib"]
    if "pip-build-env" not in ob.get_lib_dir():
        rpath.append(ob.get_lib_dir())
    return dict(
        include_dirs=[ob.get_include_dir()],
        library_dirs=[ob.get_lib_dir()],
        libraries=[ob.get_library()],
        runtime_library_dirs=rpath,
        define_macros=[("EF_HAVE_BLAS", "1"), ("BLAS_SYMBOL_PREFIX", "scipy_")],
    )


def extensions():
    from Cython.Build import cythonize
    from setuptools import Extension
    import numpy

    blas = _blas_config()
    warn = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unused-function"]
    cflags = ["-std=c99", "-O0", "-g"] if DEBUG else ["-std=c99", "-O3", "-fno-math-errno"]
    # Cython's generated C is not C99-warning-clean; -Werror applies to csrc/ in tools/check_arm.sh.
    ext = Extension(
        "edgefl._core",
        sources=["edgefl/_core.pyx"] + sorted(glob("csrc/*.c")),
        include_dirs=["csrc", numpy.get_include()] + blas.get("include_dirs", []),
        library_dirs=blas.get("library_dirs", []),
        libraries=blas.get("libraries", []) + ["m"],
        runtime_library_dirs=blas.get("runtime_library_dirs", []),
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")] + blas.get("define_macros", []),
        extra_compile_args=cflags + warn,
    )
    directives = dict(
        language_level=3,
        boundscheck=DEBUG,
        wraparound=DEBUG,
        initializedcheck=DEBUG,
        cdivision=True,
        embedsignature=True,
    )
    return cythonize([ext], compiler_directives=directives)


setup(ext_modules=extensions(), cmdclass={"build_ext": StrictOrOptionalBuildExt})
