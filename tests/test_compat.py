"""Mixed versions in one fleet (docs/protocol.md, "Compatibility"): boards running an older
edgefl than the aggregator. Each test stands in for the older side with what that version
puts on the wire, captured from it and written out here, so the suite needs no old checkout.

- A board older than secure aggregation over MQTT (before commit 99cec5b, 2026-11-26)
  ignores an announcement's `secure` field: it trains and uploads a plain update frame on
  update/<client>. Its frame, captured from that commit's `edgefl client` in a secure
  round of a current aggregator (its metadata, below), is the current format byte for byte
  (`wire.verify` takes it), so the test encodes the same frame for its own run id.
"""
from __future__ import annotations

import json
import threading
import time
import uuid

import numpy as np

from edgefl.errors import ConfigError
from edgefl.roles import Aggregator, AggregatorSettings, Client, ClientSettings, RunPlan
from edgefl.roles import messages as msg
from edgefl.roles.aggregator import secure_plan
from edgefl.roles.state import JOURNAL_FILE, read_journal
from edgefl.runconfig import load_run_config
from edgefl.runs.prepare import prepare_run
from edgefl.strategies import select_clients
from edgefl.transport import wire
from edgefl.transport.base import Message
from edgefl.transport.mqtt import MqttTransport
from edgefl.transport.topics import Topics
from helpers import write_run_yaml

pytest_plugins = ["brokers"]

RUN = {
    "dataset": {"name": "digits", "limit_train": 400},
    "partition": {"name": "iid", "clients": 4},
    "model": {"name": "softmax"},
    "strategy": {"name": "fedavg"},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "rounds": 2,
    "clients_per_round": 3,
    "seed": 0,
}

# The update frame's metadata as the pre-secure-aggregation client (commit 99cec5b^)
# wrote it in round 1 of a current aggregator's secure run (its run id replaced below).
OLD_UPDATE_META = ('{"sender":"client-0","buffers":[{"name":"params","offset":0,"size":650}],'
                   '"scalars":{"run":"20261130-164707-2d38","num_samples":100,'
                   '"train_loss":2.1781133115291595,"steps":4,"train_s":0.0064265000000887085,'
                   '"strategy":{}}}')


def _old_board_update(node: str, run_id: str, round_: int, table) -> bytes:
    scalars = json.loads(OLD_UPDATE_META)["scalars"]
    scalars["run"] = run_id
    return wire.encode("update", round_, node, {"params": np.zeros(650, np.float32)},
                       scalars, table)


def test_a_board_older_than_secure_aggregation_is_refused_by_name_not_waited_for_forever(
        tmp_path, mosquitto_server):
    """A secure run (threshold 1.0: every tasked board must take part) with one tasked board
    that predates secure aggregation over MQTT: it sends a plain update. The aggregator
    refuses it and, since the round cannot reach its threshold without that board, ends the
    run with a ConfigError naming the board, both versions and what to upgrade; before,
    it announced the round again at every deadline, forever. Nothing is lost: the
    checkpoint holds the rounds done and the plain update is not aggregated."""
    config = load_run_config(write_run_yaml(
        tmp_path, RUN, privacy={"secure_aggregation": {"threshold": 1.0}}))
    run = prepare_run(config, progress=False)
    ids = tuple(f"client-{c}" for c in range(4))
    selected = select_clients(config.seed, 1, range(4), 3)
    old = ids[selected[0]]
    tag = uuid.uuid4().hex[:8]
    fed = f"compat-{tag}"
    topics = Topics(fed)

    def transport(node):
        return MqttTransport(mosquitto_server.url, f"{node}-{tag}", reconnect_min=0.05,
                             reconnect_max=0.5, connect_timeout=5.0)

    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, ids, test=(run.dataset.x_test, run.dataset.y_test),
                   description=config.to_dict(), **secure_plan(run))
    aggregator = Aggregator(plan, transport("aggregator"), tmp_path / "agg",
                            AggregatorSettings(node_id="aggregator", federation=fed,
                                               round_timeout_s=4.0))
    clients, threads = [], []
    board = transport(old)
    outcome: dict = {}

    def run_aggregator():
        try:
            outcome["result"] = aggregator.run()
        except BaseException as exc:    # noqa: BLE001 -- inspected below
            outcome["error"] = exc

    try:
        for c, node in enumerate(ids):
            if node == old:
                continue
            client = Client(ClientSettings(node, fed, exit_when_finished=True),
                            (run.clients[c].x, run.clients[c].y), transport(node),
                            tmp_path / node)
            clients.append(client)
            threads.append(threading.Thread(target=client.run, daemon=True))
            threads[-1].start()
        board.connect()
        board.subscribe(topics.round(), qos=1)
        board.publish(topics.status(old), msg.status_payload(old, "client", True),
                      qos=1, retain=True)
        agg_thread = threading.Thread(target=run_aggregator, daemon=True)
        agg_thread.start()
        # the older board: takes the announcement (it ignores "secure") and uploads
        announcement = None
        end = time.monotonic() + 20
        while announcement is None and time.monotonic() < end:
            item = board.receive(1.0)
            if isinstance(item, Message) and item.payload:
                doc = json.loads(item.payload)
                if doc.get("round") == 1 and "secure" in doc:
                    announcement = doc
        assert announcement is not None, "no secure announcement of round 1"
        board.publish(topics.update(old), _old_board_update(
            old, announcement["run"], 1, run.model.table), qos=1).wait(5)
        # before: re-announced at every 4-s deadline without end; now it ends well before
        agg_thread.join(30)
        assert not agg_thread.is_alive(), "the aggregator kept announcing the round"
    finally:
        aggregator.stop.set()
        for client in clients:
            client.stop.set()
        for t in threads:
            t.join(5)
        board.close(timeout=1, announce_offline=False)

    error = outcome.get("error")
    assert isinstance(error, ConfigError), outcome
    text = str(error)
    for words in (old, "secure aggregation", "plain update", "edgefl 0.1.0", "upgrade"):
        assert words in text, (words, text)
    assert not [r for r in read_journal(tmp_path / "agg" / JOURNAL_FILE)
                if r.get("event") == "aggregated"]
