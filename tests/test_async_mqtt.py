"""Asynchronous FedBuff runs over MQTT (edgefl/roles/asynchronous.py) through a real
Mosquitto started by the test:

- `edgefl simulate --transport mqtt` runs FedBuff with K < C: every step is recorded with K
  updates, each task applied at most once, some updates stale (the run is asynchronous);
- the aggregator process killed with SIGKILL while updates sit in its buffer files (frozen
  with SIGSTOP when the state directory shows them, checked, then killed), restarted: it
  resumes at its last applied version, the buffered updates are applied once, the boards
  re-send their stored updates instead of retraining, and the count of applied updates is
  the count of updates accepted by the two processes.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import threading
import uuid

import pytest

pytest.register_assert_rewrite("brokers")
from edgefl.cli import main    # noqa: E402
from edgefl.errors import ConfigError    # noqa: E402
from edgefl.roles import AggregatorCheckpoint, Client, ClientSettings    # noqa: E402
from edgefl.roles.asynchronous import BOOK_FILE, BUFFER_DIR    # noqa: E402
from edgefl.roles.state import JOURNAL_FILE, load_arrays, read_journal    # noqa: E402
from edgefl.runconfig import load_run_config    # noqa: E402
from edgefl.runs.prepare import prepare_run    # noqa: E402
from helpers import (AggregatorProcesses, aggregated_rounds,  # noqa: E402
                     read_jsonl, start_mqtt_clients, stop_clients, wait_for, write_run_yaml)

pytest_plugins = ["brokers"]

BASE = {
    "dataset": {"name": "digits", "limit_train": 400},
    "partition": {"name": "iid", "clients": 6},
    "model": {"name": "softmax"},
    "strategy": {"name": "fedbuff", "concurrency": 4, "buffer_size": 2, "max_staleness": 4},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "rounds": 8,
    "clients_per_round": 4,
    "seed": 0,
}


def test_fedbuff_with_k_below_c_runs_over_mosquitto_and_records_every_step(
        tmp_path, mosquitto_server):
    path = write_run_yaml(tmp_path, BASE)
    out = tmp_path / "out"
    assert main(["simulate", path, "--transport", "mqtt", "--broker", mosquitto_server.url,
                 "--out", str(out), "--quiet"]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == list(range(1, 9))
    assert all(r["closed_by"] == "buffer" and r["updates"] == 2 for r in rows)
    tasks = [t for r in rows for t in r["tasks"]]
    assert len(tasks) == len(set(tasks)) == 16           # no task applied twice
    assert max(r["staleness_max"] for r in rows) >= 1    # boards trained older versions
    summary = json.loads((out / "summary.json").read_text())
    assert summary["transport"]["rejected"] == 0 and summary["rounds"] == 8


def test_the_virtual_fleet_stays_in_process(tmp_path):
    config = load_run_config(write_run_yaml(
        tmp_path, BASE, sim_fleet={"profile": "rpi4"}))
    from edgefl.sim import simulate
    with pytest.raises(ConfigError, match=r"run.yaml: sim_fleet: a simulated fleet \(the virtual "
                                          r"clock\) runs in edgefl simulate in process only"):
        simulate(config, None, progress=False, transport="mqtt")


def _pending(state) -> list:
    """The buffer files of steps the checkpoint does not hold yet."""
    ckpt = AggregatorCheckpoint.load(state)
    done = ckpt.round if ckpt is not None else 0
    return sorted(int(load_arrays(p)[1]["task"])
                  for p in glob.glob(os.path.join(state, BUFFER_DIR, "*.npz"))
                  if int(load_arrays(p)[1]["step"]) > done)


def _async_service(tmp_path, server):
    """The BASE run as `edgefl aggregator --once` processes (AggregatorProcesses) of a
    federation of their own on `server`, and the prepared run its clients train."""
    path = write_run_yaml(tmp_path, BASE)
    tag = uuid.uuid4().hex[:8]
    fed = f"async-{tag}"
    procs = AggregatorProcesses(tmp_path, server.url, path, f"agg-{tag}", fed)
    return procs, prepare_run(load_run_config(path), progress=False), tag, fed


def test_aggregator_killed_with_updates_buffered_resumes_losing_and_doubling_nothing(
        tmp_path, mosquitto_server):
    rounds = BASE["rounds"]
    procs, run, tag, fed = _async_service(tmp_path, mosquitto_server)
    state, out = procs.state, procs.out
    clients, threads = {}, []

    def aggregated():
        return aggregated_rounds(procs.journal)

    try:
        first = procs.spawn("aggregator-1.log")
        clients, threads = start_mqtt_clients(mosquitto_server.url, fed, tag, run, tmp_path,
                                              range(6))

        # Freeze the aggregator once a version is applied and an update of the next sits
        # in a buffer file; thawed to go on when the frozen state shows none.
        pending = []

        def frozen_with_a_buffered_update() -> bool:
            if len(aggregated()) < 2 or not os.path.isdir(state / BUFFER_DIR) \
                    or not glob.glob(str(state / BUFFER_DIR / "*.npz")):
                return False
            first.send_signal(signal.SIGSTOP)
            try:
                pending[:] = _pending(str(state))
            except (OSError, ValueError, KeyError):     # a file caught mid-rename
                pending[:] = []
            if pending and len(aggregated()) < rounds:
                return True
            first.send_signal(signal.SIGCONT)
            return False

        wait_for(frozen_with_a_buffered_update, timeout=60,
                 what="an update buffered and not yet applied", poll=0.005)
        applied_before = AggregatorCheckpoint.load(str(state)).round
        first.send_signal(signal.SIGKILL)
        assert first.wait(10) == -signal.SIGKILL
        assert aggregated() == list(range(1, applied_before + 1))
        in_flight = json.loads((state / BOOK_FILE).read_text())["flight"]

        procs.run_again(threads)
    finally:
        procs.close()
        stop_clients(clients, threads)

    # every version applied exactly once, in order, across the two processes
    assert aggregated() == list(range(1, rounds + 1))
    ckpt = AggregatorCheckpoint.load(str(state))
    assert ckpt.aggregated == list(range(1, rounds + 1))
    logs = [procs.log(f"aggregator-{i}.log") for i in (1, 2)]
    done = [[int(r) for r in re.findall(r"round (\d+) aggregated", text)] for text in logs]
    assert done == [list(range(1, applied_before + 1)),
                    list(range(applied_before + 1, rounds + 1))], done
    assert f"{applied_before} of {rounds} rounds aggregated" in logs[1]
    assert f"{len(pending)} update(s) in the buffer" in logs[1]

    # applied = accepted: the records' tasks are exactly the tasks the two processes
    # buffered (each once: a re-sent copy of a buffered task is ignored), none lost. The
    # first process may have been frozen after a buffer file and before its log line: the
    # files it left are counted; those left at the end are the unfilled last buffer.
    rows = read_jsonl(out / "metrics.jsonl")
    applied = [t for r in rows for t in r["tasks"]]
    assert sum(r["updates"] for r in rows) == len(applied) == len(set(applied)) == 2 * rounds
    logged = [[int(t) for t in re.findall(r"update of client-\d+ for task (\d+) buffered",
                                          text)] for text in logs]
    assert not set(logged[0]) & set(logged[1]), "a task was buffered by both processes"
    buffered = logged[0] + logged[1]
    assert len(buffered) == len(set(buffered)), "a task was buffered twice"
    leftover = _pending(str(state))
    assert len(leftover) < 2
    assert sorted(applied + leftover) == sorted(set(buffered) | set(pending)), \
        (applied, leftover, buffered, pending)
    assert set(pending) <= set(applied), "an update buffered before the kill was lost"

    # the boards re-sent their stored updates for tasks in flight, and trained no task twice
    named = re.compile(r"(client-\d+) \(task (\d+)\)")     # the log's "client-1 (task 7)"
    tasked = {}
    for text in logs:
        for node, t in named.findall(text):
            tasked.setdefault(node, set()).add(int(t))
    # the second process published again exactly the tasks in flight at the kill that no
    # buffer file answered, and logged them (the first may have been frozen before its log)
    again = re.findall(r"tasks in flight published again \(resumed\): (.*)", logs[1])
    republished = {n: int(t) for n, t in named.findall(again[0] if again else "")}
    assert len(again) <= 1
    assert republished == {n: e["task"] for n, e in in_flight.items()
                           if e["task"] not in pending}, (republished, in_flight, pending)
    for c, client in clients.items():
        node = f"client-{c}"
        assert client.stats["trained"] <= len(tasked.get(node, ())), (node, client.stats)
    # An in-flight task answered after the restart came from one of three places, and each
    # leaves its trace: its board re-sent its stored update (the first process had taken it
    # off the broker and died before buffering it: `resent`); the first process had written
    # its buffer file before the freeze but not yet its book (it is in `pending`, read from
    # the files while frozen); or the broker delivered the original upload to the second
    # process from the aggregator's persistent session, never acknowledged by the first
    # (seen in CI: no re-send, task 5 applied; the second process's log buffers it).
    answered = {int(n.split("-")[1]): e["task"] for n, e in in_flight.items()
                if e["task"] in applied}
    for c, task in answered.items():
        stats = clients[c].stats
        assert stats["resent"] >= 1 or task in pending or task in logged[1], \
            (f"client-{c}", task, stats, pending, logged)


def test_aggregator_killed_after_a_steps_checkpoint_applies_its_buffer_once(
        tmp_path, mosquitto_server):
    """The aggregator process dies (SIGKILL, by its own hand) inside step 2's commit: its
    checkpoint renamed into place, its journal line, the deletion of its buffer files and
    async.json not yet done (docs/async.md "A step commits in this order"). Started again,
    it deletes those buffer files as applied (the checkpoint holds their step), lists step
    2 in the journal once (recovered), and applies no task twice."""
    rounds = BASE["rounds"]
    procs, run, tag, fed = _async_service(tmp_path, mosquitto_server)
    state = procs.state
    clients, threads = {}, []
    try:
        first = procs.spawn_killed_at_round("aggregator-1.log", 2)
        clients, threads = start_mqtt_clients(mosquitto_server.url, fed, tag, run, tmp_path,
                                              range(6))
        assert first.wait(60) == -signal.SIGKILL, procs.log("aggregator-1.log")[-3000:]
        ckpt = AggregatorCheckpoint.load(str(state))
        assert ckpt.round == 2 and aggregated_rounds(procs.journal) == [1]
        step2 = set(ckpt.history[-1]["tasks"])
        left = {int(load_arrays(p)[1]["task"])
                for p in glob.glob(str(state / BUFFER_DIR / "*.npz"))}
        assert step2 <= left, (step2, left)          # killed before they were deleted
        assert json.loads((state / BOOK_FILE).read_text())["version"] == 1
        procs.run_again(threads)
    finally:
        procs.close()
        stop_clients(clients, threads)
    journal = [r for r in read_journal(procs.journal) if r.get("event") == "aggregated"]
    assert [r["round"] for r in journal] == list(range(1, rounds + 1))
    assert [r["round"] for r in journal if r.get("recovered")] == [2]
    rows = read_jsonl(procs.out / "metrics.jsonl")
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))
    applied = [t for r in rows for t in r["tasks"]]
    assert len(applied) == len(set(applied)) == 2 * rounds, applied
    assert [set(r["tasks"]) for r in rows][1] == step2


# ---------------------------------------------------------------------------------------
# agreement: the MQTT run driven by the virtual clock's arrival order is the in-process run
# ---------------------------------------------------------------------------------------

MIXED = {"rpi-zero2w": 0.3, "rpi4": 0.5, "rpi5": 0.2}


@pytest.mark.parametrize("fleet", [None, {"mix": MIXED}], ids=["lockstep", "mixed-fleet"])
def test_loopback_run_released_in_the_clocks_order_gives_the_in_process_model(tmp_path, fleet):
    """The boards' uploads are held and released in the order the virtual clock of the
    in-process run gives (its Clock and EventQueue, each task's seconds from its task
    message): the asynchronous aggregator then takes the same steps and ends with the
    in-process run's model_sha256.

    One instant's arrivals reach the aggregator together: its transport's receive waits
    while a batch is being released, so it never tasks idle boards between two updates of
    one instant (the in-process driver refills after the instant); the next instant is
    released once the aggregator has tasked as many boards as came back (or finished).
    Lockstep: every task takes one simulated second, so C updates arrive at each instant
    and two steps are taken in it; the mixed fleet: arrivals one by one, some too stale."""
    import numpy as np
    from edgefl.checkpoint import model_sha256
    from edgefl.roles import AggregatorSettings, RunPlan, default_client_ids
    from edgefl.roles.asynchronous import AsynchronousAggregator
    from edgefl.roles.messages import task_from_announcement
    from edgefl.sim import simulate
    from edgefl.sim.clock import Clock, EventQueue
    from edgefl.transport.loopback import LoopbackBroker
    from edgefl.transport.topics import Topics

    changes = dict(rounds=10, strategy={"name": "fedbuff", "concurrency": 4,
                                        "buffer_size": 2, "max_staleness": 2})
    in_process = load_run_config(write_run_yaml(
        tmp_path, BASE, "clocked.yaml", **changes, **({"sim_fleet": fleet} if fleet else {})))
    reference = simulate(in_process, tmp_path / "ref", workers=1, progress=False)
    reference_rows = [json.loads(line) for line in
                      (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    config = load_run_config(write_run_yaml(tmp_path, BASE, "run.yaml", **changes))
    run = prepare_run(config, workers=1, progress=False)
    clock = Clock.lockstep() if fleet is None else \
        Clock.for_fleet(in_process.fleet, run.setup.clients, config.seed, run.model.n_params)
    ids = default_client_ids(len(run.setup.clients))
    topics = Topics("fed")
    broker = LoopbackBroker()

    gate = threading.Lock()                  # held while one instant's uploads go out
    held: dict = {}                          # node -> [(publish, args)] of its upload
    held_lock = threading.Lock()

    def holding(transport, node):
        publish = transport.publish

        def hold(topic, payload, qos=1, retain=False, **kw):
            if topic == topics.update(node):
                with held_lock:
                    held.setdefault(node, []).append((topic, payload, qos, retain, kw))
                return None
            return publish(topic, payload, qos, retain, **kw)
        transport.publish = hold
        return publish

    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, ids, test=(run.dataset.x_test, run.dataset.y_test),
                   description=config.to_dict())
    agg_transport = broker.transport("aggregator")
    receive = agg_transport.receive

    def gated_receive(timeout=None):
        item = receive(timeout)
        with gate:                # a batch under way is queued whole before we go on
            pass
        return item
    agg_transport.receive = gated_receive
    aggregator = AsynchronousAggregator(plan, agg_transport, tmp_path / "agg",
                                        AggregatorSettings(federation="fed",
                                                           round_timeout_s=600))
    publishers, threads, errors = {}, [], []
    for c, node in enumerate(ids):
        t = broker.transport(node)
        publishers[node] = holding(t, node)
        client = Client(ClientSettings(node, "fed", exit_when_finished=True,
                                       raise_on_error=True),
                        (run.clients[c].x, run.clients[c].y), t, tmp_path / node)
        threads.append(threading.Thread(target=client.run, daemon=True))
    observer = broker.transport("observer")
    observer.connect()
    observer.subscribe(topics.subscription("task"), qos=1)
    result = []

    def aggregate():
        try:
            result.append(aggregator.run())
        except BaseException as exc:      # noqa: BLE001 -- re-raised below
            errors.append(exc)
    agg_thread = threading.Thread(target=aggregate, daemon=True)
    for t in threads:
        t.start()
    agg_thread.start()

    events, seen, now = EventQueue(), set(), 0.0
    zeros = {"params": np.zeros(run.model.n_params, np.float32)}   # a task's downlink size

    def new_tasks(count):
        """The next `count` task messages (fewer once the run is over), pushed as arrivals
        in task id order: the in-process driver's push order (sorted selection)."""
        got = []

        def enough():
            while True:
                msg = observer.receive(timeout=0)
                if msg is None:
                    break
                if not getattr(msg, "payload", None):
                    continue
                doc = json.loads(msg.payload)
                if doc["round"] not in seen:
                    seen.add(doc["round"])
                    got.append(doc)
            return len(got) >= count or not agg_thread.is_alive()
        wait_for(enough, timeout=60, what=f"{count} new task(s)")
        for doc in sorted(got, key=lambda d: d["round"]):
            (node, entry), = doc["tasks"].items()
            task = task_from_announcement(doc, node, zeros)
            c = int(entry["client"])
            events.push(now + clock.task_seconds(c, task, run.clients[c].num_samples),
                        (node, doc["round"]))
        return len(got)

    try:
        new_tasks(4)                                  # C boards tasked at version 0
        while agg_thread.is_alive():
            now, arrivals = events.pop_simultaneous()
            for node, _ in arrivals:      # each board's upload, trained and held
                wait_for(lambda: node in held, timeout=60, what=f"the upload of {node}")
            with gate:
                for node, _ in arrivals:
                    with held_lock:
                        chunks = held.pop(node)
                    for topic, payload, qos, retain, kw in chunks:
                        publishers[node](topic, payload, qos, retain, **kw)
            new_tasks(len(arrivals))
        agg_thread.join(30)
    finally:
        aggregator.stop.set()
        for t in threads:
            t.join(30)
    if errors:
        raise errors[0]
    over_mqtt = result[0]
    assert over_mqtt.finished and len(over_mqtt.history) == 10
    assert model_sha256(over_mqtt.params) == reference["model_sha256"]
    assert [r["tasks"] and len(r["tasks"]) for r in over_mqtt.history] == [2] * 10
    for key in ("staleness_mean", "staleness_max", "dropped_stale", "selected"):
        assert [r[key] for r in over_mqtt.history] == [r[key] for r in reference_rows], key


def test_an_update_is_counted_once_and_only_for_the_task_in_flight(tmp_path, caplog):
    """Straight to the aggregator's update handler over the loopback broker: an update that
    names another version than its task's is refused naming both (the task stays in
    flight); the right one is written to its buffer file and counted; a re-sent copy, or
    an update for a task not in flight, is ignored."""
    import logging
    import numpy as np
    from edgefl.roles import AggregatorSettings, RunPlan, default_client_ids
    from edgefl.roles.asynchronous import AsynchronousAggregator
    from edgefl.roles.messages import update_scalars
    from edgefl.strategies import Update
    from edgefl.transport import wire
    from edgefl.transport.loopback import LoopbackBroker

    config = load_run_config(write_run_yaml(tmp_path, BASE))
    run = prepare_run(config, workers=1, progress=False)
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, default_client_ids(6))
    agg = AsynchronousAggregator(plan, LoopbackBroker().transport("aggregator"),
                                 tmp_path / "agg", AggregatorSettings(federation="fed"))
    agg.ckpt = agg._load_or_start()
    agg._load_book()
    agg._connect()
    agg._refill()
    node, entry = sorted(agg.book["flight"].items())[0]

    def frame(task, version, run_id=None):
        update = Update({"params": np.zeros(run.model.n_params, np.float32)}, 10, 0.5, 3,
                        {"version": version})
        return wire.encode("update", task, node, update.buffers,
                           update_scalars(update, run_id or agg.ckpt.run_id, 0.01),
                           run.model.table, "none")

    caplog.set_level(logging.INFO, "edgefl.roles")
    agg._on_async_update(node, frame(entry["task"], 5))
    assert "it says it started from version 5, the task was of version 0" in caplog.text
    assert agg.stats["rejected"] == 1 and node in agg.book["flight"] and not agg.buffer
    agg._on_async_update(node, frame(entry["task"], 0))
    assert [t for t, *_ in agg.buffer] == [entry["task"]] and node not in agg.book["flight"]
    assert (tmp_path / "agg" / BUFFER_DIR / f"{entry['task']}.npz").exists()
    assert json.loads((tmp_path / "agg" / BOOK_FILE).read_text())["flight"].get(node) is None
    agg._on_async_update(node, frame(entry["task"], 0))          # re-sent
    agg._on_async_update(node, frame(entry["task"] + 100, 0))    # never tasked
    assert len(agg.buffer) == 1 and agg.stats["duplicates"] == 2
    assert "not the task in flight for it" in caplog.text
    # another run's update (a board still on a run this aggregator does not have, a
    # retained message of an earlier run) is named so, not counted as a duplicate
    agg._on_async_update(node, frame(entry["task"] + 200, 0, run_id="0123456789abcdef"))
    assert agg.stats["duplicates"] == 2 and agg.stats["rejected"] == 2
    assert f"belongs to run 0123456789abcdef, this is run {agg.ckpt.run_id}" in caplog.text
    agg._close()


class _Crash(BaseException):
    """The process dies here (raised by a patched file operation)."""


@pytest.mark.parametrize("where", ["before the checkpoint", "after the checkpoint"])
def test_a_step_cut_short_is_taken_once_after_a_restart(tmp_path, monkeypatch, where):
    """A crash inside a step, before the checkpoint is written or after it and before the
    buffer files are deleted: a new aggregator on the same state directory ends at the same
    version-1 model as an uncut step, applies each buffered update once, and ignores the
    boards' re-sent copies."""
    import numpy as np
    from edgefl.checkpoint import model_sha256
    from edgefl.roles import AggregatorSettings, RunPlan, default_client_ids
    from edgefl.roles import asynchronous as amod
    from edgefl.roles.messages import update_scalars
    from edgefl.roles.state import AggregatorCheckpoint as Ckpt
    from edgefl.strategies import Update
    from edgefl.transport import wire
    from edgefl.transport.loopback import LoopbackBroker

    config = load_run_config(write_run_yaml(tmp_path, BASE))
    run = prepare_run(config, workers=1, progress=False)
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, default_client_ids(6),
                   description=config.to_dict())
    broker = LoopbackBroker()

    def aggregator(state):
        agg = amod.AsynchronousAggregator(plan, broker.transport("aggregator"), state,
                                          AggregatorSettings(federation="fed"))
        agg.ckpt = agg._load_or_start()
        agg._load_book()
        agg._connect()
        return agg

    def frame(agg, node, task, seed):
        params = np.random.default_rng(seed).normal(size=run.model.n_params)
        update = Update({"params": params.astype(np.float32)}, 10 + seed, 0.5, 3,
                        {"version": 0})
        return wire.encode("update", task, node, update.buffers,
                           update_scalars(update, agg.ckpt.run_id, 0.01), run.model.table,
                           "none")

    def fill(agg):
        agg._refill()
        sent = []
        for i, (node, entry) in enumerate(sorted(agg.book["flight"].items())[:2]):
            sent.append((node, frame(agg, node, entry["task"], i)))
            agg._on_async_update(*sent[-1])
        assert len(agg.buffer) == 2
        return sent

    uncut = aggregator(tmp_path / "uncut")
    fill(uncut)
    uncut._step()
    expected = model_sha256(plan.strategy.global_model(uncut.ckpt.state))
    uncut._close()

    state = tmp_path / "cut"
    first = aggregator(state)
    sent = fill(first)
    if where == "before the checkpoint":
        def crash(*args, **kwargs):
            raise _Crash()
        monkeypatch.setattr(Ckpt, "save", crash)
    else:
        def crash(path):
            raise _Crash()
        monkeypatch.setattr(amod.os, "remove", crash)
    with pytest.raises(_Crash):
        first._step()
    monkeypatch.undo()
    files = sorted(p.name for p in (state / BUFFER_DIR).glob("*.npz"))
    assert len(files) == 2, files                     # the crash left both buffer files

    again = aggregator(state)
    if where == "before the checkpoint":
        assert again.ckpt.round == 0 and len(again.buffer) == 2
        again._step()                                 # the same step, taken once
    else:
        assert again.ckpt.round == 1 and again.buffer == []
        assert not list((state / BUFFER_DIR).glob("*.npz"))
    for node, data in sent:                           # the boards re-send: ignored
        again._on_async_update(node, data)
    assert again.buffer == [] and again.stats["duplicates"] == 2
    assert again.ckpt.round == 1 and again.ckpt.aggregated == [1]
    assert model_sha256(plan.strategy.global_model(again.ckpt.state)) == expected
    aggregated = [r["round"] for r in read_journal(state / JOURNAL_FILE)
                  if r.get("event") == "aggregated"]
    assert aggregated == [1]
    again._close()


# ---------------------------------------------------------------------------------------
# updates the strategy cannot use, and tasks a board cannot answer
# ---------------------------------------------------------------------------------------

def _rogue(url, fed, tag, node, answer):
    """A board `node` that answers each task on task/<node> with the update frame
    answer(task id, task) returns (bytes), over its own MQTT connection: stop() ends it."""
    from edgefl.roles.messages import task_from_announcement
    from edgefl.transport.mqtt import MqttTransport
    from edgefl.transport.topics import Topics

    topics = Topics(fed)
    t = MqttTransport(url, f"{node}-{tag}", connect_timeout=5, reconnect_min=0.05,
                      reconnect_max=0.5)
    t.connect()
    t.subscribe(topics.topic("task", node), qos=1)
    stop, answered = threading.Event(), []

    def loop():
        while not stop.is_set():
            item = t.receive(timeout=0.1)
            payload = getattr(item, "payload", None)
            if not payload:
                continue
            doc = json.loads(payload)
            if doc.get("finished") or int(doc["round"]) in answered:
                continue
            answered.append(int(doc["round"]))
            task = task_from_announcement(doc, node, {})
            t.publish(topics.topic("update", node), answer(int(doc["round"]), task, doc),
                      qos=1)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def close():
        stop.set()
        thread.join(5)
        t.close()
    return answered, close


def test_an_update_without_the_params_buffer_is_refused_and_the_run_goes_on(
        tmp_path, mosquitto_server):
    """A board answers its tasks with update frames that carry no buffers (a well-formed
    frame, of this run and of the task's version): the aggregator process refuses each,
    naming the missing 'params', and the run finishes with the other boards. Before, the
    update went into the buffer, the step raised StrategyError and the process died; a
    restart reloaded the buffer file and died again: the run was stuck for good."""
    from edgefl.roles.messages import update_scalars
    from edgefl.strategies import Update
    from edgefl.transport import wire

    rounds = BASE["rounds"]
    path = write_run_yaml(tmp_path, BASE)
    tag = uuid.uuid4().hex[:8]
    fed = f"async-{tag}"
    procs = AggregatorProcesses(tmp_path, mosquitto_server.url, path, f"agg-{tag}", fed,
                                deadline=3)
    run = prepare_run(load_run_config(path), progress=False)

    def empty(task_id, task, doc):
        update = Update({}, 10, 0.5, 3, {"version": int(task.scalars["version"])})
        return wire.encode("update", task_id, "client-0", {},
                           update_scalars(update, doc["run"], 0.01), run.model.table, "none")

    clients, threads, close = {}, [], None
    try:
        agg = procs.spawn("aggregator-1.log")
        answered, close = _rogue(mosquitto_server.url, fed, tag, "client-0", empty)
        clients, threads = start_mqtt_clients(mosquitto_server.url, fed, tag, run, tmp_path,
                                              range(1, 6))
        code = agg.wait(90)
        log_text = procs.log("aggregator-1.log")
        assert code == 0, log_text[-3000:]
    finally:
        if close is not None:
            close()
        procs.close()
        stop_clients(clients, threads)
    assert answered, "the rogue board was never tasked"
    assert aggregated_rounds(procs.journal) == list(range(1, rounds + 1))
    assert "update of client-0 for task" in log_text and \
        "carries no 'params' buffer" in log_text, log_text[-3000:]
    rows = read_jsonl(procs.out / "metrics.jsonl")
    assert not set(answered) & {t for r in rows for t in r["tasks"]}


def _mqtt_aggregator(tmp_path, server, **settings):
    """An AsynchronousAggregator of the BASE run over `server` (its own federation), its
    state loaded and its first tasks out, driven by the test: (aggregator, federation, tag)."""
    from edgefl.roles import AggregatorSettings, RunPlan, default_client_ids
    from edgefl.roles.asynchronous import AsynchronousAggregator
    from edgefl.transport.mqtt import MqttTransport

    config = load_run_config(write_run_yaml(tmp_path, BASE))
    run = prepare_run(config, workers=1, progress=False)
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, default_client_ids(6))
    tag = uuid.uuid4().hex[:8]
    fed = f"async-{tag}"
    agg = AsynchronousAggregator(
        plan, MqttTransport(server.url, f"agg-{tag}", connect_timeout=5), tmp_path / "agg",
        AggregatorSettings(federation=fed, node_id=f"agg-{tag}", **settings))
    agg.ckpt = agg._load_or_start()
    agg._load_book()
    agg._connect()
    agg._refill()
    return agg, fed, tag


def test_a_board_that_keeps_asking_for_its_model_is_given_up_at_the_deadline(
        tmp_path, mosquitto_server):
    """A board that asks for its task's model again and again (need_model in its status,
    over the broker) and never uploads gets the model re-sent each time, but its task is
    still given up once the deadline since it was tasked has passed: it does not hold one
    of the C slots for ever. Before, each re-send restarted the task's clock."""
    import time
    from edgefl.roles.messages import status_payload
    from edgefl.transport.mqtt import MqttTransport
    from edgefl.transport.topics import Topics

    agg, fed, tag = _mqtt_aggregator(tmp_path, mosquitto_server, round_timeout_s=1.0)
    board = None
    try:
        node, entry = sorted(agg.book["flight"].items())[0]
        board = MqttTransport(mosquitto_server.url, f"{node}-{tag}", connect_timeout=5)
        board.connect()
        status = Topics(fed).status(node)
        asks, tasked_at = 0, entry["opened"]
        while time.time() - tasked_at < 1.6:
            asks += 1
            board.publish(status, status_payload(node, "client", True, need_model=entry["task"],
                                                 at_ask=asks), qos=1, retain=True)
            agg._service(0.3)
        assert agg.counts["resends"] >= 3, agg.counts       # each ask was answered
        agg._give_up_overdue()
        assert node not in agg.book["flight"], agg.book["flight"][node]
        assert agg.counts["abandoned"] == 4      # the four tasked together, none answered
    finally:
        if board is not None:
            board.close()
        agg._close()


def test_a_steps_record_counts_the_updates_rejected_since_the_last_step(
        tmp_path, mosquitto_server):
    """An update refused (it names another version than its task's) is counted in the next
    step's record as `rejected`, as a synchronous round's record counts it. Before, the
    asynchronous record said 0 whatever was refused (only the run's total counted it)."""
    import numpy as np
    from edgefl.roles.messages import update_scalars
    from edgefl.strategies import Update
    from edgefl.transport import wire
    from edgefl.transport.mqtt import MqttTransport
    from edgefl.transport.topics import Topics

    agg, fed, tag = _mqtt_aggregator(tmp_path, mosquitto_server)
    board = None
    try:
        board = MqttTransport(mosquitto_server.url, f"boards-{tag}", connect_timeout=5)
        board.connect()
        n = agg.plan.model.n_params

        def send(node, task, version):
            update = Update({"params": np.zeros(n, np.float32)}, 10, 0.5, 3,
                            {"version": version})
            board.publish(Topics(fed).topic("update", node),
                          wire.encode("update", task, node, update.buffers,
                                      update_scalars(update, agg.ckpt.run_id, 0.01),
                                      agg.table, "none"), qos=1)

        flight = sorted(agg.book["flight"].items())
        send(flight[0][0], flight[0][1]["task"], 3)          # refused: not its version
        for node, entry in flight[:2]:
            send(node, entry["task"], 0)
        wait_for(lambda: agg._service(0.2) is False or len(agg.buffer) >= 2, timeout=20,
                 what="two updates buffered")
        assert agg.stats["rejected"] == 1
        agg._step()
        assert agg.ckpt.history[-1]["rejected"] == 1, agg.ckpt.history[-1]
    finally:
        if board is not None:
            board.close()
        agg._close()


def test_a_task_the_board_refuses_is_given_up_at_once(tmp_path, mosquitto_server):
    """A board that cannot take its task (its profile's limits, a task it cannot read) says
    so in its status (`refused`, naming the run and the task id), as in a synchronous
    round: the task is given up at once, its slot free for another board, and the log
    names the board's reason. Before, the asynchronous aggregator ignored the refusal and
    the slot stayed taken until round.deadline (300 s by default)."""
    from edgefl.roles.messages import status_payload
    from edgefl.transport.mqtt import MqttTransport
    from edgefl.transport.topics import Topics

    agg, fed, tag = _mqtt_aggregator(tmp_path, mosquitto_server)
    board = None
    try:
        (node, entry), (other, other_entry) = sorted(agg.book["flight"].items())[:2]
        board = MqttTransport(mosquitto_server.url, f"{node}-{tag}", connect_timeout=5)
        board.connect()
        topics = Topics(fed)
        # a refusal of another run, or of another task, changes nothing
        board.publish(topics.status(other), status_payload(
            other, "client", True, refused={"run": "another-run", "round": other_entry["task"],
                                            "reason": "not this run"}), qos=1, retain=True)
        board.publish(topics.status(node), status_payload(
            node, "client", True, refused={"run": agg.ckpt.run_id, "round": entry["task"],
                                           "reason": "model over compute.memory_budget_mb"}),
            qos=1, retain=True)
        wait_for(lambda: agg._service(0.2) and node not in agg.book["flight"], timeout=10,
                 what=f"task {entry['task']} of {node} given up")
        assert other in agg.book["flight"]
        assert json.loads((tmp_path / "agg" / BOOK_FILE).read_text())["flight"].get(node) is None
        assert agg.counts["abandoned"] == 1
    finally:
        if board is not None:
            board.close()
        agg._close()
