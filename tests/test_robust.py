"""Robust aggregation (edgefl/strategies/robust.py) and simulated attacks (edgefl/attacks.py),
issue #7 item 4, on scikit-learn's digits through the real kernels:

- properties: the median of identical updates is that update; trimmed mean with trim 0 is
  the mean; clipping bounds the update norm; a non-finite or outsized update is rejected
  with its client and the reason in the round metrics, and the rest aggregate as if it had
  not been sent; the mean rule with nothing rejected or clipped, and the unset option, are
  plain FedAvg / MFL / FedNova bit for bit;
- attacks: a seeded malicious set, the transformations, honest clients untouched, and the
  wrapper rebuilt from its announced parameters as an MQTT client does;
- acceptance: with 20% of the clients sign-flipped (x4) or scaled (x50), plain FedAvg
  collapses while median, trimmed mean and clipping stay within a few points of the clean
  run (MFL and FedNova too), in process and through a real Mosquitto;
- bad config input: errors naming the key.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from edgefl import kernels
from edgefl.attacks import AttackError, attack_section, malicious_clients, with_attack
from edgefl.cli import main
from edgefl.config import ConfigError
from edgefl.data import partition
from edgefl.models import build_model
from edgefl.runconfig import load_run_config, run_config_from_mapping
from edgefl.checkpoint import model_sha256
from edgefl.runs.prepare import local_datasets, prepare_run
from edgefl.sim import simulate
from edgefl.strategies import (Setup, State, StrategyError, Update, get_strategy, strategy_names,
                               strategy_params)

pytest_plugins = ["brokers"]

ROBUST_STRATEGIES = ("fedavg", "mfl", "fednova")


# ---------------------------------------------------------------------------------------
# fixtures: real local rounds on digits
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shards(digits):
    """Ten clients of unequal size (quantity skew: FedNova's tau_i differ)."""
    model = build_model("softmax", digits.input_shape, digits.num_classes)
    split = partition(digits, "quantity", 10, 0)
    return model, local_datasets(digits, split, model)


def first_round(strategy_name: str, shards, clients=range(10), **params):
    """(strategy, state before round 1, {client: Update}) of one real round."""
    model, data = shards
    strategy = get_strategy(strategy_name, **params)
    setup = Setup(clients=range(10), train={"lr": 0.1, "batch_size": 32, "epochs": 1}, seed=3)
    state = strategy.init(model.init(0), setup)
    tasks = strategy.configure(1, list(clients), state)
    updates = {c: strategy.train(tasks[c], data[c], None)[0] for c in tasks}
    return strategy, state, updates


def with_buffer(update: Update, name: str, buf: np.ndarray) -> Update:
    buffers = dict(update.buffers)
    buffers[name] = buf
    return Update(buffers, update.num_samples, update.train_loss, update.steps, update.scalars)


def norm(x) -> float:
    return math.sqrt(kernels.sqnorm(np.ascontiguousarray(x, dtype=np.float32)))


# ---------------------------------------------------------------------------------------
# properties of the rules
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_median_and_trimmed_mean_of_identical_updates_are_that_update(shards, rule):
    strategy, state, updates = first_round("fedavg", shards, robust={"rule": rule})
    one = updates[4].buffers["params"]
    same = {c: with_buffer(u, "params", one.copy()) for c, u in updates.items()}
    new, metrics = strategy.aggregate(1, same, state)
    w = state.buffers["params"]
    # w + (one - w): exact up to the float32 rounding of the difference and the sum
    tol = 4 * np.finfo(np.float32).eps * np.maximum(np.abs(one), np.abs(w))
    assert np.all(np.abs(new.buffers["params"] - one) <= tol)
    assert not np.array_equal(one, w)             # the update was not trivially zero
    assert metrics["robust_rejected"] == [] and metrics["robust_clipped"] == []


def test_trimmed_mean_with_trim_0_is_the_mean(shards):
    plain, state, updates = first_round("fedavg", shards, weighting="uniform")
    trimmed = get_strategy("fedavg", weighting="uniform", robust={"rule": "trimmed_mean",
                                                                  "trim": 0})
    mean = plain.aggregate(1, updates, state)[0].buffers["params"]
    got = trimmed.aggregate(1, updates, state)[0].buffers["params"]
    np.testing.assert_allclose(got, mean, rtol=1e-5, atol=1e-6)
    # and trim 0.2 of ten clients drops two at each end of every coordinate: not the mean
    cut = get_strategy("fedavg", weighting="uniform", robust={"rule": "trimmed_mean",
                                                              "trim": 0.2})
    assert not np.allclose(cut.aggregate(1, updates, state)[0].buffers["params"], mean,
                           rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip", [0.6, "auto"])
def test_clipping_bounds_the_update_norm(shards, clip):
    strategy, state, updates = first_round("fedavg", shards, robust={"clip_norm": clip})
    w = state.buffers["params"]
    norms = {c: norm(u.buffers["params"] - w) for c, u in updates.items()}
    bound = float(np.median(list(norms.values()))) if clip == "auto" else clip
    assert min(norms.values()) < bound < max(norms.values())     # some clipped, some not
    new, metrics = strategy.aggregate(1, updates, state)
    assert metrics["robust_clipped"] == sorted(c for c, n in norms.items() if n > bound)
    # a convex combination of updates of norm <= bound has norm <= bound
    assert norm(new.buffers["params"] - w) <= bound * (1 + 1e-5)
    # one client alone: its update is scaled to exactly the bound
    big = max(norms, key=norms.get)
    fixed = get_strategy("fedavg", robust={"clip_norm": bound})
    alone = fixed.aggregate(1, {big: updates[big]}, state)[0].buffers["params"]
    assert norm(alone - w) == pytest.approx(bound, rel=1e-5)


@pytest.mark.parametrize("strategy_name", ROBUST_STRATEGIES)
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_a_non_finite_update_is_rejected_naming_client_and_reason(shards, strategy_name, poison):
    strategy, state, updates = first_round(strategy_name, shards, robust={"rule": "mean"})
    plain = get_strategy(strategy_name)
    bad = np.array(updates[7].buffers["params"])
    bad[5] = np.nan if poison == "nan" else np.inf
    poisoned = dict(updates)
    poisoned[7] = with_buffer(updates[7], "params", bad)
    new, metrics = strategy.aggregate(1, poisoned, state)
    assert metrics["robust_rejected"] == [7]
    assert metrics["robust_reasons"] == {"7": "1 non-finite value(s) in 'params'"}
    assert np.all(np.isfinite(new.buffers["params"]))
    # the others aggregate exactly as if client 7 had not uploaded
    rest = {c: u for c, u in updates.items() if c != 7}
    expected = plain.aggregate(1, rest, state)[0]
    for name in new.buffers:
        np.testing.assert_array_equal(new.buffers[name], expected.buffers[name])
    # the state passed in is untouched (read-only buffers, a new State returned)
    assert state.meta["round"] == 0


def test_an_update_that_overflows_float32_is_rejected():
    """Finite values whose difference from the model is not a float32."""
    w = np.full(8, 3e38, np.float32)
    ok = Update({"params": np.full(8, 2.9e38, np.float32)}, 5, 0.1, 1)
    flipped = Update({"params": np.full(8, -3e38, np.float32)}, 5, 0.1, 1)
    state = State({"params": w}, {"round": 0})
    new, metrics = get_strategy("fedavg", robust="median").aggregate(1, {0: ok, 1: flipped},
                                                                      state)
    assert metrics["robust_rejected"] == [1]
    assert "'params' update overflows float32" in metrics["robust_reasons"]["1"]
    np.testing.assert_allclose(new.buffers["params"], 2.9e38, rtol=1e-6)


def test_every_update_rejected_fails_naming_each_client(shards):
    strategy, state, updates = first_round("fedavg", shards, clients=[2, 5], robust="median")
    poisoned = {c: with_buffer(u, "params", np.full_like(u.buffers["params"], np.nan))
                for c, u in updates.items()}
    with pytest.raises(StrategyError, match=r"round 1: every update was rejected "
                                            r"\(client 2: .*non-finite.*; client 5: "):
        strategy.aggregate(1, poisoned, state)


def test_an_outsized_update_is_rejected_by_max_norm_ratio(shards):
    strategy, state, updates = first_round("mfl", shards, robust={"max_norm_ratio": 10})
    w = state.buffers["params"]
    scaled = dict(updates)
    scaled[3] = with_buffer(updates[3], "params", (w + 50 * (updates[3].buffers["params"] - w))
                            .astype(np.float32))
    new, metrics = strategy.aggregate(1, scaled, state)
    assert metrics["robust_rejected"] == [3]
    assert "max_norm_ratio 10" in metrics["robust_reasons"]["3"]
    assert "x the round's median" in metrics["robust_reasons"]["3"]
    assert metrics["partial_participation"] is True     # MFL says it averaged fewer clients
    # the honest ones pass: a ratio of 10 does not reject normal variation
    assert strategy.aggregate(1, updates, state)[1]["robust_rejected"] == []


def test_malformed_updates_are_rejected_not_raised(shards):
    strategy, state, updates = first_round("mfl", shards, robust="trimmed_mean")
    broken = dict(updates)
    broken[1] = Update({"params": updates[1].buffers["params"]}, 10, 0.5, 3)   # no momentum
    broken[2] = with_buffer(updates[2], "params", np.zeros(5, np.float32))
    _, metrics = strategy.aggregate(1, broken, state)
    assert metrics["robust_rejected"] == [1, 2]
    assert "no 'momentum' buffer" in metrics["robust_reasons"]["1"]
    assert "'params' has 5 values" in metrics["robust_reasons"]["2"]


# ---------------------------------------------------------------------------------------
# defaults: bit for bit the plain algorithms
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy_name", ROBUST_STRATEGIES)
def test_mean_rule_with_nothing_rejected_is_the_plain_algorithm_bit_for_bit(shards,
                                                                             strategy_name):
    plain, state, updates = first_round(strategy_name, shards)
    if strategy_name == "fednova":   # unequal tau: the residual weight of w is not zero
        assert len({u.steps for u in updates.values()}) > 1
    robust = get_strategy(strategy_name, robust={"rule": "mean", "max_norm_ratio": 1000})
    expected, _ = plain.aggregate(1, updates, state)
    got, metrics = robust.aggregate(1, updates, state)
    assert metrics["robust_rejected"] == [] and metrics["robust_clipped"] == []
    assert sorted(got.buffers) == sorted(expected.buffers)
    for name in expected.buffers:
        np.testing.assert_array_equal(got.buffers[name], expected.buffers[name])


def test_unset_robust_changes_nothing_a_config_or_checkpoint_shows():
    for name in ROBUST_STRATEGIES:
        assert "robust" not in strategy_params(name)
        assert strategy_params(name, extensions=True)["robust"] is None
        assert "robust" not in get_strategy(name).hyperparameters()
        assert get_strategy(name, robust=None) == get_strategy(name)
    config = run_config_from_mapping({"strategy": {"name": "fedavg"}})
    assert config.to_dict()["strategy"] == {"name": "fedavg", "weighting": "samples"}
    assert "attack" not in config.to_dict()
    assert "attacked" not in strategy_names()     # the wrapper is not a config choice


@pytest.mark.parametrize("strategy_name", ROBUST_STRATEGIES)
def test_a_whole_run_with_the_mean_rule_ends_on_the_plain_model(strategy_name):
    base = {"dataset": {"name": "digits", "limit_train": 600},
            "partition": {"name": "quantity", "clients": 6}, "model": {"name": "softmax"},
            "train": {"lr": 0.1, "epochs": 1}, "rounds": 4, "clients_per_round": 4}
    plain = simulate(run_config_from_mapping({**base, "strategy": {"name": strategy_name}}),
                     None, progress=False, workers=2)
    robust = simulate(run_config_from_mapping(
        {**base, "strategy": {"name": strategy_name, "robust": {"max_norm_ratio": 100}}}),
        None, progress=False, workers=2)
    assert robust["model_sha256"] == plain["model_sha256"]


# ---------------------------------------------------------------------------------------
# attacks
# ---------------------------------------------------------------------------------------

def test_malicious_clients_are_seeded_and_sized_by_fraction():
    section = attack_section({"kind": "sign_flip", "fraction": 0.2, "seed": 1}, 10)
    picked = malicious_clients(section, range(10))
    assert len(picked) == 2 and picked == malicious_clients(section, range(10))
    others = {malicious_clients({**section, "seed": s}, range(10)) for s in range(2, 8)}
    assert len(others) > 1                                   # the seed chooses
    assert malicious_clients(attack_section({"kind": "scale", "clients": [4, 1]}), range(10)) \
        == (1, 4)
    assert malicious_clients({**section, "fraction": 0.0}, range(10)) == ()


@pytest.mark.parametrize("kind, factor", [("sign_flip", 3.0), ("scale", -5.0), ("noise", 2.0),
                                          ("nan", None)])
def test_an_attack_transforms_only_the_malicious_uploads(shards, kind, factor):
    model, data = shards
    plain, state, honest = first_round("mfl", shards)
    section = attack_section({"kind": kind, "clients": [2, 6], **(
        {"factor": factor} if factor is not None else {})}, 10)
    attacked = with_attack(plain, section, range(10))
    tasks = attacked.configure(1, list(range(10)), state)
    got = {c: attacked.train(tasks[c], data[c], None)[0] for c in tasks}
    for c in got:
        for name in ("params", "momentum"):
            buf, ref = got[c].buffers[name], honest[c].buffers[name]
            if c not in (2, 6):
                np.testing.assert_array_equal(buf, ref)     # honest: bit for bit untouched
                continue
            start = tasks[c].buffers[name].astype(np.float64)
            u, u_honest = buf - start, ref.astype(np.float64) - start
            if kind == "nan":
                assert np.isnan(buf).all()
            elif kind == "noise":
                assert norm(u) == pytest.approx(factor * norm(u_honest), rel=1e-4)
                assert abs(np.dot(u, u_honest)) < 0.5 * norm(u) * norm(u_honest)
            else:
                scale = -factor if kind == "sign_flip" else factor
                np.testing.assert_allclose(u, scale * u_honest, rtol=1e-4,
                                           atol=1e-5 * np.abs(start).max())
        assert got[c].num_samples == honest[c].num_samples      # scalars unchanged
        assert got[c].steps == honest[c].steps


def test_the_wrapper_is_rebuilt_from_its_announced_parameters(shards):
    """What an MQTT client does: get_strategy(name, **params) from the JSON announcement."""
    strategy = get_strategy("fednova", robust={"rule": "median", "clip_norm": "auto"})
    attacked = with_attack(strategy, attack_section({"kind": "scale", "factor": 50.0}), range(10))
    doc = json.loads(json.dumps({"name": attacked.name, "params": attacked.hyperparameters()}))
    again = get_strategy(doc["name"], **doc["params"])
    assert again == attacked and again.hyperparameters() == attacked.hyperparameters()
    assert again.inner == strategy and again.clients == attacked.clients
    assert len(again.clients) == 2
    with pytest.raises(StrategyError, match="already attacked"):
        with_attack(again, attack_section("nan"), range(10))


# ---------------------------------------------------------------------------------------
# acceptance: 20% attackers; plain FedAvg collapses, the robust rules keep accuracy
# ---------------------------------------------------------------------------------------

ACCEPTANCE = {"dataset": {"name": "digits"}, "partition": {"name": "iid", "clients": 10},
              "model": {"name": "mlp", "hidden": [32]},
              "train": {"lr": 0.1, "batch_size": 32, "epochs": 1}, "rounds": 30, "seed": 0}
ATTACKS = {"sign_flip": {"kind": "sign_flip", "factor": 4, "fraction": 0.2},
           "scale": {"kind": "scale", "factor": 50, "fraction": 0.2}}
DEFENCES = {"median": {"rule": "median"}, "trimmed_mean": {"rule": "trimmed_mean", "trim": 0.2},
            "clip": {"clip_norm": "auto"}}
FEW_POINTS = 0.05          # "within a few points of the clean run"
COLLAPSE = 0.30            # plain FedAvg loses at least this much


def accuracy(strategy: str, robust=None, attack=None, **changes) -> float:
    data = {**ACCEPTANCE, "strategy": {"name": strategy, **({"robust": robust} if robust
                                                            else {})}, **changes}
    if attack:
        data["attack"] = attack
    return simulate(run_config_from_mapping(data), None, progress=False,
                    workers=2)["final_accuracy"]


@pytest.fixture(scope="module")
def clean():
    """Accuracy of the clean runs, per strategy."""
    return {name: accuracy(name) for name in ROBUST_STRATEGIES}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_plain_fedavg_collapses_under_20_percent_attackers(clean, attack):
    assert clean["fedavg"] > 0.85
    assert accuracy("fedavg", attack=ATTACKS[attack]) < clean["fedavg"] - COLLAPSE


@pytest.mark.parametrize("defence", list(DEFENCES))
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_robust_fedavg_stays_within_a_few_points_of_the_clean_run(clean, attack, defence):
    assert accuracy("fedavg", DEFENCES[defence], ATTACKS[attack]) > clean["fedavg"] - FEW_POINTS


@pytest.mark.parametrize("strategy", ["mfl", "fednova"])
def test_robust_mfl_and_fednova_resist_sign_flips(clean, strategy):
    assert accuracy(strategy, attack=ATTACKS["sign_flip"]) < clean[strategy] - COLLAPSE
    for defence in ("median", "trimmed_mean"):
        assert accuracy(strategy, DEFENCES[defence], ATTACKS["sign_flip"]) \
            > clean[strategy] - FEW_POINTS


def test_attack_and_defence_over_real_mosquitto_match_the_in_process_run(mosquitto_server):
    """The attack wrapper travels in the announcement: the clients over MQTT attack as the
    in-process ones do, and the aggregator rejects the same clients."""
    data = {**ACCEPTANCE, "rounds": 3, "partition": {"name": "iid", "clients": 5},
            "strategy": {"name": "fedavg", "robust": {"rule": "median", "max_norm_ratio": 10}},
            "attack": ATTACKS["scale"]}
    config = run_config_from_mapping(data)
    inproc = simulate(config, None, progress=False, workers=2)
    history = []
    from edgefl.sim import run_over_broker
    run = prepare_run(config, workers=2, progress=False)
    result, info = run_over_broker(run, mosquitto_server.url, workers=2, on_round=history.append)
    assert info["broker_kind"] == "external"
    assert model_sha256(result.params) == inproc["model_sha256"]
    malicious = list(run.strategy.clients)
    assert len(malicious) == 1
    assert all(h["robust_rejected"] == malicious for h in history)
    assert all("max_norm_ratio 10" in h["robust_reasons"][str(malicious[0])] for h in history)


def test_cli_runs_the_shipped_robust_config_and_records_rejections(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["simulate", "robust", "--out", str(out), "--quiet", "--set", "rounds=3",
                 "--set", "strategy.robust.max_norm_ratio=3"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["attack"]["kind"] == "sign_flip"
    assert summary["config"]["strategy"]["robust"]["max_norm_ratio"] == 3
    assert len(records) == 3 and all(len(r["robust_rejected"]) == 2 for r in records)
    assert all("x the round's median" in why for r in records
               for why in r["robust_reasons"].values())


# ---------------------------------------------------------------------------------------
# bad config input
# ---------------------------------------------------------------------------------------

def write(tmp_path, data):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("robust, key, message", [
    ({"rule": "mode"}, "strategy.robust.rule", "'mode'; valid: mean, median, trimmed_mean"),
    ({"rule": "trimmed_mean", "trim": 0.5}, "strategy.robust.trim", "must be a number in"),
    ({"clip_norm": -1}, "strategy.robust.clip_norm", "-1 must be a number in (0.0, inf)"),
    ({"clip_norm": "big"}, "strategy.robust.clip_norm", "'big' must be a number"),
    ({"max_norm_ratio": 0.5}, "strategy.robust.max_norm_ratio", "0.5 must be a number in"),
    ({"trim_fraction": 0.1}, "strategy.robust.trim_fraction", "unknown key; valid: rule, trim"),
    (7, "strategy.robust", "must be a mapping of rule, trim, clip_norm, max_norm_ratio"),
])
def test_bad_robust_parameters_name_the_key(tmp_path, robust, key, message):
    path = write(tmp_path, {"strategy": {"name": "fedavg", "robust": robust}})
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert f"{path}: {key}: " in str(err.value) and message in str(err.value)


def test_robust_is_refused_by_strategies_without_it_and_flagged_from_set(tmp_path):
    path = write(tmp_path, {"strategy": {"name": "fedumf", "robust": "median"}})
    with pytest.raises(ConfigError, match=r"strategy\.robust: unknown parameter of fedumf"):
        load_run_config(path)
    path = write(tmp_path, {})
    with pytest.raises(ConfigError, match=r"strategy\.robust\.trim \(from --set\): "):
        load_run_config(path, ["strategy.robust.trim=0.7"])
    config = load_run_config(path, ["strategy.robust.rule=median", "strategy.robust.clip_norm=1e3",
                                    "attack.kind=scale", "attack.factor=-5"])
    assert config.strategy_params["robust"] == {"rule": "median", "trim": 0.2,
                                                "clip_norm": 1000.0, "max_norm_ratio": None}
    assert config.attack == {"kind": "scale", "fraction": 0.2, "factor": -5.0, "seed": 0}
    again = run_config_from_mapping(config.to_dict(), path)
    assert again.to_dict() == config.to_dict()


@pytest.mark.parametrize("attack, key, message", [
    ({"kind": "flip"}, "attack.kind", "'flip'; valid: sign_flip, scale, noise, nan"),
    ({"fraction": 0.2}, "attack.kind", "missing"),
    ({"kind": "scale", "fraction": 1.5}, "attack.fraction", "1.5 must be in [0, 1]"),
    ({"kind": "scale", "factor": 0}, "attack.factor", "0 would upload no update"),
    ({"kind": "sign_flip", "factor": -2}, "attack.factor", "must be > 0 for sign_flip"),
    ({"kind": "nan", "factor": 2}, "attack.factor", "takes no factor"),
    ({"kind": "scale", "clients": [3, 12]}, "attack.clients", "client 12 does not exist"),
    ({"kind": "scale", "clients": [1], "fraction": 0.1}, "attack.clients", "not both"),
    ({"kind": "scale", "seed": -1}, "attack.seed", "integer >= 0"),
    ({"kind": "scale", "target": 3}, "attack.target", "unknown key"),
])
def test_bad_attack_sections_name_the_key(tmp_path, attack, key, message):
    path = write(tmp_path, {"attack": attack})
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert f"{path}: {key}: " in str(err.value) and message in str(err.value)


def test_attack_error_carries_the_key():
    with pytest.raises(AttackError) as err:
        attack_section({"kind": "noise", "factor": "loud"})
    assert err.value.key == "attack.factor" and "'loud'" in str(err.value)


def test_a_directory_named_like_the_shipped_config_does_not_shadow_it(tmp_path, monkeypatch):
    """`edgefl simulate robust` run where an earlier `--out robust` left a directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "robust").mkdir()
    assert load_run_config("robust").attack["kind"] == "sign_flip"
    (tmp_path / "mine").mkdir()
    with pytest.raises(ConfigError, match=r"mine: is a directory, not a config file"):
        load_run_config("mine")


# ---------------------------------------------------------------------------------------
# the attack wrapper keeps what the wrapped strategy is: the run is the same run, attacked
# ---------------------------------------------------------------------------------------

SMALL_FEDBUFF = {"dataset": {"name": "digits", "limit_train": 300},
                 "partition": {"name": "iid", "clients": 6},
                 "model": {"name": "softmax"},
                 "strategy": {"name": "fedbuff", "concurrency": 4, "buffer_size": 2},
                 "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
                 "rounds": 3, "clients_per_round": 4, "seed": 0}


def test_an_attacked_fedbuff_run_stays_asynchronous():
    """FedBuff with an `attack:` section was run as synchronous rounds (the wrapper's
    `asynchronous` was the base class's False), silently: no buffer, no staleness. With an
    honest factor (scale x1) the attacked run is the plain asynchronous run bit for bit."""
    plain = simulate(run_config_from_mapping(SMALL_FEDBUFF), None, progress=False, workers=1)
    honest = run_config_from_mapping({**SMALL_FEDBUFF,
                                      "attack": {"kind": "scale", "factor": 1.0,
                                                 "clients": [0, 1]}})
    assert prepare_run(honest, progress=False).strategy.asynchronous
    attacked = simulate(honest, None, progress=False, workers=1)
    assert attacked["model_sha256"] == plain["model_sha256"]


def test_an_attacked_fedmr_run_still_scores_its_models():
    """FedMR's `evaluate_models` went missing under an attack (the wrapper's
    evaluated_members was the base class's None): each evaluated round after stage 1
    carries member_accuracy, attacked or not."""
    data = {"dataset": {"name": "digits", "limit_train": 300},
            "partition": {"name": "iid", "clients": 6}, "model": {"name": "softmax"},
            "strategy": {"name": "fedmr", "stage1_rounds": 1, "evaluate_models": True},
            "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
            "rounds": 3, "clients_per_round": 3, "seed": 0,
            "attack": {"kind": "sign_flip", "clients": [0]}}
    from edgefl.sim import run_federation
    run = prepare_run(run_config_from_mapping(data), progress=False)
    result = run_federation(run.strategy, run.init_params, run.clients, run.setup, 3,
                            test=(run.dataset.x_test, run.dataset.y_test), workers=1)
    members = [h.get("member_accuracy") for h in result.history]
    assert members[0] is None and all(m is not None and len(m) == 3 for m in members[1:]), \
        members
