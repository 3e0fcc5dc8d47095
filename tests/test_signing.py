"""Signatures (issue #16 items 2-5; docs/security.md): the keys and their files, the signed
envelope and each of its bindings, and, through a real Mosquitto, what they stop:

- a forged announcement and a forged ONNX model (signed with a key that is not the
  aggregator's, or unsigned), published with a raw paho client, are refused by a running
  `edgefl client`, which keeps its installed model and then trains the real run;
- an update signed by another board, and one replayed from an earlier run, are refused by the
  aggregator, which waits for the real one;
- a command replayed is refused, also by a restarted aggregator service (nonces on disk);
- a key rotation: boards holding the old and the new aggregator key follow runs signed with
  either; a board holding only the new one refuses the old.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import paho.mqtt.client as paho
import pytest
import yaml
from paho.mqtt.enums import CallbackAPIVersion

pytest.register_assert_rewrite("brokers")
from brokers import REPO    # noqa: E402
from edgefl.cli import main    # noqa: E402
from edgefl.config import ConfigError    # noqa: E402
from edgefl.export import export_onnx    # noqa: E402
from edgefl.models import build_model    # noqa: E402
from edgefl.roles import (Aggregator, AggregatorSettings, Client, ClientSettings,  # noqa: E402
                          RunPlan)
from edgefl.roles import messages as msg    # noqa: E402
from edgefl.roles.onnx_channel import encode_publication, part_topic, publish_model  # noqa: E402
from edgefl.roles.trust import Trust    # noqa: E402
from edgefl.runconfig import load_run_config    # noqa: E402
from edgefl.runs.prepare import prepare_run    # noqa: E402
from edgefl.service.layered import load_service_config    # noqa: E402
from edgefl.sim import simulate    # noqa: E402
from edgefl.transport import signing, wire    # noqa: E402
from edgefl.transport.mqtt import MqttTransport    # noqa: E402
from edgefl.transport.signing import (KeyFileError, NonceStore, SignatureError,  # noqa: E402
                                      Signer, Verifier, write_key_pair)
from edgefl.transport.topics import Topics    # noqa: E402
from helpers import wait_for, write_run_yaml    # noqa: E402

pytest_plugins = ["brokers"]

BASE = {
    "dataset": {"name": "digits", "limit_train": 300},
    "partition": {"name": "iid", "clients": 2},
    "model": {"name": "softmax"},
    "strategy": {"name": "fedavg"},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "rounds": 2,
    "clients_per_round": 2,
    "seed": 0,
}


def uid() -> str:
    return uuid.uuid4().hex[:8]


def keypair(tmp_path, name):
    private, public = write_key_pair(tmp_path / "keys" / name if (tmp_path / "keys").is_dir()
                                     else _mkdir(tmp_path / "keys") / name)
    return signing.load_private_key(private), private, public


def _mkdir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------
# keys and files
# ---------------------------------------------------------------------------------------

def test_keys_gen_writes_0600_refuses_to_overwrite_and_show_prints_the_fingerprint(
        tmp_path, capsys):
    out = tmp_path / "node"
    assert main(["keys", "gen", "--out", str(out), "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert os.stat(out).st_mode & 0o777 == 0o600
    assert os.stat(str(out) + ".pub").st_mode & 0o777 == 0o644
    key = signing.load_private_key(out)
    raw = key.public_key().public_bytes(signing.serialization.Encoding.Raw,
                                        signing.serialization.PublicFormat.Raw)
    assert made["fingerprint"] == hashlib.sha256(raw).hexdigest()[:16]
    for path in (out, str(out) + ".pub"):
        assert main(["keys", "show", str(path)]) == 0
        assert capsys.readouterr().out.split()[0] == made["fingerprint"]
    before = out.read_bytes()
    assert main(["keys", "gen", "--out", str(out)]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert main(["keys", "gen", "--out", str(out), "--force"]) == 0
    assert out.read_bytes() != before
    (tmp_path / "junk").write_text("not a key\n")
    assert main(["keys", "show", str(tmp_path / "junk")]) == 1
    assert "junk: not an Ed25519 public key" in capsys.readouterr().err


def test_site_file_keys_are_resolved_and_a_bad_key_file_is_named(tmp_path):
    _, agg, agg_pub = keypair(tmp_path, "aggregator")
    _, _, new_pub = keypair(tmp_path, "aggregator-new")
    _, _, c0_pub = keypair(tmp_path, "client-0")
    site = tmp_path / "client.yaml"
    site.write_text(yaml.safe_dump({"node": {"id": "client-0", "federation": "lab"},
                                    "data": "digits",
                                    "keys": {"aggregator": ["keys/aggregator.pub",
                                                            "keys/aggregator-new.pub"],
                                             "signing_key": "keys/client-0"}}))
    config = load_service_config("client", str(site))
    assert config["keys.aggregator"] == [agg_pub, new_pub]
    trust = Trust.from_service_config(config, "client")
    assert trust.signer.by == "client-0" and trust.uplink is None
    assert len(trust.downlink.fingerprints) == 2

    # the aggregator's fleet: a directory of <node>.pub, or a mapping
    site = tmp_path / "aggregator.yaml"
    site.write_text(yaml.safe_dump({"node": {"id": "aggregator", "federation": "lab"},
                                    "keys": {"fleet": "keys", "signing_key": "keys/aggregator",
                                             "operators": "keys/client-0.pub"}}))
    trust = Trust.from_service_config(load_service_config("aggregator", str(site)),
                                      "aggregator")
    assert set(trust.uplink.keys) == {"aggregator", "aggregator-new", "client-0"}
    site.write_text(yaml.safe_dump({"node": {"id": "aggregator", "federation": "lab"},
                                    "keys": {"fleet": {"client-0": c0_pub}}}))
    trust = Trust.from_service_config(load_service_config("aggregator", str(site)),
                                      "aggregator")
    assert set(trust.uplink.keys) == {"client-0"} and trust.signer is None

    site.write_text(yaml.safe_dump({"node": {"id": "aggregator", "federation": "lab"},
                                    "keys": {"fleet": {"client/0": c0_pub}}}))
    with pytest.raises(ConfigError, match="keys.fleet"):
        load_service_config("aggregator", str(site))
    site.write_text(yaml.safe_dump({"node": {"id": "client-0", "federation": "lab"},
                                    "data": "digits",
                                    "keys": {"aggregator": "keys/missing.pub"}}))
    with pytest.raises(KeyFileError, match=r"keys.aggregator: .*missing.pub: cannot read"):
        Trust.from_service_config(load_service_config("client", str(site)), "client")


# ---------------------------------------------------------------------------------------
# the envelope: every binding
# ---------------------------------------------------------------------------------------

def test_a_signature_binds_federation_run_round_kind_signer_content_and_expiry(tmp_path):
    key, rogue = signing.generate_key(), signing.generate_key()
    signer = Signer(key, "aggregator", "lab")
    verifier = Verifier("lab", {"*": [key.public_key()]})
    doc = signer.sign_doc({"v": 1, "run": "r1", "round": 3, "x": [1.5, "a"]}, "announce",
                          "r1", 3)
    doc = json.loads(json.dumps(doc, indent=2))      # spacing and key order do not matter
    ok = dict(kind="announce", where="t", run="r1", round=3, by="aggregator")
    assert verifier.verify_doc(doc, **ok)["by"] == "aggregator"
    cases = [
        (dict(ok, run="r2"), "signed for run 'r1', not 'r2'"),
        (dict(ok, round=4), "signed for round 3, not 4"),
        (dict(ok, kind="finished"), "signed as a 'announce', used as a 'finished'"),
        (dict(ok, by="client-1"), "signed by 'aggregator', not 'client-1'"),
    ]
    for expect, reason in cases:
        with pytest.raises(SignatureError, match=reason):
            verifier.verify_doc(doc, **expect)
    with pytest.raises(SignatureError, match="signed for federation 'lab', this is 'other'"):
        Verifier("other", {"*": [key.public_key()]}).verify_doc(doc, **ok)
    with pytest.raises(SignatureError, match="altered after signing"):
        verifier.verify_doc({**doc, "x": [1.5, "b"]}, **ok)
    with pytest.raises(SignatureError, match="unsigned"):
        verifier.verify_doc({k: v for k, v in doc.items() if k != "sig"}, **ok)
    with pytest.raises(SignatureError, match="bad signature"):
        verifier.verify_doc({**doc, "sig": {**doc["sig"], "run": "r2"}}, **dict(ok, run="r2"))
    forged = Signer(rogue, "aggregator", "lab").sign_doc(doc, "announce", "r1", 3)
    with pytest.raises(SignatureError, match="not one of the trusted keys"):
        verifier.verify_doc(forged, **ok)
    # a board's key is its own: client-1's signature does not pass as client-0's
    boards = Verifier("lab", {"client-0": [key.public_key()], "client-1": [rogue.public_key()]})
    as_c0 = Signer(rogue, "client-0", "lab").sign_doc({"a": 1}, "update", "r1", 1)
    with pytest.raises(SignatureError, match="not one of the trusted keys of 'client-0'"):
        boards.verify_doc(as_c0, kind="update", where="t", by="client-0")
    # expiry
    cmd = Signer(key, "operator", "lab").sign_doc({"cmd": "status"}, "command", "", 0,
                                                  expires_in=5)
    verifier.verify_doc(cmd, kind="command", where="t")
    with pytest.raises(SignatureError, match="expired"):
        verifier.verify_doc(cmd, kind="command", where="t", now=time.time() + 60)


def test_a_frame_signature_covers_its_payload_metadata_and_chunks(tmp_path):
    model = build_model({"name": "softmax"}, (9,), 10)
    table = model.table
    key = signing.generate_key()
    signer, verifier = Signer(key, "aggregator", "lab"), Verifier("lab", {"*": [key.public_key()]})
    w = np.random.default_rng(0).standard_normal(model.n_params).astype(np.float32)
    for compression in ("none", "f16", "int8"):
        data = wire.encode("model", 2, "aggregator", {"params": w}, {"run": "r1"}, table,
                           compression, sign=signer.frame_signer("r1"))
        expect = wire.Expectation(table, kinds="model")
        reassembler = wire.Reassembler(10)
        for chunk in wire.split(data, 1024):
            frame = reassembler.add(chunk, expect)
        assert verifier.verify_frame(frame, where="t", run="r1")["kind"] == "model"
        with pytest.raises(SignatureError, match="not 'r2'"):
            verifier.verify_frame(frame, where="t", run="r2")
        # the same signature on other values (a re-encoded frame, CRC valid) is refused
        sig = dict(frame.scalars)["sig"]
        other = wire.encode("model", 2, "aggregator", {"params": w * 0.5},
                            {"run": "r1", "sig": sig}, table, compression,
                            message_id=frame.message_id)
        with pytest.raises(SignatureError, match="altered after signing"):
            verifier.verify_frame(wire.decode(other, expect), where="t", run="r1")
        moved = wire.encode("model", 3, "aggregator", {"params": w},
                            {"run": "r1", "sig": sig}, table, compression,
                            message_id=frame.message_id)
        with pytest.raises(SignatureError):
            verifier.verify_frame(wire.decode(moved, expect), where="t", run="r1")


def test_nonces_are_remembered_on_disk_until_they_expire(tmp_path):
    path = str(tmp_path / "nonces.json")
    now = time.time()
    NonceStore(path).check_and_add("n1", now + 60, "t", now=now)
    store = NonceStore(path)                                # a restarted aggregator
    with pytest.raises(SignatureError, match="nonce n1 was used already"):
        store.check_and_add("n1", now + 60, "t", now=now)
    store.check_and_add("n2", now + 60, "t", now=now + 61)  # n1 has expired: forgotten
    assert set(json.loads(open(path).read())) == {"n2"}
