"""A fleet with emulated boards (marker `board`): the aggregator service on this host, two
`edgefl client` processes that are aarch64 programs in the arm64 Debian userland of
tools/board_in_a_box.sh (qemu-user), and one native client, train a run that an operator
starts with `edgefl ctl start`, through a real Mosquitto on a free port.

- the run finishes; each client is the process the test started (the boards' is qemu);
- every client installs the exported model.onnx from the broker, and `edgefl predict` run
  on the board serves it with the host's classes and probabilities;
- the final model against the same run with every client on x86-64 (`edgefl simulate` in
  process, the same config and seed): not bit-identical, because the boards' C core calls
  OpenBLAS's aarch64 GEMM kernels, which sum in another order than the x86-64 ones; the
  parameters agree within ARM_TOLERANCE and the accuracy within one test sample per round.

Skipped, saying why, when qemu-aarch64-static or the box (`tools/board_in_a_box.sh install`)
is missing. EDGEFL_BOARD_FULL=1 (tools/board_in_a_box.sh fleet) runs the long variant.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgefl.runconfig import load_run_config
from edgefl.sim import simulate
from helpers import wait_for

pytest_plugins = ["brokers"]
pytestmark = pytest.mark.board

REPO = Path(__file__).resolve().parents[1]
BOX_SCRIPT = REPO / "tools" / "board_in_a_box.sh"
VENV = "/opt/edgefl/venv"
FULL = os.environ.get("EDGEFL_BOARD_FULL") == "1"
# measured (docs/deployment.md "A board in a box"): the largest parameter difference was
# 6e-8 after the short run and 1.8e-7 after the long one; the bound leaves 50x room
ARM_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
RUN = {
    "partition": {"name": "iid", "clients": 3},
    "model": {"name": "mlp", "hidden": [32]},
    "strategy": {"name": "fedavg"},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 2 if FULL else 1},
    "rounds": 10 if FULL else 3,
    "clients_per_round": 3,
    "seed": 0,
}
CLIENT_IDS = ["board-0", "board-1", "host-2"]      # the partition's shards 0, 1, 2
BOARDS = CLIENT_IDS[:2]


def _box_dir() -> Path | None:
    try:
        out = subprocess.run(["bash", str(BOX_SCRIPT), "path"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def box_skip_reason() -> str | None:
    if shutil.which("qemu-aarch64-static") is None:
        return "qemu-aarch64-static is not installed (apt-get install qemu-user-static)"
    box = _box_dir()
    if box is None or not (box / ".userland-ok").exists():
        return (f"no arm64 userland at {box} (build it: tools/board_in_a_box.sh userland; "
                ".ci/run does)")
    if not (box / VENV.lstrip("/") / "bin" / "edgefl").exists():
        return f"edgefl is not installed in {box}{VENV} (tools/board_in_a_box.sh install)"
    return None


def board_argv(tmp_path: Path, *argv: str) -> list[str]:
    """argv running VENV/bin/<argv[0]> on the board, with tmp_path bound at the same path."""
    return ["bash", str(BOX_SCRIPT), "run", "-b", str(tmp_path), "--",
            f"{VENV}/bin/{argv[0]}", *argv[1:]]


def host_env() -> dict:
    env = dict(os.environ)
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def box():
    if os.environ.get("EDGEFL_BACKEND") == "numpy":
        pytest.skip("the boards build the C core: this test runs in the compiled backend's "
                    "pass only (its x86-64 reference would be NumPy's here)")
    reason = box_skip_reason()
    if reason:
        pytest.skip(reason)
    return _box_dir()


def write_digits(path: Path) -> None:
    """scikit-learn's digits as an npz file both sides read at the same path."""
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x, y = digits.data.astype(np.float32), digits.target.astype(np.int64)
    np.savez(path, x_train=x[:1400], y_train=y[:1400], x_test=x[1400:], y_test=y[1400:])


def test_edgefl_info_on_the_board_says_c_core_with_blas(box, tmp_path):
    out = subprocess.run(board_argv(tmp_path, "edgefl", "info"), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    fields = dict(line.split(None, 1) for line in out.stdout.splitlines()
                  if line and not line.startswith(" ") and len(line.split(None, 1)) == 2)
    assert fields["backend"].strip() == "c", out.stdout
    assert fields["blas"].strip() == "yes", out.stdout
    machine = subprocess.run(board_argv(tmp_path, "python", "-c",
                                        "import platform; print(platform.machine())"),
                             capture_output=True, text=True, timeout=300)
    assert machine.stdout.strip() == "aarch64", machine.stderr


def test_a_fleet_with_two_emulated_boards_finishes_and_the_boards_serve_its_model(
        box, tmp_path, mosquitto_server):
    fed = f"board-{uuid.uuid4().hex[:8]}"
    data = tmp_path / "digits.npz"
    write_digits(data)
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(dict(RUN, dataset={"name": "npz", "path": str(data)})))
    state = tmp_path / "aggregator"

    def site(name: str, doc: dict) -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(dict(doc, broker={"url": mosquitto_server.url},
                                            log={"level": "info"})))
        return str(path)

    agg_site = site("aggregator", {"profile": "generic-x86", "state_dir": str(state),
                                   "node": {"id": "aggregator", "federation": fed},
                                   "export": {"every": 0, "publish": True}})
    # the boards use their own profile; float32 on the wire, as the x86 reference
    client_sites = {c: site(c, {"profile": "rpi4" if c in BOARDS else "generic-x86",
                                "node": {"id": c, "federation": fed},
                                "state_dir": str(tmp_path / c),
                                "transport": {"compression": "none"}})
                    for c in CLIENT_IDS}
    env = host_env()
    host = [sys.executable, "-m", "edgefl.cli"]
    ctl = host + ["ctl", "--broker", mosquitto_server.url, "--federation", fed,
                  "--timeout", "60"]
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, argv: list[str]) -> subprocess.Popen:
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return procs[name]

    def log_of(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")

    try:
        spawn("aggregator", host + ["aggregator", "--config", agg_site])
        for shard, c in enumerate(CLIENT_IDS):
            argv = ["client", "--config", client_sites[c], "--partition", str(run_file),
                    "--shard", str(shard), "--exit-when-finished"]
            spawn(c, board_argv(tmp_path, "edgefl", *argv) if c in BOARDS else host + argv)
        wait_for(lambda: "taking commands on" in log_of("aggregator"), timeout=120, poll=0.2,
                 what="the aggregator service to take commands")
        # the boards are aarch64 processes: the kernel runs them through qemu (binfmt_misc
        # in the box's namespace), the very processes started here (exec all the way down)
        for c in BOARDS:
            exe = os.readlink(f"/proc/{procs[c].pid}/exe")
            assert exe.endswith("qemu-aarch64-static"), (c, exe)
        assert not os.readlink(f"/proc/{procs['host-2'].pid}/exe").endswith("-static")
        wait_for(lambda: all(f"federation '{fed}': waiting for a run" in log_of(c)
                             for c in CLIENT_IDS),
                 timeout=300, poll=0.5, what="every client connected")
        # the operator follows the run from before its start, so no event is missed
        watch = subprocess.Popen(ctl + ["watch"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        procs["watch"] = watch
        started = subprocess.run(ctl + ["start", str(run_file), "--run", "arm", "--clients",
                                        ",".join(CLIENT_IDS), "--json"], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr
        watched, watch_err = watch.communicate(timeout=900 if FULL else 400)
        assert watch.returncode == 0, watched[-3000:] + watch_err[-3000:] + \
            log_of("aggregator")[-3000:]
        assert "run_finished" in watched, watched
        for c in CLIENT_IDS:
            assert procs[c].wait(120) == 0, log_of(c)[-3000:]
            assert f"finished after round {RUN['rounds']}" in log_of(c), log_of(c)[-3000:]
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)

    out = state / "runs" / "arm"
    summary = json.loads(wait_for(lambda: (out / "summary.json").exists() and
                                  (out / "summary.json").read_text(),
                                  timeout=60, what="the run's summary.json"))
    rounds = RUN["rounds"]
    assert summary["rounds"] == rounds
    # every board installed the model the aggregator exported
    onnx = (out / "model.onnx").read_bytes()
    for c in CLIENT_IDS:
        assert (tmp_path / c / "model.onnx").read_bytes() == onnx, c

    # the board serves it: edgefl predict under qemu, the same answers as on the host
    samples = tmp_path / "samples.npy"
    np.save(samples, np.load(data)["x_test"][:20])
    argv = ["predict", str(tmp_path / BOARDS[0] / "model.onnx"), "--input", str(samples),
            "--json", "--top", "1"]
    on_board = subprocess.run(board_argv(tmp_path, "edgefl", *argv), capture_output=True,
                              text=True, timeout=300)
    assert on_board.returncode == 0, on_board.stderr
    on_host = subprocess.run(host + argv, env=env, capture_output=True, text=True, timeout=120)
    assert on_host.returncode == 0, on_host.stderr
    board_doc, host_doc = json.loads(on_board.stdout), json.loads(on_host.stdout)
    assert board_doc["classes"] == host_doc["classes"]
    np.testing.assert_allclose(board_doc["probabilities"], host_doc["probabilities"],
                               rtol=1e-5, atol=1e-6)

    # against the all-x86-64 run of the same config and seed
    reference = simulate(load_run_config(str(run_file)), str(tmp_path / "x86"), workers=3,
                         progress=False)
    arm_model, x86_model = np.load(out / "model.npz"), np.load(tmp_path / "x86" / "model.npz")
    report = compare_models(arm_model, x86_model)
    (tmp_path / "comparison.json").write_text(json.dumps(report, indent=2))
    print("board vs x86-64:", json.dumps(report))
    for key in report["arrays"]:
        np.testing.assert_allclose(arm_model[key], x86_model[key], **ARM_TOLERANCE,
                                   err_msg=key)
    n_test = len(np.load(data)["y_test"])
    assert abs(summary["final_accuracy"] - reference["final_accuracy"]) <= rounds / n_test


def compare_models(a, b) -> dict:
    """The float arrays both model.npz files hold: identical or not, the largest absolute
    difference, and the largest difference relative to the array's largest magnitude."""
    arrays = [k for k in a.files if k in b.files and a[k].dtype.kind == "f"]
    worst_abs = max(float(np.max(np.abs(a[k] - b[k]))) for k in arrays)
    worst_rel = max(float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-30))
                    for k in arrays)
    return {"arrays": arrays, "identical": all(np.array_equal(a[k], b[k]) for k in arrays),
            "max_abs_diff": worst_abs, "max_rel_diff": worst_rel}
