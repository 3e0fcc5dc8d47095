#!/usr/bin/env python3
"""Footprint of a client per device profile: resident memory and seconds per local epoch of
the profile's suggested model, trained with the profile's settings on a client's shard of
real data. Prints a Markdown table, or the rows as JSON (--json).

    python tools/footprint.py [--profiles rpi4,rpi5] [--datasets digits,fashion-mnist]
                              [--samples 6000] [--epochs 3] [--threads N] [--json]

For each dataset the parent writes one client's shard as an .npz file, as a board holds its
own data: digits (scikit-learn's bundled 8x8 digits, its whole training split) and
Fashion-MNIST (/usr/share/datasets/fashion-mnist, Debian's dataset-fashion-mnist; the first
--samples training images, a tenth of the set by default: one of ten clients). Then, per
(profile, dataset), a FRESH Python process, so every number is that process's own:

  1. imports edgefl (NumPy, the C core)                        -> runtime_mb (VmRSS)
  2. resolves the client's layered config for the profile (edgefl.service.layered), applies
     compute.threads (edgefl.service.profiles.apply_threads), loads the shard with edgefl's
     npz loader                                                 -> data_mb (x_train bytes)
  3. builds suggested_model, runs one untimed local epoch, then --epochs timed ones with
     train.batch_size (edgefl.kernels.local_train: one C call per epoch)
                                                                -> epoch_s (median), peak_mb (VmHWM)
  4. imports paho-mqtt and onnxruntime, which the MQTT client also loads (the transport, and
     the check of each received ONNX model)                     -> client_peak_mb (VmHWM)

peak_mb is compared with the profile's compute.memory_budget_mb. load_1m is the 1-minute
load average when the epochs ran: OpenBLAS threads beyond the first stall when other work
holds a core, so multi-threaded timings are only comparable at similar load. The numbers are
for THIS machine (printed in the header): a board owner runs the same command on the board
and compares. Threads above the CPUs this machine has are measured as set, oversubscribed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a source checkout

DATASETS = ("digits", "fashion-mnist")
FASHION_TEST = 1000     # test images kept in the shard (the loader needs a test split)


# ---------------------------------------------------------------------------------------
# the child: one fresh process per (profile, dataset)
# ---------------------------------------------------------------------------------------

def child(spec: dict) -> dict:
    from edgefl import kernels
    from edgefl.data import load_dataset
    from edgefl.models import build_model
    from edgefl.service import profiles
    from edgefl.service.layered import load_service_config

    runtime_mb = profiles.resident_mb()
    config = load_service_config(
        "client", None, profile=spec["profile"], etc_dir="/nonexistent",
        overrides=["node.id=footprint",
                   "data=" + json.dumps({"name": "npz", "path": spec["shard"],
                                         "normalize": "none"})]
        + ([f"compute.threads={spec['threads']}"] if spec.get("threads") is not None else []))
    threads = profiles.apply_threads(config["compute.threads"])
    data = dict(config["data"])
    ds = load_dataset(data.pop("name"), **data)
    model = build_model(config["suggested_model"], ds.input_shape, ds.num_classes)
    params = model.init(0)
    batch = config["train.batch_size"]
    cfg = kernels.train_config(lr=0.01, batch_size=batch, epochs=1, seed=0)
    kernels.local_train(model, params, ds.x_train, ds.y_train, cfg)       # warm-up epoch
    load = os.getloadavg()[0]     # other work on this machine while measuring
    times, loss = [], None
    for epoch in range(spec["epochs"]):
        cfg = kernels.train_config(lr=0.01, batch_size=batch, epochs=1, seed=epoch + 1)
        start = time.perf_counter()
        loss = kernels.local_train(model, params, ds.x_train, ds.y_train, cfg)["mean_loss"]
        times.append(time.perf_counter() - start)
    peak_mb = profiles.resident_mb(peak=True)
    import onnxruntime  # noqa: F401
    import paho.mqtt.client  # noqa: F401
    spec_model = config["suggested_model"]
    return {
        "profile": spec["profile"], "dataset": spec["dataset"],
        "model": spec_model if isinstance(spec_model, str) else
        spec_model["name"] + str(spec_model.get("hidden", "")).replace(" ", ""),
        "params": model.n_params, "samples": int(len(ds.x_train)), "batch": batch,
        "threads": config["compute.threads"], "threads_effective": threads,
        "epoch_s": statistics.median(times), "epoch_s_all": times, "loss": loss,
        "runtime_mb": runtime_mb, "data_mb": ds.x_train.nbytes / 2**20, "peak_mb": peak_mb,
        "client_peak_mb": profiles.resident_mb(peak=True),
        "budget_mb": config["compute.memory_budget_mb"],
        "load_1m": round(load, 2), "backend": kernels.backend,
        "blas": bool(getattr(kernels.impl, "have_blas", lambda: False)()),
    }


# ---------------------------------------------------------------------------------------
# the parent
# ---------------------------------------------------------------------------------------

def write_shard(name: str, samples: int, directory: str) -> str:
    import numpy as np

    from edgefl.data import load_dataset

    if name == "digits":
        ds = load_dataset("digits")
    else:
        ds = load_dataset(name, limit_train=samples, limit_test=FASHION_TEST)
    path = os.path.join(directory, f"{name}.npz")
    np.savez(path, x_train=ds.x_train, y_train=ds.y_train, x_test=ds.x_test, y_test=ds.y_test)
    return path


def run_child(spec: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                     else "")
    result = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                            capture_output=True, text=True, env=env, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{spec['profile']} / {spec['dataset']}: the measuring process "
                           f"failed:\n{result.stderr.strip()}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "memory_gb": round(mem_gb, 1),
            "machine": platform.machine(), "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def table(rows: list[dict], info: dict) -> str:
    lines = [f"machine: {info['cpu']}, {info['cpus']} CPUs, {info['memory_gb']} GB, "
             f"{info['machine']}, Python {info['python']}, backend {rows[0]['backend']}"
             f"{' + OpenBLAS' if rows[0]['blas'] else ''}; load: the 1-minute load average "
             f"when the row was measured (other work competing for the CPUs)", "",
             "| profile | dataset | model | params | samples | batch | threads | s/epoch | "
             "runtime MB | data MB | peak MB | budget MB | client peak MB | load |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        threads = str(r["threads"]) if r["threads"] == r["threads_effective"] else \
            f"{r['threads']} ({r['threads_effective']})"
        over = " (over)" if r["peak_mb"] > r["budget_mb"] else ""
        lines.append(
            f"| {r['profile']} | {r['dataset']} | {r['model']} | {r['params']:,} | "
            f"{r['samples']:,} | {r['batch']} | {threads} | {r['epoch_s']:.3f} | "
            f"{r['runtime_mb']:.0f} | {r['data_mb']:.1f} | {r['peak_mb']:.0f}{over} | "
            f"{r['budget_mb']} | {r['client_peak_mb']:.0f} | {r['load_1m']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from edgefl.service import profiles

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", default=",".join(profiles.profile_names()),
                        help="comma-separated profiles (default: all)")
    parser.add_argument("--datasets", default=",".join(DATASETS),
                        help="comma-separated: digits, fashion-mnist (default: both)")
    parser.add_argument("--samples", type=int, default=6000,
                        help="Fashion-MNIST training images in the shard (default 6000)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs (default 3)")
    parser.add_argument("--threads", type=int,
                        help="override compute.threads for every profile (to compare)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    names = [p for p in args.profiles.split(",") if p]
    for name in names:
        profiles.profile_path(name)          # ValueError listing the valid ones
    datasets = [d for d in args.datasets.split(",") if d]
    for d in datasets:
        if d not in DATASETS:
            parser.error(f"--datasets: {d!r}; valid: {', '.join(DATASETS)}")
    if args.epochs < 1 or args.samples < 1:
        parser.error("--epochs and --samples must be >= 1")
    info = machine()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgefl-footprint-") as tmp:
        for dataset in datasets:
            shard = write_shard(dataset, args.samples, tmp)
            for name in names:
                rows.append(run_child({"profile": name, "dataset": dataset, "shard": shard,
                                       "epochs": args.epochs, "threads": args.threads}))
                if not args.json:
                    print(f"  measured {name} / {dataset}", file=sys.stderr)
    if args.json:
        print(json.dumps({"machine": info, "rows": rows}, indent=1))
    else:
        print(table(rows, info))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"footprint: error: {exc}", file=sys.stderr)
        sys.exit(1)
