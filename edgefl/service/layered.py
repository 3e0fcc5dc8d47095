"""Layered configuration of the services (`edgefl client`, `edgefl aggregator`, the inference
service): package defaults -> device profile -> site file -> command line, and where each
resolved value came from.

    config = load_service_config("client", site="/etc/edgefl/client-07.yaml",
                                 overrides=["log.level=debug"])
    config["broker.url"]                 # 'mqtt://gateway.lan:1883'
    config.source("broker.url")          # /etc/edgefl/client-07.yaml:9: broker.url
    config.section("transport")          # {'compression': 'f16', 'chunk_size': 131072}
    config.state_dir                     # state_dir, else $STATE_DIRECTORY from systemd

Layers, later ones win:
1. package defaults: edgefl/service/defaults.yaml (every key has a default there);
2. the device profile named by `profile` (edgefl/profiles/<name>.yaml; `auto` detects the
   board), which may set only the board-dependent keys (profiles.PROFILE_KEYS);
3. the site file: the file given explicitly (the units pass /etc/edgefl/client-<id>.yaml,
   the file `edgefl install-service` writes for a client; `node_id` selects it), else
   /etc/edgefl/<role>.yaml, skipped when it does not exist;
4. the command line: `--profile NAME` and `--set dotted.key=value` (value parsed as YAML).

Every key is declared in the key table (edgefl.service.keys: KEYS, with its type, the roles
that read it and its valid values). An unknown key, a key of another role in a site file or
on the command line, or a bad value is a ConfigError naming the file, the line, the key and
the valid values. Keys of other roles in the defaults and profiles are simply not used.

The table is also the one source of the roles' settings classes (edgefl.roles
AggregatorSettings, ClientSettings): their fields take their defaults from `default(key)`
and their checks from `check_setting(key, ...)`, and `from_service_config` builds them from
a resolved ServiceConfig, so a simulation, a test and the service agree on both.
"""
from __future__ import annotations

import copy
import difflib
import functools
import glob
import json
import os
import types
from dataclasses import dataclass
from importlib import resources
from typing import Any, Mapping

import yaml

from ..config import (Config, ConfigError, FastYamlLoader, YamlLoader, apply_override,
                      dump_yaml, load_yaml, read_yaml_text)
from . import profiles
from .keys import (KEYS, ROLE_NAMES, ROLES, Key, _SECTIONS, _check_value, _readers,
                   _role_keys, check_setting)

__all__ = ["ROLES", "KEYS", "ETC_DIR", "Key", "Source", "ServiceConfig", "ConfigError",
           "add_service_config_arguments", "check_setting", "default", "default_site_path",
           "load_service_config", "service_config_from_args"]

ETC_DIR = "/etc/edgefl"


@dataclass(frozen=True)
class Source:
    """Where a value came from: a layer, its file (or the command-line text) and the key."""
    layer: str                  # "package defaults", "device profile", "site file", "command line"
    file: str                   # a path, or "--set ..." / "--profile ..."
    key: str
    line: int | None = None
    note: str = ""

    def __str__(self) -> str:
        if self.layer == "command line":
            where = self.file
        else:
            line = f":{self.line}" if self.line else ""
            where = f"{self.file}{line}: {self.key}"
        return f"{where} ({self.note})" if self.note else where

    def to_dict(self) -> dict:
        return {"layer": self.layer, "file": self.file, "key": self.key, "line": self.line,
                "note": self.note or None}


@dataclass(frozen=True)
class Layer:
    kind: str
    file: str | None
    note: str = ""


@dataclass(frozen=True)
class ServiceConfig:
    """The resolved configuration of one role: a value and a Source for every key the role
    reads (KEYS with the role in Key.roles)."""
    role: str
    values: Mapping[str, Any]
    sources: Mapping[str, Source]
    layers: tuple = ()

    def _known(self, key: str) -> str:
        if key not in self.values:
            raise KeyError(f"{key!r} is not a setting of the {ROLE_NAMES[self.role]}; valid: "
                           f"{', '.join(self.values)}")
        return key

    def __getitem__(self, key: str):
        """The value (a copy: the config cannot be changed through it)."""
        return copy.deepcopy(self.values[self._known(key)])

    def get(self, key: str, default=None):
        return copy.deepcopy(self.values[key]) if key in self.values else default

    def __contains__(self, key) -> bool:
        return key in self.values

    def source(self, key: str) -> Source:
        return self.sources[self._known(key)]

    def section(self, name: str) -> dict:
        """{key: value} of the keys under `name.` ("broker" -> url, username, ...)."""
        prefix = name + "."
        out = {k[len(prefix):]: copy.deepcopy(v) for k, v in self.values.items()
               if k.startswith(prefix)}
        if not out:
            raise KeyError(f"{name!r} is not a section of the {self.role}'s settings")
        return out

    def mib(self, key: str) -> int | None:
        """A MiB setting (limits.queue_mb, ...) in bytes; None stays None (sized later)."""
        value = self[key]
        return None if value is None else value << 20

    @property
    def profile(self) -> str:
        return self.values["profile"]

    @property
    def state_dir(self) -> str:
        """state_dir, else the directory systemd created ($STATE_DIRECTORY, the first one if
        the unit lists several); ConfigError when neither is there."""
        value = self.values.get("state_dir")
        if value:
            return value
        env = os.environ.get("STATE_DIRECTORY", "")
        if env:
            return env.split(":")[0]
        raise ConfigError(f"state_dir is not set ({self.sources['state_dir']}) and "
                          f"$STATE_DIRECTORY is not in the environment (the process was not "
                          f"started by a unit with StateDirectory=): set state_dir in the site "
                          f"file or --set state_dir=DIR")

    def nested(self) -> dict:
        """The values as nested sections, as they would be written in YAML."""
        out: dict = {}
        for key, value in self.values.items():
            node = out
            parts = key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = copy.deepcopy(value)
        return out

    def to_json(self) -> dict:
        return {"role": self.role, "profile": self.profile, "values": self.nested(),
                "sources": {k: s.to_dict() for k, s in self.sources.items()},
                "layers": [{"layer": lay.kind, "file": lay.file, "note": lay.note or None}
                           for lay in self.layers]}

    def describe(self) -> str:
        """The table `edgefl config show` prints: layers, then key, value, source."""
        board = profiles.board_summary(self.profile)
        lines = [f"edgefl {self.role}: profile {self.profile}",
                 f"  board: {board}" if board else "", "layers (later ones win):"]
        lines = [line for line in lines if line]
        for layer in self.layers:
            text = layer.file or "-"
            lines.append(f"  {layer.kind:<17} {text}" + (f"  ({layer.note})" if layer.note else ""))
        from ..transport.mqtt import shown_url       # (paho: only when a table is shown)

        rows = [(k, shown_url(v) if k == "broker.url" and isinstance(v, str) else _show(v),
                 str(self.sources[k])) for k, v in self.values.items()]
        wk = max(len(r[0]) for r in rows)
        wv = min(max(len(r[1]) for r in rows), 40)
        lines.append("")
        lines.append(f"{'key':<{wk}}  {'value':<{wv}}  from")
        for key, value, source in rows:
            lines.append(f"{key:<{wk}}  {value:<{wv}}  {source}")
        return "\n".join(lines)


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return dump_yaml(value, default_flow_style=True, sort_keys=False).strip()
    return str(value)


# ---------------------------------------------------------------------------------------
# reading layers
# ---------------------------------------------------------------------------------------

def defaults_path() -> str:
    return str(resources.files("edgefl").joinpath("service").joinpath("defaults.yaml"))


def default_site_path(role: str, node_id: str | None = None, etc_dir: str = ETC_DIR) -> str:
    """/etc/edgefl/<role>.yaml, or /etc/edgefl/client-<id>.yaml for one instance of the
    client@ template (what `edgefl install-service` writes)."""
    _check_role(role)
    return os.path.join(etc_dir, f"{role}-{node_id}.yaml" if node_id else f"{role}.yaml")


def _installed_client_hint(etc_dir: str) -> str:
    """Where an installed client's site file is, for messages about /etc/edgefl/client.yaml,
    which `edgefl install-service` never writes (its files are per client id)."""
    hint = (f"an installed client's site file is "
            f"{default_site_path('client', '<id>', etc_dir)}, which `edgefl install-service "
            f"--role client --id ID` writes: name it with --config FILE (edgefl config show: "
            f"--id ID or --config FILE)")
    found = sorted(glob.glob(os.path.join(glob.escape(etc_dir), "client-*.yaml")))
    return hint + (f"; there are {', '.join(found)}" if found else "")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ConfigError(f"role {role!r}: valid roles are {', '.join(ROLES)}")


# libyaml's safe loader when PyYAML has it: the same documents and marks, and every edgefl
# command reads defaults.yaml on start-up (20 ms with the pure-Python loader, 1 ms with it);
# a file it rejects is parsed again by the pure-Python one, whose message names the problem


def _read_yaml(path: str) -> tuple[dict, dict, dict]:
    """(mapping, {dotted key: line}, {dotted key: scalar text}) of a YAML file; ConfigError
    naming the file otherwise."""
    text = read_yaml_text(path, "a site file")
    try:
        try:
            data = load_yaml(text, FastYamlLoader)
            node = yaml.compose(text, Loader=FastYamlLoader)
        except yaml.YAMLError:       # the pure-Python loader's message, as the tests pin it
            data = load_yaml(text)
            node = yaml.compose(text, Loader=YamlLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML: "
                          f"{getattr(exc, 'problem', None) or exc}") from None
    if data is None:
        return {}, {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of settings, "
                          f"got {type(data).__name__}")
    lines: dict = {}
    raws: dict = {}

    def walk(n, prefix):
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode):
                    dotted = prefix + str(k.value)
                    lines[dotted] = k.start_mark.line + 1
                    if isinstance(v, yaml.ScalarNode):
                        raws[dotted] = v.value
                    walk(v, dotted + ".")
    walk(node, "")
    return data, lines, raws


def _flatten(data: Mapping, where, prefix: str = "") -> dict:
    """{dotted key: value} of the declared keys in a nested mapping. `where(key)` gives the
    location text for errors."""
    out = {}
    for k, value in data.items():
        if not isinstance(k, str):
            raise ConfigError(f"{where(prefix + str(k))}: keys must be strings, got {k!r}")
        dotted = prefix + k
        if dotted in KEYS:
            out[dotted] = value
        elif dotted in _SECTIONS:
            if value is None:           # an empty section ("compute:") sets nothing
                continue
            if not isinstance(value, Mapping):
                keys = ", ".join(n[len(dotted) + 1:] for n in KEYS if n.startswith(dotted + "."))
                raise ConfigError(f"{where(dotted)}: {dotted} is a section (keys: {keys}), "
                                  f"got {value!r}")
            out.update(_flatten(value, where, dotted + "."))
        else:
            raise ConfigError(f"{where(dotted)}: unknown key{_suggest(dotted, prefix)}")
    return out


def _suggest(dotted: str, prefix: str) -> str:
    level = sorted({n[len(prefix):].split(".")[0] for n in KEYS if n.startswith(prefix)})
    leaf = dotted[len(prefix):]
    close = difflib.get_close_matches(leaf, level, n=1)
    hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
    what = f"keys in {prefix[:-1]}" if prefix else "top-level keys"
    return f"{hint}; valid {what}: {', '.join(level)}"


# ---------------------------------------------------------------------------------------
# the package defaults as the settings classes use them
# ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _package_defaults() -> tuple:
    """({key: value}, {key: line}, {key: text}) of defaults.yaml, read once."""
    path = defaults_path()
    data, lines, raws = _read_yaml(path)
    return _flatten(data, lambda key: f"{path}: {key}"), lines, raws


def default(key: str):
    """The package default of a setting (edgefl/service/defaults.yaml), checked: the default
    of the settings classes of the roles (AggregatorSettings, ClientSettings), which are the
    services' settings."""
    if key not in KEYS:
        raise KeyError(f"{key!r} is not a setting; valid: {', '.join(KEYS)}")
    values, lines, raws = _package_defaults()
    path = defaults_path()
    return copy.deepcopy(_check_value(KEYS[key], values[key], f"{path}:{lines[key]}: {key}",
                                      os.path.dirname(path), raws.get(key)))


# ---------------------------------------------------------------------------------------
# resolving
# ---------------------------------------------------------------------------------------

@dataclass
class _Entry:
    value: Any
    source: Source
    base_dir: str | None = None
    where: str = ""
    raw: str | None = None       # the value as written (a YAML scalar's text)


def _file_layer(kind: str, path: str, role: str, strict: bool, allowed=None) -> dict:
    data, lines, raws = _read_yaml(path)

    def where(key):
        line = lines.get(key)
        return f"{path}:{line}: {key}" if line else f"{path}: {key}"

    flat = _flatten(data, where)
    out = {}
    base = os.path.dirname(os.path.abspath(path))
    for key, value in flat.items():
        if allowed is not None and key not in allowed:
            raise ConfigError(f"{where(key)}: a {kind} may set only the board-dependent keys "
                              f"({', '.join(allowed)})")
        if role not in KEYS[key].roles:
            if strict:
                raise ConfigError(f"{where(key)}: not a setting of the {ROLE_NAMES[role]} "
                                  f"({_readers(key)}); valid keys for the {ROLE_NAMES[role]}: "
                                  f"{', '.join(_role_keys(role))}")
            continue
        value = _layer_value(key, value, where(key), base, raws.get(key))
        out[key] = _Entry(value, Source(kind, path, key, lines.get(key)), base, where(key),
                          raws.get(key))
    return out


def _layer_value(key: str, value, where: str, base_dir: str, raw: str | None):
    """A layer's value, checked where it is written (so a bad value in a file is reported
    even when a higher layer overrides it). A nameless mapping for data or suggested_model
    (`--set data.limit_train=500`) only updates the layer below: it is checked once merged."""
    value = _absolute_paths(key, value, base_dir)
    if KEYS[key].kind in ("dataset", "model") and isinstance(value, Mapping) \
            and "name" not in value:
        return value
    return _check_value(KEYS[key], value, where, base_dir, raw)


def _set_layer(overrides, role: str) -> dict:
    """The command line's --set items. Successive items inside one data or suggested_model
    section (`--set data.name=npz --set data.path=x.npz`) build one section, which is checked
    whole (npz's path is required, so its name alone would fail); a later item giving the
    whole section (`--set data={...}`) replaces what earlier ones built."""
    given: dict = {}        # key: (value, the items that gave it, raw text of a whole value)
    for item in overrides:
        scratch = Config()
        apply_override(scratch, item)       # ConfigError "--set ...: ..." on bad syntax
        if not scratch:
            raise ConfigError(f"--set {item}: give a value (null to clear a setting)")

        def where(key, item=item):
            return f"--set {item}: {key}"

        for key, value in _flatten(scratch, where).items():
            if role not in KEYS[key].roles:
                raise ConfigError(f"--set {item}: {key} is not a setting of the "
                                  f"{ROLE_NAMES[role]} ({_readers(key)}); valid keys for the "
                                  f"{ROLE_NAMES[role]}: {', '.join(_role_keys(role))}")
            whole = item.partition("=")[0].strip() == key
            raw = item.partition("=")[2].strip() if whole else None
            items = [item]
            old = given.get(key)
            if old is not None and not whole and KEYS[key].kind in ("dataset", "model") \
                    and isinstance(value, Mapping) and isinstance(old[0], (Mapping, str)):
                before = {"name": old[0]} if isinstance(old[0], str) else old[0]
                value, items = {**before, **value}, old[1] + items
            given[key] = (value, items, raw)
    out = {}
    for key, (value, items, raw) in given.items():
        text = " ".join(f"--set {item}" for item in items)
        place = f"{text}: {key}"
        value = _layer_value(key, value, place, os.getcwd(), raw)
        out[key] = _Entry(value, Source("command line", text, key), os.getcwd(), place, raw)
    return out


def _flag_layer(flags: Mapping, role: str) -> dict:
    out = {}
    for key, (option, value) in flags.items():
        if role not in KEYS[key].roles:
            raise ConfigError(f"{option}: {key} is not a setting of the {ROLE_NAMES[role]}")
        where = f"{option}: {key}"
        out[key] = _Entry(_layer_value(key, value, where, os.getcwd(), None),
                          Source("command line", option, key), os.getcwd(), where)
    return out


def _merge(entries: dict, layer: dict) -> None:
    """Put `layer` over `entries`. A mapping-valued key (data, suggested_model) given without
    a name updates the mapping below it, so `--set data.limit_train=500` keeps the site
    file's data.name and data.path; with a name it replaces the whole mapping."""
    for key, entry in layer.items():
        old = entries.get(key)
        if KEYS[key].kind in ("dataset", "model") and isinstance(entry.value, Mapping) \
                and "name" not in entry.value and old is not None and old.value is not None:
            before = {"name": old.value} if isinstance(old.value, str) else old.value
            source = entry.source
            entry = _Entry({**before, **entry.value},
                           Source(source.layer, source.file, source.key, source.line,
                                  f"over {old.source}"),
                           entry.base_dir, entry.where, entry.raw)
        entries[key] = entry


def _absolute_paths(key: str, value, base_dir: str):
    """A dataset section's path/test_path made absolute against the directory of the file
    that names them (the command line: the working directory), before layers are merged."""
    if KEYS[key].kind != "dataset" or not isinstance(value, Mapping):
        return value
    value = dict(value)
    for option in ("path", "test_path"):
        if isinstance(value.get(option), str):
            value[option] = os.path.normpath(os.path.join(base_dir,
                                                          os.path.expanduser(value[option])))
    return value


def load_service_config(role: str, site: str | os.PathLike | None = None, *,
                        profile: str | None = None, overrides=(), flags=None,
                        node_id: str | None = None, etc_dir: str = ETC_DIR,
                        device_tree_model: str = profiles.DEVICE_TREE_MODEL) -> ServiceConfig:
    """Resolve the four layers for `role` (client, aggregator or infer).

    site: the site file; None uses /etc/edgefl/<role>.yaml when it exists. node_id (a
    client's, instead of site): the file `edgefl install-service` wrote for that client,
    /etc/edgefl/client-<id>.yaml, which must exist. profile: the command line's --profile
    (wins over the site file's `profile:`). overrides: the "dotted.key=value" strings of
    --set. flags: {key: (option as typed, value)} of a command's own options for settings
    (`edgefl aggregator --deadline 60`: {"round.deadline": ("--deadline 60", 60.0)}),
    command-line values like --set, named by their option. Raises ConfigError naming the
    file, line and key."""
    _check_role(role)
    if node_id is not None:
        if site is not None:
            raise ConfigError(f"--id {node_id} and the site file {os.fspath(site)} both name "
                              f"the site file: give one")
        if role != "client":
            raise ConfigError(f"--id {node_id}: only a client's site file is per id "
                              f"({default_site_path('client', node_id, etc_dir)}); the "
                              f"{ROLE_NAMES[role]}'s is {default_site_path(role, etc_dir=etc_dir)}")
        site = default_site_path(role, node_id, etc_dir)
    layers = []
    entries: dict[str, _Entry] = {}
    defaults = defaults_path()
    entries.update(_file_layer("package defaults", defaults, role, strict=False))
    layers.append(Layer("package defaults", defaults))

    site_entries: dict = {}
    if site is None:
        site_file = default_site_path(role, etc_dir=etc_dir)
        if os.path.exists(site_file):
            site_entries = _file_layer("site file", site_file, role, strict=True)
            layers.append(Layer("site file", site_file))
        else:
            note = f"none: {site_file} does not exist"
            if role == "client":
                note += f"; {_installed_client_hint(etc_dir)}"
            layers.append(Layer("site file", None, note))
            site_file = None
    else:
        site_file = os.fspath(site)
        site_entries = _file_layer("site file", site_file, role, strict=True)
        layers.append(Layer("site file", site_file))
    command_line = _set_layer(overrides, role)
    command_line.update(_flag_layer(flags or {}, role))
    if profile is not None:
        command_line["profile"] = _Entry(profile, Source("command line", f"--profile {profile}",
                                                         "profile"), None, f"--profile {profile}")

    # which profile: the command line, else the site file, else the defaults
    chosen = command_line.get("profile") or site_entries.get("profile") or entries["profile"]
    name = _check_value(KEYS["profile"], chosen.value, chosen.where, None)
    note = ""
    if name == "auto":
        name, how = profiles.detect_profile(device_tree_model)
        if name is None:
            raise ConfigError(f"{chosen.where}: profile auto: {how}; set profile to one of "
                              f"{', '.join(profiles.profile_names())}")
        note = f"auto: detected from {how}"
    profile_file = profiles.profile_path(name)
    _merge(entries, _file_layer("device profile", profile_file, role, strict=False,
                                allowed=profiles.PROFILE_KEYS))
    layers.insert(1, Layer("device profile", profile_file, note))
    _merge(entries, site_entries)
    _merge(entries, command_line)
    if command_line:
        given = ([f"--profile {profile}"] if profile is not None else []) + \
            [f"--set {item}" for item in overrides] + [option for option, _ in
                                                       (flags or {}).values()]
        layers.append(Layer("command line", " ".join(given)))
    else:
        layers.append(Layer("command line", None, "no --profile or --set"))

    values, sources = {}, {}
    for key in _role_keys(role):
        entry = entries[key]      # every key has a package default
        value = _check_value(KEYS[key], entry.value, entry.where, entry.base_dir, entry.raw)
        if key == "profile":
            value = name
            entry.source = Source(entry.source.layer, entry.source.file, entry.source.key,
                                  entry.source.line, note)
        if value is None and role in KEYS[key].required:
            where = site_file or default_site_path(role, etc_dir=etc_dir)
            if site_file is None and role == "client":
                raise ConfigError(f"{key}: not set, and the client needs it ({KEYS[key].help}); "
                                  f"no site file was read ({where} does not exist); "
                                  f"{_installed_client_hint(etc_dir)}, or set {key} with "
                                  f"--set {key}=...")
            if site_file is None and not os.path.exists(where):
                # say that no file was read, or "set it in the site file" reads as if the
                # file were there and lacked the key
                raise ConfigError(f"{key}: not set, and the {ROLE_NAMES[role]} needs it "
                                  f"({KEYS[key].help}); no site file was read ({where} does "
                                  f"not exist): write one there or name one with --config "
                                  f"FILE, or set {key} with --set {key}=...")
            raise ConfigError(f"{key}: not set, and the {ROLE_NAMES[role]} needs it "
                              f"({KEYS[key].help}); set it in the site file {where} or with "
                              f"--set {key}=...")
        values[key] = value
        sources[key] = entry.source
    return ServiceConfig(role, types.MappingProxyType(values), types.MappingProxyType(sources),
                         tuple(layers))


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------

def add_service_config_arguments(parser, aliases: tuple = ()) -> None:
    """The layer arguments every service command shares: the site file (`--config FILE`, and
    any `aliases` of it: `edgefl config show` also takes its older spelling `--site FILE`),
    --profile NAME and repeatable --set."""
    parser.add_argument("--config", *aliases, dest="site", metavar="FILE",
                        help=f"site file (default: {ETC_DIR}/<role>.yaml when it exists)")
    parser.add_argument("--profile", metavar="NAME",
                        help="device profile: " + ", ".join(profiles.profile_names() + ["auto"]))
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a setting, e.g. log.level=debug")


def service_config_from_args(role: str, args) -> ServiceConfig:
    """load_service_config from the arguments add_service_config_arguments declared (and
    `--id`, dest node_id, where the command has it: edgefl config show)."""
    return load_service_config(role, args.site, profile=args.profile, overrides=args.overrides,
                               node_id=getattr(args, "node_id", None))


def to_json_text(config: ServiceConfig) -> str:
    """`edgefl config show --json`: as the table, the broker URL without its password."""
    from ..transport.mqtt import shown_url       # (paho: only when a table is shown)

    doc = config.to_json()
    broker = doc["values"].get("broker")
    if isinstance(broker, dict) and isinstance(broker.get("url"), str):
        broker["url"] = shown_url(broker["url"])
    return json.dumps(doc, indent=1)
