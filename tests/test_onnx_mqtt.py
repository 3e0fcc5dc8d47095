"""The exported ONNX model during training and over MQTT (issue #5 items 3-4): `edgefl
simulate --export-every N` replaces model.onnx after every N-th round and the last; through
a real Mosquitto the aggregator exports every N rounds and the final model, publishes each
export retained in parts small enough to force chunking (roles/onnx_channel.py), the
clients install it atomically in their state directories, a client that joins after the
aggregator has exited still gets it from the broker, a shorter model clears the parts a
longer one left, and a damaged model never replaces the installed one.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid

import numpy as np
import pytest
import yaml

pytest.register_assert_rewrite("brokers")
from edgefl.export import ExportPolicy, export_onnx    # noqa: E402
from edgefl.infer import ModelFileError, Predictor    # noqa: E402
from edgefl.models import build_model    # noqa: E402
from edgefl.roles import (Aggregator, AggregatorCheckpoint, AggregatorSettings,  # noqa: E402
                          Client, ClientSettings, RunPlan, default_client_ids)
from edgefl.roles.onnx_channel import (OnnxReceiver, encode_publication, part_index,  # noqa: E402
                                       part_topic, parts_filter)
from edgefl.runconfig import load_run_config    # noqa: E402
from edgefl.roles.runner import run_aggregator  # noqa: E402
from edgefl.runs.prepare import prepare_run
from edgefl.transport import wire    # noqa: E402
from edgefl.transport.base import Message    # noqa: E402
from edgefl.transport.mqtt import MqttTransport    # noqa: E402
from edgefl.transport.topics import Topics    # noqa: E402
from helpers import onnx_that_loads_but_cannot_run, wait_for    # noqa: E402

pytest_plugins = ["brokers"]

CHUNK = 2048          # the mlp's ONNX file is ~10 KB: six parts or more
CONFIG = {
    "dataset": {"name": "digits", "limit_train": 400},
    "partition": {"name": "iid", "clients": 3},
    "model": {"name": "mlp", "hidden": [32]},
    "strategy": {"name": "fedavg"},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "rounds": 3,
    "clients_per_round": 3,
    "seed": 0,
}


def sha_of(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def transport(url, name):
    return MqttTransport(url, f"{name}-{uuid.uuid4().hex[:6]}", reconnect_min=0.05,
                         reconnect_max=0.5, connect_timeout=5.0)


def retained(url, topic_filter, seconds=1.5) -> dict:
    """topic -> payload of the retained messages under `topic_filter` right now."""
    t = transport(url, "probe")
    t.connect()
    got = {}
    try:
        t.subscribe(topic_filter, qos=1)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            item = t.receive(timeout=0.1)
            if isinstance(item, Message) and item.payload:
                got[item.topic] = item.payload
    finally:
        t.close(timeout=1.0, announce_offline=False)
    return got


def start_client(url, federation, node, data, state_dir):
    client = Client(ClientSettings(node, federation, max_payload=CHUNK), data,
                    transport(url, node), state_dir)
    thread = threading.Thread(target=client.run, name=node, daemon=True)
    thread.start()
    assert client.ready.wait(10), f"{node} did not connect"
    return client, thread


def test_simulate_exports_every_n_rounds_and_the_last(tmp_path, capsys):
    from edgefl.cli import main

    out = tmp_path / "run"
    assert main(["simulate", "quickstart", "--out", str(out), "--quiet", "--set", "rounds=5",
                 "--export-every", "2", "--export-quantize", "int8"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [e["round"] for e in summary["onnx_exports"]] == [2, 4, 5]
    meta = Predictor(out / "model.onnx").metadata
    assert meta["round"] == "5" and meta["quantization"] == "int8-static-qdq"
    assert float(meta["accuracy"]) == summary["onnx_exports"][-1]["accuracy"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temps
    capsys.readouterr()
    assert main(["simulate", "quickstart", "--out", str(tmp_path / "x"), "--quiet",
                 "--export-every", "-1"]) == 1
    assert "--export-every -1: need N >= 0" in capsys.readouterr().err


def test_part_topics_parse_only_their_own_shape():
    topics = Topics("fed1")
    assert part_topic(topics, 12) == "edgefl/fed1/onnx/12"
    assert parts_filter(topics) == "edgefl/fed1/onnx/+"
    assert part_index(topics, "edgefl/fed1/onnx/12") == 12
    for other in ("edgefl/fed1/onnx", "edgefl/fed1/onnx/012", "edgefl/fed1/onnx/-1",
                  "edgefl/fed1/onnx/1/2", "edgefl/fed2/onnx/1", "edgefl/fed1/onnx/x",
                  "edgefl/fed1/onnx/\u0663"):
        assert part_index(topics, other) is None, other


def test_aggregator_exports_every_n_rounds_and_clients_install_it(tmp_path, mosquitto_server):
    url = mosquitto_server.url
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    config = load_run_config(str(path))
    run = prepare_run(config, progress=False)
    federation = f"onnx-{uuid.uuid4().hex[:8]}"
    ids = default_client_ids(3)
    clients, threads = {}, []
    try:
        for c, node in enumerate(ids):
            clients[node], thread = start_client(url, federation, node,
                                                 (run.clients[c].x, run.clients[c].y),
                                                 tmp_path / node)
            threads.append(thread)
        settings = AggregatorSettings(federation=federation, round_timeout_s=30.0,
                                      max_payload=CHUNK)
        out, state = tmp_path / "out", tmp_path / "agg"
        summary = run_aggregator(config, transport(url, "aggregator"), str(state),
                                 settings=settings, out_dir=str(out),
                                 export=ExportPolicy(every=2))
        assert summary is not None
        # round 2 (every 2) and round 3 (the last) exported; the file is the last one
        assert [e["round"] for e in summary["onnx_exports"]] == [2, 3]
        final = out / "model.onnx"
        assert Predictor(final).metadata["round"] == "3"
        final_sha = sha_of(final)
        published = json.loads((state / "onnx-published.json").read_text())
        assert published["sha256"] == final_sha and published["round"] == 3
        assert published["parts"] >= 4, "the test must force chunking"

        # every client installed the final model (after the round-2 one)
        for node in ids:
            wait_for(lambda node=node: (tmp_path / node / "model.onnx").exists()
                     and sha_of(tmp_path / node / "model.onnx") == final_sha,
                     what=f"{node} to install the final model", poll=0.05)
            assert clients[node].onnx.installs == 2
            assert clients[node].stats["rejected"] == 0

        # the broker holds the manifest and exactly the parts of the final model
        topics = Topics(federation)
        parts = retained(url, parts_filter(topics))
        assert sorted(part_index(topics, t) for t in parts) == list(range(published["parts"]))
        manifest = wire.decode(retained(url, topics.onnx())[topics.onnx()],
                               wire.Expectation(None, kinds="onnx"))
        assert manifest.scalars["sha256"] == final_sha
        assert manifest.scalars["parts"] == published["parts"]
        assert manifest.scalars["metadata"]["round"] == "3"

        # a client that joins after the aggregator has exited gets it from retention
        late_dir = tmp_path / "late"
        late, late_thread = start_client(url, federation, "late-board",
                                         (run.clients[0].x, run.clients[0].y), late_dir)
        wait_for(lambda: (late_dir / "model.onnx").exists(), what="the late client's model",
                 poll=0.05)
        assert sha_of(late_dir / "model.onnx") == final_sha
        classes, _ = Predictor(late_dir / "model.onnx").predict(run.dataset.x_test[:4] * 0)
        assert classes.shape == (4,)

        # a shorter model: published with fewer parts, the longer one's extra parts cleared
        small_model = build_model({"name": "softmax"}, run.model.input_shape, 10)
        small = tmp_path / "small.onnx"
        export_onnx(small_model, small_model.init(1), small, norm_mean=run.dataset.norm_mean,
                    norm_std=run.dataset.norm_std)
        again = Aggregator(RunPlan(run.strategy, run.init_params, run.setup, run.model,
                                   config.clients_per_round, ids,
                                   description=config.to_dict()),
                           transport(url, "aggregator"), state, settings)
        again.ckpt = AggregatorCheckpoint.load(state)      # the finished run's checkpoint
        again.transport.connect()
        try:
            sent = again.publish_onnx(small)
        finally:
            again.transport.close(timeout=2.0, announce_offline=False)
        assert 1 < sent["parts"] < published["parts"]
        parts = retained(url, parts_filter(topics))
        assert sorted(part_index(topics, t) for t in parts) == list(range(sent["parts"]))
        wait_for(lambda: sha_of(late_dir / "model.onnx") == sha_of(small),
                 what="the running late client to install the new model", poll=0.05)
        late.stop.set()
        late_thread.join(10)
    finally:
        for client in clients.values():
            client.stop.set()
        for thread in threads:
            thread.join(5)


def test_damaged_model_is_refused_and_the_installed_one_kept(tmp_path):
    model = build_model({"name": "softmax"}, (1, 8, 8), 10)
    good = tmp_path / "good.onnx"
    export_onnx(model, model.init(0), good, norm_mean=[0.0], norm_std=[1.0])
    data = good.read_bytes()
    state = tmp_path / "state"
    receiver = OnnxReceiver(str(state))
    pub = encode_publication(data, {}, round=4, sender="aggregator", run="r1",
                             max_payload=1024)
    assert len(pub.parts) > 1
    for payload in reversed(pub.parts):          # any order
        installed = receiver.on_part(payload)
    assert installed == str(state / "model.onnx") and sha_of(installed) == sha_of(good)
    assert receiver.on_part(pub.parts[0]) is None          # a QoS 1 repeat: nothing new

    # content that does not hash to the announced sha256
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    frame = wire.encode("onnx", 5, "aggregator", {"model.onnx": bytes(bad)},
                        {"run": "r1", "sha256": pub.sha256, "bytes": len(bad), "metadata": {}})
    with pytest.raises(ModelFileError, match=r"onnx model of round 5 from 'aggregator'.*"
                                             r"sha256 .* the sender announced"):
        receiver.on_part(frame)
    # bytes that are not a model, with a matching sha256
    junk = b"not an onnx model" * 10
    frame = wire.encode("onnx", 6, "aggregator", {"model.onnx": junk},
                        {"run": "r1", "sha256": hashlib.sha256(junk).hexdigest(),
                         "bytes": len(junk), "metadata": {}})
    with pytest.raises(ModelFileError, match="not a loadable ONNX model"):
        receiver.on_part(frame)
    # a truncated part
    with pytest.raises(wire.FrameError, match=r"chunk 2/\d+: frame is \d+ bytes, header says"):
        receiver.on_part(pub.parts[1][:-10])
    # a manifest that names no parts
    with pytest.raises(wire.FrameError, match="needs no buffers and scalars sha256 and parts"):
        receiver.on_manifest(wire.encode("onnx", 6, "aggregator", {}, {"sha256": "x"}))
    assert sha_of(state / "model.onnx") == sha_of(good)          # untouched
    assert sorted(p.name for p in state.iterdir()) == ["model.onnx"]   # no temporaries left
    np.testing.assert_equal(Predictor(state / "model.onnx").predict(np.zeros((1, 64)))[0], [
        Predictor(good).predict(np.zeros((1, 64)))[0][0]])


def test_a_model_that_loads_but_cannot_run_is_not_installed(tmp_path, mosquitto_server,
                                                           caplog):
    """A board's client installed any model onnxruntime could load; one it cannot run (a
    Reshape that does not fit the declared input) replaced the working model, and the
    board's `edgefl serve` then failed every request. Through a real broker, such a model is
    refused the way any bad model is (counted as rejected, logged with the file and
    onnxruntime's error), the installed model stays, and the next good one is installed."""
    import logging

    url = mosquitto_server.url
    model = build_model({"name": "softmax"}, (1, 8, 8), 10)
    old, new = tmp_path / "old.onnx", tmp_path / "new.onnx"
    export_onnx(model, model.init(0), old, norm_mean=[0.0], norm_std=[1.0])
    export_onnx(model, model.init(1), new, norm_mean=[0.0], norm_std=[1.0])
    state = tmp_path / "board"
    state.mkdir()
    (state / "model.onnx").write_bytes(old.read_bytes())
    federation = f"onnx-{uuid.uuid4().hex[:8]}"
    topics = Topics(federation)
    publisher = transport(url, "aggregator")
    publisher.connect()

    def publish(data: bytes, round: int) -> None:
        pub = encode_publication(data, {}, round=round, sender="aggregator", run="r1",
                                 max_payload=CHUNK)
        for i, payload in enumerate(pub.parts):
            publisher.publish(part_topic(topics, i), payload, qos=1, retain=True)
        publisher.publish(topics.onnx(), pub.manifest, qos=1, retain=True)
        publisher.flush(5.0)

    x, y = np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int64)
    client, thread = None, None
    try:
        with caplog.at_level(logging.WARNING, logger="edgefl"):
            client, thread = start_client(url, federation, "board-1", (x, y), state)
            publish(onnx_that_loads_but_cannot_run(), 2)
            wait_for(lambda: client.stats["rejected"] >= 1
                     or (client.onnx is not None and client.onnx.installs), 30,
                     "the client to refuse (or install) it")
        assert sha_of(state / "model.onnx") == sha_of(old)              # untouched
        assert client.onnx.installs == 0 and client.onnx.installed_sha == sha_of(old)
        refusal = next(r.getMessage() for r in caplog.records if "rejected" in r.getMessage())
        assert "ONNX model on" in refusal and "loads but does not run" in refusal, refusal
        assert "cannot be reshaped" in refusal, refusal
        publish(new.read_bytes(), 3)                                    # the next good one
        wait_for(lambda: sha_of(state / "model.onnx") == sha_of(new), 30,
                 "the client to install the next model", poll=0.05)
        assert client.onnx.installs == 1 and client.stats["rejected"] == 1
    finally:
        if client is not None:
            client.stop.set()
            thread.join(10)
        for i in range(8):                    # leave nothing retained for other tests
            publisher.clear_retained(part_topic(topics, i))
        publisher.clear_retained(topics.onnx())
        publisher.close(timeout=2.0, announce_offline=False)


def test_acl_lets_clients_read_the_parts_and_only_the_aggregator_write_them(
        tmp_path, mosquitto_acl_server):
    """broker/acl: every node reads onnx and onnx/<i>; only the aggregator writes them."""
    url, users = mosquitto_acl_server.url, mosquitto_acl_server.users
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    config = load_run_config(str(path))
    run = prepare_run(config, progress=False)
    federation = f"acl-{uuid.uuid4().hex[:8]}"
    topics = Topics(federation)

    def login(node, **options):
        return MqttTransport(url, f"{node}-{uuid.uuid4().hex[:6]}", username=node,
                             password=users[node], connect_timeout=5.0, **options)

    model_file = tmp_path / "m.onnx"
    export_onnx(run.model, run.init_params, model_file, norm_mean=run.dataset.norm_mean,
                norm_std=run.dataset.norm_std)
    agg = Aggregator(RunPlan(run.strategy, run.init_params, run.setup, run.model,
                             config.clients_per_round, ("client-0", "client-1", "client-2"),
                             description=config.to_dict()),
                     login("aggregator"), tmp_path / "agg",
                     AggregatorSettings(federation=federation, max_payload=CHUNK))
    agg.ckpt = agg._load_or_start()                 # a real, fresh checkpoint
    agg.transport.connect()
    try:
        sent = agg.publish_onnx(model_file)
        agg.transport.flush(5.0)
    finally:
        agg.transport.close(timeout=2.0, announce_offline=False)
    assert sent["parts"] > 1

    # a client may not overwrite a part: the broker drops its publish
    rogue = login("client-2")
    rogue.connect()
    rogue.publish(part_topic(topics, 0), b"EDFL" + bytes(100), qos=1, retain=True)
    rogue.flush(5.0)
    rogue.close(timeout=1.0, announce_offline=False)

    client = Client(ClientSettings("client-1", federation), (run.clients[1].x, run.clients[1].y),
                    login("client-1", reconnect_min=0.05, reconnect_max=0.5),
                    tmp_path / "client-1")
    thread = threading.Thread(target=client.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: (tmp_path / "client-1" / "model.onnx").exists(),
                 what="client-1 to install the model through the ACL", poll=0.05)
        assert sha_of(tmp_path / "client-1" / "model.onnx") == sha_of(model_file)
        assert client.stats["rejected"] == 0
    finally:
        client.stop.set()
        thread.join(10)


def test_a_model_that_cannot_be_written_is_refused_and_the_installed_one_kept(tmp_path):
    """A board's disk fills up: writing the received model failed with an OSError, which
    left OnnxReceiver.on_part uncaught; the client catches only the errors that name a bad
    model (FrameError, ModelFileError, SignatureError), so its main loop, and with it the
    board's training client, ended, and did again on every restart as the retained model
    came back. The failure must be a ModelFileError naming the file and the cause, with the
    installed model and the receiver's state as they were."""
    import resource

    model = build_model({"name": "softmax"}, (1, 8, 8), 10)
    old, new = tmp_path / "old.onnx", tmp_path / "new.onnx"
    export_onnx(model, model.init(0), old, norm_mean=[0.0], norm_std=[1.0])
    big = build_model({"name": "mlp", "hidden": [64]}, (1, 8, 8), 10)
    export_onnx(big, big.init(1), new, norm_mean=[0.0], norm_std=[1.0])
    state = tmp_path / "state"
    state.mkdir()
    (state / "model.onnx").write_bytes(old.read_bytes())
    receiver = OnnxReceiver(str(state))
    pub = encode_publication(new.read_bytes(), {}, round=7, sender="aggregator", run="r1",
                             max_payload=1 << 20)
    limit = old.stat().st_size + 1024          # room for the old model, not the new one
    assert new.stat().st_size > limit
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))   # Python ignores SIGXFSZ
    try:
        with pytest.raises(ModelFileError, match=rf"onnx model of round 7 from 'aggregator': "
                                                 rf"{state / 'model.onnx'}: cannot write the "
                                                 rf"received model \(.*File too large"):
            receiver.on_part(pub.parts[0])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert sha_of(state / "model.onnx") == sha_of(old)                 # untouched
    assert receiver.installed_sha == sha_of(old) and receiver.installs == 0
    assert sorted(p.name for p in state.iterdir()) == ["model.onnx"]   # no temporaries left
    # room again, the retained model received again (as by a restarted client): installed
    assert OnnxReceiver(str(state)).on_part(pub.parts[0]) == str(state / "model.onnx")
    assert sha_of(state / "model.onnx") == sha_of(new)


def test_the_signing_time_is_recorded_before_the_model_so_no_restart_allows_a_downgrade(
        tmp_path):
    """A board with keys.aggregator refuses an ONNX model signed before the installed one,
    by the signing time kept beside it (model.onnx.signed.json). The receiver wrote that
    record after replacing model.onnx: when the record's write failed (a full disk, a power
    cut between the two writes) the OSError left on_part uncaught, which ends the client's
    main loop, and the restarted receiver found a record naming another sha256, took the
    floor as -inf and installed an older signed model replayed by the broker. The record
    is written first; a model whose record cannot be written is refused by name and the
    installed one kept; the floor survives a restart whatever the installed file is."""
    from edgefl.transport.signing import SignatureError, Signer, Verifier, generate_key

    key = generate_key()
    signer, verifier = Signer(key, "aggregator", "fed"), Verifier("fed", {"*": [key.public_key()]})
    model = build_model({"name": "softmax"}, (1, 8, 8), 10)
    old_file, new_file = tmp_path / "old.onnx", tmp_path / "new.onnx"
    export_onnx(model, model.init(0), old_file, norm_mean=[0.0], norm_std=[1.0])
    export_onnx(model, model.init(1), new_file, norm_mean=[0.0], norm_std=[1.0])
    old = encode_publication(old_file.read_bytes(), {}, round=1, sender="aggregator", run="r1",
                             max_payload=1 << 20, signer=signer)
    time.sleep(0.01)
    new = encode_publication(new_file.read_bytes(), {}, round=2, sender="aggregator", run="r1",
                             max_payload=1 << 20, signer=signer)
    state = tmp_path / "state"
    installed, record = state / "model.onnx", state / "model.onnx.signed.json"
    receiver = OnnxReceiver(str(state), verifier=verifier)
    assert receiver.on_part(old.parts[0]) == str(installed)
    assert sha_of(installed) == old.sha256

    record.unlink()
    record.mkdir()                       # the record cannot be written (as on a full disk)
    with pytest.raises(ModelFileError, match=rf"onnx model of round 2 from 'aggregator': "
                                             rf"{record}: cannot record"):
        receiver.on_part(new.parts[0])
    assert sha_of(installed) == old.sha256 and receiver.installed_sha == old.sha256
    record.rmdir()

    # room again: the model received again is installed, then the board restarts
    receiver = OnnxReceiver(str(state), verifier=verifier)
    assert receiver.on_part(new.parts[0]) == str(installed)
    assert sha_of(installed) == new.sha256
    # the older model replayed after a restart is refused, the newer one kept
    with pytest.raises(SignatureError, match="an older model replayed"):
        OnnxReceiver(str(state), verifier=verifier).on_part(old.parts[0])
    assert sha_of(installed) == new.sha256

    # a power cut after the record and before the model: the floor still holds
    installed.write_bytes(old_file.read_bytes())
    with pytest.raises(SignatureError, match="an older model replayed"):
        OnnxReceiver(str(state), verifier=verifier).on_part(old.parts[0])
