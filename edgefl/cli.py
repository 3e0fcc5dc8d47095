"""The `edgefl` command. Each subcommand is one `Command` (its arguments and the function that
runs it) added with `register`; `main` builds the parser from the registry.

To add a subcommand:

    def _simulate_arguments(parser): parser.add_argument("config")
    def _simulate(args) -> int: ...
    register(Command("simulate", "run N clients and the aggregator in one process",
                     _simulate_arguments, _simulate))
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Callable

from . import __version__


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    if command.name in COMMANDS:
        raise ValueError(f"edgefl: subcommand {command.name!r} is registered twice")
    COMMANDS[command.name] = command
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgefl",
                                     description="Federated learning for edge boards.")
    parser.add_argument("--version", action="version", version=f"edgefl {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS.values():
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(_command=command)
    return parser


def main(argv=None) -> int:
    """Entry point of the `edgefl` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = getattr(args, "_command", None)
    if command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return command.run(args)
    except (ValueError, OSError, ImportError) as exc:
        # Bad input (config, data, files): one line naming the cause, no traceback.
        print(f"edgefl {command.name}: error: {exc}", file=sys.stderr)
        return 1


def console_main(argv=None) -> int:
    """The `edgefl` console script and `python -m edgefl.cli`: main(), and then, if a client
    stopped mid-round left its local round running in a worker thread, an immediate exit
    (os._exit) with main's status once logs and output are flushed. The thread is inside the
    C core; a normal exit would run the C libraries' destructors under it and end the
    process with SIGSEGV (edgefl.roles.client.training_in_progress). Everything the client
    keeps is on disk and its connection is closed by then; only the abandoned round, which
    is trained again after a restart, is cut short."""
    try:
        code = main(argv)
    except BaseException as exc:            # Ctrl-C in a simulation over MQTT, a bug
        if not _training_left_running():
            raise
        traceback.print_exc()
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    if _training_left_running():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _training_left_running() -> bool:
    client = sys.modules.get("edgefl.roles.client")
    return client is not None and client.training_in_progress()


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
                             "directory)")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")


def _partition(args: argparse.Namespace) -> int:
    from .config import dataset_from_config, load_config, partition_from_config, section, seed_of
    from .data.report import format_table, label_counts, save_heatmap

    config = load_config(args.config, args.overrides)
    dataset = dataset_from_config(config)
    split = partition_from_config(config, dataset)
    counts = label_counts(dataset, split)
    spec = section(config, "partition")
    options = ", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("name", "clients"))
    title = (f"{dataset.name}: {spec['name']}({options}) over {len(split.indices)} clients, "
             f"seed {seed_of(config)}")
    print(title)
    print(format_table(counts, split.sizes, dataset.class_names))
    if not args.no_plot:
        save_heatmap(counts, split.sizes, args.out, title)
        print(f"heatmap: {args.out}")
    return 0


register(Command("partition", "print a per-client label-count table and write a heatmap PNG",
                 _partition_arguments, _partition))


# ---------------------------------------------------------------------------------------
# edgefl simulate
# ---------------------------------------------------------------------------------------

def _simulate_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", metavar="DIR",
                        help="output directory (default: runs/<config name>)")
    parser.add_argument("--workers", type=int, metavar="N",
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

    from .errors import NonFiniteError
    from .runconfig import load_run_config
    from .sim import simulate

    config = load_run_config(args.config, args.overrides)
    stem = os.path.splitext(os.path.basename(config.path or "run"))[0]
    out = args.out or os.path.join("runs", stem)
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers {args.workers}: need at least 1 thread")
    if args.broker is not None and args.transport != "mqtt":
        raise ValueError("--broker needs --transport mqtt")
    mqtt = {"max_payload": args.chunk_size} if args.transport == "mqtt" else None
    from .export import ExportPolicy

    if args.export_every < 0:
        raise ValueError(f"--export-every {args.export_every}: need N >= 0 (0: export the "
                         f"final model only)")
    export = ExportPolicy(every=args.export_every, softmax=not args.export_no_softmax,
                          quantize=args.export_quantize)
    try:
        summary = simulate(config, out, workers=args.workers, progress=not args.quiet,
                           transport=args.transport, broker=args.broker, mqtt=mqtt,
                           export=export)
    except NonFiniteError as exc:
        print(f"edgefl simulate: training diverged: {exc}", file=sys.stderr)
        return 1
    print(f"{config.strategy}: final accuracy {summary['final_accuracy']:.4f} "
          f"(best {summary['best_accuracy']:.4f} at round {summary['best_round']}), "
          f"{summary['rounds']} rounds in {summary['wall_s']:.2f} s; outputs in {out}")
    return 0


register(Command("simulate", "run the aggregator and N clients in one process (CONFIG: a YAML "
                             "file or a built-in config name such as quickstart)",
                 _simulate_arguments, _simulate))


# ---------------------------------------------------------------------------------------
# edgefl duw-train
# ---------------------------------------------------------------------------------------

def _duw_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", required=True, metavar="JSON",
                        help="weight file to write (use it with strategy.weights=JSON)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="client simulation threads (default: the number of CPUs)")
    parser.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def _duw_train(args: argparse.Namespace) -> int:
    from .config import ConfigError
    from .runconfig import load_run_config
    from .sim import prepare_run
    from .strategies.duw import WEIGHTS_FILE, load_weights

    config = load_run_config(args.config, args.overrides)
    where = config.path or "<config>"
    if config.strategy != "duw":
        raise ConfigError(f"{where}: strategy.name: duw-train learns DUW weights; got "
                          f"{config.strategy!r} (set strategy.name = duw)")
    for key in ("weights", "table"):            # else the offline phase would not train
        if config.strategy_params.get(key) is not None:
            raise ConfigError(f"{where}: strategy.{key}: duw-train writes a new table; remove "
                              f"the key (--set strategy.{key}=)")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers {args.workers}: need at least 1 thread")
    # the strategy's offline phase (DUW.prepare) trains the table and writes it to --out
    prepare_run(config, workers=args.workers, progress=not args.quiet,
                out_files={WEIGHTS_FILE: args.out})
    doc = load_weights(args.out)
    curve = doc["meta_loss"]
    change = f"meta-loss {curve[0]:.4f} -> {curve[-1]:.4f}" if curve else "no meta-iterations"
    print(f"duw: {doc['rounds']} x {len(doc['clients'])} weight table ({doc['base']}), "
          f"{len(curve)} meta-iterations, {change}, {doc['wall_s']:.2f} s; written to {args.out}")
    return 0


register(Command("duw-train", "learn DUW's rounds x clients aggregation-weight table offline by "
                              "unrolled simulation and write it as JSON",
                 _duw_train_arguments, _duw_train))


# ---------------------------------------------------------------------------------------
# edgefl info
# ---------------------------------------------------------------------------------------

def _info(args: argparse.Namespace) -> int:
    import numpy as np

    from . import backend, kernels
    from .data import dataset_status

    have_blas = getattr(kernels.impl, "have_blas", None)
    blas = ("yes" if have_blas() else "no") if have_blas else "n/a (no BLAS in this backend)"
    print(f"edgefl   {__version__}")
    print(f"backend  {backend}")
    print(f"blas     {blas}")
    print(f"numpy    {np.__version__}")
    print(f"python   {sys.version.split()[0]}")
    print("datasets")
    for name, status in dataset_status().items():
        print(f"  {name:<14} {status}")
    return 0


register(Command("info", "print version, kernel backend, BLAS and the datasets available here",
                 lambda parser: None, _info))


# ---------------------------------------------------------------------------------------
# edgefl export
# ---------------------------------------------------------------------------------------

def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run directory from `edgefl simulate` or its model.npz")
    parser.add_argument("--out", metavar="ONNX",
                        help="file to write (default: model.onnx, or model.int8.onnx with "
                             "--quantize, next to the checkpoint)")
    parser.add_argument("--quantize", choices=["int8"],
                        help="static int8 quantisation (onnxruntime), calibrated on training "
                             "samples; reports the test accuracy change")
    parser.add_argument("--no-softmax", action="store_true",
                        help="leave out the probabilities output (scores only)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _export(args: argparse.Namespace) -> int:
    import json
    import os

    from .export import export_checkpoint

    out = args.out
    if out is None:
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


register(Command("export", "export a trained model (run directory or model.npz) to ONNX",
                 _export_arguments, _export))


# ---------------------------------------------------------------------------------------
# edgefl predict
# ---------------------------------------------------------------------------------------

def _predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_ONNX", help="a model from `edgefl export`")
    parser.add_argument("--input", required=True, metavar="FILE",
                        help=".npy or .csv of raw samples, or an image file for image models")
    parser.add_argument("--threads", type=int, default=1, metavar="N",
                        help="onnxruntime threads (default 1)")
    parser.add_argument("--top", type=int, default=3, metavar="K",
                        help="classes listed per sample (default 3)")
    parser.add_argument("--json", action="store_true",
                        help="print classes and all probabilities as JSON")


def _predict(args: argparse.Namespace) -> int:
    import json

    from .infer import Predictor, read_inputs

    predictor = Predictor(args.model, threads=args.threads, check_interval=None)
    meta = predictor.metadata
    input_range = json.loads(meta["input_range"]) if meta.get("input_range") else None
    x = read_inputs(args.input, predictor.input_shape, input_range)
    if meta.get("decision") == "none":
        values = predictor.scores(x)
        if args.json:
            print(json.dumps({"model": args.model, "input": args.input,
                              "values": values.tolist()}))
        else:
            for i, row in enumerate(values):
                print(f"{i}: " + " ".join(f"{v:.6g}" for v in row))
        return 0
    classes, probs = predictor.predict(x)
    names = predictor.class_names
    if args.json:
        print(json.dumps({"model": args.model, "input": args.input, "class_names": list(names),
                          "classes": classes.tolist(),
                          "names": [names[c] for c in classes],
                          "probabilities": probs.tolist()}))
        return 0
    top = max(1, min(args.top, probs.shape[1]))
    for i, (c, p) in enumerate(zip(classes, probs)):
        best = sorted(range(len(p)), key=lambda k: -p[k])[:top]
        listed = ", ".join(f"{names[k]} {p[k]:.4f}" for k in best)
        print(f"{i}: {names[c]} (class {c}, p={p[c]:.4f})  top {top}: {listed}")
    return 0


register(Command("predict", "classify samples (npy, csv or an image) with an exported ONNX model",
                 _predict_arguments, _predict))


# ---------------------------------------------------------------------------------------
# edgefl broker
# ---------------------------------------------------------------------------------------

def _broker_arguments(parser: argparse.ArgumentParser) -> None:
    from .transport.broker import DEFAULT_MAX_PACKET_BYTES, KINDS

    parser.add_argument("--port", type=int, default=1883, metavar="N",
                        help="TCP port (default 1883; 0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; the embedded broker "
                             "is anonymous: use broker/mosquitto.conf for a network)")
    parser.add_argument("--kind", choices=KINDS, default="auto",
                        help="mosquitto (found on PATH), python (amqtt, pip install "
                             "'edgefl[broker]'), or auto: mosquitto when installed")
    parser.add_argument("--max-packet-bytes", type=int, default=DEFAULT_MAX_PACKET_BYTES,
                        metavar="N", help="largest MQTT packet accepted (default "
                                          f"{DEFAULT_MAX_PACKET_BYTES})")


def _broker(args: argparse.Namespace) -> int:
    import signal
    import threading

    from .transport.broker import EmbeddedBroker

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with EmbeddedBroker(port=args.port, kind=args.kind, host=args.host,
                        max_packet_bytes=args.max_packet_bytes) as broker:
        print(f"edgefl broker: {broker.kind} listening on {broker.url} (max packet "
              f"{broker.max_packet_bytes} bytes); Ctrl-C or SIGTERM stops it", flush=True)
        while not stop.wait(1.0):
            if not broker.running:
                print(f"edgefl broker: the {broker.kind} broker exited: "
                      f"{broker.log_tail() or 'no output'}", file=sys.stderr)
                return 1
    print("edgefl broker: stopped", flush=True)
    return 0


register(Command("broker", "run the embedded MQTT broker (Mosquitto or amqtt) on this machine "
                           "until SIGINT/SIGTERM",
                 _broker_arguments, _broker))


# ---------------------------------------------------------------------------------------
# edgefl config show
# ---------------------------------------------------------------------------------------

def _config_arguments(parser: argparse.ArgumentParser) -> None:
    from .service.layered import ROLES, add_service_config_arguments

    actions = parser.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print a service's resolved settings and where each "
                                           "came from (defaults, profile, site file, --set)")
    show.add_argument("--role", choices=ROLES, default="client",
                      help="the service whose settings to resolve (default: client)")
    add_service_config_arguments(show, site_option="--site")
    show.add_argument("--id", dest="node_id", metavar="ID",
                      help="with --role client: the site file `edgefl install-service` wrote "
                           "for client ID, /etc/edgefl/client-ID.yaml (instead of --site)")
    show.add_argument("--json", action="store_true", help="values and sources as JSON")


def _config(args: argparse.Namespace) -> int:
    from .service.layered import service_config_from_args, to_json_text

    config = service_config_from_args(args.role, args)
    print(to_json_text(config) if args.json else config.describe())
    return 0


register(Command("config", "inspect the layered service configuration (config show)",
                 _config_arguments, _config))


# ---------------------------------------------------------------------------------------
# edgefl install-service
# ---------------------------------------------------------------------------------------

def _install_service_arguments(parser: argparse.ArgumentParser) -> None:
    from .service.install import ROLE_UNITS

    parser.add_argument("--role", required=True, choices=list(ROLE_UNITS),
                        help="the service to install")
    parser.add_argument("--id", dest="node_id", metavar="ID",
                        help="client id (client), the client whose model to serve (infer), "
                             "node id (aggregator; default: aggregator)")
    parser.add_argument("--profile", metavar="NAME",
                        help="device profile (default: detected from the board)")
    parser.add_argument("--prefix", default="/", metavar="DIR",
                        help="stage the files under DIR instead of / (default: /)")
    parser.add_argument("--python", metavar="PATH",
                        help="interpreter the unit runs (default: this one, sys.executable); "
                             "it must import edgefl (checked by running PATH -c 'import "
                             "edgefl')")
    parser.add_argument("--no-python-check", dest="check_python", action="store_false",
                        help="with --prefix, staging for another machine: check only the "
                             "interpreter's path, not that it exists here and imports edgefl")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the files and commands, write nothing")


def _install_service(args: argparse.Namespace) -> int:
    from .service.install import format_report, install, plan_install

    plan = plan_install(args.role, args.node_id, profile=args.profile, prefix=args.prefix,
                        python=args.python, check_python=args.check_python)
    done = install(plan, dry_run=args.dry_run)
    print(format_report(plan, done, args.dry_run))
    return 0


register(Command("install-service", "write a systemd unit and site-file skeleton for a role and "
                                    "print the systemctl commands (it runs none of them)",
                 _install_service_arguments, _install_service))


# ---------------------------------------------------------------------------------------
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
                             "in the current directory)")
    parser.add_argument("--json", action="store_true",
                        help="print the rows as JSON instead of a Markdown table")


def _compare(args: argparse.Namespace) -> int:
    import json

    from .compare import check_target, comparison_rows, load_runs, markdown_table, plot_overlay

    target = None if args.target is None else check_target(args.target)
    runs = load_runs(args.dirs)
    rows = comparison_rows(runs, target)
    plot_overlay(runs, args.out, target)
    if args.json:
        print(json.dumps({"target": target, "plot": args.out, "runs": rows}, indent=1))
    else:
        print(markdown_table(rows, target))
        print(f"\noverlay plot: {args.out}")
    return 0


register(Command("compare", "compare finished runs: a Markdown table (final/best accuracy, "
                            "rounds to a target, bytes moved, wall time) and an overlay plot",
                 _compare_arguments, _compare))


# ---------------------------------------------------------------------------------------
# edgefl aggregator / edgefl client / edgefl status: the roles over MQTT
# ---------------------------------------------------------------------------------------

def _mqtt_transport(config, client_id: str, **options):
    """An MqttTransport from a service config's broker section (url, user, password file,
    TLS files)."""
    from .transport.mqtt import MqttTransport

    broker = config.section("broker")
    tls = {k: broker[k] for k in ("ca_file", "cert_file", "key_file") if broker.get(k)}
    transport = MqttTransport(broker["url"], client_id, username=broker.get("username"),
                              password_file=broker.get("password_file"), **tls, **options)
    transport.set_queue_limits(config["limits.queue_messages"], config["limits.queue_mb"] << 20)
    return transport


def _reassembly_limits(config) -> dict:
    """The role settings of the service config's limits section (None: the role sizes it)."""
    mib = {"reassembly_bytes": "limits.reassembly_mb"}
    if config.role == "aggregator":
        mib["reassembly_bytes_per_sender"] = "limits.sender_reassembly_mb"
    limits = {name: None if config[key] is None else config[key] << 20
              for name, key in mib.items()}
    limits["chunks_per_sender"] = config["limits.chunks_per_sender"]
    return limits


def _role_start(role: str, args: argparse.Namespace, extra_overrides=()):
    from .service import logs, profiles
    from .service.layered import load_service_config

    config = load_service_config(role, args.site, profile=args.profile,
                                 overrides=list(args.overrides) + list(extra_overrides))
    logs.setup_logging(config["log.level"])
    profiles.apply_threads(config["compute.threads"])
    return config


def _aggregator_arguments(parser: argparse.ArgumentParser) -> None:
    from .service.layered import add_service_config_arguments

    add_service_config_arguments(parser)
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="a round closes this long after it is announced, with the "
                             "updates it has (default 300)")
    parser.add_argument("--quorum", type=float, metavar="FRACTION",
                        help="close a round early once this fraction of its uploaders sent "
                             "their update (default 1.0: all of them, or the deadline)")
    parser.add_argument("--min-updates", type=int, metavar="N",
                        help="fewest updates a round is aggregated with; fewer at the deadline "
                             "announce the round again (default 1)")
    parser.add_argument("--clients", metavar="ID,ID,...",
                        help="the client ids of the federation, in the order of the run "
                             "config's partition (default: client-0 ... client-<N-1>)")
    parser.add_argument("--out", metavar="DIR",
                        help="where the site file's run writes metrics.jsonl, summary.json "
                             "and model.npz (default: <state_dir>/run; runs started on the "
                             "control topic write to <state_dir>/runs/<id>/)")
    parser.add_argument("--once", action="store_true",
                        help="exit once no run is active or queued (the site file's run done) "
                             "instead of waiting for the next run")


def _export_policy(config):
    """The ExportPolicy of the aggregator's export.* settings."""
    from .export import ExportPolicy

    return ExportPolicy(every=config["export.every"], softmax=config["export.softmax"],
                        quantize=config["export.quantize"])


def _aggregator(args: argparse.Namespace) -> int:
    import os

    from .roles import AggregatorSettings
    from .roles.daemon import Daemon, DaemonSettings
    from .service.notify import Notifier
    from .service.signals import install_stop_handlers

    config = _role_start("aggregator", args)
    state_dir = config.state_dir
    out = args.out or os.path.join(state_dir, "run")

    def setting(flag, key, default):
        # the command line, else the site file when the layered schema declares the key
        # (`clients`, `round.deadline`, `round.quorum`, `round.min_updates`), else default
        return flag if flag is not None else config.get(key, default)

    clients = setting([c.strip() for c in args.clients.split(",")] if args.clients else None,
                      "clients", None)
    settings = AggregatorSettings(node_id=config["node.id"],
                                  federation=config["node.federation"],
                                  round_timeout_s=setting(args.deadline, "round.deadline", 300.0),
                                  quorum=setting(args.quorum, "round.quorum", 1.0),
                                  min_updates=setting(args.min_updates, "round.min_updates", 1),
                                  offline_grace_s=config.get("round.offline_grace", 3.0),
                                  max_payload=config["transport.chunk_size"],
                                  compression=config["transport.compression"],
                                  profile=config.profile, **_reassembly_limits(config))
    daemon_settings = DaemonSettings(settings, client_ids=tuple(clients) if clients else None,
                                     once=args.once,
                                     run_options={"export": _export_policy(config),
                                                  "publish_onnx": config["export.publish"],
                                                  "onnx_record_dir": state_dir})

    def transport(client_id, **options):
        return _mqtt_transport(config, client_id, **options)

    notifier = Notifier.from_environment()
    site_run = (config["run"], out) if config["run"] else None
    # the pings stop when the main loop (the daemon's, or its run's) stops beating
    with install_stop_handlers() as stop, \
            notifier.watchdog_pinger(healthy=notifier.heartbeat_check()):
        daemon = Daemon(daemon_settings, state_dir, transport, stop=stop, notifier=notifier,
                        site_run=site_run)
        daemon.run()
        notifier.stopping()
    for run_id in daemon.executed:
        record = daemon.records[run_id]
        where = record["out_dir"]
        if record["state"] == "finished":
            print(f"run {run_id}: finished, final accuracy {record['final_accuracy']:.4f}, "
                  f"{record['rounds_done']} rounds, model sha256 {record['model_sha256']}; "
                  f"outputs in {where}", flush=True)
        elif record["state"] in ("running", "paused"):
            print(f"run {run_id}: interrupted ({stop.name or 'stop requested'}); the checkpoint "
                  f"in {record['state_dir']} resumes the run", flush=True)
        else:
            detail = record.get("error") or f"outputs in {where}"
            print(f"run {run_id}: {record['state']}; {detail}", flush=True)
    if stop.is_set():
        print(f"edgefl aggregator: stopped ({stop.name or 'stop requested'})", flush=True)
    return 1 if any(daemon.records[r]["state"] == "failed" for r in daemon.executed) \
        and args.once else 0


register(Command("aggregator", "the aggregator service: runs the federation's rounds over MQTT, "
                               "one run at a time, started and steered on the control topic "
                               "(and the site file's `run` first); resumes from its checkpoints",
                 _aggregator_arguments, _aggregator))


def _client_arguments(parser: argparse.ArgumentParser) -> None:
    from .service.layered import add_service_config_arguments

    add_service_config_arguments(parser)
    parser.add_argument("--partition", metavar="RUN_CONFIG",
                        help="train on a shard of this run config's dataset and partition "
                             "(a simulated or test fleet) instead of the site file's data")
    parser.add_argument("--shard", type=int, metavar="INDEX",
                        help="with --partition: which client's shard (0-based)")
    parser.add_argument("--exit-when-finished", action="store_true",
                        help="exit once the run is finished instead of waiting for the next")


def _client(args: argparse.Namespace) -> int:
    import json

    from .roles import Client, ClientSettings
    from .service import profiles
    from .service.notify import Notifier
    from .service.signals import install_stop_handlers

    if (args.partition is None) != (args.shard is None):
        raise ValueError("--partition and --shard go together")
    run_config, extra = None, []
    if args.partition is not None:
        from .runconfig import load_run_config
        from .sim import _absolute_paths

        run_config = load_run_config(args.partition)
        # the site file's data is the run's dataset (shown by `edgefl config show`)
        extra = [f"data={json.dumps(_absolute_paths(run_config.dataset, run_config.path))}"]
    config = _role_start("client", args, extra)
    if run_config is not None:
        from .sim import client_shard

        x, y = client_shard(run_config, args.shard)
    else:
        from .data import load_dataset

        data = dict(config["data"])
        dataset = load_dataset(data.pop("name"), **data)
        x, y = dataset.x_train, dataset.y_train
    rss = profiles.check_memory_budget(config["compute.memory_budget_mb"], "after loading data")
    node = config["node.id"]
    logging.getLogger("edgefl.roles.client").info(
        "%s: %d samples of shape %s loaded (%.0f MiB resident)", node, len(x), x.shape[1:], rss)
    settings = ClientSettings(node, config["node.federation"],
                              max_payload=config["transport.chunk_size"],
                              compression=config["transport.compression"],
                              exit_when_finished=args.exit_when_finished,
                              profile=config.profile, **_reassembly_limits(config),
                              # the board's limits: a run asking more is refused
                              max_params=config["compute.max_params"],
                              max_batch_size=config["compute.max_batch_size"],
                              memory_budget_mb=config["compute.memory_budget_mb"])
    transport = _mqtt_transport(config, node)
    notifier = Notifier.from_environment()
    # the pings stop when the client's main loop stops beating
    with install_stop_handlers() as stop, \
            notifier.watchdog_pinger(healthy=notifier.heartbeat_check()):
        client = Client(settings, (x, y), transport, config.state_dir, stop=stop,
                        notifier=notifier)
        client.run()
        notifier.stopping()
    print(f"edgefl client {node}: {'run finished' if client.finished else 'stopped'}; last "
          f"round trained {client.progress.trained}", flush=True)
    return 0


register(Command("client", "train on this node's data whenever the aggregator's round tasks "
                           "it (site file: id, data, broker, state directory)",
                 _client_arguments, _client))


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from .service.layered import add_service_config_arguments

    add_service_config_arguments(parser)


def _serve(args: argparse.Namespace) -> int:
    from .serve import InferenceService, serve, socket_path_for
    from .service import logs
    from .service.layered import load_service_config
    from .service.notify import Notifier
    from .service.signals import install_stop_handlers

    config = load_service_config("infer", args.site, profile=args.profile,
                                 overrides=args.overrides)
    logs.setup_logging(config["log.level"])
    service = InferenceService(config["infer.model"], threads=config["infer.threads"],
                               check_interval=config["infer.check_interval"],
                               max_request_bytes=config["infer.max_request_bytes"])
    path = socket_path_for(config["infer.socket"], lambda: config.state_dir)
    notifier = Notifier.from_environment()
    with install_stop_handlers() as stop:
        status = serve(service, path, listen=config["infer.listen"], stop=stop,
                       notifier=notifier)
    print(f"edgefl serve: stopped ({stop.name or 'stop requested'}) after "
          f"{service.requests} requests", flush=True)
    return status


register(Command("serve", "serve predictions of the latest ONNX model over HTTP on a Unix "
                          "socket (and optionally TCP); reloads the model file when the "
                          "client replaces it",
                 _serve_arguments, _serve))


def _status_arguments(parser: argparse.ArgumentParser) -> None:
    from .service.layered import add_service_config_arguments

    add_service_config_arguments(parser)
    parser.add_argument("--role", choices=["aggregator", "client"], default="aggregator",
                        help="whose site file --config is (default aggregator)")
    parser.add_argument("--broker", metavar="URL",
                        help="broker to ask, without a site file (default "
                             "mqtt://localhost:1883)")
    parser.add_argument("--federation", metavar="ID", help="federation id (default: the site "
                        "file's node.federation, else 'default')")
    parser.add_argument("--wait", type=float, default=2.0, metavar="SECONDS",
                        help="longest wait for the retained statuses (default 2)")
    parser.add_argument("--json", action="store_true", help="print the statuses as JSON")


def _status(args: argparse.Namespace) -> int:
    import json
    import os
    import time

    from .roles.messages import MessageError, parse_status
    from .service.status import format_fleet
    from .transport.base import Message
    from .transport.mqtt import MqttTransport
    from .transport.topics import Topics

    client_id = f"edgefl-status-{os.getpid()}-{os.urandom(3).hex()}"
    config = None
    if args.site is not None or args.overrides or args.profile is not None:
        from .service.layered import load_service_config

        config = load_service_config(args.role, args.site, profile=args.profile,
                                     overrides=args.overrides)
    if args.broker is not None:
        transport = MqttTransport(args.broker, client_id, clean_session=True)
    elif config is not None:
        transport = _mqtt_transport(config, client_id, clean_session=True)
    else:
        transport = MqttTransport("mqtt://localhost:1883", client_id, clean_session=True)
    federation = args.federation or (config["node.federation"] if config else "default")
    topics = Topics(federation)
    transport.connect()
    statuses = {}
    try:
        transport.subscribe(topics.subscription("status"), qos=1)
        end = time.monotonic() + max(0.0, args.wait)
        quiet_until = time.monotonic() + min(0.5, args.wait)
        while time.monotonic() < min(end, quiet_until):
            item = transport.receive(timeout=max(0.0, min(end, quiet_until) - time.monotonic()))
            if not isinstance(item, Message) or not item.payload:
                continue
            quiet_until = time.monotonic() + 0.3      # retained ones come in a burst
            try:
                _, node = topics.parse(item.topic)
                statuses[node] = parse_status(item.payload, node)
            except (MessageError, ValueError) as exc:
                print(f"edgefl status: ignored {item.topic}: {exc}", file=sys.stderr)
    finally:
        transport.close(timeout=1.0, announce_offline=False)
    rows = [statuses[n] for n in sorted(statuses)]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_fleet(rows))
    return 0


register(Command("status", "print the fleet (node, online, version, profile, last round) "
                           "from the retained status topics",
                 _status_arguments, _status))


# ---------------------------------------------------------------------------------------
# edgefl ctl: a thin client of the control topics (docs/orchestration.md)
# ---------------------------------------------------------------------------------------

CTL_ACTIONS = ("start", "pause", "resume", "stop", "export", "status", "runs", "watch")


def _ctl_arguments(parser: argparse.ArgumentParser) -> None:
    from .service.layered import add_service_config_arguments

    parser.add_argument("action", choices=CTL_ACTIONS,
                        help="start CONFIG: queue a run; pause / resume / stop / export: the "
                             "active run (or --run ID); status; runs; watch: follow the "
                             "events until the run ends (Ctrl-C to leave)")
    parser.add_argument("run_config", nargs="?", metavar="CONFIG",
                        help="with start: the run config (YAML file or built-in name)")
    add_service_config_arguments(parser)
    parser.add_argument("--role", choices=["aggregator", "client"], default="aggregator",
                        help="whose site file --config is (its broker URL, CA file and "
                             "federation are used, never its account; default aggregator)")
    parser.add_argument("--broker", metavar="URL",
                        help="mqtt://host[:port] or mqtts://... (default: the site file's, "
                             "else mqtt://localhost:1883)")
    parser.add_argument("--username", metavar="USER",
                        help="MQTT user: the operator's account (the broker's ACL lets only "
                             "the operator publish commands); never taken from --config, "
                             "whose account is the node's own")
    parser.add_argument("--password-file", metavar="FILE",
                        help="file whose first line is the MQTT password of --username")
    parser.add_argument("--cert-file", metavar="FILE",
                        help="TLS client certificate of the operator (brokers that take the "
                             "certificate's CN as the username), with --key-file")
    parser.add_argument("--key-file", metavar="FILE", help="private key of --cert-file")
    parser.add_argument("--ca-file", metavar="FILE", help="CA bundle of the broker (TLS)")
    parser.add_argument("--federation", metavar="ID",
                        help="federation id (default: the site file's node.federation, else "
                             "'default')")
    parser.add_argument("--mqtt", choices=["5", "3.1.1"], default="5",
                        help="protocol: 5 (default) sends the reply address as response topic "
                             "+ correlation data, 3.1.1 in the payload (reply_to, request_id)")
    parser.add_argument("--run", dest="run_id", metavar="ID",
                        help="the run a command is for (start: the new run's id)")
    parser.add_argument("--clients", metavar="ID,ID,...",
                        help="start: the client ids, in the order of the partition")
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="start: round deadline of this run")
    parser.add_argument("--quorum", type=float, metavar="FRACTION",
                        help="start: round quorum of this run")
    parser.add_argument("--min-updates", type=int, metavar="N",
                        help="start: fewest updates a round of this run is aggregated with")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                        help="how long to wait for a reply (default 10)")
    parser.add_argument("--json", action="store_true",
                        help="print the reply (watch: each event) as JSON")


def _ctl_connect(args: argparse.Namespace):
    """The connection of `edgefl ctl`. A site file (--config) gives the broker URL, its CA
    file and the federation, never its account: that is the node's own login (the
    aggregator's, a board's), which the broker's ACL does not let publish commands. The
    account is the command line's (--username / --password-file, or --cert-file /
    --key-file); with a site file that names an account and none given, ctl refuses
    before connecting rather than have the broker drop every command."""
    import os

    from .roles.control import RequesterTransport
    from .transport.topics import Topics

    config = None
    if args.site is not None or args.overrides or args.profile is not None:
        from .service.layered import load_service_config

        config = load_service_config(args.role, args.site, profile=args.profile,
                                     overrides=args.overrides)
    broker = config.section("broker") if config is not None else {}
    own = [f"{k} {broker[k]}" for k in ("username", "cert_file") if broker.get(k)]
    if own and not (args.username or args.cert_file):
        raise ValueError(
            f"the {args.role}'s site file {args.site or '(default)'} logs in as its own "
            f"account ({', '.join(own)}), and the broker's ACL lets only the operator account "
            f"publish commands (broker/acl), so ctl does not use it: give the operator's "
            f"credentials with --username operator --password-file FILE (or --cert-file / "
            f"--key-file); the site file still gives the broker URL, CA file and federation")
    url = args.broker or broker.get("url") or "mqtt://localhost:1883"
    options = {"ca_file": args.ca_file or broker.get("ca_file"), "cert_file": args.cert_file,
               "key_file": args.key_file}
    name = f"ctl-{os.getpid()}-{os.urandom(3).hex()}"
    transport = RequesterTransport(url, f"edgefl-{name}", clean_session=True,
                                   protocol=args.mqtt, username=args.username,
                                   password_file=args.password_file,
                                   **{k: v for k, v in options.items() if v})
    federation = args.federation or (config["node.federation"] if config else "default")
    transport.connect()
    return transport, Topics(federation), name


def _ctl_command(args: argparse.Namespace) -> dict:
    doc: dict = {"cmd": args.action}
    if args.action == "start":
        from .runconfig import load_run_config
        from .sim import _absolute_paths

        if args.run_config is None:
            raise ValueError("ctl start: name the run config (a YAML file or built-in name)")
        config = load_run_config(args.run_config)      # errors name the file and key here
        body = config.to_dict()
        body["dataset"] = _absolute_paths(config.dataset, config.path)
        doc["config"] = body
        if args.clients:
            doc["clients"] = [c.strip() for c in args.clients.split(",")]
        rounds = {k: v for k, v in (("deadline", args.deadline), ("quorum", args.quorum),
                                    ("min_updates", args.min_updates)) if v is not None}
        if rounds:
            doc["round"] = rounds
    elif args.run_config is not None:
        raise ValueError(f"ctl {args.action}: takes no CONFIG (got {args.run_config!r})")
    if args.run_id is not None and args.action not in ("status", "runs", "watch"):
        doc["run"] = args.run_id
    return doc


def _ctl(args: argparse.Namespace) -> int:
    import json

    from .roles.control import CommandRefused, ControlClient

    doc = _ctl_command(args) if args.action != "watch" else None
    transport, topics, name = _ctl_connect(args)
    try:
        if args.action == "watch":
            return _ctl_watch(args, transport, topics, name)
        client = ControlClient(transport, topics, name, mqtt5=args.mqtt == "5")
        try:
            reply = client.request(doc, timeout=args.timeout)
        except CommandRefused as exc:
            print(f"edgefl ctl: {exc}; log in as the operator (--username, --password-file)",
                  file=sys.stderr)
            return 1
        except TimeoutError as exc:
            print(f"edgefl ctl: {exc}", file=sys.stderr)
            return 1
    finally:
        transport.close(timeout=2.0, announce_offline=False)
    if args.json:
        print(json.dumps(reply, indent=1))
    elif not reply.get("ok"):
        print(f"edgefl ctl {args.action}: refused: {reply.get('error')}", file=sys.stderr)
    else:
        print(_ctl_text(args.action, reply.get("result") or {}))
    return 0 if reply.get("ok") else 1


def _ctl_text(action: str, result: dict) -> str:
    """One reply in words (what `edgefl ctl` prints without --json)."""
    if action == "runs":
        rows = result.get("runs", [])
        if not rows:
            return "no runs"
        lines = [f"{'run':<24} {'state':<10} {'rounds':>7} {'accuracy':>9}"]
        for r in rows:
            acc = r.get("final_accuracy")
            done = f"{r.get('rounds_done', '-')}/{r.get('rounds') or '?'}"
            lines.append(f"{r['id']:<24} {r['state']:<10} {done:>7} "
                         f"{f'{acc:.4f}' if acc is not None else '-':>9}")
        return "\n".join(lines)
    if action == "status":
        active = result.get("active")
        queue = ", ".join(result.get("queue") or []) or "empty"
        if not active:
            return f"{result.get('node')}: no active run; queue: {queue}"
        acc = active.get("test_accuracy")
        online = active.get("clients_online") or []
        round_text = (f"round {active['round']} of {active.get('rounds')} open, "
                      f"{active.get('updates')}/{active.get('uploaders')} updates"
                      if active.get("round") else
                      f"{active.get('rounds_done', 0)} of {active.get('rounds')} rounds done")
        return (f"run {active['run']}: {active['state']}, {round_text}; test accuracy "
                f"{f'{acc:.4f}' if acc is not None else '-'}; {len(online)} client(s) online"
                f"{': ' + ', '.join(online) if online else ''}; queue: {queue}")
    if action == "pause":
        return f"run {result.get('run')}: state {result.get('state')}, {_paused_where(result)}"
    fields = ", ".join(f"{k} {v}" for k, v in result.items() if k != "run")
    return f"run {result.get('run')}: {fields}"


def _paused_where(doc: dict) -> str:
    """Where a pause holds a run (a pause reply or a run_paused event): in its open round,
    or between rounds."""
    if doc.get("round") is not None:
        return f"round {doc['round']} open (it closes after resume)"
    done = doc.get("rounds_done")
    if not done:
        return "before its first round opens"
    return f"between rounds: {done} round(s) done, the next opens after resume"


def _ctl_watch(args, transport, topics, name) -> int:
    """Follow the events topic: rounds, accuracy, clients online, until the run ends."""
    import json

    from .roles.control import CommandRefused, ControlClient
    from .transport.base import Message

    transport.subscribe(topics.events(), qos=1)
    watched = args.run_id
    # the clients online: from the status reply (the active run's aggregator knows them),
    # then kept up to date by client_joined / client_left
    online: set = set()
    try:
        status = ControlClient(transport, topics, name, mqtt5=args.mqtt == "5").request(
            {"cmd": "status"}, timeout=args.timeout)
        if status.get("ok"):
            active = (status.get("result") or {}).get("active")
            watched = watched or (active or {}).get("run")
            if active and active.get("run") == watched:
                online.update(active.get("clients_online") or [])
            if not args.json:
                print(_ctl_text("status", status.get("result") or {}), flush=True)
    except (TimeoutError, CommandRefused) as exc:
        print(f"edgefl ctl watch: {exc} (watching the events anyway)", file=sys.stderr)
    ends = ("run_finished", "run_stopped", "run_cancelled")
    try:
        while True:
            item = transport.receive(timeout=1.0)
            if not isinstance(item, Message) or item.topic != topics.events():
                continue
            try:
                event = json.loads(item.payload)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            run = event.get("run")
            if watched is None and event.get("event") in ("run_started", "run_resumed"):
                watched = run
            if watched is not None and run not in (None, watched):
                continue
            kind = event.get("event")
            if kind == "client_joined":
                online.add(event.get("client"))
            elif kind == "client_left":
                online.discard(event.get("client"))
            if args.json:
                print(json.dumps(event), flush=True)
            else:
                print(_event_text(event, online), flush=True)
            if kind in ends or (kind == "error" and run == watched and run is not None):
                return 0 if kind == "run_finished" else 1
    except KeyboardInterrupt:
        return 0


def _event_text(event: dict, online: set) -> str:
    import time

    kind, run = event.get("event"), event.get("run")
    at = time.strftime("%H:%M:%S", time.localtime(event.get("at") or time.time()))
    if kind == "round_opened":
        left = (event.get("deadline") or 0) - (event.get("at") or 0)
        text = (f"round {event.get('round')} opened: {len(event.get('selected') or [])} "
                f"selected, deadline in {left:.0f} s")
    elif kind == "round_closed":
        acc = event.get("test_accuracy")
        text = (f"round {event.get('round')} closed ({event.get('closed_by')}): "
                f"{event.get('updates')} update(s), test accuracy "
                f"{f'{acc:.4f}' if acc is not None else '-'}")
    elif kind in ("client_joined", "client_left"):
        text = (f"{event.get('client')} {'online' if kind == 'client_joined' else 'offline'} "
                f"({len(online)} online)")
    elif kind == "run_paused":
        text = f"run_paused: {_paused_where(event)}"
    elif kind == "error":
        text = f"error: {event.get('error')}"
    else:
        extra = ", ".join(f"{k} {v}" for k, v in event.items()
                          if k not in ("event", "run", "node", "at"))
        text = kind + (f": {extra}" if extra else "")
    return f"{at} {run or '-'} {text}"


register(Command("ctl", "drive the aggregator service over MQTT: start CONFIG | pause | resume | "
                        "stop | export | status | runs | watch (the operator's account)",
                 _ctl_arguments, _ctl))


if __name__ == "__main__":
    sys.exit(console_main())
