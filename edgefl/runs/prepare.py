"""A run of a RunConfig made concrete, for every way of running it: `prepare_run` loads the
data set, partitions it, builds the model and its initial buffer (seeded, or an earlier
run's model: `model.init`, `initial_params`) and the strategy (after its offline phase,
`Strategy.prepare`, e.g. DUW's table): a `PreparedRun`, what `edgefl simulate` (edgefl.sim)
and `edgefl aggregator` (edgefl.roles.runner) start from.
`client_shard` is one client's part of it, for a client that is a process of its own. A run
ends in a `RunResult`: the server state, the clients' states, one record per round and the
global model.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from collections.abc import Mapping

import numpy as np

from .. import kernels
from ..checkpoint import ModelFile, model_sha256, read_model
from ..config import dataset_from_config, partition_from_config
from ..data.layout import contiguous
from ..data.partition import Shards, Tiled
from ..errors import CheckpointError, ConfigError, KernelError
from ..models import Model, ModelSpecError, build_model, model_options
from ..privacy import NO_HOOKS, PrivacyHooks
from ..runconfig import RunConfig
from ..strategies import LocalData, PrepareContext, Setup, State, Strategy, get_strategy
from .phases import phase

log = logging.getLogger("edgefl.runs.prepare")

__all__ = ["PreparedRun", "RunResult", "ShardClients", "build_run_model", "client_shard",
           "initial_params", "local_datasets", "prepare_run", "privacy_hooks",
           "read_init_file"]


@dataclass
class RunResult:
    """How a run ended, in process or over a broker."""
    state: State                      # the server state after the last round
    client_states: dict               # {client: State | None}
    history: list = field(default_factory=list)   # one metrics dict per round
    params: np.ndarray | None = None  # strategy.global_model(state)
    stopped: dict | None = None       # why the run ended before its last round (errors.stop_record)

    @property
    def model_sha256(self) -> str:
        return model_sha256(self.params)


def local_datasets(dataset, split, model: Model, stop=None) -> dict:
    """{client: LocalData} for a Dataset and a Partition (per-client labels when the
    partitioner replaced them, as label-noise does); `stop`, a kernels.StopFlag, stops
    their local rounds."""
    out = {}
    for c, idx in enumerate(split.indices):
        y = split.labels[c] if split.labels is not None else dataset.y_train[idx]
        out[c] = LocalData(c, model, np.ascontiguousarray(dataset.x_train[idx]),
                           np.ascontiguousarray(y), stop=stop)
    return out


class ShardClients(Mapping):
    """{client: LocalData} of a split laid out contiguously (`data.layout.contiguous`):
    client c's x and y are rows offsets[s]..offsets[s+1] of the one training array, s its
    shard (c itself, or c mod the shard count of a tiled split). The training set is
    checked against the model once, here; a client's LocalData is made when asked for (a
    few microseconds: two views) and carries its rows of that check, so nothing is kept
    per client and nothing is checked per client -- a million clients cost two arrays of
    offsets, not a million objects."""

    def __init__(self, dataset, split, model: Model, stop=None):
        indices = split.indices
        shards = indices.base if isinstance(indices, Tiled) else indices
        if not isinstance(shards, Shards):
            raise TypeError("ShardClients: the split must be laid out (data.layout.contiguous)")
        self.offsets = shards.offsets
        self._bounds = shards.offsets.tolist()      # ints: S + 1 of them, S <= samples
        self.shards = len(shards)
        self.clients = len(indices)
        labels = split.labels.base if isinstance(split.labels, Tiled) else split.labels
        self.y = dataset.y_train if labels is None else labels.order
        self.checked = kernels.Samples(model, dataset.x_train, self.y)   # once, as a whole
        self.model, self.stop = model, stop

    def __len__(self) -> int:
        return self.clients

    def __iter__(self):
        return iter(range(self.clients))

    def __contains__(self, c) -> bool:
        return isinstance(c, (int, np.integer)) and not isinstance(c, bool) \
            and 0 <= c < self.clients

    def covers(self, clients) -> bool:
        """Whether every id in `clients` (a range, or any iterable) is one of these."""
        if isinstance(clients, range):
            return len(clients) == 0 or (clients.step > 0 and clients.start >= 0
                                         and clients[-1] < self.clients)
        return all(c in self for c in clients)

    def __getitem__(self, c) -> LocalData:
        # once per client trained, every round: plain ints and no NumPy scalars on this path
        if type(c) is not int:
            if not isinstance(c, np.integer):
                raise KeyError(c)
            c = int(c)
        if not 0 <= c < self.clients:
            raise KeyError(c)
        s = c % self.shards
        start, stop = self._bounds[s], self._bounds[s + 1]
        return LocalData.of_samples(c, self.checked.rows(start, stop), self.y[start:stop],
                                    self.stop)


@dataclass
class PreparedRun:
    """A RunConfig made concrete: data, split, model, initial parameters, the strategy (after
    its offline phase, e.g. DUW's table), the Setup (units filled in) and each client's
    LocalData. What `simulate` and `edgefl aggregator` start from."""
    config: RunConfig
    dataset: object
    split: object
    model: Model
    init_params: np.ndarray
    strategy: Strategy
    setup: Setup
    clients: Mapping                  # {client: LocalData}: a ShardClients
    hooks: PrivacyHooks = NO_HOOKS    # DP's (edgefl.privacy.dp), when the config asks for it
    warm_start: dict | None = None    # model.init's checkpoint, model_sha256, round; or None


def build_run_model(config: RunConfig, dataset) -> Model:
    model_spec = {k: v for k, v in config.model.items() if k != "init"}
    try:
        return build_model(model_spec, dataset.input_shape, dataset.num_classes)
    except ModelSpecError as exc:      # (a RunConfig not read by load_run_config)
        raise ConfigError(f"{config.path or '<config>'}: model.{exc.key}: {exc.problem}") \
            from None
    except KernelError as exc:
        raise ConfigError(f"{config.path or '<config>'}: model: {exc}") from None


def read_init_file(config: RunConfig) -> ModelFile | None:
    """The checkpoint `model.init` names, read and checked (checkpoint.read_model), or None
    for a seeded model. ConfigError naming the config, the key and the file: missing (a
    relative path: both places it was looked for), unreadable, inconsistent."""
    path = config.init_file()
    if path is None:
        return None
    where = f"{config.path or '<config>'}: model.init"
    given = os.path.expanduser(config.model["init"])
    typo = config.init_typo()
    if typo is not None:
        raise ConfigError(f"{where}: {typo}")
    if not os.path.exists(path) and not os.path.isabs(given):
        beside = os.path.join(config.base_dir, given) if config.base_dir else path
        places = f"at {path}" if os.path.normpath(beside) == path else \
            f"beside the config file ({beside}) or in the working directory ({path})"
        raise ConfigError(f"{where}: {config.model['init']}: no run directory or model.npz "
                          f"{places}; model.init is uniform, zeros or the path of an "
                          f"earlier run's directory or model.npz")
    try:
        return read_model(path)
    except CheckpointError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def initial_params(config: RunConfig, model: Model,
                   init: ModelFile | None = None) -> np.ndarray:
    """The run's round-0 model: `init`'s parameters (read_init_file: a warm start), refused
    unless `init` holds this run's model (the same layer table and model name: softmax,
    svm with a bias and linear with one output per class lay out the same parameters), or
    else the seeded one (model.init uniform or zeros). Other options of the same model
    (svm's l2: a fine-tune may change its regularisation) are warned about."""
    if init is None:
        return model.init(config.seed, zero=config.model.get("init") == "zeros")
    theirs = init.model
    if theirs.table.digest != model.table.digest:
        raise ConfigError(
            f"{config.path or '<config>'}: model.init: {init.path}: holds a model of "
            f"{theirs.n_params} parameters (layer table {theirs.table.digest[:12]}, model "
            f"{theirs.spec}, input {list(theirs.input_shape)}, {theirs.num_classes} "
            f"classes), not this run's model of {model.n_params} parameters (layer table "
            f"{model.table.digest[:12]}, model {model.spec}, input "
            f"{list(model.input_shape)}, {model.num_classes} classes); a run starts only "
            f"from a checkpoint of its own model")
    where = f"{config.path or '<config>'}: model.init: {init.path}"
    ours, stored = model_options(model.spec), model_options(theirs.spec)
    if ours["name"] != stored["name"]:
        raise ConfigError(
            f"{where}: holds a {stored['name']} model ({theirs.spec}), not this run's "
            f"{ours['name']} ({model.spec}): the two lay out the same parameters (layer "
            f"table {model.table.digest[:12]}) but compute other functions of them; a run "
            f"starts only from a checkpoint of its own model")
    differ = sorted(k for k in ours.keys() | stored.keys() if ours.get(k) != stored.get(k))
    if differ:
        log.warning("%s: the checkpoint's %s model has other options than this run's: %s; "
                    "the run starts from its parameters with this run's options", where,
                    ours["name"], "; ".join(f"{k}: {stored.get(k)!r} in the checkpoint, "
                                           f"{ours.get(k)!r} here" for k in differ))
    return init.params


def _check_normalisation(config: RunConfig, init: ModelFile | None, dataset) -> None:
    """A warning when model.init's checkpoint was trained on inputs normalised otherwise
    (its norm_mean / norm_std) than this run's data set's: the model then sees its inputs
    shifted or scaled from what it learned on. A checkpoint without them is not checked."""
    if init is None or "norm_mean" not in init.arrays or "norm_std" not in init.arrays:
        return
    same = all(np.shape(init.arrays[k]) == np.shape(getattr(dataset, k)) and
               np.array_equal(init.arrays[k], getattr(dataset, k))
               for k in ("norm_mean", "norm_std"))
    if not same:
        source = init.arrays.get("dataset", {}).get("name", "?") \
            if isinstance(init.arrays.get("dataset"), dict) else "?"
        log.warning("%s: model.init: %s: the checkpoint's input normalisation (norm_mean / "
                    "norm_std, of data set %s) is not this run's data set's (%s): the model "
                    "starts on inputs shifted or scaled from those it was trained on",
                    config.path or "<config>", init.path, source, dataset.name)


def prepare_run(config: RunConfig, *, workers: int | None = None, out_dir=None,
                progress: bool | None = None, stream=None,
                strategy: Strategy | None = None,
                out_files: Mapping[str, str] | None = None, stop=None,
                read_init: bool = True) -> PreparedRun:
    """Load the dataset, partition it, build the model and its initial buffer (seeded, or
    the checkpoint model.init names: `initial_params`), and the strategy; run the
    strategy's offline phase (`Strategy.prepare`, e.g. DUW's table) unless a ready
    `strategy` is given (a resumed aggregator takes it from its checkpoint).
    read_init=False: model.init's file is not read and the seeded model stands in, for an
    edge aggregator, which takes every round's model from the centre (a board prepares no
    run: its model comes with each round).
    What the phase writes goes to out_dir, or to out_files {name: path} (duw-train --out).
    Every caller's rounds honour the whole `privacy:` section (secure aggregation, DP; a
    strategy that cannot run with it is refused when the config is read): with privacy.dp
    the run's DP hooks are built here (`privacy_hooks`).
    `stop` (a kernels.StopFlag) goes into every client's LocalData: the local rounds of the
    offline phase and of the run stop within one step once it is set."""
    hooks = privacy_hooks(config)     # before the data: a missing extra fails at once
    init = read_init_file(config) if read_init else None    # and a missing file
    # before the data loads: a long run on an unrequested NumPy fallback stops here
    kernels.check_run_backend(config.rounds * config.clients_per_round,
                              config.path or "<config>", stream or sys.stderr)
    with phase(None if progress is False else (stream or sys.stderr), "data") as note:
        dataset = dataset_from_config(config.as_config())
        split = partition_from_config(config.as_config(), dataset)
        note.append(f"{dataset.name}, {len(dataset.y_train)} train / {len(dataset.y_test)} "
                    f"test samples, {len(split.indices)} clients")
    # the training rows reordered shard by shard, in place: each client's data is a slice
    # of the one array (no per-client copy; the same rows in the same order, so the same
    # model) and the whole set is checked once (ShardClients)
    dataset, split = contiguous(dataset, split)
    model = build_run_model(config, dataset)
    init_params = initial_params(config, model, init)
    _check_normalisation(config, init, dataset)
    if getattr(hooks, "rounding", 0):     # DP under secure aggregation: room for the rounding
        try:
            hooks.clip_bound(model.n_params)
        except ValueError as exc:
            raise ConfigError(f"{config.path or '<config>'}: {exc}") from None
    setup = Setup(clients=range(len(split.indices)), train=config.train.kernel_kwargs(),
                  lr_decay=config.train.lr_decay, seed=config.seed, rounds=config.rounds,
                  units=Setup.units_of(model))
    clients = ShardClients(dataset, split, model, stop)
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if strategy is None:
        strategy = get_strategy(config.strategy, **config.strategy_params)
        context = PrepareContext(
            where=config.path or "<config>", clients_per_round=config.clients_per_round,
            base_dir=config.base_dir,
            record=config.to_dict(), out_dir=None if out_dir is None else os.fspath(out_dir),
            out_files=dict(out_files or {}), workers=workers,
            stream=None if progress is False else (stream or sys.stderr))
        strategy = strategy.prepare(init_params, clients, setup, context)
    check_secure_ring(config, strategy, clients)
    if config.attack is not None and strategy.name != "attacked":   # (a checkpoint's is already)
        from ..attacks import with_attack      # malicious clients' uploads (edgefl.attacks)
        strategy = with_attack(strategy, config.attack, setup.clients)
    warm_start = None if init is None else {   # (the file, not a runs/NAME link to it)
        "checkpoint": os.path.realpath(init.path), "model_sha256": model_sha256(init_params),
        "round": int(init.arrays.get("round", 0))}
    if init is not None:
        privacy = _source_privacy(config, init)
        if privacy is not None:
            warm_start["privacy"] = privacy
        if progress is not False:
            (stream or sys.stderr).write(
                f"model: round 0 from {warm_start['checkpoint']} (its round "
                f"{warm_start['round']}, model_sha256 {warm_start['model_sha256'][:16]})\n")
    return PreparedRun(config, dataset, split, model, init_params, strategy, setup, clients,
                       hooks, warm_start)


# what is read of the summary.json beside a warm start's model.npz: the file's size, and
# each kept value of its privacy block (a DP run's block is a dozen scalars of a few bytes)
_SUMMARY_BYTES = 16 << 20
_PRIVACY_TEXT = 200


def _source_privacy(config: RunConfig, init: ModelFile) -> dict | None:
    """The privacy block of the summary.json beside model.init's model.npz (a DP run's
    epsilon and delta), or None: no summary (it is optional), or one of a run without DP.
    Its epsilon is spent already: the new run's rounds add to it (the same boards' data),
    which the warning says. The summary is the source run's output, not ours to trust: only
    its scalar values are kept, strings bounded, and what is logged is escaped; one that
    does not read (too large, nested past the parser, not JSON) is warned about."""
    from ..io import terminal_text

    where = config.path or "<config>"
    path = os.path.join(os.path.dirname(os.path.realpath(init.path)), "summary.json")
    try:
        with open(path, "rb") as f:
            data = f.read(_SUMMARY_BYTES + 1)
        if len(data) > _SUMMARY_BYTES:
            raise ValueError(f"over {_SUMMARY_BYTES >> 20} MiB")
        summary = json.loads(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        reason = "nested too deep" if isinstance(exc, RecursionError) else exc
        log.warning("%s: model.init: %s: unreadable (%s): the source run's privacy account, "
                    "if it had one, is not carried into this run's summary", where, path,
                    terminal_text(reason, _PRIVACY_TEXT, one_line=True))
        return None
    block = summary.get("privacy") if isinstance(summary, dict) else None
    privacy = {str(k)[:_PRIVACY_TEXT]: v[:_PRIVACY_TEXT] if isinstance(v, str) else v
               for k, v in list(block.items())[:64]
               if v is None or isinstance(v, (str, bool, float)) or
               (isinstance(v, int) and abs(v) < 2 ** 63)} if isinstance(block, dict) else {}

    # the source may itself have started from a DP run's model: its summary's epsilon is
    # its own rounds' only (none, when it ran without DP), and the loss before it is in its
    # `init` block (with the loss before that, carried the same way): summed here (basic
    # composition, a valid bound whatever the runs' settings), so that a chain of warm
    # starts drops no link, a run without DP in it included
    source_init = summary.get("init") if isinstance(summary, dict) else None
    before = source_init.get("privacy") if isinstance(source_init, dict) else None
    if isinstance(before, dict):
        terms = [(before.get("epsilon"), before.get("delta")),
                 (before.get("earlier_epsilon"), before.get("earlier_delta"))]
        terms = [(e, d) for e, d in terms if _is_privacy_loss(e) and _is_privacy_loss(d)]
        if terms:
            privacy["earlier_epsilon"] = float(sum(e for e, _ in terms))
            privacy["earlier_delta"] = float(sum(d for _, d in terms))

    if not privacy:
        return None                   # no DP in the source's rounds nor before them

    def said(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return terminal_text(value, _PRIVACY_TEXT, one_line=True)
    if block is None or not isinstance(block, dict):
        log.warning("%s: model.init: %s was trained without differential privacy, from a "
                    "model that had spent epsilon %s (delta %s) on the boards' data before "
                    "it: that loss composes with this run's", where, init.path,
                    said(privacy["earlier_epsilon"]), said(privacy["earlier_delta"]))
        return privacy
    stopped = privacy.get("stopped")
    earlier = "" if "earlier_epsilon" not in privacy else (
        f"; it started from a model that had spent epsilon {said(privacy['earlier_epsilon'])} "
        f"(delta {said(privacy['earlier_delta'])}) before it, which composes too")
    log.warning("%s: model.init: %s was trained under differential privacy to epsilon %s "
                "(delta %s%s)%s: this run's epsilon covers its own rounds only, and the "
                "source's privacy loss composes with it; a run stopped at its target_epsilon "
                "is not continued on a fresh budget", where, init.path,
                said(privacy.get("epsilon")), said(privacy.get("delta")),
                f", stopped: {said(stopped)}" if stopped else "", earlier)
    return privacy


def _is_privacy_loss(value) -> bool:
    """A non-negative int or float, infinity included (a clip-only run's epsilon), not NaN
    nor a bool: an epsilon or delta read from a summary file."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) \
        and not math.isnan(value) and value >= 0


def privacy_hooks(config: RunConfig) -> PrivacyHooks:
    """The run's DP hooks (edgefl.privacy.dp.DPHooks), or NO_HOOKS without privacy.dp. Errors
    name the config and the key: dp-accounting missing, a count noise too small for the
    noise split, a target epsilon that even one round would pass."""
    dp = config.privacy.dp if config.privacy is not None else None
    if dp is None:
        return NO_HOOKS
    where = config.path or "<config>"
    try:
        from ..privacy.dp import DPHooks
        secure = config.privacy.secure_aggregation
        hooks = DPHooks(dp, config.clients, config.clients_per_round, config.seed,
                        rounding=0.0 if secure is None
                        else DPHooks.rounding_of(secure, config.clients_per_round))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if dp.delta >= 1 / config.clients:
        # delta is the chance the guarantee fails outright: at 1/N or more, a mechanism that
        # publishes one random client's data meets it
        log.warning("%s: privacy.dp.delta = %g is not below 1/N = %g (%d clients): "
                    "(epsilon, delta) then allows releasing a client's data outright with "
                    "probability delta; the usual choice is well below 1/N", where,
                    dp.delta, 1 / config.clients, config.clients)
    if dp.target_epsilon is not None and hooks.accountant.epsilon(1) > dp.target_epsilon:
        raise ConfigError(f"{where}: privacy.dp.target_epsilon: {dp.target_epsilon:g} is "
                          f"spent by the first round already (epsilon "
                          f"{hooks.accountant.epsilon(1):.4g} at noise_multiplier "
                          f"{dp.noise_multiplier:g}); raise the noise or the target")
    return hooks


def check_secure_ring(config: RunConfig, strategy: Strategy, clients: Mapping) -> None:
    """ConfigError naming privacy.secure_aggregation.ring_bits when a round of this run could
    overflow the ring: clients_per_round contributions of weight up to the largest client's
    (secagg.Quantiser.for_round states the bound), before round 1 rather than in it."""
    settings = config.privacy.secure_aggregation if config.privacy is not None else None
    if settings is None:
        return
    from ..privacy import secagg
    weight = secagg.max_weight_of(strategy, {c: d.num_samples for c, d in clients.items()})
    try:
        secagg.Quantiser.for_round(settings.ring_bits, settings.clip_range,
                                   config.clients_per_round, weight)
    except secagg.SecAggError as exc:
        raise ConfigError(f"{config.path or '<config>'}: privacy.secure_aggregation.ring_bits: "
                          f"{exc}") from None


def client_shard(config: RunConfig, index: int) -> tuple:
    """(x, y) of client `index` under the config's dataset and partition: what the
    in-process simulation gives that client, for a test or simulation fleet whose clients
    are separate processes (`edgefl client --partition CONFIG --shard INDEX`)."""
    # a shard is data: the privacy a client takes part in comes with each round's
    # announcement (secure aggregation's setup, DP's clip and noise share)
    dataset = dataset_from_config(config.as_config())
    split = partition_from_config(config.as_config(), dataset)
    n = len(split.indices)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
        raise ConfigError(f"{config.path or '<config>'}: shard {index!r}: the partition has "
                          f"clients 0..{n - 1}")
    idx = split.indices[index]
    y = split.labels[index] if split.labels is not None else dataset.y_train[idx]
    return np.ascontiguousarray(dataset.x_train[idx]), np.ascontiguousarray(y)
