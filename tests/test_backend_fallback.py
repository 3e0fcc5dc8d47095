"""The fast path never degrades silently (issue 19, item 6).

A folder named `edgefl` in the working directory (a clone beside an editable install) makes
`import edgefl` a namespace package: edgefl/__init__ (and its BLAS preload) never runs. The
compiled core must still load, and a fallback to the NumPy reference that was not asked for
must show in the run's log and summary.json, and stop a long run.

Each case is a real Python subprocess: the import system's state is what is under test.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import SMALL_RUN, write_run_yaml

import edgefl
from edgefl import kernels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(edgefl.__file__)))
needs_core = pytest.mark.skipif(kernels.backend != "c" or kernels._REQUESTED == "numpy",
                                reason="the compiled core is not in use in this run")


def _clean_env(**extra) -> dict:
    """The environment without anything that points Python at this tree or picks a backend:
    the subprocess finds edgefl only through the editable finder it installs."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EDGEFL_BACKEND")}
    env.update(extra)
    return env


def _editable_finder(tmp_path) -> str:
    """setuptools' own editable-install finder for this tree (what `pip install -e` writes to
    site-packages), in a directory of its own; returns that directory."""
    from setuptools.command.editable_wheel import _finder_template

    where = tmp_path / "finder"
    where.mkdir()
    (where / "edgefl_test_editable_finder.py").write_text(
        _finder_template("edgefl", {"edgefl": os.path.join(REPO, "edgefl")}, {}))
    return str(where)


# Runs in the subprocess: drop any other editable finder for edgefl (the machine's own
# install), install this tree's after the PathFinder, as a .pth-installed finder sits.
_PRELUDE = """
import sys
sys.path.insert(1, {finder!r})
sys.meta_path[:] = [f for f in sys.meta_path if 'edgefl' not in getattr(f, '__module__', '')]
import edgefl_test_editable_finder as finder
finder.install()
"""


@needs_core
def test_core_loads_its_blas_when_a_folder_shadows_the_package(tmp_path):
    (tmp_path / "edgefl").mkdir()           # the clone beside the install
    code = _PRELUDE.format(finder=_editable_finder(tmp_path)) + """
import warnings
warnings.simplefilter("error")             # the old fallback was only this warning
import edgefl, edgefl.kernels as k
print("init-ran", hasattr(edgefl, "__version__"))
print("backend", k.backend, k.fallback)
print("kernels", k.__file__)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # the shadow is real: the package's __init__ did not run ...
    assert "init-ran False" in out.stdout
    assert f"kernels {os.path.join(REPO, 'edgefl', 'kernels.py')}" in out.stdout
    # ... and the compiled core loaded all the same
    assert "backend c False" in out.stdout


_NO_CORE = """
import sys
sys.modules["edgefl._core"] = None         # as if the extension were not built
from edgefl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_unrequested_fallback_is_in_the_log_and_summary(tmp_path):
    config = write_run_yaml(tmp_path, SMALL_RUN)
    out = subprocess.run([sys.executable, "-c", _NO_CORE, "simulate", config, "--out",
                          str(tmp_path / "out"), "--quiet"],
                         cwd=tmp_path, env=_clean_env(PYTHONPATH=REPO), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "edgefl: backend numpy, not the compiled core (fallback: compiled core " \
           "unavailable" in out.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["backend"] == "numpy"
    assert summary["backend_reason"].startswith("fallback: compiled core unavailable")


def test_unrequested_fallback_refuses_a_long_run_unless_numpy_was_asked_for(tmp_path):
    # 3 clients x 400 rounds = 1,200 client-rounds, above kernels.LONG_RUN_CLIENT_ROUNDS
    config = write_run_yaml(tmp_path, SMALL_RUN, rounds=400)
    argv = [sys.executable, "-c", _NO_CORE, "simulate", config, "--quiet"]
    refused = subprocess.run(argv, cwd=tmp_path, env=_clean_env(PYTHONPATH=REPO),
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert "1200 client-rounds on the NumPy reference, which was not asked for" in refused.stderr
    assert "EDGEFL_BACKEND=numpy" in refused.stderr
    # asked for: the same run goes ahead, without the fallback line
    asked = subprocess.run(argv, cwd=tmp_path,
                           env=_clean_env(PYTHONPATH=REPO, EDGEFL_BACKEND="numpy"),
                           capture_output=True, text=True, timeout=300)
    assert asked.returncode == 0, asked.stderr
    assert "not the compiled core" not in asked.stderr
