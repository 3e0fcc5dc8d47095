"""Every MQTT topic edgefl uses, built and parsed in this one place (docs/protocol.md, §1).

    topics = Topics("fed1")                    # prefix "edgefl" unless told otherwise
    topics.update("pi-07")                     # 'edgefl/fed1/update/pi-07'
    topics.subscription("update")              # 'edgefl/fed1/update/+'
    topics.parse("edgefl/fed1/update/pi-07")   # ('update', 'pi-07')
    TOPIC_TABLE["update"].qos                  # 1; .retained False; .payload 'frame'

Ids (federation, client and node ids, and each level of the prefix) are single topic levels:
non-empty, at most MAX_ID_BYTES bytes of UTF-8, and without '/', the wildcards '+' and '#',
or control characters (NUL included). The limit keeps the longest topic,
prefix/fed/metrics/node, under AWS IoT's 256-byte topic limit with a one-level prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_ID_BYTES = 64
DEFAULT_PREFIX = "edgefl"


class TopicError(ValueError):
    """A topic or id edgefl cannot use; the message names it and the rule it breaks."""


@dataclass(frozen=True)
class TopicSpec:
    """One row of the topic table: how a kind of topic is published."""

    kind: str        # the name parse() returns
    pattern: str     # the levels after '<prefix>/<fed>/', '{node}' for the per-node level
    retained: bool   # published with the retain flag
    qos: int         # MQTT QoS of publishes and subscriptions
    payload: str     # "json", "frame" (binary, edgefl.transport.wire) or "secagg"
                     # (edgefl.privacy.secagg's messages, in chunks)
    meaning: str

    @property
    def per_node(self) -> bool:
        return "{node}" in self.pattern


# The topic table; docs/protocol.md §1 "Topics" prints the same rows.
TOPIC_TABLE = {spec.kind: spec for spec in (
    TopicSpec("round", "round", True, 1, "json",
              "round announcement: round, deadline, model hash, per-client tasks"),
    TopicSpec("model", "model", True, 1, "frame",
              "global model (+ extra buffers, e.g. MFL momentum)"),
    TopicSpec("client_model", "model/{node}", True, 1, "frame",
              "per-client model (FedMR)"),
    TopicSpec("task", "task/{node}", True, 1, "json",
              "an asynchronous run's task for one board (an announcement tasking it alone; "
              "round = task id), or a round's announcement with this client's task alone "
              "(per-client tasks)"),
    TopicSpec("update", "update/{node}", False, 1, "frame", "a client's update"),
    TopicSpec("status", "status/{node}", True, 1, "json",
              "online/offline (Last Will), version, device profile"),
    TopicSpec("metrics", "metrics/{node}", False, 0, "json", "metrics"),
    TopicSpec("onnx", "onnx", True, 1, "frame", "the latest exported ONNX model"),
    TopicSpec("ctl", "ctl", False, 1, "json",
              "operator commands (start/pause/resume/stop/export/status/runs); operators "
              "only"),
    TopicSpec("events", "events", False, 1, "json",
              "run events: queued/started/resumed/paused/continued/stopped/cancelled/"
              "finished, round opened/closed, client joined/left/refused, model exported, "
              "ONNX published, errors (docs/protocol.md section 9)"),
    TopicSpec("reply", "reply/{node}", False, 1, "json",
              "replies to operator commands (the requester's own reply topic)"),
    TopicSpec("runs", "runs/{node}", True, 1, "json",
              "one run's record: state, rounds done, accuracy, outputs ({node}: the run id)"),
    TopicSpec("secure", "secure/{node}", False, 1, "secagg",
              "a client's secure aggregation messages to the aggregator (keys, shares, "
              "masked input, unmask answer; docs/protocol.md section 10)"),
    TopicSpec("secure_to", "secure_to/{node}", False, 1, "secagg",
              "the aggregator's secure aggregation messages to one client (its neighbours' "
              "keys, the shares addressed to it, the unmask request)"),
)}

# first level after <prefix>/<fed>/ -> (kind without a node level, kind with one)
_BY_LEVEL = {}
for _spec in TOPIC_TABLE.values():
    _first = _spec.pattern.split("/")[0]
    _slot = 1 if _spec.per_node else 0
    _BY_LEVEL.setdefault(_first, [None, None])[_slot] = _spec.kind
del _spec, _first, _slot


# Ids that passed validate_id: a role checks the same few ids (its peers', in every chunk's
# metadata) over and over, and the check walks every character. Bounded: cleared when full.
_VALID_IDS: set = set()
_VALID_IDS_MAX = 4096


def validate_id(value, what: str = "id") -> str:
    """Return value if it can be one topic level (a federation, client or node id)."""
    if type(value) is str and value in _VALID_IDS:
        return value
    if not isinstance(value, str):
        raise TopicError(f"{what}: must be a string, got {type(value).__name__} {value!r}")
    if not value:
        raise TopicError(f"{what}: empty")
    n = len(value.encode("utf-8", "surrogatepass"))
    if n > MAX_ID_BYTES:
        raise TopicError(f"{what}: {value[:20]!r}... is {n} bytes of UTF-8, "
                         f"the limit is {MAX_ID_BYTES}")
    if value in (".", ".."):
        # a valid topic level, but ids become path components too (runs/<run id>/, a
        # node's state directory), where these name the directory itself or its parent
        raise TopicError(f"{what}: {value!r} names a directory itself or its parent when "
                         "used as a path component")
    for ch in value:
        if ch in "/+#":
            raise TopicError(f"{what}: {value!r} contains {ch!r} (a topic separator or "
                             "wildcard)")
        if ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F:
            raise TopicError(f"{what}: {value!r} contains control character U+{ord(ch):04X}")
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise TopicError(f"{what}: {value!r} contains a lone surrogate U+{ord(ch):04X} "
                             "(not UTF-8)")
    if type(value) is str:           # not a str subclass, whose hash or equality may differ
        if len(_VALID_IDS) >= _VALID_IDS_MAX:
            _VALID_IDS.clear()
        _VALID_IDS.add(value)
    return value


class Topics:
    """Topic strings for one federation under one prefix."""

    def __init__(self, federation: str, prefix: str = DEFAULT_PREFIX):
        if not isinstance(prefix, str) or not prefix:
            raise TopicError(f"prefix: need a non-empty string, got {prefix!r}")
        levels = prefix.split("/")
        for i, level in enumerate(levels):
            validate_id(level, f"prefix {prefix!r} level {i + 1}")
        if prefix.startswith("$"):
            raise TopicError(f"prefix: {prefix!r} starts with '$', which brokers reserve "
                             "($SYS, $aws, ...)")
        self.federation = validate_id(federation, "federation id")
        self.prefix = prefix
        self.base = f"{prefix}/{federation}"
        self._levels = len(levels) + 1

    def __repr__(self) -> str:
        return f"Topics({self.federation!r}, prefix={self.prefix!r})"

    # ------------------------------------------------------------------ building
    def topic(self, kind: str, node: str | None = None) -> str:
        """The topic of `kind` (a TOPIC_TABLE key); per-node kinds need `node`."""
        spec = self.spec(kind)
        if spec.per_node:
            if node is None:
                raise TopicError(f"topic {kind!r} needs a node id ({spec.pattern})")
            return f"{self.base}/{spec.pattern.format(node=validate_id(node, f'{kind} node id'))}"
        if node is not None:
            raise TopicError(f"topic {kind!r} has no node level; got node {node!r}")
        return f"{self.base}/{spec.pattern}"

    def round(self) -> str:
        return self.topic("round")

    def model(self) -> str:
        return self.topic("model")

    def client_model(self, client: str) -> str:
        return self.topic("client_model", client)

    def update(self, client: str) -> str:
        return self.topic("update", client)

    def status(self, node: str) -> str:
        return self.topic("status", node)

    def metrics(self, node: str) -> str:
        return self.topic("metrics", node)

    def onnx(self) -> str:
        return self.topic("onnx")

    def ctl(self) -> str:
        return self.topic("ctl")

    def events(self) -> str:
        return self.topic("events")

    def reply(self, requester: str) -> str:
        return self.topic("reply", requester)

    def run_record(self, run_id: str) -> str:
        return self.topic("runs", run_id)

    def secure(self, client: str) -> str:
        return self.topic("secure", client)

    def secure_to(self, client: str) -> str:
        return self.topic("secure_to", client)

    def subscription(self, kind: str) -> str:
        """The subscription filter for every topic of `kind` ('+' for the node level)."""
        spec = self.spec(kind)
        return f"{self.base}/{spec.pattern.format(node='+')}"

    @staticmethod
    def spec(kind: str) -> TopicSpec:
        try:
            return TOPIC_TABLE[kind]
        except KeyError:
            raise TopicError(f"unknown topic kind {kind!r}; valid: {sorted(TOPIC_TABLE)}") \
                from None

    # ------------------------------------------------------------------ parsing
    def parse(self, topic: str) -> tuple[str, str | None]:
        """(kind, node or None) of a topic of this federation; TopicError for anything else."""
        if not isinstance(topic, str):
            raise TopicError(f"topic: must be a string, got {type(topic).__name__}")
        if not topic.startswith(self.base + "/"):
            raise TopicError(f"topic {topic!r} is not under {self.base + '/'!r} "
                             "(another prefix or federation)")
        rest = topic[len(self.base) + 1:].split("/")
        kinds = _BY_LEVEL.get(rest[0])
        if kinds is None:
            raise TopicError(f"topic {topic!r}: unknown kind {rest[0]!r} after {self.base!r}; "
                             f"valid: {sorted(_BY_LEVEL)}")
        if len(rest) == 1:
            if kinds[0] is None:
                raise TopicError(f"topic {topic!r}: {rest[0]!r} needs a node id level")
            return kinds[0], None
        if len(rest) == 2 and kinds[1] is not None:
            try:
                node = validate_id(rest[1], f"node id in topic {topic!r}")
            except TopicError as exc:
                raise TopicError(str(exc)) from None
            return kinds[1], node
        if kinds[1] is None:
            raise TopicError(f"topic {topic!r}: {rest[0]!r} takes no further levels")
        raise TopicError(f"topic {topic!r}: {len(rest) - 2} extra level(s) after the node id")
