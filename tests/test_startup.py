"""What the `edgefl` command imports, by command: scikit-learn, matplotlib, onnx and
onnxruntime only when the command uses them (each costs 0.3-1.4 s of start-up; the times
are tools/bench_startup.py's, never asserted here). Each command runs in a fresh
interpreter, as a user's would."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("sklearn", "matplotlib", "onnx", "onnxruntime", "scipy")

PROBE = """
import json, sys
from edgefl.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:          # --help
    code = exc.code
sys.stdout.flush()
heavy = sorted({m.split('.')[0] for m in sys.modules} & set(%r))
print("\\nIMPORTED " + json.dumps({"code": code, "heavy": heavy}))
""" % (HEAVY,)


def imported(args, cwd, cache):
    env = {**os.environ, "EDGEFL_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    line = [x for x in done.stdout.splitlines() if x.startswith("IMPORTED ")]
    assert line, done.stdout + done.stderr
    result = json.loads(line[-1][len("IMPORTED "):])
    assert result["code"] in (0, None), done.stdout + done.stderr
    return set(result["heavy"])


@pytest.mark.parametrize("args", [["--help"], ["info"], ["simulate", "--help"]])
def test_help_and_info_import_none_of_the_heavy_packages(tmp_path, args):
    assert imported(args, tmp_path, tmp_path / "cache") == set()


def test_a_run_imports_what_it_uses_and_digits_only_once(tmp_path):
    pytest.importorskip("sklearn")
    cache = tmp_path / "cache"
    bare = ["simulate", "quickstart", "--quiet", "--no-plot", "--no-export"]
    # the first run decodes the digits with scikit-learn, and caches them
    assert "sklearn" in imported([*bare, "--out", "a"], tmp_path, cache)
    # later runs read the cache: none of the heavy packages
    assert imported([*bare, "--out", "b"], tmp_path, cache) == set()
    # the export and the plot bring in what they use
    full = imported(["simulate", "quickstart", "--quiet", "--out", "c"], tmp_path, cache)
    assert {"onnx", "onnxruntime", "matplotlib"} <= full and "sklearn" not in full
    assert sorted(os.listdir(tmp_path / "b")) == ["metrics.jsonl", "model.npz", "summary.json"]
