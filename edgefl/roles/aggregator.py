"""The aggregator: the round loop of a federation over MQTT (docs/roles.md).

    aggregator = Aggregator(plan, transport, state_dir, AggregatorSettings(round_timeout_s=60))
    result = aggregator.run()          # returns when the run is finished (or stop is set)

Each round r is the round engine's (edgefl.rounds), as in `edgefl simulate`; what is this
module's own is how the tasks reach the clients and the updates come back:

1. open the round (`RoundEngine.open_round`): select (`select_clients(seed, r, ...)`,
   stateless) and `strategy.configure` -> tasks, and who may upload;
2. announce: the retained JSON announcement on `round` (round, deadline, model hash,
   per-client tasks), then the model: the global model once on `model` (FedMR's per-client
   models on `model/<client>`), as binary frames chunked to `max_payload`;
3. collect updates on `update/+` until the round closes: every uploader in ("all"), a
   quorum fraction of them ("quorum"), every uploader still missing is offline by its Last
   Will ("offline"), or the deadline passed ("deadline"). A round with no update by its
   deadline is announced again with a new deadline. Late updates (for a closed round) are
   dropped, duplicates (QoS 1 repeats, a client re-sending) ignored, updates from clients
   not allowed to upload this round (FedUmf) refused, every bad frame logged with its reason;
4. close it (`RoundEngine.close_round`): aggregate in sorted client order (an update the
   strategy cannot use is refused and the rest aggregated), evaluate on the test set when
   due, build the round's record;
5. checkpoint atomically (roles/state.py), then append "aggregated" to the journal
   `rounds.jsonl` -- the record that each round was aggregated exactly once;
6. publish the round's metrics and events.

Restarted with the same state directory it loads the checkpoint and re-announces the round
that was open; clients that had already uploaded it re-send their stored update.

Retained messages and chunks (docs/protocol.md section 5): a retained topic keeps only the
last message, so a model frame that needs several chunks is published with the retain flag
clear (and the stale retained frame cleared); a client that missed it (joined late, lost a
chunk) asks with `need_model` in its status, or is re-sent its model when its status turns
online again, on its own `model/<client>` topic. A model that fits one frame is retained.

Determinism: selection, task seeds and aggregation order are the round engine's, the same
as `edgefl.sim.run_federation`'s, so with compression "none" a run over a broker ends with
the same model, bit for bit, as the in-process simulation of the same config and seed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from .. import __version__
from .._malloc import keep_frames_in_heap
from ..errors import ConfigError, budget_stop
from ..io import bounded_text, terminal_text
from ..checkpoint import model_sha256
from ..config import check_number
from ..models import Model
from ..privacy import NO_HOOKS, BudgetExhausted, PrivacyHooks, secagg
from ..privacy.hooks import task_generator
from ..rounds import RoundEngine, RoundPlan, UploadTotals, add_evaluation, client_contribution
from ..runconfig import MODEL_INITS
from ..service.layered import check_setting, default
from ..strategies import Setup, State, Strategy, StrategyError, Update
from ..transport import wire
from ..transport.base import ConnectionEvent, Message, Transport, TransportError
from ..transport.topics import DEFAULT_PREFIX, TopicError, Topics, validate_id
from ..transport.signing import SignatureError
from .trust import secure_context, secure_signer, verify_secure
from .signed_log import signed_event
from .messages import (MessageError, TopicCache, attempt_tag, build_announcement,
                       buffers_sha256, finished_announcement, new_announce_id, parse_status,
                       parse_update_scalars, peek_frame, status_payload)
from .state import (JOURNAL_FILE, AggregatorCheckpoint, StateError, StateWriteError,
                    append_journal, jsonable, read_journal)

__all__ = ["AggregatorSettings", "RunPlan", "Aggregator", "AggregatorResult", "secure_plan",
           "run_fingerprint", "default_client_ids"]

log = logging.getLogger("edgefl.roles.aggregator")
def boards_by_reason(reasons: Mapping) -> dict:
    """{reason: [nodes]} of {node: reason}, in the nodes' order: boards that gave one reason
    named together in an error."""
    out: dict = {}
    for node, why in reasons.items():
        out.setdefault(why, []).append(node)
    return out


# characters of a board's refusal reason in the log and in the client_refused event:
# edgefl's are a sentence or two; a board may send up to its whole status (64 KiB), which
# would bury the log and reach every watcher of the events topic
REASON_CHARS = 500
VERSION_CHARS = 64      # a version as a status states it, in the messages that name a board

# why a board that sends a plain update in a secure round cannot take part in it
_NO_SECURE = ("its edgefl predates secure aggregation over MQTT (docs/protocol.md sections "
              "10 and 14), so it ignores the announcement's 'secure' field and uploads its "
              f"update unmasked; this aggregator runs edgefl {__version__}: upgrade the "
              "board's edgefl")


def default_client_ids(n: int) -> tuple:
    """The node ids of a federation of n clients when none are configured: client-0 ..."""
    return tuple(f"client-{i}" for i in range(int(n)))


# The AggregatorSettings fields that are settings of the `edgefl aggregator` service: each
# takes its default and its check from that key of the layered table (edgefl.service.keys,
# edgefl/service/defaults.yaml), so a library caller, a simulation and the service agree.
AGGREGATOR_KEYS = {
    "federation": "node.federation",
    "round_timeout_s": "round.deadline",
    "quorum": "round.quorum",
    "min_updates": "round.min_updates",
    "offline_grace_s": "round.offline_grace",
    "max_payload": "transport.chunk_size",
    "compression": "transport.compression",
    "chunks_per_sender": "limits.chunks_per_sender",
}


@dataclass(frozen=True)
class AggregatorSettings:
    """How the aggregator runs rounds over the broker. The fields of AGGREGATOR_KEYS have
    the service's defaults and checks (`edgefl config show --role aggregator` lists them).

    round_timeout_s: the deadline, seconds after a round is announced (round.deadline).
    quorum:          fraction of a round's uploaders whose updates close it early
                     (1.0: wait for all of them, or for the deadline).
    min_updates:     fewest updates a round is aggregated with; a round that has fewer at
                     its deadline is announced again.
    max_payload:     bytes per MQTT message; larger frames are chunked (AWS IoT: 128 KiB).
    compression:     none | f16 | int8, how the models travel down (clients choose theirs).
    resend_interval_s: at most one model re-send per client per interval.
    offline_grace_s: how long a client must have been offline (its Last Will) before a
                     round stops waiting for it, and how long after our own reconnect to
                     the broker no round closes for missing clients being offline: a broker
                     shutting down publishes every client's will, and the clients need
                     their reconnect time to say they are back.
    reassembly_bytes, reassembly_bytes_per_sender, chunks_per_sender: the limits of the
                     update reassembler (docs/limits.md); None sizes them from the model.
    """
    node_id: str = "aggregator"
    federation: str = default("node.federation")
    prefix: str = DEFAULT_PREFIX
    round_timeout_s: float = default("round.deadline")
    quorum: float = default("round.quorum")
    min_updates: int = default("round.min_updates")
    max_payload: int = default("transport.chunk_size")
    compression: str = default("transport.compression")
    reassembly_timeout_s: float = 60.0
    reassembly_bytes: int | None = None
    reassembly_bytes_per_sender: int | None = None
    chunks_per_sender: int | None = default("limits.chunks_per_sender")
    resend_interval_s: float = 1.0
    offline_grace_s: float = default("round.offline_grace")
    profile: str | None = None
    poll_s: float = 0.25
    # signatures (roles/trust.py): what it signs with, whose updates it checks; None: neither
    trust: object = field(default=None, compare=False)
    # task_topics: also send each tasked client its task alone, retained on task/<client>
    # (and the run's end to every client there), for clients that do not follow the round
    # topic (docs/protocol.md section 1; a simulated fleet: edgefl.sim.over_broker)
    task_topics: bool = False
    # overlap_evaluation: evaluate a round's model (when due, not the last round's) in a
    # thread while the next round runs, as `edgefl simulate` in process does, instead of
    # between the round's last update and the next announcement, where every client
    # waits. The checkpoint of round r is written, and round r+1 announced, before r's
    # evaluation is done: r's record is checkpointed with it at the next commit (or when
    # the run stops), and a restart evaluates a checkpointed model whose record lacks it.
    # on_round(record) of round r comes once its evaluation is done. (A simulated fleet:
    # edgefl.sim.over_broker; at 100 clients, 10 a round, the evaluation of the test set
    # was the largest part of a round, docs/scaling.md.)
    overlap_evaluation: bool = False
    # task_in_copy (with task_topics): a tasked client's first task of a round travels in the
    # copy of the global model sent to it (the frame's scalar "task": the task alone, as it
    # would be on task/<client>), not as a message of its own: one message a tasked client
    # instead of two, through the broker and two interpreters. Only for clients that know
    # the scalar (docs/protocol.md section 1); unsigned runs without secure aggregation;
    # a re-announcement's task, and a copy too large for one message, still go on
    # task/<client>. (A simulated fleet, all of whose clients are this version.)
    task_in_copy: bool = False
    # checkpoint_rounds: write each round's checkpoint and journal line to state_dir, as a
    # fleet's aggregator must (a restart resumes from them). False: they are kept in memory
    # only, for a run whose state directory is deleted with it, which nothing can resume
    # (a simulated fleet: edgefl.sim.over_broker without a state_dir; writing them was about
    # 1.4 ms of CPU between a round's last update and the next announcement at 100 clients,
    # docs/scaling.md). The run's first checkpoint is written either way.
    checkpoint_rounds: bool = True

    def __post_init__(self):
        validate_id(self.node_id, "aggregator node id")
        validate_id(self.federation, "federation id")
        for name, key in AGGREGATOR_KEYS.items():
            object.__setattr__(self, name, check_setting(key, getattr(self, name),
                                                         f"AggregatorSettings.{name}"))
        for name in ("reassembly_bytes", "reassembly_bytes_per_sender"):
            if getattr(self, name) is not None:       # None: sized from the model
                check_number(getattr(self, name), f"AggregatorSettings.{name}",
                             integer=True, minimum=1)

    @classmethod
    def from_service_config(cls, config, **fields) -> "AggregatorSettings":
        """The settings of the `edgefl aggregator` service from its resolved configuration
        (a ServiceConfig of the aggregator); `fields` sets the others, or replaces some."""
        values = {name: config[key] for name, key in AGGREGATOR_KEYS.items()}
        values.update(node_id=config["node.id"], profile=config.profile,
                      reassembly_bytes=config.mib("limits.reassembly_mb"),
                      reassembly_bytes_per_sender=config.mib("limits.sender_reassembly_mb"))
        if "trust" not in fields:
            from .trust import Trust
            values["trust"] = Trust.from_service_config(config, "aggregator")
        return cls(**{**values, **fields})


@dataclass(frozen=True)
class RunPlan:
    """What one run is: everything the aggregator needs besides the network.

    strategy / init_params / setup: as for run_federation (setup.units filled in).
    client_ids: the node id of strategy client i at position i.
    test:       (x, y) to evaluate the global model on, or None.
    description: the run's config as JSON data (part of the checkpoint's fingerprint).
    hooks:      DP's hooks (edgefl.privacy.dp), or NO_HOOKS. With hooks the rounds sum: the
                aggregator applies the client hook to each update it receives (central DP:
                it is trusted with them, and the clients need nothing new) and closes the
                round from the clear sum (`RoundEngine.close_round_clear_sum`).
    secure:     the run's `privacy.secure_aggregation` settings, or None. With it no update
                comes up: after training, each uploader runs SecAgg+ with the aggregator on
                its `secure` / `secure_to` topics (docs/protocol.md section 10) and the round
                closes from the unmasked sum. sample_counts bound the clients' weights.
    """
    strategy: Strategy
    init_params: np.ndarray
    setup: Setup
    model: Model
    clients_per_round: int
    client_ids: tuple
    test: tuple | None = None
    eval_every: int = 1
    description: Mapping = field(default_factory=dict)
    hooks: PrivacyHooks = NO_HOOKS
    secure: object = None               # privacy.settings.SecureAggregation: secure rounds
    sample_counts: tuple = ()           # |D_i| of client i: the secure quantiser's weight bound
    # a warm start's parameters' sha256 when the parameters are not at hand: a resume whose
    # model.init file is gone takes the hash recorded at the first start (roles/runner.py),
    # and init_params, never used once a checkpoint exists, are a stand-in
    init_sha256: str | None = None

    def __post_init__(self):
        ids = tuple(self.client_ids)
        if len(ids) != len(self.setup.clients):
            raise ValueError(f"run plan: {len(ids)} client ids for {len(self.setup.clients)} "
                             f"clients")
        if len(set(ids)) != len(ids):
            raise ValueError(f"run plan: client ids are not distinct: {list(ids)[:10]}")
        for node in ids:
            validate_id(node, "client id")
        object.__setattr__(self, "client_ids", ids)


def secure_plan(run) -> dict:
    """RunPlan's secure-aggregation fields for a prepared run (runs.prepare.PreparedRun):
    the config's settings and every client's sample count."""
    privacy = run.config.privacy
    settings = privacy.secure_aggregation if privacy is not None else None
    if settings is None:
        return {}
    return {"secure": settings,
            "sample_counts": tuple(run.clients[c].num_samples for c in run.setup.clients)}


def run_fingerprint(plan: RunPlan, settings: AggregatorSettings) -> str:
    """What identifies a run in its checkpoint: config, clients, federation, strategy, and
    for a warm start (model.init naming a checkpoint) the parameters it starts from, which
    the config names only by their file's path."""
    doc = {"config": jsonable(dict(plan.description)), "clients": list(plan.client_ids),
           "federation": settings.federation, "prefix": settings.prefix,
           "strategy": plan.strategy.name, "table": plan.model.table.digest,
           "rounds": plan.setup.rounds, "seed": plan.setup.seed}
    # a warm start's parameters, which the config names only by their file's path (a seeded
    # model follows from the config: runs without a file keep the fingerprint they had)
    if dict(plan.description.get("model") or {}).get("init", "uniform") not in MODEL_INITS:
        doc["init_sha256"] = plan.init_sha256 or model_sha256(plan.init_params)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class AggregatorResult:
    run_id: str
    state: State
    params: np.ndarray
    history: list
    aggregated: list
    finished: bool
    stats: dict
    stopped: dict | None = None     # why the run ended before its last round (errors.budget_stop)


class _Downlink:
    """The payloads of one model frame, kept to re-send it. Made with `build` instead of
    payloads, the frame is encoded when they are first asked for: the global model of a
    round that sends each tasked client a copy is announced by its hash, and its frame is
    needed only if something publishes it after all (_build_downlinks)."""

    def __init__(self, topic: str, payloads: list | None, retained: bool, sha: str,
                 message_id: int, build=None):
        self.topic, self.retained, self.sha = topic, retained, sha
        # the id of the frame the payloads carry (the announcement names it)
        self.message_id = message_id
        self._payloads, self._build = payloads, build

    @property
    def payloads(self) -> list:
        if self._payloads is None:
            self._payloads, self._build = self._build(), None
        return self._payloads


@dataclass
class _OpenRound:
    round_plan: RoundPlan            # the engine's: selection, tasks and uploaders by client
    node_tasks: dict                 # node id -> Task
    uploaders: set                   # node ids of round_plan.uploaders
    announce_id: str = ""
    opened: float = 0.0
    deadline: float = 0.0
    announcement: bytes = b""
    downlinks: dict = field(default_factory=dict)     # "global" or node -> _Downlink
    copies: dict = field(default_factory=dict)        # node -> its copy of the global model
    # the buffers' (name, id) -> (buffers, announced sha256, payload sha256 or None): a
    # model's hashes, once a round however many copies of it are encoded (_frame)
    hashes: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)      # node -> Update
    train_s: dict = field(default_factory=dict)       # node -> seconds
    refused: set = field(default_factory=set)         # nodes whose update aggregate refused
    refusals: dict = field(default_factory=dict)      # node -> why it refused the round
    last_resend: dict = field(default_factory=dict)
    expects: dict = field(default_factory=dict)       # node -> wire.Expectation of its update
    secure: object = None            # the attempt's secagg.SecAggServer (secure rounds)
    secure_tag: int = 0              # the attempt's tag: the high half of its chunks' ids
    secure_seq: int = 0
    secure_in: object = None         # secagg.ChunkAssembler of the clients' messages
    secure_failed: list = field(default_factory=list)   # why each failed attempt failed
    counts: dict = field(default_factory=lambda: {"late": 0, "duplicates": 0, "rejected": 0,
                                                  "resends": 0, "announcements": 0,
                                                  "wire_up_bytes": 0, "wire_down_bytes": 0})

    @property
    def round(self) -> int:
        return self.round_plan.round


class Aggregator:
    """Runs the rounds of `plan` over `transport` (not yet connected), persisting to
    `state_dir`. on_round(record, history) is called after each round is checkpointed
    (with settings.overlap_evaluation, once its evaluation is done too), on_model(round,
    model) when its model is; `stop` (an Event-like object) ends the loop between steps. `control` (a
    roles.control.RunControl, from the daemon) names a new run and pauses it: while
    `control.paused` is set no round closes or opens, the broker is still serviced, and on
    resume the open round's deadline moves by the paused time and the round is announced
    again."""

    def __init__(self, plan: RunPlan, transport: Transport, state_dir: str | os.PathLike,
                 settings: AggregatorSettings = AggregatorSettings(), *,
                 on_round: Callable[[dict, list], None] | None = None, stop=None,
                 notifier=None, control=None,
                 on_model: Callable[[int, np.ndarray], None] | None = None):
        keep_frames_in_heap()          # every round: one update frame per client, a model out
        self.plan = plan
        self.transport = transport
        self.state_dir = os.fspath(state_dir)
        self.settings = settings
        self.on_round = on_round
        self.on_model = on_model
        # overlap_evaluation: (record, future) of the last committed round's evaluation
        # running in _evaluator's thread, and that executor (made on first use)
        self._evaluating: tuple | None = None
        self._evaluator = None
        self.stop = stop if stop is not None else threading.Event()
        self.notifier = notifier
        self.control = control
        self.topics = Topics(settings.federation, settings.prefix)
        self._topic_cache = TopicCache(self.topics)
        self.table = plan.model.table
        # the rounds' selection, tasks, upload check, aggregation, evaluation and record
        # (the test set is checked here, once for every evaluation of the run)
        self.engine = RoundEngine.for_run(plan.strategy, plan.setup, plan.model,
                                          plan.clients_per_round, eval_every=plan.eval_every,
                                          test=plan.test)
        self.members = {node: i for i, node in enumerate(plan.client_ids)}
        # the nodes whose updates come in on update/+ and whose status is followed: the
        # clients; the centre of a two-level federation takes its edges' instead (roles/edge.py)
        self.senders: Mapping[str, int] = self.members
        self.sender_kind = "client"
        # signatures (roles/trust.py): None each when the site file sets no keys
        self.signer = getattr(settings.trust, "signer", None)
        self.uplink = getattr(settings.trust, "uplink", None)
        # (array, sha256 hex) of the global model the last commit journalled (_commit)
        self._journal_hash: tuple | None = None
        self.fingerprint = run_fingerprint(plan, settings)
        # Limits (docs/limits.md). Unless configured: room for every uploader's chunked
        # update in flight at once (two buffers each, e.g. MFL's model and momentum, plus
        # headroom), never less than wire's default; per sender, two updates; and a budget
        # of four updates' worth of chunks per round at the smallest chunk size edgefl
        # allows (1 KiB), so QoS 1 repeats and re-sends after a re-announcement stay well
        # inside it while a client flooding its update topic is cut off.
        update_bytes = 2 * 4 * plan.model.n_params + (64 << 10)
        in_flight = plan.clients_per_round * update_bytes * 3 // 2
        self.reassembler = wire.Reassembler(
            settings.reassembly_timeout_s,
            max_bytes=settings.reassembly_bytes or max(256 << 20, in_flight),
            max_bytes_per_sender=settings.reassembly_bytes_per_sender or 2 * update_bytes,
            max_chunks_per_sender=settings.chunks_per_sender
            or max(256, 4 * -(-update_bytes // 1024)),
            # checking signatures: an update is hashed while its chunks arrive, so the
            # last one's check is not a whole 4 MB pass at the end of the round
            digests=self.uplink is not None)
        self.online: dict[str, bool] = {}
        self.versions: dict[str, str] = {}  # node -> the edgefl version its status names
        # secure runs: node -> why it cannot take part (a board older than secure
        # aggregation over MQTT sent a plain update); its secure message clears it
        self._without_secure: dict[str, str] = {}
        self.open: _OpenRound | None = None
        self.ckpt: AggregatorCheckpoint | None = None
        self.stats = {"late": 0, "duplicates": 0, "rejected": 0, "resends": 0}
        self.stopped: dict | None = None    # set when DP's budget ends the run early
        # (node, message id) already reported, the latest `reassembler.remember` of them: a
        # board's rejected or late frames are logged once each, and over a long run the set
        # would otherwise grow by every such frame's id, a chunk budget's worth a round
        self._logged: OrderedDict = OrderedDict()
        self._cleared: set = set()           # retained topics cleared this session
        self._retained: set = set()          # model topics we left a retained frame on
        self._connects = 0                   # `connected` events handled
        self._reconnected_at = -math.inf     # monotonic time of the last reconnect (inf:
                                             # the connection is lost)
        self._offline_since: dict[str, float] = {}   # node -> monotonic time it went offline

    # ------------------------------------------------------------------ public
    @property
    def rounds(self) -> int:
        return self.plan.setup.rounds

    @property
    def run_id(self) -> str | None:
        return self.ckpt.run_id if self.ckpt else None

    @property
    def journal_path(self) -> str:
        return os.path.join(self.state_dir, JOURNAL_FILE)

    def run(self) -> AggregatorResult:
        os.makedirs(self.state_dir, exist_ok=True)
        self.ckpt = self._load_or_start()
        if self.control is not None:
            self.control.attach(self)
        self._connect()
        if self.notifier is not None:
            self.notifier.ready(f"aggregator: run {self.ckpt.run_id}, {self.ckpt.round} of "
                                f"{self.rounds} rounds done")
        try:
            done = self.ckpt.round
            self._event("run_resumed" if done else "run_started", round=done + 1)
            for r in range(done + 1, self.rounds + 1):
                if self.stop.is_set() or not self._hold():
                    break
                if not self._run_round(r):
                    break
            self._last_evaluation()
            finished = self.ckpt.round >= self.rounds or self.stopped is not None
            if finished:
                self._finish()
        finally:
            self.open = None
            if self._evaluator is not None:
                # no thread left in the C core; a record still without its evaluation
                # (an error ended the run) is completed by the next start (_load_or_start)
                self._evaluator.shutdown(wait=True)
                self._evaluator, self._evaluating = None, None
            self._close()
        return AggregatorResult(self.ckpt.run_id, self.ckpt.state,
                                self.plan.strategy.global_model(self.ckpt.state),
                                list(self.ckpt.history), list(self.ckpt.aggregated),
                                self.ckpt.round >= self.rounds or self.stopped is not None,
                                dict(self.stats), self.stopped)

    # ------------------------------------------------------------------ start and stop
    def _strategy_record(self) -> dict:
        return {"name": self.plan.strategy.name,
                "params": self.plan.strategy.hyperparameters()}

    def _load_or_start(self) -> AggregatorCheckpoint:
        ckpt = AggregatorCheckpoint.load(self.state_dir)
        if ckpt is not None:
            if ckpt.fingerprint != self.fingerprint:
                raise StateError(
                    f"{self.state_dir}: holds the checkpoint of run {ckpt.run_id} made with "
                    f"another configuration (fingerprint {ckpt.fingerprint[:12]}, this run "
                    f"{self.fingerprint[:12]}: config, clients, federation, strategy or "
                    f"the parameters of model.init's file differ); use another state "
                    f"directory, or remove the checkpoint to start over")
            if ckpt.aggregated != list(range(1, ckpt.round + 1)):
                raise StateError(f"{self.state_dir}: checkpoint of round {ckpt.round} lists "
                                 f"aggregated rounds {ckpt.aggregated}; it is inconsistent")
            self._reconcile_journal(ckpt)
            last = ckpt.history[-1] if ckpt.history else None
            if last is not None and self._evaluation_missing(last):
                # checkpointed while its evaluation ran (overlap_evaluation): the model is
                # the checkpoint's, so the evaluation is the one the run would have made
                add_evaluation(last, self.engine.evaluate(
                    self.plan.strategy.global_model(ckpt.state)))
                ckpt.save(self.state_dir)
            log.info("resuming run %s from its checkpoint: %d of %d rounds aggregated",
                     ckpt.run_id, ckpt.round, self.rounds)
            return ckpt
        state = self.plan.strategy.init(self.plan.init_params, self.plan.setup)
        ckpt = AggregatorCheckpoint(
            run_id=getattr(self.control, "run_id", None) or os.urandom(8).hex(),
            fingerprint=self.fingerprint, round=0, aggregated=[],
            state=state, strategy=self._strategy_record(),
            rng={"seed": self.plan.setup.seed,
                 "streams": "selection (seed, round); local data order (seed, round, client); "
                            "FedMR permutations (seed, round): stateless"})
        ckpt.save(self.state_dir)
        append_journal(self.journal_path, {"event": "started", "run": ckpt.run_id,
                                           "at": time.time()})
        log.info("run %s started: %s, %d rounds, %d clients", ckpt.run_id,
                 self.plan.strategy.name, self.rounds, len(self.plan.client_ids))
        return ckpt

    def _reconcile_journal(self, ckpt: AggregatorCheckpoint) -> None:
        """A crash between the checkpoint's rename and the journal's append leaves a round
        in the checkpoint only: append it now, so the journal lists every aggregated round
        exactly once."""
        logged = {rec.get("round") for rec in read_journal(self.journal_path)
                  if rec.get("event") == "aggregated" and rec.get("run") == ckpt.run_id}
        for r in ckpt.aggregated:
            if r not in logged:
                append_journal(self.journal_path, {"event": "aggregated", "run": ckpt.run_id,
                                                   "round": r, "recovered": True,
                                                   "at": time.time()})
        append_journal(self.journal_path, {"event": "resumed", "run": ckpt.run_id,
                                           "round": ckpt.round, "at": time.time()})

    def _status(self, online: bool, will: bool = False) -> bytes:
        # The will is fixed at connect time: it carries no last round (it would be stale).
        return status_payload(self.settings.node_id, "aggregator", online,
                              profile=self.settings.profile,
                              last_round=self.ckpt.round if self.ckpt and not will else None,
                              run=self.run_id,
                              round=self.open.round if self.open and online else None,
                              paused=True if online and self._paused() else None,
                              key=self.signer.fingerprint if self.signer else None,
                              signatures="on" if self.uplink else "off")

    def _connect(self) -> None:
        t = self.transport
        t.set_will(self.topics.status(self.settings.node_id), self._status(False, will=True))
        t.connect()
        t.subscribe(self.topics.subscription("update"), qos=1)
        # Statuses at QoS 0: all are retained, so the subscription (on every connect) brings
        # one per known node at once, and at QoS 1 they filled this session's queue at the
        # broker (Mosquitto's max_queued_messages, 1000 by default), which then silently
        # dropped round 1's updates behind them (issue 19: 1,000 clients lost 82 of 100).
        # Mosquitto neither queues nor limits QoS 0 to a connected session, and a status
        # missed while disconnected comes back retained with the re-subscription.
        t.subscribe(self.topics.subscription("status"), qos=0)
        if self.plan.secure is not None:
            t.subscribe(self.topics.subscription("secure"), qos=1)
        self._publish_status()

    def _close(self) -> None:
        try:
            # Unsubscribe first: with nothing arriving while the transport disconnects, its
            # DISCONNECT goes out and the broker discards the will (paho can otherwise stop
            # its network thread between reading a message and writing the DISCONNECT).
            for topic_filter in self.transport.subscriptions:
                self.transport.unsubscribe(topic_filter)
            # our own offline status (with the last round), not the will set at connect
            self._publish_status(online=False)
            self.transport.close(announce_offline=False)
        except (TransportError, OSError) as exc:
            log.warning("closing the connection: %s", exc)

    def _publish_status(self, online: bool = True) -> None:
        try:
            self.transport.publish(self.topics.status(self.settings.node_id),
                                   self._status(online), qos=1, retain=True)
        except TransportError as exc:
            log.warning("status not published: %s", exc)

    def _event(self, event: str, **fields) -> None:
        doc = signed_event({"event": event, "run": self.run_id, "node": self.settings.node_id,
                            "at": time.time(), **fields}, self.signer)
        try:
            self.transport.publish(self.topics.events(), json.dumps(doc).encode(), qos=1)
        except TransportError as exc:
            log.debug("event %s not published: %s", event, exc)

    def _finish(self) -> None:
        sha = hashlib.sha256(np.ascontiguousarray(
            self.plan.strategy.global_model(self.ckpt.state), dtype=np.float32)).hexdigest()
        rounds = self.rounds if self.stopped is None else self.ckpt.round
        doc = finished_announcement(run_id=self.ckpt.run_id, aggregator=self.settings.node_id,
                                    rounds=rounds, model_sha256=sha)
        if self.signer is not None:
            doc = self.signer.sign_doc(doc, "finished", self.ckpt.run_id, rounds)
        payload = json.dumps(doc).encode()
        self.transport.publish(self.topics.round(), payload, qos=1, retain=True)
        if self.settings.task_topics:          # every client hears of the end, tasked or not
            for node in sorted(self.members):
                self.transport.publish(self.topics.topic("task", node), payload, qos=1,
                                       retain=True)
        for topic in sorted(self._retained):     # no stale round's model for late joiners
            self.transport.clear_retained(topic)
        if self.control is not None:
            self.control.rounds_over.set()       # before the event a script may act on
        self._event("run_finished", rounds=rounds, model_sha256=sha,
                    **({"stopped": self.stopped} if self.stopped else {}))
        self.transport.flush(10.0)
        log.info("run %s finished: %d rounds, final model sha256 %s", self.ckpt.run_id,
                 rounds, sha)

    def publish_onnx(self, path: str | os.PathLike, record_dir: str | None = None) -> dict | None:
        """An export of the run's model at `path` (edgefl.export): run_aggregator calls this
        after each one (the rounds an ExportPolicy exports, the final round included).
        Announces it, event `model_exported` (round, model_onnx, bytes, model_sha256,
        test_accuracy, trigger `periodic` or `final`), then publishes the file retained
        for every client, present and future (onnx_channel.publish_model: its parts on
        `onnx/<i>`, then the manifest on `onnx`; docs/protocol.md section 5.1) and says so,
        event `onnx_published` -- unless the run's control says this service does not
        publish (RunControl.publish_onnx, the service's `export.publish`: false); then
        None. `record_dir` keeps the part count of the last publication (default the state
        directory; a service that runs several runs on one federation gives one directory
        for all). Returns what was sent."""
        from .onnx_channel import publish_model

        path = os.fspath(path)
        r = self.ckpt.round
        params = np.ascontiguousarray(self.plan.strategy.global_model(self.ckpt.state),
                                      dtype=np.float32)
        accuracy = next((h.get("test_accuracy") for h in reversed(self.ckpt.history)
                         if h.get("test_accuracy") is not None), None)
        self._event("model_exported", round=r, model_onnx=path, bytes=os.path.getsize(path),
                    model_sha256=hashlib.sha256(params).hexdigest(), test_accuracy=accuracy,
                    trigger="final" if r >= self.rounds else "periodic")
        if self.control is not None and not getattr(self.control, "publish_onnx", True):
            return None
        pub = publish_model(self.transport, self.topics, path, round=r,
                            sender=self.settings.node_id, run=self.ckpt.run_id,
                            max_payload=self.settings.max_payload,
                            record_dir=record_dir or self.state_dir, signer=self.signer)
        self._event("onnx_published", round=pub.round, sha256=pub.sha256, bytes=pub.nbytes,
                    parts=len(pub.parts))
        log.info("round %d: ONNX model published (%d bytes in %d retained part(s), sha256 "
                 "%s)", pub.round, pub.nbytes, len(pub.parts), pub.sha256[:12])
        return {"round": pub.round, "sha256": pub.sha256, "bytes": pub.nbytes,
                "parts": len(pub.parts)}

    # ------------------------------------------------------------------ one round
    def _run_round(self, r: int) -> bool:
        """Open, collect, aggregate and commit round r; False when stopped first."""
        try:
            self.plan.hooks.before_round(r)    # a spent DP budget: no board trains for nothing
        except BudgetExhausted as exc:
            self.stopped = budget_stop(exc, r, self.rounds)
            log.info("run %s ends: %s", self.run_id, exc)
            return False
        state, ids = self.ckpt.state, self.plan.client_ids
        round_plan = self.engine.open_round(r, state)
        self.open = o = _OpenRound(round_plan,
                                   {ids[c]: t for c, t in round_plan.tasks.items()},
                                   {ids[c] for c in round_plan.uploaders})
        self._announce()
        if self.notifier is not None:
            self.notifier.status(f"round {r}/{self.rounds}: collecting updates")
        closed_by = self._collect() if self.plan.secure is None else self._collect_secure()
        if closed_by is None:
            log.info("round %d abandoned: stop requested; the checkpoint of round %d stands",
                     r, self.ckpt.round)
            return False
        if self.plan.secure is not None:
            server = o.secure
            total = server.total
            try:
                closed = self.engine.close_round_from_sum(
                    o.round_plan, total, UploadTotals.of_sum(total, server.uplink_bytes()),
                    state, hooks=self.plan.hooks, train_wall_s=0.0,
                    elapsed_before=self.ckpt.elapsed_s,
                    extras=lambda: {"closed_by": closed_by, "updates": total.count,
                                    "secure": _secure_record(server),
                                    "missing": sorted(o.uploaders - {self.plan.client_ids[c]
                                                                     for c in server.survivors}),
                                    **o.counts})
            except BudgetExhausted as exc:
                self.stopped = budget_stop(exc, r, self.rounds)
                log.info("run %s ends: %s", self.run_id, exc)
                return False
            self._commit(r, closed.state, closed.record)
            return True
        updates = {self.members[n]: u for n, u in o.received.items()}
        timing = dict(train_wall_s=max(o.train_s.values(), default=0.0),
                      elapsed_before=self.ckpt.elapsed_s,
                      # the last round's is made before the run's end is announced
                      defer_evaluation=self.settings.overlap_evaluation and r < self.rounds,
                      extras=lambda: {"closed_by": closed_by, "updates": len(updates),
                                      "missing": sorted(o.uploaders - set(o.received)),
                                      **o.counts})
        if self.plan.hooks is NO_HOOKS:
            closed = self.engine.close_round(o.round_plan, updates, state,
                                             on_unusable=self._refuse_unusable, **timing)
        else:
            try:
                closed = self._close_dp_round(o.round_plan, updates, state, timing)
            except BudgetExhausted as exc:
                self.stopped = budget_stop(exc, r, self.rounds)
                log.info("run %s ends: %s", self.run_id, exc)
                return False
        self._commit(r, closed.state, closed.record,
                     evaluate=closed.model if closed.evaluation_pending else None)
        return True

    def _close_dp_round(self, round_plan: RoundPlan, updates: dict, state: State, timing):
        """Close a central-DP round from the clear sum: each update becomes its contribution
        through the client hook here (clipped to the round's C; the same Generator seed as
        in process, so a reproducible run's model matches the in-process one bit for bit).
        An update the strategy cannot turn into a contribution is refused, as
        `on_unusable` refuses one it cannot aggregate."""
        contributions = {}
        for c, update in sorted(updates.items()):
            task = round_plan.tasks[c]
            try:
                contributions[c] = client_contribution(self.plan.strategy, task, update,
                                                       self.plan.hooks, task_generator(task))
            except (StrategyError, ValueError) as exc:
                self._refuse_unusable(c, StrategyError(str(exc)))
        for c in set(updates) - set(contributions):
            del updates[c]
        return self.engine.close_round_clear_sum(round_plan, contributions, state,
                                                 hooks=self.plan.hooks, **timing)

    def _announce(self, deadline: float | None = None) -> None:
        """Publish the announcement of the open round (a new id and deadline, `deadline` or
        round_timeout_s from now), then its models. Also used to announce the round again
        after a deadline without updates, and after a pause."""
        o, s = self.open, self.settings
        o.announce_id = new_announce_id()
        o.opened = time.time()
        o.deadline = deadline if deadline is not None else o.opened + s.round_timeout_s
        o.counts["announcements"] += 1
        if not o.downlinks:
            self._build_downlinks()
        glob = o.downlinks.get("global")
        to_each = glob is not None and self._model_to_each(o)
        embed = to_each and s.task_in_copy and s.task_topics and self.signer is None \
            and self.plan.secure is None
        carry: dict = {}          # node -> the message id of its copy, to carry its task
        if to_each:
            # the copies are made before the announcement, which names each one's frame:
            # the client takes it by its id instead of hashing it (docs/protocol.md). A
            # copy that carries its task is made after it, as it is sent, under the id
            # named in advance.
            for node, task in sorted(o.node_tasks.items()):
                if task.source != "global":
                    continue
                if embed and node not in o.copies and node not in o.downlinks:
                    carry[node] = wire.new_message_id()
                else:
                    self._copy(node)
        client_sha = {n: d.sha for n, d in o.downlinks.items() if n != "global"}
        frame_ids = {n: d.message_id for n, d in o.downlinks.items()}
        model = {"spec": json.loads(self.plan.model.spec),
                 "input_shape": list(self.plan.model.input_shape),
                 "num_classes": int(self.plan.model.num_classes),
                 "table": self.table.digest}
        doc = build_announcement(
            run_id=self.ckpt.run_id, aggregator=s.node_id, round=o.round, rounds=self.rounds,
            announce_id=o.announce_id, opened=o.opened, deadline=o.deadline,
            strategy=self._strategy_record(), model=model, compression=s.compression,
            global_sha=glob.sha if glob else None, tasks=o.node_tasks,
            client_index=self.members, client_sha=client_sha, frame_ids=frame_ids,
            copy_ids={**{n: d.message_id for n, d in o.copies.items()}, **carry})
        if self.plan.secure is not None:
            doc["secure"] = self._secure_setup().to_dict()
            if hasattr(self.plan.hooks, "client_settings"):
                # the aggregator sees only the sum, so the boards clip (and add their noise
                # shares in distributed mode) themselves
                doc["dp"] = self.plan.hooks.client_settings()
        unsigned = doc
        if self.signer is not None:
            doc = self.signer.sign_doc(doc, "announce", self.ckpt.run_id, o.round)
        o.announcement = json.dumps(doc, separators=(",", ":")).encode("utf-8")
        self.transport.publish(self.topics.round(), o.announcement, qos=1, retain=True)
        if s.task_topics:
            self._publish_tasks(unsigned, [n for n in sorted(o.node_tasks) if n not in carry])
        if to_each:
            # A few of many tasked: each its own copy (not retained) instead of the global
            # topic, which every client of the federation receives and drops unless tasked:
            # at 100 clients, 10 a round, ninety drops were half of a round through
            # Mosquitto. The client takes its copy by the frame id its task names.
            glob.retained = False            # (an online-again client is re-sent its copy)
            chunked = []
            for node, task in sorted(o.node_tasks.items()):
                if node in carry:
                    # built as it is sent: the first client starts while the next is encoded
                    if len(self._copy(node, task=self._task_payload(unsigned, node),
                                      message_id=carry[node]).payloads) > 1:
                        chunked.append(node)    # (its task is not read before the last chunk)
                if task.source == "global":
                    self._send_copy(node)
            if chunked:
                self._publish_tasks(unsigned, chunked)
        for key, downlink in o.downlinks.items():
            if key != "global" or not to_each:
                self._publish_downlink(downlink)
        self._publish_status()
        self._event("round_opened", round=o.round, deadline=o.deadline,
                    selected=[self.plan.client_ids[c] for c in o.round_plan.selected],
                    announcement=o.counts["announcements"])
        log.info("round %d announced (%s): %d tasks, %d uploaders, deadline in %.0f s",
                 o.round, o.announce_id, len(o.node_tasks), len(o.uploaders),
                 o.deadline - o.opened)

    def _publish_tasks(self, doc: dict, nodes) -> None:
        """The task alone of each of `nodes` (tasked clients), retained on its task/<client>
        topic: the round's announcement `doc` (unsigned) with only that client's entry in
        `tasks`, the same announcement id (a client that also follows the round topic takes
        it once), signed on its own when the aggregator signs."""
        for node in nodes:
            self.transport.publish(self.topics.topic("task", node),
                                   self._task_payload(doc, node), qos=1, retain=True)

    def _task_payload(self, doc: dict, node: str) -> bytes:
        """`node`'s task alone: announcement `doc` with only its entry in `tasks`."""
        alone = dict(doc, tasks={node: doc["tasks"][node]})
        if self.signer is not None:
            alone = self.signer.sign_doc(alone, "announce", self.ckpt.run_id, self.open.round)
        return json.dumps(alone, separators=(",", ":")).encode("utf-8")

    def _frame(self, kind: str, buffers, recipient: str | None = None, *,
               task: bytes | None = None, message_id: int | None = None,
               lazy: bool = False) -> _Downlink:
        """The downlink of one model frame. `lazy`: when the model's sha256 is known without
        encoding it (uncompressed), the frame is encoded only if its payloads are used."""
        o, s = self.open, self.settings
        # Each model is hashed once a round for the announcement (its sha256) and, signing,
        # once for its frames' content digest, which takes the payload's sha256 apart from
        # the frame's core (wire.content_digest): the copies of one model to several boards
        # share it, and the payload of a model of one f32 buffer is the parameters' bytes,
        # whose sha256 the journal computed at the last commit. What is left to hash is
        # hashed side by side (hashlib releases the GIL) on the way from one round's last
        # update to the next round's model.
        sign = self.signer.frame_signer(self.ckpt.run_id) if self.signer else None
        key = tuple(sorted((name, id(x)) for name, x in buffers.items()))
        cached = o.hashes.get(key)
        if cached is not None and all(buffers[n] is x for n, x in cached[0].items()):
            sha, payload = [cached[1]], cached[2]
        else:
            sha, payload = [], None
            if sign is not None and s.compression == "none":
                payload = self._payload_sha256(buffers)
            hasher = None
            if s.compression == "none":  # else the hash is of what the clients will decode
                if sum(getattr(x, "nbytes", 0) for x in buffers.values()) \
                        < _HASH_IN_THREAD_BYTES:
                    sha.append(buffers_sha256(buffers))    # (a thread costs more: _commit)
                else:
                    hasher = threading.Thread(target=lambda: sha.append(buffers_sha256(buffers)),
                                              name="edgefl-frame-hash", daemon=True)
                    hasher.start()
            try:
                if callable(payload):
                    payload = payload()
            finally:
                if hasher is not None:
                    hasher.join()
        scalars = {"run": self.ckpt.run_id}
        if task is not None:
            scalars["task"] = task.decode("utf-8")      # task_in_copy
        topic = self.topics.model() if kind == "model" else self.topics.client_model(recipient)
        lazy = lazy and bool(sha)              # its hash is known without the frame
        if lazy and message_id is None:
            message_id = wire.new_message_id()    # announced now, carried when built

        def encode() -> bytes:
            return wire.encode(kind, o.round, s.node_id, buffers, scalars, self.table,
                               s.compression, recipient=recipient, sign=sign,
                               payload_sha256=payload, message_id=message_id)
        if lazy:
            o.hashes[key] = (dict(buffers), sha[0], payload)
            return _Downlink(topic, None, False, sha[0], message_id,
                             build=lambda: wire.split(encode(), s.max_payload))
        data = encode()
        if not sha:
            sha = [buffers_sha256(wire.decode(data, wire.Expectation(self.table, kinds=kind))
                                  .buffers)]
        o.hashes[key] = (dict(buffers), sha[0], payload)
        payloads = wire.split(data, s.max_payload)
        return _Downlink(topic, payloads, len(payloads) == 1, sha[0],
                         wire.read_header(data).message_id)

    def _payload_sha256(self, buffers):
        """The sha256 (hex) of the payload wire.encode lays out for `buffers` uncompressed,
        when that is the bytes of one float32 buffer "params" (offset 0, no padding): the
        journal's hash when it is the model the last commit journalled, else a callable
        that hashes it; None for other layouts (encode hashes them)."""
        if set(buffers) != {"params"}:
            return None
        x = buffers["params"]
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous \
                or x.size != self.table.size:
            return None
        if self._journal_hash is not None and self._journal_hash[0] is x:
            return self._journal_hash[1]
        return lambda: hashlib.sha256(memoryview(x).cast("B")).hexdigest()

    def _build_downlinks(self) -> None:
        o = self.open
        shared = None
        # sent as copies (_announce), the global model's own frame is announced by its hash
        # and id, and encoded only if something publishes it after all
        to_each = self._model_to_each(o)
        for node, task in sorted(o.node_tasks.items()):
            if task.source == "global":
                if shared is None:
                    shared = task.buffers
                    o.downlinks["global"] = self._frame("model", shared, lazy=to_each)
                elif not all(task.buffers.get(k) is v for k, v in shared.items()) \
                        or set(task.buffers) != set(shared):
                    raise StrategyError(f"{self.plan.strategy.name}: round {o.round}: tasks with "
                                        f"source 'global' carry different buffers (client "
                                        f"{node}); per-client buffers need source 'client'")
            else:
                o.downlinks[node] = self._frame("client_model", task.buffers, recipient=node)

    def _publish_downlink(self, d: _Downlink) -> None:
        if not d.retained and d.topic not in self._cleared:
            # the topic's retained message is a stale whole frame or a lone chunk
            self.transport.publish(d.topic, b"", qos=1, retain=True)
            self._cleared.add(d.topic)
        for payload in d.payloads:
            self.transport.publish(d.topic, payload, qos=1, retain=d.retained)
            self.open.counts["wire_down_bytes"] += len(payload)
        if d.retained:
            self._cleared.discard(d.topic)
            self._retained.add(d.topic)

    def _model_to_each(self, o) -> bool:
        """Send the global model as a copy to each tasked client instead of once to all:
        when at most a quarter of the federation is tasked (the broker then sends at most a
        quarter of the copies; the aggregator sends one per tasked client, not one)."""
        tasked = sum(1 for t in o.node_tasks.values() if t.source == "global")
        return 0 < 4 * tasked <= len(self.members)

    def _copy(self, node: str, task: bytes | None = None,
              message_id: int | None = None) -> _Downlink:
        """`node`'s own copy of its model (built once per round; with `task`, its task in
        the round's first announcement, under `message_id`, which that task names)."""
        o = self.open
        downlink = o.downlinks.get(node) or o.copies.get(node)
        if downlink is None:
            downlink = self._frame("client_model", o.node_tasks[node].buffers, recipient=node,
                                   task=task, message_id=message_id)
            downlink.retained = False        # a copy for one client, not its retained state
            o.copies[node] = downlink
        return downlink

    def _send_copy(self, node: str) -> None:
        """Publish `node`'s own copy of its model on its topic."""
        o = self.open
        downlink = self._copy(node)
        for payload in downlink.payloads:
            self.transport.publish(downlink.topic, payload, qos=1, retain=downlink.retained)
            o.counts["wire_down_bytes"] += len(payload)

    def _resend(self, node: str, why: str) -> None:
        """Send `node` its model again on its own topic (rate-limited)."""
        o = self.open
        now = time.monotonic()
        if now - o.last_resend.get(node, -math.inf) < self.settings.resend_interval_s:
            return
        o.last_resend[node] = now
        self._send_copy(node)
        o.counts["resends"] += 1
        self.stats["resends"] += 1
        log.info("round %d: model re-sent to %s (%s)", o.round, node, why)

    # ------------------------------------------------------------------ collecting
    def _close_reason(self) -> str | None:
        o, s = self.open, self.settings
        if not o.uploaders:
            return "no_uploads"
        # Called after every message: no copies of the sets, and the scan for a client
        # still waited for stops at the first one (1,000 uploaders a round: the copies were
        # a third of the aggregator's time, docs/scaling.md)
        got = o.received.keys()
        if len(got) >= len(o.uploaders) and got >= o.uploaders:
            return "all"
        floor = min(s.min_updates, len(o.uploaders))
        if len(got) >= max(math.ceil(s.quorum * len(o.uploaders) - 1e-9), floor):
            return "quorum"
        # A client counts as gone once it has been offline for offline_grace_s, and not
        # before offline_grace_s after our own reconnect: a broker shutting down publishes
        # the wills of all its clients (to us, before it drops our connection too), and
        # the clients correct them once they are back.
        now = time.monotonic()
        waiting = any(n not in got and n not in o.refused
                      and (self.online.get(n) is not False
                           or now - self._offline_since.get(n, -math.inf) < s.offline_grace_s)
                      for n in o.uploaders)
        if not waiting and len(got) >= floor and now - self._reconnected_at >= s.offline_grace_s:
            return "offline"
        return None

    # ------------------------------------------------------------------ pause gate
    def _paused(self) -> bool:
        return self.control is not None and self.control.paused.is_set()

    def _held(self) -> None:
        hook = self.control.on_hold if self.control is not None else None
        if hook is not None:
            hook()

    def _service(self, timeout: float) -> None:
        """Handle what arrives for up to `timeout` seconds (statuses, updates, connection
        events) without closing or opening a round: the broker is serviced while paused."""
        if self.notifier is not None:
            self.notifier.beat()                # the systemd watchdog's proof of life
        item = self.transport.receive(timeout=timeout)
        while item is not None:
            self._handle(item)
            item = self.transport.receive(timeout=0)

    def _hold(self) -> bool:
        """Before opening a round: wait while the run is paused. False when stopped."""
        if self._paused():
            log.info("run %s paused before round %d", self.run_id, self.ckpt.round + 1)
            self._publish_status()
            self._held()
            while self._paused() and not self.stop.is_set():
                self._service(self.settings.poll_s)
            if not self.stop.is_set():
                log.info("run %s resumed", self.run_id)
        return not self.stop.is_set()

    def _pause_round(self) -> bool:
        """Inside a round: hold while paused, then move the deadline by the paused time and
        announce the round again (clients that already uploaded re-send their stored
        update, a duplicate here; a secure round starts a new attempt, whose first phase
        gets at least round_timeout_s). False when stopped while paused."""
        o = self.open
        held = self._wait_paused(f"round {o.round} paused ({len(o.received)} of "
                                 f"{len(o.uploaders)} updates in)")
        if held is None:
            return False
        log.info("round %d resumed after %.1f s paused: deadline moved by as much", o.round, held)
        deadline = o.deadline + held
        if o.secure is not None:
            # o.deadline is the attempt's first phase's: paused in a later phase, it may
            # have passed, and would fail the new attempt before any board could answer
            deadline = max(deadline, time.time() + self.settings.round_timeout_s)
        self._announce(deadline=deadline)
        return True

    def _wait_paused(self, what: str) -> float | None:
        """Hold while paused, servicing the broker: the seconds held, None when stopped."""
        since = time.time()
        log.info("%s", what)
        self._publish_status()
        self._held()
        while self._paused() and not self.stop.is_set():
            self._service(self.settings.poll_s)
        return None if self.stop.is_set() else time.time() - since

    def _collect(self) -> str | None:
        """Handle messages until the open round closes (returns why) or the run stops
        (None). Then its updates still missing chunks, and any of earlier rounds, are
        dropped: each would be refused when complete, and until the reassembly timeout it
        holds one of its sender's slots (a client that lost a chunk in a few rounds in a row
        would have its next updates refused)."""
        r = self.open.round
        try:
            return self._collect_until_closed()
        finally:
            self.reassembler.discard(rounds=range(r + 1))

    def _collect_until_closed(self) -> str | None:
        o, s = self.open, self.settings
        while True:
            if self.notifier is not None:
                self.notifier.beat()            # the systemd watchdog's proof of life
            self._report_evaluation_when_done()
            if self._paused() and not self._pause_round():
                return None
            reason = self._close_reason()
            if reason is not None:
                return reason
            if self.stop.is_set():
                return None
            now = time.time()
            overdue = now >= o.deadline
            if overdue and len(o.received) >= min(s.min_updates, len(o.uploaders)):
                return "deadline"
            # Not while the broker is away: each announcement then only waits in the
            # transport's queue behind the last, under a new id, one per deadline for as
            # long as the outage lasts (and each makes every client that uploaded re-send
            # its update, past its chunk budget). The first deadline after the reconnect
            # announces it once.
            if overdue and self.transport.connected:
                log.warning("round %d: %d update(s) by the deadline, %d needed; announcing it "
                            "again with a new deadline", o.round, len(o.received),
                            min(s.min_updates, len(o.uploaders)))
                self._announce()
                continue
            # while the last round's evaluation runs, look again soon: its report (the
            # progress line, on_round) is due once it is done, not at the next commit
            wait = min(s.poll_s, math.inf if overdue else o.deadline - now,
                       _EVALUATION_POLL_S if self._evaluating is not None else math.inf)
            item = self.transport.receive(timeout=max(0.0, wait))
            while item is not None:
                self._handle(item)
                if self._close_reason() is not None:
                    break
                item = self.transport.receive(timeout=0)

    def _report_evaluation_when_done(self) -> None:
        """overlap_evaluation: the last committed round's evaluation, once it is done, into
        its record and reported while this round runs, so a round's progress line and
        on_round come as soon as in process and not a round late; the next commit's
        checkpoint holds it (the record is the history's own)."""
        if self._evaluating is not None and self._evaluating[1].done():
            self._report(self._settle_evaluation())

    def _handle(self, item) -> None:
        if isinstance(item, ConnectionEvent):
            first = item.connected and self._connects == 0
            self._connects += item.connected
            if first:
                return                        # the connect() of _connect, already handled
            # "offline" closes nothing while we are away and for offline_grace_s after
            # (_close_reason: the wills of a broker restart)
            self._reconnected_at = time.monotonic() if item.connected else math.inf
            if item.connected and item.session_present:
                self._publish_status()        # our own will, published on shutdown
                if self.open is not None:
                    # A broker killed and restarted restores its last save: our session,
                    # and an older round's announcement retained, which a client joining
                    # now would take for the open round. The same announcement again (its
                    # id unchanged, so the clients that have it do nothing) puts it back;
                    # the model is not re-sent (it can be large): a client that finds the
                    # retained one stale asks for it (need_model).
                    self.transport.publish(self.topics.round(), self.open.announcement, qos=1,
                                           retain=True)
            if item.connected and not item.session_present:
                log.warning("broker lost our session (restarted without persistence?): "
                            "publishing status%s again",
                            ", and round %d under a new announcement id" % self.open.round
                            if self.open is not None else "")
                self._publish_status()
                if self.open is not None:
                    # The broker lost what it held for us with the session: update chunks
                    # queued for us, and updates a client sent while it was back and we were
                    # not yet (acknowledged to the client, with no subscriber to receive
                    # them). The same announcement again would not bring them back (a
                    # client answers an announcement id once); a new id makes the clients
                    # that uploaded re-send their stored update (a duplicate here if it did
                    # arrive). The round keeps its deadline, unless that has passed. Not
                    # while paused: the resume announces it again anyway, and moves the
                    # deadline by the paused time, which it would add to a fresh one.
                    self._cleared.clear()
                    # nor once a secure attempt's unmask requests are out: a new attempt
                    # would meet reveals of this one (see _collect_secure); this one ends
                    # at its phase's deadline if reveals were lost
                    unmasking = self.open.secure is not None and \
                        self.open.secure.phase in ("unmask", "done")
                    if not self._paused() and not unmasking:
                        self._announce(deadline=self.open.deadline
                                       if self.open.deadline > time.time() else None)
            elif not item.connected:
                log.warning("broker connection lost (%s); the transport reconnects",
                            item.reason)
            return
        if not isinstance(item, Message):
            return
        try:
            kind, node = self._topic_cache.parse(item.topic)
        except TopicError as exc:
            self._reject(None, f"message on an unexpected topic: {exc}")
            return
        if kind == "update":
            if self.open is not None:          # none while paused between rounds: late
                self._on_update(node, item.payload)
        elif kind == "secure":
            if self.open is not None and self.open.secure is not None:
                self._on_secure(node, item.payload)
        elif kind == "status":
            self._on_status(node, item.payload)

    def _reject(self, node: str | None, reason: str, key=None) -> None:
        if self.open is not None:
            self.open.counts["rejected"] += 1
        self.stats["rejected"] += 1
        if key is None or self._first_report(key):
            log.warning("rejected %s: %s", f"update from {node!r}" if node else "message", reason)

    def _first_report(self, key) -> bool:
        """Whether message `key` (node, message id) is reported now for the first time."""
        if key in self._logged:
            return False
        self._logged[key] = None
        while len(self._logged) > self.reassembler.remember:
            self._logged.popitem(last=False)
        return True

    def _on_update(self, node: str, payload: bytes) -> None:
        o = self.open
        # Every payload on a node's update topic counts against its chunk budget for the
        # open round, frame or not: a client flooding its topic is rejected once (the
        # reassembler logs why) and then costs one lookup per payload, with nothing logged
        # or remembered (docs/limits.md).
        try:
            if not self.reassembler.charge(node, o.round):
                self.stats["flood_ignored"] = self.stats.get("flood_ignored", 0) + 1
                return
        except wire.FrameError as exc:
            self._reject(node, f"[{exc.code}] {exc.reason}")
            if node in o.uploaders and node not in o.received:
                o.refused.add(node)               # the round does not wait for it
            return
        if node not in self.senders:
            self._reject(node, f"{node!r} is not a client of this federation "
                               f"({len(self.senders)} clients: {', '.join(list(self.senders)[:5])}"
                               f"{', ...' if len(self.senders) > 5 else ''})")
            return
        peek = peek_frame(payload)
        if peek is None:
            try:
                wire.read_header(payload)          # says what is wrong with it
                raise wire.FrameError("magic", "not a frame")
            except wire.FrameError as exc:
                self._reject(node, f"[{exc.code}] {exc.reason}")
            return
        frame_round, message_id = peek
        key = (node, message_id)
        if frame_round < o.round:
            o.counts["late"] += 1
            self.stats["late"] += 1
            if self._first_report(key):
                log.info("late update from %s for closed round %d (open round %d): dropped",
                         node, frame_round, o.round)
            return
        if frame_round > o.round:
            self._reject(node, f"update for round {frame_round}, but round {o.round} is open",
                         key)
            return
        refusal = self._upload_refusal(node)
        if refusal is not None:
            self._reject(node, refusal, key)
            return
        if node in o.received or node in o.refused:
            o.counts["duplicates"] += 1
            self.stats["duplicates"] += 1
            if self._first_report(key):
                log.info("duplicate update from %s for round %d ignored (message %016x)",
                         node, o.round, message_id)
            return
        expect = o.expects.get(node)
        if expect is None:                     # one per uploader and round, not per chunk
            expect = o.expects[node] = wire.Expectation.for_topic("update", node, self.table,
                                                                  rounds=o.round)
        try:
            frame = self.reassembler.add(payload, expect, charged=True)
        except wire.FrameError as exc:
            self._reject(node, f"[{exc.code}] {exc.reason}", key)
            return
        if frame is None:
            return
        where = f"update of {node} for round {o.round}"
        if self.uplink is not None:
            # the node's own key, this run and round: a board cannot pose as another, and
            # an update of an earlier run or round, replayed, is refused; a refused one is
            # not counted as the node's answer, so a forgery cannot stand in for it
            try:
                self.uplink.verify_frame(frame, kind="update", where=where,
                                         run=self.ckpt.run_id, round=o.round, by=node)
            except SignatureError as exc:
                self.stats["bad_signatures"] = self.stats.get("bad_signatures", 0) + 1
                self._reject(node, str(exc), key)
                return
        try:
            scalars = parse_update_scalars(frame.scalars, where)
        except MessageError as exc:
            self._reject(node, str(exc), key)
            return
        if scalars["run"] != self.ckpt.run_id:
            self._reject(node, f"{where} belongs to run {scalars['run']}, this is run "
                               f"{self.ckpt.run_id}", key)
            return
        base = self._announced_sha(node)
        if scalars["base"] is not None and base is not None and scalars["base"] != base:
            # a run id names one run only while the state lasts: an earlier run of the same
            # id (its state wiped) took this board's update of this round, signed as well
            self._reject(node, f"{where} was trained from model {scalars['base'][:16]}, this "
                               f"round's is {base[:16]} (an earlier run of the id "
                               f"{self.ckpt.run_id!r}, replayed?)", key)
            return
        if self.plan.secure is not None:
            self._refuse_plain_update(node, key)
            return
        if not frame.buffers:
            self._reject(node, f"{where} carries no buffers, but the task asked for an upload",
                         key)
            return
        try:
            update = Update(dict(frame.buffers), scalars["num_samples"], scalars["train_loss"],
                            scalars["steps"], scalars["strategy"])
        except StrategyError as exc:
            self._reject(node, f"{where}: {exc}", key)
            return
        o.received[node] = update
        o.train_s[node] = scalars["train_s"]
        o.counts["wire_up_bytes"] += frame.nbytes
        log.debug("round %d: update from %s (%d/%d)", o.round, node, len(o.received),
                  len(o.uploaders))

    def _announced_sha(self, node: str) -> str | None:
        """The sha256 the open round announced for the model `node` trains from (its own
        per-client model's, or the global model's), or None when it announced none."""
        o = self.open
        task = o.node_tasks.get(node)
        if task is None:
            return None
        downlink = o.downlinks.get(node if task.source == "client" else "global")
        return downlink.sha if downlink is not None else None

    def _refuse_plain_update(self, node: str, key) -> None:
        """A plain update in a secure round: only a board whose edgefl predates secure
        aggregation over MQTT sends one (it ignores the announcement's `secure` field). It
        is not aggregated, the round's phases stop waiting for the board, and a round
        that cannot reach its threshold without such boards ends the run naming them
        (_secure_unreachable) instead of being announced again at every deadline."""
        o = self.open
        self._without_secure[node] = self.versions.get(node) or "of unknown version"
        o.refused.add(node)
        why = (f"{node} (edgefl {self._without_secure[node]}, by its status) sent a plain "
               f"update in secure round {o.round}: {_NO_SECURE}")
        self._reject(node, why, key)
        self._event("client_refused", round=o.round, client=node, reason=why)

    def _unmask_failed(self, exc) -> ConfigError:
        """The error that ends the run when a secure attempt's unmask phase fails. The
        reveals it did get, and any that come late, may be enough to unmask its sum; a new
        attempt over the same stored updates with other survivors would give a second sum,
        and the difference of the two could be one board's update."""
        self._event("secure_round_failed", round=self.open.round, phase="unmask",
                    reason=str(exc))
        return ConfigError(
            f"round {self.open.round}: the unmask phase failed ({exc}); another attempt "
            "over the same updates could reveal a board's update by difference with this "
            "one, so the run stops here (its rounds done are checkpointed; see "
            "docs/privacy.md on what a restart of this round means)")

    def _secure_unreachable(self, server) -> ConfigError | None:
        """The error that ends the run when the attempt's participants that can take part
        are fewer than its threshold, or None. Two kinds cannot: boards older than secure
        aggregation over MQTT (they sent plain updates), and boards that refused the round
        in their status -- a profile's limits, or a contribution they no longer hold
        because they revealed it to an earlier attempt's unmask request or restarted since
        training. Neither changes by announcing the round again."""
        o, ids = self.open, self.plan.client_ids
        nodes = [ids[c] for c in server.setup.participants]
        older = [n for n in nodes if n in self._without_secure]
        refusing = [n for n in nodes if n in o.refused and n not in self._without_secure]
        able = len(nodes) - len(older) - len(refusing)
        if not (older or refusing) or able >= server.setup.threshold:
            return None
        why = []
        if older:
            boards = ", ".join(f"{n} (edgefl {self._without_secure[n]})" for n in older)
            why.append(f"{boards} sent plain updates: {_NO_SECURE}")
        if refusing:
            by_reason = boards_by_reason({n: o.refusals.get(n, "no reason given")
                                          for n in refusing})
            why.append("; ".join(f"{', '.join(ns)} refused the round: {reason}"
                                 for reason, ns in by_reason.items()))
        advice = "a restart after the upgrade resumes it), or run it without " \
            "privacy.secure_aggregation" if not refusing else \
            "the same boards would refuse this round again); start a new run from its " \
            "model (model.init: docs/orchestration.md), or with a lower threshold"
        return ConfigError(
            f"round {o.round}: secure aggregation needs {server.setup.threshold} of its "
            f"{len(nodes)} clients, and {len(older) + len(refusing)} cannot take part: "
            f"{'; '.join(why)}. The run stops here (its rounds done are checkpointed: "
            f"{advice}")

    def _attempt_failure(self, server, phase: str, waiting, exc) -> str:
        """What failed a secure attempt in `phase`, naming the boards: those it still waited
        for, or, when every board answered the masked phase, the boards of each shape of
        masked input (none sent by t of them)."""
        if waiting:
            return f"{_names(sorted(waiting))} did not answer phase {phase!r}"
        if phase == "masked" and server.masked:
            ids, shapes = self.plan.client_ids, {}
            for c, m in sorted(server.masked.items()):
                shapes.setdefault((m.size, m.scalar_names), []).append(ids[c])
            named = len({names for _, names in shapes}) > 1
            return ("no shape of masked input came from the threshold's boards: " + "; ".join(
                f"{size} words" + (f" and scalars {list(names)}" if named else "")
                + f" from {_names(nodes)}" for (size, names), nodes in shapes.items()))
        return str(exc)

    def _attempts_spent(self, server) -> ConfigError:
        """The error that ends the run when the open round's secure attempts all failed
        (privacy.secure_aggregation.max_attempts of them): boards that neither answer nor
        say they refuse, or that keep sending another shape, would have the round announced
        again for ever."""
        o, spent = self.open, len(self.open.secure_failed)
        by_failure: dict = {}
        for i, why in enumerate(o.secure_failed, 1):
            by_failure.setdefault(why, []).append(i)
        why = "; ".join(f"{text} (attempt{'s' if len(at) > 1 else ''} "
                        f"{', '.join(map(str, at))})" for text, at in by_failure.items())
        return ConfigError(
            f"round {o.round}: secure aggregation failed {spent} attempts in a row "
            f"(privacy.secure_aggregation.max_attempts = {self.plan.secure.max_attempts}), "
            f"each short of its threshold of {server.setup.threshold} boards: {why}. The run "
            f"stops here (its rounds done are checkpointed): bring back or fix the boards "
            f"named, then start a new run from its model (model.init: docs/orchestration.md), "
            f"or give a lower threshold or more attempts")

    def _upload_refusal(self, node: str) -> str | None:
        """Why `node` may not upload in the open round, or None (the engine's check)."""
        return self.open.round_plan.upload_refusal(self.members[node], node)

    def _on_status(self, node: str, payload: bytes) -> None:
        if not payload or node not in self.senders:
            # a cleared retained status; or not a member's (our own, twice a round, comes
            # back on status/+ too): not parsed
            return
        try:
            doc = parse_status(payload, node)
        except MessageError as exc:
            log.warning("ignored status on %s: %s", self.topics.status(node), exc)
            return
        before = self.online.get(node)
        now_online = doc["online"]
        self.online[node] = now_online
        if isinstance(doc.get("version"), str):
            # shown in messages that name the board (a plain update in a secure round, the
            # error that ends such a run): what a board claims is one short escaped line
            self.versions[node] = terminal_text(doc["version"], VERSION_CHARS, one_line=True)
        if not now_online and before is not False:
            self._offline_since[node] = time.monotonic()
        if before is not now_online:
            log.info("%s %s is %s", self.sender_kind, node,
                     "online" if now_online else "offline")
            self._event("client_joined" if now_online else "client_left", client=node)
        o = self.open
        refusal = doc.get("refused")
        if isinstance(refusal, dict) and refusal.get("run") == self.run_id:
            # the board cannot take part in this round (its profile's limits, a task it
            # cannot read): not waited for. A board says so in every round it is tasked,
            # so a retained refusal of an earlier round (after our restart) is stale
            if o is not None and node in o.uploaders and node not in o.received \
                    and node not in o.refused and refusal.get("round", o.round) == o.round:
                o.refused.add(node)
                # the board's own words: one line, escaped, bounded in the operator's log;
                # bounded alike but raw in the event (its readers escape for display)
                o.refusals[node] = terminal_text(refusal.get("reason"), REASON_CHARS,
                                                 one_line=True)
                log.warning("round %d: %s refused the run: %s", o.round, node,
                            o.refusals[node])
                self._event("client_refused", round=o.round, client=node,
                            reason=bounded_text(refusal.get("reason"), REASON_CHARS))
            return
        if o is None or node not in o.node_tasks or node in o.received or not now_online:
            return
        if doc.get("need_model") == o.round:
            self._resend(node, "it asked for the model of this round")
        elif before is False:
            downlink = o.downlinks.get(node) or o.downlinks.get("global")
            if downlink is not None and not downlink.retained:
                self._resend(node, "it came back online and the model was chunked (not retained)")

    # ------------------------------------------------------------------ closing
    def _refuse_unusable(self, c: int, why: StrategyError) -> None:
        """The engine found that the strategy cannot use client c's update: refuse it."""
        o, node = self.open, self.plan.client_ids[c]
        self._reject(node, f"round {o.round}: the strategy cannot use it: {why}")
        o.received.pop(node, None)
        o.refused.add(node)

    # ------------------------------------------------------------------ secure rounds
    def _secure_setup(self) -> "secagg.RoundSetup":
        """A fresh attempt of the open round: its SecAgg+ setup (the announcement carries
        it) and the server that runs it. Every uploader takes part; the quantiser's weight
        bound is the largest sample count among them (1 under uniform weighting), as in
        process (edgefl.sim.secure), so the sum and the model are the same."""
        o, plan = self.open, self.plan
        participants = sorted(o.round_plan.uploaders)
        max_weight = secagg.max_weight_of(plan.strategy,
                                          {c: plan.sample_counts[c] for c in participants})
        setup = secagg.round_setup(plan.secure, run_id=f"{self.ckpt.run_id}:{o.announce_id}",
                                   round=o.round, participants=participants,
                                   seed=plan.setup.seed, vector_size=None, scalar_names=None,
                                   max_weight=max_weight)
        o.secure = secagg.SecAggServer(setup)
        o.secure_tag = attempt_tag(o.announce_id)
        o.secure_seq = 0
        o.secure_in = secagg.ChunkAssembler(2 * 8 * plan.model.n_params + (1 << 20))
        return setup

    def _collect_secure(self) -> str | None:
        """The secure round's phases (docs/protocol.md section 10): each ends when every
        client it waits for has answered, when the ones still missing are offline and the
        phase has its threshold, or at its deadline (the announcement's for the first, which includes training; then
        round_timeout_s each). A phase left below the threshold fails the attempt cleanly
        (nothing is unmasked) and the round is announced again: a new attempt with fresh
        keys. Returns "secure" once the sum is unmasked, None when stopped."""
        o, s = self.open, self.settings
        phase_deadline, attempt = o.deadline, o.secure
        while True:
            if self.notifier is not None:
                self.notifier.beat()
            if self.stop.is_set():
                return None
            # a pause holds a secure round as it holds any: no phase closes or fails while
            # it lasts; the resume announces the round again, a new attempt with fresh keys
            # and the deadline moved by the pause. Not once the unmask requests are out:
            # the reveals come in while paused, and a new attempt over the same updates
            # with other survivors would give two sums whose difference is an update. That
            # attempt runs to its close, committed (an unmasked sum held uncommitted through
            # the pause would be unmasked again after a restart), and the pause holds the
            # next round.
            if self._paused() and o.secure.phase != "unmask" and not self._pause_round():
                return None
            server = o.secure
            if server is not attempt:
                # a new attempt started under us (the round announced again by _handle: the
                # broker lost our session; or by the resume of a pause): its first phase has
                # the announcement's deadline, not what was left of the old attempt's phase
                # (which may have passed, and would fail the new attempt before any board
                # could answer)
                phase_deadline, attempt = o.deadline, server
            waiting, book = self._secure_waiting(server)
            now, mono = time.time(), time.monotonic()
            # stop waiting for offline clients (their Last Will, offline_grace_s ago; not
            # within offline_grace_s of our own reconnect: a restarting broker publishes
            # every will) only once the phase has its threshold: below it, the clients may
            # come back before the deadline, and failing early would only start over
            # boards that cannot speak secure aggregation, or that refused the round (their
            # status says why: limits, or a contribution revealed or lost), never answer:
            # not waited for
            answering = waiting - self._without_secure.keys() - o.refused
            unable = bool(waiting) and not answering
            offline = {n for n in answering if self.online.get(n) is False
                       and mono - self._offline_since.get(n, -math.inf) >= s.offline_grace_s}
            gone = bool(waiting) and answering <= offline \
                and len(book) >= server.setup.threshold \
                and mono - self._reconnected_at >= s.offline_grace_s
            if not waiting or gone or unable or now >= phase_deadline:
                phase = server.phase
                try:
                    out = server.advance()
                except secagg.SecAggAborted as exc:
                    # the unmask phase's failure first: its reason (and its event) is the
                    # privacy one, whatever left the phase short (a board restarted after
                    # its masked input refuses the round: no contribution left)
                    if phase == "unmask":
                        raise self._unmask_failed(exc) from None
                    unreachable = self._secure_unreachable(server)
                    if unreachable is not None:
                        raise unreachable from None
                    self._event("secure_round_failed", round=o.round, phase=phase,
                                reason=str(exc))
                    # boards known to be offline (a site's power cut) are waited for, as a
                    # plain round waits for them: an attempt that failed for them alone is
                    # not one of max_attempts, which ends a run whose boards cannot answer
                    if not (answering and answering <= offline):
                        o.secure_failed.append(self._attempt_failure(server, phase, waiting,
                                                                     exc))
                    if len(o.secure_failed) >= self.plan.secure.max_attempts:
                        raise self._attempts_spent(server) from None
                    log.warning("round %d: secure aggregation failed (%s); announcing it again",
                                o.round, exc)
                    self._announce()
                    phase_deadline, attempt = o.deadline, o.secure
                    continue
                log.info("round %d: secure phase %r closed (%d of %d answered)", o.round,
                         phase, len(book), len(book) + len(waiting))
                for c, msg in out.items():
                    self._send_secure(self.plan.client_ids[c], msg)
                if server.phase == "done":
                    return "secure"
                phase_deadline = time.time() + s.round_timeout_s
                continue
            item = self.transport.receive(timeout=max(0.0, min(s.poll_s, phase_deadline - now)))
            while item is not None:
                self._handle(item)
                item = self.transport.receive(timeout=0)

    def _secure_waiting(self, server) -> tuple:
        """(node ids the current phase still waits for, the phase's answers so far)."""
        ids = self.plan.client_ids
        expected, book = {
            "keys": (server.setup.participants, server.keys),
            "shares": (server.keys, server.shares),
            "masked": (server.shares, server.masked),
            "unmask": (server.survivors, server.revealed)}[server.phase]
        return {ids[c] for c in expected if c not in book}, book

    def _send_secure(self, node: str, msg) -> None:
        o = self.open
        o.secure_seq += 1
        # signed (keys.signing_key) for this run, round, attempt and board: what a board
        # acts on (protocol.md section 11)
        sign = secure_signer(self.signer, self.ckpt.run_id, o.round,
                             secure_context(o.announce_id, node))
        try:
            for chunk in secagg.to_chunks(msg, self.settings.max_payload,
                                          (o.secure_tag << 32) | o.secure_seq, sign):
                self.transport.publish(self.topics.secure_to(node), chunk, qos=1)
                o.counts["wire_down_bytes"] += len(chunk)
        except TransportError as exc:
            log.warning("round %d: secure message to %s not sent: %s", o.round, node, exc)

    def _on_secure(self, node: str, payload: bytes) -> None:
        """A client's secure aggregation message: chunks reassembled, the sender bound to
        its topic (the ACL lets a client write only its own), handed to the attempt's
        server. An earlier attempt's chunks are dropped; a masked input after the unmask
        request is refused (secagg.LateMessage)."""
        o = self.open
        if node not in self.members:
            self._reject(node, "secure message from a node outside the federation")
            return
        if len(payload) < 12 or int.from_bytes(payload[4:8], "big") != o.secure_tag:
            o.counts["late"] += 1
            return
        o.counts["wire_up_bytes"] += len(payload)
        self._without_secure.pop(node, None)        # it speaks secure aggregation now
        try:
            repeats = o.secure_in.repeats
            sealed = o.secure_in.add_sealed(node, payload)
            o.counts["duplicates"] += o.secure_in.repeats - repeats
            if sealed is None:
                return
            if self.uplink is not None:
                # the node's own key, this run, round, attempt and node: a masked input is
                # the node's update; refused before the server sees it, so a forgery
                # changes nothing (its message id is free again for the node's own)
                try:
                    verify_secure(self.uplink, sealed, run=self.ckpt.run_id, round=o.round,
                                  context=secure_context(o.announce_id, node), by=node,
                                  where=f"secure message {sealed.message_id & 0xffffffff} "
                                        f"of {node} for round {o.round}")
                except SignatureError as exc:
                    o.secure_in.forget(node, sealed.message_id)
                    self.stats["bad_signatures"] = self.stats.get("bad_signatures", 0) + 1
                    self._reject(node, str(exc))
                    return
            msg = sealed.message()
            if getattr(msg, "client", None) != self.members[node]:
                raise secagg.SecAggError(f"it speaks for client {getattr(msg, 'client', None)}, "
                                         f"{node} is client {self.members[node]}")
            o.secure.receive(msg)
        except secagg.LateMessage as exc:
            o.counts["late"] += 1
            self._reject(node, str(exc))
        except secagg.SecAggError as exc:
            self._reject(node, f"secure message: {exc}")

    def _commit(self, r: int, state: State, record: dict,
                evaluate: np.ndarray | None = None) -> None:
        """Checkpoint round r (its state and record), journal it, and report it. `evaluate`:
        the round's model, whose evaluation is due and still to be made
        (overlap_evaluation): made in a thread from now on, while the checkpoint is written
        and the next round runs; r's record is reported once it is in, and checkpointed
        with it at the next commit."""
        # the previous round's evaluation: into its record, so this checkpoint holds it
        earlier = self._settle_evaluation()
        if evaluate is not None:
            if self._evaluator is None:
                from concurrent.futures import ThreadPoolExecutor

                self._evaluator = ThreadPoolExecutor(1, thread_name_prefix="edgefl-evaluate")
            self._evaluating = (record, self._evaluator.submit(self.engine.evaluate, evaluate))
        ckpt = self.ckpt
        new = AggregatorCheckpoint(ckpt.run_id, ckpt.fingerprint, r, ckpt.aggregated + [r],
                                   state, ckpt.strategy, ckpt.rng, ckpt.history + [record],
                                   record["elapsed_s"])
        # The journal's model hash is computed while the checkpoint is written: sha256 of a
        # 1M-parameter model is 2 ms here, hashlib releases the GIL, and the checkpoint's
        # fsync waits on the disk: both sit between a round's last update and the next
        # announcement, when every client is idle. A small model is hashed here: its hash
        # (31 KB: 20 us) costs less than starting a thread (100-200 us, milliseconds when
        # the cores are busy).
        params = np.ascontiguousarray(self.plan.strategy.global_model(state), dtype=np.float32)
        digest: list = []
        hasher = None
        if params.nbytes >= _HASH_IN_THREAD_BYTES:
            hasher = threading.Thread(target=lambda: digest.append(hashlib.sha256(params)),
                                      name="edgefl-journal-hash", daemon=True)
            hasher.start()
        else:
            digest.append(hashlib.sha256(params))
        try:
            if self.settings.checkpoint_rounds:
                new.save(self.state_dir)  # the round is aggregated once this rename is done
        except StateWriteError as exc:
            # Stop rather than go on: later rounds would build on a state no restart can
            # recover, and the journal would list rounds the checkpoint does not hold.
            log.error("round %d aggregated but not checkpointed, stopping: %s (the checkpoint "
                      "of round %d is intact; a restart runs round %d again)", r, exc,
                      ckpt.round, r)
            raise
        finally:
            if hasher is not None:
                hasher.join()
        self.ckpt = new
        self.open = None
        sha = digest[0].hexdigest()
        self._journal_hash = (params, sha)   # a model frame's payload hash (_frame)
        if self.settings.checkpoint_rounds:
            append_journal(self.journal_path, {"event": "aggregated", "run": new.run_id,
                                               "round": r, "updates": record["updates"],
                                               "closed_by": record["closed_by"],
                                               "model_sha256": sha, "at": time.time()})
        acc = record["test_accuracy"]
        log.info("round %d aggregated: %d update(s), closed by %s%s, %.3f s", r,
                 record["updates"], record["closed_by"],
                 f", test accuracy {acc:.4f}" if acc is not None else
                 (", evaluating" if evaluate is not None else ""), record["wall_s"])
        refused = record.get("robust_reasons") or {}
        for c, why in sorted(refused.items(), key=lambda item: int(item[0])):
            # strategy.robust refused this update (non-finite, or too long next to the others)
            log.warning("round %d: robust aggregation rejected the update of %s: %s", r,
                        self.plan.client_ids[int(c)], why)
        if self.on_model is not None:
            self.on_model(r, params)
        if earlier is not None:
            self._report(earlier)
        if evaluate is None:
            self._report(record, status=True)
        else:
            self._publish_status()

    def _evaluation_missing(self, record: dict) -> bool:
        """A checkpointed record whose evaluation was due and is not in it."""
        return record.get("test_accuracy") is None and self.engine.evaluation_due(
            int(record["round"]))

    def _settle_evaluation(self) -> dict | None:
        """The record whose evaluation ran in the background, with it filled in (waiting
        for it); None when there is none."""
        pending, self._evaluating = self._evaluating, None
        if pending is None:
            return None
        record, future = pending
        add_evaluation(record, future.result())
        return record

    def _last_evaluation(self) -> None:
        """The run's rounds are over or stopped: the last committed round's evaluation,
        still running, goes into its record, the checkpoint again (the same round, now
        with it) and the report."""
        record = self._settle_evaluation()
        if record is not None:
            if self.settings.checkpoint_rounds:
                self.ckpt.save(self.state_dir)
            self._report(record)

    def _report(self, record: dict, status: bool = False) -> None:
        """A checkpointed round's record, complete, to whoever follows the run: the metrics
        topic, the round_closed event, our status (`status`: the commit's own), on_round."""
        r = record["round"]
        try:
            self.transport.publish(self.topics.metrics(self.settings.node_id),
                                   json.dumps(jsonable(record)).encode(), qos=0)
        except TransportError:
            pass
        # the losses too, so a watcher (the dashboard) draws the curves from the events
        # alone: they are QoS 1, the metrics topic is QoS 0
        self._event("round_closed", round=r, closed_by=record["closed_by"],
                    updates=record["updates"], missing=record["missing"],
                    test_accuracy=record["test_accuracy"], test_loss=record["test_loss"],
                    train_loss=record["train_loss"],
                    **{k: record[k] for k in ("dp_epsilon", "dp_delta") if k in record})
        if status:
            self._publish_status()
        if self.on_round is not None:
            # the history up to this round (a later one may be checkpointed already)
            history = self.ckpt.history
            upto = next(i for i in range(len(history) - 1, -1, -1) if history[i] is record)
            self.on_round(record, list(history[:upto + 1]))


# a model at least this large is hashed in a thread, for the journal while the checkpoint
# is written (Aggregator._commit), for the announcement while its frame is (_frame)
_HASH_IN_THREAD_BYTES = 1 << 20


def _names(nodes, limit: int = 10) -> str:
    """Node ids for an error message: the first `limit` of them, the rest as a count."""
    nodes = list(nodes)
    more = f" and {len(nodes) - limit} more" if len(nodes) > limit else ""
    return ", ".join(nodes[:limit]) + more


def _secure_record(server) -> dict:
    """The round record's `secure` field, as in process (edgefl.sim.secure)."""
    return {"survivors": server.total.count, "dropped": list(server.dropped),
            "ring_bits": server.setup.ring_bits, "levels": server.setup.levels,
            "threshold": server.setup.threshold}
# how often a round that waits for updates looks whether the last round's evaluation,
# running beside it (overlap_evaluation), is done and due to be reported
_EVALUATION_POLL_S = 0.005
