#!/usr/bin/env python3
"""What one message's work costs hot, and after a pause: the interpreted per-message work
of a round over a broker, called right after itself, after the thread slept or spun, and
beside the same work on the other CPU (issue 19, item 3; docs/scaling.md).

    python tools/bench_cold.py [--repeats 5] [--calls 40] [--json]

Why: a round through a broker (tools/bench_scale.py) spends most of its CPU on short pieces
of Python -- decoding a copy of the model, parsing a task, paho's packet handling -- each run
once per message, between which the thread sleeps or other processes run. In the run such a
piece costs several times what it costs in a loop (docs/scaling.md). This tool measures that
directly for two of them:

  decode a copy    wire.decode of a 31 KB client_model frame carrying a task (a tasked
                   client's copy of a softmax model for Fashion-MNIST)
  parse a task     roles.messages.parse_announcement of a tasked client's task (790 bytes)

before each call:
  nothing          called again at once: hot, as in a loop
  sleep 1 ms       the thread sleeps 1 ms (20 ms): the CPU idles or runs whatever else is
  sleep 20 ms      scheduled there
  spin 20 ms       the thread runs a loop that touches almost no memory for 20 ms
  other CPU busy   nothing, while a child process runs the same work in a loop on the
                   other CPU (two interpreters at once on two CPUs)

Each call is timed alone by its thread's CPU time, pinned to the last CPU (the load to the
first). A repeat makes `--calls` calls of every (work, before) pair, pair after pair, so a
drifting machine biases none; a row gives the median, min and max over the repeats of the
repeat's median call, and the median of the same-repeat ratio to the hot call (`times_hot`).
Linux, two CPUs or more.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))                          # a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np    # noqa: E402

from _bench import print_result    # noqa: E402

# a tasked client's task as a simulation's aggregator sends it (captured from
# tools/bench_scale.py's run, 790 bytes)
TASK = (b'{"v":1,"run":"d56e295f38ba9ce2","aggregator":"aggregator","round":1,"rounds":12,'
        b'"announce":"8f6721551af02201","opened":1796007775.3230631,"deadline":1796007895.3230631,'
        b'"strategy":{"name":"fedavg","params":{"weighting":"samples"}},"model":{"spec":{"name":'
        b'"softmax"},"input_shape":[1,28,28],"num_classes":10,"table":"70e1b24d9aec74eaedde04c0b2'
        b'aeb62dabbe89c981409c8ad8f8f2bdedbaef21"},"compression":"none","model_sha256":"7e81c4f4'
        b'ee83025709398a00d86b2b306b2b10a5ed85842c72d05058de1dbdc2","train":{"lr":0.1,"momentum"'
        b':0.0,"weight_decay":0.0,"batch_size":32,"epochs":1,"steps":0,"grad0_mode":0},"scalars"'
        b':{},"tasks":{"client-23":{"client":23,"upload":true,"source":"global","train":{"seed":'
        b'"14582928364222908850"},"scalars":{},"model_frame":"ce2d9ee4b059845e"}},"model_frame":'
        b'"d7fafc300c2dec2e"}')

WORKS = ("decode a copy", "parse a task")


def work(name: str):
    """A function doing `name` once."""
    if name == "parse a task":
        from edgefl.roles.messages import parse_announcement

        return lambda: parse_announcement(TASK)
    if name == "decode a copy":
        from edgefl.models import build_model
        from edgefl.transport import wire

        model = build_model({"name": "softmax"}, (1, 28, 28), 10)
        params = (np.random.default_rng(0).standard_normal(model.table.size) * 0.01) \
            .astype(np.float32)
        data = wire.encode("client_model", 3, "aggregator", {"params": params},
                           {"run": "d56e295f38ba9ce2", "task": TASK.decode()}, model.table,
                           recipient="client-23")
        expect = wire.Expectation(model.table, kinds="client_model")
        return lambda: wire.decode(data, expect)
    raise ValueError(f"work {name!r}; one of {WORKS}")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# what happens before each call ("other CPU busy": the load process, started per pair)
PAUSES = {"nothing": None, "sleep 1 ms": lambda: time.sleep(0.001),
          "sleep 20 ms": lambda: time.sleep(0.02), "spin 20 ms": lambda: _spin(0.02),
          "other CPU busy": None}
BEFORE = tuple(PAUSES)


def _serve_load(name: str, cpu: int) -> None:
    """The load process, on CPU `cpu`: `name` in a loop until killed."""
    os.sched_setaffinity(0, {cpu})
    fn = work(name)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        fn()


def _load(name: str, cpu: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--serve-load", name, str(cpu)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    if proc.stdout.readline().strip() != b"ready":
        proc.stdout.close()
        raise RuntimeError(f"the load process ({name!r} on CPU {cpu}) did not start "
                           f"(exit status {proc.wait()})")
    time.sleep(0.2)                                   # in its loop by now
    return proc


def _measure(repeats: int, calls: int, load_cpu: int) -> dict:
    """{(work, before): [the median call of each repeat, in us]}, from this CPU."""
    fns = {name: work(name) for name in WORKS}
    medians = {(w, b): [] for w in WORKS for b in BEFORE}
    for _ in range(repeats):
        for w in WORKS:
            for before in BEFORE:
                load = _load(w, load_cpu) if before == "other CPU busy" else None
                pause = PAUSES[before]
                try:
                    fns[w]()                          # its first call of the pair, untimed
                    ts = []
                    for _ in range(calls):
                        if pause is not None:
                            pause()
                        t0 = time.thread_time_ns()
                        fns[w]()
                        ts.append(time.thread_time_ns() - t0)
                finally:
                    if load is not None:
                        load.kill()
                        load.wait()
                        load.stdout.close()
                medians[(w, before)].append(statistics.median(ts) / 1e3)
    return medians


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40, help="calls per pair and repeat")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.calls < 1:
        parser.error("--repeats and --calls must be at least 1")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        parser.error(f"needs two CPUs (a load beside the work); this process may use {cpus}")
    work_cpu, load_cpu = cpus[-1], cpus[0]
    os.sched_setaffinity(0, {work_cpu})
    try:
        medians = _measure(args.repeats, args.calls, load_cpu)
    finally:
        os.sched_setaffinity(0, cpus)            # (a caller's process, e.g. a test's)
    rows = []
    for w in WORKS:
        hot = medians[(w, "nothing")]
        for before in BEFORE:
            us = medians[(w, before)]
            rows.append({"work": w, "before each call": before,
                         "us_median": round(statistics.median(us), 1),
                         "us_min": round(min(us), 1), "us_max": round(max(us), 1),
                         "times_hot": round(statistics.median(u / h for u, h in zip(us, hot)),
                                            2)})
    meta = {"repeats": args.repeats, "calls": args.calls, "work_cpu": work_cpu,
            "load_cpu": load_cpu, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print_result(meta, rows, f"a message's work, hot and after a pause ({args.repeats} "
                             f"interleaved repeats of {args.calls} calls; {meta['date']})",
                 args.json)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-load"]:
        _serve_load(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
