"""Resource limits (docs/limits.md): the bounded receive queue (a full queue drops, counts and
logs instead of stalling paho's network thread), the reassembler's byte and chunk budgets (a
client flooding its update topic is cut off for the round, logged once, and the round goes on
without it), a full disk while checkpointing (a real small tmpfs, and simulated ENOSPC: the
previous checkpoint stays intact and a restart resumes from it), and the clean close of an
MQTT transport, which must never make Mosquitto publish the Last Will."""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import threading

import numpy as np
import pytest

from edgefl.params import LayerTable
from edgefl.roles import (Aggregator, AggregatorCheckpoint, AggregatorSettings, Client,
                          ClientSettings, RunPlan, default_client_ids)
from edgefl.roles import state as state_module
from edgefl.roles.state import (StateWriteError, append_journal, atomic_write, read_journal)
from edgefl.checkpoint import model_sha256
from edgefl.runs.prepare import prepare_run
from edgefl.sim import simulate
from edgefl.strategies import State
from edgefl.transport import wire
from edgefl.transport.base import ConnectionEvent, Message, ReceiveQueue
from edgefl.transport.loopback import LoopbackBroker
from edgefl.transport.mqtt import MqttTransport
from edgefl.transport.topics import Topics

pytest.register_assert_rewrite("brokers")
from brokers import messages_within, next_message    # noqa: E402
from helpers import load_small_run, wait_for    # noqa: E402

# tests/ on sys.path, so tests/brokers.py loads as the plugin "brokers".
pytest_plugins = ["brokers"]


def fleet(tmp_path, config, broker, settings):
    """An aggregator and the config's clients on `broker`; the clients' threads not started."""
    run = prepare_run(config, progress=False)
    ids = default_client_ids(len(run.setup.clients))
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, ids, test=(run.dataset.x_test, run.dataset.y_test),
                   description=config.to_dict())
    aggregator = Aggregator(plan, broker.transport("aggregator"), tmp_path / "agg", settings)
    threads = []
    for c, node in enumerate(ids):
        client = Client(ClientSettings(node, "fed", exit_when_finished=True),
                        (run.clients[c].x, run.clients[c].y), broker.transport(node),
                        tmp_path / node)
        threads.append(threading.Thread(target=client.run, daemon=True))
    return run, aggregator, threads


def run_in_thread(aggregator):
    out = {}

    def body():
        try:
            out["result"] = aggregator.run()
        except BaseException as exc:        # noqa: BLE001 -- examined by the test
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


# ---------------------------------------------------------------------------------------
# the receive queue
# ---------------------------------------------------------------------------------------

def test_full_receive_queue_drops_counts_and_logs_once_per_episode(caplog):
    caplog.set_level(logging.WARNING, "edgefl.transport")
    q = ReceiveQueue(max_messages=3, max_bytes=1000, full_wait_s=0.05, name="pi-01")
    for i in range(5):
        q.put(Message(f"t/{i}", b"x" * 10))
    q.put(ConnectionEvent("connected"))            # state is never dropped
    assert (q.qsize(), q.dropped, q.dropped_bytes, q.nbytes) == (4, 2, 20, 30)
    full = [r for r in caplog.records if "full" in r.getMessage()]
    assert len(full) == 1 and "'pi-01'" in full[0].getMessage() and "t/3" in full[0].getMessage()
    assert [q.get().topic for _ in range(2)] == ["t/0", "t/1"]
    q.put(Message("t/5", b"y"))                    # room again: taken, the episode reported
    assert "2 message(s) dropped while it was full" in caplog.text
    assert [getattr(q.get(), "topic", "event") for _ in range(3)] == ["t/2", "event", "t/5"]
    # the byte bound: one large message fills it, but an empty queue takes any one message
    q.put(Message("big", b"z" * 5000))
    q.put(Message("small", b"z" * 10))
    assert q.qsize() == 1 and q.dropped == 3 and q.peak_bytes == 5000


def test_a_full_queue_waits_briefly_for_a_consumer_before_dropping():
    q = ReceiveQueue(max_messages=1, max_bytes=1 << 20, full_wait_s=10.0)
    q.put(Message("a", b"1"))
    taker = threading.Timer(0.2, q.get)
    taker.start()
    q.put(Message("b", b"2"))                      # waits for the taker, not 10 s
    taker.join()
    assert q.dropped == 0 and q.get().topic == "b"
    with pytest.raises(ValueError, match="max_messages = 0"):
        q.set_limits(0, 100)


def test_mqtt_flood_fills_the_bounded_queue_without_stalling_the_connection(mosquitto_server,
                                                                            caplog):
    caplog.set_level(logging.WARNING, "edgefl.transport")
    uid = os.urandom(4).hex()
    slow = MqttTransport(mosquitto_server.url, f"slow-{uid}", clean_session=True)
    slow.set_queue_limits(max_messages=5, max_bytes=1 << 20)
    slow.messages.full_wait_s = 0.05
    sender = MqttTransport(mosquitto_server.url, f"flood-{uid}", clean_session=True)
    try:
        slow.connect()
        slow.subscribe(f"limits/{uid}/#")
        sender.connect()
        for i in range(60):
            sender.publish(f"limits/{uid}/m", str(i).encode(), qos=1)
        assert sender.flush(20.0), "the broker stopped acknowledging the flood"
        wait_for(lambda: slow.queue_drops + slow.messages.qsize() >= 61, what="flood arrival",
                 timeout=20.0, poll=0.01)
        assert slow.messages.qsize() == 6 and slow.queue_drops == 55   # 5 + `connected`
        assert slow.connected
        assert sum("full" in r.getMessage() for r in caplog.records) == 1
        first = [slow.receive(1.0) for _ in range(6)]
        assert [m.payload for m in first if isinstance(m, Message)] == [b"0", b"1", b"2",
                                                                         b"3", b"4"]
        sender.publish(f"limits/{uid}/m", b"after", qos=1)   # drained: delivered again
        assert next_message(slow, 10.0).payload == b"after"
        assert "55 message(s) dropped while it was full" in caplog.text
    finally:
        sender.close(timeout=2, announce_offline=False)
        slow.close(timeout=2, announce_offline=False)


# ---------------------------------------------------------------------------------------
# the clean close of an MQTT transport
# ---------------------------------------------------------------------------------------

def test_clean_close_never_fires_the_will_even_under_incoming_traffic(mosquitto_server):
    """paho closes its socket right after writing DISCONNECT; unread incoming messages then
    turn the close into a TCP RST, and Mosquitto used to lose the DISCONNECT and publish the
    will (about one close in ten here). Repeated to make that race visible."""
    uid = os.urandom(4).hex()
    url = mosquitto_server.url
    observer = MqttTransport(url, f"observer-{uid}", clean_session=True)
    observer.connect()
    observer.subscribe(f"will/{uid}/#")
    sender = MqttTransport(url, f"traffic-{uid}", clean_session=True)
    sender.connect()
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            sender.publish(f"traffic/{uid}", b"t" * 20000, qos=1)

    pump = threading.Thread(target=traffic, daemon=True)
    pump.start()
    try:
        for i in range(40):
            node = MqttTransport(url, f"node-{uid}-{i}", clean_session=True)
            node.set_will(f"will/{uid}/{i}", b"offline", retain=False)
            node.connect()
            node.subscribe(f"traffic/{uid}")
            next_message(node, 10.0)                 # traffic is flowing into its socket
            node.close(timeout=5.0, announce_offline=False)
        fired = messages_within(observer, 1.5)
        assert [m.topic for m in fired] == []
    finally:
        stop.set()
        pump.join(10)
        sender.close(timeout=2, announce_offline=False)
        observer.close(timeout=2, announce_offline=False)


# ---------------------------------------------------------------------------------------
# the reassembler's budgets
# ---------------------------------------------------------------------------------------

TABLE = LayerTable.from_shapes([("w", (64, 32)), ("b", (32,))])


def chunks_of(sender, round=1, seed=0, max_payload=512):
    w = np.random.default_rng(seed).standard_normal(TABLE.size).astype(np.float32)
    return wire.split(wire.encode("update", round, sender, {"params": w}, None, TABLE),
                      max_payload)


def test_a_flooding_sender_is_cut_off_for_the_round_and_logged_once(caplog):
    caplog.set_level(logging.DEBUG, "edgefl.transport.wire")
    r = wire.Reassembler(max_chunks_per_sender=10)
    ex = {s: wire.Expectation(TABLE, kinds="update", rounds=1, topic_sender=s)
          for s in ("pi-01", "pi-02")}
    storm = chunks_of("pi-01")
    assert len(storm) > 10
    for c in storm[:3]:
        assert r.add(c, ex["pi-01"]) is None
    assert r.bytes_in_flight > 0
    for _ in range(7):                              # QoS 1 repeats count too
        assert r.add(storm[0], ex["pi-01"]) is None
    with pytest.raises(wire.FrameError) as info:
        r.add(storm[3], ex["pi-01"])
    assert info.value.code == "flood" and "budget of 10" in info.value.reason
    assert r.bytes_in_flight == 0 and r.pending == 0           # its partial is released
    for c in storm * 3:                                          # ignored, cheaply and quietly
        assert r.add(c, ex["pi-01"]) is None
    assert r.stats["ignored"] == 3 * len(storm) and r.is_flooding("pi-01", 1)
    floods = [rec for rec in caplog.records if "floods round 1" in rec.getMessage()]
    assert len(floods) == 1 and floods[0].levelno == logging.WARNING
    assert r.rejected == {"flood": 1}
    assert "rejected [flood]" in caplog.text
    # another sender, and the same sender in the next round, are not affected
    assert [f for f in (r.add(c, ex["pi-02"]) for c in chunks_of("pi-02")[:10]) if f] == []
    assert not r.is_flooding("pi-01", 2)
    next_round = wire.Expectation(TABLE, kinds="update", rounds=2, topic_sender="pi-01")
    frames = [r.add(c, next_round) for c in chunks_of("pi-01", round=2, max_payload=8192)]
    assert frames[-1] is not None and frames[-1].round == 2


def test_per_sender_byte_limit_leaves_room_for_the_others():
    one = wire.read_header(chunks_of("pi-01")[0])
    total = json.loads(bytes(chunks_of("pi-01")[0][64:64 + one.meta_len]))["total"]
    r = wire.Reassembler(max_bytes=10 * total, max_bytes_per_sender=total + 100)
    ex = wire.Expectation(TABLE, kinds="update", rounds=1)
    assert r.add(chunks_of("pi-01", seed=1)[0], ex) is None
    with pytest.raises(wire.FrameError) as info:
        r.add(chunks_of("pi-01", seed=2)[0], ex)
    assert info.value.code == "memory" and f"already holds {total} of its" in info.value.reason
    assert r.add(chunks_of("pi-02", seed=2)[0], ex) is None
    assert r.bytes_in_flight == 2 * total and r.peak_bytes == 2 * total


def test_aggregator_drops_a_flooding_client_for_the_round_and_goes_on(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    config = load_small_run(tmp_path, rounds=2)
    broker = LoopbackBroker()
    settings = AggregatorSettings(federation="fed", round_timeout_s=30, chunks_per_sender=20)
    run, aggregator, threads = fleet(tmp_path, config, broker, settings)
    thread, out = run_in_thread(aggregator)
    wait_for(lambda: aggregator.open is not None, what="round 1 to open", timeout=20.0, poll=0.01)
    rogue = broker.transport("rogue")
    rogue.connect()
    topic = Topics("fed").update("client-0")
    w = run.init_params
    forged = wire.split(wire.encode("update", 1, "client-0", {"params": w}, None,
                                    run.model.table), 1024)
    for c in forged[:2]:                            # a message that never completes
        rogue.publish(topic, c)
    wait_for(lambda: aggregator.reassembler.bytes_in_flight > 0, what="the partial message",
             timeout=20.0, poll=0.01)
    for _ in range(200):
        rogue.publish(topic, b"garbage " * 20)
    wait_for(lambda: aggregator.stats.get("flood_ignored", 0) == 200 - 18 - 1,
             what="the flood to be ignored", timeout=20.0, poll=0.01)
    assert aggregator.reassembler.bytes_in_flight == 0
    assert sum("floods round 1" in r.getMessage() for r in caplog.records) == 1
    # 18 garbage payloads rejected (one line each), the 19th over budget, then silence
    rejected = [r for r in caplog.records if "rejected update from 'client-0'" in r.getMessage()]
    assert len(rejected) == 19 and "[flood]" in rejected[-1].getMessage()
    for t in threads:
        t.start()
    thread.join(60)
    assert "error" not in out, out.get("error")
    result = out["result"]
    assert result.finished
    # round 1 closes without the flooder (it is not waited for), round 2 has everyone
    assert [h["updates"] for h in result.history] == [2, 3]
    assert result.history[0]["missing"] == ["client-0"]
    for t in threads:
        t.join(10)


# ---------------------------------------------------------------------------------------
# a full disk while checkpointing
# ---------------------------------------------------------------------------------------

def checkpoint(round, seed=0, size=30_000):
    params = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    return AggregatorCheckpoint(run_id="r1", fingerprint="f", round=round,
                                aggregated=list(range(1, round + 1)),
                                state=State({"params": params}, {}), strategy={"name": "x"},
                                rng={"seed": 0})


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 512 KiB tmpfs (we are root in CI); skipped where mounting is not permitted."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs",
                               str(mount_point)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], capture_output=True, timeout=30)


def fill(directory) -> str:
    """Write a filler file until the file system is full; its path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return path


def test_a_full_tmpfs_leaves_the_previous_checkpoint_intact(small_tmpfs):
    state_dir = small_tmpfs / "agg"
    checkpoint(1, seed=1).save(state_dir)                # ~120 KB
    filler = fill(small_tmpfs)
    with pytest.raises(StateWriteError) as info:
        checkpoint(2, seed=2).save(state_dir)
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert "checkpoint of round 2 not saved" in message
    assert str(state_dir / "aggregator.npz") in message and "No space left" in message
    assert "the old one is intact" in message
    kept = AggregatorCheckpoint.load(state_dir)
    assert kept.round == 1
    assert np.array_equal(kept.state.buffers["params"], checkpoint(1, seed=1).state.buffers[
        "params"])
    # no temporary file left
    assert sorted(os.listdir(state_dir)) == ["aggregator.npz", "history.jsonl"]
    os.unlink(filler)                                    # space again: the next save works
    checkpoint(2, seed=2).save(state_dir)
    assert AggregatorCheckpoint.load(state_dir).round == 2


def test_a_failed_journal_append_leaves_no_torn_line(tmp_path, monkeypatch):
    path = tmp_path / "rounds.jsonl"
    append_journal(path, {"round": 1})
    real_write = os.write

    def half_then_enospc(fd, data):                      # the disk fills mid-line
        real_write(fd, bytes(data[:len(data) // 2]))
        monkeypatch.setattr(os, "write", fail)
        return len(data) // 2

    def fail(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_enospc)
    with pytest.raises(StateWriteError, match=r"rounds.jsonl: cannot write a journal record; "
                                              r"the journal is as it was \(No space left"):
        append_journal(path, {"round": 2, "event": "aggregated"})
    monkeypatch.setattr(os, "write", real_write)
    append_journal(path, {"round": 3})
    assert read_journal(path) == [{"round": 1}, {"round": 3}]


def test_atomic_write_names_the_file_when_a_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    atomic_write(path, b"old")

    class FullDisk:                                      # a file object on a full disk
        def __init__(self, fd, mode):
            self.fd = fd

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            os.close(self.fd)

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state_module.os, "fdopen", FullDisk)
    with pytest.raises(StateWriteError) as info:
        atomic_write(path, b"new" * 100)
    assert info.value.errno == errno.ENOSPC and str(path) in str(info.value)
    assert "the file system is full" in str(info.value)
    monkeypatch.undo()
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]


def test_aggregator_stops_cleanly_on_enospc_and_a_restart_resumes(tmp_path, monkeypatch,
                                                                   caplog):
    """The disk fills after round 2: the checkpoint of round 3 fails with ENOSPC, the
    aggregator logs it and stops (run() raises, the connection is closed); the checkpoint
    of round 2 is intact; restarted, it runs round 3 again and finishes with the model of
    an uninterrupted run, each round in the journal once."""
    caplog.set_level(logging.ERROR, "edgefl.roles.aggregator")
    config = load_small_run(tmp_path, rounds=3)
    reference = simulate(config, None, progress=False)
    broker = LoopbackBroker()
    settings = AggregatorSettings(federation="fed", round_timeout_s=30)
    _, aggregator, threads = fleet(tmp_path, config, broker, settings)
    agg_dir = str(tmp_path / "agg")
    full = threading.Event()
    real_fsync = os.fsync

    def fsync(fd):                 # ENOSPC for the aggregator's files once the disk is "full"
        if full.is_set() and os.readlink(f"/proc/self/fd/{fd}").startswith(agg_dir):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    aggregator.on_round = lambda record, history: full.set() if record["round"] == 2 else None
    for t in threads:
        t.start()
    thread, out = run_in_thread(aggregator)
    thread.join(60)
    error = out.get("error")
    assert isinstance(error, StateWriteError) and error.errno == errno.ENOSPC
    assert "checkpoint of round 3 not saved" in str(error)
    assert "round 3 aggregated but not checkpointed, stopping" in caplog.text
    assert "checkpoint of round 2 is intact" in caplog.text
    assert AggregatorCheckpoint.load(agg_dir).round == 2
    assert not [n for n in os.listdir(agg_dir) if n.endswith(".tmp")]
    assert not aggregator.transport.connected

    full.clear()                                          # space freed: restart
    restarted = Aggregator(aggregator.plan, broker.transport("aggregator"), agg_dir, settings)
    result = restarted.run()
    assert result.finished and [h["round"] for h in result.history] == [1, 2, 3]
    assert model_sha256(result.params) == reference["model_sha256"]
    journal = [r["round"] for r in read_journal(os.path.join(agg_dir, "rounds.jsonl"))
               if r.get("event") == "aggregated"]
    assert journal == [1, 2, 3]
    for t in threads:
        t.join(10)


# ---------------------------------------------------------------------------------------
# the service config keys reach the roles
# ---------------------------------------------------------------------------------------

def test_limits_keys_reach_the_transport_and_the_reassemblers(tmp_path):
    from edgefl.cli.service import _mqtt_transport
    from edgefl.service.layered import ConfigError, load_service_config

    site = tmp_path / "aggregator.yaml"
    site.write_text("node: {id: agg}\nrun: quickstart\n"
                    "limits: {queue_messages: 50, queue_mb: 8, reassembly_mb: 64,\n"
                    "         sender_reassembly_mb: 2, chunks_per_sender: 300}\n")
    config = load_service_config("aggregator", str(site))
    transport = _mqtt_transport(config, "agg")
    assert (transport.messages.max_messages, transport.messages.max_bytes) == (50, 8 << 20)
    settings = AggregatorSettings.from_service_config(config, federation="fed")
    assert (settings.node_id, settings.chunks_per_sender) == ("agg", 300)
    _, aggregator, _ = fleet(tmp_path, load_small_run(tmp_path), LoopbackBroker(), settings)
    r = aggregator.reassembler
    assert (r.max_bytes, r.max_bytes_per_sender, r.max_chunks_per_sender) == \
        (64 << 20, 2 << 20, 300)
    # null: sized from the model (softmax on digits: 650 parameters)
    _, auto, _ = fleet(tmp_path, load_small_run(tmp_path), LoopbackBroker(),
                       AggregatorSettings(federation="fed"))
    update = 8 * 650 + (64 << 10)
    assert (auto.reassembler.max_bytes, auto.reassembler.max_bytes_per_sender,
            auto.reassembler.max_chunks_per_sender) == (256 << 20, 2 * update,
                                                        max(256, 4 * -(-update // 1024)))
    client = Client(ClientSettings("client-0", "fed", reassembly_bytes=16 << 20,
                                   chunks_per_sender=99), (np.zeros((1, 64), np.float32),
                                                           np.zeros(1, np.int64)),
                    LoopbackBroker().transport("client-0"), tmp_path / "c0")
    assert (client.reassembler.max_bytes, client.reassembler.max_chunks_per_sender) == \
        (16 << 20, 99)
    with pytest.raises(ConfigError, match=r"limits.queue_mb: 0 is below the minimum 1"):
        load_service_config("aggregator", str(site), overrides=["limits.queue_mb=0"])
    # the settings classes check their fields as the site file's keys are checked
    with pytest.raises(ConfigError, match=r"^AggregatorSettings.chunks_per_sender "
                                          r"\(limits.chunks_per_sender\): 0 is below the "
                                          r"minimum 1$"):
        AggregatorSettings(chunks_per_sender=0)
    with pytest.raises(ConfigError, match=r"^AggregatorSettings.reassembly_bytes: 0 is below "
                                          r"the minimum 1$"):
        AggregatorSettings(reassembly_bytes=0)
