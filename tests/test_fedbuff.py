"""FedBuff (edgefl/strategies/fedbuff.py), the asynchronous driver (edgefl/sim/asynchronous.py),
the virtual clock (edgefl/sim/clock.py) and the `sim_fleet:` section (edgefl/virtual_fleet.py).

The acceptance tests: FedBuff with K = C and no staleness is FedAvg bit for bit; an
asynchronous run on a mixed fleet has the same model_sha256 for 1 and 4 worker threads.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from edgefl.errors import ConfigError
from edgefl.virtual_fleet import BOARDS, assign_profiles
from edgefl.rounds import RoundEngine, UploadRefused
from edgefl.runconfig import run_config_from_mapping
from edgefl.runs.prepare import prepare_run
from edgefl.service import profiles
from edgefl.sim import Clock, simulate
from edgefl.sim.clock import EventQueue
from edgefl.strategies import Setup, StrategyError, Update, get_strategy
from helpers import StopAtLine, load_small_run

MIXED = {"rpi-zero2w": 0.3, "rpi4": 0.5, "rpi5": 0.2}

RUN = {
    "dataset": {"name": "digits", "limit_train": 600},
    "partition": {"name": "dirichlet", "clients": 10, "alpha": 0.5},
    "model": {"name": "softmax"},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "rounds": 6,
    "clients_per_round": 5,
    "seed": 3,
}


def config(tmp_path, name="run.yaml", **changes):
    return load_small_run(tmp_path, name, **{**RUN, **changes})


def run(cfg, workers=1, out=None):
    return simulate(cfg, out, workers=workers, progress=False)


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------
# the reduction: K = C, no staleness, is synchronous FedAvg bit for bit
# ---------------------------------------------------------------------------------------

def test_fedbuff_with_k_equal_c_and_no_staleness_is_fedavg_bit_for_bit(tmp_path):
    """Without a fleet every task lasts one simulated second: the C clients tasked at a
    version all arrive together, fill the buffer (K = C) and are all fresh. Dirichlet
    shards make the sample weights unequal, so the weights are exercised too."""
    fedavg = run(config(tmp_path, "a.yaml", strategy={"name": "fedavg"}))
    for params in ({}, {"concurrency": 5, "buffer_size": 5, "staleness": "constant"},
                   {"staleness": "hinge", "max_staleness": 0}):
        fedbuff = run(config(tmp_path, "b.yaml", strategy={"name": "fedbuff", **params}),
                      out=tmp_path / f"b{len(params)}")
        assert fedbuff["model_sha256"] == fedavg["model_sha256"], params
        recs = records(tmp_path / f"b{len(params)}")
        assert [r["staleness_max"] for r in recs] == [0] * RUN["rounds"]
        assert [r["sim_time_s"] for r in recs] == [1.0 * r for r in range(1, 7)]


@pytest.mark.parametrize("eta, weighting", [(0.5, "samples"), (1.7, "uniform")])
def test_with_a_server_rate_the_reduction_is_fedavg_with_that_server_rate(tmp_path, eta,
                                                                          weighting):
    """With every update fresh and K = C, the step is w + eta sum_k p_k (w^k - w): FedAvg's
    average taken with server learning rate eta, which is FedAvgM without momentum (beta =
    0). Both compute it as one weighted sum with exact coefficients (eta p_k on the models,
    1 - eta on w), so the runs agree bit for bit, for the paper's uniform 1/K too."""
    sync = run(config(tmp_path, "a.yaml", strategy={"name": "fedavgm", "eta": eta,
                                                     "beta": 0.0, "weighting": weighting}))
    fedbuff = run(config(tmp_path, "b.yaml", strategy={"name": "fedbuff", "eta": eta,
                                                        "weighting": weighting}))
    plain = run(config(tmp_path, "c.yaml", strategy={"name": "fedavg", "weighting": weighting}))
    assert fedbuff["model_sha256"] == sync["model_sha256"] != plain["model_sha256"]


def test_the_reduction_holds_on_a_fleet_whose_tasks_all_take_as_long(tmp_path):
    """One board for everybody and equal IID shards: equal task times, so on the virtual
    clock too FedBuff (K = C) is FedAvg, model and simulated time."""
    iid = {"name": "iid", "clients": 10}
    fleet = {"profile": "rpi4"}
    fedavg = run(config(tmp_path, "a.yaml", strategy="fedavg", partition=iid, sim_fleet=fleet),
                 out=tmp_path / "a")
    fedbuff = run(config(tmp_path, "b.yaml", strategy="fedbuff", partition=iid,
                         sim_fleet=fleet),
                  out=tmp_path / "b")
    assert fedbuff["model_sha256"] == fedavg["model_sha256"]
    assert fedbuff["sim_time_s"] == pytest.approx(fedavg["sim_time_s"], rel=1e-12)
    assert fedavg["sim_time_s"] > 0


def test_a_clock_changes_no_bit_of_a_synchronous_run_without_deadline(tmp_path):
    plain = run(config(tmp_path, "a.yaml", strategy="fedavg"))
    timed = run(config(tmp_path, "b.yaml", strategy="fedavg", sim_fleet=MIXED), out=tmp_path / "b")
    assert timed["model_sha256"] == plain["model_sha256"]
    recs = records(tmp_path / "b")
    assert all(r["late"] == 0 for r in recs)
    times = [r["sim_time_s"] for r in recs]
    assert times == sorted(times) and times[0] > 0


# ---------------------------------------------------------------------------------------
# determinism: the event order is the clock's, never the threads'
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("partition", [{"name": "iid", "clients": 10},
                                       {"name": "dirichlet", "clients": 10, "alpha": 0.5}])
def test_an_asynchronous_run_is_the_same_for_any_number_of_workers(tmp_path, partition):
    cfg = config(tmp_path, strategy={"name": "fedbuff", "concurrency": 6, "buffer_size": 2},
                 partition=partition, sim_fleet=MIXED, rounds=12)
    one = run(cfg, workers=1, out=tmp_path / "w1")
    four = run(cfg, workers=4, out=tmp_path / "w4")
    assert one["model_sha256"] == four["model_sha256"]
    strip = ("wall_s", "train_wall_s", "elapsed_s")
    assert [{k: v for k, v in r.items() if k not in strip} for r in records(tmp_path / "w1")] \
        == [{k: v for k, v in r.items() if k not in strip} for r in records(tmp_path / "w4")]
    # the fleet is mixed, so updates do come in stale: the asynchronous path was exercised
    assert max(r["staleness_max"] for r in records(tmp_path / "w1")) >= 1


def test_updates_staler_than_max_staleness_are_dropped_and_counted(tmp_path):
    cfg = config(tmp_path, strategy={"name": "fedbuff", "concurrency": 6, "buffer_size": 2,
                                     "max_staleness": 1},
                 partition={"name": "iid", "clients": 10}, sim_fleet=MIXED, rounds=12)
    summary = run(cfg, out=tmp_path / "o")
    recs = records(tmp_path / "o")
    assert max(r["staleness_max"] for r in recs) <= 1
    dropped = sum(r["dropped_stale"] for r in recs)
    assert dropped > 0 and sum(r["dropped_bytes"] for r in recs) == dropped * 64 * 10 * 4 + \
        dropped * 10 * 4
    assert summary["rounds"] == 12


# ---------------------------------------------------------------------------------------
# the strategy's arithmetic
# ---------------------------------------------------------------------------------------

def test_staleness_weights():
    poly = get_strategy("fedbuff", staleness="polynomial", staleness_exponent=0.5)
    assert [poly.weight(s) for s in (0, 3)] == [1.0, 0.5]
    hinge = get_strategy("fedbuff", staleness="hinge", hinge_a=10, hinge_b=4)
    assert [hinge.weight(s) for s in (0, 4, 5)] == [1.0, 1.0, 1.0 / 11]
    assert get_strategy("fedbuff", staleness="constant").weight(7) == 1.0


def _update(params, version, n):
    return Update({"params": np.asarray(params, np.float32)}, n, 0.5, 3, {"version": version})


def test_a_stale_step_moves_by_the_weighted_deltas_from_each_start_model():
    """Two steps by hand: the second buffer holds one fresh update and one that started
    from version 0; the step is w_1 + eta sum_k p_k f(s_k) (w^k - w_{tau_k})."""
    fb = get_strategy("fedbuff", eta=0.5, staleness="polynomial", staleness_exponent=1.0,
                      max_staleness=2, weighting="samples")
    w0 = np.array([1.0, -2.0, 3.0], np.float32)
    s0 = fb.init(w0, Setup(clients=(0, 1, 2)))
    s1, m1 = fb.aggregate(1, {0: _update([2, 0, 1], 0, 1), 1: _update([0, 0, 0], 0, 3)}, s0)
    w1 = w0 + 0.5 * (0.25 * (np.float64([2, 0, 1]) - w0) + 0.75 * (0 - np.float64(w0)))
    assert np.allclose(s1.buffers["params"], w1, atol=1e-6) and m1["staleness_max"] == 0
    assert "params_v0" in s1.buffers
    fresh, stale = [5.0, 5.0, 5.0], [-1.0, 1.0, 0.0]
    s2, m2 = fb.aggregate(2, {(2, 0): _update(fresh, 1, 2), (0, 1): _update(stale, 0, 2)}, s1)
    w1 = np.float64(s1.buffers["params"])
    expect = w1 + 0.5 * (0.5 * (np.float64(fresh) - w1) + 0.5 * 0.5 * (np.float64(stale) - w0))
    assert np.allclose(s2.buffers["params"], expect, atol=1e-6)
    assert (m2["staleness_mean"], m2["staleness_max"]) == (0.5, 1)
    # the window keeps max_staleness past models: versions 0 and 1 after step 2
    assert sorted(b for b in s2.buffers if b.startswith("params_v")) == ["params_v0",
                                                                        "params_v1"]
    s3, _ = fb.aggregate(3, {1: _update(fresh, 2, 1)}, s2)
    assert sorted(b for b in s3.buffers if b.startswith("params_v")) == ["params_v1",
                                                                        "params_v2"]
    with pytest.raises(StrategyError, match="staleness 3 > max_staleness 2"):
        fb.aggregate(4, {1: _update(fresh, 0, 1)}, s3)


def test_a_task_from_the_future_or_without_version_is_refused():
    fb = get_strategy("fedbuff")
    state = fb.init(np.zeros(2, np.float32), Setup(clients=(0,)))
    assert "ahead of the server" in fb.staleness_refusal(_update([1, 1], 3, 1), state)
    no_version = Update({"params": np.ones(2, np.float32)}, 1, 0.1, 1)
    assert "no integer 'version'" in fb.staleness_refusal(no_version, state)


@pytest.mark.parametrize("params, key", [
    ({"buffer_size": 6, "concurrency": 4}, "buffer_size"),
    ({"concurrency": -1}, "concurrency"),
    ({"max_staleness": 1.5}, "max_staleness"),
    ({"eta": 0}, "eta"),
    ({"staleness": "linear"}, "staleness"),
    ({"staleness_exponent": -1}, "staleness_exponent"),
])
def test_bad_parameters_are_refused_by_name(params, key):
    with pytest.raises(StrategyError, match=key):
        get_strategy("fedbuff", **params)


def test_a_buffer_larger_than_the_runs_concurrency_is_refused_at_start(tmp_path):
    cfg = config(tmp_path, strategy={"name": "fedbuff", "buffer_size": 7})
    with pytest.raises(StrategyError, match="buffer_size = 7 is more than the concurrency 5"):
        run(cfg)


# ---------------------------------------------------------------------------------------
# the engine's asynchronous close
# ---------------------------------------------------------------------------------------

def test_close_buffer_checks_each_update_against_the_plan_that_tasked_it(tmp_path):
    prepared = prepare_run(config(tmp_path, strategy="fedbuff"), workers=1, progress=False)
    engine = RoundEngine.for_run(prepared.strategy, prepared.setup, prepared.model, 5,
                                 rounds=3)
    state = prepared.strategy.init(prepared.init_params, prepared.setup)
    plan = engine.open_round(1, state, among=[0, 1, 2, 3], count=2, draw=1)
    assert len(plan.selected) == 2 and set(plan.selected) <= {0, 1, 2, 3}
    outsider = next(c for c in range(10) if c not in plan.selected)
    c = plan.selected[0]
    update, _ = prepared.strategy.train(plan.tasks[c], prepared.clients[c], None)
    with pytest.raises(UploadRefused, match=f"client {outsider} has no task"):
        engine.close_buffer(1, [(plan, outsider, update)], [plan], state, started=0.0,
                            train_wall_s=0.0)
    closed = engine.close_buffer(1, [(plan, c, update), (plan, c, update)], [plan], state,
                                 started=0.0, train_wall_s=0.0)
    # the same client twice in one buffer counts twice; downlink = the plan's two tasks
    assert closed.record["selected"] == [c] and closed.record["trained"] == 2
    assert closed.record["uplink_bytes"] == 2 * update.nbytes


# ---------------------------------------------------------------------------------------
# the virtual clock and the fleet section
# ---------------------------------------------------------------------------------------

def test_every_device_profile_has_board_rates():
    assert sorted(BOARDS) == profiles.profile_names()


def test_profiles_are_dealt_in_the_mix_shares():
    got = assign_profiles(MIXED, range(20), np.random.default_rng(0))
    counts = {p: list(got.values()).count(p) for p in MIXED}
    assert counts == {"rpi-zero2w": 6, "rpi4": 10, "rpi5": 4}
    assert sorted(got) == list(range(20))


def test_a_tasks_time_is_download_compute_upload(tmp_path):
    cfg = config(tmp_path, strategy="fedavg", sim_fleet={"profile": "rpi-zero2w",
                                                      "bandwidth_mbps": 8, "gflops": 2})
    prepared = prepare_run(cfg, workers=1, progress=False)
    clock = Clock.for_fleet(cfg.fleet, prepared.setup.clients, cfg.seed,
                            prepared.model.n_params)
    state = prepared.strategy.init(prepared.init_params, prepared.setup)
    task = prepared.strategy.configure(1, [0], state)[0]
    n = prepared.clients[0].num_samples
    compute = 6 * prepared.model.n_params * n / 2e9          # one epoch of n samples
    wire = 2 * task.nbytes * 0.25 * 8 / 8e6                  # int8 on the Zero 2 W's link
    assert clock.task_seconds(0, task, n) == pytest.approx(compute + wire, rel=1e-12)


def test_the_deadline_stops_late_clients_and_closes_the_round(tmp_path):
    base = config(tmp_path, "a.yaml", strategy="fedavg", sim_fleet=MIXED)
    prepared = prepare_run(base, workers=1, progress=False)
    clock = Clock.for_fleet(base.fleet, prepared.setup.clients, base.seed,
                            prepared.model.n_params)
    state = prepared.strategy.init(prepared.init_params, prepared.setup)
    tasks = prepared.strategy.configure(1, list(range(10)), state)
    seconds = sorted(clock.task_seconds(c, tasks[c], prepared.clients[c].num_samples)
                     for c in range(10))
    deadline = (seconds[4] + seconds[5]) / 2
    cfg = config(tmp_path, "b.yaml", strategy="fedavg",
                 sim_fleet={"mix": MIXED, "deadline_s": deadline})
    summary = run(cfg, out=tmp_path / "d")
    recs = records(tmp_path / "d")
    assert sum(r["late"] for r in recs) > 0
    assert all(len(r["selected"]) == 5 for r in recs)
    for before, r in zip([0.0] + [x["sim_time_s"] for x in recs], recs):
        assert r["sim_time_s"] - before <= deadline * (1 + 1e-12)
    assert summary["model_sha256"] != run(base)["model_sha256"]
    hopeless = config(tmp_path, "c.yaml", strategy="fedavg",
                      sim_fleet={"mix": MIXED, "deadline_s": seconds[0] / 2})
    with pytest.raises(ValueError, match="sim_fleet.deadline_s .*no client of round 1"):
        run(hopeless)


@pytest.mark.parametrize("fleet, key", [
    ({"rpi9": 1.0}, "sim_fleet.rpi9"),
    ({"mix": {"rpi4": 0.5, "rpi9": 0.5}}, "sim_fleet.mix.rpi9"),
    ({"mix": {"rpi4": 0.5, "rpi5": 0.4}}, "sim_fleet.mix: the shares add up to 0.9"),
    ({"mix": {"rpi4": 1.0}, "gflops": {"rpi4": -2}}, "sim_fleet.gflops.rpi4"),
    ({"mix": {"rpi4": 1.0}, "bandwidth_mbps": "fast"},
     "sim_fleet.bandwidth_mbps: must be a number"),
    ({"mix": {"rpi4": 1.0}, "bandwidth_mbps": {"rpi4": 0}},
     "sim_fleet.bandwidth_mbps.rpi4: 0.0 Mbit/s"),
    ({"profile": "rpi4", "deadline_s": -1}, "sim_fleet.deadline_s"),
    ({"profile": "rpi4", "mix": {"rpi4": 1.0}}, "sim_fleet: give sim_fleet.mix"),
    ("rpi4", "sim_fleet: must be a mapping"),
])
def test_fleet_errors_name_the_key(fleet, key):
    data = {**RUN, "strategy": "fedavg", "sim_fleet": fleet}
    with pytest.raises(ConfigError, match=re.escape(key)):
        run_config_from_mapping(data, "run.yaml")


def test_a_deadline_is_refused_for_an_asynchronous_strategy():
    data = {**RUN, "strategy": "fedbuff", "sim_fleet": {"profile": "rpi4", "deadline_s": 5}}
    with pytest.raises(ConfigError, match=r"sim_fleet\.deadline_s: .*fedbuff is asynchronous"):
        run_config_from_mapping(data, "run.yaml")


def test_the_fleet_section_survives_the_resolved_config(tmp_path):
    cfg = config(tmp_path, strategy="fedbuff", sim_fleet=MIXED)
    again = run_config_from_mapping(cfg.to_dict(), "again.yaml")
    assert again.fleet == cfg.fleet and again.fleet["bandwidth_mbps"]["rpi4"] == 100.0


def test_the_virtual_fleet_is_refused_over_mqtt(tmp_path):
    """Asynchronous runs go over MQTT (tests/test_async_mqtt.py); the simulated clock does
    not: the boards' own speeds order their updates there."""
    with pytest.raises(ConfigError, match=r"sim_fleet: a simulated fleet \(the virtual clock\) "
                                          r"runs in edgefl simulate in process only"):
        simulate(config(tmp_path, strategy="fedbuff", sim_fleet=MIXED), None, progress=False,
                 transport="mqtt")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stopped_asynchronous_run_keeps_the_steps_done_and_their_model(tmp_path, workers):
    """simulate of FedBuff (K < C) stopped once step 1 is recorded, as a SIGTERM to edgefl
    simulate would: RunStopped in step 2, which is dropped; out/ holds step 1 as a stopped
    synchronous run holds its rounds done: metrics.jsonl, summary.json with `stopped`, and
    model.npz of step 1, the model an unstopped run has after step 1."""
    from edgefl.checkpoint import load_checkpoint, model_sha256
    from edgefl.errors import RunStopped
    from edgefl.kernels import StopFlag
    from edgefl.sim import run_asynchronous

    cfg = config(tmp_path, strategy={"name": "fedbuff", "concurrency": 4, "buffer_size": 2})
    prepared = prepare_run(cfg, progress=False)
    models = {}
    run_asynchronous(prepared.strategy, prepared.init_params, prepared.clients, prepared.setup,
                     cfg.clients_per_round, test=(prepared.dataset.x_test,
                                                  prepared.dataset.y_test),
                     workers=workers, on_model=lambda r, m: models.__setitem__(r, m.copy()))
    stop, out = StopFlag(), tmp_path / "out"
    with pytest.raises(RunStopped) as info:
        simulate(cfg, out, workers=workers, progress=None, stream=StopAtLine(stop, "round 1/"),
                 stop=stop)
    assert info.value.round == 2 and [r["round"] for r in info.value.result.history] == [1]
    assert [r["round"] for r in records(out)] == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == {"reason": "stop_requested", "in_round": 2, "rounds_done": 1,
                                  "rounds_planned": RUN["rounds"],
                                  "message": f"stopped in round 2 of {RUN['rounds']}; 1 round "
                                             f"done"}
    ckpt = load_checkpoint(str(out / "model.npz"))
    assert ckpt["round"] == 1 and model_sha256(ckpt["params"]) == summary["model_sha256"] \
        == model_sha256(models[1])
    assert not (out / "model.onnx").exists()


def test_the_old_name_fleet_still_works_with_a_warning_and_not_beside_the_new_one():
    """`fleet:` was the section's name until it was renamed `sim_fleet:` (the `edgefl fleet`
    command runs real processes): a config with it runs the same fleet, saying so."""
    with pytest.warns(FutureWarning, match=r"run.yaml: fleet: is deprecated, rename it "
                                           r"sim_fleet:"):
        old = run_config_from_mapping({**RUN, "strategy": "fedbuff", "fleet": MIXED},
                                      "run.yaml")
    new = run_config_from_mapping({**RUN, "strategy": "fedbuff", "sim_fleet": MIXED},
                                  "run.yaml")
    assert old == new and old.to_dict() == new.to_dict() and "sim_fleet" in new.to_dict()
    with pytest.raises(ConfigError, match=r"run.yaml: fleet: give sim_fleet only \(fleet is "
                                          r"its old name\)"):
        run_config_from_mapping({**RUN, "fleet": MIXED, "sim_fleet": MIXED}, "run.yaml")


def test_events_at_the_same_time_come_out_in_push_order():
    q = EventQueue()
    for t, x in ((2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b")):
        q.push(t, x)
    assert q.pop_simultaneous() == (1.0, ["a", "b"])
    assert q.pop_simultaneous() == (2.0, ["c", "d"])
    assert len(q) == 0


@pytest.mark.parametrize("changes, key", [
    ({"strategy": "fedavg", "sim_fleet": MIXED},
     "sim_fleet: a simulated fleet (the virtual clock) runs in edgefl simulate in process only"),
    ({"strategy": "fedbuff", "sim_fleet": MIXED},
     "sim_fleet: a simulated fleet (the virtual clock) runs in edgefl simulate in process only"),
])
def test_the_aggregator_refuses_what_it_would_run_otherwise(tmp_path, changes, key):
    """A simulated fleet means nothing to real boards: refused before the aggregator
    connects (FedBuff with K < C runs, roles/asynchronous.py)."""
    from edgefl.roles.runner import run_aggregator
    from edgefl.roles import AggregatorSettings
    from edgefl.transport.loopback import LoopbackBroker
    transport = LoopbackBroker().transport("aggregator")
    with pytest.raises(ConfigError, match=re.escape(key)):
        run_aggregator(config(tmp_path, **changes), transport, str(tmp_path / "agg"),
                       settings=AggregatorSettings(federation="fed"))
    assert not transport.connected


def test_compare_shows_the_simulated_time_to_a_target(tmp_path):
    """`edgefl compare` adds "sim s to >= ACC" when a run has a clock; a run without one
    shows a dash there, and the table of clockless runs keeps its columns."""
    from edgefl.compare import comparison_rows, load_runs, markdown_table
    run(config(tmp_path, "a.yaml", strategy="fedavg", sim_fleet=MIXED), out=tmp_path / "timed")
    run(config(tmp_path, "b.yaml", strategy="fedavg"), out=tmp_path / "plain")
    runs = load_runs([tmp_path / "timed", tmp_path / "plain"])
    first = next(r for r in records(tmp_path / "timed") if r["test_accuracy"] >= 0.5)
    rows = comparison_rows(runs, 0.5)
    assert rows[0]["sim_s_to_target"] == first["sim_time_s"]
    table = markdown_table(rows, 0.5).splitlines()
    assert "sim s to ≥0.5" in table[0]
    assert f"| {first['sim_time_s']:.3g} |" in table[2] and "| – |" in table[3]
    plain = markdown_table(comparison_rows(runs[1:], 0.5), 0.5)
    assert "sim s" not in plain


def test_jitter_varies_a_boards_task_times_around_their_mean_and_repeats_per_seed(tmp_path):
    """sim_fleet.jitter multiplies each task's time by a log-normal factor of mean 1 drawn from
    the task's seed: the same task takes the same time in every run, different rounds of
    one client differ, and over many tasks the mean stays the board's time."""
    cfg = config(tmp_path, strategy="fedavg", sim_fleet={"profile": "rpi4", "jitter": 0.3})
    prepared = prepare_run(cfg, workers=1, progress=False)
    clock = Clock.for_fleet(cfg.fleet, prepared.setup.clients, cfg.seed,
                            prepared.model.n_params)
    steady = Clock.for_fleet({**cfg.fleet, "jitter": 0.0}, prepared.setup.clients, cfg.seed,
                             prepared.model.n_params)
    state = prepared.strategy.init(prepared.init_params, prepared.setup)
    n = prepared.clients[0].num_samples
    ratios = [clock.task_seconds(0, t, n) / steady.task_seconds(0, t, n)
              for t in (prepared.strategy.configure(r, [0], state)[0] for r in range(1, 401))]
    assert len(set(ratios)) == len(ratios)
    assert abs(np.mean(ratios) - 1) < 0.05 and 0.2 < np.std(ratios) < 0.45
    again = prepared.strategy.configure(7, [0], state)[0]
    assert clock.task_seconds(0, again, n) / steady.task_seconds(0, again, n) == ratios[6]
    with pytest.raises(ConfigError, match=r"sim_fleet\.jitter: 3 is above the maximum 2"):
        run_config_from_mapping({**RUN, "sim_fleet": {"profile": "rpi4", "jitter": 3}},
                                "run.yaml")
    # an asynchronous run with jitter is still the same for any number of workers
    cfg = config(tmp_path, "b.yaml", strategy={"name": "fedbuff", "concurrency": 6,
                                               "buffer_size": 2},
                 sim_fleet={"mix": MIXED, "jitter": 0.5}, rounds=10)
    assert run(cfg, workers=1)["model_sha256"] == run(cfg, workers=3)["model_sha256"]


def test_client_momentum_is_allowed_and_the_reduction_still_holds(tmp_path):
    """train.momentum runs on the clients as in FedAvg (a fresh buffer every local round,
    never uploaded): FedBuff at K = C is FedAvg with momentum bit for bit, and an
    asynchronous run with momentum differs from one without."""
    train = {"lr": 0.05, "batch_size": 32, "epochs": 1, "momentum": 0.9}
    fedavg = run(config(tmp_path, "a.yaml", strategy="fedavg", train=train))
    fedbuff = run(config(tmp_path, "b.yaml", strategy="fedbuff", train=train))
    assert fedbuff["model_sha256"] == fedavg["model_sha256"]
    asynchronous = {"name": "fedbuff", "concurrency": 6, "buffer_size": 2}
    with_momentum = run(config(tmp_path, "c.yaml", strategy=asynchronous, train=train,
                               sim_fleet=MIXED), out=tmp_path / "c")
    without = run(config(tmp_path, "d.yaml", strategy=asynchronous,
                         train={**train, "momentum": 0.0}, sim_fleet=MIXED))
    assert with_momentum["model_sha256"] != without["model_sha256"]
    assert all(set(r) >= {"sim_time_s", "staleness_max"} for r in records(tmp_path / "c"))
