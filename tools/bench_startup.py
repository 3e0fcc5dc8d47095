"""How long the `edgefl` command takes as a user meets it: whole processes, start-up included.

    python tools/bench_startup.py [--repeats N] [--against CHECKOUT] [--json]

Each row is a command run as a subprocess, in a temporary working directory, `--repeats`
times (default 7) after one untimed warm-up; the commands take turns within each repeat, so
a machine whose load drifts biases none. Reported: the median wall time and the range
(min-max). The quickstart runs as the README shows it (`edgefl simulate quickstart`, a new
run directory each time) with the decoded data set cached, as every run after a user's first
is; `cold cache` is that first run (an empty EDGEFL_CACHE_DIR each time: scikit-learn is
imported to decode the digits). Two floors put the numbers in proportion: the interpreter
alone and `import numpy`, which edgefl cannot start without.

`--against CHECKOUT` runs every edgefl command a second time with that checkout's code (its
directory first on PYTHONPATH; it needs its extension built) within the same repeats, and
gives this tree's median over the other's: a ratio that holds when the machine is busy, where
the absolute figures do not.

Targets (issue 18): `edgefl --help` and `edgefl info` under 0.5 s, the quickstart under 2 s.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import markdown, need_counts  # noqa: E402

TARGETS = {"edgefl --help": 0.5, "edgefl info": 0.5, "edgefl simulate quickstart": 2.0}


def edgefl_command() -> list[str]:
    """The console script beside this interpreter (what `pip install` made), else -m."""
    script = os.path.join(os.path.dirname(sys.executable), "edgefl")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "edgefl.cli"]


def cases(edgefl: list[str], cache: str, cold_root: str) -> list[tuple[str, list[str], dict]]:
    warm = {"EDGEFL_CACHE_DIR": cache}
    return [
        ("python -c pass (floor)", [sys.executable, "-c", "pass"], warm),
        ("python -c 'import numpy' (floor)", [sys.executable, "-c", "import numpy"], warm),
        ("edgefl --help", [*edgefl, "--help"], warm),
        ("edgefl info", [*edgefl, "info"], warm),
        ("edgefl simulate quickstart", [*edgefl, "simulate", "quickstart"], warm),
        ("edgefl simulate quickstart --no-plot --no-export",
         [*edgefl, "simulate", "quickstart", "--no-plot", "--no-export"], warm),
        ("edgefl simulate quickstart (cold cache)", [*edgefl, "simulate", "quickstart"],
         {"EDGEFL_CACHE_DIR": cold_root}),     # emptied before each run
    ]


def with_tree(table: list, checkout: str, label: str) -> list:
    """The edgefl rows of `table` again, running `checkout`'s code."""
    path = os.pathsep.join([os.path.abspath(checkout)] +
                           [p for p in [os.environ.get("PYTHONPATH")] if p])
    return [(f"{name} [{label}]", argv, {**env, "PYTHONPATH": path})
            for name, argv, env in table if name.startswith("edgefl")]


def run_once(argv: list[str], env: dict, cwd: str, may_fail: bool = False) -> float | None:
    """Wall time of one run; None when it failed and may_fail (the other checkout lacks
    the option), else the failure ends the benchmark."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        if may_fail:
            return None
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): "
                         f"{done.stderr.decode(errors='replace')[-2000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--against", metavar="CHECKOUT",
                        help="also run the edgefl commands with this checkout's code and "
                             "report this tree's median over its")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    need_counts(parser, args, "repeats")
    edgefl = edgefl_command()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as work:
        cache, cold = os.path.join(work, "cache"), os.path.join(work, "cold-cache")
        table = cases(edgefl, cache, cold)
        if args.against:
            table += with_tree(table, args.against, "against")
        times: list[list[float]] = [[] for _ in table]
        failed: set = set()
        for repeat in range(args.repeats + 1):           # repeat 0: the warm-up
            for (name, argv, env), ts in zip(table, times):
                if name in failed:
                    continue
                shutil.rmtree(cold, ignore_errors=True)
                elapsed = run_once(argv, env, work, may_fail=name.endswith("[against]"))
                if elapsed is None:
                    failed.add(name)
                elif repeat:
                    ts.append(elapsed)
        table, times = zip(*[(row, ts) for row, ts in zip(table, times) if row[0] not in failed])
    medians = {name: statistics.median(ts) for (name, _, _), ts in zip(table, times)}
    rows = []
    for (name, argv, env), ts in zip(table, times):
        target = TARGETS.get(name)
        median = medians[name]
        other = medians.get(f"{name} [against]")
        rows.append({"command": name, "median_s": round(median, 3),
                     "range_s": f"{min(ts):.3f}-{max(ts):.3f}", "repeats": len(ts),
                     "target_s": target,
                     "met": None if target is None else ("yes" if median < target else "NO"),
                     **({"vs_against": round(median / other, 2) if other else None}
                        if args.against else {})})
    if args.json:
        print(json.dumps({"edgefl": edgefl, "against": args.against, "python": sys.version.split()[0],
                          "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                          "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          "rows": rows}, indent=1))
    else:
        print(markdown(rows))
        print(f"\n{' '.join(edgefl)}; python {sys.version.split()[0]}; {os.cpu_count()} CPUs; "
              f"load average {os.getloadavg()[0]:.2f}; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
