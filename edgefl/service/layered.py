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

Every key is declared in KEYS with its type, the roles that read it and its valid values. An
unknown key, a key of another role in a site file or on the command line, or a bad value is
a ConfigError naming the file, the line, the key and the valid values. Keys of other roles
in the defaults and profiles are simply not used.

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

from ..config import Config, ConfigError, apply_override, check_number
from ..transport import wire
from ..transport.topics import TopicError, validate_id
from . import profiles

__all__ = ["ROLES", "KEYS", "ETC_DIR", "Key", "Source", "ServiceConfig", "ConfigError",
           "add_service_config_arguments", "check_setting", "default", "default_site_path",
           "load_service_config", "service_config_from_args"]

ROLES = ("client", "aggregator", "infer")
ROLE_NAMES = {"client": "client", "aggregator": "aggregator", "infer": "inference service"}
ETC_DIR = "/etc/edgefl"
_MQTT = ("client", "aggregator")
COMPRESSIONS = tuple(wire.COMPRESSIONS)            # how frames may travel
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MQTT_MAX_PAYLOAD = 268_435_455                     # the MQTT packet size limit


@dataclass(frozen=True)
class Key:
    """One setting: its dotted name, type and valid values, and the roles that read it."""
    name: str
    kind: str               # str, id, ids, path, int, number, bool, choice, profile, model,
                            # dataset, run, listen
    help: str
    roles: tuple = ROLES
    choices: tuple = ()
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False
    required: tuple = ()    # roles that refuse to start while it is null


KEYS = {k.name: k for k in (
    Key("profile", "profile", "the device profile, or auto (detect the board)"),
    Key("node.id", "id", "this node's id (one MQTT topic level)", _MQTT, nullable=True,
        required=_MQTT),
    Key("node.federation", "id", "the federation id", _MQTT),
    Key("state_dir", "path", "where the node keeps its state (null: $STATE_DIRECTORY)",
        nullable=True),
    Key("broker.url", "str", "mqtt://host[:port] or mqtts://host[:port]", _MQTT),
    Key("broker.username", "str", "MQTT user name", _MQTT, nullable=True),
    Key("broker.password_file", "path", "file whose first line is the MQTT password", _MQTT,
        nullable=True),
    Key("broker.ca_file", "path", "CA bundle that signed the broker's certificate", _MQTT,
        nullable=True),
    Key("broker.cert_file", "path", "client certificate (mutual TLS)", _MQTT, nullable=True),
    Key("broker.key_file", "path", "client certificate's private key", _MQTT, nullable=True),
    Key("log.level", "choice", "logging level", choices=LOG_LEVELS),
    Key("compute.threads", "int", "C-core GEMM threads while training (0: all CPUs)", _MQTT,
        minimum=0, maximum=256),
    Key("compute.memory_budget_mb", "int", "resident memory limit of the client, MiB", _MQTT,
        minimum=16),
    Key("compute.max_params", "int", "largest model (parameters) the client trains; a run "
        "asking more is refused (null: no limit but the memory budget)", ("client",),
        minimum=1, nullable=True),
    Key("compute.max_batch_size", "int", "largest minibatch the client trains with; a run "
        "asking more is refused (null: no limit)", ("client",), minimum=1, nullable=True),
    Key("train.batch_size", "int", "local minibatch size when the task sets none", ("client",),
        minimum=1),
    Key("transport.compression", "choice", "how models and updates travel", _MQTT,
        choices=COMPRESSIONS),
    Key("transport.chunk_size", "int", "bytes per MQTT message; larger frames are split",
        _MQTT, minimum=1024, maximum=MQTT_MAX_PAYLOAD),
    Key("limits.queue_messages", "int", "received messages waiting for the role at most; "
        "more are dropped and counted (docs/limits.md)", _MQTT, minimum=1),
    Key("limits.queue_mb", "int", "payload MiB waiting in the receive queue at most", _MQTT,
        minimum=1),
    Key("limits.reassembly_mb", "int", "MiB of incomplete chunked messages held at most "
        "(null: sized from the model)", _MQTT, minimum=1, nullable=True),
    Key("limits.sender_reassembly_mb", "int", "MiB of one sender's incomplete messages at "
        "most (null: two updates)", ("aggregator",), minimum=1, nullable=True),
    Key("limits.chunks_per_sender", "int", "payloads a sender may deliver per round before "
        "it is dropped for the round as a flooder (null: sized from the model; none on "
        "clients)", _MQTT, minimum=1, nullable=True),
    Key("clients", "ids", "the federation's client ids, in the order of the run config's "
        "partition (null: client-0 ... client-<N-1>)", ("aggregator",), nullable=True),
    Key("round.deadline", "number", "seconds after its announcement a round closes with the "
        "updates it has", ("aggregator",), minimum=0.1, maximum=7 * 24 * 3600),
    Key("round.quorum", "number", "fraction of a round's uploaders whose updates close it "
        "early (1: all, or the deadline)", ("aggregator",), minimum=0.01, maximum=1),
    Key("round.min_updates", "int", "fewest updates a round is aggregated with; fewer at the "
        "deadline announce it again", ("aggregator",), minimum=1),
    Key("round.offline_grace", "number", "seconds a client must have been offline (its Last "
        "Will) before a round stops waiting for it; also after the aggregator reconnects, as "
        "a restarted broker delivers the wills it published on shutdown", ("aggregator",),
        minimum=0, maximum=3600),
    Key("export.every", "int", "also export (and publish) the global model to ONNX after "
        "every N-th round (0: the final model only)", ("aggregator",), minimum=0),
    Key("export.softmax", "bool", "exported models have the probabilities output",
        ("aggregator",)),
    Key("export.quantize", "choice", "none, or int8: static quantisation calibrated on the "
        "run's training data", ("aggregator",), choices=("none", "int8")),
    Key("export.publish", "bool", "publish each exported model, retained, on the onnx topic "
        "for the clients to install", ("aggregator",)),
    Key("infer.model", "path", "the ONNX model file the inference service serves", ("infer",),
        nullable=True, required=("infer",)),
    Key("infer.socket", "path", "the Unix socket of the HTTP API (null: "
        "$RUNTIME_DIRECTORY/predict.sock, else <state_dir>/predict.sock)", ("infer",),
        nullable=True),
    Key("infer.listen", "listen", "also serve on TCP HOST:PORT (e.g. 127.0.0.1:8080; null: "
        "the Unix socket only)", ("infer",), nullable=True),
    Key("infer.max_request_bytes", "int", "largest request body accepted (bytes)", ("infer",),
        minimum=1024, maximum=1 << 30),
    Key("infer.threads", "int", "onnxruntime intra-op threads", ("infer",), minimum=1,
        maximum=256),
    Key("infer.check_interval", "number", "seconds between checks for a new model file",
        ("infer",), minimum=0),
    Key("suggested_model", "model", "the model this board trains comfortably (a model spec)"),
    Key("data", "dataset", "the client's training data: a dataset section (docs/data.md)",
        ("client",), nullable=True, required=("client",)),
    Key("run", "run", "the run config run first: a YAML file or a built-in name "
        "(edgefl/configs); null: wait for runs started on the control topic",
        ("aggregator",), nullable=True),
)}
_SECTIONS = sorted({name.rsplit(".", 1)[0] for name in KEYS if "." in name})


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
        rows = [(k, _show(v), str(self.sources[k])) for k, v in self.values.items()]
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
        return yaml.safe_dump(value, default_flow_style=True, sort_keys=False).strip()
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
            f"--id ID or --site FILE)")
    found = sorted(glob.glob(os.path.join(glob.escape(etc_dir), "client-*.yaml")))
    return hint + (f"; there are {', '.join(found)}" if found else "")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ConfigError(f"role {role!r}: valid roles are {', '.join(ROLES)}")


def _read_yaml(path: str) -> tuple[dict, dict, dict]:
    """(mapping, {dotted key: line}, {dotted key: scalar text}) of a YAML file; ConfigError
    naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
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
# the table as the settings classes use it
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


def check_setting(key: str, value, where: str, *, unset_ok: bool = False):
    """`value` checked as a site file's `key` is (its type, range, choices), for a settings
    class's field: the validated value, or ConfigError "<where> (<key>): <problem>".
    unset_ok: None passes (a field whose None means "no limit")."""
    if value is None and unset_ok:
        return None
    return _check_value(KEYS[key], value, f"{where} ({key})", None)


# ---------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------

def _check_value(key: Key, value, where: str, base_dir: str | None, raw: str | None = None):
    """The validated (and for paths, absolute) value, or ConfigError naming `where`. raw: the
    value's text as written, for messages."""
    def fail(problem):
        raise ConfigError(f"{where}: {problem}")

    if value is None:
        if key.nullable:
            return None
        fail(f"must be set ({key.help})")
    kind = key.kind
    if kind == "bool":
        if not isinstance(value, bool):
            fail(f"must be true or false, got {value!r}")
        return value
    if kind == "ids":
        return _check_ids(value, raw, fail)
    if kind == "listen":
        return _check_listen(value, fail)
    if kind in ("str", "path", "id", "run"):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and kind == "id":
            text = raw if raw is not None else str(value)
            fail(f"must be a string, but YAML reads {text} as the number {value!r}; quote it: "
                 f"'{text}' -> '\"{text}\"'")
        if not isinstance(value, str) or not value.strip():
            fail(f"must be a non-empty string ({key.help}), got {value!r}")
        if kind == "id":
            _check_id(value, fail)
        if kind == "path":
            value = os.path.expanduser(value)
            if base_dir and not os.path.isabs(value):
                value = os.path.normpath(os.path.join(base_dir, value))
        if kind == "run":
            value = _check_run(value, base_dir, fail)
        return value
    if kind in ("int", "number"):
        return check_number(value, fail, integer=kind == "int", minimum=key.minimum,
                            maximum=key.maximum)
    if kind == "choice":
        if isinstance(value, str):
            value = value.strip().lower() if key.name == "log.level" else value
        if value not in key.choices:
            fail(f"{value!r} is not valid; valid: {', '.join(key.choices)}")
        return value
    if kind == "profile":
        valid = profiles.profile_names() + ["auto"]
        if value not in valid:
            fail(f"unknown profile {value!r}; valid profiles: {', '.join(valid)}")
        return value
    if kind == "model":
        return _check_model(value, fail)
    if kind == "dataset":
        return _check_dataset(value, fail)
    raise AssertionError(f"KEYS[{key.name!r}]: unknown kind {kind!r}")


def _check_id(value: str, fail) -> None:
    """The transport's rule for ids (edgefl.transport.topics.validate_id), reported with the
    file and key."""
    try:
        validate_id(value, "id")
    except TopicError as exc:
        fail(f"{str(exc).removeprefix('id: ')}; an id is one MQTT topic level")


def _check_ids(value, raw, fail) -> list:
    if isinstance(value, str):          # --set clients=a,b,c
        value = [part.strip() for part in value.split(",")]
    if not isinstance(value, list) or not value:
        fail(f"must be a non-empty list of client ids, got {raw if raw is not None else value!r}")
    seen = set()
    for i, node in enumerate(value):
        if not isinstance(node, str) or not node:
            fail(f"item {i}: {node!r} is not an id (a non-empty string; quote numbers: "
                 f"'\"{node}\"')")
        _check_id(node, lambda problem, i=i: fail(f"item {i}: {problem}"))
        if node in seen:
            fail(f"item {i}: {node!r} appears twice; client ids are distinct")
        seen.add(node)
    return list(value)


def _check_listen(value, fail) -> str:
    text = str(value).strip() if isinstance(value, (str, int)) else None
    host, sep, port = (text or "").rpartition(":")
    host = host.strip("[]")
    if not text or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        fail(f"{value!r}: need HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:8080")
    return f"{host}:{int(port)}" if ":" not in host else f"[{host}]:{int(port)}"


def _check_run(value: str, base_dir: str | None, fail) -> str:
    from ..runconfig import resolve_config_path

    candidate = os.path.expanduser(value)
    if base_dir and not os.path.isabs(candidate):
        candidate = os.path.join(base_dir, candidate)
    if os.path.isfile(candidate):
        return os.path.normpath(candidate)
    try:
        return resolve_config_path(value)
    except ConfigError as exc:
        fail(str(exc))


def _check_model(value, fail):
    from ..errors import KernelError
    from ..models import build_model, model_names

    spec = {"name": value} if isinstance(value, str) else value
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        fail(f"must be a model name or a mapping with a name, got {value!r}; valid names: "
             f"{', '.join(model_names())}")
    try:   # the options are checked by building the model for 28x28 images, 10 classes
        build_model(dict(spec), (1, 28, 28), 10)
    except (KernelError, TypeError, ValueError) as exc:
        fail(str(exc))
    return value


def _check_dataset(value, fail):
    from ..data import LOADERS, dataset_options

    spec = {"name": value} if isinstance(value, str) else value
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        fail(f"must be a dataset section with a name, got {value!r}; valid names: "
             f"{', '.join(LOADERS)}")
    spec = dict(spec)
    if spec["name"] not in LOADERS:
        fail(f"unknown dataset {spec['name']!r}; valid: {', '.join(LOADERS)}")
    valid = dataset_options(spec["name"])
    for option in spec:
        if option != "name" and option not in valid:
            fail(f"unknown option {option!r} of dataset {spec['name']!r}; valid: "
                 f"{', '.join(('name',) + tuple(valid))}")
    return spec    # path/test_path were made absolute when the layer was read


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
    out = {}
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
            raw = item.partition("=")[2].strip() if item.partition("=")[0].strip() == key \
                else None
            value = _layer_value(key, value, where(key), os.getcwd(), raw)
            out[key] = _Entry(value, Source("command line", f"--set {item}", key),
                              os.getcwd(), where(key), raw)
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


def _readers(key: str) -> str:
    return "read by the " + " and the ".join(ROLE_NAMES[r] for r in KEYS[key].roles)


def _role_keys(role: str) -> list:
    return [name for name, key in KEYS.items() if role in key.roles]


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

def add_service_config_arguments(parser, site_option: str = "--config") -> None:
    """The layer arguments every service command shares: the site file (`--config FILE` for
    the roles, `--site FILE` for `edgefl config show`), --profile NAME and repeatable --set."""
    parser.add_argument(site_option, dest="site", metavar="FILE",
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
    return json.dumps(config.to_json(), indent=1)
