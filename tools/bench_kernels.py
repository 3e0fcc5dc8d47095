#!/usr/bin/env python3
"""Benchmarks of edgefl's kernels: prints a Markdown table, or the rows as JSON (--json).

Run from a checkout with the extension built in place (or edgefl installed):
    python tools/bench_kernels.py [--quick] [--json] [--only aggregate] [--mem-budget-gb 6]

Every benchmark is a function in BENCHMARKS that yields one dict per table row; rows share
the keys `bench`, `impl` and `median_s` (median wall time over `repeats` timed calls, after
one untimed warm-up call; the implementations compared in one row group take turns, so a
drifting machine biases none of them) and add their own. Everything runs on one thread: the BLAS/OpenMP
thread counts are pinned to 1 before NumPy is imported.

aggregate: out = sum_k w_k * x_k over K separate float32 buffers of P floats, for
  K in {10, 100} and P in {1M, 10M} (--quick: P = 1M only).
    c            edgefl._core.weighted_sum (one streaming pass, float64 block accumulator)
    numpy-naive  sum(w * x for w, x in zip(weights, xs)), the obvious NumPy code
    memcpy       np.copyto of each x_k into one P-float buffer: the same K*P*4 bytes read
  gb_per_s = (bytes read + bytes written) / median_s / 1e9, the same definition for all
  three: K*P*4 + P*4 bytes for c and numpy-naive (temporaries not counted), K*P*4 + K*P*4
  for memcpy. vs_memcpy = gb_per_s / memcpy's gb_per_s at the same K, P. Combinations whose
  buffers exceed the memory budget (default 6 GB, capped by MemAvailable) are reported as
  skipped rows.

train: samples/s of one local epoch (seeded shuffle, minibatch gather, forward, backward, SGD
  step) on MNIST-shaped random data (1x28x28, 10 classes) at batch 32 and 64, for softmax
  (784->10), mlp (784-200-200-10) and cnn-mnist (FedAvg's CNN), as
    c      edgefl._core.local_train (one call per epoch)
    c-prox the same with FedProx's proximal term (prox_mu = 0.01, anchored at the start point):
           the cost of one more pass over the parameters per step
    numpy  edgefl.reference.local_train (the NumPy twin, same loop)
    torch  the same network and SGD step in PyTorch (torch.set_num_threads(1)); skipped, with
           a note, when torch is not importable (it is never an edgefl dependency)
  vs_numpy / vs_torch = samples_per_s / that implementation's at the same model and batch.

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE: some machines set these to pin old OpenBLAS builds to
safe kernels; they also pin current NumPy and scipy-openblas32 to older (slower) code paths.
The tool removes them before NumPy loads, so c and numpy run the kernels OpenBLAS would pick
by itself; --keep-openblas-env keeps them.
"""
from __future__ import annotations

import os
import sys

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: one thread, comparable numbers
if "--keep-openblas-env" not in sys.argv:
    for _var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        os.environ.pop(_var, None)
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout
from _bench import time_medians, markdown  # noqa: E402  (tools/ is the script directory)

try:
    from edgefl import (
        _blas,  # noqa: F401  (preloads the BLAS the core links, as kernels.py)
        _core,
    )
    _NO_CORE = ""
except ImportError as exc:
    _core = None
    _NO_CORE = f"edgefl._core not built ({exc})"

GB = 1e9


def memory_budget(args) -> float:
    """Bytes a benchmark may allocate: --mem-budget-gb, capped at 80% of MemAvailable."""
    budget = args.mem_budget_gb * GB
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    budget = min(budget, 0.8 * int(line.split()[1]) * 1024)
    except OSError:
        pass
    return budget


# ---------------------------------------------------------------------------------------
# aggregate: weighted sum of K separate buffers
# ---------------------------------------------------------------------------------------

def bench_aggregate(args) -> Iterator[dict]:
    sizes = [1_000_000] if args.quick else [1_000_000, 10_000_000]
    repeats = 5 if args.quick else 7
    budget = memory_budget(args)
    for k in (10, 100):
        for p in sizes:
            base = {"bench": "aggregate", "K": k, "P": p}
            need = (k + 4) * p * 4  # inputs, out, memcpy target, numpy-naive's temporaries
            if need > budget:
                yield dict(base, impl="all", gb_per_s=None, median_s=None, repeats=0,
                           note=f"skipped: needs {need / GB:.1f} GB, budget {budget / GB:.1f} GB")
                continue
            yield from _aggregate_rows(base, k, p, repeats)


def _aggregate_rows(base: dict, k: int, p: int, repeats: int) -> Iterator[dict]:
    rng = np.random.default_rng(0)
    seed = rng.random(p, dtype=np.float32)  # real pages: np.zeros would map the zero page
    xs = []
    for i in range(k):
        x = np.empty(p, np.float32)
        np.multiply(seed, np.float32(1.0 + i / k), out=x)
        xs.append(x)
    weights = rng.dirichlet(np.ones(k))
    wf = [float(w) for w in weights]
    out = np.empty(p, np.float32)
    sum_bytes = (k * p + p) * 4
    copy_bytes = 2 * k * p * 4

    def memcpy():
        for x in xs:
            np.copyto(out, x)

    impls = [("memcpy", memcpy, copy_bytes, "")]
    if _core is not None:
        impls.append(("c", lambda: _core.weighted_sum(out, xs, weights), sum_bytes, ""))
    else:
        impls.append(("c", None, sum_bytes, _NO_CORE))
    impls.append(("numpy-naive", lambda: sum(w * x for w, x in zip(wf, xs)), sum_bytes, ""))

    runnable = [(name, fn) for name, fn, _, _ in impls if fn is not None]
    medians = dict(zip([name for name, _ in runnable],
                       time_medians([fn for _, fn in runnable], repeats)))
    memcpy_rate = copy_bytes / medians["memcpy"] / GB
    for name, fn, nbytes, note in impls:
        if fn is None:
            yield dict(base, impl=name, gb_per_s=None, median_s=None, repeats=0, note=note)
            continue
        t = medians[name]
        rate = nbytes / t / GB
        yield dict(base, impl=name, gb_per_s=round(rate, 2), median_s=round(t, 5),
                   repeats=repeats, vs_memcpy=round(rate / memcpy_rate, 2))


# ---------------------------------------------------------------------------------------
# train: one local epoch through local_train
# ---------------------------------------------------------------------------------------

TRAIN_MODELS = (
    # (row name, model spec, samples per timed epoch: full, quick)
    ("softmax", {"name": "softmax"}, (8192, 2048)),
    ("mlp", {"name": "mlp", "hidden": [200, 200]}, (4096, 1024)),
    ("cnn-mnist", {"name": "cnn-mnist"}, (512, 128)),
)


def _torch_epoch(name: str, x: np.ndarray, y: np.ndarray, batch: int):
    """One epoch of the same network and plain SGD step in PyTorch, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nn = torch.nn
    if name == "softmax":
        net = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    elif name == "mlp":
        net = nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200),
                            nn.ReLU(), nn.Linear(200, 10))
    else:
        net = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))

    def epoch():
        perm = torch.randperm(tx.shape[0])
        for i in range(0, tx.shape[0], batch):
            idx = perm[i:i + batch]
            opt.zero_grad()
            loss_fn(net(tx[idx]), ty[idx]).backward()
            opt.step()
    return epoch


def bench_train(args) -> Iterator[dict]:
    from edgefl import reference
    from edgefl.kernels import train_config
    from edgefl.models import build_model

    rng = np.random.default_rng(0)
    repeats = 3 if args.quick else 5
    for name, spec, sizes in TRAIN_MODELS:
        n = sizes[1] if args.quick else sizes[0]
        x = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, n).astype(np.int32)
        model = build_model(spec, (1, 28, 28), 10)
        for batch in (32, 64):
            base = {"bench": "train", "model": name, "batch": batch}
            cfg = train_config(lr=0.01, batch_size=batch, epochs=1, seed=1)
            prox_cfg = train_config(lr=0.01, prox_mu=0.01, batch_size=batch, epochs=1, seed=1)
            anchor = model.init(0)
            impls = []
            for impl_name, impl, run_cfg in (("c", _core, cfg), ("c-prox", _core, prox_cfg),
                                             ("numpy", reference, cfg)):
                if impl is None:
                    yield dict(base, impl=impl_name, samples_per_s=None, note=_NO_CORE)
                    continue
                params = model.init(0)
                impls.append((impl_name, lambda impl=impl, params=params, run_cfg=run_cfg:
                               impl.local_train(params, None, model, x, y, None, run_cfg,
                                                anchor=anchor)))
            torch_epoch = _torch_epoch(name, x, y, batch)
            if torch_epoch is not None:
                impls.append(("torch", torch_epoch))
            medians = dict(zip([i for i, _ in impls], time_medians([f for _, f in impls], repeats)))
            rates = {i: n / t for i, t in medians.items()}
            for impl_name, rate in rates.items():
                row = dict(base, impl=impl_name, samples_per_s=round(rate), median_s=round(
                    medians[impl_name], 5), repeats=repeats, n=n)
                for ref in ("numpy", "torch"):
                    if ref in rates and ref != impl_name:
                        row[f"vs_{ref}"] = round(rate / rates[ref], 2)
                yield row
            if torch_epoch is None:
                yield dict(base, impl="torch", samples_per_s=None,
                           note="skipped: torch not importable (pip install torch to compare)")


# ---------------------------------------------------------------------------------------
# registry: each entry yields row dicts. The training benchmark (local_train steps/s) is added
# here by its owner, e.g. `bench_training`; keep one function per benchmark.
# ---------------------------------------------------------------------------------------

BENCHMARKS: list[Callable[[argparse.Namespace], Iterator[dict]]] = [
    bench_train,
    bench_aggregate,
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only this benchmark (repeatable): "
                         + ", ".join(b.__name__.removeprefix("bench_") for b in BENCHMARKS))
    ap.add_argument("--keep-openblas-env", action="store_true",
                    help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE (read before NumPy loads)")
    ap.add_argument("--mem-budget-gb", type=float, default=6.0,
                    help="skip sizes whose buffers need more than this (default 6)")
    args = ap.parse_args(argv)
    chosen = [b for b in BENCHMARKS
              if not args.only or b.__name__.removeprefix("bench_") in args.only]
    if not chosen:
        ap.error(f"--only {args.only}: no such benchmark")
    rows = []
    for bench in chosen:
        for row in bench(args):
            rows.append(row)
            if not args.json:
                print(f"  {row}", file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
