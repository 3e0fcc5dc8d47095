"""`tools/bench_scale.py --mode simulate` and `--mode million` (issue 19, items 1 and 2):
whole `edgefl simulate` processes against the plain NumPy loop (tools/plain_loop.py), as
subprocesses taking turns within each repeat.

    python tools/bench_scale.py --mode simulate [--repeats 5] [--before CHECKOUT] [--outputs]
                                [--only 100] [--json]
    python tools/bench_scale.py --mode million [--repeats 3] [--json]

Workload: softmax regression on Fashion-MNIST, IID, lr 0.1, batch 32, one local epoch, the
test set evaluated every round, seed 0. `simulate` runs the issue's three sizes (100 clients,
10 a round, 20 rounds; 1,000/100/10; 10,000/1,000/5); each repeat runs, one after another,
the plain loop, `edgefl simulate --no-plot --no-export` (the plain loop writes neither a plot
nor an ONNX file, so this is the same work), with `--outputs` also plain `edgefl simulate`
(curves.png and model.onnx too), and with `--before CHECKOUT` the same simulate with that
checkout's code (its directory first on PYTHONPATH, its extension built). `million` runs
`edgefl simulate --no-plot --no-export` at 10,000 clients (1,000 a round) and at 1,000,000
virtual clients (1,000 a round, `partition.tile: 100`: 10,000 shards of 6 images, each held
by 100 clients), 5 rounds each.

Measured per process: wall time from the parent (start-up, data, rounds, outputs, exit),
peak RSS (`os.wait4`'s ru_maxrss of that child alone), and the round time: the median of
the run's rounds (edgefl: metrics.jsonl's wall_s; the loop: its own per-round times).
Reported: median [min, max] over the repeats, and the same-repeat ratios the targets are
about. One untimed warm-up run of each first (it fills edgefl's data cache and the byte-code
cache: children run with byte-code caching on, in a scratch PYTHONPYCACHEPREFIX, as a user's
installed edgefl has it).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _bench import child_env, markdown

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)

SIZES = {"100": (100, 10, 20), "1000": (1000, 100, 10), "10000": (10000, 1000, 5)}
MILLION = (("10,000 clients", 10_000, 1), ("1,000,000 clients (tile 100)", 1_000_000, 100))
DATA_BYTES = (60000 + 10000) * 784 * 4 + (60000 + 10000) * 4   # float32 images, int32 labels


def config(where: str, clients: int, per_round: int, rounds: int, tile: int = 1) -> str:
    partition = {"name": "iid", "clients": clients}
    if tile > 1:
        partition["tile"] = tile
    path = os.path.join(where, f"run-{clients}-{per_round}-{rounds}.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"dataset": {"name": "fashion-mnist"}, "partition": partition,
                   "model": {"name": "softmax"}, "strategy": {"name": "fedavg"},
                   "train": {"lr": 0.1, "batch_size": 32, "epochs": 1},
                   "rounds": rounds, "clients_per_round": per_round, "seed": 0,
                   "eval_every": 1}, fh)
    return path


def run_child(argv: list, env: dict, cwd: str) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MiB, stdout) of one child process."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err)
        _pid, status, usage = os.wait4(proc.pid, 0)      # this child's own rusage
        wall = time.perf_counter() - start
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if code != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({code}):\n{stderr[-2000:]}")
    return wall, usage.ru_maxrss / 1024, stdout


class Variant:
    def __init__(self, name: str, argv_of, env: dict, rounds_of):
        self.name, self.argv_of, self.env, self.rounds_of = name, argv_of, env, rounds_of
        self.wall, self.rss, self.round = [], [], []


def simulate_argv(cfg: str, flags: tuple):
    def argv(out: str) -> list:
        return [sys.executable, "-c",
                "import sys; from edgefl.cli import console_main; sys.exit(console_main())",
                "simulate", cfg, "--out", out, "--force", *flags]
    return argv


def edgefl_rounds(out: str, _stdout: str) -> float:
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        return statistics.median(json.loads(line)["wall_s"] for line in fh if line.strip())


def loop_rounds(_out: str, stdout: str) -> float:
    return statistics.median(json.loads(stdout)["round_s"])


def measure(variants: list, repeats: int, scratch: str) -> None:
    for v in variants:                      # warm-up: data cache, byte-code cache
        out = os.path.join(scratch, "warm")
        run_child(v.argv_of(out), v.env, scratch)
    for _ in range(repeats):
        for v in variants:
            out = os.path.join(scratch, "out")
            wall, rss, stdout = run_child(v.argv_of(out), v.env, scratch)
            v.wall.append(wall)
            v.rss.append(rss)
            v.round.append(v.rounds_of(out, stdout))


def span(values: list, digits: int) -> str:
    return (f"{round(statistics.median(values), digits)} [{round(min(values), digits)}, "
            f"{round(max(values), digits)}]")


def stats(values: list, digits: int) -> dict:
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits)}


def main(args) -> int:
    scratch = tempfile.mkdtemp(prefix="edgefl-bench-sim-")
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows, records = [], []
    if args.mode == "simulate":
        sizes = [SIZES[k] for k in (args.only or list(SIZES))]
        for clients, per_round, rounds in sizes:
            cfg = config(scratch, clients, per_round, rounds)
            plain = Variant("plain loop", lambda out, c=clients, p=per_round, r=rounds: [
                sys.executable, os.path.join(TOOLS, "plain_loop.py"), "--clients", str(c),
                "--per-round", str(p), "--rounds", str(r), "--json"],
                child_env(scratch, None), loop_rounds)
            variants = [plain, Variant("edgefl simulate --no-plot --no-export",
                                       simulate_argv(cfg, ("--no-plot", "--no-export")),
                                       child_env(scratch, REPO), edgefl_rounds)]
            if args.outputs:
                variants.append(Variant("edgefl simulate (curves.png, model.onnx)",
                                        simulate_argv(cfg, ()), child_env(scratch, REPO),
                                        edgefl_rounds))
            if args.before:
                variants.append(Variant("before: --no-plot --no-export",
                                        simulate_argv(cfg, ("--no-plot", "--no-export")),
                                        child_env(scratch, os.path.abspath(args.before)),
                                        edgefl_rounds))
            measure(variants, args.repeats, scratch)
            workload = f"{clients:,} clients, {per_round:,} a round, {rounds} rounds"
            for v in variants:
                wall_ratio = [a / b for a, b in zip(v.wall, plain.wall)]
                rss_over = [a - b for a, b in zip(v.rss, plain.rss)]
                row = {"workload": workload, "run": v.name, "wall_s": span(v.wall, 2),
                       "round_ms": span([x * 1e3 for x in v.round], 1),
                       "peak_rss_mib": span(v.rss, 0)}
                if v is not plain:
                    row["wall / loop's"] = span(wall_ratio, 2)
                    row["rss - loop's (MiB)"] = span(rss_over, 0)
                rows.append(row)
                records.append({"workload": [clients, per_round, rounds], "run": v.name,
                                "wall_s": stats(v.wall, 3), "round_s": stats(v.round, 4),
                                "peak_rss_mib": stats(v.rss, 1),
                                "wall_ratio": stats(wall_ratio, 3),
                                "rss_over_loop_mib": stats(rss_over, 1)})
        targets = "wall <= the loop's, peak RSS <= the loop's + 100 MB, round <= before's"
    else:
        variants = []
        for name, clients, tile in MILLION:
            cfg = config(scratch, clients, 1000, 5, tile)
            variants.append(Variant(name, simulate_argv(cfg, ("--no-plot", "--no-export")),
                                    child_env(scratch, REPO), edgefl_rounds))
        measure(variants, args.repeats, scratch)
        base = variants[0]
        data_mib = DATA_BYTES / 2 ** 20
        for v in variants:
            ratio = [a / b for a, b in zip(v.round, base.round)]
            over = [r - data_mib for r in v.rss]
            rows.append({"run": v.name, "wall_s": span(v.wall, 2),
                         "round_ms": span([x * 1e3 for x in v.round], 1),
                         "round / 10,000's": span(ratio, 2),
                         "peak_rss_mib": span(v.rss, 0),
                         "rss - data (MiB)": span(over, 0)})
            records.append({"run": v.name, "wall_s": stats(v.wall, 3),
                            "round_s": stats(v.round, 4), "round_ratio": stats(ratio, 3),
                            "peak_rss_mib": stats(v.rss, 1), "rss_over_data_mib": stats(over, 1)})
        targets = (f"round <= 1.5 x the 10,000-client run's, peak RSS <= data "
                   f"({data_mib:.0f} MiB: Fashion-MNIST as float32) + 300 MB")
    meta = {"mode": args.mode, "repeats": args.repeats, "date": date, "targets": targets,
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "before": args.before}
    if args.json:
        print(json.dumps({"meta": meta, "rows": records}, indent=1))
    else:
        print(f"# edgefl simulate, whole processes ({args.mode}; {args.repeats} interleaved "
              f"repeats, median [min, max]; {date}; load average at the end "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)\n\ntargets: {targets}\n")
        print(markdown(rows))
    return 0
