"""`edgefl prune`: remove the files of the aggregator service's older ended runs, on demand
(the service does it itself as each run ends when the site file sets retention.keep_runs;
the rules are roles/retention.py's)."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from .command import Command, UsageError, whole


def _prune_arguments(parser: argparse.ArgumentParser) -> None:
    from ..service.layered import add_service_config_arguments

    add_service_config_arguments(parser)
    parser.add_argument("--keep", type=whole, metavar="N",
                        help="keep the files of the N most recently ended runs (0: none); "
                             "default: the site file's retention.keep_runs")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would be removed and remove nothing")


def _lock_holder(path: str) -> str:
    """What the holder of a state directory's lock wrote in it (hold_state_dir)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(256).strip() or "its process id not yet written"
    except OSError:
        return "its process unknown"


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "?"


def _prune(args: argparse.Namespace) -> int:
    from ..roles.daemon import RECORD_FILE, RunStore
    from ..roles.retention import prune_runs
    from ..roles.state import StateError, hold_state_dir
    from ..service.layered import service_config_from_args

    config = service_config_from_args("aggregator", args)
    keep = args.keep if args.keep is not None else config["retention.keep_runs"]
    if keep is None:
        raise UsageError(f"give --keep N: retention.keep_runs is not set "
                         f"({config.source('retention.keep_runs')})")
    store = RunStore(config.state_dir)

    def mark(record, run):
        record.update(pruned=time.time(), pruned_bytes=run.bytes)
        store.save(record)

    # the service's claim on its state directory: its records in memory would not know
    # what was removed behind its back (a dry run removes nothing and needs no claim)
    try:
        claim = contextlib.nullcontext() if args.dry_run else \
            hold_state_dir(store.state_dir, "aggregator")
        with claim:
            report = prune_runs(store.load_all(), keep, store.root, spare=(RECORD_FILE,),
                                dry_run=args.dry_run, mark=mark)
    except StateError:
        holder = _lock_holder(os.path.join(store.state_dir, "aggregator.lock"))
        raise StateError(f"{store.state_dir}: the state directory is in use by the "
                         f"aggregator service ({holder}), which prunes by itself as each run "
                         f"ends when its site file sets retention.keep_runs; to prune by "
                         f"hand, stop it first (--dry-run works while it runs)") from None
    verb = "would remove" if args.dry_run else "removed"
    print(f"{store.root}: keeping the files of the {keep} most recently ended run(s)")
    for run in report.runs:
        print(f"{verb} run {run.run} ({run.state} {_when(run.ended)}): {len(run.removed)} "
              f"file(s), {run.bytes} bytes")
    for path, why in report.errors:
        print(f"edgefl prune: cannot remove {path}: {why}", file=sys.stderr)
    for run_id, why in report.skipped:
        print(f"edgefl prune: run {run_id} left: {why}", file=sys.stderr)
    done = [r for r in report.runs if not r.errors]
    print(f"{verb} {len(done)} run(s), {report.bytes} bytes"
          + (" (dry run: nothing removed)" if args.dry_run else "")
          + (f"; {len(report.errors)} path(s) could not be removed" if report.errors else ""))
    return 1 if report.errors else 0


PRUNE = Command(
    "prune",
    "remove the files of the aggregator service's older ended runs (runs/<id>/), keeping "
    "their records",
    _prune_arguments, _prune)
