"""An in-process MQTT twin: `LoopbackBroker` routes publications between `LoopbackTransport`s
in one process with the semantics edgefl relies on from a real broker, so simulations and
tests run the roles' real code paths without sockets:

- topic filters with '+' and '#' ('$' topics hidden from leading wildcards);
- retained messages (an empty retained payload deletes), delivered with `retain=True` to
  each new subscription, forwarded live with `retain=False`;
- QoS 1 at-least-once: a publish made while the transport is disconnected (broker stopped)
  waits in the transport and is sent after it reconnects; a persistent session (the
  default, as in MqttTransport) keeps its subscriptions and queues QoS 1 messages while the
  node is away; QoS 0 is dropped when there is nobody to take it;
- Last Will on kill() (and on session take-over), not on close();
- stop() / start() / restart() mimic a broker restart without persistence: every connected
  transport sees `disconnected`, then `connected` with session_present False, and has
  re-subscribed (so its retained messages arrive again).

Fault injection for tests of the reliability rules: `duplicate_rate` re-delivers a live
message a second time (with `duplicate=True`), and `drop_rate` loses a live delivery
outright -- deliberately breaking at-least-once, as a node that misses a message would --
both restricted to topics matching `faults_on` and drawn from a seeded generator.

Delivery is synchronous: when publish() returns, the message is already in every
subscriber's queue, in publish order.
"""
from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .base import (CONNECTED, DISCONNECTED, DONE, MQTT_MAX_PAYLOAD, Delivery, Message,
                   Transport, TransportError, check_filter, check_response_properties,
                   topic_matches)

__all__ = ["LoopbackBroker", "LoopbackTransport"]


@dataclass
class _Session:
    clean: bool
    subscriptions: dict = field(default_factory=dict)     # filter -> granted qos
    pending: deque = field(default_factory=deque)         # QoS 1 messages while offline
    transport: "LoopbackTransport | None" = None

    def granted_qos(self, topic: str) -> int | None:
        best = None
        for topic_filter, qos in self.subscriptions.items():
            if topic_matches(topic_filter, topic) and (best is None or qos > best):
                best = qos
        return best


class LoopbackBroker:
    """The in-process broker. Thread-safe; any number of transports, each by client id."""

    def __init__(self, *, max_payload: int = MQTT_MAX_PAYLOAD, duplicate_rate: float = 0.0,
                 drop_rate: float = 0.0, faults_on: str = "#", seed: int = 0,
                 max_queued: int = 100_000):
        for name, rate in (("duplicate_rate", duplicate_rate), ("drop_rate", drop_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"LoopbackBroker {name}={rate!r}: must be in [0, 1]")
        check_filter(faults_on)
        self.max_payload = max_payload
        self.duplicate_rate = duplicate_rate
        self.drop_rate = drop_rate
        self.faults_on = faults_on
        self.max_queued = max_queued
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._retained: dict[str, Message] = {}
        self._sessions: dict[str, _Session] = {}
        self._wanted: list[LoopbackTransport] = []     # connected before stop(): reconnect
        self._running = True
        self.stats = {"published": 0, "delivered": 0, "duplicated": 0, "dropped": 0,
                      "queued_offline": 0, "discarded_offline": 0}

    def transport(self, client_id: str, clean_session: bool = False,
                  max_payload: int | None = None) -> "LoopbackTransport":
        return LoopbackTransport(self, client_id, clean_session=clean_session,
                                 max_payload=max_payload)

    @property
    def url(self) -> str:
        return "loopback://"

    @property
    def running(self) -> bool:
        return self._running

    def retained(self) -> dict[str, bytes]:
        """A snapshot of the retained store: {topic: payload}."""
        with self._lock:
            return {topic: msg.payload for topic, msg in self._retained.items()}

    def online(self) -> list[str]:
        with self._lock:
            return sorted(cid for cid, s in self._sessions.items() if s.transport is not None)

    def stop(self, keep_state: bool = False) -> None:
        """Go down: connected transports see `disconnected` and queue their QoS 1 publishes.
        Without `keep_state` (like Mosquitto with persistence off) retained messages and
        sessions are gone when the broker comes back."""
        with self._lock:
            if not self._running:
                return
            self._running = False
            self._wanted = []
            for session in self._sessions.values():
                transport = session.transport
                if transport is not None:
                    session.transport = None
                    transport._connected = False
                    self._wanted.append(transport)
                    transport._emit(DISCONNECTED, "broker stopped")
            if not keep_state:
                self._sessions.clear()
                self._retained.clear()

    def start(self) -> None:
        """Come back: the transports that were connected reconnect and re-subscribe."""
        with self._lock:
            if self._running:
                return
            self._running = True
            wanted, self._wanted = self._wanted, []
            for transport in wanted:
                if transport._wanted:
                    self._attach(transport)

    def restart(self, keep_state: bool = False) -> None:
        with self._lock:
            self.stop(keep_state)
            self.start()

    # -- inside the broker (called with self._lock held) ---------------------------------

    def _attach(self, transport: "LoopbackTransport") -> None:
        cid = transport.client_id
        session = self._sessions.get(cid)
        if session is not None and session.transport is not None \
                and session.transport is not transport:
            # Session take-over: the older connection is thrown out as if its socket died.
            old = session.transport
            session.transport = None
            old._connected = False
            old._wanted = False
            old._emit(DISCONNECTED, "session taken over by a new connection")
            self._fire_will(old)
        present = session is not None and not session.clean and not transport.clean_session
        if not present:
            session = _Session(clean=transport.clean_session)
            self._sessions[cid] = session
        session.transport = transport
        transport._connected = True
        transport._emit(CONNECTED, "connected", present)
        while session.pending:
            self._deliver(transport, session.pending.popleft(), faults=False)
        for topic_filter, qos in transport.subscriptions.items():
            self._subscribe(session, topic_filter, qos)
        outbox, transport._outbox = transport._outbox, deque()
        for topic, payload, qos, retain, props in outbox:
            self._route(topic, payload, qos, retain, **props)

    def _detach(self, transport: "LoopbackTransport", will: bool) -> None:
        session = self._sessions.get(transport.client_id)
        transport._connected = False
        if session is None or session.transport is not transport:
            return
        session.transport = None
        if session.clean:
            del self._sessions[transport.client_id]
        if will:
            self._fire_will(transport)

    def _fire_will(self, transport: "LoopbackTransport") -> None:
        if transport._will is not None:
            topic, payload, qos, retain = transport._will
            self._route(topic, payload, qos, retain)

    def _subscribe(self, session: _Session, topic_filter: str, qos: int) -> None:
        session.subscriptions[topic_filter] = qos
        for topic, msg in list(self._retained.items()):
            if topic_matches(topic_filter, topic):
                self._deliver(session.transport,
                              Message(topic, msg.payload, True, min(qos, msg.qos),
                                      response_topic=msg.response_topic,
                                      correlation_data=msg.correlation_data),
                              faults=False)

    def _route(self, topic: str, payload: bytes, qos: int, retain: bool, *,
               response_topic: str | None = None, correlation_data: bytes | None = None) -> None:
        # MQTT 5 carries a publication's response topic and correlation data to every
        # subscriber (and keeps them with a retained message), so the loopback does too.
        props = {"response_topic": response_topic, "correlation_data": correlation_data}
        self.stats["published"] += 1
        if retain:
            if payload:
                self._retained[topic] = Message(topic, payload, True, qos, **props)
            else:
                self._retained.pop(topic, None)
        for session in self._sessions.values():
            granted = session.granted_qos(topic)
            if granted is None:
                continue
            msg = Message(topic, payload, False, min(qos, granted), **props)
            if session.transport is not None:
                self._deliver(session.transport, msg, faults=True)
            elif msg.qos >= 1 and not session.clean:
                if len(session.pending) < self.max_queued:
                    session.pending.append(msg)
                    self.stats["queued_offline"] += 1
                else:
                    self.stats["discarded_offline"] += 1

    def _deliver(self, transport: "LoopbackTransport", msg: Message, faults: bool) -> None:
        copies = 1
        if faults and (self.drop_rate or self.duplicate_rate) \
                and topic_matches(self.faults_on, msg.topic):
            if self.drop_rate and self._rng.random() < self.drop_rate:
                self.stats["dropped"] += 1
                return
            if self.duplicate_rate and self._rng.random() < self.duplicate_rate:
                copies = 2
                self.stats["duplicated"] += 1
        now = time.time()
        for i in range(copies):
            transport.messages.put(Message(msg.topic, msg.payload, msg.retain, msg.qos, now,
                                           duplicate=i > 0, response_topic=msg.response_topic,
                                           correlation_data=msg.correlation_data))
            self.stats["delivered"] += 1


class LoopbackTransport(Transport):
    """A Transport attached to a LoopbackBroker (create it with `broker.transport(id)`)."""

    def __init__(self, broker: LoopbackBroker, client_id: str, clean_session: bool = False,
                 max_payload: int | None = None):
        super().__init__(client_id)
        self.broker = broker
        self.clean_session = clean_session
        self._max_payload = max_payload
        self._state_lock = broker._lock        # one lock: broker and transports change together
        self._connected = False
        self._wanted = False                   # connect() called and not closed or killed
        self._outbox: deque = deque()

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def max_payload(self) -> int:
        own = self._max_payload if self._max_payload is not None else MQTT_MAX_PAYLOAD
        return min(own, self.broker.max_payload)

    def connect(self, timeout: float | None = None) -> None:
        with self.broker._lock:
            if self._wanted:
                raise TransportError(f"{self!r}: connect() called twice; close() first")
            if not self.broker._running:
                raise TransportError(f"cannot reach the loopback broker for "
                                     f"{self.client_id!r}: it is stopped")
            self._wanted = True
            self.broker._attach(self)

    def close(self, timeout: float = 5.0, announce_offline: bool = True) -> None:
        with self.broker._lock:
            if not self._wanted:
                return
            if announce_offline and self._will is not None and self._connected:
                topic, payload, qos, retain = self._will
                self.broker._route(topic, payload, qos, retain)
            self._wanted = False
            self._outbox.clear()
            self.broker._detach(self, will=False)
            if self in self.broker._wanted:
                self.broker._wanted.remove(self)
            self._emit(DISCONNECTED, "closed")

    def kill(self) -> None:
        with self.broker._lock:
            if not self._wanted:
                return
            self._wanted = False
            self._outbox.clear()
            self.broker._detach(self, will=True)
            if self in self.broker._wanted:
                self.broker._wanted.remove(self)

    def publish(self, topic: str, payload, qos: int = 1, retain: bool = False, *,
                response_topic: str | None = None,
                correlation_data: bytes | None = None) -> Delivery:
        data = self._check_publish(topic, payload, qos)
        check_response_properties(response_topic, correlation_data)
        props = {"response_topic": response_topic,
                 "correlation_data": bytes(correlation_data) if correlation_data is not None
                 else None}
        with self.broker._lock:
            if not self._wanted:
                raise TransportError(f"publish to {topic!r}: {self!r} is not connected; call "
                                     "connect() first")
            if self._connected:
                self.broker._route(topic, data, qos, retain, **props)
            elif qos >= 1:
                self._outbox.append((topic, data, qos, retain, props))  # sent after reconnecting
        return DONE

    def _subscribe_now(self, topic_filter: str, qos: int, timeout: float | None) -> None:
        with self.broker._lock:
            session = self.broker._sessions.get(self.client_id)
            if session is not None and session.transport is self:
                self.broker._subscribe(session, topic_filter, qos)

    def _unsubscribe_now(self, topic_filter: str) -> None:
        with self.broker._lock:
            session = self.broker._sessions.get(self.client_id)
            if session is not None and session.transport is self:
                session.subscriptions.pop(topic_filter, None)
