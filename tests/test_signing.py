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

import base64
import errno
import hashlib
import json
import os
import stat
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
    # a directory that does not exist yet (~/.config/edgefl on a fresh machine) is named,
    # with the key asked for; nothing is written
    absent = tmp_path / "config" / "edgefl"
    assert main(["keys", "gen", "--out", str(absent / "operator.key")]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {absent / 'operator.key'}: No such file or directory: {absent}" \
        in err and ".tmp" not in err
    assert not (tmp_path / "config").exists()
    assert main(["keys", "show", str(tmp_path / "junk")]) == 1
    assert "junk: not an Ed25519 public key" in capsys.readouterr().err


def test_keys_gen_checks_both_files_before_writing_either_and_keeps_the_old_pair(
        tmp_path, capsys, monkeypatch):
    """A private key and its .pub are one pair: `keys gen` refuses a directory at either
    name (with or without --force, which replaces files) before writing anything, and a
    write that fails part-way leaves the old pair whole, not a new private key beside the
    old public one."""
    kp = tmp_path / "kp"
    assert main(["keys", "gen", "--out", str(kp)]) == 0
    capsys.readouterr()
    old = kp.read_bytes()
    os.unlink(f"{kp}.pub")
    os.mkdir(f"{kp}.pub")
    for force in ([], ["--force"]):
        assert main(["keys", "gen", "--out", str(kp)] + force) == 1
        err = capsys.readouterr().err
        assert f"{kp}.pub is a directory" in err
        assert "pass --force" not in err and ".tmp" not in err
        assert kp.read_bytes() == old and os.listdir(f"{kp}.pub") == []
        assert sorted(os.listdir(tmp_path)) == ["kp", "kp.pub"]
    # --out naming a directory: following the advice to pass --force must not be a trap
    folder = _mkdir(tmp_path / "folder")
    for force in ([], ["--force"]):
        assert main(["keys", "gen", "--out", str(folder)] + force) == 1
        err = capsys.readouterr().err
        assert f"{folder} is a directory" in err
        assert "pass --force" not in err and ".tmp" not in err
        assert os.listdir(folder) == [] and not os.path.exists(f"{folder}.pub")

    # the disk fills while the second file is written: neither file of the old pair changes
    pair = tmp_path / "pair"
    assert main(["keys", "gen", "--out", str(pair)]) == 0
    capsys.readouterr()
    before = {name: (tmp_path / name).read_bytes() for name in ("pair", "pair.pub")}
    files_synced, real_fsync = [], os.fsync

    def full_on_the_second_file(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            files_synced.append(fd)
            if len(files_synced) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_on_the_second_file)
    assert main(["keys", "gen", "--out", str(pair), "--force"]) == 1
    monkeypatch.undo()
    assert "No space left on device" in capsys.readouterr().err
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(tmp_path)) == ["folder", "kp", "kp.pub", "pair", "pair.pub"]
    assert signing.fingerprint(signing.load_private_key(pair)) == \
        signing.fingerprint(signing.load_public_key(f"{pair}.pub"))


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
    # the same 64 signature bytes written a second way (the last base64 character's two
    # unused bits set): one encoding per signature, so it is refused
    sig = doc["sig"]["sig"]
    assert sig.endswith("==")
    last = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".index(sig[-3])
    other = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"[last ^ 1]
    twin = sig[:-3] + other + "=="
    assert base64.b64decode(twin) == base64.b64decode(sig)
    with pytest.raises(SignatureError, match="not in canonical base64"):
        verifier.verify_doc({**doc, "sig": {**doc["sig"], "sig": twin}}, **ok)
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
    # a signing time further ahead of this node's clock than MAX_SKEW_S is refused: a board
    # that followed it would take every later announcement for an older one, a replay
    at = doc["sig"]["at"]
    verifier.verify_doc(doc, **ok, now=at - signing.MAX_SKEW_S + 1)
    with pytest.raises(SignatureError, match="in the future"):
        verifier.verify_doc(doc, **ok, now=at - signing.MAX_SKEW_S - 10)


def test_a_frame_signature_hashes_its_payload_once_for_all_copies_and_binds_it():
    """content_digest is sha256(core, newline, sha256(payload)): copies of one model to
    several boards share the payload's hash (their cores differ), a one-buffer f32 model's
    payload hash is checkpoint.model_sha256 of its parameters (the aggregator's journal
    hash), and a payload hash passed to encode that is not the payload's makes a frame
    every receiver refuses."""
    from edgefl.checkpoint import model_sha256
    model = build_model({"name": "softmax"}, (9,), 10)
    key = signing.generate_key()
    signer, verifier = Signer(key, "aggregator", "lab"), Verifier("lab", {"*": [key.public_key()]})
    w = np.random.default_rng(0).standard_normal(model.n_params).astype(np.float32)
    sha = model_sha256(w)
    frames = {}
    for node in ("client-0", "client-1"):
        for given in (None, sha):
            data = wire.encode("client_model", 2, "aggregator", {"params": w}, {"run": "r1"},
                               model.table, recipient=node, sign=signer.frame_signer("r1"),
                               payload_sha256=given)
            frame = wire.decode(data, wire.Expectation(model.table, kinds="client_model"))
            assert verifier.verify_frame(frame, where="t", run="r1")["kind"] == "client_model"
            frames[node, given] = frame
        core = frame.content_sha256()
        assert core == wire.frame_digest(wire.frame.content_core(
            "client_model", 2, "aggregator", node, "f32", model.table.hash64,
            frame.message_id, list(frame.rows), {"run": "r1"}), sha)
    assert frames["client-0", None].content_sha256() != frames["client-1", None].content_sha256()
    # a payload hash that is not the payload's: signed, but no receiver takes it
    wrong = model_sha256(w * 2)
    data = wire.encode("model", 2, "aggregator", {"params": w}, {"run": "r1"}, model.table,
                       sign=signer.frame_signer("r1"), payload_sha256=wrong)
    frame = wire.decode(data, wire.Expectation(model.table, kinds="model"))
    with pytest.raises(SignatureError, match="altered after signing"):
        verifier.verify_frame(frame, where="t", run="r1")
    for bad, kwargs in (("ABC", {"sign": signer.frame_signer("r1")}), (sha, {})):
        with pytest.raises(wire.EncodeError, match="payload_sha256"):
            wire.encode("model", 2, "aggregator", {"params": w}, {"run": "r1"}, model.table,
                        payload_sha256=bad, **kwargs)


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
        assert frame.digest_hint is None
        # hashed while the chunks arrive (a receiver that checks signatures), in any order:
        # the same digest as one pass over the frame received
        # (unless the metadata does not fit in the first chunk, as here: then in one pass)
        reassembler = wire.Reassembler(10, digests=True)
        for chunk in wire.split(data, 1024):
            along = reassembler.add(chunk, expect)
        assert along.digest_hint is None and along.content_sha256() == frame.content_sha256()
        big = build_model({"name": "softmax"}, (300,), 10)
        data = wire.encode("model", 2, "aggregator", {"params": np.ones(big.n_params,
                                                                        np.float32)},
                           {"run": "r1"}, big.table, compression,
                           sign=signer.frame_signer("r1"))
        whole = wire.decode(data, wire.Expectation(big.table, kinds="model"))
        chunks = wire.split(data, 2048)
        order = np.random.default_rng(1).permutation(len(chunks))
        reassembler = wire.Reassembler(10, digests=True)
        for i in order:
            along = reassembler.add(chunks[i], wire.Expectation(big.table, kinds="model"))
        assert along.digest_hint is not None
        assert along.digest_hint[1] == whole.content_sha256()
        assert verifier.verify_frame(along, where="t", run="r1")["kind"] == "model"
        # a hint whose core is not the frame's is not taken
        import dataclasses
        stray = dataclasses.replace(along, digest_hint=(b"{}", along.digest_hint[1]))
        assert stray.content_sha256() == whole.content_sha256()
        stray = dataclasses.replace(along, digest_hint=(along.digest_hint[0], "0" * 64))
        with pytest.raises(SignatureError, match="altered after signing"):
            verifier.verify_frame(stray, where="t", run="r1")
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


# ---------------------------------------------------------------------------------------
# through a real Mosquitto
# ---------------------------------------------------------------------------------------

def write_config(tmp_path, **changes) -> str:
    return write_run_yaml(tmp_path, BASE, "run.yaml", **changes)


def reference_sha(config) -> str:
    return simulate(config, None, workers=1, progress=False)["model_sha256"]


class RawPublisher:
    """A plain paho client, nothing of edgefl's transport: what an attacker with broker
    access publishes."""

    def __init__(self, url: str):
        host, port = url.removeprefix("mqtt://").split(":")
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"raw-{uid()}")
        self.client.connect(host, int(port))
        self.client.loop_start()

    def publish(self, topic, payload, retain=False):
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def close(self):
        self.client.loop_stop()
        self.client.disconnect()


def mqtt(url, name):
    return MqttTransport(url, f"{name}-{uid()}", reconnect_min=0.05, reconnect_max=0.5,
                         connect_timeout=5.0)


def sha_of(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class SignedRun:
    """An Aggregator (thread) signing with `agg_key`, checking the boards' keys, on `fed`."""

    def __init__(self, tmp_path, config, url, fed, agg_key, board_keys, state="agg",
                 ids=("client-0", "client-1"), run_id=None):
        from edgefl.roles.control import RunControl
        from edgefl.roles.aggregator import secure_plan
        self.run = prepare_run(config, progress=False)
        plan = RunPlan(self.run.strategy, self.run.init_params, self.run.setup, self.run.model,
                       config.clients_per_round, ids, description=config.to_dict(),
                       **secure_plan(self.run))
        trust = Trust(fed, signer=Signer(agg_key, "aggregator", fed),
                      uplink=Verifier(fed, {n: [k.public_key()] for n, k in board_keys.items()})
                      if board_keys is not None else None)
        self.aggregator = Aggregator(plan, mqtt(url, "aggregator"), tmp_path / state,
                                     AggregatorSettings(node_id="aggregator", federation=fed,
                                                        round_timeout_s=60.0, trust=trust),
                                     control=RunControl(run_id) if run_id else None)
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._body, daemon=True)

    def _body(self):
        try:
            self.result = self.aggregator.run()
        except BaseException as exc:      # noqa: BLE001 -- re-raised by finish()
            self.error = exc

    def start(self):
        self.thread.start()
        # announced, not only opened: the round is open (self.aggregator.open) before its
        # announcement is built, and a test reads the announcement at once
        wait_for(lambda: (self.aggregator.open is not None and
                          self.aggregator.open.announcement) or self.error is not None,
                 what="round 1 to be announced", timeout=20.0)
        return self

    def finish(self, timeout=60.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the aggregator did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def board(tmp_path, run, url, fed, node, key, aggregator_keys, **options):
    c = int(node.rsplit("-", 1)[1])
    trust = Trust(fed, signer=Signer(key, node, fed) if key is not None else None,
                  downlink=Verifier(fed, {"*": [k.public_key() for k in aggregator_keys]}))
    options.setdefault("exit_when_finished", True)
    client = Client(ClientSettings(node, fed, trust=trust, **options),
                    (run.clients[c % len(run.clients)].x, run.clients[c % len(run.clients)].y),
                    mqtt(url, node), tmp_path / node)
    thread = threading.Thread(target=client.run, daemon=True)
    thread.start()
    assert client.ready.wait(10)
    return client, thread


def forged_announcement(run, node="client-0", run_id="forged-run") -> dict:
    now = time.time()
    doc = {"v": 1, "run": run_id, "aggregator": "aggregator", "round": 1, "rounds": 1,
           "announce": uid(), "opened": now, "deadline": now + 60,
           "strategy": {"name": "fedavg", "params": {}},
           "model": {"spec": json.loads(run.model.spec),
                     "input_shape": list(run.model.input_shape),
                     "num_classes": int(run.model.num_classes), "table": run.model.table.digest},
           "compression": "none", "model_sha256": "0" * 64,
           "train": {"lr": 0.1, "batch_size": 32, "epochs": 1}, "scalars": {},
           "tasks": {node: {"client": 0, "upload": True, "source": "global",
                            "train": {"seed": "1"}, "scalars": {}}}}
    msg.parse_announcement(json.dumps(doc).encode())     # well formed: only its signature fails
    return doc


def test_a_running_edgefl_client_refuses_forged_announcements_and_onnx_and_keeps_its_model(
        tmp_path, mosquitto_server, capsys):
    path = write_config(tmp_path)
    config = load_run_config(path)
    fed = f"sig-{uid()}"
    topics = Topics(fed)
    agg_key, _, agg_pub = keypair(tmp_path, "aggregator")
    rogue_key = signing.generate_key()
    c0_key, c0_private, _ = keypair(tmp_path, "client-0")
    c1_key = signing.generate_key()
    run = prepare_run(config, progress=False)
    state = tmp_path / "client-0-state"
    site = tmp_path / "client-0.yaml"
    site.write_text(yaml.safe_dump({
        "profile": "generic-x86", "node": {"id": "client-0", "federation": fed},
        "state_dir": str(state), "broker": {"url": mosquitto_server.url},
        "log": {"level": "info"},
        "keys": {"aggregator": [agg_pub], "signing_key": c0_private}}))
    log_path = tmp_path / "client-0.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "client", "--config",
                                 str(site), "--partition", path, "--shard", "0"],
                                cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)

    def logged(text):
        return text in log_path.read_text()

    raw = RawPublisher(mosquitto_server.url)
    publisher = mqtt(mosquitto_server.url, "aggregator-pub")
    others = []
    try:
        wait_for(lambda: logged("waiting for a run"), what="client-0 up", timeout=30)
        assert logged("checks aggregator messages against " + signing.fingerprint(agg_key))

        # the aggregator's ONNX model is installed
        good, bad = tmp_path / "good.onnx", tmp_path / "bad.onnx"
        export_onnx(run.model, run.init_params, good, norm_mean=run.dataset.norm_mean,
                    norm_std=run.dataset.norm_std)
        export_onnx(run.model, run.init_params * 0 + 1, bad, norm_mean=run.dataset.norm_mean,
                    norm_std=run.dataset.norm_std)
        publisher.connect()
        pub = publish_model(publisher, topics, good, round=1, sender="aggregator", run="r0",
                            max_payload=2048, record_dir=str(tmp_path),
                            signer=Signer(agg_key, "aggregator", fed))
        installed = state / "model.onnx"
        wait_for(lambda: installed.exists() and sha_of(installed) == pub.sha256,
                 what="the signed ONNX model installed", timeout=20)

        # a forged ONNX model: signed with another key, then unsigned; parts and manifest
        from edgefl.export import model_payload
        data, metadata = model_payload(bad)
        for signer, why in ((Signer(rogue_key, "aggregator", fed), "not one of the trusted keys"),
                            (None, "unsigned")):
            forged = encode_publication(data, metadata, round=9, sender="aggregator",
                                        run="r0", max_payload=2048, signer=signer)
            for i, payload in enumerate(forged.parts):
                raw.publish(part_topic(topics, i), payload, retain=True)
            raw.publish(topics.onnx(), forged.manifest, retain=True)
            wait_for(lambda why=why: logged("rejected ONNX model on") and logged(why),
                     what=f"the forged ONNX model refused ({why})", timeout=20)
        assert sha_of(installed) == pub.sha256             # still serving the good model

        # a forged announcement: another key, then unsigned
        doc = forged_announcement(run)
        raw.publish(topics.round(), json.dumps(
            Signer(rogue_key, "aggregator", fed).sign_doc(doc, "announce", "forged-run", 1)
        ).encode(), retain=True)
        wait_for(lambda: logged("rejected announcement: signed by 'aggregator' with key "
                                + signing.fingerprint(rogue_key)), what="forged announcement "
                 "refused", timeout=20)
        raw.publish(topics.round(), json.dumps(forged_announcement(run)).encode(), retain=True)
        wait_for(lambda: logged("rejected announcement: unsigned"),
                 what="unsigned announcement refused", timeout=20)
        from edgefl.roles.state import ClientProgress
        assert ClientProgress.load(str(state)).run_id is None     # nothing of forged-run
        assert sha_of(installed) == pub.sha256

        # the real run: the board takes it, and the model is the in-process one
        probe = mqtt(mosquitto_server.url, "probe")
        probe.connect()
        probe.subscribe(topics.round(), qos=1)
        others.append(probe)
        real = SignedRun(tmp_path, config, mosquitto_server.url, fed, agg_key,
                         {"client-0": c0_key, "client-1": c1_key}).start()
        c1, t1 = board(tmp_path, run, mosquitto_server.url, fed, "client-1", c1_key, [agg_key])
        result = real.finish()
        t1.join(10)
        assert [h["updates"] for h in result.history] == [2, 2]
        from edgefl.checkpoint import model_sha256
        assert model_sha256(result.params) == reference_sha(config)
        assert real.aggregator.stats.get("bad_signatures", 0) == 0

        # an announcement of that run replayed after it finished: refused by its age
        seen = []
        while (item := probe.receive(timeout=0.5)) is not None:
            if getattr(item, "payload", b""):
                seen.append(json.loads(item.payload))
        first = next(d for d in seen if d.get("round") == 1 and d.get("run") == result.run_id)
        raw.publish(topics.round(), json.dumps(first).encode(), retain=True)
        wait_for(lambda: logged("a replay; the model this board has stays"),
                 what="the replayed announcement refused", timeout=20)
        assert sha_of(installed) == pub.sha256

        # `edgefl status` shows each node's key fingerprint and whether it checks
        capsys.readouterr()
        assert main(["status", "--broker", mosquitto_server.url, "--federation", fed,
                     "--wait", "2"]) == 0
        table = capsys.readouterr().out
        rows = {line.split()[0]: line.split() for line in table.splitlines()[1:-1]}
        assert rows["client-0"][-2:] == [signing.fingerprint(c0_key), "on"], table
        assert rows["aggregator"][-2:] == [signing.fingerprint(agg_key), "on"], table
    finally:
        proc.terminate()
        proc.wait(30)
        raw.close()
        for t in [publisher] + others:
            t.close(timeout=1.0, announce_offline=False)
    text = log_path.read_text()
    assert "Traceback" not in text, text[-3000:]


def _signed_updates_of_round_one(tmp_path, config, run, url, fed, agg_key, keys, **named):
    """A whole signed run in state directory agg-a (its boards under tmp_path/a), and what
    client-0 published on its update topic for round 1, seen from the broker: (payloads,
    the finished SignedRun)."""
    probe = mqtt(url, "probe")
    probe.connect()
    probe.subscribe(Topics(fed).update("client-0"), qos=1)
    first = SignedRun(tmp_path, config, url, fed, agg_key, keys, state="agg-a",
                      **named).start()
    boards = [board(tmp_path / "a", run, url, fed, n, keys[n], [agg_key]) for n in keys]
    first.finish()
    for _, t in boards:
        t.join(10)
    captured = []
    while (item := probe.receive(timeout=0.5)) is not None:
        if getattr(item, "payload", b"") and msg.peek_frame(item.payload)[0] == 1:
            captured.append(item.payload)
    probe.close(timeout=1.0, announce_offline=False)
    assert captured, "no update of round 1 seen"
    return captured, first


def test_an_update_signed_by_another_board_or_replayed_from_an_earlier_run_is_refused(
        tmp_path, mosquitto_server):
    config = load_run_config(write_config(tmp_path))
    fed = f"sig-{uid()}"
    topics = Topics(fed)
    agg_key = signing.generate_key()
    keys = {"client-0": signing.generate_key(), "client-1": signing.generate_key()}
    run = prepare_run(config, progress=False)

    # run A: capture client-0's signed update of round 1 from the broker
    captured, first = _signed_updates_of_round_one(tmp_path, config, run,
                                                   mosquitto_server.url, fed, agg_key, keys)

    # run B (a new run id): client-0 is not up yet; its old update is replayed, and client-1
    # (a rogue board) sends an update in client-0's name, signed with its own key
    second = SignedRun(tmp_path, config, mosquitto_server.url, fed, agg_key, keys,
                       state="agg-b").start()
    agg = second.aggregator
    assert agg.run_id != first.result.run_id
    raw = RawPublisher(mosquitto_server.url)
    try:
        for payload in captured:
            raw.publish(topics.update("client-0"), payload)
        wait_for(lambda: agg.stats.get("bad_signatures", 0) >= 1, what="the replay refused")
        table = run.model.table
        w = np.zeros(run.model.n_params, dtype=np.float32)
        posing = wire.encode("update", 1, "client-0", {"params": w},
                             msg.update_scalars(_update(w), agg.run_id, 0.1), table,
                             sign=Signer(keys["client-1"], "client-0", fed).frame_signer(
                                 agg.run_id))
        raw.publish(topics.update("client-0"), posing)
        wait_for(lambda: agg.stats.get("bad_signatures", 0) >= 2, what="the forgery refused")
        # client-1 signing honestly as itself, in a frame naming client-0 on its topic: a
        # good signature, but an update counts only signed by the board it is from
        as_itself = wire.encode("update", 1, "client-0", {"params": w},
                                msg.update_scalars(_update(w), agg.run_id, 0.1), table,
                                sign=Signer(keys["client-1"], "client-1", fed).frame_signer(
                                    agg.run_id))
        raw.publish(topics.update("client-0"), as_itself)
        wait_for(lambda: agg.stats.get("bad_signatures", 0) >= 3,
                 what="another board's own signature refused")
        unsigned = wire.encode("update", 1, "client-0", {"params": w},
                               msg.update_scalars(_update(w), agg.run_id, 0.1), table)
        raw.publish(topics.update("client-0"), unsigned)
        wait_for(lambda: agg.stats.get("bad_signatures", 0) >= 4, what="unsigned refused")
        assert "client-0" not in agg.open.received and agg.open.round == 1
    finally:
        raw.close()
    # the real boards: the run completes with the in-process model
    boards = [board(tmp_path / "b", run, mosquitto_server.url, fed, n, keys[n], [agg_key])
              for n in keys]
    result = second.finish()
    for _, t in boards:
        t.join(10)
    assert [h["updates"] for h in result.history] == [2, 2]
    from edgefl.checkpoint import model_sha256
    assert model_sha256(result.params) == reference_sha(config)


def test_an_update_replayed_from_an_earlier_run_of_the_same_id_is_refused(
        tmp_path, mosquitto_server):
    """A run id names one run only while the aggregator's state lasts: its state directory
    wiped, the id r1 is given again, and client-0's round-1 update of the earlier r1 still
    verifies for run r1, round 1, client-0 (the board's key outlives the state). Replayed
    before the board's own, it was taken as client-0's answer and the board's real update
    dropped as a duplicate. The update names the model it was trained from (its signed
    `base`), which is not the new run's: refused, and the run ends on its own model."""
    url = mosquitto_server.url
    fed = f"sig-{uid()}"
    topics = Topics(fed)
    agg_key = signing.generate_key()
    keys = {"client-0": signing.generate_key(), "client-1": signing.generate_key()}
    earlier_config = load_run_config(write_config(tmp_path, seed=1))
    config = load_run_config(write_config(tmp_path))
    earlier_run = prepare_run(earlier_config, progress=False)
    run = prepare_run(config, progress=False)

    captured, first = _signed_updates_of_round_one(tmp_path, earlier_config, earlier_run, url,
                                                   fed, agg_key, keys, run_id="r1")

    # the state wiped (another state directory), r1 started again
    second = SignedRun(tmp_path, config, url, fed, agg_key, keys, state="agg-b",
                       run_id="r1").start()
    agg = second.aggregator
    assert agg.run_id == first.result.run_id == "r1"
    raw = RawPublisher(url)
    try:
        for payload in captured:
            raw.publish(topics.update("client-0"), payload)
        wait_for(lambda: agg.stats["rejected"] >= 1 or "client-0" in agg.open.received,
                 what="the aggregator to act on the replayed update")
        assert "client-0" not in agg.open.received, "the earlier r1's update was taken"
    finally:
        raw.close()
    boards = [board(tmp_path / "b", run, url, fed, n, keys[n], [agg_key]) for n in keys]
    result = second.finish()
    for _, t in boards:
        t.join(10)
    assert [h["updates"] for h in result.history] == [2, 2]
    from edgefl.checkpoint import model_sha256
    assert model_sha256(result.params) == reference_sha(config)


def _update(w, **scalars):
    from edgefl.strategies import Update
    return Update({"params": w}, 10, 0.5, 1, scalars)


def test_an_asynchronous_aggregator_refuses_unsigned_forged_and_replayed_updates(
        tmp_path, mosquitto_server):
    """FedBuff's aggregator (roles/asynchronous.py) takes updates on its own path: with
    keys.fleet it must refuse, as the synchronous one does, an update that is unsigned,
    signed by another board's key, or signed for another run, and keep the task in flight
    for the board's own."""
    from edgefl.roles.asynchronous import aggregator_class
    from edgefl.roles.aggregator import secure_plan
    config = load_run_config(write_config(
        tmp_path, strategy={"name": "fedbuff", "concurrency": 2, "buffer_size": 1,
                            "max_staleness": 4}))
    fed = f"sig-{uid()}"
    topics = Topics(fed)
    keys = {"client-0": signing.generate_key(), "client-1": signing.generate_key()}
    run = prepare_run(config, progress=False)
    plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                   config.clients_per_round, ("client-0", "client-1"),
                   description=config.to_dict(), **secure_plan(run))
    trust = Trust(fed, signer=Signer(signing.generate_key(), "aggregator", fed),
                  uplink=Verifier(fed, {n: [k.public_key()] for n, k in keys.items()}))
    cls = aggregator_class(plan)
    assert cls.__name__ == "AsynchronousAggregator"
    agg = cls(plan, mqtt(mosquitto_server.url, "aggregator"), tmp_path / "agg",
              AggregatorSettings(node_id="aggregator", federation=fed, round_timeout_s=60.0,
                                 trust=trust))
    thread = threading.Thread(target=agg.run, daemon=True)
    thread.start()
    raw = RawPublisher(mosquitto_server.url)
    try:
        entry = wait_for(lambda: getattr(agg, "book", {}).get("flight", {}).get("client-0"),
                         what="client-0's task in flight", timeout=20.0)
        task, version = entry["task"], entry["version"]
        w = np.zeros(run.model.n_params, dtype=np.float32)
        scalars = msg.update_scalars(_update(w, version=version), agg.ckpt.run_id, 0.1)
        table = run.model.table
        forgeries = [
            wire.encode("update", task, "client-0", {"params": w}, scalars, table),
            wire.encode("update", task, "client-0", {"params": w}, scalars, table,
                        sign=Signer(keys["client-1"], "client-0", fed).frame_signer(
                            agg.ckpt.run_id)),
            wire.encode("update", task, "client-0", {"params": w}, scalars, table,
                        sign=Signer(keys["client-0"], "client-0", fed).frame_signer(
                            "an-earlier-run"))]
        for i, payload in enumerate(forgeries, 1):
            raw.publish(topics.update("client-0"), payload)
            wait_for(lambda: agg.stats.get("bad_signatures", 0) >= i or agg.ckpt.round > 0,
                     what=f"forgery {i} refused for its signature, or taken")
            assert agg.ckpt.round == 0, f"forgery {i} was applied as client-0's update"
        assert agg.book["flight"]["client-0"]["task"] == task and not agg.buffer
        # client-0's update of this task of an earlier run of the same id (the state wiped,
        # the id given again: task ids start at 1 again), signed as well: it names the model
        # it was trained from, not this task's
        rejected = agg.stats.get("rejected", 0)
        earlier = msg.update_scalars(_update(w, version=version), agg.ckpt.run_id, 0.1,
                                     base="ab" * 32)
        raw.publish(topics.update("client-0"), wire.encode(
            "update", task, "client-0", {"params": w}, earlier, table,
            sign=Signer(keys["client-0"], "client-0", fed).frame_signer(agg.ckpt.run_id)))
        wait_for(lambda: agg.stats.get("rejected", 0) > rejected or agg.ckpt.round > 0,
                 what="the earlier run's update refused, or taken")
        assert agg.ckpt.round == 0, "an earlier run's update was applied as client-0's"
        assert agg.book["flight"]["client-0"]["task"] == task and not agg.buffer
        # the board's own, signed with its key for this run: taken (K = 1: a step)
        base = agg.book["flight"]["client-0"]["doc"]["tasks"]["client-0"]["model_sha256"]
        scalars = msg.update_scalars(_update(w, version=version), agg.ckpt.run_id, 0.1,
                                     base=base)
        raw.publish(topics.update("client-0"), wire.encode(
            "update", task, "client-0", {"params": w}, scalars, table,
            sign=Signer(keys["client-0"], "client-0", fed).frame_signer(agg.ckpt.run_id)))
        wait_for(lambda: agg.ckpt.round >= 1, what="the signed update applied")
    finally:
        raw.close()
        agg.stop.set()
        thread.join(20)


def test_signed_copies_of_the_model_to_a_few_of_many_boards_verify_and_give_the_reference(
        tmp_path, mosquitto_server):
    """2 of 8 boards tasked a round: the aggregator sends each its own signed copy of the
    model (client_model frames), the copies sharing the model's payload hash, round 2's
    taken from the journal's hash of round 1; every board checks its copy, and the run
    ends on the in-process simulation's model."""
    from edgefl.checkpoint import model_sha256
    config = load_run_config(write_config(tmp_path, partition={"name": "iid", "clients": 8},
                                          clients_per_round=2, rounds=2))
    fed = f"sig-{uid()}"
    agg_key = signing.generate_key()
    keys = {f"client-{i}": signing.generate_key() for i in range(8)}
    run = prepare_run(config, progress=False)
    signed = SignedRun(tmp_path, config, mosquitto_server.url, fed, agg_key, keys,
                       ids=tuple(keys)).start()
    boards = [board(tmp_path, run, mosquitto_server.url, fed, n, keys[n], [agg_key])
              for n in keys]
    result = signed.finish()
    for client, t in boards:
        t.join(10)
        assert client.stats["rejected"] == 0, client.node
    assert sum(client.stats["trained"] for client, _ in boards) == 4
    assert model_sha256(result.params) == reference_sha(config)


def test_a_signed_copy_of_an_earlier_run_of_the_same_id_replayed_to_a_board_is_refused(
        tmp_path, mosquitto_server):
    """A run id names one run only while the aggregator's state lasts: wiped, the id r1 can
    be given again, and everything the earlier r1 signed still verifies for run r1 (same
    key). Whoever can publish on the broker replays the earlier r1's round-1 copy of the
    model for client-0 (a client_model frame, signed for r1, round 1, client-0) while the
    new r1's round 1 is announced. The board must not train from it: its announcement names
    another frame and another model sha256. It trains from the new run's own copy."""
    config = load_run_config(write_config(tmp_path))
    run = prepare_run(config, progress=False)
    url, fed = mosquitto_server.url, f"sig-{uid()}"
    topics = Topics(fed)
    agg_key = signing.generate_key()
    signer = Signer(agg_key, "aggregator", fed)
    table = run.model.table

    def copy(params, message_id=None):
        return wire.encode("client_model", 1, "aggregator", {"params": params}, {"run": "r1"},
                           table, recipient="client-0", message_id=message_id,
                           sign=signer.frame_signer("r1"))

    # the earlier r1's copy (its round-1 model was another: another seed, another config)
    earlier = copy(np.full(run.model.n_params, 0.25, np.float32))
    params = np.asarray(run.init_params, np.float32)
    copy_id = wire.new_message_id()
    doc = forged_announcement(run, run_id="r1")
    doc["model_sha256"] = msg.buffers_sha256({"params": params})
    doc["tasks"]["client-0"]["model_frame"] = f"{copy_id:016x}"
    announcement = signer.sign_doc(doc, "announce", "r1", 1)
    client, thread = board(tmp_path, run, url, fed, "client-0", signing.generate_key(),
                           [agg_key])
    raw = RawPublisher(url)
    try:
        raw.publish(topics.round(), json.dumps(announcement), retain=True)
        wait_for(lambda: client.ann is not None, what="the board to take the announcement")
        raw.publish(topics.client_model("client-0"), earlier)
        wait_for(lambda: client.stats["rejected"] or client.job is not None
                 or client.stats["trained"], what="the board to act on the replayed copy")
        assert client.job is None and client.stats["trained"] == 0, \
            "the board trained from the earlier run's model"
        assert client.stats["rejected"] == 1
        raw.publish(topics.client_model("client-0"), copy(params, copy_id))
        wait_for(lambda: client.stats["trained"] == 1, what="the board to train the run's model")
    finally:
        raw.publish(topics.round(), b"", retain=True)
        raw.close()
        client.stop.set()
        thread.join(10)


def test_key_rotation_two_accepted_keys_during_the_change_over(tmp_path, mosquitto_server):
    """Boards hold [old, new] aggregator keys while the aggregator moves from old to new:
    they follow a run signed with either. A board that already dropped the old key (or was
    set up with the new one only) refuses the old key's run."""
    config = load_run_config(write_config(tmp_path, rounds=1))
    fed = f"sig-{uid()}"
    old, new = signing.generate_key(), signing.generate_key()
    keys = {"client-0": signing.generate_key(), "client-1": signing.generate_key()}
    run = prepare_run(config, progress=False)
    results = []
    # a board outside the run (not tasked) holding only the new key: it still checks
    # every announcement it sees
    observer, observer_thread = board(tmp_path / "observer", run, mosquitto_server.url, fed,
                                      "client-9", None, [new], exit_when_finished=False)
    try:
        for step, agg_key in enumerate((old, new)):
            rejected_before = observer.stats["rejected"]
            signed = SignedRun(tmp_path, config, mosquitto_server.url, fed, agg_key, keys,
                               state=f"agg-{step}").start()
            boards = [board(tmp_path / f"b{step}", run, mosquitto_server.url, fed, n, keys[n],
                            [old, new]) for n in keys]
            results.append(signed.finish())
            for client, t in boards:
                t.join(10)
                assert client.stats["trained"] == 1 and client.stats["rejected"] == 0
            wait_for(lambda: observer.ann is not None or observer.stats["rejected"]
                     > rejected_before, what="the observer to see the run")
            if agg_key is old:
                wait_for(lambda: observer.stats["rejected"] > rejected_before,
                         what="the old key refused by a board holding only the new one")
                assert observer.ann is None
            else:
                wait_for(lambda: observer.ann is not None and observer.ann["run"]
                         == results[-1].run_id, what="the new key's run followed")
    finally:
        observer.stop.set()
        observer_thread.join(10)
    assert [len(r.history) for r in results] == [1, 1]


def test_commands_must_be_signed_and_a_replayed_one_is_refused_even_after_a_restart(
        tmp_path, mosquitto_server, capsys):
    from edgefl.roles.control import ControlClient
    from edgefl.roles.daemon import Daemon, DaemonSettings

    fed = f"sig-{uid()}"
    topics = Topics(fed)
    operator, intruder = signing.generate_key(), signing.generate_key()
    trust = Trust(fed, operators=Verifier(fed, {"*": [operator.public_key()]}),
                  command_window_s=60.0)
    settings = DaemonSettings(AggregatorSettings(node_id="aggregator", federation=fed,
                                                 trust=trust), idle_poll_s=0.1)

    def start():
        stop = threading.Event()
        daemon = Daemon(settings, str(tmp_path / "agg"), lambda cid, **o: MqttTransport(
            mosquitto_server.url, f"{cid}-{uid()}", reconnect_min=0.05, reconnect_max=0.5,
            connect_timeout=5.0, **o), stop=stop)
        thread = threading.Thread(target=daemon.run, daemon=True)
        thread.start()
        wait_for(daemon.ready.is_set, what="the control connection")
        return stop, thread

    requester = mqtt(mosquitto_server.url, "operator")
    requester.connect()
    stop, thread = start()
    try:
        signed = ControlClient(requester, topics, "alice",
                               signer=Signer(operator, "alice", fed))
        assert signed.request({"cmd": "status"}, timeout=20)["ok"]
        for signer, why in ((None, "unsigned"),
                            (Signer(intruder, "alice", fed), "not one of the trusted keys")):
            reply = ControlClient(requester, topics, "bob", signer=signer).request(
                {"cmd": "status"}, timeout=20)
            assert not reply["ok"] and why in reply["error"], reply
        too_long = ControlClient(requester, topics, "alice", expires_in=3600,
                                 signer=Signer(operator, "alice", fed))
        reply = too_long.request({"cmd": "status"}, timeout=20)
        assert not reply["ok"] and "keys.command_window" in reply["error"], reply

        # a signed command captured and replayed after the service restarted (its memory of
        # answered commands is gone; the nonce file is not)
        doc = Signer(operator, "alice", fed).sign_doc(
            {"cmd": "status", "reply_to": topics.reply("eve"), "request_id": "1"}, "command",
            "", 0, expires_in=30)
        replies = mqtt(mosquitto_server.url, "eve")
        replies.connect()
        replies.subscribe(topics.reply("eve"), qos=1)

        def next_reply():
            def got():
                item = replies.receive(timeout=0.2)
                return json.loads(item.payload) if getattr(item, "payload", b"") else None
            return wait_for(got, what="a reply", timeout=20)

        requester.publish(topics.ctl(), json.dumps(doc).encode(), qos=1)
        assert next_reply()["ok"]
        stop.set()
        thread.join(30)
        stop, thread = start()
        requester.publish(topics.ctl(), json.dumps(doc).encode(), qos=1)
        reply = next_reply()
        assert not reply["ok"] and "was used already (a replayed command)" in reply["error"]
        replies.close(timeout=1.0, announce_offline=False)

        # `edgefl ctl` signs with --operator-key; without it the service refuses
        write_key_pair(tmp_path / "operator", operator)
        base = ["ctl", "status", "--broker", mosquitto_server.url, "--federation", fed,
                "--timeout", "20"]
        assert main(base + ["--operator-key", str(tmp_path / "operator")]) == 0
        assert main(base) == 1
        assert "refused: command status: unsigned" in capsys.readouterr().err

    finally:
        stop.set()
        thread.join(30)
        requester.close(timeout=1.0, announce_offline=False)


# ---------------------------------------------------------------------------------------
# replies to commands: signed by the aggregator's key, checked by `edgefl ctl`
# ---------------------------------------------------------------------------------------

def control_service(tmp_path, url, fed, trust, state):
    """An aggregator service (its control thread) on `fed` with `trust`; (stop, thread)."""
    from edgefl.roles.daemon import Daemon, DaemonSettings

    stop = threading.Event()
    settings = DaemonSettings(AggregatorSettings(node_id="aggregator", federation=fed,
                                                 trust=trust), idle_poll_s=0.1)
    daemon = Daemon(settings, str(tmp_path / state), lambda cid, **o: MqttTransport(
        url, f"{cid}-{uid()}", reconnect_min=0.05, reconnect_max=0.5, connect_timeout=5.0,
        **o), stop=stop)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    wait_for(daemon.ready.is_set, what="the control connection")
    return stop, thread


def stop_service(service):
    stop, thread = service
    stop.set()
    thread.join(30)
    assert not thread.is_alive()


class ReplyForger:
    """A compromised broker, or an account the ACL lets publish on reply/+: it reads every
    command on the ctl topic and answers it itself, `answer(command, address)` being the
    payload it sends to the command's reply address, with the command's own correlation
    data (a property anyone publishing may set)."""

    def __init__(self, url, topics, answer):
        from edgefl.roles.control import reply_address

        self.transport = MqttTransport(url, f"forger-{uid()}", protocol="5")
        self.transport.connect()
        self.transport.subscribe(topics.ctl(), qos=1)
        self.stop = threading.Event()

        def body():
            while not self.stop.is_set():
                item = self.transport.receive(timeout=0.1)
                if getattr(item, "topic", None) != topics.ctl():
                    continue
                command = json.loads(item.payload)
                address = reply_address(item, command, topics)
                self.transport.publish(address.topic, answer(command, address), qos=1,
                                       correlation_data=address.correlation_data)
        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.transport.close(timeout=1.0, announce_offline=False)


def test_ctl_checks_the_aggregators_reply_signature_and_refuses_forged_and_replayed_ones(
        tmp_path, mosquitto_server):
    from edgefl.roles.control import ControlClient, ReplyRefused, reply_payload

    url, fed = mosquitto_server.url, f"rep-{uid()}"
    topics = Topics(fed)
    agg_key, intruder = signing.generate_key(), signing.generate_key()
    verifier = Verifier(fed, {"*": [agg_key.public_key()]})
    v311, v5 = mqtt(url, "op311"), MqttTransport(url, f"op5-{uid()}", protocol="5")
    spy = mqtt(url, "spy")
    for t in (v311, v5, spy):
        t.connect()
    spy.subscribe(topics.reply("alice"), qos=1)

    def ask(mqtt5, cmd="status", timeout=20.0, checked=True):
        return ControlClient(v5 if mqtt5 else v311, topics, "alice", mqtt5=mqtt5,
                             verifier=verifier if checked else None).request(
            {"cmd": cmd}, timeout=timeout)

    # an aggregator of before signed replies (or one without keys.signing_key): refused as
    # unsigned, at once, not after the timeout; without the key, ctl takes it as before
    service = control_service(tmp_path, url, fed, None, "old")
    try:
        for mqtt5 in (False, True):
            began = time.monotonic()
            with pytest.raises(ReplyRefused, match=r"status: reply .* unsigned") as refused:
                ask(mqtt5, timeout=30)
            assert time.monotonic() - began < 10, "refused only at the timeout"
            assert "no reply" not in str(refused.value)
            assert ask(mqtt5, checked=False)["ok"]
    finally:
        stop_service(service)

    # the aggregator signs with its keys.signing_key: genuine replies are taken
    trust = Trust(fed, signer=Signer(agg_key, "aggregator", fed))
    service = control_service(tmp_path, url, fed, trust, "agg")
    try:
        for mqtt5 in (False, True):
            reply = ask(mqtt5)
            assert reply["ok"] and reply["cmd"] == "status", reply
            assert reply["sig"]["kind"] == "reply" and reply["sig"]["fed"] == fed
            assert reply["sig"]["exp"] - reply["sig"]["at"] <= 60
            assert ask(mqtt5, checked=False)["ok"]      # a ctl without the key: as before
        # a repeated command is answered from the reply memory, signed afresh (a resend
        # after a lost reply must not get one that has expired meanwhile)
        command = json.dumps({"cmd": "runs", "reply_to": topics.reply("alice"),
                              "request_id": "again"}).encode()
        def answer_again():
            item = v311.receive(timeout=0.2)     # (the replies to the requests above too)
            doc = json.loads(item.payload) if getattr(item, "payload", None) else {}
            return doc if doc.get("request_id") == "again" else None

        repeats = []
        for _ in range(2):
            v311.publish(topics.ctl(), command, qos=1)
            repeats.append(wait_for(answer_again, what="the reply"))
        assert [r["request_id"] for r in repeats] == ["again", "again"]
        assert repeats[0]["sig"]["nonce"] != repeats[1]["sig"]["nonce"]
        for r in repeats:
            verifier.verify_doc(r, kind="reply", where="repeat")
    finally:
        stop_service(service)
    genuine = {}         # mqtt5 -> the first signed reply its requester got, as it was sent
    for item in iter(lambda: spy.receive(timeout=1.0), None):
        doc = json.loads(item.payload) if getattr(item, "payload", None) else {}
        if doc.get("sig"):       # an MQTT 5 request has its token as a property, not here
            genuine.setdefault(doc["request_id"] is None, item.payload)
    spy.close(timeout=1.0, announce_offline=False)
    assert set(genuine) == {False, True}

    # from here no aggregator runs: every reply is the forger's
    def forged(answer, why, mqtt5=True, cmd="stop", error=ReplyRefused):
        forger = ReplyForger(url, topics, answer)
        try:
            with pytest.raises(error, match=why):
                ask(mqtt5, cmd, timeout=3.0 if error is TimeoutError else 20.0)
        finally:
            forger.close()

    fake_stop = {"run": "digits-1", "state": "stopped"}
    for mqtt5 in (False, True):
        forged(lambda c, a: reply_payload(c["cmd"], a, result=fake_stop),
               r"stop: reply .*unsigned", mqtt5)
        forged(lambda c, a: reply_payload(c["cmd"], a, result=fake_stop,
                                          signer=Signer(intruder, "aggregator", fed)),
               "not one of the trusted keys", mqtt5)
        # the aggregator's own key, but signed for another federation, another command, or
        # long ago
        forged(lambda c, a: reply_payload(c["cmd"], a, result=fake_stop,
                                          signer=Signer(agg_key, "aggregator", "other")),
               "signed for federation 'other'", mqtt5)
        forged(lambda c, a: reply_payload("status", a, result={"active": None},
                                          signer=Signer(agg_key, "aggregator", fed)),
               r"reply to 'status', this command is 'stop'", mqtt5)
        forged(lambda c, a: json.dumps(Signer(agg_key, "aggregator", fed).sign_doc(
            json.loads(reply_payload(c["cmd"], a, result=fake_stop)), "reply", "", 0,
            expires_in=-5.0)).encode(), "expired", mqtt5)
    # a genuine reply replayed to another request: over MQTT 5 the forger sets the new
    # request's correlation data, which the signature does not cover; the signed copy in
    # the payload is the old request's
    forged(lambda c, a: genuine[True], r"signed for request .*replayed", True, "status")
    # over 3.1.1 the token is in the signed payload: the old request's, never taken for
    # this one (the requester waits for its own, here until its timeout)
    forged(lambda c, a: genuine[False], "no reply", False, "status", TimeoutError)
    for t in (v311, v5):
        t.close(timeout=1.0, announce_offline=False)


def test_edgefl_ctl_takes_the_aggregator_key_from_its_option_or_the_site_file(
        tmp_path, mosquitto_server, capsys):
    url, fed = mosquitto_server.url, f"rep-{uid()}"
    agg_key, agg_private, agg_pub = keypair(tmp_path, "aggregator")
    _, _, other_pub = keypair(tmp_path, "other")
    site = tmp_path / "aggregator.yaml"
    site.write_text(yaml.safe_dump({"node": {"id": "aggregator", "federation": fed},
                                    "broker": {"url": url},
                                    "keys": {"signing_key": "keys/aggregator",
                                             "aggregator": "keys/aggregator.pub"}}))
    by_option = ["ctl", "status", "--broker", url, "--federation", fed, "--timeout", "20",
                 "--aggregator-key", agg_pub]
    by_site = ["ctl", "status", "--config", str(site), "--timeout", "20"]
    # on the aggregator's host its own site file names its private key only: ctl checks
    # with the public key beside it (as `edgefl keys gen` writes it)
    own = tmp_path / "aggregator-own.yaml"
    own.write_text(yaml.safe_dump({"node": {"id": "aggregator", "federation": fed},
                                   "broker": {"url": url},
                                   "keys": {"signing_key": "keys/aggregator"}}))
    by_own_site = ["ctl", "status", "--config", str(own), "--timeout", "20"]

    service = control_service(tmp_path, url, fed, None, "old")      # unsigned replies
    try:
        for argv in (by_option, by_site, by_own_site):
            assert main(argv) == 1
            err = capsys.readouterr().err
            assert "edgefl ctl: status: reply on" in err and "unsigned" in err, err
            assert "no reply" not in err, err
        # watch starts from a status reply: refused, it prints nothing of it and ends
        assert main(["ctl", "watch", "--run", "r1"] + by_option[2:]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and "edgefl ctl watch: status: reply on" in captured.err
        assert "unsigned" in captured.err, captured.err
    finally:
        stop_service(service)

    config = load_service_config("aggregator", str(site))
    service = control_service(tmp_path, url, fed, Trust.from_service_config(
        config, "aggregator"), "agg")
    try:
        for argv in (by_option, by_site, by_own_site):
            assert main(argv) == 0
            assert "no active run" in capsys.readouterr().out
        # a key the aggregator does not sign with: refused, naming the key
        assert main(by_option[:-1] + [other_pub]) == 1
        assert "not one of the trusted keys" in capsys.readouterr().err
        # two keys, as during a change-over: either verifies
        assert main(by_option + ["--aggregator-key", other_pub]) == 0
        capsys.readouterr()
        # the aggregator's refusal of a command it cannot read is its signed answer too
        # (it names the command, so it is taken as the answer to this one)
        assert main(["ctl", "stop", "--run", "a/b"] + by_option[2:]) == 1
        err = capsys.readouterr().err
        assert "edgefl ctl stop: refused: stop: run: 'a/b' contains '/'" in err, err
    finally:
        stop_service(service)
    # the aggregator's own site file whose key has no .pub beside it: checked by nothing,
    # and said so
    os.rename(agg_pub, agg_pub + ".away")
    try:
        assert main(by_own_site + ["--timeout", "1"]) == 1     # (no service: no reply)
    finally:
        os.rename(agg_pub + ".away", agg_pub)
    err = capsys.readouterr().err
    assert "aggregator.pub is not there" in err and "not checked" in err, err
    # a private key where the aggregator's public key belongs: named, before connecting
    assert main(by_option[:-1] + [agg_private]) == 1
    err = capsys.readouterr().err
    assert "error: --aggregator-key" in err and "a private key, not a public key" in err, err


# ---------------------------------------------------------------------------------------
# the service's events and run records: signed by the aggregator's key, checked by ctl watch
# ---------------------------------------------------------------------------------------

def test_an_event_or_run_record_signature_binds_its_body_kind_run_federation_and_time():
    from edgefl.roles.signed_log import check_event, check_record, signed_event, signed_record

    fed, key = f"log-{uid()}", signing.generate_key()
    signer, verifier = Signer(key, "aggregator", fed), Verifier(fed, {"*": [key.public_key()]})
    topic = Topics(fed).events()
    event = signed_event({"event": "round_closed", "run": "r1", "round": 2,
                          "test_accuracy": np.float32(0.5), "at": time.time()}, signer)
    check_event(json.loads(json.dumps(event)), verifier, topic,
                not_before=time.time() - 5)
    record = signed_record({"id": "r1", "state": "running", "rounds_done": 1}, signer)
    check_record(record, verifier, "edgefl/x/runs/r1", "r1")
    # another event made of it, another run, a record passed off as an event, or the other
    # way round, another federation, an unsigned one, and an event signed long before the
    # watch began (not retained: a replay)
    cases = [
        (lambda: check_event({**event, "event": "run_finished"}, verifier, topic),
         "altered after signing"),
        (lambda: check_event({**event, "run": "r2"}, verifier, topic), "altered after"),
        (lambda: check_event(signed_event({"event": "run_finished", "run": "r1"}, Signer(
            key, "aggregator", "other")), verifier, topic), "signed for federation 'other'"),
        (lambda: check_event(signed_record({"id": "r1", "event": "run_finished",
                                            "run": "r1"}, signer), verifier, topic),
         "signed as a 'run_record', used as a 'event'"),
        (lambda: check_record(signed_event({"id": "r1", "state": "finished", "run": "r1"},
                                           signer), verifier, "t", "r1"),
         "signed as a 'event', used as a 'run_record'"),
        (lambda: check_record(record, verifier, "edgefl/x/runs/r2", "r2"),
         "signed for run 'r1', not 'r2'"),
        (lambda: check_event({"event": "run_finished", "run": "r1"}, verifier, topic),
         r"event on .*/events: unsigned .*older than signed events"),
        (lambda: check_record({"id": "r1", "state": "finished"}, verifier, "t", "r1"),
         r"run record on t: unsigned"),
        (lambda: check_event(event, verifier, topic, not_before=time.time() + 60),
         "before this watch began"),
    ]
    for call, why in cases:
        with pytest.raises(SignatureError, match=why):
            call()


def test_watch_takes_a_resumed_runs_record_by_its_resumed_time():
    """watch without --run learns its run from a run_started or run_resumed event signed
    after it began, and takes that run's records only if they say the run started no
    earlier. A run the service tried again keeps its first start time, so its genuine
    records were refused as an earlier run's (the service restarted, or the run waited
    between tries after a full disk): the service now records when it last tried the run
    (`resumed`), and that is the time checked when the record has it. Which event the
    run's aggregator sends depends on its checkpoint, not on the service's tries: a first
    try over a checkpoint the service did not know says run_resumed with `started` alone,
    a restart before round 1 run_started with `resumed`; watch checks both alike."""
    from edgefl.roles.signed_log import check_record, events_not_before, signed_record

    fed, key = f"log-{uid()}", signing.generate_key()
    signer, verifier = Signer(key, "aggregator", fed), Verifier(fed, {"*": [key.public_key()]})
    began = time.time()
    not_before = events_not_before(began, {"at": began})
    tried_again = signed_record({"id": "r1", "state": "finished", "created": began - 3600,
                                 "started": began - 3590, "resumed": began + 2,
                                 "ended": began + 5}, signer)
    first_try = signed_record({"id": "r1", "state": "running", "created": began - 3600,
                               "started": began + 1}, signer)
    for genuine in (tried_again, first_try):
        check_record(genuine, verifier, "edgefl/x/runs/r1", "r1", not_before=not_before,
                     since="started")
    earlier = signed_record({"id": "r1", "state": "finished", "created": began - 7200,
                             "started": began - 7190, "resumed": began - 7000}, signer)
    with pytest.raises(SignatureError, match="resumed .*before this reader began listening"):
        check_record(earlier, verifier, "edgefl/x/runs/r1", "r1", not_before=not_before,
                     since="started")


def test_watch_takes_the_aggregators_time_from_its_signed_status_reply():
    """Events are not retained: one signed before watch subscribed is a replay. The clocks
    may differ, so the bound is the aggregator's own time, from the signed status reply
    watch starts from, less a margin for the reply's way back (an earlier run's genuine
    events, replayed a minute later, are refused); without that reply, watch's own time less
    the clocks' allowance."""
    from edgefl.roles.signed_log import REPLAY_MARGIN_S, events_not_before
    from edgefl.transport.signing import MAX_SKEW_S

    began = 1_700_000_000.0
    assert events_not_before(began, {"ok": True, "at": began + 120.0}) == \
        began + 120.0 - REPLAY_MARGIN_S              # its clock 2 minutes ahead: followed
    assert REPLAY_MARGIN_S <= 30 < MAX_SKEW_S
    for reply in (None, {}, {"at": "soon"}, {"at": True}, {"at": float("nan")}):
        assert events_not_before(began, reply) == began - MAX_SKEW_S


def _watch(tmp_path, url, fed, *args):
    """A real `edgefl ctl watch` process; (process, its stderr's path)."""
    err_path = tmp_path / f"watch-{uid()}.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "ctl", "watch", "--broker",
                                 url, "--federation", fed, *args], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
    return proc, err_path


def _start_r1(url, topics):
    """Run r1 (BASE, over client-0 and client-1) started on the service, as an operator."""
    from edgefl.roles.control import ControlClient

    requester = mqtt(url, "op")
    requester.connect()
    try:
        reply = ControlClient(requester, topics, "op").request(
            {"cmd": "start", "config": dict(BASE), "run": "r1",
             "clients": ["client-0", "client-1"]}, timeout=20)
    finally:
        requester.close(timeout=1.0, announce_offline=False)
    assert reply["ok"], reply


def test_ctl_watch_refuses_forged_events_and_run_records_and_ends_on_the_genuine_end(
        tmp_path, mosquitto_server):
    """A compromised broker (here: the test, publishing as anyone may on an anonymous
    broker) forges the end of the watched run: a `run_finished` event and a retained
    `finished` record. `edgefl ctl watch` given the aggregator's key refuses each, naming
    the topic and the cause, keeps watching, and ends on the real service's signed
    run_finished when the run really finishes."""
    from edgefl.roles.signed_log import signed_event, signed_record

    url, fed = mosquitto_server.url, f"ev-{uid()}"
    topics = Topics(fed)
    agg_key, _, agg_pub = keypair(tmp_path, "aggregator")
    intruder = signing.generate_key()
    config = load_run_config(write_config(tmp_path))
    run = prepare_run(config, progress=False)
    service = control_service(tmp_path, url, fed,
                              Trust(fed, signer=Signer(agg_key, "aggregator", fed)), "agg")
    watch, err_path = _watch(tmp_path, url, fed, "--run", "r1", "--timeout", "90",
                             "--aggregator-key", agg_pub)
    forger = RawPublisher(url)
    boards = []
    try:
        wait_for(lambda: b"waiting" in err_path.read_bytes(), timeout=60,
                 what="ctl watch to wait for run r1")
        time.sleep(1.0)          # its subscription to runs/r1 follows that line
        fake = {"event": "run_finished", "run": "r1", "node": "aggregator", "rounds": 99,
                "model_sha256": "0" * 64, "at": time.time()}
        forger.publish(topics.run_record("r1"), json.dumps(
            {"id": "r1", "state": "finished", "rounds_done": 99, "rounds": 99}), retain=True)
        for doc in (fake,
                    signed_event(fake, Signer(intruder, "aggregator", fed)),
                    signed_event(fake, Signer(agg_key, "aggregator", "other-fed")),
                    # a genuine signature of another event, on this one
                    {**fake, "sig": signed_event({**fake, "event": "round_closed"},
                                                 Signer(agg_key, "aggregator", fed))["sig"]}):
            forger.publish(topics.events(), json.dumps(doc))
        # the record of another run, genuinely signed, moved onto this run's topic
        forger.publish(topics.run_record("r1"), json.dumps(signed_record(
            {"id": "r0", "state": "finished", "rounds_done": 99},
            Signer(agg_key, "aggregator", fed))), retain=True)
        wait_for(lambda: err_path.read_text().count("refused") >= 6 or watch.poll() is not None,
                 timeout=30, what="watch to refuse the six forgeries")
        time.sleep(1.0)
        assert watch.poll() is None, (watch.returncode, watch.stdout.read(),
                                      err_path.read_text())
        err = err_path.read_text()
        record_topic = topics.run_record("r1")
        for why in (f"run record on {record_topic}: unsigned",
                    f"event on {topics.events()}: unsigned",
                    "not one of the trusted keys", "signed for federation 'other-fed'",
                    "altered after signing", "signed for run 'r0', not 'r1'"):
            assert why in err, (why, err)
        assert "older than signed events" in err, err

        for node in ("client-0", "client-1"):
            boards.append(board(tmp_path, run, url, fed, node, None, [agg_key]))
        _start_r1(url, topics)
        out, _ = watch.communicate(timeout=120)
        out = out.decode()
        assert watch.returncode == 0, (out, err_path.read_text())
        finished = [line for line in out.splitlines() if "run_finished" in line]
        assert len(finished) == 1 and "rounds 2" in finished[0], out
        # the forgeries' 99 rounds, as watch would print them (a bare "99" also matched
        # the genuine lines' paths and hashes: pytest-199 in CI run 4)
        assert "rounds 99" not in out and " 99/" not in out and "sig" not in out, out
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
        forger.publish(topics.run_record("r1"), b"", retain=True)
        forger.close()
        stop_service(service)
        for client, thread in boards:
            client.stop.set()
            thread.join(10)


def test_ctl_watch_refuses_the_retained_record_of_an_earlier_run_of_the_same_id(
        tmp_path, mosquitto_server):
    """The aggregator's state directory was wiped (a reinstall, `rm -r fleet/state`) and the
    operator starts a run under an id it had used, r1. Whoever can publish on the broker
    kept the earlier r1's last record, `finished`, genuinely signed by the same key (the key
    outlives the state), and publishes it retained on runs/r1 after the new r1 started.
    `edgefl ctl watch --run r1` must not end on it as the new run's end: the record is of
    another run of that id (another `created`), refused on stderr naming the cause; watch
    ends on the new run's real end."""
    from edgefl.roles.signed_log import signed_record

    url, fed = mosquitto_server.url, f"ev-{uid()}"
    topics = Topics(fed)
    agg_key, _, agg_pub = keypair(tmp_path, "aggregator")
    config = load_run_config(write_config(tmp_path))
    run = prepare_run(config, progress=False)
    service = control_service(tmp_path, url, fed,
                              Trust(fed, signer=Signer(agg_key, "aggregator", fed)), "agg")
    forger = RawPublisher(url)
    boards, watch = [], None
    try:
        _start_r1(url, topics)               # no board yet: it stays in its first round
        reader = mqtt(url, "reader")         # its record says running: no later one comes
        reader.connect()
        reader.subscribe(topics.run_record("r1"), qos=1)

        def running():
            item = reader.receive(timeout=0.2)
            return item is not None and b'"running"' in getattr(item, "payload", b"")
        wait_for(running, timeout=30, what="run r1 to be running")
        reader.close(timeout=1.0, announce_offline=False)
        earlier = signed_record({"id": "r1", "state": "finished", "rounds_done": 2,
                                 "rounds": 2, "created": time.time() - 3600.0,
                                 "final_accuracy": 0.1234},
                                Signer(agg_key, "aggregator", fed))
        forger.publish(topics.run_record("r1"), json.dumps(earlier), retain=True)
        watch, err_path = _watch(tmp_path, url, fed, "--run", "r1", "--timeout", "90",
                                 "--aggregator-key", agg_pub)
        wait_for(lambda: "earlier run" in err_path.read_text() or watch.poll() is not None,
                 timeout=60, what="watch to refuse the earlier r1's record")
        assert watch.poll() is None, (watch.returncode, watch.stdout.read(),
                                      err_path.read_text())
        for node in ("client-0", "client-1"):
            boards.append(board(tmp_path, run, url, fed, node, None, [agg_key]))
        out, _ = watch.communicate(timeout=120)
        out = out.decode()
        assert watch.returncode == 0, (out, err_path.read_text())
        finished = [line for line in out.splitlines() if "run_finished" in line]
        assert len(finished) == 1 and "rounds 2" in finished[0], out
        assert "0.1234" not in out, out
    finally:
        if watch is not None and watch.poll() is None:
            watch.kill()
            watch.wait(10)
        forger.publish(topics.run_record("r1"), b"", retain=True)
        forger.close()
        stop_service(service)
        for client, thread in boards:
            client.stop.set()
            thread.join(10)


def test_ctl_watch_is_not_ended_by_unsigned_forgeries_once_the_aggregator_is_known_to_sign(
        tmp_path, mosquitto_server):
    """watch, given the aggregator's key and started while no run is active, starts from the
    service's status reply, signed: the aggregator signs, so its events are signed too. A
    forger who then sends only unsigned events (no signed one comes while the service is
    idle) must get them skipped, not end the watch with status 1 after --timeout as if the
    aggregator signed none; watch follows the run started next and ends on its real end,
    status 0."""
    url, fed = mosquitto_server.url, f"ev-{uid()}"
    topics = Topics(fed)
    agg_key, _, agg_pub = keypair(tmp_path, "aggregator")
    config = load_run_config(write_config(tmp_path))
    run = prepare_run(config, progress=False)
    service = control_service(tmp_path, url, fed,
                              Trust(fed, signer=Signer(agg_key, "aggregator", fed)), "agg")
    forger = RawPublisher(url)
    boards = []
    watch, err_path = _watch(tmp_path, url, fed, "--timeout", "3", "--aggregator-key", agg_pub)
    fake = {"event": "run_finished", "run": "r0", "node": "aggregator", "rounds": 1}
    try:
        def refused() -> int:
            forger.publish(topics.events(), json.dumps({**fake, "at": time.time()}))
            return err_path.read_text().count("unsigned (this node requires signatures)")
        wait_for(lambda: refused() >= 1 or watch.poll() is not None, timeout=60, poll=0.3,
                 what="watch to refuse an unsigned event")
        until = time.monotonic() + 5.0             # past --timeout, forging all along
        while time.monotonic() < until and watch.poll() is None:
            refused()
            time.sleep(0.3)
        assert watch.poll() is None, (watch.returncode, err_path.read_text()[-500:])
        for node in ("client-0", "client-1"):
            boards.append(board(tmp_path, run, url, fed, node, None, [agg_key]))
        _start_r1(url, topics)
        out, _ = watch.communicate(timeout=120)
        assert watch.returncode == 0, (out, err_path.read_text()[-500:])
        finished = [line for line in out.decode().splitlines() if "run_finished" in line]
        assert len(finished) == 1 and "rounds 2" in finished[0], out
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
        forger.close()
        stop_service(service)
        for client, thread in boards:
            client.stop.set()
            thread.join(10)


def test_ctl_watch_with_the_key_ends_with_an_error_on_an_aggregator_that_signs_no_events(
        tmp_path, mosquitto_server):
    """Mixed versions: an aggregator older than signed events (or without a signing key)
    publishes its events unsigned. watch with the key refuses each as unsigned, never acts
    on them (an unsigned run_finished is not an end), and, when nothing signed has come
    for --timeout seconds after the first, ends with status 1 and says why, rather than
    waiting forever. (Its status reply would be refused at once, test above; here no
    service answers it, so watch follows the events.)"""
    url, fed = mosquitto_server.url, f"ev-{uid()}"
    topics = Topics(fed)
    _, _, agg_pub = keypair(tmp_path, "aggregator")
    watch, err_path = _watch(tmp_path, url, fed, "--timeout", "3", "--mqtt", "3.1.1",
                             "--aggregator-key", agg_pub)
    old = RawPublisher(url)
    try:
        wait_for(lambda: b"watching the events anyway" in err_path.read_bytes(), timeout=60,
                 what="ctl watch to follow the events")
        for kind in ("run_started", "round_closed", "run_finished"):
            old.publish(topics.events(), json.dumps({"event": kind, "run": "r1", "round": 1,
                                                     "node": "aggregator",
                                                     "at": time.time()}))
        out, _ = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
        old.close()
    err = err_path.read_text()
    assert watch.returncode == 1, (out, err)
    assert b"run_finished" not in out, out
    assert err.count("unsigned") >= 3, err
    assert "no signed event or run record within 3 s" in err, err


# ---------------------------------------------------------------------------------------
# install-service
# ---------------------------------------------------------------------------------------

def test_install_service_places_the_key_0600_for_the_service_user_and_never_prints_it(
        tmp_path, capsys):
    from edgefl.service import install as inst

    _, _, agg_pub = keypair(tmp_path, "aggregator")
    stage = tmp_path / "stage"
    args = ["install-service", "--role", "client", "--id", "07", "--profile", "rpi4",
            "--prefix", str(stage), "--python", "/opt/edgefl/venv/bin/python",
            "--no-python-check", "--signing-key", "new", "--trust-key", agg_pub]
    assert main(args + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "PRIVATE KEY" not in out
    assert f"--- {stage}/etc/edgefl/keys/client-07.key\n(a private key, mode 0600, owned by " \
        "edgefl:edgefl: not shown)" in out
    assert "chown edgefl:edgefl /etc/edgefl/keys/client-07.key" in out
    assert not stage.exists()
    assert main(args) == 0
    out = capsys.readouterr().out
    key = stage / "etc/edgefl/keys/client-07.key"
    assert os.stat(key).st_mode & 0o777 == 0o600 and "PRIVATE KEY" not in out
    assert os.stat(str(key) + ".pub").st_mode & 0o777 == 0o644
    # the printed commands: the user first, then the key becomes its, then the unit starts
    lines = [line.strip() for line in out.splitlines()]
    order = [lines.index(c) for c in ("systemd-sysusers /etc/sysusers.d/edgefl.conf",
                                      "chown edgefl:edgefl /etc/edgefl/keys/client-07.key",
                                      "systemctl enable --now edgefl-client@07.service")]
    assert order == sorted(order)
    # the site file names them, and the key loads as the node's signing key
    site = yaml.safe_load((stage / "etc/edgefl/client-07.yaml").read_text())
    assert site["keys"] == {"signing_key": "/etc/edgefl/keys/client-07.key",
                            "aggregator": ["/etc/edgefl/keys/aggregator-0.pub"]}
    assert signing.fingerprint(signing.load_private_key(key)) == \
        signing.fingerprint(signing.load_public_key(str(key) + ".pub"))
    assert (stage / "etc/edgefl/keys/aggregator-0.pub").read_text() == open(agg_pub).read()
    with pytest.raises(inst.InstallError, match="--trust-key .*junk"):
        (tmp_path / "junk").write_text("x")
        inst.plan_install("client", "07", profile="rpi4", prefix=str(stage),
                          python="/opt/edgefl/venv/bin/python", check_python=False,
                          trusted_keys=(str(tmp_path / "junk"),))


def test_install_service_run_again_keeps_the_nodes_private_key_and_writes_nothing(
        tmp_path, capsys):
    """The node's key is its identity: the fleet holds its public key (keys.fleet). Run a
    second time with --signing-key new (a reinstall, a command from the shell's history),
    install-service once replaced the private key with a new one, the old lost for good and
    every update of the board then refused as signed by a key nobody trusts. Refused before
    anything is written, naming the file; the same key given again is no change."""
    stage = tmp_path / "stage"
    args = ["install-service", "--role", "client", "--id", "07", "--profile", "rpi4",
            "--prefix", str(stage), "--python", "/opt/edgefl/venv/bin/python",
            "--no-python-check"]
    assert main(args + ["--signing-key", "new"]) == 0
    key = stage / "etc/edgefl/keys/client-07.key"
    before = key.read_bytes(), (stage / "etc/edgefl/keys/client-07.key.pub").read_bytes()
    unit = stage / "etc/systemd/system/edgefl-client@.service"
    unit.unlink()
    other = tmp_path / "other.key"
    assert main(["keys", "gen", "--out", str(other)]) == 0
    capsys.readouterr()
    for given in ("new", str(other)):
        assert main(args + ["--signing-key", given]) == 1
        err = capsys.readouterr().err
        assert f"--signing-key: {key} exists" in err and "not replaced" in err, err
        assert (key.read_bytes(), (stage / "etc/edgefl/keys/client-07.key.pub")
                .read_bytes()) == before
        assert not unit.exists()                   # nothing written
    # the node's own key again: unchanged, and the rest is installed
    assert main(args + ["--signing-key", str(key)]) == 0
    out = capsys.readouterr().out
    assert f"unchanged      {key}\n" in out and unit.exists()
    assert key.read_bytes() == before[0]


@pytest.mark.parametrize("role, setting", [("client", "aggregator"),
                                           ("aggregator", "operators")])
def test_install_service_refuses_a_private_key_to_trust_and_writes_nothing(
        tmp_path, capsys, role, setting):
    """`--trust-key k1` instead of k1.pub would put a signing key, world-readable, on every
    board it is installed on: refused before any file is written, naming the option, the
    file and the public key to pass; a file that is no key at all is refused the same way."""
    k1 = tmp_path / "k1"
    assert main(["keys", "gen", "--out", str(k1)]) == 0
    capsys.readouterr()
    stage = tmp_path / "stage"
    args = ["install-service", "--role", role, "--id", "pi1", "--profile", "rpi4",
            "--prefix", str(stage), "--python", "/opt/edgefl/venv/bin/python",
            "--no-python-check", "--signing-key", "new"]
    for dry in ([], ["--dry-run"]):
        assert main(args + ["--trust-key", f"{k1}.pub", "--trust-key", str(k1)] + dry) == 1
        err = capsys.readouterr().err
        assert f"--trust-key {k1}: a private key" in err
        assert f"use its public key, {k1}.pub" in err and "BEGIN" not in err
        assert not stage.exists()
    # without its .pub beside it, the message still says what to pass
    os.rename(f"{k1}.pub", tmp_path / "elsewhere.pub")
    assert main(args + ["--trust-key", str(k1)]) == 1
    err = capsys.readouterr().err
    assert f"--trust-key {k1}: a private key" in err and "its public key" in err
    assert not stage.exists()
    (tmp_path / "notes.txt").write_text("-----BEGIN NOTHING-----\n")
    assert main(args + ["--trust-key", str(tmp_path / "notes.txt")]) == 1
    err = capsys.readouterr().err
    assert f"--trust-key {tmp_path / 'notes.txt'}: not an Ed25519 public key" in err
    assert not stage.exists()
    # the public key is installed, as a public key
    assert main(args + ["--trust-key", str(tmp_path / "elsewhere.pub")]) == 0
    installed = stage / f"etc/edgefl/keys/{setting}-0.pub"
    assert installed.read_bytes() == (tmp_path / "elsewhere.pub").read_bytes()
    assert signing.fingerprint(signing.load_public_key(installed)) == \
        signing.fingerprint(signing.load_private_key(k1))


def test_a_private_key_where_a_node_expects_a_public_one_stops_it_at_start(tmp_path, capsys):
    """A private key named in keys.aggregator, keys.fleet or keys.operators (or --centre-key)
    is another node's signing key copied where it does not belong: the role refuses to start,
    naming the setting and the file, rather than trust its public half and say nothing."""
    _, agg, agg_pub = keypair(tmp_path, "aggregator")
    _, c0, c0_pub = keypair(tmp_path, "client-0")
    for kwargs, setting, path in ((dict(aggregator=[agg_pub, agg]), "keys.aggregator", agg),
                                  (dict(fleet={"client-0": c0}), "keys.fleet (client-0)", c0),
                                  (dict(operators=[agg]), "keys.operators", agg)):
        with pytest.raises(KeyFileError) as refused:
            Trust.load(fed="lab", node="n", **kwargs)
        assert str(refused.value).startswith(f"{setting}: {path}: a private key")
        assert f"use its public key, {path}.pub" in str(refused.value)
    # a fleet directory holding a board's private key under the <id>.pub name
    fleet = _mkdir(tmp_path / "fleet")
    (fleet / "client-0.pub").write_bytes(open(c0, "rb").read())
    with pytest.raises(KeyFileError, match=r"keys.fleet \(client-0\): .*client-0.pub: a "
                                           "private key"):
        Trust.load(fed="lab", node="aggregator", fleet=str(fleet))
    # `keys show` reads either: the fingerprint of a private key is that of its public key
    assert main(["keys", "show", agg]) == 0
    assert capsys.readouterr().out.split()[0] == \
        signing.fingerprint(signing.load_public_key(agg_pub))


def test_a_public_key_given_to_sign_with_is_named_as_one(tmp_path):
    """--signing-key k.pub (or keys.signing_key) is refused saying it is a public key and
    which file to use; it said "not an unencrypted Ed25519 private key (...): Could not
    deserialize key data", as for a corrupt file."""
    _, key, pub = keypair(tmp_path, "aggregator")
    with pytest.raises(KeyFileError) as refused:
        signing.load_private_key(pub)
    assert str(refused.value) == (f"{pub}: a public key, not a private key to sign with; "
                                  f"use {key}, the private key beside it")
    lone = tmp_path / "lone.pem"
    lone.write_bytes(open(pub, "rb").read())
    with pytest.raises(KeyFileError, match=r"lone.pem: a public key, not a private key to "
                                           r"sign with; a node signs with its private key"):
        signing.load_private_key(lone)
    assert signing.fingerprint(signing.load_private_key(key)) == \
        signing.fingerprint(signing.load_public_key(pub))


# an EC key on secp112r1 (openssl ecparam -name secp112r1 -genkey), a curve OpenSSL 3
# parses but `cryptography` does not support: it raises UnsupportedAlgorithm, which is not
# a ValueError
EC112_PRIVATE = b"""-----BEGIN EC PRIVATE KEY-----
MD4CAQEEDq34C8n1DA+QPpc35ejxoAcGBSuBBAAGoSADHgAEb0nm+oY/8IfMB71a
jRKkClv3ts8J2dDuCTPjuw==
-----END EC PRIVATE KEY-----
"""
EC112_PUBLIC = b"""-----BEGIN PUBLIC KEY-----
MDIwEAYHKoZIzj0CAQYFK4EEAAYDHgAEb0nm+oY/8IfMB71ajRKkClv3ts8J2dDu
CTPjuw==
-----END PUBLIC KEY-----
"""


def test_a_key_of_an_unsupported_algorithm_is_named_not_a_traceback(tmp_path, capsys):
    """A key file of a kind `cryptography` cannot load at all (here an EC key on an old
    curve, given by mistake as a node's key) is a KeyFileError naming the file and the
    setting, as a corrupt one is: the service stopped with cryptography's traceback, and
    `edgefl keys show` with one."""
    private, public = tmp_path / "ec.key", tmp_path / "ec.pub"
    private.write_bytes(EC112_PRIVATE)
    public.write_bytes(EC112_PUBLIC)
    with pytest.raises(KeyFileError, match=r"ec.key: not an unencrypted Ed25519 private "
                                           r"key .*not supported"):
        signing.load_private_key(private)
    with pytest.raises(KeyFileError, match=r"ec.pub: not an Ed25519 public key .*not "
                                           r"supported"):
        signing.load_public_key(public)
    with pytest.raises(KeyFileError, match=r"^keys.signing_key: .*ec.key: not an "):
        Trust.load(fed="lab", node="client-0", signing_key=str(private))
    with pytest.raises(KeyFileError, match=r"^keys.aggregator: .*ec.pub: not an "):
        Trust.load(fed="lab", node="client-0", aggregator=[str(public)])
    for path in (private, public):
        assert main(["keys", "show", str(path)]) == 1
        err = capsys.readouterr().err
        assert f"{path}: not an" in err and "Traceback" not in err, err


def test_a_signing_key_other_accounts_can_read_is_refused_naming_file_and_mode(tmp_path,
                                                                            capsys):
    """A signing key whoever reads signs as its node with: one that other accounts may read
    or change (a `chmod 644`, a copy under a umask of 022, root:edgefl 0640 as a password
    file is, which the inference service and operators in group edgefl read) is refused
    where a node signs with it, naming the file, its mode and the fix; it was taken. Its
    fingerprint is still shown (`keys show` signs nothing)."""
    _, key, pub = keypair(tmp_path, "aggregator")
    for mode in (0o644, 0o640, 0o604, 0o620):
        os.chmod(key, mode)
        with pytest.raises(KeyFileError) as refused:
            Trust.load(fed="lab", node="aggregator", signing_key=key)
        assert str(refused.value).startswith(f"keys.signing_key: {key}: mode {mode:04o}")
        assert f"chmod 600 {key}" in str(refused.value)
        with pytest.raises(KeyFileError, match=f"mode {mode:04o}"):
            Signer.from_file(key, "operator", "lab")
    assert main(["keys", "show", key]) == 0
    assert capsys.readouterr().out.split()[0] == \
        signing.fingerprint(signing.load_public_key(pub))
    os.chmod(key, 0o600)
    assert Trust.load(fed="lab", node="aggregator", signing_key=key).signer is not None
    os.chmod(key, 0o400)
    assert Signer.from_file(key, "operator", "lab").fingerprint == \
        signing.fingerprint(signing.load_public_key(pub))


def test_a_signing_key_systemd_hands_over_as_a_credential_is_taken(tmp_path, monkeypatch):
    """systemd's LoadCredential= writes the file 0400 and, for a unit with User=, adds an
    ACL entry letting that user read it: the mode then reads 0440 (the group bits show the
    ACL's mask), though no group may read it. A key in the unit's credentials directory
    ($CREDENTIALS_DIRECTORY, under /run/credentials) is systemd's to keep private; it was
    refused with advice ("chmod 600") nobody can follow on that read-only file."""
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    _, key, pub = keypair(credentials, "client-0")
    os.chmod(key, 0o440)
    with pytest.raises(KeyFileError, match="mode 0440"):
        Trust.load(fed="lab", node="client-0", signing_key=key)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    assert Trust.load(fed="lab", node="client-0", signing_key=key).signer.fingerprint == \
        signing.fingerprint(signing.load_public_key(pub))
    elsewhere = tmp_path / "elsewhere"          # the exemption is the directory's alone
    elsewhere.mkdir()
    _, other, _ = keypair(elsewhere, "client-1")
    os.chmod(other, 0o440)
    with pytest.raises(KeyFileError, match="mode 0440"):
        Trust.load(fed="lab", node="client-1", signing_key=other)


def test_boards_without_keys_follow_a_signing_aggregator_and_say_signatures_are_off(
        tmp_path, mosquitto_server, caplog, capsys):
    """Backward compatible: the aggregator signs, the boards have no keys (an older site
    file): they take the signed messages as before, log and publish that signatures are
    off, and the run ends with the in-process model."""
    import logging

    caplog.set_level(logging.INFO, "edgefl.roles.client")
    config = load_run_config(write_config(tmp_path))
    fed = f"sig-{uid()}"
    run = prepare_run(config, progress=False)
    signed = SignedRun(tmp_path, config, mosquitto_server.url, fed, signing.generate_key(),
                       None).start()
    boards = []
    for node in ("client-0", "client-1"):
        c = int(node[-1])
        client = Client(ClientSettings(node, fed, exit_when_finished=True),
                        (run.clients[c].x, run.clients[c].y), mqtt(mosquitto_server.url, node),
                        tmp_path / node)
        thread = threading.Thread(target=client.run, daemon=True)
        thread.start()
        boards.append((client, thread))
    result = signed.finish()
    for client, thread in boards:
        thread.join(10)
        assert client.stats["rejected"] == 0
    from edgefl.checkpoint import model_sha256
    assert model_sha256(result.params) == reference_sha(config)
    assert "client-0: signatures off: announcements, models and ONNX files are taken " \
        "unsigned" in caplog.text
    capsys.readouterr()
    assert main(["status", "--broker", mosquitto_server.url, "--federation", fed,
                 "--wait", "2", "--json"]) == 0
    statuses = {s["node"]: s for s in json.loads(capsys.readouterr().out)}
    assert statuses["client-0"]["signatures"] == "off" and "key" not in statuses["client-0"]
    assert statuses["aggregator"]["signatures"] == "off"      # it checks no updates
    assert len(statuses["aggregator"]["key"]) == 16           # but signs


def test_an_earlier_runs_announcement_replayed_to_a_restarted_board_is_refused(
        tmp_path, mosquitto_server):
    """The signing time a board follows is on disk: restarted after run B, it still refuses
    run A's announcement (validly signed by the aggregator, for run A)."""
    config = load_run_config(write_config(tmp_path, rounds=1))
    fed = f"sig-{uid()}"
    topics = Topics(fed)
    agg_key = signing.generate_key()
    keys = {"client-0": signing.generate_key(), "client-1": signing.generate_key()}
    run = prepare_run(config, progress=False)
    probe = mqtt(mosquitto_server.url, "probe")
    probe.connect()
    probe.subscribe(topics.round(), qos=1)
    results = []
    for name in ("a", "b"):
        signed = SignedRun(tmp_path, config, mosquitto_server.url, fed, agg_key, keys,
                           state=f"agg-{name}").start()
        boards = [board(tmp_path, run, mosquitto_server.url, fed, n, keys[n], [agg_key])
                  for n in keys]                    # the same state directories each run
        results.append(signed.finish())
        for _, t in boards:
            t.join(10)
    seen = []
    while (item := probe.receive(timeout=0.5)) is not None:
        if getattr(item, "payload", b""):
            seen.append(json.loads(item.payload))
    probe.close(timeout=1.0, announce_offline=False)
    replay = next(d for d in seen if d["run"] == results[0].run_id and not d.get("finished"))

    # nothing newer retained: what the restarted board knows of run B is on its disk only
    raw = RawPublisher(mosquitto_server.url)
    raw.publish(topics.round(), b"", retain=True)
    client, thread = board(tmp_path, run, mosquitto_server.url, fed, "client-0",
                           keys["client-0"], [agg_key], exit_when_finished=False)
    try:
        raw.publish(topics.round(), json.dumps(replay).encode(), retain=True)
        wait_for(lambda: client.stats["rejected"] >= 1, what="the replay refused")
        assert client.ann is None and client.progress.run_id == results[1].run_id
    finally:
        raw.close()
        client.stop.set()
        thread.join(10)


# ---------------------------------------------------------------------------------------
# secure aggregation: its phase messages are signed both ways
# ---------------------------------------------------------------------------------------

def test_a_secure_message_signature_binds_run_round_attempt_board_sender_and_id():
    from edgefl.privacy import secagg
    from edgefl.roles.trust import secure_context, secure_signer, verify_secure

    key, other = signing.generate_key(), signing.generate_key()
    boards = Verifier("lab", {"client-0": [key.public_key()], "client-1": [other.public_key()]})
    words = np.arange(5000, dtype=np.uint32)
    msg = secagg.MaskedInput(3, 0, words, np.array([7, 9], np.uint64), ("x",))
    context = secure_context("attempt-a", "client-0")

    def sealed(signer=Signer(key, "client-0", "lab"), run="r1", round=3, ctx=context,
               mid=(5 << 32) | 2):
        assembler = secagg.ChunkAssembler(1 << 20)
        out = None
        for chunk in secagg.to_chunks(msg, 4096, mid, secure_signer(signer, run, round, ctx)):
            out = assembler.add_sealed("client-0", chunk) or out
        return out

    ok = dict(context=context, run="r1", round=3, by="client-0", where="t")
    good = sealed()
    assert verify_secure(boards, good, **ok)["kind"] == "secure"
    got = good.message()
    assert isinstance(got, secagg.MaskedInput) and np.array_equal(got.words, words)
    cases = [
        (dict(ok, run="r2"), "signed for run 'r1', not 'r2'"),
        (dict(ok, round=4), "signed for round 3, not 4"),
        (dict(ok, context=secure_context("attempt-b", "client-0")), "altered after signing"),
        (dict(ok, context=secure_context("attempt-a", "client-1")), "altered after signing"),
        (dict(ok, by="client-1"), "signed by 'client-0', not 'client-1'"),
    ]
    for expect, reason in cases:
        with pytest.raises(SignatureError, match=reason):
            verify_secure(boards, good, **expect)
    # under another message id (the same signature moved): its hash is not the signed one
    with pytest.raises(SignatureError, match="altered after signing"):
        verify_secure(boards, secagg.Sealed(good.message_id + 1, good.envelope, good.body), **ok)
    # the words altered after signing
    body = bytearray(good.body)
    body[-100] ^= 1
    with pytest.raises(SignatureError, match="altered after signing"):
        verify_secure(boards, secagg.Sealed(good.message_id, good.envelope, bytes(body)), **ok)
    # another board's key in client-0's name; unsigned
    with pytest.raises(SignatureError, match="not one of the trusted keys of 'client-0'"):
        verify_secure(boards, sealed(Signer(other, "client-0", "lab")), **ok)
    with pytest.raises(SignatureError, match="unsigned"):
        verify_secure(boards, sealed(None), **ok)
    # a receiver that checks nothing reads a signed message as an unsigned one
    assembler = secagg.ChunkAssembler(1 << 20)
    parsed = [assembler.add("client-0", c) for c in secagg.to_chunks(
        msg, 4096, 9, secure_signer(Signer(key, "client-0", "lab"), "r1", 3, context))]
    assert np.array_equal(parsed[-1].words, words) and parsed[:-1] == [None] * (len(parsed) - 1)
    # a refused message's id is free again: the sender's own message under it is taken
    assembler = secagg.ChunkAssembler(1 << 20)
    for chunk in secagg.to_chunks(msg, 1 << 20, 11):
        forged = assembler.add_sealed("client-0", chunk)
    assert assembler.add_sealed("client-0", chunk) is None           # a repeat
    assembler.forget("client-0", forged.message_id)
    assert assembler.add_sealed("client-0", chunk) is not None
    with pytest.raises(secagg.SecAggError, match="signature of 99999 bytes"):
        secagg.unseal(secagg._SEAL.pack(secagg.SEAL_MAGIC, 99999) + b"{}", 1)
    with pytest.raises(secagg.SecAggError, match="not JSON"):
        secagg.unseal(secagg._SEAL.pack(secagg.SEAL_MAGIC, 2) + b"{x", 1)


SECURE = {"secure_aggregation": {"threshold": 1.0}}


def test_secure_aggregation_signed_forged_phase_messages_refused_same_model_as_unsigned(
        tmp_path, mosquitto_server, caplog):
    """A secure run with every node keyed: forged uploads on client-0's secure topic
    (unsigned, signed by client-1 as itself or in client-0's name, client-0's own signature
    for another attempt), among them a masked input, are refused by the aggregator before
    its SecAgg+ server sees them; forged phase messages to client-0 (unsigned, another
    key's, the aggregator's own for client-1) are refused by the board, which goes on; the
    run closes its rounds from the unmasked sum with the model of the same run unsigned."""
    from edgefl.privacy import secagg
    from edgefl.roles.messages import attempt_tag
    from edgefl.roles.trust import secure_context, secure_signer
    import logging

    caplog.set_level(logging.WARNING, "edgefl.roles")
    config = load_run_config(write_config(tmp_path, privacy=SECURE))
    fed = f"sig-{uid()}"
    topics = Topics(fed)
    agg_key, rogue = signing.generate_key(), signing.generate_key()
    keys = {"client-0": signing.generate_key(), "client-1": signing.generate_key()}
    run = prepare_run(config, progress=False)
    signed = SignedRun(tmp_path, config, mosquitto_server.url, fed, agg_key, keys).start()
    agg = signed.aggregator
    o = agg.open
    tag = attempt_tag(o.announce_id)
    first = (tag << 32) | 1                 # the id of client-0's first message of the attempt
    x25519 = secagg.SecAggClient(0, secagg.RoundSetup.from_dict(json.loads(
        o.announcement)["secure"]))
    advertise = x25519.advertise()
    masked = secagg.MaskedInput(1, 0, np.zeros(run.model.n_params, np.uint32),
                                np.zeros(1, np.uint64))
    here = secure_context(o.announce_id, "client-0")

    def sign(key, by, context=here, run_id=None):
        return secure_signer(Signer(key, by, fed), run_id or agg.run_id, 1, context)

    raw = RawPublisher(mosquitto_server.url)
    try:
        forged_up = [
            (advertise, None),                                        # unsigned
            (advertise, sign(keys["client-1"], "client-1")),          # another board's, as it
            (advertise, sign(keys["client-1"], "client-0")),          # ... in client-0's name
            (advertise, sign(keys["client-0"], "client-0",            # client-0's, another
                             secure_context("an-earlier-attempt", "client-0"))),   # attempt
            (advertise, sign(keys["client-0"], "client-0", run_id="an-earlier-run")),
            (masked, None),                                           # a masked input
        ]
        for n, (msg_, signer) in enumerate(forged_up, 1):
            for chunk in secagg.to_chunks(msg_, 1 << 20, first, signer):
                raw.publish(topics.secure("client-0"), chunk)
            wait_for(lambda n=n: agg.stats.get("bad_signatures", 0) >= n,
                     what=f"forged upload {n} refused")
        assert o.secure.phase == "keys" and o.secure.keys == {}     # the server saw none

        # client-0 joins: its own advertisement (under the id the forgeries used) is taken
        c0, t0 = board(tmp_path, run, mosquitto_server.url, fed, "client-0", keys["client-0"],
                       [agg_key])
        wait_for(lambda: 0 in o.secure.keys, what="client-0's own keys taken")
        keys_msg = secagg.KeysBroadcast(1, {0: [advertise.c_public, advertise.s_public],
                                            1: [advertise.c_public, advertise.s_public]})
        forged_down = [
            (None, "unsigned"),
            (secure_signer(Signer(rogue, "aggregator", fed), agg.run_id, 1, here),
             "not one of the trusted keys"),
            (secure_signer(Signer(agg_key, "aggregator", fed), agg.run_id, 1,
                           secure_context(o.announce_id, "client-1")), "altered after signing"),
        ]
        for n, (signer, why) in enumerate(forged_down, 1):
            for chunk in secagg.to_chunks(keys_msg, 1 << 20, (tag << 32) | (100 + n), signer):
                raw.publish(topics.secure_to("client-0"), chunk)
            wait_for(lambda n=n: c0.stats["rejected"] >= n, what=f"forged phase message {n} "
                     f"to client-0 refused ({why})")
        assert c0._secure is not None and c0._secure._keys == {}     # it shared nothing
    finally:
        raw.close()

    # client-1 joins: the run completes from the unmasked sums
    c1, t1 = board(tmp_path, run, mosquitto_server.url, fed, "client-1", keys["client-1"],
                   [agg_key])
    result = signed.finish(timeout=120)
    for _, t in ((c0, t0), (c1, t1)):
        t.join(10)
    assert [h["closed_by"] for h in result.history] == ["secure", "secure"]
    assert agg.stats["bad_signatures"] == len(forged_up)     # nothing genuine refused
    assert c0.stats["rejected"] == len(forged_down) and c1.stats["rejected"] == 0
    # each refusal logged with its reason
    for reason in ("secure message 1 of client-0 for round 1: unsigned",
                   "signed by 'client-1', not 'client-0'",
                   "not one of the trusted keys of 'client-0'",
                   "altered after signing", "signed for run 'an-earlier-run'"):
        assert reason in caplog.text, reason
    assert "client-0: rejected secure message" in caplog.text
    assert "the secure round goes on without it" in caplog.text
    from edgefl.checkpoint import model_sha256
    unsigned = simulate(config, None, workers=2, progress=False, transport="mqtt",
                        broker=mosquitto_server.url)
    assert model_sha256(result.params) == unsigned["model_sha256"] == reference_sha(config)
