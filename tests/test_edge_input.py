"""The centre of a two-level run against bad partial aggregates from its edges
(edgefl/roles/edge.py): each is refused naming the edge and what is wrong with it, the
round goes on with the other edges, and the run is not ended by one edge's frame (which a
restarted edge would send again, stored, after every restart of the centre)."""
from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest

from brokers import _require_mosquitto
from helpers import load_small_run
from test_edge import Broker, _started, run_centre, three_brokers  # noqa: F401 -- a fixture

from edgefl.roles import AggregatorSettings, RunPlan, default_client_ids
from edgefl.roles.edge import CentralAggregator, partial_update
from edgefl.roles.messages import update_scalars
from edgefl.roles.state import tag_floats
from edgefl.rounds import RoundEngine, client_contribution
from edgefl.runs.prepare import prepare_run
from edgefl.strategies import Update
from edgefl.transport import wire
from edgefl.transport.mqtt import MqttTransport

SITES = {"site-a": ("client-0", "client-1"), "site-b": ("client-2", "client-3")}


def _partials(run, r: int = 1) -> dict:
    """{edge: the Update its edge aggregator would forward for round r}, computed in process
    from the run's round-r plan (the centre's selection and tasks are the same)."""
    engine = RoundEngine.for_run(run.strategy, run.setup, run.model, 4)
    state = run.strategy.init(run.init_params, run.setup)
    plan = engine.open_round(r, state)
    ids = default_client_ids(4)
    out = {}
    for edge, nodes in SITES.items():
        contributions = {}
        for c, task in sorted(plan.tasks.items()):
            if ids[c] in nodes and c in plan.uploaders:
                update, _ = run.strategy.train(task, run.clients[c], None)
                contributions[c] = client_contribution(run.strategy, task, update)
        total = engine.sum_clear(contributions, r)
        out[edge] = partial_update(total, run.model.n_params,
                                   [ids[c] for c in sorted(contributions)])
    return out


def _forge(update: Update, **edge_changes) -> Update:
    """`update` with entries of its scalars' "edge" block replaced (buffers too: "buffers")."""
    edge = dict(update.scalars["edge"])
    buffers = edge_changes.pop("buffers", update.buffers)
    num_samples = edge_changes.pop("num_samples", update.num_samples)
    edge.update(edge_changes)
    return Update(buffers, num_samples, update.train_loss, update.steps, {"edge": edge})


def _run_centre(tmp_path, run, forged: dict, *, limit_s: float = 60.0):
    """The centre of `run` (4 clients, SITES) on a real Mosquitto, each edge played by a
    thread that publishes `forged[edge]` (an Update, or a list of them in order; an
    (Update, run id) pair is sent as of that run) for the round it announces; returns
    (the centre's result or the exception its run() raised, the centre)."""
    _require_mosquitto()
    broker = Broker(tmp_path / "central")
    broker.start()
    ids = default_client_ids(4)
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model, 4, ids)
    stop = threading.Event()
    centre = CentralAggregator(plan, MqttTransport(broker.url, "centre", clean_session=True),
                               str(tmp_path / "centre"),
                               AggregatorSettings(federation="fed", node_id="centre",
                                                  round_timeout_s=30),
                               sites=SITES, stop=stop)
    errors = []

    def edges():
        t = MqttTransport(broker.url, "edges", clean_session=True)
        t.connect()
        t.subscribe("edgefl/fed/round", qos=1)
        sent = set()
        try:
            while not stop.is_set():
                item = t.receive(0.2)
                if item is None or not getattr(item, "payload", b""):
                    continue
                doc = json.loads(item.payload)
                if doc.get("finished"):
                    return
                if doc["round"] in sent:
                    continue
                sent.add(doc["round"])
                for edge, frames in sorted(forged.items()):
                    for update in frames if isinstance(frames, list) else [frames]:
                        run_id = doc["run"]
                        if isinstance(update, tuple):       # (Update, another run id)
                            update, run_id = update
                        data = wire.encode("update", doc["round"], edge, update.buffers,
                                           update_scalars(update, run_id, 0.0),
                                           run.model.table, "none")
                        for payload in wire.split(data, 1 << 20):
                            t.publish(f"edgefl/fed/update/{edge}", payload, qos=1)
        finally:
            t.close()

    thread = _started(edges, "edges", errors)
    watchdog = threading.Timer(limit_s, stop.set)
    watchdog.start()
    try:
        try:
            outcome = centre.run()
        except Exception as exc:           # noqa: BLE001 -- what the test looks at
            outcome = exc
    finally:
        watchdog.cancel()
        stop.set()
        thread.join(10)
        broker.stop()
    if errors:
        raise errors[0]
    return outcome, centre


def _prepared(tmp_path, strategy):
    return prepare_run(load_small_run(tmp_path, partition={"name": "iid", "clients": 4},
                                      strategy=strategy, rounds=1, clients_per_round=4),
                       progress=False)


def _one_edge_model(run, edge: str) -> np.ndarray:
    """The round-1 model from `edge`'s partial alone (what the centre makes of a round the
    other edge's partial was refused from)."""
    from edgefl.roles.edge import partial_total
    engine = RoundEngine.for_run(run.strategy, run.setup, run.model, 4)
    state = run.strategy.init(run.init_params, run.setup)
    total = engine.sum_partials({edge: partial_total(_partials(run)[edge])}, 1)
    new, _ = run.strategy.aggregate_sum(1, total, state)
    return run.strategy.global_model(new)


# (the frame's num_samples, which cannot be negative on the wire, and the partial's
# edge block that the centre sums)
BAD = {
    "a client count larger than the site has": (
        {"count": 5}, r"edge\.count = 5, but site 'site-a' has 2 clients"),
    "a client of another site": (
        {"clients": ["client-0", "client-2"]}, r"client-2, not a client of site 'site-a'"),
    "a weight of 0": ({"weight": 0, "num_samples": 0}, r"edge\.weight = 0 must be > 0"),
    "a negative weight": ({"weight": -150, "num_samples": 0}, r"edge\.weight = -150 must"),
    "a weight that is not the frame's sample count": (
        {"weight": 1}, r"edge\.weight = 1 is not the frame's num_samples"),
    "clients that are not its count": (
        {"clients": ["client-0"]}, r"lists 1 client\(s\), edge\.count = 2"),
    "a client twice": (
        {"clients": ["client-0", "client-0"]}, r"lists client-0 twice"),
    "a uniform weight that is not its count": (
        {"weight": 3, "num_samples": 3}, r"edge\.weight = 3 is not edge\.count = 2"),
}


@pytest.mark.parametrize("case", list(BAD), ids=lambda c: c.replace(" ", "-"))
def test_a_partial_inconsistent_with_its_site_is_refused(tmp_path, case, caplog):
    changes, match = BAD[case]
    run = _prepared(tmp_path, {"name": "fedavg",
                               "weighting": "uniform" if "uniform" in case else "samples"})
    good = _partials(run)
    forged = {"site-a": _forge(good["site-a"], **changes), "site-b": good["site-b"]}
    caplog.set_level("WARNING", logger="edgefl.roles")
    outcome, centre = _run_centre(tmp_path, run, forged)
    assert not isinstance(outcome, Exception), repr(outcome)
    assert outcome.finished
    record = outcome.history[0]
    assert record["edges"] == ["site-b"] and record["updates"] == 2, record
    assert record["clients"] == ["client-2", "client-3"]
    assert centre.stats["rejected"] >= 1
    assert re.search(r"rejected update from 'site-a': round 1: .*" + match, caplog.text), \
        caplog.text
    np.testing.assert_array_equal(outcome.params, _one_edge_model(run, "site-b"))


@pytest.mark.parametrize("strategy, changes, match", [
    # a partial whose strategy scalars are not the strategy's: FedNova's step needs
    # weighted_a_norm (a KeyError ended the centre's run)
    ({"name": "fednova"}, {"scalars": {"train_loss_x_steps": 1.0, "train_steps": 2.0}},
     r"lacks the 'weighted_a_norm' scalar"),
    # one model-sized part too many for FedAvg (sum_partials' mismatch ended the run)
    ({"name": "fedavg"}, "extra part", r"the sum has 1300 values, the server's buffers 650"),
    # a non-finite scalar: FedNova's tau_eff, and so the model, became NaN
    ({"name": "fednova"}, "nan scalar",
     r"edge\.scalars\['weighted_a_norm'\] = nan is not finite"),
], ids=["missing-scalar", "extra-part", "nan-scalar"])
def test_a_partial_the_strategy_cannot_use_is_refused_without_ending_the_run(
        tmp_path, strategy, changes, match, caplog):
    run = _prepared(tmp_path, strategy)
    good = _partials(run)
    a = good["site-a"]
    if changes == "extra part":
        bad = _forge(a, buffers={**a.buffers, "sum1": a.buffers["sum0"]})
    elif changes == "nan scalar":
        scalars = dict(a.scalars["edge"]["scalars"])
        scalars["weighted_a_norm"] = tag_floats(float("nan"))
        bad = _forge(a, scalars=scalars)
    else:
        bad = _forge(a, **changes)
    caplog.set_level("WARNING", logger="edgefl.roles")
    # site-a's alone, then with site-b's: neither may end the run
    outcome, centre = _run_centre(tmp_path, run, {"site-a": bad, "site-b": good["site-b"]})
    assert not isinstance(outcome, Exception), repr(outcome)
    assert outcome.finished and outcome.history[0]["edges"] == ["site-b"]
    assert re.search(r"rejected update from 'site-a': round 1: .*" + match, caplog.text), \
        caplog.text
    assert np.all(np.isfinite(outcome.params))


def test_a_partial_of_another_run_is_refused_and_the_edge_still_waited_for(tmp_path,
                                                                             caplog):
    """A partial aggregate of another run (an edge's copy from before the centre's state
    was replaced) is refused naming both runs; the edge's partial of this run, after it, is
    the one summed."""
    run = _prepared(tmp_path, {"name": "fedavg"})
    good = _partials(run)
    caplog.set_level("WARNING", logger="edgefl.roles")
    outcome, centre = _run_centre(tmp_path, run, {
        "site-a": [(good["site-a"], "0123456789abcdef"), good["site-a"]],
        "site-b": good["site-b"]})
    assert outcome.finished and outcome.history[0]["edges"] == ["site-a", "site-b"]
    assert outcome.history[0]["updates"] == 4
    assert re.search(r"rejected update from 'site-a': update of site-a for round 1 belongs "
                     r"to run 0123456789abcdef, this is run " + outcome.run_id, caplog.text)


# ---------------------------------------------------------------------------------------
# an edge whose site's updates the strategy cannot use
# ---------------------------------------------------------------------------------------

def test_an_edge_whose_updates_are_all_unusable_refuses_them_once(three_brokers, tmp_path,
                                                                  caplog):
    """site-a's two boards send FedNova updates without the 'a_norm' scalar (a board of
    another strategy's build): the edge refuses each, naming it, forwards nothing and waits
    for the centre's next round; the centre closes round 1 with site-b at its deadline. (The
    edge opened the round again at once, each time with a new announcement id that made
    both boards re-send, until the centre moved on: a few hundred announcements a second.)"""
    from edgefl.roles import Client, ClientSettings
    from edgefl.roles.edge import EdgeAggregator
    from edgefl.roles.messages import parse_announcement

    central, sites = three_brokers
    run = _prepared(tmp_path, {"name": "fednova"})
    ids = default_client_ids(4)
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model, 4, ids)
    stop = threading.Event()
    threads, errors, seen = [], [], set()

    def start(target, name):
        threads.append(_started(target, name, errors))

    def boards_without_a_norm():
        t = MqttTransport(sites["site-a"].url, "forger", clean_session=True)
        t.connect()
        t.subscribe("edgefl/fed/round", qos=1)
        try:
            while not stop.is_set():
                item = t.receive(0.2)
                if item is None or not getattr(item, "payload", b""):
                    continue
                doc = parse_announcement(item.payload)
                if doc.get("finished"):
                    return
                seen.add(doc["announce"])
                for node in SITES["site-a"]:
                    update = Update({"params": run.init_params.astype(np.float32)}, 75, 1.0, 3)
                    data = wire.encode("update", doc["round"], node, update.buffers,
                                       update_scalars(update, doc["run"], 0.0),
                                       run.model.table, "none")
                    t.publish(f"edgefl/fed/update/{node}", data, qos=1)
        finally:
            t.close()

    settings = AggregatorSettings(federation="fed", round_timeout_s=8.0)
    start(boards_without_a_norm, "forger")
    for i in (2, 3):
        c = Client(ClientSettings(ids[i], "fed", exit_when_finished=True, raise_on_error=True),
                   (run.clients[i].x, run.clients[i].y),
                   MqttTransport(sites["site-b"].url, f"c-{ids[i]}", clean_session=True),
                   str(tmp_path / ids[i]), stop=stop)
        start(c.run, ids[i])
    for e in SITES:
        edge = EdgeAggregator(plan, MqttTransport(sites[e].url, f"e-{e}", clean_session=True),
                              str(tmp_path / e), settings, edge_id=e, site=SITES[e], stop=stop)
        start(edge.run, e)
    centre = CentralAggregator(plan, MqttTransport(central.url, "centre", clean_session=True),
                               str(tmp_path / "centre"),
                               AggregatorSettings(federation="fed", node_id="centre",
                                                  round_timeout_s=8.0),
                               sites=SITES, stop=stop)
    caplog.set_level("WARNING", logger="edgefl.roles")
    result = run_centre(centre, stop, threads, errors, 60.0, join_s=0)
    assert result.finished
    assert [(r["edges"], r["missing"], r["clients"]) for r in result.history] == \
        [(["site-b"], ["site-a"], ["client-2", "client-3"])]
    assert len(seen) <= 3, f"site-a's edge announced round 1 {len(seen)} times"
    for node in SITES["site-a"]:
        assert f"rejected update from '{node}': round 1: the strategy cannot use it: " \
               f"fednova: the update lacks the 'a_norm' scalar" in caplog.text
    assert not (tmp_path / "site-a" / "partial.frame").exists()
