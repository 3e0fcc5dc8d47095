"""`MqttTransport`: the Transport interface over paho-mqtt 2, for any MQTT 3.1.1 or 5 broker
(Mosquitto, EMQX, VerneMQ, HiveMQ, NATS's or RabbitMQ's MQTT front end, the embedded broker).

    t = MqttTransport("mqtts://board-07:secret@gateway.lan:8883", "board-07",
                      ca_file="/etc/edgefl/ca.crt")
    t.set_will("edgefl/lab/status/board-07", b'{"online":false}')
    t.connect()

Decisions (docs/brokers.md has the reasoning):
- Persistent session by default (`clean_session=False`; MQTT 5: clean start off and a session
  expiry of `session_expiry` seconds) under a client id that is stable per node. The broker
  then keeps the node's subscriptions and queues QoS 1 messages for it while it is away --
  a restarted aggregator receives the updates clients sent while it was down. Two processes
  must never share a client id: the broker would throw each out in turn.
- paho runs its network loop in its own thread (`loop_start`) and reconnects by itself with
  exponential backoff (`reconnect_min` doubling up to `reconnect_max`); or, with
  `network_loop=`, a NetworkLoop shared by the process's transports does both (netloop.py:
  for a process that plays a whole federation). Subscriptions are (re)made in on_connect,
  so a reconnect to a broker that lost our session re-subscribes.
- Callbacks only enqueue onto `messages`; publishes are bounded: at most `max_inflight`
  unacknowledged QoS 1 messages on the wire and `max_queued` waiting, beyond which publish()
  blocks for up to `publish_timeout` seconds, then raises TransportError.
- connect() is blocking and strict: an unreachable broker raises TransportError naming
  host:port and the socket error; a refusal (bad credentials, not authorised) names the
  MQTT reason code.
"""
from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from .base import (CONNECTED, DISCONNECTED, MQTT_MAX_PAYLOAD, Delivery, Message, Transport,
                   TransportError, check_response_properties)
from .netloop import NetworkLoop

__all__ = ["BrokerAddress", "MqttSettings", "MqttTransport", "parse_broker_url", "shown_url"]

log = logging.getLogger("edgefl.transport")
_paho_log = logging.getLogger("edgefl.transport.paho")

# A connection lost within this many seconds of the broker accepting it, with a QoS 1
# message unacknowledged, counts as a quick drop; _QUICK_DROPS of them in a row are named
# as the likely cause (_on_disconnect): a message over the broker's packet limit.
_QUICK_DROP_S = 2.0
_QUICK_DROPS = 3

_DEFAULT_PORTS = {"mqtt": 1883, "tcp": 1883, "mqtts": 8883, "ssl": 8883, "tls": 8883}
_TLS_SCHEMES = {"mqtts", "ssl", "tls"}


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def shown_url(url: str) -> str:
    """A broker URL as edgefl prints it (errors, logs, `edgefl config show`): with the
    password of `mqtt://user:password@host` replaced by ***, so it never reaches a journal,
    a terminal or a pasted bug report. Anything else is shown as it is."""
    if "@" not in url:
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, host = rest.rpartition("@")
    user, colon, _password = userinfo.partition(":")
    shown = f"{user}:***" if colon else user
    return f"{scheme}{sep}{shown}{at}{host}"


def parse_broker_url(url: str) -> BrokerAddress:
    """`mqtt://[user[:password]@]host[:port]` (plain TCP, port 1883) or `mqtts://...` (TLS,
    port 8883); `tcp://` / `ssl://` / `tls://` are accepted as synonyms and a bare
    `host[:port]` means mqtt://. User and password are percent-decoded."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"broker URL must be a non-empty string, got {url!r}")
    text = url.strip()
    shown = shown_url(url)
    if "://" not in text:
        text = "mqtt://" + text
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"broker URL {shown!r}: scheme {scheme!r} is not one of mqtt://, "
                         "mqtts:// (or tcp://, ssl://, tls://); websockets are not supported")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"broker URL {shown!r}: expected "
                         "scheme://[user[:password]@]host[:port] with no path or query")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"broker URL {shown!r}: bad port ({exc})") from None
    if not parts.hostname:
        raise ValueError(f"broker URL {shown!r} names no host")
    if port is None and parts.netloc.endswith(":"):
        # "mqtt://127.0.0.1:$PORT" with PORT unset: not the default port, a mistake (it
        # reached whatever listens on 1883)
        raise ValueError(f"broker URL {shown!r}: empty port after ':' (leave out the ':' for "
                         f"the default, {_DEFAULT_PORTS[scheme]})")
    return BrokerAddress(
        host=parts.hostname,
        port=port if port is not None else _DEFAULT_PORTS[scheme],
        tls=scheme in _TLS_SCHEMES,
        username=unquote(parts.username) if parts.username is not None else None,
        password=unquote(parts.password) if parts.password is not None else None)


@dataclass(frozen=True)
class MqttSettings:
    """Everything MqttTransport needs; the config layer builds this from YAML."""

    url: str = "mqtt://127.0.0.1:1883"
    client_id: str = ""
    username: str | None = None          # overrides the URL's user
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None     # first line is the password (systemd credentials)
    ca_file: str | None = None           # CA bundle to verify the broker (default: system CAs)
    cert_file: str | None = None         # client certificate (mutual TLS)
    key_file: str | None = None
    tls_insecure: bool = False           # skip certificate and hostname checks (testing only)
    protocol: str = "3.1.1"              # "3.1.1" or "5"
    keepalive: int = 30                  # seconds; the broker fires the will after 1.5x this
    clean_session: bool = False          # False: persistent session (see module docstring)
    session_expiry: int = 3600           # MQTT 5 only: how long the broker keeps our session
    reconnect_min: float = 1.0           # backoff: first retry delay, doubled up to max
    reconnect_max: float = 30.0
    connect_timeout: float = 10.0        # TCP + TLS + CONNACK
    max_payload: int = MQTT_MAX_PAYLOAD  # lower it to the broker's max_packet_size
    max_inflight: int = 16               # unacknowledged QoS 1 publishes on the wire
    max_queued: int = 4096               # QoS 1 publishes waiting (incl. in flight)
    publish_timeout: float = 60.0        # how long publish() blocks on a full queue

    def __post_init__(self):
        if self.protocol not in ("3.1.1", "5"):
            raise ValueError(f"MQTT protocol {self.protocol!r}: use '3.1.1' or '5'")
        for name in ("keepalive", "max_inflight", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"MQTT setting {name}={getattr(self, name)!r}: must be >= 1")
        if not 0 < self.reconnect_min <= self.reconnect_max:
            raise ValueError(f"MQTT reconnect delays: need 0 < reconnect_min "
                             f"({self.reconnect_min}) <= reconnect_max ({self.reconnect_max})")
        if not 0 < self.max_payload <= MQTT_MAX_PAYLOAD:
            raise ValueError(f"MQTT max_payload={self.max_payload}: must be in 1.."
                             f"{MQTT_MAX_PAYLOAD} (the MQTT packet limit)")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("MQTT TLS: cert_file and key_file go together (client "
                             "certificate and its private key)")
        if self.password is not None and self.password_file is not None:
            raise ValueError("MQTT: give password or password_file, not both")


def _no_delay(client, userdata, sock) -> None:
    # paho leaves Nagle's algorithm on: a small write (PUBACK, a small publish) then waits
    # for the peer's delayed ACK, ~40 ms per QoS 1 exchange. The broker side needs the same
    # (Mosquitto: set_tcp_nodelay true).
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass       # not a TCP socket (unix socket, websocket wrapper)


def _drain_socket(sock, deadline: float) -> None:
    """Half-close `sock` and discard what the broker still sends until it closes its side
    (it does once it has read our DISCONNECT) or `deadline` (time.monotonic()) passes: closing
    a socket with unread data sends a TCP RST, which can make the broker lose the DISCONNECT
    (MqttTransport.close)."""
    try:
        sock.shutdown(socket.SHUT_WR)
        while (remaining := deadline - time.monotonic()) > 0:
            sock.settimeout(min(remaining, 1.0))
            if not sock.recv(65536):
                return
    except (OSError, ValueError, AttributeError):
        pass       # already reset or closed by the broker: nothing left to protect


class _PahoDelivery(Delivery):
    """Completed from on_publish (QoS 1: the broker's PUBACK; QoS 0: written to the socket).
    paho's own MQTTMessageInfo reports a QoS 1 message published while disconnected as failed
    even though paho sends it after reconnecting, so we track completion ourselves."""

    __slots__ = ("_event", "qos", "size")

    def __init__(self, qos: int, size: int = 0):
        self._event = threading.Event()
        self.qos = qos
        self.size = size

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    @property
    def done(self) -> bool:
        return self._event.is_set()


class MqttTransport(Transport):
    """A Transport over paho-mqtt 2. `MqttTransport(url, client_id, **MqttSettings fields)`."""

    def __init__(self, url: str = "mqtt://127.0.0.1:1883", client_id: str = "", *,
                 network_loop: NetworkLoop | None = None, **options):
        super().__init__(client_id)
        self.settings = MqttSettings(url=url, client_id=client_id, **options)
        # None: paho's own network thread (loop_start), as a board runs. A NetworkLoop:
        # one thread shared with the process's other transports (netloop.py).
        self._network_loop = network_loop
        self.address = parse_broker_url(url)
        if self.settings.ca_file or self.settings.cert_file:
            if not self.address.tls:
                raise ValueError(f"broker URL {shown_url(url)!r} is plain TCP but TLS files are "
                                 "set: use mqtts://host:8883")
        self._client: paho.Client | None = None
        self._connected = False
        self._closing = False
        self._first_connack = threading.Event()
        self._refusal: str | None = None
        self._server_max_packet: int | None = None
        # QoS 1 accounting for backpressure and flush(); notified from on_publish.
        self._flow = threading.Condition()
        self._outstanding = 0
        self._deliveries: dict[int, _PahoDelivery] = {}
        self._early_acks: set[int] = set()
        self._subacks: dict[int, list] = {}
        self._losses = 0                     # connections lost so far (_subscribe_now)
        self._resubscribing: dict[int, bool] = {}     # SUBACK mid -> session_present
        self._up_since = 0.0                 # time.monotonic() of the last CONNACK
        self._quick_drops = 0                # connections lost right after it, in a row
        # paho's own log, under edgefl.transport.paho, muted while we tear the connection
        # down on purpose (paho 2.2 then logs socket errors and "Client is not connected").
        self._paho_logger = logging.Logger(f"{_paho_log.name}.{client_id}")
        self._paho_logger.parent = _paho_log
        self._paho_logger.addFilter(self._paho_log_filter)

    # -- connection -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def max_payload(self) -> int:
        limit = self.settings.max_payload
        if self._server_max_packet:
            limit = min(limit, self._server_max_packet - 1024)
        return limit

    def _payload_limit(self, topic_bytes: int) -> int:
        limit = self.settings.max_payload
        if self._server_max_packet:
            # fixed header (<= 5) + topic length (2) + topic + packet id (2) + properties
            limit = min(limit, self._server_max_packet - topic_bytes - 16)
        return limit

    def connect(self, timeout: float | None = None) -> None:
        if self._client is not None:
            raise TransportError(f"{self!r}: connect() called twice; close() first")
        s = self.settings
        timeout = s.connect_timeout if timeout is None else timeout
        v5 = s.protocol == "5"
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             clean_session=None if v5 else s.clean_session,
                             protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
                             reconnect_on_failure=True)
        client.enable_logger(self._paho_logger)
        client.connect_timeout = timeout
        client.reconnect_delay_set(s.reconnect_min, s.reconnect_max)
        client.max_inflight_messages_set(s.max_inflight)
        client.max_queued_messages_set(0)   # we bound the queue ourselves, by blocking
        username, password = self._credentials()
        if username is not None:
            client.username_pw_set(username, password)
        if self.address.tls:
            client.tls_set_context(self._tls_context())
            if s.tls_insecure:
                client.tls_insecure_set(True)
        if self._will is not None:
            topic, payload, qos, retain = self._will
            client.will_set(topic, payload, qos=qos, retain=retain)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        client.on_socket_open = _no_delay
        if self._network_loop is not None:
            self._network_loop.prepare(client)

        connect_kwargs = {}
        if v5:
            connect_kwargs["clean_start"] = s.clean_session
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 0 if s.clean_session else s.session_expiry
            connect_kwargs["properties"] = props
        self._closing = False
        self._refusal = None
        self._first_connack.clear()
        try:
            # Blocking TCP (+ TLS) connect, so an unreachable broker is reported here with
            # the socket's own error rather than as silent retries in the background.
            client.connect(self.address.host, self.address.port, keepalive=s.keepalive,
                           **connect_kwargs)
        except ssl.SSLError as exc:
            raise TransportError(f"TLS handshake with MQTT broker {self.address} failed: "
                                 f"{exc}") from None
        except socket.gaierror as exc:
            raise TransportError(f"cannot reach MQTT broker {self.address}: cannot resolve "
                                 f"host {self.address.host!r} ({exc})") from None
        except (socket.timeout, TimeoutError):
            raise TransportError(f"cannot reach MQTT broker {self.address}: no answer "
                                 f"within {timeout:g} s") from None
        except OSError as exc:
            hint = ""
            if self.address.tls and isinstance(exc, ConnectionResetError):
                hint = " (during the TLS handshake: is this port a plain-TCP listener?)"
            raise TransportError(f"cannot reach MQTT broker {self.address}: "
                                 f"{exc.strerror or exc}{hint}") from None
        self._client = client
        if self._network_loop is not None:
            self._network_loop.add(client, self.client_id, lambda: not self._closing,
                                   s.reconnect_min, s.reconnect_max)
        else:
            client.loop_start()
        if not self._first_connack.wait(timeout):
            self._teardown()
            hint = "is it an MQTT listener? TLS expected?"
            if v5:
                hint += " MQTT 5 not supported (NATS, amqtt, RabbitMQ < 3.13)? use protocol 3.1.1"
            raise TransportError(f"MQTT broker {self.address} accepted the TCP connection but "
                                 f"sent no CONNACK within {timeout:g} s ({hint})")
        if self._refusal is not None:
            refusal = self._refusal
            self._teardown()
            raise TransportError(f"MQTT broker {self.address} refused client "
                                 f"{self.client_id!r}: {refusal}")

    def close(self, timeout: float = 5.0, announce_offline: bool = True) -> None:
        """Transport.close: up to `timeout` for outstanding QoS 1 publishes, then up to
        `timeout` again until the broker has taken our DISCONNECT (so it drops the will)."""
        client = self._client
        if client is None:
            return
        if announce_offline and self._will is not None and self._connected:
            topic, payload, qos, retain = self._will
            try:
                self.publish(topic, payload, qos=qos, retain=retain)
            except TransportError:
                pass
        self.flush(timeout)
        self._closing = True
        # A clean close must reach the broker as a DISCONNECT, or it publishes our Last Will
        # as if we had crashed. Two races lose it:
        # 1. loop_stop() may end paho's network thread before it has written the DISCONNECT
        #    that disconnect() only queued: so wait (bounded) for on_disconnect, which paho
        #    calls once that packet is written, before stopping the loop.
        # 2. paho closes the socket right after writing DISCONNECT; if messages sent to us
        #    are still unread in the socket, the kernel answers with a TCP RST instead of a
        #    FIN, and the broker can drop the DISCONNECT still in its receive buffer (with
        #    Mosquitto under incoming traffic about 1 clean close in 10 fired the will). So
        #    on this close, half-close our side and drain until the broker closes its side,
        #    which it does after reading the DISCONNECT.
        # Both waits share a second `timeout` (the first one bounded the flush).
        deadline = time.monotonic() + timeout
        disconnected = threading.Event()

        def on_disconnect(*args) -> None:
            disconnected.set()
            self._on_disconnect(*args)

        def drain_before_close(_client, _userdata, sock) -> None:
            _drain_socket(sock, deadline)

        client.on_socket_close = drain_before_close
        client.on_disconnect = on_disconnect
        if self._connected and client.disconnect() == MQTTErrorCode.MQTT_ERR_SUCCESS:
            if not disconnected.wait(max(0.0, deadline - time.monotonic())):
                log.warning("closing %r: no DISCONNECT written to %s within %g s; the broker "
                            "may publish our Last Will", self.client_id, self.address, timeout)
        self._teardown()
        self._emit(DISCONNECTED, "closed")

    def kill(self) -> None:
        client = self._client
        if client is None:
            return
        self._closing = True
        sock = client.socket()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)   # FIN without an MQTT DISCONNECT
            except OSError:
                pass
        self._teardown()

    def _teardown(self) -> None:
        client, self._client = self._client, None
        self._closing = True
        self._connected = False
        if client is None:
            return
        # disconnect() stops paho's reconnect loop; after kill() its DISCONNECT meets a dead
        # socket and is never seen by the broker.
        try:
            client.disconnect()
        except Exception:       # noqa: BLE001 -- already torn down on paho's side
            pass
        if self._network_loop is not None:
            self._network_loop.remove(client)
        else:
            client.loop_stop()
        with self._flow:
            self._outstanding = 0
            self._deliveries.clear()
            self._early_acks.clear()
            self._subacks.clear()
            self._resubscribing.clear()
            self._flow.notify_all()

    def _paho_log_filter(self, record: logging.LogRecord) -> bool:
        if self._closing or self._refusal is not None:
            return False
        # paho's loop logs "Client is not connected. Socket: None)" at every pass while it
        # reconnects (a line a second, at error level); _on_disconnect said the connection
        # was lost and is retried with backoff, which is all there is to say
        return self._connected or not record.getMessage().startswith("Client is not connected")

    def _credentials(self) -> tuple[str | None, str | None]:
        s = self.settings
        username = s.username if s.username is not None else self.address.username
        password = s.password if s.password is not None else self.address.password
        if s.password_file is not None:
            try:
                with open(s.password_file, encoding="utf-8") as fh:
                    password = fh.readline().rstrip("\r\n")
            except OSError as exc:
                raise TransportError(f"MQTT password_file {s.password_file}: "
                                     f"{exc.strerror or exc}") from None
        if password is not None and username is None:
            raise ValueError("MQTT: a password without a username")
        return username, password

    def _tls_context(self) -> ssl.SSLContext:
        s = self.settings
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(s, name)
            if path is not None and not os.path.isfile(path):
                raise TransportError(f"MQTT TLS {name} {path}: no such file")
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=s.ca_file)
            if s.cert_file:
                context.load_cert_chain(s.cert_file, s.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise TransportError(f"MQTT TLS files (ca {s.ca_file}, cert {s.cert_file}, key "
                                 f"{s.key_file}): {exc}") from None
        if s.tls_insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    # -- paho callbacks (network thread: record and enqueue, nothing else) ---------------

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            reason = f"{reason_code} (reason code {reason_code.value})"
            if reason_code.value in (4, 5, 134, 135):
                reason += ": check the username/password and the broker's ACL"
            if not self._first_connack.is_set():
                self._refusal = reason
                self._first_connack.set()
            else:
                log.warning("MQTT broker %s refused reconnect of %r: %s", self.address,
                            self.client_id, reason)
                self._emit(DISCONNECTED, f"refused: {reason}")
            return
        max_packet = getattr(properties, "MaximumPacketSize", None) if properties else None
        self._server_max_packet = int(max_packet) if max_packet else None
        self._up_since = time.monotonic()
        with self._state_lock:
            self._connected = True
            wanted = list(self._subscriptions.items())
        session_present = bool(flags.session_present)
        if wanted:
            # `connected` is announced once the broker has acknowledged the re-subscription
            # (on_subscribe), so a role reacting to it cannot miss what follows.
            result, mid = client.subscribe(wanted)
            if result == MQTTErrorCode.MQTT_ERR_SUCCESS:
                with self._flow:
                    self._resubscribing[mid] = session_present
                return
        self._announce_connected(session_present)

    def _announce_connected(self, session_present: bool) -> None:
        self._emit(CONNECTED, "connected", session_present)
        self._first_connack.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        was_connected = self._connected
        self._connected = False
        with self._flow:
            self._losses += 1           # a SUBACK awaited on the lost connection never comes
            self._flow.notify_all()
        if not self._first_connack.is_set() and not self._closing:
            # Closed before accepting us: a TLS listener that wants a client certificate,
            # a connection limit, a protocol the broker does not speak.
            self._refusal = (f"it closed the connection before accepting it ({reason_code}); "
                             "a TLS client certificate required? MQTT 5 not supported? "
                             "a connection limit? (see the broker's log)")
            self._first_connack.set()
            return
        if not self._closing and was_connected:
            log.warning("MQTT connection of %r to %s lost (%s); reconnecting with backoff",
                        self.client_id, self.address, reason_code)
            self._note_quick_drop()
            self._emit(DISCONNECTED, f"connection lost ({reason_code})")

    def _note_quick_drop(self) -> None:
        """A broker closes the connection of a client that sends a packet over its limit
        (Mosquitto's max_packet_size), under MQTT 3.1.1 without saying why; paho sends the
        same message again after reconnecting, and the node flaps for as long as it runs,
        its Last Will fired each time. Losing the connection right after CONNACK a few times
        in a row with a QoS 1 message unacknowledged is named, once per episode."""
        if self.settings.protocol != "3.1.1":
            return              # an MQTT 5 broker refuses such a packet with a reason code
        with self._flow:
            largest = max((d.size for d in self._deliveries.values() if d.qos), default=0)
        if largest == 0 or time.monotonic() - self._up_since > _QUICK_DROP_S:
            self._quick_drops = 0
            return
        self._quick_drops += 1
        if self._quick_drops == _QUICK_DROPS:
            log.error("MQTT broker %s dropped the connection of %r %d times in a row right "
                      "after accepting it, with a message of %s bytes unacknowledged: probably "
                      "over the broker's maximum packet size (Mosquitto: max_packet_size), "
                      "which an MQTT 3.1.1 broker enforces by disconnecting without a reason: "
                      "set max_payload (transport.chunk_size) below it, or raise the broker's "
                      "limit (else: another client connected under the same id, each taking "
                      "the session from the other)", self.address, self.client_id,
                      _QUICK_DROPS, f"{largest:,}")

    def _on_message(self, client, userdata, msg) -> None:
        try:
            topic = msg.topic
        except UnicodeDecodeError:
            log.warning("dropped a message whose topic is not UTF-8: %r", msg._topic[:80])
            return
        # MQTT 5 request/response properties (a command's reply address); paho gives a
        # Properties object on every v5 message, None-like attributes when absent.
        props = getattr(msg, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props is not None else None
        correlation = getattr(props, "CorrelationData", None) if props is not None else None
        self.messages.put(Message(topic, msg.payload, bool(msg.retain), msg.qos, time.time(),
                                  bool(msg.dup), response_topic or None,
                                  bytes(correlation) if correlation is not None else None))

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        if reason_code.is_failure:   # MQTT 5 only: e.g. 135 Not authorized (the ACL)
            log.warning("MQTT broker %s rejected publish (message id %d): %s (reason code "
                        "%d)", self.address, mid, reason_code, reason_code.value)
        with self._flow:
            delivery = self._deliveries.pop(mid, None)
            if delivery is None:
                self._early_acks.add(mid)     # publish() has not registered it yet
                return
            delivery._event.set()
            if delivery.qos > 0 and self._outstanding > 0:
                self._outstanding -= 1
            self._flow.notify_all()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        with self._flow:
            resubscribed = mid in self._resubscribing
            session_present = self._resubscribing.pop(mid, False)
            if not resubscribed:
                self._subacks[mid] = reason_codes
                self._flow.notify_all()
                return
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        if refused:
            log.warning("MQTT broker %s refused re-subscribing %r: %s", self.address,
                        self.client_id, ", ".join(refused))
        self._announce_connected(session_present)

    # -- publish / subscribe ----------------------------------------------------------

    def publish(self, topic: str, payload, qos: int = 1, retain: bool = False, *,
                response_topic: str | None = None,
                correlation_data: bytes | None = None) -> Delivery:
        data = self._check_publish(topic, payload, qos)
        check_response_properties(response_topic, correlation_data)
        properties = None
        if response_topic is not None or correlation_data is not None:
            if self.settings.protocol != "5":
                raise ValueError(f"publish to {topic!r}: response topic and correlation data "
                                 f"are MQTT 5 properties, and this connection speaks MQTT "
                                 f"{self.settings.protocol}; put a reply topic and request id "
                                 f"in the payload instead (docs/protocol.md \"Control\")")
            properties = Properties(PacketTypes.PUBLISH)
            if response_topic is not None:
                properties.ResponseTopic = response_topic
            if correlation_data is not None:
                properties.CorrelationData = bytes(correlation_data)
        client = self._client
        if client is None:
            raise TransportError(f"publish to {topic!r}: {self!r} is not connected; call "
                                 "connect() first")
        if qos > 0:
            self._reserve_slot(topic)
        info = client.publish(topic, data, qos=qos, retain=retain, properties=properties)
        delivery = _PahoDelivery(qos, len(data))
        failed = info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN)
        with self._flow:
            if info.mid in self._early_acks:
                self._early_acks.discard(info.mid)
                delivery._event.set()
                acked = True
            else:
                acked = False
                if not failed and (qos > 0 or info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS):
                    self._deliveries[info.mid] = delivery
            if qos > 0 and (acked or failed):
                self._outstanding = max(0, self._outstanding - 1)
                self._flow.notify_all()
        if failed:
            raise TransportError(f"publish to {topic!r} failed: "
                                 f"{paho.error_string(info.rc)}")
        # MQTT_ERR_NO_CONN: QoS 1 stays in paho's queue and goes out after reconnecting;
        # QoS 0 is dropped (its delivery never completes).
        return delivery

    def _reserve_slot(self, topic: str) -> None:
        deadline = time.monotonic() + self.settings.publish_timeout
        with self._flow:
            while self._outstanding >= self.settings.max_queued:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._client is None:
                    raise TransportError(
                        f"publish to {topic!r}: {self._outstanding} QoS 1 messages to "
                        f"{self.address} unacknowledged for {self.settings.publish_timeout:g} s "
                        f"(connected: {self._connected}); the broker is unreachable or slow")
                self._flow.wait(remaining)
            self._outstanding += 1

    def flush(self, timeout: float | None = None) -> bool:
        with self._flow:
            return self._flow.wait_for(lambda: self._outstanding == 0 or self._client is None,
                                       timeout)

    def _subscribe_now(self, topic_filter: str, qos: int, timeout: float | None) -> None:
        client = self._client
        if client is None:
            return
        timeout = self.settings.connect_timeout if timeout is None else timeout
        with self._flow:
            losses = self._losses
        result, mid = client.subscribe(topic_filter, qos)
        if result != MQTTErrorCode.MQTT_ERR_SUCCESS:
            return   # not connected after all: on_connect subscribes on the next connection
        with self._flow:
            if not self._flow.wait_for(lambda: mid in self._subacks or self._client is None
                                       or self._losses != losses, timeout):
                raise TransportError(f"subscribe to {topic_filter!r}: no SUBACK from "
                                     f"{self.address} within {timeout:g} s")
            if mid not in self._subacks:
                # The connection was lost before the broker answered: the filter is
                # registered, and on_connect subscribes to it again on the new connection
                # (a broker dropping connections under a burst of clients must not make a
                # client give up at start-up).
                return
            codes = self._subacks.pop(mid, [])
        refused = [rc for rc in codes if rc.is_failure]
        if refused:
            with self._state_lock:
                self._subscriptions.pop(topic_filter, None)
            raise TransportError(f"MQTT broker {self.address} refused subscription to "
                                 f"{topic_filter!r}: {refused[0]} (check the ACL)")

    def _unsubscribe_now(self, topic_filter: str) -> None:
        client = self._client
        if client is not None:
            client.unsubscribe(topic_filter)
