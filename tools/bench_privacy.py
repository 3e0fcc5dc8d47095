#!/usr/bin/env python3
"""Secure aggregation's cost: mask expansion speed, and a secure round against a clear one.

Run from a checkout with the extension built in place (or edgefl installed):
    python tools/bench_privacy.py [--repeats N] [--quick] [--json]

Rows:
    mask expansion      1 or 10 masks added to a vector of 1M words (secagg.apply_masks,
                        kernels.secagg_mask), by each path: the AES-256-CTR keystream from
                        `cryptography` added block by block (the twin, the fallback; the GIL
                        held), and the C core's OpenSSL EVP loop on 1 thread and on every
                        usable core (EDGEFL_MASK_THREADS); GB/s = mask bytes per second of
                        wall time, GB per CPU-s = per second of process CPU time (all
                        threads; steadier than wall time on a loaded machine).
    round               one FedAvg round in process (`run_federation`, one thread, every
                        selected client uploads): the clear round against the same round run
                        secure (SecAgg+ between the in-process clients: keys, Shamir shares,
                        quantisation, masks, unmasking; in process the messages are not
                        encoded for a wire; the keys, shares and masks run on a thread while
                        the clients train, edgefl.sim.secure). Clients train on digits (IID shards)
                        with `local` work: 1 epoch of batch 32 (quickstart runs 5), or a
                        single step of batch 8, where the round is almost only the
                        aggregation path, the part secure aggregation changes; models are
                        digits MLPs of about 100k and 1M parameters. `neighbours` is SecAgg+'s
                        k (0: every pair masks, SecAgg). Three runs interleaved: clear,
                        secure with the masks on every usable core (`ratio`), secure with one
                        mask thread (`ratio, 1 mask thread`; the clients' masks, expanded
                        beside training, take one thread either way, so this changes only the
                        server's unmasking); `CPU ratio` is the process CPU
                        time (all threads) of the first secure run over the clear one's.
    round, Mosquitto    the same rounds through a real Mosquitto started for the benchmark, with
                        the aggregator and one client role per shard as threads of this process
                        (`edgefl simulate --transport mqtt`'s `run_over_broker`, one training
                        thread): every run has 2 rounds, and its time is the median of their
                        `wall_s` (announcement to record: the model down, training, the
                        update or the secure phases up, aggregation).
Each row's functions run interleaved (clear, secure, clear, secure, ...) after one warm-up;
times are medians over the repeats with [min, max], and `ratio` is the median of the
per-repeat secure / clear ratios (same-run ratios, so drift on the shared machine cancels).
"""
from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: the C core's GEMMs on one thread
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np    # noqa: E402
from _bench import markdown, need_counts    # noqa: E402

from edgefl import kernels    # noqa: E402
from edgefl.data import load_dataset, partition    # noqa: E402
from edgefl.models import build_model    # noqa: E402
from edgefl.privacy import secagg    # noqa: E402
from edgefl.privacy.settings import SecureAggregation    # noqa: E402
from edgefl.runs.prepare import local_datasets    # noqa: E402
from edgefl.sim import run_federation    # noqa: E402
from edgefl.sim.secure import in_process_secure_sum    # noqa: E402
from edgefl.strategies import Setup, get_strategy    # noqa: E402

HIDDEN = {100_000: [1500], 1_000_000: [1000, 900]}     # digits MLPs: 112k and 975k params


def interleaved(fns, repeats, cpu=False):
    """Per-function lists of wall times, the functions interleaved, after one warm-up each;
    cpu=True: (wall times, process CPU times, all threads)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    cpus = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts, cs in zip(fns, times, cpus):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            cs.append(time.process_time() - c0)
    return (times, cpus) if cpu else times


def spread(ts, scale=1.0, digits=1):
    med = statistics.median(ts) * scale
    return f"{med:.{digits}f} [{min(ts) * scale:.{digits}f}, {max(ts) * scale:.{digits}f}]"


def _threads(n):
    """Run with EDGEFL_MASK_THREADS=n (None: unset, the usable cores)."""
    if n is None:
        os.environ.pop("EDGEFL_MASK_THREADS", None)
    else:
        os.environ["EDGEFL_MASK_THREADS"] = str(n)


MASK_PATHS = [("cryptography", False, 1), ("C core, OpenSSL, 1 thread", True, 1),
              ("C core, OpenSSL, all cores", True, None)]


def mask_rows(repeats):
    rows = []
    for bits in (32, 64):
        n = 1_000_000
        dtype = kernels.RING_DTYPES[bits]
        words, scalars = np.zeros(n, dtype), np.zeros(0, np.uint64)
        for count in (1, 10):
            masks = [(bytes([k]) * 32, k % 2 == 1) for k in range(count)]

            def run(c_masks, threads):
                kernels.use_c_masks(c_masks)
                _threads(threads)
                secagg.apply_masks(words, scalars, masks)

            paths = [p for p in MASK_PATHS if p[1] is False or kernels.masks_in_c()]
            times, cpus = interleaved([lambda c=c, t=t: run(c, t) for _, c, t in paths],
                                      repeats, cpu=True)
            kernels.use_c_masks(True)
            _threads(None)
            nbytes = count * n * dtype.itemsize
            for (name, _, threads), ts, cs in zip(paths, times, cpus):
                rates = [nbytes / t / 1e9 for t in ts]
                per_cpu = [nbytes / max(c, 1e-9) / 1e9 for c in cs]
                rows.append({"row": f"mask expansion, {bits}-bit words, {count} mask(s), "
                                    f"{name}",
                             "size": f"{nbytes / 1e6:.0f} MB",
                             "GB/s": f"{statistics.median(rates):.2f} [{min(rates):.2f}, "
                                     f"{max(rates):.2f}]",
                             "GB per CPU-s": f"{statistics.median(per_cpu):.2f}"})
    return rows


def round_rows(repeats, cases):
    ds = load_dataset("digits")
    rows = []
    for clients_n, params, neighbours, local in cases:
        model = build_model({"name": "mlp", "hidden": HIDDEN[params]}, ds.input_shape, ds.num_classes)
        clients = local_datasets(ds, partition(ds, "iid", clients_n, 0), model)
        train = {"lr": 0.05, "batch_size": 32, "epochs": 1} if local == "1 epoch" else \
            {"lr": 0.05, "batch_size": 8, "steps": 1}
        setup = Setup(clients=sorted(clients), train=train, seed=0, rounds=1)
        init = model.init(0)
        strategy = get_strategy("fedavg")
        settings = SecureAggregation(threshold=0.67, neighbours=neighbours, ring_bits=32,
                                     clip_range=1.0)
        secure_sum = in_process_secure_sum(settings, "bench", 0)

        def clear():
            run_federation(strategy, init, clients, setup, clients_n, workers=1)

        def secure(threads):
            _threads(threads)
            run_federation(strategy, init, clients, setup, clients_n, workers=1, summing=True,
                           secure_sum=secure_sum)
            _threads(None)

        fns = [clear, lambda: secure(None), lambda: secure(1)]
        walls, cpus = interleaved(fns, repeats, cpu=True)
        t_clear, t_secure, t_one = walls

        def ratio(a, b):
            r = [x / y for x, y in zip(a, b)]
            return f"{statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}]"

        rows.append({"row": "round, in process", "clients": clients_n,
                     "params": init.size, "neighbours": neighbours, "local": local,
                     "clear ms": spread(t_clear, 1e3, 0), "secure ms": spread(t_secure, 1e3, 0),
                     "ratio": ratio(t_secure, t_clear),
                     "ratio, 1 mask thread": ratio(t_one, t_clear),
                     "CPU ratio": ratio(cpus[1], cpus[0])})
    return rows


def broker_rows(repeats, cases):
    from edgefl.runconfig import load_run_config
    from edgefl.runs.prepare import prepare_run
    from edgefl.sim import run_over_broker
    from edgefl.transport.broker import EmbeddedBroker, packet_bytes_for

    rows = []
    broker = EmbeddedBroker(kind="mosquitto", max_packet_bytes=packet_bytes_for(128 << 10))
    broker.start()
    try:
        for clients_n, params in cases:
            base = ["rounds=2", f"partition.clients={clients_n}",
                    f"clients_per_round={clients_n}", "train.epochs=1",
                    f"model.hidden={json.dumps(HIDDEN[params])}"]
            runs = [prepare_run(load_run_config("quickstart", base + extra), progress=False,
                                workers=1)
                    for extra in ([], ["privacy.secure_aggregation.threshold=0.67"])]
            walls = [[], []]

            def one(i):
                result, _ = run_over_broker(runs[i], broker.url, workers=1)
                walls[i].append(statistics.median(r["wall_s"] for r in result.history))

            interleaved([lambda: one(0), lambda: one(1)], repeats)
            t_clear, t_secure = walls[0][1:], walls[1][1:]      # without the warm-up's
            ratios = [s / c for s, c in zip(t_secure, t_clear)]
            rows.append({"row": "round, Mosquitto", "clients": clients_n,
                         "params": runs[0].init_params.size, "neighbours": 0,
                         "local": "1 epoch", "clear ms": spread(t_clear, 1e3, 0),
                         "secure ms": spread(t_secure, 1e3, 0),
                         "ratio": f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, "
                                  f"{max(ratios):.2f}]"})
    finally:
        broker.stop()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="the 10-client rows and the 100-client 100k row only")
    parser.add_argument("--no-broker", action="store_true",
                        help="skip the rows through Mosquitto")
    parser.add_argument("--target", action="store_true",
                        help="the rows of the targets only: mask expansion, 10 clients x 1M "
                             "parameters in process (1 epoch), and through Mosquitto")
    parser.add_argument("--json", action="store_true", help="rows as JSON instead of a table")
    args = parser.parse_args(argv)
    need_counts(parser, args, "repeats")
    cases = [(10, 100_000, 0, "1 epoch"), (10, 1_000_000, 0, "1 epoch"),
             (10, 1_000_000, 0, "1 step"), (100, 100_000, 0, "1 epoch"),
             (100, 100_000, 10, "1 epoch")]
    if not args.quick:
        cases += [(100, 1_000_000, 10, "1 epoch")]
    if args.target:
        cases = [(10, 1_000_000, 0, "1 epoch")]
    rows = mask_rows(max(args.repeats, 10)) + round_rows(args.repeats, cases)
    if not args.no_broker:
        rows += broker_rows(args.repeats, [(10, 100_000), (10, 1_000_000)])
    if args.json:
        print(json.dumps({"backend": kernels.backend, "repeats": args.repeats, "rows": rows},
                         indent=1))
    else:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
