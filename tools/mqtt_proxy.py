#!/usr/bin/env python3
"""A fault-injecting TCP proxy for MQTT: sits between nodes and a real broker, splits each
byte stream into MQTT packets and delays or duplicates PUBLISH packets on the way.

    proxy = MqttFaultProxy(("127.0.0.1", broker_port), seed=1, delay_rate=0.05,
                           duplicate_rate=0.05)
    proxy.start()                      # nodes connect to proxy.url instead of the broker
    ...
    proxy.stats                        # {"delayed": 12, "duplicated": 9, ...}
    proxy.stop()

Why a proxy and not a flag in the transport: the roles under test then run unchanged, in
their own processes, against the real broker; only the network between them misbehaves.

What it does to a PUBLISH, in either direction (node -> broker, broker -> node):

- delay:     hold the packet for `delay_s` (uniform in the range) before forwarding it. The
             stream behind it waits too, as behind a stalled TCP connection: MQTT keeps the
             order of one connection's packets, and a proxy that reordered them would test
             something no network does.
- duplicate: forward the packet, then a copy with the DUP flag set. For QoS 1 this is what
             a redelivery looks like to the receiver (the same message twice), so the roles
             must handle it idempotently. The receiver then acknowledges both copies; the
             proxy forwards the first PUBACK and swallows the second, because a stray PUBACK
             could acknowledge a later message that reuses the packet id (a real redelivery
             happens after a reconnect, when the sender still waits for exactly one PUBACK).
             QoS 2 packets are never duplicated (their handshake is not modelled here).

- drop acked: (node -> broker, QoS 1 only, `drop_acked_rate`, off unless asked for) answer
             the PUBLISH with a PUBACK made by the proxy and never forward it: a broker
             that lost a message it had acknowledged. No broker should do this; it exists
             so a test can show that tools/chaos.py counts such an update as lost.

`sever()` cuts every open connection (both sides see the TCP connection drop without an MQTT
DISCONNECT: the broker fires the node's Last Will, the node reconnects). When the broker is
down, a new node connection is closed at once, as the broker's refused TCP connect would be.

Packet framing (MQTT 3.1.1 section 2.2, the same in MQTT 5): one byte of type and flags, then
the remaining length as a varint of 1-4 bytes (7 bits each, least significant first), then
that many bytes. A PUBLISH's variable header starts with the topic (2-byte length + UTF-8),
followed by the 2-byte packet id when QoS > 0; a PUBACK's starts with the packet id.

Faults are drawn from a random.Random seeded with `seed` (each connection draws from its own
generator, seeded from the proxy's), so a run's fault rates are reproducible; which packet
gets which fault also depends on thread timing, as on a real network.
"""
from __future__ import annotations

import argparse
import random
import socket
import threading
import time
from collections import Counter

__all__ = ["MqttFaultProxy", "FramingError", "split_packets", "publish_info",
           "connect_protocol", "topic_kind"]

CONNECT = 1
PUBLISH = 3
PUBACK = 4


class FramingError(ValueError):
    """The byte stream is not MQTT (a remaining length of more than 4 bytes)."""


def split_packets(buf: bytearray) -> list[bytes]:
    """Remove and return every complete MQTT packet at the start of `buf` (which keeps the
    incomplete tail)."""
    packets = []
    pos = 0
    n = len(buf)
    while n - pos >= 2:
        length, shift, i, complete = 0, 0, pos + 1, False
        while i < n:
            byte = buf[i]
            i += 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                complete = True
                break
            shift += 7
            if shift >= 28:
                raise FramingError(f"remaining length of the packet at byte {pos} takes more "
                                   "than 4 bytes: not an MQTT stream")
        if not complete:
            break                               # the varint is not complete yet
        end = i + length
        if end > n:
            break                               # the body is not complete yet
        packets.append(bytes(buf[pos:end]))
        pos = end
    del buf[:pos]
    return packets


def _header_length(packet: bytes) -> int:
    """Bytes of the fixed header (type byte + remaining-length varint)."""
    i = 1
    while packet[i] & 0x80:
        i += 1
    return i + 1


def publish_info(packet: bytes, protocol: int = 4) -> tuple[str, int, int | None, bytes]:
    """(topic, qos, packet id or None, application payload) of a PUBLISH packet of MQTT
    protocol level `protocol` (4: 3.1.1, 5: MQTT 5, whose properties precede the payload)."""
    qos = (packet[0] >> 1) & 0x03
    h = _header_length(packet)
    topic_len = int.from_bytes(packet[h:h + 2], "big")
    topic = packet[h + 2:h + 2 + topic_len].decode("utf-8", "replace")
    at = h + 2 + topic_len
    pid = None
    if qos > 0:
        pid = int.from_bytes(packet[at:at + 2], "big")
        at += 2
    if protocol >= 5:
        props, shift = 0, 0
        while True:
            byte = packet[at]
            at += 1
            props |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        at += props
    return topic, qos, pid, packet[at:]


def connect_protocol(packet: bytes) -> int:
    """The protocol level of a CONNECT packet (4: MQTT 3.1.1, 5: MQTT 5)."""
    h = _header_length(packet)
    name_len = int.from_bytes(packet[h:h + 2], "big")
    return packet[h + 2 + name_len]


def _ack_id(packet: bytes) -> int:
    h = _header_length(packet)
    return int.from_bytes(packet[h:h + 2], "big")


def topic_kind(topic: str) -> str:
    """The edgefl topic kind (update, round, model, status, ...) of `prefix/<fed>/<kind>/...`,
    for the fault counts; the whole topic for anything else."""
    parts = topic.split("/")
    return parts[2] if len(parts) >= 3 else topic


class _Pump:
    """One direction of one connection: reads packets from `src`, faults PUBLISHes, writes
    them to `dst`."""

    def __init__(self, conn: "_Connection", src: socket.socket, dst: socket.socket,
                 direction: str):
        self.conn, self.src, self.dst, self.direction = conn, src, dst, direction
        self.reverse: _Pump | None = None
        # packet ids whose PUBLISH we duplicated towards dst: dst answers with two PUBACKs;
        # the reverse pump forwards the first ("first") and swallows the second ("drop")
        self.extra_acks: dict[int, str] = {}
        # QoS 1 PUBLISHes sent towards dst and not yet acknowledged (only with on_acked)
        self.unacked: dict[int, tuple[str, bytes]] = {}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"mqtt-proxy-{conn.number}-{direction}")

    def _run(self) -> None:
        buf = bytearray()
        try:
            while True:
                data = self.src.recv(65536)
                if not data:
                    break
                buf += data
                for packet in split_packets(buf):
                    self._forward(packet)
        except (OSError, FramingError):
            pass
        finally:
            self.conn.close()

    def _forward(self, packet: bytes) -> None:
        kind = packet[0] >> 4
        proxy = self.conn.proxy
        if kind == CONNECT:
            self.conn.protocol = connect_protocol(packet)
        if kind == PUBACK and self.reverse is not None:
            pid = _ack_id(packet)
            with self.reverse.lock:
                state = self.reverse.extra_acks.get(pid)
                if state == "first":
                    self.reverse.extra_acks[pid] = "drop"
                elif state == "drop":
                    del self.reverse.extra_acks[pid]
                    proxy._count("absorbed_puback", self.direction, "puback")
                    return
                acked = self.reverse.unacked.pop(pid, None)
            if acked is not None:
                proxy.on_acked(self.reverse.direction, acked[0], acked[1], time.time())
        if kind != PUBLISH:
            self.conn.send(self.dst, packet)
            return
        topic, qos, pid, payload = publish_info(packet, self.conn.protocol)
        if qos == 1 and proxy.on_acked is not None:
            with self.lock:
                self.unacked[pid] = (topic, payload)
        what = topic_kind(topic)
        if not proxy.faults_on(topic):
            self.conn.send(self.dst, packet)
            proxy._count("forwarded", self.direction, what)
            return
        hold = proxy.hold_s.get((self.direction, what))
        if hold:
            time.sleep(hold)                # a slow link for this topic, not a fault
        rng = self.conn.rng
        if qos == 1 and self.direction == "up" and rng.random() < proxy.drop_acked_rate:
            # the broker's PUBACK, made here: the node believes the broker has it
            with self.lock:
                self.unacked.pop(pid, None)
            self.conn.send(self.src, bytes([PUBACK << 4, 2]) + pid.to_bytes(2, "big"))
            proxy._count("dropped_acked", self.direction, what)
            if proxy.on_acked is not None:
                proxy.on_acked(self.direction, topic, payload, time.time())
            return
        delay = rng.random() < proxy.delay_rate
        duplicate = qos < 2 and rng.random() < proxy.duplicate_rate
        if delay:
            seconds = rng.uniform(*proxy.delay_s)
            proxy._count("delayed", self.direction, what)
            time.sleep(seconds)
        if duplicate and qos == 1:
            with self.lock:
                self.extra_acks[pid] = "first"
        self.conn.send(self.dst, packet)
        proxy._count("forwarded", self.direction, what)
        if duplicate:
            self.conn.send(self.dst, bytes([packet[0] | 0x08]) + packet[1:] if qos else packet)
            proxy._count("duplicated", self.direction, what)


class _Connection:
    def __init__(self, proxy: "MqttFaultProxy", number: int, node: socket.socket,
                 broker: socket.socket):
        self.proxy, self.number = proxy, number
        self.node, self.broker = node, broker
        self.protocol = 4                   # until the CONNECT says otherwise
        self.rng = random.Random(proxy._rng.getrandbits(64))
        self._closed = threading.Event()
        self._send_locks = {node: threading.Lock(), broker: threading.Lock()}
        up = _Pump(self, node, broker, "up")            # node -> broker
        down = _Pump(self, broker, node, "down")        # broker -> node
        up.reverse, down.reverse = down, up
        self.pumps = (up, down)

    def start(self) -> None:
        for pump in self.pumps:
            pump.thread.start()

    def send(self, sock: socket.socket, data: bytes) -> None:
        # both pumps write to the node's socket when the proxy answers a PUBLISH itself
        with self._send_locks[sock]:
            sock.sendall(data)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for sock in (self.node, self.broker):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.proxy._forget(self)


class MqttFaultProxy:
    """Listens on `listen` (host, port; port 0: a free one) and connects every node that
    connects to it to the broker at `upstream`. delay_rate / duplicate_rate: probability per
    PUBLISH; delay_s: (min, max) seconds of a delay; drop_acked_rate: probability that a
    node's QoS 1 PUBLISH is acknowledged by the proxy and dropped; faults_on(topic) -> bool
    picks which PUBLISHes may be faulted (default: all); hold_s: {(direction, topic kind):
    seconds} every such PUBLISH is held before the faults (a slow link, e.g. to pace rounds). on_acked(direction, topic, payload, time) is
    called (on a proxy thread) when a QoS 1 PUBLISH is acknowledged: direction "up" means a
    node's message the broker took responsibility for."""

    def __init__(self, upstream: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0),
                 *, seed: int = 0, delay_rate: float = 0.0,
                 delay_s: tuple[float, float] = (0.05, 0.5), duplicate_rate: float = 0.0,
                 drop_acked_rate: float = 0.0, hold_s: dict | None = None,
                 faults_on=None, on_acked=None, connect_timeout: float = 2.0):
        for name, rate in (("delay_rate", delay_rate), ("duplicate_rate", duplicate_rate),
                           ("drop_acked_rate", drop_acked_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"MqttFaultProxy {name} = {rate!r}: a probability in [0, 1]")
        if not 0.0 <= delay_s[0] <= delay_s[1]:
            raise ValueError(f"MqttFaultProxy delay_s = {delay_s!r}: need 0 <= min <= max")
        self.upstream = upstream
        self.delay_rate, self.delay_s, self.duplicate_rate = delay_rate, delay_s, duplicate_rate
        self.drop_acked_rate = drop_acked_rate
        self.hold_s = dict(hold_s or {})
        self.faults_on = faults_on or (lambda topic: True)
        self.on_acked = on_acked
        self.connect_timeout = connect_timeout
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._connections: set[_Connection] = set()
        self._number = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(listen)
        self._listener.listen(128)
        self.host, self.port = self._listener.getsockname()[:2]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name="mqtt-proxy-accept")

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> "MqttFaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._listener.close()
        except OSError:
            pass
        self.sever()
        self._thread.join(5)

    def sever(self) -> int:
        """Cut every open connection; returns how many."""
        with self._lock:
            live = list(self._connections)
        for conn in live:
            conn.close()
        return len(live)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ statistics
    @property
    def stats(self) -> dict:
        """Totals per fault: connections, refused (broker down), forwarded, delayed,
        duplicated, absorbed_puback, dropped_acked."""
        out = Counter()
        with self._lock:
            for (what, _direction, _kind), n in self._counts.items():
                out[what] += n
        return dict(out)

    def counts(self) -> dict:
        """Every count keyed "fault/direction/topic kind", e.g. "duplicated/up/update"."""
        with self._lock:
            return {"/".join(k): n for k, n in sorted(self._counts.items())}

    def _count(self, what: str, direction: str, kind: str) -> None:
        with self._lock:
            self._counts[(what, direction, kind)] += 1

    # ------------------------------------------------------------------ connections
    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)

    def _accept_loop(self) -> None:
        # accept() with a timeout: closing a listening socket does not wake a thread
        # blocked in accept() on Linux, so stop() would wait for the next connection
        self._listener.settimeout(0.1)
        while not self._stopped.is_set():
            try:
                node, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            node.settimeout(None)
            try:
                broker = socket.create_connection(self.upstream, timeout=self.connect_timeout)
            except OSError:
                self._count("refused", "up", "connect")   # the broker is down
                node.close()
                continue
            broker.settimeout(None)
            for sock in (node, broker):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._number += 1
                conn = _Connection(self, self._number, node, broker)
                self._connections.add(conn)
                self._counts[("connections", "up", "connect")] += 1
            conn.start()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", default="127.0.0.1:1883", metavar="HOST:PORT")
    parser.add_argument("--listen", default="127.0.0.1:1884", metavar="HOST:PORT")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delay-rate", type=float, default=0.05)
    parser.add_argument("--delay-min", type=float, default=0.05, metavar="SECONDS")
    parser.add_argument("--delay-max", type=float, default=0.5, metavar="SECONDS")
    parser.add_argument("--duplicate-rate", type=float, default=0.05)
    args = parser.parse_args(argv)

    def address(text):
        host, _, port = text.rpartition(":")
        return host or "127.0.0.1", int(port)

    proxy = MqttFaultProxy(address(args.broker), address(args.listen), seed=args.seed,
                           delay_rate=args.delay_rate, delay_s=(args.delay_min, args.delay_max),
                           duplicate_rate=args.duplicate_rate)
    proxy.start()
    print(f"proxy {proxy.url} -> {args.broker}; Ctrl-C prints the fault counts", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        proxy.stop()
        for key, n in proxy.counts().items():
            print(f"{key:32s} {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
