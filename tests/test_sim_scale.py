"""`edgefl simulate` at scale (issue 19, items 1-2): a client's shard is a slice of the one
training array, not a copy; the training set is checked once, not once per client; the
layout trains the same model as per-client copies did; a million virtual clients over a
tiny data set select and train at small cost. Nothing here is timed (tools/bench_scale.py
--mode simulate / million measures)."""
import json
import os

import numpy as np
import pytest
import yaml

from edgefl import kernels
from edgefl.config import ConfigError, dataset_from_config, partition_from_config
from edgefl.data import partition as split_of
from edgefl.data.layout import contiguous, permute_rows
from edgefl.data.partition import Partition, Shards, Tiled
from edgefl.runconfig import load_run_config
import test_sim                                  # its small run
from helpers import import_tool
from edgefl.runs.prepare import ShardClients, local_datasets, prepare_run
from edgefl.sim import run_federation, simulate
from edgefl.strategies import Setup, select_clients

SMALL = {**test_sim.SMALL, "rounds": 3}     # digits, 6 IID clients, 3 a round


def config(tmp_path, **sections):
    data = json.loads(json.dumps(SMALL))
    data.update(sections)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_run_config(str(path))


def test_permute_rows_matches_a_gather_across_step_boundaries(monkeypatch):
    import edgefl.data.layout as layout
    monkeypatch.setattr(layout, "_CHUNK_BYTES", 3 * 4 * 5)     # 5 rows a step
    rng = np.random.default_rng(7)
    for n in (0, 1, 2, 3, 17, 500):
        x = rng.standard_normal((n, 3)).astype(np.float32)
        order = rng.permutation(n)
        want = x[order]
        permute_rows(x, order)
        assert np.array_equal(x, want)
    with pytest.raises(ValueError, match="order"):
        permute_rows(np.zeros((4, 2), np.float32), np.arange(3))


@pytest.mark.parametrize("partition", [
    {"name": "iid", "clients": 6},
    {"name": "dirichlet", "clients": 5, "alpha": 0.5},
    {"name": "label-noise", "clients": 4, "rate": 0.5},
])
def test_a_shard_is_a_view_of_the_one_training_array(tmp_path, partition):
    cfg = config(tmp_path, partition=partition)
    run = prepare_run(cfg, progress=False)
    # what each client held before: its own copy of x_train[indices] (a fresh load)
    dataset = dataset_from_config(cfg.as_config())
    split = partition_from_config(cfg.as_config(), dataset)
    copies = local_datasets(dataset, split, run.model)
    assert isinstance(run.clients, ShardClients) and len(run.clients) == len(split.indices)
    train = run.dataset.x_train
    for c in range(len(split.indices)):
        data = run.clients[c]
        assert np.shares_memory(data.x, train), f"client {c}'s x is a copy"
        assert data.x.base is train or data.x.base is train.base
        assert np.array_equal(data.x, copies[c].x)        # the same rows, in the same order
        assert np.array_equal(data.y, copies[c].y)
        assert data.samples.x is data.x                   # no check made a copy either
    # the same rounds give the same model bit for bit
    a = run_federation(run.strategy, run.init_params, run.clients, run.setup, 3)
    b = run_federation(run.strategy, run.init_params, copies, run.setup, 3)
    assert a.model_sha256 == b.model_sha256


def test_the_training_set_is_checked_once_not_per_client(tmp_path, monkeypatch):
    calls = []
    real = kernels.check_inputs
    monkeypatch.setattr(kernels, "check_inputs",
                        lambda model, x, *a, **k: calls.append(len(x)) or real(model, x, *a, **k))
    run = prepare_run(config(tmp_path), progress=False)
    run_federation(run.strategy, run.init_params, run.clients, run.setup, 3,
                   test=(run.dataset.x_test, run.dataset.y_test), workers=1)
    # once for the whole training set (prepare_run), once for the test set (the engine);
    # per-client checks would add one per distinct client trained (up to 6 here)
    assert calls == [len(run.dataset.x_train), len(run.dataset.x_test)]


def test_a_split_that_is_not_a_permutation_is_gathered_not_reordered():
    from edgefl.data import load_dataset
    ds = load_dataset("digits", limit_train=50)
    before = ds.x_train.copy()
    split = Partition((np.array([0, 1, 2]), np.array([2, 3])))     # overlaps, leaves rows out
    laid, out = contiguous(ds, split)
    assert np.array_equal(ds.x_train, before)                      # the caller's rows kept
    assert np.array_equal(laid.x_train[out.indices[0]], before[[0, 1, 2]])
    assert np.array_equal(laid.x_train[out.indices[1]], before[[2, 3]])
    assert isinstance(out.indices, Shards) and list(out.sizes) == [3, 2]


def test_a_million_virtual_clients_over_a_tiny_data_set(tmp_path):
    cfg = config(tmp_path, partition={"name": "iid", "clients": 1_000_000, "tile": 10_000},
                 rounds=2, clients_per_round=50)
    run = prepare_run(cfg, progress=False)
    # nothing of size N but ids: the clients are a range, the shards 100 slices
    assert isinstance(run.setup.clients, range) and len(run.setup.clients) == 1_000_000
    assert isinstance(run.split.indices, Tiled) and len(run.split.indices.base) == 100
    assert run.setup.to_json()["clients"] == {"start": 0, "stop": 1_000_000}
    assert Setup.from_json(run.setup.to_json()).clients == run.setup.clients
    far = run.clients[999_999]
    assert np.array_equal(far.x, run.clients[99].x) and np.shares_memory(far.x, run.clients[99].x)
    assert far.client == 999_999 and 1_000_000 not in run.clients
    with pytest.raises(KeyError):
        run.clients[1_000_000]
    summary = simulate(cfg, None, progress=False, workers=1)
    assert summary["rounds"] == 2 and np.isfinite(summary["final_loss"])
    # the selection over a range is the selection over the same ids as a list
    picked = select_clients(0, 1, range(1_000_000), 50)
    assert len(set(picked)) == 50 and max(picked) < 1_000_000 and picked == sorted(picked)
    assert picked == select_clients(0, 1, list(range(1_000_000)), 50)


def test_tile_must_divide_the_clients(tmp_path):
    with pytest.raises(ConfigError, match="tile = 7 does not divide clients = 100"):
        prepare_run(config(tmp_path, partition={"name": "iid", "clients": 100, "tile": 7}),
                    progress=False)
    with pytest.raises(ValueError, match="tile must be a positive integer"):
        split_of(np.zeros(10, np.int32), "iid", 10, 0, tile=0)


def test_first_train_gives_the_source_order_after_the_layout():
    from edgefl.data import load_dataset
    ds = load_dataset("digits", limit_train=300)
    before = ds.x_train.copy()
    laid, _ = contiguous(ds, split_of(ds, "dirichlet", 5, 0, alpha=0.5))
    assert not np.array_equal(laid.x_train[:20], before[:20])      # the rows moved ...
    assert np.array_equal(laid.first_train(20), before[:20])       # ... the first 20 did not
    assert np.array_equal(laid.first_train(10_000), before)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_bench_scale_cpu_meter_counts_each_threads_cpu_per_round():
    """bench_scale --cpu (docs/scaling.md's CPU-by-part table): CPU burnt by a named thread
    between the first and the last round's model is that thread's, divided by the rounds
    after the first; a pool's numbered threads are one part; the total adds the parts."""
    import threading
    import time
    bench_scale = import_tool("bench_scale")

    meter = bench_scale.CpuMeter(last_round=3, broker_pid=None)
    meter(1, None)
    done = threading.Event()
    burnt = [threading.Event() for _ in range(2)]

    def burn(i):
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        burnt[i].set()
        done.wait(10)                # alive at the last snapshot: its /proc entry is read

    workers = [threading.Thread(target=burn, args=(i,), name=f"burner_{i}") for i in range(2)]
    for w in workers:
        w.start()
    for event in burnt:
        assert event.wait(10)
    meter(2, None)
    meter(3, None)
    done.set()
    for w in workers:
        w.join()
    out = meter.per_round()
    # 2 x 0.3 s over 2 rounds: 300 ms a round, give or take the 10 ms ticks
    assert 250 <= out["this process: burner"] <= 350, out
    assert out["total"] == pytest.approx(sum(v for k, v in out.items() if k != "total"))
    assert bench_scale.CpuMeter(3, None).per_round() == {}


def test_bench_scale_limit_test_evaluates_both_layouts_on_the_first_n_test_images(tmp_path,
                                                                                   capsys):
    """bench_scale --limit-test N (docs/scaling.md: how the ratio moves when work both runs
    share gets cheaper): the run file both layouts load has a test set of N images; without
    it the whole test set. N below 1, or the option with another --mode, is refused with a
    line that says why, before anything starts."""
    import argparse
    bench_scale = import_tool("bench_scale")

    def loaded_test_set(limit, where):
        args = argparse.Namespace(dataset="digits", limit_test=limit, clients=6, per_round=2,
                                  rounds=2)
        where.mkdir()
        run_file = bench_scale.config_file(str(where), args)
        return dataset_from_config(load_run_config(run_file).as_config())

    full = loaded_test_set(None, tmp_path / "full").x_test
    limited = loaded_test_set(50, tmp_path / "limited").x_test
    assert len(full) > 50 and len(limited) == 50
    np.testing.assert_array_equal(limited, full[:50])
    for argv, says in ((["--limit-test", "0"], "--limit-test 0: need a positive number"),
                       (["--limit-test", "50", "--mode", "million"],
                        "--limit-test is for --mode broker")):
        with pytest.raises(SystemExit) as exc:
            bench_scale.main(argv)
        assert exc.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--repeats", "0"], "--repeats 0: need at least 1"),
    (["--clients", "0"], "--clients 0: need at least 1"),
    (["--clients", "10", "--per-round", "20"], "--per-round 20: more than the 10 clients"),
    # options of --mode simulate were ignored in the other modes: a "before" never measured
    (["--before", "."], "--before: for --mode simulate, not --mode broker"),
    (["--outputs", "--mode", "million"], "--outputs: for --mode simulate, not --mode million"),
    (["--mode", "simulate", "--before", "/nonexistent"],
     "--before /nonexistent: not a checkout of edgefl"),
])
def test_bench_scale_refuses_bad_arguments_before_measuring(argv, says, capsys):
    bench_scale = import_tool("bench_scale")
    with pytest.raises(SystemExit) as exc:
        bench_scale.main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.skipif(__import__("edgefl.transport.broker", fromlist=["x"]).find_mosquitto()
                    is None, reason="needs the mosquitto binary")
def test_bench_broker_floor_moves_every_update_and_leaves_no_process(tmp_path):
    """tools/bench_broker_floor.py (docs/scaling.md: what paho alone costs a round): each
    round's updates all come back through a real Mosquitto (a missing one ends the run with
    SystemExit), its CPU is read for each part, and its worker processes are gone after."""
    bench_scale = import_tool("bench_scale")
    floor = import_tool("bench_broker_floor")
    before = set(floor.children(os.getpid()))     # a session's broker fixture, say
    broker = bench_scale.Mosquitto(str(tmp_path))
    try:
        out = floor.floor_run(broker.port, clients=6, per_round=2, rounds=5, processes=2,
                              broker_pid=broker.proc.pid, seed=7)
    finally:
        broker.stop()
    assert set(out) == {"aggregator", "workers", "broker", "total"}
    assert all(v >= 0 for v in out.values())
    assert out["total"] == pytest.approx(out["aggregator"] + out["workers"] + out["broker"],
                                         abs=0.02)
    assert set(floor.children(os.getpid())) <= before


@pytest.mark.parametrize("tool, argv, says", [
    ("fuzz", ["--frames", "0"], "--frames 0: need at least 1"),
    ("plain_loop", ["--clients", "10", "--per-round", "20"],
     "--per-round 20: more than the 10 clients"),
    ("bench_privacy", ["--repeats", "0"], "--repeats 0: need at least 1"),
    ("bench_transport", ["--pairs", "0"], "--pairs 0: need at least 1"),
    ("bench_edge", ["--capacity", "--sites", "0"], "--sites 0: need at least 1"),
    ("bench_broker_floor", ["--rounds", "2"], "--rounds 2: need at least 3"),
    ("bench_broker_floor", ["--per-round", "20", "--clients", "10"],
     "--per-round 20: more than the 10 clients"),
    ("experiments/secagg_round_cost", ["--repeats", "0"], "--repeats 0: need at least 1"),
    ("experiments/dp_accuracy", ["--epsilons", "abc"], "--epsilons 'abc': need numbers"),
    ("experiments/dp_accuracy", ["--partitions", "nosuch"], "--partitions: nosuch unknown"),
])
def test_tools_refuse_a_count_that_would_measure_nothing(tool, argv, says):
    # a usage error naming the option, before anything runs: a run of 0 repeats or frames
    # printed empty tables and "failures: 0", or died in a traceback ("no median for
    # empty data"), and a misspelt partition failed after the first ones had run
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / f"{tool}.py"
    done = subprocess.run([sys.executable, str(script), *argv], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="tools/bench_cold.py puts a load on a second CPU (Linux)")
def test_bench_cold_times_every_pair_restores_the_affinity_and_refuses_bad_arguments(capsys):
    """tools/bench_cold.py (docs/scaling.md's table of a message's work hot and after a
    pause): a row for every (work, before) pair with the hot row its own unit; the calling
    process may use all its CPUs again afterwards; a bad count is refused by name."""
    bench_cold = import_tool("bench_cold")
    cpus = os.sched_getaffinity(0)
    assert bench_cold.main(["--repeats", "1", "--calls", "2", "--json"]) == 0
    assert os.sched_getaffinity(0) == cpus
    out = json.loads(capsys.readouterr().out)
    rows = {(r["work"], r["before each call"]): r for r in out["rows"]}
    assert set(rows) == {(w, b) for w in bench_cold.WORKS for b in bench_cold.BEFORE}
    for (work, before), row in rows.items():
        assert 0 < row["us_min"] <= row["us_median"] <= row["us_max"], row
        if before == "nothing":
            assert row["times_hot"] == 1.0
    for bad in (["--repeats", "0"], ["--calls", "0"]):
        with pytest.raises(SystemExit):
            bench_cold.main(bad)
        assert "--repeats and --calls must be at least 1" in capsys.readouterr().err
