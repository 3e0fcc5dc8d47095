"""The exported ONNX model over MQTT: how the aggregator publishes it and how a client
receives and installs it (docs/protocol.md section 5.1; issue #5 item 4).

A retained topic keeps only the last message, and an ONNX file of a CNN is megabytes, so
it is chunked: the chunk sequence cannot be retained on one topic. Each payload of the
model's frame is therefore retained on its own part topic, and a small retained manifest
on the `onnx` topic says which message the parts make up:

    <prefix>/<fed>/onnx/<i>   i = 0 .. n-1: payload i of wire.split(frame, max_payload),
                              retained, QoS 1 (a frame that fits is its own part 0)
    <prefix>/<fed>/onnx       the manifest: an `onnx` frame with no buffers whose scalars
                              name the parts (run, sha256, bytes, parts, message_id,
                              metadata), retained, published after the parts

The frame is kind `onnx`, dtype bytes, one buffer `model.onnx` (the file's bytes), scalars
{run, sha256, bytes, metadata}. A client that subscribes at any time, even after the
aggregator has exited, receives the manifest and every part from the broker's retained
store, reassembles the frame, checks its sha256 and installs the file atomically
(edgefl.infer.install_model, which needs onnxruntime only). Parts left over from an
earlier, longer model are cleared (an empty retained message) by the publisher, which
remembers the part count of its last publication in its state directory.

`publish_model` is the publisher's side, shared by the Aggregator (each export during a run)
and the aggregator service (the model of a `stop` or an `export` command, published on its
control connection); one lock in this process keeps two publications from interleaving
their parts.

The part topics are built here from Topics.onnx(), not in edgefl.transport.topics, because
TOPIC_TABLE's rows are one kind per frame kind (tests/test_wire.py); moving the row there
is a one-line change when the table allows sub-levels of `onnx`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from dataclasses import dataclass

from ..infer import ModelFileError, install_model
from ..transport import wire
from ..transport.topics import Topics
from .state import atomic_write

__all__ = ["BUFFER_NAME", "INSTALLED_FILES", "OnnxPublication", "OnnxReceiver", "PUBLISHED_FILE",
           "encode_publication", "part_index", "part_topic", "parts_filter",
           "publish_model", "published_parts"]

log = logging.getLogger("edgefl.roles.onnx")

BUFFER_NAME = "model.onnx"
PUBLISHED_FILE = "onnx-published.json"     # in the aggregator's state directory
MODEL_FILE = "model.onnx"                  # a client's installed model, in its state directory
SIGNED_SUFFIX = ".signed.json"             # beside it: when the installed model was signed
INSTALLED_FILES = (MODEL_FILE, MODEL_FILE + SIGNED_SUFFIX)
MAX_PARTS = 100_000                        # 12 GiB at 128 KiB: far beyond any edge model


def part_topic(topics: Topics, index: int) -> str:
    """The retained topic of part `index` of the published model: <prefix>/<fed>/onnx/<i>."""
    return f"{topics.onnx()}/{int(index)}"


def parts_filter(topics: Topics) -> str:
    return f"{topics.onnx()}/+"


def part_index(topics: Topics, topic: str) -> int | None:
    """i for <prefix>/<fed>/onnx/<i> (decimal, no sign or leading zero), None for any other
    topic."""
    head = topics.onnx() + "/"
    if not topic.startswith(head):
        return None
    rest = topic[len(head):]
    if not rest.isdigit() or not rest.isascii() or (len(rest) > 1 and rest[0] == "0"):
        return None
    index = int(rest)
    return index if index < MAX_PARTS else None


@dataclass(frozen=True)
class OnnxPublication:
    manifest: bytes          # the `onnx` topic's retained payload
    parts: list              # the payloads of onnx/0 .. onnx/n-1
    sha256: str
    nbytes: int
    round: int


def encode_publication(data: bytes, metadata: dict, *, round: int, sender: str, run: str,
                       max_payload: int, signer=None) -> OnnxPublication:
    """The manifest and the part payloads of an exported model's bytes; both signed by
    `signer` (edgefl.transport.signing.Signer) when given: the frame the parts make up as
    kind "onnx", the manifest as kind "onnx_manifest"."""
    sha = hashlib.sha256(data).hexdigest()
    scalars = {"run": run, "sha256": sha, "bytes": len(data),
               "metadata": {str(k): str(v) for k, v in metadata.items()}}
    message_id = wire.new_message_id()
    frame = wire.encode("onnx", round, sender, {BUFFER_NAME: data}, scalars,
                        message_id=message_id,
                        sign=signer.frame_signer(run) if signer else None)
    parts = wire.split(frame, max_payload)
    if len(parts) > MAX_PARTS:
        raise wire.EncodeError(f"onnx: {len(data)} bytes in chunks of {max_payload} make "
                               f"{len(parts)} parts, more than {MAX_PARTS}")
    manifest = wire.encode("onnx", round, sender, {},
                           {**scalars, "parts": len(parts), "message_id": f"{message_id:016x}"},
                           sign=signer.manifest_signer(run) if signer else None)
    return OnnxPublication(manifest, parts, sha, len(data), round)


def published_parts(state_dir: str) -> int:
    """How many part topics the last publication from this state directory retained (0 when
    none is recorded, or the record is unreadable: then nothing is cleared)."""
    try:
        with open(os.path.join(state_dir, PUBLISHED_FILE), encoding="utf-8") as f:
            parts = json.load(f).get("parts", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return parts if isinstance(parts, int) and 0 <= parts <= MAX_PARTS else 0


def record_publication(state_dir: str, pub: OnnxPublication, run: str) -> None:
    atomic_write(os.path.join(state_dir, PUBLISHED_FILE),
                 json.dumps({"run": run, "round": pub.round, "sha256": pub.sha256,
                             "bytes": pub.nbytes, "parts": len(pub.parts)}).encode())


_PUBLISHING = threading.Lock()     # one publication at a time: parts never interleave


def publish_model(transport, topics: Topics, path, *, round: int, sender: str, run: str,
                  max_payload: int, record_dir: str, signer=None) -> OnnxPublication:
    """Publish the exported model at `path` retained for every client, present and future:
    each payload of its chunked frame on its own part topic `onnx/<i>`, the parts a longer
    earlier model left cleared (the part count of the last publication is kept in
    `record_dir`), then the manifest on `onnx` (docs/protocol.md section 5.1). The transport
    is connected and may write the onnx topics (broker/acl: the aggregator account)."""
    from ..export import model_payload

    data, metadata = model_payload(path)
    pub = encode_publication(data, metadata, round=round, sender=sender, run=run,
                             max_payload=max_payload, signer=signer)
    with _PUBLISHING:
        before = published_parts(record_dir)
        for i, payload in enumerate(pub.parts):
            transport.publish(part_topic(topics, i), payload, qos=1, retain=True)
        for i in range(len(pub.parts), before):
            transport.clear_retained(part_topic(topics, i))
        transport.publish(topics.onnx(), pub.manifest, qos=1, retain=True)
        record_publication(record_dir, pub, run)
    return pub


class OnnxReceiver:
    """A client's side: feed it every payload of the `onnx` topic and its part topics; it
    installs each new complete model as `state_dir/name` (atomic replace) and returns its
    path. Bad payloads raise wire.FrameError or ModelFileError naming the cause; the
    installed model is never touched by one."""

    def __init__(self, state_dir: str, name: str = MODEL_FILE, *,
                 timeout_s: float = 120.0, max_bytes: int = 512 << 20, verifier=None):
        self.state_dir = state_dir
        self.name = name
        self.path = os.path.join(state_dir, name)
        self.reassembler = wire.Reassembler(timeout_s, max_bytes=max_bytes)
        self.expect = wire.Expectation(None, kinds="onnx")
        self.installed_sha = _file_sha256(self.path)
        self.installed_round: int | None = None     # unknown for a file installed earlier
        self.manifest: dict | None = None
        self.installs = 0
        # signatures: with a verifier (the aggregator's keys) the manifest and the model must
        # be signed by it, and signed no earlier than the newest one accepted (an older one
        # replayed would be a downgrade); that signing time is kept beside the model
        self.verifier = verifier
        self.signed_path = self.path + SIGNED_SUFFIX
        self.installed_at = _signed_at(self.signed_path)

    def _check_signature(self, frame, kind: str, where: str) -> float | None:
        if self.verifier is None:
            return None
        env = self.verifier.verify_frame(frame, kind=kind, where=where, by=frame.sender)
        if env["at"] < self.installed_at:
            from ..transport.signing import SignatureError

            raise SignatureError(f"{where}: signed at {env['at']:.3f}, before the newest "
                                 f"model this board accepted ({self.installed_at:.3f}): an "
                                 "older model replayed; not installed")
        return env["at"]

    def on_manifest(self, payload: bytes) -> dict | None:
        """Record the announced model (None for a cleared manifest)."""
        if not payload:
            return None
        frame = wire.decode(payload, self.expect)
        self._check_signature(frame, "onnx_manifest",
                              f"onnx manifest of round {frame.round} from {frame.sender!r}")
        scalars = dict(frame.scalars)
        if frame.buffers or not isinstance(scalars.get("sha256"), str) \
                or not isinstance(scalars.get("parts"), int):
            raise wire.FrameError("metadata", f"onnx manifest of round {frame.round} from "
                                              f"{frame.sender!r}: needs no buffers and scalars "
                                              f"sha256 and parts, got {sorted(scalars)}")
        self.manifest = {"round": frame.round, "sender": frame.sender, **scalars}
        if self.installed_round is None and scalars["sha256"] == self.installed_sha:
            # the model installed before a restart, announced again (the retained manifest,
            # checked as above): its round is known again, for the board's status
            self.installed_round = frame.round
        return self.manifest

    def on_part(self, payload: bytes) -> str | None:
        """Add one part; the installed path when it completed a new model, else None."""
        if not payload:
            return None                       # a cleared part topic
        frame = self.reassembler.add(payload, self.expect)
        if frame is None:
            return None
        where = f"onnx model of round {frame.round} from {frame.sender!r}"
        signed_at = self._check_signature(frame, "onnx", where)
        blob = frame.buffers.get(BUFFER_NAME)
        sha = frame.scalars.get("sha256")
        if blob is None or not isinstance(sha, str):
            raise wire.FrameError("metadata", f"{where}: needs buffer {BUFFER_NAME!r} and "
                                              f"scalar sha256, has {sorted(frame.buffers)} and "
                                              f"{sorted(frame.scalars)}")
        data = blob.tobytes()
        got = hashlib.sha256(data).hexdigest()
        if got != sha:
            raise ModelFileError(f"{where}: {len(data)} bytes with sha256 {got[:12]}, the "
                                 f"sender announced {sha[:12]}; not installed")
        if sha == self.installed_sha:
            log.debug("%s: sha256 %s is installed already", where, sha[:12])
            return None
        if signed_at is not None and signed_at > self.installed_at:
            # The floor first, then the model: with the model first, a record that could not
            # be written (a full disk, a power cut between the two) left the floor of an
            # older model, -inf after a restart, and a replayed older model was installed.
            try:
                atomic_write(self.signed_path,
                             json.dumps({"sha256": sha, "at": signed_at}).encode())
            except OSError as exc:
                raise ModelFileError(f"{where}: {self.signed_path}: cannot record its signing "
                                     f"time ({exc}); not installed, the model there before "
                                     "is kept") from None
            self.installed_at = signed_at
        try:
            path = install_model(data, self.state_dir, self.name, sha256=sha)
        except ModelFileError as exc:
            raise ModelFileError(f"{where}: {exc}") from None
        self.installed_sha = sha
        self.installed_round = frame.round
        self.installs += 1
        log.info("installed %s: %s (%d bytes, sha256 %s)", where, path, len(data), sha[:12])
        return path


def _file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _signed_at(path: str) -> float:
    """The signing time of the newest signed model this board accepted (-inf: none). It is
    recorded before that model is written, so it holds whatever model.onnx is: the
    installed one, or the one before when the write failed or the power went."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        at = doc.get("at")
        if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at):
            return float(at)
    except (OSError, ValueError, AttributeError):
        pass
    return float("-inf")
