"""The JSON documents the roles exchange besides frames: the
round announcement, the node status, and the scalars of an update frame. Built and checked
here only (docs/roles.md describes them); a document that fails a check raises
MessageError naming the field.

Round announcement (retained, `<prefix>/<fed>/round`):

    {"v": 1, "run": "3f9c...", "aggregator": "aggregator", "round": 3, "rounds": 20,
     "announce": "a1b2...",                 # new for every (re-)announcement of a round
     "opened": 1700000000.0, "deadline": 1700000300.0,          # Unix time, seconds
     "strategy": {"name": "mfl", "params": {"gamma": 0.9, "weighting": "samples"}},
     "model": {"spec": {"name": "softmax"}, "input_shape": [64], "num_classes": 10,
               "table": "<layer table sha256>"},
     "compression": "none",
     "model_sha256": "<sha256 of the global model's buffers>",  # null: no global model
     "model_frame": "<message id of the frame that carries it, 16 hex digits>",
     "train": {...}, "scalars": {...},      # the values every task shares
     "tasks": {"client-2": {"client": 2, "upload": true, "source": "global",
                            "train": {"seed": "1234..."}, "scalars": {}}}}

A per-client task (source "client", FedMR) also carries its own "model_sha256" and
"model_frame". A client takes a model frame whose message id is the announced
"model_frame" as the announced model (only the aggregator may publish model frames, and it
draws a new random id for each one it encodes); any other frame of the round it checks by
content hash, so a receiver may ignore "model_frame" (it is optional). Train
seeds travel as decimal strings (they are 64-bit; JSON numbers are exact only to 2^53).
The final announcement of a run is {"v": 1, "run": ..., "aggregator": ..., "round": T,
"rounds": T, "finished": true, "model_sha256": ...}.

Status (retained, `status/<node>`; the Last Will carries the same object with online
false and no last round): {"node", "role", "online", "version", "profile", "last_round",
"run", "at"}, plus, only when they apply (status_payload leaves out None):
  from a client:      "need_model": round (waiting for a model it cannot get; parse_status
                      checks it is a round number), "refused": {"run", "round", "reason"}
                      (the run exceeds the board's limits: the aggregator stops waiting)
  from the aggregator during a run: "round" (the open round), "paused": true
  from the aggregator service between runs (roles/daemon.py): "service": "waiting",
                      "queued": runs waiting (left out of its will)
parse_status checks the node and "online" and passes the other fields through.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
import time
from typing import Mapping

import numpy as np

from .. import __version__
from ..strategies import Task
from ..transport import wire
from ..transport.topics import TopicError, Topics, validate_id
from .state import tag_floats, untag_floats

__all__ = ["MessageError", "VERSION", "MAX_JSON_DEPTH", "MAX_STATUS_BYTES", "json_object", "buffers_sha256", "peek_frame", "TopicCache", "AnnouncementCache", "new_announce_id", "build_announcement",
           "parse_announcement", "finished_announcement", "task_from_announcement",
           "status_payload", "parse_status", "update_scalars", "parse_update_scalars"]

VERSION = 1
MAX_JSON_BYTES = 4 << 20
# nesting of a JSON message (status, command, reply, event, record): the deepest the protocol
# sends is a run config inside a command, a few levels. Deeper is refused: json.loads raises
# RecursionError (not a ValueError) near 1,000 levels, and a document just under that
# breaks whoever encodes it again (the dashboard's page, a reply): a board chooses its status
MAX_JSON_DEPTH = 32
# a node's status: a few hundred bytes (status_payload). Every reader keeps or parses each
# one a board publishes (the aggregator, `edgefl status`, the dashboard, which queues each
# change for every open page), so a board's status is held to far less than MAX_JSON_BYTES
MAX_STATUS_BYTES = 64 << 10


class MessageError(ValueError):
    """A JSON document that is not what the protocol says; the message names the field."""


def buffers_sha256(buffers: Mapping[str, np.ndarray]) -> str:
    """sha256 over the buffers in name order: each name (UTF-8), a NUL, the float32 bytes.
    With one buffer "params" this differs from checkpoint.model_sha256 (the bytes alone) by
    the name prefix; it identifies a frame's content, not a model file."""
    h = hashlib.sha256()
    for name in sorted(buffers):
        h.update(name.encode("utf-8") + b"\0")
        h.update(np.ascontiguousarray(buffers[name], dtype=np.float32).data)
    return h.hexdigest()


_PEEK = struct.Struct("<4sxxxxI28xQ")      # magic, round (byte 8), message id (byte 40)


def peek_frame(payload) -> tuple[int, int] | None:
    """(round, message id) from a frame's header at the offsets of docs/protocol.md 2.1,
    without checking it: enough to sort a payload (late, current, future) before the full
    checks of wire.Reassembler. None when it cannot be a frame (those checks then say why)."""
    if len(payload) < wire.HEADER_SIZE:
        return None
    magic, round_, message_id = _PEEK.unpack_from(payload, 0)
    return (round_, message_id) if magic == wire.MAGIC else None


class TopicCache:
    """Topics.parse with a memory: a role sees the same few topics over and over, and
    parsing validates every character of the ids."""

    def __init__(self, topics: Topics, limit: int = 65536):
        self.topics, self.limit = topics, limit
        self._seen: dict = {}

    def parse(self, topic: str):
        hit = self._seen.get(topic)
        if hit is None:
            hit = self.topics.parse(topic)          # TopicError for a foreign topic
            if len(self._seen) >= self.limit:
                self._seen.clear()
            self._seen[topic] = hit
        return hit


def new_announce_id() -> str:
    return os.urandom(8).hex()


def attempt_tag(announce_id: str) -> int:
    """The 32-bit tag of a round attempt (its announcement id): the high half of every
    secure chunk's message id, which the aggregator and its clients derive alike, so
    messages of an earlier attempt are told apart."""
    return int.from_bytes(hashlib.sha256(announce_id.encode()).digest()[:4], "big")


# ---------------------------------------------------------------------------------------
# announcement
# ---------------------------------------------------------------------------------------

def _common(dicts: list[dict]) -> dict:
    """The key/values every dict shares exactly (the rest stays per task)."""
    if not dicts:
        return {}
    first = dicts[0]
    return {k: v for k, v in first.items()
            if all(k in d and _same(d[k], v) for d in dicts[1:])}


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def _wire_train(cfg: Mapping) -> dict:
    out = dict(cfg)
    # FedProx's term is left out when off, as the train config then means what it meant
    # before the term existed: a board whose edgefl predates it still takes the round.
    if out.get("prox_mu", None) == 0.0:
        del out["prox_mu"]
    if "seed" in out:
        out["seed"] = str(int(out["seed"]))
    return out


def build_announcement(*, run_id: str, aggregator: str, round: int, rounds: int,
                       announce_id: str, opened: float, deadline: float, strategy: dict,
                       model: dict, compression: str, global_sha: str | None,
                       tasks: Mapping[str, Task], client_index: Mapping[str, int],
                       client_sha: Mapping[str, str],
                       frame_ids: Mapping[str, int] | None = None,
                       copy_ids: Mapping[str, int] | None = None) -> dict:
    """The announcement of `round`. tasks: {node id: Task}; client_index: {node id: the
    strategy's client id}; client_sha: {node id: sha of its per-client model}; frame_ids:
    {"global" or node id: message id of the frame carrying that model}; copy_ids: {node id:
    message id of the copy of the global model sent to that node alone}."""
    frame_ids, copy_ids = frame_ids or {}, copy_ids or {}
    nodes = sorted(tasks)
    trains = [_wire_train(tasks[n].train) for n in nodes]
    scalars = [tag_floats(dict(tasks[n].scalars)) for n in nodes]
    common_train, common_scalars = _common(trains), _common(scalars)
    entries = {}
    for n, train, sc in zip(nodes, trains, scalars):
        task = tasks[n]
        entry = {"client": int(client_index[n]), "upload": bool(task.upload),
                 "source": task.source,
                 "train": {k: v for k, v in train.items() if k not in common_train},
                 "scalars": {k: v for k, v in sc.items() if k not in common_scalars}}
        if task.source == "client":
            entry["model_sha256"] = client_sha[n]
            if n in frame_ids:
                entry["model_frame"] = f"{frame_ids[n]:016x}"
        elif n in copy_ids:
            entry["model_frame"] = f"{copy_ids[n]:016x}"
        entries[n] = entry
    doc = {"v": VERSION, "run": run_id, "aggregator": aggregator, "round": int(round),
           "rounds": int(rounds), "announce": announce_id, "opened": float(opened),
           "deadline": float(deadline), "strategy": tag_floats(strategy), "model": model,
           "compression": compression, "model_sha256": global_sha,
           "train": common_train, "scalars": common_scalars, "tasks": entries}
    if global_sha is not None and "global" in frame_ids:
        doc["model_frame"] = f"{frame_ids['global']:016x}"
    return doc


def finished_announcement(*, run_id: str, aggregator: str, rounds: int,
                          model_sha256: str) -> dict:
    return {"v": VERSION, "run": run_id, "aggregator": aggregator, "round": int(rounds),
            "rounds": int(rounds), "finished": True, "model_sha256": model_sha256,
            "announce": new_announce_id()}


def _need(doc: Mapping, key: str, kind, where: str = "announcement"):
    if key not in doc:
        raise MessageError(f"{where}: missing field {key!r}")
    value = doc[key]
    t = type(value)
    if t is kind or (t is not bool and type(kind) is tuple and t in kind):
        return value              # exactly a type asked for: every field of a good message
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise MessageError(f"{where}: {key} = {value!r} must be {kind}")
    if not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise MessageError(f"{where}: {key} must be {names}, got {type(value).__name__} "
                           f"{str(value)[:60]!r}")
    return value


def json_object(payload: bytes, what: str, limit: int = MAX_JSON_BYTES) -> dict:
    """The JSON object in `payload` (a message of the protocol: announcement, status,
    command, reply, event, run record), checked for size, constants, nesting and kind;
    MessageError naming `what` otherwise."""
    if len(payload) > limit:
        raise MessageError(f"{what}: {len(payload)} bytes, the limit is {limit}")
    try:
        doc = json.loads(payload.decode("utf-8"),
                         parse_constant=lambda c: (_ for _ in ()).throw(
                             MessageError(f"{what}: {c} is not JSON")))
    except UnicodeDecodeError as exc:
        raise MessageError(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise MessageError(f"{what}: not JSON ({exc.msg} at line {exc.lineno} column "
                           f"{exc.colno})") from None
    except RecursionError:
        raise MessageError(f"{what}: nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(doc, dict):
        raise MessageError(f"{what}: a JSON object was expected, got {type(doc).__name__}")
    # a document cannot nest deeper than it has brackets: most messages (statuses, commands,
    # replies, events) have too few to need the walk, which an announcement of 1,000
    # tasks pays (about a quarter of its parse)
    if payload.count(b"{") + payload.count(b"[") > MAX_JSON_DEPTH:
        _check_depth(doc, what)
    return doc


def _check_depth(doc, what: str) -> None:
    """MessageError when `doc` nests deeper than MAX_JSON_DEPTH: walked a level at a time,
    containers only (an announcement of 1,000 tasks: 0.89 ms against 1.76 ms for a stack of
    (value, depth) pairs, medians of 30 interleaved on a quiet machine, 2026-11-30; about 2
    ms against json.loads' 2.8 ms on a busy one)."""
    level, depth = [doc], 1
    while level:
        if depth > MAX_JSON_DEPTH:
            raise MessageError(f"{what}: nested deeper than {MAX_JSON_DEPTH} levels")
        deeper = []
        for value in level:
            deeper += [v for v in (value.values() if type(value) is dict else value)
                       if type(v) is dict or type(v) is list]
        level, depth = deeper, depth + 1


def parse_announcement(payload: bytes) -> dict:
    """The checked announcement (or final announcement) in `payload`."""
    doc = json_object(payload, "announcement")
    if doc.get("v") != VERSION:
        raise MessageError(f"announcement: version {doc.get('v')!r}, this node speaks {VERSION}")
    _need(doc, "run", str)
    try:
        validate_id(_need(doc, "aggregator", str), "announcement aggregator")
    except TopicError as exc:
        raise MessageError(str(exc)) from None
    for key in ("round", "rounds"):
        value = _need(doc, key, int)
        if value < 0 or value >= 2 ** 32:
            raise MessageError(f"announcement: {key} = {value} out of range")
    _need(doc, "announce", str)
    if doc.get("finished") is True:
        _need(doc, "model_sha256", str)
        return doc
    if doc["round"] < 1:
        raise MessageError(f"announcement: round {doc['round']}: rounds start at 1")
    for key in ("opened", "deadline"):
        value = _need(doc, key, (int, float))
        if not math.isfinite(value):
            raise MessageError(f"announcement: {key} is not finite")
    strategy = _need(doc, "strategy", dict)
    _need(strategy, "name", str, "announcement strategy")
    _need(strategy, "params", dict, "announcement strategy")
    model = _need(doc, "model", dict)
    _need(model, "spec", (dict, str), "announcement model")
    shape = _need(model, "input_shape", list, "announcement model")
    if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                            for d in shape):
        raise MessageError(f"announcement model: input_shape {shape!r} must be positive ints")
    _need(model, "num_classes", int, "announcement model")
    _need(model, "table", str, "announcement model")
    _need(doc, "compression", str)
    if doc.get("model_sha256") is not None:
        _need(doc, "model_sha256", str)
    _check_frame_id(doc, "announcement")
    _need(doc, "train", dict)
    _need(doc, "scalars", dict)
    tasks = _need(doc, "tasks", dict)
    for node, entry in tasks.items():
        where = f"announcement task {node!r}"
        try:
            validate_id(node, where)
        except TopicError as exc:
            raise MessageError(str(exc)) from None
        if not isinstance(entry, dict):
            raise MessageError(f"{where}: must be an object")
        client = _need(entry, "client", int, where)
        if client < 0:
            raise MessageError(f"{where}: client {client} must be >= 0")
        _need(entry, "upload", bool, where)
        if _need(entry, "source", str, where) not in ("global", "client"):
            raise MessageError(f"{where}: source {entry['source']!r}; valid: global, client")
        _need(entry, "train", dict, where)
        _need(entry, "scalars", dict, where)
        _check_frame_id(entry, where)
        if entry["source"] == "client":
            _need(entry, "model_sha256", str, where)
        elif doc.get("model_sha256") is None:
            raise MessageError(f"{where}: source global but the announcement has no "
                               "model_sha256")
    return doc


class AnnouncementCache:
    """parse_announcement for many clients of one process that receive the same payloads
    (a simulation over a broker: every client gets every announcement on its own
    connection). Each distinct payload is parsed and checked once; the clients share the
    resulting dict, which they only read. Keeps the last `size` payloads. Thread-safe."""

    def __init__(self, size: int = 8):
        self.size = size
        self._docs: dict = {}
        self._lock = threading.Lock()
        self.parsed = 0                          # payloads parsed (the rest were hits)

    def parse(self, payload: bytes) -> dict:
        key = bytes(payload)
        with self._lock:
            doc = self._docs.get(key)
        if doc is not None:
            return doc
        doc = parse_announcement(key)            # MessageError: not kept
        with self._lock:
            self.parsed += 1
            self._docs[key] = doc
            while len(self._docs) > self.size:
                del self._docs[next(iter(self._docs))]
        return doc


def _check_frame_id(doc: Mapping, where: str) -> None:
    """An optional "model_frame": a 64-bit message id as 16 lowercase hex digits."""
    value = doc.get("model_frame")
    if value is None:
        return
    if not (isinstance(value, str) and len(value) == 16
            and all(c in "0123456789abcdef" for c in value)):
        raise MessageError(f"{where}: model_frame {str(value)[:40]!r} must be a message id of "
                           "16 lowercase hex digits")


def announced_frame_id(doc: Mapping, node: str) -> int | None:
    """The message id of the frame carrying `node`'s model in announcement `doc` (its
    per-client model's, its own copy of the global model's, or the global model's), or None
    when the announcement gives none."""
    entry = doc["tasks"][node]
    value = entry.get("model_frame")
    if value is None and entry["source"] != "client":
        value = doc.get("model_frame")
    return None if value is None else int(value, 16)


def task_from_announcement(doc: Mapping, node: str, buffers: Mapping[str, np.ndarray]) -> Task:
    """The strategy Task of `node` in announcement `doc`, starting from `buffers` (the
    received model). MessageError if its train section is not a valid train config."""
    from .. import kernels
    from ..errors import KernelError

    entry = doc["tasks"][node]
    train = dict(doc["train"])
    train.update(entry["train"])
    try:
        cfg = kernels.train_config(**train)
    except (KernelError, TypeError, ValueError) as exc:
        raise MessageError(f"announcement task {node!r}: train: {exc}") from None
    scalars = untag_floats(dict(doc["scalars"]))
    scalars.update(untag_floats(dict(entry["scalars"])))
    return Task(int(doc["round"]), buffers, cfg, source=entry["source"], upload=entry["upload"],
                scalars=scalars)


# ---------------------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------------------

def status_payload(node: str, role: str, online: bool, *, profile: str | None = None,
                   last_round: int | None = None, run: str | None = None,
                   **extra) -> bytes:
    doc = {"node": node, "role": role, "online": bool(online), "version": __version__,
           "profile": profile, "last_round": last_round, "run": run, "at": time.time()}
    doc.update({k: v for k, v in extra.items() if v is not None})
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def parse_status(payload: bytes, topic_node: str) -> dict:
    """A checked status document; its node must be the topic's node."""
    doc = json_object(payload, f"status of {topic_node!r}", MAX_STATUS_BYTES)
    where = f"status of {topic_node!r}"
    if doc.get("node") != topic_node:
        raise MessageError(f"{where}: names node {doc.get('node')!r}, published on the topic "
                           f"of {topic_node!r}")
    _need(doc, "online", bool, where)
    need = doc.get("need_model")
    if need is not None and (isinstance(need, bool) or not isinstance(need, int)):
        raise MessageError(f"{where}: need_model must be a round number, got {need!r}")
    return doc


# ---------------------------------------------------------------------------------------
# update scalars
# ---------------------------------------------------------------------------------------

def update_scalars(update, run_id: str, train_s: float, base: str | None = None) -> dict:
    """The scalars of an update frame: the Update's fields, the run it belongs to, the
    client's training time, the strategy's own scalars (non-finite floats tagged), and
    `base`, the announced sha256 of the model it was trained from, when given."""
    out = {"run": run_id, "num_samples": int(update.num_samples),
           "train_loss": tag_floats(float(update.train_loss)), "steps": int(update.steps),
           "train_s": float(train_s), "strategy": tag_floats(dict(update.scalars))}
    if base is not None:
        # a run id names one run only while the aggregator's state lasts: signed with the
        # update, the model it started from tells it from an earlier run's of the same id
        out["base"] = base
    return out


def parse_update_scalars(scalars: Mapping, where: str) -> dict:
    """(checked) {run, num_samples, train_loss, steps, train_s, strategy, base} of an
    update; base None from a board older than it."""
    out = {}
    if not isinstance(scalars.get("run"), str):
        raise MessageError(f"{where}: scalar 'run' missing or not a string")
    out["run"] = scalars["run"]
    base = scalars.get("base")
    if base is not None and not isinstance(base, str):
        raise MessageError(f"{where}: scalar 'base' = {str(base)[:40]!r} must be a string "
                           "(the sha256 of the model it was trained from)")
    out["base"] = base
    for key in ("num_samples", "steps"):
        value = scalars.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MessageError(f"{where}: scalar {key!r} = {value!r} must be an integer >= 0")
        out[key] = value
    loss = untag_floats(scalars.get("train_loss"))
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise MessageError(f"{where}: scalar 'train_loss' = {loss!r} must be a number")
    out["train_loss"] = float(loss)
    train_s = scalars.get("train_s", 0.0)
    if isinstance(train_s, bool) or not isinstance(train_s, (int, float)) or train_s < 0:
        raise MessageError(f"{where}: scalar 'train_s' = {train_s!r} must be a number >= 0")
    out["train_s"] = float(train_s)
    strategy = scalars.get("strategy", {})
    if not isinstance(strategy, dict):
        raise MessageError(f"{where}: scalar 'strategy' must be an object")
    out["strategy"] = untag_floats(strategy)
    return out
