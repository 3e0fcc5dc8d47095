"""The commands that work on run configs and their outputs, on this machine and without a
broker: partition, simulate, duw-train, info, export, predict, compare."""
from __future__ import annotations

import argparse
import sys

from .. import __version__
from .command import Command, UsageError, count
from .destinations import FORCE_HELP, check_new_file, check_out_dir


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """CONFIG plus repeatable --set overrides, shared by every subcommand that reads a config."""
    parser.add_argument("config", metavar="CONFIG", help="YAML run configuration")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a config value, e.g. partition.clients=20")


# ---------------------------------------------------------------------------------------
# edgefl partition
# ---------------------------------------------------------------------------------------

def _partition_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", default="partition.png", metavar="PNG",
                        help="heatmap file to write (default: partition.png in the current "
                             "directory); an existing file is refused without --force")
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)
    parser.add_argument("--no-plot", action="store_true", help="print the table only")


def _partition(args: argparse.Namespace) -> int:
    from ..config import dataset_from_config, partition_from_config
    from ..data.report import format_table, label_counts, save_heatmap
    from ..runconfig import load_run_config

    if not args.no_plot:
        check_new_file(args.out, args.force)
    # read as simulate reads it (a built-in config by name, unknown keys refused, every
    # section checked): the split shown is the one that config's run would train on
    config = load_run_config(args.config, args.overrides)
    sections = config.as_config()
    dataset = dataset_from_config(sections)
    split = partition_from_config(sections, dataset)
    counts = label_counts(dataset, split)
    spec = config.partition
    options = ", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("name", "clients"))
    title = (f"{dataset.name}: {spec['name']}({options}) over {len(split.indices)} clients, "
             f"seed {config.seed}")
    print(title)
    print(format_table(counts, split.sizes, dataset.class_names))
    if not args.no_plot:
        save_heatmap(counts, split.sizes, args.out, title)
        print(f"heatmap: {args.out}")
    return 0


PARTITION = Command(
    "partition",
    "print a per-client label-count table and write a heatmap PNG",
    _partition_arguments, _partition)


# ---------------------------------------------------------------------------------------
# edgefl simulate
# ---------------------------------------------------------------------------------------

def _simulate_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", metavar="DIR",
                        help="output directory, refused if it is not empty unless --force "
                             "(default: a new runs/NAME-YYYYmmdd-HHMMSS, NAME the config's "
                             "name, and runs/NAME links to the latest finished run)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty --out DIR (an earlier run's outputs "
                             "there go once this run starts; other files are kept); only "
                             "with --out")
    parser.add_argument("--no-plot", action="store_true",
                        help="do not draw curves.png (saves importing matplotlib, about "
                             "0.6 s)")
    parser.add_argument("--no-export", action="store_true",
                        help="do not export model.onnx (`edgefl export RUN_DIR` can make it "
                             "later from model.npz)")
    parser.add_argument("--workers", type=count, metavar="N",
                        help="client training threads (default: the number of CPUs)")
    parser.add_argument("--quiet", action="store_true", help="no progress output on stderr")
    parser.add_argument("--transport", choices=["inproc", "mqtt"], default="inproc",
                        help="inproc (default): clients as function calls; mqtt: the "
                             "aggregator and every client as roles with their own MQTT "
                             "connection, through --broker or an embedded broker")
    parser.add_argument("--broker", metavar="URL",
                        help="with --transport mqtt: mqtt://[user:pass@]host[:port] of a "
                             "running broker (default: start an embedded one for the run)")
    parser.add_argument("--chunk-size", type=int, default=128 * 1024, metavar="BYTES",
                        help="with --transport mqtt: bytes per MQTT message; larger frames "
                             "are chunked (default 131072, AWS IoT's limit)")
    parser.add_argument("--client-processes", type=int, default=None, metavar="N",
                        help="with --transport mqtt: fork N worker processes to host the "
                             "clients (0: host them in this process; default: 2, up to 4 for "
                             "large fleets; docs/scaling.md)")
    add_export_arguments(parser)


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """How a training run exports its model to <out>/model.onnx (edgefl.export.ExportPolicy)."""
    parser.add_argument("--export-every", type=int, default=0, metavar="N",
                        help="also export the global model to ONNX after every N-th round "
                             "(atomic replace of model.onnx; default 0: the final model only)")
    parser.add_argument("--export-quantize", choices=["none", "int8"], default="none",
                        help="int8: static quantisation of every export, calibrated on the "
                             "run's training data (default none)")
    parser.add_argument("--export-no-softmax", action="store_true",
                        help="exports without the probabilities output (scores only)")


def _simulate(args: argparse.Namespace) -> int:
    import os

    from ..errors import NonFiniteError, RunStopped
    from ..runconfig import load_run_config
    from ..service.signals import exit_status, install_stop_handlers
    from ..sim import simulate
    from .destinations import discard_if_empty, link_latest, new_run_dir

    if args.out is not None:
        check_out_dir(args.out, args.force)
    elif args.force:
        # without --out every run gets a new directory: nothing would be forced, and a
        # user who typed it probably meant to replace a run that is in fact kept
        raise UsageError("--force only applies to --out DIR (a non-empty directory to write "
                         "into); without --out each run gets a new directory under "
                         "runs/, so there is nothing to replace")
    if args.no_export and args.export_every:
        raise UsageError(f"--no-export and --export-every {args.export_every} contradict "
                         f"each other; drop one")
    config = load_run_config(args.config, args.overrides)
    name = os.path.splitext(os.path.basename(config.path or "run"))[0]
    if args.broker is not None and args.transport != "mqtt":
        raise ValueError("--broker needs --transport mqtt")
    if args.transport == "mqtt":
        from ..service.layered import check_setting

        # a board's transport.chunk_size rule, named by this command's option
        check_setting("transport.chunk_size", args.chunk_size, "--chunk-size")
    mqtt = {"max_payload": args.chunk_size} if args.transport == "mqtt" else None
    if args.client_processes is not None:
        if args.transport != "mqtt":
            raise ValueError("--client-processes needs --transport mqtt")
        if args.client_processes < 0:
            raise ValueError(f"--client-processes {args.client_processes}: need N >= 0 (0: "
                             f"the clients in this process)")
        mqtt["client_processes"] = args.client_processes
    from ..export import ExportPolicy

    if args.export_every < 0:
        raise ValueError(f"--export-every {args.export_every}: need N >= 0 (0: export the "
                         f"final model only)")
    export = ExportPolicy(every=args.export_every, softmax=not args.export_no_softmax,
                          quantize=args.export_quantize)
    out = args.out if args.out is not None else new_run_dir(name)
    try:
        # SIGINT (Ctrl-C) and SIGTERM stop the local rounds within one step (StopSignal's
        # stop word); simulate then writes the rounds done and raises RunStopped
        with install_stop_handlers() as stop:
            summary = simulate(config, out, workers=args.workers, progress=not args.quiet,
                               transport=args.transport, broker=args.broker, mqtt=mqtt,
                               export=None if args.no_export else export,
                               onnx=not args.no_export, plot=not args.no_plot, stop=stop)
    except RunStopped as exc:
        if args.out is None:            # stopped before writing: no empty run directory left
            discard_if_empty(out)
        done = exc.summary["stopped"]["rounds_done"] if exc.summary else 0
        print(f"edgefl simulate: stopped ({stop.name or 'stop requested'}) in round "
              f"{exc.round} of {config.rounds}, which is dropped; "
              + (f"rounds 1-{done} are in {out} (summary.json says it stopped)" if done else
                 f"no round was done ({out})"), file=sys.stderr)
        return exit_status(stop)
    except NonFiniteError as exc:
        print(f"edgefl simulate: training diverged: {exc} (the rounds before it, if any, are "
              f"in {out}/metrics.jsonl)", file=sys.stderr)
        return 1
    except BaseException:
        if args.out is None:            # failed before writing: no empty run directory left
            discard_if_empty(out)
        raise
    link = link_latest(out, name) if args.out is None else None
    print(f"{config.strategy}: final accuracy {summary['final_accuracy']:.4f} "
          f"(best {summary['best_accuracy']:.4f} at round {summary['best_round']}), "
          f"{summary['rounds']} rounds in {summary['wall_s']:.2f} s; outputs in {out}"
          + (f" ({link} links to it)" if link else ""))
    if "privacy" in summary and "epsilon" in summary["privacy"]:
        p = summary["privacy"]
        print(f"privacy: epsilon {p['epsilon']:.4g} at delta {p['delta']:g} ({p['accountant']}); "
              f"{p['epsilon_selection_known']:.4g} against whoever knows who was selected "
              f"({p['rounds_selected_most']} round(s) for the most selected client)")
    if summary.get("stopped"):
        print(f"stopped early: {summary['stopped']['message']}")
    return 0


SIMULATE = Command(
    "simulate",
    "run the aggregator and N clients in one process (CONFIG: a YAML file or a built-in "
    "config name such as quickstart)",
    _simulate_arguments, _simulate)


# ---------------------------------------------------------------------------------------
# edgefl duw-train
# ---------------------------------------------------------------------------------------

def _duw_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", required=True, metavar="JSON",
                        help="weight file to write (use it with strategy.weights=JSON); an "
                             "existing file is refused without --force")
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)
    parser.add_argument("--workers", type=count, metavar="N",
                        help="client simulation threads (default: the number of CPUs)")
    parser.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def _duw_train(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..runconfig import load_run_config
    from ..runs.prepare import prepare_run
    from ..strategies.duw import WEIGHTS_FILE, load_weights

    check_new_file(args.out, args.force)
    config = load_run_config(args.config, args.overrides)
    where = config.path or "<config>"
    if config.strategy != "duw":
        raise ConfigError(f"{where}: strategy.name: duw-train learns DUW weights; got "
                          f"{config.strategy!r} (set strategy.name = duw)")
    for key in ("weights", "table"):            # else the offline phase would not train
        if config.strategy_params.get(key) is not None:
            raise ConfigError(f"{where}: strategy.{key}: duw-train writes a new table; remove "
                              f"the key (--set strategy.{key}=)")
    # the strategy's offline phase (DUW.prepare) trains the table and writes it to --out
    prepare_run(config, workers=args.workers, progress=not args.quiet,
                out_files={WEIGHTS_FILE: args.out})
    doc = load_weights(args.out)
    curve = doc["meta_loss"]
    change = f"meta-loss {curve[0]:.4f} -> {curve[-1]:.4f}" if curve else "no meta-iterations"
    print(f"duw: {doc['rounds']} x {len(doc['clients'])} weight table ({doc['base']}), "
          f"{len(curve)} meta-iterations, {change}, {doc['wall_s']:.2f} s; written to {args.out}")
    return 0


DUW_TRAIN = Command(
    "duw-train",
    "learn DUW's rounds x clients aggregation-weight table offline by unrolled simulation "
    "and write it as JSON",
    _duw_train_arguments, _duw_train)


# ---------------------------------------------------------------------------------------
# edgefl info
# ---------------------------------------------------------------------------------------

def _info(args: argparse.Namespace) -> int:
    import numpy as np

    from .. import backend, kernels
    from ..data import dataset_status
    from ..data.cache import cache_dir

    have_blas = getattr(kernels.impl, "have_blas", None)
    blas = ("yes" if have_blas() else "no") if have_blas else "n/a (no BLAS in this backend)"
    print(f"edgefl   {__version__}")
    print(f"backend  {backend}")
    print(f"blas     {blas}")
    print(f"numpy    {np.__version__}")
    print(f"python   {sys.version.split()[0]}")
    print(f"cache    {cache_dir() or 'off (EDGEFL_CACHE_DIR)'}  (decoded data sets)")
    print("datasets")
    for name, status in dataset_status().items():
        print(f"  {name:<14} {status}")
    return 0


INFO = Command(
    "info",
    "print version, kernel backend, BLAS and the datasets available here",
    lambda parser: None, _info)


# ---------------------------------------------------------------------------------------
# edgefl export
# ---------------------------------------------------------------------------------------

def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run directory from `edgefl simulate` or its model.npz")
    parser.add_argument("--out", metavar="ONNX",
                        help="file to write, refused if it exists unless --force (default: "
                             "model.onnx, or model.int8.onnx with --quantize, next to the "
                             "checkpoint, which is made from it and is replaced)")
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)
    parser.add_argument("--quantize", choices=["int8"],
                        help="static int8 quantisation (onnxruntime), calibrated on training "
                             "samples; reports the test accuracy change")
    parser.add_argument("--no-softmax", action="store_true",
                        help="leave out the probabilities output (scores only)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _export(args: argparse.Namespace) -> int:
    import json
    import os

    from ..export import export_checkpoint

    out = args.out
    if out is not None:
        check_new_file(out, args.force)
    else:
        directory = args.source if os.path.isdir(args.source) else \
            os.path.dirname(os.path.abspath(args.source))
        out = os.path.join(directory, "model.int8.onnx" if args.quantize else "model.onnx")
    report = export_checkpoint(args.source, out, quantize=args.quantize,
                               softmax=not args.no_softmax)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"exported {report['model']} ({report['n_params']:,} parameters, "
          f"{report['algorithm'] or 'unknown algorithm'} round {report['round']}, layer table "
          f"{report['table_digest'][:12]}) to {report['out']} ({report['bytes']:,} bytes)")
    fp32, int8 = report["accuracy_fp32"], report["accuracy_int8"]
    if report["test_samples"]:
        print(f"test accuracy (onnxruntime, {report['test_samples']} samples): fp32 {fp32:.4f}"
              + (f", int8 {int8:.4f} (change {int8 - fp32:+.4f}; fp32 file "
                 f"{report['bytes_fp32']:,} bytes)" if int8 is not None else ""))
    elif fp32 is not None:
        print(f"test accuracy {fp32:.4f} (the run's summary; not re-measured: {report['note']})")
    elif report["note"]:
        print(f"test accuracy not measured: {report['note']}")
    return 0


EXPORT = Command(
    "export",
    "export a trained model (run directory or model.npz) to ONNX",
    _export_arguments, _export)


# ---------------------------------------------------------------------------------------
# edgefl predict
# ---------------------------------------------------------------------------------------

def _predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_ONNX", help="a model from `edgefl export`")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", metavar="FILE",
                        help=".npy or .csv of raw samples, or an image file for image models")
    source.add_argument("--from-dataset", nargs="?", const="", metavar="NAME",
                        help="instead of a file, the first --limit test samples of a built-in "
                             "data set, raw as the model takes them: NAME, or without it the "
                             "data set the model was trained on (its metadata)")
    parser.add_argument("--limit", type=count, metavar="N",
                        help="with --from-dataset: how many test samples (default 10)")
    parser.add_argument("--threads", type=count, default=1, metavar="N",
                        help="onnxruntime threads (default 1)")
    parser.add_argument("--top", type=count, default=3, metavar="K",
                        help="classes listed per sample (default 3)")
    parser.add_argument("--json", action="store_true",
                        help="print classes and all probabilities as JSON")


def _dataset_samples(name: str, limit: int, predictor) -> tuple:
    """(raw samples, their labels, a description) for `predict --from-dataset`: the first
    `limit` test samples of data set `name` (the model's own data set section when name is
    empty), with the loader's normalisation undone, since the graph normalises itself."""
    import json

    from ..data import load_dataset
    from ..export.onnx import raw_inputs

    if name:
        options = {"name": name}
    else:
        options = json.loads(predictor.metadata.get("dataset") or "{}")
        if not options.get("name"):
            raise ValueError("--from-dataset: the model does not name the data set it was "
                             "trained on; name one: --from-dataset NAME")
    options = dict(options)
    name = options.pop("name")
    dataset = load_dataset(name, **options)
    if tuple(dataset.input_shape) != tuple(predictor.input_shape):
        raise ValueError(f"--from-dataset {name}: its samples have shape "
                         f"{tuple(dataset.input_shape)}, the model takes "
                         f"{tuple(predictor.input_shape)}")
    raw = raw_inputs(dataset, dataset.x_test[:limit])
    return raw, dataset.y_test[:len(raw)], f"{name} test samples 0..{len(raw) - 1}"


def _predict(args: argparse.Namespace) -> int:
    import json

    from ..infer import Predictor, read_inputs

    predictor = Predictor(args.model, threads=args.threads, check_interval=None)
    meta = predictor.metadata
    labels = None
    if args.input is not None:
        if args.limit is not None:
            raise ValueError("--limit counts --from-dataset's samples; a --input file is "
                             "read whole")
        input_range = json.loads(meta["input_range"]) if meta.get("input_range") else None
        x = read_inputs(args.input, predictor.input_shape, input_range)
        source = args.input
    else:
        x, labels, source = _dataset_samples(args.from_dataset,
                                             10 if args.limit is None else args.limit, predictor)
    if meta.get("decision") == "none":
        values = predictor.scores(x)
        if args.json:
            doc = {"model": args.model, "input": source, "values": values.tolist()}
            print(json.dumps(doc if labels is None else {**doc, "labels": labels.tolist()}))
        else:
            for i, row in enumerate(values):
                print(f"{i}: " + " ".join(f"{v:.6g}" for v in row))
        return 0
    classes, probs = predictor.predict(x)
    names = predictor.class_names
    if args.json:
        doc = {"model": args.model, "input": source, "class_names": list(names),
               "classes": classes.tolist(), "names": [names[c] for c in classes],
               "probabilities": probs.tolist()}
        print(json.dumps(doc if labels is None else {**doc, "labels": labels.tolist()}))
        return 0
    top = min(args.top, probs.shape[1])      # --top is >= 1 (command.count)
    for i, (c, p) in enumerate(zip(classes, probs)):
        best = sorted(range(len(p)), key=lambda k: -p[k])[:top]
        listed = ", ".join(f"{names[k]} {p[k]:.4f}" for k in best)
        truth = "" if labels is None else f"  (true: {names[int(labels[i])]})"
        print(f"{i}: {names[c]} (class {c}, p={p[c]:.4f})  top {top}: {listed}{truth}")
    return 0


PREDICT = Command(
    "predict",
    "classify samples (npy, csv, an image, or a data set's test samples) with an exported "
    "ONNX model",
    _predict_arguments, _predict)


# edgefl compare
# ---------------------------------------------------------------------------------------

def _compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="run directories of "
                        "`edgefl simulate` (each holding summary.json and metrics.jsonl)")
    parser.add_argument("--target", type=float, metavar="ACC",
                        help="add a rounds-to-target column: the first round whose test "
                             "accuracy is >= ACC (a fraction, e.g. 0.9); * = not reached")
    parser.add_argument("--out", default="compare.png", metavar="PNG",
                        help="overlay plot of accuracy and loss by round (default: compare.png "
                             "in the current directory); an existing file is refused without "
                             "--force")
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    parser.add_argument("--json", action="store_true",
                        help="print the rows as JSON instead of a Markdown table")


def _compare(args: argparse.Namespace) -> int:
    import json

    from ..compare import check_target, comparison_rows, load_runs, markdown_table, plot_overlay

    if not args.no_plot:
        check_new_file(args.out, args.force)
    target = None if args.target is None else check_target(args.target)
    runs = load_runs(args.dirs)
    rows = comparison_rows(runs, target)
    plot = None if args.no_plot else args.out
    if plot is not None:
        plot_overlay(runs, plot, target)
    if args.json:
        print(json.dumps({"target": target, "plot": plot, "runs": rows}, indent=1))
    else:
        print(markdown_table(rows, target))
        if plot is not None:
            print(f"\noverlay plot: {plot}")
    return 0


COMPARE = Command(
    "compare",
    "compare finished runs: a Markdown table (final/best accuracy, rounds to a target, bytes "
    "moved, wall time) and an overlay plot",
    _compare_arguments, _compare)
