#!/usr/bin/env python3
"""Run the papers' main comparisons at this machine's scale and write docs/results.md.

    python tools/reproduce.py --quick          # 5 seeds, fewer rounds and data (~5 min, 2 idle cores)
    python tools/reproduce.py                  # the full run: 5-10 seeds, the longer settings
    python tools/reproduce.py --long           # the CNN settings, resumable (many hours)
    python tools/reproduce.py --only mfl,duw --seeds 1 --out /tmp/r   # a subset

Verdicts: every comparison pairs the arms by seed and is decided by the 95% t interval of the
paired differences (tools/verdicts.py: holds / contradicted / not resolved at this scale; a
target not reached is never given a value, a comparison with one goes to an exact sign test).

Each experiment is a file tools/experiments/NAME.yaml:

    title, paper, spec     what is reproduced: `spec` names the paper's own sections,
                           figures and tables ("the paper's §5.3 (Fig. 3)")
    headline               the claim in one line (the summary table of results.md)
    claim                  the paper's claim (quoted or paraphrased, with its § and figure)
    setup, notes           what was scaled down and why; caveats printed with the results
    base                   an `edgefl simulate` run config (its YAML vocabulary)
    settings               NAME: {label, set: {...}, arms: [...], arm_set: {ARM: {...}},
                           targets: [...]}: one comparison table each (e.g. C=0.1 / C=0.5)
    arms                   NAME: {label, set: {...}, cost}: the algorithms compared
    targets                accuracies for the rounds-to-target columns
    columns                metrics shown (see METRICS)
    checks                 the claim as testable statements about the seed means (see CHECKS)
    seeds                  seeds 0..n-1 of every (setting, arm)
    scale                  the scale in one line (the summary table's every row)
    differs                what still differs from the paper (printed with the verdict)
    quick, full, long      overrides for that tier, merged into everything above; only the
                           files with a `long:` block take part in the long tier
    A setting or a check with `tiers: [...]` exists only in those tiers.

A run's config is base, then the setting's `set`, then the arm's `set`, then the setting's
`arm_set` for that arm (mappings merge key by key), with seed = the seed index. One
extension of the vocabulary: `partition: {name: natural, owners: {label_sets: [[...], ...],
per_client: N}}` gives client k the samples whose class is in label_sets[k] (a class shared
by several clients is dealt round-robin among them, in sample order; at most per_client
samples each -- one number, or one per client -- the rest unused), for the label-set environments of FedVeca's Case 3 and DUW's
Env II, which no built-in partitioner draws. The resolved owner array goes to the `natural`
partitioner.

Runs go to OUT/EXPERIMENT/SETTING/ARM/seedK (each a normal `edgefl simulate` directory
without model.onnx and curves.png, readable by `edgefl compare`), plus OUT/EXPERIMENT/SETTING/overlay.png (seed 0 of every
arm). Runs execute in --workers processes (default: the CPU count), one training thread
each; results do not depend on the number of workers (simulate is deterministic per seed).

--resume (implied by --long) keeps every run an earlier invocation finished with the same
config (OUT/.../reproduce.json records the config's SHA-256), so an interrupted invocation
continues with the runs it had not finished; a run cut off half-way starts again from its
first round (edgefl simulate has no mid-run resume). --stop-after MINUTES ends a sitting
cleanly: no run starts after that time; --runs PATTERN,... runs only the matching runs,
in that order, and writes no report (a sitting's priorities). The long tier's run directories
(runs/reproduce-long) are committed without their model.npz: what the report needs from a
model (the global training loss, FedMR's K models' accuracies) is computed as the run ends
and kept in its reproduce.json, so a sitting on a fresh clone continues the last one's.
A run that diverges (a non-finite loss or gradient ends it) is an outcome, kept like a
finished run: the report counts it with chance accuracy, never drops it, and names it in
its arm's row.

docs/results.md keeps one section per mode (quick, full, long), each stating the command, its
wall time, CPU time and the machine; running one mode replaces only its section; a section
written before the paired statistics is marked as such. Sections between
`<!-- kept:NAME -->` and `<!-- /kept:NAME -->` lines were measured otherwise and are kept as
they are, after the generated ones. With --only the report
goes to OUT/results.md unless --results is given, so a partial run never overwrites the
committed one. --report-only rebuilds the report from the run directories of an earlier
invocation (OUT/manifest.json keeps its command and wall time).
"""
from __future__ import annotations

import argparse
import collections
import copy
import datetime
import io
import json
import math
import os
import platform
import re
import shutil
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
TOOLS = os.path.join(REPO, "tools")
if TOOLS not in sys.path:   # tools/verdicts.py
    sys.path.insert(0, TOOLS)

import numpy as np
import yaml

from edgefl.config import load_yaml  # noqa: E402 -- 1e-3 a float, as simulate reads it

EXPERIMENTS_DIR = os.path.join(REPO, "tools", "experiments")
RESULTS = os.path.join(REPO, "docs", "results.md")
MODES = ("quick", "full", "long")
MODE_TITLES = {"quick": "Quick run", "full": "Full run", "long": "Long run (over several sittings)"}
# how each tier is asked for on the command line (the full run is the default)
MODE_FLAGS = {"quick": " --quick", "full": "", "long": " --long"}
# 2: paired-by-seed intervals and the three verdicts of tools/verdicts.py (issue 21); a section
# of results.md without it was judged on seed means only and says so
STATS_VERSION = 2
OLD_STATS_NOTE = ("**Old statistics.** This section was produced before the verdicts were "
                  "paired by seed with 95% intervals (issue 21): its checks compare seed "
                  "means with strict inequalities on 2–5 seeds, and a target not reached "
                  "counted as rounds + 1. Its settings are also the older ones. Read its "
                  "verdicts as provisional; the sections with intervals supersede them.")

TOP_KEYS = {"title", "paper", "spec", "headline", "claim", "setup", "notes", "order", "base",
            "settings", "arms", "targets", "columns", "checks", "extras", "seeds", "scale",
            "differs", "quick", "full", "long"}
SETTING_KEYS = {"label", "set", "arms", "arm_set", "targets", "tiers"}
ARM_KEYS = {"label", "set", "cost"}

# metric -> (column header, True if higher is better / False if lower / None, formatter kind)
METRICS = {
    "final_accuracy": ("final acc", True, "acc"),
    "best_accuracy": ("best acc", True, "acc"),
    "final_test_loss": ("final test loss", False, "loss"),
    "final_train_loss": ("final train loss", False, "loss"),
    # F(w): the final global model's loss (with the L2 term) on the whole training set
    "global_train_loss": ("F(w) on the training set", False, "loss"),
    "rounds_to": ("rounds to target", False, "rounds"),   # one column per target
    "bytes": ("up+down bytes", False, "bytes"),
    "uplink_bytes": ("uplink bytes", False, "bytes"),
    "downlink_bytes": ("downlink bytes", False, "bytes"),
    "local_steps": ("local steps / round", None, "steps"),
    "wall_s": ("wall / run", False, "time"),
}
CHECKS = ("compare", "order", "equal", "similar", "speedup", "curve")
EXTRAS = ("duw_table", "fedmr_models", "gap_curve")


class ExperimentError(ValueError):
    """A malformed experiment file; the message names the file and the key."""


# ---------------------------------------------------------------------------------------
# experiment files
# ---------------------------------------------------------------------------------------

def merge(base, extra):
    """A deep copy of `base` with `extra` merged in, mapping by mapping (other values replace)."""
    out = copy.deepcopy(base)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass
class Experiment:
    name: str
    path: str
    mode: str
    doc: dict                     # the file with the mode's overrides merged in
    seeds: int
    settings: dict = field(default_factory=dict)
    arms: dict = field(default_factory=dict)
    tiers: frozenset = frozenset()   # the mode blocks the file has (quick, full, long)

    @property
    def order(self):
        return (self.doc.get("order", 100), self.name)

    def arms_of(self, setting: str) -> list:
        listed = self.settings[setting].get("arms")
        return list(listed) if listed else list(self.arms)

    def targets_of(self, setting: str) -> list:
        return [float(t) for t in self.settings[setting].get("targets",
                                                             self.doc.get("targets", []))]

    def config(self, setting: str, arm: str, seed: int) -> dict:
        s = self.settings[setting]
        config = merge(self.doc["base"], s.get("set"))
        config = merge(config, self.arms[arm].get("set"))
        config = merge(config, (s.get("arm_set") or {}).get(arm))
        config["seed"] = int(seed)
        return config


def load_experiment(path: str, mode: str, seeds: int | None = None) -> Experiment:
    name = os.path.splitext(os.path.basename(path))[0]
    try:
        with open(path, encoding="utf-8") as f:
            raw = load_yaml(f)
    except yaml.YAMLError as exc:
        raise ExperimentError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ExperimentError(f"{path}: the top level must be a mapping")
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise ExperimentError(f"{path}: unknown key(s) {unknown}; valid: {sorted(TOP_KEYS)}")
    for key in ("title", "spec", "headline", "claim", "base", "settings", "arms", "checks"):
        if key not in raw:
            raise ExperimentError(f"{path}: missing key {key!r}")
    doc = merge({k: v for k, v in raw.items() if k not in MODES}, raw.get(mode))
    n_seeds = int(seeds if seeds is not None else doc.get("seeds", 3))
    if n_seeds < 1:
        raise ExperimentError(f"{path}: seeds = {n_seeds} must be >= 1")
    for what, entries in (("settings", list((doc["settings"] or {}).values())),
                          ("checks", doc["checks"])):
        for entry in entries:
            tiers = entry.get("tiers") if isinstance(entry, dict) else None
            if tiers is not None and (not isinstance(tiers, list) or set(tiers) - set(MODES)):
                raise ExperimentError(f"{path}: {what}: tiers {tiers!r}; a list of "
                                      f"{', '.join(MODES)}")
    # a setting or a check with `tiers: [...]` exists only in those tiers (e.g. the CNN
    # settings only in the long tier)
    doc["settings"] = {k: v for k, v in doc["settings"].items()
                       if mode in (v or {}).get("tiers", MODES)}
    doc["checks"] = [c for c in doc["checks"] if mode in c.get("tiers", MODES)]
    exp = Experiment(name, path, mode, doc, n_seeds, dict(doc["settings"]), dict(doc["arms"]),
                     frozenset(m for m in MODES if m in raw))
    for sname, setting in exp.settings.items():
        if not isinstance(setting, dict):
            raise ExperimentError(f"{path}: settings.{sname}: must be a mapping with keys "
                                  f"{sorted(SETTING_KEYS)}")
        bad = sorted(set(setting) - SETTING_KEYS)
        if bad:
            raise ExperimentError(f"{path}: settings.{sname}: unknown key(s) {bad}; valid: "
                                  f"{sorted(SETTING_KEYS)}")
        for arm in list(setting.get("arms") or []) + list(setting.get("arm_set") or {}):
            if arm not in exp.arms:
                raise ExperimentError(f"{path}: settings.{sname}: unknown arm {arm!r}; "
                                      f"arms: {', '.join(exp.arms)}")
    for aname, arm in exp.arms.items():
        if not isinstance(arm, dict):
            raise ExperimentError(f"{path}: arms.{aname}: must be a mapping with keys "
                                  f"{sorted(ARM_KEYS)}")
        bad = sorted(set(arm) - ARM_KEYS)
        if bad:
            raise ExperimentError(f"{path}: arms.{aname}: unknown key(s) {bad}; valid: "
                                  f"{sorted(ARM_KEYS)}")
    for column in doc.get("columns", []):
        if column not in METRICS:
            raise ExperimentError(f"{path}: columns: unknown metric {column!r}; valid: "
                                  f"{', '.join(METRICS)}")
    for i, check in enumerate(doc["checks"]):
        _validate_check(exp, check, f"{path}: checks[{i}]")
    for i, extra in enumerate(doc.get("extras", [])):
        if not isinstance(extra, dict) or extra.get("kind") not in EXTRAS:
            raise ExperimentError(f"{path}: extras[{i}]: kind must be one of {', '.join(EXTRAS)}")
        for arm in _as_list(extra.get("arms")) + _as_list(extra.get("baseline")):
            if arm not in exp.arms:
                raise ExperimentError(f"{path}: extras[{i}]: unknown arm {arm!r}")
        if extra["kind"] == "gap_curve" and not extra.get("baseline"):
            raise ExperimentError(f"{path}: extras[{i}]: gap_curve needs a baseline arm")
    return exp


def _validate_check(exp: Experiment, check: dict, where: str) -> None:
    kind = check.get("kind")
    if kind not in CHECKS:
        raise ExperimentError(f"{where}: kind {kind!r}; valid: {', '.join(CHECKS)}")
    if "claim" not in check:
        raise ExperimentError(f"{where}: needs a 'claim' (the statement being tested)")
    if check.get("role", "claim") not in ("claim", "extra"):
        raise ExperimentError(f"{where}: role {check['role']!r}; valid: claim, extra")
    metric = check.get("metric", "test_accuracy" if kind == "curve" else None)
    if kind != "curve" and metric not in METRICS:
        raise ExperimentError(f"{where}: metric {metric!r}; valid: {', '.join(METRICS)}")
    arms = []
    for key in ("better", "than", "arms", "arm", "baseline"):
        value = check.get(key)
        arms += value if isinstance(value, list) else ([value] if value else [])
    for arm in arms:
        if arm not in exp.arms:
            raise ExperimentError(f"{where}: unknown arm {arm!r}; arms: {', '.join(exp.arms)}")
    for key in ("settings", "larger_in", "than_in"):
        value = check.get(key)
        for s in (value if isinstance(value, list) else ([value] if value else [])):
            if s not in exp.settings:
                raise ExperimentError(f"{where}: unknown setting {s!r}; settings: "
                                      f"{', '.join(exp.settings)}")
    reasons = check.get("if_not")
    if reasons is not None and not isinstance(reasons, str) and not (
            isinstance(reasons, dict) and reasons and set(reasons) <= set(REASON_KEYS)
            and all(isinstance(v, str) for v in reasons.values())):
        raise ExperimentError(f"{where}: if_not must be a text (shown when the claim is "
                              f"contradicted or not resolved) or a mapping with keys "
                              f"{', '.join(REASON_KEYS)} to texts")


def discover(only: list | None) -> list:
    paths = sorted(os.path.join(EXPERIMENTS_DIR, f) for f in os.listdir(EXPERIMENTS_DIR)
                   if f.endswith(".yaml"))
    names = {os.path.splitext(os.path.basename(p))[0]: p for p in paths}
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ExperimentError(f"--only: unknown experiment(s) {unknown}; available: "
                                  f"{', '.join(names)}")
        return [names[n] for n in only]
    return list(names.values())


# ---------------------------------------------------------------------------------------
# label-set owners (partition natural)
# ---------------------------------------------------------------------------------------

_LABEL_CACHE: dict = {}


def owners_from_label_sets(labels: np.ndarray, n_clients: int, label_sets, per_client=None):
    """Owner id per training sample (-1 = unused): client k holds the classes in
    label_sets[k]; a class held by several clients is dealt round-robin among them in
    sample order; each client keeps its first per_client samples (one number, or a list of
    one per client)."""
    if len(label_sets) != n_clients:
        raise ExperimentError(f"owners.label_sets has {len(label_sets)} entries for "
                              f"{n_clients} clients")
    owners = np.full(len(labels), -1, dtype=np.int64)
    for cls in np.unique(labels):
        holders = [k for k, s in enumerate(label_sets) if int(cls) in [int(c) for c in s]]
        if holders:
            idx = np.flatnonzero(labels == cls)
            owners[idx] = np.asarray(holders)[np.arange(len(idx)) % len(holders)]
    if per_client is not None:
        caps = list(per_client) if isinstance(per_client, (list, tuple)) \
            else [per_client] * n_clients
        if len(caps) != n_clients:
            raise ExperimentError(f"owners.per_client has {len(caps)} entries for "
                                  f"{n_clients} clients")
        for k in range(n_clients):
            idx = np.flatnonzero(owners == k)
            owners[idx[int(caps[k]):]] = -1
    empty = [k for k in range(n_clients) if not np.any(owners == k)]
    if empty:
        raise ExperimentError(f"owners.label_sets: client(s) {empty} get no samples")
    return owners


def resolve_owners(config: dict) -> dict:
    """Replace partition.owners = {label_sets, per_client} by the owner array."""
    partition = config.get("partition") or {}
    spec = partition.get("owners")
    if not isinstance(spec, dict):
        return config
    bad = sorted(set(spec) - {"label_sets", "per_client"})
    if bad or "label_sets" not in spec:
        raise ExperimentError(f"partition.owners: needs label_sets (and optionally "
                              f"per_client); unknown {bad}")
    from edgefl.data import load_dataset
    dataset = dict(config.get("dataset") or {"name": "digits"})
    key = json.dumps(dataset, sort_keys=True)
    if key not in _LABEL_CACHE:
        ds = load_dataset(dataset.pop("name"), **dataset)
        _LABEL_CACHE[key] = ds.y_train_original if ds.y_train_original is not None \
            else ds.y_train
    owners = owners_from_label_sets(_LABEL_CACHE[key], int(partition["clients"]),
                                    spec["label_sets"], spec.get("per_client"))
    config = copy.deepcopy(config)
    config["partition"]["owners"] = owners.tolist()
    return config


# ---------------------------------------------------------------------------------------
# jobs
# ---------------------------------------------------------------------------------------

@dataclass
class Job:
    experiment: str
    setting: str
    arm: str
    seed: int
    out: str
    config: dict          # as written in the experiment (owners unresolved)
    resolved: dict        # what runs: owners resolved to the owner array
    cost: float = 1.0
    # metrics the report needs from the run's model.npz, computed by the worker as the run
    # ends and kept in reproduce.json, so a report needs no model file (the long tier's run
    # directories are committed without them)
    derive: tuple = ()

    @property
    def key(self) -> str:
        return f"{self.experiment}/{self.setting}/{self.arm}/seed{self.seed}"


def make_jobs(experiments: list, out_root: str) -> list:
    from edgefl.runconfig import run_config_from_mapping
    jobs = []
    for exp in experiments:
        for setting in exp.settings:
            for arm in exp.arms_of(setting):
                for seed in range(exp.seeds):
                    config = exp.config(setting, arm, seed)
                    where = f"{exp.path}: setting {setting}, arm {arm}"
                    try:   # validate every config before anything runs
                        resolved = resolve_owners(config)
                        run_config_from_mapping(resolved, where)
                    except ValueError as exc:
                        raise ExperimentError(str(exc)) from None
                    jobs.append(Job(exp.name, setting, arm, seed,
                                    os.path.join(out_root, exp.name, setting, arm, f"seed{seed}"),
                                    config, resolved, float(exp.arms[arm].get("cost", 1.0)),
                                    derived_metrics(exp, arm)))
    return jobs


def derived_metrics(exp, arm: str) -> tuple:
    """The DERIVED metrics a run of `arm` needs: the global training loss where the
    experiment shows it, the K models' accuracies where a fedmr_models extra names the arm."""
    wanted = ["global_train_loss"] if "global_train_loss" in exp.doc.get("columns", []) else []
    if any(extra.get("kind") == "fedmr_models" and arm in _as_list(extra.get("arms"))
           for extra in exp.doc.get("extras", [])):
        wanted.append("fedmr_models")
    return tuple(wanted)


def select_runs(jobs: list, patterns: str) -> list:
    """The jobs whose key matches one of the comma-separated fnmatch `patterns`, in the
    patterns' order (a sitting's priorities); ExperimentError naming a pattern that matches
    nothing, so a typo does not run nothing silently."""
    import fnmatch
    chosen, seen = [], set()
    for pattern in [p.strip() for p in patterns.split(",") if p.strip()]:
        matched = [j for j in jobs if fnmatch.fnmatchcase(j.key, pattern)]
        if not matched:
            raise ExperimentError(f"--runs: {pattern!r} matches no run of this tier (keys "
                                  f"look like {jobs[0].key if jobs else 'EXPERIMENT/SETTING/ARM/seedN'})")
        chosen += [j for j in matched if j.key not in seen]
        seen.update(j.key for j in matched)
    return chosen


def config_digest(config: dict) -> str:
    import hashlib
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def finished_run(job: dict) -> dict | None:
    """The status of a run already finished in job["out"] with the same config (what
    --resume keeps), else None. A run that diverged is finished too: its outcome is kept."""
    done = kept_record(job["out"])
    if not done or done.get("config_sha256") != config_digest(job["config"]):
        return None
    if done.get("diverged"):
        return {"key": job["key"], "ok": True, "elapsed_s": done["elapsed_s"], "resumed": True,
                "cpu": done.get("cpu"), "final_accuracy": None, "diverged": done["diverged"]}
    try:
        with open(os.path.join(job["out"], "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    if summary.get("stopped"):
        return None
    if any(what not in done.get("derived", {}) for what in job.get("derive", ())):
        return None   # finished before its derived metrics were kept: run it again
    return {"key": job["key"], "ok": True, "elapsed_s": done["elapsed_s"], "resumed": True,
            "cpu": done.get("cpu"), "final_accuracy": summary["final_accuracy"]}


def divergence_record(job: dict, exc: Exception) -> dict:
    """reproduce.json's `diverged` for a run that met a non-finite loss or gradient: the
    round it happened in (the first not recorded in metrics.jsonl), the error, and the
    chance accuracy 1/C that the report counts from that round on."""
    from edgefl.config import dataset_from_config
    from edgefl.runconfig import run_config_from_mapping
    rounds_done = 0
    try:
        with open(os.path.join(job["out"], "metrics.jsonl"), encoding="utf-8") as f:
            rounds_done = sum(1 for line in f if line.strip())
    except OSError:
        pass
    dataset = dataset_from_config(run_config_from_mapping(job["config"]).as_config())
    return {"round": rounds_done + 1, "error": str(exc).strip().splitlines()[-1],
            "chance": 1.0 / dataset.num_classes}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows of it. A run's last
    float32 bits depend on the BLAS kernels the CPU gets, so each run records it."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def keep_record(job: dict, elapsed: float, derived: dict, **extra) -> dict:
    """Write run job["out"]'s reproduce.json as it ends (kept_record reads it back); returns
    what it wrote."""
    record = {"key": job["key"], "elapsed_s": elapsed,
              "config_sha256": config_digest(job["config"]), "derived": derived,
              "cpu": cpu_model(), **extra}
    # (simulate makes its directory with the first round, or when the run stops or
    # diverges; a job that failed before that still gets its record)
    os.makedirs(job["out"], exist_ok=True)
    with open(os.path.join(job["out"], "reproduce.json"), "w", encoding="utf-8") as f:
        json.dump(record, f)
    return record


def execute(job: dict) -> dict:
    """Run one job (in a worker process): simulate into job["out"], return a status. With
    job["resume"], a run finished earlier with the same config is kept, not repeated."""
    from edgefl.errors import NonFiniteError
    started = time.perf_counter()
    if job.get("resume"):
        done = finished_run(job)
        if done is not None:
            return done
    try:
        from edgefl.runconfig import run_config_from_mapping
        from edgefl.sim import simulate
        config = run_config_from_mapping(job["config"])
        if os.path.isdir(job["out"]):
            shutil.rmtree(job["out"])          # no stale files from an earlier invocation
        # no model.onnx and no curves.png per run: the report reads metrics.jsonl,
        # summary.json and model.npz, and draws one overlay per setting; the export and the
        # plot cost ~0.3 s a run, a tenth of the quick tier
        summary = simulate(config, job["out"], workers=job["threads"], progress=False,
                           stream=io.StringIO(), onnx=False, plot=False)
        derived = {what: DERIVED[what](job["out"]) for what in job.get("derive", ())}
        elapsed = time.perf_counter() - started
        kept = keep_record(job, elapsed, derived)
        return {"key": job["key"], "ok": True, "elapsed_s": elapsed, "cpu": kept["cpu"],
                "final_accuracy": summary["final_accuracy"]}
    except NonFiniteError as exc:
        # an outcome of the algorithm, not a failure of the tool: kept (and committed with
        # the long tier's runs) so that a sitting does not repeat it, and reported as such
        elapsed = time.perf_counter() - started
        diverged = divergence_record(job, exc)
        kept = keep_record(job, elapsed, {}, diverged=diverged)
        return {"key": job["key"], "ok": True, "elapsed_s": elapsed, "cpu": kept["cpu"],
                "final_accuracy": None, "diverged": diverged}
    except Exception:   # noqa: BLE001 -- any failure is reported per run; the others go on
        return {"key": job["key"], "ok": False, "elapsed_s": time.perf_counter() - started,
                "error": traceback.format_exc(limit=4)}


def run_jobs(jobs: list, workers: int, log, resume: bool = False,
             stop_at: float | None = None, in_order: bool = False) -> dict:
    """{job key: status}; heavier jobs start first so the pool ends evenly (in_order: in
    the order given). resume: runs finished by an earlier invocation (same config) are
    kept. stop_at (a perf_counter time): no run starts after it; the runs not started have
    no status."""
    order = list(jobs) if in_order else sorted(jobs, key=lambda j: -j.cost)
    payloads = [{"key": j.key, "out": j.out, "config": j.resolved, "resume": resume,
                 "derive": j.derive,
                 "threads": 1 if workers > 1 else (os.cpu_count() or 1)} for j in order]
    results = {}
    started = time.perf_counter()

    def report(status):
        results[status["key"]] = status
        done = len(results)
        if not status["ok"]:
            what = "FAILED: " + status["error"].strip().splitlines()[-1]
        else:
            what = (f"diverged in round {status['diverged']['round']}" if status.get("diverged")
                    else f"final acc {status['final_accuracy']:.4f}")
            what += " (kept from an earlier invocation)" if status.get("resumed") else ""
        log(f"[{done:>{len(str(len(jobs)))}}/{len(jobs)}] {status['key']}: {what}, "
            f"{status['elapsed_s']:.1f} s (elapsed {time.perf_counter() - started:.0f} s)")

    def stopping() -> bool:
        return stop_at is not None and time.perf_counter() >= stop_at

    if workers <= 1:
        for payload in payloads:
            if stopping():
                break
            report(execute(payload))
        return results
    import multiprocessing
    # at most `workers` runs handed out at a time, so that none starts after stop_at (a
    # pool's own queue would have started the next ones already)
    queued, running = iter(payloads), set()
    with ProcessPoolExecutor(max_workers=workers,
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        while True:
            while len(running) < workers and not stopping():
                payload = next(queued, None)
                if payload is None:
                    break
                running.add(pool.submit(execute, payload))
            if not running:
                return results
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                report(future.result())


# ---------------------------------------------------------------------------------------
# metrics of finished runs
# ---------------------------------------------------------------------------------------

def local_steps_per_round(run, config: dict) -> float | None:
    """Mean local SGD steps per round summed over the clients that trained: FedVeca logs its
    per-client tau; otherwise from the partition sizes and the train section."""
    if "tau" in run.history[0]:
        return float(np.mean([sum(h["tau"].values()) for h in run.history]))
    from edgefl.config import dataset_from_config, partition_from_config
    from edgefl.runconfig import run_config_from_mapping
    rc = run_config_from_mapping(config)
    key = ("sizes", json.dumps(config.get("dataset"), sort_keys=True),
           json.dumps(config.get("partition"), sort_keys=True), rc.seed)
    if key not in _LABEL_CACHE:
        cfg = rc.as_config()
        split = partition_from_config(cfg, dataset_from_config(cfg))
        _LABEL_CACHE[key] = [len(ix) for ix in split.indices]
    sizes = _LABEL_CACHE[key]
    train = rc.train

    def steps(n):
        if train.steps:
            return train.steps
        batch = train.batch_size or n
        return train.epochs * math.ceil(n / batch)
    return float(np.mean([sum(steps(sizes[c]) for c in h["selected"]) for h in run.history]))


def global_train_loss(out: str) -> float:
    """F(w) of a finished run: its final model's mean loss (with the L2 term) over the
    training samples its clients held (the union of the partition), computed by the kernels
    from model.npz -- not the clients' minibatch losses."""
    from edgefl import kernels
    from edgefl.checkpoint import load_checkpoint
    from edgefl.config import dataset_from_config, partition_from_config
    from edgefl.models import build_model
    from edgefl.runconfig import run_config_from_mapping
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        config = json.load(f)["config"]
    cfg = run_config_from_mapping(config).as_config()
    key = ("train", json.dumps(config["dataset"], sort_keys=True),
           json.dumps(config.get("partition"), sort_keys=True), config.get("seed"))
    if key not in _TEST_CACHE:
        ds = dataset_from_config(cfg)
        held = np.unique(np.concatenate([np.asarray(ix) for ix in
                                         partition_from_config(cfg, ds).indices]))
        _TEST_CACHE[key] = (ds, held)
    ds, held = _TEST_CACHE[key]
    ck = load_checkpoint(os.path.join(out, "model.npz"))
    model = build_model(ck["model_spec"], ds.input_shape, ds.num_classes)
    x = np.ascontiguousarray(ds.x_train[held])
    y = np.ascontiguousarray(ds.y_train[held])
    return float(kernels.evaluate(model, ck["params"], x, y)["loss"])


def run_metrics(job: Job, targets: list, columns: list) -> dict:
    from edgefl.compare import load_run
    done = kept_record(job.out)
    if done.get("diverged"):
        return diverged_metrics(job, done, targets)
    run = load_run(job.out)
    s, last = run.summary, run.history[-1]
    elapsed, derived = done.get("elapsed_s", s.get("wall_s")), done.get("derived", {})
    metrics = {
        "final_accuracy": s["final_accuracy"], "best_accuracy": s["best_accuracy"],
        "final_test_loss": s["final_loss"], "final_train_loss": last.get("train_loss"),
        "bytes": run.bytes_moved, "uplink_bytes": s["uplink_bytes"],
        "downlink_bytes": s["downlink_bytes"], "wall_s": elapsed, "rounds": s["rounds"],
        "curve": {h["round"]: h["test_accuracy"] for h in run.history
                  if h["test_accuracy"] is not None},
        # FedMR with evaluate_models: the test accuracy of each of its K models by round
        "members": {h["round"]: h["member_accuracy"] for h in run.history
                    if h.get("member_accuracy")},
        "out": job.out, "seed": job.seed,
    }
    for what in job.derive:   # kept by the worker; runs from before that read model.npz
        metrics[what] = derived[what] if what in derived else DERIVED[what](job.out)
    for t in targets:
        metrics[f"rounds_to:{t:g}"] = run.rounds_to(t)
    if "local_steps" in columns:
        metrics["local_steps"] = local_steps_per_round(run, job.resolved)
    return metrics


@dataclass
class Stat:
    values: list            # per seed; None = not available (rounds: not reached)

    @property
    def known(self):
        return [v for v in self.values if v is not None]

    @property
    def mean(self):
        """Mean over the seeds that have a value (a target not reached has none)."""
        return float(np.mean(self.known)) if self.known else None

    @property
    def std(self):
        return float(np.std(self.known, ddof=1)) if len(self.known) > 1 else 0.0


def stat_of(runs: list, metric: str) -> Stat:
    return Stat([r.get(metric) for r in runs])


def fmt_stat(stat: Stat, kind: str) -> str:
    from edgefl.compare import format_bytes, format_duration
    known, n = stat.known, len(stat.values)
    if kind == "rounds":
        if not known:
            return f"not reached (0/{n})"
        mean = float(np.mean(known))
        std = float(np.std(known, ddof=1)) if len(known) > 1 else 0.0
        text = f"{mean:.1f} ± {std:.1f}" if len(known) > 1 else f"{known[0]}"
        return text if len(known) == n else f"{text} (reached in {len(known)}/{n})"
    if not known:
        return "–"
    mean = float(np.mean(known))
    std = float(np.std(known, ddof=1)) if len(known) > 1 else 0.0
    if kind == "acc":
        return f"{mean:.4f} ± {std:.4f}" if n > 1 else f"{mean:.4f}"
    if kind == "loss":
        return f"{mean:.4f} ± {std:.4f}" if n > 1 else f"{mean:.4f}"
    if kind == "bytes":
        return format_bytes(mean)
    if kind == "steps":
        return f"{mean:.1f}"
    if kind == "time":
        return format_duration(mean)
    return f"{mean:g}"


def kept_record(out: str) -> dict:
    """The reproduce.json a worker wrote as run `out` ended (elapsed_s, config_sha256,
    derived, and diverged for a run that diverged); {} when there is none."""
    try:
        with open(os.path.join(out, "reproduce.json"), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def diverged_metrics(job: Job, done: dict, targets: list) -> dict:
    """The metrics of a run that diverged in round `done["diverged"]["round"]` (`done`: its
    kept_record). It is counted, not dropped (dropping it would flatter the algorithm that
    diverged): its final accuracy is chance, 1/C (a model carrying non-finite parameters on
    predicts nothing); its best accuracy and any target reached are those of the rounds
    before; a target not reached then is never reached; losses, bytes and derived metrics
    are None."""
    from edgefl.compare import RunDirError, read_history, rounds_to_target
    diverged, elapsed = done["diverged"], done["elapsed_s"]
    try:
        history = read_history(job.out)
    except RunDirError:   # diverged in round 1: nothing recorded
        history = []
    curve = {h["round"]: h["test_accuracy"] for h in history if h.get("test_accuracy") is not None}
    metrics = {
        "final_accuracy": diverged["chance"],
        "best_accuracy": max([diverged["chance"], *curve.values()]),
        "final_test_loss": None, "final_train_loss": None, "bytes": None,
        "uplink_bytes": None, "downlink_bytes": None, "wall_s": elapsed,
        "rounds": diverged["round"] - 1, "curve": curve,
        "members": {h["round"]: h["member_accuracy"] for h in history
                    if h.get("member_accuracy")},
        "out": job.out, "seed": job.seed, "diverged": diverged["round"], "local_steps": None,
    }
    for what in job.derive:
        metrics[what] = None
    for t in targets:
        metrics[f"rounds_to:{t:g}"] = rounds_to_target(history, t)
    return metrics


def divergence_note(runs: list) -> str:
    """" (diverged in k of n seeds, rounds a-b)" for an arm's runs, "" when none did."""
    rounds = sorted(r["diverged"] for r in runs if r.get("diverged"))
    if not rounds:
        return ""
    where = f"round {rounds[0]}" if len(rounds) == 1 else f"rounds {rounds[0]}–{rounds[-1]}"
    return f" — diverged in {len(rounds)} of {len(runs)} seeds ({where})"


# ---------------------------------------------------------------------------------------
# checks: every comparison paired by seed, decided by tools/verdicts.py
# ---------------------------------------------------------------------------------------

def _as_list(value):
    return value if isinstance(value, list) else ([] if value is None else [value])


def _metric_keys(check: dict, exp: Experiment, setting: str) -> list:
    metric = check.get("metric")
    if metric == "rounds_to":
        targets = check.get("targets", "all")
        targets = exp.targets_of(setting) if targets == "all" else _as_list(targets)
        return [f"rounds_to:{float(t):g}" for t in targets]
    return [metric]


def _label(key: str) -> str:
    if key.startswith("rounds_to:"):
        return f"rounds to ≥{key.split(':')[1]}"
    return METRICS[key][0]


def _higher_better(key: str) -> bool:
    return METRICS["rounds_to" if key.startswith("rounds_to:") else key][1]


def _num(stat: Stat, key: str) -> str:
    n = len(stat.values)
    if stat.mean is None:
        return f"not reached (0/{n})" if key.startswith("rounds_to:") else "n/a"
    if key.startswith("rounds_to:"):
        text = f"{stat.mean:.1f}"
        return text if len(stat.known) == n else f"{text} (reached in {len(stat.known)}/{n})"
    kind = METRICS[key][2]
    if kind == "bytes":
        from edgefl.compare import format_bytes
        return format_bytes(stat.mean)
    return f"{stat.mean:.4f}"


def _fmt(key: str) -> str:
    """Format of a gain's interval for this metric."""
    if key.startswith("rounds_to:"):
        return "+.1f"
    return "+.3g"


def aligned(*arm_runs, key=None) -> tuple:
    """(seeds, [values per arm]) over the seeds every arm has (pairing by seed); with key
    None the runs themselves."""
    by_seed = [{r["seed"]: r for r in runs} for runs in arm_runs]
    seeds = sorted(set.intersection(*(set(b) for b in by_seed))) if by_seed else []
    return seeds, [[(b[s] if key is None else b[s].get(key)) for s in seeds] for b in by_seed]


def evaluate_check(check: dict, exp: Experiment, table: dict) -> tuple:
    """(verdict, lines): verdict is one of tools/verdicts.py's three words, or None when
    runs are missing; `table[setting][arm]` is the list of per-seed metric dicts."""
    import verdicts as V
    kind = check["kind"]
    settings = _as_list(check.get("settings")) or list(exp.settings)
    lines, results = [], []

    def runs_of(setting, arm):
        return table.get(setting, {}).get(arm) or []

    if kind == "speedup":
        s1, s2 = check["larger_in"], check["than_in"]
        for key in _metric_keys(check, exp, s1):
            groups = [runs_of(s1, check["baseline"]), runs_of(s1, check["arm"]),
                      runs_of(s2, check["baseline"]), runs_of(s2, check["arm"])]
            if not all(groups):
                return None, ["runs missing"]
            seeds, (b1, a1, b2, a2) = aligned(*groups, key=key)
            if not seeds:
                return None, ["no seed common to all four groups of runs"]
            v = V.ratio_difference(b1, a1, b2, a2)
            results.append(v)
            lines.append(f"{_label(key)}: speed-up {check['baseline']}/{check['arm']} in {s1} "
                         f"minus that in {s2}, per seed: {V.describe(v, '+.2f')}")
        return V.combine(results), lines

    for setting in settings:
        if kind == "curve":
            for a in _as_list(check["better"]):
                for b in _as_list(check["than"]):
                    ra, rb = runs_of(setting, a), runs_of(setting, b)
                    if not ra or not rb:
                        return None, ["runs missing"]
                    seeds, (ca, cb) = aligned(ra, rb, key="curve")
                    # a run that diverged has no points after it: the rounds all evaluated
                    rounds = sorted(set.intersection(*(set(c) for c in ca + cb)))
                    per_round = [V.paired([c[t] for c in ca], [c[t] for c in cb], True)
                                 for t in rounds]
                    words = [v.verdict for v in per_round]
                    results += per_round
                    worst = min(per_round, key=lambda v: v.interval.lo)
                    lines.append(
                        f"{setting}: {a} vs {b}, test accuracy paired by seed (n = "
                        f"{len(seeds)}) in each of {len(rounds)} evaluated rounds: ahead "
                        f"(interval above 0) in {words.count(V.HOLDS)}, behind in "
                        f"{words.count(V.CONTRADICTED)}, not resolved in "
                        f"{words.count(V.UNRESOLVED)}; the weakest round's gain "
                        f"{worst.interval.text('+.3g')} — {V.combine(per_round)}")
            continue
        for key in _metric_keys(check, exp, setting):
            if kind == "compare":
                margin = float(check.get("margin", 0.0))
                for a in _as_list(check["better"]):
                    for b in _as_list(check["than"]):
                        ra, rb = runs_of(setting, a), runs_of(setting, b)
                        if not ra or not rb:
                            return None, ["runs missing"]
                        seeds, (va, vb) = aligned(ra, rb, key=key)
                        v = V.paired(va, vb, _higher_better(key), margin,
                                     horizons=aligned(ra, rb, key="rounds")[1])
                        results.append(v)
                        sa, sb = Stat(va), Stat(vb)
                        extra = ""
                        if key.startswith("rounds_to:") and len(sa.known) == len(sa.values) \
                                and len(sb.known) == len(sb.values):
                            extra = f" ({sb.mean / sa.mean:.2f}× as many rounds for {b})"
                        lines.append(f"{setting}, {_label(key)}: {a} {_num(sa, key)} vs {b} "
                                     f"{_num(sb, key)}{extra}; {V.describe(v, _fmt(key))}")
            elif kind in ("order", "equal", "similar"):
                arms = _as_list(check["arms"])
                groups = [runs_of(setting, a) for a in arms]
                if not all(groups):
                    return None, ["runs missing"]
                seeds, values = aligned(*groups, key=key)
                horizons = aligned(*groups, key="rounds")[1]
                summary = ", ".join(f"{a} {_num(Stat(v), key)}" for a, v in zip(arms, values))
                if kind == "order":
                    decreasing = check.get("direction", "decreasing") == "decreasing"
                    word = "decreasing" if decreasing else "increasing"
                    steps = [V.paired(values[i + 1], values[i], not decreasing,
                                      horizons=(horizons[i + 1], horizons[i]))
                             for i in range(len(arms) - 1)]
                    results += steps
                    lines.append(f"{setting}, {_label(key)} {word} along {summary}:")
                    lines += [f"  {arms[i + 1]} vs {arms[i]}: {V.describe(v, _fmt(key))}"
                              for i, v in enumerate(steps)]
                elif kind == "equal":
                    pairs = [V.exactly_equal(values[0], values[i]) for i in range(1, len(arms))]
                    results += pairs
                    lines.append(f"{setting}, {_label(key)} equal: {summary}; "
                                 + "; ".join(f"{arms[0]} vs {arms[i + 1]}: {V.describe(v)}"
                                             for i, v in enumerate(pairs)))
                else:
                    tol = float(check["tolerance"])
                    pairs = [(i, j, V.equivalent(values[i], values[j], tol))
                             for i in range(len(arms)) for j in range(i + 1, len(arms))]
                    results += [v for _, _, v in pairs]
                    lines.append(f"{setting}, {_label(key)} within ±{tol:g} of each other "
                                 f"({summary}):")
                    lines += [f"  {arms[i]} − {arms[j]}: {V.describe(v, _fmt(key))}"
                              for i, j, v in pairs]
    return (V.combine(results) if results else None), lines


# ---------------------------------------------------------------------------------------
# extras: what the algorithms learned, read back from the run directories
# ---------------------------------------------------------------------------------------

def duw_table_lines(runs: list) -> list:
    """DUW's learned weight table (duw_weights.json), mean over seeds: first and last round
    and the time average theta_k of the paper's Theorem 1 (§4.5)."""
    tables, sizes = [], None
    for r in runs:
        with open(os.path.join(r["out"], "duw_weights.json"), encoding="utf-8") as f:
            doc = json.load(f)
        table = doc["table"]
        tables.append(np.asarray(json.loads(table) if isinstance(table, str) else table))
        sizes = doc.get("num_samples")
    mean = np.mean(tables, axis=0)
    k = mean.shape[1]
    fedavg = ", ".join(f"{n / sum(sizes):.2f}" for n in sizes) if sizes else "N_k/N"
    lines = [("Learned aggregation weights Θ_k^(t), mean over seeds (FedAvg's N_k/N: "
             f"{fedavg}):"), "",
             "| round | " + " | ".join(f"client {c}" for c in range(k)) + " |",
             "|---|" + "|".join("--:" for _ in range(k)) + "|"]
    for label, row in (("1", mean[0]), (str(len(mean)), mean[-1]), ("mean over rounds",
                                                                    mean.mean(axis=0))):
        lines.append(f"| {label} | " + " | ".join(f"{w:.3f}" for w in row) + " |")
    return lines + [""]


_TEST_CACHE: dict = {}


def fedmr_model_accuracies(out: str) -> dict | None:
    """Test accuracy of a finished FedMR run's global model and of its K individual models
    at the end ({"global": a, "models": [a_1, ..., a_K]}), from its model.npz; None when the
    checkpoint holds no recombined model list (stage 1 only)."""
    from edgefl import kernels
    from edgefl.checkpoint import load_checkpoint
    from edgefl.config import dataset_from_config
    from edgefl.models import build_model
    from edgefl.runconfig import run_config_from_mapping
    ck = load_checkpoint(os.path.join(out, "model.npz"))
    if "state.models" not in ck:
        return None
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        config = json.load(f)["config"]
    key = json.dumps(config["dataset"], sort_keys=True)
    if key not in _TEST_CACHE:
        _TEST_CACHE[key] = dataset_from_config(run_config_from_mapping(config).as_config())
    ds = _TEST_CACHE[key]
    model = build_model(ck["model_spec"], ds.input_shape, ds.num_classes)
    models = ck["state.models"].reshape(int(ck["state_meta"]["slots"]), -1)
    return {"global": kernels.evaluate(model, ck["params"], ds.x_test, ds.y_test)["accuracy"],
            "models": [kernels.evaluate(model, np.ascontiguousarray(m), ds.x_test,
                                        ds.y_test)["accuracy"] for m in models]}


# metric name -> f(run directory): what a worker computes from model.npz as a run ends
DERIVED = {"global_train_loss": global_train_loss, "fedmr_models": fedmr_model_accuracies}


def fedmr_model_lines(runs: list, arm: str) -> list:
    """Test accuracy of FedMR's K individual models at the end against their mean (the
    global model FedMR evaluates, the paper's Algorithm 1 line 11)."""
    n, note = len(runs), divergence_note(runs)
    runs = [r for r in runs if not r.get("diverged")]
    if not runs:
        return [f"{arm}{note}: no model at the end of any seed.", ""]
    if note:
        note = (f" ({n - len(runs)} of {n} seeds diverged; the {len(runs)} that did not are "
                f"shown here and below)")
    finals = [r.get("fedmr_models") or fedmr_model_accuracies(r["out"]) for r in runs]
    if any(f is None for f in finals):
        return [f"{arm}: no recombined model list in the checkpoint (stage 1 only).", ""]
    k = len(finals[0]["models"])
    return [(f"{arm} at the last round, mean over seeds{note}: the global model (mean of the K = "
             f"{k} models) {np.mean([f['global'] for f in finals]):.4f}; the K individual "
             f"models {np.mean([np.mean(f['models']) for f in finals]):.4f} on average, best "
             f"{np.mean([max(f['models']) for f in finals]):.4f}."), ""] \
        + fedmr_member_curve(runs, arm)


def shown_rounds(rounds: list, points: int) -> list:
    """Up to `points` of the sorted `rounds`, evenly spaced, the last always among them (the
    rows of a table over rounds)."""
    step = max(1, math.ceil(len(rounds) / points))
    return sorted(set(rounds[::step]) | {rounds[-1]})


def fedmr_member_curve(runs: list, arm: str, points: int = 8) -> list:
    """The K models' test accuracy over rounds (runs made with `evaluate_models: true`, whose
    records carry member_accuracy) against the global model's: a table at up to `points`
    evaluated rounds, means over the seeds that evaluated that round. [] without them."""
    rounds = sorted(set.intersection(*(set(r.get("members") or {}) for r in runs))) \
        if runs else []
    if not rounds:
        return []
    shown = shown_rounds(rounds, points)
    lines = [f"{arm}: test accuracy of the K models over rounds (mean over {len(runs)} seeds):",
             "", "| round | global model | K models, mean | K models, best | K models, worst |",
             "|--:|--:|--:|--:|--:|"]
    for t in shown:
        accs = [r["members"][t] for r in runs]
        glob = [r["curve"][t] for r in runs if t in r["curve"]]
        lines.append(f"| {t} | {np.mean(glob):.4f} | {np.mean([np.mean(a) for a in accs]):.4f} "
                     f"| {np.mean([max(a) for a in accs]):.4f} "
                     f"| {np.mean([min(a) for a in accs]):.4f} |")
    return lines + [""]


def gap_curve_lines(runs_by_arm: dict, baseline: str, points: int = 8) -> list:
    """Issue 21 item 4, whether a gap closes as the rounds grow: each arm's test accuracy
    minus the baseline's, paired by seed (seeds where either run diverged are left out), at
    up to `points` rounds both evaluated; then the change of the gap from about a third of
    the run to its end, paired by seed, and where a least-squares line through the mean gaps
    of that stretch would cross zero (an extrapolation, said as such)."""
    import verdicts as V
    base = {r["seed"]: r for r in runs_by_arm.get(baseline) or [] if not r.get("diverged")}
    rows, notes = {}, []
    for arm, runs in runs_by_arm.items():
        pairs = [(r, base[r["seed"]]) for r in runs or []
                 if not r.get("diverged") and r["seed"] in base]
        if arm == baseline or len(pairs) < 2:
            continue
        common = sorted(set.intersection(*(set(a["curve"]) & set(b["curve"])
                                           for a, b in pairs)))
        if len(common) < 3:
            continue
        shown = shown_rounds(common, points)
        gap = {t: [a["curve"][t] - b["curve"][t] for a, b in pairs] for t in shown}
        rows[arm] = {t: V.t_interval(g) for t, g in gap.items()}
        last = shown[-1]
        since = min(shown, key=lambda t: abs(t - last / 3))
        change = V.t_interval([x - y for x, y in zip(gap[last], gap[since])])
        word = {V.HOLDS: f"{arm} gained on {baseline}", V.CONTRADICTED:
                f"{arm} lost ground to {baseline}", V.UNRESOLVED: "no change resolved"}[
                    V.judge(change)]
        text = (f"{arm} − {baseline}: the gap changed by {change.text('+.4f')} from round "
                f"{since} to round {last} (n = {len(pairs)}): {word}")
        tail = [t for t in shown if t >= since]
        slope, icept = np.polyfit(tail, [rows[arm][t].mean for t in tail], 1)
        if change.lo > 0 and rows[arm][last].mean < 0 < slope:
            text += (f"; the least-squares line through the mean gaps of rounds {since}-{last} "
                     f"(a trend, not a model of the curve) reaches zero about round "
                     f"{math.ceil(-icept / slope)}")
        notes.append(text + ".")
    if not rows:
        return []
    arms = list(rows)
    shown = sorted(set.union(*(set(r) for r in rows.values())))
    lines = [f"Test accuracy minus {baseline}'s over rounds, paired by seed (mean and 95% t "
             f"interval):", "", "| round | " + " | ".join(arms) + " |",
             "|--:|" + "|".join("--:" for _ in arms) + "|"]
    for t in shown:
        cells = [rows[a][t].text("+.3f") if t in rows[a] else "" for a in arms]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines + [""] + [f"- {n}" for n in notes] + [""]


def extra_lines(exp: Experiment, setting: str, table: dict) -> list:
    lines = []
    for extra in exp.doc.get("extras", []):
        if extra["kind"] == "gap_curve":
            runs = table.get(setting, {})
            lines += gap_curve_lines({a: runs.get(a) for a in
                                      [extra["baseline"], *_as_list(extra.get("arms"))]},
                                     extra["baseline"])
            continue
        for arm in _as_list(extra.get("arms")):
            runs = table.get(setting, {}).get(arm) or []
            if not runs:
                continue
            try:
                if extra["kind"] == "duw_table":
                    lines += duw_table_lines(runs)
                else:
                    lines += fedmr_model_lines(runs, arm)
            except (OSError, ValueError, KeyError) as exc:
                lines += [f"({extra['kind']} of {arm} unavailable: {exc})", ""]
    return lines


# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------

def verdict_word(results: list) -> str:
    """The experiment's verdict on the paper's claims (checks of role `claim`): how many
    hold, are contradicted, are not resolved at this scale."""
    import verdicts as V
    claims = [verdict for check, verdict, _ in results if check.get("role", "claim") == "claim"]
    if any(v is None for v in claims):
        return "Not evaluated (runs missing)"
    n = len(claims)
    if not n:
        return "No claim of the paper checked in this tier"
    if all(v == V.HOLDS for v in claims):
        return f"Holds ({n} of {n} claims)"
    head = "Contradicted" if V.CONTRADICTED in claims else "Not resolved at this scale"
    return (f"{head} ({claims.count(V.HOLDS)} of {n} claims hold, "
            f"{claims.count(V.CONTRADICTED)} contradicted, {claims.count(V.UNRESOLVED)} "
            f"not resolved)")


def scale_of(exp: Experiment) -> str:
    """The scale of an experiment's runs in one line (the summary table's every row)."""
    scale = str(exp.doc.get("scale", "")).strip()
    seeds = f"{exp.seeds} seed{'s' if exp.seeds != 1 else ''} paired"
    return f"{scale}; {seeds}" if scale else seeds


def describe_setting(exp: Experiment, setting: str) -> str:
    from edgefl.compare import describe_section
    arms = exp.arms_of(setting)
    config = exp.config(setting, arms[0], 0)
    train = ", ".join(f"{k} {v}" for k, v in (config.get("train") or {}).items())
    who = (f"{config['clients_per_round']} clients/round" if "clients_per_round" in config
           else f"fraction {config['fraction']}" if "fraction" in config else "all clients")
    partition = dict(config.get("partition") or {})
    owners = partition.get("owners")
    if isinstance(owners, dict):
        partition["owners"] = "label sets " + json.dumps(owners["label_sets"]).replace(" ", "") \
            + (f", ≤{owners['per_client']} per client" if owners.get("per_client") else "")
    return (f"{describe_section(config.get('dataset'))}; "
            f"{describe_section(partition, skip=('name',))}; "
            f"model {describe_section(config.get('model'))}; "
            f"train: {train}; {config.get('rounds', 10)} rounds, {who}")


# an if_not mapping's keys -> the verdicts they explain
REASON_KEYS = {"contradicted": "contradicted", "unresolved": "not resolved at this scale"}


def reason_for(check: dict, word: str | None) -> str | None:
    """The line explaining a verdict other than "holds" from the check's `if_not`: a text
    (for either verdict) or a mapping {contradicted: text, unresolved: text}; None when the
    claim holds, was not evaluated, or the check gives no reason for this verdict."""
    reasons = check.get("if_not")
    if word is None or word == "holds" or not reasons:
        return None
    if isinstance(reasons, dict):
        key = next((k for k, v in REASON_KEYS.items() if v == word), None)
        reasons = reasons.get(key)
        if not reasons:
            return None
    lead = ("Why it is likely contradicted here" if word == "contradicted"
            else "Why it is likely not resolved here")
    return f"{lead}: {reasons.strip()}"


def render_experiment(exp: Experiment, table: dict, failures: dict) -> tuple:
    """(markdown, verdict) of one experiment."""
    doc = exp.doc
    out = [f"### {doc['title']}", "", f"*{doc.get('paper', '')}* — reproduces {doc['spec']}.", ""]
    out += [f"**Claim.** {doc['claim'].strip()}", ""]
    if doc.get("setup"):
        seeds = (f"Seeds 0–{exp.seeds - 1}; every number below is the mean ± sample std "
                 f"over the {exp.seeds} seeds (rounds to a target: over the seeds that "
                 f"reached it, with their count)." if exp.seeds > 1 else
                 "One seed (0): no spread is shown.")
        out += [f"**Setup here.** {doc['setup'].strip()} {seeds}", ""]
    for setting in exp.settings:
        s = exp.settings[setting]
        out += [f"**{setting}** — {s.get('label', '')}".rstrip(" —"), "",
                f"<sub>{describe_setting(exp, setting)}</sub>", ""]
        columns = doc.get("columns", ["final_accuracy", "rounds_to", "bytes"])
        targets = exp.targets_of(setting)
        header, keys = ["arm"], []
        for c in columns:
            if c == "rounds_to":
                for t in targets:
                    header.append(f"rounds to ≥{t:g}")
                    keys.append((f"rounds_to:{t:g}", "rounds"))
            else:
                header.append(METRICS[c][0])
                keys.append((c, METRICS[c][2]))
        out.append("| " + " | ".join(header) + " |")
        out.append("|---|" + "|".join("--:" for _ in keys) + "|")
        for arm in exp.arms_of(setting):
            runs = table.get(setting, {}).get(arm) or []
            label = exp.arms[arm].get("label", arm)
            cells = [(f"{arm}: {label}" if label != arm else arm) + divergence_note(runs)]
            if not runs:
                cells += ["failed"] * len(keys)
            else:
                cells += [fmt_stat(stat_of(runs, key), kind) for key, kind in keys]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
        out += extra_lines(exp, setting, table)
    results = []
    for check in doc["checks"]:
        verdict, lines = evaluate_check(check, exp, table)
        results.append((check, verdict, lines))
    verdict = verdict_word(results)
    if any(r.get("diverged") for arms in table.values() for runs in arms.values() for r in runs):
        out += [("**Runs that diverged.** A non-finite loss or gradient in local training "
                 "ends a run (edgefl stops rather than carry NaN parameters on). Such a run is "
                 "counted, not dropped: its final accuracy is chance, 1/C (a model whose "
                 "outputs are not numbers predicts nothing), its best accuracy and rounds to "
                 "a target are those of the rounds before, and it has no losses or bytes."), ""]
    out += [("**Checks** (each comparison paired by seed: the mean gain in the claimed "
             "direction and its 95% t interval; *holds* when the interval excludes zero (or "
             "the stated margin) on the claimed side, *contradicted* when it excludes it on "
             "the other, otherwise *not resolved at this scale*; a target not reached is "
             "never given a value: such a comparison goes by the signs of the seeds' "
             "differences, with the 95% interval of the median gain, see "
             "tools/verdicts.py):"), ""]
    for check, word, lines in results:
        role = "" if check.get("role", "claim") == "claim" else " *(our addition, not the paper's)*"
        mark = word if word is not None else "not evaluated"
        out.append(f"- **{mark}** — {check['claim'].strip()}{role}")
        out += [f"  - {line}" if not line.startswith("  ") else f"    - {line.strip()}"
                for line in lines]
        reason = reason_for(check, word)
        if reason:
            out.append(f"  - {reason}")
    out.append("")
    if failures:
        out += ["**Failed runs:**", ""] + [f"- `{k}`: {v}" for k, v in sorted(failures.items())] \
            + [""]
    out.append(f"**Verdict: {verdict}.** Scale: {scale_of(exp)}.")
    if doc.get("differs"):
        out += ["", f"**Still differs from the paper:** {doc['differs'].strip()}"]
    out.append("")
    for note in doc.get("notes", []):
        out.append(f"- {note.strip()}")
    if doc.get("notes"):
        out.append("")
    return "\n".join(out), verdict


SECTION_RE = re.compile(r"<!-- reproduce:(\w+) (\{.*?\}) -->\n(.*?)<!-- /reproduce:\1 -->\n",
                        re.DOTALL)
# The long tier takes several sittings, each perhaps on another machine: its finished runs
# are committed (.gitignore keeps out model.npz and the plots; reproduce.json holds what the
# report needs from the model) so that --long on a fresh clone continues where the last
# sitting stopped.
COMMITTED_RUNS = "committed without model.npz, so a later sitting on another clone resumes them"
# sections measured by other means (a hand-measured table): kept as they are,
# after the generated ones, when a run rewrites the file
KEPT_RE = re.compile(r"<!-- kept:([\w-]+) -->\n.*?<!-- /kept:\1 -->\n", re.DOTALL)


def render_section(mode, manifest, experiments, tables, failures) -> tuple:
    from edgefl.compare import format_duration
    verdicts, body = {}, []
    for exp in experiments:
        text, verdict = render_experiment(exp, tables[exp.name], failures.get(exp.name, {}))
        verdicts[exp.name] = verdict
        body.append(text)
    m = manifest
    load = (f"load average {m['load_start']:.2f} at the start and {m['load_end']:.2f} at the "
            f"end (other processes were running)" if m.get("load_start") is not None else "")
    if m.get("cpu_s"):
        load += (f"; {format_duration(m['cpu_s'])} of CPU time in all (about "
                 f"{format_duration(m['cpu_s'] / max(1, min(m['workers'], m['cpus'] or 1)))} "
                 f"of wall time on {min(m['workers'], m['cpus'] or 1)} otherwise idle cores)")
    # every run kept from earlier sittings: this invocation only rendered them
    rendered = bool(m.get("resumed")) and m["resumed"] == m["runs"]
    head = [f"## {MODE_TITLES[mode]}", "",
            (f"{'Rendered' if rendered else 'Produced'} by `{m['command']}` in "
             f"**{format_duration(m['wall_s'])}** "
            f"({m['wall_s']:.0f} s wall time, {m['runs']} runs, {m['workers']} worker "
            f"process{'es' if m['workers'] != 1 else ''}) on {m['cpus']} CPUs ({m['machine']}), "
            f"{load}; edgefl {m['edgefl']} ({m['backend']} backend), finished {m['date']}. "
            f"Run directories: `{m['out']}` ({COMMITTED_RUNS if mode == 'long' else 'not committed'}"
            f"; `edgefl compare` reads them, and each setting has an overlay.png of seed 0)."),
            ""]
    if m.get("only"):
        head += [(f"**Part of the tier only:** this invocation ran "
                  f"{', '.join(f'`{n}`' for n in m['only'])} (`--only`); the tier's other "
                  f"experiments are not in this section until an invocation without `--only` "
                  f"finishes them."), ""]
    total = sum(st.get("elapsed_s", 0.0) for st in m.get("statuses", {}).values())
    if rendered:
        head += [(f"All {m['runs']} runs were made by earlier invocations (sittings) and "
                  f"kept; this one only read them back and wrote this section. The runs' own "
                  f"times add up to {format_duration(total)} of single-worker time, measured "
                  f"as elapsed time: a run that shared the cores with other jobs, or whose "
                  f"sitting was paused, counts longer than its work."), ""]
    elif m.get("resumed"):
        head += [(f"This invocation resumed an interrupted one: {m['resumed']} of the "
                  f"{m['runs']} runs were finished by earlier invocations and kept; the "
                  f"runs' own times add up to {format_duration(total)} of single-worker "
                  f"time."), ""]
    cpus = collections.Counter(st.get("cpu") for st in m.get("statuses", {}).values()
                               if st.get("ok"))
    if len(cpus) > 1:           # runs kept from sittings on other machines
        made = [f"{n} on {cpu}" for cpu, n in cpus.most_common() if cpu is not None]
        if cpus.get(None):
            made.append(f"{cpus[None]} before runs recorded it (2026-11-29), on the machines "
                        f"of earlier sittings")
        head += [(f"CPUs of the runs: {'; '.join(made)}. A float32 run's last bits depend "
                  f"on the BLAS kernels the CPU gets, so two arms of one seed made on "
                  f"different CPUs share their initial model, data order and client "
                  f"selection, but not every rounding."), ""]
    if m.get("rendered"):
        head += [(f"The text of this section was re-rendered from those run directories by "
                  f"`{m['rendered']['command']}` on {m['rendered']['date']}; no run was "
                  f"repeated, and every number is from the runs above."), ""]
    meta = {"wall_s": round(m["wall_s"], 1), "command": m["command"], "verdicts": verdicts,
            # a resumed invocation's wall time is only its own sitting's: the summary table
            # gives the runs' own times instead
            **({"runs_s": round(total, 1)} if m.get("resumed") else {}),
            "titles": {e.name: e.doc.get("headline", e.doc["title"]) for e in experiments},
            "scales": {e.name: scale_of(e) for e in experiments}, "stats": STATS_VERSION}
    return "\n".join(head + body), meta


def write_results(path: str, mode: str, section: str, meta: dict) -> None:
    from edgefl.io import atomic_write
    sections, kept = {}, []
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for match in SECTION_RE.finditer(text):
            sections[match.group(1)] = (json.loads(match.group(2)), match.group(3))
        kept = [match.group(0) for match in KEPT_RE.finditer(text)]
    sections[mode] = (meta, section.rstrip("\n") + "\n")
    names, titles = [], {}
    for m in MODES:
        if m in sections:
            for name, title in sections[m][0]["titles"].items():
                if name not in titles:
                    names.append(name)
                    titles[name] = title
    from edgefl.compare import format_duration
    modes = [m for m in ("long", "full", "quick") if m in sections]
    lines = ["# Reproducing the papers' main comparisons", "",
             ("Generated by `tools/reproduce.py` from the experiments in `tools/experiments/` "
              "(each file's header says which sections, figures and tables of its paper it "
              "reproduces, what was scaled down to fit this 2-core machine and what still "
              "differs from the paper). Every number below comes from the runs of the "
              "command stated in its section; nothing is copied from the papers except the "
              "claims being tested."), "",
             ("Each comparison pairs the arms seed by seed and gives the mean gain with its "
              "95% t interval. A claim **holds** only when the interval excludes zero (or the "
              "claim's margin) on the claimed side, is **contradicted** only when it excludes "
              "it on the other side, and is otherwise **not resolved at this scale**: the "
              "verdicts are about these settings (the scale column), not about the papers' "
              "own. A target not reached within the run is reported as such; a comparison "
              "with such a run is decided by the sign of each seed's difference (an exact "
              "sign test, which needs at least 6 seeds on one side) and shows the 95% "
              "interval of the median gain that is the test's dual (a run that missed the "
              "target within H rounds only bounds its gain: it needed at least H + 1), never "
              "by counting it as rounds + 1. Each comparison is its own 95% interval: a "
              "claim made of several comparisons holds when all of them hold and is "
              "contradicted when any is, with no correction for multiplicity, so a claim of "
              "many comparisons is more often contradicted by chance than one of a single "
              "comparison. The rule is written out in `tools/verdicts.py`."), "",
             "| paper / claim | tier (wall time) | scale | verdict |",
             "|---|---|---|---|"]
    for name in names:
        for m in modes:
            meta_m = sections[m][0]
            if name not in meta_m["verdicts"]:
                continue
            old = meta_m.get("stats", 1) < STATS_VERSION
            scale = meta_m.get("scales", {}).get(name, "older settings; 2–5 seeds, unpaired")
            verdict = meta_m["verdicts"][name] + (" *(old statistics: seed means only)*"
                                                  if old else "")
            took = (f"{format_duration(meta_m['runs_s'])} of runs, over sittings"
                    if meta_m.get("runs_s") else format_duration(meta_m["wall_s"]))
            lines.append(f"| **{name}**: {titles[name]} | {m} ({took}) | {scale} | {verdict} |")
    lines.append("")
    lines.append("To run again: `python tools/reproduce.py --quick` (the smoke tier; its section "
                 "gives its wall and CPU time) or "
                 "`python tools/reproduce.py` (the full run) or `python tools/reproduce.py "
                 "--long` (the CNN experiments, resumable: an interrupted invocation continues "
                 "with the runs it had not finished, and `--stop-after MINUTES` ends a sitting "
                 "cleanly; its finished runs are committed in `runs/reproduce-long`, so a "
                 "sitting on a fresh clone continues the last one's); `--only NAME` runs one "
                 "experiment, "
                 "`--seeds N` changes the number of seeds.")
    lines.append("")
    for m in modes:
        meta_m, text = sections[m]
        lines.append(f"<!-- reproduce:{m} {json.dumps(meta_m, ensure_ascii=False)} -->")
        if meta_m.get("stats", 1) < STATS_VERSION and OLD_STATS_NOTE not in text:
            head, _, rest = text.partition("\n\n")
            text = f"{head}\n\n{OLD_STATS_NOTE}\n\n{rest}"
        lines.append(text.rstrip("\n"))
        lines.append(f"<!-- /reproduce:{m} -->")
        lines.append("")
    for block in kept:
        lines.append(block.rstrip("\n"))
        lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, "\n".join(lines).rstrip("\n") + "\n")


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------

def collect(experiments, jobs, statuses) -> tuple:
    """({exp: {setting: {arm: [metrics per seed]}}}, {exp: {job key: error}})."""
    from edgefl.compare import load_runs, plot_overlay
    tables = {e.name: {} for e in experiments}
    failures = {e.name: {} for e in experiments}
    by_name = {e.name: e for e in experiments}
    for job in jobs:
        exp = by_name[job.experiment]
        status = statuses.get(job.key)
        if status is not None and not status["ok"]:
            failures[exp.name][job.key] = status["error"].strip().splitlines()[-1]
            continue
        try:
            metrics = run_metrics(job, exp.targets_of(job.setting), exp.doc.get("columns", []))
        except (OSError, ValueError) as exc:
            failures[exp.name][job.key] = str(exc)
            continue
        tables[exp.name].setdefault(job.setting, {}).setdefault(job.arm, []).append(metrics)
    for exp in experiments:
        for setting in exp.settings:
            dirs = [j.out for j in jobs if j.experiment == exp.name and j.setting == setting
                    and j.seed == 0 and j.key not in failures[exp.name]
                    and not kept_record(j.out).get("diverged")]   # no summary.json to draw
            if dirs:
                try:
                    runs = load_runs(dirs)
                    targets = exp.targets_of(setting)
                    plot_overlay(runs, os.path.join(os.path.dirname(os.path.dirname(dirs[0])),
                                                    "overlay.png"),
                                 targets[0] if targets else None, f"{exp.name}: {setting}, seed 0")
                except (OSError, ValueError, ImportError) as exc:
                    print(f"overlay plot of {exp.name}/{setting} skipped: {exc}", file=sys.stderr)
    return tables, failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="fewer seeds, rounds and data (each experiment's `quick:` block)")
    parser.add_argument("--long", action="store_true",
                        help="the long tier: the experiments with a `long:` block (the CNN "
                             "settings), resumable (implies --resume)")
    parser.add_argument("--resume", action="store_true",
                        help="keep runs an earlier invocation finished with the same config "
                             "(an interrupted invocation continues where it stopped)")
    parser.add_argument("--seeds", type=int, metavar="N",
                        help="seeds per (setting, arm), overriding the experiment files")
    parser.add_argument("--only", metavar="NAME[,NAME]",
                        help="run only these experiments (file names in tools/experiments)")
    parser.add_argument("--out", metavar="DIR",
                        help="run directories (default: runs/reproduce-quick, "
                             "runs/reproduce-full or runs/reproduce-long in the repository)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="runs in parallel processes, one training thread each "
                             "(default: the CPU count)")
    parser.add_argument("--results", metavar="MD",
                        help="report to write (default: docs/results.md; OUT/results.md "
                             "with --only)")
    parser.add_argument("--stop-after", type=float, metavar="MINUTES",
                        help="start no run after MINUTES (the runs under way finish) and exit "
                             "without a report if runs are left; the same command with "
                             "--resume (implied by --long) continues with them: one sitting "
                             "of a tier longer than a session")
    parser.add_argument("--runs", metavar="PATTERN[,PATTERN]",
                        help="run only the runs whose key (EXPERIMENT/SETTING/ARM/seedN, "
                             "e.g. 'fedmr/cnn-dir0.5/*') matches a pattern, in the patterns' "
                             "order, and write no report: a sitting that does these first")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the report from OUT's run directories without running")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.quick and args.long:
        parser.error("--quick and --long: choose one tier")
    mode = "quick" if args.quick else "long" if args.long else "full"
    resume = args.resume or args.long
    only = [n for n in (args.only or "").split(",") if n]
    out = os.path.abspath(args.out or os.path.join(REPO, "runs", f"reproduce-{mode}"))
    results = args.results or (os.path.join(out, "results.md") if only else RESULTS)
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: need at least 1")
    if args.stop_after is not None and not args.stop_after > 0:
        parser.error(f"--stop-after {args.stop_after:g}: need a positive number of minutes")
    if args.stop_after is not None and args.report_only:
        parser.error("--stop-after runs nothing with --report-only: choose one")
    if args.runs is not None and args.report_only:
        parser.error("--runs runs nothing with --report-only: choose one")
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: need at least 1")
    manifest_path = os.path.join(out, "manifest.json")
    manifest = None
    if args.report_only:   # the experiments and seeds of the run being reported
        try:
            with open(manifest_path, encoding="utf-8") as f:
                manifest = json.load(f)
        except OSError:
            print(f"reproduce: error: {manifest_path}: no manifest; run without --report-only "
                  f"first", file=sys.stderr)
            return 2
        if manifest.get("mode") != mode:
            print(f"reproduce: error: {out} holds a {manifest.get('mode')} run; add or drop "
                  f"--quick to match", file=sys.stderr)
            return 2
        recorded = manifest.get("only") or []
        if only and sorted(only) != sorted(recorded):
            # the section's header (command, wall time, machines) is the manifest's: it
            # would describe another invocation's runs than the experiments rendered
            ran = f"--only {','.join(recorded)}" if recorded else "the whole tier"
            print(f"reproduce: error: --only {','.join(only)}: {manifest_path} records the "
                  f"invocation `{manifest.get('command')}` ({ran}), whose times and machines "
                  f"the section's header gives; re-render that one (drop --only), or run "
                  f"`python tools/reproduce.py{MODE_FLAGS[mode]} --only {','.join(only)}` "
                  f"(its finished runs are kept, not repeated)", file=sys.stderr)
            return 2
        only = recorded
        args.seeds = args.seeds if args.seeds is not None else manifest.get("seeds")
    try:
        experiments = sorted((load_experiment(p, mode, args.seeds) for p in discover(only)),
                             key=lambda e: e.order)
        if mode == "long":   # only the experiments that define a long tier
            experiments = [e for e in experiments if "long" in e.tiers]
            if not experiments:
                raise ExperimentError("--long: no experiment file has a `long:` block")
        # and only those with a setting in this tier (a diagnosis may run in one tier only)
        experiments = [e for e in experiments if e.settings]
        jobs = make_jobs(experiments, out)
        if args.runs is not None:
            jobs = select_runs(jobs, args.runs)
    except (ExperimentError, OSError) as exc:
        print(f"reproduce: error: {exc}", file=sys.stderr)
        return 2

    def log(message):
        print(message, flush=True)

    if args.report_only:
        statuses = manifest.get("statuses", {})
        manifest["rendered"] = {
            "command": "python tools/reproduce.py --report-only" + "".join(
                f" {a}" for a in (argv if argv is not None else sys.argv[1:])
                if a != "--report-only"),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}
    else:
        if args.workers > 1:   # one BLAS thread per worker process: no oversubscription
            for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                os.environ.setdefault(var, "1")
        load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        log(f"reproduce ({mode}): {len(experiments)} experiments, {len(jobs)} runs, "
            f"{args.workers} worker process(es), output in {out}")
        os.makedirs(out, exist_ok=True)
        stop_at = started + 60 * args.stop_after if args.stop_after is not None else None
        statuses = run_jobs(jobs, args.workers, log, resume, stop_at,
                            in_order=args.runs is not None)
        if args.runs is not None:
            failed = sum(1 for st in statuses.values() if not st["ok"])
            log(f"--runs: {len(statuses)} of {len(jobs)} runs done ({failed} failed); no "
                f"report written (an invocation without --runs writes it, keeping these)")
            return 1 if failed else (3 if len(statuses) < len(jobs) else 0)
        left = len(jobs) - len(statuses)
        if left:
            again = "" if resume else " --resume"
            log(f"stopped after {args.stop_after:g} min: {len(statuses)} of {len(jobs)} runs "
                f"done, {left} left; no report written. The same command{again} continues "
                f"with the {left} left.")
            return 3
        import edgefl
        from edgefl import kernels
        command = "python tools/reproduce.py" + MODE_FLAGS[mode] + \
            "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])
                    if a not in ("--quick", "--long"))
        manifest = {
            "command": command, "mode": mode, "runs": len(jobs), "workers": args.workers,
            "cpus": os.cpu_count(),
            "machine": f"{platform.machine()}, {platform.system()}, {cpu_model()}",
            "edgefl": edgefl.__version__, "backend": kernels.backend,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "out": os.path.relpath(out, REPO) if out.startswith(REPO) else out,
            "load_start": load_start, "only": only, "seeds": args.seeds,
            "statuses": statuses,
            "resumed": sum(1 for st in statuses.values() if st.get("resumed")),
        }
    tables, failures = collect(experiments, jobs, statuses)
    if not args.report_only:
        manifest["load_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        manifest["wall_s"] = time.perf_counter() - started   # runs + metrics + plots
        try:   # CPU time of this process and its workers: the load-independent cost
            import resource
            usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                      resource.RUSAGE_CHILDREN)]
            manifest["cpu_s"] = sum(u.ru_utime + u.ru_stime for u in usage)
        except (ImportError, OSError):
            pass
        with open(manifest_path, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
    section, meta = render_section(mode, manifest, experiments, tables, failures)
    write_results(results, mode, section, meta)
    n_failed = sum(len(f) for f in failures.values())
    for exp in experiments:
        log(f"{exp.name}: {meta['verdicts'][exp.name]}")
    log(f"report: {results}")
    log(f"wall time: {manifest['wall_s']:.1f} s ({mode}, {len(jobs)} runs"
        f"{f', {n_failed} failed' if n_failed else ''})"
        + (" [recorded by the run; --report-only did not rerun]" if args.report_only else ""))
    return 1 if n_failed else 0


if __name__ == "__main__":
    sys.exit(main())
