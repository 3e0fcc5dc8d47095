"""The roles' own parts, on the in-process loopback broker (tests/test_roles_e2e.py runs them
through real brokers): atomic persistence (a crash at any instant leaves the old or the new
file), the JSON documents (every bad field named), the client's checks of what it receives
(topic, sender, round, hash, NaN: rejected with a reason, the client keeps running), a round
never trained twice, and the aggregator's refusals (late, duplicate, unauthorised, another
run's update)."""
from __future__ import annotations

import collections
import json
import logging
import os
import struct
import threading
import time
import zlib

import numpy as np
import pytest

from edgefl.roles import (Aggregator, AggregatorCheckpoint, AggregatorSettings, Client,
                          ClientProgress, ClientSettings, RunPlan, StateError,
                          default_client_ids)
from edgefl.roles import messages as msg
from edgefl.params import LayerTable
from edgefl.roles import state as state_files
from edgefl.roles.state import (HISTORY_FILE, StateWriteError, append_journal, atomic_write,
                                load_arrays, read_journal, save_arrays, tag_floats,
                                untag_floats)
from edgefl import kernels
from edgefl.checkpoint import model_sha256
from edgefl.runs.prepare import prepare_run
from edgefl.sim import simulate
from edgefl.strategies import State, Update, select_clients
from edgefl.transport import wire
from edgefl.transport.base import Message
from edgefl.transport.loopback import LoopbackBroker
from edgefl.transport.topics import Topics
from edgefl.errors import ConfigError  # noqa: E402
from helpers import import_tool, load_small_run, wait_for


# ---------------------------------------------------------------------------------------
# state.py: atomic files, checkpoints, progress, journal
# ---------------------------------------------------------------------------------------

def test_atomic_write_replaces_whole_files_and_keeps_the_old_one_on_failure(tmp_path,
                                                                            monkeypatch):
    path = tmp_path / "f.bin"
    atomic_write(path, b"old")
    atomic_write(path, b"new contents")
    assert path.read_bytes() == b"new contents"

    def crash(src, dst):          # the process dies between the fsync and the rename
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, b"x" * 1000)
    assert path.read_bytes() == b"new contents"
    assert os.listdir(tmp_path) == ["f.bin"]          # no temporary file left behind


def test_arrays_round_trip_without_pickles_and_corruption_names_the_file(tmp_path):
    path = tmp_path / "s.npz"
    w = np.arange(5, dtype=np.float32)
    save_arrays(path, {"w": w}, {"round": 3, "loss": 0.5})
    arrays, meta = load_arrays(path)
    assert np.array_equal(arrays["w"], w) and meta == {"round": 3, "loss": 0.5}
    with np.load(path, allow_pickle=False) as z:      # readable without pickle
        assert set(z.files) == {"w", "__meta__"}
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(StateError, match=r"s\.npz: unreadable state file"):
        load_arrays(path)


def test_non_finite_floats_survive_json_tagging():
    data = {"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": (1, 2),
            "d": np.float64(0.25), "e": None}
    tagged = tag_floats(data)
    text = json.dumps(tagged, allow_nan=False)               # valid JSON
    back = untag_floats(json.loads(text))
    assert np.isnan(back["a"]) and back["b"][:2] == [float("inf"), -float("inf")]
    assert back["b"][2] == 1.5 and back["c"] == [1, 2] and back["d"] == 0.25
    assert back["e"] is None


def history_checkpoint(history, round_=None):
    r = len(history) if round_ is None else round_
    return AggregatorCheckpoint("r1", "fp", r, list(range(1, r + 1)),
                                State({"params": np.full(5, float(r), np.float32)}, {}),
                                {"name": "fedavg"}, {"seed": 0}, list(history), float(r))


def history_lines(directory) -> int:
    with open(os.path.join(directory, HISTORY_FILE), encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def test_the_history_is_appended_each_save_not_rewritten(tmp_path):
    """A save writes the new round's record and, when its evaluation came in since, the
    last one again; never the whole history (at 1,000 rounds that was ~30 ms a round)."""
    history = []
    for r in range(1, 6):
        if history:                         # the previous round's evaluation comes in late
            history[-1]["test_accuracy"] = 0.5 + r / 100
        history = history + [{"round": r, "test_accuracy": None, "loss": float("nan")}]
        history_checkpoint(history).save(tmp_path)
    # round 1 written once, rounds 2-5 twice (appended, then again with the evaluation)
    assert history_lines(tmp_path) == 1 + 2 * 4
    history_checkpoint(history).save(tmp_path)             # nothing changed: nothing added
    assert history_lines(tmp_path) == 9
    back = AggregatorCheckpoint.load(tmp_path)
    assert back.round == 5 and [h["round"] for h in back.history] == [1, 2, 3, 4, 5]
    assert [h["test_accuracy"] for h in back.history] == [0.52, 0.53, 0.54, 0.55, None]
    assert all(h["loss"] is None for h in back.history)     # NaN as in version 1: null


def test_history_lines_of_an_interrupted_save_are_ignored_and_superseded(tmp_path,
                                                                         monkeypatch):
    history = [{"round": 1, "v": "a"}, {"round": 2, "v": "a"}]
    history_checkpoint(history).save(tmp_path)

    def crash(*args, **kwargs):             # killed after the history, before the rename
        raise StateWriteError("simulated crash before the checkpoint's rename")
    monkeypatch.setattr(state_files, "save_arrays", crash)
    with pytest.raises(StateWriteError):
        history_checkpoint(history + [{"round": 3, "v": "lost"}]).save(tmp_path)
    monkeypatch.undo()
    assert history_lines(tmp_path) == 3
    back = AggregatorCheckpoint.load(tmp_path)              # round 2's checkpoint, as it was
    assert back.round == 2 and back.history == history
    # the restarted aggregator (a new process: nothing remembered) reruns round 3
    state_files._HISTORY_WRITTEN.clear()
    with open(os.path.join(tmp_path, HISTORY_FILE), "a", encoding="utf-8") as f:
        f.write('{"i": 2, "record": {"round"')               # and a torn line to boot
    history_checkpoint(back.history + [{"round": 3, "v": "rerun"}]).save(tmp_path)
    again = AggregatorCheckpoint.load(tmp_path)
    assert again.round == 3 and [h["v"] for h in again.history] == ["a", "a", "rerun"]
    assert history_lines(tmp_path) == 3                      # rewritten whole, torn line gone


def test_a_version_1_checkpoint_loads_and_moves_its_history_out(tmp_path):
    meta = {"format": "edgefl-aggregator-checkpoint", "version": 1, "run_id": "r1",
            "fingerprint": "fp", "round": 2, "aggregated": [1, 2], "state_meta": {},
            "strategy": {"name": "fedavg"}, "rng": {"seed": 0},
            "history": [{"round": 1}, {"round": 2}], "elapsed_s": 2.0}
    save_arrays(os.path.join(tmp_path, "aggregator.npz"),
                {"state.params": np.zeros(5, np.float32)}, meta)
    old = AggregatorCheckpoint.load(tmp_path)
    assert old.round == 2 and old.history == [{"round": 1}, {"round": 2}]
    history_checkpoint(old.history + [{"round": 3}]).save(tmp_path)
    _, meta = load_arrays(os.path.join(tmp_path, "aggregator.npz"))
    assert meta["version"] == 2 and "history" not in meta and meta["history_len"] == 3
    assert [h["round"] for h in AggregatorCheckpoint.load(tmp_path).history] == [1, 2, 3]


def test_a_checkpoint_without_its_history_file_is_refused_by_name(tmp_path):
    history_checkpoint([{"round": 1}, {"round": 2}]).save(tmp_path)
    path = os.path.join(tmp_path, HISTORY_FILE)
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    with open(path, "w", encoding="utf-8") as f:          # entry 1 lost
        f.write(first)
    with pytest.raises(StateError, match=r"history\.jsonl: holds no record for 1 of the 2 "
                                         r"entries .*entry 1"):
        AggregatorCheckpoint.load(tmp_path)
    os.unlink(path)
    with pytest.raises(StateError, match=r"history\.jsonl: missing; the checkpoint beside it "
                                         r"lists 2 round record"):
        AggregatorCheckpoint.load(tmp_path)
    assert os.path.exists(os.path.join(tmp_path, "aggregator.npz"))   # nothing removed


def test_bench_checkpoint_times_the_aggregators_save_pattern(capsys):
    """tools/bench_checkpoint.py (docs/scaling.md's checkpoint table) runs the save as the
    aggregator makes it in a process of its own and reports one row per length; a --before
    that is no edgefl checkout is refused by name."""
    bench_checkpoint = import_tool("bench_checkpoint")

    assert bench_checkpoint.main(["--records", "2,5", "--saves", "3", "--repeats", "1",
                                  "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["records"], r["saves"]) for r in rows] == [(2, 3), (5, 3)]
    assert all(0 < r["save_cpu_ms_min"] <= r["save_cpu_ms_median"] <= r["save_cpu_ms_max"]
               for r in rows)
    with pytest.raises(SystemExit):
        bench_checkpoint.main(["--before", os.path.dirname(__file__)])
    assert "no edgefl checkout there" in capsys.readouterr().err


def test_checkpoint_and_progress_round_trip(tmp_path):
    state = State({"params": np.linspace(-1, 1, 7, dtype=np.float32),
                   "momentum": np.ones(7, dtype=np.float32)},
                  {"round": 4, "tau": {"0": 10, "1": 3}, "L": None, "gn2": float("inf")})
    ckpt = AggregatorCheckpoint("r1", "fp", 4, [1, 2, 3, 4], state,
                                {"name": "mfl", "params": {"gamma": 0.5}}, {"seed": 3},
                                [{"round": 1}], 2.5)
    ckpt.save(tmp_path)
    back = AggregatorCheckpoint.load(tmp_path)
    assert back.round == 4 and back.aggregated == [1, 2, 3, 4] and back.run_id == "r1"
    for name in state.buffers:
        assert np.array_equal(back.state.buffers[name], state.buffers[name])
    assert back.state.meta["tau"] == {"0": 10, "1": 3} and back.state.meta["gn2"] == np.inf
    assert back.history == [{"round": 1}] and back.elapsed_s == 2.5
    assert AggregatorCheckpoint.load(tmp_path / "nowhere") is None

    table = LayerTable.from_shapes([("w", (7,))])

    def update_frame(r, value=0.5):
        return wire.encode("update", r, "client-0", {"params": np.full(7, value, np.float32)},
                           {"run": "r1"}, table)

    frame3 = update_frame(3)
    progress = ClientProgress("r1", 3, frame3, State({"g": np.zeros(7, np.float32)},
                                                     {"round": 3, "lr": 0.1}))
    progress.save(tmp_path)
    progress.save_upload(tmp_path)
    again = ClientProgress.load(tmp_path)
    assert (again.run_id, again.trained, again.upload) == ("r1", 3, frame3)
    assert again.client_state.meta == {"round": 3, "lr": 0.1} and not again.upload_missing
    assert ClientProgress.load(tmp_path / "fresh").trained == 0
    # the next round's progress is written, the process dies before its update file is
    # rewritten: the round counts as trained (never again), its update is known to be
    # missing -- the file still holds round 3's frame, which must not pass for round 4's
    frame4 = update_frame(4, 0.25)
    ClientProgress("r1", 4, frame4, None).save(tmp_path)
    crashed = ClientProgress.load(tmp_path)
    assert crashed.trained == 4 and crashed.upload is None
    assert "update.frame" in crashed.upload_missing and "not the update of round 4" in \
        crashed.upload_missing
    # ... or dies while rewriting it: a torn frame is refused the same way
    with open(tmp_path / "update.frame", "r+b") as f:
        f.write(frame4[:len(frame4) // 2])
    torn = ClientProgress.load(tmp_path)
    assert torn.trained == 4 and torn.upload is None and "torn" in torn.upload_missing
    ClientProgress("r1", 4, frame4, None).save_upload(tmp_path)
    assert ClientProgress.load(tmp_path).upload == frame4
    # a shorter frame cuts the file to its length
    short = wire.encode("update", 5, "client-0", {"params": np.ones(3, np.float32)}, None,
                        LayerTable.from_shapes([("w", (3,))]))
    assert len(short) < len(frame4)
    ClientProgress("r1", 5, short, None).save(tmp_path)
    ClientProgress("r1", 5, short, None).save_upload(tmp_path)
    assert ClientProgress.load(tmp_path).upload == short
    assert (tmp_path / "update.frame").stat().st_size == len(short)
    # a state directory of an earlier version: its update-<round>.frame is read, then the
    # next save_upload replaces it with update.frame
    os.replace(tmp_path / "update.frame", tmp_path / "update-5.frame")
    meta_path = tmp_path / "client.npz"
    arrays, meta = load_arrays(meta_path)
    meta["upload_file"] = "update-5.frame"
    save_arrays(meta_path, arrays, meta)
    assert ClientProgress.load(tmp_path).upload == short
    ClientProgress("r1", 5, short, None).save_upload(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("update*")) == ["update.frame"]


def test_journal_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "rounds.jsonl"
    append_journal(path, {"event": "aggregated", "round": 1})
    append_journal(path, {"event": "aggregated", "round": 2})
    with open(path, "a") as f:
        f.write('{"event": "aggreg')                  # a crash in the middle of a write
    assert [r["round"] for r in read_journal(path)] == [1, 2]
    assert read_journal(tmp_path / "none.jsonl") == []


def test_a_record_appended_after_a_torn_last_line_is_read(tmp_path):
    """A power cut mid-append leaves a line without its newline. The next start appends
    (the aggregator's `recovered` round, `resumed`): that line must not be glued to the
    torn one, or it is lost to the reader and the journal misses a round it promised."""
    path = tmp_path / "rounds.jsonl"
    append_journal(path, {"event": "aggregated", "round": 1})
    with open(path, "a") as f:
        f.write('{"event": "aggregated", "rou')         # round 2's line, cut short
    append_journal(path, {"event": "aggregated", "round": 2, "recovered": True})
    append_journal(path, {"event": "resumed", "round": 2})
    assert [(r["event"], r["round"]) for r in read_journal(path)] == \
        [("aggregated", 1), ("aggregated", 2), ("resumed", 2)]


# ---------------------------------------------------------------------------------------
# messages.py: the announcement, status and update scalars
# ---------------------------------------------------------------------------------------

def announcement_for(tmp_path, strategy="fedveca", **changes):
    config = load_small_run(tmp_path, strategy={"name": strategy}, train={"lr": 0.05},
                            **changes)
    run = prepare_run(config, progress=False)
    state = run.strategy.init(run.init_params, run.setup)
    tasks = run.strategy.configure(1, [0, 1, 2], state)
    ids = default_client_ids(3)
    doc = msg.build_announcement(
        run_id="run1", aggregator="agg", round=1, rounds=2, announce_id="a1", opened=1.0,
        deadline=2.0, strategy={"name": run.strategy.name,
                                "params": run.strategy.hyperparameters()},
        model={"spec": json.loads(run.model.spec), "input_shape": list(run.model.input_shape),
               "num_classes": run.model.num_classes, "table": run.model.table.digest},
        compression="none", global_sha="ab" * 32,
        tasks={ids[c]: t for c, t in tasks.items()}, client_index={n: i for i, n in
                                                                enumerate(ids)},
        client_sha={})
    return run, tasks, doc


def test_announcement_round_trips_every_task(tmp_path):
    run, tasks, doc = announcement_for(tmp_path)
    payload = json.dumps(doc).encode()
    parsed = msg.parse_announcement(payload)
    # seeds travel as strings (64-bit), shared values once
    assert all(isinstance(t["train"]["seed"], str) for t in parsed["tasks"].values())
    assert "lr" in parsed["train"] and "seed" not in parsed["train"]
    for c, task in tasks.items():
        node = f"client-{c}"
        again = msg.task_from_announcement(parsed, node, task.buffers)
        assert dict(again.train) == dict(task.train) and again.upload == task.upload
        assert again.source == task.source and dict(again.scalars) == dict(task.scalars)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(v=2), "version 2, this node speaks 1"),
    (lambda d: d.pop("deadline"), "missing field 'deadline'"),
    (lambda d: d.update(round=0), "round 0: rounds start at 1"),
    (lambda d: d.update(round=True), "round = True must be"),
    (lambda d: d["model"].update(input_shape=[0]), "input_shape [0] must be positive ints"),
    (lambda d: d["tasks"].update({"a/b": {}}), "contains '/'"),
    (lambda d: d["tasks"]["client-0"].update(source="peer"), "source 'peer'; valid"),
    (lambda d: d.update(model_sha256=None), "source global but the announcement has no "
                                            "model_sha256"),
    (lambda d: d.update(model_frame="12345"), "model_frame '12345' must be a message id"),
    (lambda d: d.update(model_frame="ABCDEF0123456789"), "16 lowercase hex digits"),
])
def test_bad_announcements_name_the_field(tmp_path, edit, message):
    _, _, doc = announcement_for(tmp_path)
    edit(doc)
    with pytest.raises(msg.MessageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        msg.parse_announcement(json.dumps(doc).encode())


@pytest.mark.parametrize("payload, message", [
    (b"\xff\xfe", "not UTF-8"),
    (b"{not json", "not JSON"),
    (b'{"v": 1, "x": NaN}', "NaN is not JSON"),
    (b"[1, 2]", "a JSON object was expected, got list"),
])
def test_announcement_that_is_not_json(payload, message):
    with pytest.raises(msg.MessageError, match=message):
        msg.parse_announcement(payload)


def test_status_and_update_scalars():
    payload = msg.status_payload("pi-7", "client", True, profile="rpi4", last_round=3,
                                 need_model=4)
    doc = msg.parse_status(payload, "pi-7")
    assert doc["online"] is True and doc["last_round"] == 3 and doc["need_model"] == 4
    with pytest.raises(msg.MessageError, match="names node 'pi-7', published on the topic of "
                                               "'pi-8'"):
        msg.parse_status(payload, "pi-8")
    update = Update({}, 30, float("nan"), 5, {"beta": float("inf"), "fused": True})
    scalars = msg.update_scalars(update, "run1", 0.25)
    json.dumps(scalars, allow_nan=False)
    back = msg.parse_update_scalars(json.loads(json.dumps(scalars)), "update")
    assert np.isnan(back["train_loss"]) and back["strategy"] == {"beta": float("inf"),
                                                                 "fused": True}
    with pytest.raises(msg.MessageError, match="'num_samples' = -1 must be an integer >= 0"):
        msg.parse_update_scalars(dict(scalars, num_samples=-1), "update")


# ---------------------------------------------------------------------------------------
# the client on its own: the test plays the aggregator on the loopback broker
# ---------------------------------------------------------------------------------------

def reseal(frame: bytes) -> bytes:
    """Recompute both CRCs of an edited frame (docs/protocol.md 2.1: body CRC at byte 48
    over [64, end), header CRC at byte 60 over [0, 60))."""
    data = bytearray(frame)
    struct.pack_into("<I", data, 48, zlib.crc32(data[64:]))
    struct.pack_into("<I", data, 60, zlib.crc32(data[:60]))
    return bytes(data)


def with_nan(frame: bytes) -> bytes:
    data = bytearray(frame)
    start = wire.read_header(frame).data_offset
    data[start:start + 4] = np.float32(np.nan).tobytes()
    return reseal(bytes(data))


def loopback_aggregator():
    """(broker, the test's aggregator transport on it, subscribed to the updates, topics)."""
    broker = LoopbackBroker()
    agg = broker.transport("agg")
    agg.connect()
    agg.subscribe("edgefl/fed/update/+")
    return broker, agg, Topics("fed")


class ClientHarness:
    """One Client role in a thread; the test publishes what the aggregator would."""

    def __init__(self, tmp_path, broker, run, node="client-0", shard=0, **settings):
        self.run, self.node = run, node
        self.topics = Topics("fed")
        data = run.clients[shard]
        self.client = Client(ClientSettings(node, "fed", model_wait_s=60, **settings),
                             (data.x, data.y), broker.transport(node),
                             tmp_path / f"state-{node}")
        self.thread = threading.Thread(target=self.client.run, daemon=True)
        self.thread.start()
        assert self.client.ready.wait(5)

    def stop(self):
        self.client.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


def test_client_says_when_it_is_connected_and_waiting(tmp_path, caplog):
    caplog.set_level(logging.INFO, "edgefl.roles.client")
    broker, _, _ = loopback_aggregator()
    run, _, _ = announcement_for(tmp_path, strategy="fedavg")
    harness = ClientHarness(tmp_path, broker, run)
    try:
        assert "client-0: connected to broker in this process, federation 'fed': waiting " \
               "for a run" in caplog.text
    finally:
        harness.stop()


def test_client_checks_every_frame_and_trains_each_round_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, "edgefl.roles.client")
    broker, agg, topics = loopback_aggregator()
    run, tasks, doc = announcement_for(tmp_path, strategy="fedavg")
    table = run.model.table
    global_buffers = tasks[0].buffers
    good = wire.encode("model", 1, "agg", global_buffers, {"run": "run1"}, table)
    doc["model_sha256"] = msg.buffers_sha256(global_buffers)
    harness = ClientHarness(tmp_path, broker, run)
    client = harness.client
    try:
        agg.publish(topics.round(), b"garbage", retain=True)
        agg.publish(topics.round(), json.dumps(doc).encode(), retain=True)
        other = {"params": np.zeros(table.size, dtype=np.float32)}
        bad_frames = {
            "sender": wire.encode("model", 1, "mallory", global_buffers, {"run": "run1"}, table),
            "hash": wire.encode("model", 1, "agg", other, {"run": "run1"}, table),
            "non_finite": with_nan(good),
            "crc": good[:-1] + bytes([good[-1] ^ 1]),
            "table_hash": wire.encode("model", 1, "agg",
                                      {"params": np.zeros(10, np.float32)}, {"run": "run1"},
                                      LayerTable.from_shapes([("w", (10,))])),
        }
        for frame in bad_frames.values():
            agg.publish(topics.model(), frame)
        # a model for another client on our own topic
        agg.publish(topics.client_model("client-0"),
                    wire.encode("client_model", 1, "agg", global_buffers, {"run": "run1"}, table,
                                recipient="client-1"))
        time.sleep(0.3)
        assert client.stats["trained"] == 0 and harness.thread.is_alive()
        log_text = caplog.text
        for reason in ("rejected announcement: not JSON", "sender 'mallory' not expected",
                       "is not the announced", "non-finite value", "crc mismatch",
                       "[table_hash]", "[recipient]"):
            assert reason in log_text, reason
        agg.publish(topics.model(), good)
        upload = next_update(agg)
        # what the client sent is the strategy's own result for its task, bit for bit
        expected, _ = run.strategy.train(tasks[0], run.clients[0], None)
        frame = wire.decode(upload, wire.Expectation(table, kinds="update", rounds=1,
                                                     topic_sender="client-0"))
        assert np.array_equal(frame.buffers["params"], expected.buffers["params"])
        assert frame.scalars["run"] == "run1" and frame.scalars["num_samples"] == 100
        assert client.progress.trained == 1 and client.progress.upload == upload
        # the same round announced again (aggregator restarted): re-sent, not retrained
        doc["announce"] = "a2"
        agg.publish(topics.round(), json.dumps(doc).encode(), retain=True)
        assert next_update(agg) == upload
        assert client.stats["trained"] == 1 and client.stats["resent"] == 1
    finally:
        harness.stop()
    # restarted, the client finds the round it trained: it re-sends, it does not train
    again = ClientHarness(tmp_path, broker, run)
    try:
        assert next_update(agg) == upload
        assert again.client.stats["trained"] == 0 and again.client.progress.trained == 1
    finally:
        again.stop()


def test_a_client_past_the_announced_round_neither_trains_it_nor_sends(tmp_path, caplog):
    """A board that trained round 2 and hears round 1 announced (a retained announcement of
    an earlier round, an aggregator restarted from an older checkpoint) ignores it: a board
    never goes back to an earlier round, so it never trains one twice."""
    caplog.set_level(logging.DEBUG, "edgefl.roles.client")
    broker, agg, topics = loopback_aggregator()
    run, tasks, doc = announcement_for(tmp_path, strategy="fedavg")
    doc["model_sha256"] = msg.buffers_sha256(tasks[0].buffers)
    state_dir = tmp_path / "state-client-0"
    state_dir.mkdir()
    ClientProgress("run1", 2, None, None).save(state_dir)
    harness = ClientHarness(tmp_path, broker, run)
    try:
        agg.publish(topics.round(), json.dumps(doc).encode(), retain=True)
        agg.publish(topics.model(), wire.encode("model", 1, "agg", tasks[0].buffers,
                                                {"run": "run1"}, run.model.table))
        ignored = "announcement of round 1, already at round 2: ignored"
        wait_for(lambda: ignored in caplog.text or harness.client.stats["trained"],
                 what="the announcement of round 1 handled")
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            item = agg.receive(timeout=0.1)
            assert not (isinstance(item, Message) and "/update/" in item.topic), item.topic
        assert harness.client.stats["trained"] == 0 and harness.client.progress.trained == 2
        assert ignored in caplog.text
    finally:
        harness.stop()


@pytest.mark.parametrize("case", ["announced id, hash not consulted", "other id, same content",
                                  "other id, other content"])
def test_the_announced_model_frame_is_taken_by_id_any_other_by_content(tmp_path, caplog, case):
    """An announcement names the message id of its model frame ("model_frame"): that frame
    is the model without a sha256 over it (shown with a deliberately wrong hash in the
    announcement); another frame of the round (re-encoded, stale, foreign) is checked by
    content as before."""
    caplog.set_level(logging.INFO, "edgefl.roles.client")
    broker, agg, topics = loopback_aggregator()
    run, tasks, doc = announcement_for(tmp_path, strategy="fedavg")
    table = run.model.table
    buffers = tasks[0].buffers
    announced = wire.encode("model", 1, "agg", buffers, {"run": "run1"}, table)
    doc["model_frame"] = f"{wire.read_header(announced).message_id:016x}"
    doc["model_sha256"] = msg.buffers_sha256(buffers)
    if case == "announced id, hash not consulted":
        doc["model_sha256"] = "00" * 32
        sent = announced
    elif case == "other id, same content":
        sent = wire.encode("model", 1, "agg", buffers, {"run": "run1"}, table)
    else:
        sent = wire.encode("model", 1, "agg", {"params": np.zeros(table.size, np.float32)},
                           {"run": "run1"}, table)
    assert msg.parse_announcement(json.dumps(doc).encode())["model_frame"] == doc["model_frame"]
    harness = ClientHarness(tmp_path, broker, run)
    try:
        agg.publish(topics.round(), json.dumps(doc).encode(), retain=True)
        agg.publish(topics.model(), sent)
        if case == "other id, other content":
            time.sleep(0.3)
            assert harness.client.stats["trained"] == 0
            assert "is not the announced" in caplog.text
        else:
            next_update(agg)
            assert harness.client.stats["trained"] == 1
    finally:
        harness.stop()


def next_update(transport, timeout=5.0) -> bytes:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        item = transport.receive(timeout=0.1)
        if isinstance(item, Message) and "/update/" in item.topic:
            return item.payload
    pytest.fail("no update within the timeout")


def test_client_refuses_a_run_whose_model_does_not_fit_its_data(tmp_path, caplog):
    caplog.set_level(logging.INFO, "edgefl.roles.client")
    broker = LoopbackBroker()
    run, _, doc = announcement_for(tmp_path, strategy="fedavg")
    doc["model"]["input_shape"] = [1, 28, 28]
    agg = broker.transport("agg")
    agg.connect()
    harness = ClientHarness(tmp_path, broker, run)
    try:
        agg.publish(Topics("fed").round(), json.dumps(doc).encode(), retain=True)
        wait_for(lambda: "cannot take part in round 1" in caplog.text, what="refusal",
                 timeout=10.0, poll=0.01)
        assert "builds here with layer table" in caplog.text or "samples of shape" in caplog.text
        assert harness.thread.is_alive()
    finally:
        harness.stop()


# ---------------------------------------------------------------------------------------
# the aggregator with real clients on the loopback broker
# ---------------------------------------------------------------------------------------

def fleet(tmp_path, config, broker, settings=None, client_settings=None, start_clients=True):
    """The run's aggregator (the asynchronous one for an asynchronous strategy) and a client
    role per shard, all on `broker`: (run, aggregator, clients, their threads)."""
    from edgefl.roles.asynchronous import aggregator_class

    run = prepare_run(config, progress=False)
    ids = default_client_ids(len(run.setup.clients))
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, ids, test=(run.dataset.x_test, run.dataset.y_test),
                   description=config.to_dict())
    aggregator = aggregator_class(plan)(
        plan, broker.transport("aggregator"), tmp_path / "agg",
        settings or AggregatorSettings(federation="fed", round_timeout_s=20))
    clients = []
    for c, node in enumerate(ids):
        data = run.clients[c]
        clients.append(Client(ClientSettings(node, "fed", exit_when_finished=True,
                                             **(client_settings or {})),
                              (data.x, data.y), broker.transport(node), tmp_path / node))
    threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
    if start_clients:
        for t in threads:
            t.start()
    return run, aggregator, clients, threads


def run_fleet(aggregator, clients, threads, limit_s: float = 60.0):
    """The clients' threads started (fleet(..., start_clients=False)), the aggregator run
    (stopped after limit_s), then the clients stopped and joined: the aggregator's result,
    or what it raised."""
    for t in threads:
        t.start()
    timer = threading.Timer(limit_s, aggregator.stop.set)
    timer.start()
    try:
        return aggregator.run()
    finally:
        timer.cancel()
        for client in clients:        # a run that failed sends no end for them to exit on
            client.stop.set()
        for t in threads:
            t.join(5)


@pytest.mark.parametrize("strategy", ["fedumf", "mfl"])
def test_duplicated_deliveries_change_nothing(tmp_path, strategy):
    """QoS 1 repeats: the broker delivers half of all messages twice."""
    config = load_small_run(tmp_path, strategy={"name": strategy}, rounds=3,
                            clients_per_round=2)
    reference = simulate(config, None, progress=False)
    broker = LoopbackBroker(duplicate_rate=0.5, seed=1)
    _, aggregator, clients, threads = fleet(tmp_path, config, broker)
    result = aggregator.run()
    for t in threads:
        t.join(5)
    assert result.finished and model_sha256(result.params) == reference["model_sha256"]
    assert broker.stats["duplicated"] > 0
    assert sum(c.stats["trained"] for c in clients) == sum(h["trained"] for h in result.history)


def test_a_client_checks_its_data_against_the_model_once_per_run_not_per_round(
        tmp_path, monkeypatch):
    """A client trains on the same shard every round: its check (kernels.Samples: shape,
    values, labels) is made by its first local round and kept, and the model is the same."""
    config = load_small_run(tmp_path, rounds=4, clients_per_round=2)
    reference = simulate(config, None, progress=False)
    checked = collections.Counter()          # client shard (its x's id) -> checks made
    real = kernels.Samples

    class CountingSamples(real):
        __slots__ = ()

        def __init__(self, model, x, y):
            checked[id(x)] += 1
            super().__init__(model, x, y)

    monkeypatch.setattr(kernels, "Samples", CountingSamples)
    broker = LoopbackBroker()
    _, aggregator, clients, threads = fleet(tmp_path, config, broker)
    result = aggregator.run()
    for t in threads:
        t.join(10)
    assert result.finished and model_sha256(result.params) == reference["model_sha256"]
    trained = {id(c.x): c.stats["trained"] for c in clients if c.stats["trained"]}
    assert sum(trained.values()) > len(trained)      # some client trained in several rounds
    assert {shard: checked[shard] for shard in trained} == {shard: 1 for shard in trained}


@pytest.mark.parametrize("follow_round", [True, False], ids=["round-and-task", "task-only"])
def test_per_client_tasks_serve_clients_with_and_without_the_round_topic(tmp_path,
                                                                       follow_round):
    """An aggregator with task_topics: each tasked client also gets its task alone on
    task/<client>, and every client the run's end there. A client that follows both topics
    trains each task once; one that follows only its own topic takes part all the same and
    ends with the run (docs/protocol.md section 1)."""
    config = load_small_run(tmp_path, rounds=3, clients_per_round=2)
    reference = simulate(config, None, progress=False)
    broker = LoopbackBroker()
    _, aggregator, clients, threads = fleet(
        tmp_path, config, broker,
        settings=AggregatorSettings(federation="fed", round_timeout_s=20, task_topics=True),
        client_settings={"follow_round": follow_round})
    result = aggregator.run()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)          # every client heard of the end
    assert result.finished and model_sha256(result.params) == reference["model_sha256"]
    assert [h["closed_by"] for h in result.history] == ["all"] * 3
    assert sum(c.stats["trained"] for c in clients) == sum(h["trained"] for h in result.history)
    assert sum(c.stats["resent"] for c in clients) == 0


def test_each_tasked_clients_copy_is_named_in_its_task_and_taken_without_a_hash(
        tmp_path, monkeypatch):
    """When a few of many are tasked, each gets its own copy of the global model; its task
    names that copy's frame ("model_frame" of the entry), so the client takes it as the
    announced model without hashing it, and the run ends with the in-process model."""
    from edgefl.roles import client as client_module

    hashed = []
    real = client_module.buffers_sha256
    monkeypatch.setattr(client_module, "buffers_sha256",
                        lambda buffers: hashed.append(1) or real(buffers))
    reference, _, result, clients, seen = _one_of_four_watched(tmp_path)
    assert result.finished and model_sha256(result.params) == reference
    tasks = [entry for doc in seen for entry in doc["tasks"].values()]
    assert len(tasks) == 2 and all(e["source"] == "global" and len(e["model_frame"]) == 16
                                   for e in tasks)
    assert sum(c.stats["trained"] for c in clients) == 2 and hashed == []


def _one_of_four_watched(tmp_path):
    """2 rounds of one client of 4 through a LoopbackBroker (each tasked client gets its
    own copy), with a watcher on the round topic: (in-process model_sha256, the aggregator,
    its result, the clients, the rounds' announcements as the watcher saw them)."""
    config = load_small_run(tmp_path, rounds=2, clients_per_round=1,
                            partition={"name": "iid", "clients": 4})
    reference = simulate(config, None, progress=False)["model_sha256"]
    broker = LoopbackBroker()
    _, aggregator, clients, threads = fleet(tmp_path, config, broker)
    watcher = broker.transport("watcher")
    watcher.connect()
    watcher.subscribe(Topics("fed").round())
    result = aggregator.run()
    for t in threads:
        t.join(10)
    seen = []
    while (item := watcher.receive(timeout=0)) is not None:
        if isinstance(item, Message) and item.payload:
            doc = json.loads(item.payload)
            if not doc.get("finished"):
                seen.append(doc)
    return reference, aggregator, result, clients, seen


@pytest.mark.parametrize("max_payload", [128 * 1024, 1024], ids=["whole", "chunked"])
def test_a_task_carried_in_the_copy_of_the_model_is_taken_as_if_on_its_own_topic(
        tmp_path, monkeypatch, max_payload):
    """task_in_copy (a simulated fleet's aggregator): a tasked client's task travels in its
    copy of the global model (the scalar "task"), not on task/<client>: one message a tasked
    client. A client that follows only its own topics takes it from the copy, without a
    hash (the task names the copy's frame), and the run ends with the in-process model;
    task/<client> carries only the run's end. A copy split into chunks carries no task that
    can be read before its last chunk: its task goes on task/<client> too, after it."""
    from edgefl.roles import client as client_module

    hashed = []
    real = client_module.buffers_sha256
    monkeypatch.setattr(client_module, "buffers_sha256",
                        lambda buffers: hashed.append(1) or real(buffers))
    broker = LoopbackBroker()
    watcher = broker.transport("watcher")
    watcher.connect()
    watcher.subscribe(Topics("fed").subscription("task"))
    watcher.subscribe(Topics("fed").subscription("client_model"))
    reference, result, clients, threads = _run_with_tasks_in_copies(
        tmp_path, broker,
        AggregatorSettings(federation="fed", round_timeout_s=20, task_topics=True,
                           task_in_copy=True, max_payload=max_payload),
        {"follow_round": False, "max_payload": max_payload})
    assert not any(t.is_alive() for t in threads)          # every client heard of the end
    assert result.finished and model_sha256(result.params) == reference
    assert [h["closed_by"] for h in result.history] == ["all"] * 3
    tasks, copies = [], []
    while (item := watcher.receive(timeout=0)) is not None:
        if isinstance(item, Message) and item.payload:
            (copies if "/model/" in item.topic else tasks).append(item.payload)
    assert sum(c.stats["trained"] for c in clients) == 3 and hashed == []
    if max_payload < 128 * 1024:
        assert len(copies) > 3 and sum(not json.loads(p).get("finished") for p in tasks) == 3
        return
    assert tasks and all(json.loads(p)["finished"] for p in tasks)      # only the run's end
    assert len(copies) == 3
    for payload in copies:
        task = json.loads(wire.peek_scalars(payload)["task"])
        (node, entry), = task["tasks"].items()
        assert int(entry["model_frame"], 16) == wire.read_header(payload).message_id


def test_a_lost_copy_carrying_its_task_costs_a_deadline_not_the_run(tmp_path):
    """task_in_copy: the copy is not retained, so a lost one leaves its client without the
    task. The round's deadline re-announces it, and that task goes on task/<client>
    (retained); the client then takes its copy (re-sent) as the model of a task it already
    has. The run ends with the in-process model."""
    broker = LoopbackBroker(drop_rate=0.5, faults_on=Topics("fed").subscription("client_model"),
                            seed=3)
    reference, result, _, _ = _run_with_tasks_in_copies(
        tmp_path, broker,
        AggregatorSettings(federation="fed", round_timeout_s=1.5, task_topics=True,
                           task_in_copy=True, resend_interval_s=0.2),
        {"follow_round": False, "model_wait_s": 0.3})
    assert broker.stats["dropped"] > 0
    assert result.finished and model_sha256(result.params) == reference
    assert sum(h["announcements"] for h in result.history) > 3     # some round re-announced


def _run_with_tasks_in_copies(tmp_path, broker, settings, client_settings):
    """The task_in_copy tests' run: 3 rounds of one client of 4 through `broker`, the clients
    subscribed before the run starts (a copy is not retained; a simulation's clients listen
    before the run too). (in-process model_sha256, result, clients, client threads)."""
    config = load_small_run(tmp_path, rounds=3, clients_per_round=1,
                            partition={"name": "iid", "clients": 4})
    reference = simulate(config, None, progress=False)["model_sha256"]
    _, aggregator, clients, threads = fleet(tmp_path, config, broker, settings=settings,
                                            client_settings=client_settings,
                                            start_clients=False)
    for t in threads:
        t.start()
    topics = Topics("fed")
    wait_for(lambda: all(topics.secure_to(c.node) in c.transport.subscriptions
                         for c in clients), what="every client subscribed")
    result = aggregator.run()
    for t in threads:
        t.join(10)
    return reference, result, clients, threads


def test_sending_copies_leaves_the_global_frame_unencoded_until_it_is_asked_for(
        tmp_path, monkeypatch):
    """When each tasked client gets its own copy, the global model's frame is announced by
    its hash and message id but not encoded (nothing publishes it). Asked for after all,
    it is encoded then: under the announced id, with the announced hash."""
    from edgefl.roles import aggregator as aggregator_module

    encoded = collections.Counter()
    real_encode = wire.encode
    monkeypatch.setattr(aggregator_module.wire, "encode",       # the aggregator's frames
                        lambda kind, r, sender, *a, **k:
                        encoded.update([kind] if sender == "aggregator" else []) or
                        real_encode(kind, r, sender, *a, **k))
    globals_ = []
    real_build = Aggregator._build_downlinks

    def build(self):
        real_build(self)
        globals_.append((self.open.round, self.open.downlinks["global"]))
    monkeypatch.setattr(Aggregator, "_build_downlinks", build)
    reference, aggregator, result, _, seen = _one_of_four_watched(tmp_path)
    assert result.finished and model_sha256(result.params) == reference
    assert encoded == {"client_model": 2}                # one copy a round, no global frame
    announced = {doc["round"]: doc for doc in seen}
    assert [r for r, _ in globals_] == [1, 2]
    for r, downlink in globals_:
        (payload,) = downlink.payloads                   # encoded now
        frame = wire.decode(payload, wire.Expectation(aggregator.table, kinds="model",
                                                      rounds=r))
        assert frame.message_id == int(announced[r]["model_frame"], 16)
        assert msg.buffers_sha256(frame.buffers) == downlink.sha == \
            announced[r]["model_sha256"]
    assert encoded == {"client_model": 2, "model": 2}


class _LosesAChunk(LoopbackBroker):
    """Loses the second chunk of the updates of `nodes` on their way to the aggregator: in
    `rounds`, or (rounds None) in the first `first` updates of each (by round, which is the
    task of an asynchronous run)."""

    def __init__(self, nodes, rounds=None, first: int = 0, **kw):
        super().__init__(**kw)
        self.nodes, self.rounds, self.first = set(nodes), rounds, first
        self.lost: dict = collections.defaultdict(list)         # node -> rounds

    def _deliver(self, transport, msg, faults):
        node = msg.topic.rsplit("/", 1)[-1]
        if "/update/" in msg.topic and node in self.nodes and msg.payload:
            h = wire.read_header(msg.payload)
            lost = self.lost[node]
            if h.is_chunk and h.chunk_index == 1 and h.round not in lost and \
                    (h.round in self.rounds if self.rounds is not None
                     else len(lost) < self.first):
                lost.append(h.round)
                return
        super()._deliver(transport, msg, faults)


def test_a_client_that_lost_a_chunk_in_five_rounds_in_a_row_is_heard_in_the_next(tmp_path):
    """A client whose update misses a chunk in rounds 1-5 (the broker lost it) leaves five
    incomplete messages, more than the four the aggregator holds per sender. Each is dropped
    when its round closes, so its complete update of round 6 is taken at once, not refused
    until the first ones time out (reassembly_timeout_s)."""
    config = load_small_run(tmp_path, rounds=7, clients_per_round=2,
                            partition={"name": "iid", "clients": 2})
    broker = _LosesAChunk({"client-0"}, range(1, 6))
    _, aggregator, _, threads = fleet(
        tmp_path, config, broker,
        settings=AggregatorSettings(federation="fed", round_timeout_s=1.0, min_updates=1,
                                    max_payload=1024),
        client_settings={"max_payload": 1024})
    result = aggregator.run()
    for t in threads:
        t.join(10)
    assert result.finished and broker.lost["client-0"] == [1, 2, 3, 4, 5]
    # (a round 1-5 re-announced for want of any update would have client-0's re-sent whole)
    assert [(h["updates"], h["closed_by"]) for h in result.history][5:] == [(2, "all")] * 2
    assert aggregator.reassembler.pending == 0


def test_an_asynchronous_client_that_lost_a_chunk_in_five_tasks_is_heard_in_the_next(
        tmp_path):
    """The same for FedBuff's tasks: each client's updates of its first five tasks miss a
    chunk. A task given up at its timeout takes its incomplete update with it, so a sixth
    update is taken at once, and the step it makes ends the run seconds after the start,
    not after the reassembly timeout (60 s)."""
    config = load_small_run(tmp_path, rounds=1, clients_per_round=2,
                            partition={"name": "iid", "clients": 2},
                            strategy={"name": "fedbuff", "concurrency": 2, "buffer_size": 1,
                                      "max_staleness": 4})
    broker = _LosesAChunk({"client-0", "client-1"}, first=5)
    _, aggregator, _, threads = fleet(
        tmp_path, config, broker,
        settings=AggregatorSettings(federation="fed", round_timeout_s=1.0, max_payload=1024),
        client_settings={"max_payload": 1024})
    timer = threading.Timer(30.0, aggregator.stop.set)   # the reassembly timeout is 60 s
    timer.start()
    try:
        result = aggregator.run()
    finally:
        timer.cancel()
    for t in threads:
        t.join(10)
    assert result.finished, broker.lost
    assert max(len(lost) for lost in broker.lost.values()) == 5   # its sixth made the step
    assert [h["updates"] for h in result.history] == [1]


def test_rounds_kept_in_memory_only_when_asked_write_no_checkpoint_and_end_the_same(
        tmp_path):
    """checkpoint_rounds=False (a simulation whose state is deleted with the run): the
    rounds' checkpoints and journal lines are not written, only the run's start, and the
    run ends with the in-process model and records."""
    config = load_small_run(tmp_path, rounds=3, clients_per_round=2)
    reference = simulate(config, None, progress=False)
    broker = LoopbackBroker()
    _, aggregator, _, threads = fleet(
        tmp_path, config, broker,
        settings=AggregatorSettings(federation="fed", round_timeout_s=20,
                                    checkpoint_rounds=False))
    result = aggregator.run()
    for t in threads:
        t.join(10)
    assert result.finished and model_sha256(result.params) == reference["model_sha256"]
    assert [h["round"] for h in result.history] == [1, 2, 3] and result.aggregated == [1, 2, 3]
    on_disk = AggregatorCheckpoint.load(tmp_path / "agg")
    assert on_disk.round == 0 and on_disk.run_id == result.run_id
    events = [e["event"] for e in state_files.read_journal(aggregator.journal_path)]
    assert "aggregated" not in events and events[0] == "started"


def test_overlapped_evaluation_gives_the_same_records_and_survives_a_restart(tmp_path):
    """overlap_evaluation (a simulated fleet's aggregator): a round's evaluation runs while
    the next round does. The records, test metrics included, and the model are the ones in
    process; on_round sees each round once, in order, evaluated, with the history up to it;
    on_model each round's model as it is checkpointed. A checkpoint written while its
    round's evaluation ran (the process killed then) is completed when the run resumes."""
    from edgefl.sim import run_federation

    config = load_small_run(tmp_path, rounds=4, clients_per_round=2)
    broker = LoopbackBroker()
    settings = AggregatorSettings(federation="fed", round_timeout_s=20, overlap_evaluation=True)
    run, aggregator, clients, threads = fleet(tmp_path, config, broker, settings=settings)
    reference = run_federation(run.strategy, run.init_params, run.clients, run.setup,
                               config.clients_per_round, test=(run.dataset.x_test,
                                                               run.dataset.y_test))
    seen, models = [], []

    def on_model(r, model):
        models.append((r, model_sha256(model)))
        if r == 2:
            aggregator.stop.set()        # the run stops after round 2 is checkpointed

    aggregator.on_round = lambda record, history: seen.append(
        (record["round"], record["test_accuracy"], [h["round"] for h in history]))
    aggregator.on_model = on_model
    first = aggregator.run()
    assert not first.finished and [h["round"] for h in first.history] == [1, 2]
    # round 2's evaluation, still running when the run stopped, is in the checkpoint
    ckpt = AggregatorCheckpoint.load(tmp_path / "agg")
    assert ckpt.history[-1]["test_accuracy"] == reference.history[1]["test_accuracy"]
    # as if the process had died before it was: resuming evaluates the checkpointed model
    ckpt.history[-1]["test_accuracy"] = ckpt.history[-1]["test_loss"] = None
    ckpt.save(tmp_path / "agg")
    second = Aggregator(aggregator.plan, broker.transport("aggregator"), tmp_path / "agg",
                        settings)
    second.on_round = aggregator.on_round
    second.on_model = lambda r, model: models.append((r, model_sha256(model)))
    result = second.run()
    for t in threads:
        t.join(10)
    assert result.finished and model_sha256(result.params) == model_sha256(reference.params)
    for got, want in zip(result.history, reference.history, strict=True):
        assert (got["round"], got["test_accuracy"], got["test_loss"], got["train_loss"]) == \
            (want["round"], want["test_accuracy"], want["test_loss"], want["train_loss"])
    assert seen == [(r, reference.history[r - 1]["test_accuracy"], list(range(1, r + 1)))
                    for r in (1, 2, 3, 4)]
    assert [r for r, _ in models] == [1, 2, 3, 4] and models[-1][1] == \
        model_sha256(reference.params)


def test_aggregator_refuses_foreign_late_and_unauthorised_updates(tmp_path, caplog):
    caplog.set_level(logging.INFO, "edgefl.roles.aggregator")
    config = load_small_run(tmp_path, strategy={"name": "fedumf"}, rounds=2,
                            clients_per_round=1)
    broker = LoopbackBroker()
    run, aggregator, clients, threads = fleet(tmp_path, config, broker, start_clients=False)
    chosen = select_clients(config.seed, 1, range(3), 1)[0]
    other = next(c for c in range(3) if c != chosen)
    rogue = broker.transport("rogue")
    rogue.connect()
    table = run.model.table
    params = {"params": run.init_params}

    def forge(node, round, run_id):
        scalars = msg.update_scalars(Update(params, 10, 0.5, 1), run_id, 0.0)
        return wire.encode("update", round, node, params, scalars, table)

    done = threading.Event()
    result = {}

    def body():
        result["r"] = aggregator.run()
        done.set()

    agg_thread = threading.Thread(target=body, daemon=True)
    agg_thread.start()
    wait_for(lambda: aggregator.open is not None, what="round 1 to open", timeout=10.0, poll=0.01)
    run_id = aggregator.run_id
    topics = Topics("fed")
    rogue.publish(topics.update(f"client-{other}"), forge(f"client-{other}", 1, run_id))
    rogue.publish(topics.update("stranger"), forge("stranger", 1, run_id))
    rogue.publish(topics.update(f"client-{chosen}"), forge(f"client-{chosen}", 1, "old-run"))
    rogue.publish(topics.update(f"client-{chosen}"), forge(f"client-{other}", 1, run_id))
    wait_for(lambda: aggregator.stats["rejected"] >= 4, what="four rejections",
             timeout=10.0, poll=0.01)
    assert "was not selected to upload this round (FedUmf" in caplog.text
    assert "'stranger' is not a client of this federation" in caplog.text
    assert "belongs to run old-run" in caplog.text
    assert f"sender 'client-{other}'" in caplog.text
    for t in threads:
        t.start()
    assert done.wait(20)
    r = result["r"]
    assert r.finished and [h["updates"] for h in r.history] == [1, 1]
    reference = simulate(config, None, progress=False)
    assert model_sha256(r.params) == reference["model_sha256"]
    for t in threads:
        t.join(5)


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    config = load_small_run(tmp_path, rounds=1)
    broker = LoopbackBroker()
    _, aggregator, clients, threads = fleet(tmp_path, config, broker)
    assert aggregator.run().finished
    for t in threads:
        t.join(5)
    other = load_small_run(tmp_path, "other.yaml", rounds=1, seed=1)
    _, second, _, _ = fleet(tmp_path, other, broker, start_clients=False)
    with pytest.raises(StateError, match="holds the checkpoint of run .* made with another "
                                         "configuration"):
        second.run()


def test_a_stop_during_the_offline_phase_ends_the_aggregators_run_before_it_starts(tmp_path):
    """DUW learns its table by training before round 1; the aggregator service's stop (a
    StopFlag among the stop events it passes) stops that training within one local step,
    and run_aggregator returns None (not finished: the service resumes the run after a
    restart) without a checkpoint or touching the transport, instead of failing the run."""
    from edgefl.errors import TrainingStopped
    from edgefl.kernels import StopFlag
    from edgefl.roles.control import EitherStop
    from edgefl.roles.runner import run_aggregator

    config = load_small_run(tmp_path, "duw.yaml", strategy={"name": "duw",
                                                             "meta_iterations": 2},
                            clients_per_round=3)
    flag = StopFlag()
    flag.set()
    result = run_aggregator(config, None, str(tmp_path / "agg"), settings=AggregatorSettings(),
                            stop=EitherStop(flag, threading.Event()))
    assert result is None
    assert AggregatorCheckpoint.load(tmp_path / "agg") is None
    # the stop, not the config, ended it: the phase raises TrainingStopped with the flag set
    # and learns its table with it clear
    with pytest.raises(TrainingStopped):
        prepare_run(config, workers=1, progress=False, stop=flag)
    flag.clear()
    assert prepare_run(config, workers=1, progress=False, stop=flag).strategy.name == "duw"


def test_a_boards_refusal_reason_reaches_the_aggregators_log_as_one_clean_line(tmp_path,
                                                                             caplog):
    """A board in hostile hands sends a refusal whose reason holds terminal escape
    sequences (retitle, clear, recolour), a carriage return and newlines, and is 20,000
    characters long. The aggregator logged it raw: the operator's terminal obeyed the
    escapes, and the newlines forged log lines of their own. It is now one line, control
    characters escaped, bounded; the round still goes on without that board. Its
    client_refused event carried the reason whole (up to the 64 KiB status limit, to every
    watcher of the events topic): it is bounded like the log line, with a mark that it was
    cut, and otherwise raw (readers escape for display)."""
    from edgefl.roles.aggregator import REASON_CHARS

    caplog.set_level(logging.WARNING, "edgefl.roles.aggregator")
    config = load_small_run(tmp_path, rounds=1, clients_per_round=2)
    broker = LoopbackBroker()
    _, aggregator, clients, threads = fleet(
        tmp_path, config, broker, AggregatorSettings(federation="fed", round_timeout_s=30),
        start_clients=False)
    threads[1].start()                            # client-1 is an honest board
    hostile = ("\x1b]0;owned\x07\x1b[2J\x1b[31mbad\r\n"
               "2026-11-30 12:00:00 INFO edgefl.roles.aggregator round 1 closed\n" + "x" * 20_000)
    topics = Topics("fed")
    rogue = broker.transport("client-0")          # client-0's account, in hostile hands
    rogue.connect()
    rogue.subscribe(topics.topic("round"))
    stop = threading.Event()

    def refuse_every_round():
        while not stop.is_set():
            item = rogue.receive(timeout=0.1)
            if isinstance(item, Message) and item.payload:
                doc = json.loads(item.payload)
                if "finished" in doc:
                    continue
                rogue.publish(topics.status("client-0"), json.dumps(
                    {"node": "client-0", "role": "client", "online": True,
                     "version": hostile,
                     "refused": {"run": doc["run"], "round": doc["round"],
                                 "reason": hostile}}).encode(), retain=True)

    watcher = broker.transport("watcher")         # `edgefl ctl watch`, the dashboard
    watcher.connect()
    watcher.subscribe(topics.events())
    board = threading.Thread(target=refuse_every_round, daemon=True)
    board.start()
    try:
        result = aggregator.run()
    finally:
        stop.set()
        board.join(5)
        threads[1].join(5)
    assert result.history[0]["updates"] == 1     # not waited for
    # the version a status claims is kept for messages that name the board (a plain update
    # in a secure round, the error that ends such a run): one short escaped line, too
    version = aggregator.versions["client-0"]
    assert len(version) <= 128 and "\x1b" not in version and "\n" not in version, version
    events = []
    while (item := watcher.receive(timeout=0.2)) is not None:
        if isinstance(item, Message):
            events.append(json.loads(item.payload))
    (refused,) = [e for e in events if e["event"] == "client_refused"]
    assert refused["client"] == "client-0"
    reason = refused["reason"]
    assert reason == f"{hostile[:REASON_CHARS]}... ({len(hostile)} characters)", \
        (len(reason), reason[-100:])
    lines = [r.getMessage() for r in caplog.records if "client-0 refused" in r.getMessage()]
    assert len(lines) == 1, caplog.text[-2000:]
    line = lines[0]
    assert not any(ch in line for ch in "\x1b\x07\r\n"), repr(line[:300])
    assert r"\x1b]0;owned\x07" in line and r"\r\n2026-11-30" in line, line[:300]
    assert len(line) < 1000 and "characters)" in line, len(line)


def test_a_board_that_cannot_read_its_task_says_so_and_is_not_waited_for(tmp_path,
                                                                         monkeypatch, caplog):
    """A newer aggregator may announce a train setting this board's edgefl does not know
    (here: every announcement gets one more train key, as such an aggregator's would):
    kernels.train_config refuses it, and the board sat the round out saying nothing, so the
    round waited for its deadline. It now says so in its status (`refused`, with the
    reason), as for a model its limits refuse: the round closes without it at once."""
    import edgefl.roles.aggregator as aggregator_module

    def newer(**kwargs):       # client-0's task carries the setting client-1's does not
        doc = msg.build_announcement(**kwargs)
        if "client-0" in doc["tasks"]:
            entry = doc["tasks"]["client-0"]
            entry["train"] = {**entry["train"], "future_knob": 1}
        return doc

    monkeypatch.setattr(aggregator_module, "build_announcement", newer)
    caplog.set_level(logging.WARNING, "edgefl.roles.aggregator")
    config = load_small_run(tmp_path, rounds=1, clients_per_round=2)
    broker = LoopbackBroker()
    _, aggregator, _, threads = fleet(
        tmp_path, config, broker, AggregatorSettings(federation="fed", round_timeout_s=30))
    started = time.monotonic()
    result = aggregator.run()
    took = time.monotonic() - started
    for t in threads:
        t.join(5)
    first = result.history[0]
    assert first["closed_by"] != "deadline" and took < 20, (first, took)
    assert first["updates"] == 1
    refused = [r.getMessage() for r in caplog.records if "client-0 refused" in r.getMessage()]
    assert refused and "future_knob" in refused[0], caplog.text[-2000:]


def test_a_board_whose_training_diverges_says_so_and_the_round_does_not_wait_for_it(tmp_path):
    """A board whose local round fails (its training diverged: data out of all scale, a
    learning rate too high for it) has no update to send. It logged the error and said
    nothing, so the aggregator waited for it until the round's deadline, every round it was
    tasked. It now says why in its retained status, as a board refusing a round does, and
    the round closes with the others' updates at once."""
    config = load_small_run(tmp_path, rounds=1, clients_per_round=2)
    broker = LoopbackBroker()
    _, aggregator, clients, threads = fleet(
        tmp_path, config, broker, AggregatorSettings(federation="fed", round_timeout_s=120),
        start_clients=False)
    clients[0].x = clients[0].x * np.float32(1e30)     # a sensor gone wrong: finite, huge
    watcher = broker.transport("watcher")
    watcher.connect()
    watcher.subscribe(Topics("fed").events())
    result = run_fleet(aggregator, clients, threads)
    (record,) = result.history
    assert record["updates"] == 1 and record["closed_by"] != "deadline", record
    events = []
    while (item := watcher.receive(timeout=0.2)) is not None:
        if isinstance(item, Message):
            events.append(json.loads(item.payload))
    (refused,) = [e for e in events if e["event"] == "client_refused"]
    assert refused["client"] == "client-0" and refused["round"] == 1
    assert refused["reason"].startswith("round 1: training diverged"), refused["reason"]


def test_no_update_is_buffered_after_an_asynchronous_runs_last_step(tmp_path, monkeypatch):
    """After FedBuff's last step the run is over: an update already queued then was still
    taken in (a buffer file written for a step that never comes, left in the finished run's
    state; seen in CI as two such files where the kill -9 test allows none). Here the last
    step waits until the other two boards' updates are queued behind it."""
    import glob

    from edgefl.roles.asynchronous import BUFFER_DIR, AsynchronousAggregator

    config = load_small_run(tmp_path, rounds=1, partition={"name": "iid", "clients": 4},
                            strategy={"name": "fedbuff", "concurrency": 4, "buffer_size": 2,
                                      "max_staleness": 4})
    broker = LoopbackBroker()
    _, aggregator, clients, threads = fleet(tmp_path, config, broker)
    step = AsynchronousAggregator._step

    def step_once_all_trained(self):
        wait_for(lambda: sum(c.stats["uploads"] for c in clients) == 4, 20,
                 what="every board's update sent")
        time.sleep(0.2)                        # and delivered to the aggregator's queue
        step(self)

    monkeypatch.setattr(AsynchronousAggregator, "_step", step_once_all_trained)
    result = aggregator.run()
    for t in threads:
        t.join(10)
    assert result.finished and [h["updates"] for h in result.history] == [2]
    assert glob.glob(str(tmp_path / "agg" / BUFFER_DIR / "*.npz")) == []


def _async_fleet_with_limits(tmp_path, monkeypatch, limited: list, rounds: int = 3):
    """FedBuff over four boards on the loopback broker, the boards in `limited` refusing
    every task (compute.max_params = 1), the others taking 0.3 s a local round:
    (aggregator, clients, threads), not yet run."""
    import dataclasses

    from edgefl.roles.client import Client
    finish = Client._finish_job

    def slow(self):
        time.sleep(0.3)
        finish(self)

    monkeypatch.setattr(Client, "_finish_job", slow)
    config = load_small_run(tmp_path, rounds=rounds, partition={"name": "iid", "clients": 4},
                            strategy={"name": "fedbuff", "concurrency": 4, "buffer_size": 2,
                                      "max_staleness": 4})
    _, aggregator, clients, threads = fleet(
        tmp_path, config, LoopbackBroker(),
        AggregatorSettings(federation="fed", round_timeout_s=20), start_clients=False)
    for i in limited:
        clients[i].settings = dataclasses.replace(clients[i].settings, max_params=1)
    return aggregator, clients, threads


def test_an_asynchronous_run_does_not_task_a_refusing_board_again_at_the_same_version(
        tmp_path, monkeypatch):
    """A board that refuses its task (its limits rule the model out) is given up at once;
    it was then the first idle board and tasked again at once, and refused again: 119
    tasks, each with its model published, in a one-second run of three steps (the review's
    count). It is tasked again only once the version has moved on."""
    aggregator, clients, threads = _async_fleet_with_limits(tmp_path, monkeypatch, [0])
    result = run_fleet(aggregator, clients, threads)
    assert result.finished and len(result.history) == 3
    # given up: client-0's refused tasks, at most one a version (0, 1 and 2)
    assert sum(h["abandoned"] for h in result.history) <= 3, result.history
    assert clients[0].stats["trained"] == 0


def test_an_asynchronous_run_every_board_refuses_fails_naming_them(tmp_path, monkeypatch):
    """No board can train the run: every one refuses its task. The run could never take a
    step; it ends at once with an error naming the boards and why, instead of waiting."""
    aggregator, clients, threads = _async_fleet_with_limits(tmp_path, monkeypatch,
                                                            [0, 1, 2, 3])
    with pytest.raises(ConfigError, match=r"version 0: every board refused this run's "
                                          r"task.*client-0, client-1, client-2, client-3: "
                                          r"the run's model has \d+ parameters") as failed:
        run_fleet(aggregator, clients, threads, limit_s=30.0)
    assert "max_params = 1" in str(failed.value)


def test_an_asynchronous_board_whose_local_round_failed_is_tasked_again(tmp_path,
                                                                        monkeypatch):
    """A failed local round (here each board's first: a data file briefly unreadable) is
    said as a refusal of that task, which is given up at once; unlike a board whose limits
    rule the run out, the board may well train its next task, so it is not kept out of the
    version (every board failing once at version 0 ended the run with 'every board
    refused'; review -95)."""
    from edgefl.roles.client import Client

    finish, failed = Client._finish_job, set()

    def fails_once(self):
        if self.node not in failed and self.job is not None and self.job.error is None:
            failed.add(self.node)
            self.job.error = ValueError("data file briefly unreadable")
        finish(self)

    monkeypatch.setattr(Client, "_finish_job", fails_once)
    config = load_small_run(tmp_path, rounds=2, partition={"name": "iid", "clients": 3},
                            strategy={"name": "fedbuff", "concurrency": 3, "buffer_size": 2,
                                      "max_staleness": 4})
    _, aggregator, clients, threads = fleet(
        tmp_path, config, LoopbackBroker(),
        AggregatorSettings(federation="fed", round_timeout_s=20), start_clients=False)
    result = run_fleet(aggregator, clients, threads)
    assert failed == {"client-0", "client-1", "client-2"}
    assert result.finished and len(result.history) == 2


def test_the_rejections_an_aggregator_remembers_stay_bounded_over_a_long_run(tmp_path,
                                                                            caplog):
    """Each rejected or late frame of a board is logged once, by its message id; the ids
    were kept for the whole run, a chunk budget's worth a round from a board that keeps
    sending bad frames. The latest `reassembler.remember` of them are kept: a repeat of a
    recent one is still logged once."""
    config = load_small_run(tmp_path, rounds=2, clients_per_round=2)
    _, aggregator, _, _ = fleet(tmp_path, config, LoopbackBroker(), start_clients=False)
    remember = aggregator.reassembler.remember
    caplog.set_level(logging.WARNING, "edgefl.roles")
    for message_id in range(3 * remember):
        aggregator._reject("client-0", "a bad frame", ("client-0", message_id))
    assert len(aggregator._logged) == remember
    logged = caplog.text.count("a bad frame")
    aggregator._reject("client-0", "a bad frame", ("client-0", 3 * remember - 1))
    assert caplog.text.count("a bad frame") == logged == 3 * remember
