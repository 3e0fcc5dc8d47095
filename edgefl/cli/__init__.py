"""The `edgefl` command. Each subcommand is one `Command` (its arguments and the function that
runs it), defined in the module of its family:

    runs.py      partition, simulate, duw-train, info, export, predict, compare: run configs
                 and their outputs, in this process
    service.py   broker, config, install-service, aggregator, client, serve, status: a node's
                 services and their setup
    ctl.py       ctl: the operator's commands to the aggregator service, and watch
    fleet.py     fleet: a fleet on one machine (up, status, down)
    dashboard.py dashboard: the live, read-only web page of a federation
    keys.py      keys: signing keys (gen, show)
    prune.py     prune: the aggregator service's older ended runs' files removed

`main` builds the parser from COMMANDS. To add a subcommand, define it in its family's module

    def _simulate_arguments(parser): parser.add_argument("config")
    def _simulate(args) -> int: ...
    SIMULATE = Command("simulate", "run N clients and the aggregator in one process",
                       _simulate_arguments, _simulate)

and list it below, where `edgefl --help` is to show it. Nothing imports the CLI: it is the top
layer.
"""
from __future__ import annotations

import argparse
import os
import select
import sys
import warnings

from .. import __version__
from . import ctl, dashboard, fleet, keys, prune, runs, service
from .command import Command, UsageError

__all__ = ["COMMANDS", "Command", "build_parser", "console_main", "main"]

COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    if command.name in COMMANDS:
        raise ValueError(f"edgefl: subcommand {command.name!r} is registered twice")
    COMMANDS[command.name] = command
    return command


# in the order `edgefl --help` lists them
for _command in (runs.PARTITION, runs.SIMULATE, runs.DUW_TRAIN, runs.INFO, runs.EXPORT,
                 runs.PREDICT, service.BROKER, service.CONFIG, service.INSTALL_SERVICE,
                 runs.COMPARE, service.AGGREGATOR, service.CLIENT, service.SERVE,
                 service.STATUS, prune.PRUNE, keys.KEYS, ctl.CTL, dashboard.DASHBOARD,
                 fleet.FLEET):
    register(_command)
del _command


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of `edgefl`. only: declare the arguments of that subcommand alone (every
    subcommand is still listed with its help): a launch runs one subcommand, and declaring
    them all cost ~0.1 s of every launch, mostly the service commands importing their
    settings modules to show the defaults."""
    parser = argparse.ArgumentParser(prog="edgefl",
                                     description="Federated learning for edge boards.")
    parser.add_argument("--version", action="version", version=f"edgefl {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS.values():
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        if only is None or command.name == only:
            command.add_arguments(sub)
        sub.set_defaults(_command=command)
    return parser


def main(argv=None) -> int:
    """Entry point of the `edgefl` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    named = argv[0] if argv and argv[0] in COMMANDS else None   # else: --help, --version, ...
    parser = build_parser(only=named) if named else build_parser()
    args = parser.parse_args(argv)
    command = getattr(args, "_command", None)
    if command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return command.run(args)
    except UsageError as exc:
        print(f"edgefl {command.name}: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError) as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            raise       # the reader of the output has gone: console_main ends quietly
        # Bad input (config, data, files): one line naming the cause, no traceback.
        print(f"edgefl {command.name}: error: {exc}", file=sys.stderr)
        return 1


def console_main(argv=None) -> int:
    """The `edgefl` console script and `python -m edgefl.cli`: main(), ending quietly with
    status 141 when the reader of stdout has gone (`edgefl predict ... | head -3`). A stopped
    role or simulation returns from main() normally: its training threads stop within one
    local step (kernels.StopFlag) and are joined, so none is left inside the C core."""
    warnings.formatwarning = _format_warning
    _whole_lines()
    try:
        code = main(argv)
        sys.stdout.flush()      # output still buffered meets a closed pipe here, not at exit
    except BrokenPipeError:
        code = _closed_pipe()
    return code


def _whole_lines() -> None:
    """Write each line of stdout and stderr in one system call. Under PYTHONUNBUFFERED (or
    `python -u`) the text streams write through: print() writes a line, then its newline, in
    two calls, and another process writing to the same terminal or pipe lands between them
    (`edgefl ctl watch ... & edgefl ctl start ...` printed one line glued to the other's).
    Line buffering is as prompt, a line (or a carriage return) at a time."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "write_through", False) and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(write_through=False, line_buffering=True)
            except (ValueError, OSError):      # closed, or not a reconfigurable stream
                pass


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """A warning on the command line is one line for the user (edgefl's name the file and
    key concerned), not the Python source line that raised it."""
    return f"edgefl: warning: {message} ({category.__name__})\n"


def _stdout_closed() -> bool:
    """Whether a BrokenPipeError was stdout's (and not a socket's, which stays an error):
    the write end of a pipe whose reader has gone polls as POLLERR."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):    # no poll, no stdout or no fd
        return False


def _closed_pipe() -> int:
    """`edgefl predict ... | head -3`: the reader has gone, so what is left of the output has
    nowhere to go. stdout is pointed at /dev/null so the interpreter's flush at exit does not
    fail a second time (and print "Exception ignored ... BrokenPipeError"). The status is
    141, 128 + SIGPIPE, what a C program killed by the signal reports: the shell shows it
    only under `set -o pipefail`, where a truncated output is meant to be noticed, and
    `head`'s status, the pipeline's otherwise, is 0 either way."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13     # signal.SIGPIPE is 13 on every POSIX system
