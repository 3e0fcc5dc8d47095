#!/usr/bin/env python3
"""Benchmarks of edgefl's transport: prints a Markdown table, or the rows as JSON (--json).

Run from a checkout with the extension built in place (or edgefl installed):
    python tools/bench_transport.py [--quick] [--json] [--only frame]

Every benchmark is a function in BENCHMARKS that yields one dict per table row; rows share
the keys `bench`, `impl` and `median_s` (median wall time over `repeats` timed calls, after
one untimed warm-up call; the operations compared in one row group take turns, so a drifting
machine biases none of them) and add their own. Everything runs on one thread: the
BLAS/OpenMP thread counts are pinned to 1 before NumPy is imported.

frame: edgefl.transport.wire on a model of P float32 parameters in four layers, for P in
  {1M, 10M} (--quick: 1M only) and compression none (f32 on the wire), f16 and int8:
    encode      wire.encode("update", ...) of one buffer: checks (finite; f16 range), codec,
                metadata, CRC32, one bytes object
    decode      wire.decode(...) with a full Expectation: header, CRC32, metadata, finite
                values; f32 returns a zero-copy view, f16/int8 decompress into a new array
    chunk-128k  wire.split(frame, 128 KiB) (AWS IoT's payload limit) and every chunk through a
                wire.Reassembler, which returns the decoded frame after the last one
    memcpy      np.copyto of the P floats into another buffer (the same 4P bytes read), as a
                reference for what the memory system allows
  gb_per_s = 4P / median_s / 1e9 for every row: float32 model bytes per second, whatever
  the bytes on the wire (wire_bytes), so compressions compare by what they deliver.
  vs_memcpy = gb_per_s / memcpy's gb_per_s at the same P. Targets (issue 4): f32 encode and
  decode >= 1 GB/s.

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are removed before NumPy loads, as in
tools/bench_kernels.py (--keep-openblas-env keeps them).
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
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout

from edgefl import kernels
from edgefl.params import LayerTable
from edgefl.transport import wire

GB = 1e9
AWS_IOT_MAX_PAYLOAD = 128 * 1024


def time_medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median wall time of each fn over `repeats` rounds, after one untimed warm-up call each.
    Rounds interleave the functions, so a drifting machine (other jobs, turbo) biases none."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


# ---------------------------------------------------------------------------------------
# frame: encode / decode / chunk+reassemble
# ---------------------------------------------------------------------------------------

def bench_table(p: int) -> LayerTable:
    """Four layers, P parameters: two dense layers and their biases."""
    return LayerTable.from_shapes([("fc1.weight", (p // 1000 - 12, 1000)), ("fc1.bias", (1000,)),
                                   ("fc2.weight", (10, 1000)), ("fc2.bias", (1000,))])


def bench_frame(args) -> Iterator[dict]:
    sizes = [1_000_000] if args.quick else [1_000_000, 10_000_000]
    repeats = 5 if args.quick else 9
    for p in sizes:
        table = bench_table(p)
        assert table.size == p
        rng = np.random.default_rng(0)
        x = rng.standard_normal(p, dtype=np.float32)
        out = np.empty_like(x)
        model_bytes = 4 * p
        memcpy_t, = time_medians([lambda out=out, x=x: np.copyto(out, x)], repeats)
        memcpy_rate = model_bytes / memcpy_t / GB
        yield {"bench": "frame", "P": p, "compression": "-", "impl": "memcpy",
               "gb_per_s": round(memcpy_rate, 2), "median_s": round(memcpy_t, 5),
               "repeats": repeats, "wire_bytes": model_bytes, "vs_memcpy": 1.0}
        for compression in ("none", "f16", "int8"):
            yield from _frame_rows(table, x, compression, repeats, memcpy_rate)


def _frame_rows(table: LayerTable, x: np.ndarray, compression: str, repeats: int,
                memcpy_rate: float) -> Iterator[dict]:
    scalars = {"num_samples": 600, "train_loss": 0.4321}
    expect = wire.Expectation(table, kinds="update", rounds=7, topic_sender="pi-07")

    def encode():
        return wire.encode("update", 7, "pi-07", {"params": x}, scalars, table, compression)

    data = encode()
    frame = wire.decode(data, expect)
    if compression == "none":  # the zero-copy claim, checked where it is measured
        assert np.shares_memory(frame.buffers["params"], np.frombuffer(data, np.uint8))

    def decode():
        return wire.decode(data, expect)

    def chunk_128k():
        reassembler = wire.Reassembler(timeout_s=600)
        got = None
        for chunk in wire.split(data, AWS_IOT_MAX_PAYLOAD):
            got = reassembler.add(chunk, expect)
        assert got is not None
        return got

    ops = [("encode", encode), ("decode", decode), ("chunk-128k", chunk_128k)]
    medians = time_medians([fn for _, fn in ops], repeats)
    n_chunks = len(wire.split(data, AWS_IOT_MAX_PAYLOAD))
    for (op, _), t in zip(ops, medians):
        rate = 4 * x.size / t / GB
        row = {"bench": "frame", "P": x.size, "compression": compression, "impl": op,
               "backend": kernels.backend,
               "gb_per_s": round(rate, 2), "median_s": round(t, 5), "repeats": repeats,
               "wire_bytes": len(data), "vs_memcpy": round(rate / memcpy_rate, 2)}
        if op == "chunk-128k":
            row["chunks"] = n_chunks
        yield row


# ---------------------------------------------------------------------------------------
# registry: each entry yields row dicts. The MQTT round-overhead benchmark (10 clients, a
# 1M-parameter model through Mosquitto and the embedded broker, next to raw paho moving the
# same bytes) is added here by its owner, e.g. `bench_round`; keep one function per benchmark.
# ---------------------------------------------------------------------------------------

BENCHMARKS: list[Callable[[argparse.Namespace], Iterator[dict]]] = [
    bench_frame,
]


def markdown(rows: list[dict]) -> str:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]

    def cell(v):
        if v is None:
            return ""
        if isinstance(v, int) and not isinstance(v, bool) and v >= 10_000:
            return f"{v:,}".replace(",", "_")
        return str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only this benchmark (repeatable): "
                         + ", ".join(b.__name__.removeprefix("bench_") for b in BENCHMARKS))
    ap.add_argument("--keep-openblas-env", action="store_true",
                    help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE (read before NumPy loads)")
    args = ap.parse_args(argv)
    chosen = [b for b in BENCHMARKS
              if not args.only or b.__name__.removeprefix("bench_") in args.only]
    if not chosen:
        ap.error(f"--only {args.only}: no such benchmark")
    print(f"edgefl backend: {kernels.backend}", file=sys.stderr)
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
