"""The C unit tests (tests/c/test_core.c) compiled strictly with the host gcc and run: the
core stands on its own, without Python, with the portable GEMM (tools/check_arm.sh runs the
same program for aarch64 and armhf under qemu-user)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_c_unit_tests_pass(tmp_path):
    exe = tmp_path / "test_core"
    sources = sorted(str(p) for p in (ROOT / "csrc").glob("*.c"))
    subprocess.run(["gcc", "-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}",
                    *sources, str(ROOT / "tests" / "c" / "test_core.c"), "-lm", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    last = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0 and last.endswith(" 0 failed"), run.stdout
    assert int(last.split()[0]) >= 20
