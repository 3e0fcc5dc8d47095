#!/usr/bin/env python3
"""The baseline of issue 19: FedAvg as a user would write it in one NumPy script.

    python tools/plain_loop.py [--clients 100] [--per-round 10] [--rounds 20]
                               [--path /usr/share/datasets/fashion-mnist] [--seed 0] [--json]

Workload: softmax regression on Fashion-MNIST (the IDX files, gzip or not), normalised with
the data set's usual mean and std, an IID split (one shuffle, equal shares), each round
`--per-round` clients drawn uniformly without replacement, each training one local epoch of
minibatch SGD (lr 0.1, batch 32, a fresh shuffle per epoch) from the global model, the
server averaging the models weighted by the clients' sample counts, and the test set
evaluated after every round. Nothing from edgefl is imported: this is the standalone
loop `tools/bench_scale.py --mode simulate` holds `edgefl simulate` against (it measures
this script's wall time and peak RSS from outside, as a subprocess).

It keeps one float32 copy of the training set and indexes each selected client's shard out
of it when the client trains (`x[idx]`, a copy of that shard only). Prints one JSON object
with `--json` (wall time, per-round times, accuracy), else a line per round.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse   # noqa: E402
import gzip       # noqa: E402
import json       # noqa: E402
import sys        # noqa: E402
import time       # noqa: E402

import numpy as np   # noqa: E402

STARTED = time.perf_counter()
MEAN, STD = 0.2860, 0.3530          # Fashion-MNIST's pixel mean and std (of x / 255)


def read_idx(path: str) -> np.ndarray:
    """One IDX file (gzip or plain) as an array: 2 zero bytes, a type code, ndim, then
    big-endian uint32 dimensions and the values (only uint8 is needed here)."""
    for candidate in (path, path + ".gz"):
        if os.path.exists(candidate):
            break
    else:
        raise SystemExit(f"{path}(.gz) not found")
    opener = gzip.open if candidate.endswith(".gz") else open
    with opener(candidate, "rb") as f:
        data = f.read()
    if data[0:2] != b"\0\0" or data[2] != 0x08:
        raise SystemExit(f"{candidate}: not a uint8 IDX file")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def images(path: str) -> np.ndarray:
    raw = read_idx(path)
    x = raw.reshape(len(raw), -1).astype(np.float32)
    del raw
    x *= 1.0 / 255.0
    x -= MEAN
    x /= STD
    return x


def local_epoch(w, b, x, y, lr, batch, rng):
    """One epoch of minibatch SGD on softmax cross-entropy, in place on copies of (w, b)."""
    w, b = w.copy(), b.copy()
    order = rng.permutation(len(y))
    for start in range(0, len(y), batch):
        idx = order[start:start + batch]
        xb, yb = x[idx], y[idx]
        z = xb @ w + b
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(yb)), yb] -= 1.0
        p /= len(yb)
        w -= lr * (xb.T @ p)
        b -= lr * p.sum(axis=0)
    return w, b


def evaluate(w, b, x, y):
    z = x @ w + b
    z -= z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float((z.argmax(axis=1) == y).mean()), float(-logp[np.arange(len(y)), y].mean())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--path", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("clients", "per_round", "rounds", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: need at least 1")
    if args.per_round > args.clients:
        parser.error(f"--per-round {args.per_round}: more than the {args.clients} clients")

    x = images(os.path.join(args.path, "train-images-idx3-ubyte"))
    y = read_idx(os.path.join(args.path, "train-labels-idx1-ubyte")).astype(np.int64)
    x_test = images(os.path.join(args.path, "t10k-images-idx3-ubyte"))
    y_test = read_idx(os.path.join(args.path, "t10k-labels-idx1-ubyte")).astype(np.int64)
    loaded = time.perf_counter() - STARTED

    rng = np.random.default_rng(args.seed)
    shards = np.array_split(rng.permutation(len(y)), args.clients)
    d, k = x.shape[1], int(y.max()) + 1
    w = (rng.standard_normal((d, k)) * np.sqrt(1.0 / d)).astype(np.float32)
    b = np.zeros(k, np.float32)
    rounds = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        picked = rng.choice(args.clients, size=args.per_round, replace=False)
        w_sum, b_sum, n_sum = np.zeros_like(w, np.float64), np.zeros_like(b, np.float64), 0
        for c in picked:
            idx = shards[c]
            wc, bc = local_epoch(w, b, x[idx], y[idx], args.lr, args.batch, rng)
            w_sum += len(idx) * wc
            b_sum += len(idx) * bc
            n_sum += len(idx)
        w, b = (w_sum / n_sum).astype(np.float32), (b_sum / n_sum).astype(np.float32)
        accuracy, loss = evaluate(w, b, x_test, y_test)
        rounds.append(time.perf_counter() - t0)
        if not args.json:
            print(f"round {r + 1}: accuracy {accuracy:.4f}, loss {loss:.4f}, "
                  f"{rounds[-1] * 1e3:.1f} ms", flush=True)
    wall = time.perf_counter() - STARTED
    out = {"wall_s": wall, "load_s": loaded, "round_s": rounds, "final_accuracy": accuracy,
           "final_loss": loss}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"wall {wall:.2f} s (data {loaded:.2f} s), final accuracy {accuracy:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
