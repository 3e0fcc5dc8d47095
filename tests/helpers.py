"""Helpers several test modules share: polling for a condition with a timeout that names
what was awaited, a real NOTIFY_SOCKET read in the background (what systemd sees of a
service), and run configs written to real YAML files.

Import them as `from helpers import wait_for, NotifySocket` (pytest puts tests/ on sys.path,
as `pytest_plugins = ["brokers"]` relies on). Broker fixtures and message waits stay in
tests/brokers.py.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import yaml

from edgefl.runconfig import load_run_config

__all__ = ["wait_for", "NotifySocket", "SMALL_RUN", "write_run_yaml", "load_small_run"]


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
    a {field: value} dict; `find` looks a field up in the latter."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)       # the reader wakes up to notice close()
        self.path = path
        self.lines: list[str] = []
        self.messages: list[dict] = []
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
            self.messages.append(dict(line.split("=", 1) for line in lines if "=" in line))

    def poll(self) -> list[dict]:
        """The datagrams received so far, as {field: value} dicts."""
        return list(self.messages)

    def find(self, key, value=None):
        """The first datagram with field `key` (containing `value`, if given), or None."""
        return next((m for m in self.poll() if key in m and (value is None or
                                                                value in m[key])), None)

    def close(self) -> None:
        self.closed.set()
        self.thread.join(2)
        self.sock.close()


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
