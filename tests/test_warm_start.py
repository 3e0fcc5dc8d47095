"""Warm start: `model.init` naming an earlier run's directory (or its model.npz) starts a run
from that run's model. The second run's round-0 model is the first run's final model bit for
bit; a checkpoint of another model, a missing or unreadable file are refused naming the file
and the key; a relative path is looked up beside the config file, then in the working
directory; the aggregator's fingerprint covers the file's parameters (a resume with another
file is refused, with the same file it resumes); and nothing but the process that prepares
the run reads the file: boards get the model over MQTT, an edge aggregator from the centre.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import threading
import uuid

import numpy as np
import pytest
import yaml

from edgefl import kernels
from edgefl.checkpoint import load_checkpoint, model_sha256
from edgefl.config import ConfigError
from edgefl.models import build_model
from edgefl.roles import AggregatorSettings
from edgefl.roles.state import StateError
from edgefl.runconfig import load_run_config
from edgefl.runs.prepare import client_shard, prepare_run
from edgefl.sim import simulate
from edgefl.transport.mqtt import MqttTransport
from helpers import read_jsonl, start_mqtt_clients, stop_clients

pytest_plugins = ["brokers"]

BASE = {
    "dataset": {"name": "digits", "limit_train": 600},
    "partition": {"name": "iid", "clients": 4},
    "model": {"name": "softmax"},
    "strategy": {"name": "fedavg"},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "rounds": 4,
    "clients_per_round": 2,
    "seed": 0,
}


def write(directory, name="run.yaml", **changes) -> str:
    """BASE with `changes` (top-level keys replaced whole) as directory/name; its path."""
    data = json.loads(json.dumps(BASE))
    data.update(json.loads(json.dumps(changes)))
    path = os.path.join(directory, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def warm(directory, init, name="warm.yaml", model=None, **changes):
    """The run config of BASE with model.init = `init`, written to directory/name, loaded."""
    return load_run_config(write(directory, name, model={**(model or BASE["model"]),
                                                         "init": str(init)}, **changes))


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A finished 4-round run: (its directory, its summary)."""
    root = tmp_path_factory.mktemp("first")
    config = load_run_config(write(str(root)))
    summary = simulate(config, root / "run", workers=1, progress=False, onnx=False,
                       plot=False)
    return root / "run", summary


def test_a_run_continues_from_an_earlier_runs_final_model(first, tmp_path):
    run_dir, summary = first
    stored = load_checkpoint(str(run_dir / "model.npz"))["params"]
    assert model_sha256(stored) == summary["model_sha256"]
    for source in (run_dir, run_dir / "model.npz"):          # the directory or the file
        config = warm(tmp_path, source, rounds=2)
        run = prepare_run(config, progress=False)
        # round 0 is the first run's final model, bit for bit
        assert run.init_params.dtype == np.float32
        assert np.array_equal(run.init_params.view(np.uint32), stored.view(np.uint32))
        assert model_sha256(run.init_params) == summary["model_sha256"]
        # and scores what the first run ended with
        scored = kernels.evaluate(run.model, run.init_params, run.dataset.x_test,
                                  run.dataset.y_test)
        assert scored["accuracy"] == summary["final_accuracy"]

    config = warm(tmp_path, run_dir, rounds=2)
    said = io.StringIO()
    prepare_run(config, progress=True, stream=said)
    # the run's output says where round 0 comes from
    assert f"model: round 0 from {run_dir / 'model.npz'} (its round 4, model_sha256 " \
           f"{summary['model_sha256'][:16]})\n" in said.getvalue(), said.getvalue()
    out = simulate(config, tmp_path / "warm", workers=1, progress=False, onnx=False,
                   plot=False)
    cold = simulate(load_run_config(write(str(tmp_path), "cold.yaml", rounds=2)),
                    tmp_path / "cold", workers=1, progress=False, onnx=False, plot=False)
    warm_rounds = read_jsonl(tmp_path / "warm" / "metrics.jsonl")
    cold_rounds = read_jsonl(tmp_path / "cold" / "metrics.jsonl")
    # the accuracy goes on from where the first run ended, not from a fresh model's
    assert warm_rounds[0]["test_accuracy"] >= summary["final_accuracy"] - 0.02
    assert warm_rounds[0]["test_accuracy"] > cold_rounds[0]["test_accuracy"] + 0.02
    # the summary says where the run started from
    assert out["init"] == {"checkpoint": str(run_dir / "model.npz"),
                           "model_sha256": summary["model_sha256"], "round": 4}
    assert out["config"]["model"]["init"] == str(run_dir)
    assert "init" not in cold

    # over a broker the boards get the model each round: the same run, the same model
    over = simulate(config, None, workers=1, progress=False, transport="mqtt")
    assert over["model_sha256"] == out["model_sha256"]


def test_a_relative_path_is_looked_up_beside_the_config_then_in_the_working_directory(
        first, tmp_path, monkeypatch):
    run_dir, summary = first
    shutil.copytree(run_dir, tmp_path / "runs" / "a")
    # beside the config file: configs/warm.yaml names ../runs/a
    config = warm(tmp_path / "configs", "../runs/a")
    assert model_sha256(prepare_run(config, progress=False).init_params) == \
        summary["model_sha256"]
    # not there: the working directory (`--set model.init=runs/a` with a config elsewhere)
    monkeypatch.chdir(tmp_path)
    config = load_run_config(write(str(tmp_path / "configs")), ["model.init=runs/a"])
    assert model_sha256(prepare_run(config, progress=False).init_params) == \
        summary["model_sha256"]
    # in neither: both places are named
    config = load_run_config(write(str(tmp_path / "configs")), ["model.init=runs/b"])
    with pytest.raises(ConfigError) as refused:
        prepare_run(config, progress=False)
    message = str(refused.value)
    assert "model.init" in message and config.path in message
    assert str(tmp_path / "configs" / "runs" / "b") in message
    assert str(tmp_path / "runs" / "b") in message


def test_a_checkpoint_of_another_model_is_refused_naming_both(first, tmp_path):
    run_dir, _ = first
    config = warm(tmp_path, run_dir, model={"name": "mlp", "hidden": [8]})
    theirs = build_model({"name": "softmax"}, (1, 8, 8), 10)
    ours = build_model({"name": "mlp", "hidden": [8]}, (1, 8, 8), 10)
    with pytest.raises(ConfigError) as refused:
        prepare_run(config, progress=False)
    message = str(refused.value)
    assert message.startswith(f"{config.path}: model.init: {run_dir / 'model.npz'}: ")
    for model in (theirs, ours):
        assert model.table.digest[:12] in message
        assert f"{model.n_params} parameters" in message


def test_a_missing_or_unreadable_file_is_refused_naming_it_and_the_key(first, tmp_path):
    run_dir, _ = first
    missing = tmp_path / "nowhere"
    config = warm(tmp_path, missing)
    with pytest.raises(ConfigError, match=rf"^{config.path}: model\.init: .*{missing}"):
        simulate(config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=rf"model\.init: run directory {tmp_path / 'empty'} "
                                          rf"has no model\.npz"):
        prepare_run(warm(tmp_path, tmp_path / "empty"), progress=False)
    data = (run_dir / "model.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError, match=rf"model\.init: {tmp_path / 'cut.npz'}: not a "
                                          rf"readable edgefl checkpoint"):
        prepare_run(warm(tmp_path, tmp_path / "cut.npz"), progress=False)
    # not a string: refused when the config is read
    path = write(str(tmp_path), "bad.yaml", model={"name": "softmax", "init": 3})
    with pytest.raises(ConfigError, match=r"model\.init: 3: .*uniform, zeros"):
        load_run_config(path)


def test_a_checkpoint_with_non_finite_parameters_is_refused_naming_the_layer(first,
                                                                              tmp_path):
    """A diverged run's model.npz (NaN or infinite parameters) must not become round 0: the
    boards' training would diverge at once and say nothing of the file."""
    from edgefl.checkpoint import load_checkpoint

    run_dir, _ = first
    with np.load(run_dir / "model.npz", allow_pickle=False) as z:
        arrays = dict(z)
    params = load_checkpoint(str(run_dir / "model.npz"))["params"].copy()
    for bad in (np.nan, np.inf):
        params[3] = bad
        key = next(k for k, v in arrays.items() if v.dtype == np.float32 and
                   v.shape == params.shape)
        np.savez(tmp_path / "diverged.npz", **{**arrays, key: params})
        with pytest.raises(ConfigError, match=rf"model\.init: {tmp_path / 'diverged.npz'}: "
                                              r"1 of the 650 parameters .*not finite.*layer "
                                              r"'fc1\.weight'"):
            prepare_run(warm(tmp_path, tmp_path / "diverged.npz"), progress=False)


@pytest.mark.parametrize("key, value", [
    ("model_spec", np.array(json.dumps([1, 2]))),          # JSON, but not a model spec
    ("input_shape", np.array(64, dtype=np.int64)),        # a number, not a shape
    ("num_classes", np.array([10, 10], dtype=np.int64)),  # a shape, not a number
])
def test_a_checkpoint_whose_model_fields_have_the_wrong_type_is_refused_naming_them(
        first, tmp_path, key, value):
    """A foreign or damaged model.npz with the keys of a checkpoint but not their types gave
    a bare TypeError traceback ("iteration over a 0-d array") naming neither file nor key."""
    run_dir, _ = first
    with np.load(run_dir / "model.npz", allow_pickle=False) as z:
        arrays = dict(z)
    np.savez(tmp_path / "odd.npz", **{**arrays, key: value})
    with pytest.raises(ConfigError, match=rf"model\.init: {tmp_path / 'odd.npz'}: {key} "):
        prepare_run(warm(tmp_path, tmp_path / "odd.npz"), progress=False)


def test_a_board_never_needs_the_file(tmp_path, mosquitto_server):
    """A board with `--partition CONFIG` reads the config for its data only; an edge
    aggregator prepares the run from the centre's config but takes every round's model
    from the centre: neither opens model.init's file, which only the centre has."""
    from edgefl.roles.runner import run_edge

    config = warm(tmp_path, tmp_path / "only-on-the-centre")
    x, y = client_shard(config, 1)
    assert len(x) == len(y) > 0
    stop = threading.Event()
    stop.set()                     # the edge connects, subscribes and stops: prepared
    transport = MqttTransport(mosquitto_server.url, f"edge-{uuid.uuid4().hex[:6]}",
                              clean_session=True)
    assert run_edge(config, transport, str(tmp_path / "edge"),
                    settings=AggregatorSettings(federation=f"w{uuid.uuid4().hex[:6]}"),
                    edge_id="site-a", site=("client-0", "client-1"), stop=stop) is False


def _service_run(url, config, state, tmp_path):
    """(aggregate, the run's first summary): run_aggregator of `config` over a fresh
    federation on `url` with its state in `state`, once with four client threads to its end;
    aggregate(tag) runs it again (a resume), without clients."""
    from edgefl.roles.runner import run_aggregator

    federation = f"warm-{uuid.uuid4().hex[:8]}"
    settings = AggregatorSettings(federation=federation, round_timeout_s=30.0)
    run = prepare_run(config, progress=False)

    def aggregate(tag):
        transport = MqttTransport(url, f"agg-{tag}-{federation}", clean_session=True)
        return run_aggregator(config, transport, str(state), settings=settings)

    clients, threads = start_mqtt_clients(url, federation, "a", run, tmp_path, range(4))
    try:
        summary = aggregate("a")
    finally:
        stop_clients(clients, threads)
    return aggregate, summary


def test_a_resume_goes_on_from_the_model_it_started_from_whatever_the_file_holds_now(
        first, tmp_path, mosquitto_server, caplog):
    """A started run is defined by the model it started from, which warm_start.json
    records: the file replaced by another model (a link moved to a newer run, a copy over
    it) or an unreadable record must not fail a run that can resume from its checkpoint.
    Only a checkpoint of before the record, which has nothing else to go by, refuses a
    file that now holds another model."""
    run_dir, _ = first
    shutil.copytree(run_dir, tmp_path / "init")
    config = warm(tmp_path, tmp_path / "init", rounds=2)
    state = str(tmp_path / "agg")
    aggregate, summary = _service_run(mosquitto_server.url, config, state, tmp_path)
    reference = simulate(config, None, workers=1, progress=False)
    assert summary["model_sha256"] == reference["model_sha256"]
    # the same file: the run's checkpoint is taken up again (its rounds are done)
    assert aggregate("b")["model_sha256"] == summary["model_sha256"]
    # another model in its place (the same layer table): the run resumes, saying so
    other = simulate(load_run_config(write(str(tmp_path), "other.yaml", rounds=1)),
                     tmp_path / "other", workers=1, progress=False, onnx=False, plot=False)
    shutil.copy(tmp_path / "other" / "model.npz", tmp_path / "init" / "model.npz")
    started = summary["init"]["model_sha256"]
    assert other["model_sha256"] != started
    with caplog.at_level("WARNING", logger="edgefl.roles.runner"):
        again = aggregate("c")
    assert again["model_sha256"] == summary["model_sha256"]
    assert again["init"]["model_sha256"] == started
    assert any(other["model_sha256"][:12] in r.getMessage() and started[:12] in
               r.getMessage() for r in caplog.records), caplog.text
    # an unreadable record, the file there: read again (the fingerprint decides)
    record = os.path.join(state, "warm_start.json")
    with open(record, "w") as f:
        f.write("")
    shutil.copy(run_dir / "model.npz", tmp_path / "init" / "model.npz")
    assert aggregate("d")["model_sha256"] == summary["model_sha256"]
    # a checkpoint of before the record: the file is all it has, and it is another model
    os.unlink(record)
    shutil.copy(tmp_path / "other" / "model.npz", tmp_path / "init" / "model.npz")
    with pytest.raises(StateError, match=r"made with another configuration .*model\.init"):
        aggregate("e")


def test_ctl_start_names_the_file_as_the_aggregator_service_will_find_it(first, tmp_path,
                                                                        monkeypatch):
    """`edgefl ctl start` sends the config as data, without its file: a relative model.init
    is resolved where the config is read (beside it, then the working directory) and sent
    as an absolute path, which the service, in a directory of its own, reads."""
    import argparse

    from edgefl.cli.ctl import _ctl_command
    from edgefl.runconfig import run_config_from_mapping

    run_dir, summary = first
    shutil.copytree(run_dir, tmp_path / "runs" / "a")
    path = write(str(tmp_path / "configs"), model={"name": "softmax", "init": "../runs/a"})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    doc = _ctl_command(argparse.Namespace(action="start", run_config=path, clients=None,
                                          deadline=None, quorum=None, min_updates=None,
                                          run_id=None, keep=None, dry_run=False))
    assert doc["config"]["model"]["init"] == str(tmp_path / "runs" / "a")
    received = run_config_from_mapping(doc["config"], "start: config")
    assert model_sha256(prepare_run(received, progress=False).init_params) == \
        summary["model_sha256"]


def test_a_started_run_resumes_without_the_file(first, tmp_path, mosquitto_server, caplog):
    """Once the run has started, its state directory records the parameters' sha256: a
    resume after the file was removed (retention pruned the source run, an operator cleared
    it) goes on from the checkpoint with a warning naming the file, and the fingerprint is
    still checked, with the recorded hash. A checkpoint of before the record (none there)
    needs the file as before, and records it when the file is there."""
    record_file = "warm_start.json"      # in the run's state directory, beside its checkpoint
    run_dir, first_summary = first
    shutil.copytree(run_dir, tmp_path / "init")
    config = warm(tmp_path, tmp_path / "init", rounds=1)
    state = tmp_path / "agg"
    aggregate, summary = _service_run(mosquitto_server.url, config, state, tmp_path)

    shutil.rmtree(tmp_path / "init")
    caplog.clear()
    with caplog.at_level("WARNING", logger="edgefl.roles.runner"):
        resumed = aggregate("b")
    assert resumed["model_sha256"] == summary["model_sha256"]
    assert resumed["init"] == summary["init"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(str(tmp_path / "init") in m and "model.init" in m for m in warned), warned
    record = json.loads((state / record_file).read_text())
    assert record["model_sha256"] == first_summary["model_sha256"] == summary["init"][
        "model_sha256"]

    # the fingerprint is checked with the recorded hash: another one is another run
    (state / record_file).write_text(json.dumps({**record, "model_sha256": "0" * 64}))
    with pytest.raises(StateError, match=r"made with another configuration"):
        aggregate("c")

    # a checkpoint of before the record needs the file, as it did; with the file there,
    # the resume records it
    (state / record_file).unlink()
    with pytest.raises(ConfigError, match=rf"model\.init: .*{tmp_path / 'init'}") as refused:
        aggregate("d")
    # ... saying why this checkpoint needs it (a state directory copied without its record)
    assert f"no {record_file} beside it" in str(refused.value), refused.value
    shutil.copytree(run_dir, tmp_path / "init")
    assert aggregate("e")["model_sha256"] == summary["model_sha256"]
    assert json.loads((state / record_file).read_text()) == record


@pytest.mark.parametrize("model", [{"name": "svm", "bias": True},
                                   {"name": "linear", "outputs": 10}])
def test_a_checkpoint_of_another_model_with_the_same_layers_is_refused(first, tmp_path, model):
    """softmax, svm(bias=True) and linear(outputs=10) lay out the same parameters (one
    layer table) but are other models: the names differ, and the run is refused naming
    both."""
    run_dir, _ = first
    config = warm(tmp_path, run_dir, model=model)
    with pytest.raises(ConfigError) as refused:
        prepare_run(config, progress=False)
    message = str(refused.value)
    assert message.startswith(f"{config.path}: model.init: {run_dir / 'model.npz'}: ")
    assert "softmax" in message and model["name"] in message, message


def test_other_model_options_or_input_normalisation_are_warned_about(tmp_path, caplog):
    """The same model with other options (l2: a fine-tune may change the regularisation)
    starts, with a warning naming the option and both values; so does a checkpoint whose
    input normalisation is not the run's data set's."""
    source = simulate(load_run_config(write(str(tmp_path), "svm.yaml", rounds=1,
                                            model={"name": "svm", "l2": 0.1})),
                      tmp_path / "svm", workers=1, progress=False, onnx=False, plot=False)
    config = warm(tmp_path, tmp_path / "svm", model={"name": "svm", "l2": 0.01})
    with caplog.at_level("WARNING", logger="edgefl.runs.prepare"):
        run = prepare_run(config, progress=False)
    assert model_sha256(run.init_params) == source["model_sha256"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("model.init" in m and "l2" in m and "0.1" in m and "0.01" in m
               for m in warned), warned
    assert not any("normalisation" in m for m in warned), warned

    # the same checkpoint with another input normalisation
    with np.load(tmp_path / "svm" / "model.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["norm_mean"] = arrays["norm_mean"] + np.float32(0.5)
    (tmp_path / "shifted").mkdir()
    np.savez(tmp_path / "shifted" / "model.npz", **arrays)
    caplog.clear()
    config = warm(tmp_path, tmp_path / "shifted", model={"name": "svm", "l2": 0.1})
    with caplog.at_level("WARNING", logger="edgefl.runs.prepare"):
        prepare_run(config, progress=False)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("normalisation" in m and str(tmp_path / "shifted") in m for m in warned), warned
    assert not any("l2" in m for m in warned), warned


@pytest.mark.parametrize("typo, right", [("Zeros", "zeros"), ("UNIFORM", "uniform")])
def test_a_seeded_init_spelt_in_other_case_is_refused_when_the_config_is_read(tmp_path, typo,
                                                                               right):
    path = write(str(tmp_path), model={"name": "softmax", "init": typo})
    with pytest.raises(ConfigError, match=rf"model\.init: '{typo}': .*'{right}'"):
        load_run_config(path)


def test_a_bare_word_that_names_nothing_is_a_typo_not_a_missing_run(first, tmp_path):
    """A model.init with no path separator and no suffix that names no file is taken for a
    misspelt uniform or zeros, and said so, with the close match; a run directory of such a
    name beside the config is still a warm start."""
    config = warm(tmp_path, "unifrom")
    with pytest.raises(ConfigError) as refused:
        prepare_run(config, progress=False)
    message = str(refused.value)
    assert message.startswith(f"{config.path}: model.init: 'unifrom': not uniform or zeros, "
                              f"and no such run directory or model.npz"), message
    assert "did you mean 'uniform'?" in message, message
    # `edgefl ctl start` says so too, rather than sending it as a path
    import argparse

    from edgefl.cli.ctl import _ctl_command
    with pytest.raises(ConfigError, match=r"model\.init: 'unifrom': not uniform or zeros"):
        _ctl_command(argparse.Namespace(action="start", run_config=config.path, clients=None,
                                        deadline=None, quorum=None, min_updates=None,
                                        run_id=None))
    config = warm(tmp_path, "previous")
    with pytest.raises(ConfigError, match=r"model\.init: 'previous': not uniform or zeros, "
                                          r"and no such run directory or model\.npz"):
        prepare_run(config, progress=False)
    run_dir, summary = first
    shutil.copytree(run_dir, tmp_path / "previous")
    assert model_sha256(prepare_run(config, progress=False).init_params) == \
        summary["model_sha256"]


def test_a_warm_start_from_a_dp_run_carries_its_privacy_account(tmp_path, caplog):
    """The source run's privacy loss composes with the new run's (its model was trained on
    the same boards' data): the new summary's `init` carries the source summary's privacy
    block, and the start warns naming the source's epsilon. Without a summary.json beside
    the model.npz there is nothing to carry."""
    dp = {"dp": {"clip": 1.0, "noise_multiplier": 1.0, "reproducible": True}}
    source = simulate(load_run_config(write(str(tmp_path), "dp.yaml", rounds=2, privacy=dp,
                                            strategy={"name": "fedavg",
                                                      "weighting": "uniform"})),
                      tmp_path / "dp", workers=1, progress=False, onnx=False, plot=False)
    epsilon = source["privacy"]["epsilon"]
    config = warm(tmp_path, tmp_path / "dp", rounds=1)
    with caplog.at_level("WARNING", logger="edgefl.runs.prepare"):
        out = simulate(config, tmp_path / "warm", workers=1, progress=False, onnx=False,
                       plot=False)
    assert out["init"]["privacy"] == source["privacy"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"{epsilon:.4g}" in m and "epsilon" in m and str(tmp_path / "dp") in m
               for m in warned), warned

    os.unlink(tmp_path / "dp" / "summary.json")
    run = prepare_run(config, progress=False)
    assert "privacy" not in run.warm_start


def test_a_hostile_summary_beside_the_source_model_neither_fails_the_run_nor_reaches_the_log(
        first, tmp_path, caplog):
    """summary.json beside model.init's model.npz is read for the source's privacy block: a
    huge number, a document nested past the parser's limit, a block of megabytes or a
    string of terminal escapes must not fail the run with a traceback, nor be logged raw."""
    run_dir, _ = first
    cases = {
        "huge": '{"privacy": {"epsilon": 1' + "0" * 400 + ', "delta": 1e-5}}',
        "deep": '{"privacy": ' + "[" * 100000 + "]" * 100000 + "}",
        "escapes": '{"privacy": {"epsilon": "\\u001b[2J\\nFAKE LOG LINE", "delta": 1}}',
        "large": json.dumps({"privacy": {"epsilon": 1.0, "junk": "x" * (1 << 20)}}),
    }
    for name, text in cases.items():
        source = tmp_path / name
        shutil.copytree(run_dir, source)
        (source / "summary.json").write_text(text)
        caplog.clear()
        with caplog.at_level("WARNING", logger="edgefl.runs.prepare"):
            run = prepare_run(warm(tmp_path, source, name=f"{name}.yaml"), progress=False)
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "\x1b" not in logged and "\nFAKE LOG LINE" not in logged, (name, logged)
        kept = run.warm_start.get("privacy")
        assert kept is None or len(json.dumps(kept)) < 4096, (name, len(json.dumps(kept)))



def test_a_warm_start_from_a_warm_started_dp_run_names_every_earlier_runs_privacy(tmp_path,
                                                                                caplog):
    """A -> B -> C, A and B DP runs, each from the one before: C's model was trained on the
    boards' data in A's rounds too, so C's start must not name B's epsilon alone (B's summary
    says its own rounds only; A's block is in B's `init`): the earlier loss is carried and
    named, summed over the chain (basic composition of what came before B)."""
    dp = {"dp": {"clip": 1.0, "noise_multiplier": 1.0, "reproducible": True}}
    strategy = {"name": "fedavg", "weighting": "uniform"}
    a = simulate(load_run_config(write(str(tmp_path), "a.yaml", rounds=2, privacy=dp,
                                       strategy=strategy)),
                 tmp_path / "a", workers=1, progress=False, onnx=False, plot=False)
    b = simulate(warm(tmp_path, tmp_path / "a", name="b.yaml", rounds=1, privacy=dp,
                      strategy=strategy),
                 tmp_path / "b", workers=1, progress=False, onnx=False, plot=False)
    assert b["init"]["privacy"]["epsilon"] == a["privacy"]["epsilon"]
    with caplog.at_level("WARNING", logger="edgefl.runs.prepare"):
        run = prepare_run(warm(tmp_path, tmp_path / "b", name="c.yaml", rounds=1),
                          progress=False)
    carried = run.warm_start["privacy"]
    assert carried["epsilon"] == b["privacy"]["epsilon"]
    assert carried["earlier_epsilon"] == pytest.approx(a["privacy"]["epsilon"])
    assert carried["earlier_delta"] == pytest.approx(a["privacy"]["delta"])
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"{a['privacy']['epsilon']:.4g}" in m and f"{b['privacy']['epsilon']:.4g}" in m
               for m in warned), warned


def test_a_chain_through_a_run_without_dp_still_names_the_dp_runs_loss(tmp_path, caplog):
    """A (DP) -> B (no DP, from A's model) -> C: B's summary has no privacy block of its own,
    but its model carries A's loss (in B's `init`). C's start said nothing: the source's
    block was looked for, and no further. The earlier loss is carried and named."""
    dp = {"dp": {"clip": 1.0, "noise_multiplier": 1.0, "reproducible": True}}
    strategy = {"name": "fedavg", "weighting": "uniform"}
    a = simulate(load_run_config(write(str(tmp_path), "a.yaml", rounds=2, privacy=dp,
                                       strategy=strategy)),
                 tmp_path / "a", workers=1, progress=False, onnx=False, plot=False)
    b = simulate(warm(tmp_path, tmp_path / "a", name="b.yaml", rounds=1, strategy=strategy),
                 tmp_path / "b", workers=1, progress=False, onnx=False, plot=False)
    assert "privacy" not in b and b["init"]["privacy"]["epsilon"] == a["privacy"]["epsilon"]
    with caplog.at_level("WARNING", logger="edgefl.runs.prepare"):
        run = prepare_run(warm(tmp_path, tmp_path / "b", name="c.yaml", rounds=1),
                          progress=False)
    carried = run.warm_start["privacy"]
    assert carried.get("epsilon") is None
    assert carried["earlier_epsilon"] == pytest.approx(a["privacy"]["epsilon"])
    assert carried["earlier_delta"] == pytest.approx(a["privacy"]["delta"])
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("without differential privacy" in m and f"{a['privacy']['epsilon']:.4g}" in m
               for m in warned), warned
