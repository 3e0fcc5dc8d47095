"""Secure aggregation in `edgefl simulate` (in process): the round runs the real SecAgg+
protocol between the in-process clients and closes from the unmasked sum. Its model is the
clear run's within the quantisation bound, for every strategy that serves it; configs it
cannot honour are refused before anything runs."""
import threading

import numpy as np
import pytest

from edgefl.errors import ConfigError
from edgefl.privacy import secagg
from edgefl.privacy.settings import SecureAggregation
from edgefl.runconfig import load_run_config
from edgefl.runs.prepare import client_shard
from edgefl.sim import run_federation, simulate
from edgefl.sim import secure as secure_module
from edgefl.sim.secure import in_process_secure_sum
from edgefl.data import load_dataset, partition
from edgefl.models import build_model
from edgefl.runs.prepare import local_datasets
from edgefl.strategies import Setup, get_strategy, strategy_names

EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def fed():
    ds = load_dataset("digits")
    model = build_model("softmax", ds.input_shape, ds.num_classes)
    return model, local_datasets(ds, partition(ds, "dirichlet", 6, 3, alpha=0.5), model)


@pytest.mark.parametrize("name", sorted(n for n in strategy_names() if get_strategy(n).secure_sum))
def test_one_secure_round_is_the_clear_round_within_the_quantisation_bound(fed, name):
    """After one round, |secure - summed in the clear| <= factor * clip / levels per
    coordinate: the weighted mean of the stochastic rounding errors is below one level, and
    the server step scales the mean delta by `factor` (FedNova's tau_eff; for the adaptive
    optimisers a difference in the mean delta moves the step by up to eta / tau times it)."""
    model, clients = fed
    strategy = get_strategy(name)
    setup = Setup(clients=sorted(clients), train={"lr": 0.1, "steps": 4}, seed=3, rounds=1)
    settings = SecureAggregation(threshold=0.8, ring_bits=32, clip_range=2.0)
    clear = run_federation(strategy, model.init(0), clients, setup, 5, summing=True)
    secure = run_federation(strategy, model.init(0), clients, setup, 5, summing=True,
                            secure_sum=in_process_secure_sum(settings, "t", 3))
    record = secure.history[0]
    levels = record["secure"]["levels"]
    assert record["secure"]["survivors"] == 5 and record["secure"]["threshold"] == 4
    factor = clear.history[0]["tau_eff"] if name == "fednova" else \
        strategy.eta / strategy.tau if name in ("fedadam", "fedyogi") else 1.0
    bound = factor * 2.0 / levels + 4 * EPS32 * np.abs(clear.params).max()
    diff = np.abs(secure.params.astype(np.float64) - clear.params).max()
    assert 0 < diff <= bound, (diff, bound)
    # masked 32-bit words and the 64-bit scalars went up, not float32 vectors
    n = clear.params.size * (2 if name == "mfl" else 1)
    scalars = 1 + 2 + (1 if name in ("fednova", "fedumf") else 0)
    assert record["uplink_bytes"] == 5 * (4 * n + 8 * scalars)
    assert record["train_loss"] == pytest.approx(clear.history[0]["train_loss"], rel=1e-6)


def test_simulate_with_secure_aggregation_writes_the_protocol_into_the_record(tmp_path):
    cfg = load_run_config("quickstart", ["rounds=2", "privacy.secure_aggregation.threshold=0.8",
                                         "privacy.secure_aggregation.ring_bits=64"])
    summary = simulate(cfg, tmp_path, progress=False)
    assert summary["rounds"] == 2 and summary["final_accuracy"] > 0.5
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert '"secure": {"survivors": 5, "dropped": [], "ring_bits": 64' in lines[0]
    clear = simulate(load_run_config("quickstart", ["rounds=2"]), None, progress=False)
    assert summary["model_sha256"] != clear["model_sha256"]   # it did not run the clear rounds


@pytest.mark.parametrize("foreseen", [True, False])
def test_the_phases_run_during_training_change_no_bit_of_the_model(fed, monkeypatch, foreseen):
    """run_federation begins each secure round while the clients train (keys, shares, the
    masks, each masked input as its contribution comes: edgefl.sim.secure); the model is
    the one of the whole protocol run after training, bit for bit, with a dropout and with
    more than one training thread. When the contributions are not the foreseen ones (here a
    weight bound foreseen wrong) the round begun is dropped and the protocol runs after
    training, with the same result."""
    model, clients = fed
    setup = Setup(clients=sorted(clients), train={"lr": 0.1, "epochs": 1, "batch_size": 16},
                  seed=5, rounds=3)
    settings = SecureAggregation(threshold=0.6, ring_bits=32, clip_range=2.0)
    used = []
    result, max_weight_of = secure_module._Ahead.result, secagg.max_weight_of

    def counted(self, *args):
        prepared = result(self, *args)
        used.append(prepared is not None)
        return prepared

    monkeypatch.setattr(secure_module._Ahead, "result", counted)
    if not foreseen:
        monkeypatch.setattr(secagg, "max_weight_of", lambda *a: max_weight_of(*a) + 1)
    vanish = (lambda r: {"masked": [2]} if r == 2 else {})
    runs = []
    for begin in (True, False):
        secure = in_process_secure_sum(settings, "t", 5, vanish)
        call = secure if begin else (lambda *a: secure(*a))    # no `begin`: after training
        runs.append(run_federation(get_strategy("fedavg"), model.init(0), clients, setup, 6,
                                   summing=True, workers=2, secure_sum=call))
    assert runs[0].params.tobytes() == runs[1].params.tobytes()
    assert [h["secure"] for h in runs[0].history] == [h["secure"] for h in runs[1].history]
    assert runs[0].history[1]["secure"]["dropped"] == [2]
    assert used == [foreseen] * 3


def test_a_run_that_fails_in_training_leaves_no_secure_thread_behind(fed, monkeypatch):
    """A round begun (its thread waiting for contributions) whose training fails: the
    run's end stops the thread."""
    model, clients = fed
    strategy = get_strategy("fedavg")
    train = type(strategy).train

    def failing(self, task, data, state):
        if task.round == 2 and data is clients[3]:
            raise RuntimeError("client 3 fell over")
        return train(self, task, data, state)

    monkeypatch.setattr(type(strategy), "train", failing)
    setup = Setup(clients=sorted(clients), train={"lr": 0.1, "epochs": 1, "batch_size": 16},
                  seed=5, rounds=3)
    with pytest.raises(RuntimeError, match="client 3 fell over"):
        run_federation(strategy, model.init(0), clients, setup, 6, summing=True, workers=2,
                       secure_sum=in_process_secure_sum(SecureAggregation(threshold=0.6),
                                                        "t", 5))
    assert not [t for t in threading.enumerate() if t.name == "edgefl-secagg-ahead"]


@pytest.mark.parametrize("sets, words", [
    (["strategy.name=fedmr"], "fedmr"),
    (["strategy.robust.rule=median"], "robust aggregation"),
    (["attack.kind=sign_flip", "attack.fraction=0.2"], "attack"),
])
def test_runs_that_would_read_single_updates_are_refused(sets, words):
    with pytest.raises(ConfigError, match=f"privacy.secure_aggregation.*{words}"):
        load_run_config("quickstart", ["privacy.secure_aggregation.threshold=0.8", *sets])


def test_fleet_shards_of_secure_configs_are_plain_data():
    """A fleet client's shard is data; what it takes part in (secure aggregation's setup,
    DP's clip and noise share) comes with each round's announcement. (Secure aggregation
    with DP over MQTT, the boards clipping themselves: tests/test_dp_runs.py.)"""
    for sets in (["privacy.secure_aggregation.threshold=0.8"],
                 ["privacy.secure_aggregation.threshold=0.8", "strategy.weighting=uniform",
                  "privacy.dp.mode=distributed"]):
        x, y = client_shard(load_run_config("quickstart", sets), 0)
        assert len(x) == len(y) > 0


def test_a_run_survives_dropouts_down_to_the_threshold_and_stops_cleanly_below(fed):
    """Round 2 loses n - t clients after sharing keys: it closes with the survivors' sum
    (the record says who dropped). Losing one more fails round 2 with SecAggAborted: the
    records of round 1 stand, nothing of round 2 is applied."""
    model, clients = fed
    setup = Setup(clients=sorted(clients), train={"lr": 0.1, "steps": 2}, seed=4, rounds=3)
    settings = SecureAggregation(threshold=4, ring_bits=64)          # t = 4 of 6
    seen = []
    ok = run_federation(get_strategy("fedavg"), model.init(0), clients, setup, 6,
                        summing=True, on_round=seen.append,
                        secure_sum=in_process_secure_sum(
                            settings, "t", 4, lambda r: {"masked": [1, 3]} if r == 2 else {}))
    assert [h["secure"]["dropped"] for h in ok.history] == [[], [1, 3], []]
    assert ok.history[1]["secure"]["survivors"] == 4
    # the survivors' sum only: round 2's uplink is four masked inputs
    assert ok.history[1]["uplink_bytes"] == 4 * ok.history[0]["uplink_bytes"] // 6
    seen.clear()
    with pytest.raises(secagg.SecAggAborted, match=r"round 2: only 3 of 6 clients sent masked "
                                                   r"input .*threshold is 4"):
        run_federation(get_strategy("fedavg"), model.init(0), clients, setup, 6, summing=True,
                       on_round=seen.append, workers=1,
                       secure_sum=in_process_secure_sum(
                           settings, "t", 4, lambda r: {"masked": [1, 3, 5]} if r == 2 else {}))
    assert [h["round"] for h in seen] == [1]


def test_a_ring_too_small_for_the_run_is_refused_before_round_one(monkeypatch, tmp_path):
    """The ring bound n * max_weight * levels < 2^(bits-1) is checked when the run is
    prepared, with the run's clients_per_round and largest client (here made to fail by
    asking for more levels than a 32-bit ring can give 5 clients of ~180 samples)."""
    monkeypatch.setattr(secagg, "MIN_LEVELS", 2 ** 22)
    cfg = load_run_config("quickstart", ["privacy.secure_aggregation.threshold=0.8"])
    with pytest.raises(ConfigError, match=r"privacy.secure_aggregation.ring_bits: ring_bits 32 "
                                          r"cannot hold the sum of 5 contributions of weight up "
                                          r"to 1\d\d: .*use ring_bits: 64"):
        simulate(cfg, tmp_path, progress=False)
    assert not (tmp_path / "metrics.jsonl").exists()
    simulate(load_run_config("quickstart", ["rounds=1", "privacy.secure_aggregation.ring_bits=64"]),
             None, progress=False)
