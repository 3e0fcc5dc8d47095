"""The aggregator as a long-lived service (`edgefl aggregator`): it waits for runs, runs them
one at a time, and takes operator commands from the control topic while it does
(docs/orchestration.md; the commands are roles/control.py).

    daemon = Daemon(DaemonSettings(aggregator=AggregatorSettings(...)), state_dir,
                    transport_factory)
    daemon.run()               # until stop is set (or, once=True, until the queue is empty)

Runs. `start` queues a run; each has an id (the operator's, or made here), a record
`<state_dir>/runs/<id>/run.json` (atomic writes: what was asked, its state, times, result),
and its own directory `<state_dir>/runs/<id>/`: the aggregator's checkpoint and journal in
`state/`, and the outputs (metrics.jsonl, summary.json, model.npz, model.onnx) beside it.
States: queued -> running <-> paused -> finished | stopped (operator) | failed; a queued run
may be cancelled. The records are the queue: a restarted daemon resumes the run that was
running (or paused: it stays paused) from its checkpoint, then takes the queued runs in the
order they were started. A service shutdown (SIGTERM) leaves the active run as it is, to be
resumed; an operator's `stop` ends it for good and exports its last checkpoint.

Topics. The runs share the federation's round, model, update and onnx topics, one at a
time, and the announcement names the run (its `run` field is the run id), so boards follow
whatever run is active with no configuration; every frame names its run too, and the
Aggregator takes only updates of its own run (docs/orchestration.md "How runs are kept
apart"). A run the operator stops leaves an end-of-run announcement on the round topic
(and no retained model), as a finished run does, so no board trains for it afterwards. Per
run there is the retained record on `<prefix>/<fed>/runs/<id>` (state, rounds, accuracy,
outputs); events on `events` carry the run id.

Exports. Every export of a run's model -- each one the export policy makes during the run
(the Aggregator's), the stopped run's, an `export` command's -- is announced with event
`model_exported` and, unless `export.publish` is false (run_options `publish_onnx`),
published retained on the onnx topics (event `onnx_published`), so the boards install it.

The daemon takes commands on its own MQTT connection (client id `<node>-ctl`, MQTT 5 when
the broker speaks it, so replies can carry correlation data), separate from the connection
of the run's Aggregator, which is made afresh for each run.

The run named by the site file (`run:`) is the first in the queue, with the layout
`edgefl aggregator` always had: its checkpoint directly in the state directory and its
outputs in `--out` (default `<state_dir>/run`). It is queued once: its record remembers the
file and a digest of the run config in it, so a restart finds the run again (to resume it,
or to leave it as it ended); the file changed after its run ended is a new run.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import __version__
from ..errors import ConfigError
from ..io import jsonable
from ..service.layered import check_setting
from ..transport.base import ConnectionEvent, Message, TransportError
from ..transport.topics import TopicError, Topics, validate_id
from .aggregator import AggregatorSettings, default_client_ids
from .asynchronous import BOOK_FILE, BUFFER_DIR
from .control import (CommandError, EitherStop, RunControl, parse_command, reply_payload,
                      sign_reply)
from .messages import finished_announcement, status_payload
from .runner import WARM_START_FILE
from .signed_log import signed_event, signed_record
from .onnx_channel import PUBLISHED_FILE
from .state import (CHECKPOINT_FILE, HISTORY_FILE, JOURNAL_FILE, AggregatorCheckpoint,
                    StateError, write_json)

__all__ = ["DaemonSettings", "Daemon", "RunStore", "RUN_STATES", "SITE_RUN_DIR", "STATE_FILES",
           "STATE_SUBDIRECTORIES", "export_run_checkpoint"]

log = logging.getLogger("edgefl.roles.daemon")

RUNS_DIR = "runs"
RECORD_FILE = "run.json"
ACTIVE_STATES = ("running", "paused")
DONE_STATES = ("finished", "stopped", "cancelled", "failed")
# runs listed in a reply to `prune` (and as many runs left): about 100 bytes each, so the
# reply stays one small message (AWS IoT's limit is 128 KiB); its totals count them all
PRUNE_REPLY_RUNS = 200
RUN_STATES = ("queued",) + ACTIVE_STATES + DONE_STATES
# a write that failed for want of space (roles.state.StateWriteError's errno among them): the
# run is tried again, not failed (Daemon._try_again)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
REMEMBERED_REPLIES = 256
NONCES_FILE = "command-nonces.json"      # nonces of signed commands, until they expire
SITE_RUN_DIR = "run"                     # the site file's run's outputs, unless --out
# what the aggregator service replaces atomically in its state directory (the site file's
# run keeps its checkpoint there), and the directories in it that only the service writes
# (the runs, the site run's outputs, the buffered updates): hold_state_dir removes what its
# writers killed mid-write left of them
STATE_FILES = (CHECKPOINT_FILE, HISTORY_FILE, BOOK_FILE, NONCES_FILE, PUBLISHED_FILE,
               WARM_START_FILE)
STATE_SUBDIRECTORIES = (RUNS_DIR, SITE_RUN_DIR, BUFFER_DIR)


@dataclass(frozen=True)
class DaemonSettings:
    """aggregator: the settings every run starts from (a `start` command's `round` section
    overrides deadline, quorum and min_updates). client_ids: the federation's client ids
    when a `start` names none (None: client-0 ... client-<N-1> for a partition of N).
    once: return from run() when no run is active or queued (scripts, tests).
    retry_s: wait before trying a run again whose broker connection failed, or whose
    checkpoint a full disk refused.
    run_options: more keyword arguments of roles.runner.run_aggregator for every run (export
    policy, `publish_onnx`: whether exports are published on the onnx topics, default true;
    `onnx_record_dir`).
    keep_runs: the site file's retention.keep_runs: as each run ends, the files of ended runs
    beyond the keep_runs most recent are removed (roles/retention.py); None keeps them all."""
    aggregator: AggregatorSettings = AggregatorSettings()
    client_ids: tuple | None = None
    once: bool = False
    run_options: dict = field(default_factory=dict)
    idle_poll_s: float = 0.5
    retry_s: float = 5.0
    keep_runs: int | None = None

    def __post_init__(self):
        check_setting("retention.keep_runs", self.keep_runs, "DaemonSettings.keep_runs",
                      unset_ok=True)

    @property
    def node_id(self) -> str:
        return self.aggregator.node_id


class _StoppedBefore(Exception):
    """_execute: the run's record says the operator stopped it (a stop the service died
    before carrying out); nothing is run, the stop is carried out."""


class RunStore:
    """The run records under `<state_dir>/runs/`: one directory per run, `run.json` in it."""

    def __init__(self, state_dir: str):
        self.state_dir = os.fspath(state_dir)
        self.root = os.path.join(self.state_dir, RUNS_DIR)

    def run_dir(self, run_id: str) -> str:
        return os.path.join(self.root, run_id)

    def load_all(self) -> list[dict]:
        """Every readable record, in queue order (seq). A record that cannot be read is
        reported with its file and skipped: one bad file does not stop the service."""
        records = []
        if not os.path.isdir(self.root):
            return records
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name, RECORD_FILE)
            if not os.path.isfile(path):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    record = json.load(f)
                fields = record if isinstance(record, dict) else {}
                if fields.get("id") != name or fields.get("state") not in RUN_STATES:
                    raise ValueError(f"not a run record of run {name!r} (id "
                                     f"{fields.get('id')!r}, state {fields.get('state')!r})")
                # as every run id that comes in a command is (its record's topic, its
                # directory): a directory made by hand may be named otherwise
                validate_id(name, "run id")
            except (OSError, ValueError, TopicError) as exc:
                log.error("run record %s skipped: %s", path, exc)
                continue
            records.append(record)
        return sorted(records, key=lambda r: r.get("seq", 0))

    def save(self, record: dict) -> None:
        directory = self.run_dir(record["id"])
        os.makedirs(directory, exist_ok=True)
        write_json(os.path.join(directory, RECORD_FILE), record)

    def new_id(self, taken) -> str:
        while True:
            run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + os.urandom(2).hex()
            if run_id not in taken and not os.path.lexists(self.run_dir(run_id)):
                return run_id


def run_config_of(record: dict):
    """The RunConfig of a record: the site file's run from its file, a started run from the
    config it was started with (validated again: the record is a file on disk)."""
    from ..runconfig import load_run_config, run_config_from_mapping

    if record.get("site"):
        return load_run_config(record["site"])
    return run_config_from_mapping(record["config"], f"run {record['id']} (run.json)")


def site_config_digest(path: str) -> str:
    """What the site file's run config asks for, as a sha256 of the YAML as written (parsed:
    comments and layout aside), not as resolved: a default a later edgefl adds must not make
    an unchanged file another run (a finished run's checkpoint in the state directory would
    then refuse the service's start after an upgrade). A changed file is another run."""
    import hashlib

    from ..config import load_yaml

    with open(path, encoding="utf-8") as f:
        doc = load_yaml(f)
    text = json.dumps(jsonable(doc), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def export_run_checkpoint(record: dict) -> dict:
    """model.npz and model.onnx (atomic replace each) of the run's latest checkpoint, in its
    output directory. Returns {round, model_npz, model_onnx, model_sha256, bytes,
    test_accuracy}."""
    from ..checkpoint import model_sha256, save_checkpoint
    from ..config import dataset_from_config
    from ..export import export_run, run_from_params
    from ..strategies import get_strategy
    from ..runs.outputs import absolute_dataset_paths
    from ..runs.prepare import RunResult, build_run_model

    if record.get("pruned"):
        raise CommandError(f"run {record['id']}: its files were pruned (retention.keep_runs, "
                           f"edgefl prune or edgefl ctl prune): no checkpoint left to export")
    ckpt = AggregatorCheckpoint.load(record["state_dir"])
    if ckpt is None:
        raise CommandError(f"run {record['id']} has no checkpoint yet (state "
                           f"{record['state']}): nothing to export")
    config = run_config_of(record)
    strategy = get_strategy(ckpt.strategy["name"], **ckpt.strategy["params"])
    dataset = dataset_from_config(config.as_config())
    model = build_run_model(config, dataset)
    params = np.ascontiguousarray(strategy.global_model(ckpt.state), dtype=np.float32)
    out = record["out_dir"]
    os.makedirs(out, exist_ok=True)
    dataset_config = absolute_dataset_paths(config.dataset, config.path)
    npz = os.path.join(out, "model.npz")
    save_checkpoint(npz, model, strategy, RunResult(ckpt.state, {}, list(ckpt.history), params),
                    dataset, dataset_config=dataset_config)
    onnx_path = os.path.join(out, "model.onnx")
    live = run_from_params(model, params, round=ckpt.round, algorithm=strategy.name,
                           dataset=dataset, dataset_config=dataset_config)
    report = export_run(live, onnx_path, dataset=dataset)
    # the test accuracy the aggregator measured for that round (None: not evaluated)
    accuracy = next((h.get("test_accuracy") for h in reversed(ckpt.history)
                     if h.get("test_accuracy") is not None), None)
    return {"round": ckpt.round, "model_npz": npz, "model_onnx": onnx_path,
            "model_sha256": model_sha256(params), "bytes": report["bytes"],
            "test_accuracy": accuracy}


class Daemon:
    """The long-lived aggregator: a run queue on disk, one run at a time, commands on the
    control topic. transport_factory(client_id, **options) makes an unconnected Transport
    (options: clean_session, protocol). site_run: (run config path, output directory) of the
    site file's run, queued first."""

    def __init__(self, settings: DaemonSettings, state_dir: str,
                 transport_factory: Callable, *, stop=None, notifier=None,
                 site_run: tuple | None = None, stream=None):
        self.settings = settings
        s = settings.aggregator
        self.topics = Topics(s.federation, s.prefix)
        self.store = RunStore(state_dir)
        self.state_dir = self.store.state_dir
        self._nonces = None                  # NonceStore, loaded at the first signed command
        self.transport_factory = transport_factory
        self.stop = stop if stop is not None else threading.Event()
        self.notifier = notifier
        self.site_run = site_run
        self.stream = stream
        self.records: dict[str, dict] = {}
        self.active: tuple[dict, RunControl] | None = None
        self.ready = threading.Event()            # the control connection is up
        self.executed: list[str] = []             # run ids this process ran (tests)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._control_stop = threading.Event()
        self._ctl = None
        self._ctl_error: BaseException | None = None
        self._export_lock = threading.Lock()
        self._answered: dict = {}                 # command -> its reply (repeats)
        self._answering = None
        self._own_status = False                  # the idle status is ours to withdraw
        self.site_record: dict | None = None      # the site file's run (_queue_site_run)
        # the run whose end _execute is recording (its export after a stop, its end-of-run
        # announcement, its record): ended, but not yet the `prune` command's to remove
        self._closing: str | None = None

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        os.makedirs(self.store.root, exist_ok=True)
        trust = self.settings.aggregator.trust
        log.info("%s", trust.describe() if trust is not None and trust.active else
                 "signatures off: nothing signed, updates and commands not checked (set keys.* "
                 "in the site file; docs/security.md)")
        for record in self.store.load_all():
            self.records[record["id"]] = record
        if self.site_run is not None:
            self._queue_site_run(*self.site_run)
        thread = threading.Thread(target=self._control_loop, name="edgefl-ctl", daemon=True)
        thread.start()
        while not self.ready.wait(0.1):
            if self._ctl_error is not None:
                raise self._ctl_error
            if self.stop.is_set():
                break
        if self.notifier is not None:
            self.notifier.ready(f"aggregator: {self._queue_text()}")
        for record in self._records_in("queued", *ACTIVE_STATES):
            self._publish_record(record)
        try:
            while not self.stop.is_set():
                if self.notifier is not None:
                    self.notifier.beat()            # the systemd watchdog's proof of life
                if self._ctl_error is not None:
                    raise self._ctl_error
                record = self._next()
                if record is None:
                    if self.settings.once:
                        break
                    if self.notifier is not None:
                        self.notifier.status("aggregator: waiting for a run")
                    with self._wake:
                        self._wake.wait(self.settings.idle_poll_s)
                    continue
                self._execute(record)
        finally:
            self._control_stop.set()
            thread.join(timeout=10.0)

    def _records_in(self, *states) -> list[dict]:
        with self._lock:
            return sorted((r for r in self.records.values() if r["state"] in states),
                          key=lambda r: r.get("seq", 0))

    def _next(self) -> dict | None:
        active = self._records_in(*ACTIVE_STATES)       # interrupted by a restart
        if active:
            return active[0]
        queued = self._records_in("queued")
        return queued[0] if queued else None

    def _queue_text(self) -> str:
        queued = self._records_in("queued", *ACTIVE_STATES)
        return f"{len(queued)} run(s) queued" if queued else "waiting for a run"

    def _next_seq(self, first: bool = False) -> int:
        seqs = [r.get("seq", 0) for r in self.records.values()]
        if not seqs:
            return 1
        return min(seqs) - 1 if first else max(seqs) + 1

    def _queue_site_run(self, config_path: str, out_dir: str) -> None:
        """Queue the site file's run first, once. A record remembers it by its file and the
        digest of the run config it holds: started again with that file unchanged, the
        service finds the run's record (and resumes it, or leaves it as it ended); with the
        file changed after that run ended, it is another run, queued under a new id --
        unless the state directory holds the ended run's checkpoint, which the new config
        cannot use (ConfigError). self.site_record is the record either way."""
        from ..runconfig import load_run_config

        config_path = os.path.abspath(config_path)
        load_run_config(config_path)               # a bad file fails the start, naming it
        digest = site_config_digest(config_path)
        mine = sorted((r for r in self.records.values() if r.get("site") == config_path
                       and r["state_dir"] == self.state_dir),
                      key=lambda r: (r.get("created") or 0, r.get("seq", 0)))
        last = mine[-1] if mine else None
        # a record made before the digest was kept is recognised by its file alone, as then;
        # a run not yet ended is this file's run whatever the file says now (its checkpoint
        # refuses another config: the fingerprint)
        if last is not None and (last["state"] not in DONE_STATES
                                 or last.get("site_config_sha256") in (None, digest)):
            if last["state"] not in DONE_STATES and \
                    last.get("site_config_sha256") not in (None, digest):
                # it runs (or resumes) with the file as it is now (run_config_of reads the
                # file): its record says so, or its next start would take the file it ran
                # with for a changed one
                last = {**last, "site_config_sha256": digest}
                self._save(last)
            self.site_record = last
            if last["state"] in DONE_STATES:
                log.info("the site file's run %s (%s) ended %s; it is not run again (a "
                         "changed run config is a new run)%s", last["id"], config_path,
                         last["state"], "" if self.settings.once else
                         f"; waiting for runs on {self.topics.ctl()}")
            return
        ckpt = AggregatorCheckpoint.load(self.state_dir)
        if ckpt is not None and ckpt.run_id in self.records:
            # the checkpoint directly in the state directory is another run's (this file's
            # ended run, or another file's): a new run there would be refused by its
            # fingerprint (or, the config the same in effect, resume that run's checkpoint
            # under another id)
            other = self.records[ckpt.run_id]
            why = (f"the site file's run config changed since run {last['id']} "
                   f"({last['state']})" if last is not None else
                   f"the site file's run config is not the one of run {other['id']} "
                   f"({other.get('site') or 'started with edgefl ctl'})")
            raise ConfigError(
                f"{config_path}: {why}, and the state directory {self.state_dir} holds the "
                f"checkpoint of run {other['id']} ({other['state']}): a new run needs a state "
                f"directory of its own (set state_dir to another), or move that run's "
                f"checkpoint ({CHECKPOINT_FILE}, {HISTORY_FILE}, {JOURNAL_FILE}) out of it")
        if last is not None:
            log.info("the site file's run config %s changed since run %s (%s): queued as a "
                     "new run", config_path, last["id"], last["state"])
        # a checkpoint no record knows: the one-run aggregator's, resumed under its id
        run_id = ckpt.run_id if ckpt is not None else self.store.new_id(self.records)
        record = {"id": run_id, "seq": self._next_seq(first=True), "state": "queued",
                  "site": config_path, "site_config_sha256": digest, "config": None,
                  "clients": list(self.settings.client_ids) if self.settings.client_ids
                  else None, "round": {}, "created": time.time(),
                  "run_dir": self.store.run_dir(run_id), "state_dir": self.state_dir,
                  "out_dir": os.path.abspath(out_dir)}
        self._save(record)
        self.site_record = record

    def _save(self, record: dict) -> None:
        with self._lock:
            self.records[record["id"]] = record
            self.store.save(record)

    def _execute(self, record: dict) -> None:
        from .runner import run_aggregator

        control = RunControl(record["id"], paused=record["state"] == "paused",
                             publish_onnx=self._publishes_onnx)
        control.on_hold = lambda: self._record_progress(record, control)
        if record.get("stop_requested"):
            # stopped by the operator, and the service died before it ended the run: end it
            # now (export its checkpoint, record it stopped), train nothing more
            control.stop_requested.set()
        self._own_status = False                  # the run's Aggregator publishes it now
        with self._lock:
            record["state"] = "paused" if control.paused.is_set() else "running"
            if "started" in record:
                # tried again (the service restarted, or the run waited out a full disk):
                # `started` stays the first start; ctl watch, learning of the run from its
                # run_resumed event, takes its records by this time (signed_log.check_record)
                record["resumed"] = time.time()
            else:
                record["started"] = time.time()
            self._save(record)
            self.active = (record, control)
        self._publish_record(record)
        summary, error = None, None
        try:
            if control.stop_requested.is_set():
                raise _StoppedBefore()
            config = run_config_of(record)
            rounds = record.get("round") or {}
            settings = dataclasses.replace(
                self.settings.aggregator,
                round_timeout_s=rounds.get("deadline", self.settings.aggregator.round_timeout_s),
                quorum=rounds.get("quorum", self.settings.aggregator.quorum),
                min_updates=rounds.get("min_updates", self.settings.aggregator.min_updates))
            transport = self.transport_factory(self.settings.node_id)
            log.info("run %s: %s, %d rounds, %d clients; state in %s", record["id"],
                     config.strategy, config.rounds, config.clients, record["state_dir"])
            # publish_onnx=True: run_aggregator then hands every export to the Aggregator
            # (publish_onnx), which announces it (model_exported) and publishes it only
            # when control.publish_onnx says so
            options = {**self.settings.run_options, "publish_onnx": True}
            summary = run_aggregator(config, transport, record["state_dir"], settings=settings,
                                     client_ids=record.get("clients"),
                                     out_dir=record["out_dir"],
                                     stop=EitherStop(self.stop, control.stop_requested),
                                     notifier=self.notifier, control=control,
                                     stream=self.stream, **options)
        except _StoppedBefore:
            log.info("run %s was stopped by the operator before this start: ending it from "
                     "its checkpoint", record["id"])
        except TransportError as exc:
            # the broker is unreachable: not the run's fault; it is tried again
            self._try_again(record, str(exc))
            return
        except (ConfigError, StateError) as exc:
            # the user's to fix (a dataset that is not there, a state directory holding
            # another run's checkpoint): the message names the file and the key, and is
            # all there is to say -- a traceback would present the user's mistake as a crash
            log.error("run %s failed: %s", record["id"], exc)
            error = str(exc)
        except Exception as exc:      # noqa: BLE001 -- a failed run must not end the service
            if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
                # A full disk (its checkpoints are what fill it) is not the run's fault
                # either: marked failed, the run was lost for good though its last
                # checkpoint stood. It stays running and is tried again from that
                # checkpoint until there is space (or the operator stops it: _cmd_stop).
                self._try_again(record, f"{exc}; free space there: the run goes on from its "
                                        f"last checkpoint once it can write the next")
                return
            log.exception("run %s failed", record["id"])
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, (ValueError, OSError)) \
                else str(exc)
        # the rounds done and accuracy as the run ends: a failed run, or a stopped one whose
        # export fails, would otherwise keep a pause's figures (a finished or exported run's
        # own replace them below)
        record.update(self._progress(control))
        with self._lock:
            self.active = None
            self._closing = record["id"]
        try:
            self._close_run(record, control, summary, error)
        finally:
            with self._lock:
                self._closing = None
        if record["state"] in DONE_STATES:
            self._apply_retention()
        if not self.stop.is_set() and not (self.settings.once and self._next() is None):
            self._publish_idle_status()

    def _try_again(self, record: dict, why: str) -> None:
        """The active run could not go on for a reason not its own (no broker, a full
        disk): logged, left active (its record as it is) and started again, from its
        checkpoint, after retry_s."""
        log.error("run %s: %s; trying again in %g s", record["id"], why, self.settings.retry_s)
        with self._lock:
            self.active = None
        end = time.monotonic() + self.settings.retry_s
        while not self.stop.is_set() and time.monotonic() < end:
            time.sleep(0.1)

    def _close_run(self, record: dict, control: RunControl, summary, error) -> None:
        """Record how the run ended (failed, finished, stopped by the operator, or only
        interrupted by a service shutdown), export a stopped run's model, and publish."""
        self.executed.append(record["id"])
        now = time.time()
        if error is not None:
            record.update(state="failed", ended=now, error=error)
            self._save(record)
            self._event("error", run=record["id"], error=error)
        elif summary is not None:
            record.update(state="finished", ended=now, rounds_done=summary["rounds"],
                          final_accuracy=summary["final_accuracy"],
                          model_sha256=summary["model_sha256"],
                          model_onnx=os.path.join(record["out_dir"], "model.onnx"))
            self._save(record)
            if summary["rounds"] not in [e["round"] for e in summary.get("onnx_exports", [])]:
                self._final_export_after_run(record, summary)
        elif control.stop_requested.is_set():
            record.update(state="stopped", ended=now)
            exported = None
            try:
                with self._export_lock:
                    exported = export_run_checkpoint(record)
                record.update(rounds_done=exported["round"], model_onnx=exported["model_onnx"],
                              model_sha256=exported["model_sha256"],
                              final_accuracy=exported["test_accuracy"])
            except Exception as exc:      # noqa: BLE001 -- the checkpoint stands regardless
                log.exception("run %s: export after stop failed", record["id"])
                record["export_error"] = str(exc)
                self._event("error", run=record["id"], error=f"export after stop: {exc}")
            self._end_of_run(record, exported)
            if exported is not None:
                self._exported(record, exported, "stop")
            self._save(record)
            self._event("run_stopped", run=record["id"], round=record.get("rounds_done"),
                        model_onnx=record.get("model_onnx"))
            log.info("run %s stopped by the operator at round %s; checkpoint and model.onnx in "
                     "%s", record["id"], record.get("rounds_done"), record["run_dir"])
        else:
            log.info("run %s interrupted (service stopping); it resumes from its checkpoint "
                     "after a restart", record["id"])
        self._publish_record(record)

    def _apply_retention(self) -> None:
        """retention.keep_runs, as a run ends: _prune with it; a failure is logged and the
        service goes on."""
        keep = self.settings.keep_runs
        if keep is None:
            return
        try:
            self._prune(keep, "retention")
        except Exception:         # noqa: BLE001 -- retention must not end the service
            log.exception("retention (keep_runs %d) failed", keep)

    def _prune(self, keep: int, why: str, dry_run: bool = False):
        """Remove the files of the ended runs beyond the newest `keep` (roles/retention.py),
        each pruned run's record saved and published marked pruned; the report (a
        PruneReport), each run logged with `why` (retention, prune). The end-of-run
        retention and the `prune` command both come here. The records are taken before the
        export lock is: a run that ends meanwhile is not among them (kept, as if newer),
        and the run whose end is still being recorded (an export after its stop) is left."""
        from .retention import prune_runs

        def mark(record, run):
            with self._lock:
                record.update(pruned=time.time(), pruned_bytes=run.bytes)
                self._save(record)
                self._publish_record(record)

        with self._lock:
            # every record: the waiting runs' name the model.init files retention leaves
            records = list(self.records.values())
            leave = {self._closing: "it has just ended: its export and end-of-run record are "
                                    "still being written (prune again)"} \
                if self._closing is not None else {}
        # each run under the export lock: an export of a run being pruned would read a
        # checkpoint half removed, or write a model.onnx into a run then marked pruned; let
        # go between runs, so a run's end (its export) waits for one run's removal, not for
        # a prune of thousands (its service's watchdog would miss its beats meanwhile)
        def current():
            with self._lock:
                return list(self.records.values())

        report = prune_runs(records, keep, self.store.root, spare=(RECORD_FILE,),
                            dry_run=dry_run, mark=mark, leave=leave, lock=self._export_lock,
                            current=current)
        verb = "would remove" if dry_run else "pruned"
        for run in report.runs:
            log.info("%s: run %s (%s) %s, %d bytes in %d file(s)%s", why, run.run, run.state,
                     verb, run.bytes, len(run.removed),
                     f"; {len(run.errors)} could not be removed" if run.errors else "")
            for path, reason in run.errors:
                log.error("%s: cannot remove %s: %s", why, path, reason)
        for run_id, reason in report.skipped:
            log.info("%s: run %s left: %s", why, run_id, reason)
        return report

    # ------------------------------------------------------------------ exports
    @property
    def _publishes_onnx(self) -> bool:
        return bool(self.settings.run_options.get("publish_onnx", True))

    def _exported(self, record: dict, exported: dict, trigger: str) -> dict | None:
        """Announce an export the service made (`stop`, `export`): event model_exported,
        then, unless export.publish is false, the file published retained on the onnx
        topics over the control connection (the aggregator's account may write them) and
        event onnx_published. Returns what was published, or None."""
        from ..export import ExportError
        from .onnx_channel import publish_model

        self._event("model_exported", run=record["id"], trigger=trigger, **exported)
        if not self._publishes_onnx or self._ctl is None:
            return None
        record_dir = self.settings.run_options.get("onnx_record_dir") or record["state_dir"]
        try:
            pub = publish_model(self._ctl, self.topics, exported["model_onnx"],
                                round=exported["round"], sender=self.settings.node_id,
                                run=record["id"], max_payload=self.settings.aggregator.max_payload,
                                record_dir=record_dir,
                                signer=getattr(self.settings.aggregator.trust, "signer", None))
        except (TransportError, ExportError, OSError, ValueError) as exc:
            log.error("run %s: model.onnx of round %s exported but not published: %s",
                      record["id"], exported["round"], exc)
            self._event("error", run=record["id"], error=f"{trigger}: model.onnx exported but "
                                                         f"not published: {exc}")
            return None
        self._event("onnx_published", run=record["id"], round=pub.round, sha256=pub.sha256,
                    bytes=pub.nbytes, parts=len(pub.parts))
        log.info("run %s: model.onnx of round %d published (%d bytes in %d retained part(s))",
                 record["id"], pub.round, pub.nbytes, len(pub.parts))
        return {"sha256": pub.sha256, "parts": len(pub.parts)}

    def _final_export_after_run(self, record: dict, summary: dict) -> None:
        """The run's own export of its final round failed (logged), and run_aggregator made
        model.onnx again from model.npz after the run's aggregator had closed: announced
        and published here, so the boards still get the final model. Nothing when that
        failed too (model.onnx then holds an earlier round's export, or nothing)."""
        path = os.path.join(record["out_dir"], "model.onnx")
        try:
            from ..export import model_payload

            _, metadata = model_payload(path)
        except (ImportError, OSError, ValueError):
            return
        if metadata.get("round") != str(summary["rounds"]):
            return
        self._exported(record, {"round": summary["rounds"], "model_onnx": path,
                                "model_sha256": summary["model_sha256"],
                                "bytes": os.path.getsize(path),
                                "test_accuracy": summary.get("final_accuracy")}, "final")

    def _end_of_run(self, record: dict, exported: dict | None) -> None:
        """After an operator's stop: the round topic says the run is over (the end-of-run
        announcement a finished run leaves, with `stopped: true`) and the retained models
        of its abandoned round are cleared, so a board that (re)connects before the next run
        trains nothing for it. (A service shutdown leaves both: the run resumes.)"""
        if self._ctl is None:
            return
        try:
            if exported is not None:
                rounds, sha = exported["round"], exported["model_sha256"]
            else:
                ckpt = AggregatorCheckpoint.load(record["state_dir"])
                if ckpt is None:
                    return                       # never started: it announced nothing
                from ..checkpoint import model_sha256
                from ..strategies import get_strategy

                strategy = get_strategy(ckpt.strategy["name"], **ckpt.strategy["params"])
                rounds, sha = ckpt.round, model_sha256(strategy.global_model(ckpt.state))
        except Exception as exc:          # noqa: BLE001 -- then the next run's announcement
            log.warning("run %s: no end-of-run announcement: %s", record["id"], exc)
            return
        doc = finished_announcement(run_id=record["id"], aggregator=self.settings.node_id,
                                    rounds=rounds, model_sha256=sha)
        doc["stopped"] = True
        signer = getattr(self.settings.aggregator.trust, "signer", None)
        if signer is not None:
            doc = signer.sign_doc(doc, "finished", record["id"], rounds)
        self._publish(self.topics.round(), doc, retain=True)
        for topic in [self.topics.model()] + [self.topics.client_model(c)
                                              for c in record.get("clients") or []]:
            self._publish(topic, b"", retain=True)

    # ------------------------------------------------------------------ control connection
    def _control_loop(self) -> None:
        try:
            self._ctl = self._connect_control()
        except BaseException as exc:            # noqa: BLE001 -- re-raised by run()
            self._ctl_error = exc
            return
        with self._lock:
            if self.active is None:
                self._publish_idle_status()
        self.ready.set()
        ctl = self._ctl
        try:
            while not self._control_stop.is_set():
                item = ctl.receive(timeout=0.2)
                if isinstance(item, ConnectionEvent):
                    if item.connected:
                        self._republish_status()
                    continue
                if not isinstance(item, Message) or item.topic != self.topics.ctl():
                    continue
                if item.retain and item.payload:
                    # the broker's retained copy, handed over on subscribing: a command
                    # published retained by mistake would be carried out again at every
                    # restart (a start, a prune); a command is live, or nothing
                    log.warning("a retained message on %s is not a command: ignored (publish "
                                "commands without retain; clear it with an empty retained "
                                "message)", item.topic)
                    continue
                try:
                    self._on_command(item)
                except TransportError as exc:
                    log.warning("reply not sent: %s", exc)
                except Exception:         # noqa: BLE001 -- the service keeps taking commands
                    log.exception("command on %s not handled", item.topic)
        finally:
            try:
                if self._own_status:
                    self._publish(self.topics.status(self.settings.node_id),
                                  self._status(False), retain=True)
                ctl.close(timeout=2.0, announce_offline=False)
            except (TransportError, OSError) as exc:
                log.warning("closing the control connection: %s", exc)

    # The retained status of the aggregator node: while a run is active, its Aggregator
    # publishes it (online with the round; offline with the last round when the run ends);
    # between runs the service says it is online and waiting, so `edgefl status` does not
    # show a service that waits for runs as offline. The control connection's will covers a
    # crash while waiting.
    def _status(self, online: bool, will: bool = False) -> bytes:
        return status_payload(self.settings.node_id, "aggregator", online,
                              profile=self.settings.aggregator.profile,
                              service="waiting" if online else None,
                              queued=None if will else len(self._records_in("queued")),
                              key=getattr(getattr(self.settings.aggregator.trust, "signer",
                                                  None), "fingerprint", None),
                              signatures="on" if getattr(self.settings.aggregator.trust,
                                                         "uplink", None) else "off")

    def _publish_idle_status(self) -> None:
        self._own_status = True
        self._publish(self.topics.status(self.settings.node_id), self._status(True),
                      retain=True)

    def _republish_status(self) -> None:
        """After a reconnect of the control connection (the broker may have published its
        will): the status again, from whoever owns it now."""
        with self._lock:
            active = self.active
        if active is None:
            self._publish_idle_status()
        elif active[1].aggregator is not None:
            active[1].aggregator._publish_status()

    def _connect_control(self):
        client_id = f"{self.settings.node_id}-ctl"
        will = (self.topics.status(self.settings.node_id), self._status(False, will=True))
        try:
            ctl = self.transport_factory(client_id, clean_session=True, protocol="5")
            ctl.set_will(*will)
            ctl.connect()
        except TransportError as exc:
            # a broker without MQTT 5 (NATS, amqtt): commands still work with the payload's
            # reply_to / request_id (docs/protocol.md "Control")
            log.warning("control connection over MQTT 5 failed (%s); using MQTT 3.1.1", exc)
            ctl = self.transport_factory(client_id, clean_session=True, protocol="3.1.1")
            ctl.set_will(*will)
            ctl.connect()
        ctl.subscribe(self.topics.ctl(), qos=1)
        log.info("taking commands on %s", self.topics.ctl())
        return ctl

    def _publish(self, topic: str, doc, **options) -> None:
        ctl = self._ctl
        if ctl is None:
            return
        try:
            ctl.publish(topic, doc if isinstance(doc, bytes) else
                        json.dumps(jsonable(doc), separators=(",", ":")).encode(), qos=1,
                        **options)
        except TransportError as exc:
            log.warning("not published on %s: %s", topic, exc)

    @property
    def _signer(self):
        # the aggregator's keys.signing_key: its replies, events and run records are signed
        return getattr(self.settings.aggregator.trust, "signer", None)

    def _event(self, event: str, **fields) -> None:
        self._publish(self.topics.events(), signed_event(
            {"event": event, "node": self.settings.node_id, "at": time.time(), **fields},
            self._signer))

    def _publish_record(self, record: dict) -> None:
        self._publish(self.topics.run_record(record["id"]),
                      signed_record(self._public(record), self._signer), retain=True)

    @staticmethod
    def _public(record: dict) -> dict:
        keys = ("id", "state", "created", "started", "resumed", "ended", "rounds_done",
                "final_accuracy",
                "test_accuracy",
                "model_sha256", "model_onnx", "run_dir", "out_dir", "error", "export_error",
                "clients", "pruned", "pruned_bytes")
        out = {k: record.get(k) for k in keys if record.get(k) is not None}
        out["rounds"] = (record.get("config") or {}).get("rounds")
        return out

    def _reply(self, name, reply, *, result=None, error=None) -> None:
        if reply is None or reply.topic is None:
            return
        options = {}
        if reply.mqtt5 and reply.correlation_data is not None:
            options["correlation_data"] = reply.correlation_data
        payload = reply_payload(name, reply, result=result, error=error)
        if reply.request_id is not None or reply.correlation_data is not None:
            # remembered (the last REMEMBERED_REPLIES) so a repeat is answered, not redone
            self._answered[self._answering] = (reply, payload, options)
            while len(self._answered) > REMEMBERED_REPLIES:
                self._answered.pop(next(iter(self._answered)))
        self._send_reply(reply, payload, options)

    def _send_reply(self, reply, payload: bytes, options: dict) -> None:
        # signed as it is sent, with the aggregator's key when it has one
        # (control.sign_reply): a repeat is the first reply, with a signature as fresh as
        # the first's (a resend after a lost reply must not get an expired one)
        signer = self._signer
        self._publish(reply.topic, payload if signer is None else
                      sign_reply(payload, reply, signer), **options)

    def _on_command(self, message: Message) -> None:
        # QoS 1 may deliver a command twice, and a requester repeats one it got no answer
        # to: a command with a reply address and a token is carried out once, and a repeat
        # gets the first reply again
        key = (message.response_topic, message.correlation_data, message.payload) \
            if message.correlation_data is not None or message.response_topic is not None \
            else (None, None, message.payload)
        if key in self._answered:
            reply, payload, options = self._answered[key]
            self._send_reply(reply, payload, options)
            return
        self._answering = key
        try:
            self._handle_command(message)
        finally:
            self._answering = None

    def _handle_command(self, message: Message) -> None:
        try:
            command = parse_command(message, self.topics)
        except CommandError as exc:
            reply = getattr(exc, "reply", None)
            log.warning("command refused: %s", exc)
            if reply is not None and reply.topic is not None:
                self._reply(getattr(exc, "cmd", None), reply, error=str(exc))
            else:
                self._event("error", error=f"command refused: {exc}")
            return
        refusal = self._signature_refusal(command)
        if refusal is not None:
            log.warning("command %s refused: %s", command.name, refusal)
            self._reply(command.name, command.reply, error=refusal)
            return
        handler = getattr(self, f"_cmd_{command.name}")
        try:
            result = handler(command)
        except CommandError as exc:
            log.warning("%s refused: %s", command.name, exc)
            self._reply(command.name, command.reply, error=str(exc))
            return
        except Exception as exc:          # noqa: BLE001 -- a reply, not a dead control thread
            log.exception("%s failed", command.name)
            self._reply(command.name, command.reply, error=f"{type(exc).__name__}: {exc}")
            return
        log.info("%s: done (%s)", command.name, command.reply.request_id)
        self._reply(command.name, command.reply, result=result)

    def _signature_refusal(self, command) -> str | None:
        """Why `command` is refused for its signature (keys.operators set), or None. It must
        be an operator's, for this federation, unexpired, valid no longer than
        keys.command_window, and its nonce unseen: nonces are kept on disk until their
        command expires, so a command replayed even after a restart is refused."""
        trust = self.settings.aggregator.trust
        verifier = getattr(trust, "operators", None)
        if verifier is None:
            return None
        from ..transport.signing import NonceStore, SignatureError

        where = f"command {command.name}"
        try:
            env = verifier.verify_doc(command.doc, kind="command", where=where)
            if env["exp"] is None or env["exp"] - env["at"] > trust.command_window_s:
                raise SignatureError(f"{where}: valid for "
                                     f"{'ever' if env['exp'] is None else env['exp'] - env['at']}"
                                     f" s, more than keys.command_window = "
                                     f"{trust.command_window_s:g} s")
            if self._nonces is None:
                self._nonces = NonceStore(os.path.join(self.state_dir, NONCES_FILE))
                if self._nonces.error:
                    log.warning("command nonces not read (%s): a command replayed within "
                                "keys.command_window of this restart is not recognised; "
                                "the file is replaced", self._nonces.error)
            self._nonces.check_and_add(env["nonce"], env["exp"], where)
        except SignatureError as exc:
            return str(exc)
        return None

    # ------------------------------------------------------------------ commands
    def _cmd_start(self, command) -> dict:
        from ..config import ConfigError
        from ..runconfig import run_config_from_mapping

        fields = command.fields
        try:
            config = run_config_from_mapping(dict(fields["config"]), "start: config")
        except ConfigError as exc:
            raise CommandError(str(exc)) from None
        clients = fields.get("clients") or (list(self.settings.client_ids)
                                            if self.settings.client_ids else None)
        if clients is not None and len(clients) != config.clients:
            source = "start: clients" if fields.get("clients") else "the site file's clients"
            raise CommandError(f"{source} lists {len(clients)} client ids, the config's "
                               f"partition.clients is {config.clients}")
        ids = clients or list(default_client_ids(config.clients))
        with self._lock:
            run_id = fields.get("run")
            if run_id is not None and run_id in self.records:
                raise CommandError(f"start: run id {run_id!r} is taken (state "
                                   f"{self.records[run_id]['state']}); choose another or "
                                   f"leave it out")
            if run_id is not None and os.path.lexists(self.store.run_dir(run_id)):
                # a record load_all skipped (torn, another version's): a new one would be
                # written over it, and the run would take its checkpoint and outputs
                raise CommandError(f"start: run id {run_id!r} is taken: "
                                   f"{self.store.run_dir(run_id)} holds a run whose record "
                                   f"cannot be read (the service's log says why); choose "
                                   f"another id, or move that directory away")
            if run_id is None:
                run_id = self.store.new_id(self.records)
            run_dir = self.store.run_dir(run_id)
            record = {"id": run_id, "seq": self._next_seq(), "state": "queued", "site": None,
                      "config": config.to_dict(), "clients": ids,
                      "round": dict(fields.get("round") or {}), "created": time.time(),
                      "run_dir": run_dir, "state_dir": os.path.join(run_dir, "state"),
                      "out_dir": run_dir}
            self._save(record)
            ahead = len(self._records_in("queued", *ACTIVE_STATES)) - 1
            if self.active is not None and self.active[1].rounds_over.is_set():
                ahead -= 1       # it only writes its outputs now (RunControl.rounds_over)
            self._wake.notify_all()
        self._publish_record(record)
        self._event("run_queued", run=run_id, ahead=ahead, strategy=config.strategy,
                    rounds=config.rounds, clients=ids)
        return {"run": run_id, "state": "queued", "ahead": ahead, "run_dir": run_dir}

    def _target_active(self, command) -> tuple[dict, RunControl]:
        with self._lock:
            active = self.active
            closing = None if self.stop.is_set() else self._closing     # (_between_tries)
        wanted = command.run
        if active is None:
            if closing is not None and wanted in (None, closing):
                raise CommandError(f"{command.name}: run {closing} has just ended; its end is "
                                   "being recorded")
            if wanted is not None and wanted in self.records:
                raise CommandError(f"{command.name}: run {wanted} is "
                                   f"{self.records[wanted]['state']}, not active")
            raise CommandError(f"{command.name}: no run is active ({self._queue_text()})")
        record, control = active
        if wanted is not None and wanted != record["id"]:
            state = self.records[wanted]["state"] if wanted in self.records else "unknown"
            raise CommandError(f"{command.name}: run {wanted} is {state}, the active run is "
                               f"{record['id']}")
        return record, control

    def _cmd_pause(self, command) -> dict:
        record, control = self._target_active(command)
        if control.paused.is_set():
            raise CommandError(f"pause: run {record['id']} is already paused")
        control.paused.set()
        with self._lock:
            record["state"] = "paused"
            # the rounds done so far in the record: a dashboard or `ctl runs` that comes
            # during the pause sees no round close, and has only the record to go by
            record.update(self._progress(control))
            self._save(record)
        self._publish_record(record)
        agg = control.aggregator
        o = agg.open if agg is not None else None
        ckpt = agg.ckpt if agg is not None else None
        # round: the open round the pause holds, None between rounds (or before the run's
        # first: rounds_done None while its aggregator is still starting)
        where = {"round": o.round if o else None,
                 "rounds_done": ckpt.round if ckpt is not None else None}
        self._event("run_paused", run=record["id"], **where)
        return {"run": record["id"], "state": "paused", **where}

    def _cmd_resume(self, command) -> dict:
        record, control = self._target_active(command)
        if not control.paused.is_set():
            raise CommandError(f"resume: run {record['id']} is not paused (state "
                               f"{record['state']})")
        control.paused.clear()
        with self._lock:
            record["state"] = "running"
            record.update(self._progress(control))
            self._save(record)
        self._publish_record(record)
        self._event("run_continued", run=record["id"])
        return {"run": record["id"], "state": "running"}

    def _cmd_stop(self, command) -> dict:
        wanted = command.run
        with self._lock:
            if wanted is not None and wanted in self.records \
                    and self.records[wanted]["state"] == "queued":
                record = self.records[wanted]
                record.update(state="cancelled", ended=time.time())
                self._save(record)
                cancelled = True
            else:
                cancelled = False
        if cancelled:
            self._publish_record(record)
            self._event("run_cancelled", run=wanted)
            return {"run": wanted, "state": "cancelled"}
        if wanted is not None and wanted not in self.records:
            raise CommandError(f"stop: no run {wanted!r} (runs: "
                               f"{', '.join(self.records) or 'none'})")
        between = self._between_tries(wanted)
        if between is not None:
            # not active now, and started again after retry_s (_try_again): that start finds
            # the mark and ends the run from its checkpoint, training nothing more
            with self._lock:
                between["stop_requested"] = time.time()
            note = "it was waiting to be tried again; it ends from its last checkpoint"
            try:
                self._save(between)
            except OSError as exc:      # a full disk: the mark in memory does it
                note += f" (the stop could not be written to the run's record: {exc})"
            with self._wake:
                self._wake.notify_all()
            return {"run": between["id"], "state": "stopping", "note": note}
        record, control = self._target_active(command)
        # On disk before the answer: the run's end (its round abandoned, its model exported,
        # its record `stopped`) comes later, and a service killed in between (kill -9, power
        # loss) would otherwise resume, and train on, a run the operator was told is
        # stopping. A restart finds the mark and ends the run instead (_execute).
        note = ("the checkpoint of the last aggregated round stands; model.onnx is exported "
                "from it (event run_stopped)")
        try:
            with self._lock:
                record["stop_requested"] = time.time()
                self._save(record)
        except OSError as exc:
            # The mark is a guard against a crash, not a condition of the stop: a disk that
            # is full (a run's checkpoints are what fills it) must not keep the operator
            # from stopping the run.
            log.error("run %s: its stop is not on disk (%s): a restart of the service before "
                      "the run has ended would resume it", record["id"], exc)
            note += f"; the stop could not be written to the run's record ({exc})"
        control.stop_requested.set()
        return {"run": record["id"], "state": "stopping", "note": note}

    def _between_tries(self, wanted) -> dict | None:
        """The record of the run `wanted` (None: the run) that is running or paused but not
        active: between two tries of _try_again."""
        with self._lock:
            if self.active is not None:
                return None
            # the run being closed is still `running` until its end is recorded: not one
            # waiting for its next try (_target_active says it has just ended), unless the
            # service is shutting down: then it was only interrupted, resumes at the next
            # start, and the stop's mark in its record ends it then
            closing = None if self.stop.is_set() else self._closing
            waiting = [r for r in self._records_in(*ACTIVE_STATES) if r["id"] != closing]
        if wanted is not None:
            waiting = [r for r in waiting if r["id"] == wanted]
        return waiting[0] if waiting else None

    def _cmd_export(self, command) -> dict:
        wanted = command.run
        with self._lock:
            if wanted is None:
                if self.active is None:
                    raise CommandError("export: no run is active; name one with \"run\"")
                record = self.active[0]
            elif wanted not in self.records:
                raise CommandError(f"export: no run {wanted!r}")
            else:
                record = self.records[wanted]
        with self._export_lock:
            exported = export_run_checkpoint(record)
        published = self._exported(record, exported, "export")
        return {"run": record["id"], **exported, "published": published is not None}

    def _cmd_status(self, command) -> dict:
        with self._lock:
            active = self.active
            queue = [r["id"] for r in self._records_in("queued")]
        out = {"node": self.settings.node_id, "federation": self.topics.federation,
               "version": __version__, "active": None, "queue": queue}
        if active is not None:
            record, control = active
            out["active"] = self._live(record, control)
        return out

    def _record_progress(self, record: dict, control: RunControl) -> None:
        """The paused run's rounds done and accuracy into its record, saved and published
        (RunControl.on_hold)."""
        with self._lock:
            if record.get("state") != "paused":
                return
            record.update(self._progress(control))
            self._save(record)
            # published under the lock: this runs on the aggregator's thread, and a resume
            # on the control thread (which changes the state under the lock) must not
            # publish `running` before this copy's `paused` lands after it
            self._publish_record(record)

    @staticmethod
    def _progress(control: RunControl) -> dict:
        """{rounds_done, test_accuracy} of an active run from its aggregator's checkpoint (the
        latest evaluated round's accuracy); {} while the aggregator has not loaded it."""
        agg = control.aggregator
        ckpt = agg.ckpt if agg is not None else None
        if ckpt is None:
            return {}
        accuracy = next((h.get("test_accuracy") for h in reversed(list(ckpt.history))
                         if h.get("test_accuracy") is not None), None)
        return {"rounds_done": ckpt.round, "test_accuracy": accuracy}

    @classmethod
    def _live(cls, record: dict, control: RunControl) -> dict:
        # created: which run of this id it is (a wiped state directory lets an id be
        # given again; `ctl watch` refuses the earlier one's retained records by it)
        doc = {"run": record["id"], "state": record["state"], "created": record.get("created"),
               "rounds": (record.get("config") or {}).get("rounds")}
        agg = control.aggregator
        if agg is None:
            return doc
        o = agg.open
        progress = cls._progress(control)
        accuracy = progress.get("test_accuracy")
        doc.update(rounds=agg.rounds, rounds_done=progress.get("rounds_done", 0),
                   round=o.round if o is not None else None,
                   deadline=o.deadline if o is not None else None,
                   updates=len(o.received) if o is not None else None,
                   uploaders=len(o.uploaders) if o is not None else None,
                   clients_online=sorted(n for n, up in dict(agg.online).items() if up),
                   test_accuracy=accuracy)
        return doc

    def _cmd_runs(self, command) -> dict:
        with self._lock:
            records = sorted(self.records.values(), key=lambda r: r.get("seq", 0))
            runs = [self._public(r) for r in records]
            active = self.active
        if active is not None:
            # the active run's record is written on its state changes, not every round:
            # its rounds done and accuracy come from its aggregator, as `status` gives them
            record, control = active
            for doc in runs:
                if doc["id"] == record["id"]:
                    doc.update({k: v for k, v in self._progress(control).items()
                                if v is not None})
        return {"runs": runs}

    def _cmd_prune(self, command) -> dict:
        keep = command.fields.get("keep")
        if keep is None:
            keep = self.settings.keep_runs
        if keep is None:
            raise CommandError("prune: give keep (how many of the most recently ended runs "
                               "keep their files): the service's site file sets no "
                               "retention.keep_runs")
        report = self._prune(keep, "prune", bool(command.fields.get("dry_run")))
        return report.as_dict(limit=PRUNE_REPLY_RUNS)
