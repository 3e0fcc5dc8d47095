#!/usr/bin/env python3
"""FedMR's K models round by round: how large their weights grow and how far apart they
drift, up to the end of the run or the round whose local training met a non-finite loss
(issue 21 item 4: why FedMR with momentum diverges on the CNN here).

    python tools/fedmr_norms.py                            # the long tier's cnn-dir0.1 run
    python tools/fedmr_norms.py --setting dir0.1 --tier full --arm fedmr --seed 1
    python tools/fedmr_norms.py --set train.momentum=0.0   # one key of the run config changed

The run is the experiment's (tools/experiments/fedmr.yaml) for that tier, setting, arm and
seed, run by `sim.run_federation` as `edgefl simulate` runs it. After each aggregation the
tool records, per layer, the largest absolute weight over the K models and the mean
distance of each model's layer from the K models' mean (relative to the mean's norm), and
the round's mean training loss. Prints a table of the weight tensors (every --every rounds,
the first rounds and the last) and with --json the whole series, biases included. A
spread of 1 means the models' layers are on average as far from their mean as the mean is
from zero.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import reproduce    # noqa: E402
from _bench import markdown    # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", default="long", choices=("quick", "full", "long"))
    parser.add_argument("--setting", default="cnn-dir0.1")
    parser.add_argument("--arm", default="fedmr")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change one key of the run config, as `edgefl simulate --set`")
    parser.add_argument("--rounds", type=int, help="stop after this many rounds")
    parser.add_argument("--every", type=int, default=5, help="table row every N rounds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from edgefl.config import ConfigError, apply_override
    from edgefl.errors import NonFiniteError
    from edgefl.runconfig import run_config_from_mapping
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim import run_federation
    from edgefl.strategies.fedmr import FedMR, recombination_units

    exp = reproduce.load_experiment(str(REPO / "tools" / "experiments" / "fedmr.yaml"), args.tier)
    if args.setting not in exp.settings or args.arm not in exp.arms_of(args.setting):
        parser.error(f"--setting {args.setting} --arm {args.arm}: not in the {args.tier} tier "
                     f"(settings {', '.join(exp.settings)})")
    config = reproduce.resolve_owners(exp.config(args.setting, args.arm, args.seed))
    try:   # the `edgefl simulate --set` syntax: the value parsed as YAML
        for item in args.set:
            apply_override(config, item)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.rounds:
        config["rounds"] = args.rounds
    run = prepare_run(run_config_from_mapping(config, "fedmr_norms"), workers=1, progress=False)
    if not isinstance(run.strategy, FedMR):
        parser.error(f"--arm {args.arm}: not a FedMR arm")
    setup = run.setup
    units = recombination_units(setup.units, run.strategy.granularity, run.init_params.size)
    by_offset = {e.offset: e.name for e in run.model.table.entries}
    names = ["+".join(by_offset.get(o, f"@{o}") for o, _ in unit) for unit in units]
    series = []

    class Recording(type(run.strategy)):
        def aggregate(self, round, updates, state):
            new, metrics = super().aggregate(round, updates, state)
            record(round, new, metrics)
            return new, metrics

    def record(round, new, metrics):
        models = (FedMR.models(new) if "models" in new.buffers
                  else new.buffers["params"][None, :])
        row = {"round": round, "train_loss": metrics["train_loss"], "layers": []}
        for unit in units:
            block = np.concatenate([models[:, o:o + n] for o, n in unit], axis=1)
            mean = block.mean(axis=0)
            spread = float(np.mean(np.linalg.norm(block - mean, axis=1))
                           / max(np.linalg.norm(mean), 1e-12))
            row["layers"].append({"max_abs": float(np.abs(block).max()), "spread": spread})
        series.append(row)

    import dataclasses
    strategy = Recording(**{f.name: getattr(run.strategy, f.name)
                            for f in dataclasses.fields(run.strategy) if f.init})
    diverged = None
    try:
        run_federation(strategy, run.init_params, run.clients, setup,
                       config["clients_per_round"], workers=1, eval_every=10 ** 9)
    except NonFiniteError as exc:
        diverged = {"round": len(series) + 1, "error": str(exc)}
    if args.json:
        print(json.dumps({"config": config, "units": names, "series": series,
                          "diverged": diverged}, indent=1))
        return 0
    shown = {r["round"] for r in series if r["round"] <= 3 or r["round"] % args.every == 0}
    shown |= {series[-1]["round"]} if series else set()
    rows = []
    for r in series:
        if r["round"] not in shown:
            continue
        row = {"round": r["round"], "train_loss": round(r["train_loss"], 3)}
        for name, layer in zip(names, r["layers"]):
            parts = name.split("+")
            if all(p.endswith(".bias") for p in parts):   # (in --json; weights tell the story)
                continue
            label = parts[0].rsplit(".", 1)[0]             # the layer: fc1 for fc1.weight(+bias)
            row[f"{label}: max abs, spread"] = \
                f"{layer['max_abs']:.2f}, {layer['spread']:.2f}"
        rows.append(row)
    print(f"# FedMR's K models by round: {args.tier} tier, {args.setting}, {args.arm}, seed "
          f"{args.seed}{''.join(' --set ' + s for s in args.set)}\n")
    print(markdown(rows))
    if diverged:
        print(f"\ndiverged in round {diverged['round']}: {diverged['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
