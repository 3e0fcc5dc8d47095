#!/usr/bin/env python3
"""Inference speed and int8 accuracy: exported models in onnxruntime versus edgefl's own C
forward pass, int8 quantisation of runs from the shipped configs, and `edgefl serve`.

Run from a checkout with the extension built in place (or edgefl installed):
    python tools/bench_onnx.py [--quick] [--json] [--only speed|accuracy|serve ...]

It prints a context line (date, CPU, load average, versions) and one Markdown table per
benchmark (--json: {"context": {...}, "speed": [rows], ...}). Everything measured runs on
ONE thread: OPENBLAS_NUM_THREADS=OMP_NUM_THREADS=1 before NumPy is imported, onnxruntime
intra-op threads = 1 (as edgefl.infer.Predictor(threads=1) builds its session), simulations
with workers=1, `edgefl serve` with infer.threads=1.

speed: the median wall time of one call, after one untimed warm-up; the implementations
  take turns, so a drifting machine biases none. 500 calls at batch 1 (bench "latency"),
  50 at batch 64 ("throughput"); --quick: 50 and 10. Models (28x28x1 input, 10 classes,
  seeded random weights: speed does not depend on them):
    mlp        784-200-200-10, ReLU (FedAvg's MNIST 2NN), 199,210 parameters
    cnn-mnist  FedAvg's MNIST CNN, 1,663,370 parameters
  Implementations:
    edgefl-c                  edgefl.kernels.forward on normalised float32 input (the C core;
                              edgefl-numpy under EDGEFL_BACKEND=numpy)
    onnxruntime               InferenceSession.run of the fp32 export on raw input
                              (normalisation in the graph; the probabilities output too)
    onnxruntime-int8          the same after edgefl's int8 export (export.quantize_int8, what
                              `edgefl export --quantize int8` runs: static QDQ, calibrated on
                              256 random images)
    onnxruntime-int8-dynamic  onnxruntime.quantization.quantize_dynamic (weights int8,
                              activations quantised at run time), the alternative edgefl
                              does not use
  Columns: samples_per_s = batch / median_s; vs_c = edgefl-c's median_s / this median_s
  (above 1: faster than the C core); file_bytes: size of the .onnx file.

accuracy: `edgefl simulate` of shipped configs (ACCURACY_RUNS, some with --set overrides),
  then `edgefl export` of the run as fp32 and with --quantize int8 (export_checkpoint, the
  same code): the test accuracy of each file through onnxruntime on the whole test set, the
  change, the file sizes, and the wall time of the int8 export (load, calibrate on 512
  training samples, quantise, two test-set passes).

serve: a real `edgefl serve` process (python -m edgefl.cli serve, infer.threads 1) serving
  the quickstart run's model.onnx on a Unix socket; a client in this process sends POST
  /predict with JSON bodies ({"inputs": digits test samples}, raw values) over one
  keep-alive connection (http.client) and times each request from sending to the parsed
  JSON answer: the median over 500 requests at batch 1 and 200 at batch 64 (--quick: 50,
  20), after 10 untimed ones. Compared with Predictor.predict on the same samples in this
  process (the service's own work without HTTP and JSON). The client and the service are
  two processes.
"""
from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: one thread, comparable numbers
os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import datetime
import json
import logging
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a source checkout
from _bench import markdown, time_medians  # noqa: E402  (tools/ is the script directory)

from edgefl import __version__, kernels
from edgefl.serve import UnixHTTPConnection    # noqa: E402
from edgefl.export import export_checkpoint, export_onnx, quantize_int8
from edgefl.infer import Predictor, session_options
from edgefl.models import build_model

MODELS = {"mlp": dict(name="mlp", hidden=[200, 200]), "cnn-mnist": "cnn-mnist"}
MEAN, STD = np.float32(0.1307 * 255), np.float32(0.3081 * 255)   # MNIST's statistics

# (shipped config, --set overrides): the runs of the accuracy table
ACCURACY_RUNS = [
    ("quickstart", []),
    ("quickstart", ["model={name: cnn, conv: [{out: 16, k: 3, pad: 1, pool: 2}, "
                    "{out: 32, k: 3, pad: 1, pool: 2}], fc: [64]}"]),
    ("quickstart", ["dataset.binary=even-odd", "model={name: logreg}"]),
    ("mfl", []),
    ("fedmr", []),
]


def context() -> dict:
    import onnxruntime

    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                   if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpu": cpu, "cpus": os.cpu_count(),
            "load_average": [round(v, 2) for v in os.getloadavg()],
            "edgefl": __version__, "backend": kernels.backend,
            "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


# ---------------------------------------------------------------------------------------
# speed
# ---------------------------------------------------------------------------------------

def quantize_dynamic_int8(src: str, dst: str) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(src, dst, weight_type=QuantType.QInt8)


def session_of(path: str, impl: str):
    """The session a speed row times: a Predictor's for edgefl's exports. The
    onnxruntime-int8-dynamic file is onnxruntime's quantize_dynamic output (ConvInteger,
    MatMulInteger, DynamicQuantizeLinear), ops edgefl's exporter never writes, which
    edgefl.infer refuses to load: a plain session with the Predictor's options."""
    if impl != "onnxruntime-int8-dynamic":
        return Predictor(path, threads=1, check_interval=None).session
    import onnxruntime as ort

    return ort.InferenceSession(path, session_options(1), providers=["CPUExecutionProvider"])


def bench_speed(args) -> Iterator[dict]:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in MODELS.items():
            model = build_model(spec, (1, 28, 28), 10)
            params = model.init(0)
            files = {impl: os.path.join(tmp, f"{name}.{impl}.onnx")
                     for impl in ("onnxruntime", "onnxruntime-int8", "onnxruntime-int8-dynamic")}
            export_onnx(model, params, files["onnxruntime"], norm_mean=[MEAN], norm_std=[STD])
            calibration = rng.integers(0, 256, (256, 1, 28, 28)).astype(np.float32)
            quantize_int8(files["onnxruntime"], files["onnxruntime-int8"], calibration)
            quantize_dynamic_int8(files["onnxruntime"], files["onnxruntime-int8-dynamic"])
            sessions = {impl: session_of(path, impl) for impl, path in files.items()}
            c_impl = f"edgefl-{kernels.backend}"
            for batch, bench_name in ((1, "latency"), (64, "throughput")):
                raw = rng.integers(0, 256, (batch, 1, 28, 28)).astype(np.float32)
                x = np.ascontiguousarray((raw - MEAN) / STD, dtype=np.float32)
                fns: dict[str, Callable[[], object]] = {
                    c_impl: lambda m=model, p=params, x=x: kernels.forward(m, p, x)}
                for impl, session in sessions.items():
                    fns[impl] = lambda s=session, raw=raw: s.run(None, {"input": raw})
                repeats = (50 if batch == 1 else 10) if args.quick else \
                    (500 if batch == 1 else 50)
                medians = dict(zip(fns, time_medians(list(fns.values()), repeats)))
                base = medians[c_impl]
                for impl, median in medians.items():
                    yield {"bench": bench_name, "model": name, "batch": batch, "impl": impl,
                           "median_s": float(f"{median:.4g}"),
                           "samples_per_s": round(batch / median),
                           "vs_c": round(base / median, 2),
                           "file_bytes": os.path.getsize(files[impl]) if impl in files
                           else None}


# ---------------------------------------------------------------------------------------
# accuracy of the int8 export
# ---------------------------------------------------------------------------------------

def bench_accuracy(args) -> Iterator[dict]:
    from edgefl.runconfig import load_run_config
    from edgefl.sim import simulate

    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(ACCURACY_RUNS):
            config = load_run_config(name, overrides)
            out = os.path.join(tmp, f"run{i}")
            simulate(config, out, workers=1, progress=False)
            fp32 = export_checkpoint(out, os.path.join(tmp, f"run{i}.onnx"))
            t0 = time.perf_counter()
            int8 = export_checkpoint(out, os.path.join(tmp, f"run{i}.int8.onnx"),
                                     quantize="int8")
            seconds = time.perf_counter() - t0
            assert int8["accuracy_fp32"] == fp32["accuracy_fp32"]
            command = "edgefl simulate " + " ".join(
                [name] + [f"--set '{o}'" if " " in o else f"--set {o}" for o in overrides])
            yield {"bench": "int8-accuracy", "run": command,
                   "dataset": " ".join([str(config.dataset["name"])] + [
                       f"{k}={v}" for k, v in sorted(config.dataset.items()) if k != "name"]),
                   "model": fp32["model"], "n_params": fp32["n_params"],
                   "rounds": fp32["round"], "test_samples": fp32["test_samples"],
                   "fp32": round(fp32["accuracy_fp32"], 4),
                   "int8": round(int8["accuracy_int8"], 4),
                   "change": round(int8["accuracy_int8"] - fp32["accuracy_fp32"], 4),
                   "bytes_fp32": fp32["bytes"], "bytes_int8": int8["bytes"],
                   "export_int8_s": round(seconds, 2)}


# ---------------------------------------------------------------------------------------
# edgefl serve
# ---------------------------------------------------------------------------------------

def _post(conn, body: bytes) -> dict:
    conn.request("POST", "/predict", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    doc = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"POST /predict: {response.status} {doc}")
    return doc


def bench_serve(args) -> Iterator[dict]:
    import yaml

    from edgefl.data import load_dataset
    from edgefl.export.onnx import raw_inputs
    from edgefl.runconfig import load_run_config
    from edgefl.sim import simulate

    # a short directory: a Unix socket path has at most 107 bytes
    with tempfile.TemporaryDirectory(prefix="efb-", dir="/tmp") as tmp:
        run = os.path.join(tmp, "run")
        simulate(load_run_config("quickstart"), run, workers=1, progress=False)
        model_path = os.path.join(run, "model.onnx")
        sock = os.path.join(tmp, "predict.sock")
        site = os.path.join(tmp, "infer.yaml")
        with open(site, "w", encoding="utf-8") as f:
            yaml.safe_dump({"profile": "generic-x86", "state_dir": os.path.join(tmp, "state"),
                            "log": {"level": "warning"},
                            "infer": {"model": model_path, "socket": sock, "threads": 1}}, f)
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep +
                   os.environ.get("PYTHONPATH", ""))
        for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            env.pop(var, None)
        log_path = os.path.join(tmp, "serve.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "edgefl.cli", "serve",
                                     "--config", site], env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            conn = UnixHTTPConnection(sock, timeout=30.0)
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"edgefl serve exited {proc.returncode}: "
                                       f"{Path(log_path).read_text()}")
                try:
                    conn.request("GET", "/health")
                    response = conn.getresponse()
                    response.read()
                    if response.status == 200:
                        break
                except OSError:
                    conn.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"edgefl serve: no model served after 60 s: "
                                       f"{Path(log_path).read_text()}")
                time.sleep(0.05)
            ds = load_dataset("digits")
            raw = raw_inputs(ds, ds.x_test)
            predictor = Predictor(model_path, threads=1, check_interval=None)
            model_name = f"quickstart {predictor.metadata['model_kind']}"
            for batch, repeats in ((1, 500), (64, 200)):
                if args.quick:
                    repeats //= 10
                x = raw[:batch]
                body = json.dumps({"inputs": x.tolist()}).encode()
                want = predictor.predict(x)[0].tolist()
                for _ in range(10):
                    if _post(conn, body)["classes"] != want:
                        raise RuntimeError("edgefl serve and the local Predictor disagree")
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    _post(conn, body)
                    times.append(time.perf_counter() - t0)
                served = statistics.median(times)
                local, = time_medians([lambda x=x: predictor.predict(x)], repeats)
                for impl, median in (("edgefl serve: unix socket, JSON", served),
                                     ("Predictor.predict in process", local)):
                    yield {"bench": "serve", "model": model_name, "batch": batch,
                           "impl": impl, "calls": repeats,
                           "median_s": float(f"{median:.4g}"),
                           "samples_per_s": round(batch / median),
                           "request_bytes": len(body) if impl.startswith("edgefl") else None}
            conn.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------------------------------

BENCHMARKS: list[Callable[[argparse.Namespace], Iterator[dict]]] = [
    bench_speed,
    bench_accuracy,
    bench_serve,
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--json", action="store_true",
                    help="print {context, <benchmark>: [rows]} as JSON")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only this benchmark (repeatable): "
                         + ", ".join(b.__name__.removeprefix("bench_") for b in BENCHMARKS))
    args = ap.parse_args(argv)
    chosen = [b for b in BENCHMARKS
              if not args.only or b.__name__.removeprefix("bench_") in args.only]
    if not chosen or (args.only and len(chosen) != len(set(args.only))):
        ap.error(f"--only {args.only}: valid: "
                 + ", ".join(b.__name__.removeprefix("bench_") for b in BENCHMARKS))
    logging.getLogger().setLevel(logging.ERROR)   # onnxruntime.quantization's info chatter
    doc = {"context": context()}
    for bench in chosen:
        name = bench.__name__.removeprefix("bench_")
        doc[name] = []
        for row in bench(args):
            doc[name].append(row)
            if not args.json:
                print(f"  {row}", file=sys.stderr, flush=True)
    doc["context"]["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    doc["context"]["command"] = " ".join(["python", "tools/bench_onnx.py"] + list(
        sys.argv[1:] if argv is None else argv))
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(" ".join(f"{k}={v}" for k, v in doc["context"].items()))
    for name, rows in doc.items():
        if name != "context":
            print(f"\n{name}:\n{markdown(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
