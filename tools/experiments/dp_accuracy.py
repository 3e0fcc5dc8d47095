#!/usr/bin/env python3
"""Accuracy against epsilon for DP-FedAvg on Fashion-MNIST: the table of docs/privacy.md
("Differential privacy").

    python tools/experiments/dp_accuracy.py                      # the table in docs/privacy.md
    python tools/experiments/dp_accuracy.py --rounds 20 --out /tmp/dp   # a quick look

For each partition (IID, Dirichlet 0.5) and each target epsilon it picks the noise
multiplier z whose epsilon after the run's rounds is the target at the run's delta
(`privacy.accountant.noise_for_epsilon`: dp-accounting's calibration over the same event
the run's accountant composes), then runs `edgefl simulate` with privacy.dp set to it and
reads the run's summary.json. Two rows have no noise: "inf (clip only)" (clipping and the
fixed denominator, z = 0: what DP costs before any noise) and "no DP" (plain FedAvg with
uniform weights). Every run uses privacy.dp.reproducible: true (noise seeded from the run's
seed), so the table is reproduced exactly by the same command; a deployment must not.

The scale: client-level DP needs many clients per round (the noise on the average is
z * C / m per coordinate), so the 60,000 training images are split over --clients clients
(default 1000, 60 images each) with --per-round of them per round (default 100, q = 0.1).
Runs execute one after another, each with --workers threads.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from edgefl.privacy.accountant import PrivacyAccountant, noise_for_epsilon  # noqa: E402
from edgefl.privacy.settings import DifferentialPrivacy  # noqa: E402

PARTITIONS = {"iid": {"name": "iid"}, "dirichlet-0.5": {"name": "dirichlet", "alpha": 0.5}}


def base_config(args) -> dict:
    return {
        "dataset": {"name": "fashion-mnist"},
        "partition": {"name": "iid", "clients": args.clients},
        "model": {"name": "mlp", "hidden": [100]},
        "strategy": {"name": "fedavg", "weighting": "uniform"},
        "train": {"lr": args.lr, "batch_size": 10, "epochs": 1},
        "rounds": args.rounds,
        "clients_per_round": args.per_round,
        "eval_every": args.rounds,
        "seed": 0,
    }


def yaml_of(value) -> str:
    return json.dumps(value)          # JSON is YAML: the config file needs no YAML writer


def run(args, config: dict, sets: list, out: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("\n".join(f"{k}: {yaml_of(v)}" for k, v in config.items()) + "\n")
        path = f.name
    cmd = [sys.executable, "-m", "edgefl.cli", "simulate", path, "--out", out, "--force",
           "--quiet", "--workers", str(args.workers)]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)   # stdout: the table
    finally:
        os.unlink(path)
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "edgefl-dp-accuracy"))
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--min-size", type=int, default=10,
                    help="the Dirichlet split's smallest client (redrawn until it holds this)")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--clip", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--epsilons", default="1,2,4,8")
    ap.add_argument("--partitions", default=",".join(PARTITIONS))
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    for name in ("clients", "per_round", "rounds", "workers"):
        if getattr(args, name, 1) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: need at least 1")
    if args.per_round > args.clients:
        ap.error(f"--per-round {args.per_round}: more than the {args.clients} clients")
    try:
        epsilons = [float(e) for e in args.epsilons.split(",")]
    except ValueError:
        ap.error(f"--epsilons {args.epsilons!r}: need numbers separated by commas (1,2,4,8)")
    unknown = [p for p in args.partitions.split(",") if p not in PARTITIONS]
    if unknown:
        ap.error(f"--partitions: {', '.join(unknown)} unknown; valid: {', '.join(PARTITIONS)}")
    config = base_config(args)
    started = time.time()
    rows = []          # (partition, label, z, epsilon reported, final acc, best acc)
    for part in args.partitions.split(","):
        config["partition"] = dict(PARTITIONS[part], clients=args.clients)
        if config["partition"]["name"] == "dirichlet":
            config["partition"]["min_size"] = args.min_size
        dp = DifferentialPrivacy(clip=args.clip, delta=args.delta)
        arms = [(f"{e:g}", noise_for_epsilon(e, dp, args.clients, args.per_round, args.rounds))
                for e in epsilons]
        arms += [("inf (clip only)", 0.0), ("no DP", None)]
        for label, z in arms:
            sets = []
            if z is not None:
                sets = ["privacy.dp.mode=central", f"privacy.dp.clip={args.clip}",
                        f"privacy.dp.noise_multiplier={z!r}", f"privacy.dp.delta={args.delta}",
                        "privacy.dp.reproducible=true"]
            out = os.path.join(args.out, part, label.split()[0] if z is not None else "nodp")
            summary = run(args, config, sets, out)
            eps = (summary.get("privacy") or {}).get("epsilon")
            if z is not None and z > 0:   # the run's own accountant agrees with the calibration
                want = PrivacyAccountant(DifferentialPrivacy(noise_multiplier=z,
                                                             delta=args.delta),
                                         args.clients, args.per_round).epsilon(args.rounds)
                assert eps is not None and math.isclose(eps, want, rel_tol=1e-9), (eps, want)
            rows.append((part, label, z, eps, summary["final_accuracy"]))
            print(f"{part:14s} eps={label:16s} z={z if z is not None else '-'!s:>8.8s} "
                  f"acc={summary['final_accuracy']:.4f}", file=sys.stderr)
    took = time.time() - started
    cmd = "python tools/experiments/dp_accuracy.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k != "out" and v != ap.get_default(k))
    print(f"Command: `{cmd}` ({datetime.date.today().isoformat()}, {took / 60:.1f} min on "
          f"{os.cpu_count()} cores).\n")
    print("| partition | target epsilon | noise multiplier z | epsilon after the run "
          "| test accuracy |")
    print("|---|---|---|---|---|")
    for part, label, z, eps, acc in rows:
        zs = "-" if z is None else f"{z:.3f}"
        es = "-" if z is None else "inf" if z == 0 else f"{eps:.3f}"   # JSON has no inf
        print(f"| {part} | {label} | {zs} | {es} | {acc:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
