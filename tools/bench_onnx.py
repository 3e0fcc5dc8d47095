#!/usr/bin/env python3
"""Inference speed: exported models in onnxruntime versus edgefl's own C forward pass.

Run from a checkout with the extension built in place (or edgefl installed):
    python tools/bench_onnx.py [--quick] [--json]

Models (28x28x1 input, 10 classes, seeded random weights: speed does not depend on them):
    mlp        784-200-200-10, ReLU (FedAvg's MNIST 2NN), 199,210 parameters
    cnn-mnist  FedAvg's MNIST CNN, 1,663,370 parameters
Implementations, all on ONE thread (OPENBLAS_NUM_THREADS=1 before NumPy is imported;
onnxruntime intra-op threads = 1, as edgefl.infer.Predictor(threads=1) builds its session):
    edgefl-c          edgefl.kernels.forward on normalised float32 input (the C core)
    onnxruntime       InferenceSession.run of the fp32 export on raw input (normalisation is
                      in the graph; the probabilities output is computed too)
    onnxruntime-int8  the same after `edgefl export --quantize int8` (static QDQ, calibrated
                      on 256 random images)
Rows: bench (latency = batch 1, throughput = batch 64), model, batch, impl, median_s (median
wall time of one call over the repeats, after one untimed warm-up; implementations take turns
so a drifting machine biases none), samples_per_s = batch / median_s, vs_c = edgefl-c's
median_s / this median_s (above 1: faster than the C core).
"""
from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: one thread, comparable numbers
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout
from _bench import time_medians  # noqa: E402  (tools/ is the script directory)

from edgefl import kernels
from edgefl.export import export_onnx, quantize_int8
from edgefl.infer import Predictor
from edgefl.models import build_model

MODELS = {"mlp": dict(name="mlp", hidden=[200, 200]), "cnn-mnist": "cnn-mnist"}
MEAN, STD = np.float32(0.1307 * 255), np.float32(0.3081 * 255)   # MNIST's statistics


def bench(args) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in MODELS.items():
            model = build_model(spec, (1, 28, 28), 10)
            params = model.init(0)
            fp32, int8 = os.path.join(tmp, f"{name}.onnx"), os.path.join(tmp, f"{name}.int8.onnx")
            export_onnx(model, params, fp32, norm_mean=[MEAN], norm_std=[STD])
            calibration = rng.integers(0, 256, (256, 1, 28, 28)).astype(np.float32)
            quantize_int8(fp32, int8, calibration)
            sessions = {impl: Predictor(path, threads=1, check_interval=None).session
                        for impl, path in (("onnxruntime", fp32), ("onnxruntime-int8", int8))}
            for batch, bench_name in ((1, "latency"), (64, "throughput")):
                raw = rng.integers(0, 256, (batch, 1, 28, 28)).astype(np.float32)
                x = np.ascontiguousarray((raw - MEAN) / STD, dtype=np.float32)
                fns = {f"edgefl-{kernels.backend}":
                       lambda m=model, p=params, x=x: kernels.forward(m, p, x)}
                for impl, session in sessions.items():
                    fns[impl] = lambda s=session, raw=raw: s.run(None, {"input": raw})
                repeats = (50 if batch == 1 else 10) if args.quick else \
                    (500 if batch == 1 else 50)
                medians = dict(zip(fns, time_medians(list(fns.values()), repeats)))
                base = medians[f"edgefl-{kernels.backend}"]
                for impl, median in medians.items():
                    row = {"bench": bench_name, "model": name, "batch": batch, "impl": impl,
                           "median_s": float(f"{median:.4g}"),
                           "samples_per_s": round(batch / median),
                           "vs_c": round(base / median, 2)}
                    rows.append(row)
                    if not args.json:
                        print(f"  {row}", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    args = ap.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)   # onnxruntime.quantization's info chatter
    rows = bench(args)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
