"""Run configuration: a YAML file plus `--set dotted.key=value` overrides, and the dataset and
partition it describes. Errors name the file and the key (and the YAML line when known).

    seed: 0
    dataset: {name: digits, limit_train: 500}
    partition: {name: dirichlet, clients: 10, alpha: 0.3}
"""
from __future__ import annotations

import os

import yaml

from .data import Dataset, Partition, dataset_options, load_dataset, partition, partition_options
from .errors import ConfigError     # re-exported: the configs' error, raised below them too

_REMOVE = object()   # an override with an empty value deletes the key


class Config(dict):
    """A config mapping that remembers which file it came from (`path`, None if built in code)."""

    def __init__(self, data=(), path: str | None = None):
        super().__init__(data)
        self.path = path


def load_config(path: str | os.PathLike, overrides=()) -> Config:
    """Read the YAML mapping in `path` (yaml.safe_load), then apply each override
    "dotted.key=value", the value parsed as YAML ("3" is an int, "[1, 2]" a list); an empty
    value ("dotted.key=") removes the key, e.g. an option of a partitioner being replaced."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file does not exist") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, "
                          f"got {type(data).__name__}")
    config = Config(data, path)
    for item in overrides:
        apply_override(config, item)
    return config


def apply_override(config: Config, item: str) -> None:
    """Set "dotted.key=value" in `config`, creating missing sections; "dotted.key=" removes it."""
    source = f"--set {item}"
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"{source}: expected dotted.key=value")
    try:
        value = yaml.safe_load(text) if text.strip() else _REMOVE
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: value is not valid YAML ({exc})") from None
    node = config
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {'.'.join(parts[:depth + 1])} is "
                              f"{type(child).__name__}, not a section")
        node = child
    if value is _REMOVE:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value


def section(config: Config, name: str, required: bool = True) -> dict:
    """config[name] as a mapping, or ConfigError naming the file and section."""
    value = config.get(name)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{_where(config)}: section {name!r} must be a mapping"
                          + (" (it is missing)" if value is None else f", got {value!r}"))
    return value


def seed_of(config: Config) -> int:
    seed = config.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"{_where(config)}: seed must be an integer, got {seed!r}")
    return seed


def dataset_from_config(config: Config) -> Dataset:
    """The dataset the `dataset:` section names, with the rest of the section as options.
    Relative `path`/`test_path` options are taken relative to the config file's directory."""
    options = dict(section(config, "dataset"))
    name = _name(config, "dataset", options)
    valid = _valid(config, "dataset", name, dataset_options)
    _reject_unknown(config, "dataset", options, valid)
    base = os.path.dirname(os.path.abspath(config.path)) if getattr(config, "path", None) else None
    for key in ("path", "test_path"):
        if base and isinstance(options.get(key), str):
            options[key] = os.path.join(base, os.path.expanduser(options[key]))
    try:
        return load_dataset(name, **options)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"{_where(config)}: dataset: {exc}") from exc


def partition_from_config(config: Config, dataset: Dataset) -> Partition:
    """The split the `partition:` section describes (name, clients, then the partitioner's
    options), drawn with the top-level `seed`."""
    options = dict(section(config, "partition"))
    name = _name(config, "partition", options)
    valid = _valid(config, "partition", name, partition_options)
    _reject_unknown(config, "partition", options, ("clients",) + valid)
    if "clients" not in options:
        raise ConfigError(f"{_where(config)}: partition.clients (the number of clients) is missing")
    clients = options.pop("clients")
    try:
        return partition(dataset, name, clients, seed_of(config), **options)
    except ValueError as exc:
        raise ConfigError(f"{_where(config)}: partition: {exc}") from exc


def _where(config) -> str:
    return getattr(config, "path", None) or "<config>"


def _name(config, kind, options) -> str:
    name = options.pop("name", None)
    if not isinstance(name, str):
        raise ConfigError(f"{_where(config)}: {kind}.name is missing or not a string ({name!r})")
    return name


def _valid(config, kind, name, options_of) -> tuple:
    try:
        return options_of(name)
    except ValueError as exc:
        raise ConfigError(f"{_where(config)}: {kind}.name: {exc}") from None


def _reject_unknown(config, kind, options, valid) -> None:
    for key in options:
        if key not in valid:
            raise ConfigError(f"{_where(config)}: unknown key {kind}.{key}; valid keys: "
                              f"{', '.join(('name',) + tuple(valid))}")
