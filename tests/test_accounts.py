"""Broker accounts bound to client ids (edgefl.service.accounts, `edgefl broker accounts`),
against a real Mosquitto with the dynamic security plugin loading the generated state.

The attack (issue 16): with one board's credentials, connect under the aggregator's client
id (or the control connection's, or another board's). Without a binding, Mosquitto closes
the older connection, and a clean-session connect wipes the aggregator's persistent session
with the QoS 1 updates queued for it. With the generated accounts the connection is refused
before the session is touched. `test_an_unbound_account_can_take_a_session_over` shows the
same steps do wipe a session for the one unbound account (the operator), so the refusal
tests would catch a binding that went missing.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
pytest.register_assert_rewrite("brokers")

from brokers import ServerProcess, messages_within, next_message, wait_event  # noqa: E402
from helpers import usage_error  # noqa: E402
from edgefl.fleet import mosquitto_conf  # noqa: E402
from edgefl.service.accounts import (dynsec_state, federation_accounts,  # noqa: E402
                                     find_dynsec_plugin, hash_password, write_accounts)
from edgefl.transport.base import ConnectionEvent, TransportError  # noqa: E402
from edgefl.transport.broker import find_mosquitto  # noqa: E402
from edgefl.transport.mqtt import MqttTransport  # noqa: E402

FED = "lab"
CLIENTS = ["client-1", "client-2"]


class DynsecMosquitto(ServerProcess):
    """Mosquitto with the fleet's config: the generated accounts, one plain listener."""

    name = "mosquitto"

    def __init__(self, workdir: Path):
        super().__init__(workdir)
        self.accounts = federation_accounts(FED, CLIENTS)
        write_accounts(self.accounts, str(self.workdir))
        self.conf = self.workdir / "broker" / "mosquitto.conf"
        self.conf.write_text(mosquitto_conf(self.port, find_dynsec_plugin(),
                                            as_root=os.geteuid() == 0))

    def command(self):
        return [find_mosquitto(), "-c", str(self.conf)]

    def start(self):
        cwd = os.getcwd()
        os.chdir(self.workdir / "broker")      # the config's paths are relative to it
        try:
            super().start()
        finally:
            os.chdir(cwd)

    def password_file(self, username: str) -> str:
        return str(self.workdir / "credentials" / f"{username}.pw")

    def transport(self, username: str, client_id: str | None = None, **options):
        options.setdefault("clean_session", True)
        return MqttTransport(self.url, client_id or username, username=username,
                             password_file=self.password_file(username), reconnect_min=0.05,
                             reconnect_max=0.5, connect_timeout=5.0, **options)


@pytest.fixture
def broker(tmp_path):
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    if find_dynsec_plugin() is None:
        pytest.skip("Mosquitto's dynamic security plugin is not installed (Mosquitto >= 2.0)")
    server = DynsecMosquitto(tmp_path)
    server.start()
    made = []

    def transport(*args, **options):
        t = server.transport(*args, **options)
        made.append(t)
        return t

    server.make = transport
    yield server
    for t in made:
        try:
            t.close(timeout=1.0, announce_offline=False)
        except Exception:           # noqa: BLE001 -- teardown
            t.kill()
    server.stop()


def _events_within(transport, seconds: float) -> list:
    """The ConnectionEvents queued on `transport` within `seconds` (messages skipped)."""
    import time

    deadline = time.monotonic() + seconds
    events = []
    while (remaining := deadline - time.monotonic()) > 0:
        item = transport.receive(remaining)
        if isinstance(item, ConnectionEvent):
            events.append(item)
    return events


def _aggregator_session(broker):
    """The aggregator's rounds connection, persistent, subscribed to the updates."""
    agg = broker.make("aggregator", clean_session=False)
    agg.connect()
    agg.subscribe(f"edgefl/{FED}/update/+", qos=1)
    return agg


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
@pytest.mark.parametrize("victim", ["aggregator", "aggregator-ctl", "client-2"])
def test_a_board_cannot_take_another_client_id(broker, victim, protocol):
    agg = _aggregator_session(broker)
    ctl = broker.make("aggregator-ctl")
    ctl.connect()
    other = broker.make("client-2")
    other.connect()
    attacker = broker.make("client-1", victim, protocol=protocol)
    with pytest.raises(TransportError, match=r"refused client .*" + victim):
        attacker.connect()
    # no connection of the victims was closed, and the broker never took one over
    for t in (agg, ctl, other):
        assert t.connected
        assert [e.state for e in _events_within(t, 0.3)] == ["connected"]   # its first only
    assert "already connected, closing old connection" not in broker.log_tail(200)
    # the aggregator's session still delivers: client-1 with its own id is served
    board = broker.make("client-1")
    board.connect()
    board.publish(f"edgefl/{FED}/update/client-1", b"u1", qos=1).wait(5)
    assert next_message(agg).payload == b"u1"


def test_the_aggregators_queued_updates_survive_a_takeover_attempt(broker):
    agg = _aggregator_session(broker)
    agg.close(announce_offline=False)       # offline, its persistent session kept
    board = broker.make("client-1")
    board.connect()
    assert board.publish(f"edgefl/{FED}/update/client-1", b"queued", qos=1).wait(5)
    attacker = broker.make("client-2", "aggregator", clean_session=True)
    with pytest.raises(TransportError, match="Not authorized|not authori"):
        attacker.connect()
    back = broker.make("aggregator", clean_session=False)
    back.connect()
    event = wait_event(back, "connected")
    assert event.session_present, "the broker forgot the aggregator's session"
    assert next_message(back).payload == b"queued"


def test_an_unbound_account_can_take_a_session_over(broker):
    """The control of the tests above: the same steps under the one account with no bound
    client id (the operator's, docs/brokers.md says why) do wipe the queued update."""
    agg = _aggregator_session(broker)
    agg.close(announce_offline=False)
    board = broker.make("client-1")
    board.connect()
    assert board.publish(f"edgefl/{FED}/update/client-1", b"queued", qos=1).wait(5)
    intruder = broker.make("operator", "aggregator", clean_session=True)
    intruder.connect()
    intruder.close(announce_offline=False)
    back = broker.make("aggregator", clean_session=False)
    back.connect()
    assert not wait_event(back, "connected").session_present
    assert messages_within(back, 0.5) == []


def test_each_account_has_its_own_topics_only(broker):
    spy = broker.make("operator", "edgefl-spy")
    spy.connect()
    spy.subscribe(f"edgefl/{FED}/#", qos=1)
    board = broker.make("client-1", protocol="5")
    board.connect()
    for topic in (f"edgefl/{FED}/update/client-2", f"edgefl/{FED}/round",
                  f"edgefl/{FED}/ctl", f"edgefl/{FED}/status/aggregator"):
        board.publish(topic, b"forged", qos=1).wait(5)
    board.publish(f"edgefl/{FED}/update/client-1", b"mine", qos=1).wait(5)
    got = [(m.topic, m.payload) for m in messages_within(spy, 0.5)]
    assert got == [(f"edgefl/{FED}/update/client-1", b"mine")]
    # a board cannot read another's update; the operator's command reaches the aggregator
    with pytest.raises(TransportError, match="refused subscription"):
        board.subscribe(f"edgefl/{FED}/update/client-2", qos=1)
    ctl = broker.make("aggregator-ctl")
    ctl.connect()
    ctl.subscribe(f"edgefl/{FED}/ctl", qos=1)
    op = broker.make("operator", "edgefl-ctl-test")
    op.connect()
    op.publish(f"edgefl/{FED}/ctl", b'{"cmd":"status"}', qos=1).wait(5)
    assert next_message(ctl).payload == b'{"cmd":"status"}'


def test_a_wrong_password_is_refused(broker, tmp_path):
    wrong = tmp_path / "wrong.pw"
    wrong.write_text("not-the-password\n")
    t = MqttTransport(broker.url, "client-1", username="client-1", password_file=str(wrong),
                      clean_session=True, connect_timeout=5.0)
    with pytest.raises(TransportError, match="refused client 'client-1'"):
        t.connect()


# ------------------------------------------------------------------ the generator
def test_hash_password_is_what_the_plugin_checks():
    fields = hash_password("s3cret", salt=b"0123456789ab", iterations=101)
    want = hashlib.pbkdf2_hmac("sha512", b"s3cret", b"0123456789ab", 101)
    assert base64.b64decode(fields["password"]) == want
    assert base64.b64decode(fields["salt"]) == b"0123456789ab"


def test_every_node_account_is_bound_and_only_tools_are_not():
    fed = federation_accounts(FED, CLIENTS)
    state = dynsec_state(fed)
    bound = {c["username"]: c.get("clientid") for c in state["clients"]}
    assert bound == {"aggregator": "aggregator", "aggregator-ctl": "aggregator-ctl",
                     "client-1": "client-1", "client-2": "client-2",
                     "operator": None, "edgefl-admin": None}
    assert len({a.password for a in fed.accounts}) == len(fed.accounts)
    assert not any(a.password in json.dumps(state) for a in fed.accounts)


@pytest.mark.parametrize("clients, match", [
    ([], "at least one client"),
    (["client-1", "client-1"], "appears twice"),
    (["operator"], "appears twice"),
    (["a/b"], "client id"),
])
def test_bad_client_ids_are_refused(clients, match):
    with pytest.raises(ValueError, match=match):
        federation_accounts(FED, clients)


def test_the_command_writes_private_files_and_never_replaces_them(tmp_path):
    out = tmp_path / "acc"
    cmd = [sys.executable, "-m", "edgefl.cli", "broker", "accounts", "--federation", FED,
           "--clients", "3", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "client-3" in done.stdout and "client id client-3" in done.stdout
    state = json.loads((out / "broker" / "dynamic-security.json").read_text())
    assert [c["username"] for c in state["clients"]][2:5] == ["client-1", "client-2",
                                                              "client-3"]
    for path in [out / "broker" / "dynamic-security.json",
                 *sorted((out / "credentials").iterdir())]:
        assert path.stat().st_mode & 0o777 == 0o600, path
    before = (out / "credentials" / "client-1.pw").read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 1
    assert "dynamic-security.json: exists" in again.stderr
    assert (out / "credentials" / "client-1.pw").read_text() == before



@pytest.mark.parametrize("clients", ["-2", "0", " -1 "])
def test_a_count_of_clients_below_one_is_refused_naming_the_option(tmp_path, capsys, clients):
    # "-2" is a mistyped count, not a board: it used to make an account named -2 (and 0
    # failed later, as "a federation needs at least one client id")
    out = tmp_path / "acc"
    assert usage_error(["broker", "accounts", "--federation", FED, "--clients", clients,
                        "--out", str(out)], capsys) == (
        f"edgefl broker accounts: error: argument --clients: need a whole number >= 1, "
        f"got {int(clients)}")
    assert not out.exists()

# ------------------------------------------------------------------ without the plugin
class PasswordFileMosquitto(ServerProcess):
    """broker/mosquitto.conf adapted (one plain listener) with a generated password file
    and ACL instead of the plugin."""

    name = "mosquitto"

    def __init__(self, workdir: Path, written: dict):
        super().__init__(workdir)
        from edgefl.transport.broker import adapt_mosquitto_conf

        repo = Path(__file__).resolve().parents[1]
        self.conf = self.workdir / "mosquitto.conf"
        self.conf.write_text(adapt_mosquitto_conf((repo / "broker" / "mosquitto.conf")
                                                  .read_text(), self.port, self.workdir,
                                                  written["passwords"], written["acl"]))

    def command(self):
        return [find_mosquitto(), "-c", str(self.conf)]


@pytest.mark.parametrize("hasher", ["mosquitto_passwd", "edgefl"])
def test_password_file_accounts_log_in_and_keep_to_their_topics(tmp_path, monkeypatch,
                                                                hasher):
    """`--mechanism passwd`: the hashes Mosquitto reads, whether mosquitto_passwd made them
    or edgefl wrote its format itself; the ACL gives each account its topics."""
    from edgefl.service.accounts import write_password_file_accounts

    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    if hasher == "edgefl":
        monkeypatch.setenv("EDGEFL_MOSQUITTO_PASSWD", "none")
    elif not os.access("/usr/bin/mosquitto_passwd", os.X_OK):
        pytest.skip("mosquitto_passwd is not installed")
    written = write_password_file_accounts(federation_accounts(FED, CLIENTS), str(tmp_path))
    assert written["hashed_by"].endswith(hasher)
    lines = Path(written["passwords"]).read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == ["aggregator", "aggregator-ctl",
                                                      "client-1", "client-2", "operator"]
    assert all(line.split(":", 1)[1].startswith("$7$101$") for line in lines)
    server = PasswordFileMosquitto(tmp_path, written)
    server.start()
    made = []
    try:
        def login(user, cid):
            t = MqttTransport(server.url, cid, username=user, clean_session=True,
                              password_file=written["credentials"][user], connect_timeout=5)
            t.connect()
            made.append(t)
            return t

        agg = login("aggregator", "aggregator")
        agg.subscribe(f"edgefl/{FED}/update/+", qos=1)
        board = login("client-1", "client-1")
        board.publish(f"edgefl/{FED}/update/client-2", b"forged", qos=1).wait(5)
        board.publish(f"edgefl/{FED}/update/client-1", b"mine", qos=1).wait(5)
        assert next_message(agg).payload == b"mine"
        wrong = tmp_path / "wrong.pw"
        wrong.write_text("nope\n")
        with pytest.raises(TransportError, match="refused client"):
            MqttTransport(server.url, "client-2", username="client-2",
                          password_file=str(wrong), connect_timeout=5).connect()
    finally:
        for t in made:
            t.close(timeout=1.0, announce_offline=False)
        server.stop()


def test_an_aggregator_without_its_control_account_is_told_what_to_set(broker, tmp_path):
    """A site file giving the service one account for both connections, against a broker
    that binds accounts: the control connection is refused, and the error says which keys
    to set."""
    site = tmp_path / "aggregator.yaml"
    site.write_text(f"node: {{id: aggregator, federation: {FED}}}\n"
                    f"broker: {{url: \"{broker.url}\", username: aggregator, "
                    f"password_file: {broker.password_file('aggregator')}}}\n"
                    f"state_dir: {tmp_path / 'state'}\nclients: [client-1, client-2]\n")
    done = subprocess.run([sys.executable, "-m", "edgefl.cli", "aggregator", "--config",
                           str(site), "--once"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "refused client 'aggregator-ctl'" in done.stderr
    assert "set broker.control_username (aggregator-ctl)" in done.stderr
    # with the keys set, the same service starts and (--once, nothing queued) exits 0
    site.write_text(site.read_text().replace(
        "broker: {", "broker: {control_username: aggregator-ctl, control_password_file: "
                     f"{broker.password_file('aggregator-ctl')}, "))
    done = subprocess.run([sys.executable, "-m", "edgefl.cli", "aggregator", "--config",
                           str(site), "--once"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _broker_acl_grants() -> dict:
    """{user or "%pattern": {(access, topic)}} of the shipped broker/acl."""
    grants: dict = {"%pattern": set()}
    user = None
    acl = Path(__file__).resolve().parent.parent / "broker" / "acl"
    for line in acl.read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "user":
            user = words[1]
            grants.setdefault(user, set())
        elif words[0] == "pattern":
            grants["%pattern"].add((words[1], words[2]))
        elif words[0] == "topic":
            grants[user].add((words[1], words[2]))
    return grants


def test_the_generated_roles_grant_what_broker_acl_grants():
    """The dynamic-security roles are broker/acl spelled out per account: a topic a new
    feature adds to broker/acl (secure aggregation, asynchronous tasks) and forgets here
    would fail on every fleet that `fleet up` / `broker accounts` made."""
    fed = federation_accounts("lab", ["client-1", "client-2"])
    roles = {r["rolename"]: r["acls"] for r in dynsec_state(fed)["roles"]}

    def granted(role: str) -> set:
        kinds = {"publishClientSend": "write", "subscribePattern": "read"}
        return {(kinds[a["acltype"]], a["topic"]) for a in roles[role]
                if a["acltype"] in kinds and a["allow"]}

    acl = _broker_acl_grants()
    # the generated files are one federation's: its name where broker/acl has a wildcard
    lab = lambda topic: topic.replace("edgefl/+/", "edgefl/lab/", 1).replace(  # noqa: E731
        "edgefl/#", "edgefl/lab/#")
    board = {(access, lab(topic).replace("%u", "client-1")) for access, topic in acl["%pattern"]}
    assert board <= granted("edgefl-board-client-1"), board - granted("edgefl-board-client-1")
    for user, role in (("aggregator", "edgefl-aggregator"), ("operator", "edgefl-operator")):
        wanted = {(access, lab(topic)) for access, topic in acl[user]}
        assert wanted <= granted(role), (user, wanted - granted(role))
