"""`edgefl dashboard` (edgefl/dashboard/, edgefl/cli/dashboard.py): a live fleet on a real
Mosquitto with the repo's ACL (the aggregator service and two clients as `edgefl` processes,
each with its own account; the dashboard as the operator), watched in headless Chromium
(tests/browser.py); the folding of the topics into the view; the server's refusals; the
command's errors. Nothing waits for a fixed time: every wait polls for what it needs, with a
generous timeout.
"""
from __future__ import annotations

import errno
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest_plugins = ["brokers"]

from browser import Browser, find_chromium    # noqa: E402
from edgefl.cli import main           # noqa: E402
from edgefl.dashboard import DashboardServer, FleetView, is_loopback    # noqa: E402
from edgefl.transport.base import Message    # noqa: E402
from edgefl.transport.topics import Topics    # noqa: E402
from helpers import refused_port, wait_for          # noqa: E402

ROUNDS, EVAL_EVERY = 5, 2           # evaluated: rounds 2, 4 and 5 (every 2nd and the last)
RUN = {"dataset": {"name": "digits"}, "partition": {"name": "iid", "clients": 2},
       "model": {"name": "softmax"}, "strategy": {"name": "fedavg"},
       "train": {"lr": 0.1, "batch_size": 32, "epochs": 1}, "rounds": ROUNDS,
       "eval_every": EVAL_EVERY, "seed": 3}
CLIENTS = ("client-1", "client-2")          # accounts of the mosquitto_acl_server fixture


class Processes:
    """edgefl commands as real processes, each logging to tmp_path/<name>.log; stopped with
    SIGTERM (then killed) at the end."""

    def __init__(self, tmp_path: Path):
        self.tmp, self.procs = tmp_path, {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.tmp / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", *args], cwd=self.tmp,
                                    stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


# ---------------------------------------------------------------------------------------
# the page in a real browser, against a live fleet
# ---------------------------------------------------------------------------------------

DOM = {
    "nodes": """[...document.querySelectorAll('#fleet tbody tr')].map(r => ({
        node: r.dataset.node, online: r.dataset.online,
        model: r.querySelector('.model').textContent}))""",
    "runs": """Object.fromEntries([...document.querySelectorAll('#runs tbody tr')].map(
        r => [r.dataset.run, r.querySelector('.state').textContent]))""",
    "accuracy": "document.querySelectorAll('#chart-accuracy circle.point.accuracy').length",
    "accuracy_rounds": """[...document.querySelectorAll('#chart-accuracy circle.point')]
        .map(c => Number(c.dataset.round))""",
    "train_loss": "document.querySelectorAll('#chart-loss circle.point.train-loss').length",
    "test_loss": "document.querySelectorAll('#chart-loss circle.point.test-loss').length",
    "events": "[...document.querySelectorAll('#events li')].map(li => li.dataset.event)",
    "link": "document.getElementById('link').dataset.state",
    "curve_run": "document.getElementById('curves-section').dataset.run",
}


def _accounts_and_sites(tmp_path, server):
    """account(user): the broker section of `user`'s account on the ACL `server` (its
    password in a file in tmp_path); site(name, doc): a site file tmp_path/<name>.yaml with
    that account and `doc`, returning its path."""
    def account(user: str) -> dict:
        path = tmp_path / f"{user}.pw"
        path.write_text(server.users[user] + "\n")
        return {"url": server.url, "username": user, "password_file": str(path)}

    def site(name: str, doc: dict) -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"profile": "generic-x86", "log": {"level": "info"},
                                        "broker": account(name), **doc}))
        return str(path)

    return account, site


@pytest.mark.skipif(find_chromium() is None, reason="chromium is not installed (Debian "
                    "package chromium): the dashboard's browser test needs a real browser")
def test_dashboard_follows_a_live_run_in_a_real_browser(tmp_path, mosquitto_acl_server):
    server = mosquitto_acl_server
    fed = f"dash-{os.urandom(4).hex()}"
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(RUN))
    run2_file = tmp_path / "run2.yaml"            # 3 rounds, every one evaluated
    run2_file.write_text(yaml.safe_dump({**RUN, "rounds": 3, "eval_every": 1}))

    account, site = _accounts_and_sites(tmp_path, server)

    agg_site = site("aggregator", {"node": {"id": "aggregator", "federation": fed},
                                   "state_dir": str(tmp_path / "agg-state"),
                                   # a round waits for every client: the run stays running
                                   # until the test starts the second one
                                   "round": {"deadline": 600.0, "quorum": 1.0},
                                   "clients": list(CLIENTS)})
    client_sites = {c: site(c, {"node": {"id": c, "federation": fed},
                                "state_dir": str(tmp_path / f"{c}-state")}) for c in CLIENTS}
    operator = ["--username", "operator", "--password-file", account("operator")["password_file"],
                "--federation", fed]
    procs = Processes(tmp_path)
    try:
        procs.start("aggregator", "aggregator", "--config", agg_site)
        procs.start("client-1", "client", "--config", client_sites["client-1"],
                    "--partition", str(run_file), "--shard", "0")
        procs.start("dashboard", "dashboard", "--broker", server.url.split("://")[1],
                    "--port", "0", *operator)
        line = wait_for(lambda: next((ln for ln in procs.log("dashboard").splitlines()
                                      if "(read-only)" in ln), None), 60, "the dashboard's URL")
        url = line.split()[2]
        assert url.startswith("http://127.0.0.1:"), line

        with Browser(tmp_path) as browser:
            page = browser.open(url)

            def dom(key):
                return page.evaluate(DOM[key])

            # the fleet: the aggregator service and the first board, online
            def online():
                nodes = {n["node"]: n for n in dom("nodes")}
                return {"aggregator", "client-1"} <= {k for k, n in nodes.items()
                                                      if n["online"] == "true"} and nodes
            nodes = wait_for(online, 60, "aggregator and client-1 online in the fleet table")
            assert "client-2" not in nodes, nodes
            assert dom("link") == "live"

            # a run started by the operator: round 1 waits for client-2, so it is running
            def ctl(*args):
                done = subprocess.run([sys.executable, "-m", "edgefl.cli", "ctl", *args,
                                       "--broker", server.url, *operator], cwd=tmp_path,
                                      capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, done.stderr

            def state_of(run, state):
                return lambda: dom("runs").get(run) == state

            # a run started by the operator: round 1 waits for client-2, so it stays running
            ctl("start", str(run_file), "--run", "dash-run")
            wait_for(state_of("dash-run", "running"), 60, "run dash-run shown as running")
            wait_for(lambda: "round_opened" in dom("events"), 60, "round 1 opened in the events")
            assert dom("accuracy") == 0 and dom("train_loss") == 0   # no round has closed
            assert dom("curve_run") == "dash-run"
            ctl("pause")
            wait_for(state_of("dash-run", "paused"), 60, "run dash-run shown as paused")
            ctl("resume")
            wait_for(state_of("dash-run", "running"), 60, "run dash-run running again")
            # a second run waits in the queue behind the active one
            ctl("start", str(run2_file), "--run", "dash-run-2")
            wait_for(state_of("dash-run-2", "queued"), 60, "run dash-run-2 shown as queued")
            assert dom("curve_run") == "dash-run"            # the active run's curves
            page.screenshot(tmp_path / "dashboard-running.png")

            # the second board comes: both runs go through their rounds and finish
            procs.start("client-2", "client", "--config", client_sites["client-2"],
                        "--partition", str(run_file), "--shard", "1")
            for run in ("dash-run", "dash-run-2"):
                wait_for(state_of(run, "finished"), 180, f"run {run} shown as finished")

            def evaluated(run):
                metrics = tmp_path / "agg-state" / "runs" / run / "metrics.jsonl"
                rounds = [json.loads(line) for line in metrics.read_text().splitlines()]
                return len(rounds), [r["round"] for r in rounds
                                     if r["test_accuracy"] is not None]

            # by default the curves of the run that ended last; a click on a run's row
            # shows its own. One point per evaluated round on the accuracy and test loss
            # curves, one per round on the train loss curve.
            for run, click in (("dash-run-2", False), ("dash-run", True)):
                if click:
                    page.evaluate(f"document.querySelector('#runs tr[data-run=\"{run}\"]')"
                                  ".click()")
                rounds, points = evaluated(run)
                assert (rounds, points) == {"dash-run": (ROUNDS, [2, 4, 5]),
                                            "dash-run-2": (3, [1, 2, 3])}[run]
                wait_for(lambda: dom("curve_run") == run and dom("accuracy") == len(points),
                         30, f"{len(points)} accuracy points of {run} (got {dom('accuracy')} "
                         f"of {dom('curve_run')})")
                assert sorted(dom("accuracy_rounds")) == points
                assert dom("test_loss") == len(points) and dom("train_loss") == rounds
            assert {"run_queued", "run_started", "run_paused", "run_continued", "round_closed",
                    "run_finished"} <= set(dom("events"))
            # every board installed the last run's final ONNX model, and its status says so
            wait_for(lambda: {n["node"] for n in dom("nodes")} >= set(CLIENTS)
                     and all("round 3" in n["model"] for n in dom("nodes")
                             if n["node"] in CLIENTS), 60,
                     "both clients showing the model of round 3 installed")
            assert page.errors == [], page.errors
            shot = page.screenshot(tmp_path / "dashboard.png")
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20000
    finally:
        procs.stop_all()
    assert "edgefl dashboard: stopped" in procs.log("dashboard"), procs.log("dashboard")[-2000:]


@pytest.mark.skipif(find_chromium() is None, reason="chromium is not installed (Debian "
                    "package chromium): the dashboard's browser test needs a real browser")
def test_a_page_opened_during_a_paused_run_shows_its_progress(tmp_path, mosquitto_acl_server):
    """A dashboard started (or restarted) while a run is paused saw none of its rounds close:
    its row comes from the run's retained record alone, which said nothing of the rounds done,
    so the page showed 0/ROUNDS and no accuracy (and `ctl runs` -/ROUNDS) for as long as the
    pause lasted. Both must show what metrics.jsonl and `ctl status` say."""
    server = mosquitto_acl_server
    fed = f"dash-{os.urandom(4).hex()}"
    rounds = 1000
    run_file = tmp_path / "long.yaml"
    run_file.write_text(yaml.safe_dump({**RUN, "rounds": rounds, "eval_every": 1}))

    account, site = _accounts_and_sites(tmp_path, server)

    agg_site = site("aggregator", {"node": {"id": "aggregator", "federation": fed},
                                   "state_dir": str(tmp_path / "agg-state"),
                                   "clients": list(CLIENTS)})
    operator = ["--username", "operator", "--password-file", account("operator")["password_file"],
                "--federation", fed]

    def ctl(*args) -> str:
        done = subprocess.run([sys.executable, "-m", "edgefl.cli", "ctl", *args,
                               "--broker", server.url, *operator], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    metrics = tmp_path / "agg-state" / "runs" / "long" / "metrics.jsonl"

    def history():
        return [json.loads(line) for line in metrics.read_text().splitlines()] \
            if metrics.exists() else []

    procs = Processes(tmp_path)
    try:
        procs.start("aggregator", "aggregator", "--config", agg_site)
        for shard, c in enumerate(CLIENTS):
            procs.start(c, "client", "--config",
                        site(c, {"node": {"id": c, "federation": fed},
                                 "state_dir": str(tmp_path / f"{c}-state")}),
                        "--partition", str(run_file), "--shard", str(shard))
        ctl("start", str(run_file), "--run", "long")
        wait_for(lambda: len(history()) >= 3, 120, "3 rounds of run long")
        ctl("pause")
        done = len(history())
        accuracy = history()[-1]["test_accuracy"]
        assert f"{done} of {rounds} rounds done" in ctl("status") or \
            f"round {done + 1} of {rounds} open" in ctl("status")

        table = ctl("runs")
        row = next(line for line in table.splitlines() if line.startswith("long "))
        assert row.split()[2:] == [f"{done}/{rounds}", f"{accuracy:.4f}"], table

        procs.start("dashboard", "dashboard", "--broker", server.url.split("://")[1],
                    "--port", "0", *operator)
        line = wait_for(lambda: next((ln for ln in procs.log("dashboard").splitlines()
                                      if "(read-only)" in ln), None), 60, "the dashboard's URL")
        with Browser(tmp_path) as browser:
            page = browser.open(line.split()[2])
            cells = ("[...document.querySelectorAll('#runs tr[data-run=\"long\"] td')]"
                     ".map(c => c.textContent)")
            wait_for(lambda: (page.evaluate(cells) or [None, None])[1] == "paused", 60,
                     "run long shown as paused")
            assert page.evaluate(cells)[2:4] == [f"{done}/{rounds}", f"{accuracy:.4f}"]
            assert len(history()) == done                   # still paused: nothing moved
            assert page.errors == [], page.errors
    finally:
        procs.stop_all()


# ---------------------------------------------------------------------------------------
# the command's errors
# ---------------------------------------------------------------------------------------

def test_unreachable_broker_is_named(capsys):
    port = refused_port()               # nothing listens there
    assert main(["dashboard", "--broker", f"127.0.0.1:{port}", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach MQTT broker 127.0.0.1:{port}" in err, err


def test_port_in_use_is_named(capsys, mosquitto_server):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        assert main(["dashboard", "--broker", mosquitto_server.url, "--port", str(port)]) == 1
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err and "--port" in err, err


def test_a_non_loopback_host_warns(capsys):
    # the warning comes before the broker is tried (here: unreachable)
    assert main(["dashboard", "--host", "0.0.0.0", "--port", "0",
                 "--broker", f"127.0.0.1:{refused_port()}"]) == 1
    err = capsys.readouterr().err
    assert "warning: serving on 0.0.0.0" in err and "ssh -L" in err, err
    assert "cannot reach MQTT broker" in err


def test_a_site_files_own_account_is_not_used(tmp_path, capsys):
    site = tmp_path / "aggregator.yaml"
    site.write_text(yaml.safe_dump({"node": {"id": "aggregator"},
                                    "broker": {"url": "mqtt://127.0.0.1:1",
                                               "username": "aggregator"}}))
    assert main(["dashboard", "--config", str(site), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "read the run records" in err and "--username operator" in err, err


# ---------------------------------------------------------------------------------------
# the server: read-only, loopback names only, its assets
# ---------------------------------------------------------------------------------------

def _request(port, method="GET", path="/", host=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Host": host} if host else {}
    conn.request(method, path, headers=headers)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response, body


def test_server_is_read_only_and_answers_only_to_loopback_names():
    view = FleetView(Topics("lab"), broker="127.0.0.1:1883")
    with DashboardServer(view, "127.0.0.1", 0) as server:
        response, body = _request(server.port)
        assert response.status == 200 and b"/dashboard.js" in body
        assert "default-src 'self'" in response.getheader("Content-Security-Policy")
        for path, kind in (("/dashboard.js", "javascript"), ("/dashboard.css", "css"),
                           ("/state", "json")):
            response, body = _request(server.port, path=path)
            assert response.status == 200 and kind in response.getheader("Content-Type")
        assert json.loads(_request(server.port, path="/state")[1])["broker"]["federation"] \
            == "lab"
        for method in ("POST", "PUT", "DELETE"):
            response, body = _request(server.port, method, "/state")
            assert response.status == 405 and b"read-only" in body
        response, body = _request(server.port, host="attacker.example:8765")
        assert response.status == 421 and b"attacker.example" in body
        for host in ("localhost:8765", "127.0.0.1", "[::1]:8765"):
            assert _request(server.port, host=host)[0].status == 200, host
        assert _request(server.port, path="/../../etc/passwd")[0].status == 404


def test_port_in_use_error_from_the_server():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as exc:
            DashboardServer(FleetView(Topics("lab")), "127.0.0.1", port)
    assert exc.value.errno == errno.EADDRINUSE and f"port {port}" in str(exc.value)


def test_loopback_names():
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com", "localhost.example.com"):
        assert not is_loopback(host), host


# ---------------------------------------------------------------------------------------
# the view: what the topics become
# ---------------------------------------------------------------------------------------

def _message(topics, kind, node=None, doc=None, retain=False, raw=None):
    topic = topics.topic(kind, node) if node is not None else topics.topic(kind)
    payload = raw if raw is not None else json.dumps(doc).encode()
    return Message(topic, payload, retain=retain, received_at=time.time())


def test_view_folds_status_records_and_events():
    topics = Topics("lab")
    view = FleetView(topics)
    listener, first = view.listen()
    assert first["nodes"] == [] and first["runs"] == []
    view.apply(_message(topics, "status", "pi-1", {"node": "pi-1", "online": True,
                                                   "role": "client", "at": 100.0,
                                                   "onnx_sha256": "ab" * 32, "onnx_round": 3},
                        retain=True))
    assert view.nodes["pi-1"]["seen"] == 100.0       # retained: when it was published
    # a status naming another node, a payload that is not JSON: ignored and counted
    view.apply(_message(topics, "status", "pi-2", {"node": "pi-9", "online": True}))
    view.apply(_message(topics, "events", raw=b"{not json"))
    assert set(view.nodes) == {"pi-1"} and view.ignored == 2

    # a run seen only in its events (no service record) takes its state from them
    view.apply(_message(topics, "events", doc={"event": "run_started", "run": "r1",
                                               "at": 5.0}))
    for r, acc in ((1, None), (2, 0.8)):
        view.apply(_message(topics, "events", doc={
            "event": "round_closed", "run": "r1", "round": r, "test_accuracy": acc,
            "test_loss": None if acc is None else 0.5, "train_loss": 1.0 / r}))
    assert view.runs["r1"]["state"] == "running" and view.runs["r1"]["rounds_done"] == 2
    assert [p["test_accuracy"] for p in view.snapshot()["points"]["r1"]] == [None, 0.8]
    view.apply(_message(topics, "events", doc={"event": "run_finished", "run": "r1",
                                               "rounds": 2}))
    assert view.runs["r1"]["state"] == "finished"
    # a late event from another connection does not restart an ended run
    view.apply(_message(topics, "events", doc={"event": "run_resumed", "run": "r1"}))
    assert view.runs["r1"]["state"] == "finished"

    # the service's record is the word on the state
    view.apply(_message(topics, "runs", "r2", {"id": "r2", "state": "queued", "rounds": 4},
                        retain=True))
    view.apply(_message(topics, "events", doc={"event": "run_started", "run": "r2"}))
    assert view.runs["r2"]["state"] == "queued"
    view.apply(_message(topics, "runs", "r2", {"id": "r2", "state": "running", "rounds": 4}))
    assert view.runs["r2"]["state"] == "running"
    view.apply(_message(topics, "runs", "r3", {"id": "other", "state": "running"}))
    assert "r3" not in view.runs and view.ignored == 3

    # cleared retained topics remove their row
    view.apply(_message(topics, "status", "pi-1", raw=b""))
    view.apply(_message(topics, "runs", "r2", raw=b""))
    assert "pi-1" not in view.nodes and "r2" not in view.runs

    changes = []
    while not listener.queue.empty():
        changes.append(listener.queue.get_nowait()[0])
    assert changes.count("point") == 2 and "node_gone" in changes and "run_gone" in changes
    view.unlisten(listener)



@pytest.mark.parametrize("bad", [2 ** 53, 2 ** 60, 0, -3, True])
def test_a_round_the_page_cannot_count_to_is_no_point_on_its_curves(bad):
    """The page walks the rounds between two points to find the ones it never saw close;
    past 2**53 a JavaScript number's r++ leaves r as it is, and that walk never ended (the
    operator's tab hung). Only the aggregator publishes events, but it is a message like
    any other: a round_closed event's round must be a whole number from 1 to 2**53 - 1 to
    become a point or move the run's progress; the event itself is still listed."""
    topics = Topics("lab")
    view = FleetView(topics)
    view.apply(_message(topics, "events", doc={"event": "round_closed", "run": "r1",
                                               "round": 2, "test_accuracy": 0.5}))
    view.apply(_message(topics, "events", doc={"event": "round_closed", "run": "r1",
                                               "round": bad, "test_accuracy": 0.6}))
    assert [p["round"] for p in view.snapshot()["points"]["r1"]] == [2]
    assert view.runs["r1"]["rounds_done"] == 2
    assert len(view.events) == 2

def test_event_stream_starts_with_a_snapshot_then_sends_each_change():
    topics = Topics("lab")
    view = FleetView(topics, broker="127.0.0.1:1883")
    with DashboardServer(view, "127.0.0.1", 0) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/events")
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type") == "text/event-stream"

        def next_event():
            fields = {}
            while True:
                line = response.fp.readline().decode().rstrip("\n")
                if not line:
                    if "event" in fields:
                        return fields["event"], json.loads(fields["data"])
                    continue
                key, _, value = line.partition(": ")
                fields[key] = value

        kind, snapshot = next_event()
        assert kind == "snapshot" and snapshot["nodes"] == [] and not snapshot["broker"][
            "connected"]
        view.apply(_message(topics, "status", "pi-1", {"node": "pi-1", "online": True}))
        kind, doc = next_event()
        assert kind == "node" and doc["node"] == "pi-1" and doc["online"] is True
        from edgefl.transport.base import ConnectionEvent
        view.apply(ConnectionEvent("disconnected", "broker restarted"))
        kind, doc = next_event()
        assert kind == "broker" and doc["connected"] is False and doc["reason"] == \
            "broker restarted"
        conn.close()


def test_a_page_that_stops_reading_is_dropped_past_a_byte_bound_not_only_a_count():
    """Each open page's queue of changes was bounded by count alone: 2,000 changes, and a
    board's status may be 64 KiB, so one page that stopped reading (a stalled browser, a
    laptop lid closed) kept about 128 MB alive. Past LISTENER_BACKLOG_BYTES it is dropped
    as past the count: its queue is freed, its stream ends, and its browser reconnects to a
    fresh snapshot, which has the latest state."""
    topics = Topics("lab")
    view = FleetView(topics, broker="127.0.0.1:1883")
    with DashboardServer(view, "127.0.0.1", 0) as server:
        page = socket.socket()
        # little kernel buffering on the page's side: what it does not read stays queued
        page.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
        page.settimeout(10)
        page.connect(("127.0.0.1", server.port))
        page.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        wait_for(lambda: len(view._listeners) == 1, 10, "the page's stream to open")
        changes = 300           # of 60 KB: 18 MB, far past the byte bound, far below 2,000
        for i in range(changes):
            view.apply(_message(topics, "status", "pi-1", {
                "node": "pi-1", "online": True, "last_round": i, "version": "x" * 60_000}))
        received, ended = b"", False
        try:
            while True:
                piece = page.recv(1 << 20)
                if not piece:
                    ended = True
                    break
                received += piece
        except TimeoutError:
            pass                # the stream stayed open
        finally:
            page.close()
        got = received.count(b"event: node\n")
        assert ended and got < changes, f"stream ended: {ended}; {got} of {changes} changes"
        assert not view._listeners                     # the page's queue is gone
        response, body = _request(server.port, path="/state")
        assert json.loads(body)["nodes"][0]["last_round"] == changes - 1


def test_server_on_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        server = DashboardServer(FleetView(Topics("lab")), "::1", 0)
    except OSError as exc:
        pytest.skip(f"cannot listen on ::1 here: {exc}")
    with server:
        assert server.url.startswith("http://[::1]:")
        conn = http.client.HTTPConnection("::1", server.port, timeout=10)
        conn.request("GET", "/state")
        assert conn.getresponse().status == 200
        conn.close()


@pytest.mark.skipif(find_chromium() is None, reason="chromium is not installed (Debian "
                    "package chromium)")
def test_the_browser_starts_from_a_process_with_few_files_open(tmp_path):
    # tests/browser.py hands the browser its pipe as fds 3 and 4; in a process with no other
    # files open the pipe's own ends were 3 and 4, and the redirects closed one of them
    # ("Remote debugging pipe file descriptors are not open"): any script outside pytest
    probe = ("import os, sys\n"
             "os.closerange(3, 256)\n"
             f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
             "from pathlib import Path\n"
             "from browser import Browser\n"
             "b = Browser(Path(sys.argv[1]))\n"
             "print(b.open('about:blank').evaluate('6 * 7'))\n"
             "b.close()\n")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == "42", done.stdout + done.stderr


@pytest.mark.skipif(find_chromium() is None, reason="chromium is not installed (Debian "
                    "package chromium)")
def test_curves_leave_a_gap_for_rounds_the_page_never_saw_close(tmp_path):
    """After a broker outage the page has no round_closed event for the rounds that closed
    meanwhile (events are not retained): their curves were one straight line across the
    gap, drawn as if measured. Each stretch of rounds seen closing is a line of its own; a
    run evaluated every other round, every round seen, is still one line."""
    topics = Topics("lab")
    for rounds, evaluated, lines in ((list(range(1, 4)) + list(range(7, 10)), None, 2),
                                     (list(range(1, 7)), {2, 4, 6}, 1)):
        view = FleetView(topics, broker="127.0.0.1:1883")
        view.apply(_message(topics, "runs", "r1", {"id": "r1", "state": "running",
                                                   "rounds": 9}, retain=True))
        for r in rounds:
            acc = 0.5 + r / 100 if evaluated is None or r in evaluated else None
            view.apply(_message(topics, "events", doc={
                "event": "round_closed", "run": "r1", "round": r, "test_accuracy": acc,
                "test_loss": None if acc is None else 1.0 - acc, "train_loss": 1.0 / r}))
        with DashboardServer(view, "127.0.0.1", 0) as server, Browser(tmp_path) as browser:
            page = browser.open(f"http://127.0.0.1:{server.port}/")
            n_points = len([r for r in rounds if evaluated is None or r in evaluated])
            wait_for(lambda: page.evaluate(DOM["accuracy"]) == n_points, timeout=30,
                     what="the accuracy points")
            assert page.evaluate(
                "document.querySelectorAll('#chart-accuracy polyline.line').length") == lines
            assert page.evaluate(
                "document.querySelectorAll('#chart-loss polyline.line').length") == lines


# ---------------------------------------------------------------------------------------
# a hostile board: what it publishes on its own topics, within the broker's ACL
# ---------------------------------------------------------------------------------------

def _board(server, user: str):
    """A connected transport logged in as board `user` of the ACL broker `server`: it may
    publish only its own status, update, metrics and secure topics (broker/acl)."""
    import uuid

    from edgefl.transport.mqtt import MqttTransport
    t = MqttTransport(server.url, f"{user}-{uuid.uuid4().hex[:6]}", username=user,
                      password=server.users[user], clean_session=True, connect_timeout=10)
    t.connect()
    return t


def _nested_status(node: str, depth: int) -> bytes:
    return (json.dumps({"node": node, "online": True})[:-1] + ', "x": '
            + "[" * depth + "]" * depth + "}").encode()


def test_a_boards_status_nested_too_deep_neither_stops_the_feed_nor_breaks_the_page(
        mosquitto_acl_server):
    """A board's status is JSON it chooses. Nested 2,000 deep it raised RecursionError
    (not a ValueError) out of the dashboard's feed thread: the page stopped following the
    fleet for good, and, retained, on every restart too. Nested 990 deep it parsed, and
    then every /state and every page's first snapshot failed (the encoder's recursion in
    the server's thread): one board blanked the page. Both are now refused as that board's
    unreadable status, named and counted, and the page keeps the rest of the fleet."""
    import uuid

    from edgefl.dashboard import Dashboard
    topics = Topics(f"dash-{uuid.uuid4().hex[:8]}")
    board1 = _board(mosquitto_acl_server, "client-1")
    board2 = _board(mosquitto_acl_server, "client-2")
    try:
        with Dashboard(mosquitto_acl_server.url, topics.federation, port=0,
                       username="operator",
                       password=mosquitto_acl_server.users["operator"]) as dashboard:
            def state():
                response, body = _request(dashboard.port, path="/state")
                assert response.status == 200, (response.status, body[:200])
                return json.loads(body)

            for i, depth in enumerate((2000, 990)):
                board1.publish(topics.status("client-1"), _nested_status("client-1", depth),
                               qos=1, retain=True).wait(10)
                board2.publish(topics.status("client-2"), json.dumps(
                    {"node": "client-2", "online": True, "last_round": i}).encode(),
                               qos=1, retain=True).wait(10)
                # client-2's status comes after client-1's: the feed went past it
                wait_for(lambda: any(n.get("last_round") == i for n in state()["nodes"]),
                         timeout=30, what=f"client-2's status after a status {depth} deep")
                assert [n["node"] for n in state()["nodes"]] == ["client-2"]
                assert dashboard._feed_thread.is_alive()
            assert state()["ignored"] == 2
    finally:
        for board, node in ((board1, "client-1"), (board2, "client-2")):
            board.publish(topics.status(node), b"", qos=1, retain=True).wait(10)
            board.close(timeout=1, announce_offline=False)


@pytest.mark.parametrize("bad", ["3", [3], {"n": 3}, True, 2.5])
def test_a_run_record_whose_rounds_done_is_no_whole_number_leaves_the_feed_running(
        mosquitto_acl_server, bad):
    """A run record is retained: one whose rounds_done is not a whole number (an
    aggregator of another version, a record written by hand) raised TypeError out of the
    dashboard's feed thread, on comparing it with the rounds seen, and the page, still
    showing "connected", followed nothing more; retained, the same on every restart. It is
    refused as that run's unreadable record, named and counted, and the feed goes on."""
    import uuid

    from edgefl.dashboard import Dashboard
    topics = Topics(f"dash-{uuid.uuid4().hex[:8]}")
    agg = _board(mosquitto_acl_server, "aggregator")
    try:
        agg.publish(topics.run_record("r1"), json.dumps(
            {"id": "r1", "state": "running", "rounds_done": bad}).encode(), qos=1,
                    retain=True).wait(10)
        with Dashboard(mosquitto_acl_server.url, topics.federation, port=0,
                       username="operator",
                       password=mosquitto_acl_server.users["operator"]) as dashboard:
            agg.publish(topics.run_record("r2"), json.dumps(
                {"id": "r2", "state": "finished", "rounds_done": 4}).encode(), qos=1,
                        retain=True).wait(10)
            wait_for(lambda: "r2" in dashboard.view.runs, timeout=30,
                     what="run r2's record after r1's")
            assert dashboard._feed_thread.is_alive()
            assert "r1" not in dashboard.view.runs and dashboard.view.ignored == 1
            assert dashboard.view.runs["r2"]["rounds_done"] == 4
    finally:
        for run in ("r1", "r2"):
            agg.publish(topics.run_record(run), b"", qos=1, retain=True).wait(10)
        agg.close(timeout=1, announce_offline=False)


XSS = ['<img src=x onerror="window.__pwned=1">', "<script>window.__pwned=2</script>",
       '"><svg onload="window.__pwned=3">', "javascript:window.__pwned=4"]


@pytest.mark.skipif(find_chromium() is None, reason="chromium is not installed (Debian "
                    "package chromium)")
def test_a_hostile_boards_status_is_shown_as_text_and_cannot_freeze_the_page(
        tmp_path, mosquitto_acl_server):
    """A board in hostile hands publishes, on its own status topic (all the broker's ACL
    lets it), markup in every field the page shows and a field of the wrong type. The page
    must show the markup as text (no element made, no script run) and keep rendering the
    rest of the fleet: `onnx_sha256` as a number made renderFleet throw (`.slice` of a
    number) on every render, so the page stopped updating at that board's row: no other
    board, no run, no event was drawn again while its status stayed retained."""
    import uuid

    from edgefl.dashboard import Dashboard
    topics = Topics(f"dash-{uuid.uuid4().hex[:8]}")
    board1 = _board(mosquitto_acl_server, "client-1")
    board2 = _board(mosquitto_acl_server, "client-2")
    hostile = {"node": "client-1", "online": True, "role": XSS[0], "profile": XSS[1],
               "version": XSS[2], "run": XSS[3], "last_round": XSS[0],
               "onnx_sha256": 123456789012345, "onnx_round": XSS[1],
               "refused": {"run": XSS[2], "reason": XSS[0]}}
    try:
        board1.publish(topics.status("client-1"), json.dumps(hostile).encode(), qos=1,
                       retain=True).wait(10)
        with Dashboard(mosquitto_acl_server.url, topics.federation, port=0,
                       username="operator",
                       password=mosquitto_acl_server.users["operator"]) as dashboard, \
                Browser(tmp_path) as browser:
            page = browser.open(dashboard.url)
            wait_for(lambda: page.evaluate("document.body && document.body.dataset.ready")
                     == "true", 60, "the page's first render")
            # a board that comes online after the hostile one: the page must still draw it
            board2.publish(topics.status("client-2"), json.dumps(
                {"node": "client-2", "online": True, "version": "0.1.0"}).encode(), qos=1,
                retain=True).wait(10)
            rows = "[...document.querySelectorAll('#fleet tbody tr')].map(r => r.dataset.node)"
            try:
                wait_for(lambda: page.evaluate(rows) == ["client-1", "client-2"], 30,
                         "both boards' rows")
            except pytest.fail.Exception:
                pytest.fail(f"the rows are {page.evaluate(rows)}; the page's errors: "
                            f"{page.errors}")
            cells = page.evaluate("[...document.querySelectorAll('#fleet tr[data-node="
                                  "\"client-1\"] td')].map(c => c.textContent)")
            page.screenshot(tmp_path / "hostile.png")
            assert cells[1] == XSS[0] and cells[3] == XSS[1] and cells[4] == XSS[2], cells
            assert XSS[0] in cells[-1] and XSS[2] in cells[-1], cells
            assert page.evaluate("document.querySelectorAll('main img, main script, "
                                 "main svg:not([id^=chart])').length") == 0
            assert page.evaluate("typeof window.__pwned") == "undefined"
            assert page.errors == [], page.errors
    finally:
        for board, node in ((board1, "client-1"), (board2, "client-2")):
            board.publish(topics.status(node), b"", qos=1, retain=True).wait(10)
            board.close(timeout=1, announce_offline=False)


def test_a_boards_status_past_the_status_size_limit_is_refused_by_name(mosquitto_acl_server,
                                                                       caplog):
    """A status is a few hundred bytes, but a board's was read up to the 4 MiB of any JSON
    message: kept in the view, sent in every page's snapshot, and queued once per change
    for each open page (up to LISTENER_BACKLOG changes: 2,000 x 4 MiB for one slow page),
    parsed again by the aggregator each time. Past MAX_STATUS_BYTES it is that board's
    unreadable status, named with its size and the limit."""
    import logging
    import uuid

    from edgefl.dashboard import Dashboard
    from edgefl.roles.messages import MAX_STATUS_BYTES
    topics = Topics(f"dash-{uuid.uuid4().hex[:8]}")
    board1 = _board(mosquitto_acl_server, "client-1")
    board2 = _board(mosquitto_acl_server, "client-2")
    head = json.dumps({"node": "client-1", "online": True, "version": ""}).encode()
    big = head[:-2] + b"x" * (MAX_STATUS_BYTES + 1 - len(head)) + b'"}'
    assert len(big) == MAX_STATUS_BYTES + 1
    try:
        with caplog.at_level(logging.WARNING, logger="edgefl.dashboard"), \
                Dashboard(mosquitto_acl_server.url, topics.federation, port=0,
                          username="operator",
                          password=mosquitto_acl_server.users["operator"]) as dashboard:
            board1.publish(topics.status("client-1"), big, qos=1, retain=True).wait(10)
            board2.publish(topics.status("client-2"), json.dumps(
                {"node": "client-2", "online": True}).encode(), qos=1, retain=True).wait(10)
            wait_for(lambda: "client-2" in dashboard.view.nodes, 30, "client-2's status")
            assert "client-1" not in dashboard.view.nodes and dashboard.view.ignored == 1
        assert f"{MAX_STATUS_BYTES + 1} bytes" in caplog.text and "client-1" in caplog.text
    finally:
        for board, node in ((board1, "client-1"), (board2, "client-2")):
            board.publish(topics.status(node), b"", qos=1, retain=True).wait(10)
            board.close(timeout=1, announce_offline=False)


def test_a_slow_request_neither_holds_a_thread_for_good_nor_delays_other_pages():
    """Slowloris: connections that send half a request and then nothing. Each held one of
    the server's threads for as long as the peer kept the socket open (forever); other
    pages were still served, but every such connection was a thread for good. A request
    must be complete within the server's request timeout, or its connection is closed."""
    view = FleetView(Topics("lab"), broker="127.0.0.1:1883")
    with DashboardServer(view, "127.0.0.1", 0, request_timeout=1.0) as server:
        slow = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
                for _ in range(20)]
        try:
            for s in slow:
                s.sendall(b"GET /state HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            started = time.monotonic()
            assert _request(server.port, path="/state")[0].status == 200
            assert time.monotonic() - started < 5
            for s in slow:          # closed by the server: recv sees the end, not a timeout
                assert s.recv(1024) == b""
        finally:
            for s in slow:
                s.close()


def test_a_page_that_keeps_up_takes_a_change_larger_than_its_byte_bound():
    """The byte bound drops a page that stopped reading, not one that keeps up: JSON's
    escapes can make an event within the 4 MiB input limit three times that on the page
    (each non-ASCII character a \\uXXXX), past the 8 MiB bound alone. Into an empty queue
    a change always goes; behind another one past the bound, the page is dropped."""
    from edgefl.dashboard.view import Listener, page_json

    big = page_json({"event": "run_failed", "error": "\u00e9" * 1_000_000})
    listener = Listener(backlog_bytes=len(big) - 1)
    listener.put("event", big)
    assert not listener.overflowed and listener.get(1.0) == ("event", big)
    listener.put("event", big)
    listener.put("event", big)
    assert listener.overflowed
