"""The contract every strategy keeps, checked for every name `strategy_names()` lists: an
algorithm dropped into edgefl/strategies/ gets these tests without writing any.

1. read-only buffers: the buffers of every State, Task and Update it hands over are
   read-only, and nothing it is handed is changed;
2. the same model for any number of worker threads (1, 2, 3);
3. the same model over the loopback broker (aggregator and clients as roles) as in process;
4. an aggregator stopped after round 1 and restarted on its state directory ends with the
   model of an unbroken run;
5. a bad parameter is rejected with a StrategyError naming it;
6. its local round stops before its first step when the client's LocalData.stop is set
   (a signal to `edgefl simulate` or a client: the round raises TrainingStopped).

Every strategy runs a small federation on digits (CONTRACT_RUN: four clients, three of them
per round, three rounds, softmax); SETTINGS gives a strategy what it needs on top (DUW: full
participation and a short meta-training of its table). A new strategy needs an entry only if
its defaults cannot run that federation.
"""
from __future__ import annotations

import sys
import textwrap
import threading

import numpy as np
import pytest

from edgefl.roles import (Aggregator, AggregatorCheckpoint, AggregatorSettings, Client,
                          ClientSettings, RunPlan, default_client_ids)
from edgefl.checkpoint import model_sha256
from edgefl.errors import TrainingStopped
from edgefl.kernels import StopFlag
from edgefl.runs.prepare import prepare_run
from edgefl.sim import simulate
from edgefl import strategies
from edgefl.strategies import _registry
from edgefl.strategies import (State, StrategyError, get_strategy, select_clients,
                               strategy_names, strategy_params)
from edgefl.transport.loopback import LoopbackBroker
from helpers import load_small_run

NAMES = strategy_names()

CONTRACT_RUN = {
    "dataset": {"name": "digits", "limit_train": 320},
    "partition": {"name": "dirichlet", "clients": 4, "alpha": 1.0},   # unequal |D_i|
    "model": {"name": "softmax"},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "rounds": 3,
    "clients_per_round": 3,
    "seed": 0,
}

# what a strategy needs beyond CONTRACT_RUN with its default parameters
SETTINGS = {
    # the table is indexed by client (every client every round); 2 meta-iterations suffice
    # to make the table differ from FedAvg's weights
    "duw": {"strategy": {"meta_iterations": 2, "meta_lr": 0.05}, "clients_per_round": 4},
    # DR-FedAvg runs in DUW's environment: every client every round
    "drfedavg": {"clients_per_round": 4},
    # both stages: recombination starts at round 2
    "fedmr": {"strategy": {"stage1_rounds": 1}},
    # a short tau keeps the local rounds as small as the others'
    "fedveca": {"strategy": {"tau_init": 3, "tau_max": 8}},
}


def contract_config(tmp_path, name):
    extra = SETTINGS.get(name, {})
    changes = {k: v for k, v in CONTRACT_RUN.items() if k not in ("dataset", "model")}
    changes.update({k: v for k, v in extra.items() if k != "strategy"})
    changes["strategy"] = {"name": name, **extra.get("strategy", {})}
    changes["dataset"], changes["model"] = CONTRACT_RUN["dataset"], CONTRACT_RUN["model"]
    return load_small_run(tmp_path, f"{name}.yaml", **changes)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """{name: model_sha256 of the in-process run on one thread}, computed once per name."""
    cache = {}

    def get(name):
        if name not in cache:
            config = contract_config(tmp_path_factory.mktemp(name), name)
            cache[name] = simulate(config, None, workers=1, progress=False)["model_sha256"]
        return cache[name]
    return get


# ---------------------------------------------------------------------------------------
# 1. read-only buffers, nothing handed over is changed
# ---------------------------------------------------------------------------------------

def snapshot(buffers):
    return {k: np.array(v, copy=True) for k, v in buffers.items()}


def assert_frozen_and_unchanged(buffers, before, what):
    assert set(buffers) == set(before), f"{what}: buffers {sorted(buffers)} changed names"
    for key, buf in buffers.items():
        assert not buf.flags.writeable, f"{what}: buffer {key!r} is writable"
        assert np.array_equal(buf, before[key], equal_nan=True), f"{what}: {key!r} was mutated"
        with pytest.raises(ValueError, match="read-only"):
            buf[:1] = 0


@pytest.mark.parametrize("name", NAMES)
def test_buffers_handed_over_are_read_only_and_never_mutated(tmp_path, name):
    """The rounds driven by hand, as any engine drives them: init, configure, train every
    task (uploads only where allowed), aggregate. After each call every buffer it was
    given is unchanged, and every buffer it returned is read-only."""
    config = contract_config(tmp_path, name)
    run = prepare_run(config, workers=1, progress=False)
    strategy, setup, clients = run.strategy, run.setup, run.clients
    init = np.array(run.init_params, copy=True)
    state = strategy.init(run.init_params, setup)
    assert np.array_equal(run.init_params, init), "init changed the initial model it was given"
    client_states = {c: None for c in setup.clients}
    for r in range(1, config.rounds + 1):
        held = snapshot(state.buffers)
        selected = select_clients(setup.seed, r, setup.clients, config.clients_per_round)
        tasks = strategy.configure(r, selected, state)
        assert_frozen_and_unchanged(state.buffers, held, f"round {r} state after configure")
        updates = {}
        for c in sorted(tasks):
            task = tasks[c]
            given = snapshot(task.buffers)
            cstate = client_states[c]
            kept = None if cstate is None else snapshot(cstate.buffers)
            update, new_cstate = strategy.train(task, clients[c], cstate)
            assert_frozen_and_unchanged(task.buffers, given, f"round {r} client {c} task")
            if cstate is not None:
                assert_frozen_and_unchanged(cstate.buffers, kept,
                                            f"round {r} client {c} client state")
            assert_frozen_and_unchanged(update.buffers, snapshot(update.buffers),
                                        f"round {r} client {c} update")
            assert new_cstate is None or isinstance(new_cstate, State)
            if new_cstate is not None:
                assert_frozen_and_unchanged(new_cstate.buffers, snapshot(new_cstate.buffers),
                                            f"round {r} client {c} new client state")
            client_states[c] = new_cstate
            if task.upload:
                updates[c] = update
            else:
                assert not update.buffers, f"client {c} uploads although its task forbids it"
        uploaded = {c: snapshot(u.buffers) for c, u in updates.items()}
        new_state, metrics = strategy.aggregate(r, updates, state)
        assert_frozen_and_unchanged(state.buffers, held, f"round {r} state after aggregate")
        for c, u in updates.items():
            assert_frozen_and_unchanged(u.buffers, uploaded[c], f"round {r} client {c} upload")
        assert isinstance(new_state, State) and new_state is not state
        assert_frozen_and_unchanged(new_state.buffers, snapshot(new_state.buffers),
                                    f"round {r} new state")
        assert isinstance(metrics, dict)
        model = strategy.global_model(new_state)
        assert not model.flags.writeable and np.all(np.isfinite(model))
        state = new_state
    assert not np.array_equal(strategy.global_model(state), init), "the model never moved"


# ---------------------------------------------------------------------------------------
# 2. any number of worker threads gives the same model
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_the_model_does_not_depend_on_the_number_of_threads(tmp_path, name, unbroken):
    config = contract_config(tmp_path, name)
    shas = {w: simulate(config, None, workers=w, progress=False)["model_sha256"]
            for w in (2, 3)}
    assert shas == {2: unbroken(name), 3: unbroken(name)}


# ---------------------------------------------------------------------------------------
# 3. and 4. over the loopback broker, unbroken and resumed
# ---------------------------------------------------------------------------------------

class LoopbackFleet:
    """An aggregator and the config's clients as roles on one loopback broker, the clients
    in threads. The aggregator stops after round `stop_after`, if given, or as soon as a
    client fails (its error is re-raised by `run`, rather than waiting out round deadlines).
    `restart` makes a new aggregator on the same state directory for the same clients,
    with the strategy from the checkpoint (run_aggregator's way: DUW's table is not
    trained again)."""

    def __init__(self, tmp_path, config, stop_after=None):
        self.tmp_path, self.config, self.broker = tmp_path, config, LoopbackBroker()
        self.stop = threading.Event()
        self.errors = []
        self.aggregator, self.run_ = self._aggregator(None, stop_after)
        ids = default_client_ids(len(self.run_.setup.clients))
        self.threads = []
        for c, node in enumerate(ids):
            client = Client(ClientSettings(node, "fed", exit_when_finished=True,
                                           raise_on_error=True),
                            (self.run_.clients[c].x, self.run_.clients[c].y),
                            self.broker.transport(node), tmp_path / node)
            self.threads.append(threading.Thread(target=self._client, args=(client,),
                                                 daemon=True))

    def _aggregator(self, strategy, stop_after):
        run = prepare_run(self.config, workers=1, progress=False, strategy=strategy)
        plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                       self.config.clients_per_round, default_client_ids(len(run.setup.clients)),
                       test=(run.dataset.x_test, run.dataset.y_test),
                       description=self.config.to_dict())

        def on_round(record, history):
            if stop_after is not None and record["round"] >= stop_after:
                self.stop.set()
        aggregator = Aggregator(plan, self.broker.transport("aggregator"), self.tmp_path / "agg",
                                AggregatorSettings(federation="fed", round_timeout_s=60),
                                on_round=on_round, stop=self.stop)
        return aggregator, run

    def _client(self, client):
        try:
            client.run()
        except BaseException as exc:       # noqa: BLE001 -- re-raised by run()
            self.errors.append(exc)
            self.stop.set()

    def run(self):
        if not any(t.is_alive() for t in self.threads):
            for t in self.threads:
                t.start()
        result = self.aggregator.run()
        if self.errors:
            raise self.errors[0]
        return result

    def restart(self, strategy):
        self.stop.clear()
        self.aggregator, _ = self._aggregator(strategy, None)

    def join(self):
        for t in self.threads:
            t.join(30)
        if self.errors:
            raise self.errors[0]
        assert not any(t.is_alive() for t in self.threads), "a client did not finish"


@pytest.mark.parametrize("name", NAMES)
def test_loopback_roles_give_the_in_process_model(tmp_path, name, unbroken):
    fleet = LoopbackFleet(tmp_path, contract_config(tmp_path, name))
    result = fleet.run()
    fleet.join()
    assert result.finished and [h["round"] for h in result.history] == [1, 2, 3]
    assert model_sha256(result.params) == unbroken(name)


@pytest.mark.parametrize("name", NAMES)
def test_a_run_resumed_from_its_checkpoint_equals_an_unbroken_run(tmp_path, name, unbroken):
    """Round 1, the aggregator stops; a new one on the same state directory (strategy from
    the checkpoint, as run_aggregator does) runs rounds 2 and 3 with the same clients."""
    fleet = LoopbackFleet(tmp_path, contract_config(tmp_path, name), stop_after=1)
    stopped = fleet.run()
    assert not stopped.finished and [h["round"] for h in stopped.history] == [1]
    ckpt = AggregatorCheckpoint.load(tmp_path / "agg")
    assert ckpt.round == 1
    fleet.restart(get_strategy(ckpt.strategy["name"], **ckpt.strategy["params"]))
    result = fleet.run()
    fleet.join()
    assert result.finished and [h["round"] for h in result.history] == [1, 2, 3]
    assert model_sha256(result.params) == unbroken(name)


# ---------------------------------------------------------------------------------------
# 5. bad parameters are named
# ---------------------------------------------------------------------------------------

class _NotAValue:
    """No parameter of any strategy can take this."""

    def __repr__(self):
        return "<not a value>"


@pytest.mark.parametrize("name", NAMES)
def test_a_bad_parameter_is_rejected_naming_it(name):
    params = strategy_params(name, extensions=True)
    assert params, f"{name} has no parameters to check"
    for key in params:
        with pytest.raises(StrategyError, match=rf"\b{key}\b"):
            get_strategy(name, **{key: _NotAValue()})
        # plausible mistakes: accepted, or refused with a StrategyError naming the key
        for value in ("nonsense", -1, float("nan"), 10 ** 9, None, []):
            try:
                get_strategy(name, **{key: value})
            except StrategyError as exc:
                assert key in str(exc), f"{name}.{key} = {value!r}: {exc}"
    with pytest.raises(StrategyError, match=rf"strategy {name!r}: unknown parameter 'no_such'"):
        get_strategy(name, no_such=1)


# ---------------------------------------------------------------------------------------
# discovery: a file dropped into the package is an algorithm
# ---------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------
# 6. a set stop flag stops the local round
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_the_local_round_honours_the_stop_flag_of_its_data(tmp_path, name):
    """Every client half hands LocalData.stop to the kernel: with the flag set, each task of
    round 1 raises TrainingStopped after 0 steps, and the task's buffers are unchanged."""
    config = contract_config(tmp_path, name)
    flag = StopFlag()
    run = prepare_run(config, workers=1, progress=False, stop=flag)
    strategy, setup = run.strategy, run.setup
    state = strategy.init(run.init_params, setup)
    tasks = strategy.configure(1, select_clients(setup.seed, 1, setup.clients,
                                                 config.clients_per_round), state)
    flag.set()
    for c in sorted(tasks):
        given = snapshot(tasks[c].buffers)
        with pytest.raises(TrainingStopped) as stopped:
            strategy.train(tasks[c], run.clients[c], None)
        assert stopped.value.steps == 0, (name, c)
        for key, buf in tasks[c].buffers.items():
            assert np.array_equal(buf, given[key], equal_nan=True)


def test_a_module_dropped_into_the_package_is_discovered_and_one_that_forgets_register_fails(
        tmp_path, monkeypatch):
    """Discovery imports every module of edgefl.strategies (a second directory on the
    package's path stands in for files dropped into it): a registered class is offered by
    name with nothing else edited; a module that registers nothing and is not marked
    HELPER is an error naming it; a HELPER module is imported and registers nothing."""
    monkeypatch.setattr(strategies, "__path__", [*strategies.__path__, str(tmp_path)])
    # the registry and its discovery flag are the registry module's own state
    monkeypatch.setattr(_registry, "_REGISTRY", dict(_registry._REGISTRY))
    monkeypatch.setattr(_registry, "_DISCOVERED", False)
    for module in ("zz_dropped", "zz_shared", "zz_forgot"):
        monkeypatch.delitem(sys.modules, f"edgefl.strategies.{module}", raising=False)
    (tmp_path / "zz_dropped.py").write_text(textwrap.dedent("""
        from dataclasses import dataclass
        from . import register
        from .fedavg import FedAvg

        @register("zz_dropped")
        @dataclass(frozen=True)
        class Dropped(FedAvg):
            pass
    """))
    (tmp_path / "zz_shared.py").write_text("HELPER = True\n")
    (tmp_path / "_zz_private.py").write_text("raise AssertionError('never imported')\n")
    assert "zz_dropped" in strategy_names()
    assert get_strategy("zz_dropped").name == "zz_dropped"
    assert "edgefl.strategies.zz_shared" in sys.modules

    (tmp_path / "zz_forgot.py").write_text("X = 1\n")
    monkeypatch.setattr(_registry, "_DISCOVERED", False)
    with pytest.raises(StrategyError, match=r"edgefl\.strategies\.zz_forgot registers no "
                                            r"strategy: .*@register.*HELPER = True"):
        strategy_names()
