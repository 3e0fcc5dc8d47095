"""`edgefl prune`: remove the files of the aggregator service's older ended runs, on demand
while the service is stopped (the service does it itself as each run ends when the site
file sets retention.keep_runs, and on `edgefl ctl prune` while it runs; the rules are
roles/retention.py's). What both commands print of a prune is here (prune_lines)."""
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


def _check_state_dir(store, config) -> None:
    """ValueError naming the directory and where its name came from unless it is an
    aggregator service's state directory (one with runs/): a state_dir mistyped, or the
    wrong site file, was made by the claim on it and reported as "removed 0 run(s)", exit 0,
    while the runs meant filled the disk elsewhere."""
    where = config.source("state_dir") if config.values.get("state_dir") else \
        "$STATE_DIRECTORY"
    if not os.path.isdir(store.state_dir):
        what = "not a directory" if os.path.exists(store.state_dir) else "no such directory"
        raise ValueError(f"{store.state_dir}: {what} (state_dir, {where}): not the aggregator "
                         f"service's state directory; name its site file with --config, or "
                         f"--set state_dir=DIR (under systemd /var/lib/edgefl/aggregator)")
    if not os.path.isdir(store.root):
        raise ValueError(f"{store.state_dir}: holds no {os.path.basename(store.root)}/ "
                         f"directory, so no aggregator service has kept runs there (state_dir, "
                         f"{where}): nothing to prune; is it the service's state directory?")


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
    _check_state_dir(store, config)

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
                         f"ends when its site file sets retention.keep_runs; while it runs, "
                         f"prune through it: edgefl ctl prune --keep N (or stop it first; "
                         f"--dry-run works here while it runs)") from None
    out, err = prune_lines(report.as_dict(), "edgefl prune")
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    return prune_status(report.as_dict())


def prune_lines(doc: dict, tool: str) -> tuple[list, list]:
    """What `edgefl prune` and `edgefl ctl prune` print of a prune's report
    (PruneReport.as_dict, the service's `prune` reply): lines for stdout (each run removed,
    or on a dry run to be removed, and the total) and for stderr (`tool`: each path that
    could not be removed, each run left and why)."""
    dry_run = doc.get("dry_run")
    verb = "would remove" if dry_run else "removed"
    runs, skipped = doc.get("runs") or [], doc.get("skipped") or []
    out = [f"{doc.get('runs_root')}: keeping the files of the {doc.get('keep')} most recently "
           f"ended run(s)"]
    out += [f"{verb} run {run.get('run')} ({run.get('state')} {_when(run.get('ended'))}): "
            f"{run.get('files')} file(s), {run.get('bytes')} bytes" for run in runs]
    errors = [e for run in runs for e in run.get("errors") or []]
    err = [f"{tool}: cannot remove {e.get('path')}: {e.get('error')}" for e in errors]
    err += [f"{tool}: run {s.get('run')} left: {s.get('why')}" for s in skipped]
    # a reply lists a bounded number of runs (as_dict's limit); its totals are the prune's
    total = doc.get("runs_total", len(runs))
    failed = doc.get("runs_failed", sum(1 for run in runs if run.get("errors")))
    if total > len(runs):
        out.append(f"... and {total - len(runs)} more run(s), not listed")
    if doc.get("skipped_total", len(skipped)) > len(skipped):
        err.append(f"{tool}: ... and {doc['skipped_total'] - len(skipped)} more run(s) left, "
                   f"not listed")
    out.append(f"{verb} {total - failed} run(s), {doc.get('bytes')} bytes"
               + (" (dry run: nothing removed)" if dry_run else "")
               + (f"; {len(errors)} path(s) could not be removed" if errors else ""))
    return out, err


def prune_status(doc: dict) -> int:
    """The exit status of a prune: 1 when a path could not be removed, else 0."""
    failed = doc.get("runs_failed")
    if failed is None:
        failed = sum(1 for run in doc.get("runs") or [] if run.get("errors"))
    return 1 if failed else 0


PRUNE = Command(
    "prune",
    "remove the files of the aggregator service's older ended runs (runs/<id>/), keeping "
    "their records",
    _prune_arguments, _prune)
