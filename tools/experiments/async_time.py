#!/usr/bin/env python3
"""Simulated time to a target accuracy on a mixed fleet: synchronous FedAvg (with and without
a round deadline), FedBuff and FedVeca on Fashion-MNIST; writes the tables of docs/async.md.

    python tools/experiments/async_time.py              # 5 seeds, 15-20 min on 2 busy cores
    python tools/experiments/async_time.py --seeds 2 --out /tmp/a --doc /tmp/async.md

Every run is an ordinary `edgefl simulate` run with a `sim_fleet:` section
(edgefl/virtual_fleet.py), so each record carries sim_time_s, the simulated time at which
the model of that round or step existed. From the records of a run this script reads: the
simulated time at which the test accuracy first reached each target, the bytes moved until
then (float32 bytes of the tasks sent down, the updates aggregated and the updates dropped
as too stale), the accuracy of the model the server held at the time budget, and how many
client updates were lost by then (stopped at a deadline, or dropped as too stale). Each
table cell is the mean over seeds 0..n-1 with a 95% confidence interval (Student's t over
the seeds); a target some seeds did not reach within the run says how many did, and its mean
is over those.

The generated part of docs/async.md lies between the lines `<!-- async:begin -->` and
`<!-- async:end -->`; the text around it is kept. Runs go to OUT/SETTING/ARM/seedK.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import io
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(REPO, "docs", "async.md")
BEGIN, END = "<!-- async:begin -->", "<!-- async:end -->"

MIXED = {"rpi-zero2w": 0.3, "rpi4": 0.5, "rpi5": 0.2}
BASE = {
    "dataset": {"name": "fashion-mnist", "limit_train": 12000, "limit_test": 10000},
    "partition": {"name": "iid", "clients": 20},
    "model": {"name": "mlp", "hidden": [64]},
    "train": {"lr": 0.05, "batch_size": 32, "epochs": 1},
    "clients_per_round": 10,
    "eval_every": 1,
    "sim_fleet": {"mix": MIXED},
}
# A Pi 4's local round on a 600-image shard takes 0.047 simulated seconds, a Zero 2 W's 0.163
# (edgefl.virtual_fleet.BOARDS, mlp [64]): the deadline stops the Zeros, not the others.
DEADLINE_S = 0.1
BUDGET_S = 6.0                  # the time budget of the "at T" columns
TARGETS = (0.80, 0.83)
SETTINGS = {
    "iid": ("IID over 20 clients, mixed fleet (30% Zero 2 W, 50% Pi 4, 20% Pi 5)",
            {"partition": {"name": "iid", "clients": 20}}),
    "dirichlet": ("Dirichlet(0.5) label skew over 20 clients, mixed fleet",
                  {"partition": {"name": "dirichlet", "clients": 20, "alpha": 0.5}}),
    "one-board": ("IID over 20 clients, every board a Pi 4 (no stragglers)",
                  {"sim_fleet": {"profile": "rpi4"}}),
}
# rounds (server steps) per arm: enough for every run to pass BUDGET_S
ARMS = {
    "fedavg": ("FedAvg, rounds wait for the slowest", {"strategy": {"name": "fedavg"},
                                                       "rounds": 45}),
    "fedavg-m5": ("FedAvg, 5 clients per round", {"strategy": {"name": "fedavg"},
                                                   "clients_per_round": 5, "rounds": 45}),
    "fedavg-deadline": (f"FedAvg, {DEADLINE_S:g} s deadline",
                        {"strategy": {"name": "fedavg"}, "rounds": 70,
                         "sim_fleet": {"deadline_s": DEADLINE_S}}),
    "fedbuff": ("FedBuff, C = 10, K = 5", {"strategy": {"name": "fedbuff", "concurrency": 10,
                                                        "buffer_size": 5}, "rounds": 260}),
    "fedbuff-k10": ("FedBuff, C = 10, K = 10", {"strategy": {"name": "fedbuff",
                                                             "concurrency": 10,
                                                             "buffer_size": 10},
                                                "rounds": 140}),
    "fedveca": ("FedVeca", {"strategy": {"name": "fedveca"}, "rounds": 100}),
}
SKIP = {("one-board", "fedavg-deadline")}     # no board misses the deadline: FedAvg again
# the boards of one-board are all fast: more rounds to reach BUDGET_S
ROUNDS = {("one-board", "fedavg"): 140, ("one-board", "fedavg-m5"): 140,
          ("one-board", "fedveca"): 200,
          ("one-board", "fedbuff-k10"): 140}

# two-sided 95% Student t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def config_of(setting: str, arm: str, seed: int) -> dict:
    cfg = merge(merge(BASE, SETTINGS[setting][1]), ARMS[arm][1])
    if cfg["sim_fleet"].get("profile"):
        cfg["sim_fleet"].pop("mix", None)
    cfg["seed"] = seed
    cfg["rounds"] = ROUNDS.get((setting, arm), cfg["rounds"])
    return cfg


def execute(job: dict) -> dict:
    from edgefl.runconfig import run_config_from_mapping
    from edgefl.sim import simulate
    started = time.perf_counter()
    simulate(run_config_from_mapping(job["config"]), job["out"], workers=1, progress=False,
             stream=io.StringIO())
    return {"key": job["key"], "wall_s": time.perf_counter() - started}


def run_metrics(out: str) -> dict:
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    moved = 0
    metrics = {"end_s": recs[-1]["sim_time_s"], "acc_at_budget": None, "steps_by_budget": 0,
               "lost_by_budget": 0, "mib_by_budget": 0.0, "trained_by_budget": 0}
    for t in TARGETS:
        metrics[f"time:{t}"] = metrics[f"mib:{t}"] = None
    for r in recs:
        moved += r["uplink_bytes"] + r["downlink_bytes"] + r.get("dropped_bytes", 0)
        acc = r["test_accuracy"]
        if r["sim_time_s"] <= BUDGET_S:
            metrics["acc_at_budget"] = acc
            metrics["steps_by_budget"] += 1
            metrics["lost_by_budget"] += r.get("late", 0) + r.get("dropped_stale", 0)
            metrics["trained_by_budget"] += r["trained"]
            metrics["mib_by_budget"] = moved / 2 ** 20
        for t in TARGETS:
            if metrics[f"time:{t}"] is None and acc is not None and acc >= t:
                metrics[f"time:{t}"] = r["sim_time_s"]
                metrics[f"mib:{t}"] = moved / 2 ** 20
    return metrics


def stat(values: list, digits: int) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return f"not reached (0/{len(values)})"
    mean = sum(known) / len(known)
    text = f"{mean:.{digits}f}"
    if len(known) > 1:
        sd = math.sqrt(sum((v - mean) ** 2 for v in known) / (len(known) - 1))
        df = len(known) - 1
        t = T95.get(df) or T95[max(k for k in T95 if k <= df)]
        text += f" ± {t * sd / math.sqrt(len(known)):.{digits}f}"
    if len(known) < len(values):
        text += f" ({len(known)}/{len(values)} reached)"
    return text


def render(results: dict, seeds: int, command: str, wall_s: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"Produced by `{command}` on {now:%Y-%m-%d} ({now:%H:%M} UTC) in "
             f"{wall_s / 60:.1f} min on {os.cpu_count()} CPUs ({platform.machine()}, load "
             f"average {load:.1f} at the end), seeds 0–{seeds - 1}: "
             f"{BASE['dataset']['limit_train']:,} Fashion-MNIST training images over 20 "
             f"clients, {BASE['dataset']['limit_test']:,} test images, MLP 784-64-10, one "
             f"local epoch of batch 32 at lr 0.05, 10 clients per synchronous round (5 where "
             f"said). "
             f"Times are simulated seconds; ± is the 95% confidence interval over seeds.", ""]
    for setting, (label, _) in SETTINGS.items():
        lines += [f"**{setting}** — {label}", "",
                  f"| arm | time to {TARGETS[0]:.2f} (s) | time to {TARGETS[1]:.2f} (s) | "
                  f"MiB moved to {TARGETS[0]:.2f} | accuracy at {BUDGET_S:g} s | "
                  f"MiB moved by {BUDGET_S:g} s | server steps by {BUDGET_S:g} s | "
                  f"tasks sent by {BUDGET_S:g} s | updates lost by {BUDGET_S:g} s |",
                  "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for arm, (arm_label, _) in ARMS.items():
            runs = results.get((setting, arm))
            if not runs:
                continue
            cells = [stat([m[f"time:{TARGETS[0]}"] for m in runs], 2),
                     stat([m[f"time:{TARGETS[1]}"] for m in runs], 2),
                     stat([m[f"mib:{TARGETS[0]}"] for m in runs], 1),
                     stat([m["acc_at_budget"] for m in runs], 4),
                     stat([m["mib_by_budget"] for m in runs], 0),
                     stat([m["steps_by_budget"] for m in runs], 0),
                     stat([m["trained_by_budget"] for m in runs], 0),
                     stat([m["lost_by_budget"] for m in runs], 0)]
            lines.append(f"| {arm_label} | " + " | ".join(cells) + " |")
        short = [f"{arm} seed {i}" for arm in ARMS for i, m in
                 enumerate(results.get((setting, arm), [])) if m["end_s"] < BUDGET_S]
        if short:
            lines.append(f"\nRuns that ended before {BUDGET_S:g} s (their accuracy at the "
                         f"budget is their last): {', '.join(short)}.")
        lines.append("")
    return "\n".join(lines)


def write_doc(path: str, body: str) -> None:
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else \
        f"# Asynchronous rounds\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} lines to replace")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{body}\n{END}{tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes, one training thread each")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "async-time"))
    parser.add_argument("--doc", default=DOC, help="the markdown file to update")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from edgefl.runconfig import run_config_from_mapping

    jobs = []
    for setting in SETTINGS:
        for arm in ARMS:
            if (setting, arm) in SKIP:
                continue
            for seed in range(args.seeds):
                cfg = config_of(setting, arm, seed)
                run_config_from_mapping(cfg, f"{setting}/{arm}")     # fail before running
                jobs.append({"key": (setting, arm, seed), "config": cfg,
                             "out": os.path.join(args.out, setting, arm, f"seed{seed}")})
    started = time.perf_counter()
    done = 0
    with ProcessPoolExecutor(max_workers=args.workers,
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(execute, j) for j in jobs]):
            status = future.result()
            done += 1
            print(f"[{done}/{len(jobs)}] {'/'.join(map(str, status['key']))}: "
                  f"{status['wall_s']:.1f} s", file=sys.stderr)
    results: dict = {}
    for job in jobs:
        setting, arm, _ = job["key"]
        results.setdefault((setting, arm), []).append(run_metrics(job["out"]))
    command = "python tools/experiments/async_time.py" + \
        (f" --seeds {args.seeds}" if args.seeds != 5 else "")
    body = render(results, args.seeds, command, time.perf_counter() - started)
    write_doc(args.doc, body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
