"""How long the `edgefl` command takes as a user meets it: whole processes, start-up included.

    python tools/bench_startup.py [--repeats N] [--json]

Each row is a command run as a subprocess, in a temporary working directory, `--repeats`
times (default 7) after one untimed warm-up; the commands take turns within each repeat, so
a machine whose load drifts biases none. Reported: the median wall time and the range
(min-max). The quickstart runs as the README shows it (`edgefl simulate quickstart`, a new
run directory each time) with the decoded data set cached, as every run after a user's first
is; `cold cache` is that first run (an empty EDGEFL_CACHE_DIR each time: scikit-learn is
imported to decode the digits). Two floors put the numbers in proportion: the interpreter
alone and `import numpy`, which edgefl cannot start without.

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
from _bench import markdown  # noqa: E402

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


def run_once(argv: list[str], env: dict, cwd: str) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): "
                         f"{done.stderr.decode(errors='replace')[-2000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    edgefl = edgefl_command()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as work:
        cache, cold = os.path.join(work, "cache"), os.path.join(work, "cold-cache")
        table = cases(edgefl, cache, cold)
        times: list[list[float]] = [[] for _ in table]
        for repeat in range(args.repeats + 1):           # repeat 0: the warm-up
            for (name, argv, env), ts in zip(table, times):
                shutil.rmtree(cold, ignore_errors=True)
                elapsed = run_once(argv, env, work)
                if repeat:
                    ts.append(elapsed)
    rows = []
    for (name, argv, env), ts in zip(table, times):
        target = TARGETS.get(name)
        median = statistics.median(ts)
        rows.append({"command": name, "median_s": round(median, 3),
                     "range_s": f"{min(ts):.3f}-{max(ts):.3f}", "repeats": len(ts),
                     "target_s": target,
                     "met": None if target is None else ("yes" if median < target else "NO")})
    if args.json:
        print(json.dumps({"edgefl": edgefl, "python": sys.version.split()[0],
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
