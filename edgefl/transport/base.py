"""The transport interface the roles use: opaque bytes on MQTT topic strings, with MQTT's
semantics (QoS 0/1, retained messages, wildcards, Last Will), and nothing about frames or
topic layout (wire.py and topics.py own those).

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
import queue
import threading
import time
from dataclasses import dataclass
from typing import Union

__all__ = ["Message", "ConnectionEvent", "Delivery", "Transport", "TransportError",
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
    `received_at` is wall-clock time (time.time()) when the network thread got it."""

    topic: str
    payload: bytes
    retain: bool = False
    qos: int = 0
    received_at: float = 0.0
    duplicate: bool = False


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


class Transport(abc.ABC):
    """What a role sees of the network. Subclasses implement the connection; this class keeps
    the parts every transport shares: the receive queue, the subscription list that is
    replayed on every (re)connect, the Last Will, and argument checks."""

    def __init__(self, client_id: str):
        if not client_id or not isinstance(client_id, str):
            raise ValueError("a transport needs a non-empty client id, stable per node (the "
                             "broker keeps its session and QoS 1 messages under it)")
        self.client_id = client_id
        # Unbounded: the network thread must never block on a slow consumer (it would stop
        # acknowledging and the broker would stall every publisher to us).
        self.messages: queue.Queue[Received] = queue.Queue()
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
    def publish(self, topic: str, payload, qos: int = 1, retain: bool = False) -> Delivery:
        """Send `payload` (bytes-like) on `topic`. QoS 1 is at-least-once: while the
        connection is down, messages wait in a bounded outgoing queue and are sent after
        reconnecting; when that queue is full, publish() blocks (backpressure). Raises
        PayloadTooLarge above `max_payload`."""

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
                "in chunks (wire.py) or raise the broker's max_packet_size")
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


def _check_qos(qos: int) -> None:
    if qos not in (0, 1):
        raise ValueError(f"qos={qos!r}: edgefl uses QoS 0 (metrics) and 1 (everything else); "
                         "QoS 2 is not supported by every broker (NATS) and not needed, since "
                         "handlers are idempotent")
