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
import sys
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
    try:
        summary = simulate(config, out, workers=args.workers, progress=not args.quiet)
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


if __name__ == "__main__":
    sys.exit(main())
