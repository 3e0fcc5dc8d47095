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


SANITIZE = ["-fsanitize=address,undefined,float-cast-overflow", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer"]


def _sanitizers_link(tmp_path) -> bool:
    probe = tmp_path / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    return subprocess.run(["gcc", *SANITIZE, str(probe), "-o", str(tmp_path / "probe")],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_c_unit_tests_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """The same C unit tests built with AddressSanitizer and UndefinedBehaviorSanitizer (float
    to integer overflow included, which -fsanitize=undefined leaves out in gcc): any report
    (an out-of-bounds access, a misaligned load, a signed overflow) fails the run."""
    if not _sanitizers_link(tmp_path):
        pytest.skip("gcc cannot link -fsanitize=address,undefined here (libasan/libubsan)")
    exe = tmp_path / "test_core_san"
    sources = sorted(str(p) for p in (ROOT / "csrc").glob("*.c"))
    subprocess.run(["gcc", "-std=c99", "-O1", "-g", *SANITIZE, "-Wall", "-Wextra", "-Werror",
                    f"-I{ROOT / 'csrc'}", *sources, str(ROOT / "tests" / "c" / "test_core.c"),
                    "-lm", "-o", str(exe)], check=True, capture_output=True, text=True)
    env = {"ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "print_stacktrace=1",
           "PATH": "/usr/bin:/bin"}
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=env)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0 and lines and lines[-1].endswith(" 0 failed"), \
        run.stdout[-4000:] + run.stderr[-4000:]
