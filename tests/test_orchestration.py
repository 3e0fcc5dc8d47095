"""Runs driven purely over MQTT (issue #8): the aggregator service (roles/daemon.py) against a
real Mosquitto with the repo's broker/acl and generated passwords, in-process Client threads
as the boards (each with its own connection and account), and the operator's commands on
the control topic (roles/control.py) -- with MQTT 5 correlation data and the 3.1.1
fallback. Every wait has a generous timeout; nothing asserts on timing.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid

import numpy as np
import pytest

pytest_plugins = ["brokers"]

from brokers import messages_within    # noqa: E402
from helpers import usage_error    # noqa: E402
from edgefl.roles import (AggregatorCheckpoint, AggregatorSettings, Client,  # noqa: E402
                          ClientSettings)
from edgefl.roles.control import ControlClient    # noqa: E402
from edgefl.roles.daemon import Daemon, DaemonSettings, RunStore    # noqa: E402
from edgefl.roles.state import JOURNAL_FILE, read_journal    # noqa: E402
from edgefl.runconfig import run_config_from_mapping    # noqa: E402
from edgefl.runs.prepare import client_shard  # noqa: E402
from edgefl.transport.base import Message    # noqa: E402
from edgefl.transport.mqtt import MqttTransport    # noqa: E402
from edgefl.transport.topics import Topics    # noqa: E402
from helpers import wait_for    # noqa: E402

CLIENTS = ("client-1", "client-2")          # accounts of the mosquitto_acl_server fixture


def run_config(rounds=3, model=None, **extra) -> dict:
    doc = {"dataset": {"name": "digits"}, "partition": {"name": "iid", "clients": 2},
           "model": model or {"name": "softmax"}, "strategy": {"name": "fedavg"},
           "train": {"lr": 0.1, "batch_size": 32, "epochs": 1}, "rounds": rounds, "seed": 3}
    doc.update(extra)
    return doc


class Events:
    """The operator's view of the events topic, collected by a thread."""

    def __init__(self, transport, topics: Topics):
        self.transport, self.items, self.topics = transport, [], topics
        transport.subscribe(topics.events(), qos=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set():
            item = self.transport.receive(timeout=0.1)
            if isinstance(item, Message) and item.topic == self.topics.events():
                self.items.append(json.loads(item.payload))

    def of(self, kind, **match):
        return [e for e in list(self.items) if e.get("event") == kind
                and all(e.get(k) == v for k, v in match.items())]

    def wait(self, kind, timeout=30.0, **match):
        return wait_for(lambda: self.of(kind, **match), timeout, f"event {kind} {match}")[0]

    def close(self):
        self._stop.set()
        self._thread.join(5)


class Fleet:
    """The aggregator service, the boards and the operator of one federation on the ACL
    broker; every node logs in with its own account."""

    def __init__(self, server, tmp_path, *, deadline=60.0, quorum=1.0, client_limits=None,
                 run_options=None, keep_runs=None, tag=None, site_run=None):
        self.server, self.tmp = server, tmp_path
        # tag: another Fleet's, for the same federation again (a restarted service)
        self.tag = tag or uuid.uuid4().hex[:8]
        self.fed = f"orch-{self.tag}"
        self.topics = Topics(self.fed)
        self.transports: list = []
        self.stop = threading.Event()
        self.client_limits = client_limits or {}
        settings = DaemonSettings(
            AggregatorSettings(node_id="aggregator", federation=self.fed,
                               round_timeout_s=deadline, quorum=quorum, poll_s=0.05),
            client_ids=CLIENTS, retry_s=0.5, run_options=dict(run_options or {}),
            **({"keep_runs": keep_runs} if keep_runs is not None else {}))
        self.state_dir = tmp_path / "aggregator"
        # site_run: (run config file, output directory) of the site file's run, queued first
        self.daemon = Daemon(settings, str(self.state_dir), self._aggregator_transport,
                             stop=self.stop, site_run=site_run)
        self.thread = None
        self.error = None
        self.clients: dict = {}
        self.client_threads: dict = {}
        self.data = {}
        self.operator = self.transport("operator", protocol="5")
        self.operator.connect()
        watcher = self.transport("operator", protocol="5")
        watcher.connect()
        self.events = Events(watcher, self.topics)

    def transport(self, user, protocol="3.1.1", client_id=None, **options):
        t = MqttTransport(self.server.url, client_id or f"{user}-{uuid.uuid4().hex[:6]}",
                          username=user, password=self.server.users[user], protocol=protocol,
                          reconnect_min=0.05, reconnect_max=0.5, connect_timeout=5.0,
                          **options)
        self.transports.append(t)
        return t

    def _aggregator_transport(self, client_id, **options):
        # node id "aggregator" (its topics, the ACL user); the MQTT client id is unique to
        # this test, so nothing of another test's session is met on the shared broker
        options.setdefault("clean_session", True)
        return self.transport("aggregator", client_id=f"{client_id}-{self.tag}", **options)

    def start_daemon(self):
        def body():
            try:
                self.daemon.run()
            except BaseException as exc:       # noqa: BLE001 -- reported by the test
                self.error = exc

        self.thread = threading.Thread(target=body, name="daemon", daemon=True)
        self.thread.start()
        wait_for(lambda: self.daemon.ready.is_set() or self.error, what="the daemon's control "
                 "connection")
        assert self.error is None, self.error

    def start_all(self):
        """The daemon, then every board (CLIENTS)."""
        self.start_daemon()
        for node in CLIENTS:
            self.start_client(node)

    def run_to_end(self, doc, run_id, timeout=120.0):
        """Start the run config `doc` as `run_id` (the operator's start command) and wait
        until the service records it finished: returns its run_finished event, its
        round_closed events in round order, and its summary.json."""
        self.ok({"cmd": "start", "config": doc, "run": run_id})
        finished = self.events.wait("run_finished", timeout=timeout, run=run_id)
        closed = sorted(self.events.of("round_closed", run=run_id), key=lambda e: e["round"])
        wait_state(self, run_id, "finished")
        summary = json.loads((self.state_dir / "runs" / run_id / "summary.json").read_text())
        return finished, closed, summary

    def start_client(self, node):
        config = run_config_from_mapping(run_config())
        x, y = client_shard(config, CLIENTS.index(node))
        t = self.transport(node)
        client = Client(ClientSettings(node, self.fed, model_wait_s=2.0,
                                       **self.client_limits.get(node, {})),
                        (x, y), t, str(self.tmp / node), stop=threading.Event())
        thread = threading.Thread(target=client.run, name=node, daemon=True)
        thread.start()
        wait_for(client.ready.is_set, what=f"{node} connected")
        self.clients[node], self.client_threads[node] = client, thread
        return client

    def stop_client(self, node):
        """The board goes away: its client stops (offline status, as a service stop)."""
        self.clients[node].stop.set()
        self.client_threads[node].join(30)
        assert not self.client_threads[node].is_alive()

    def control(self, mqtt5=True, name=None):
        t = self.operator if mqtt5 else self._operator311()
        return ControlClient(t, self.topics, name or f"op-{uuid.uuid4().hex[:6]}", mqtt5=mqtt5)

    def _operator311(self):
        t = self.transport("operator")
        t.connect()
        return t

    def ok(self, doc, mqtt5=True, timeout=20.0):
        reply = self.control(mqtt5).request(doc, timeout=timeout)
        assert reply["ok"], reply
        return reply["result"]

    def close(self):
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30)
        for client in self.clients.values():
            client.stop.set()
        for thread in self.client_threads.values():
            thread.join(10)
        self.events.close()
        for t in self.transports:
            try:
                t.close(timeout=1.0, announce_offline=False)
            except Exception:                  # noqa: BLE001 -- teardown
                t.kill()


@pytest.fixture
def fleet(mosquitto_acl_server, tmp_path):
    made = []

    def make(**options):
        f = Fleet(mosquitto_acl_server, tmp_path, **options)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def retained_status(fleet) -> dict | None:
    """The retained status of the aggregator node, when it says online-and-waiting or
    offline (None while a run's Aggregator owns it)."""
    t = fleet.transport("operator")
    t.connect()
    try:
        t.subscribe(fleet.topics.status("aggregator"), qos=1)
        got = [json.loads(m.payload) for m in messages_within(t, 0.5) if m.payload]
    finally:
        t.close(timeout=1.0, announce_offline=False)
    doc = got[-1] if got else None
    return doc if doc and ("service" in doc or not doc["online"]) else None


def wait_state(fleet, run_id, state, timeout=60.0):
    """Poll the `runs` command until run_id is in `state` (the record is written after the
    outputs, after the aggregator's run_finished event)."""
    def reached():
        runs = {r["id"]: r for r in fleet.ok({"cmd": "runs"})["runs"]}
        return runs.get(run_id, {}).get("state") == state and runs[run_id]
    return wait_for(reached, timeout, f"run {run_id} {state}", poll=0.2)


# ---------------------------------------------------------------------------------------
# a whole run started, paused mid-round, resumed and finished; a second run queued behind
# ---------------------------------------------------------------------------------------

def test_run_started_paused_mid_round_resumed_finished_and_next_run_queued(fleet):
    f = fleet()
    f.start_daemon()
    assert f.ok({"cmd": "status"}) ["active"] is None
    f.start_client("client-1")                 # client-2 joins later: round 1 stays open

    started = f.ok({"cmd": "start", "config": run_config(rounds=3), "run": "first"})
    assert started == {"run": "first", "state": "queued", "ahead": 0,
                       "run_dir": str(f.state_dir / "runs" / "first")}
    opened = f.events.wait("round_opened", run="first", round=1)
    wait_for(lambda: f.clients["client-1"].progress.trained == 1, what="client-1's round 1")
    wait_for(lambda: f.ok({"cmd": "status"})["active"].get("updates") == 1, poll=0.2,
             what="client-1's update at the aggregator")

    paused = f.ok({"cmd": "pause"})
    assert paused == {"run": "first", "state": "paused", "round": 1, "rounds_done": 0}
    f.start_client("client-2")                 # trains and uploads while the run is paused
    wait_for(lambda: f.clients["client-2"].progress.trained == 1, what="client-2's round 1")
    wait_for(lambda: f.ok({"cmd": "status"})["active"].get("updates") == 2, poll=0.2,
             what="client-2's update at the aggregator")
    # every update is in, yet the paused round neither closes nor does a new one open
    assert not f.events.of("round_closed", run="first")
    status = f.ok({"cmd": "status"})["active"]
    assert status["state"] == "paused" and status["round"] == 1 and status["rounds_done"] == 0
    assert status["updates"] == 2 and status["clients_online"] == ["client-1", "client-2"]
    assert f.ok({"cmd": "runs"})["runs"][0]["state"] == "paused"
    paused_at = time.time()
    time.sleep(0.5)                            # a pause of some length: the deadline moves

    # a second run, another model, queued behind the active one
    second = f.ok({"cmd": "start", "run": "second",
                   "config": run_config(rounds=2, model={"name": "mlp", "hidden": [16]})},
                  mqtt5=False)
    assert second["state"] == "queued" and second["ahead"] == 1
    assert f.ok({"cmd": "status"})["queue"] == ["second"]

    assert f.ok({"cmd": "resume"}) == {"run": "first", "state": "running"}
    resumed_at = time.time()
    again = f.events.wait("round_opened", run="first", round=1, announcement=2)
    # announced again with the deadline moved by (at least) the paused time
    assert again["deadline"] >= opened["deadline"] + (resumed_at - paused_at) - 1.0
    assert f.events.wait("round_closed", run="first", round=1)["closed_by"] == "all"
    f.events.wait("run_finished", run="first")
    # client-1 was online when the run started, client-2 joined during round 1: one
    # client_joined each, and nobody left
    assert [e["client"] for e in f.events.of("client_joined", run="first")] == list(CLIENTS)
    assert f.events.of("client_left", run="first") == []
    f.events.wait("run_finished", run="second", timeout=60)
    wait_state(f, "second", "finished")
    records = {r["id"]: r for r in f.ok({"cmd": "runs"})["runs"]}
    assert [records[r]["state"] for r in ("first", "second")] == ["finished", "finished"]
    assert records["first"]["rounds_done"] == 3 and records["first"]["final_accuracy"] > 0.5
    for run_id, rounds in (("first", 3), ("second", 2)):
        run_dir = f.state_dir / "runs" / run_id
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["rounds"] == rounds and summary["config"]["rounds"] == rounds
        assert (run_dir / "model.onnx").stat().st_size > 0
        ckpt = AggregatorCheckpoint.load(run_dir / "state")
        assert ckpt.run_id == run_id and ckpt.aggregated == list(range(1, rounds + 1))
        aggregated = [r["round"] for r in read_journal(run_dir / "state" / JOURNAL_FILE)
                      if r.get("event") == "aggregated"]
        assert aggregated == list(range(1, rounds + 1))    # each round exactly once
    # the boards followed the second run and its model, with no configuration
    second_summary = json.loads((f.state_dir / "runs" / "second" / "summary.json").read_text())
    assert second_summary["config"]["model"] == {"name": "mlp", "hidden": [16]}
    for node in CLIENTS:
        client = f.clients[node]
        assert client.progress.run_id == "second" and client.progress.trained == 2
        assert client._model.n_params == 64 * 16 + 16 + 16 * 10 + 10     # the run's MLP
    # the queue and records survive on disk, and each run's record is retained on its topic
    assert [r["id"] for r in RunStore(str(f.state_dir)).load_all()] == ["first", "second"]
    late = f.transport("operator")
    late.connect()
    late.subscribe(f.topics.subscription("runs"), qos=1)
    retained = {f.topics.parse(m.topic)[1]: json.loads(m.payload)
                for m in messages_within(late, 1.0) if m.retain}
    assert {k: (v["state"], v["rounds_done"], v["rounds"]) for k, v in retained.items()} == {
        "first": ("finished", 3, 3), "second": ("finished", 2, 2)}


# ---------------------------------------------------------------------------------------
# stop: a valid checkpoint and an exported model
# ---------------------------------------------------------------------------------------

def test_an_asynchronous_fedbuff_run_started_with_ctl_finishes_through_the_acl(fleet):
    """FedBuff with K < C (roles/asynchronous.py) started with `edgefl ctl` on the service,
    through the repo's ACL: the boards read their own task topics, every step is recorded."""
    f = fleet()
    f.start_all()
    config = run_config(rounds=4, strategy={"name": "fedbuff", "concurrency": 2,
                                            "buffer_size": 1})
    f.ok({"cmd": "start", "config": config, "run": "async"})
    wait_state(f, "async", "finished")
    run_dir = f.state_dir / "runs" / "async"
    ckpt = AggregatorCheckpoint.load(run_dir / "state")
    assert ckpt.round == 4 and [h["closed_by"] for h in ckpt.history] == ["buffer"] * 4
    tasks = [t for h in ckpt.history for t in h["tasks"]]
    assert len(tasks) == len(set(tasks)) == 4
    assert sum(f.clients[n].stats["trained"] for n in CLIENTS) >= 4
    assert sum(f.clients[n].stats["rejected"] for n in CLIENTS) == 0


def test_stop_leaves_a_valid_checkpoint_and_an_exported_model(fleet):
    from edgefl.infer import Predictor

    f = fleet(quorum=0.5)                       # one of the two clients closes a round
    f.start_daemon()
    f.start_client("client-1")
    f.ok({"cmd": "start", "config": run_config(rounds=500), "run": "long"})
    f.events.wait("round_closed", run="long", round=2)

    exported = f.ok({"cmd": "export"}, mqtt5=False)        # `export` while it runs
    assert exported["run"] == "long" and exported["round"] >= 2
    assert os.path.getsize(exported["model_onnx"]) > 0

    assert f.ok({"cmd": "stop"})["state"] == "stopping"
    stopped = f.events.wait("run_stopped", run="long")
    run_dir = f.state_dir / "runs" / "long"
    ckpt = AggregatorCheckpoint.load(run_dir / "state")
    assert ckpt is not None and ckpt.round == stopped["round"] >= 2
    assert ckpt.aggregated == list(range(1, ckpt.round + 1))
    aggregated = [r["round"] for r in read_journal(run_dir / "state" / JOURNAL_FILE)
                  if r.get("event") == "aggregated"]
    assert aggregated == ckpt.aggregated
    exported = f.events.wait("model_exported", run="long", round=ckpt.round)
    predictor = Predictor(str(run_dir / "model.onnx"), check_interval=None)
    classes, probs = predictor.predict(np.zeros((3, 64), np.float32))
    assert classes.shape == (3,) and np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    assert predictor.metadata.get("round") in (str(ckpt.round), ckpt.round)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["state"] == "stopped" and record["model_onnx"] == str(run_dir / "model.onnx")
    # summary.json of the rounds done, as simulate writes for a stopped run: `edgefl compare`
    # refused the run ("no summary.json ... did not finish")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == ckpt.round and summary["stopped"]["reason"] == "stop_requested"
    assert summary["stopped"]["rounds_done"] == ckpt.round
    from edgefl.cli import main as cli_main
    assert cli_main(["compare", str(run_dir), "--no-plot"]) == 0
    # stopped means stopped: nothing to resume or pause, and the daemon waits for runs
    reply = f.control().request({"cmd": "resume"})
    assert not reply["ok"] and reply["error"] == "resume: no run is active (waiting for a run)"
    assert f.ok({"cmd": "status"})["active"] is None


def test_stop_cancels_a_queued_run_and_a_restart_keeps_the_queue(fleet, tmp_path):
    f = fleet(quorum=0.5)
    f.start_daemon()
    f.start_client("client-1")
    f.ok({"cmd": "start", "config": run_config(rounds=500), "run": "a"})
    f.ok({"cmd": "start", "config": run_config(rounds=2), "run": "b"})
    f.ok({"cmd": "start", "config": run_config(rounds=2), "run": "c"})
    assert f.ok({"cmd": "stop", "run": "c"}) == {"run": "c", "state": "cancelled"}
    f.events.wait("round_closed", run="a", round=1)
    # the service stops (SIGTERM): run a is left to resume, b stays queued
    f.stop.set()
    f.thread.join(30)
    assert not f.thread.is_alive()
    states = {r["id"]: r["state"] for r in RunStore(str(f.state_dir)).load_all()}
    assert states == {"a": "running", "b": "queued", "c": "cancelled"}
    done = AggregatorCheckpoint.load(f.state_dir / "runs" / "a" / "state").round
    assert done >= 1

    # a new service process on the same state: a resumes from its checkpoint, then b
    f.stop = threading.Event()
    f.daemon = Daemon(f.daemon.settings, str(f.state_dir), f._aggregator_transport,
                      stop=f.stop)
    f.start_daemon()
    wait_for(lambda: any(r.get("event") == "resumed" for r in read_journal(
        f.state_dir / "runs" / "a" / "state" / JOURNAL_FILE)), what="run a resumed")
    f.ok({"cmd": "stop", "run": "a"})
    f.events.wait("run_finished", run="b", timeout=60)
    wait_state(f, "b", "finished")
    states = {r["id"]: r["state"] for r in f.ok({"cmd": "runs"})["runs"]}
    assert states == {"a": "stopped", "b": "finished", "c": "cancelled"}
    assert AggregatorCheckpoint.load(f.state_dir / "runs" / "a" / "state").round >= done


def test_a_run_started_on_the_last_runs_end_event_has_nothing_ahead(fleet):
    """run_finished comes before the service has written the run's outputs and closed its
    record. A script that starts the next run on that event finds nothing ahead of it: the
    ended run no longer counts (RunControl.rounds_over), though it is still active."""
    f = fleet()
    f.start_all()
    f.ok({"cmd": "start", "config": run_config(rounds=1), "run": "one"})
    f.events.wait("run_finished", run="one", timeout=60)
    nxt = f.ok({"cmd": "start", "config": run_config(rounds=1), "run": "two"})
    assert nxt["ahead"] == 0, nxt
    assert f.events.wait("run_queued", run="two")["ahead"] == 0
    f.events.wait("run_finished", run="two", timeout=60)
    wait_state(f, "two", "finished")
    assert wait_state(f, "one", "finished")["rounds_done"] == 1


# ---------------------------------------------------------------------------------------
# access: only the operator's commands reach the aggregator
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_a_command_from_a_client_account_is_refused_by_the_broker(fleet, protocol):
    f = fleet()
    f.start_daemon()
    spy = f.transport("operator")              # reads edgefl/#: sees any command delivered
    spy.connect()
    spy.subscribe(f.topics.ctl(), qos=1)
    intruder = f.transport("client-1", protocol=protocol)
    intruder.connect()
    forged = {"cmd": "start", "config": run_config(), "run": "forged",
              "reply_to": f.topics.reply("intruder")}
    delivery = intruder.publish(f.topics.ctl(), json.dumps(forged).encode(), qos=1)
    assert delivery.wait(10)            # acknowledged (3.1.1) or refused with 135 (MQTT 5)
    assert messages_within(spy, 1.0) == []
    assert f.ok({"cmd": "runs"}) == {"runs": []}
    assert not (f.state_dir / "runs" / "forged").exists()
    # the operator's own command on the same topic is delivered and carried out
    f.ok({"cmd": "start", "config": run_config(), "run": "mine"})
    assert [json.loads(m.payload)["cmd"] for m in messages_within(spy, 1.0)] == ["runs",
                                                                                "start"]


# ---------------------------------------------------------------------------------------
# bad commands: error replies naming the problem, nothing changed
# ---------------------------------------------------------------------------------------

def test_bad_commands_get_error_replies_and_change_nothing(fleet):
    f = fleet()
    f.start_daemon()
    reply_topic = f.topics.reply("bad")
    raw = f.transport("operator")
    raw.connect()
    raw.subscribe(reply_topic, qos=1)

    def send(payload: bytes, expect_reply=True):
        """The replies to one command: the first within 10 s and any more within 0.3 s
        after it; none within 1.5 s when no reply is expected."""
        raw.publish(f.topics.ctl(), payload, qos=1)
        got = messages_within(raw, 1.5) if not expect_reply else []
        if expect_reply:
            end = time.monotonic() + 10
            while not got and time.monotonic() < end:
                item = raw.receive(timeout=0.1)
                if isinstance(item, Message):
                    got = [item] + messages_within(raw, 0.3)
        return [json.loads(m.payload) for m in got if m.topic == reply_topic]

    fallback = {"reply_to": reply_topic, "request_id": "r1"}
    cases = [
        ({"cmd": "launch", **fallback}, "command: unknown cmd 'launch'; valid: start, pause, "
                                        "resume, stop, export, status, runs"),
        ({"cmd": "pause", "force": True, **fallback}, "pause: unknown field 'force'; valid: "
                                                      "cmd, request_id, reply_to, run"),
        ({"cmd": "start", **fallback}, "start: field 'config' must be a run config object"),
        ({"cmd": "start", "config": run_config(train={"lr": -1}), **fallback},
         "start: config: train.lr: -1.0 must be > 0"),
        ({"cmd": "start", "config": run_config(strategy={"name": "fedbest"}), **fallback},
         "start: config: strategy.name: unknown strategy 'fedbest'"),
        ({"cmd": "start", "config": run_config(), "clients": ["client-1"], **fallback},
         "start: clients lists 1 client ids, the config's partition.clients is 2"),
        ({"cmd": "start", "config": run_config(), "run": "a/b", **fallback},
         "start: run: 'a/b' contains '/'"),
        ({"cmd": "start", "config": run_config(), "round": {"quorum": 2}, **fallback},
         "start (round.quorum): 2 is above the maximum 1"),
        ({"cmd": "pause", **fallback}, "pause: no run is active (waiting for a run)"),
        ({"cmd": "stop", "run": "ghost", **fallback}, "stop: no run 'ghost' (runs: none)"),
        ({"cmd": "export", **fallback}, "export: no run is active; name one with \"run\""),
    ]
    for doc, error in cases:
        replies = send(json.dumps(doc).encode())
        assert len(replies) == 1, (doc, replies)
        assert replies[0]["ok"] is False and replies[0]["request_id"] == "r1"
        assert replies[0]["error"].startswith(error), (replies[0]["error"], error)
    # not JSON, or JSON but not an object: no reply address can be read, an error event
    for payload, error in [(b"{start", "command: not JSON"),
                           (b"[1, 2]", "command: a JSON object was expected")]:
        assert send(payload, expect_reply=False) == []
        event = f.events.wait("error")
        assert event["error"].startswith(f"command refused: {error}")
        f.events.items.clear()
    # a reply topic outside the federation's reply topics is never written to
    bad_reply = {"cmd": "status", "reply_to": f.topics.round(), "request_id": "r2"}
    assert send(json.dumps(bad_reply).encode(), expect_reply=False) == []
    assert "replies go only to this federation's reply topics" in f.events.wait("error")["error"]
    # nothing changed
    assert f.ok({"cmd": "runs"}) == {"runs": []}
    assert RunStore(str(f.state_dir)).load_all() == []
    assert f.ok({"cmd": "status"})["active"] is None


# ---------------------------------------------------------------------------------------
# the reply address: MQTT 5 correlation data, and the 3.1.1 fallback
# ---------------------------------------------------------------------------------------

def test_mqtt5_correlation_data_round_trips_and_the_311_fallback_answers(fleet):
    f = fleet()
    f.start_daemon()
    reply_topic = f.topics.reply("v5")
    v5 = f.transport("operator", protocol="5")
    v5.connect()
    v5.subscribe(reply_topic, qos=1)
    token = b"\x00\xffopaque-\x01"
    v5.publish(f.topics.ctl(), b'{"cmd": "status"}', qos=1, response_topic=reply_topic,
               correlation_data=token)
    replies = [m for m in messages_within(v5, 2.0) if m.topic == reply_topic]
    assert len(replies) == 1
    assert replies[0].correlation_data == token
    doc = json.loads(replies[0].payload)
    assert doc["ok"] and doc["cmd"] == "status" and doc["result"]["active"] is None

    # MQTT 3.1.1: no properties; the payload carries reply_to and request_id
    old = f.transport("operator", protocol="3.1.1")
    old.connect()
    old.subscribe(f.topics.reply("old"), qos=1)
    old.publish(f.topics.ctl(), json.dumps({"cmd": "runs", "reply_to": f.topics.reply("old"),
                                            "request_id": 42}).encode(), qos=1)
    replies = [m for m in messages_within(old, 2.0) if m.topic == f.topics.reply("old")]
    assert len(replies) == 1 and replies[0].correlation_data is None
    doc = json.loads(replies[0].payload)
    assert doc == {**doc, "ok": True, "cmd": "runs", "request_id": 42,
                   "result": {"runs": []}}
    # a 3.1.1 connection cannot send MQTT 5 properties: a clear error, nothing sent
    with pytest.raises(ValueError, match="MQTT 5 properties"):
        old.publish(f.topics.ctl(), b"{}", qos=1, response_topic=reply_topic)

    # a command repeated (QoS 1 redelivery, a requester that got no answer) is carried out
    # once and answered each time with the same reply
    start = json.dumps({"cmd": "start", "config": run_config(), "run": "once",
                        "reply_to": f.topics.reply("old"), "request_id": "dup"}).encode()
    old.publish(f.topics.ctl(), start, qos=1)
    old.publish(f.topics.ctl(), start, qos=1)
    replies = [json.loads(m.payload) for m in messages_within(old, 2.0)
               if m.topic == f.topics.reply("old")]
    assert len(replies) == 2 and replies[0] == replies[1] and replies[0]["ok"]
    assert [r["id"] for r in f.ok({"cmd": "runs"})["runs"]] == ["once"]


def test_loopback_carries_the_mqtt5_request_properties():
    from edgefl.transport.loopback import LoopbackBroker

    broker = LoopbackBroker()
    a, b = broker.transport("a"), broker.transport("b")
    a.connect()
    b.connect()
    b.subscribe("x/#")
    a.publish("x/1", b"{}", response_topic="x/reply", correlation_data=b"\x01\x02")
    a.publish("x/2", b"{}", retain=True, correlation_data=b"r")
    got = [m for m in messages_within(b, 0.2)]
    assert [(m.response_topic, m.correlation_data) for m in got] == [("x/reply", b"\x01\x02"),
                                                                    (None, b"r")]
    late = broker.transport("late")
    late.connect()
    late.subscribe("x/2")
    assert [m.correlation_data for m in messages_within(late, 0.2)] == [b"r"]   # retained
    with pytest.raises(ValueError, match="wildcards|not allowed"):
        a.publish("x/3", b"", response_topic="x/+")


# ---------------------------------------------------------------------------------------
# clients follow the run, within their board's limits
# ---------------------------------------------------------------------------------------

def test_a_run_beyond_a_boards_limits_is_refused_by_that_board(fleet):
    # client-2's board trains at most 1,000 parameters: the softmax on digits has 650, the
    # MLP 64-32-10 has 2,410
    f = fleet(client_limits={"client-2": {"max_params": 1000}})
    f.start_all()
    big = run_config(rounds=2, model={"name": "mlp", "hidden": [32]})
    f.ok({"cmd": "start", "config": big, "run": "big"})
    refused = f.events.wait("client_refused", run="big", client="client-2")
    assert refused["reason"] == ("the run's model has 2,410 parameters, this board's limit is "
                                 "compute.max_params = 1,000")
    closed = f.events.wait("round_closed", run="big", round=1)
    assert closed["updates"] == 1 and closed["closed_by"] == "offline"
    f.events.wait("run_finished", run="big")
    wait_state(f, "big", "finished")
    assert f.clients["client-2"].stats["trained"] == 0
    assert f.clients["client-1"].progress.trained == 2
    # a run within the limits: both boards train it
    f.ok({"cmd": "start", "config": run_config(rounds=1), "run": "small"})
    assert f.events.wait("round_closed", run="small", round=1)["updates"] == 2


def test_a_run_whose_activations_pass_a_boards_memory_budget_is_refused_by_that_board(fleet):
    """A conv net's activations can be a hundred times its input: the budget check counts
    the backend's workspace for the run's minibatch (kernels.workspace_bytes), not the
    parameters and the input alone. Here 4 padded convs on 8x8 digits, full batch: the old
    estimate was about 12 MiB, the compiled core's workspace is over 200 MiB."""
    from edgefl.service.profiles import resident_mb

    budget = int(resident_mb()) + 150
    # client-1 refuses it by its parameter count (so that nobody trains a model this wide)
    f = fleet(client_limits={"client-1": {"max_params": 1000},
                             "client-2": {"memory_budget_mb": budget}})
    f.start_all()
    wide = run_config(rounds=1, model={"name": "cnn", "conv": [{"out": 64, "k": 3, "pad": 4}] * 4},
                      train={"lr": 0.01, "batch_size": 0, "epochs": 1})
    f.ok({"cmd": "start", "config": wide, "run": "wide"})
    refused = f.events.wait("client_refused", run="wide", client="client-2")
    need = re.match(r"a local round of the run's model needs about (\d+) MiB on top of \d+ "
                    rf"MiB resident, over compute.memory_budget_mb = {budget}$",
                    refused["reason"])
    assert need and int(need[1]) > 200, refused["reason"]
    f.events.wait("client_refused", run="wide", client="client-1")
    assert f.clients["client-2"].stats["trained"] == 0


def test_a_secure_run_a_board_refuses_below_its_threshold_fails_naming_that_board(fleet):
    """Secure aggregation over both boards (threshold 1.0) and client-2's board refuses the
    run (its limits): round 1 cannot reach its threshold, and announcing it again changes
    nothing. The run must fail at once, naming the board and its reason -- not wait out
    each 60 s phase deadline and announce the round again, for ever."""
    f = fleet(client_limits={"client-2": {"max_params": 1000}})
    f.start_all()
    big = run_config(rounds=2, model={"name": "mlp", "hidden": [32]},
                     privacy={"secure_aggregation": {"threshold": 1.0}})
    f.ok({"cmd": "start", "config": big, "run": "big"})
    record = wait_state(f, "big", "failed", timeout=20)
    assert ("client-2 refused the round: the run's model has 2,410 parameters, this "
            "board's limit is compute.max_params = 1,000") in record["error"], record
    assert f.clients["client-2"].stats["trained"] == 0


# ---------------------------------------------------------------------------------------
# the commands themselves: `edgefl aggregator` (the service) and `edgefl ctl`, as processes
# ---------------------------------------------------------------------------------------

def test_edgefl_ctl_drives_the_aggregator_service_process(fleet, tmp_path):
    import signal
    import subprocess
    import sys

    import yaml


    f = fleet()
    secrets = {}
    for user in ("aggregator", "operator"):
        secrets[user] = tmp_path / f"{user}.password"
        secrets[user].write_text(f.server.users[user] + "\n")
    site = tmp_path / "aggregator.yaml"
    site.write_text(yaml.safe_dump({
        "profile": "generic-x86", "node": {"id": "aggregator", "federation": f.fed},
        "state_dir": str(f.state_dir), "log": {"level": "info"},
        "broker": {"url": f.server.url, "username": "aggregator",
                   "password_file": str(secrets["aggregator"])}}))
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(run_config(rounds=2)))
    env = dict(os.environ)
    ctl = [sys.executable, "-m", "edgefl.cli", "ctl", "--broker", f.server.url,
           "--username", "operator", "--password-file", str(secrets["operator"]),
           "--federation", f.fed, "--timeout", "30"]
    log = open(tmp_path / "aggregator.log", "wb")
    service = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "aggregator", "--config",
                                str(site)], env=env, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    log.close()
    watch = None
    try:
        wait_for(lambda: "taking commands on" in (tmp_path / "aggregator.log").read_text(),
                 timeout=60, poll=0.1, what="the aggregator service to take commands")
        status = subprocess.run(ctl + ["status"], env=env, capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0, status.stderr
        assert status.stdout.strip() == "aggregator: no active run; queue: empty"
        watch = subprocess.Popen(ctl + ["watch"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        for node in CLIENTS:
            f.start_client(node)
        started = subprocess.run(ctl + ["start", str(run_file), "--run", "cli", "--clients",
                                        "client-1,client-2", "--json"], env=env,
                                 capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stderr
        reply = json.loads(started.stdout)
        assert reply["ok"] and reply["result"]["run"] == "cli"
        out, err = watch.communicate(timeout=90)
        assert watch.returncode == 0, err
        lines = out.splitlines()
        assert any("cli round 2 closed (all): 2 update(s), test accuracy 0." in line
                   for line in lines), out
        assert any(line.endswith("run_finished") or " run_finished: " in line
                   for line in lines), out
        def cli_state():
            listed = subprocess.run(ctl + ["runs"], env=env, capture_output=True, text=True,
                                    timeout=60)
            rows = [line.split() for line in listed.stdout.splitlines()[1:]]
            return next((row[1] for row in rows if row[0] == "cli"), None) == "finished" \
                and rows

        # watch returns once the service has closed the run, not at its last event: a
        # script's next command finds it finished at once (no wait), and nothing ahead
        rows = cli_state()
        assert rows and rows[0][:3] == ["cli", "finished", "2/2"]
        refused = subprocess.run(ctl + ["pause"], env=env, capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode == 1
        assert refused.stderr.strip() == ("edgefl ctl pause: refused: pause: no run is active "
                                          "(waiting for a run)")
        assert (f.state_dir / "runs" / "cli" / "model.onnx").stat().st_size > 0
        # between runs the service's retained status says it is up and waiting
        assert wait_for(lambda: retained_status(f), what="the idle status")["service"] == \
            "waiting"
        service.send_signal(signal.SIGTERM)
        assert service.wait(30) == 0, (tmp_path / "aggregator.log").read_text()[-3000:]
        assert retained_status(f)["online"] is False
    finally:
        for proc in (service, watch):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_ctl_watch_of_a_run_that_has_ended_prints_its_outcome_and_exits(fleet, tmp_path):
    """`edgefl ctl watch --run ID` started after the run ended (issue #18 item 8) does not
    wait for events that will never come: against the real aggregator service process it
    prints the run's outcome from the service's run records and exits 0 for a finished run
    (rounds, final accuracy, where the outputs are), 1 for a failed one (its error); a run
    id the service does not know is an error naming the id and the runs it has, once
    --timeout passes without it being started; with the service down, the run's retained
    record says how it ended."""
    import signal
    import subprocess
    import sys

    import yaml


    f = fleet()
    secrets = {}
    for user in ("aggregator", "operator"):
        secrets[user] = tmp_path / f"{user}.password"
        secrets[user].write_text(f.server.users[user] + "\n")
    site = tmp_path / "aggregator.yaml"
    site.write_text(yaml.safe_dump({
        "profile": "generic-x86", "node": {"id": "aggregator", "federation": f.fed},
        "state_dir": str(f.state_dir), "log": {"level": "info"},
        "broker": {"url": f.server.url, "username": "aggregator",
                   "password_file": str(secrets["aggregator"])}}))
    good, bad = tmp_path / "short.yaml", tmp_path / "nodata.yaml"
    good.write_text(yaml.safe_dump(run_config(rounds=2)))
    bad.write_text(yaml.safe_dump(run_config(
        rounds=2, dataset={"name": "npz", "path": "/nonexistent/edgefl/data.npz"})))
    env = dict(os.environ)
    ctl = [sys.executable, "-m", "edgefl.cli", "ctl", "--broker", f.server.url,
           "--username", "operator", "--password-file", str(secrets["operator"]),
           "--federation", f.fed, "--timeout", "30"]

    def run_ctl(*args):
        return subprocess.run(ctl + list(args), env=env, capture_output=True, text=True,
                              timeout=120)

    log = open(tmp_path / "aggregator.log", "wb")
    service = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "aggregator", "--config",
                                str(site)], env=env, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    log.close()
    try:
        wait_for(lambda: "taking commands on" in (tmp_path / "aggregator.log").read_text(),
                 timeout=60, poll=0.1, what="the aggregator service to take commands")
        for node in CLIENTS:
            f.start_client(node)
        for config, run_id in ((good, "short"), (bad, "nodata")):
            started = run_ctl("start", str(config), "--run", run_id, "--clients",
                              "client-1,client-2")
            assert started.returncode == 0, started.stderr
        finished = wait_state(f, "short", "finished")
        wait_state(f, "nodata", "failed")

        watched = run_ctl("watch", "--run", "short")
        assert watched.returncode == 0, watched.stderr
        run_dir = f.state_dir / "runs" / "short"
        assert watched.stdout == (f"run short: finished before watch began, 2/2 rounds, final "
                                  f"accuracy {finished['final_accuracy']:.4f}; outputs in "
                                  f"{run_dir}\n")
        assert (run_dir / "summary.json").exists() and (run_dir / "model.onnx").exists()
        as_json = run_ctl("watch", "--run", "short", "--json")
        assert as_json.returncode == 0, as_json.stderr
        record = json.loads(as_json.stdout)
        assert (record["id"], record["state"], record["rounds_done"], record["rounds"]) == \
            ("short", "finished", 2, 2)

        failed = run_ctl("watch", "--run", "nodata")
        assert failed.returncode == 1, failed.stderr
        assert failed.stdout.startswith("run nodata: failed before watch began, 0/2 rounds; ") \
            and \
            "npz: file /nonexistent/edgefl/data.npz does not exist" in failed.stdout, \
            failed.stdout

        # an id the service does not know: an error once --timeout passes without such a
        # run being started (a script may start watch before the run, to see all of it)
        ctl[ctl.index("--timeout") + 1] = "3"
        unknown = run_ctl("watch", "--run", "nosuch")
        assert unknown.returncode == 1, unknown.stdout + unknown.stderr
        said = (f"edgefl ctl watch: no run 'nosuch' on aggregator aggregator of federation "
                f"{f.fed!r} (its runs: short, nodata; `edgefl ctl runs` lists them)")
        assert unknown.stderr.splitlines() == [f"{said}; waiting 3 s for it to be started",
                                               f"{said}; none was started within 3 s"]
        assert unknown.stdout == "aggregator: no active run; queue: empty\n"

        # with the service down, nothing answers: the retained record on runs/short says it
        service.send_signal(signal.SIGTERM)
        assert service.wait(30) == 0, (tmp_path / "aggregator.log").read_text()[-3000:]
        ctl[ctl.index("--timeout") + 1] = "2"
        offline = run_ctl("watch", "--run", "short")
        assert offline.returncode == 0, offline.stderr
        assert "(watching the events anyway)" in offline.stderr
        assert offline.stdout == watched.stdout.replace(
            "before watch began", "(its record; the end's event came before watch was "
                                  "listening)")
    finally:
        if service.poll() is None:
            service.send_signal(signal.SIGTERM)
            try:
                service.wait(30)
            except subprocess.TimeoutExpired:
                service.kill()
                service.wait(10)


# ---------------------------------------------------------------------------------------
# bad input on the aggregator's side: a run that cannot start, a corrupt record
# ---------------------------------------------------------------------------------------

def test_a_retained_command_on_the_control_topic_is_not_carried_out(fleet, caplog):
    """A command published retained (mosquitto_pub -r by mistake) would be carried out
    again by every restart of the service, a `prune` or a `start` each time: the service
    ignores the retained copy the broker hands it on subscribing, and says why."""
    f = fleet()
    f.operator.publish(f.topics.ctl(), json.dumps(
        {"cmd": "start", "config": run_config(rounds=1), "run": "ghost"}).encode(),
        qos=1, retain=True)
    try:
        with caplog.at_level(logging.WARNING, logger="edgefl.roles.daemon"):
            f.start_all()
            time.sleep(1.0)
            assert [r["id"] for r in f.ok({"cmd": "runs"})["runs"]] == []
        assert "a retained message on edgefl/orch-" in caplog.text, caplog.text
    finally:
        f.operator.publish(f.topics.ctl(), b"", qos=1, retain=True)


def test_a_run_that_cannot_start_fails_with_its_reason_and_the_queue_goes_on(fleet):
    f = fleet()
    f.start_all()
    missing = run_config(dataset={"name": "npz", "path": "/nonexistent/edgefl/data.npz"})
    f.ok({"cmd": "start", "config": missing, "run": "nodata"})
    f.ok({"cmd": "start", "config": run_config(rounds=1), "run": "next"})
    error = f.events.wait("error", run="nodata")
    assert "npz: file /nonexistent/edgefl/data.npz does not exist" in error["error"]
    record = wait_state(f, "nodata", "failed")
    assert "/nonexistent/edgefl/data.npz does not exist" in record["error"]
    wait_state(f, "next", "finished")


def test_a_corrupt_run_record_is_reported_and_skipped(tmp_path, caplog):
    store = RunStore(str(tmp_path))
    store.save({"id": "good", "seq": 2, "state": "queued"})
    store.save({"id": "older", "seq": 1, "state": "finished"})
    bad = tmp_path / "runs" / "torn" / "run.json"
    bad.parent.mkdir()
    bad.write_text('{"id": "torn", "state": ')
    other = tmp_path / "runs" / "alien" / "run.json"
    other.parent.mkdir()
    other.write_text('{"id": "someone-else", "state": "queued"}')
    # made by hand: an id that cannot be a topic level (its record's topic runs/<id>)
    wild = tmp_path / "runs" / "a+b" / "run.json"
    wild.parent.mkdir()
    wild.write_text('{"id": "a+b", "state": "finished"}')
    with caplog.at_level("ERROR", logger="edgefl.roles.daemon"):
        assert [r["id"] for r in store.load_all()] == ["older", "good"]
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(bad) in m and "skipped" in m for m in messages), messages
    assert any(str(other) in m and "not a run record of run 'alien'" in m for m in messages)
    assert any(str(wild) in m and "contains '+'" in m for m in messages), messages


def test_start_refuses_a_run_id_whose_directory_holds_a_record_it_cannot_read(fleet):
    """A run whose record cannot be read (torn by the disk, written by another version) is
    skipped at start, logged: its id was then free, and a `start` naming it wrote a new
    record over the old one and ran in its directory, with its checkpoint and outputs. The
    id is refused, naming the directory; nothing in it changes."""
    f = fleet()
    torn = f.state_dir / "runs" / "old-1"
    (torn / "state").mkdir(parents=True)
    (torn / "run.json").write_text('{"id": "old-1", "state": ')
    (torn / "state" / "aggregator.npz").write_bytes(b"the old run's checkpoint")
    before = {p.name: p.read_bytes() for p in (torn / "run.json", torn / "state" /
                                                "aggregator.npz")}
    f.start_daemon()
    reply = f.control().request({"cmd": "start", "config": run_config(), "run": "old-1"},
                                timeout=20)
    assert not reply["ok"], reply
    assert f"start: run id 'old-1' is taken: {torn} holds a run whose record cannot be " \
        "read" in reply["error"], reply["error"]
    assert {p.name: p.read_bytes() for p in (torn / "run.json", torn / "state" /
                                             "aggregator.npz")} == before
    assert "old-1" not in {r["id"] for r in f.ok({"cmd": "runs"})["runs"]}


# ---------------------------------------------------------------------------------------
# `edgefl ctl` as a process: every command, watch's count of clients online, the account
# ---------------------------------------------------------------------------------------

def ctl_argv(f, tmp_path, user="operator", mqtt="5") -> list:
    """`edgefl ctl` logged in as `user` (its password in a file, as an operator keeps it)."""
    import sys

    secret = tmp_path / f"{user}.password"
    secret.write_text(f.server.users[user] + "\n")
    return [sys.executable, "-m", "edgefl.cli", "ctl", "--broker", f.server.url,
            "--username", user, "--password-file", str(secret), "--federation", f.fed,
            "--mqtt", mqtt]


def run_ctl(argv, *args, timeout=120):
    import subprocess

    return subprocess.run(list(argv) + list(args), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


class Lines:
    """A process's stdout, read line by line by a thread."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, predicate, what, timeout=60.0):
        return wait_for(lambda: next((x for x in list(self.lines) if predicate(x)), None),
                        timeout, what, poll=0.05)


def test_edgefl_ctl_processes_pause_resume_export_stop_and_watch_counts_clients(fleet,
                                                                                 tmp_path):
    import re
    import subprocess

    f = fleet()
    f.start_all()
    f.ok({"cmd": "start", "config": run_config(rounds=500), "run": "long"})
    f.events.wait("round_closed", run="long", round=1)
    ctl = ctl_argv(f, tmp_path)

    # watch starts while both clients are online: it counts them from the status reply
    watch = subprocess.Popen(ctl + ["watch"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    out = Lines(watch)
    try:
        first = out.wait(lambda x: x.startswith("run long: "), "watch's status line")
        assert "2 client(s) online: client-1, client-2" in first, first

        paused = run_ctl(ctl, "pause")
        assert paused.returncode == 0, paused.stderr
        # mid-round or, as rounds follow each other quickly, between two rounds
        assert re.fullmatch(r"run long: state paused, (round \d+ open \(it closes after "
                            r"resume\)|between rounds: \d+ round\(s\) done, the next opens "
                            r"after resume)", paused.stdout.strip()), paused.stdout
        where = paused.stdout.strip().split("state paused, ", 1)[1]
        out.wait(lambda x: x.endswith(f" long run_paused: {where}"), "watch's run_paused line")
        resumed = run_ctl(ctl, "resume")
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.strip() == "run long: state running"
        f.events.wait("run_continued", run="long")

        exported = run_ctl(ctl, "export", "--json")
        assert exported.returncode == 0, exported.stderr
        result = json.loads(exported.stdout)["result"]
        assert result["run"] == "long" and result["published"] is True
        event = f.events.wait("model_exported", run="long", trigger="export")
        assert event["round"] == result["round"] and event["model_onnx"] == result["model_onnx"]
        f.events.wait("onnx_published", run="long", round=result["round"])

        # a board goes away: client_left, and watch counts one client online, not -1 or 0
        f.stop_client("client-1")
        f.events.wait("client_left", run="long", client="client-1")
        out.wait(lambda x: x.endswith(" long client-1 offline (1 online)"),
                 "watch's client-1 offline line")

        stopped = run_ctl(ctl, "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.startswith("run long: state stopping"), stopped.stdout
        assert watch.wait(60) == 3                # the watched run was stopped, not finished
        out.thread.join(5)
        assert any(" long run_stopped: " in x for x in out.lines), out.lines
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
    stop_export = f.events.wait("model_exported", run="long", trigger="stop")
    run_dir = f.state_dir / "runs" / "long"
    assert stop_export["model_onnx"] == str(run_dir / "model.onnx")
    published = f.events.wait("onnx_published", run="long", round=stop_export["round"])
    # the board still online installs the stopped run's model from the onnx topics
    import hashlib

    def installed():
        path = f.tmp / "client-2" / "model.onnx"
        return path.exists() and hashlib.sha256(path.read_bytes()).hexdigest()

    wait_for(lambda: installed() == published["sha256"], what="client-2 to install the "
             "stopped run's model")
    assert hashlib.sha256((run_dir / "model.onnx").read_bytes()).hexdigest() == \
        published["sha256"]


def test_edgefl_ctl_fails_at_once_when_the_broker_refuses_and_never_uses_a_site_account(
        fleet, tmp_path):
    import time as clock

    import yaml

    f = fleet()
    f.start_daemon()
    # MQTT 5: the broker's PUBACK says 135 Not authorized; ctl says so without waiting out
    # its timeout (run() would raise TimeoutExpired if it waited the 600 s)
    begun = clock.monotonic()
    refused = run_ctl(ctl_argv(f, tmp_path, "client-1"), "status", "--timeout", "600",
                      timeout=300)
    assert refused.returncode == 1
    assert clock.monotonic() - begun < 300
    assert refused.stderr.splitlines()[-1].startswith(      # (after the transport's log)
        f"edgefl ctl: status: the broker refused the command on {f.topics.ctl()} (MQTT 5 "
        f"reason code 135, Not authorized) from account 'client-1': the broker's ACL lets "
        f"only the operator account publish commands (broker/acl)"), refused.stderr
    # MQTT 3.1.1 cannot say it: the timeout is the only signal, and it names the ACL
    silent = run_ctl(ctl_argv(f, tmp_path, "client-1", mqtt="3.1.1"), "status", "--timeout",
                     "2")
    assert silent.returncode == 1
    assert "a likely cause is the broker's ACL refusing account 'client-1' the command " \
           f"topic {f.topics.ctl()}" in silent.stderr, silent.stderr
    assert "under MQTT 3.1.1 a broker drops a refused command silently" in silent.stderr

    # the aggregator's site file: its account is the aggregator's own, never used by ctl
    secret = tmp_path / "aggregator.password"
    secret.write_text(f.server.users["aggregator"] + "\n")
    site = tmp_path / "aggregator.yaml"
    site.write_text(yaml.safe_dump({
        "node": {"id": "aggregator", "federation": f.fed},
        "broker": {"url": f.server.url, "username": "aggregator",
                   "password_file": str(secret)}}))
    base = ctl_argv(f, tmp_path)[:4]             # python -m edgefl.cli ctl
    early = run_ctl(base, "status", "--config", str(site))
    assert early.returncode == 1
    assert early.stderr.startswith(
        f"edgefl ctl: error: the aggregator's site file {site} logs in as its own account "
        f"(username aggregator), and the broker's ACL lets only the operator account publish "
        f"commands (broker/acl), so ctl does not use it: give the operator's credentials "
        f"with --username operator --password-file FILE"), early.stderr
    # with the operator's credentials the site file gives the broker and the federation
    operator = tmp_path / "operator.password"
    operator.write_text(f.server.users["operator"] + "\n")
    status = run_ctl(base, "status", "--config", str(site), "--username", "operator",
                     "--password-file", str(operator))
    assert status.returncode == 0, status.stderr
    assert status.stdout.strip() == "aggregator: no active run; queue: empty"


def test_a_stop_as_a_run_ends_is_not_taken_for_one_between_tries(tmp_path):
    """Between a run's end and its record saying so (the service closing it: export, end
    record), the run is neither active nor ended. A stop then was answered "stopping; it
    was waiting to be tried again" and its mark saved into the finished run's record."""
    from edgefl.roles.control import Command, CommandError

    daemon = Daemon(DaemonSettings(), str(tmp_path), transport_factory=None)
    record = {"id": "r1", "state": "running", "config": {"rounds": 5}}
    daemon.records["r1"] = record
    daemon._closing = "r1"                # as _execute has it until the run's end is recorded
    for run in ("r1", None):
        with pytest.raises(CommandError, match="run r1 has just ended; its end is being "
                                               "recorded"):
            daemon._cmd_stop(Command("stop", {"run": run} if run else {}))
    assert "stop_requested" not in record
    # the service shutting down: the run was only interrupted, and resumes at the next
    # start, where the stop's mark in its record ends it
    daemon.stop.set()
    assert daemon._cmd_stop(Command("stop", {"run": "r1"}))["state"] == "stopping"
    assert "stop_requested" in record


def test_pause_between_rounds_says_where_the_run_is_held(tmp_path):
    from types import SimpleNamespace

    from edgefl.cli.ctl import _ctl_text, _event_text
    from edgefl.roles.control import Command, RunControl

    daemon = Daemon(DaemonSettings(), str(tmp_path), transport_factory=None)
    record = {"id": "r", "state": "running", "config": {"rounds": 5}}
    control = RunControl("r")
    daemon.records["r"] = record
    daemon.active = (record, control)
    # the run's aggregator between rounds 3 and 4: no open round
    control.attach(SimpleNamespace(open=None, ckpt=SimpleNamespace(round=3, history=[])))
    result = daemon._cmd_pause(Command("pause"))
    assert result == {"run": "r", "state": "paused", "round": None, "rounds_done": 3}
    assert _ctl_text("pause", result) == ("run r: state paused, between rounds: 3 round(s) "
                                          "done, the next opens after resume")
    event = {"event": "run_paused", "run": "r", "at": 0.0, **result}
    assert _event_text(event, set()).endswith(" r run_paused: between rounds: 3 round(s) "
                                              "done, the next opens after resume")
    # before the aggregator has started the run: nothing done yet
    assert _ctl_text("pause", {"run": "r", "state": "paused", "round": None,
                               "rounds_done": None}) == ("run r: state paused, before its "
                                                         "first round opens")


# ---------------------------------------------------------------------------------------
# every export: model_exported, and on the onnx topics when publishing is on
# ---------------------------------------------------------------------------------------

def test_every_export_of_a_run_is_announced_and_published(fleet):
    import hashlib

    from edgefl.export import ExportPolicy

    f = fleet(run_options={"export": ExportPolicy(every=2)})
    f.start_all()
    f.ok({"cmd": "start", "config": run_config(rounds=3), "run": "short"})
    f.events.wait("run_finished", run="short")
    exports = f.events.of("model_exported", run="short")
    assert [(e["round"], e["trigger"]) for e in exports] == [(2, "periodic"), (3, "final")]
    published = f.events.of("onnx_published", run="short")
    assert [e["round"] for e in published] == [2, 3]
    final = f.state_dir / "runs" / "short" / "model.onnx"
    assert exports[-1]["model_onnx"] == str(final)
    sha = hashlib.sha256(final.read_bytes()).hexdigest()
    assert published[-1]["sha256"] == sha
    for node in CLIENTS:
        path = f.tmp / node / "model.onnx"
        wait_for(lambda path=path: path.exists() and
                 hashlib.sha256(path.read_bytes()).hexdigest() == sha,
                 what=f"{node} to install the final model")


def test_with_publishing_off_exports_are_announced_but_not_published(fleet):
    f = fleet(run_options={"publish_onnx": False})
    f.start_all()
    f.ok({"cmd": "start", "config": run_config(rounds=1), "run": "quiet"})
    f.events.wait("run_finished", run="quiet")
    assert f.events.wait("model_exported", run="quiet")["trigger"] == "final"
    wait_state(f, "quiet", "finished")
    result = f.ok({"cmd": "export", "run": "quiet"})
    assert result["published"] is False
    assert f.events.wait("model_exported", run="quiet", trigger="export")["round"] == 1
    assert f.events.of("onnx_published") == []
    probe = f.transport("operator")
    probe.connect()
    probe.subscribe(f.topics.onnx(), qos=1)
    assert [m for m in messages_within(probe, 0.5) if m.payload] == []


# ---------------------------------------------------------------------------------------
# runs on shared topics: a stopped run leaves nothing to train, its updates reach no run
# ---------------------------------------------------------------------------------------

def test_a_stopped_run_leaves_no_round_and_its_late_update_is_refused_by_the_next(
        fleet, caplog):
    import logging

    from edgefl.roles import messages as msg
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim import simulate
    from edgefl.strategies import Update
    from edgefl.transport import wire

    caplog.set_level(logging.INFO, "edgefl.roles.aggregator")
    f = fleet()
    f.start_all()
    f.ok({"cmd": "start", "config": run_config(rounds=500), "run": "old"})
    f.events.wait("round_closed", run="old", round=1)
    f.ok({"cmd": "stop"})
    f.events.wait("run_stopped", run="old")
    # the round topic says run old is over, and no model of its abandoned round is retained:
    # a board that connects before the next run trains nothing
    probe = f.transport("operator")
    probe.connect()
    for topic_filter in (f.topics.round(), f.topics.model(), f.topics.subscription("model")):
        probe.subscribe(topic_filter, qos=1)
    retained = {m.topic: m.payload for m in messages_within(probe, 1.0)
                if m.retain and m.payload}
    assert sorted(retained) == [f.topics.round()]
    end = json.loads(retained[f.topics.round()])
    assert (end["run"], end["finished"], end["stopped"]) == ("old", True, True)
    wait_for(lambda: all(c.finished for c in f.clients.values()),
             what="the boards to see the end of run old")

    f.stop_client("client-1")
    # run new waits for both updates of every round (min_updates 2); client-1 is away
    f.ok({"cmd": "start", "config": run_config(rounds=2), "run": "new",
          "round": {"min_updates": 2}})
    f.events.wait("round_opened", run="new", round=1)
    # what client-1 would upload for run old if it were still at it: round 1, the same
    # model, its own account -- the aggregator of run new refuses it, naming both runs
    config = run_config_from_mapping(run_config(rounds=2))
    prepared = prepare_run(config, progress=False)
    params = {"params": prepared.init_params}
    stale = wire.encode("update", 1, "client-1", params,
                        msg.update_scalars(Update(params, 10, 0.5, 1), "old", 0.0),
                        prepared.model.table)
    board = f.transport("client-1")
    board.connect()
    assert board.publish(f.topics.update("client-1"), stale, qos=1).wait(10)
    wait_for(lambda: "update of client-1 for round 1 belongs to run old, this is run new"
             in caplog.text, what="the stale update refused")
    f.start_client("client-1")                  # back: it follows run new from its round 1
    f.events.wait("client_joined", run="new", client="client-1")
    finished = f.events.wait("run_finished", run="new")
    closed = f.events.of("round_closed", run="new")
    assert [(e["round"], e["updates"], e["closed_by"]) for e in closed] == [(1, 2, "all"),
                                                                           (2, 2, "all")]
    journal = read_journal(f.state_dir / "runs" / "new" / "state" / JOURNAL_FILE)
    assert [r["round"] for r in journal if r.get("event") == "aggregated"] == [1, 2]
    # the model is exactly the one of run new without the stale update
    assert finished["model_sha256"] == simulate(config, None, progress=False)["model_sha256"]


def test_a_final_model_exported_after_the_run_is_still_announced_and_published(fleet,
                                                                                monkeypatch):
    import hashlib

    from edgefl.runs.outputs import RoundExporter

    real = RoundExporter.__call__

    def final_fails(self, round, params):     # the run's own final export fails (logged)
        return None if round == self.run.config.rounds else real(self, round, params)

    monkeypatch.setattr(RoundExporter, "__call__", final_fails)
    f = fleet()
    f.start_all()
    f.ok({"cmd": "start", "config": run_config(rounds=2), "run": "late"})
    # write_outputs made model.onnx again from model.npz, after the run's aggregator closed:
    # the service announces and publishes it
    exported = f.events.wait("model_exported", run="late")
    assert (exported["round"], exported["trigger"]) == (2, "final")
    published = f.events.wait("onnx_published", run="late", round=2)
    path = f.state_dir / "runs" / "late" / "model.onnx"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == published["sha256"]


# ---------------------------------------------------------------------------------------
# the site file's run (`run:`) and `edgefl aggregator --once`, as a script runs them
# ---------------------------------------------------------------------------------------

class SiteRunScript:
    """`edgefl aggregator --once` with the site file's run given as `--set run=FILE`, as a
    process in tmp_path (its own federation on the anonymous test Mosquitto, state in
    tmp_path/S, outputs in tmp_path/out): what a script written for the one-run aggregator
    does, run again and again."""

    def __init__(self, server, tmp_path):
        self.server, self.tmp = server, tmp_path
        self.fed = "site" + uuid.uuid4().hex[:6]
        self.state, self.out = tmp_path / "S", tmp_path / "out"
        self.file = tmp_path / "mn.yaml"

    def write(self, doc: dict) -> None:
        import yaml

        self.file.write_text(yaml.safe_dump(doc))

    def run(self, timeout=120):
        import subprocess
        import sys

        return subprocess.run(
            [sys.executable, "-m", "edgefl.cli", "aggregator", "--set", "node.id=agg4",
             "--set", f"node.federation={self.fed}", "--set", f"broker.url={self.server.url}",
             "--set", f"state_dir={self.state}", "--set", f"run={self.file.name}",
             "--out", str(self.out), "--deadline", "60", "--once"],
            cwd=self.tmp, capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL)

    def run_with_clients(self, config: dict):
        """run(), with the two clients of `config` (a run_config mapping) as threads."""
        from edgefl.runs.prepare import prepare_run
        from helpers import start_mqtt_clients, stop_clients

        clients, threads = start_mqtt_clients(
            self.server.url, self.fed, "site",
            prepare_run(run_config_from_mapping(config), progress=False), self.tmp, [0, 1])
        try:
            return self.run()
        finally:
            stop_clients(clients, threads)

    def records(self) -> dict:
        return {r["id"]: r for r in RunStore(str(self.state)).load_all()}


def test_a_site_run_failing_on_a_config_error_logs_its_one_line(mosquitto_server, tmp_path):
    """The site file's run whose dataset cannot be loaded: the ConfigError is the user's
    mistake, not a crash, so the service logs its one line (the file and the key, no
    traceback), records it, and --once exits 1."""
    s = SiteRunScript(mosquitto_server, tmp_path)
    s.write(run_config(rounds=2, dataset={"name": "npz", "path": "/nonexistent/edgefl/d.npz"}))
    done = s.run()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    [(run_id, record)] = s.records().items()
    assert record["state"] == "failed"
    assert "npz: file /nonexistent/edgefl/d.npz does not exist" in record["error"]
    failed = [line for line in done.stderr.splitlines() if f"run {run_id} failed" in line]
    assert len(failed) == 1, done.stderr
    assert f"{s.file}: dataset: npz: file /nonexistent/edgefl/d.npz does not exist" \
        in failed[0]


def test_once_with_the_site_run_failed_earlier_exits_1_saying_what_to_do(mosquitto_server,
                                                                         tmp_path):
    """Run again with the file unchanged, the failed site-file run (remembered by its record)
    is not redone; --once must not then report success with nothing run (a script would
    go on without outputs): it exits 1, saying the run failed earlier, why, and how to run
    it again."""
    s = SiteRunScript(mosquitto_server, tmp_path)
    s.write(run_config(rounds=2, dataset={"name": "npz", "path": "/nonexistent/edgefl/d.npz"}))
    assert s.run().returncode == 1
    [(run_id, record)] = s.records().items()

    again = s.run()
    assert again.returncode == 1, again.stderr + again.stdout
    assert "Traceback" not in again.stderr, again.stderr
    assert (f"edgefl aggregator: error: the site file's run {run_id} ({s.file}) failed "
            f"earlier and is not run again: {record['error']}; a changed run config is "
            f"queued as a new run") in again.stderr, again.stderr
    assert "edgefl ctl start" in again.stderr and str(s.state / "runs" / run_id) \
        in again.stderr
    assert s.records() == {run_id: record}          # nothing queued, the record as it was


def test_a_changed_site_run_config_is_queued_as_a_new_run(mosquitto_server, tmp_path):
    """The user fixes the file of a failed site-file run and runs the same command: the
    changed run config is a new run (a new id and record; the failed one stays as it ended),
    and it runs. Run once more unchanged, the finished run is recognised (exit 0, nothing
    redone); changed again, the new config cannot use the state directory that holds the
    finished run's checkpoint, and the command says so in one line before running anything."""
    s = SiteRunScript(mosquitto_server, tmp_path)
    s.write(run_config(rounds=2, dataset={"name": "npz", "path": "/nonexistent/edgefl/d.npz"}))
    assert s.run().returncode == 1
    [failed_id] = s.records()

    s.write(run_config(rounds=2))                                  # fixed: digits
    done = s.run_with_clients(run_config(rounds=2))
    assert done.returncode == 0, done.stderr
    records = s.records()
    assert set(records) - {failed_id} and records[failed_id]["state"] == "failed"
    [new_id] = set(records) - {failed_id}
    assert records[new_id]["state"] == "finished" and records[new_id]["rounds_done"] == 2
    assert f"run {new_id}: finished" in done.stdout
    assert (s.out / "summary.json").is_file()
    assert AggregatorCheckpoint.load(str(s.state)).run_id == new_id

    # unchanged: the finished run is not redone, and that is success
    again = s.run()
    assert again.returncode == 0, again.stderr
    assert f"the site file's run {new_id} ({s.file}) finished earlier" in again.stdout
    assert s.records() == records

    # changed once more: the finished run's checkpoint in the state directory belongs to the
    # old config (a new run there would be refused by its fingerprint, or resume another
    # run's checkpoint under a new id), so the command stops at once, naming both
    s.write(run_config(rounds=3))
    changed = s.run()
    assert changed.returncode == 1
    assert "Traceback" not in changed.stderr, changed.stderr
    assert (f"edgefl aggregator: error: {s.file}: the site file's run config changed since "
            f"run {new_id} (finished)") in changed.stderr, changed.stderr
    assert s.records() == records


def test_a_site_run_not_yet_ended_takes_the_file_as_it_is_now(mosquitto_server, tmp_path):
    """The service queued the site file's run, stopped before it ended, and the file was
    edited meanwhile: the run is still this file's (a run not ended is resumed, not
    replaced), runs with the file as it is now, and its record takes that file's digest.
    Otherwise the next start, the file unchanged since, would take it for a changed run
    config and refuse to start (the state directory holds the run's checkpoint)."""
    import time as _time

    from edgefl.roles.daemon import RunStore, site_config_digest

    s = SiteRunScript(mosquitto_server, tmp_path)
    s.write(run_config(rounds=2))
    store = RunStore(str(s.state))
    queued = {"id": "r-queued", "seq": 1, "state": "queued", "site": str(s.file),
              "site_config_sha256": "0" * 64,      # the digest of the file as it was then
              "config": None, "clients": None, "round": {}, "created": _time.time(),
              "run_dir": store.run_dir("r-queued"), "state_dir": str(s.state),
              "out_dir": str(s.out)}
    store.save(queued)
    done = s.run_with_clients(run_config(rounds=2))
    assert done.returncode == 0, done.stderr
    [(run_id, record)] = s.records().items()              # no second run queued
    assert run_id == "r-queued" and record["state"] == "finished", record
    assert record["site_config_sha256"] == site_config_digest(str(s.file))

    again = s.run()                                        # the file unchanged since
    assert again.returncode == 0, again.stderr
    assert f"the site file's run r-queued ({s.file}) finished earlier" in again.stdout
    assert s.records() == {run_id: record}


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_ctl_refuses_a_timeout_of_zero_or_less_naming_the_option(capsys, value):
    # `ctl status --timeout -1` used to publish and then report "no reply ... within -1 s
    # ... (connection lost?)", blaming the broker; it is refused before connecting (the
    # --broker here is a closed port, so an accepted value could not reach a real broker)
    assert usage_error(["ctl", "status", "--broker", "mqtt://127.0.0.1:1", "--timeout", value],
                       capsys) == (f"edgefl ctl: error: argument --timeout: need a number of "
                                   f"seconds > 0, got {value}")


@pytest.mark.parametrize("option, value, problem", [
    ("--deadline", "-1", "--deadline (round.deadline): -1.0 is below the minimum 0.1"),
    ("--quorum", "0", "--quorum (round.quorum): 0.0 is below the minimum 0.01"),
    ("--min-updates", "0", "--min-updates (round.min_updates): 0 is below the minimum 1"),
])
def test_ctl_start_checks_the_rounds_settings_before_sending(capsys, option, value, problem):
    # the aggregator's own rule (its site file's round.*), applied before the command is
    # published: the --broker is a closed port, so only a refusal here can say this
    from edgefl.cli import main

    assert main(["ctl", "start", "quickstart", option, value, "--broker",
                 "mqtt://127.0.0.1:1"]) == 1
    assert capsys.readouterr().err == f"edgefl ctl: error: {problem}\n"


def test_the_site_runs_digest_is_of_the_file_as_written(tmp_path):
    # what the file asks for, not the config as this edgefl resolves it: a default a later
    # release adds would otherwise make an unchanged file another run, and the finished
    # run's checkpoint in the state directory would refuse the upgraded service's start
    from edgefl.roles.daemon import site_config_digest

    path = tmp_path / "run.yaml"
    path.write_text("rounds: 3\nmodel: {name: softmax}\n")
    digest = site_config_digest(str(path))
    path.write_text("# the lab's run\nmodel:\n  name: softmax\nrounds: 3   # three\n")
    assert site_config_digest(str(path)) == digest          # comments and layout aside
    path.write_text("rounds: 4\nmodel: {name: softmax}\n")
    assert site_config_digest(str(path)) != digest


# ---------------------------------------------------------------------------------------
# an operator's stop survives the service's death (kill -9) before it was carried out
# ---------------------------------------------------------------------------------------

def test_a_stop_acknowledged_before_a_kill_is_carried_out_by_the_restarted_service(
        fleet, tmp_path):
    """`stop` is answered "stopping" at once; the run's end (export, record `stopped`) comes
    after the open round is abandoned and the model exported. The service process is killed
    with SIGKILL as soon as the answer arrives: started again, it must not resume the run
    the operator stopped (no round aggregated after the restart), and the run ends
    `stopped` with its last checkpoint exported."""
    import signal
    import subprocess
    import sys

    import yaml


    f = fleet()
    secret = tmp_path / "aggregator.password"
    secret.write_text(f.server.users["aggregator"] + "\n")
    site = tmp_path / "aggregator.yaml"
    site.write_text(yaml.safe_dump({
        "profile": "generic-x86", "node": {"id": "aggregator", "federation": f.fed},
        "state_dir": str(f.state_dir), "log": {"level": "info"},
        "clients": list(CLIENTS),
        "broker": {"url": f.server.url, "username": "aggregator",
                   "password_file": str(secret)}}))
    env = dict(os.environ)
    procs = []

    def service(log_name):
        with open(tmp_path / log_name, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "aggregator",
                                     "--config", str(site)], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(proc)
        wait_for(lambda: "taking commands on" in (tmp_path / log_name).read_text(),
                 timeout=60, poll=0.1, what="the aggregator service to take commands")
        return proc

    run_dir = f.state_dir / "runs" / "long"
    journal = run_dir / "state" / JOURNAL_FILE
    try:
        first = service("aggregator-1.log")
        for node in CLIENTS:
            f.start_client(node)
        f.ok({"cmd": "start", "config": run_config(rounds=500), "run": "long"})
        f.events.wait("round_closed", run="long", round=2, timeout=60)
        assert f.ok({"cmd": "stop"})["state"] == "stopping"
        first.send_signal(signal.SIGKILL)            # the stop acknowledged, then the crash
        assert first.wait(10) == -signal.SIGKILL
        done = AggregatorCheckpoint.load(run_dir / "state").round
        killed_at = len(read_journal(journal))

        second = service("aggregator-2.log")
        # the restarted service either carries the stop out or resumes the run
        wait_for(lambda: json.loads((run_dir / "run.json").read_text())["state"] == "stopped"
                 or any(r.get("event") == "aggregated"
                        for r in read_journal(journal)[killed_at:]),
                 timeout=60, poll=0.1, what="run long stopped, or a round aggregated")
        record = json.loads((run_dir / "run.json").read_text())
        after = [r["round"] for r in read_journal(journal)[killed_at:]
                 if r.get("event") == "aggregated"]
        assert after == [] and record["state"] == "stopped", \
            (record["state"], after, (tmp_path / "aggregator-2.log").read_text()[-2000:])
        assert record["rounds_done"] == done
        assert (run_dir / "model.onnx").stat().st_size > 0
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0, (tmp_path / "aggregator-2.log").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_stop_whose_mark_cannot_be_written_still_stops_the_run(tmp_path, monkeypatch):
    """The stop mark in the run's record guards against a crash before the stop is carried
    out; it must not be a condition of the stop. A full disk (a run's checkpoints fill it)
    made `_save` raise before the run's stop was set: `ctl stop` answered an OSError and the
    run trained on."""
    from edgefl.roles.control import Command, RunControl

    daemon = Daemon(DaemonSettings(), str(tmp_path), transport_factory=None)
    record = {"id": "r", "state": "running", "config": {"rounds": 5}}
    control = RunControl("r")
    daemon.records["r"] = record
    daemon.active = (record, control)

    def full(_record):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(daemon.store, "save", full)
    result = daemon._cmd_stop(Command("stop"))
    assert control.stop_requested.is_set()
    assert result["state"] == "stopping"
    assert "could not be written" in result["note"] and "No space left" in result["note"]


# ---------------------------------------------------------------------------------------
# a hostile board's strings on the operator's terminal
# ---------------------------------------------------------------------------------------

# what a compromised board may put in its status: a terminal escape that sets the window
# title and clears the screen, a bell, a right-to-left override that reverses what follows,
# a lone surrogate (valid in JSON, unprintable in UTF-8)
HOSTILE = "\x1b]0;owned\x07\x1b[2J\x1b[31mred\u202etxt.exe\r\ud800"


def _login(server, user: str) -> MqttTransport:
    t = MqttTransport(server.url, f"{user}-{uuid.uuid4().hex[:6]}", username=user,
                      password=server.users[user], clean_session=True, connect_timeout=10)
    t.connect()
    return t


def _no_terminal_controls(text: str) -> None:
    for ch in ("\x1b", "\x07", "\u202e", "\r", "\ud800"):
        assert ch not in text, f"{ch!r} reached the terminal: {text!r}"


def test_edgefl_status_prints_a_boards_control_characters_escaped(mosquitto_acl_server,
                                                                  tmp_path, capsys):
    """`edgefl status` (and `edgefl fleet status`, the same table) printed a board's
    version and profile as they came: a board could retitle, clear or recolour the
    operator's terminal, or reverse what follows with U+202E. They are printed escaped, so
    the operator sees what the board sent."""
    from edgefl.cli import main
    topics = Topics(f"tty-{uuid.uuid4().hex[:8]}")
    board = _login(mosquitto_acl_server, "client-1")
    password = tmp_path / "operator.pw"
    password.write_text(mosquitto_acl_server.users["operator"] + "\n")
    try:
        board.publish(topics.status("client-1"), json.dumps(
            {"node": "client-1", "online": True, "version": HOSTILE, "profile": HOSTILE,
             "role": HOSTILE}).encode(), qos=1, retain=True).wait(10)
        capsys.readouterr()
        assert main(["status", "--broker", mosquitto_acl_server.url, "--federation",
                     topics.federation, "--username", "operator", "--password-file",
                     str(password)]) == 0
        out = capsys.readouterr().out
        assert "client-1" in out and "owned" in out
        _no_terminal_controls(out)
        assert "\\x1b]0;owned\\x07" in out and "\\u202e" in out
    finally:
        board.publish(topics.status("client-1"), b"", qos=1, retain=True).wait(10)
        board.close(timeout=1, announce_offline=False)


def _ctl_watch_of(server, tmp_path, payloads) -> tuple[str, str]:
    """(stdout, stderr) of a real `edgefl ctl watch` process on a federation of its own, to
    which the aggregator account publishes `payloads` on the events topic once the watch
    follows it (no service answers the watch's status request: it follows the events after
    --timeout)."""
    import subprocess
    import sys

    topics = Topics(f"watch-{uuid.uuid4().hex[:8]}")
    password = tmp_path / "operator.pw"
    password.write_text(server.users["operator"] + "\n")
    with open(tmp_path / "watch.err", "wb") as err:
        watch = subprocess.Popen(
            [sys.executable, "-m", "edgefl.cli", "ctl", "watch", "--broker", server.url,
             "--federation", topics.federation, "--username", "operator", "--password-file",
             str(password), "--timeout", "1", "--mqtt", "3.1.1"], cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
    aggregator = _login(server, "aggregator")
    try:
        wait_for(lambda: b"watching the events anyway" in (tmp_path / "watch.err")
                 .read_bytes(), timeout=60, what="ctl watch to follow the events")
        for payload in payloads:
            aggregator.publish(topics.events(), payload, qos=1).wait(10)
        out, _ = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
        aggregator.close(timeout=1, announce_offline=False)
    return out.decode("utf-8", "replace"), (tmp_path / "watch.err").read_text()


def _event(**fields) -> bytes:
    return json.dumps({**fields, "node": "aggregator", "at": time.time()}).encode()


def test_ctl_watch_prints_a_boards_refusal_reason_escaped(mosquitto_acl_server, tmp_path):
    """A board that refuses a run says why in its status (`refused.reason`), and the
    aggregator forwards that text verbatim in its client_refused event
    (roles/aggregator.py _on_status); `edgefl ctl watch` printed it as it came, control
    characters and all. The event is published here as the aggregator account would: the
    watch, a real `edgefl ctl` process, must print it escaped."""
    out, _ = _ctl_watch_of(mosquitto_acl_server, tmp_path, [
        _event(event="client_refused", run="r1", round=1, client="client-1", reason=HOSTILE),
        _event(event="run_finished", run="r1", rounds=1)])
    assert "client_refused" in out and "owned" in out, out
    _no_terminal_controls(out)
    assert "\\x1b]0;owned\\x07" in out


def test_ctl_watch_skips_an_event_nested_too_deep_and_goes_on(mosquitto_acl_server, tmp_path):
    """`ctl watch` read events with json.loads, whose RecursionError (not a ValueError) on a
    document nested 2,000 deep ended the watch with a traceback. Events are read as every
    other message is (messages.json_object): a deep one is skipped, the next one printed."""
    deep = b'{"event": "round_closed", "run": "r1", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    out, err = _ctl_watch_of(mosquitto_acl_server, tmp_path,
                             [deep, _event(event="run_finished", run="r1", rounds=1)])
    assert "Traceback" not in err, err
    assert "run_finished" in out, (out, err)


# ---------------------------------------------------------------------------------------
# a full disk under the service
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("then", ["space", "stop"])
def test_a_run_whose_checkpoint_meets_a_full_disk_waits_for_space_and_resumes(
        fleet, tmp_path, caplog, then):
    """The disk fills while a run goes on (its checkpoints are what fill it): the round's
    checkpoint cannot be written, the aggregator stops, and its log says a restart runs the
    round again. The service marked the run failed, for good: no command resumes a failed
    run, and the rounds done were lost to it though their checkpoint stood. A full disk is
    not the run's fault, as an unreachable broker is not: the run stays running, is tried
    again, and once there is space goes on from its checkpoint, each round aggregated once.
    The state directory is a real tmpfs, filled by a file; the run record still fits.
    Between two tries the operator can still stop the run (then="stop"): it ends stopped,
    not failed, at the round its checkpoint holds."""
    import subprocess

    caplog.set_level(logging.INFO, "edgefl")
    state = tmp_path / "aggregator"
    state.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(state)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    f = None
    try:
        f = fleet()
        f.start_all()
        doc = run_config(rounds=4, model={"name": "mlp", "hidden": [256]})   # 77 KB a model
        f.ok({"cmd": "start", "config": doc, "run": "full-1"})
        f.events.wait("round_closed", run="full-1", round=1)
        f.ok({"cmd": "pause", "run": "full-1"})
        filler = str(state / "filler")
        with open(filler, "wb") as out:             # the disk fills up ...
            try:
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            except OSError:
                pass
        os.truncate(filler, max(0, os.path.getsize(filler) - 8 * 4096))  # ... but 32 KB
        f.ok({"cmd": "resume", "run": "full-1"})
        wait_for(lambda: "aggregated but not checkpointed" in caplog.text, timeout=60,
                 what="a checkpoint refused by the full disk")
        time.sleep(1.0)                        # the service has had its say on the run
        runs = {r["id"]: r for r in f.ok({"cmd": "runs"})["runs"]}
        assert runs["full-1"]["state"] == "running", runs["full-1"]
        assert "no space left" in caplog.text.lower()
        if then == "stop":
            held = AggregatorCheckpoint.load(state / "runs" / "full-1" / "state").round
            stopping = f.ok({"cmd": "stop", "run": "full-1"})
            assert stopping["state"] == "stopping", stopping
            ended = wait_state(f, "full-1", "stopped", timeout=60)
            assert 1 <= held < 4 and ended["rounds_done"] == held, (held, ended)
            assert "error" not in ended, ended
            return
        os.unlink(filler)                       # space again
        ended = wait_state(f, "full-1", "finished", timeout=120)
        # tried again: the record says when (ctl watch takes a resumed run's records by it)
        assert ended["started"] < ended["resumed"] <= ended["ended"], ended
        journal = read_journal(state / "runs" / "full-1" / "state" / JOURNAL_FILE)
        assert [r["round"] for r in journal if r.get("event") == "aggregated"] == [1, 2, 3, 4]
        assert f.error is None
    finally:
        if f is not None:
            f.close()                           # nothing writes there any more
        subprocess.run(["umount", str(state)], capture_output=True, timeout=30)
