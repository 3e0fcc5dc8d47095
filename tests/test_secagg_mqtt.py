"""Secure aggregation over a real Mosquitto: the SecAgg+ phases travel as chunked messages on
the per-client `secure/<client>` (up) and `secure_to/<client>` (down) topics, guarded by the
repo's ACL; a secure run gives the same model, bit for bit, as the in-process secure run
(the ring sum is exact and each client rounds with its task's seed), through
`edgefl simulate --transport mqtt` and through the aggregator service (`edgefl ctl start`)."""
import uuid

import pytest

from edgefl.runconfig import load_run_config, run_config_from_mapping
from edgefl.sim import simulate
from edgefl.transport.base import Message
from edgefl.transport.mqtt import MqttTransport
from edgefl.transport.topics import Topics
from helpers import read_jsonl

pytest.register_assert_rewrite("brokers")     # imported by test_orchestration
import test_orchestration as orchestration  # noqa: E402

pytest_plugins = ["brokers"]

fleet = orchestration.fleet         # the aggregator service and its boards on the ACL broker


@pytest.mark.parametrize("sets", [
    ["privacy.secure_aggregation.threshold=0.8"],
    ["strategy.name=mfl", "privacy.secure_aggregation.neighbours=2",
     "privacy.secure_aggregation.ring_bits=64"],
])
def test_same_model_over_mosquitto_as_in_process(mosquitto_server, tmp_path, sets):
    config = load_run_config("quickstart", ["rounds=3", *sets])
    inproc = simulate(config, tmp_path / "inproc", workers=2, progress=False)
    over = simulate(config, tmp_path / "mqtt", workers=2, progress=False, transport="mqtt",
                    broker=mosquitto_server.url, mqtt={"max_payload": 16 << 10})
    assert over["transport"]["broker_kind"] == "external"
    assert over["model_sha256"] == inproc["model_sha256"]
    a, b = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("inproc", "mqtt"))
    assert [r["closed_by"] for r in b] == ["secure"] * 3
    assert [r["secure"] for r in b] == [r["secure"] for r in a]
    assert [r["uplink_bytes"] for r in b] == [r["uplink_bytes"] for r in a]
    assert [r["train_loss"] for r in b] == [r["train_loss"] for r in a]


def test_a_secure_run_through_the_aggregator_service(fleet):
    """`ctl start` of a secure config on the ACL broker (every node its own account): the
    rounds close from the unmasked sum and the model is the in-process secure run's."""
    f = fleet()
    f.start_all()
    doc = orchestration.run_config(rounds=2, privacy={"secure_aggregation": {"threshold": 1.0}})
    _, closed, summary = f.run_to_end(doc, "sa")
    assert [(e["round"], e["closed_by"]) for e in closed] == [(1, "secure"), (2, "secure")]
    inproc = simulate(run_config_from_mapping(doc), None, progress=False)
    assert summary["model_sha256"] == inproc["model_sha256"]


def test_the_acl_keeps_each_clients_secure_topics_its_own(mosquitto_acl_server):
    """client-1 may write only its own secure/<client> and read only its own secure_to:
    another client's shares and masked input never reach it, and it cannot speak for
    another client."""
    topics = Topics(f"acl-{uuid.uuid4().hex[:8]}")
    made = []

    def login(user):
        t = MqttTransport(mosquitto_acl_server.url, f"{user}-{uuid.uuid4().hex[:6]}",
                          username=user, password=mosquitto_acl_server.users[user],
                          clean_session=True, connect_timeout=10)
        t.connect()
        made.append(t)
        return t

    try:
        aggregator, client1 = login("aggregator"), login("client-1")
        aggregator.subscribe(topics.subscription("secure"))
        client1.subscribe(topics.subscription("secure_to"))          # asks for everyone's
        client1.publish(topics.secure("client-2"), b"forged").wait(10)
        client1.publish(topics.secure("client-1"), b"own").wait(10)
        aggregator.publish(topics.secure_to("client-2"), b"for client-2").wait(10)
        aggregator.publish(topics.secure_to("client-1"), b"for client-1").wait(10)
        got = {"aggregator": [], "client-1": []}
        for who, t, marker in (("aggregator", aggregator, b"own"),
                               ("client-1", client1, b"for client-1")):
            while not any(m.payload == marker for m in got[who]):
                item = t.receive(10)
                assert item is not None, f"{who}: {marker!r} did not arrive"
                if isinstance(item, Message):
                    got[who].append(item)
        assert [(m.topic, m.payload) for m in got["aggregator"]] == \
            [(topics.secure("client-1"), b"own")]
        assert [(m.topic, m.payload) for m in got["client-1"]] == \
            [(topics.secure_to("client-1"), b"for client-1")]
    finally:
        for t in made:
            t.close(timeout=1, announce_offline=False)


def test_a_client_that_stops_answering_is_a_dropout_and_the_model_matches(mosquitto_server,
                                                                          monkeypatch):
    """client-2 trains and shares its keys but never sends its masked input (a board that
    dies mid-round; it stays online, so its phase runs to the deadline): the rounds it takes
    part in close with the other clients' exact sum, the model the in-process secure run's
    with client 2 vanishing at the same phase."""
    from edgefl.roles import client as client_role
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim import run_federation
    from edgefl.sim.secure import in_process_secure_sum

    answer = client_role.Client._on_secure

    def dies_before_masking(self, payload):
        if self.node == "client-2" and self._secure is not None and self._secure._keys:
            return                       # after its shares: silent from the masked phase on
        answer(self, payload)

    monkeypatch.setattr(client_role.Client, "_on_secure", dies_before_masking)
    config = load_run_config("quickstart", ["rounds=3", "privacy.secure_aggregation.threshold=0.8"])
    over = simulate(config, None, workers=2, progress=False, transport="mqtt",
                    broker=mosquitto_server.url, mqtt={"round_timeout_s": 3.0})
    run = prepare_run(config, progress=False)
    dropped = []
    inproc = run_federation(
        run.strategy, run.init_params, run.clients, run.setup, config.clients_per_round,
        summing=True, on_round=lambda rec: dropped.append(rec["secure"]["dropped"]),
        secure_sum=in_process_secure_sum(config.privacy.secure_aggregation, "x", config.seed,
                                         lambda r: {"masked": [2]}))
    assert [2] in dropped                   # client 2 was selected, and dropped, somewhere
    assert over["model_sha256"] == inproc.model_sha256


def test_a_client_revealing_garbage_is_refused_and_the_round_unmasks_from_the_others(
        mosquitto_server, monkeypatch):
    """client-2 answers the unmask request with shares that are not numbers (a broken or
    malicious board): before, the aggregator took the reveal and its reconstruction raised
    TypeError, which ended the run; now the reveal is refused naming client 2 and the
    field, and the sum is unmasked from the other holders' shares (4 of 5 reach t = 4), so
    the model is the in-process secure run's."""
    from edgefl.privacy import secagg

    unmask = secagg.SecAggClient.unmask

    def garbage(self, msg):
        answer = unmask(self, msg)
        if self.client != 2:
            return answer
        return secagg.UnmaskResponse(answer.round, 2, {c: "x" for c in answer.seed_shares},
                                     answer.key_shares)

    monkeypatch.setattr(secagg.SecAggClient, "unmask", garbage)
    config = load_run_config("quickstart", ["rounds=3", "privacy.secure_aggregation.threshold=0.8"])
    over = simulate(config, None, workers=2, progress=False, transport="mqtt",
                    broker=mosquitto_server.url, mqtt={"round_timeout_s": 3.0})
    monkeypatch.setattr(secagg.SecAggClient, "unmask", unmask)
    inproc = simulate(config, None, workers=2, progress=False)
    assert over["model_sha256"] == inproc["model_sha256"]


def test_a_client_whose_advertisement_does_not_parse_is_a_dropout_not_the_end_of_the_run(
        mosquitto_server, monkeypatch):
    """client-2 advertises a message whose key field is {"b64": 5}: before, parsing it
    raised AttributeError out of the aggregator's handling of its secure topic, which ended
    the run; now it is refused naming the field, client 2 has not answered the keys phase
    (it closes at its deadline), and the rounds close with the others' exact sum: the model
    is the in-process secure run's with client 2 vanishing before its keys."""
    import json
    import struct

    from edgefl.privacy import secagg
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim import run_federation
    from edgefl.sim.secure import in_process_secure_sum

    advertise = secagg.SecAggClient.advertise

    class Unparsable:
        def __init__(self, msg):
            self.msg = msg

        def to_bytes(self):
            head = json.dumps({"kind": "advertise", "round": self.msg.round, "client": 2,
                               "c_public": {"b64": 5}, "s_public": {"b64": 5}}).encode()
            return struct.pack(">I", len(head)) + head

    def broken(self):
        msg = advertise(self)
        return Unparsable(msg) if self.client == 2 else msg

    monkeypatch.setattr(secagg.SecAggClient, "advertise", broken)
    config = load_run_config("quickstart", ["rounds=3", "privacy.secure_aggregation.threshold=0.8"])
    over = simulate(config, None, workers=2, progress=False, transport="mqtt",
                    broker=mosquitto_server.url, mqtt={"round_timeout_s": 3.0})
    monkeypatch.setattr(secagg.SecAggClient, "advertise", advertise)
    run = prepare_run(config, progress=False)
    dropped = []
    inproc = run_federation(
        run.strategy, run.init_params, run.clients, run.setup, config.clients_per_round,
        summing=True, on_round=lambda rec: dropped.append(rec["secure"]),
        secure_sum=in_process_secure_sum(config.privacy.secure_aggregation, "x", config.seed,
                                         lambda r: {"keys": [2]}))
    assert any(rec["survivors"] == 4 for rec in dropped)     # client 2 was selected somewhere
    assert over["model_sha256"] == inproc.model_sha256
