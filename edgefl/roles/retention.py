"""Retention of the aggregator service's ended runs: which runs' files go, and their removal
(docs/orchestration.md "Retention"). The service applies it as each run ends (the site
file's `retention.keep_runs`) and on its `prune` command (`edgefl ctl prune`), `edgefl
prune` on demand while the service is stopped.

    report = prune_runs(records, keep=3, runs_root=store.root, spare=("run.json",),
                        mark=save_pruned)     # dry_run=True: the same report, nothing removed

The rules, each a line of prune_runs:

- Only ended runs that ran -- finished, stopped, failed -- are ranked, newest end first; the
  `keep` newest keep their files. Queued, running and paused runs (and everything their
  resume needs) are never touched; a cancelled run never had files.
- An ended run whose directory (or a file in it: its model.npz) a queued, running or paused
  run names in `model.init` is left: that run starts from its model, and one started
  before its warm start was recorded (roles/runner.py) reads the file again to resume.
- The site file's run is left: its checkpoint is the state directory's own (not under
  runs/<id>/), and it decides whether a changed site file may start a new run there.
- A run the caller names in `leave` (the service: one whose end it is still recording --
  its export after a stop, its announcements) is ranked as ended but left, with the
  caller's reason.
- Only what is under `<runs_root>/<id>/` is removed, and the run's record (`spare`) stays,
  marked pruned (its time and bytes), so listings, run ids and the retained record on the
  runs topic stay consistent: a pruned run is listed as pruned. A run whose directory is a
  symbolic link, or whose record names a state or output directory outside it, is left
  and reported. Inside, a symbolic link is removed, never followed.
- A file that cannot be removed (permissions, a read-only or immutable file) is reported by
  path and the rest goes on; that run is not marked pruned, so the next prune tries again.

Bytes are the sizes of the regular files removed (st_size, not blocks). The report as JSON
(PruneReport.as_dict) is the service's reply to `prune`, and what `edgefl prune` prints
from."""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["RAN_STATES", "RunPrune", "PruneReport", "prune_runs"]

RAN_STATES = ("finished", "stopped", "failed")
WAITING_STATES = ("queued", "running", "paused")


@dataclass
class RunPrune:
    """One run's files removed (or, on a dry run, to be removed): (path, bytes) each, and
    (path, reason) of each that could not be."""
    run: str
    state: str
    ended: float | None
    removed: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.removed)


@dataclass
class PruneReport:
    keep: int
    dry_run: bool
    runs_root: str = ""
    runs: list = field(default_factory=list)         # RunPrune, oldest first
    skipped: list = field(default_factory=list)      # (run id, why it was left)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.runs)

    @property
    def errors(self) -> list:
        return [e for r in self.runs for e in r.errors]

    def as_dict(self, limit: int | None = None) -> dict:
        """{keep, dry_run, runs_root, bytes, runs: [{run, state, ended, files, bytes,
        errors: [{path, error}]}], skipped: [{run, why}], runs_total, runs_failed,
        skipped_total}: JSON, the removed paths counted, not listed (a run's state
        directory may hold thousands). limit: at most that many runs and runs left listed
        (the service's reply is one message), the runs with a failed removal first; the
        totals are the whole prune's."""
        failed = [r for r in self.runs if r.errors]
        runs = failed + [r for r in self.runs if not r.errors]
        return {"keep": self.keep, "dry_run": self.dry_run, "runs_root": self.runs_root,
                "bytes": self.bytes, "runs_total": len(self.runs), "runs_failed": len(failed),
                "skipped_total": len(self.skipped),
                "runs": [{"run": r.run, "state": r.state, "ended": r.ended,
                          "files": len(r.removed), "bytes": r.bytes,
                          "errors": [{"path": p, "error": why} for p, why in r.errors]}
                         for r in runs[:limit]],
                "skipped": [{"run": run, "why": why} for run, why in self.skipped[:limit]]}


def _newest_first(record: dict) -> tuple:
    return (-(record.get("ended") or record.get("created") or 0.0), -record.get("seq", 0))


def prune_runs(records, keep: int, runs_root: str, *, spare=("run.json",),
               dry_run: bool = False, mark: Callable | None = None,
               leave: dict | None = None, lock=None,
               current: Callable | None = None) -> PruneReport:
    """Remove the files of the ended runs among `records` (the run records, dicts) beyond
    the `keep` most recently ended, under `runs_root` (the service's `<state_dir>/runs`).
    mark(record, run_prune) is called for each run whose files are all gone (not on a dry
    run), to save its record marked pruned. leave: {run id: why} of runs ranked but left.
    lock: held while each run is looked at and pruned, and let go between runs (the
    service's export lock: an export waits for one run's removal, not for the whole
    prune; a run another prune has pruned meanwhile is passed over). current: the records
    as they are now, read again under the lock before each run, for the waiting runs'
    model.init (a run queued during the prune keeps the model it starts from)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep: a whole number >= 0, got {keep!r}")
    report = PruneReport(keep, dry_run, runs_root)
    records = list(records)
    ran = sorted((r for r in records if r.get("state") in RAN_STATES), key=_newest_first)
    known: dict = {}                    # run id -> the path its model.init names, or None
    sources = _warm_start_sources(records, known)
    for record in reversed(ran[keep:]):
        with lock if lock is not None else contextlib.nullcontext():
            if current is not None:
                sources = _warm_start_sources(current(), known)
            _prune_one(record, runs_root, spare, dry_run, mark, leave, sources, report)
    return report


def _prune_one(record, runs_root, spare, dry_run, mark, leave, sources, report) -> None:
    """prune_runs for one ranked-out run: left (with why), or its files removed."""
    if record.get("pruned"):
        return
    why = (leave or {}).get(record["id"]) or _why_left(record, runs_root) \
        or _needed_by(record, runs_root, sources)
    if why is not None:
        report.skipped.append((record["id"], why))
        return
    run = RunPrune(record["id"], record["state"], record.get("ended"))
    _remove_under(os.path.join(runs_root, record["id"]), set(spare), dry_run, run)
    report.runs.append(run)
    if not dry_run and not run.errors and mark is not None:
        mark(record, run)


def _why_left(record: dict, runs_root: str) -> str | None:
    """Why the run's files are not to be touched, or None."""
    if record.get("site"):
        return ("the site file's run: its checkpoint is the state directory's own, not under "
                "runs/<id>/ (move it out by hand)")
    run_dir = os.path.join(runs_root, record["id"])
    # the id must be one plain name under runs_root (none, `.`, `..` or `a/..` there would
    # name runs_root itself or its parent: every run's files; topics.validate_id refuses
    # them at the start, this guards a store written otherwise)
    if not record["id"] or os.path.basename(run_dir) != record["id"] \
            or record["id"] in (".", "..") \
            or os.path.realpath(os.path.dirname(run_dir)) != os.path.realpath(runs_root):
        return f"its id is not one directory name under {runs_root}: {record['id']!r}"
    if os.path.islink(run_dir):
        return f"{run_dir} is a symbolic link: not followed out of the state directory"
    if not os.path.isdir(run_dir):
        return f"{run_dir} is not a directory"
    inside = os.path.realpath(run_dir)
    for key in ("state_dir", "out_dir"):
        where = record.get(key)
        if where and os.path.commonpath([os.path.realpath(where), inside]) != inside:
            return f"its {key} {where} is outside {run_dir}: left as it is"
    return None


def _warm_start_sources(records, known: dict | None = None) -> list:
    """(run id, state, the real path model.init names) of each queued, running or paused
    run that starts from an earlier run's model. A config that does not read is skipped:
    its run fails when it starts, and needs nothing. known: {run id: path or None} of the
    configs read already (a run's config does not change), filled in here: prune_runs reads
    the waiting runs again before each run it prunes, each config once."""
    from ..errors import ConfigError
    from ..runconfig import load_run_config, run_config_from_mapping

    known = {} if known is None else known
    out = []
    for record in records:
        if record.get("state") not in WAITING_STATES:
            continue
        if record["id"] not in known:
            try:
                config = load_run_config(record["site"]) if record.get("site") else \
                    run_config_from_mapping(record.get("config") or {}, f"run {record['id']}")
                known[record["id"]] = config.init_file()
            except (ConfigError, OSError, KeyError, TypeError, ValueError):
                known[record["id"]] = None
        if known[record["id"]] is not None:
            out.append((record["id"], record["state"], known[record["id"]]))
    return out


def _needed_by(record: dict, runs_root: str, sources) -> str | None:
    """Why the run's files are left for a waiting run that starts from them, or None. The
    file prepare reads is the one checked: a directory's model.npz, links followed (a
    directory of the user's whose model.npz links into the run)."""
    inside = os.path.realpath(os.path.join(runs_root, record["id"]))
    for run_id, state, path in sources:
        read = [path, os.path.join(path, "model.npz")] if os.path.isdir(path) else [path]
        if any(os.path.commonpath([os.path.realpath(p), inside]) == inside for p in read):
            return f"run {run_id} ({state}) starts from its model (model.init {path})"
    return None


def _remove_under(run_dir: str, spare: set, dry_run: bool, run: RunPrune) -> None:
    """Everything under run_dir but its top-level `spare` names, bottom up; links are
    removed themselves (os.walk does not follow them)."""
    def unreadable(exc: OSError) -> None:
        run.errors.append((exc.filename or run_dir, exc.strerror or str(exc)))

    for parent, dirs, files in os.walk(run_dir, topdown=False, onerror=unreadable):
        links = [d for d in dirs if os.path.islink(os.path.join(parent, d))]
        for name in files + links:
            if parent == run_dir and name in spare:
                continue
            path = os.path.join(parent, name)
            try:
                st = os.lstat(path)
                if not dry_run:
                    os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                run.errors.append((path, exc.strerror or str(exc)))
                continue
            run.removed.append((path, st.st_size if stat.S_ISREG(st.st_mode) else 0))
        if parent == run_dir or dry_run:
            continue
        try:
            os.rmdir(parent)
        except OSError as exc:
            # not empty because something in it could not be removed: that was reported
            if exc.errno != errno.ENOTEMPTY or not any(
                    p.startswith(parent + os.sep) for p, _ in run.errors):
                run.errors.append((parent, exc.strerror or str(exc)))

