#!/usr/bin/env python3
"""Chaos soak: a real federation (an `edgefl aggregator` process and N `edgefl client`
processes against a real Mosquitto) run for many rounds while a seeded schedule kills and
restarts its parts, then the same run without faults; prints what survived.

    python tools/chaos.py                      # 10 clients, 50 rounds, the default faults
    python tools/chaos.py --json               # the report as JSON
    python tools/chaos.py --clients 4 --rounds 8 --client-kills 2 ...   (tests/test_chaos.py)

The set-up (all in a temporary directory, removed afterwards unless --keep):

- Mosquitto with the repo's broker/mosquitto.conf (its listeners replaced by one on a free
  port of 127.0.0.1), the repo's ACL (broker/acl) and a generated password file: every node
  logs in as itself, as in production. Persistence is on, so a broker restart keeps the
  sessions and queued messages.
- tools/mqtt_proxy.py between every node and the broker: it delays and duplicates PUBLISH
  packets in both directions, and records which QoS 1 update chunks the broker acknowledged.
  It also holds each round announcement of the aggregator for 0.25 s in both runs (a slow
  link, not a fault): rounds otherwise take tens of milliseconds, and a run could end
  between a fault's trigger and its firing.
- The run: FedAvg, softmax regression on the built-in `digits` dataset (stored once as an
  .npz: process starts stay fast), iid over N clients, every client selected every round,
  quorum 1.0 (a round closes when every selected client sent its update, when those missing
  are offline by their Last Will, or at the deadline). With `--buffer-size K`: FedBuff
  instead, asynchronous (roles/asynchronous.py), every client busy and a step per K
  updates; "rounds" are then steps, updates are counted by task id, and the proxy holds
  each task message (not the round announcement) for the same 0.25 s.

The fault schedule is drawn from --seed before the run and is triggered by progress (after
round k is aggregated, plus a small delay), so it hits the same rounds on a fast or a loaded
machine:

- client kill:     SIGKILL of a client process, restarted `down` seconds later with the same
                   state directory (it resumes from its persisted progress);
- aggregator kill: SIGKILL of the aggregator mid-round, restarted (it resumes from its
                   checkpoint and announces the open round again);
- broker restart:  SIGTERM of Mosquitto (it saves its persistence file), started again on
                   the same port; every node reconnects;
- delay/duplicate: per PUBLISH, with --delay-rate / --duplicate-rate (the proxy).

A fault whose process is still down from an earlier one waits until it is back (and is not
injected if the run ends first); the report counts the faults injected. A process that
exits with an error (a client started while the broker is down: `connect()` at start-up
is strict by design) is restarted after 1 s, as systemd's Restart=on-failure does for the
units in devices/systemd/ (RestartSec=5/10 there), and counted.

Definitions of the report (computed after the run from the proxy's record, the
aggregator's journal, checkpoint and logs):

- rounds completed:  distinct rounds in the journal `rounds.jsonl` with event "aggregated".
- aggregated twice:  rounds with more than one "aggregated" journal record, or more than
                     one "round N aggregated" line in the aggregator processes' logs.
- updates accepted:  the sum over rounds of the updates each round was aggregated with
                     (the checkpoint's per-round history).
- updates lost:      updates the broker acknowledged (every chunk of client c's frame for
                     round r PUBACKed to c, seen by the proxy) before round r was
                     aggregated (its journal time), that round r did not aggregate and
                     that no aggregator process logged as a late update of c for round r.
                     An update the broker never acknowledged (the client was killed with
                     it in its send queue) is not lost: the client persisted it and re-sends
                     it if its round is announced again; a round does not wait for an
                     offline client.
- acked late:        updates acknowledged only after their round was aggregated (a client
                     that came back, or a delay); the aggregator drops them as late. Also,
                     in the last round, an update acknowledged before the round closed that
                     the round lists as missing and no aggregator logged: it had not reached
                     the aggregator when the round closed (the proxy delays deliveries), and
                     an aggregator whose run has ended reads nothing more, so it is never
                     logged late. (Silent drops are thus checked in every round but the last.)

Exit status: 0 when every round was aggregated exactly once, no update was lost and every
process finished cleanly; 1 otherwise; 2 when a run could not be completed (not finished in
--timeout seconds, a process failing again and again, no Mosquitto).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import yaml  # noqa: E402

from edgefl.roles.state import JOURNAL_FILE, AggregatorCheckpoint, read_journal    # noqa: E402
from edgefl.transport import wire    # noqa: E402
from edgefl.transport.broker import (adapt_mosquitto_conf, find_mosquitto,  # noqa: E402
                                     free_port, probe)
from mqtt_proxy import MqttFaultProxy    # noqa: E402

MOSQUITTO_CONF = REPO / "broker" / "mosquitto.conf"
MOSQUITTO_ACL = REPO / "broker" / "acl"
AGGREGATOR_ID = "aggregator"          # the username broker/acl grants the aggregator's topics
MAX_SUPERVISOR_RESTARTS = 20          # per process: beyond, the soak fails naming it

# `edgefl client` as installed, with paho's per-packet debug lines muted: the soak runs the
# clients at log level debug for the role's "round N done (..., uploaded)" lines.
CLIENT_BOOT = ("import logging, sys; "
               "logging.getLogger('edgefl.transport.paho').setLevel(logging.INFO); "
               "from edgefl.cli import main; sys.exit(main(sys.argv[1:]))")

@dataclass
class SoakConfig:
    clients: int = 10
    rounds: int = 50
    seed: int = 0
    client_kills: int = 12
    aggregator_kills: int = 3
    broker_restarts: int = 2
    delay_rate: float = 0.02
    delay_s: tuple = (0.05, 0.4)
    duplicate_rate: float = 0.05
    deadline_s: float = 30.0
    chunk_size: int = 1024             # the smallest edgefl allows: every update is chunked
    drop_acked_rate: float = 0.0       # self-test only: the proxy acks and drops updates
    restart_s: float = 1.0             # RestartSec of the emulated Restart=on-failure
    # The aggregator's round announcements reach the broker this late (both runs): a round
    # takes tens of milliseconds here, so without it a run could end between a fault's
    # trigger round and its firing.
    announce_hold_s: float = 0.25
    timeout_s: float = 900.0
    secure: float = 0.0                # > 0: privacy.secure_aggregation with this threshold
    # every node keyed (docs/security.md): the aggregator signs and checks every update,
    # each client checks the aggregator's messages and signs its updates
    signed: bool = False
    buffer_size: int = 0               # > 0: FedBuff, asynchronous (roles/asynchronous.py):
                                       # every client busy (C = clients), a step per K updates

    def __post_init__(self):
        if self.clients < 2:
            raise ValueError(f"clients = {self.clients}: the soak needs at least 2")
        if self.rounds < 3:
            raise ValueError(f"rounds = {self.rounds}: the soak needs at least 3")
        for name in ("client_kills", "aggregator_kills", "broker_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)}: need >= 0")
        for name in ("delay_rate", "duplicate_rate", "drop_acked_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} = {getattr(self, name)}: a probability in [0, 1]")
        if self.buffer_size and not (0 < self.buffer_size < self.clients):
            raise ValueError(f"buffer_size = {self.buffer_size}: an asynchronous soak needs "
                             f"0 < K < clients = {self.clients}")
        if self.buffer_size and self.secure:
            raise ValueError("buffer_size and secure: FedBuff does not run secure rounds")
        for name in ("deadline_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} = {getattr(self, name)}: need > 0 seconds")
        # the run config the aggregator will be given, checked as it will check it: a
        # setting it refuses (a secure threshold of 0.3) would fail every start of the
        # aggregator, and the soak would restart it until its timeout
        from edgefl.runconfig import run_config_from_mapping

        run_config_from_mapping(soak_run_config(self, {"name": "digits"}),
                                "the soak's run config")


@dataclass(order=True)
class Fault:
    after_round: int                   # fires once this many rounds are aggregated ...
    delay_s: float                     # ... plus this long
    kind: str = field(compare=False)   # client_kill | aggregator_kill | broker_restart
    target: str = field(compare=False, default="")
    down_s: float = field(compare=False, default=1.0)


def fault_schedule(cfg: SoakConfig) -> list[Fault]:
    """The seeded list of process faults, ordered by when they fire. Triggers leave the
    first round (start-up) and the last (the finish) alone."""
    rng = random.Random(cfg.seed)
    last = cfg.rounds - 2
    faults = []
    for _ in range(cfg.client_kills):
        faults.append(Fault(rng.randint(1, last), rng.uniform(0.0, 0.2), "client_kill",
                            f"client-{rng.randrange(cfg.clients)}", rng.uniform(0.3, 3.0)))
    for r in rng.sample(range(1, last + 1), min(cfg.aggregator_kills, last)):
        faults.append(Fault(r, rng.uniform(0.0, 0.2), "aggregator_kill", AGGREGATOR_ID,
                            rng.uniform(0.3, 2.0)))
    for r in rng.sample(range(1, last + 1), min(cfg.broker_restarts, last)):
        faults.append(Fault(r, rng.uniform(0.0, 0.2), "broker_restart", "mosquitto",
                            rng.uniform(0.2, 1.5)))
    return sorted(faults)


# ---------------------------------------------------------------------------------------
# the parts: broker, processes, acknowledged updates
# ---------------------------------------------------------------------------------------

class Broker:
    """Mosquitto on a fixed port, stoppable and restartable with the same state."""

    def __init__(self, workdir: Path, users: dict):
        binary = find_mosquitto()
        if binary is None:
            raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
        passwd = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        passwords = workdir / "passwords"
        passwords.write_text("".join(f"{u}:{p}\n" for u, p in users.items()))
        subprocess.run([passwd, "-U", str(passwords)], check=True, timeout=30)
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(adapt_mosquitto_conf(MOSQUITTO_CONF.read_text(), self.port,
                                                  workdir, passwords, MOSQUITTO_ACL))
        self.log = workdir / "mosquitto.log"
        self.proc = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([self.binary, "-c", str(self.conf)],
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not probe("127.0.0.1", self.port, timeout=0.5, any_answer=True):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto on 127.0.0.1:{self.port} did not start; see "
                                   f"{self.log}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)      # saves the persistence file
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


class Role:
    """One edgefl process (aggregator or client), restartable; every incarnation logs to
    its own file."""

    def __init__(self, name: str, command: list, workdir: Path, env: dict):
        self.name, self.command, self.workdir, self.env = name, command, workdir, env
        self.proc: subprocess.Popen | None = None
        self.incarnations = 0
        self.restart_at: float | None = None
        self.exit_codes: list = []

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.incarnations += 1
        with open(self.log_path(self.incarnations), "wb") as log:
            self.proc = subprocess.Popen(self.command, cwd=self.workdir, env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        self.restart_at = None

    def kill(self, restart_after: float) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.exit_codes.append(self.proc.returncode)
        self.proc = None
        self.restart_at = time.monotonic() + restart_after

    def reap(self) -> int | None:
        """The exit code if the process ended by itself (and forget it), else None."""
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            self.exit_codes.append(code)
            self.proc = None
            return code
        return None

    def log_path(self, n: int) -> Path:
        return self.workdir / "logs" / f"{self.name}.{n}.log"

    def logs(self) -> str:
        return "".join(self.log_path(n).read_text(errors="replace")
                       for n in range(1, self.incarnations + 1)
                       if self.log_path(n).exists())

    def terminate(self) -> None:
        if self.running:
            self.proc.kill()
            self.proc.wait(10)


class AckedUpdates:
    """Which update frames the broker acknowledged, and when: fed by the proxy with every
    QoS 1 PUBLISH a node sent that the broker PUBACKed."""

    def __init__(self):
        self.lock = threading.Lock()
        self.chunks = defaultdict(set)            # (node, round, message id) -> chunk indices
        self.complete: dict = {}                  # (node, round) -> first time complete

    def on_acked(self, direction: str, topic: str, payload: bytes, at: float) -> None:
        parts = topic.split("/")
        if direction != "up" or len(parts) != 4 or parts[2] != "update":
            return
        try:
            header = wire.read_header(payload)
        except wire.FrameError:
            return                                 # not a frame: the aggregator rejects it
        node = parts[3]
        key = (node, header.round, header.message_id)
        with self.lock:
            self.chunks[key].add(header.chunk_index)
            if len(self.chunks[key]) == header.chunk_count:
                self.complete.setdefault((node, header.round), at)


# ---------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------

def digits_npz(workdir: Path) -> dict:
    """The dataset section of the soak's run: the built-in `digits` (its train/test split),
    stored once as an .npz, so that each of the many process starts does not import
    scikit-learn (seconds each on a loaded 2-core machine)."""
    import numpy as np

    from edgefl.data.datasets import load_digits

    path = workdir / "digits.npz"
    if not path.exists():
        raw = load_digits()
        np.savez(path, x_train=raw.x_train, y_train=raw.y_train, x_test=raw.x_test,
                 y_test=raw.y_test)
    return {"name": "npz", "path": str(path), "num_classes": 10}


def _write(path: Path, data) -> str:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def soak_run_config(cfg: SoakConfig, dataset: dict) -> dict:
    """The run config the soak's aggregator runs, on `dataset` (a dataset section)."""
    return {
        "dataset": dataset, "partition": {"name": "iid", "clients": cfg.clients},
        "model": {"name": "softmax"},
        # asynchronous: nothing is dropped as too stale, so every update counts or is lost
        "strategy": {"name": "fedbuff", "concurrency": cfg.clients,
                     "buffer_size": cfg.buffer_size, "max_staleness": cfg.rounds}
        if cfg.buffer_size else {"name": "fedavg"},
        "train": {"lr": 0.1, "batch_size": 32, "epochs": 1}, "rounds": cfg.rounds,
        "clients_per_round": cfg.clients, "seed": cfg.seed,
        **({"privacy": {"secure_aggregation": {"threshold": cfg.secure}}} if cfg.secure else {})}


def run_soak(cfg: SoakConfig, workdir: Path, faults: bool = True, say=print) -> dict:
    """One run of cfg in `workdir`, with the fault schedule and the proxy's faults or
    without any; returns the report as a dict."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "logs").mkdir(exist_ok=True)
    nodes = [AGGREGATOR_ID] + [f"client-{i}" for i in range(cfg.clients)]
    users = {n: secrets.token_urlsafe(16) for n in nodes}
    broker = Broker(workdir, users)
    acked = AckedUpdates()
    proxy = MqttFaultProxy(("127.0.0.1", broker.port), seed=cfg.seed,
                           delay_rate=cfg.delay_rate if faults else 0.0, delay_s=cfg.delay_s,
                           duplicate_rate=cfg.duplicate_rate if faults else 0.0,
                           drop_acked_rate=cfg.drop_acked_rate if faults else 0.0,
                           # the self-test loses updates only, so the run still moves
                           faults_on=(lambda t: "/update/" in t) if cfg.drop_acked_rate
                           else None, on_acked=acked.on_acked,
                           hold_s={("up", "task" if cfg.buffer_size else "round"):
                                   cfg.announce_hold_s})
    federation = f"chaos-{cfg.seed}"
    run_path = _write(workdir / "run.yaml", soak_run_config(cfg, digits_npz(workdir)))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    keys = {}
    if cfg.signed:
        from edgefl.transport.signing import write_key_pair

        (workdir / "keys" / "fleet").mkdir(parents=True, exist_ok=True)
        agg_key, agg_pub = write_key_pair(workdir / "keys" / AGGREGATOR_ID, force=True)
        keys[AGGREGATOR_ID] = {"signing_key": agg_key,
                               "fleet": str(workdir / "keys" / "fleet")}
        for n in nodes[1:]:
            private, _ = write_key_pair(workdir / "keys" / "fleet" / n, force=True)
            keys[n] = {"signing_key": private, "aggregator": [agg_pub]}

    def site(node: str, **extra) -> str:
        if node in keys:
            extra["keys"] = keys[node]
        secret = workdir / f"{node}.password"
        secret.write_text(users[node] + "\n")
        secret.chmod(0o600)
        return _write(workdir / f"{node}.yaml", {
            "profile": "generic-x86", "node": {"id": node, "federation": federation},
            "state_dir": str(workdir / "state" / node),
            "broker": {"url": proxy.url, "username": node, "password_file": str(secret)},
            "transport": {"chunk_size": cfg.chunk_size}, **extra})

    out_dir = workdir / "out"
    aggregator = Role(AGGREGATOR_ID, [
        sys.executable, "-m", "edgefl.cli", "aggregator",
        "--config", site(AGGREGATOR_ID, run=run_path, log={"level": "info"}),
        "--deadline", str(cfg.deadline_s), "--out", str(out_dir), "--once"], workdir, env)
    clients = {n: Role(n, [sys.executable, "-c", CLIENT_BOOT, "client",
                           "--config", site(n, log={"level": "debug"}),
                           "--partition", run_path, "--shard", str(i), "--exit-when-finished"],
                       workdir, env)
               for i, n in enumerate(nodes[1:])}
    schedule = fault_schedule(cfg) if faults else []
    injected = Counter()
    supervisor = Counter()                               # role -> restarts after exit != 0
    journal = workdir / "state" / AGGREGATOR_ID / JOURNAL_FILE
    started = time.monotonic()
    aggregator_done = None
    finished_in = None
    try:
        broker.start()
        proxy.start()
        for role in clients.values():
            role.start()
        aggregator.start()
        pending = list(schedule)
        armed: dict = {}                                     # id(fault) -> fire time
        broker_back_at = None
        while True:
            now = time.monotonic()
            if now - started > cfg.timeout_s:
                raise TimeoutError(f"the run did not finish in {cfg.timeout_s:g} s")
            done = len({r["round"] for r in read_journal(journal)
                        if r.get("event") == "aggregated"})
            # restarts that are due
            if broker_back_at is not None and now >= broker_back_at:
                broker.start()
                broker_back_at = None
            for role in [aggregator, *clients.values()]:
                if role.restart_at is not None and now >= role.restart_at:
                    role.start()
            # faults that are due
            for fault in list(pending):
                if done < fault.after_round or aggregator_done is not None:
                    continue
                fire = armed.setdefault(id(fault), now + fault.delay_s)
                if now < fire:
                    continue
                if fault.kind == "client_kill":
                    role = clients[fault.target]
                    if not role.running:
                        continue                     # still down from an earlier kill
                    role.kill(fault.down_s)
                elif fault.kind == "aggregator_kill":
                    if not aggregator.running:
                        continue
                    aggregator.kill(fault.down_s)
                else:
                    if broker_back_at is not None:
                        continue
                    broker.stop()
                    broker_back_at = time.monotonic() + fault.down_s
                pending.remove(fault)
                injected[fault.kind] += 1
                say(f"  [{time.monotonic() - started:6.1f} s] after round {done}: "
                    f"{fault.kind} {fault.target} (down {fault.down_s:.1f} s)")
            # a process that exits with an error is restarted, as systemd's
            # Restart=on-failure does (e.g. started while the broker is down: connect()
            # fails at start-up by design)
            for role in [aggregator, *clients.values()]:
                if role is aggregator and aggregator_done is not None:
                    continue
                code = role.reap()
                if code is None:
                    continue
                if code == 0 and role is aggregator:
                    aggregator_done = 0
                    finished_in = time.monotonic() - started
                elif code != 0:
                    supervisor[role.name] += 1
                    if supervisor[role.name] > MAX_SUPERVISOR_RESTARTS:
                        log = role.log_path(role.incarnations)
                        raise RuntimeError(f"{role.name} failed {supervisor[role.name]} "
                                           f"times (exit {code}); see {log}")
                    role.restart_at = time.monotonic() + cfg.restart_s
                    say(f"  [{time.monotonic() - started:6.1f} s] {role.name} exited with "
                        f"{code}: restarted in {cfg.restart_s:g} s (Restart=on-failure)")
            if aggregator_done is not None and broker_back_at is None and not any(
                    r.running or r.restart_at is not None for r in clients.values()):
                break
            time.sleep(0.02)
    finally:
        for role in [aggregator, *clients.values()]:
            role.terminate()
        proxy.stop()
        broker.stop()

    # ------------------------------------------------------------------ the report
    records = read_journal(journal)
    per_round = Counter(r["round"] for r in records if r.get("event") == "aggregated")
    closed_at = {}
    for r in records:
        if r.get("event") == "aggregated":
            closed_at.setdefault(r["round"], r["at"])
    agg_logs = aggregator.logs()
    logged_twice = [int(r) for r, n in Counter(
        re.findall(r"round (\d+) aggregated", agg_logs)).items() if n > 1]
    late_logged = {(m.group(1), int(m.group(2))) for m in re.finditer(
        r"late update from (\S+) for closed round (\d+)", agg_logs)}
    ckpt = AggregatorCheckpoint.load(workdir / "state" / AGGREGATOR_ID)
    ids = list(clients)
    aggregated_from, missing = {}, {}
    for record in (ckpt.history if ckpt else []):
        aggregated_from[record["round"]] = {ids[c] for c in record["selected"]} - set(
            record["missing"])
        missing[record["round"]] = set(record["missing"])
    lost, late = [], []
    if cfg.buffer_size:
        lost, late = _asynchronous_losses(acked, records, ckpt, agg_logs,
                                          workdir / "state" / AGGREGATOR_ID)
        late_logged = set()
    for (node, r), at in sorted(acked.complete.items()) if not cfg.buffer_size else ():
        if r not in closed_at or at >= closed_at[r]:
            late.append((node, r))
        elif node in aggregated_from.get(r, set()) or (node, r) in late_logged:
            continue
        elif r == cfg.rounds and node in missing.get(r, set()):
            late.append((node, r))        # unread when the last round closed (docstring)
        else:
            lost.append((node, r))
    client_logs = {n: role.logs() for n, role in clients.items()}
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    history = ckpt.history if ckpt else []
    return {
        "faults": faults,
        "rounds_completed": len(per_round),
        "rounds_expected": cfg.rounds,
        "aggregated_twice": sorted({r for r, n in per_round.items() if n > 1}
                                   | set(logged_twice)),
        "updates_accepted": sum(h["updates"] for h in history),
        "updates_acked": len(acked.complete),
        "updates_lost": [f"{n}@{r}" for n, r in lost],
        "acked_late": len(late),
        "late_dropped": len(late_logged),
        "duplicates_ignored": sum(h.get("duplicates", 0) for h in history),
        "rejected": sum(h.get("rejected", 0) for h in history),
        "signed": cfg.signed,
        # refusals for a signature: none expected of the aggregator (every update is a
        # board's own); a client may refuse an announcement the proxy delayed past a newer
        # one ("a replay": signed earlier than the one it follows), which is correct
        "signature_refusals": {
            "aggregator": len(re.findall(r"rejected update from .*(?:signature|signed)",
                                         agg_logs)),
            "clients": sum(len(re.findall(r"rejected .*(?:signature|signed)", t))
                           for t in client_logs.values())},
        "closed_by": dict(Counter(h["closed_by"] for h in history)),
        # secure rounds: clients whose contribution did not reach the sum (a client killed
        # after training holds its contribution in memory only: a dropout, by design)
        "secure_dropouts": sum(len(h["selected"]) - h["secure"]["survivors"] for h in history if "secure" in h),
        "uploads_recorded": sum(len(re.findall(r"round \d+ done \([^)]*uploaded", t))
                                for t in client_logs.values()),
        "resent": sum(t.count("its stored update re-sent") for t in client_logs.values()),
        "faults_injected": {**{k: injected.get(k, 0) for k in
                               ("client_kill", "aggregator_kill", "broker_restart")},
                            "delayed": proxy.stats.get("delayed", 0),
                            "duplicated": proxy.stats.get("duplicated", 0),
                            **({"dropped_acked": proxy.stats.get("dropped_acked", 0)}
                               if cfg.drop_acked_rate else {})},
        "restarted_on_failure": dict(supervisor),
        "aggregator_exit": aggregator_done,
        "client_exits": {n: role.exit_codes for n, role in clients.items()},
        "final_accuracy": summary.get("final_accuracy"),
        "model_sha256": summary.get("model_sha256"),
        "wall_s": round(finished_in if finished_in is not None
                        else time.monotonic() - started, 1),
    }


# ---------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------

def _asynchronous_losses(acked, records, ckpt, agg_logs: str, state: Path) -> tuple:
    """(lost, late) of an asynchronous run, as (node, task id) pairs (the frame's round is
    the task id). Acknowledged by the broker (every chunk) after the last step: late (the
    run was over). Otherwise lost unless a step applied its task (the records' `tasks`),
    it waits in a buffer file of the unfilled last step, an aggregator process logged it
    as dropped too stale, it was acknowledged after its task was given up at the deadline
    (the board was gone that long), or its task was still in flight at the end and it was
    acknowledged during the last step (the run ended before it was read)."""
    from edgefl.roles.asynchronous import BOOK_FILE, BUFFER_DIR
    from edgefl.roles.state import load_arrays
    applied = {t for h in (ckpt.history if ckpt else []) for t in h.get("tasks", [])}
    leftover = {int(load_arrays(p)[1]["task"]) for p in (state / BUFFER_DIR).glob("*.npz")}
    book = json.loads((state / BOOK_FILE).read_text()) if (state / BOOK_FILE).exists() else {}
    in_flight = {int(e["task"]) for e in book.get("flight", {}).values()}
    given_up = {}
    for m in re.finditer(r"^(\S+ \S+) \S+\s+\S+ task (\d+) of \S+ \(version \d+\) "
                         r"unanswered", agg_logs, re.M):
        stamp, frac = m.group(1).split(",")
        given_up[int(m.group(2))] = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) \
            + int(frac) / 1000
    stale = {int(t) for t in re.findall(r"for task (\d+) dropped", agg_logs)}
    ends = sorted(r["at"] for r in records if r.get("event") == "aggregated")
    end = ends[-1] if ends else float("inf")
    last_step_from = ends[-2] if len(ends) > 1 else float("-inf")
    lost, late = [], []
    for (node, t), at in sorted(acked.complete.items()):
        if at >= end:
            late.append((node, t))
        elif t in applied or t in leftover or t in stale:
            continue
        elif t in given_up and at >= given_up[t]:
            continue
        elif t in in_flight and at >= last_step_from:
            continue
        else:
            lost.append((node, t))
    return lost, late


def verdict(chaos: dict) -> list[str]:
    """What is wrong with a chaos run's report ([] when nothing)."""
    problems = []
    if chaos["rounds_completed"] != chaos["rounds_expected"]:
        problems.append(f"{chaos['rounds_completed']} of {chaos['rounds_expected']} rounds "
                        "completed")
    if chaos["aggregated_twice"]:
        problems.append(f"rounds aggregated twice: {chaos['aggregated_twice']}")
    if chaos["updates_lost"]:
        problems.append(f"updates lost: {chaos['updates_lost']}")
    if chaos["aggregator_exit"] != 0:
        problems.append(f"the aggregator exited with {chaos['aggregator_exit']}")
    bad = {n: codes[-1] for n, codes in chaos["client_exits"].items()
           if codes and codes[-1] != 0}
    if bad:
        problems.append(f"clients that did not finish cleanly: {bad}")
    return problems


def table(cfg: SoakConfig, chaos: dict, clean: dict | None) -> str:
    f = chaos["faults_injected"]

    def acc(report):
        a = report and report.get("final_accuracy")
        return f"{a:.4f}" if isinstance(a, float) else "-"

    rows = [
        ("rounds completed", f"{chaos['rounds_completed']} / {chaos['rounds_expected']}",
         f"{clean['rounds_completed']} / {clean['rounds_expected']}" if clean else "-"),
        ("faults injected", str(sum(f.values())), "0"),
        ("  client kill -9 + restart", str(f["client_kill"]), "0"),
        ("  aggregator kill -9 + restart", str(f["aggregator_kill"]), "0"),
        ("  broker restart", str(f["broker_restart"]), "0"),
        ("  PUBLISH delayed", str(f["delayed"]), "0"),
        ("  PUBLISH duplicated", str(f["duplicated"]), "0"),
        ("updates accepted", str(chaos["updates_accepted"]),
         str(clean["updates_accepted"]) if clean else "-"),
        ("updates acknowledged by the broker", str(chaos["updates_acked"]),
         str(clean["updates_acked"]) if clean else "-"),
        ("updates lost", str(len(chaos["updates_lost"])),
         str(len(clean["updates_lost"])) if clean else "-"),
        ("rounds aggregated twice", str(len(chaos["aggregated_twice"])),
         str(len(clean["aggregated_twice"])) if clean else "-"),
        ("late updates dropped (distinct)", str(chaos["late_dropped"]),
         str(clean["late_dropped"]) if clean else "-"),
        ("duplicate update messages ignored", str(chaos["duplicates_ignored"]),
         str(clean["duplicates_ignored"]) if clean else "-"),
        ("stored updates re-sent", str(chaos["resent"]), str(clean["resent"]) if clean else "-"),
        ("restarts after exit != 0", str(sum(chaos["restarted_on_failure"].values())),
         str(sum(clean["restarted_on_failure"].values())) if clean else "-"),
        ("rounds closed by", ", ".join(f"{k} {v}" for k, v in sorted(chaos["closed_by"].items())),
         ", ".join(f"{k} {v}" for k, v in sorted(clean["closed_by"].items())) if clean else "-"),
        *([("secure rounds: dropouts", str(chaos["secure_dropouts"]),
            str(clean["secure_dropouts"]) if clean else "-")] if cfg.secure else []),
        ("final test accuracy", acc(chaos), acc(clean)),
        ("wall time (s)", str(chaos["wall_s"]), str(clean["wall_s"]) if clean else "-"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"chaos soak: {cfg.clients} clients, {cfg.rounds} rounds, seed {cfg.seed} "
             f"({f'FedBuff C={cfg.clients} K={cfg.buffer_size}, rounds are steps' if cfg.buffer_size else 'FedAvg'}"
             f", softmax on digits, {cfg.chunk_size}-byte chunks"
             f"{f', secure aggregation t={cfg.secure:g}' if cfg.secure else ''})", "",
             f"| {'':{width}} | chaos | fault-free |", f"|{'-' * (width + 2)}|---|---|"]
    lines += [f"| {a:{width}} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=d.clients)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--client-kills", type=int, default=d.client_kills)
    p.add_argument("--aggregator-kills", type=int, default=d.aggregator_kills)
    p.add_argument("--broker-restarts", type=int, default=d.broker_restarts)
    p.add_argument("--delay-rate", type=float, default=d.delay_rate,
                   help="probability that the proxy delays a PUBLISH")
    p.add_argument("--duplicate-rate", type=float, default=d.duplicate_rate,
                   help="probability that the proxy duplicates a PUBLISH")
    p.add_argument("--drop-acked-rate", type=float, default=0.0,
                   help="self-test of the report: the proxy acknowledges this fraction of "
                        "update messages itself and drops them (a broker losing messages), "
                        "which must show as lost updates")
    p.add_argument("--deadline", type=float, default=d.deadline_s, metavar="SECONDS",
                   help="the aggregator's round deadline")
    p.add_argument("--timeout", type=float, default=d.timeout_s, metavar="SECONDS",
                   help="give up on a run after this long")
    p.add_argument("--secure", type=float, default=0.0, metavar="THRESHOLD",
                   help="run with privacy.secure_aggregation at this threshold (updates then "
                        "travel masked on the secure topics: 'updates lost' counts update "
                        "frames, which a secure run does not send; see 'dropouts')")
    p.add_argument("--signed", action="store_true",
                   help="every node keyed: the aggregator signs and checks every update's "
                        "signature, the clients check the aggregator's and sign theirs")
    p.add_argument("--buffer-size", type=int, default=0, metavar="K",
                   help="asynchronous: FedBuff with every client busy and a step per K "
                        "updates (0 < K < --clients); 'rounds' are then steps, and an update "
                        "counts as lost unless applied, left in the last buffer, in flight at "
                        "the end, given up at its deadline or dropped as too stale")
    p.add_argument("--no-clean", action="store_true", help="skip the fault-free run")
    p.add_argument("--keep", metavar="DIR", help="run in DIR and keep it (logs, state)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    try:
        cfg = SoakConfig(clients=args.clients, rounds=args.rounds, seed=args.seed,
                         client_kills=args.client_kills, aggregator_kills=args.aggregator_kills,
                         broker_restarts=args.broker_restarts, delay_rate=args.delay_rate,
                         duplicate_rate=args.duplicate_rate, deadline_s=args.deadline,
                         drop_acked_rate=args.drop_acked_rate, timeout_s=args.timeout,
                         secure=args.secure, signed=args.signed,
                         buffer_size=args.buffer_size)
    except ValueError as exc:
        p.error(str(exc))

    def say(text):
        if not args.quiet:
            print(text, file=sys.stderr, flush=True)

    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="edgefl-chaos-"))
    try:
        say(f"chaos run in {base / 'chaos'}")
        runs = {}
        for name, faults in (("chaos", True), ("clean", False)):
            if name == "clean" and args.no_clean:
                runs[name] = None
                continue
            if name == "clean":
                say(f"fault-free run in {base / name}")
            try:
                runs[name] = run_soak(cfg, base / name, faults=faults, say=say)
            except (TimeoutError, RuntimeError) as exc:
                print(f"{name} run: {exc}; logs in {base / name / 'logs'}", file=sys.stderr)
                args.keep = args.keep or str(base)
                return 2
        chaos, clean = runs["chaos"], runs["clean"]
        problems = verdict(chaos)
        if args.json:
            print(json.dumps({"config": asdict(cfg), "chaos": chaos, "clean": clean,
                              "problems": problems}, indent=1))
        else:
            print(table(cfg, chaos, clean))
            for problem in problems:
                print(f"FAIL: {problem}")
        if problems and not args.keep:
            args.keep = str(base)
            print(f"logs and state kept in {base}", file=sys.stderr)
        return 1 if problems else 0
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
