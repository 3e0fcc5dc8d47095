"""What the dashboard shows, folded from the federation's messages: `FleetView`.

Sources (docs/protocol.md):

- `status/<node>` (retained): one row of the fleet per node; an empty retained payload
  removes the node. "Last seen" is when the status was published (its `at`) for a retained
  message delivered on subscribing, and when it arrived for a live one (a Last Will carries
  the time its connection was made, not when it fired).
- `runs/<run>` (retained): the run's record (state, rounds, accuracy); an empty payload
  removes it.
- `events`: the event stream; `round_closed` gives a curve point (test accuracy and loss on
  evaluated rounds, train loss on every round); the run events give a run's state where no
  record is published (an aggregator outside the service, `edgefl simulate --transport
  mqtt`). A record always wins over what the events said.

Every change becomes one (kind, JSON bytes) pair for the listeners (the open pages):
`node`, `node_gone`, `run`, `run_gone`, `point`, `event`, `broker`. A page that connects
gets `snapshot()` first, taken under the same lock as its registration, so it misses
nothing and sees nothing twice.

A payload that cannot be read (not JSON, nested too deep, a status naming another node, a
run record whose rounds_done is not a whole number) is counted and logged with its topic,
and changes nothing.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque

from ..io import jsonable
from ..roles.daemon import DONE_STATES, RUN_STATES
from ..roles.messages import MAX_JSON_BYTES, MessageError, json_object, parse_status
from ..transport.base import ConnectionEvent, Message
from ..transport.topics import TopicError, Topics

__all__ = ["FleetView", "Listener", "MAX_EVENTS", "page_json"]

log = logging.getLogger("edgefl.dashboard")

MAX_EVENTS = 500                # events kept for a page that connects later
LISTENER_BACKLOG = 2000         # changes queued for one page before it is dropped
# Bytes of changes queued for one page before it is dropped. The count alone let a page
# that stopped reading hold 2,000 board statuses of up to 64 KiB each (128 MB) alive. Twice
# the largest message the view reads (MAX_JSON_BYTES, 4 MiB: an event), so that a page that
# keeps up takes the largest change with another queued behind it; an empty queue takes any
# change (Listener.put), since the page's JSON of an event can be larger than its input.
LISTENER_BACKLOG_BYTES = 2 * MAX_JSON_BYTES

# the state a run event puts its run in, where no record says otherwise
_EVENT_STATES = {"run_queued": "queued", "run_started": "running", "run_resumed": "running",
                 "run_continued": "running", "run_paused": "paused",
                 "run_finished": "finished", "run_stopped": "stopped",
                 "run_cancelled": "cancelled"}


def page_json(doc) -> bytes:
    """A document as the page receives it: compact JSON of plain types (edgefl.io.jsonable)."""
    return json.dumps(jsonable(doc), separators=(",", ":")).encode()


class Listener:
    """One open page: a queue of changes (kind, JSON bytes), bounded by count and by bytes.
    When the page cannot keep up, the queue is dropped (`overflowed`: the changes queued are
    freed at once) and the page's stream ends; the browser reconnects and starts from a
    fresh snapshot rather than from a view with holes."""

    def __init__(self, backlog: int = LISTENER_BACKLOG,
                 backlog_bytes: int = LISTENER_BACKLOG_BYTES):
        self.queue: queue.Queue = queue.Queue(backlog)
        self.backlog_bytes = backlog_bytes
        self.queued_bytes = 0
        self.overflowed = False
        self._lock = threading.Lock()      # the feed puts, the page's thread gets

    def put(self, kind: str, data: bytes) -> None:
        with self._lock:
            if self.overflowed:
                return
            # an empty queue takes any change: JSON's escapes can make one event within
            # the view's input limit larger than the bound by itself
            if self.queued_bytes and self.queued_bytes + len(data) > self.backlog_bytes:
                self._drop()
                return
            try:
                self.queue.put_nowait((kind, data))
            except queue.Full:
                self._drop()
                return
            self.queued_bytes += len(data)

    def get(self, timeout: float) -> tuple[str, bytes]:
        """The next change; queue.Empty after `timeout` seconds without one."""
        kind, data = self.queue.get(timeout=timeout)
        with self._lock:
            self.queued_bytes = max(0, self.queued_bytes - len(data))
        return kind, data

    def _drop(self) -> None:
        self.overflowed = True
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self.queued_bytes = 0


class FleetView:
    """The fleet, the runs, their curves and the recent events of one federation."""

    def __init__(self, topics: Topics, broker: str = "", max_events: int = MAX_EVENTS):
        self.topics = topics
        self._lock = threading.Lock()
        self.nodes: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.points: dict[str, dict[int, dict]] = {}     # run -> round -> point
        self.events: deque = deque(maxlen=max_events)
        self.broker = {"url": broker, "federation": topics.federation, "connected": False,
                       "reason": "connecting", "at": time.time()}
        self.ignored = 0
        self._listeners: set[Listener] = set()

    # ------------------------------------------------------------------ pages
    def listen(self) -> tuple[Listener, dict]:
        """A new listener and the snapshot it starts from."""
        listener = Listener()
        with self._lock:
            self._listeners.add(listener)
            return listener, self._snapshot()

    def unlisten(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.discard(listener)

    def snapshot(self) -> dict:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict:
        return {"broker": dict(self.broker), "nodes": list(self.nodes.values()),
                "runs": list(self.runs.values()),
                "points": {run: sorted(p.values(), key=lambda q: q["round"])
                           for run, p in self.points.items()},
                "events": list(self.events), "ignored": self.ignored, "now": time.time()}

    def _emit(self, kind: str, doc: dict) -> None:
        if not self._listeners:
            return
        data = page_json(doc)        # once for every page, and its size is what it holds
        for listener in list(self._listeners):
            listener.put(kind, data)

    # ------------------------------------------------------------------ messages
    def apply(self, item) -> None:
        """Fold one received item (a Message or a ConnectionEvent) into the view."""
        if isinstance(item, ConnectionEvent):
            with self._lock:
                self.broker.update(connected=item.connected, reason=item.reason,
                                   at=time.time())
                self._emit("broker", dict(self.broker))
            return
        if not isinstance(item, Message):
            return
        try:
            kind, node = self.topics.parse(item.topic)
            if kind == "status":
                self._on_status(item, node)
            elif kind == "runs":
                self._on_record(item, node)
            elif kind == "events":
                self._on_event(item)
        except (TopicError, MessageError, ValueError) as exc:
            with self._lock:
                self.ignored += 1
            log.warning("ignored a message on %s: %s", item.topic, exc)

    def _on_status(self, message: Message, node: str) -> None:
        with self._lock:
            if not message.payload:          # the retained status was cleared
                if self.nodes.pop(node, None) is not None:
                    self._emit("node_gone", {"node": node})
                return
        doc = parse_status(message.payload, node)
        at = doc.get("at")
        seen = at if message.retain and isinstance(at, (int, float)) else message.received_at
        row = {**doc, "seen": seen}
        with self._lock:
            self.nodes[node] = row
            self._emit("node", row)

    def _on_record(self, message: Message, run: str) -> None:
        with self._lock:
            if not message.payload:
                if self.runs.pop(run, None) is not None:
                    self._emit("run_gone", {"id": run})
                return
        doc = json_object(message.payload, f"run record of {run!r}")
        if doc.get("id") != run or doc.get("state") not in RUN_STATES:
            raise MessageError(f"run record of {run!r}: id {doc.get('id')!r}, state "
                               f"{doc.get('state')!r} (need id {run!r} and a state of "
                               f"{', '.join(RUN_STATES)})")
        done = doc.get("rounds_done")
        if done is not None and (type(done) is not int or done < 0):
            # compared with the rounds seen closing below: a string or a list there raised
            # TypeError out of the feed thread, which then followed nothing more
            raise MessageError(f"run record of {run!r}: rounds_done {str(done)[:40]!r} is "
                               f"not a whole number >= 0")
        with self._lock:
            known = self.runs.get(run, {})
            row = {**doc, "record": True}
            # rounds seen closing in the events, which a record of the running run lags
            done = max(doc.get("rounds_done") or 0, known.get("rounds_done") or 0)
            row["rounds_done"] = done or doc.get("rounds_done")
            if known.get("test_accuracy") is not None:
                row.setdefault("test_accuracy", known["test_accuracy"])
            self.runs[run] = row
            self._emit("run", row)

    def _on_event(self, message: Message) -> None:
        doc = json_object(message.payload, "event")
        kind = doc.get("event")
        if not isinstance(kind, str):
            raise MessageError(f"event: field 'event' missing or not a string: "
                               f"{str(doc)[:80]}")
        run = doc.get("run") if isinstance(doc.get("run"), str) else None
        event = {**doc, "received": message.received_at}
        with self._lock:
            self.events.append(event)
            self._emit("event", event)
            if run is None:
                return
            # a round the page can count to: it walks the rounds between two points, and
            # past 2**53 a JavaScript number's r + 1 is r again (that walk never ended)
            counted = kind == "round_closed" and type(doc.get("round")) is int \
                and 1 <= doc["round"] < 2 ** 53
            if counted:
                self._point(run, doc)
            state = _EVENT_STATES.get(kind)
            if state is not None or counted:
                self._run_from_event(run, kind, state, doc)

    def _point(self, run: str, doc: dict) -> None:
        point = {"run": run, "round": doc["round"]}
        for key in ("test_accuracy", "test_loss", "train_loss"):
            value = doc.get(key)
            point[key] = value if isinstance(value, (int, float)) \
                and not isinstance(value, bool) else None
        self.points.setdefault(run, {})[doc["round"]] = point
        self._emit("point", point)

    def _run_from_event(self, run: str, kind: str, state: str | None, doc: dict) -> None:
        row = dict(self.runs.get(run) or {"id": run, "state": state or "running",
                                          "record": False})
        if kind == "round_closed":
            row["rounds_done"] = max(row.get("rounds_done") or 0, doc["round"])
            if doc.get("test_accuracy") is not None:
                row["test_accuracy"] = doc["test_accuracy"]
        elif kind == "run_queued" and doc.get("rounds"):
            row.setdefault("rounds", doc["rounds"])
        elif kind == "run_finished" and doc.get("rounds"):
            row["rounds_done"] = row["rounds"] = doc["rounds"]
        # a record is the service's word on the state; without one, the events are, and a
        # run that ended does not start again on a late event of another connection
        if state is not None and not row.get("record") and row.get("state") not in DONE_STATES:
            row["state"] = state
        if kind in ("run_started", "run_resumed"):
            row.setdefault("started", doc.get("at"))
        if state in DONE_STATES:
            row.setdefault("ended", doc.get("at"))
        self.runs[run] = row
        self._emit("run", row)
