"""FedMR's per-model accuracies (issue 21 item 4): with `evaluate_models`, every evaluated
round's record carries the test accuracy of each of the K recombined models
(member_accuracy), the same whether the evaluation runs at once (one thread) or is deferred
into the next round's pool (several threads); without it, or in stage 1, none."""
import numpy as np
import pytest

from edgefl import kernels
from edgefl.data import load_dataset, partition
from edgefl.models import build_model
from edgefl.runs.prepare import local_datasets
from edgefl.sim import run_federation
from edgefl.strategies import Setup, StrategyError, get_strategy

TRAIN = {"lr": 0.05, "batch_size": 16, "epochs": 1}


@pytest.fixture(scope="module")
def fed():
    digits = load_dataset("digits")
    mlp = build_model({"name": "mlp", "hidden": [16]}, digits.input_shape, digits.num_classes)
    clients = local_datasets(digits, partition(digits, "dirichlet", 6, 0, alpha=0.5), mlp)
    return digits, mlp, clients


def run(strategy, fed, workers, rounds=4, m=3):
    digits, mlp, clients = fed
    setup = Setup(clients=sorted(clients), train=TRAIN, seed=0, rounds=rounds,
                  units=Setup.units_of(mlp))
    return run_federation(strategy, mlp.init(0), clients, setup, m, workers=workers,
                          test=(digits.x_test, digits.y_test))


@pytest.mark.parametrize("workers", [1, 2], ids=["at-once", "deferred"])
def test_records_carry_each_models_accuracy_after_stage_1(fed, workers):
    digits, mlp, _ = fed
    result = run(get_strategy("fedmr", stage1_rounds=2, evaluate_models=True), fed, workers)
    members = [h.get("member_accuracy") for h in result.history]
    assert members[:2] == [None, None]                      # stage 1: one model, no members
    assert all(len(m) == 3 for m in members[2:])            # K = 3 selected per round
    final = result.state.buffers["models"].reshape(3, -1)
    want = [kernels.evaluate(mlp, np.ascontiguousarray(w), digits.x_test,
                             digits.y_test)["accuracy"] for w in final]
    assert members[-1] == want
    # the global model's own accuracy is unchanged by the extra evaluations
    plain = run(get_strategy("fedmr", stage1_rounds=2), fed, workers)
    assert [h["test_accuracy"] for h in plain.history] == \
        [h["test_accuracy"] for h in result.history]
    assert all("member_accuracy" not in h for h in plain.history)


def test_evaluate_models_must_be_a_boolean():
    with pytest.raises(StrategyError, match="evaluate_models"):
        get_strategy("fedmr", evaluate_models="yes")
