"""Operator commands on the control topic: their schema, their checks, and the replies
(docs/protocol.md "Control", docs/orchestration.md).

An operator (`edgefl ctl`, `mosquitto_pub`, Node-RED) publishes one JSON object on
`<prefix>/<fed>/ctl`; only the operator account may (broker/acl). The aggregator daemon
(roles/daemon.py) answers on the reply address the command carries:

    {"cmd": "pause", "request_id": "7", "reply_to": "edgefl/lab/reply/alice"}
    -> on edgefl/lab/reply/alice: {"v": 1, "ok": true, "cmd": "pause", "request_id": "7",
                                   "result": {"run": "...", "state": "paused"}}

MQTT 5 requesters set the PUBLISH properties Response Topic and Correlation Data instead of
`reply_to` / `request_id`; the reply then goes to the response topic and carries the same
correlation data (as a property) -- the MQTT 5 request/response pattern. MQTT 3.1.1 has no
properties, so there the payload carries both (the documented fallback). A command with
neither gets no reply (its outcome is still on the events topic).

Every reply topic must be one of this federation's `reply/<name>` topics: the broker's ACL
lets the aggregator publish there and nowhere else an operator could read, so a command
cannot make the aggregator write to the round or model topics. A command that is not JSON,
names an unknown command or field, or has a bad value is answered with `ok: false` and an
`error` naming the problem, and changes nothing.

`RunControl` is the hand-over between the daemon's control thread and the Aggregator of the
active run: the pause gate the aggregator's collect loop honours, the stop request, and
whether the run's exports are published on the onnx topics.

An aggregator with a signing key (keys.signing_key) signs every reply (kind "reply",
transport/signing.py), valid for REPLY_VALID_S; the signed document names the command
(`cmd`) and the request (`request_id`, and `correlation`: the MQTT 5 correlation data in
hex, which as a property no signature covers), and the envelope the federation. A requester
holding the aggregator's public key (keys.aggregator, `edgefl ctl --aggregator-key`) takes
only a reply that verifies and answers its own request and command: a forged one, or a
genuine one replayed to another request or federation, is refused with ReplyRefused.

`ControlClient` is the requester's side. A command the broker refuses (the ACL: only the
operator account may publish on the ctl topic) never reaches the aggregator, so no reply
comes. Over MQTT 5 the broker says so in its PUBACK (reason code 135, Not authorized):
with a `RequesterTransport` (edgefl.transport.requester) the request fails at once with
`CommandRefused`, naming the code and the account. MQTT 3.1.1 has no way to say it; there
the timeout is the only signal, and its message names the ACL as a likely cause.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from .. import __version__
from ..config import check_number
from ..errors import ConfigError
from ..io import jsonable
from ..service.layered import check_setting
from ..transport.base import Message
from ..transport.topics import TopicError, Topics, validate_id
from ..transport.signing import SignatureError
from .messages import MessageError, json_object

__all__ = ["COMMANDS", "CommandError", "Command", "CommandRefused", "ControlClient",
           "ReplyAddress", "ReplyRefused", "RunControl", "parse_command", "reply_address",
           "reply_payload", "sign_reply", "REPLY_VALID_S", "VERSION"]

VERSION = 1
MAX_REQUEST_ID = 128          # characters of a payload request id
# seconds a signed reply is valid: it is read at once, so this only needs to cover the
# clocks' difference (as a command's 60 s does), and a reply kept by the broker or an
# attacker is dead after it
REPLY_VALID_S = 60.0

# command -> its own fields (besides cmd, request_id, reply_to), and what it does
COMMANDS: dict[str, tuple[tuple[str, ...], str]] = {
    "start": (("config", "run", "clients", "round"),
              "queue a run: config (a run config as JSON), optional run id, client ids, "
              "round settings"),
    "pause": (("run",), "pause the active run: no round closes or opens until resume"),
    "resume": (("run",), "resume the paused run; the open round's deadline is extended"),
    "stop": (("run",), "stop the active run (checkpoint + model.onnx kept) or cancel a "
                       "queued one"),
    "export": (("run",), "write model.npz and model.onnx of a run's latest checkpoint now"),
    "status": ((), "the daemon's state: active run, round, clients online, queue"),
    "runs": ((), "every run the daemon knows, with its state"),
    "prune": (("keep", "dry_run"),
              "remove the files of the ended runs beyond the `keep` most recently ended "
              "(default: the site file's retention.keep_runs); dry_run: only say which"),
}
COMMON_FIELDS = ("cmd", "request_id", "reply_to")
SIGNATURE_FIELD = "sig"       # the operator's signature (transport/signing.py), when signed
ROUND_FIELDS = ("deadline", "quorum", "min_updates")


class CommandError(ValueError):
    """A command that cannot be carried out; the message names the field or the state that
    forbids it. The reply is `ok: false` with this message."""


@dataclass(frozen=True)
class ReplyAddress:
    """Where the answer to a command goes: `topic` (None: nowhere), and the requester's token
    to echo: MQTT 5 correlation data (bytes) or the payload's request id."""
    topic: str | None
    correlation_data: bytes | None = None
    request_id: Any = None
    mqtt5: bool = False            # the address came from MQTT 5 properties


@dataclass(frozen=True)
class Command:
    name: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    reply: ReplyAddress = ReplyAddress(None)
    doc: Mapping[str, Any] = field(default_factory=dict)   # as received: its "sig" is checked

    @property
    def run(self) -> str | None:
        return self.fields.get("run")


def reply_address(message: Message, doc: Mapping | None, topics: Topics) -> ReplyAddress:
    """The reply address of a command: MQTT 5 properties first, else the payload's
    `reply_to` / `request_id`. CommandError when the topic is not one of this federation's
    reply topics (the caller can only report that on the events topic)."""
    doc = doc if isinstance(doc, Mapping) else {}
    request_id = doc.get("request_id")
    if request_id is not None:
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
            request_id = None           # reported by parse_command; not echoed
        elif isinstance(request_id, str) and len(request_id) > MAX_REQUEST_ID:
            request_id = request_id[:MAX_REQUEST_ID]
    if message.response_topic is not None:
        topic, mqtt5 = message.response_topic, True
    else:
        topic, mqtt5 = doc.get("reply_to"), False
        if topic is not None and not isinstance(topic, str):
            raise CommandError(f"reply_to must be a topic string, got "
                               f"{type(topic).__name__} {str(topic)[:40]!r}")
    address = ReplyAddress(topic, message.correlation_data, request_id, mqtt5)
    if topic is None:
        return address
    try:
        kind, _ = topics.parse(topic)
    except TopicError as exc:
        kind, why = None, str(exc)
    else:
        why = f"it is a {kind!r} topic"
    if kind != "reply":
        where = "response topic" if mqtt5 else "reply_to"
        raise CommandError(f"{where} {topic!r}: replies go only to this federation's reply "
                           f"topics, {topics.reply('<name>')} ({why})")
    return address


def parse_command(message: Message, topics: Topics) -> Command:
    """The checked command in `message` (a publication on the ctl topic). CommandError naming
    the problem otherwise; its `reply` attribute holds the reply address when one was
    readable, so the error can still be answered."""
    doc = None
    try:
        doc = json_object(message.payload, "command")
    except MessageError as exc:
        error = CommandError(str(exc))
        error.reply = _address_or_none(message, None, topics)
        error.cmd = None
        raise error from None
    try:
        reply = reply_address(message, doc, topics)
    except CommandError as exc:
        exc.reply = ReplyAddress(None)
        exc.cmd = None
        raise
    try:
        return Command(*_check(doc), reply=reply, doc=doc)
    except CommandError as exc:
        exc.reply = reply
        # the refusal names the command it refuses when there is one: a requester checking
        # signed replies takes only the reply to its own command
        name = doc.get("cmd")
        exc.cmd = name if isinstance(name, str) and name in COMMANDS else None
        raise


def _address_or_none(message: Message, doc, topics: Topics) -> ReplyAddress:
    try:
        return reply_address(message, doc, topics)
    except CommandError:
        return ReplyAddress(None)


def _check(doc: Mapping) -> tuple[str, dict]:
    name = doc.get("cmd")
    if name is None:
        raise CommandError(f"command: missing field 'cmd' (one of {', '.join(COMMANDS)})")
    if not isinstance(name, str) or name not in COMMANDS:
        raise CommandError(f"command: unknown cmd {name!r}; valid: {', '.join(COMMANDS)}")
    own, _ = COMMANDS[name]
    for key in doc:
        if key not in own and key not in COMMON_FIELDS and key != SIGNATURE_FIELD:
            valid = ", ".join(COMMON_FIELDS + own)
            raise CommandError(f"{name}: unknown field {key!r}; valid: {valid}")
    request_id = doc.get("request_id")
    if request_id is not None and (isinstance(request_id, bool)
                                   or not isinstance(request_id, (str, int))):
        raise CommandError(f"{name}: request_id must be a string or an integer, got "
                           f"{type(request_id).__name__}")
    if isinstance(request_id, str) and len(request_id) > MAX_REQUEST_ID:
        raise CommandError(f"{name}: request_id is {len(request_id)} characters, the limit is "
                           f"{MAX_REQUEST_ID}")
    fields = {k: doc[k] for k in own if k in doc}
    if "run" in fields and fields["run"] is not None:
        try:
            validate_id(fields["run"], f"{name}: run")
        except TopicError as exc:
            raise CommandError(str(exc)) from None
    if name == "start":
        config = fields.get("config")
        if not isinstance(config, Mapping):
            raise CommandError("start: field 'config' must be a run config object (the YAML "
                               f"of `edgefl simulate` as JSON), got "
                               f"{type(config).__name__ if config is not None else 'nothing'}")
        clients = fields.get("clients")
        if clients is not None:
            if not isinstance(clients, list) or not clients:
                raise CommandError("start: clients must be a non-empty list of client ids")
            for i, node in enumerate(clients):
                try:
                    validate_id(node, f"start: clients[{i}]")
                except TopicError as exc:
                    raise CommandError(str(exc)) from None
            if len(set(clients)) != len(clients):
                raise CommandError("start: clients lists an id twice")
        fields["round"] = _round_settings(fields.get("round"))
    if name == "prune":
        if fields.get("keep") is not None:
            # a whole number >= 0, as `edgefl prune --keep` (0 keeps none); true is no number
            fields["keep"] = check_number(fields["keep"], _refuse("prune: keep"), integer=True,
                                          minimum=0)
        if "dry_run" in fields and not isinstance(fields["dry_run"], bool):
            raise CommandError(f"prune: dry_run: must be true or false, got "
                               f"{fields['dry_run']!r}")
    return name, fields


def _refuse(where: str):
    """check_number's `where` for a command's field: its problem as a CommandError."""
    def fail(problem):
        raise CommandError(f"{where}: {problem}")
    return fail


def _round_settings(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise CommandError(f"start: round must be an object with {', '.join(ROUND_FIELDS)}")
    out = {}
    for key, v in value.items():
        if key not in ROUND_FIELDS:
            raise CommandError(f"start: round.{key}: unknown; valid: {', '.join(ROUND_FIELDS)}")
        # the same rule as the aggregator's site file and --deadline/--quorum/--min-updates
        try:
            out[key] = check_setting(f"round.{key}", v, "start")
        except ConfigError as exc:
            raise CommandError(str(exc)) from None
    return out


def reply_payload(name: str | None, reply: ReplyAddress, *, result=None,
                  error: str | None = None, signer=None) -> bytes:
    """The reply document. The payload echoes `request_id` (the 3.1.1 fallback; harmless
    over MQTT 5, whose correlation data travels as a property). `signer`: signed
    (sign_reply)."""
    doc = {"v": VERSION, "ok": error is None, "cmd": name, "request_id": reply.request_id,
           "version": __version__, "at": time.time()}
    if error is None:
        doc["result"] = result
    else:
        doc["error"] = error
    # jsonable: a NumPy value in a result goes out as a number, a NaN as null (valid JSON)
    payload = json.dumps(jsonable(doc), separators=(",", ":"), default=str).encode("utf-8")
    return payload if signer is None else sign_reply(payload, reply, signer)


def sign_reply(payload: bytes, reply: ReplyAddress, signer) -> bytes:
    """The reply `payload` (reply_payload's, unsigned) signed by `signer` (the aggregator's
    transport.signing.Signer): kind "reply", valid REPLY_VALID_S from now, with the
    correlation data as `correlation` (hex) so that the signature binds it."""
    doc = json.loads(payload)      # signed as the requester will parse it
    if reply.correlation_data is not None:
        doc["correlation"] = reply.correlation_data.hex()
    doc = signer.sign_doc(doc, "reply", "", 0, expires_in=REPLY_VALID_S)
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


class RunControl:
    """The operator's hold on the active run, shared by the daemon's control thread and the
    Aggregator running it: `paused` (set while paused: the aggregator closes and opens no
    round), `stop_requested` (the operator's stop, as opposed to a service shutdown, which
    leaves the run to resume after a restart), and `run_id` (the id a new checkpoint takes,
    so the announcement names the run the operator started). `publish_onnx`: whether each
    export of the run's model is also published on the onnx topics (the service's
    `export.publish`); the Aggregator reads it in publish_onnx. `rounds_over`: set by the
    Aggregator as it announces the run's end, before its run_finished event; the run then
    only writes its outputs, and a run started from then on has it in no count of runs
    `ahead` (a script that starts the next run on that event is told 0)."""

    def __init__(self, run_id: str, paused: bool = False, publish_onnx: bool = True):
        self.run_id = run_id
        self.publish_onnx = publish_onnx
        self.paused = threading.Event()
        if paused:
            self.paused.set()
        self.stop_requested = threading.Event()
        self.rounds_over = threading.Event()
        self.aggregator = None
        self.attached = threading.Event()
        # called by the Aggregator, in its thread, once a pause holds it (between rounds or
        # in the open round): a round that was already closing when the pause came has been
        # committed by then, so the service records the rounds done as they stand
        self.on_hold = None

    def attach(self, aggregator) -> None:
        """Called by the Aggregator when its run starts: status answers read from it."""
        self.aggregator = aggregator
        self.attached.set()


class EitherStop:
    """is_set() of any of several Event-like objects: an aggregator stops for the service's
    SIGTERM and for the operator's stop alike."""

    def __init__(self, *events):
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)

    def set(self) -> None:
        self.events[-1].set()

    @property
    def name(self):
        return next((getattr(e, "name", None) for e in self.events
                     if e.is_set() and getattr(e, "name", None)), None)


class CommandRefused(RuntimeError):
    """The broker refused to take a command (MQTT 5 PUBACK with a failure reason code,
    e.g. 135 Not authorized: the account may not publish on the ctl topic)."""

    def __init__(self, message: str, reason_code: int, account: str | None):
        super().__init__(message)
        self.reason_code = reason_code
        self.account = account


class ReplyRefused(RuntimeError):
    """A reply that did not verify with the aggregator's key (unsigned, signed by another
    key, altered, expired, or signed for another federation, request or command); the
    message says which. Nothing of it is acted on."""


class ControlClient:
    """The requester's side (`edgefl ctl`, tests): publish a command on the ctl topic and wait
    for its reply on our own reply topic, `<prefix>/<fed>/reply/<name>`. mqtt5: the reply
    address travels as MQTT 5 properties (response topic, correlation data), else in the
    payload (`reply_to`, `request_id`: the 3.1.1 fallback). The transport must be connected
    with the matching protocol. `account`: the MQTT username the transport logged in with,
    for the messages (default: read from an MqttTransport's settings). `verifier`: a
    transport.signing.Verifier of the aggregator's keys (roles.trust.aggregator_verifier):
    a reply must then be signed by one of them for this request (ReplyRefused otherwise);
    None takes replies unchecked."""

    def __init__(self, transport, topics: Topics, name: str, mqtt5: bool = False,
                 account: str | None = None, signer=None, expires_in: float = 60.0,
                 verifier=None):
        self.transport = transport
        self.topics = topics
        self.reply_topic = topics.reply(validate_id(name, "reply name"))
        self.mqtt5 = mqtt5
        self.account = account if account is not None else _account_of(transport)
        self._subscribed = False
        # an operator key (edgefl.transport.signing.Signer): every command is signed, with
        # a fresh nonce and an expiry `expires_in` seconds on (the aggregator refuses a
        # command whose nonce it has seen, or whose expiry has passed)
        self.signer = signer
        self.expires_in = expires_in
        self.verifier = verifier

    resend_s = 3.0

    def _send(self, payload: bytes, request_id: str):
        if self.mqtt5:
            return self.transport.publish(self.topics.ctl(), payload, qos=1,
                                          response_topic=self.reply_topic,
                                          correlation_data=request_id.encode())
        return self.transport.publish(self.topics.ctl(), payload, qos=1)

    def _check_refused(self, cmd, seen: int) -> None:
        refused = getattr(self.transport, "refused", None)
        if refused is None or len(refused) <= seen:
            return
        code, name = refused[-1]
        raise CommandRefused(
            f"{cmd}: the broker refused the command on {self.topics.ctl()} (MQTT 5 reason "
            f"code {code}, {name}) from account {self._account_text()}: the broker's ACL "
            f"lets only the operator account publish commands (broker/acl)", code,
            self.account)

    def _account_text(self) -> str:
        return repr(self.account) if self.account else "(anonymous)"

    def request(self, doc: Mapping, timeout: float = 10.0) -> dict:
        """The reply document to command `doc`. CommandRefused as soon as the broker says it
        refused the command (MQTT 5 with a RequesterTransport); with a verifier,
        ReplyRefused as soon as a reply to this request does not verify; TimeoutError
        naming the likely causes when no reply comes within `timeout` seconds."""
        import os

        if not self._subscribed:
            self.transport.subscribe(self.reply_topic, qos=1)
            self._subscribed = True
        request_id = os.urandom(6).hex()
        doc = dict(doc)
        if not self.mqtt5:
            doc.update(reply_to=self.reply_topic, request_id=request_id)
        if self.signer is not None:
            doc = self.signer.sign_doc(doc, "command", doc.get("run") or "", 0,
                                       expires_in=self.expires_in)
        payload = json.dumps(doc).encode()
        seen = len(getattr(self.transport, "refused", ()))
        deadline = time.monotonic() + timeout
        acknowledged = False
        while True:
            # (re)send, then wait for the broker's acknowledgement: over MQTT 5 it says at
            # once whether the command was refused. Re-sent every resend_s while no reply
            # comes: the service may have been starting (its control connection keeps no
            # session, so a command sent before it subscribed is gone); the same request
            # id again is answered once (the daemon remembers it).
            delivery = self._send(payload, request_id)
            resend_at = time.monotonic() + self.resend_s
            if delivery is not None and delivery.wait(max(0.0, min(deadline, resend_at)
                                                          - time.monotonic())):
                acknowledged = True
            self._check_refused(doc.get("cmd"), seen)
            while (remaining := min(deadline, resend_at) - time.monotonic()) > 0:
                item = self.transport.receive(timeout=remaining)
                if not isinstance(item, Message) or item.topic != self.reply_topic:
                    continue
                try:
                    reply = json_object(item.payload, "reply")
                except MessageError:
                    continue
                token = item.correlation_data.decode("utf-8", "replace") \
                    if self.mqtt5 and item.correlation_data is not None \
                    else reply.get("request_id")
                if token == request_id:
                    return self._checked(reply, doc.get("cmd"), request_id)
            if time.monotonic() >= deadline:
                break
        raise TimeoutError(self._timeout_text(doc.get("cmd"), timeout, acknowledged))

    def _checked(self, reply: dict, cmd, request_id: str) -> dict:
        """`reply` when there is no verifier, or when it is signed by the aggregator's key
        for this federation, unexpired, and for this request and command; else
        ReplyRefused. The token that picked it (a property over MQTT 5) is anyone's to
        set: only the signed copy in the payload counts."""
        if self.verifier is None:
            return reply
        where = f"{cmd}: reply on {self.reply_topic}"
        try:
            env = self.verifier.verify_doc(reply, kind="reply", where=where)
            if env["exp"] is None:
                raise SignatureError(f"{where}: signed without an expiry")
            signed, token = (reply.get("correlation"), request_id.encode().hex()) \
                if self.mqtt5 else (reply.get("request_id"), request_id)
            if signed != token:
                raise SignatureError(f"{where}: signed for request {str(signed)[:40]!r}, this "
                                     f"is request {token!r} (a reply replayed from another "
                                     "request?)")
            if reply.get("cmd") != cmd:
                raise SignatureError(f"{where}: signed as the reply to "
                                     f"{str(reply.get('cmd'))[:40]!r}, this command is "
                                     f"{cmd!r}")
        except SignatureError as exc:
            unsigned = reply.get("sig") is None
            raise ReplyRefused(
                f"{exc}; refused: it is not the aggregator's answer"
                + (" (an aggregator without keys.signing_key, or one older than signed "
                   "replies, does not sign them)" if unsigned else "")) from None
        return reply

    def _timeout_text(self, cmd, timeout: float, acknowledged: bool) -> str:
        head = f"{cmd}: no reply on {self.reply_topic} within {timeout:g} s"
        service = (f"is the aggregator service running for federation "
                   f"{self.topics.federation!r}?")
        if not acknowledged:
            return (f"{head}: the broker did not even acknowledge the command (connection "
                    f"lost?); {service}")
        if self.mqtt5 and hasattr(self.transport, "refused"):
            # MQTT 5 reports a refused publish: this one was accepted
            return (f"{head}: the broker accepted the command from account "
                    f"{self._account_text()}; {service}")
        acl = (f"the broker's ACL refusing account {self._account_text()} the command topic "
               f"{self.topics.ctl()} (only the operator may publish there: broker/acl)")
        if not self.mqtt5:
            return (f"{head}: a likely cause is {acl}: under MQTT 3.1.1 a broker drops a "
                    f"refused command silently and cannot say so (MQTT 5 can); else, "
                    f"{service}")
        return f"{head}: {service} Or is it {acl}?"


def _account_of(transport) -> str | None:
    settings = getattr(transport, "settings", None)
    user = getattr(settings, "username", None)
    if user is None:
        user = getattr(getattr(transport, "address", None), "username", None)
    return user
