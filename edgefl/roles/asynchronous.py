"""The aggregator's asynchronous mode (FedBuff with a buffer K smaller than its concurrency C):
buffered steps over MQTT, the network twin of edgefl/sim/asynchronous.py (docs/async.md).

    aggregator = aggregator_class(plan)(plan, transport, state_dir, settings)
    aggregator.run()

The engine calls are the in-process driver's: `open_round(v + 1, state, among=idle,
count=n, draw=j)` tasks idle boards, `close_buffer(v + 1, buffer, tasked, state, ...)` takes
step v + 1. What is this module's own is how a task reaches a board and its update comes back:

- **A task** is a retained JSON document on `task/<node>` in the format of a round
  announcement (roles/messages.build_announcement) tasking that board alone, whose `round` is
  the task id -- one counter for the run, so a board's tasks only go up and the client's
  "never train a round twice, re-send the stored update of the round last trained" holds for
  tasks unchanged. Its model goes, retained, on the board's own `model/<node>` (source
  "client", with the model's sha256 in the task): the board trains the version it was tasked
  with, and reports that version in its update's scalars ("version").
- **An update** comes up on `update/<node>` as in a synchronous round, its frame's round the
  task id. It counts only if it answers the task in flight for that board (and, with
  keys.fleet, is signed by that board's key for this run and task); anything else (a
  task already buffered, applied or dropped; a QoS 1 repeat) is a duplicate, ignored; an
  update of another run is refused, naming both runs.
  An update staler than max_staleness is dropped (the strategy's staleness_refusal).
- **State on disk** (state_dir): `aggregator.npz` is the checkpoint at the last step (the
  base class's: state with its window of past models, `history.jsonl` beside it, journal
  `rounds.jsonl`);
  `buffer/<task id>.npz` holds each update accepted into the buffer, written atomically
  before it counts, with the step it is for; `async.json` holds the driver's bookkeeping
  (next task id, draws at this version, the tasks in flight and the tasks opened since the
  last step), written before a task is published and after an update is buffered.
- **A step commits in this order:** aggregate the buffer; write `aggregator.npz` (the new
  version); delete the buffer files; write `async.json`; publish the next tasks. Killed
  before the checkpoint, the restart reloads the buffer files and takes the same step
  (aggregation is deterministic); killed after it, the buffer files are of a step the
  checkpoint holds and are deleted. Nothing is applied twice: a buffered task is no longer
  in flight, and only the task in flight counts.
- **After a restart** every task in flight is published again with a new announcement id:
  a board that had trained it re-sends its stored update (it never retrains a task), one
  that had not trains it (its model is still retained on `model/<node>`).

A task unanswered for round_timeout_s is given up (the board can be tasked again; its late
update is ignored), so a board that died does not hold a slot for ever.
"""
from __future__ import annotations

import copy
import dataclasses
import glob
import json
import logging
import os
import time

from ..rounds import RoundPlan
from ..strategies import StrategyError, Update
from ..transport import wire
from ..transport.base import ConnectionEvent, Message, TransportError
from ..transport.signing import SignatureError
from ..transport.topics import TopicError
from ..errors import ConfigError
from ..io import terminal_text
from .aggregator import REASON_CHARS, Aggregator, AggregatorResult, boards_by_reason
from .messages import (MessageError, build_announcement, buffers_sha256, new_announce_id,
                       parse_status, parse_update_scalars, task_from_announcement)
from .state import load_arrays, read_json, save_arrays, write_json

__all__ = ["AsynchronousAggregator", "aggregator_class", "is_asynchronous",
           "BOOK_FILE", "BUFFER_DIR"]

log = logging.getLogger("edgefl.roles.asynchronous")

BOOK_FILE = "async.json"
BUFFER_DIR = "buffer"

def is_asynchronous(strategy, clients_per_round: int) -> bool:
    """Whether a run of `strategy` needs the asynchronous aggregator: an asynchronous strategy
    whose (C, K) is not the synchronous round's (clients_per_round, clients_per_round)."""
    if not getattr(strategy, "asynchronous", False):
        return False
    m = clients_per_round
    return tuple(strategy.resolved(m)) != (m, m)

def aggregator_class(plan) -> type:
    """The aggregator that runs `plan` (a RunPlan)."""
    return AsynchronousAggregator if is_asynchronous(plan.strategy, plan.clients_per_round) \
        else Aggregator

class AsynchronousAggregator(Aggregator):
    """Aggregator (roles/aggregator.py) whose run is FedBuff's buffered steps: see the module
    docstring. The rounds of the base class are the steps here (ckpt.round = version)."""

    def __init__(self, plan, *args, **kwargs):
        super().__init__(plan, *args, **kwargs)
        if plan.secure is not None or getattr(plan.hooks, "client_settings", None) is not None:
            raise StrategyError(f"{plan.strategy.name}: {plan.strategy.secure_sum_refusal}")
        c, k = plan.strategy.resolved(plan.clients_per_round)
        self.concurrency = min(c, len(plan.client_ids))
        self.buffer_size = k
        self.book: dict = {}
        self.tasks: dict = {}        # task id -> Task (the plans' view of it)
        self.buffer: list = []       # (task id, node, Update, train_s) in arrival order
        self.step_started = time.perf_counter()
        self.counts = {"duplicates": 0, "rejected": 0, "resends": 0, "announcements": 0,
                       "wire_up_bytes": 0, "wire_down_bytes": 0, "abandoned": 0}
        # node -> (version, reason) of the last task it refused (its limits, a task it
        # cannot read): not tasked again at that task's version (it would refuse again at
        # once, a task and its model published each time)
        self.refusals: dict = {}

    # ------------------------------------------------------------------ files
    @property
    def book_path(self) -> str:
        return os.path.join(self.state_dir, BOOK_FILE)

    @property
    def buffer_dir(self) -> str:
        return os.path.join(self.state_dir, BUFFER_DIR)

    def _save_book(self) -> None:
        write_json(self.book_path, self.book)

    def _load_book(self) -> None:
        """async.json and the buffer files, reconciled with the checkpoint (module
        docstring: the commit order)."""
        v = self.ckpt.round
        try:
            book = read_json(self.book_path)
        except FileNotFoundError:
            book = None
        if not book or book.get("run") != self.ckpt.run_id:
            book = {"run": self.ckpt.run_id, "version": v, "next_task": 1, "draws": 0,
                    "flight": {}, "tasked": [], "dropped": 0, "dropped_bytes": 0}
        if book["version"] != v:    # killed between the checkpoint and async.json
            book.update(version=v, draws=0, tasked=[], dropped=0, dropped_bytes=0)
        self.book = book
        os.makedirs(self.buffer_dir, exist_ok=True)
        entries = []
        for path in glob.glob(os.path.join(self.buffer_dir, "*.npz")):
            arrays, meta = load_arrays(path)
            if meta.get("run") != self.ckpt.run_id or int(meta["step"]) <= v:
                # another run's, or applied (the checkpoint holds its step)
                os.remove(path)
                continue
            entries.append((int(meta["arrival"]), meta, arrays))
        entries.sort(key=lambda e: e[0])
        self.buffer = []
        for _, meta, arrays in entries:
            update = Update(arrays, int(meta["num_samples"]), float(meta["train_loss"]),
                            int(meta["steps"]), dict(meta["scalars"]))
            self.buffer.append((int(meta["task"]), meta["node"], update,
                                float(meta["train_s"])))
            # killed between the buffer file and async.json: the task is answered
            flight = self.book["flight"].get(meta["node"])
            if flight is not None and flight["task"] == int(meta["task"]):
                del self.book["flight"][meta["node"]]
        for entry in list(self.book["tasked"]) + list(self.book["flight"].values()):
            self.tasks[entry["task"]] = self._task_of(entry)
        for _, meta, _ in entries:
            self.tasks[int(meta["task"])] = self._task_of(meta["entry"])
        if self.buffer or self.book["flight"]:
            log.info("asynchronous state: version %d, %d update(s) in the buffer, %d task(s) "
                     "in flight", v, len(self.buffer), len(self.book["flight"]))
        self._save_book()

    def _task_of(self, entry: dict):
        """The Task of a stored task entry, its model from the state's window when kept."""
        params = self._model_of(entry["version"])
        return task_from_announcement(entry["doc"], entry["node"],
                                      {} if params is None else {"params": params})

    def _model_of(self, version: int):
        state = self.ckpt.state
        if version == int(state.meta["round"]):
            return state.buffers["params"]
        return state.buffers.get(f"params_v{version}")

    # ------------------------------------------------------------------ the loop
    def run(self):
        os.makedirs(self.state_dir, exist_ok=True)
        self.ckpt = self._load_or_start()
        self._load_book()
        if self.control is not None:
            self.control.attach(self)
        self._connect()
        if self.notifier is not None:
            self.notifier.ready(f"aggregator: asynchronous run {self.ckpt.run_id}, version "
                                f"{self.ckpt.round} of {self.rounds}")
        try:
            self._event("run_resumed" if self.ckpt.round or self.book["flight"]
                        else "run_started", round=self.ckpt.round + 1)
            # a synchronous announcement of an earlier run must not task anyone here
            self.transport.clear_retained(self.topics.round())
            self._publish_flight_again("resumed")
            drained = True
            while self.ckpt.round < self.rounds and not self.stop.is_set():
                if self.notifier is not None:
                    self.notifier.beat()
                if self._paused():
                    # no step, no task; updates come in only while the buffer has room (a
                    # buffer file names its step: one more than K would be misfiled)
                    if len(self.buffer) >= self.buffer_size:
                        self.stop.wait(self.settings.poll_s)
                    else:
                        self._service(self.settings.poll_s)
                    continue
                if len(self.buffer) >= self.buffer_size:
                    self._step()
                    if self.ckpt.round < self.rounds:
                        # not after the last step: an update buffered then is never applied,
                        # and its file would stay in the finished run's state
                        drained = self._service(0.0)
                    continue
                if drained:
                    # what arrived together is handled before idle boards are tasked, as
                    # the in-process driver handles one simulated instant's arrivals
                    self._give_up_overdue()
                    self._refill()
                drained = self._service(self.settings.poll_s)
            finished = self.ckpt.round >= self.rounds
            if finished:
                # no board meets a task or a model of this run after it (a later run's
                # client would otherwise train it)
                for node in self.plan.client_ids:
                    self.transport.clear_retained(self.topics.topic("task", node))
                    self.transport.clear_retained(self.topics.client_model(node))
                self._finish()
        finally:
            self._close()
        return AggregatorResult(self.ckpt.run_id, self.ckpt.state,
                                self.plan.strategy.global_model(self.ckpt.state),
                                list(self.ckpt.history), list(self.ckpt.aggregated),
                                self.ckpt.round >= self.rounds, dict(self.stats), None)

    def _service(self, timeout: float) -> bool:
        """Handle what arrives within `timeout` and whatever is queued behind it; True once
        the queue is empty, False when a full buffer stopped it (the step comes first:
        later arrivals are checked against the new version)."""
        item = self.transport.receive(timeout=timeout)
        while item is not None:
            self._handle(item)
            if len(self.buffer) >= self.buffer_size:
                return False
            item = self.transport.receive(timeout=0)
        return True

    # ------------------------------------------------------------------ tasks
    def _refill(self) -> None:
        """Task idle boards up to the concurrency, from the current version (the in-process
        driver's refill: one open_round, the draw counting refills at this version)."""
        flight = self.book["flight"]
        ids = self.plan.client_ids
        v = self.ckpt.round
        refused = {node: why for node, (at, why) in self.refusals.items() if at == v}
        idle = [c for c in self.plan.setup.clients if ids[c] not in flight
                and ids[c] not in refused]
        if not flight and not idle:
            # every board refused its task at this version: no update can come, no step
            raise ConfigError(f"version {v}: every board refused this run's task, so it "
                              f"can take no step: " + "; ".join(
                                  f"{', '.join(sorted(ns))}: {why}"
                                  for why, ns in boards_by_reason(refused).items()))
        n = min(self.concurrency - len(flight), len(idle))
        if n <= 0:
            return
        plan = self.engine.open_round(v + 1, self.ckpt.state, among=sorted(idle), count=n,
                                      draw=self.book["draws"])
        self.book["draws"] += 1
        new = []
        for c in plan.selected:
            node, task_id = ids[c], self.book["next_task"]
            self.book["next_task"] += 1
            task = dataclasses.replace(plan.tasks[c], source="client")
            entry = {"task": task_id, "node": node, "client": int(c), "version": v,
                     "opened": time.time(), "doc": None, "frame_id": None}
            frame = self._model_frame(task_id, node, task.buffers)
            entry["frame_id"] = frame[2]
            entry["doc"] = self._task_doc(task_id, node, task, frame)
            self.tasks[task_id] = task
            flight[node] = entry
            self.book["tasked"].append(entry)
            new.append((node, frame))
        self._save_book()               # before any board hears of these task ids
        # logged before the publishes: a process stopped after the book and before this
        # line logs its tasks in flight when it resumes (_publish_flight_again)
        log.info("version %d: tasked %s (%d in flight)", v,
                 self._named_tasks(n for n, _ in new), len(flight))
        for node, frame in new:
            self._publish_task(node, frame=frame)

    def _publish_flight_again(self, why: str) -> None:
        """Publish every task in flight once more, logged as `_refill` logs new ones, so the
        logs name every task a board may train: a process stopped between saving its book and
        logging (_refill) leaves tasks in flight that no log names yet."""
        nodes = sorted(self.book["flight"])
        if not nodes:
            return
        log.info("version %d: tasks in flight published again (%s): %s", self.ckpt.round, why,
                 self._named_tasks(nodes))
        for node in nodes:
            self._publish_task(node, again=True)

    def _named_tasks(self, nodes) -> str:
        """The tasks in flight of `nodes` as the log names them: client-1 (task 7), ..."""
        flight = self.book["flight"]
        return ", ".join(f"{n} (task {flight[n]['task']})" for n in nodes)

    def _model_frame(self, task_id: int, node: str, buffers) -> tuple:
        """(payloads, sha256 of the decoded buffers, message id) of a task's model."""
        s = self.settings
        data = wire.encode("client_model", task_id, s.node_id, buffers,
                           {"run": self.ckpt.run_id}, self.table, s.compression,
                           recipient=node,
                           sign=self.signer.frame_signer(self.ckpt.run_id) if self.signer
                           else None)
        if s.compression != "none":      # the hash is of what the board will decode
            buffers = wire.decode(data, wire.Expectation(self.table,
                                                         kinds="client_model")).buffers
        return wire.split(data, s.max_payload), buffers_sha256(buffers), \
            wire.read_header(data).message_id

    def _task_doc(self, task_id: int, node: str, task, frame) -> dict:
        model = {"spec": json.loads(self.plan.model.spec),
                 "input_shape": list(self.plan.model.input_shape),
                 "num_classes": int(self.plan.model.num_classes),
                 "table": self.table.digest}
        now = time.time()
        return build_announcement(
            run_id=self.ckpt.run_id, aggregator=self.settings.node_id, round=task_id,
            rounds=self.rounds, announce_id=new_announce_id(), opened=now,
            deadline=now + self.settings.round_timeout_s, strategy=self._strategy_record(),
            model=model, compression=self.settings.compression, global_sha=None,
            tasks={node: task}, client_index=self.members, client_sha={node: frame[1]},
            frame_ids={node: frame[2]})

    def _publish_task(self, node: str, frame=None, again: bool = False,
                      restart_clock: bool = True) -> None:
        """The task in flight for `node` on task/<node>, then its model on model/<node>
        (retained when one frame). again: published once more (a restart, a lost broker
        session, the board asked): a new announcement id, so a board that trained the task
        re-sends its stored update, and the model encoded anew from the state's window (a
        version out of the window has no model left to send: the task goes out without it,
        its update will be dropped as too stale, and it is given up at its deadline).
        restart_clock: the task's round_timeout_s counts from now (a restart, a lost
        session: the time we were away is not the board's); not when the board asked for
        its model, or a board that keeps asking would hold its slot for ever."""
        entry = self.book["flight"][node]
        doc = copy.deepcopy(entry["doc"])
        if frame is None:
            params = self._model_of(entry["version"])
            if params is not None:
                frame = self._model_frame(entry["task"], node, {"params": params})
                doc["tasks"][node]["model_frame"] = f"{frame[2]:016x}"
                entry["frame_id"] = frame[2]
        if again:
            doc["announce"] = new_announce_id()
            if restart_clock:
                entry["opened"] = time.time()
        entry["doc"] = doc
        if self.signer is not None:     # signed as a round announcement whose round is the task
            doc = self.signer.sign_doc(doc, "announce", self.ckpt.run_id, entry["task"])
        try:
            self.transport.publish(self.topics.topic("task", node),
                                   json.dumps(doc, separators=(",", ":")).encode(), qos=1,
                                   retain=True)
            self.counts["announcements"] += 1
            if frame is None:
                return
            topic = self.topics.client_model(node)
            payloads = frame[0]
            if len(payloads) > 1:     # chunks are not retained: clear a stale whole frame
                self.transport.publish(topic, b"", qos=1, retain=True)
            for payload in payloads:
                self.transport.publish(topic, payload, qos=1, retain=len(payloads) == 1)
                self.counts["wire_down_bytes"] += len(payload)
        except TransportError as exc:
            log.warning("task %d for %s not published: %s (published again after a "
                        "reconnect, or given up at its timeout)", entry["task"], node, exc)

    def _give_up_overdue(self) -> None:
        """A task unanswered for round_timeout_s frees its slot (the board may be gone)."""
        now = time.time()
        overdue = [n for n, e in self.book["flight"].items()
                   if now - e["opened"] >= self.settings.round_timeout_s]
        for node in overdue:
            self._give_up(node, f"unanswered after {self.settings.round_timeout_s:.0f} s")
        if overdue:
            self._save_book()

    def _give_up(self, node: str, why: str) -> None:
        """The task in flight for `node` given up: its slot is free (the caller saves the
        book)."""
        entry = self.book["flight"].pop(node)
        # its update, if part of it came, would be ignored when complete: its chunks go
        # now, not after the reassembly timeout (they would hold the board's slots)
        self.reassembler.discard(node, {entry["task"]})
        self.counts["abandoned"] += 1
        log.warning("task %d of %s (version %d) %s: given up", entry["task"], node,
                    entry["version"], why)

    # ------------------------------------------------------------------ updates
    def _handle(self, item) -> None:
        if isinstance(item, Message):
            try:
                kind, node = self._topic_cache.parse(item.topic)
            except TopicError:
                kind = None             # the base class logs it
            if kind == "update":
                self._on_async_update(node, item.payload)
                return
        super()._handle(item)
        if isinstance(item, ConnectionEvent) and item.connected and not item.session_present \
                and self._connects > 1:
            self._publish_flight_again("the broker lost the retained tasks")

    def _reject(self, node: str | None, reason: str, key=None) -> None:
        self.counts["rejected"] += 1        # the next step's record (no round is open here)
        super()._reject(node, reason, key)

    def _on_async_update(self, node: str, payload: bytes) -> None:
        if node not in self.members:
            self._reject(node, "update from a node outside the federation")
            return
        expect = wire.Expectation.for_topic("update", node, self.table)
        try:
            frame = self.reassembler.add(payload, expect)
        except wire.FrameError as exc:
            self._reject(node, f"[{exc.code}] {exc.reason}")
            return
        if frame is None:
            return
        task_id = frame.round
        where = f"update of {node} for task {task_id}"
        run = frame.scalars.get("run")
        if run != self.ckpt.run_id:
            # before the flight check: another run's task ids mean nothing here, and such an
            # update is no repeat of one of ours (parse_update_scalars checks the rest below)
            self._reject(node, f"{where} belongs to run {run}, this is run {self.ckpt.run_id}")
            return
        entry = self.book["flight"].get(node)
        if entry is None or entry["task"] != task_id:
            self.counts["duplicates"] += 1
            self.stats["duplicates"] += 1
            log.info("%s ignored: not the task in flight for it (already buffered, applied, "
                     "dropped or given up)", where)
            return
        if self.uplink is not None:
            # as the synchronous aggregator checks (_on_update): the node's own key, this run
            # and this task (the frame's round); a refused update leaves the task in flight,
            # so a forgery cannot stand in for the board's own
            try:
                self.uplink.verify_frame(frame, kind="update", where=where,
                                         run=self.ckpt.run_id, round=task_id, by=node)
            except SignatureError as exc:
                self.stats["bad_signatures"] = self.stats.get("bad_signatures", 0) + 1
                self._reject(node, str(exc))
                return
        try:
            scalars = parse_update_scalars(frame.scalars, where)
            update = Update(dict(frame.buffers), scalars["num_samples"],
                            scalars["train_loss"], scalars["steps"], scalars["strategy"])
            if update.scalars.get("version") != entry["version"]:
                raise MessageError(f"{where}: it says it started from version "
                                   f"{update.scalars.get('version')!r}, the task was of "
                                   f"version {entry['version']}")
            # as the synchronous aggregator checks (_on_update): task ids start at 1 again
            # in a run whose id was given again after a state wipe, and the earlier run's
            # update of this task, signed as well, names another model as its start
            base = entry["doc"]["tasks"][node].get("model_sha256")
            if scalars["base"] is not None and base is not None and scalars["base"] != base:
                raise MessageError(f"{where} was trained from model {scalars['base'][:16]}, "
                                   f"this task's is {base[:16]} (an earlier run of the id "
                                   f"{self.ckpt.run_id!r}, replayed?)")
            why = self.plan.strategy.update_refusal(update)
            if why is not None:
                raise MessageError(f"{where}: {why}")
            self.engine.accept_upload(self._plan_of(entry["task"], node), entry["client"],
                                      update)
        except (MessageError, StrategyError, ValueError) as exc:
            self._reject(node, str(exc))
            return
        self.counts["wire_up_bytes"] += frame.nbytes
        del self.book["flight"][node]
        why = self.plan.strategy.staleness_refusal(update, self.ckpt.state)
        if why is not None:
            self.book["dropped"] += 1
            self.book["dropped_bytes"] += update.nbytes
            self._save_book()
            log.info("%s dropped: %s", where, why)
            return
        step = self.ckpt.round + 1
        save_arrays(os.path.join(self.buffer_dir, f"{task_id}.npz"), update.buffers,
                    {"run": self.ckpt.run_id, "task": task_id, "node": node, "step": step,
                     "arrival": len(self.buffer),
                     "num_samples": update.num_samples, "train_loss": update.train_loss,
                     "steps": update.steps, "scalars": update.scalars,
                     "train_s": scalars["train_s"], "entry": entry})
        self.buffer.append((task_id, node, update, scalars["train_s"]))
        self._save_book()
        log.info("%s buffered (version %d, %d/%d)", where, entry["version"],
                 len(self.buffer), self.buffer_size)

    def _plan_of(self, task_id: int, node: str) -> RoundPlan:
        """The one-board plan of a task: what close_buffer checks the update against."""
        c = self.members[node]
        task = self.tasks[task_id]
        return RoundPlan(task.round, (c,), {c: task},
                         frozenset([c]) if task.upload else frozenset(), self.step_started)

    def _on_status(self, node: str, payload: bytes) -> None:
        super()._on_status(node, payload)
        if not payload or node not in self.book.get("flight", {}):
            return
        try:
            doc = parse_status(payload, node)
        except MessageError:
            return
        entry = self.book["flight"][node]
        refusal = doc.get("refused")
        if isinstance(refusal, dict) and refusal.get("run") == self.ckpt.run_id \
                and refusal.get("round") == entry["task"]:
            # the board cannot take this task (its limits, a task it cannot read): given
            # up now, as a synchronous round stops waiting for it, not at the deadline
            why = terminal_text(refusal.get("reason"), REASON_CHARS, one_line=True)
            self._give_up(node, "refused by the board: " + why)
            if not refusal.get("failed"):
                # its limits or a task it cannot read: it would refuse the version's next
                # task too (a failed local round may not recur: tasked again as usual)
                self.refusals[node] = (entry["version"], why)
            self._save_book()
            return
        if doc.get("online") and doc.get("need_model") == entry["task"]:
            log.info("task %d: model re-sent to %s (it asked)",
                     self.book["flight"][node]["task"], node)
            self.counts["resends"] += 1
            self._publish_task(node, again=True, restart_clock=False)

    # ------------------------------------------------------------------ a step
    def _step(self) -> None:
        r = self.ckpt.round + 1
        taken, self.buffer = self.buffer[:self.buffer_size], self.buffer[self.buffer_size:]
        buffer = [(self._plan_of(t, n), self.members[n], u) for t, n, u, _ in taken]
        tasked = [self._plan_of(e["task"], e["node"]) for e in self.book["tasked"]]
        dropped, dropped_bytes = self.book["dropped"], self.book["dropped_bytes"]
        counts = dict(self.counts)
        closed = self.engine.close_buffer(
            r, buffer, tasked, self.ckpt.state, started=self.step_started,
            train_wall_s=max((s for *_, s in taken), default=0.0),
            elapsed_before=self.ckpt.elapsed_s,
            extras=lambda: {"closed_by": "buffer", "updates": len(buffer), "missing": [],
                            "tasks": [t for t, *_ in taken], "dropped_stale": dropped,
                            "dropped_bytes": dropped_bytes, **counts})
        self._commit(r, closed.state, closed.record)      # aggregator.npz: version r
        for t, *_ in taken:
            try:
                os.remove(os.path.join(self.buffer_dir, f"{t}.npz"))
            except FileNotFoundError:
                pass
        self.book.update(version=r, draws=0, dropped=0, dropped_bytes=0, tasked=[])
        keep = {e["task"] for e in self.book["flight"].values()} | {t for t, *_ in self.buffer}
        self.tasks = {t: task for t, task in self.tasks.items() if t in keep}
        self._save_book()
        for k in self.counts:
            self.counts[k] = 0
        self.step_started = time.perf_counter()
