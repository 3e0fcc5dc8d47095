"""DP-FedAvg in whole runs: epsilon after each round in metrics.jsonl and summary.json equal
to the accountant's, budget mode ending the run before the round that would pass the
target (outputs written, the reason stated), clipping bounding a client's effect on the
round's sum through the engine, the adaptive clip moving in a run, the same model over a
real Mosquitto as in process, and a DP run started through the aggregator service."""
import json
import math
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("dp_accounting")

pytest_plugins = ["brokers"]

from edgefl.cli.ctl import _event_text  # noqa: E402
from edgefl.errors import ConfigError, RunStopped  # noqa: E402
from edgefl.kernels import StopFlag  # noqa: E402
from edgefl.privacy import NO_HOOKS  # noqa: E402
from edgefl.privacy.accountant import PrivacyAccountant  # noqa: E402
from edgefl.privacy.dp import DPHooks  # noqa: E402
from edgefl.privacy.hooks import task_generator  # noqa: E402
from edgefl.privacy.settings import AdaptiveClip, DifferentialPrivacy  # noqa: E402
from edgefl.rounds import RoundEngine, client_contribution  # noqa: E402
from edgefl.runconfig import load_run_config, run_config_from_mapping  # noqa: E402
from edgefl.runs.prepare import prepare_run  # noqa: E402
from edgefl.sim import simulate  # noqa: E402
from edgefl.strategies import Update  # noqa: E402
from helpers import StopAtLine, read_jsonl  # noqa: E402

pytest.register_assert_rewrite("brokers")     # imported by test_orchestration
import test_orchestration as orchestration  # noqa: E402

fleet = orchestration.fleet         # the aggregator service and its boards on the ACL broker


def dp_config(*sets, rounds=6):
    return load_run_config("quickstart", ["strategy.weighting=uniform", f"rounds={rounds}",
                                          "privacy.dp.clip=1.0",
                                          "privacy.dp.noise_multiplier=0.9",
                                          "privacy.dp.reproducible=true", *sets])


def test_epsilon_after_each_round_in_metrics_and_summary(tmp_path):
    config = dp_config(rounds=5)
    summary = simulate(config, tmp_path, workers=2, progress=False)
    acc = PrivacyAccountant(config.privacy.dp, config.clients, config.clients_per_round)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["round"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert r["dp_epsilon"] == pytest.approx(acc.epsilon(r["round"]), rel=1e-12)
        assert r["dp_delta"] == 1e-5 and r["dp_clip"] == 1.0
        assert r["dp_noise_std"] == pytest.approx(0.9) and r["dp_participants"] == 5
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    p = summary["privacy"]
    assert p["epsilon"] == pytest.approx(acc.epsilon(5)) and p["delta"] == 1e-5
    assert p["accountant"] == "rdp" and p["mode"] == "central" and p["rounds_accounted"] == 5
    assert p["sampling_rate"] == 0.5 and "poisson" in p["sampling"]
    assert "stopped" not in summary
    # reproducible noise: the same run again is the same model
    again = simulate(config, None, workers=1, progress=False)
    assert again["model_sha256"] == summary["model_sha256"]


def test_noise_changes_the_model_and_fresh_noise_differs_each_run():
    quiet = simulate(dp_config("privacy.dp.noise_multiplier=0.0"), None, progress=False)
    noisy = simulate(dp_config(), None, progress=False)
    assert quiet["model_sha256"] != noisy["model_sha256"]
    assert quiet["privacy"]["epsilon"] == math.inf
    fresh = [simulate(dp_config("privacy.dp.reproducible=false", rounds=2), None,
                      progress=False)["model_sha256"] for _ in range(2)]
    assert fresh[0] != fresh[1]


def test_budget_mode_stops_before_the_round_that_would_pass_the_target(tmp_path):
    target = 11.0
    config = dp_config(f"privacy.dp.target_epsilon={target}", rounds=20)
    acc = PrivacyAccountant(config.privacy.dp, config.clients, config.clients_per_round)
    last = acc.rounds_within(target, 20)
    assert 1 < last < 20
    summary = simulate(config, tmp_path, workers=2, progress=False)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(records) == summary["rounds"] == last
    assert records[-1]["dp_epsilon"] <= target < acc.epsilon(last + 1)
    assert records[-1]["test_accuracy"] is not None        # the last round run is evaluated
    stopped = summary["stopped"]
    assert stopped["message"].startswith(f"round {last + 1}: privacy budget")
    assert f"target_epsilon = {target:g}" in stopped["message"]
    assert stopped == {"reason": "privacy_budget", "in_round": last + 1, "rounds_done": last,
                       "rounds_planned": 20, "message": stopped["message"]}
    assert summary["privacy"]["stopped"] == stopped
    assert summary["privacy"]["epsilon"] == pytest.approx(acc.epsilon(last))
    for name in ("summary.json", "model.npz", "metrics.jsonl"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("past_last", [1, 3])
def test_a_budget_stop_evaluates_its_last_round_whatever_eval_every(tmp_path, past_last):
    """The round the budget ends the run after is the run's last: evaluated as the planned
    last round would be, so summary.json's final accuracy is that model's and metrics'
    last row says it (eval_every last + 1: no round evaluated before it, which crashed the
    summary with max() of an empty list; last - 1: an earlier round evaluated, and a null
    final accuracy crashed the command line's last line)."""
    target = 11.0
    config = dp_config(f"privacy.dp.target_epsilon={target}", rounds=20)
    last = PrivacyAccountant(config.privacy.dp, config.clients,
                             config.clients_per_round).rounds_within(target, 20)
    every = last + 1 if past_last == 1 else last - 1
    assert last % every != 0
    config = replace(config, eval_every=every)
    summary = simulate(config, tmp_path, workers=2, progress=False)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert summary["rounds"] == len(records) == last
    assert summary["stopped"]["reason"] == "privacy_budget"
    assert records[-1]["test_accuracy"] is not None
    assert summary["final_accuracy"] == records[-1]["test_accuracy"]
    assert json.loads((tmp_path / "summary.json").read_text())["final_accuracy"] == \
        records[-1]["test_accuracy"]


def test_a_target_the_first_round_passes_is_a_config_error():
    with pytest.raises(ConfigError, match=r"privacy.dp.target_epsilon: 0.5 is spent by the "
                                          r"first round"):
        prepare_run(dp_config("privacy.dp.target_epsilon=0.5"), progress=False)



def test_a_delta_not_below_one_over_the_clients_is_warned_about(caplog):
    """(epsilon, delta)-DP with delta >= 1/N allows releasing one client's data outright
    with probability delta: a guarantee in name only. The run goes on (a user may mean it)
    but says so, naming the key and 1/N; the usual delta (1e-5 at 10 clients) says nothing."""
    config = dp_config("privacy.dp.delta=0.2")
    with caplog.at_level("WARNING", logger="edgefl"):
        prepare_run(config, progress=False)
    warned = [r.getMessage() for r in caplog.records if "privacy.dp.delta" in r.getMessage()]
    assert warned and f"privacy.dp.delta = 0.2 is not below 1/N = {1 / config.clients:g} " \
        f"({config.clients} clients)" in warned[0], warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="edgefl"):
        prepare_run(dp_config(), progress=False)
    assert not [r for r in caplog.records if "privacy.dp.delta" in r.getMessage()]

def test_a_huge_update_moves_the_sum_by_at_most_the_clip():
    """Through the engine: the round's sum with one client's update blown up differs from
    the sum without that client by at most C (noise off, so the difference is the clip)."""
    config = dp_config("privacy.dp.noise_multiplier=0.0", "privacy.dp.clip=0.3")
    run = prepare_run(config, progress=False)
    engine = RoundEngine.for_run(run.strategy, run.setup, run.model, config.clients_per_round)
    state = run.strategy.init(run.init_params, run.setup)
    plan = engine.open_round(1, state)
    hooks = run.hooks
    contributions = {}
    for c, task in sorted(plan.tasks.items()):
        update, _ = run.strategy.train(task, run.clients[c], None)
        if c == plan.selected[0]:     # a client whose model ran away
            huge = task.buffers["params"] + np.float32(1e3)
            update = Update({"params": huge}, update.num_samples, update.train_loss,
                            update.steps)
        contributions[c] = client_contribution(run.strategy, task, update, hooks,
                                               task_generator(task))
    with_all = engine.sum_clear(contributions).vector.astype(np.float64)
    rest = dict(contributions)
    del rest[plan.selected[0]]
    without = engine.sum_clear(rest).vector.astype(np.float64)
    assert np.linalg.norm(with_all - without) <= 0.3 * (1 + 1e-6)
    assert np.linalg.norm(with_all - without) == pytest.approx(0.3, rel=1e-4)


def test_the_sum_is_divided_by_the_fixed_denominator():
    """With dropouts the round moves the model by sum / m, m = clients_per_round."""
    dp = DifferentialPrivacy(clip=1.0, noise_multiplier=0.0)
    hooks = DPHooks(dp, 10, 5, seed=0)
    from edgefl.strategies import SumTotal
    total = SumTotal(np.ones(4, np.float32), 3.0, {}, 3)       # 3 of 5 came up
    out = hooks.server_sum(total, 1)
    assert out.weight == 5.0 and np.array_equal(out.vector, total.vector)


def test_adaptive_clip_moves_in_a_run_and_is_reported(tmp_path):
    # every quickstart delta is far above 0.01, so the clip must grow round after round
    config = dp_config("privacy.dp.clip=0.01", "privacy.dp.adaptive_clip.lr=0.5",
                       "privacy.dp.adaptive_clip.count_noise=0.5", rounds=6)
    summary = simulate(config, tmp_path, progress=False)
    history = summary["privacy"]["clip_history"]
    assert history[0] == 0.01 and len(history) == 6
    assert all(b > a for a, b in zip(history, history[1:])), history
    assert summary["privacy"]["clip"] > history[-1]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["dp_clip"] for r in records] == history
    assert all("dp_unclipped_fraction" in r for r in records)


def test_dp_only_needs_no_hooks_without_the_section():
    assert prepare_run(load_run_config("quickstart", ["rounds=1"]),
                       progress=False).hooks is NO_HOOKS


def test_missing_dp_accounting_fails_before_the_run(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ConfigError, match=r"pip install 'edgefl\[privacy\]'"):
        prepare_run(dp_config(), progress=False)


def test_same_model_over_mosquitto_as_in_process(mosquitto_server, tmp_path):
    config = dp_config("privacy.dp.target_epsilon=11", rounds=20)
    inproc = simulate(config, tmp_path / "inproc", workers=2, progress=False)
    over = simulate(config, tmp_path / "mqtt", workers=2, progress=False, transport="mqtt",
                    broker=mosquitto_server.url)
    assert over["transport"]["broker_kind"] == "external"
    assert over["model_sha256"] == inproc["model_sha256"]
    assert over["rounds"] == inproc["rounds"] < 20
    assert over["privacy"]["epsilon"] == inproc["privacy"]["epsilon"]
    assert over["stopped"] == inproc["stopped"]
    assert over["stopped"]["reason"] == "privacy_budget"
    eps = [r["dp_epsilon"] for r in read_jsonl(tmp_path / "mqtt" / "metrics.jsonl")]
    assert eps == [r["dp_epsilon"] for r in read_jsonl(tmp_path / "inproc" / "metrics.jsonl")]


def test_a_budget_stop_over_mosquitto_evaluates_its_last_round(mosquitto_server, tmp_path):
    """The aggregator role closes its rounds with the same engine: a budget stop between two
    evaluations still ends with the final model evaluated, as in process."""
    config = replace(dp_config("privacy.dp.target_epsilon=11", rounds=20), eval_every=50)
    inproc = simulate(config, tmp_path / "inproc", workers=2, progress=False)
    over = simulate(config, tmp_path / "mqtt", workers=2, progress=False, transport="mqtt",
                    broker=mosquitto_server.url)
    assert over["model_sha256"] == inproc["model_sha256"]
    assert over["stopped"]["reason"] == "privacy_budget"
    last = read_jsonl(tmp_path / "mqtt" / "metrics.jsonl")[-1]
    assert last["test_accuracy"] is not None
    assert over["final_accuracy"] == inproc["final_accuracy"] == last["test_accuracy"]


def test_stopped_has_one_shape_whether_the_budget_or_a_stop_request_ends_the_run(tmp_path):
    """summary.json's `stopped` is the same object (errors.stop_record) for the two ways a
    run ends early; only the reason and the words differ."""
    budget_run = simulate(dp_config("privacy.dp.target_epsilon=11", rounds=20),
                          tmp_path / "budget", workers=1, progress=False)
    budget = json.loads((tmp_path / "budget" / "summary.json").read_text())["stopped"]
    assert budget == budget_run["stopped"]
    stop = StopFlag()
    with pytest.raises(RunStopped) as info:
        simulate(dp_config(rounds=3), tmp_path / "stop", workers=1, progress=None,
                 stream=StopAtLine(stop, "round 1/"), stop=stop)
    requested = json.loads((tmp_path / "stop" / "summary.json").read_text())["stopped"]
    assert requested == info.value.summary["stopped"]
    assert list(budget) == list(requested) == ["reason", "in_round", "rounds_done",
                                               "rounds_planned", "message"]
    assert budget["reason"] == "privacy_budget"
    assert budget["rounds_done"] == budget["in_round"] - 1 == budget_run["rounds"]
    assert requested == {"reason": "stop_requested", "in_round": 2, "rounds_done": 1,
                         "rounds_planned": 3, "message": "stopped in round 2 of 3; 1 round done"}


def test_watch_prints_epsilon_of_a_closed_round():
    text = _event_text({"event": "round_closed", "run": "r1", "round": 3, "closed_by": "all",
                        "updates": 2, "test_accuracy": 0.5, "dp_epsilon": 2.345678,
                        "dp_delta": 1e-5, "at": 0}, set())
    assert text.endswith("r1 round 3 closed (all): 2 update(s), test accuracy 0.5000, "
                         "epsilon 2.346 at delta 1e-05")


def test_watch_tells_why_a_run_finished_early_in_words():
    from edgefl.errors import budget_stop
    stopped = budget_stop(RuntimeError("privacy budget: past the target"), 4, 10)
    text = _event_text({"event": "run_finished", "run": "r1", "rounds": 3,
                        "model_sha256": "ab12", "stopped": stopped, "at": 0}, set())
    assert text.endswith("r1 run_finished: rounds 3, model_sha256 ab12, stopped round 4: "
                         "privacy budget: past the target")


def test_a_dp_run_through_the_aggregator_service(fleet):
    """`ctl start` of a DP config: each round_closed event carries epsilon, the budget ends
    the run as finished, and its summary.json says why."""
    f = fleet()
    f.start_all()
    doc = orchestration.run_config(rounds=30, strategy={"name": "fedavg", "weighting": "uniform"},
                     privacy={"dp": {"clip": 1.0, "noise_multiplier": 2.0,
                                     "target_epsilon": 8.0}})
    config = run_config_from_mapping(doc)
    acc = PrivacyAccountant(config.privacy.dp, 2, 2)
    last = acc.rounds_within(8.0, 30)
    assert 1 < last < 30
    finished, closed, summary = f.run_to_end(doc, "dp")
    assert finished["rounds"] == last and "privacy budget" in finished["stopped"]["message"]
    assert [e["round"] for e in closed] == list(range(1, last + 1))
    for e in closed:
        assert e["dp_epsilon"] == pytest.approx(acc.epsilon(e["round"]))
    assert summary["rounds"] == last and summary["privacy"]["epsilon"] == \
        pytest.approx(acc.epsilon(last))
    assert summary["stopped"] == finished["stopped"]
    assert summary["stopped"]["reason"] == "privacy_budget"


def test_every_client_every_round_is_accounted_without_sampling():
    dp = DifferentialPrivacy(noise_multiplier=1.0)
    assert PrivacyAccountant(dp, 4, 4).description["sampling"].startswith("none")
    pld = PrivacyAccountant(replace(dp, accountant="pld"), 4, 4)
    assert pld.description["accountant"] == "pld" and 0 < pld.epsilon(3) < math.inf


# ---------------------------------------------------------------------------------------
# distributed noise under secure aggregation
# ---------------------------------------------------------------------------------------

def secure_dp_config(*sets, rounds=3):
    return load_run_config("quickstart", [
        "strategy.weighting=uniform", f"rounds={rounds}",
        "privacy.secure_aggregation.threshold=0.8", "privacy.dp.mode=distributed",
        "privacy.dp.clip=0.5", "privacy.dp.noise_multiplier=1.5",
        "privacy.dp.reproducible=true", *sets])


def test_a_run_with_secure_aggregation_and_distributed_noise(tmp_path):
    summary = simulate(secure_dp_config(), tmp_path, workers=2, progress=False)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(records) == 3
    for r in records:
        assert r["secure"]["survivors"] == 5 and r["dp_noise_shortfall"] == 0
        assert r["dp_epsilon"] > 0
    assert summary["privacy"]["mode"] == "distributed"
    assert summary["privacy"]["epsilon"] == records[-1]["dp_epsilon"]


def test_the_unmasked_sum_carries_the_full_noise():
    """Clients that did not move (delta 0) contribute only their noise shares; the secure
    protocol's unmasked sum of the m shares has std z * C, and the aggregator adds nothing."""
    from edgefl.sim.secure import in_process_secure_sum

    config = secure_dp_config()
    run = prepare_run(config, progress=False)
    engine = RoundEngine.for_run(run.strategy, run.setup, run.model, config.clients_per_round)
    state = run.strategy.init(run.init_params, run.setup)
    plan = engine.open_round(1, state)
    contributions = {}
    for c, task in sorted(plan.tasks.items()):
        still = Update({"params": task.buffers["params"]}, run.clients[c].num_samples, 0.0, 1)
        contributions[c] = client_contribution(run.strategy, task, still, run.hooks,
                                               task_generator(task))
        assert np.std(contributions[c].vector.astype(np.float64)) == \
            pytest.approx(1.5 * 0.5 / np.sqrt(5), rel=0.06)
    secure_sum = in_process_secure_sum(config.privacy.secure_aggregation, "dp-test",
                                       config.seed)
    total, _, extras = secure_sum(engine, plan, contributions)
    assert extras["secure"]["survivors"] == 5
    clear = engine.sum_clear(contributions).vector.astype(np.float64)
    unmasked = total.vector.astype(np.float64)
    assert np.abs(unmasked - clear).max() < 1e-3          # within the quantisation bound
    # n = 4810 values: the sample std's own relative error is 1 %, so 5 % is five of those
    assert np.std(unmasked) == pytest.approx(1.5 * 0.5, rel=0.05)
    released = run.hooks.server_sum(total, 1)
    assert np.array_equal(released.vector, total.vector)
    assert run.hooks.round_metrics(1)["dp_noise_shortfall"] == 0


def test_count_noise_too_small_is_named_before_the_run():
    config = dp_config("privacy.dp.adaptive_clip.lr=0.2")   # m = 5: default sigma_b 0.25
    with pytest.raises(ConfigError, match=r"quickstart.yaml: privacy.dp.adaptive_clip."
                                          r"count_noise: 0.25 is too small for "
                                          r"noise_multiplier 0.9"):
        prepare_run(config, progress=False)


def test_a_resumed_aggregator_takes_the_adaptive_clip_up_from_its_records():
    dp = DifferentialPrivacy(clip=1.0, noise_multiplier=0.0,
                             adaptive_clip=AdaptiveClip(count_noise=1.0))
    hooks = DPHooks(dp, 10, 5, seed=0)
    hooks.resume([{"round": 1, "dp_clip": 1.0, "dp_next_clip": 0.8},
                  {"round": 2, "dp_clip": 0.8, "dp_next_clip": 0.7}])
    assert hooks.clip == 0.7
    DPHooks(replace(dp, adaptive_clip=None), 10, 5, seed=0).resume([{"round": 1}])


@pytest.mark.parametrize("mode", ["distributed", "central"])
def test_secure_dp_over_mosquitto_is_the_in_process_run(mosquitto_server, tmp_path, mode):
    """Under secure aggregation the aggregator sees only the sum, so the boards clip (and in
    distributed mode add their noise shares) themselves, from the announcement's `dp`: with
    reproducible noise the model over a real broker is the in-process model bit for bit."""
    config = secure_dp_config(f"privacy.dp.mode={mode}", "privacy.dp.clip=0.3")
    inproc = simulate(config, tmp_path / "inproc", workers=2, progress=False)
    over = simulate(config, tmp_path / "mqtt", workers=2, progress=False, transport="mqtt",
                    broker=mosquitto_server.url)
    assert over["model_sha256"] == inproc["model_sha256"]
    records = read_jsonl(tmp_path / "mqtt" / "metrics.jsonl")
    assert [r["closed_by"] for r in records] == ["secure"] * 3
    assert [r["dp_epsilon"] for r in records] == \
        [r["dp_epsilon"] for r in read_jsonl(tmp_path / "inproc" / "metrics.jsonl")]
    # and the boards did clip: without DP the same secure run ends elsewhere
    plain = simulate(load_run_config("quickstart", [
        "strategy.weighting=uniform", "rounds=3",
        "privacy.secure_aggregation.threshold=0.8"]), None, progress=False)
    assert plain["model_sha256"] != over["model_sha256"]


def test_edgefl_ctl_watch_prints_epsilon_each_round(fleet, tmp_path):
    """`edgefl ctl start` and `edgefl ctl watch` as processes against the aggregator service:
    watch prints each round's epsilon and ends with the budget's run_finished."""
    import subprocess

    import yaml

    from test_orchestration import CLIENTS, Lines, ctl_argv, run_config, run_ctl
    f = fleet()
    f.start_all()
    ctl = ctl_argv(f, tmp_path)
    run_file = tmp_path / "dp.yaml"
    run_file.write_text(yaml.safe_dump(run_config(
        rounds=30, strategy={"name": "fedavg", "weighting": "uniform"},
        privacy={"dp": {"clip": 1.0, "noise_multiplier": 2.0, "target_epsilon": 8.0}})))
    acc = PrivacyAccountant(DifferentialPrivacy(clip=1.0, noise_multiplier=2.0), 2, 2)
    last = acc.rounds_within(8.0, 30)
    watch = subprocess.Popen(ctl + ["watch"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    out = Lines(watch)
    try:
        out.wait(lambda x: "no active run" in x, "watch's status line")
        started = run_ctl(ctl, "start", str(run_file), "--run", "dpw", "--clients",
                          ",".join(CLIENTS))
        assert started.returncode == 0, started.stderr
        assert watch.wait(120) == 0, watch.stderr.read()
        out.thread.join(5)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
    for r in range(1, last + 1):
        line = next(x for x in out.lines if f" dpw round {r} closed " in x)
        assert line.endswith(f", epsilon {acc.epsilon(r):.4g} at delta 1e-05"), line
    assert not any(f" dpw round {last + 1} opened" in x for x in out.lines), out.lines
    finished = next(x for x in out.lines if " dpw run_finished: " in x)
    assert f"rounds {last}" in finished and "privacy budget" in finished, finished


def test_the_quantised_contribution_that_enters_the_secure_sum_stays_within_the_clip():
    """Under secure aggregation a board's clipped delta is quantised (rounded stochastically
    to the ring's levels) before it is masked, and what enters the sum is that quantised
    vector: its L2 norm, not the float delta's, is the one the accountant takes to be at
    most C. Each value moves by under one level, so up to sqrt(d) levels in L2; a clip small
    against that (here 2e-6 at 4,810 values and a level of 1.9e-8, where it passed C by 5%;
    at 1M values and 1,000 clients a round a level is 3.7e-6, and the same happens at
    C = 0.01) shows it. The board (hooks from the announcement) must clip as the in-process
    client does, and a clip the rounding alone could pass is refused before round 1."""
    from edgefl.privacy import secagg
    from edgefl.privacy.dp import DPHooks

    clip = 2e-6
    config = secure_dp_config("privacy.dp.mode=central", f"privacy.dp.clip={clip}")
    run = prepare_run(config, progress=False)
    board = DPHooks.from_client_settings(run.hooks.client_settings())
    engine = RoundEngine.for_run(run.strategy, run.setup, run.model, config.clients_per_round)
    state = run.strategy.init(run.init_params, run.setup)
    plan = engine.open_round(1, state)
    settings = config.privacy.secure_aggregation
    setup = secagg.round_setup(settings, run_id="dp-test", round=1,
                               participants=sorted(plan.uploaders), seed=config.seed,
                               vector_size=None, scalar_names=None,
                               max_weight=secagg.max_weight_of(run.strategy, {}))
    for c, task in sorted(plan.tasks.items()):
        far = Update({"params": task.buffers["params"] + np.float32(1.0)},
                     run.clients[c].num_samples, 0.0, 1)
        for hooks in (run.hooks, board):
            contribution = client_contribution(run.strategy, task, far, hooks,
                                               task_generator(task))
            sent = setup.quantiser.decode(setup.quantiser.encode(
                contribution, task.train["seed"], setup.max_weight))
            assert np.linalg.norm(sent.astype(np.float64)) <= clip, (c, hooks)
    with pytest.raises(ConfigError, match=r"privacy.dp.clip = 1e-06 leaves no room for the "
                                          r"secure quantiser's rounding: 4810 values"):
        prepare_run(secure_dp_config("privacy.dp.mode=central", "privacy.dp.clip=1e-6"),
                    progress=False)


def test_a_board_takes_the_dp_settings_of_an_aggregator_that_sends_no_rounding():
    """An aggregator from before the rounding was announced sends the dp object without it:
    a newer board clips to C as that aggregator's boards did (rounding 0), not refuse the
    round; a rounding that is there must be a finite number >= 0."""
    from edgefl.privacy.dp import DPHooks

    config = secure_dp_config("privacy.dp.mode=central", "privacy.dp.clip=2e-6")
    settings = prepare_run(config, progress=False).hooks.client_settings()
    assert settings["rounding"] > 0
    older = {k: v for k, v in settings.items() if k != "rounding"}
    assert DPHooks.from_client_settings(older).rounding == 0.0
    for bad in (-1.0, float("nan"), "x"):
        with pytest.raises(ValueError, match="announcement dp"):
            DPHooks.from_client_settings(dict(settings, rounding=bad))


def test_summary_states_epsilon_against_whoever_knows_who_was_selected(tmp_path):
    """The accountant's sampling rate q = m / N amplifies privacy only while the sample is
    secret. edgefl's is not: select_clients(seed, round) is a function of the config's seed,
    each round's record names it (`selected`) and every board reads it in the
    announcements. Against anyone who knows it, a client's guarantee is the Gaussian
    mechanism composed, without sampling, over the rounds it was selected in: summary.json
    gives that figure too, here checked against dp-accounting composed directly."""
    import collections

    import dp_accounting
    from dp_accounting import rdp

    from edgefl.strategies import select_clients

    config = dp_config(rounds=6)
    summary = simulate(config, tmp_path, workers=2, progress=False)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["selected"] for r in records] == [
        select_clients(config.seed, r, range(config.clients), config.clients_per_round)
        for r in range(1, 7)]                           # the public seed alone gives it
    most = max(collections.Counter(c for r in records for c in r["selected"]).values())
    direct = rdp.RdpAccountant()
    direct.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.9), most))
    p = summary["privacy"]
    assert p["rounds_selected_most"] == most
    assert p["epsilon_selection_known"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert p["epsilon_selection_known"] > p["epsilon"]


def test_a_run_stopped_before_any_evaluation_still_states_its_epsilon(tmp_path, caplog):
    """A DP run stopped after rounds none of which was evaluated (eval_every past them)
    leaves a model trained under DP: its summary must still give the privacy spent, and a
    warm start from that model must still be told (the warning reads the summary's block)."""
    stop = StopFlag()
    config = dp_config("eval_every=5", rounds=5)
    with pytest.raises(RunStopped) as info:
        simulate(config, tmp_path / "stop", workers=1, progress=None,
                 stream=StopAtLine(stop, "round 2/"), stop=stop)
    summary = json.loads((tmp_path / "stop" / "summary.json").read_text())
    assert summary == json.loads(json.dumps(info.value.summary))
    assert summary["stopped"]["rounds_done"] == 2
    acc = PrivacyAccountant(config.privacy.dp, config.clients, config.clients_per_round)
    assert "privacy" in summary, sorted(summary)
    assert summary["privacy"]["epsilon"] == pytest.approx(acc.epsilon(2))
    assert summary["privacy"]["rounds_accounted"] == 2
    with caplog.at_level("WARNING", logger="edgefl"):
        prepare_run(dp_config(f"model.init={tmp_path / 'stop' / 'model.npz'}"),
                    progress=False)
    assert any("trained under differential privacy" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
