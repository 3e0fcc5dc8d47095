"""Access control against a real Mosquitto running the repo's broker files: broker/acl with a
generated password file (tests/brokers.py `mosquitto_acl_server`), and broker/mosquitto.conf
itself with test certificates for its TLS listener.

What a client's credentials must not let it do (docs/brokers.md "Credentials and the ACL",
docs/reliability.md "Access control", broker/acl):
publish into another client's update or status topic, publish the round announcement or
the global model, read other clients' updates, send operator commands, or log in without a
password. Mosquitto does not tell an MQTT 3.1.1 client that a publish was denied (it sends
the PUBACK and drops the message); MQTT 5 clients get reason code 135 (Not authorized) in
the PUBACK. Either way the test checks the one thing that matters: the message never
reaches a subscriber allowed to read the topic, and no retained copy is left behind. Each
denial is paired with the allowed publish right after it, so "nothing arrived" means
"denied", not "slow".

TLS: a test CA (made here with the `cryptography` package) signs the broker's certificate;
edgefl's MqttTransport connects over mqtts:// with that CA, is refused with a TransportError
naming the failed verification when given another CA, and, on the listener with the
conf's mutual-TLS lines switched on, logs in by its certificate's CN -- which the ACL then
applies, so a board's certificate is as narrow as its password.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import re
import time
import uuid

import pytest

pytest.register_assert_rewrite("brokers")
from brokers import MOSQUITTO_CONF, ServerProcess, messages_within    # noqa: E402
from edgefl.service.accounts import dynsec_state, federation_accounts, find_dynsec_plugin  # noqa: E402,E501
from edgefl.transport.base import Message, TransportError    # noqa: E402
from edgefl.transport.broker import find_mosquitto, free_port    # noqa: E402
from edgefl.transport.mqtt import MqttTransport    # noqa: E402
from edgefl.transport.topics import Topics    # noqa: E402

pytest_plugins = ["brokers"]

PROTOCOLS = ["3.1.1", "5"]
NOT_AUTHORIZED = 135          # MQTT 5 reason code of a denied publish


# the TLS brokers' accounts are generated for one federation (edgefl broker accounts)
TLS_FEDERATION = Topics("acc-tls")


@pytest.fixture
def federation():
    return Topics(f"acc-{uuid.uuid4().hex[:8]}")


class Nodes:
    """Connected transports as named users of the ACL broker, closed after the test."""

    def __init__(self, server, protocol):
        self.server, self.protocol, self.made = server, protocol, []

    def login(self, user, client_id=None, **options):
        t = MqttTransport(self.server.url, client_id or f"{user}-{uuid.uuid4().hex[:6]}",
                          username=user, password=self.server.users[user],
                          protocol=self.protocol, clean_session=True, connect_timeout=10,
                          reconnect_min=0.05, reconnect_max=0.5, **options)
        t.connect()
        self.made.append(t)
        return t

    def close(self):
        for t in self.made:
            try:
                t.close(timeout=1, announce_offline=False)
            except TransportError:
                t.kill()


@pytest.fixture(params=PROTOCOLS, ids=lambda p: f"mqtt{p}")
def nodes(request, mosquitto_acl_server):
    made = Nodes(mosquitto_acl_server, request.param)
    yield made
    made.close()


def received_until(transport, marker: bytes, timeout: float = 10.0) -> list[Message]:
    """Every message up to and including the one whose payload is `marker` (sent right
    after the one that must be denied, on the same connection, so it arrives after it)."""
    got, deadline = [], time.monotonic() + timeout
    while not any(m.payload == marker for m in got):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"{marker!r} did not arrive within {timeout:g} s; got "
                        f"{[(m.topic, m.payload[:20]) for m in got]}")
        item = transport.receive(remaining)
        if isinstance(item, Message):
            got.append(item)
    return got


def retained(nodes, user, topic) -> list[bytes]:
    """The retained message on `topic` as a fresh subscriber with read access sees it."""
    reader = nodes.login(user)
    reader.subscribe(topic)
    return [m.payload for m in messages_within(reader, 0.5) if m.retain]


def assert_denied_publish(nodes, caplog, publisher, topic, payload, retain=False):
    """`publisher` publishes; the broker acknowledges (3.1.1) or refuses with 135 (v5)."""
    with caplog.at_level(logging.WARNING, logger="edgefl.transport"):
        caplog.clear()
        assert publisher.publish(topic, payload, retain=retain).wait(10), \
            f"no PUBACK for the publish to {topic}"
    if nodes.protocol == "5":
        assert re.search(rf"rejected publish .*reason code {NOT_AUTHORIZED}\)", caplog.text), \
            caplog.text
    else:
        assert "rejected publish" not in caplog.text      # 3.1.1: acknowledged and dropped


# ---------------------------------------------------------------------------------------
# what a client may not write
# ---------------------------------------------------------------------------------------

def test_a_client_cannot_publish_another_clients_update(nodes, federation, caplog):
    aggregator = nodes.login("aggregator")
    aggregator.subscribe(federation.subscription("update"))
    client1 = nodes.login("client-1")
    assert_denied_publish(nodes, caplog, client1, federation.update("client-2"), b"forged")
    client1.publish(federation.update("client-1"), b"own").wait(10)
    got = received_until(aggregator, b"own")
    assert [(m.topic, m.payload) for m in got] == [(federation.update("client-1"), b"own")]


def test_a_client_id_does_not_grant_another_clients_topics(nodes, federation, caplog):
    """The ACL keys on the username, not the MQTT client id a node chooses."""
    aggregator = nodes.login("aggregator")
    aggregator.subscribe(federation.subscription("update"))
    impostor = nodes.login("client-1", client_id="client-2")
    assert_denied_publish(nodes, caplog, impostor, federation.update("client-2"), b"forged")
    impostor.publish(federation.update("client-1"), b"own").wait(10)
    assert [m.payload for m in received_until(aggregator, b"own")] == [b"own"]


def test_a_client_cannot_publish_another_clients_status(nodes, federation, caplog):
    """A forged retained "online"/"offline" status would make the aggregator wait for, or
    give up on, another board."""
    aggregator = nodes.login("aggregator")
    aggregator.subscribe(federation.subscription("status"))
    client1 = nodes.login("client-1")
    assert_denied_publish(nodes, caplog, client1, federation.status("client-2"),
                          b'{"online": false}', retain=True)
    client1.publish(federation.status("client-1"), b"own status", retain=True).wait(10)
    got = received_until(aggregator, b"own status")
    assert [(m.topic, m.payload) for m in got] == [(federation.status("client-1"),
                                                    b"own status")]
    assert retained(nodes, "aggregator", federation.status("client-2")) == []
    client1.clear_retained(federation.status("client-1")).wait(10)


@pytest.mark.parametrize("kind", ["round", "model"])
def test_a_client_cannot_publish_the_round_or_the_global_model(nodes, federation, caplog, kind):
    topic = federation.round() if kind == "round" else federation.model()
    reader = nodes.login("client-2")           # every client reads round and model
    reader.subscribe(topic)
    client1 = nodes.login("client-1")
    assert_denied_publish(nodes, caplog, client1, topic, b"forged " + kind.encode(),
                          retain=True)
    aggregator = nodes.login("aggregator")
    aggregator.publish(topic, b"genuine", retain=True).wait(10)
    assert [m.payload for m in received_until(reader, b"genuine")] == [b"genuine"]
    assert retained(nodes, "client-2", topic) == [b"genuine"]
    aggregator.clear_retained(topic).wait(10)


def test_a_client_cannot_send_operator_commands(nodes, federation, caplog):
    aggregator = nodes.login("aggregator")
    ctl = federation.ctl()
    aggregator.subscribe(ctl)
    client1 = nodes.login("client-1")
    assert_denied_publish(nodes, caplog, client1, ctl, b'{"command": "stop"}')
    operator = nodes.login("operator")
    operator.publish(ctl, b'{"command": "status"}').wait(10)
    assert [m.payload for m in received_until(aggregator, b'{"command": "status"}')] == \
        [b'{"command": "status"}']


def test_a_client_cannot_forge_what_the_operator_reads(nodes, federation, caplog):
    """What `edgefl ctl` prints as the aggregator's word (a reply on its reply topic, the
    events `ctl watch` follows, a run's retained record) and what the dashboard shows of
    the runs: a board may publish none of it; only its own status is the board's word."""
    operator = nodes.login("operator")
    topics = (federation.reply("operator"), federation.events(),
              federation.run_record("r1"))
    for topic in topics:
        operator.subscribe(topic)
    client1 = nodes.login("client-1")
    forged = b'{"v": 1, "ok": true, "cmd": "stop", "request_id": "x", "result": {}}'
    for topic in topics:
        assert_denied_publish(nodes, caplog, client1, topic, forged, retain=True)
    aggregator = nodes.login("aggregator")
    for topic in topics:
        aggregator.publish(topic, b"genuine " + topic.encode()).wait(10)
    got = received_until(operator, b"genuine " + topics[-1].encode())
    assert sorted(m.payload for m in got) == sorted(b"genuine " + t.encode() for t in topics)


# ---------------------------------------------------------------------------------------
# what a client may not read
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("topic_filter", ["update/+", "update/client-1", "#"])
def test_a_client_cannot_read_other_clients_updates(nodes, federation, topic_filter):
    """Mosquitto grants the subscription (the ACL is applied per message delivered), so
    the proof is that client-1's update reaches the aggregator and not client-2, while
    client-2 does get what it may read (the round announcement) on the same filter."""
    aggregator = nodes.login("aggregator")
    aggregator.subscribe(federation.subscription("update"))
    spy = nodes.login("client-2")
    spy.subscribe(f"{federation.base}/{topic_filter}")
    if topic_filter == "#":
        spy.subscribe(federation.round())
    client1 = nodes.login("client-1")
    client1.publish(federation.update("client-1"), b"private update").wait(10)
    assert [m.payload for m in received_until(aggregator, b"private update")] == \
        [b"private update"]
    marker_topic = federation.round() if topic_filter == "#" else None
    if marker_topic:
        aggregator.publish(marker_topic, b"round marker").wait(10)
        got = received_until(spy, b"round marker")
    else:
        got = messages_within(spy, 0.5)
    assert not [m for m in got if "/update/" in m.topic], [m.topic for m in got]


# ---------------------------------------------------------------------------------------
# who may connect at all
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("username, password", [(None, None), ("client-1", None),
                                                ("client-1", "wrong"), ("nobody", "x")],
                         ids=["anonymous", "no-password", "wrong-password", "unknown-user"])
def test_anonymous_and_bad_logins_are_refused(mosquitto_acl_server, protocol, username,
                                              password):
    t = MqttTransport(mosquitto_acl_server.url, f"anon-{uuid.uuid4().hex[:6]}",
                      username=username, password=password, protocol=protocol,
                      clean_session=True, reconnect_min=0.05, connect_timeout=10)
    # 3.1.1: 5 "not authorised" / 4 "bad user name or password"; 5: 135 / 134
    with pytest.raises(TransportError, match=rf"127\.0\.0\.1:{mosquitto_acl_server.port} "
                                             r"refused .*reason code (4|5|134|135)\b"):
        t.connect()
    assert not t.connected


# ---------------------------------------------------------------------------------------
# TLS: the repo's mosquitto.conf with test certificates
# ---------------------------------------------------------------------------------------

def _key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _write_pem(path, cert=None, key=None):
    from cryptography.hazmat.primitives import serialization
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)


def _cert(subject_cn, key, issuer_cn=None, issuer_key=None, ca=False, san=False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)])
    issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn or subject_cn)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH if san else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost")]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def make_pki(d):
    """A test CA signing the broker's certificate (for the name localhost) and two board
    certificates (CN client-1, aggregator); and a second, unrelated CA with a board
    certificate of its own (CN client-1), which the broker must not trust."""
    files = {}
    for ca_name in ("ca", "other-ca"):
        ca_key = _key()
        ca_cn = f"edgefl {ca_name} (test)"
        _write_pem(d / f"{ca_name}.crt", cert=_cert(ca_cn, ca_key, ca=True))
        leaves = [("server", "localhost", True)] if ca_name == "ca" else []
        leaves += [("client-1", "client-1", False)]
        if ca_name == "ca":
            leaves += [("aggregator", "aggregator", False)]
        for stem, cn, is_server in leaves:
            key = _key()
            prefix = "" if ca_name == "ca" else "other-"
            _write_pem(d / f"{prefix}{stem}.crt",
                       cert=_cert(cn, key, ca_cn, ca_key, san=is_server))
            _write_pem(d / f"{prefix}{stem}.key", key=key)
        files[ca_name] = d / f"{ca_name}.crt"
    return files


def tls_conf(d, tls_port, local_port, dynsec_file, mutual: bool) -> str:
    """broker/mosquitto.conf as shipped, its paths pointed at the test's files and its two
    listeners at free ports on 127.0.0.1; with `mutual`, its commented-out mutual-TLS lines
    switched on."""
    text = MOSQUITTO_CONF.read_text()
    replacements = {
        "listener 8883 0.0.0.0": f"listener {tls_port} 127.0.0.1",
        "listener 1883 127.0.0.1": f"listener {local_port} 127.0.0.1",
        "/etc/mosquitto/certs/ca.crt": str(d / "ca.crt"),
        "/etc/mosquitto/certs/server.crt": str(d / "server.crt"),
        "/etc/mosquitto/certs/server.key": str(d / "server.key"),
        "/var/lib/mosquitto/edgefl-dynsec.json": str(dynsec_file),
        "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so": find_dynsec_plugin(),
        "persistence_location /var/lib/mosquitto/": f"persistence_location {d}/",
        "log_dest syslog": "log_dest stderr",
    }
    for old, new in replacements.items():
        assert old in text, f"broker/mosquitto.conf no longer has {old!r}: update this test"
        text = text.replace(old, new)
    if mutual:
        for line in ("require_certificate true", "use_identity_as_username true"):
            assert f"#{line}" in text, f"broker/mosquitto.conf has no '#{line}' line"
            text = text.replace(f"#{line}", line)
    if os.geteuid() == 0:
        text += "\nuser root\n"      # mosquitto would drop to "mosquitto", locked out of d
    return text


class TlsMosquitto(ServerProcess):
    name = "mosquitto-tls"

    def __init__(self, d, users, mutual):
        super().__init__(d)
        self.local_port = self.port            # listener 2: the aggregator's, plain TCP
        self.tls_port = free_port()            # listener 1: the boards', TLS
        # the accounts as `edgefl broker accounts` makes them, with the test's passwords
        accounts = federation_accounts(TLS_FEDERATION.federation, ["client-1", "client-2"],
                                       passwords=users)
        dynsec = d / "dynsec.json"
        dynsec.write_text(json.dumps(dynsec_state(accounts)))
        self.conf = d / "mosquitto.conf"
        self.conf.write_text(tls_conf(d, self.tls_port, self.local_port, dynsec, mutual))
        self.users = users

    def command(self):
        return [find_mosquitto(), "-c", str(self.conf)]


def _tls_broker(tmp_path_factory, mutual):
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    if find_dynsec_plugin() is None:
        pytest.skip("Mosquitto's dynamic security plugin, which broker/mosquitto.conf loads, "
                    "is not installed (Mosquitto >= 2.0)")
    pytest.importorskip("cryptography", reason="the test CA is made with `cryptography`")
    d = tmp_path_factory.mktemp("tls-mutual" if mutual else "tls")
    make_pki(d)
    users = {"aggregator": "agg-secret", "client-1": "c1-secret", "client-2": "c2-secret",
             "operator": "op-secret"}
    server = TlsMosquitto(d, users, mutual)
    server.start()
    server.dir = d
    return server


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory):
    """The repo's conf: TLS listener with passwords and the ACL, plus the local listener."""
    server = _tls_broker(tmp_path_factory, mutual=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mutual_tls_broker(tmp_path_factory):
    """The same with the conf's mutual-TLS lines on: the certificate's CN is the user."""
    server = _tls_broker(tmp_path_factory, mutual=True)
    yield server
    server.stop()


def _tls(server, user, ca="ca.crt", host="localhost", **options):
    d = server.dir
    if user in server.users and "cert_file" not in options:
        options.update(username=user, password=server.users[user])
    # the client id bound to the account (broker/mosquitto.conf's accounts)
    return MqttTransport(f"mqtts://{host}:{server.tls_port}", user,
                         ca_file=str(d / ca), clean_session=True, connect_timeout=10,
                         reconnect_min=0.05, **options)


def _local(server, user):
    return MqttTransport(f"mqtt://127.0.0.1:{server.local_port}", user,
                         username=user, password=server.users[user], clean_session=True,
                         connect_timeout=10)


def assert_only_its_own_update_arrives(aggregator, board, federation, how: str):
    """The ACL whatever the login: `board`, logged in as client-1 (`how`: "over TLS", "by
    certificate"), publishes an update as client-2, then its own; the connected `aggregator`
    receives only the latter. Closes both transports."""
    forged, own = f"forged {how}".encode(), f"update {how}".encode()
    try:
        aggregator.subscribe(federation.subscription("update"))
        board.publish(federation.update("client-2"), forged).wait(10)
        board.publish(federation.update("client-1"), own).wait(10)
        got = received_until(aggregator, own)
        assert [(m.topic, m.payload) for m in got] == [(federation.update("client-1"), own)]
    finally:
        board.close(timeout=1, announce_offline=False)
        aggregator.close(timeout=1, announce_offline=False)


def test_tls_with_the_test_ca_works_and_the_acl_still_applies(tls_broker):
    federation = TLS_FEDERATION
    aggregator = _local(tls_broker, "aggregator")        # listener 2, on the gateway
    aggregator.connect()
    board = _tls(tls_broker, "client-1")                 # listener 1, over the network
    board.connect()
    assert_only_its_own_update_arrives(aggregator, board, federation, "over TLS")


def test_tls_with_another_ca_is_refused(tls_broker):
    wrong = _tls(tls_broker, "client-1", ca="other-ca.crt")
    with pytest.raises(TransportError, match=rf"TLS handshake with MQTT broker "
                                             rf"localhost:{tls_broker.tls_port} failed.*"
                                             r"certificate verify failed"):
        wrong.connect()
    assert not wrong.connected


def test_tls_checks_the_host_name(tls_broker):
    """The broker's certificate names localhost; the same broker reached as 127.0.0.1 is
    not the one the certificate vouches for."""
    other_name = _tls(tls_broker, "client-1", host="127.0.0.1")
    with pytest.raises(TransportError, match=r"TLS handshake .*(IP address mismatch|"
                                             r"hostname|doesn't match)"):
        other_name.connect()


def test_the_tls_listener_speaks_no_plain_mqtt_and_needs_a_password(tls_broker):
    plain = MqttTransport(f"mqtt://127.0.0.1:{tls_broker.tls_port}", "plain-1",
                          username="client-1", password="c1-secret", connect_timeout=3,
                          reconnect_min=0.05)
    with pytest.raises(TransportError, match=rf"127\.0\.0\.1:{tls_broker.tls_port}"):
        plain.connect()
    anonymous = MqttTransport(f"mqtts://localhost:{tls_broker.tls_port}", "anon-1",
                              ca_file=str(tls_broker.dir / "ca.crt"), connect_timeout=10,
                              reconnect_min=0.05)
    with pytest.raises(TransportError, match=r"refused .*reason code (5|135)\b"):
        anonymous.connect()


def test_status_over_tls_takes_the_brokers_ca_from_the_command_line(tls_broker, tmp_path,
                                                                    capsys, monkeypatch):
    """`edgefl status --broker mqtts://...` from an operator's machine with no site file:
    the broker's CA comes from --ca-file (as for `edgefl ctl`); without it the system's
    CAs do not know the broker's, and the error says so."""
    from edgefl.cli import main

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    federation = TLS_FEDERATION
    board = _tls(tls_broker, "client-1")
    board.connect()
    try:
        board.publish(federation.status("client-1"),
                      json.dumps({"node": "client-1", "online": True}).encode(),
                      retain=True).wait(10)
    finally:
        board.close(timeout=1, announce_offline=False)
    password = tmp_path / "operator.pw"
    password.write_text("op-secret\n")
    asked = ["status", "--broker", f"mqtts://localhost:{tls_broker.tls_port}",
             "--federation", federation.federation, "--username", "operator",
             "--password-file", str(password), "--wait", "5", "--json"]
    assert main(asked) == 1
    err = capsys.readouterr().err
    assert "TLS handshake with MQTT broker localhost" in err
    assert "certificate verify failed" in err
    assert main(asked + ["--ca-file", str(tls_broker.dir / "ca.crt")]) == 0
    assert [row["node"] for row in json.loads(capsys.readouterr().out)] == ["client-1"]
    assert main(asked + ["--cert-file", str(tls_broker.dir / "client-1.crt")]) == 1
    assert "--cert-file and --key-file go together" in capsys.readouterr().err


def test_mutual_tls_logs_in_by_certificate_and_the_acl_applies_to_its_cn(mutual_tls_broker):
    federation = TLS_FEDERATION
    d = mutual_tls_broker.dir
    aggregator = _local(mutual_tls_broker, "aggregator")
    aggregator.connect()
    board = _tls(mutual_tls_broker, "client-1", cert_file=str(d / "client-1.crt"),
                 key_file=str(d / "client-1.key"))
    board.connect()                                      # no username, no password
    assert_only_its_own_update_arrives(aggregator, board, federation, "by certificate")


@pytest.mark.parametrize("case", ["no-certificate", "certificate-of-another-ca"])
def test_mutual_tls_refuses_a_board_without_a_certificate_of_its_ca(mutual_tls_broker, case):
    d = mutual_tls_broker.dir
    options = {} if case == "no-certificate" else {
        "cert_file": str(d / "other-client-1.crt"), "key_file": str(d / "other-client-1.key")}
    board = _tls(mutual_tls_broker, "client-1", **options)
    with pytest.raises(TransportError, match=rf"localhost:{mutual_tls_broker.tls_port}"):
        board.connect(timeout=5)
    assert not board.connected


def test_mutual_tls_identity_logins_are_not_bound_to_a_client_id(mutual_tls_broker):
    """What broker/mosquitto.conf and docs/brokers.md warn of: a login by certificate
    (use_identity_as_username) skips the plugin's password check and the client-id binding
    that is part of it, so a board's certificate connects under the aggregator's client id.
    The binding holds only for password logins."""
    d = mutual_tls_broker.dir
    board = MqttTransport(f"mqtts://localhost:{mutual_tls_broker.tls_port}", "aggregator",
                          ca_file=str(d / "ca.crt"), cert_file=str(d / "client-1.crt"),
                          key_file=str(d / "client-1.key"), clean_session=True,
                          connect_timeout=10, reconnect_min=0.05)
    board.connect()
    try:
        assert board.connected
    finally:
        board.close(timeout=1, announce_offline=False)
