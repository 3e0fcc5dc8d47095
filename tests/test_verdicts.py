"""The verdict logic of tools/reproduce.py (tools/verdicts.py): paired t intervals, the three
verdicts, censoring of rounds-to-target without inventing a value, ratios, equivalence."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from helpers import import_tool

REPO = Path(__file__).resolve().parents[1]

V = import_tool("verdicts")


def test_t_table_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 41):
        assert V.t_critical(df) == pytest.approx(stats.t.ppf(0.975, df), abs=1e-4)


def test_interval_by_hand():
    # diffs 1, 2, 3: mean 2, sd 1, half width t(2) / sqrt(3) = 4.3027 / 1.7321 = 2.4842
    iv = V.t_interval([1, 2, 3])
    assert iv.mean == 2 and iv.sd == pytest.approx(1.0)
    assert iv.lo == pytest.approx(2 - 2.48417, abs=1e-4)
    assert iv.hi == pytest.approx(2 + 2.48417, abs=1e-4)
    one = V.t_interval([5.0])
    assert one.n == 1 and one.lo == -math.inf and one.hi == math.inf


def test_interval_covers_the_mean_at_the_stated_rate():
    """Coverage of the 95% t interval on normal paired differences, n = 5: the statements
    above would be wrong if the critical value or the sd were."""
    import numpy as np
    rng = np.random.default_rng(0)
    hits = 0
    trials = 4000
    for _ in range(trials):
        iv = V.t_interval(rng.normal(0.3, 1.0, size=5))
        hits += iv.lo < 0.3 < iv.hi
    assert 0.935 < hits / trials < 0.965


def test_holds_case():
    # accuracy: better arm ahead by about 0.02 in every seed, little spread
    better = [0.84, 0.85, 0.845, 0.842, 0.848]
    than = [0.82, 0.83, 0.826, 0.821, 0.827]
    v = V.paired(better, than, higher_is_better=True)
    assert v.verdict == V.HOLDS and v.interval.lo > 0 and v.n == 5
    assert "holds" in V.describe(v)


def test_contradicted_case():
    # rounds (lower is better): the "better" arm needs more rounds in every seed
    better = [30, 32, 31, 29, 33]
    than = [20, 21, 22, 20, 19]
    v = V.paired(better, than, higher_is_better=False)
    assert v.verdict == V.CONTRADICTED and v.interval.hi < 0


def test_not_resolved_case():
    """Built so that the mean favours the claim (as the old strict-inequality-of-means check
    would have said "held") but the interval contains zero."""
    better = [0.80, 0.86, 0.79, 0.87, 0.82]
    than = [0.82, 0.81, 0.83, 0.80, 0.82]
    assert sum(better) / 5 > sum(than) / 5
    v = V.paired(better, than, higher_is_better=True)
    assert v.verdict == V.UNRESOLVED
    assert v.interval.lo < 0 < v.interval.hi
    assert "not resolved at this scale" in V.describe(v)


def test_one_seed_is_never_resolved():
    v = V.paired([0.9], [0.1], higher_is_better=True)
    assert v.verdict == V.UNRESOLVED


def test_margin():
    gains_of_6 = ([0.76, 0.77, 0.75, 0.76, 0.765], [0.70, 0.71, 0.69, 0.70, 0.705])
    assert V.paired(*gains_of_6, higher_is_better=True).verdict == V.HOLDS
    # the claim "at least 10 points": the interval (about +0.06) lies below 0.10
    v = V.paired(*gains_of_6, higher_is_better=True, margin=0.10)
    assert v.verdict == V.CONTRADICTED
    assert "needs > 0.1" in V.describe(v)


def test_censored_never_counts_as_rounds_plus_one():
    """FedAvg never reaches the target in 5 seeds, FedUmf always does: the old rule
    (not reached = R + 1) made a "1.2x gain" out of it; here no mean and no interval is
    given, the counts are, and 5 one-sided seeds are not enough for the sign test."""
    fedumf = [30, 31, 29, 33, 35]
    fedavg = [None] * 5
    v = V.paired(fedumf, fedavg, higher_is_better=False)
    assert v.method == "sign" and v.interval is None
    assert v.signs["for"] == 5 and v.signs["reached_than"] == 0
    assert v.verdict == V.UNRESOLVED and "at least 6" in v.note
    text = V.describe(v)
    assert "censored" in text and "reached in 5/5 vs 0/5" in text
    assert "41" not in text and "1.2" not in text


def test_censored_sign_test_resolves_with_enough_seeds():
    better = [30, 31, 29, 33, 35, 30, 28, 40, 39, 31]
    than = [None, None, 35, None, None, 38, None, None, None, 35]
    v = V.paired(better, than, higher_is_better=False)
    assert v.verdict == V.HOLDS and v.signs["p_for"] < 0.025
    # and the mirror image is contradicted
    w = V.paired(than, better, higher_is_better=False)
    assert w.verdict == V.CONTRADICTED


def test_censored_mixed_signs_not_resolved():
    better = [30, None, 29, 45, None, 30]
    than = [None, 33, 35, 40, 31, None]
    v = V.paired(better, than, higher_is_better=False)
    assert v.verdict == V.UNRESOLVED and v.signs["for"] == 3 and v.signs["against"] == 3


def test_neither_reached():
    v = V.paired([None] * 5, [None] * 5, higher_is_better=False)
    assert v.verdict == V.UNRESOLVED and "neither arm reached" in V.describe(v)


def test_censoring_errors_name_the_cause():
    with pytest.raises(ValueError, match="lower is better"):
        V.paired([None, 0.8], [0.7, 0.7], higher_is_better=True)
    with pytest.raises(ValueError, match="margin"):
        V.paired([None, 3], [4, 5], higher_is_better=False, margin=1)
    with pytest.raises(ValueError, match="pair them by seed"):
        V.paired([1, 2, 3], [1, 2], higher_is_better=True)


def test_ratio_difference_and_its_censoring():
    # speed-up fedavg/fedumf: ~1.7 at C = 0.1 vs ~1.4 at C = 0.5
    v = V.ratio_difference([43, 42, 44, 41, 45], [25, 25, 26, 24, 26],
                           [41, 40, 42, 39, 41], [29, 29, 30, 28, 29])
    assert v.verdict == V.HOLDS
    w = V.ratio_difference([None, 42, 44, 41, 45], [25, 25, 26, 24, 26],
                           [41, 40, 42, 39, 41], [29, 29, 30, 28, 29])
    assert w.verdict == V.UNRESOLVED and "1 of 5 seeds censored" in w.note


def test_equivalence():
    same = V.equivalent([0.90, 0.91, 0.905, 0.902], [0.901, 0.909, 0.904, 0.903], 0.005)
    assert same.verdict == V.HOLDS
    apart = V.equivalent([0.90, 0.91, 0.905, 0.902], [0.88, 0.889, 0.884, 0.882], 0.005)
    assert apart.verdict == V.CONTRADICTED
    noisy = V.equivalent([0.90, 0.93, 0.88, 0.91], [0.91, 0.90, 0.90, 0.90], 0.005)
    assert noisy.verdict == V.UNRESOLVED


def test_exact_and_combine():
    assert V.exactly_equal([5, 5], [5, 5]).verdict == V.HOLDS
    assert V.exactly_equal([5, 5], [5, 6]).verdict == V.CONTRADICTED
    assert V.combine([V.HOLDS, V.HOLDS]) == V.HOLDS
    assert V.combine([V.HOLDS, V.UNRESOLVED]) == V.UNRESOLVED
    assert V.combine([V.HOLDS, V.UNRESOLVED, V.CONTRADICTED]) == V.CONTRADICTED
    assert V.combine([]) == V.UNRESOLVED


# ---------------------------------------------------------------------------------------
# tools/reproduce.py: the experiment files in every tier, pairing by seed, resuming
# ---------------------------------------------------------------------------------------

def _reproduce():
    import reproduce
    return reproduce


@pytest.mark.parametrize("mode", ["quick", "full", "long"])
def test_experiment_files_load_in_every_tier(mode):
    """Every experiment file loads in every tier; its checks name only settings and arms
    that run in that tier; every run config validates (label-set owners resolved)."""
    R = _reproduce()
    for path in R.discover(None):
        exp = R.load_experiment(path, mode)
        if mode == "long" and "long" not in exp.tiers:
            continue
        assert exp.seeds >= 5 or mode == "long", f"{path}: {exp.seeds} seeds in {mode}"
        for check in exp.doc["checks"]:
            for setting in R._as_list(check.get("settings")) or list(exp.settings):
                ran = set(exp.arms_of(setting))
                for key in ("better", "than", "arms", "arm", "baseline"):
                    for arm in R._as_list(check.get(key)):
                        assert arm in ran, f"{path} ({mode}): {check['claim']}: {arm} " \
                                           f"does not run in {setting}"
        if exp.settings:
            R.make_jobs([exp], "/nonexistent")   # validates every config, runs nothing


def test_tiers_key_is_checked(tmp_path):
    R = _reproduce()
    _refused_with_edit(R, tmp_path, "case1-iid:\n", "case1-iid:\n    tiers: [nightly]\n",
                       "tiers")


def test_if_not_reason_follows_the_verdict(tmp_path):
    """if_not explains a verdict other than "holds": one text for either, or a text per
    verdict; a malformed one is refused when the file loads."""
    R = _reproduce()
    both = {"if_not": "  the reason  "}
    split = {"if_not": {"contradicted": "went the other way", "unresolved": "too noisy"}}
    assert R.reason_for(both, V.HOLDS) is None and R.reason_for(both, None) is None
    assert R.reason_for(both, V.CONTRADICTED) == "Why it is likely contradicted here: the reason"
    assert R.reason_for(both, V.UNRESOLVED) == "Why it is likely not resolved here: the reason"
    assert R.reason_for(split, V.CONTRADICTED).endswith(": went the other way")
    assert R.reason_for(split, V.UNRESOLVED).endswith(": too noisy")
    assert R.reason_for({"if_not": {"unresolved": "x"}}, V.CONTRADICTED) is None
    _refused_with_edit(R, tmp_path, "    if_not: >\n", "    if_not:\n      failed: >\n",
                       "if_not")


def _refused_with_edit(R, tmp_path, old: str, new: str, match: str) -> None:
    """fedveca.yaml with its first `old` made `new` is refused when it loads, naming `match`."""
    src = (REPO / "tools" / "experiments" / "fedveca.yaml").read_text(encoding="utf-8")
    assert old in src, f"fedveca.yaml no longer holds {old!r}: the test edits nothing"
    bad = tmp_path / "bad.yaml"
    bad.write_text(src.replace(old, new, 1), encoding="utf-8")
    with pytest.raises(R.ExperimentError, match=match):
        R.load_experiment(str(bad), "quick")


def test_fedmr_member_curve_means_over_seeds_by_round():
    """The per-model table of FedMR's long-tier runs: each shown round's global accuracy and
    the mean / best / worst of the K models, averaged over seeds; nothing without records."""
    R = _reproduce()
    runs = [{"curve": {2: 0.5, 4: 0.7}, "members": {2: [0.2, 0.4], 4: [0.3, 0.5]}},
            {"curve": {2: 0.7, 4: 0.9}, "members": {2: [0.4, 0.6], 4: [0.5, 0.9]}}]
    lines = R.fedmr_member_curve(runs, "fedmr")
    assert "| 2 | 0.6000 | 0.4000 | 0.5000 | 0.3000 |" in lines
    assert "| 4 | 0.8000 | 0.5500 | 0.7000 | 0.4000 |" in lines
    assert R.fedmr_member_curve([{"curve": {2: 0.5}, "members": {}}], "fedmr") == []


def test_gap_curve_says_whether_a_gap_closes_and_pairs_by_seed():
    """Issue 21 item 4: an arm 0.10 behind at round 100 and 0.02-0.03 behind at round 300
    in every seed has closed in (resolved), with the extrapolated crossing; a seed that
    diverged leaves both arms, and an arm whose gap only wobbles is "no change resolved"."""
    R = _reproduce()
    rounds = [20, 60, 100, 140, 180, 220, 260, 300]

    def run(seed, accs, diverged=False):
        return {"seed": seed, "curve": dict(zip(rounds, accs)), "diverged": diverged}

    base = [run(s, [0.5 + 0.001 * s + 0.02 * i for i in range(8)]) for s in range(5)]
    closing = [run(s, [a - g for a, g in zip(base[s]["curve"].values(),
                                             [0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.03,
                                              0.02 + 0.002 * s])]) for s in range(5)]
    flat = [run(s, [a - 0.05 + (0.01 if (s + i) % 2 else -0.01)
                    for i, a in enumerate(base[s]["curve"].values())]) for s in range(5)]
    flat.append(run(5, [0.1] * 8, diverged=True))     # no partner: ignored
    lines = R.gap_curve_lines({"fedavg": base, "fedmr": closing, "flat": flat}, "fedavg")
    text = "\n".join(lines)
    assert "| round | fedmr | flat |" in text
    assert "| 100 | -0.100 [95% CI -0.100, -0.100] |" in text
    closing_note = next(x for x in lines if x.startswith("- fedmr"))
    assert "from round 100 to round 300 (n = 5): fedmr gained on fedavg" in closing_note
    assert "reaches zero about round" in closing_note
    flat_note = next(x for x in lines if x.startswith("- flat"))
    assert "no change resolved" in flat_note and "reaches zero" not in flat_note
    assert R.gap_curve_lines({"fedavg": base}, "fedavg") == []


def test_checks_pair_by_seed_not_by_position():
    """A failed seed drops out of both arms of a comparison, not shifts the pairing."""
    R = _reproduce()
    a = [{"seed": s, "x": v} for s, v in [(0, 1.0), (2, 3.0), (3, 4.0)]]
    b = [{"seed": s, "x": v} for s, v in [(0, 0.5), (1, 9.0), (3, 3.5)]]
    seeds, (va, vb) = R.aligned(a, b, key="x")
    assert seeds == [0, 3] and va == [1.0, 4.0] and vb == [0.5, 3.5]


def test_resume_keeps_a_finished_run_and_reruns_a_changed_one(tmp_path):
    R = _reproduce()
    config = {"dataset": {"name": "digits"}, "partition": {"name": "iid", "clients": 2},
              "model": {"name": "softmax"}, "train": {"lr": 0.05, "batch_size": 32},
              "rounds": 2, "seed": 0}
    job = {"key": "t/s/a/seed0", "out": str(tmp_path / "run"), "config": config,
           "threads": 1, "resume": True}
    first = R.execute(job)
    assert first["ok"] and not first.get("resumed"), first
    again = R.execute(job)
    assert again["ok"] and again["resumed"] and again["final_accuracy"] == first["final_accuracy"]
    assert again["cpu"] == first["cpu"] == R.cpu_model() != ""    # kept in reproduce.json
    changed = dict(job, config=dict(config, rounds=3))
    third = R.execute(changed)
    assert third["ok"] and not third.get("resumed")
    # an interrupted run (summary marked stopped) is run again, not kept
    import json
    summary = tmp_path / "run" / "summary.json"
    doc = json.loads(summary.read_text())
    doc["stopped"] = "interrupted"
    summary.write_text(json.dumps(doc))
    assert not R.execute(changed).get("resumed")


def test_derived_metrics_are_kept_so_a_run_needs_no_model_file(tmp_path):
    """What the report reads from a model (here FedMR's K models and the global training
    loss) is computed as the run ends and kept in reproduce.json: with model.npz deleted,
    as in the committed long-tier runs, the run is still resumed and reported the same."""
    import json
    import os
    R = _reproduce()
    config = {"dataset": {"name": "digits"}, "partition": {"name": "iid", "clients": 4},
              "model": {"name": "softmax"}, "train": {"lr": 0.05, "batch_size": 32},
              "strategy": {"name": "fedmr", "stage1_rounds": 0}, "rounds": 2,
              "clients_per_round": 2, "seed": 0}
    out = str(tmp_path / "run")
    job = {"key": "t/s/fedmr/seed0", "out": out, "config": config, "threads": 1,
           "resume": True, "derive": ("global_train_loss", "fedmr_models")}
    assert R.execute(job)["ok"]
    kept = json.loads((tmp_path / "run" / "reproduce.json").read_text())["derived"]
    assert kept["global_train_loss"] == R.global_train_loss(out)
    assert kept["fedmr_models"] == R.fedmr_model_accuracies(out)
    assert len(kept["fedmr_models"]["models"]) == 2
    os.remove(os.path.join(out, "model.npz"))
    assert R.execute(job).get("resumed")
    spec = R.Job("t", "s", "fedmr", 0, out, config, config, 1.0, job["derive"])
    metrics = R.run_metrics(spec, [], ["global_train_loss"])
    assert metrics["global_train_loss"] == kept["global_train_loss"]
    assert f"{kept['fedmr_models']['global']:.4f}" in R.fedmr_model_lines([metrics], "fedmr")[0]
    # a run kept before its derived metrics were recorded is run again, not reported blind
    doc = json.loads((tmp_path / "run" / "reproduce.json").read_text())
    del doc["derived"]
    (tmp_path / "run" / "reproduce.json").write_text(json.dumps(doc))
    assert not R.execute(job).get("resumed")


def test_a_run_that_diverges_is_kept_and_counted_at_chance(tmp_path):
    """A non-finite loss ends a run. That is the algorithm's outcome, not the tool's failure:
    reproduce.json keeps it (a sitting does not repeat it), and the report counts the run
    with chance accuracy -- dropping it would flatter the arm that diverged -- with its
    targets reached only in the rounds before, and says so in the arm's row."""
    import json
    R = _reproduce()
    # an MLP at learning rate 2, 8 steps a round: NaN in round 3 (rounds 1-2 recorded)
    config = {"dataset": {"name": "digits"}, "partition": {"name": "iid", "clients": 2},
              "model": {"name": "mlp"}, "train": {"lr": 2.0, "batch_size": 32, "steps": 8},
              "rounds": 4, "eval_every": 1, "seed": 0}
    out = str(tmp_path / "run")
    job = {"key": "t/s/a/seed0", "out": out, "config": config, "threads": 1, "resume": True}
    first = R.execute(job)
    assert first["ok"] and first["final_accuracy"] is None, first
    assert first["diverged"]["round"] == 3 and first["diverged"]["chance"] == 0.1
    assert "non-finite" in first["diverged"]["error"]
    again = R.execute(job)
    assert again["resumed"] and again["diverged"] == first["diverged"]
    rerun = R.execute(dict(job, config=dict(config, rounds=5)))   # a changed config reruns
    assert not rerun.get("resumed") and rerun["diverged"]["round"] == 3
    first = R.execute(job)    # ... and its record replaced the first one's
    assert not first.get("resumed") and first["diverged"]["round"] == 3

    spec = R.Job("t", "s", "a", 0, out, config, config)
    metrics = R.run_metrics(spec, [0.05, 0.99], ["bytes"])
    assert metrics["final_accuracy"] == 0.1 and metrics["diverged"] == 3
    assert metrics["rounds"] == 2 and sorted(metrics["curve"]) == [1, 2]
    assert metrics["best_accuracy"] == max(0.1, *metrics["curve"].values())
    assert metrics["rounds_to:0.05"] == 1 and metrics["rounds_to:0.99"] is None
    assert metrics["bytes"] is None and metrics["final_test_loss"] is None
    # paired against an arm that did not diverge, the chance accuracy counts against it
    import verdicts as V
    others = [dict(metrics, seed=s, diverged=3 + s) for s in range(5)]
    better = [dict(metrics, seed=s, diverged=None, final_accuracy=0.9 + s / 100)
              for s in range(5)]
    seeds, (va, vb) = R.aligned(others, better, key="final_accuracy")
    assert V.paired(va, vb, True).verdict == V.CONTRADICTED
    assert R.divergence_note(others) == " — diverged in 5 of 5 seeds (rounds 3–7)"
    assert R.divergence_note(better) == ""
    kept = dict(metrics, diverged=None, fedmr_models={"global": 0.5, "models": [0.4, 0.6]})
    line = R.fedmr_model_lines([metrics, kept], "fedmr")[0]
    assert "(1 of 2 seeds diverged; the 1 that did not" in line and "0.5000" in line
    assert json.loads((tmp_path / "run" / "reproduce.json").read_text())["diverged"]["round"] == 3


def test_stop_after_starts_no_run_after_its_time_and_resume_continues(tmp_path):
    """--stop-after ends a sitting: the runs not started are left for the next invocation,
    which (with --resume) keeps the finished ones and runs only the rest."""
    R = _reproduce()
    config = {"dataset": {"name": "digits"}, "partition": {"name": "iid", "clients": 2},
              "model": {"name": "softmax"}, "train": {"lr": 0.05, "batch_size": 32},
              "rounds": 1}
    jobs = [R.Job("t", "s", "a", seed, str(tmp_path / f"seed{seed}"), dict(config, seed=seed),
                  dict(config, seed=seed)) for seed in range(5)]
    import time
    now = time.perf_counter
    assert R.run_jobs(jobs, 1, lambda m: None, resume=True, stop_at=now()) == {}
    assert R.run_jobs(jobs, 2, lambda m: None, resume=True, stop_at=now()) == {}
    first = R.run_jobs(jobs[:2], 2, lambda m: None, resume=True, stop_at=now() + 600)
    assert len(first) == 2 and all(st["ok"] for st in first.values())
    second = R.run_jobs(jobs, 1, lambda m: None, resume=True)
    assert len(second) == len(jobs)
    assert {k for k, st in second.items() if st.get("resumed")} == set(first)
    with pytest.raises(SystemExit):
        R.main(["--stop-after", "0"])


@pytest.mark.fashion_mnist
@pytest.mark.parametrize("mode", ["quick", "full", "long"])
def test_every_partition_of_a_tier_can_be_drawn(mode):
    """Every run's partition is drawn as the run would draw it (Dirichlet's minimum size can
    fail for a data limit and a client count: the long tier's first FedMR setting did, at
    min_size 10), so a tier never starts runs that fail at once, many hours into a sitting."""
    R = _reproduce()
    from edgefl.config import dataset_from_config, partition_from_config
    from edgefl.runconfig import run_config_from_mapping
    datasets, drawn = {}, set()
    for path in R.discover(None):
        exp = R.load_experiment(path, mode)
        if mode == "long" and "long" not in exp.tiers:
            continue
        for job in R.make_jobs([exp], "/nonexistent"):
            cfg = run_config_from_mapping(job.resolved).as_config()
            key = json.dumps([job.resolved.get("dataset"), job.resolved.get("partition"),
                              job.resolved.get("seed")], sort_keys=True, default=str)
            if key in drawn:
                continue
            drawn.add(key)
            dkey = json.dumps(job.resolved.get("dataset"), sort_keys=True)
            if dkey not in datasets:
                datasets[dkey] = dataset_from_config(cfg)
            try:
                partition_from_config(cfg, datasets[dkey])
            except ValueError as exc:
                pytest.fail(f"{path} ({mode}): {job.key}: {exc}")


def test_runs_selects_a_sittings_runs_in_the_patterns_order(tmp_path, capsys):
    """--runs PATTERN,...: the matching runs of the tier, in the patterns' order (not by
    cost), each once; a pattern matching nothing is refused naming it; with --runs no
    report is written."""
    R = _reproduce()
    jobs = R.make_jobs([R.load_experiment(R.discover(["fedmr"])[0], "long")], "/nonexistent")
    chosen = R.select_runs(jobs, "fedmr/cnn-dir0.5/fedmr-sgd/seed1, fedmr/cnn-dir0.1/*/seed0,"
                                 "fedmr/cnn-dir0.1/fedavg/seed0")
    assert [j.key for j in chosen] == ["fedmr/cnn-dir0.5/fedmr-sgd/seed1"] + [
        f"fedmr/cnn-dir0.1/{arm}/seed0" for arm in ("fedavg", "fedmr", "fedmr-2stage",
                                                    "fedmr-sgd")]
    with pytest.raises(R.ExperimentError, match=r"--runs: 'fedmr/cnn-dir9/\*' matches no run"):
        R.select_runs(jobs, "fedmr/cnn-dir0.1/*,fedmr/cnn-dir9/*")
    # one digits run of the quick tier, chosen by --runs: it runs, and no report is written
    out = tmp_path / "out"
    code = R.main(["--quick", "--only", "server_optimisers", "--out", str(out), "--workers",
                   "1", "--runs", "server_optimisers/*/fedavg/seed0"])
    assert code == 0
    done = sorted(p.parent.relative_to(out).as_posix() for p in out.rglob("reproduce.json"))
    assert done and all(d.endswith("/fedavg/seed0") for d in done)
    assert not (out / "results.md").exists() and not (out / "manifest.json").exists()
    assert "no report written" in capsys.readouterr().out


def test_report_only_of_other_experiments_than_the_manifests_is_refused(tmp_path, capsys):
    """--report-only takes the section's header (command, wall time, machines) from
    OUT/manifest.json; rendering other experiments under it would credit them with another
    invocation's times, so it is refused, naming both and the ways out."""
    R = _reproduce()
    out = tmp_path / "long"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({
        "mode": "long", "only": ["fedmr_momentum"], "seeds": None,
        "command": "python tools/reproduce.py --long --only fedmr_momentum --workers 1"}))
    code = R.main(["--long", "--report-only", "--only", "fedmr", "--out", str(out),
                   "--results", str(tmp_path / "r.md")])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "r.md").exists()
    assert f"--only fedmr: {out / 'manifest.json'} records the invocation " in err
    assert "(--only fedmr_momentum)" in err and "--long --only fedmr` (its finished" in err


@pytest.mark.fashion_mnist
def test_fedmr_norms_follows_the_k_models(capsys):
    """tools/fedmr_norms.py (the FedMR divergence diagnosis in docs/results.md): one row per
    round with every recombination unit of the model; in stage 1 the K models are the one
    global model (no spread); a non-FedMR arm is refused by name."""
    fedmr_norms = import_tool("fedmr_norms")
    assert fedmr_norms.main(["--tier", "quick", "--setting", "dir0.1", "--rounds", "3",
                             "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["round"] for r in doc["series"]] == [1, 2, 3] and doc["diverged"] is None
    assert len(doc["units"]) == len(doc["series"][0]["layers"]) == 6   # 3 layers, w and b
    assert all(layer["spread"] > 0 for r in doc["series"] for layer in r["layers"])
    assert fedmr_norms.main(["--tier", "quick", "--setting", "dir0.1", "--rounds", "2",
                             "--json", "--set", "strategy.stage1_rounds=5"]) == 0
    stage1 = json.loads(capsys.readouterr().out)
    assert all(layer["spread"] == 0 for r in stage1["series"] for layer in r["layers"])
    with pytest.raises(SystemExit):
        fedmr_norms.main(["--tier", "quick", "--setting", "dir0.1", "--arm", "fedavg"])
    assert "not a FedMR arm" in capsys.readouterr().err


def test_a_resumed_tier_is_summarised_by_its_runs_time_not_its_last_sitting(tmp_path):
    """The long tier is finished over sittings: its last invocation's wall time is minutes,
    so the summary table gives the runs' own times added up; a tier run in one go keeps its
    wall time."""
    R = _reproduce()
    from edgefl.compare import format_duration
    statuses = {f"x/s/a/seed{i}": {"ok": True, "elapsed_s": 3600.0, "resumed": i > 0}
                for i in range(3)}
    manifest = {"command": "python tools/reproduce.py --long", "mode": "long", "runs": 3,
                "workers": 2, "cpus": 2, "machine": "x86_64, Linux", "edgefl": "0", "backend": "c",
                "date": "2026-11-29 08:00", "out": "runs/reproduce-long", "load_start": None,
                "statuses": statuses, "resumed": 2, "wall_s": 3700.0}
    section, meta = R.render_section("long", manifest, [], {}, {})
    assert meta["runs_s"] == 10800.0
    assert f"add up to {format_duration(10800.0)}" in section
    meta["titles"], meta["verdicts"], meta["scales"] = {"x": "t"}, {"x": "Holds"}, {"x": "s"}
    results = tmp_path / "results.md"
    R.write_results(str(results), "long", section, meta)
    quick = dict(meta, wall_s=200.0)
    del quick["runs_s"]
    R.write_results(str(results), "quick", "## Quick run\n", quick)
    text = results.read_text()
    assert f"| long ({format_duration(10800.0)} of runs, over sittings) |" in text
    assert f"| quick ({format_duration(200.0)}) |" in text
    assert section.count("Produced by") == 1 and "Rendered by" not in section
    # every run kept: the last invocation only rendered them, and says so
    statuses["x/s/a/seed0"]["resumed"] = True
    section, _ = R.render_section("long", dict(manifest, resumed=3, wall_s=4.0), [], {}, {})
    assert "Rendered by `python tools/reproduce.py --long`" in section
    assert "Produced by" not in section
    assert "All 3 runs were made by earlier invocations (sittings) and kept" in section


def test_a_tier_made_on_several_cpus_says_which_runs_ran_where():
    """A run's last float bits depend on the CPU's BLAS kernels: a tier finished over
    sittings on different machines says how many runs each CPU made (runs kept from before
    reproduce.json recorded it counted apart); a tier made on one CPU says nothing of it."""
    R = _reproduce()
    cpus = ["AMD EPYC", "AMD EPYC", None]
    statuses = {f"x/s/a/seed{i}": {"ok": True, "elapsed_s": 60.0, "resumed": i > 0,
                                   "cpu": cpu} for i, cpu in enumerate(cpus)}
    statuses["x/s/b/seed0"] = {"ok": False, "elapsed_s": 1.0, "error": "boom"}   # not a run
    manifest = {"command": "python tools/reproduce.py --long", "mode": "long", "runs": 3,
                "workers": 2, "cpus": 2, "machine": "x86_64, Linux", "edgefl": "0",
                "backend": "c", "date": "2026-11-29 08:00", "out": "runs/reproduce-long",
                "load_start": None, "statuses": statuses, "resumed": 2, "wall_s": 70.0}
    section, _ = R.render_section("long", manifest, [], {}, {})
    assert ("CPUs of the runs: 2 on AMD EPYC; 1 before runs recorded it (2026-11-29)"
            in section), section
    for status in statuses.values():
        status["cpu"] = "AMD EPYC"
    section, _ = R.render_section("long", manifest, [], {}, {})
    assert "CPUs of the runs" not in section


# ---------------------------------------------------------------------------------------
# the interval of a censored comparison: the median's, dual of the sign test
# ---------------------------------------------------------------------------------------

def test_median_rank_matches_the_binomial_tails():
    """k of the 95% median interval: P(X <= k - 1) < 0.025 for X ~ Binomial(m, 1/2)."""
    assert [V.median_rank(m) for m in (1, 5, 6, 7, 8, 9, 10, 20)] == [0, 0, 1, 1, 1, 2, 2, 6]
    for m in range(1, 40):
        k = V.median_rank(m)
        tail = sum(math.comb(m, i) for i in range(k)) / 2 ** m
        assert tail < 0.025 <= tail + math.comb(m, k) / 2 ** m


def test_censored_interval_uses_the_horizon_as_a_bound_not_a_value():
    """FedAvg misses the target in 7 of 10 seeds within 50 rounds: each of those gains is
    at least 51 - a, not 51 - a (a value); the interval's lower end is the 2nd smallest
    bound (k = 2 for 10 seeds) and its upper end stays open."""
    better = [30, 31, 29, 33, 35, 30, 28, 40, 39, 31]
    than = [None, None, 35, None, None, 38, None, None, None, 35]
    v = V.paired(better, than, higher_is_better=False, horizons=([50] * 10, [50] * 10))
    assert v.verdict == V.HOLDS and v.median == (6, math.inf)
    assert "median gain over the 10 seeds with a sign 95% CI [+6, +∞)" in V.describe(v)
    # without horizons the censored seeds only say "at least one round saved"
    w = V.paired(better, than, higher_is_better=False)
    assert w.median == (1, math.inf) and w.verdict == V.HOLDS


@pytest.mark.parametrize("seed", range(200))
def test_censored_interval_excludes_zero_exactly_when_the_sign_test_decides(seed):
    """Random censored comparisons (ties, one-sided and two-sided censoring, 5-12 seeds):
    the median interval lies above zero iff the sign test holds, below iff contradicted."""
    rng = random.Random(seed)
    n, horizon = rng.randint(5, 12), 40
    a = [rng.choice([None, rng.randint(5, horizon)]) for _ in range(n)]
    b = [rng.choice([None, rng.randint(5, horizon)]) for _ in range(n)]
    if all(x is not None for x in a + b):
        b[0] = None
    v = V.paired(a, b, higher_is_better=False, horizons=([horizon] * n, [horizon] * n))
    lo, hi = v.median
    assert (lo > 0) == (v.verdict == V.HOLDS), (a, b, v)
    assert (hi < 0) == (v.verdict == V.CONTRADICTED), (a, b, v)
