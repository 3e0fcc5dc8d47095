"""Where the run commands write, and their one rule: a command never replaces earlier work
unless told to with --force.

`edgefl simulate --out DIR` refuses a DIR that is not empty; without --out each run gets a
directory of its own, runs/NAME-YYYYmmdd-HHMMSS, and runs/NAME is a symbolic link to the
latest run that finished; --force without --out is refused, as it would force nothing.
`edgefl export --out`, `edgefl partition`, `edgefl compare` and `edgefl duw-train --out`
refuse a file that exists. A refusal is a UsageError (exit status 2), raised before
the command writes anything.

This is the command line's policy, not the library's: edgefl.sim.simulate(config, out_dir)
writes into the directory it is given, as tests and tools expect."""
from __future__ import annotations

import os
import sys
import time

from .command import UsageError

RUNS_ROOT = "runs"
FORCE_HELP = "replace what --out names if it exists (without it the command refuses)"


def check_new_file(path: str, force: bool, option: str = "--out") -> None:
    """Refuse `path` if something is there: a file unless `force`, a directory always (a file
    cannot replace it, and --force never deletes one)."""
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a directory; name the file to write")
    if os.path.lexists(path) and not force:
        raise UsageError(f"{option} {path}: file exists; pass --force to replace it, or "
                         f"choose another {option}")


def check_out_dir(path: str, force: bool) -> None:
    """Refuse an --out directory that holds anything, unless `force`: a run's files would
    replace an earlier run's of the same names and mix with the rest. An empty or absent
    directory is fine; a path that is not a directory never is."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"--out {path}: exists and is not a directory")
    # a directory to be made under a file: refused now, not after the first round
    above = os.path.dirname(os.path.normpath(path))
    while above and not os.path.lexists(above):
        above = os.path.dirname(above)
    if above and not os.path.isdir(above):
        raise UsageError(f"--out {path}: {above} is not a directory")
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise UsageError(f"--out {path}: directory is not empty (it holds an earlier run?); "
                         f"pass --force to write into it anyway (an earlier run's outputs "
                         f"there go once this run starts, other files are kept), choose "
                         f"another --out, or drop --out "
                         f"and the run gets a directory of its own under {RUNS_ROOT}/")


def new_run_dir(name: str, root: str = RUNS_ROOT, now: float | None = None) -> str:
    """Create and return root/NAME-YYYYmmdd-HHMMSS (local time), or NAME-YYYYmmdd-HHMMSS-2,
    -3, ... when a run started in the same second already has it. mkdir is the reservation,
    so two processes starting together still get a directory each."""
    os.makedirs(root, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = os.path.join(root, f"{name}-{stamp}")
    for n in range(1, 10_000):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise OSError(f"{base}: 9999 run directories started in the same second")


def discard_if_empty(path: str) -> None:
    """Remove a run directory this command created if the run left nothing in it (it failed
    before writing); rmdir cannot remove anything else."""
    try:
        os.rmdir(path)
    except OSError:
        pass


def link_latest(run_dir: str, name: str, root: str = RUNS_ROOT, stream=None) -> str | None:
    """Point root/NAME at run_dir (a relative link, so the runs folder can move) by creating
    a temporary link beside it and renaming it over the old one: a reader sees the old run
    or the new one, never no link. root/NAME that is not a link (a run directory from an
    edgefl before timestamped runs, or one named with --out) is left as it is, and one line
    on `stream` says so.
    Returns the link's path, or None when it was not made."""
    stream = stream or sys.stderr
    link = os.path.join(root, name)
    if os.path.lexists(link) and not os.path.islink(link):
        print(f"edgefl simulate: {link} is not the link to the latest run (a directory "
              f"from an earlier edgefl, or an --out), left as it is; this run is in "
              f"{run_dir}", file=stream)
        return None
    temp = os.path.join(root, f".{name}.link-{os.getpid()}")
    try:
        if os.path.lexists(temp):
            os.unlink(temp)
        os.symlink(os.path.relpath(run_dir, root), temp)
        os.replace(temp, link)
    except OSError as exc:           # a file system without symbolic links: the run is kept
        if os.path.lexists(temp):
            os.unlink(temp)
        print(f"edgefl simulate: could not link {link} to {run_dir} ({exc}); the run is in "
              f"{run_dir}", file=stream)
        return None
    return link
