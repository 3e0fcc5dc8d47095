"""The key table of the services' settings (`edgefl client`, `edgefl aggregator`, the
inference service): every key with its type, the roles that read it and its valid values,
and the check of one value against its key.

Every key is declared in KEYS. Its default is in edgefl/service/defaults.yaml, and the
layers that can set it (device profile, site file, command line) are resolved into a
ServiceConfig by edgefl.service.layered, which reports an unknown key, a key of another
role or a bad value as a ConfigError naming the file, the line, the key and the valid
values.

The table is also the one source of the roles' settings classes (edgefl.roles
AggregatorSettings, ClientSettings): their fields take their checks from
`check_setting(key, ...)` here and their defaults from `layered.default(key)`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ..config import ConfigError, check_number
from ..transport import wire
from ..transport.topics import TopicError, validate_id
from . import profiles

__all__ = ["ROLES", "ROLE_NAMES", "KEYS", "Key", "COMPRESSIONS", "LOG_LEVELS",
           "MQTT_MAX_PAYLOAD", "check_setting"]

ROLES = ("client", "aggregator", "infer")
ROLE_NAMES = {"client": "client", "aggregator": "aggregator", "infer": "inference service"}
_MQTT = ("client", "aggregator")
COMPRESSIONS = tuple(wire.COMPRESSIONS)            # how frames may travel
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MQTT_MAX_PAYLOAD = 268_435_455                     # the MQTT packet size limit


@dataclass(frozen=True)
class Key:
    """One setting: its dotted name, type and valid values, and the roles that read it."""
    name: str
    kind: str               # str, id, ids, path, paths, keymap, int, number, bool, choice,
                            # profile, model, dataset, run, listen
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
    Key("broker.control_username", "str", "aggregator: the MQTT user of the service's control "
        "connection (client id <node.id>-ctl; null: broker.username)", ("aggregator",),
        nullable=True),
    Key("broker.control_password_file", "path", "aggregator: the password file of "
        "broker.control_username", ("aggregator",), nullable=True),
    Key("broker.ca_file", "path", "CA bundle that signed the broker's certificate", _MQTT,
        nullable=True),
    Key("broker.cert_file", "path", "client certificate (mutual TLS)", _MQTT, nullable=True),
    Key("broker.key_file", "path", "client certificate's private key", _MQTT, nullable=True),
    Key("broker.keepalive", "int", "seconds between MQTT keepalive pings; a node whose link "
        "dies without closing its socket is seen offline 1.5x this later", _MQTT, minimum=5,
        maximum=65535),
    # Signatures (docs/security.md): every key null (the default) leaves them off.
    Key("keys.signing_key", "path", "this node's Ed25519 private key (edgefl keys gen): the "
        "aggregator signs announcements, models and ONNX files with it, a board its updates "
        "(null: sends unsigned)", _MQTT, nullable=True),
    Key("keys.aggregator", "paths", "the aggregator's public key file(s): when set, the board "
        "refuses announcements, models and ONNX files not signed by one of them, and "
        "`edgefl ctl` (which reads the client's or the aggregator's site file; the service "
        "itself ignores it) refuses replies, and `ctl watch` events and run records, not "
        "signed by one of them; two during a key "
        "change-over (null: signatures not checked)", _MQTT, nullable=True),
    Key("keys.fleet", "keymap", "the boards' public keys: a directory of <node id>.pub "
        "files, or a mapping node id -> file: when set, an update must be signed by its "
        "node's key (null: updates not checked)", ("aggregator",), nullable=True),
    Key("keys.operators", "paths", "the operators' public key file(s): when set, a command "
        "must be signed by one of them (null: commands not checked)", ("aggregator",),
        nullable=True),
    Key("keys.operator_key", "path", "the operator's private key `edgefl ctl` signs commands "
        "with (it reads the aggregator's site file)", ("aggregator",), nullable=True),
    Key("keys.command_window", "number", "seconds a signed command stays valid; its nonce is "
        "remembered on disk that long", ("aggregator",), minimum=1, maximum=24 * 3600),
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
    Key("infer.max_concurrent", "int", "requests read and run at once (each holds its body "
        "and the model's activations); one more waits 10 s for a slot, then gets 503",
        ("infer",), minimum=1, maximum=256),
    Key("infer.check_interval", "number", "seconds between checks for a new model file",
        ("infer",), minimum=0),
    Key("retention.keep_runs", "int", "keep the files of this many of the most recently "
        "ended runs (finished, stopped or failed) under runs/<id>/, removing older runs' as "
        "each run ends; their records stay, marked pruned (null: keep every run's files)",
        ("aggregator",), minimum=1, nullable=True),
    Key("suggested_model", "model", "the model this board trains comfortably (a model spec)"),
    Key("data", "dataset", "the client's training data: a dataset section (docs/data.md)",
        ("client",), nullable=True, required=("client",)),
    Key("run", "run", "the run config run first: a YAML file or a built-in name "
        "(edgefl/configs); null: wait for runs started on the control topic",
        ("aggregator",), nullable=True),
)}
_SECTIONS = sorted({name.rsplit(".", 1)[0] for name in KEYS if "." in name})


def _readers(key: str) -> str:
    return "read by the " + " and the ".join(ROLE_NAMES[r] for r in KEYS[key].roles)


def _role_keys(role: str) -> list:
    return [name for name, key in KEYS.items() if role in key.roles]


# ---------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------

def check_setting(key: str, value, where: str, *, unset_ok: bool = False):
    """`value` checked as a site file's `key` is (its type, range, choices), for a settings
    class's field: the validated value, or ConfigError "<where> (<key>): <problem>".
    unset_ok: None passes (a field whose None means "no limit")."""
    if value is None and unset_ok:
        return None
    return _check_value(KEYS[key], value, f"{where} ({key})", None)


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
    if kind == "paths":
        return _check_paths(value, base_dir, fail)
    if kind == "keymap":
        return _check_keymap(value, base_dir, fail)
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


def _absolute(path: str, base_dir: str | None) -> str:
    path = os.path.expanduser(path)
    return os.path.normpath(os.path.join(base_dir, path)) if base_dir and \
        not os.path.isabs(path) else path


def _check_paths(value, base_dir, fail) -> list:
    """One file or a non-empty list of them (e.g. the aggregator's old and new public key
    during a change-over), made absolute against the site file's directory."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",")] if "," in value else [value]
    if not isinstance(value, list) or not value:
        fail(f"must be a file or a non-empty list of files, got {value!r}")
    for i, path in enumerate(value):
        if not isinstance(path, str) or not path.strip():
            fail(f"item {i}: {path!r} is not a file name")
    return [_absolute(p, base_dir) for p in value]


def _check_keymap(value, base_dir, fail):
    """A directory (of <node id>.pub files) or a mapping node id -> public key file."""
    if isinstance(value, str) and value.strip():
        return _absolute(value, base_dir)
    if not isinstance(value, Mapping) or not value:
        fail(f"must be a directory of <node id>.pub files or a mapping node id -> public key "
             f"file, got {value!r}")
    out = {}
    for node, path in value.items():
        _check_id(str(node), lambda problem, node=node: fail(f"{node!r}: {problem}"))
        if not isinstance(path, str) or not path.strip():
            fail(f"{node!r}: {path!r} is not a file name")
        out[str(node)] = _absolute(path, base_dir)
    return out


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
