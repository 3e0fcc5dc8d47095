"""The run configuration of `edgefl simulate`: YAML (plus `--set dotted.key=value`
overrides, parsed by edgefl.config) validated into frozen dataclasses, with defaults.

    dataset:   {name: digits}                 # + the dataset's options (edgefl.data)
    partition: {name: iid, clients: 10}       # + the partitioner's options
    model:     {name: softmax}                # + the model's options; init: uniform | zeros
                                              #   | an earlier run's directory or model.npz
    strategy:  {name: mfl, gamma: 0.5}        # + the algorithm's parameters as sibling keys
                                              #   (fedavg/mfl/fednova: robust, docs/robust.md)
    train:     {lr: 0.1, batch_size: 32, epochs: 1}   # or steps; momentum, weight_decay, lr_decay
    rounds: 20
    clients_per_round: 5                      # or fraction (of partition.clients); default: all
    seed: 0
    eval_every: 1                             # evaluate every k rounds (and after the last)
    attack: {kind: sign_flip, fraction: 0.2}  # optional: malicious clients (edgefl.attacks)
    sim_fleet: {rpi-zero2w: 0.3, rpi4: 0.7}   # optional: simulated boards (edgefl.virtual_fleet;
                                              #   `fleet:` is its deprecated old name)
    privacy: {secure_aggregation: {...}, dp: {...}}   # optional (edgefl.privacy.settings)

Every error names the file, the dotted key (and says when it came from --set) and the valid
choices. A config may also be named by the stem of a file shipped in edgefl/configs
(`edgefl simulate quickstart`).

`model.init` naming a file is a warm start: the run's round-0 model is that checkpoint's
(`RunConfig.init_file` resolves the path, edgefl.runs.prepare reads it). Reading the config
never opens the file: a board or an edge aggregator reads the same config without it.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import types
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any, Mapping

from . import kernels
from .attacks import AttackError, attack_section
from .config import Config, ConfigError, check_number, load_config
from .virtual_fleet import FLEET_KEY, OLD_FLEET_KEY, fleet_in, fleet_section
from .data import dataset_options, partition_options
from .models import ModelSpecError, check_model_spec, model_names
from .privacy import settings as privacy_settings
from .privacy.settings import AdaptiveClip, DifferentialPrivacy, Privacy, SecureAggregation
from .strategies import (PrepareContext, StrategyError, get_strategy, strategy_names,
                         strategy_params)

__all__ = ["TrainConfig", "RunConfig", "load_run_config", "run_config_from_mapping",
           "builtin_configs", "resolve_config_path", "ConfigError"]

TOP_KEYS = ("dataset", "partition", "model", "strategy", "train", "rounds", "clients_per_round",
            "fraction", "seed", "eval_every", "attack", "privacy", "sim_fleet", "fleet")
# model.init: "uniform" is Model.init's seeded default; "zeros" is w(0) = 0 for the convex
# models (what the MFL reproduction uses; the paper only asks for equal initial values);
# any other string is the path of a checkpoint to start from (RunConfig.init_file).
# The other model keys are the model's options.
MODEL_INITS = ("uniform", "zeros")
DEFAULTS = {
    "dataset": {"name": "digits"},
    "partition": {"name": "iid", "clients": 10},
    "model": {"name": "softmax"},
    "strategy": {"name": "fedavg"},
}


@dataclass(frozen=True)
class TrainConfig:
    """Local hyper-parameters (the `train:` section). epochs and steps are exclusive: setting
    steps (> 0) runs that many minibatch steps per round instead of epochs."""
    lr: float = 0.1
    batch_size: int = 32
    epochs: int = 1
    steps: int = 0
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_decay: float = 1.0          # eta_t = lr * lr_decay**(t-1)

    def kernel_kwargs(self) -> dict:
        """The keyword arguments of kernels.train_config (everything but lr_decay)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lr_decay"}

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.pop("steps" if self.steps == 0 else "epochs")
        return out


@dataclass(frozen=True)
class RunConfig:
    dataset: Mapping[str, Any]
    partition: Mapping[str, Any]
    model: Mapping[str, Any]
    strategy: str
    strategy_params: Mapping[str, Any]
    train: TrainConfig = field(default_factory=TrainConfig)
    rounds: int = 10
    clients_per_round: int = 0     # resolved: the M selected each round
    seed: int = 0
    eval_every: int = 1
    path: str | None = None        # the file it came from (relative dataset paths use it)
    attack: Mapping[str, Any] | None = None   # the `attack:` section (edgefl.attacks), resolved
    fleet: Mapping[str, Any] | None = None    # `sim_fleet:` (edgefl.virtual_fleet), resolved
    privacy: Privacy | None = None            # the `privacy:` section (edgefl.privacy.settings)

    @property
    def clients(self) -> int:
        return int(self.partition["clients"])

    @property
    def base_dir(self) -> str | None:
        """The config file's directory, where a relative path it names is looked up first
        (None: a config of no file)."""
        return os.path.dirname(os.path.abspath(self.path)) if self.path else None

    def init_file(self) -> str | None:
        """The absolute path of the checkpoint `model.init` names (a run directory or a
        model.npz; not opened here), or None for a seeded model (uniform, zeros). A relative
        path is taken beside the config file when it exists there, else in the working
        directory, as for DUW's weight file (PrepareContext.resolve): a config file's own
        neighbours are found from any directory, and `--set model.init=runs/x` works with a
        built-in config too."""
        init = self.model.get("init", "uniform")
        if init in MODEL_INITS:
            return None
        return os.path.abspath(PrepareContext(base_dir=self.base_dir).resolve(init))

    def init_typo(self) -> str | None:
        """What is wrong with a model.init that is a bare word (no path separator, no
        suffix) naming no file beside the config file or in the working directory: a
        misspelt uniform or zeros (`unifrom`) far more likely than a lost run directory;
        the close match is suggested. None when model.init is not such a word."""
        name = self.model.get("init", "uniform")
        path = self.init_file()
        if path is None or os.path.exists(path) or os.sep in name or "/" in name or \
                os.path.splitext(name)[1] or name.startswith("~"):
            return None
        close = difflib.get_close_matches(name.lower(), MODEL_INITS, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else \
            "model.init is uniform, zeros or the path of an earlier run's directory or model.npz"
        places = f"beside the config file or in the working directory ({path})" \
            if self.base_dir else f"in the working directory ({path})"
        return (f"{name!r}: not {' or '.join(MODEL_INITS)}, and no such run directory or "
                f"model.npz {places}; {hint}")

    def to_dict(self) -> dict:
        """The resolved configuration in the YAML vocabulary; loading it again gives the
        same RunConfig."""
        out = {
            "dataset": dict(self.dataset),
            "partition": dict(self.partition),
            "model": dict(self.model),
            "strategy": {"name": self.strategy, **dict(self.strategy_params)},
            "train": self.train.to_dict(),
            "rounds": self.rounds,
            "clients_per_round": self.clients_per_round,
            "seed": self.seed,
            "eval_every": self.eval_every,
        }
        if self.attack is not None:       # absent when unset: plain runs keep their config
            out["attack"] = dict(self.attack)
        if self.fleet is not None:        # absent when unset, as attack
            out[FLEET_KEY] = {k: dict(v) if isinstance(v, Mapping) else v
                            for k, v in self.fleet.items()}
        if self.privacy is not None:
            out["privacy"] = self.privacy.to_dict()
        return out

    def as_config(self) -> Config:
        """The edgefl.config mapping for dataset_from_config / partition_from_config."""
        return Config({"dataset": dict(self.dataset), "partition": dict(self.partition),
                       "seed": self.seed}, self.path)


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------

def builtin_configs() -> dict:
    """{name: path} of the configs shipped in edgefl/configs."""
    root = resources.files("edgefl").joinpath("configs")
    if not root.is_dir():
        return {}
    return {entry.name[:-5]: str(entry) for entry in sorted(root.iterdir(), key=lambda e: e.name)
            if entry.name.endswith(".yaml")}


def resolve_config_path(name_or_path: str | os.PathLike) -> str:
    """A file path as given if it exists, else the shipped config of that name (also when a
    directory of that name is in the way, e.g. the output of an earlier run)."""
    path = os.fspath(name_or_path)
    if os.path.exists(path) and not os.path.isdir(path):
        return path
    shipped = builtin_configs()
    stem = os.path.basename(path)
    stem = stem[:-5] if stem.endswith(".yaml") else stem
    if os.sep not in path and stem in shipped:
        return shipped[stem]
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a directory, not a config file (and not a built-in "
                          f"config: {', '.join(shipped) or 'none installed'})")
    raise ConfigError(f"{path}: config file does not exist, and it is not a built-in config "
                      f"({', '.join(shipped) or 'none installed'})")


def load_run_config(name_or_path: str | os.PathLike, overrides=()) -> RunConfig:
    """Read and validate a run config file (or a built-in config by name) with overrides."""
    path = resolve_config_path(name_or_path)
    raw = load_config(path, overrides)
    return run_config_from_mapping(raw, path, overrides)


def run_config_from_mapping(data: Mapping, path: str | None = None, overrides=()) -> RunConfig:
    """Validate a config mapping (as read from YAML) into a RunConfig."""
    v = _Validator(path, overrides)
    data = dict(data)
    for key in data:
        if key not in TOP_KEYS:
            v.fail(key, f"unknown key; valid keys: "
                        f"{', '.join(k for k in TOP_KEYS if k != OLD_FLEET_KEY)}")

    dataset = v.section(data, "dataset")
    v.options(dataset, "dataset", dataset_options)
    partition = v.section(data, "partition")
    v.options(partition, "partition", partition_options, extra=("clients",))
    clients = partition.setdefault("clients", DEFAULTS["partition"]["clients"])
    v.integer("partition.clients", clients, lo=1)
    model = v.section(data, "model")
    if model["name"] not in model_names():
        v.fail("model.name", f"unknown model {model['name']!r}; valid: {', '.join(model_names())}")
    init = model.get("init", "uniform")
    if not isinstance(init, str) or not init.strip():
        v.fail("model.init", f"{init!r}: give {', '.join(MODEL_INITS)}, or the path of an "
                             f"earlier run's directory or its model.npz (a warm start)")
    right = next((m for m in MODEL_INITS if init.lower() == m != init), None)
    if right is not None:      # `init: Zeros` would otherwise be the path of a run directory
        v.fail("model.init", f"{init!r}: write {right!r} (model.init is case-sensitive: "
                             f"{', '.join(MODEL_INITS)}, or the path of an earlier run's "
                             f"directory or its model.npz)")
    try:   # the options' names and types, here: every command that reads a config checks them
        check_model_spec(model, extra=("init",))
    except ModelSpecError as exc:
        v.fail(f"model.{exc.key}", exc.problem)

    strategy = v.section(data, "strategy")
    name = strategy.pop("name")
    if name not in strategy_names():
        v.fail("strategy.name", f"unknown strategy {name!r}; valid: {', '.join(strategy_names())}")
    valid_params = strategy_params(name, extensions=True)
    for key in strategy:
        if key not in valid_params:
            v.fail(f"strategy.{key}", f"unknown parameter of {name}; valid: "
                                      f"{', '.join(['name', *valid_params])}")
    try:
        instance = get_strategy(name, **strategy)
    except StrategyError as exc:   # a bad value; the message names the parameter
        v.fail(_strategy_key(str(exc), strategy), str(exc))
    params = instance.hyperparameters()

    train = _train(v, data.get("train", {}))
    rounds = v.integer("rounds", data.get("rounds", 10), lo=1)
    seed = v.integer("seed", data.get("seed", 0), lo=0)
    eval_every = v.integer("eval_every", data.get("eval_every", 1), lo=1)
    m = _clients_per_round(v, data, clients)
    try:
        attack = attack_section(data.get("attack"), clients)
    except AttackError as exc:
        v.fail(exc.key, exc.problem)
    privacy = _privacy(v, data.get("privacy"), m)
    if privacy is not None:
        refused = privacy_settings.refusal(privacy, instance, params.get("robust"), attack)
        if refused:
            v.fail(*refused)
    fleet = fleet_section(fleet_in(data, v.fail, path or "<config>"), v.fail)
    if fleet is not None and fleet["deadline_s"] and getattr(instance, "asynchronous", False):
        v.fail(f"{FLEET_KEY}.deadline_s", f"a deadline closes synchronous rounds; {name} is "
                                   f"asynchronous (its buffer closes a step)")
    return RunConfig(dataset=_frozen(dataset), partition=_frozen(partition), model=_frozen(model),
                     strategy=name, strategy_params=_frozen(params), train=train, rounds=rounds,
                     clients_per_round=m, seed=seed, eval_every=eval_every, path=path,
                     attack=None if attack is None else _frozen(attack), privacy=privacy,
                     fleet=None if fleet is None else _frozen(fleet))


def _strategy_key(message: str, params: Mapping) -> str:
    """The dotted key a strategy's error names: "strategy.gamma", or a nested parameter's
    "strategy.robust.trim" (the messages say " robust.trim = ...")."""
    for key in params:
        found = re.search(rf" ({re.escape(key)}(?:\.\w+)*) = ", message)
        if found:
            return f"strategy.{found.group(1)}"
    return "strategy"


def _train(v: "_Validator", section) -> TrainConfig:
    if not isinstance(section, Mapping):
        v.fail("train", f"must be a mapping of {', '.join(f.name for f in fields(TrainConfig))}, "
                        f"got {section!r}")
    valid = [f.name for f in fields(TrainConfig)]
    for key in section:
        if key not in valid:
            v.fail(f"train.{key}", f"unknown key; valid keys: {', '.join(valid)}")
    if "epochs" in section and "steps" in section:
        v.fail("train.steps", "give train.epochs or train.steps, not both")
    values = {}
    defaults = TrainConfig()
    for key in ("lr", "momentum", "weight_decay", "lr_decay"):
        values[key] = v.number(f"train.{key}", section.get(key, getattr(defaults, key)))
    values["batch_size"] = v.integer("train.batch_size", section.get("batch_size", 32), lo=0)
    if "steps" in section:
        values["steps"] = v.integer("train.steps", section["steps"], lo=1)
        values["epochs"] = 0
    else:
        values["epochs"] = v.integer("train.epochs", section.get("epochs", 1), lo=1)
    if not values["lr"] > 0:
        v.fail("train.lr", f"{values['lr']} must be > 0")
    if not 0 < values["lr_decay"] <= 1:
        v.fail("train.lr_decay", f"{values['lr_decay']} must be in (0, 1]")
    try:
        kernels.train_config(**{k: x for k, x in values.items() if k != "lr_decay"})
    except ValueError as exc:
        key = next((k for k in values if str(exc).startswith(f"train config: {k} ")), None)
        v.fail(f"train.{key}" if key else "train", str(exc).replace("train config: ", ""))
    return TrainConfig(**values)


def _privacy(v: "_Validator", section, per_round: int) -> Privacy | None:
    """The `privacy:` section (keys and meaning: edgefl/privacy/settings.py), or None."""
    if section is None:
        return None
    _keys(v, "privacy", section, ("secure_aggregation", "dp"))
    if not section:
        v.fail("privacy", "is empty; give secure_aggregation, dp or both (or drop the section)")
    secagg = dp = None
    if section.get("secure_aggregation") is not None:
        secagg = _secure_aggregation(v, section["secure_aggregation"], per_round)
    if section.get("dp") is not None:
        dp = _dp(v, section["dp"])
        if dp.mode == "distributed" and secagg is None:
            v.fail("privacy.dp.mode", "distributed noise protects a client only when the "
                                      "aggregator sees nothing but the sum; add "
                                      "privacy.secure_aggregation or use mode: central")
        if dp.mode == "distributed" and secagg is not None:
            # each client's noisy delta goes through the quantiser, which clips every value
            # to [-clip_range, clip_range]; a clipped noise share is less noise than the
            # accountant counts, so the range must hold the clipped delta plus 8 share stds
            share = dp.noise_multiplier * dp.clip / math.sqrt(per_round)
            need = dp.clip + 8 * share
            if secagg.clip_range < need:
                v.fail("privacy.secure_aggregation.clip_range",
                       f"{secagg.clip_range:g} would clip the noise: each client's value is "
                       f"up to privacy.dp.clip = {dp.clip:g} plus a noise share of std "
                       f"{share:.3g}; give clip_range >= {need:.3g} (clip + 8 stds)")
        if secagg is not None and dp.adaptive_clip is not None:
            v.fail("privacy.dp.adaptive_clip", "adapts the clip without secure aggregation "
                                               "only: under it the boards clip, so the clip "
                                               "would have to reach them each round and "
                                               "their clip bits go through the secure sum; "
                                               "drop one of the two")
    return Privacy(secure_aggregation=secagg, dp=dp)


def _keys(v: "_Validator", where: str, section, valid) -> None:
    if not isinstance(section, Mapping):
        v.fail(where, f"must be a mapping of {', '.join(valid)}, got {section!r}")
    for key in section:
        if key not in valid:
            v.fail(f"{where}.{key}", f"unknown key; valid keys: {', '.join(valid)}")


def _secure_aggregation(v: "_Validator", section, per_round: int) -> SecureAggregation:
    where = "privacy.secure_aggregation"
    _keys(v, where, section, privacy_settings.SECAGG_KEYS)
    d = SecureAggregation()
    threshold = v.number(f"{where}.threshold", section.get("threshold", d.threshold))
    if threshold > 1:
        if threshold != int(threshold):
            v.fail(f"{where}.threshold", f"{threshold}: a count (> 1) must be whole; a "
                                         f"fraction of the round's clients is in (0.5, 1]")
        # more than half, as a fraction must be: the never-both rule protects a client
        # only when two disjoint groups of holders cannot each reach t
        lo = max(2, per_round // 2 + 1)
        if not lo <= threshold <= per_round:
            v.fail(f"{where}.threshold", f"{int(threshold)} clients: must be between {lo} and "
                                         f"the {per_round} clients of a round (more than half "
                                         f"of them: at most half would let two disjoint "
                                         f"halves each unmask)")
    elif not 0.5 < threshold <= 1:
        v.fail(f"{where}.threshold", f"{threshold}: a fraction of the round's clients must be "
                                     f"in (0.5, 1] (at most half would let two disjoint halves "
                                     f"each unmask), or give a count > 1")
    neighbours = v.integer(f"{where}.neighbours", section.get("neighbours", d.neighbours), lo=0)
    if neighbours == 1:
        v.fail(f"{where}.neighbours", "1 neighbour masks with one peer only; give >= 2, or 0 "
                                      "for all")
    ring_bits = v.integer(f"{where}.ring_bits", section.get("ring_bits", d.ring_bits))
    if ring_bits not in privacy_settings.RING_BITS:
        v.fail(f"{where}.ring_bits", f"{ring_bits}; valid: "
                                     f"{', '.join(map(str, privacy_settings.RING_BITS))}")
    clip_range = v.number(f"{where}.clip_range", section.get("clip_range", d.clip_range))
    if not clip_range > 0:
        v.fail(f"{where}.clip_range", f"{clip_range} must be > 0")
    elif clip_range < _F32_TINY:
        # every float32 update would clip to about 0, and the quantiser's scale (levels /
        # clip_range) overflows float64: the kernels refuse it, but only at the first round
        v.fail(f"{where}.clip_range", f"{clip_range:g} is below the smallest normal float32 "
                                      f"({_F32_TINY:.3g}): every value would clip to it")
    max_attempts = v.integer(f"{where}.max_attempts",
                             section.get("max_attempts", d.max_attempts), lo=1)
    if per_round < 2:
        v.fail(where, f"needs at least 2 clients a round (clients_per_round is {per_round}): "
                      f"the sum of one update is that update")
    return SecureAggregation(threshold=threshold, neighbours=neighbours, ring_bits=ring_bits,
                             clip_range=clip_range, max_attempts=max_attempts)


_F32_TINY = 2.0 ** -126        # the smallest normal float32 (numpy.finfo(float32).tiny)


def _dp(v: "_Validator", section) -> DifferentialPrivacy:
    where = "privacy.dp"
    _keys(v, where, section, privacy_settings.DP_KEYS)
    d = DifferentialPrivacy()
    mode = section.get("mode", d.mode)
    if mode not in privacy_settings.DP_MODES:
        v.fail(f"{where}.mode", f"{mode!r}; valid: {', '.join(privacy_settings.DP_MODES)}")
    clip = v.number(f"{where}.clip", section.get("clip", d.clip))
    if not clip > 0:
        v.fail(f"{where}.clip", f"{clip} must be > 0")
    noise = v.number(f"{where}.noise_multiplier",
                     section.get("noise_multiplier", d.noise_multiplier))
    if noise < 0:
        v.fail(f"{where}.noise_multiplier", f"{noise} must be >= 0")
    delta = v.number(f"{where}.delta", section.get("delta", d.delta))
    if not 0 < delta < 1:
        v.fail(f"{where}.delta", f"{delta} must be in (0, 1)")
    target = section.get("target_epsilon")
    if target is not None:
        target = v.number(f"{where}.target_epsilon", target)
        if not target > 0:
            v.fail(f"{where}.target_epsilon", f"{target} must be > 0")
        if noise == 0:
            v.fail(f"{where}.target_epsilon", "a budget needs noise: noise_multiplier is 0, "
                                              "so epsilon is infinite from the first round")
    accountant = section.get("accountant", d.accountant)
    if accountant not in privacy_settings.ACCOUNTANTS:
        v.fail(f"{where}.accountant", f"{accountant!r}; valid: "
                                      f"{', '.join(privacy_settings.ACCOUNTANTS)}")
    adaptive = None
    if section.get("adaptive_clip") is not None:
        a_where = f"{where}.adaptive_clip"
        raw = section["adaptive_clip"]
        _keys(v, a_where, raw, privacy_settings.ADAPTIVE_KEYS)
        a = AdaptiveClip()
        quantile = v.number(f"{a_where}.target_quantile",
                            raw.get("target_quantile", a.target_quantile))
        if not 0 < quantile < 1:
            v.fail(f"{a_where}.target_quantile", f"{quantile} must be in (0, 1)")
        lr = v.number(f"{a_where}.lr", raw.get("lr", a.lr))
        if not lr > 0:
            v.fail(f"{a_where}.lr", f"{lr} must be > 0")
        count_noise = raw.get("count_noise")
        if count_noise is not None:
            count_noise = v.number(f"{a_where}.count_noise", count_noise)
            if count_noise < 0:
                v.fail(f"{a_where}.count_noise", f"{count_noise} must be >= 0")
        adaptive = AdaptiveClip(target_quantile=quantile, lr=lr, count_noise=count_noise)
    reproducible = section.get("reproducible", d.reproducible)
    if not isinstance(reproducible, bool):
        v.fail(f"{where}.reproducible", f"{reproducible!r} must be true or false")
    return DifferentialPrivacy(mode=mode, clip=clip, noise_multiplier=noise, delta=delta,
                               target_epsilon=target, accountant=accountant,
                               adaptive_clip=adaptive, reproducible=reproducible)


def _clients_per_round(v: "_Validator", data: Mapping, clients: int) -> int:
    if "clients_per_round" in data and "fraction" in data:
        v.fail("fraction", "give clients_per_round or fraction, not both")
    if "clients_per_round" in data:
        m = v.integer("clients_per_round", data["clients_per_round"], lo=1)
        if m > clients:
            v.fail("clients_per_round", f"{m} is more than partition.clients = {clients}")
        return m
    fraction = v.number("fraction", data.get("fraction", 1.0))
    if not 0 < fraction <= 1:
        v.fail("fraction", f"{fraction} must be in (0, 1]")
    # M = round(C * N), at least 1: our reading of a client fraction C (FedUmf's C, §5.1.2)
    return max(1, min(clients, int(round(fraction * clients))))


def _frozen(mapping: Mapping) -> Mapping:
    return types.MappingProxyType(dict(mapping))


class _Validator:
    """Builds error messages: file, dotted key (and whether --set gave it), problem."""

    def __init__(self, path: str | None, overrides=()):
        self.path = path or "<config>"
        self.overridden = {item.partition("=")[0].strip() for item in overrides}

    def fail(self, key: str, problem: str):
        parts = re.sub(r"\[\d+\]", "", key).split(".")   # model.conv[0].k: --set model.conv=...
        from_set = any(".".join(parts[:i]) in self.overridden for i in range(1, len(parts) + 1))
        raise ConfigError(f"{self.path}: {key}{' (from --set)' if from_set else ''}: {problem}")

    def section(self, data: Mapping, name: str) -> dict:
        """A named section as a dict with a string `name` (a bare string is the name)."""
        value = data.get(name, DEFAULTS[name])
        if isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, Mapping):
            self.fail(name, f"must be a mapping with a name, got {value!r}")
        value = {"name": DEFAULTS[name]["name"], **value}
        if not isinstance(value["name"], str):
            self.fail(f"{name}.name", f"must be a string, got {value['name']!r}")
        return value

    def options(self, section: dict, kind: str, options_of, extra=()) -> None:
        try:
            valid = options_of(section["name"])
        except ValueError as exc:
            self.fail(f"{kind}.name", str(exc))
        for key in section:
            if key != "name" and key not in valid and key not in extra:
                choices = ", ".join(("name", *extra, *valid))
                self.fail(f"{kind}.{key}", f"unknown option of {kind} {section['name']!r}; "
                                           f"valid: {choices}")

    def integer(self, key: str, value, lo: int | None = None) -> int:
        return check_number(value, lambda problem: self.fail(key, problem), integer=True,
                            minimum=lo)

    def number(self, key: str, value) -> float:
        return check_number(value, lambda problem: self.fail(key, problem))
