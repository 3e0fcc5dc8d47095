"""The transport interface the roles use: opaque bytes on MQTT topic strings, with MQTT's
semantics (QoS 0/1, retained messages, wildcards, Last Will), and nothing about frames or
topic layout (wire/ and topics.py own those).

A transport is used from ordinary threads; everything it receives arrives on one thread-safe
queue, `transport.messages`, as `Message` (a publication) or `ConnectionEvent` (connected /
disconnected). Network callbacks only enqueue; the role's own loop does the work:

    transport.set_will(status_topic, b'{"online": false}')      # before connect
    transport.connect()                                           # raises TransportError
    transport.subscribe(round_topic)
    while running:
        item = transport.receive(timeout=1.0)                     # None on timeout
        if isinstance(item, ConnectionEvent):
            ...   # re-publish retained state after `connected` with session_present False
        elif item is not None:
            handle(item.topic, item.payload)                      # idempotent: QoS 1 repeats
    transport.close()

Implementations: `mqtt.MqttTransport` (paho-mqtt 2, any MQTT 3.1.1/5 broker) and
`loopback.LoopbackTransport` (in-process, for simulations and tests).
"""
from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Union

__all__ = ["Message", "ConnectionEvent", "Delivery", "Transport", "TransportError",
           "ReceiveQueue",
           "PayloadTooLarge", "topic_matches", "check_topic", "check_filter",
           "MQTT_MAX_PAYLOAD", "CONNECTED", "DISCONNECTED"]

# The MQTT remaining-length field tops out at 268,435,455 bytes; topic and headers share it.
MQTT_MAX_PAYLOAD = 268_435_455 - 65_536

CONNECTED = "connected"
DISCONNECTED = "disconnected"


class TransportError(ConnectionError):
    """The broker cannot be reached, refused us, or an operation needs a connection we do not
    have. The message names the broker (host:port) and the underlying cause. A subclass of
    OSError, so the CLI reports it in one line."""


class PayloadTooLarge(ValueError):
    """A payload larger than the transport's `max_payload` (the broker's packet limit)."""


@dataclass(frozen=True)
class Message:
    """One received publication. `retain` is true for a retained message delivered because we
    subscribed (MQTT clears the flag on live forwarding). `duplicate` is the MQTT DUP flag: a
    redelivery; QoS 1 may repeat a message with or without it, so handlers are idempotent.
    `received_at` is wall-clock time (time.time()) when the network thread got it.

    `response_topic` and `correlation_data` are MQTT 5's request/response properties (the
    requester names where the answer goes and a token to echo back; docs/protocol.md
    "Control"); None over MQTT 3.1.1, which has no properties."""

    topic: str
    payload: bytes
    retain: bool = False
    qos: int = 0
    received_at: float = 0.0
    duplicate: bool = False
    response_topic: str | None = None
    correlation_data: bytes | None = None


@dataclass(frozen=True)
class ConnectionEvent:
    """A change of connection state, queued in order with the messages. After `connected`
    the transport has already re-subscribed every filter; `session_present` False means the
    broker kept nothing for us (first connect, clean session, or a broker restarted without
    persistence), so retained state we own (status, round, model) may need re-publishing."""

    state: str                    # CONNECTED or DISCONNECTED
    reason: str = ""
    session_present: bool = False
    at: float = 0.0

    @property
    def connected(self) -> bool:
        return self.state == CONNECTED


Received = Union[Message, ConnectionEvent]


class Delivery:
    """Handle for one publish. `wait(timeout)` returns True once the broker acknowledged it
    (QoS 1: PUBACK; QoS 0: written to the socket). A done delivery is returned by transports
    that deliver synchronously."""

    def wait(self, timeout: float | None = None) -> bool:
        return True

    @property
    def done(self) -> bool:
        return True


DONE = Delivery()


def check_topic(topic: str) -> bytes:
    """A topic name one may publish to: non-empty UTF-8, no wildcards, no NUL, < 64 KiB."""
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"MQTT topic must be a non-empty string, got {topic!r}")
    if "+" in topic or "#" in topic or "\0" in topic:
        raise ValueError(f"MQTT topic {topic!r}: '+', '#' and NUL are not allowed in a "
                         "topic name (only in subscription filters)")
    encoded = topic.encode("utf-8")
    if len(encoded) > 65535:
        raise ValueError(f"MQTT topic of {len(encoded)} bytes: the limit is 65535")
    return encoded


def check_filter(topic_filter: str) -> None:
    """A subscription filter: '+' only as a whole level, '#' only as the whole last level."""
    if not isinstance(topic_filter, str) or not topic_filter or "\0" in topic_filter:
        raise ValueError(f"MQTT topic filter must be a non-empty string, got {topic_filter!r}")
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ValueError(f"MQTT topic filter {topic_filter!r}: '#' must be the whole "
                             "last level")
        if "+" in level and level != "+":
            raise ValueError(f"MQTT topic filter {topic_filter!r}: '+' must be a whole level")
    if len(topic_filter.encode("utf-8")) > 65535:
        raise ValueError("MQTT topic filter longer than 65535 bytes")


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT matching: '+' is one level, '#' this level and all below (so 'a/#' matches 'a');
    topics starting with '$' are not matched by a leading wildcard (MQTT 4.7.2)."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    filter_levels = topic_filter.split("/")
    topic_levels = topic.split("/")
    for i, level in enumerate(filter_levels):
        if level == "#":
            return True
        if i >= len(topic_levels):
            return False
        if level != "+" and level != topic_levels[i]:
            return False
    return len(filter_levels) == len(topic_levels)


def as_bytes(payload) -> bytes:
    """bytes as-is; bytearray / memoryview / NumPy buffers copied once into immutable bytes,
    so a caller reusing its buffer cannot change a message still waiting to be sent."""
    if isinstance(payload, bytes):
        return payload
    if payload is None:
        return b""
    if isinstance(payload, str):
        raise TypeError("payload must be bytes (encode text yourself, e.g. json.dumps(...)"
                        ".encode())")
    return bytes(memoryview(payload).cast("B"))


log = logging.getLogger("edgefl.transport")

# Receive queue bounds (service config: limits.queue_messages, limits.queue_mb). A message is
# at most one chunk (transport.chunk_size, 128 KiB by default), so 256 MiB holds 2,048 full
# chunks: every update of a 250-client round of a 1 MB model waiting at once.
DEFAULT_QUEUE_MESSAGES = 10_000
DEFAULT_QUEUE_BYTES = 256 << 20
# How long the network thread may wait for room when the queue first fills (see ReceiveQueue)
QUEUE_FULL_WAIT_S = 0.5


class ReceiveQueue(queue.Queue):
    """The bounded queue between the network thread and the role: at most `max_messages`
    Messages holding at most `max_bytes` of payload. Anything that is not a Message
    (ConnectionEvent, a role's own wake-up marker) is always taken: it is state, not load.

    What a full queue does on paho's network thread is a choice between two losses:
    - blocking until the role makes room stops that thread from reading and writing the
      socket: no PINGREQ goes out, so after 1.5 x keepalive the broker drops us (and fires
      our will), and every QoS 1 publish of ours waits for its PUBACK meanwhile;
    - dropping the message loses it for good, QoS 1 or not: paho acknowledges a QoS 1
      message as soon as on_message returns, so the broker will not redeliver it.
    edgefl drops, because its protocol already recovers lost messages: round, model and
    status topics are retained and re-sent on request (need_model), a client re-sends its
    stored update when a round is announced again, and a round closes at its deadline with
    what it has. A stalled connection, instead, loses everything in flight at once.
    To ride out a short burst the first message that meets a full queue waits up to
    `full_wait_s` for room (TCP then slows the broker down); while the queue stays full the
    next ones are dropped at once, so the thread never stalls for long. Drops are counted
    (`dropped`, `dropped_bytes`) and logged: a warning when the queue fills, one line with
    the count when it has room again."""

    def __init__(self, max_messages: int = DEFAULT_QUEUE_MESSAGES,
                 max_bytes: int = DEFAULT_QUEUE_BYTES, full_wait_s: float = QUEUE_FULL_WAIT_S,
                 name: str = ""):
        super().__init__()                       # unbounded underneath; put() applies limits
        self.name = name
        self.full_wait_s = float(full_wait_s)
        self.set_limits(max_messages, max_bytes)
        self.dropped = 0
        self.dropped_bytes = 0
        self.peak_messages = 0
        self.peak_bytes = 0
        self._messages = 0                       # Messages waiting (other items not counted)
        self._bytes = 0
        self._overflow = 0                       # drops since the queue last had room
        # called (no arguments, outside the lock) after an item is queued: how a host that
        # drives many roles from one thread learns which of them has work (edgefl.sim.hosting)
        self.on_item = None

    def set_limits(self, max_messages: int, max_bytes: int) -> None:
        for what, value in (("max_messages", max_messages), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"receive queue {what} = {value!r}: need an integer >= 1")
        with self.mutex:
            self.max_messages = max_messages
            self.max_bytes = max_bytes

    @property
    def nbytes(self) -> int:
        """Payload bytes of the Messages waiting."""
        return self._bytes

    def _room_for(self, size: int) -> bool:
        # an empty queue takes any one message, however large (max_payload bounds it)
        return not self.queue or (self._messages < self.max_messages
                                  and self._bytes + size <= self.max_bytes)

    def _put(self, item) -> None:
        self.queue.append(item)
        if isinstance(item, Message):
            self._messages += 1
            self._bytes += len(item.payload)
            self.peak_messages = max(self.peak_messages, self._messages)
            self.peak_bytes = max(self.peak_bytes, self._bytes)

    def _get(self):
        item = self.queue.popleft()
        if isinstance(item, Message):
            self._messages -= 1
            self._bytes -= len(item.payload)
        return item

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        """Enqueue `item`; a Message that finds the queue full is dropped (class docstring).
        `block` and `timeout` are accepted for queue.Queue compatibility and ignored."""
        if not isinstance(item, Message):
            with self.not_full:
                self._put(item)
                self.unfinished_tasks += 1
                self.not_empty.notify()
            if self.on_item is not None:
                self.on_item()
            return
        size = len(item.payload)
        with self.not_full:
            if not self._room_for(size) and self._overflow == 0:
                deadline = time.monotonic() + self.full_wait_s
                while not self._room_for(size):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self.not_full.wait(remaining)
            if not self._room_for(size):
                self.dropped += 1
                self.dropped_bytes += size
                self._overflow += 1
                if self._overflow == 1:
                    log.warning("receive queue%s full (%d messages, %d bytes; limits %d "
                                "messages, %d bytes): dropping message on %s and the next ones "
                                "until it has room; the consumer is too slow or a sender "
                                "floods", f" of {self.name!r}" if self.name else "",
                                self._messages, self._bytes, self.max_messages,
                                self.max_bytes, item.topic)
                return
            if self._overflow:
                log.warning("receive queue%s has room again: %d message(s) dropped while it "
                            "was full (%d dropped in all)",
                            f" of {self.name!r}" if self.name else "", self._overflow,
                            self.dropped)
                self._overflow = 0
            self._put(item)
            self.unfinished_tasks += 1
            self.not_empty.notify()
        if self.on_item is not None:
            self.on_item()


class Transport(abc.ABC):
    """What a role sees of the network. Subclasses implement the connection; this class keeps
    the parts every transport shares: the receive queue, the subscription list that is
    replayed on every (re)connect, the Last Will, and argument checks."""

    def __init__(self, client_id: str):
        if not client_id or not isinstance(client_id, str):
            raise ValueError("a transport needs a non-empty client id, stable per node (the "
                             "broker keeps its session and QoS 1 messages under it)")
        self.client_id = client_id
        # Bounded (ReceiveQueue explains what a full queue does); set_queue_limits() sizes it.
        self.messages: ReceiveQueue = ReceiveQueue(name=client_id)
        self._subscriptions: dict[str, int] = {}
        self._will: tuple[str, bytes, int, bool] | None = None
        self._state_lock = threading.RLock()

    # -- what subclasses provide -------------------------------------------------------

    @abc.abstractmethod
    def connect(self, timeout: float | None = None) -> None:
        """Connect and wait for the broker's acceptance; raise TransportError naming the
        broker and cause if it cannot be reached or refuses us. Afterwards the transport
        reconnects by itself (with backoff) and re-subscribes."""

    @abc.abstractmethod
    def close(self, timeout: float = 5.0, announce_offline: bool = True) -> None:
        """Disconnect cleanly. With a Last Will set and `announce_offline`, publish the will
        payload first (a clean DISCONNECT makes the broker discard the will, yet the node is
        going offline all the same). Waits up to `timeout` for outstanding QoS 1 publishes."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Drop the connection without DISCONNECT, as a crash or a pulled cable would: the
        broker publishes the Last Will. For tests and fault injection."""

    @property
    @abc.abstractmethod
    def connected(self) -> bool:
        """True while the broker has accepted us (between CONNACK and a disconnect)."""

    @property
    @abc.abstractmethod
    def max_payload(self) -> int:
        """The largest payload publish() accepts: the configured limit, lowered to the
        broker's maximum packet size when the broker announces one (MQTT 5)."""

    @abc.abstractmethod
    def publish(self, topic: str, payload, qos: int = 1, retain: bool = False, *,
                response_topic: str | None = None,
                correlation_data: bytes | None = None) -> Delivery:
        """Send `payload` (bytes-like) on `topic`. QoS 1 is at-least-once: while the
        connection is down, messages wait in a bounded outgoing queue and are sent after
        reconnecting; when that queue is full, publish() blocks (backpressure). Raises
        PayloadTooLarge above `max_payload`. `response_topic` / `correlation_data`: MQTT 5
        request/response properties (ValueError on an MQTT 3.1.1 connection, which cannot
        carry them: put a reply topic and request id in the payload instead)."""

    @abc.abstractmethod
    def _subscribe_now(self, topic_filter: str, qos: int, timeout: float | None) -> None:
        """Subscribe on the live connection (called with the filter already recorded)."""

    @abc.abstractmethod
    def _unsubscribe_now(self, topic_filter: str) -> None:
        """Unsubscribe on the live connection."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every QoS 1 publish so far is acknowledged; False on timeout."""
        return True

    # -- shared behaviour -------------------------------------------------------------

    def set_will(self, topic: str, payload, retain: bool = True, qos: int = 1) -> None:
        """Last Will: published by the broker if we vanish without DISCONNECT. Set before
        connect() (MQTT sends it in CONNECT); edgefl uses the retained status topic."""
        if self.connected:
            raise TransportError("set_will() must be called before connect(): the will is "
                                 "part of the CONNECT packet")
        check_topic(topic)
        _check_qos(qos)
        self._will = (topic, as_bytes(payload), qos, bool(retain))

    def subscribe(self, topic_filter: str, qos: int = 1, timeout: float | None = None) -> None:
        """Subscribe now if connected (waiting for the broker's SUBACK, so a publication made
        after this returns is delivered) and again after every reconnect. Retained messages
        matching the filter arrive with `retain=True`."""
        check_filter(topic_filter)
        _check_qos(qos)
        with self._state_lock:
            self._subscriptions[topic_filter] = qos
            live = self.connected
        if live:
            self._subscribe_now(topic_filter, qos, timeout)

    def unsubscribe(self, topic_filter: str) -> None:
        with self._state_lock:
            known = self._subscriptions.pop(topic_filter, None) is not None
            live = self.connected
        if known and live:
            self._unsubscribe_now(topic_filter)

    @property
    def subscriptions(self) -> dict[str, int]:
        with self._state_lock:
            return dict(self._subscriptions)

    def clear_retained(self, topic: str) -> Delivery:
        """Delete the retained message on `topic` (MQTT: an empty retained publish)."""
        return self.publish(topic, b"", qos=1, retain=True)

    def set_queue_limits(self, max_messages: int = DEFAULT_QUEUE_MESSAGES,
                         max_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        """Bound the receive queue (service config limits.queue_messages, limits.queue_mb);
        a Message arriving while it is full is dropped, counted and logged (ReceiveQueue)."""
        self.messages.set_limits(max_messages, max_bytes)

    @property
    def queue_drops(self) -> int:
        """Messages dropped so far because the receive queue was full."""
        return self.messages.dropped

    def receive(self, timeout: float | None = None) -> Received | None:
        """The next Message or ConnectionEvent, or None after `timeout` seconds."""
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def _emit(self, state: str, reason: str = "", session_present: bool = False) -> None:
        self.messages.put(ConnectionEvent(state, reason, session_present, time.time()))

    def _check_publish(self, topic: str, payload, qos: int) -> bytes:
        encoded = check_topic(topic)
        _check_qos(qos)
        data = as_bytes(payload)
        limit = self._payload_limit(len(encoded))
        if len(data) > limit:
            raise PayloadTooLarge(
                f"payload of {len(data):,} bytes on {topic!r} exceeds the limit of "
                f"{limit:,} bytes (max_payload, or the broker's maximum packet size): send it "
                "in chunks (wire.split) or raise the broker's max_packet_size")
        return data

    def _payload_limit(self, topic_bytes: int) -> int:
        return self.max_payload

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "connected" if self.connected else "not connected"
        return f"<{type(self).__name__} {self.client_id!r} {state}>"


def check_response_properties(response_topic, correlation_data) -> None:
    """The MQTT 5 request/response properties a publish may carry: a topic name (no
    wildcards) and bytes."""
    if response_topic is not None:
        check_topic(response_topic)
    if correlation_data is not None and not isinstance(correlation_data, (bytes, bytearray)):
        raise TypeError(f"correlation_data must be bytes, got "
                        f"{type(correlation_data).__name__}")


def _check_qos(qos: int) -> None:
    if qos not in (0, 1):
        raise ValueError(f"qos={qos!r}: edgefl uses QoS 0 (metrics) and 1 (everything else); "
                         "QoS 2 is not supported by every broker (NATS) and not needed, since "
                         "handlers are idempotent")
