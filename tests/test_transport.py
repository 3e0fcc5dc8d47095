"""The transport layer against every broker edgefl supports (tests/brokers.py starts them):
MQTT semantics the roles rely on -- retained messages for late joiners, wildcards, QoS 1 with
large payloads, Last Will when a node dies, reconnect and re-subscribe after a broker restart,
persistent sessions -- plus clear errors (unreachable broker, bad credentials), the ACL in
broker/acl, TLS, the embedded broker and `edgefl broker`."""
from __future__ import annotations

import hashlib
import logging
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.register_assert_rewrite("brokers")
from brokers import (Backend, ServerProcess, messages_within,  # noqa: E402
                     next_message, wait_event)
from edgefl.cli import main  # noqa: E402
from edgefl.transport.base import (CONNECTED, DISCONNECTED, ConnectionEvent, PayloadTooLarge,
                                   TransportError, check_filter, check_topic, topic_matches)
from edgefl.transport.broker import (BrokerError, EmbeddedBroker, find_mosquitto, free_port,
                                     have_python_broker, mosquitto_config)
from edgefl.transport.loopback import LoopbackBroker
from edgefl.transport.mqtt import MqttTransport, parse_broker_url

# The broker fixtures (any_broker, mosquitto_server, mosquitto_acl_server, ...); pytest puts
# tests/ on sys.path, so tests/brokers.py loads as the plugin "brokers".
pytest_plugins = ["brokers"]


def collect_until(transport, payload: bytes, timeout: float = 5.0, linger: float = 0.3):
    """Messages up to and including the first with `payload`, then any arriving within
    `linger` seconds more (to catch what should not have come)."""
    got = list(transport.__dict__.pop("skipped", []))
    deadline = time.monotonic() + timeout
    while not any(m.payload == payload for m in got):
        if time.monotonic() > deadline:
            pytest.fail(f"{payload!r} not received within {timeout} s; got "
                        f"{[(m.topic, m.payload[:20]) for m in got]}")
        got.append(next_message(transport, max(0.1, deadline - time.monotonic())))
    return got + messages_within(transport, linger)


# ---------------------------------------------------------------------------------------
# Pure functions: topic matching, validation, URLs
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("topic_filter, topic, expected", [
    ("a/b", "a/b", True), ("a/b", "a/c", False), ("a/+", "a/b", True),
    ("a/+", "a/b/c", False), ("a/+", "a", False), ("a/#", "a", True), ("a/#", "a/b/c", True),
    ("#", "a/b", True), ("+/+", "a/b", True), ("+", "a/b", False), ("a/+/c", "a/b/c", True),
    ("a/+/c", "a//c", True), ("#", "$SYS/x", False), ("+/x", "$SYS/x", False),
    ("$SYS/#", "$SYS/x", True), ("edgefl/+/update/+", "edgefl/f1/update/client-1", True),
    ("edgefl/+/update/+", "edgefl/f1/update/client-1/chunk", False),
])
def test_topic_matches(topic_filter, topic, expected):
    assert topic_matches(topic_filter, topic) is expected


@pytest.mark.parametrize("bad", ["", "a/#/b", "a/b#", "a+/b", "a/+b"])
def test_bad_filters_are_rejected(bad):
    with pytest.raises(ValueError):
        check_filter(bad)


@pytest.mark.parametrize("bad", ["", "a/+", "a/#", "a\0b"])
def test_bad_topics_are_rejected(bad):
    with pytest.raises(ValueError):
        check_topic(bad)


def test_parse_broker_url():
    a = parse_broker_url("mqtt://user:p%40ss@broker.lan:1884")
    assert (a.host, a.port, a.tls, a.username, a.password) == \
        ("broker.lan", 1884, False, "user", "p@ss")
    assert str(a) == "broker.lan:1884" and "p@ss" not in repr(a)
    b = parse_broker_url("mqtts://gateway")
    assert (b.host, b.port, b.tls, b.username) == ("gateway", 8883, True, None)
    assert parse_broker_url("10.0.0.2").port == 1883
    assert str(parse_broker_url("mqtt://[::1]:1999")) == "[::1]:1999"
    for bad in ("http://x", "mqtt://", "mqtt://h:99999", "mqtt://h/path", ""):
        with pytest.raises(ValueError):
            parse_broker_url(bad)
    # a port variable left unset ("mqtt://127.0.0.1:$PORT") is a mistake, not port 1883
    for bare in ("mqtt://127.0.0.1:", "127.0.0.1:", "mqtts://u:p@gw:"):
        with pytest.raises(ValueError, match=r"empty port after ':' \(leave out the ':' for "
                                             r"the default, (1883|8883)\)"):
            parse_broker_url(bare)


def test_a_password_in_a_broker_url_is_never_printed(tmp_path, capsys, mosquitto_acl_server):
    """mqtt://user:password@host is a broker URL edgefl takes; what it prints about one (a
    refused URL, which a service writes to the journal; `edgefl config show`; `edgefl
    status` finding no nodes) names the URL with its password left out, and still says
    what is wrong with it."""
    secret = "s3cret-pw"
    for bad, cause in ((f"mqtt://edgefl:{secret}@gw:", "empty port"),
                       (f"mqtt://edgefl:{secret}@gw:99999", "bad port"),
                       (f"mqtt://edgefl:{secret}@gw/path", "no path"),
                       (f"http://edgefl:{secret}@gw", "scheme")):
        with pytest.raises(ValueError, match=cause) as exc:
            parse_broker_url(bad)
        assert secret not in str(exc.value) and "edgefl:***@gw" in str(exc.value), exc.value
    with pytest.raises(ValueError, match="TLS files are set") as exc:
        MqttTransport(f"mqtt://edgefl:{secret}@gw", "n", ca_file="/ca.crt")
    assert secret not in str(exc.value), exc.value

    site = tmp_path / "client.yaml"
    site.write_text(f"profile: generic-x86\nnode: {{id: b1, federation: f}}\n"
                    f"state_dir: {tmp_path / 'state'}\n"
                    f"broker: {{url: 'mqtt://edgefl:{secret}@127.0.0.1:'}}\n"
                    f"data: {{name: digits, limit_train: 100}}\n")
    assert main(["client", "--config", str(site)]) != 0
    out, err = capsys.readouterr()
    assert "empty port" in err and secret not in out + err, err
    assert main(["config", "show", "--role", "client", "--config", str(site)]) == 0
    out, err = capsys.readouterr()
    assert "mqtt://edgefl:***@127.0.0.1:" in out and secret not in out + err, out
    assert main(["config", "show", "--role", "client", "--config", str(site), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["values"]["broker"]["url"] == "mqtt://edgefl:***@127.0.0.1:"
    assert secret not in out + err, out

    password = mosquitto_acl_server.users["operator"]
    url = f"mqtt://operator:{password}@127.0.0.1:{mosquitto_acl_server.port}"
    assert main(["status", "--broker", url, "--federation", f"empty-{os.getpid()}",
                 "--wait", "0.5"]) == 0
    out, err = capsys.readouterr()
    assert "no nodes have published a status" in out, (out, err)
    assert password not in out + err, out


def test_settings_are_checked_before_connecting():
    with pytest.raises(ValueError, match="mqtts://"):
        MqttTransport("mqtt://h", "n", ca_file="/ca.crt")
    with pytest.raises(ValueError, match="protocol"):
        MqttTransport("mqtt://h", "n", protocol="4")
    with pytest.raises(ValueError, match="client id"):
        MqttTransport("mqtt://h", "")
    with pytest.raises(ValueError, match="QoS 2"):
        LoopbackBroker().transport("n").publish("t", b"x", qos=2)


# ---------------------------------------------------------------------------------------
# The same behaviour on every broker
# ---------------------------------------------------------------------------------------

def test_publish_subscribe(any_broker: Backend):
    sub = any_broker.connected("sub")
    sub.subscribe(any_broker.topic("x"))
    pub = any_broker.connected("pub")
    for payload in (b"bytes", bytearray(b"bytearray"), memoryview(b"memoryview")):
        assert pub.publish(any_broker.topic("x"), payload).wait(5)
        msg = next_message(sub)
        assert (msg.topic, msg.payload, msg.qos, msg.retain) == \
            (any_broker.topic("x"), bytes(payload), 1, False)
        assert isinstance(msg.payload, bytes) and msg.received_at > 0
    assert pub.flush(5)


def test_retained_reaches_late_subscribers_until_cleared(any_broker: Backend):
    topic = any_broker.topic("round")
    pub = any_broker.connected("aggregator")
    pub.publish(topic, b"round 7", retain=True).wait(5)
    late = any_broker.connected("late")
    late.subscribe(topic)
    msg = next_message(late)
    assert (msg.payload, msg.retain) == (b"round 7", True)
    # forwarded live to a current subscriber: MQTT clears the retain flag
    pub.publish(topic, b"round 8", retain=True).wait(5)
    live = next_message(late)
    assert (live.payload, live.retain) == (b"round 8", False)
    pub.clear_retained(topic).wait(5)
    later = any_broker.connected("later")
    later.subscribe(topic)
    assert [m.payload for m in messages_within(later, 0.4)] == []


def test_wildcard_filters(any_broker: Backend):
    sub = any_broker.connected("aggregator")
    sub.subscribe(any_broker.topic("update/+"))
    sub.subscribe(any_broker.topic("model/#"))
    pub = any_broker.connected("client")
    sent = ["update/c1", "update/c1/extra", "model", "model/c2", "model/c2/x", "round",
            "status/c1"]
    for suffix in sent:
        pub.publish(any_broker.topic(suffix), suffix.encode())
    pub.publish(any_broker.topic("update/end"), b"end")
    got = {m.topic for m in collect_until(sub, b"end")}
    expected = {any_broker.topic(s) for s in ("update/c1", "model", "model/c2", "model/c2/x",
                                           "update/end")}
    assert got == expected


@pytest.mark.parametrize("size", [1 << 20, 10 << 20], ids=["1MB", "10MB"])
def test_qos1_large_payloads(any_broker: Backend, size):
    if any_broker.packet_limit is not None and any_broker.packet_limit < size + 1024:
        pytest.skip(f"{any_broker.name} is configured for packets up to {any_broker.packet_limit}")
    payload = os.urandom(size)
    sub = any_broker.connected("sub")
    sub.subscribe(any_broker.topic("model"))
    pub = any_broker.connected("pub")
    started = time.monotonic()
    assert pub.publish(any_broker.topic("model"), payload, qos=1).wait(8)
    msg = next_message(sub, timeout=8)
    assert len(msg.payload) == size
    assert hashlib.sha256(msg.payload).digest() == hashlib.sha256(payload).digest()
    assert time.monotonic() - started < 8


def test_payload_limit_is_enforced_at_the_sender(any_broker: Backend):
    pub = any_broker.connected("pub", max_payload=1000)
    assert pub.max_payload == 1000
    pub.publish(any_broker.topic("small"), b"x" * 1000)
    with pytest.raises(PayloadTooLarge, match="1,001 bytes"):
        pub.publish(any_broker.topic("big"), b"x" * 1001)


def test_last_will_when_a_node_dies(any_broker: Backend):
    status = any_broker.topic("status/board-1")
    observer = any_broker.connected("observer")
    observer.subscribe(status)
    board = any_broker.transport("board-1")
    board.set_will(status, b'{"online": false}')
    board.connect()
    with pytest.raises(TransportError, match="before connect"):
        board.set_will(status, b"too late")
    board.publish(status, b'{"online": true}', retain=True).wait(5)
    assert next_message(observer).payload == b'{"online": true}'
    board.kill()                                    # socket dropped, no DISCONNECT
    assert next_message(observer).payload == b'{"online": false}'
    late = any_broker.connected("late")
    late.subscribe(status)                          # the will was retained
    msg = next_message(late)
    assert (msg.payload, msg.retain) == (b'{"online": false}', True)
    late.clear_retained(status).wait(5)


def test_clean_close_announces_offline(any_broker: Backend):
    status = any_broker.topic("status/board-2")
    observer = any_broker.connected("observer")
    observer.subscribe(status)
    board = any_broker.transport("board-2")
    board.set_will(status, b"offline")
    board.connect()
    board.publish(status, b"online", retain=True)
    assert next_message(observer).payload == b"online"
    board.close()
    assert [m.payload for m in messages_within(observer, 0.5)] == [b"offline"]
    observer.clear_retained(status).wait(5)


def test_reconnect_and_resubscribe_after_broker_restart(any_broker: Backend, caplog):
    if not any_broker.restartable:
        pytest.skip(f"{any_broker.name} is not started by the tests, so they cannot restart it")
    sub = any_broker.connected("sub")                   # clean session: the broker forgets it
    sub.subscribe(any_broker.topic("r/#"))
    pub = any_broker.connected("pub")
    any_broker.stop()
    wait_event(sub, DISCONNECTED)
    wait_event(pub, DISCONNECTED)
    assert not pub.connected
    # QoS 1 while the broker is down: kept by the client, sent after it reconnects
    queued = pub.publish(any_broker.topic("r/during"), b"queued", retain=True)
    time.sleep(2.5)                                     # a few reconnect attempts
    # one warning said the connection was lost and is retried; paho's own "Client is not
    # connected. Socket: None)" at every attempt (in a dashboard's log, a line a second)
    # says nothing more
    assert not [r for r in caplog.records if "Client is not connected" in r.getMessage()]
    any_broker.start()
    event = wait_event(sub, CONNECTED, timeout=8)
    assert event.session_present is False
    wait_event(pub, CONNECTED, timeout=8)
    assert queued.wait(5)
    assert sub.connected and sub.subscriptions == {any_broker.topic("r/#"): 1}
    pub.publish(any_broker.topic("r/after"), b"live")
    payloads = {m.payload for m in collect_until(sub, b"live", linger=0.0)}
    payloads |= {m.payload for m in messages_within(sub, 0.3)}
    # re-subscribed by itself: sees what was sent while down (live or retained) and after
    assert {b"queued", b"live"} <= payloads
    pub.clear_retained(any_broker.topic("r/during")).wait(5)


def test_persistent_session_keeps_qos1_messages_while_away(any_broker: Backend):
    inbox = any_broker.topic("update/aggregator")
    first = any_broker.transport("aggregator", clean_session=False)
    first.connect()
    first.subscribe(inbox)
    first.close(announce_offline=False)            # gone (e.g. restarting after a crash)
    client = any_broker.connected("client")
    client.publish(inbox, b"update while away").wait(5)
    assert client.flush(5)
    second = any_broker.transport("aggregator", clean_session=False)
    second.connect()
    event = second.receive(5)
    assert isinstance(event, ConnectionEvent) and event.connected
    assert event.session_present is True
    assert next_message(second).payload == b"update while away"
    second.close(announce_offline=False)
    # leave nothing behind on a shared broker: a clean session discards the stored one
    any_broker.connected("aggregator", clean_session=True)


def test_a_network_loop_serves_many_transports_from_one_thread(mosquitto_server):
    from edgefl.transport.netloop import NetworkLoop

    loop = NetworkLoop(name="test-netloop")
    uid = os.urandom(4).hex()
    before = threading.active_count()
    nodes = [MqttTransport(mosquitto_server.url, f"netloop-{i}-{uid}", clean_session=True,
                           network_loop=loop) for i in range(6)]
    try:
        for i, t in enumerate(nodes):
            t.connect()
            t.subscribe(f"edgefl-test/{uid}/to/{i}")
        assert threading.active_count() == before        # no network thread of their own
        # each node sends 40 messages of 64 KiB to the next, all at once: the loop reads and
        # writes six connections both ways, QoS 1 with paho's in-flight window
        payloads = [bytes([k]) * (64 << 10) for k in range(40)]
        deliveries = [d for i, t in enumerate(nodes) for d in
                      (t.publish(f"edgefl-test/{uid}/to/{(i + 1) % 6}", p) for p in payloads)]
        assert all(d.wait(10) for d in deliveries)
        for t in nodes:
            got = [next_message(t).payload for _ in payloads]
            assert got == payloads                         # all of them, in order
    finally:
        for t in nodes:
            t.close(timeout=2.0, announce_offline=False)
    assert loop.clients == 0
    loop.close()


def test_a_network_loops_pass_hook_runs_on_its_thread_and_stops_when_removed(
        mosquitto_server):
    """set_on_pass: the loop's own thread calls the hook after its passes (sim.hosting steps
    its clients there), messages read on that thread are there to handle, a publish made
    in the hook goes out, and once set_on_pass(None) returns the hook is not running and
    never called again."""
    from edgefl.transport.netloop import NetworkLoop

    loop = NetworkLoop(name="test-netloop-hook")
    uid = os.urandom(4).hex()
    a = MqttTransport(mosquitto_server.url, f"hook-a-{uid}", clean_session=True,
                      network_loop=loop)
    b = MqttTransport(mosquitto_server.url, f"hook-b-{uid}", clean_session=True,
                      network_loop=loop)
    calls, threads = [], set()

    def on_pass() -> float:
        calls.append(1)
        threads.add(threading.current_thread().name)
        item = a.receive(timeout=0)
        if item is not None and getattr(item, "topic", "").endswith("/ping"):
            a.publish(f"edgefl-test/{uid}/pong", item.payload)   # answered where it was read
        return 0.05

    try:
        a.connect()
        b.connect()
        a.subscribe(f"edgefl-test/{uid}/ping")
        b.subscribe(f"edgefl-test/{uid}/pong")
        loop.set_on_pass(on_pass)
        b.publish(f"edgefl-test/{uid}/ping", b"hello")
        assert next_message(b).payload == b"hello"
        assert threads == {"test-netloop-hook"}
        loop.set_on_pass(None)
        count = len(calls)
        time.sleep(0.2)
        assert len(calls) == count
    finally:
        for t in (a, b):
            t.close(timeout=2.0, announce_offline=False)
        loop.close()


def test_publish_needs_connect(any_broker: Backend):
    transport = any_broker.transport("never")
    with pytest.raises(TransportError, match="not connected"):
        transport.publish(any_broker.topic("x"), b"x")


# ---------------------------------------------------------------------------------------
# Errors that name the cause
# ---------------------------------------------------------------------------------------

def test_unreachable_broker_names_host_and_port():
    port = free_port()
    transport = MqttTransport(f"mqtt://127.0.0.1:{port}", "board-1")
    started = time.monotonic()
    with pytest.raises(TransportError, match=rf"127\.0\.0\.1:{port}.*refused") as info:
        transport.connect()
    assert time.monotonic() - started < 5
    assert isinstance(info.value, OSError) and not transport.connected


def test_unresolvable_host_is_named():
    transport = MqttTransport("mqtt://no-such-broker.invalid:1883", "board-1")
    with pytest.raises(TransportError, match=r"no-such-broker\.invalid:1883.*resolve"):
        transport.connect()


def test_stopped_loopback_broker_is_unreachable():
    broker = LoopbackBroker()
    broker.stop()
    with pytest.raises(TransportError, match="stopped"):
        broker.transport("board-1").connect()


def test_non_mqtt_listener_times_out_clearly():
    import socket
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        transport = MqttTransport(f"mqtt://127.0.0.1:{port}", "board-1")
        with pytest.raises(TransportError, match=rf"127\.0\.0\.1:{port}.*no CONNACK"):
            transport.connect(timeout=0.5)


def test_a_connection_lost_before_the_suback_does_not_fail_the_subscription():
    """A broker that drops the connection while a SUBSCRIBE is unanswered (seen with the
    pure-Python broker under a burst of ten connecting clients): subscribe() returns, and
    the filter is subscribed again on the next connection, instead of the node giving up
    at start-up with "no SUBACK". The broker here is a few lines of MQTT 3.1.1 on a socket:
    the first connection is cut at its SUBSCRIBE, the second one is answered."""
    import socket
    import threading
    subscribed = threading.Event()

    def read_packet(conn):
        first = conn.recv(1)
        if not first:
            return None, b""
        length, shift = 0, 0
        while True:
            byte = conn.recv(1)[0]
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        body = b""
        while len(body) < length:
            body += conn.recv(length - len(body))
        return first[0] >> 4, body

    def broker(server):
        for attempt in range(2):
            conn, _ = server.accept()
            with conn:
                while True:
                    kind, body = read_packet(conn)
                    if kind is None:
                        break
                    if kind == 1:                                   # CONNECT
                        conn.sendall(b"\x20\x02\x00\x00")
                    elif kind == 8 and attempt == 0:                # SUBSCRIBE: cut
                        conn.shutdown(socket.SHUT_RDWR)
                        break
                    elif kind == 8:                                 # SUBACK, granted QoS 1
                        conn.sendall(b"\x90\x03" + body[:2] + b"\x01")
                        subscribed.set()
                    elif kind == 12:                                # PINGREQ
                        conn.sendall(b"\xd0\x00")
                    elif kind == 14:                                # DISCONNECT
                        break

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        thread = threading.Thread(target=broker, args=(server,), daemon=True)
        thread.start()
        transport = MqttTransport(f"mqtt://127.0.0.1:{port}", "board-1", reconnect_min=0.05,
                                  reconnect_max=0.2)
        transport.connect(timeout=5)
        try:
            transport.subscribe("edgefl/fed/round", qos=1, timeout=5)
            assert transport.subscriptions == {"edgefl/fed/round": 1}
            assert subscribed.wait(5), "not subscribed again after the reconnect"
        finally:
            transport.close()


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_bad_credentials_give_the_reason_code(mosquitto_acl_server, protocol):
    url = mosquitto_acl_server.url
    for username, password in (("client-1", "wrong"), (None, None)):
        transport = MqttTransport(url, "client-1", username=username, password=password,
                                  protocol=protocol, reconnect_min=0.05)
        with pytest.raises(TransportError, match=rf"127\.0\.0\.1:{mosquitto_acl_server.port} "
                                                 r"refused .*reason code 13[45]"):
            transport.connect()


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_acl_a_client_writes_only_its_own_update(mosquitto_acl_server, protocol, caplog):
    users = mosquitto_acl_server.users
    url = mosquitto_acl_server.url
    fed = f"acl{protocol.replace('.', '')}{os.getpid()}"
    made = []

    def node(user):
        t = MqttTransport(url, user, username=user, password=users[user], protocol=protocol,
                          clean_session=True)
        t.connect()
        made.append(t)
        return t

    try:
        aggregator = node("aggregator")
        aggregator.subscribe(f"edgefl/{fed}/update/+")
        client2 = node("client-2")
        client2.subscribe(f"edgefl/{fed}/update/+")          # allowed, but reads nothing
        client1 = node("client-1")
        with caplog.at_level(logging.WARNING, logger="edgefl.transport"):
            client1.publish(f"edgefl/{fed}/update/client-2", b"forged").wait(5)
            client1.publish(f"edgefl/{fed}/update/client-1", b"own").wait(5)
        got = collect_until(aggregator, b"own")
        assert [(m.topic, m.payload) for m in got] == [(f"edgefl/{fed}/update/client-1",
                                                        b"own")]
        assert messages_within(client2, 0.2) == []
        if protocol == "5":                                 # MQTT 5 PUBACK says why
            assert "Not authorized" in caplog.text
        # the aggregator may publish the round; a client may not
        client1.publish(f"edgefl/{fed}/round", b"forged round", retain=True).wait(5)
        aggregator.publish(f"edgefl/{fed}/round", b"round 1", retain=True).wait(5)
        client1.subscribe(f"edgefl/{fed}/round")
        assert [m.payload for m in collect_until(client1, b"round 1", linger=0.2)] == \
            [b"round 1"]
        aggregator.clear_retained(f"edgefl/{fed}/round").wait(5)
    finally:
        for t in made:
            t.close(timeout=1, announce_offline=False)


# ---------------------------------------------------------------------------------------
# Mosquitto-specific: a real process killed, TLS, the broker's packet limit via MQTT 5
# ---------------------------------------------------------------------------------------

def test_will_fires_when_a_process_is_sigkilled(mosquitto_server):
    status = f"edgefl-test/kill{os.getpid()}/status/board-9"
    observer = MqttTransport(mosquitto_server.url, f"observer-{os.getpid()}",
                             clean_session=True)
    observer.connect()
    try:
        observer.subscribe(status)
        code = (
            "import time\n"
            "from edgefl.transport.mqtt import MqttTransport\n"
            f"t = MqttTransport({mosquitto_server.url!r}, 'board-9-{os.getpid()}')\n"
            f"t.set_will({status!r}, b'offline')\n"
            "t.connect()\n"
            f"t.publish({status!r}, b'online', retain=True).wait(5)\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            assert next_message(observer).payload == b"online"
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)
            assert next_message(observer).payload == b"offline"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
        observer.clear_retained(status).wait(5)
    finally:
        observer.close(announce_offline=False)


def test_mqtt5_learns_the_brokers_packet_limit():
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    with EmbeddedBroker(kind="mosquitto", max_packet_bytes=1 << 20) as broker:
        v5 = MqttTransport(broker.url, "v5", protocol="5", clean_session=True)
        v5.connect()
        try:
            assert (1 << 20) - 2048 < v5.max_payload < 1 << 20
            v5.publish("t/ok", b"x" * v5.max_payload).wait(5)
            with pytest.raises(PayloadTooLarge, match="maximum packet size"):
                v5.publish("t/big", b"x" * (1 << 20))
            assert v5.connected
        finally:
            v5.close()


def test_backpressure_when_the_broker_is_gone():
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    with EmbeddedBroker(kind="mosquitto") as broker:
        t = MqttTransport(broker.url, "bp", clean_session=True, max_queued=2,
                          publish_timeout=0.3, reconnect_min=0.05, reconnect_max=0.2)
        t.connect()
        broker.stop()
        wait_event(t, DISCONNECTED)
        t.publish("t/a", b"1")
        t.publish("t/b", b"2")
        started = time.monotonic()
        with pytest.raises(TransportError, match="2 QoS 1 messages.*unacknowledged"):
            t.publish("t/c", b"3")
        assert 0.25 < time.monotonic() - started < 3
        assert not t.flush(0.1)
        t.kill()


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def tls_mosquitto(tmp_path_factory):
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make test certificates)")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "2", "-subj", "/CN=edgefl test CA", cwd=d)
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client-1"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", "san.ext",
                 cwd=d)

    class TlsMosquitto(ServerProcess):
        name = "mosquitto-tls"

        def __init__(self):
            super().__init__(d)
            self.mtls_port = free_port()
            conf = d / "tls.conf"
            lines = [f"listener {self.port} 127.0.0.1",
                     f"cafile {d}/ca.crt", f"certfile {d}/server.crt", f"keyfile {d}/server.key",
                     f"listener {self.mtls_port} 127.0.0.1",
                     f"cafile {d}/ca.crt", f"certfile {d}/server.crt", f"keyfile {d}/server.key",
                     "require_certificate true",
                     "allow_anonymous true", "set_tcp_nodelay true", "persistence false",
                     "log_dest stderr"]
            if os.geteuid() == 0:
                lines.append("user root")
            conf.write_text("\n".join(lines) + "\n")
            self.conf = conf

        def command(self):
            return [find_mosquitto(), "-c", str(self.conf)]

        def ready(self):
            import socket
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return True
            except OSError:
                return False

    server = TlsMosquitto()
    server.start()
    server.dir = d
    yield server
    server.stop()


def test_tls_verifies_the_broker_and_presents_a_client_certificate(tls_mosquitto):
    d = tls_mosquitto.dir
    ok = MqttTransport(f"mqtts://localhost:{tls_mosquitto.port}", "tls-1",
                       ca_file=str(d / "ca.crt"), clean_session=True)
    ok.connect()
    ok.subscribe("t/tls")
    ok.publish("t/tls", b"over TLS").wait(5)
    assert next_message(ok).payload == b"over TLS"
    ok.close()
    # the system CAs do not know our test CA
    with pytest.raises(TransportError, match=rf"TLS handshake with MQTT broker "
                                             rf"localhost:{tls_mosquitto.port}.*verify failed"):
        MqttTransport(f"mqtts://localhost:{tls_mosquitto.port}", "tls-2").connect()
    # insecure mode skips the checks (testing only; off by default)
    insecure = MqttTransport(f"mqtts://localhost:{tls_mosquitto.port}", "tls-3",
                             tls_insecure=True, clean_session=True)
    insecure.connect()
    insecure.close()
    # mutual TLS: the listener requires a client certificate signed by the CA
    mtls_url = f"mqtts://127.0.0.1:{tls_mosquitto.mtls_port}"
    with pytest.raises(TransportError, match="client certificate required"):
        MqttTransport(mtls_url, "tls-4", ca_file=str(d / "ca.crt"),
                      reconnect_min=0.05).connect(timeout=3)
    mutual = MqttTransport(mtls_url, "tls-5", ca_file=str(d / "ca.crt"),
                           cert_file=str(d / "client-1.crt"), key_file=str(d / "client-1.key"),
                           clean_session=True)
    mutual.connect()
    mutual.close()
    with pytest.raises(TransportError, match="no such file"):
        MqttTransport(mtls_url, "tls-6", ca_file=str(d / "missing.crt")).connect()


# ---------------------------------------------------------------------------------------
# Loopback extras: fault injection, session take-over
# ---------------------------------------------------------------------------------------

def test_loopback_injects_duplicates_and_drops():
    broker = LoopbackBroker(duplicate_rate=1.0, seed=1)
    sub = broker.transport("sub")
    sub.connect()
    sub.subscribe("f/#")
    pub = broker.transport("pub")
    pub.connect()
    pub.publish("f/update/c1", b"u")
    first, second = next_message(sub, 1), next_message(sub, 1)
    assert (first.payload, first.duplicate, second.payload, second.duplicate) == \
        (b"u", False, b"u", True)
    lossy = LoopbackBroker(drop_rate=1.0, faults_on="f/update/#")
    sub = lossy.transport("sub")
    sub.connect()
    sub.subscribe("f/#")
    pub = lossy.transport("pub")
    pub.connect()
    pub.publish("f/update/c1", b"lost")
    pub.publish("f/round", b"kept")
    assert [m.payload for m in messages_within(sub, 0.05)] == [b"kept"]
    assert lossy.stats["dropped"] == 1


def test_loopback_session_takeover_fires_the_will():
    broker = LoopbackBroker()
    observer = broker.transport("observer")
    observer.connect()
    observer.subscribe("s/#")
    old = broker.transport("board")
    old.set_will("s/board", b"offline")
    old.connect()
    new = broker.transport("board")
    new.connect()
    assert not old.connected and new.connected
    assert wait_event(old, DISCONNECTED).reason.startswith("session taken over")
    assert next_message(observer, 1).payload == b"offline"
    assert broker.online() == ["board", "observer"]


# ---------------------------------------------------------------------------------------
# The embedded broker and `edgefl broker`
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mosquitto", "python"])
def test_embedded_broker_reports_a_taken_port(kind):
    if kind == "mosquitto" and find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    if kind == "python" and not have_python_broker():
        pytest.skip("amqtt is not installed (pip install 'edgefl[broker]')")
    with EmbeddedBroker(kind=kind) as first:
        assert first.kind == kind and first.url == f"mqtt://127.0.0.1:{first.port}"
        with pytest.raises(BrokerError, match=rf"127\.0\.0\.1:{first.port} is already in use"):
            EmbeddedBroker(port=first.port, kind=kind).start()
    assert not first.running


def test_embedded_broker_prefers_mosquitto_and_configures_it():
    conf = mosquitto_config(1999, max_packet_bytes=123456)
    for line in ("listener 1999 127.0.0.1", "set_tcp_nodelay true", "persistence false",
                 "max_packet_size 123456"):
        assert line in conf.splitlines()
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    with EmbeddedBroker() as broker:
        assert broker.kind == "mosquitto" and broker.pid is not None
    with pytest.raises(ValueError, match="kind"):
        EmbeddedBroker(kind="rabbit")



def test_a_message_over_the_brokers_packet_limit_is_named_not_just_retried(caplog):
    """MQTT 3.1.1 has no way to say "too large": Mosquitto closes the connection of a client
    that sends a packet over its max_packet_size, paho reconnects and sends the same message
    again, and so on every second for as long as the node runs. The transport cannot stop
    the broker from dropping it, but it names the cause: an error with the broker, the size
    of the message and the setting to change, once."""
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    with EmbeddedBroker(kind="mosquitto", max_packet_bytes=64 << 10) as broker:
        t = MqttTransport(broker.url, "oversized", clean_session=True, reconnect_min=0.1,
                          reconnect_max=0.1, connect_timeout=5.0)
        t.connect()
        try:
            with caplog.at_level(logging.WARNING, logger="edgefl.transport"):
                t.publish("edgefl-test/oversized", b"\0" * (100 << 10))
                deadline = time.monotonic() + 10
                while not [r for r in caplog.records
                           if r.name == "edgefl.transport" and r.levelno >= logging.ERROR]:
                    assert time.monotonic() < deadline, "no error naming the packet size"
                    time.sleep(0.05)
                time.sleep(1.0)                 # more drops: still one error
        finally:
            t.kill()
    # (paho's own "Connection reset by peer" lines are under edgefl.transport.paho)
    errors = [r.getMessage() for r in caplog.records
              if r.name == "edgefl.transport" and r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert f"127.0.0.1:{broker.port}" in errors[0] and "102,400 bytes" in errors[0]
    assert "max_packet_size" in errors[0] and "max_payload" in errors[0]


def test_edgefl_broker_refuses_a_packet_limit_below_one(capsys):
    # a negative limit reached the broker's own configuration before
    with pytest.raises(SystemExit) as exc:
        main(["broker", "--max-packet-bytes", "-5"])
    assert exc.value.code == 2
    assert "argument --max-packet-bytes: need a whole number >= 1, got -5" in \
        capsys.readouterr().err


@pytest.mark.parametrize("host, cause", [
    # the resolver's own words differ by machine (no DNS: "Temporary failure in name
    # resolution")
    ("999.1.1.1", r"cannot listen on 999\.1\.1\.1: (Name or service not known|Temporary "
                  r"failure in name resolution|[^()]+) \(--host\)"),
    ("192.0.2.1", r"cannot listen on 192\.0\.2\.1: not an address of this machine \(--host\)"),
])
@pytest.mark.parametrize("port", ["0", None])
def test_edgefl_broker_names_a_host_it_cannot_listen_on(capsys, host, cause, port):
    # '--host 999.1.1.1' said only "[Errno -2] Name or service not known", and with a port
    # given the failed bind read as "port ... is already in use"; the words are the
    # dashboard's (transport.broker.listen_error). 192.0.2.1 is TEST-NET-1, no machine's.
    if find_mosquitto() is None and not have_python_broker():
        pytest.skip("neither mosquitto nor amqtt is installed")
    port = port or str(free_port())
    assert main(["broker", "--port", port, "--host", host]) == 1
    out, err = capsys.readouterr()
    assert out == "" and re.fullmatch(f"edgefl broker: error: {cause}\n", err), err

def test_edgefl_broker_command_runs_until_sigterm():
    if find_mosquitto() is None and not have_python_broker():
        pytest.skip("neither mosquitto nor amqtt is installed")
    proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "broker", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on mqtt://127.0.0.1:" in line, proc.stderr.read()
        url = line.split("listening on ")[1].split()[0]
        t = MqttTransport(url, "cli-check", clean_session=True)
        t.connect()
        t.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
