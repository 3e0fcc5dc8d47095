"""Run configuration: a YAML file plus `--set dotted.key=value` overrides, and the dataset and
partition it describes. Errors name the file and the key (and the YAML line when known).

    seed: 0
    dataset: {name: digits, limit_train: 500}
    partition: {name: dirichlet, clients: 10, alpha: 0.3}
"""
from __future__ import annotations

import math
import os
import re

import yaml

from .data import Dataset, Partition, dataset_options, load_dataset, partition, partition_options
from .errors import ConfigError  # noqa: F401 -- raised here; callers import it from here too

_REMOVE = object()   # an override with an empty value deletes the key


# ---------------------------------------------------------------------------------------
# YAML, as every edgefl file and --set value is read
# ---------------------------------------------------------------------------------------

# PyYAML reads YAML 1.1, where a float needs a dot: `1e-3` -- a learning rate or tolerance as
# papers and docs/algorithms.md write it -- was the string '1e-3', refused as "not a number".
# These loaders read it as YAML 1.2 does, a float; otherwise they are yaml's safe loaders.
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def _with_exponent_floats(base):
    loader = type(f"Edgefl{base.__name__}", (base,), {})
    # (add_implicit_resolver copies the base's resolver table first: yaml's own loaders
    # are left as they are)
    loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT,
                                 list("-+0123456789"))
    return loader


YamlLoader = _with_exponent_floats(yaml.SafeLoader)
# libyaml's parser when PyYAML has it (much faster; the same documents and marks)
FastYamlLoader = _with_exponent_floats(getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def load_yaml(stream, loader=YamlLoader):
    """yaml.safe_load, with `1e-3` a float (YAML 1.2): the one way edgefl reads YAML."""
    return yaml.load(stream, Loader=loader)


# ... and the dumper that writes what they read back: yaml's safe dumper left a string such
# as '1e5' (a board id, a path) unquoted, which the loaders above read back as a float.
YamlDumper = type("EdgeflSafeDumper", (yaml.SafeDumper,), {})
YamlDumper.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT,
                                 list("-+0123456789"))


def dump_yaml(value, **options) -> str:
    """yaml.safe_dump (options as its own), quoting what load_yaml would read as a number."""
    return yaml.dump(value, Dumper=YamlDumper, **options)


class Config(dict):
    """A config mapping that remembers which file it came from (`path`, None if built in code)."""

    def __init__(self, data=(), path: str | None = None):
        super().__init__(data)
        self.path = path


def read_yaml_text(path: str, what: str) -> str:
    """The text of the YAML file `path`, `what` it is ("a config", "a site file"); a
    ConfigError naming the file when it is missing, unreadable or not UTF-8 (the decoder's
    own message names no file): run configs and site files alike."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                          f"offset {exc.start}); {what} is a YAML file in UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None


def load_config(path: str | os.PathLike, overrides=()) -> Config:
    """Read the YAML mapping in `path` (load_yaml), then apply each override
    "dotted.key=value", the value parsed as YAML ("3" is an int, "[1, 2]" a list); an empty
    value ("dotted.key=") removes the key, e.g. an option of a partitioner being replaced."""
    path = os.fspath(path)
    try:
        data = load_yaml(read_yaml_text(path, "a config"))
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
        value = load_yaml(text) if text.strip() else _REMOVE
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
    def fail(problem):
        raise ConfigError(f"{_where(config)}: seed {problem}")

    return check_number(config.get("seed", 0), fail, integer=True)


def check_number(value, where, *, integer: bool = False, minimum=None, maximum=None):
    """`value` as an int (integer=True) or a finite float, within [minimum, maximum]; else
    ConfigError "<where>: <problem>" (where: the file and key), or where(problem) when it is
    a function that raises. The one check of numbers in run configs (edgefl.runconfig), site
    files and --set (edgefl.service.layered) and the role settings classes, which take
    their checks from the layered key table."""
    def fail(problem):
        if callable(where):
            where(problem)
        raise ConfigError(f"{where}: {problem}")

    if integer:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(f"must be an integer, got {value!r}")
    else:
        if isinstance(value, str):      # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                fail(f"must be a number, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            fail(f"must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        fail(f"{value} is below the minimum {minimum:g}")
    if maximum is not None and value > maximum:
        fail(f"{value} is above the maximum {maximum:g}")
    return int(value) if integer else float(value)


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
