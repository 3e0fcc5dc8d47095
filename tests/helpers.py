"""Helpers several test modules share: polling for a condition with a timeout that names
what was awaited, a real NOTIFY_SOCKET read in the background (what systemd sees of a
service), a child's stderr pipe the test can jam (a stalled journald), and run configs
written to real YAML files.

Import them as `from helpers import wait_for, NotifySocket` (pytest puts tests/ on sys.path,
as `pytest_plugins = ["brokers"]` relies on). Broker fixtures and message waits stay in
tests/brokers.py.
"""
from __future__ import annotations

import io
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml

from edgefl.roles.state import JOURNAL_FILE, read_journal
from edgefl.runconfig import load_run_config

__all__ = ["wait_for", "NotifySocket", "StderrGate", "SMALL_RUN", "write_run_yaml",
           "load_small_run", "read_jsonl", "AggregatorProcesses", "start_mqtt_clients",
           "stop_clients", "aggregated_rounds", "StopAtLine", "import_tool", "usage_error",
           "killed_at_append", "onnx_that_loads_but_cannot_run"]


def import_tool(name: str):
    """The module of tools/<name>.py: the benchmarks and checks there are scripts, not a
    package, so their directory goes on sys.path (once)."""
    import importlib
    from pathlib import Path

    tools = str(Path(__file__).resolve().parents[1] / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module(name)


def usage_error(argv, capsys) -> str:
    """The error line of `edgefl ARGV` refused while its command line is parsed: exit status
    2 (argparse's), usage and one error line on stderr, no traceback, nothing on stdout."""
    from edgefl.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and "Traceback" not in err, (out, err)
    assert err.startswith("usage: "), err
    return err.splitlines()[-1]


def read_jsonl(path) -> list:
    """The records of a JSON-lines file (metrics.jsonl, a journal), in order."""
    with open(path) as f:
        return [json.loads(line) for line in f]


class StopAtLine(io.StringIO):
    """A progress stream for simulate (one line per round when it is not a TTY) that sets
    `stop` (a kernels.StopFlag) when a line containing `text` is written: a SIGTERM after
    that round, at a point the test chooses (edgefl simulate's StopSignal is a StopFlag)."""

    def __init__(self, stop, text: str):
        super().__init__()
        self.stop, self.text = stop, text

    def write(self, chunk):
        if self.text in chunk:
            self.stop.set()
        return super().write(chunk)


def refused_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` where nobody listens, below the kernel's ephemeral range:
    connecting to it is refused. (A free port from the kernel -- transport.broker.free_port
    -- is in that range, where a connection to it can, rarely, be given that very port as
    its source and connect to itself, a TCP self-connect: the client then reads back its own
    CONNECT, and a test of "cannot reach" sees a protocol error instead.)"""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(10000, max(low, 10001)), min(500, max(low - 10000, 1))):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} on {host}")


def wait_for(predicate, timeout=30.0, what="condition", poll=0.02):
    """Call `predicate` every `poll` seconds until it returns something truthy, and return
    that; after `timeout` seconds fail the test naming `what` was awaited. A loaded machine
    only makes it slower, never makes it fail: pass a timeout generous enough for that."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}")


class NotifySocket:
    """A real NOTIFY_SOCKET bound at `path` (keep it short: sun_path holds 108 bytes): a
    thread reads the datagrams as they come, as systemd does (a full datagram queue would
    block the sender).

    `lines` keeps every line sent ("STATUS=round 2: training"), `messages` every datagram as
    a {field: value} dict; `find` looks a field up in the latter, `times` says when datagrams
    with a field arrived."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)       # the reader wakes up to notice close()
        self.path = path
        self.lines: list[str] = []
        self.messages: list[dict] = []
        self.timed: list[tuple[float, dict]] = []     # (time.monotonic() at arrival, message)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.closed.is_set():
            try:
                data = self.sock.recv(4096)
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            lines = data.decode().splitlines()
            self.lines += lines
            # sd_notify fields are KEY=VALUE; a line without "=" is no field (kept in lines)
            message = dict(line.split("=", 1) for line in lines if "=" in line)
            self.messages.append(message)
            self.timed.append((time.monotonic(), message))

    def poll(self) -> list[dict]:
        """The datagrams received so far, as {field: value} dicts."""
        return list(self.messages)

    def find(self, key, value=None):
        """The first datagram with field `key` (containing `value`, if given), or None."""
        return next((m for m in self.poll() if key in m and (value is None or
                                                                value in m[key])), None)

    def times(self, key, value=None) -> list[float]:
        """When (time.monotonic()) the datagrams with field `key` (equal to `value`, if
        given) arrived, oldest first."""
        return [t for t, m in list(self.timed)
                if key in m and (value is None or m[key] == value)]

    def close(self) -> None:
        self.closed.set()
        self.thread.join(2)
        self.sock.close()


class StderrGate:
    """A pipe to pass as a child process's stderr (`stderr=gate.write_fd`), drained by a
    thread into `data`, which the test can jam like a stalled journald: jam() stops draining
    and fills the pipe, so the child's next write to stderr (a log line) blocks in the kernel
    until release(). Only the thread that writes blocks: the child's other threads run on.

    The pipe is filled through a second open file description of it (/proc/self/fd, Linux),
    non-blocking there only: the child's descriptor stays blocking."""

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        self._filler = os.open(f"/proc/self/fd/{self.write_fd}", os.O_WRONLY | os.O_NONBLOCK)
        self.data = bytearray()
        self._draining = threading.Event()
        self._draining.set()
        self._lock = threading.Lock()          # held by the drain thread while it reads
        self._closed = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while not self._closed.is_set():
            if not self._draining.wait(0.1):
                continue
            with self._lock:
                if not self._draining.is_set():
                    continue
                ready, _, _ = select.select([self.read_fd], [], [], 0.1)
                if ready:
                    chunk = os.read(self.read_fd, 65536)
                    if not chunk:
                        return
                    self.data += chunk

    def text(self) -> str:
        """What the child wrote (without jam()'s filler bytes)."""
        return self.data.replace(b"\0", b"").decode(errors="replace")

    def jam(self) -> int:
        """Stop draining and fill the pipe to the last byte; returns the bytes written."""
        with self._lock:
            self._draining.clear()
        filled = 0
        for size in (65536, 4096, 256, 16, 1):     # a write that does not fit fails whole
            while True:                             # (<= PIPE_BUF) or in part: fill down to 1
                try:
                    filled += os.write(self._filler, b"\0" * size)
                except BlockingIOError:
                    break
        return filled

    def release(self) -> None:
        """Drain again: the child's blocked write completes."""
        with self._lock:
            self._draining.set()

    def close(self) -> None:
        self._closed.set()
        self._draining.set()
        self.thread.join(2)
        for fd in (self._filler, self.write_fd, self.read_fd):
            try:
                os.close(fd)
            except OSError:
                pass


# A run small enough for the roles' tests on a loopback broker: seconds per run.
SMALL_RUN = {
    "dataset": {"name": "digits", "limit_train": 300},
    "partition": {"name": "iid", "clients": 3},
    "model": {"name": "softmax"},
    "strategy": {"name": "fedavg"},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "rounds": 2,
    "seed": 0,
}


def write_run_yaml(tmp_path, base: dict, name: str = "run.yaml", **changes) -> str:
    """Write the run config `base` with `changes` (top-level keys, each replaced whole) to
    tmp_path/name and return its path; `base` and the caller's values are not modified."""
    data = json.loads(json.dumps(base))
    data.update(json.loads(json.dumps(changes)))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def load_small_run(tmp_path, name: str = "run.yaml", **changes):
    """SMALL_RUN with `changes`, written to tmp_path/name and loaded as the roles load it."""
    return load_run_config(write_run_yaml(tmp_path, SMALL_RUN, name, **changes))


# ---------------------------------------------------------------------------------------
# an aggregator process killed and restarted, its boards as threads on a real broker
# ---------------------------------------------------------------------------------------

def aggregated_rounds(journal) -> list:
    """The rounds (versions) the aggregator's journal records as aggregated, in order."""
    return [r["round"] for r in read_journal(journal) if r.get("event") == "aggregated"]


class AggregatorProcesses:
    """`edgefl aggregator --once` as child processes of the test, started from one site file
    (node `node_id` of `federation`, run `run_path`, state in tmp_path/agg-state, outputs in
    tmp_path/out), each child logging to its own file in tmp_path; close() kills any child
    still running. spawn() also starts other commands (an `edgefl client`) the same way."""

    def __init__(self, tmp_path, broker_url, run_path, node_id, federation, deadline=60):
        self.tmp = tmp_path
        self.state, self.out = tmp_path / "agg-state", tmp_path / "out"
        self.journal = self.state / JOURNAL_FILE
        site = tmp_path / "aggregator.yaml"
        site.write_text(yaml.safe_dump({
            "profile": "generic-x86", "node": {"id": node_id, "federation": federation},
            "state_dir": str(self.state), "broker": {"url": broker_url}, "run": str(run_path),
            "log": {"level": "info"}}))
        self.env = dict(os.environ)
        self.command = [sys.executable, "-m", "edgefl.cli", "aggregator", "--config",
                        str(site), "--deadline", str(deadline), "--out", str(self.out),
                        "--once"]
        self.procs: list[subprocess.Popen] = []

    def spawn(self, log_name, args=None) -> subprocess.Popen:
        """Start the aggregator (or `args`), its output going to tmp_path/log_name."""
        with open(self.tmp / log_name, "wb") as log:
            proc = subprocess.Popen(args or self.command, cwd=self.tmp, env=self.env,
                                    stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def spawn_killed_at_round(self, log_name, round_: int) -> subprocess.Popen:
        """The aggregator, killing itself with SIGKILL as it is about to journal round
        `round_` as aggregated (its checkpoint already renamed into place): killed_at_append."""
        return self.spawn(log_name, killed_at_append(
            self.tmp, JOURNAL_FILE, '"event":"aggregated"', f'"round":{round_},') +
            self.command[3:])

    def run_again(self, threads, timeout: float = 90) -> None:
        """The aggregator started again (logging to aggregator-2.log) runs to its end (exit
        0) and the clients' `threads` end."""
        again = self.spawn("aggregator-2.log")
        assert again.wait(timeout) == 0, self.log("aggregator-2.log")[-3000:]
        for t in threads:
            t.join(20)

    def log(self, log_name) -> str:
        return (self.tmp / log_name).read_text()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def start_mqtt_clients(broker_url, federation, tag, run, tmp_path, shards):
    """A Client thread for each shard c of the prepared `run` (node client-<c>, exiting when
    the run is finished, its own MQTT connection and state directory tmp_path/client-<c>),
    started: returns ({c: Client}, [thread])."""
    from edgefl.roles import Client, ClientSettings
    from edgefl.transport.mqtt import MqttTransport
    clients, threads = {}, []
    for c in shards:
        node = f"client-{c}"
        t = MqttTransport(broker_url, f"{node}-{tag}", connect_timeout=5,
                          reconnect_min=0.05, reconnect_max=0.5)
        clients[c] = Client(ClientSettings(node, federation, exit_when_finished=True),
                            (run.clients[c].x, run.clients[c].y), t, tmp_path / node)
        threads.append(threading.Thread(target=clients[c].run, daemon=True))
        threads[-1].start()
    return clients, threads


def stop_clients(clients, threads, timeout=5.0) -> None:
    for client in clients.values():
        client.stop.set()
    for t in threads:
        t.join(timeout)


def killed_at_append(tmp_path, file_name: str, *words: str) -> list:
    """The command line prefix (python and a launcher script) of an `edgefl` process that
    kills itself with SIGKILL -- a crash: no clean-up, no atexit, no flush -- at one point
    of its own: when it is about to append (roles/state.py's _append, behind
    append_journal and the history) a line to a file named `file_name` that holds every
    one of `words` (bytes of the line's JSON, e.g. '"round":2'). Everything it wrote
    before that point is on disk as it would be after a kill -9 there. Append the
    `edgefl` arguments: killed_at_append(...) + ["aggregator", "--config", ...]."""
    script = tmp_path / f"killed-at-{file_name}.py"
    script.write_text(
        "import os, signal, sys\n"
        "from edgefl.roles import state\n"
        "_append = state._append\n"
        f"WORDS = {[w.encode() for w in words]!r}\n"
        "def append(path, data, what, whole):\n"
        f"    if os.path.basename(os.fspath(path)) == {file_name!r} and \\\n"
        "            all(w in data for w in WORDS):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return _append(path, data, what, whole)\n"
        "state._append = append\n"
        "from edgefl.cli import console_main\n"
        "sys.exit(console_main(sys.argv[1:]))\n")
    return [sys.executable, str(script)]


def onnx_that_loads_but_cannot_run(input_shape=(1, 8, 8), classes: int = 10) -> bytes:
    """A model file onnxruntime builds a session from and that declares what a Predictor
    needs (one float input (batch, *input_shape), scores (batch, classes)), but whose Reshape
    asks for rows of one feature more than a sample has: shape inference cannot see it with
    a symbolic batch, so only running the graph fails ("cannot be reshaped")."""
    import math

    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    features = math.prod(input_shape) + 1
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["input", "shape"], ["flat"]),
         helper.make_node("Gemm", ["flat", "weight"], ["scores"], transB=1)],
        "loads-but-cannot-run",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", *input_shape])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", classes])],
        [numpy_helper.from_array(np.array([-1, features], np.int64), "shape"),
         numpy_helper.from_array(np.zeros((classes, features), np.float32), "weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def onnx_edgefl_never_emits(kind: str, input_shape=(1, 8, 8), classes: int = 10) -> bytes:
    """A model a Predictor could serve (one float input (batch, *input_shape), scores
    (batch, classes)) and onnxruntime loads and runs, holding what edgefl's exporter never
    writes: "external" keeps the weights in a file named "secret.bin", which onnxruntime
    reads relative to its working directory (a model loaded from bytes); "contrib" ends in
    onnxruntime's com.microsoft Gelu; "op" in a standard op (Tanh) of no edgefl export;
    "function" in a custom op defined as a model-local function."""
    import math

    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    features = math.prod(input_shape)
    weight = numpy_helper.from_array(np.full((classes, features), 0.01, np.float32), "weight")
    last = [helper.make_node("Gemm", ["flat", "weight"], ["scores"], transB=1)]
    opsets = [helper.make_opsetid("", 17)]
    functions = []
    if kind == "external":
        weight.ClearField("raw_data")
        weight.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "secret.bin"), ("offset", "0"),
                           ("length", str(4 * classes * features))):
            entry = weight.external_data.add()
            entry.key, entry.value = key, value
    elif kind in ("contrib", "op", "function"):
        op, domain = {"contrib": ("Gelu", "com.microsoft"), "op": ("Tanh", ""),
                      "function": ("Squash", "custom.fn")}[kind]
        last = [helper.make_node("Gemm", ["flat", "weight"], ["gemm"], transB=1),
                helper.make_node(op, ["gemm"], ["scores"], domain=domain)]
        if domain:
            opsets.append(helper.make_opsetid(domain, 1))
        if kind == "function":
            functions.append(helper.make_function(
                "custom.fn", "Squash", ["x"], ["y"], [helper.make_node("Tanh", ["x"], ["y"])],
                [helper.make_opsetid("", 17)]))
    else:
        raise ValueError(kind)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["input"], ["flat"], axis=1)] + last, kind,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", *input_shape])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", classes])],
        [weight])
    model = helper.make_model(graph, opset_imports=opsets, functions=functions)
    model.ir_version = 8
    return model.SerializeToString()
