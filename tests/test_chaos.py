"""The chaos soak in short (tools/chaos.py) and the fault-injecting MQTT proxy it runs
(tools/mqtt_proxy.py), against a real Mosquitto.

- the proxy: a duplicated QoS 1 PUBLISH reaches the subscriber twice (the second with the
  DUP flag) and the sender sees exactly one PUBACK, so later publishes reusing the packet id
  are not acknowledged by a stray one; delays hold the stream without reordering it; a
  severed connection fires the node's Last Will; an "acked and dropped" message is the
  broker losing a message it acknowledged;
- the soak: an `edgefl aggregator` and 4 `edgefl client` processes for 8 rounds while
  clients and the aggregator are killed with SIGKILL and restarted, the broker restarted,
  and PUBLISHes delayed and duplicated: every round aggregated exactly once, no update the
  broker acknowledged lost, every client finishes;
- the soak's own check: with a proxy that acknowledges some updates and drops them, the
  report counts them as lost and the run fails (so "0 lost" above means something);
- what the soak found: Mosquitto publishes the Last Will of every connected client when it
  shuts down, so after a broker restart (sessions kept) each client's retained status said
  "offline" while it was back, and the aggregator closed open rounds without the updates
  that were on their way. Clients now republish their status on every reconnect, and the
  aggregator does not close a round for missing clients being offline until
  `offline_grace_s` after its own reconnect;
- a broker that lost the aggregator's session (the embedded one, persistence off,
  restarted): the round is announced again under a new id -- a secure round's new attempt
  with the announcement's deadline for its first phase, not the old phase's, even when
  the aggregator gets to the reconnect after that has passed; and not while the run is
  paused (the resume announces it, its deadline moved by the pause once).
"""
from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid

import pytest

pytest.register_assert_rewrite("brokers")
from brokers import (MosquittoProcess, messages_within, next_message,  # noqa: E402
                     wait_event)
from edgefl.runconfig import load_run_config    # noqa: E402
from edgefl.transport.base import DISCONNECTED    # noqa: E402
from edgefl.transport.broker import find_mosquitto    # noqa: E402
from edgefl.transport.mqtt import MqttTransport    # noqa: E402
from edgefl.transport.topics import Topics    # noqa: E402
from helpers import StderrGate, import_tool, wait_for    # noqa: E402

chaos = import_tool("chaos")
_proxy = import_tool("mqtt_proxy")
MqttFaultProxy, split_packets, FramingError = \
    _proxy.MqttFaultProxy, _proxy.split_packets, _proxy.FramingError

pytest_plugins = ["brokers"]


@pytest.fixture
def proxied(mosquitto_server):
    """A factory of proxies in front of the module's Mosquitto, and of transports through
    them; everything closed afterwards."""
    made = []

    def proxy(**faults):
        p = MqttFaultProxy(("127.0.0.1", mosquitto_server.port), seed=7, **faults).start()
        made.append(p)
        return p

    def transport(url, role, **options):
        t = MqttTransport(url, f"{role}-{uuid.uuid4().hex[:6]}", clean_session=True,
                          connect_timeout=10, reconnect_min=0.05, reconnect_max=0.5,
                          **options)
        made.append(t)
        return t

    yield proxy, transport
    for thing in reversed(made):
        if isinstance(thing, MqttFaultProxy):
            thing.stop()
        else:
            try:
                thing.close(timeout=1, announce_offline=False)
            except Exception:      # noqa: BLE001 -- a transport the proxy already cut
                thing.kill()


def test_split_packets_keeps_incomplete_tails_and_refuses_non_mqtt():
    publish = bytes([0x32, 7, 0, 3]) + b"a/b" + bytes([0, 5])
    puback = bytes([0x40, 2, 0, 5])
    stream = bytearray(publish + puback + bytes([0x30, 0x80]))       # varint unfinished
    assert split_packets(stream) == [publish, puback] and stream == bytes([0x30, 0x80])
    stream += bytes([1]) + bytes([0, 1]) + b"t" + b"x" * 125          # 128-byte body
    assert [len(p) for p in split_packets(stream)] == [131] and stream == b""
    with pytest.raises(FramingError, match="more than 4 bytes"):
        split_packets(bytearray([0x30, 0xFF, 0xFF, 0xFF, 0xFF, 1]))


def test_duplicated_publish_is_delivered_twice_and_acknowledged_once(proxied,
                                                                     mosquitto_server):
    make_proxy, transport = proxied
    topic = f"edgefl-test/dup{uuid.uuid4().hex[:6]}/update/c1"
    # up: the publisher's PUBLISH duplicated on its way to the broker, which forwards both
    up = make_proxy(duplicate_rate=1.0)
    sub = transport(mosquitto_server.url, "sub")
    sub.connect()
    sub.subscribe(topic)
    pub = transport(up.url, "pub")
    pub.connect()
    for i in range(20):          # more than paho's packet ids in flight: ids get reused
        assert pub.publish(topic, b"m%d" % i).wait(10)
    got = [next_message(sub, 10) for _ in range(40)]
    assert [m.payload for m in got] == [b"m%d" % (i // 2) for i in range(40)]
    assert messages_within(sub, 0.3) == []
    assert up.stats["duplicated"] == 20 and up.stats["absorbed_puback"] == 20
    assert pub.flush(5)          # no publish left waiting for a PUBACK that was swallowed
    # down: the broker's PUBLISH duplicated on its way to a subscriber: a redelivery
    down = make_proxy(duplicate_rate=1.0)
    sub2 = transport(down.url, "sub2")
    sub2.connect()
    sub2.subscribe(topic)
    direct = transport(mosquitto_server.url, "direct")
    direct.connect()
    direct.publish(topic, b"once").wait(10)
    got = [next_message(sub2, 10), next_message(sub2, 10)]
    assert [(m.payload, m.duplicate) for m in got] == [(b"once", False), (b"once", True)]
    deadline = time.monotonic() + 10        # the subscriber acknowledges both copies
    while down.stats.get("absorbed_puback", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert down.stats.get("absorbed_puback") == 1
    assert messages_within(sub2, 0.3) == []


def test_delays_hold_the_stream_in_order(proxied, mosquitto_server):
    make_proxy, transport = proxied
    proxy = make_proxy(delay_rate=1.0, delay_s=(0.02, 0.05))
    topic = f"edgefl-test/delay{uuid.uuid4().hex[:6]}/round"
    sub = transport(proxy.url, "sub")                  # delayed on the way down
    sub.connect()
    sub.subscribe(topic)
    pub = transport(proxy.url, "pub")                  # and on the way up
    pub.connect()
    for i in range(10):
        pub.publish(topic, b"%d" % i)
    assert [next_message(sub, 10).payload for _ in range(10)] == [b"%d" % i
                                                                   for i in range(10)]
    assert proxy.stats["delayed"] >= 20


def test_severed_connection_fires_the_will_and_the_node_reconnects(proxied, mosquitto_server):
    make_proxy, transport = proxied
    proxy = make_proxy()
    status = f"edgefl-test/sever{uuid.uuid4().hex[:6]}/status/board-1"
    observer = transport(mosquitto_server.url, "observer")
    observer.connect()
    observer.subscribe(status)
    board = transport(proxy.url, "board")
    board.set_will(status, b"offline")
    board.connect()
    assert proxy.sever() == 1
    assert next_message(observer, 10).payload == b"offline"
    wait_event(board, DISCONNECTED, 10)
    deadline = time.monotonic() + 10
    while not board.connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert board.connected, "the board did not reconnect through the proxy"


def test_acked_and_dropped_publish_never_arrives(proxied, mosquitto_server):
    make_proxy, transport = proxied
    seen = []
    proxy = make_proxy(drop_acked_rate=1.0)
    proxy.on_acked = lambda direction, topic, payload, at: seen.append((direction, payload))
    topic = f"edgefl-test/drop{uuid.uuid4().hex[:6]}/update/c1"
    sub = transport(mosquitto_server.url, "sub")
    sub.connect()
    sub.subscribe(topic)
    pub = transport(proxy.url, "pub")
    pub.connect()
    assert pub.publish(topic, b"gone").wait(10)        # acknowledged ...
    assert messages_within(sub, 0.5) == []             # ... and never delivered
    assert ("up", b"gone") in seen and proxy.stats["dropped_acked"] == 1


# ---------------------------------------------------------------------------------------
# the soak, short
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--delay-rate", "1.5"], "delay_rate = 1.5: a probability in [0, 1]"),
    (["--clients", "1"], "clients = 1: the soak needs at least 2"),
    (["--client-kills", "-1"], "client_kills = -1: need >= 0"),
    (["--deadline", "0"], "deadline_s = 0.0: need > 0 seconds"),
    # refused by the aggregator's own check of the run config, said here once instead of at
    # every restart of the aggregator until the soak's timeout
    (["--secure", "0.3"], "the soak's run config: privacy.secure_aggregation.threshold: 0.3: "
                          "a fraction of the round's clients must be in (0.5, 1]"),
])
def test_soak_options_are_checked_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        chaos.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _need_mosquitto():
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")


def _mosquitto_fleet(tmp_path, clients: int, rounds: int, round_timeout_s: float,
                     **settings):
    """A Mosquitto of the tests' own in tmp_path/broker (started; the caller stops it) and
    a test_roles_e2e Fleet of `clients` IID clients, all of them in each of `rounds`
    (`settings`: the aggregator's others)."""
    _need_mosquitto()
    from test_roles_e2e import Fleet, write_config

    (tmp_path / "broker").mkdir()
    server = MosquittoProcess(tmp_path / "broker")
    server.start()
    config = load_run_config(write_config(tmp_path, rounds=rounds, clients_per_round=clients,
                                          partition={"name": "iid", "clients": clients}))
    return server, Fleet(tmp_path, config, server.url,
                         settings={"round_timeout_s": round_timeout_s, **settings})


def test_short_chaos_soak_loses_no_update_and_aggregates_each_round_once(tmp_path):
    _need_mosquitto()
    cfg = chaos.SoakConfig(clients=4, rounds=8, seed=3, client_kills=3, aggregator_kills=1,
                           broker_restarts=1, delay_rate=0.05, duplicate_rate=0.1,
                           timeout_s=240)
    kinds = {f.kind for f in chaos.fault_schedule(cfg)}
    assert kinds == {"client_kill", "aggregator_kill", "broker_restart"}
    report = chaos.run_soak(cfg, tmp_path / "soak", say=lambda text: None)
    logs = tmp_path / "soak" / "logs"
    assert chaos.verdict(report) == [], f"{report}\nlogs in {logs}"
    assert report["rounds_completed"] == 8 and report["aggregated_twice"] == []
    assert report["updates_lost"] == []
    faults = report["faults_injected"]
    assert faults["client_kill"] >= 2 and faults["aggregator_kill"] == 1
    assert faults["broker_restart"] == 1
    assert faults["delayed"] > 0 and faults["duplicated"] > 0
    # the run still learned: the clients' updates went in, the model is a real one
    assert report["updates_accepted"] >= 8 * 4 // 2
    assert report["final_accuracy"] > 0.8


def test_signed_chaos_soak_loses_no_update(tmp_path):
    """Every node keyed (docs/security.md): clients killed and restarted re-send their stored,
    signed updates, a killed aggregator resumes and checks them, the proxy delays and
    duplicates; no update is lost and the aggregator refuses none of the boards' own."""
    _need_mosquitto()
    cfg = chaos.SoakConfig(clients=3, rounds=6, seed=5, client_kills=2, aggregator_kills=1,
                           broker_restarts=1, delay_rate=0.05, duplicate_rate=0.1,
                           timeout_s=240, signed=True)
    report = chaos.run_soak(cfg, tmp_path / "soak", say=lambda text: None)
    logs = tmp_path / "soak" / "logs"
    assert chaos.verdict(report) == [], f"{report}\nlogs in {logs}"
    assert report["signed"] and report["updates_lost"] == []
    assert report["signature_refusals"]["aggregator"] == 0, f"logs in {logs}"
    assert report["updates_accepted"] >= 6 * 3 // 2
    texts = [p.read_text() for p in logs.iterdir()]
    assert any("checks updates against" in t for t in texts)
    assert any("checks aggregator messages against" in t for t in texts)


def test_short_asynchronous_chaos_soak_loses_no_update_and_applies_each_step_once(tmp_path):
    """FedBuff (every client busy, a step per 2 updates) under the same faults: every
    step applied once, no update the broker acknowledged lost (applied, or waiting in the
    unfilled last buffer, or in flight at the end), the boards' stored updates re-sent."""
    _need_mosquitto()
    cfg = chaos.SoakConfig(clients=4, rounds=8, seed=3, client_kills=3, aggregator_kills=1,
                           broker_restarts=1, delay_rate=0.05, duplicate_rate=0.1,
                           timeout_s=240, buffer_size=2)
    report = chaos.run_soak(cfg, tmp_path / "soak", say=lambda text: None)
    logs = tmp_path / "soak" / "logs"
    assert chaos.verdict(report) == [], f"{report}\nlogs in {logs}"
    assert report["rounds_completed"] == 8 and report["aggregated_twice"] == []
    assert report["updates_lost"] == [] and report["closed_by"] == {"buffer": 8}
    assert report["updates_accepted"] == 16
    assert report["faults_injected"]["aggregator_kill"] == 1


def test_the_soak_reports_updates_the_broker_acknowledged_and_lost(tmp_path):
    """The soak's check, checked: a proxy that acknowledges and drops every third update
    message (a broker losing what it acknowledged) makes lost updates, the report lists
    them, and the run fails."""
    _need_mosquitto()
    cfg = chaos.SoakConfig(clients=2, rounds=3, seed=1, client_kills=0, aggregator_kills=0,
                           broker_restarts=0, delay_rate=0.0, duplicate_rate=0.0,
                           drop_acked_rate=0.34, deadline_s=1.5, timeout_s=120)
    report = chaos.run_soak(cfg, tmp_path / "lossy", say=lambda text: None)
    assert report["faults_injected"]["dropped_acked"] > 0
    assert report["updates_lost"], report
    assert any(p.startswith("updates lost") for p in chaos.verdict(report))


def test_the_asynchronous_soak_reports_updates_the_broker_acknowledged_and_lost(tmp_path):
    """The same check for the asynchronous mode: updates acknowledged and dropped by the
    proxy are never read, their tasks given up at the deadline: listed as lost."""
    _need_mosquitto()
    cfg = chaos.SoakConfig(clients=3, rounds=4, seed=1, client_kills=0, aggregator_kills=0,
                           broker_restarts=0, delay_rate=0.0, duplicate_rate=0.0,
                           drop_acked_rate=0.34, deadline_s=1.5, timeout_s=400,
                           buffer_size=1)   # (a hang guard: ~25 s on a quiet machine)
    report = chaos.run_soak(cfg, tmp_path / "lossy", say=lambda text: None)
    assert report["faults_injected"]["dropped_acked"] > 0
    assert report["updates_lost"], report
    assert any(p.startswith("updates lost") for p in chaos.verdict(report))


# ---------------------------------------------------------------------------------------
# what the soak found: the wills of a broker restart
# ---------------------------------------------------------------------------------------

def test_broker_restart_wills_neither_hide_clients_nor_close_the_round(tmp_path):
    """Round 1 is open with client-0's and client-1's updates in, client-2 still training
    (held by its training slot), when Mosquitto restarts (SIGTERM: it saves its sessions
    and publishes every connected client's will). Afterwards client-0's retained status is
    online again, and round 1 closes with all three updates once client-2 is done."""
    server, fleet = _mosquitto_fleet(tmp_path, clients=3, rounds=2, round_timeout_s=60)
    watcher = None
    try:
        gate = threading.Semaphore(0)
        fleet.start_client("client-0")
        fleet.start_client("client-1")
        fleet.start_client("client-2", train_slots=gate)
        fleet.start_aggregator()
        deadline = time.monotonic() + 30
        while set(fleet.aggregator.open.received) != {"client-0", "client-1"}:
            assert time.monotonic() < deadline, "round 1 updates of client-0/1 not received"
            time.sleep(0.02)
        server.stop()
        server.start()
        watcher = fleet.transport("watcher", clean_session=True)
        watcher.connect()
        watcher.subscribe(f"edgefl/{fleet.federation}/status/client-0")
        statuses = []
        deadline = time.monotonic() + 15
        while not (statuses and statuses[-1]["online"]):
            assert time.monotonic() < deadline, \
                f"client-0's status stayed {statuses} after the broker restart"
            item = watcher.receive(0.2)
            if item is not None and getattr(item, "payload", None):
                statuses.append(json.loads(item.payload))
        gate.release(10)
        result = fleet.finish(timeout=60)
    finally:
        if watcher is not None:
            watcher.close(timeout=1, announce_offline=False)
        fleet.close()
        server.stop()
    first = result.history[0]
    assert (first["closed_by"], first["updates"]) == ("all", 3), first
    assert [h["updates"] for h in result.history] == [3, 3]


def test_a_broker_that_lost_the_sessions_gets_the_round_answered_again(tmp_path):
    """The embedded broker (persistence off) restarts mid-round 1 with client-2 still
    training. client-2 finishes while the broker is down; its update waits in paho's queue
    and goes out as soon as client-2 is back -- before the aggregator is (it reconnects
    later), so the broker, which forgot the aggregator's session and subscriptions, has
    no one to give it to, yet acknowledges it. The aggregator, back with no session, must
    announce the round again under a new id, so that the clients re-send their stored
    updates: round 1 closes with all three, and the run ends with the model of an
    uninterrupted one (not at the deadline, without client-2's update)."""
    _need_mosquitto()
    from edgefl.transport.broker import EmbeddedBroker
    from test_roles_e2e import Fleet, reference_sha, write_config

    config = load_run_config(write_config(tmp_path, rounds=2, clients_per_round=3,
                                          partition={"name": "iid", "clients": 3}))
    broker = EmbeddedBroker(kind="mosquitto").start()
    fleet = Fleet(tmp_path, config, broker.url, settings={"round_timeout_s": 40})
    # the aggregator comes back 2 s after the clients (they retry every 0.05-0.5 s)
    fleet.aggregator.transport = MqttTransport(
        broker.url, f"aggregator-{fleet.uid}", reconnect_min=2.0, reconnect_max=2.0,
        connect_timeout=5.0)
    try:
        gate = threading.Semaphore(0)
        fleet.start_client("client-0")
        fleet.start_client("client-1")
        late = fleet.start_client("client-2", train_slots=gate)
        fleet.start_aggregator()
        deadline = time.monotonic() + 30
        while set(fleet.aggregator.open.received) != {"client-0", "client-1"} \
                or late.job is None:
            assert time.monotonic() < deadline, "round 1: client-0/1's updates not received"
            time.sleep(0.02)
        broker.stop()
        gate.release(10)
        deadline = time.monotonic() + 20
        while late.stats["uploads"] < 1:        # queued by paho: the broker is down
            assert time.monotonic() < deadline, "client-2 did not finish training"
            time.sleep(0.02)
        started = time.monotonic()
        broker.start()
        result = fleet.finish(timeout=60)
        took = time.monotonic() - started
    finally:
        fleet.close()
        broker.stop()
    first = result.history[0]
    assert (first["closed_by"], first["updates"]) == ("all", 3), first
    assert took < 20, f"the run took {took:.1f} s after the restart (round 1's deadline?)"
    assert late.stats["resent"] >= 1 and late.stats["trained"] == 2
    from edgefl.checkpoint import model_sha256
    assert model_sha256(result.params) == reference_sha(config)


class StalledLogLine:
    """The aggregator's thread stalled, for real, at one of its log lines: a handler on its
    logger writes the lines starting with `prefix` (only) to a pipe nobody drains
    (helpers.StderrGate jammed: a stalled journald), so the thread logging one blocks in
    the kernel until release(). `reached` is set as it starts writing it. With it a test
    puts the aggregator's handling of an event after a deadline, as a busy board does."""

    def __init__(self, prefix: str, logger: str = "edgefl.roles.aggregator",
                 level: int = logging.WARNING, when=lambda record: True):
        self.prefix, self.logger = prefix, logging.getLogger(logger)
        self.held_level, self.when = level, when
        self.reached = threading.Event()
        self.gate = StderrGate()
        self.stream = open(self.gate.write_fd, "w", buffering=1, closefd=False)
        self.handler = logging.StreamHandler(self.stream)
        self.handler.addFilter(self._only)
        self.level = self.logger.level

    def _only(self, record) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.prefix) \
                and self.when(record):
            self.reached.set()
            return True
        return False

    def __enter__(self):
        self.gate.jam()
        self.logger.setLevel(self.held_level)      # the held line's level
        self.logger.addHandler(self.handler)
        return self

    def release(self) -> None:
        self.gate.release()

    def __exit__(self, *exc):
        self.release()
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        self.stream.close()
        self.gate.close()


def _secure_fleet(tmp_path, round_timeout_s: float, control=None, clients: int = 3,
                  threshold: float = 1.0, **settings):
    """(broker, fleet) of a one-round secure run of `clients` clients, all tasked, of which
    `threshold` must answer (default: all three), over an embedded Mosquitto without
    persistence (a restart loses every session), none of its roles started; `settings`:
    more of the aggregator's."""
    from edgefl.transport.broker import EmbeddedBroker
    from test_roles_e2e import Fleet, write_config

    config = load_run_config(write_config(
        tmp_path, rounds=1, clients_per_round=clients,
        partition={"name": "iid", "clients": clients},
        privacy={"secure_aggregation": {"threshold": threshold}}))
    broker = EmbeddedBroker(kind="mosquitto").start()
    return broker, Fleet(tmp_path, config, broker.url,
                         settings={"round_timeout_s": round_timeout_s, **settings},
                         control=control)


def _keys_in_but_client_2s(fleet):
    """client-0, client-1 and the aggregator started (client-2 not), and round 1's first
    secure phase holding their two keys: (the aggregator, its attempt, the phase's
    deadline)."""
    fleet.start_client("client-0")
    fleet.start_client("client-1")
    fleet.start_aggregator()
    agg = fleet.aggregator
    first, deadline = agg.open.secure, agg.open.deadline
    wait_for(lambda: len(first.keys) == 2, timeout=10,
             what="round 1: client-0/1's keys (client-2 not started)")
    return agg, first, deadline


@contextlib.contextmanager
def _held_at_the_close_of(fleet, phase: str):
    """The fleet's three clients and its aggregator started, the aggregator's thread held
    at the log line of its secure `phase`'s close (StalledLogLine), until stall.release()
    or the block's end."""
    with StalledLogLine("round %d: secure phase %r closed", level=logging.INFO,
                        when=lambda record: record.args[1] == phase) as stall:
        for name in ("client-0", "client-1", "client-2"):
            fleet.start_client(name)
        fleet.start_aggregator()
        assert stall.reached.wait(20), f"the {phase} phase did not close"
        yield stall


def test_a_secure_attempt_restarted_by_a_lost_session_gets_the_announcements_deadline(
        tmp_path):
    """A secure round (threshold: all 3 clients) waits in its first phase for client-2's
    keys when the embedded broker (persistence off) restarts. The aggregator, back with no
    session, handles that after the phase's deadline has passed (held at its "lost our
    session" log line: a stalled log, a busy board) and announces the round again: a new
    attempt with a fresh deadline. The new attempt's first phase must get that deadline,
    not the old phase's, which has passed and would fail it at once with no keys (a
    secure_round_failed and a third announcement) before any board could answer."""
    _need_mosquitto()
    broker, fleet = _secure_fleet(tmp_path, 4.0)
    try:
        agg, first, deadline = _keys_in_but_client_2s(fleet)
        with StalledLogLine("broker lost our session") as stall:
            broker.restart()
            assert stall.reached.wait(10), "the aggregator did not see its session lost"
            fleet.start_client("client-2")     # nothing to answer until it is announced again
            wait_for(lambda: time.time() > deadline + 0.2, timeout=10,
                     what="the first phase's deadline to pass")
            assert agg.open.secure is first and first.phase == "keys", \
                "the aggregator was not held at the reconnect: the test proves nothing"
            stall.release()
            result = fleet.finish(timeout=30)
    finally:
        fleet.close()
        broker.stop()
    record = result.history[0]
    assert record["closed_by"] == "secure"
    assert record["announcements"] == 2, \
        f"{record['announcements']} announcements: the restarted attempt failed at once"
    assert record["secure"]["survivors"] == 3 and record["secure"]["dropped"] == []


def test_a_paused_secure_round_neither_fails_nor_closes_until_resumed(tmp_path):
    """A pause holds a secure round as it holds a plain one: round 1 waits in its first
    phase for client-2's keys (client-2 not started) when the run is paused, and stays
    paused past the phase's deadline. Before, _collect_secure never looked at the pause:
    the phase failed at its deadline and the round was announced again while paused (and
    would have closed, had enough boards answered). Now nothing happens until the resume,
    which announces the round again (a new attempt: fresh keys) with the deadline moved by
    the pause, and the round closes "secure" with all three."""
    _need_mosquitto()
    from edgefl.roles.control import RunControl

    control = RunControl("paused-secure-run")
    held = threading.Event()
    control.on_hold = held.set
    broker, fleet = _secure_fleet(tmp_path, 6.0, control)
    try:
        agg, first, deadline = _keys_in_but_client_2s(fleet)
        control.paused.set()
        assert held.wait(10), "the aggregator did not hold the secure round"
        wait_for(lambda: time.time() > deadline + 1.0, timeout=10,
                 what="the first phase's deadline to pass while paused")
        assert agg.open.counts["announcements"] == 1 and agg.open.secure is first, \
            "the secure round was announced again while paused"
        assert first.phase == "keys", f"the secure round moved on while paused: {first.phase}"
        fleet.start_client("client-2")
        control.paused.clear()
        result = fleet.finish(timeout=30)
    finally:
        fleet.close()
        broker.stop()
    record = result.history[0]
    assert record["closed_by"] == "secure", record
    assert record["announcements"] == 2, record
    assert record["secure"]["survivors"] == 3 and record["secure"]["dropped"] == [], record


def test_a_pause_once_the_unmask_requests_are_out_lets_the_round_close(tmp_path):
    """The pause comes as the secure round's masked inputs are in and its unmask requests
    are about to go out (the aggregator held at that log line). The boards' reveals then
    arrive while paused. A new attempt at the resume, over the same updates with fresh
    masks and perhaps other survivors, would leave the aggregator with two sums whose
    difference could be one board's update; and an unmasked sum held uncommitted through
    the pause would be unmasked again after a restart. So the round runs to its close,
    committed, paused or not, and the pause holds the next round. One announcement, closed
    "secure" by all three, without a resume."""
    _need_mosquitto()
    from edgefl.roles.control import RunControl

    control = RunControl("paused-unmask-run")
    broker, fleet = _secure_fleet(tmp_path, 20.0, control)
    try:
        with _held_at_the_close_of(fleet, "masked") as stall:
            control.paused.set()
            stall.release()
            result = fleet.finish(timeout=30)        # paused still: the last round closes
    finally:
        fleet.close()
        broker.stop()
    record = result.history[0]
    assert record["closed_by"] == "secure" and record["announcements"] == 1, record
    assert record["secure"]["survivors"] == 3 and record["secure"]["dropped"] == [], record


@pytest.mark.parametrize("client_2", ["stopped", "restarted"])
def test_an_unmask_phase_that_fails_stops_the_run_instead_of_a_second_attempt(tmp_path,
                                                                              client_2):
    """client-2 stops once the masked inputs are in (the aggregator held at the masked
    phase's close), so the unmask phase gets 2 of the 3 reveals it needs and fails at its
    deadline. Announcing the round again, a new attempt over the same stored updates, would
    let an aggregator that kept the late reveals unmask both sums and subtract them: the
    run stops instead, saying why, with round 1 not aggregated. Restarted, client-2 has no
    contribution left and says so (a refusal): the error is still the unmask phase's, with
    its reason, not the one for a round that refusals leave below its threshold."""
    _need_mosquitto()
    from edgefl.errors import ConfigError

    broker, fleet = _secure_fleet(tmp_path, 3.0)
    try:
        with _held_at_the_close_of(fleet, "masked") as stall:
            fleet.clients["client-2"].stop.set()
            fleet.threads["client-2"].join(10)
            if client_2 == "restarted":
                watcher = fleet.transport("watcher", clean_session=True)
                watcher.connect()
                try:
                    watcher.subscribe(Topics(fleet.federation).status("client-2"), qos=1)
                    fleet.start_client("client-2")
                    wait_for(lambda: b'"refused"' in next_message(watcher, 10).payload,
                             timeout=10, what="the restarted client-2's refusal")
                finally:
                    watcher.close(timeout=1, announce_offline=False)
            stall.release()
            with pytest.raises(ConfigError, match=r"round 1: the unmask phase failed.*"
                                                  r"the run stops here"):
                fleet.finish(timeout=30)
        assert fleet.aggregated() == []
    finally:
        fleet.close()
        broker.stop()


def test_a_board_that_revealed_for_a_round_takes_no_part_in_its_later_attempts(tmp_path):
    """Round 1's unmask phase has closed (every board revealed; the aggregator held at that
    log line) when the round is announced again under a new attempt, as an aggregator
    restarted from its checkpoint mid-round does. A board that answered an unmask request
    must not take part with the same contribution: two unmasked sums over it, with other
    survivors, could be subtracted. Each board sits the new attempt out (no keys)."""
    _need_mosquitto()
    from edgefl.roles.messages import attempt_tag

    broker, fleet = _secure_fleet(tmp_path, 20.0)
    try:
        with _held_at_the_close_of(fleet, "unmask") as stall:
            agg = fleet.aggregator
            agg._announce()                     # a second attempt of round 1
            again = attempt_tag(agg.open.announce_id)
            time.sleep(2.0)
            joined = [n for n, c in fleet.clients.items() if c._secure_tag == again]
            assert joined == [], f"{joined} took part again after revealing"
            stall.release()
    finally:
        fleet.close()
        broker.stop()


def test_an_aggregator_restarted_mid_unmask_ends_the_run_naming_the_boards_that_revealed(
        tmp_path):
    """The aggregator stops (as a kill would) right after sending round 1's unmask
    requests; every board reveals, and so drops its contribution. The aggregator started
    again from its checkpoint announces round 1 again. Each board must say, in its status,
    that it sits the round out and why; the aggregator, with too few boards left for the
    threshold, must end the run with an error naming them, at once -- not announce the
    round again at every deadline until an operator stops it."""
    _need_mosquitto()
    from edgefl.errors import ConfigError
    from edgefl.roles.aggregator import Aggregator, AggregatorSettings

    broker, fleet = _secure_fleet(tmp_path, 3.0)
    names = ("client-0", "client-1", "client-2")
    try:
        with StalledLogLine("round %d: secure phase %r closed", level=logging.INFO,
                            when=lambda record: record.args[1] == "masked") as stall:
            for name in names:
                fleet.start_client(name)
            fleet.start_aggregator()
            assert stall.reached.wait(20), "the masked phase did not close"
            first = fleet.aggregator
            run = first.run_id
            first.stop.set()                   # stops once its unmask requests are out
            stall.release()
        wait_for(lambda: all(fleet.clients[n]._secure_revealed == (run, 1) for n in names),
                 timeout=10, what="every board to answer its unmask request")
        fleet._agg_thread.join(10)             # (the boards wait on: not joined)
        assert not fleet._agg_thread.is_alive(), "the first aggregator did not stop"
        assert fleet.result.history == [], "round 1 was committed"
        # a deadline the test does not wait out: the boards' statuses must end the run
        fleet.aggregator = Aggregator(
            fleet.plan, fleet.transport("aggregator"), tmp_path / "agg",
            AggregatorSettings(node_id="aggregator", federation=fleet.federation,
                               round_timeout_s=120.0))
        fleet.start_aggregator()
        with pytest.raises(ConfigError) as caught:
            fleet.finish(timeout=30)
    finally:
        fleet.close()
        broker.stop()
    message = str(caught.value)
    assert "round 1" in message and "revealed" in message, message
    for name in names:
        assert name in message, message


@pytest.mark.parametrize("clients, offline", [(3, ()), (5, ("client-3",))])
def test_a_secure_round_waits_in_no_phase_for_a_board_that_refused_it(tmp_path, clients,
                                                                      offline):
    """Secure aggregation needing 60% of the boards, and the last board refuses the run (its
    limits: 650 parameters, it trains at most 100). The round must go on with the others at
    once, phase by phase, not wait out each phase's 30 s deadline for a board that said it
    will not answer -- also when another missing board has gone offline (its status says
    so): a board that refused is not waited for longer than one that went away."""
    _need_mosquitto()
    broker, fleet = _secure_fleet(tmp_path, 30.0, clients=clients, threshold=0.6,
                                  offline_grace_s=0.2)
    refusing = f"client-{clients - 1}"
    try:
        for name in (f"client-{i}" for i in range(clients - 1)):
            fleet.start_client(name)
            if name in offline:
                fleet.clients[name].stop.set()
                fleet.threads[name].join(10)
        fleet.start_client(refusing, max_params=100)
        fleet.start_aggregator()
        result = fleet.finish(timeout=20)
    finally:
        fleet.close()
        broker.stop()
    record = result.history[0]
    assert record["closed_by"] == "secure", record
    assert record["updates"] == clients - 1 - len(offline), record


def test_no_announcement_from_a_lost_session_while_paused(tmp_path):
    """Round 1 is paused (RunControl, as `edgefl ctl pause`) and stays paused past its
    deadline while the embedded broker (persistence off) restarts. The aggregator, back
    with no session, must not announce the round again while paused: the resume does,
    moving the deadline by the paused time -- which, added to the fresh deadline of a
    re-announcement made during the pause, would hold the round for the pause twice over.
    So: two announcements (the round's, the resume's), the second's deadline the first's
    plus the pause."""
    _need_mosquitto()
    from edgefl.roles.control import RunControl
    from edgefl.transport.broker import EmbeddedBroker
    from test_roles_e2e import Fleet, write_config

    config = load_run_config(write_config(tmp_path, rounds=1, clients_per_round=2,
                                          partition={"name": "iid", "clients": 2}))
    broker = EmbeddedBroker(kind="mosquitto").start()
    control = RunControl("paused-run")
    held = threading.Event()
    control.on_hold = held.set
    fleet = Fleet(tmp_path, config, broker.url, settings={"round_timeout_s": 3.0},
                  control=control)
    watcher = None
    try:
        fleet.start_client("client-0")
        fleet.start_aggregator()
        agg = fleet.aggregator
        opened = agg.open.deadline
        paused_at = time.time()
        control.paused.set()
        assert held.wait(10), "the aggregator did not hold the round"
        wait_for(lambda: time.time() > opened + 0.2, timeout=10,
                 what="round 1's deadline to pass while paused")
        broker.restart()
        watcher = fleet.transport("watcher", clean_session=True)
        watcher.connect()
        watcher.subscribe(Topics(fleet.federation).events(), qos=1)
        # client-1's status reaches the aggregator only after its reconnect (the broker
        # kept nothing): once it is in, the lost session has been handled
        fleet.start_client("client-1")
        wait_for(lambda: agg.online.get("client-1"), timeout=10,
                 what="the aggregator to be back and see client-1")
        assert agg.open.counts["announcements"] == 1, "announced again while paused"
        control.paused.clear()
        resumed_at = time.time()
        result = fleet.finish(timeout=30)
        events = [json.loads(m.payload) for m in messages_within(watcher, 0.5)]
    finally:
        if watcher is not None:
            watcher.close(timeout=1, announce_offline=False)
        fleet.close()
        broker.stop()
    record = result.history[0]
    assert record["announcements"] == 2, record
    assert record["closed_by"] == "all" and record["updates"] == 2, record
    again = [e for e in events if e["event"] == "round_opened"]
    assert [e["announcement"] for e in again] == [2], again
    # the resume's deadline: the first moved once by the pause the aggregator measured,
    # which lies within the test's, give or take a poll
    moved, paused = again[-1]["deadline"] - opened, resumed_at - paused_at
    assert paused - 1.0 <= moved <= paused + 1.0, \
        f"deadline moved {moved:.1f} s by a pause of {paused:.1f} s"


def test_an_upload_cut_off_mid_chunks_completes_and_counts_once(tmp_path, proxied,
                                                                 mosquitto_server):
    """client-2 uploads its round-1 update in 1 KiB chunks through a slow link (every
    update chunk held 0.3 s) and the link is cut once the aggregator holds part of it:
    the chunks not acknowledged go out again after the reconnect (persistent session), the
    update is completed and counted once, and the run ends with the model of an
    uninterrupted one."""
    from edgefl.checkpoint import model_sha256
    from edgefl.roles import Client, ClientSettings
    from test_roles_e2e import Fleet, reference_sha, write_config

    make_proxy, _ = proxied
    proxy = make_proxy(hold_s={("up", "update"): 0.3})
    config = load_run_config(write_config(tmp_path, rounds=2, clients_per_round=3,
                                          partition={"name": "iid", "clients": 3}))
    fleet = Fleet(tmp_path, config, mosquitto_server.url, settings={"round_timeout_s": 40})
    try:
        fleet.start_client("client-0")
        fleet.start_client("client-1")
        data = fleet.run.clients[2]
        slow = Client(ClientSettings("client-2", fleet.federation, exit_when_finished=True,
                                     max_payload=1024),
                      (data.x, data.y),
                      MqttTransport(proxy.url, f"client-2-{fleet.uid}", reconnect_min=0.05,
                                    reconnect_max=0.5, connect_timeout=5.0),
                      tmp_path / "client-2")
        thread = threading.Thread(target=slow.run, daemon=True)
        thread.start()
        fleet.threads["client-2"] = thread
        assert slow.ready.wait(10)
        fleet.start_aggregator()
        agg = fleet.aggregator
        deadline = time.monotonic() + 30
        while agg.reassembler.pending == 0 or agg.open.round != 1:
            assert time.monotonic() < deadline, "no partial update from client-2"
            time.sleep(0.01)
        assert "client-2" not in agg.open.received
        assert proxy.sever() >= 1
        result = fleet.finish(timeout=60)
    finally:
        fleet.close()
        slow.stop.set()
    first = result.history[0]
    assert (first["closed_by"], first["updates"]) == ("all", 3), first
    assert result.stats["rejected"] == 0, result.stats
    assert slow.stats["trained"] == 2
    assert model_sha256(result.params) == reference_sha(config)


def test_a_crashed_broker_back_with_a_stale_retained_round_is_corrected(tmp_path):
    """Mosquitto with the repo's config (persistence on) saves its state during round 2
    (SIGUSR1, as an autosave would), then is killed -9 during round 3 and restarted: it
    comes back with the sessions and with round 2's announcement retained. A client that
    joins now, needed in round 3 and in no earlier round, must hear of round 3 without
    waiting for the deadline: the aggregator, reconnected, puts its open round's
    announcement back."""
    _need_mosquitto()
    import signal

    from edgefl.strategies import select_clients
    from test_roles_e2e import Fleet, write_config

    config = load_run_config(write_config(tmp_path, rounds=3))      # 4 clients, 3 a round
    picked = [select_clients(config.seed, r, range(4), 3) for r in (1, 2, 3)]
    late = next(c for c in range(4) if c not in picked[0] + picked[1] and c in picked[2])
    held = next(c for c in picked[0] if c in picked[1])
    (tmp_path / "broker").mkdir()
    server = MosquittoProcess(tmp_path / "broker")
    server.start()
    fleet = Fleet(tmp_path, config, server.url, settings={"round_timeout_s": 40})
    try:
        class Gate:                       # held trains round 1, then waits for open
            def __init__(self):
                self.rounds, self.open = 0, threading.Event()

            def acquire(self):
                self.rounds += 1
                if self.rounds > 1:
                    self.open.wait(60)

            def release(self):
                pass

        gate = Gate()
        for c in sorted(set(picked[0] + picked[1]) - {late}):
            fleet.start_client(f"client-{c}", train_slots=gate if c == held else None)
        fleet.start_aggregator()
        agg = fleet.aggregator

        def wait_round(r, updates):
            deadline = time.monotonic() + 30
            while agg.open is None or agg.open.round != r or len(agg.open.received) < updates:
                assert time.monotonic() < deadline, f"round {r}: {updates} updates not in"
                time.sleep(0.02)

        wait_round(2, 2)
        db = tmp_path / "broker" / "mosquitto.db"
        server.proc.send_signal(signal.SIGUSR1)         # save now: round 2 retained
        deadline = time.monotonic() + 10
        while not (db.exists() and db.stat().st_size > 0):
            assert time.monotonic() < deadline, "mosquitto saved no database"
            time.sleep(0.02)
        gate.open.set()
        wait_round(3, 0)
        server.proc.send_signal(signal.SIGKILL)         # a crash: round 3 not saved
        server.proc.wait(10)
        server.proc = None
        server.start()
        started = time.monotonic()
        fleet.start_client(f"client-{late}")
        result = fleet.finish(timeout=60)
        took = time.monotonic() - started
    finally:
        fleet.close()
        server.stop()
    third = result.history[2]
    assert (third["closed_by"], third["updates"]) == ("all", 3), third
    assert took < 20, f"round 3 took {took:.1f} s after the restart (its deadline?)"


def test_no_announcements_pile_up_while_the_broker_is_away(tmp_path):
    """Round 1 has a 0.5 s deadline and no update (its clients held), and Mosquitto is
    down for 4 s. Announcing the round again at each deadline while disconnected only
    queues another announcement and model behind the last, each under a new id, for as
    long as the broker is away (and every client that uploaded then re-sends its update
    once per id, past its chunk budget). None is made while the connection is down; after
    the restart the round is announced again and finishes."""
    # min_updates 2: after the restart the 0.5 s deadline would otherwise close the round
    # on whichever update came first (seen under CI's load: 1 of 2)
    server, fleet = _mosquitto_fleet(tmp_path, clients=2, rounds=1, round_timeout_s=0.5,
                                     min_updates=2)
    try:
        gate = threading.Semaphore(0)
        fleet.start_client("client-0", train_slots=gate)
        fleet.start_client("client-1", train_slots=gate)
        fleet.start_aggregator()
        agg = fleet.aggregator
        deadline = time.monotonic() + 10
        while agg.transport.connected:
            if time.monotonic() > deadline:
                pytest.fail("the aggregator never saw a connection to stop")
            if agg.open.counts["announcements"] >= 2:
                server.stop()
            time.sleep(0.01)
        before = agg.open.counts["announcements"]
        time.sleep(4)
        during = agg.open.counts["announcements"] - before
        server.start()
        gate.release(10)
        result = fleet.finish(timeout=30)
    finally:
        fleet.close()
        server.stop()
    assert during == 0, f"{during} announcements made while the broker was down"
    assert result.history[0]["updates"] == 2


def test_a_secure_round_waits_out_a_board_known_offline_past_its_attempts(tmp_path):
    """A board whose status says it is offline (a site's power cut) is waited for, as a
    plain round waits: the attempts that fail while every board missing is known offline
    are not counted against max_attempts (which ended such a run after five deadlines,
    ConfigError, the run to be started again from its model). It comes back, and the
    round closes with all three."""
    _need_mosquitto()
    broker, fleet = _secure_fleet(tmp_path, 1.0)
    try:
        c2 = fleet.start_client("client-2")
        c2.stop.set()                       # a clean stop: its retained status is offline
        fleet.threads["client-2"].join(10)
        del fleet.clients["client-2"], fleet.threads["client-2"]
        fleet.start_client("client-0")
        fleet.start_client("client-1")
        fleet.start_aggregator()
        agg = fleet.aggregator
        wait_for(lambda: agg.open is not None, timeout=10, what="round 1 to open")
        time.sleep(8)                       # six attempts' deadlines, client-2 offline
        assert fleet.error is None, fleet.error
        fleet.start_client("client-2")      # the power is back
        fleet.finish(timeout=60)
        assert fleet.aggregated() == [1]
    finally:
        fleet.close()
        broker.stop()


@pytest.mark.parametrize("board", ["silent", "another size"])
def test_a_secure_round_that_cannot_reach_its_threshold_ends_after_its_attempts(
        tmp_path, monkeypatch, board):
    """Secure aggregation needing all 3 boards, and client-2 never lets a phase reach it
    without saying why: it is silent (online as far as the aggregator knows: never
    started, so no Last Will fires), or it sends a masked input of another size at every
    attempt (a board on another model). No refusal names it, so _secure_unreachable cannot
    end the run, and before, each failed attempt announced the round again, for ever: the
    run hung. Now after privacy.secure_aggregation.max_attempts failed attempts (its
    default, 5) the run stops with an error naming why and the board, nothing aggregated."""
    _need_mosquitto()
    import dataclasses

    from edgefl.errors import ConfigError
    from edgefl.privacy import secagg

    if board == "another size":
        masked_input = secagg.SecAggClient.masked_input

        def shorter(self, msg, contribution, *args, **kwargs):
            if self.client == 2:
                contribution = dataclasses.replace(contribution,
                                                   vector=contribution.vector[:-1])
            return masked_input(self, msg, contribution, *args, **kwargs)

        monkeypatch.setattr(secagg.SecAggClient, "masked_input", shorter)
    broker, fleet = _secure_fleet(tmp_path, 1.5)
    try:
        for name in ("client-0", "client-1") + (("client-2",) if board != "silent" else ()):
            fleet.start_client(name)
        fleet.start_aggregator()
        with pytest.raises(ConfigError) as caught:
            fleet.finish(timeout=30)
        assert fleet.aggregated() == []
    finally:
        fleet.close()
        broker.stop()
    message = str(caught.value)
    assert "round 1" in message and "5 attempts" in message and "max_attempts" in message, \
        message
    assert "(attempts 1, 2, 3, 4, 5)" in message, message
    assert ("client-2 did not answer phase 'keys'" if board == "silent" else
            "650 words from client-0, client-1; 649 words from client-2") in message, message
