"""`edgefl simulate`: the run config (vocabulary, defaults, errors that name the key), the
outputs, determinism across thread counts, byte accounting, and the shipped quickstart."""
import io
import json
import os

import numpy as np
import pytest
import yaml

from edgefl.cli import main
from edgefl.config import ConfigError
from edgefl.runs.outputs import plot_curves
from edgefl.runconfig import builtin_configs, load_run_config, run_config_from_mapping
from edgefl.checkpoint import load_checkpoint, model_sha256
from edgefl.sim import Progress, simulate
from edgefl.strategies import strategy_names

SMALL = {
    "dataset": {"name": "digits", "limit_train": 600},
    "partition": {"name": "iid", "clients": 6},
    "model": {"name": "softmax"},
    "strategy": {"name": "fedavg"},
    "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
    "rounds": 4,
    "clients_per_round": 3,
    "seed": 0,
}
METRIC_KEYS = {"round", "test_accuracy", "test_loss", "train_loss", "uplink_bytes",
               "downlink_bytes", "wall_s", "selected"}


def write(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def small(**changes):
    data = json.loads(json.dumps(SMALL))
    for key, value in changes.items():
        section, _, sub = key.partition("__")
        if sub:
            data[section][sub] = value
        elif value is None:
            data.pop(section)
        else:
            data[section] = value
    return data


# ---------------------------------------------------------------------------------------
# run config
# ---------------------------------------------------------------------------------------

def test_defaults_fill_an_empty_config(tmp_path):
    config = load_run_config(write(tmp_path, {}))
    assert config.dataset["name"] == "digits" and config.partition["clients"] == 10
    assert config.model["name"] == "softmax" and config.strategy == "fedavg"
    assert config.strategy_params == {"weighting": "samples"}
    assert config.clients_per_round == 10 and config.rounds == 10 and config.seed == 0
    assert config.train.lr == 0.1 and config.train.epochs == 1 and config.train.steps == 0


def test_resolved_config_round_trips(tmp_path):
    config = load_run_config(write(tmp_path, small(strategy={"name": "mfl"}, train={"steps": 3},
                                                   clients_per_round=None, fraction=0.5)))
    assert config.clients_per_round == 3 and config.strategy_params["gamma"] == 0.5
    again = run_config_from_mapping(config.to_dict(), config.path)
    assert again.to_dict() == config.to_dict()
    assert again.train.steps == 3 and again.train.epochs == 0


def test_overrides_and_string_shorthands(tmp_path):
    config = load_run_config(write(tmp_path, small(strategy="mfl", model="svm",
                                                   dataset__binary="even-odd"), "short.yaml"))
    assert config.strategy == "mfl" and config.model == {"name": "svm"}
    path = write(tmp_path, small())
    config = load_run_config(path, ["strategy.name=fedumf", "strategy.alpha=0.5", "train.lr=1e-2",
                                    "partition.clients=12", "clients_per_round=4"])
    assert config.strategy == "fedumf" and config.strategy_params["alpha"] == 0.5
    assert config.train.lr == 0.01 and config.clients == 12 and config.clients_per_round == 4


@pytest.mark.parametrize("data, overrides, message", [
    (small(round=3), (), r"run\.yaml: round: unknown key; valid keys: dataset, partition, model"),
    (small(train__lrr=0.1), (), r"train\.lrr: unknown key; valid keys: lr, batch_size, epochs"),
    (small(train__lr="fast"), (), r"train\.lr: must be a number, got 'fast'"),
    (small(train__lr=0), (), r"train\.lr: 0\.0 must be > 0"),
    (small(train__momentum=1.0), (), r"train\.momentum: .*must be < 1"),
    (small(train__steps=5), (), r"train\.steps: give train\.epochs or train\.steps, not both"),
    (small(rounds=0), (), r"rounds: 0 is below the minimum 1"),
    (small(rounds=2.5), (), r"rounds: must be an integer, got 2\.5"),
    (small(clients_per_round=7), (), r"clients_per_round: 7 is more than partition\.clients = 6"),
    (small(fraction=0.5), (), r"fraction: give clients_per_round or fraction, not both"),
    (small(strategy={"name": "fedsgd"}), (), r"strategy\.name: unknown strategy 'fedsgd'; valid: .*fedavg"),
    (small(strategy={"name": "mfl", "alpha": 1}), (),
     r"strategy\.alpha: unknown parameter of mfl; valid: name, gamma, weighting"),
    (small(strategy={"name": "mfl", "gamma": 1.2}), (), r"strategy\.gamma: .*gamma = 1\.2 must be"),
    (small(dataset={"name": "imagenet"}), (), r"dataset\.name: unknown dataset 'imagenet'; valid: digits"),
    (small(dataset__colour=True), (), r"dataset\.colour: unknown option of dataset 'digits'"),
    (small(partition__alpha=0.3), (), r"partition\.alpha: unknown option of partition 'iid'"),
    (small(partition={"name": "dirichlet", "clients": 0}), (), r"partition\.clients: 0 is below the minimum 1"),
    (small(model={"name": "resnet"}), (), r"model\.name: unknown model 'resnet'; valid: .*mlp"),
    # (a string other than uniform and zeros is a checkpoint's path: tests/test_warm_start.py)
    (small(model={"name": "mlp", "init": 3}), (),
     r"model\.init: 3: give uniform, zeros, or the path"),
    (small(), ("train.batchsize=3",), r"train\.batchsize \(from --set\): unknown key"),
    (small(), ("strategy.gamma=0.3",), r"strategy\.gamma \(from --set\): unknown parameter of fedavg"),
])
def test_config_errors_name_the_file_the_key_and_the_choices(tmp_path, data, overrides, message):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=message) as info:
        load_run_config(path, overrides)
    assert str(info.value).startswith(path)


def test_unknown_model_options_are_named_when_the_config_is_read(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.yaml: model\.width: unknown option of model "
                                          r"mlp; valid: name, init, hidden"):
        load_run_config(write(tmp_path, small(model={"name": "mlp", "width": 3})))


def test_builtin_configs_resolve_by_name_and_unknown_names_list_them():
    assert {"quickstart", "mfl", "fedumf"} <= set(builtin_configs())
    for name in ("quickstart", "mfl", "fedumf"):
        load_run_config(name)            # every shipped config validates
    with pytest.raises(ConfigError, match=r"not a built-in config \(.*quickstart"):
        load_run_config("quikstart")


def test_every_strategy_has_an_example_config():
    shown = {load_run_config(name).strategy for name in builtin_configs()}
    assert set(strategy_names()) <= shown, sorted(set(strategy_names()) - shown)


def test_the_fednova_example_gives_its_clients_different_numbers_of_local_steps(tmp_path):
    """What the config is there to show: with equal steps, tau_eff (the p-weighted mean of
    the clients' steps) would be that whole number in every round."""
    config = load_run_config("fednova", ["rounds=2"])
    assert config.strategy == "fednova"
    simulate(config, tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["tau_eff"] != int(r["tau_eff"]) for r in rows), rows


# ---------------------------------------------------------------------------------------
# outputs and determinism
# ---------------------------------------------------------------------------------------

def test_curves_tick_the_rounds_at_whole_numbers(tmp_path):
    history = [{"round": r, "test_accuracy": 0.5 + r / 10, "test_loss": 1.0 / r,
                "train_loss": 1.2 / r} for r in (1, 2, 3)]
    fig = plot_curves(history, str(tmp_path / "curves.png"), title="three rounds")
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    for axes in fig.axes:
        ticks = [t for t in axes.get_xticks() if 1 <= t <= 3]
        assert ticks == [1, 2, 3], axes.get_xticks()


def test_outputs_exist_and_parse(tmp_path):
    config = load_run_config(write(tmp_path, small(eval_every=3)))
    out = tmp_path / "out"
    summary = simulate(config, out, workers=2, progress=False)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert METRIC_KEYS <= set(row)
        assert len(row["selected"]) == 3 and row["selected"] == sorted(row["selected"])
    # evaluated every 3 rounds and after the last
    assert [r["test_accuracy"] is not None for r in rows] == [False, False, True, True]
    text = (out / "summary.json").read_text()
    assert text.endswith("}\n")                  # a text file: cat, diff and git see its end
    on_disk = json.loads(text)
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["rounds"] == 4 and on_disk["final_accuracy"] == rows[-1]["test_accuracy"]
    assert on_disk["best_accuracy"] >= on_disk["final_accuracy"] > 0.5
    assert on_disk["config"] == config.to_dict()
    ckpt = load_checkpoint(str(out / "model.npz"))
    assert model_sha256(ckpt["params"]) == on_disk["model_sha256"]
    assert ckpt["round"] == 4 and ckpt["table"].size == ckpt["params"].size == 650
    assert ckpt["model_spec"] == {"name": "softmax"}
    assert ckpt["strategy"] == {"name": "fedavg", "weighting": "samples"}
    assert np.array_equal(ckpt["state.params"], ckpt["params"])
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ckpt["dataset"]["name"] == "digits"      # so `edgefl export` can re-measure it
    # the final model is exported for onnxruntime, and it is the checkpoint's model
    import onnxruntime as ort
    session = ort.InferenceSession(str(out / "model.onnx"))
    meta = session.get_modelmeta().custom_metadata_map
    assert model_sha256(ckpt["params"]) in json.dumps(meta)
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]


def test_same_seed_same_model_whatever_the_thread_count(tmp_path):
    config = load_run_config(write(tmp_path, small(strategy={"name": "fedumf"})))
    one = simulate(config, None, workers=1, progress=False)
    two = simulate(config, None, workers=2, progress=False)
    four = simulate(config, None, workers=4, progress=False)
    assert one["model_sha256"] == two["model_sha256"] == four["model_sha256"]
    other = simulate(load_run_config(config.path, ["seed=1"]), None, workers=2, progress=False)
    assert other["model_sha256"] != one["model_sha256"]


def test_deferred_evaluation_gives_every_round_its_own_accuracy_in_order(tmp_path):
    """With several threads a round's evaluation overlaps the next round's training: the
    records still reach on_round in round order, each with the accuracy of its own round's
    model, the same numbers as evaluating between rounds on one thread."""
    from edgefl import kernels
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim import run_federation
    config = load_run_config(write(tmp_path, small(eval_every=1)))
    run = prepare_run(config, workers=1, progress=False)
    test = (run.dataset.x_test, run.dataset.y_test)
    runs = {}
    for workers in (1, 3):
        seen, models = [], {}
        result = run_federation(run.strategy, run.init_params, run.clients, run.setup,
                                config.clients_per_round, test=test, workers=workers,
                                on_round=lambda rec: seen.append(dict(rec)),
                                on_model=lambda r, m: models.__setitem__(r, m.copy()))
        assert [rec["round"] for rec in seen] == [1, 2, 3, 4]
        assert [rec["round"] for rec in result.history] == [1, 2, 3, 4]
        for rec in seen:       # each round's accuracy is that of the model of that round
            assert rec["test_accuracy"] == kernels.evaluate(run.model, models[rec["round"]],
                                                            *test)["accuracy"]
        runs[workers] = [(rec["test_accuracy"], rec["test_loss"]) for rec in seen]
    assert runs[1] == runs[3]


@pytest.mark.parametrize("alone_below", [0.0, 1.0, "switch"])
def test_the_calling_thread_alone_or_the_pool_give_the_same_rounds(tmp_path, monkeypatch,
                                                                   alone_below):
    """sim.loop._Pace: clients cheaper than ALONE_BELOW train on the calling thread alone,
    others on the pool, and a run may switch in the middle of its first round; every way
    ends with the one-thread run's model and records (timings aside)."""
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim import loop, run_federation
    config = load_run_config(write(tmp_path, small(eval_every=1)))
    run = prepare_run(config, workers=1, progress=False)
    test = (run.dataset.x_test, run.dataset.y_test)

    def rounds(workers):
        result = run_federation(run.strategy, run.init_params, run.clients, run.setup,
                                config.clients_per_round, test=test, workers=workers)
        timing = ("wall_s", "train_wall_s", "elapsed_s")
        return result.model_sha256, [{k: v for k, v in rec.items() if k not in timing}
                                     for rec in result.history]

    one = rounds(1)
    decided = []
    probe = loop._Pace.probe

    def watched(self, fn, items):
        out = probe(self, fn, items)
        decided.append((self.alone, len(out), len(items)))
        return out
    monkeypatch.setattr(loop._Pace, "probe", watched)
    if alone_below == "switch":   # each client "takes" 1 s: the budget of 2 runs out at the 2nd
        ticks = iter(range(1_000_000))
        monkeypatch.setattr(loop._Pace, "clock", staticmethod(lambda: float(next(ticks))))
        monkeypatch.setattr(loop._Pace, "PROBE", 4)
        monkeypatch.setattr(loop._Pace, "ALONE_BELOW", 0.5)
    else:
        monkeypatch.setattr(loop._Pace, "ALONE_BELOW", alone_below)
        monkeypatch.setattr(loop._Pace, "PROBE", 1_000_000 if alone_below else 1)
    assert rounds(3) == one
    if alone_below == 1.0:        # never decided: every round timed on the calling thread
        assert all(alone is None and done == n for alone, done, n in decided)
    else:                         # decided for the pool in round 1, after 1 or 2 clients
        assert len(decided) == 1 and decided[0][0] is False
        assert decided[0][1] == (2 if alone_below == "switch" else 1) < decided[0][2]


@pytest.mark.parametrize("alone_below", [0.0, 1.0])
def test_a_failing_client_is_named_alike_on_the_calling_thread_or_the_pool(
        tmp_path, monkeypatch, alone_below):
    """Whichever thread trains them, the error raised names the first failing client in
    sorted order, as with one thread."""
    from edgefl.errors import NonFiniteError
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim import loop, run_federation
    from edgefl.strategies import select_clients
    config = load_run_config(write(tmp_path, small()))
    run = prepare_run(config, workers=1, progress=False)
    monkeypatch.setattr(loop._Pace, "ALONE_BELOW", alone_below)
    monkeypatch.setattr(loop._Pace, "PROBE", 1_000_000 if alone_below else 1)
    selected = select_clients(run.setup.seed, 1, run.setup.clients, config.clients_per_round)
    train = type(run.strategy).train

    def failing(self, task, data, state):         # all of round 1's clients but the first
        if data.client in selected[1:]:
            raise NonFiniteError(0, "boom")
        return train(self, task, data, state)
    monkeypatch.setattr(type(run.strategy), "train", failing)
    with pytest.raises(NonFiniteError, match=f"round 1, client {selected[1]}: "):
        run_federation(run.strategy, run.init_params, run.clients, run.setup,
                       config.clients_per_round, workers=3)


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("how", ["between-rounds", "mid-training"])
def test_a_stop_ends_the_run_with_the_rounds_done_recorded(tmp_path, workers, how):
    """A StopFlag set once round 1 is aggregated -- before round 2 opens (the event), or as
    a word that stops round 2's local rounds after 2 steps each (mid-training) -- ends
    run_federation with RunStopped(round 2): round 2 is dropped, and round 1 is recorded,
    evaluated (with several threads its evaluation was deferred into round 2, which never
    finished) and equal to round 1 of the run that was not stopped."""
    from edgefl.errors import RunStopped
    from edgefl.kernels import StopFlag
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim import run_federation

    config = load_run_config(write(tmp_path, small(eval_every=1)))
    flag = StopFlag()
    run = prepare_run(config, workers=1, progress=False, stop=flag)
    test = (run.dataset.x_test, run.dataset.y_test)
    models = {}
    unbroken = run_federation(run.strategy, run.init_params, run.clients, run.setup,
                              config.clients_per_round, test=test, workers=workers,
                              on_model=lambda r, m: models.__setitem__(r, m.copy()))

    def on_model(r, model):
        if r == 1:
            flag.set() if how == "between-rounds" else flag.stop_after_steps(2)

    seen = []
    with pytest.raises(RunStopped) as stopped:
        run_federation(run.strategy, run.init_params, run.clients, run.setup,
                       config.clients_per_round, test=test, workers=workers,
                       on_round=seen.append, on_model=on_model, stop=flag)
    assert stopped.value.round == 2 and stopped.value.rounds_planned == config.rounds
    result = stopped.value.result
    assert [rec["round"] for rec in seen] == [1] == [rec["round"] for rec in result.history]
    first = unbroken.history[0]
    assert (seen[0]["test_accuracy"], seen[0]["test_loss"]) == \
        (first["test_accuracy"], first["test_loss"])
    assert model_sha256(result.params) == model_sha256(models[1])


def test_byte_accounting_counts_the_float32_buffers_sent(tmp_path):
    """FedAvg moves M * 4d each way; MFL twice that (it sends the momentum buffer as well as the model)."""
    d = 650
    rows = {}
    for name in ("fedavg", "mfl"):
        out = tmp_path / name
        simulate(load_run_config(write(tmp_path, small(strategy={"name": name})), ), out,
                 progress=False)
        rows[name] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["uplink_bytes"] == r["downlink_bytes"] == 3 * 4 * d for r in rows["fedavg"])
    assert all(r["uplink_bytes"] == r["downlink_bytes"] == 2 * 3 * 4 * d for r in rows["mfl"])


# ---------------------------------------------------------------------------------------
# CLI and progress
# ---------------------------------------------------------------------------------------

def test_quickstart_reaches_90_percent(tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["simulate", "quickstart", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.9 and summary["rounds"] == 20
    captured = capsys.readouterr()
    assert captured.err == ""                                  # --quiet
    assert "final accuracy" in captured.out and str(out) in captured.out


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    path = write(tmp_path, small())
    assert main(["simulate", path, "--set", "strategy.name=fedsgd", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "strategy.name (from --set): unknown strategy 'fedsgd'" in err[0]


# Options of the wrong type (a string, a list, a boolean where a number goes; a string where
# a list of layer sizes goes) were TypeError tracebacks, or messages naming neither the file
# nor the key, or -- model.hidden: "64" -- a run of two hidden layers [6, 4]. Each is a
# user's mistake: one line naming the file, the key and the value, exit 1, nothing written,
# from `edgefl simulate` and from `edgefl partition` (which reads the same config).
BAD_OPTIONS = [
    (("partition.name=dirichlet", "partition.alpha=abc"),
     "run.yaml: partition: dirichlet: alpha must be a number, got 'abc'"),
    (("partition.name=dirichlet", "partition.alpha=[1]"),
     r"run.yaml: partition: dirichlet: alpha must be a finite number, got \[1\]"),
    (("partition.name=dirichlet", "partition.alpha=true"),     # a bool is not a number
     "run.yaml: partition: dirichlet: alpha must be a finite number, got True"),
    (("partition.name=quantity", "partition.sigma=abc"),
     "run.yaml: partition: quantity: sigma must be a number, got 'abc'"),
    (("partition.name=label-noise", "partition.rate=abc"),
     "run.yaml: partition: label-noise: rate must be a number, got 'abc'"),
    (("partition.name=label-noise", "partition.rate=[0.1, abc, 0, 0, 0, 0]"),
     r"run.yaml: partition: label-noise: rate\[1\] must be a number, got 'abc'"),
    (("partition.name=label-noise", "partition.rate=0.1", "partition.num_classes=abc"),
     "run.yaml: partition: label-noise: num_classes must be a positive integer, got 'abc'"),
    (("partition.name=mod", "partition.num_classes=abc"),
     "run.yaml: partition: mod: num_classes must be a positive integer, got 'abc'"),
    (("dataset={name: synthetic, alpha: abc}",),
     "run.yaml: dataset: synthetic: alpha must be a number, got 'abc'"),
    (("dataset={name: synthetic, beta: abc}",),
     "run.yaml: dataset: synthetic: beta must be a number, got 'abc'"),
    (("dataset={name: synthetic, beta: true}",),
     "run.yaml: dataset: synthetic: beta must be a finite number, got True"),
    (("model.name=mlp", "model.hidden=abc"),
     r"run.yaml: model.hidden \(from --set\): must be a list of positive integers, got 'abc'"),
    (("model.name=mlp", "model.hidden=[[1]]"),
     r"run.yaml: model.hidden \(from --set\): must be a list of positive integers, got \[\[1\]\]"),
    (("model.name=mlp", 'model.hidden="64"'),   # a string is not iterated into [6, 4]
     r"run.yaml: model.hidden \(from --set\): must be a list of positive integers, got '64'"),
    (("model.name=mlp", "model.hidden=[6.5]"),  # not truncated to 6
     r"run.yaml: model.hidden \(from --set\): must be a list of positive integers, got \[6.5\]"),
    (("model.name=cnn", "model.fc=abc"),
     r"run.yaml: model.fc \(from --set\): must be a list of positive integers, got 'abc'"),
    (("model.name=cnn", "model.conv=abc"),
     r"run.yaml: model.conv \(from --set\): must be a list of layers \{out, k, stride, pad, "
     r"pool\}, got 'abc'"),
    (("model.name=cnn", "model.conv=[{out: 4, k: abc}]"),
     r"run.yaml: model.conv\[0\].k \(from --set\): must be an integer >= 1, got 'abc'"),
    (("model.name=cnn", "model.conv=[{out: 4, k: 3, pool: true}]"),
     r"run.yaml: model.conv\[0\].pool \(from --set\): must be an integer >= 0, got True"),
    (("model.name=cnn", "model.conv=[4]"),
     r"run.yaml: model.conv\[0\] \(from --set\): must be a mapping of out, k"),
]


@pytest.mark.parametrize("command", ["simulate", "partition"])
@pytest.mark.parametrize("overrides, message", BAD_OPTIONS)
def test_cli_options_of_the_wrong_type_are_one_line_naming_file_key_and_value(
        tmp_path, capsys, command, overrides, message):
    import re

    path = write(tmp_path, small())
    out = tmp_path / ("o" if command == "simulate" else "o.png")
    extra = ["--quiet", "--no-plot", "--no-export"] if command == "simulate" else []
    args = [command, path, "--out", str(out), *extra]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edgefl {command}: error: "), lines
    assert re.search(message, lines[0]), lines[0]
    assert not out.exists()


def test_model_option_errors_are_found_when_the_config_is_read(tmp_path):
    # ctl start, the client's --partition and the aggregator check a config by reading it
    # (load_run_config) without building the model: the model's options are checked there
    with pytest.raises(ConfigError, match=r"run\.yaml: model\.hidden: must be a list of "
                                          r"positive integers, got '64'"):
        load_run_config(write(tmp_path, small(model={"name": "mlp", "hidden": "64"})))
    config = load_run_config(write(tmp_path, small(model={"name": "cnn-mnist", "fc": [32]})))
    assert config.model["fc"] == [32]       # a preset's options may still be replaced


def test_cli_reports_divergence_naming_round_and_client(tmp_path, capsys):
    path = write(tmp_path, small(model={"name": "mlp"}, train={"lr": 1e10}))
    assert main(["simulate", path, "--out", str(tmp_path / "o"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "training diverged: round 1, client" in err
    # the run had started: its directory is there, with the rounds before it (none here)
    assert f"(the rounds before it, if any, are in {tmp_path / 'o'}/metrics.jsonl)" in err
    assert (tmp_path / "o" / "metrics.jsonl").read_text() == ""


def test_progress_prints_one_line_per_round_when_not_a_tty():
    stream = io.StringIO()
    bar = Progress(3, stream)
    for r in (1, 2, 3):
        bar.update({"round": r, "test_accuracy": 0.5 + r / 10, "train_loss": 1.0 / r,
                    "elapsed_s": float(r), "wall_s": 1.0})
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[2].startswith("round 3/3 acc 0.8000")
    assert "ETA 1s" in lines[1] and "ETA 0s" in lines[2]
    silent = io.StringIO()
    Progress(3, silent, enabled=False).update({"round": 1, "test_accuracy": 0.5, "train_loss": 1.0,
                                                "elapsed_s": 1.0, "wall_s": 1.0})
    assert silent.getvalue() == ""


def test_progress_redraws_a_bar_on_a_tty():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    bar = Progress(4, stream)
    bar.update({"round": 2, "test_accuracy": None, "train_loss": 0.5, "elapsed_s": 2.0, "wall_s": 1.0})
    bar.close()
    text = stream.getvalue()
    assert text.startswith("\rround 2/4 [############------------]") and "ETA 2s" in text
    assert text.endswith("\n")
