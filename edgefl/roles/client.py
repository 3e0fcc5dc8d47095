"""A client: waits for a round that tasks it, trains with the strategy's client half,
uploads, and persists its progress so that no round is trained twice (docs/roles.md).

    client = Client(ClientSettings("client-3"), (x, y), transport, state_dir)
    client.run()               # until stop is set (or the run finishes, exit_when_finished)

The client follows the run: the strategy, the model architecture and every local
hyper-parameter come with the round announcement, so nothing but its data, its id and the
broker are configured on the board. Per announcement:

- not tasked: nothing to do; an older round than the one last trained: ignored;
- the round last trained: its stored update is re-sent (once per announcement: the
  aggregator was restarted and lost what it had received, or this client restarted and may
  not have finished publishing); a round is never trained twice;
- a new round: wait for its model (the global `model` frame, or its own `model/<client>`
  frame, whose content must hash to the announced sha256), train in a worker thread
  (the C core releases the GIL; the loop keeps handling messages and the stop signal),
  persist progress atomically (client strategy state, round, the encoded update), then
  upload the update in chunks of `max_payload` with QoS 1. A client that stops while it
  trains stops the round before its next local step (the kernel reads a stop word,
  kernels.StopFlag), joins the training thread and stores nothing of that round.

The exported ONNX model the aggregator publishes (retained, in parts: roles/onnx_channel.py)
is reassembled, checked (sha256, onnxruntime loads it and runs one zero sample) and
installed atomically as `<state_dir>/model.onnx`, the file `edgefl serve` on the board
serves.

A model that does not arrive within `model_wait_s` (joined mid-round, missed a chunk) is
asked for again by publishing the status with `need_model`. Every frame and announcement is
checked (topic, sender, round, hash, finite values); a bad one is logged with its reason
and dropped, and the client keeps running.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .. import kernels
from .._malloc import keep_frames_in_heap
from ..config import check_number
from ..errors import KernelError, NonFiniteError, TrainingStopped
from ..infer import ModelFileError
from ..models import build_model
from ..privacy import NO_HOOKS, secagg
from ..privacy.dp import DPHooks
from ..privacy.hooks import task_generator
from ..rounds import client_contribution
from ..service.layered import check_setting, default
from ..strategies import LocalData, StrategyError, get_strategy
from ..transport import wire
from ..transport.base import ConnectionEvent, Message, Transport, TransportError
from ..transport.signing import SignatureError
from .trust import secure_context, secure_signer, verify_secure
from ..transport.topics import DEFAULT_PREFIX, TopicError, Topics, validate_id
from .messages import (MessageError, TopicCache, announced_frame_id, attempt_tag,
                       buffers_sha256, parse_announcement, peek_frame, status_payload,
                       task_from_announcement, update_scalars)
from .onnx_channel import INSTALLED_FILES, OnnxReceiver, part_index, parts_filter
from .state import PROGRESS_FILE, ClientProgress

__all__ = ["ClientSettings", "Client", "STATE_FILES"]

log = logging.getLogger("edgefl.roles.client")


# The ClientSettings fields that are settings of the `edgefl client` service: each takes its
# default and its check from that key of the layered table (edgefl.service.keys,
# edgefl/service/defaults.yaml). The board's limits (max_params, max_batch_size,
# memory_budget_mb) are None by default, no limit: a simulation's clients have none, a
# service's come from its profile and site file.
CLIENT_KEYS = {
    "federation": "node.federation",
    "max_payload": "transport.chunk_size",
    "compression": "transport.compression",
    "chunks_per_sender": "limits.chunks_per_sender",
    "max_params": "compute.max_params",
    "max_batch_size": "compute.max_batch_size",
    "memory_budget_mb": "compute.memory_budget_mb",
}
_NO_LIMIT_BY_DEFAULT = ("max_params", "max_batch_size", "memory_budget_mb")


@dataclass(frozen=True)
class ClientSettings:
    """node_id: this client's id (its topics, its MQTT client id, the ACL user).
    max_payload: bytes per MQTT message of an upload; compression: none | f16 | int8.
    model_wait_s: how long to wait for an announced model before asking for it again
    (doubling up to 60 s). exit_when_finished: return from run() when the run finishes
    (simulations, tests); a service keeps waiting for the next run. raise_on_error: a local
    round that fails (diverged, bad task) raises out of run() naming the round and client
    (simulations); otherwise it is logged and the client waits for the next round.
    max_params / max_batch_size / memory_budget_mb: the board's limits (its profile and site
    file); a run whose model or minibatch exceeds them is refused with the reason in this
    client's status (`refused`), and the client trains nothing of that run. None: no limit.
    The fields of CLIENT_KEYS have the service's checks (and, but for the limits, its
    defaults)."""
    node_id: str
    federation: str = default("node.federation")
    prefix: str = DEFAULT_PREFIX
    max_payload: int = default("transport.chunk_size")
    compression: str = default("transport.compression")
    model_wait_s: float = 5.0
    reassembly_timeout_s: float = 60.0
    # model reassembly limits (docs/limits.md); None: wire's defaults, no chunk budget
    reassembly_bytes: int | None = None
    chunks_per_sender: int | None = default("limits.chunks_per_sender")
    exit_when_finished: bool = False
    profile: str | None = None
    poll_s: float = 0.25
    max_early_bytes: int = 64 << 20
    raise_on_error: bool = False
    max_params: int | None = None
    max_batch_size: int | None = None
    memory_budget_mb: int | None = None
    # signatures (roles/trust.py): None or a Trust without keys.aggregator: nothing checked
    trust: object = field(default=None, compare=False)
    # keep_progress False: the progress (round trained, client state, the update for a
    # re-send) is kept in memory only, not written to state_dir: for a simulated client,
    # never restarted, whose state directory is deleted with the run
    keep_progress: bool = True
    # follow_round False: not subscribed to the round topic; its tasks and the run's end
    # come on its own task/<client> topic alone, from an aggregator with task_topics on (a
    # simulated fleet, where most clients are idle most rounds: docs/protocol.md section 1)
    follow_round: bool = True
    # round_status False: no status after each trained round. That status only moves
    # `last_round` on (the dashboard's and `edgefl fleet`'s column); the aggregator acts on
    # `online`, `need_model` and `refused` alone, all still published. For a simulated fleet,
    # where it was a quarter of a tasked client's messages (docs/scaling.md)
    round_status: bool = True

    def __post_init__(self):
        validate_id(self.node_id, "client id")
        validate_id(self.federation, "federation id")
        for name, key in CLIENT_KEYS.items():
            object.__setattr__(self, name, check_setting(
                key, getattr(self, name), f"ClientSettings.{name}",
                unset_ok=name in _NO_LIMIT_BY_DEFAULT))
        if not self.model_wait_s > 0:
            raise ValueError(f"model_wait_s = {self.model_wait_s!r}: need > 0 seconds")
        if self.reassembly_bytes is not None:
            check_number(self.reassembly_bytes, "ClientSettings.reassembly_bytes", integer=True,
                         minimum=1)

    @classmethod
    def from_service_config(cls, config, **fields) -> "ClientSettings":
        """The settings of the `edgefl client` service from its resolved configuration (a
        ServiceConfig of the client); `fields` sets the others, or replaces some."""
        values = {name: config[key] for name, key in CLIENT_KEYS.items()}
        values.update(node_id=config["node.id"], profile=config.profile,
                      reassembly_bytes=config.mib("limits.reassembly_mb"))
        if "trust" not in fields:
            from .trust import Trust
            values["trust"] = Trust.from_service_config(config, "client")
        return cls(**{**values, **fields})


_TRAINING_DONE = object()


class _Job:
    """One local round running in a worker thread. `stop` is the kernels.StopFlag its
    training reads before every step: the client's own stop when that is one (a signal then
    stops the round at once), else the job's own, set when the client stops."""

    def __init__(self, announcement: dict, task, local: LocalData, strategy, client_state,
                 slots, wake):
        self.wake = wake
        self.announcement = announcement
        self.round = int(announcement["round"])
        self.task = task
        self.stop = local.stop
        self.planned_steps = kernels.planned_steps(task.train, local.num_samples)
        self.result = None
        self.error: BaseException | None = None
        self.train_s = 0.0
        self.done = threading.Event()
        self.local = local
        self._args = (local, strategy, client_state, slots)

    def start(self, pool=None) -> None:
        """Train in a thread of its own, or in `pool` (a concurrent.futures executor: a
        process hosting many clients saves a thread start per local round)."""
        if pool is not None:
            pool.submit(self._run, *self._args)
            return
        threading.Thread(target=self._run, name=f"edgefl-train-{self._args[0].client}",
                         args=self._args, daemon=True).start()

    def _run(self, local, strategy, client_state, slots) -> None:
        try:
            if slots is not None:
                slots.acquire()
            try:
                t0 = time.perf_counter()
                self.result = strategy.train(self.task, local, client_state)
                self.train_s = time.perf_counter() - t0
            finally:
                if slots is not None:
                    slots.release()
        except BaseException as exc:        # noqa: BLE001 -- reported by the main loop
            self.error = exc
        finally:
            self.done.set()
            # Wake the main loop, which blocks on the transport's queue: the queue is the
            # one place it waits, so the end of training is one more item in it.
            self.wake.put(_TRAINING_DONE)


class Client:
    """One federated client over `transport` (not yet connected). `data` is (x, y): its
    samples, float32 C-contiguous features and labels/targets. `state_dir` holds its
    progress. `train_slots` (a Semaphore) bounds how many clients of one process train at
    once (simulations); `announcements` (messages.AnnouncementCache) lets the clients of one
    process parse each announcement once; `train_pool` (an executor) runs the local rounds
    instead of a thread each."""

    def __init__(self, settings: ClientSettings, data, transport: Transport,
                 state_dir: str | os.PathLike, *, stop=None, train_slots=None, notifier=None,
                 announcements=None, train_pool=None):
        keep_frames_in_heap()          # a model frame in, an update frame out, every round
        self.settings = settings
        self.node = settings.node_id
        x, y = data
        self.x = np.ascontiguousarray(x)
        self.y = np.ascontiguousarray(y)
        self.transport = transport
        self.state_dir = os.fspath(state_dir)
        self.stop = stop if stop is not None else threading.Event()
        self.train_slots = train_slots
        self.train_pool = train_pool
        self.notifier = notifier
        # an AnnouncementCache shared by the clients of one process (simulations), or None
        self._parse_announcement = announcements.parse if announcements is not None \
            else parse_announcement
        self.topics = Topics(settings.federation, settings.prefix)
        self._topic_cache = TopicCache(self.topics)
        self._onnx_parts = self.topics.onnx() + "/"     # the ONNX part topics' prefix
        # Models come from the aggregator only (the ACL lets no one else publish them), so
        # the limits guard against a broken aggregator rather than an attacker.
        self.reassembler = wire.Reassembler(
            settings.reassembly_timeout_s,
            max_bytes=settings.reassembly_bytes or wire.Reassembler.DEFAULT_MAX_BYTES,
            max_chunks_per_sender=settings.chunks_per_sender,
            # checking signatures: a model frame is hashed while its chunks arrive
            digests=getattr(settings.trust, "downlink", None) is not None)
        self.progress = ClientProgress()
        self.ann: dict | None = None            # the announcement acted on
        self.next_ann: dict | None = None       # one that arrived while training
        self.finished = False
        self.job: _Job | None = None
        # this client's data checked against the run's model (kernels.Samples): made by the
        # first local round's training, kept for the others of the run (_local_data)
        self._samples = None
        self.waiting = None                     # [round, since (monotonic), times asked]
        self.early: deque = deque()             # frames that came before their announcement
        self._early_bytes = 0
        self._answered: str | None = None       # announcement id our upload answered
        self._run_key = None                    # (run, model table, strategy) prepared for
        self._model = None
        self._strategy = None
        self._unusable: str | None = None
        self._expect: dict = {}
        self.stats = {"trained": 0, "uploads": 0, "resent": 0, "rejected": 0, "asked": 0}
        self._writer: threading.Thread | None = None   # stores the last update frame
        self.ready = threading.Event()          # set once connected and subscribed
        self._connects = 0                      # `connected` events handled
        self.onnx: OnnxReceiver | None = None   # the exported model (created on first use)
        # secure aggregation: the contribution of the round trained last (kept in memory only:
        # the round may be attempted again with fresh keys), and the attempt in progress
        self._secure_held = None                # (run, round, task seed, Contribution)
        self._secure_revealed = None            # (run, round) whose unmask it answered
        self._secure: secagg.SecAggClient | None = None
        self._secure_tag = 0                    # the attempt's tag (its chunks' id prefix)
        self._secure_seq = 0
        self._secure_in = secagg.ChunkAssembler(64 << 20)
        self._secure_for = None                 # (run, round, signature context, aggregator)
        self._secure_last = 0
        # signatures (roles/trust.py): None each when the site file sets no keys
        self.signer = getattr(settings.trust, "signer", None)
        self.downlink = getattr(settings.trust, "downlink", None)
        self._signed_at = -math.inf             # signing time of the announcement followed
        self._signed_run = None                 # the run of the signing time on disk

    # ------------------------------------------------------------------ public
    @property
    def client_state(self):
        return self.progress.client_state

    def run(self) -> None:
        """Connect, then handle messages until `stop` is set (or the run finishes, with
        exit_when_finished); always closes the connection on the way out."""
        self.start()
        try:
            while not self.stop.is_set():
                if self.step(self.settings.poll_s):
                    break
        finally:
            self.finish()

    # run() in three parts, for a host that drives many clients from one thread
    # (edgefl.sim.hosting): start() once, step() whenever its transport's queue has
    # something (or now and then), finish() once.
    def start(self) -> None:
        """Load the stored progress, connect and subscribe (blocking); `ready` is set when
        done."""
        os.makedirs(self.state_dir, exist_ok=True)
        self.progress = ClientProgress.load(self.state_dir)
        self._signed_at, self._signed_run = _load_signed_at(self.state_dir)
        if self.settings.trust is not None and self.settings.trust.active:
            log.info("%s: %s", self.node, self.settings.trust.describe())
        if self.downlink is None:
            log.info("%s: signatures off: announcements, models and ONNX files are taken "
                     "unsigned (set keys.aggregator to require the aggregator's)", self.node)
        if self.progress.upload_missing:
            log.warning("%s: the update of round %d was not stored before the process ended "
                        "(%s missing): that round is not trained again and cannot be re-sent",
                        self.node, self.progress.trained, self.progress.upload_missing)
        self._connect()
        # An MqttTransport knows its broker's address (host:port, never a password); the
        # loopback one is a broker inside this process.
        broker = getattr(self.transport, "address", None) or "in this process"
        log.info("%s: connected to broker %s, federation %r: waiting for a run", self.node,
                 broker, self.settings.federation)
        self.ready.set()
        if self.notifier is not None:
            self.notifier.ready(f"client {self.node}: waiting for a round")

    @property
    def done(self) -> bool:
        """The run is finished and nothing is left to do (with exit_when_finished)."""
        return self.finished and self.job is None and self.settings.exit_when_finished

    def step(self, timeout: float = 0.0) -> bool:
        """One pass of the loop: wait up to `timeout` for a message, handle what is queued,
        finish a local round whose training ended, act on an announcement that came while
        training, ask again for a model that does not come. True when `done`."""
        if self.notifier is not None:
            self.notifier.beat()            # the systemd watchdog's proof of life
        if self.done:
            return True
        item = self.transport.receive(timeout=timeout)
        while item is not None:
            self._handle(item)
            item = self.transport.receive(timeout=0) if self.job is None or \
                not self.job.done.is_set() else None
        if self.job is not None and self.job.done.is_set():
            self._finish_job()
        if self.job is None and self.next_ann is not None:
            doc, self.next_ann = self.next_ann, None
            self._adopt(doc)
        self._maybe_ask_for_model()
        return False

    def finish(self) -> None:
        """Stop a local round still training (not stored), then close the connection."""
        try:
            self._stop_job()
        finally:
            self._close()

    def _stop_job(self) -> None:
        """The loop has ended: a local round still training stops before its next step, and
        its thread is joined, so no thread is left inside the C core when the process exits.
        A round stopped short is not stored (trained again after a restart); one that ended
        on its own meanwhile is finished as usual (stored, then uploaded)."""
        job = self.job
        if job is None:
            return
        if not job.done.is_set():
            job.stop.set()
            job.done.wait()
        self._finish_job()

    # ------------------------------------------------------------------ connection
    def _status(self, online: bool, will: bool = False, **extra) -> bytes:
        # The will is fixed at connect time: it carries no last round (it would be stale).
        # onnx_*: the exported model installed for `edgefl serve` (the dashboard shows it)
        onnx = self.onnx if not will else None
        return status_payload(self.node, "client", online, profile=self.settings.profile,
                              last_round=None if will else (self.progress.trained or None),
                              run=self.progress.run_id,
                              onnx_sha256=onnx.installed_sha if onnx else None,
                              onnx_round=onnx.installed_round if onnx else None,
                              key=self.signer.fingerprint if self.signer else None,
                              signatures="on" if self.downlink else "off", **extra)

    def _publish_status(self, online: bool = True, **extra) -> None:
        try:
            self.transport.publish(self.topics.status(self.node),
                                   self._status(online, **extra), qos=1, retain=True)
        except TransportError as exc:
            log.warning("%s: status not published: %s", self.node, exc)

    def _connect(self) -> None:
        t = self.transport
        t.set_will(self.topics.status(self.node), self._status(False, will=True))
        t.connect()
        if self.settings.follow_round:
            t.subscribe(self.topics.round(), qos=1)
        t.subscribe(self.topics.model(), qos=1)
        t.subscribe(self.topics.client_model(self.node), qos=1)
        # asynchronous runs; a synchronous run's aggregator with task_topics on
        t.subscribe(self.topics.topic("task", self.node), qos=1)
        # the latest exported ONNX model, retained: its manifest and its parts
        t.subscribe(self.topics.onnx(), qos=1)
        t.subscribe(parts_filter(self.topics), qos=1)
        t.subscribe(self.topics.secure_to(self.node), qos=1)
        self._publish_status()

    def _close(self) -> None:
        self._join_writer()
        try:
            if self.transport.connected:
                # Unsubscribe first, so nothing arrives while the transport disconnects and
                # its DISCONNECT is sent (the broker then discards the will); then our own
                # offline status, with the last round, which the will cannot carry.
                for topic_filter in self.transport.subscriptions:
                    self.transport.unsubscribe(topic_filter)
                self._publish_status(online=False)
            self.transport.close(announce_offline=False)
        except (TransportError, OSError) as exc:
            log.warning("%s: closing the connection: %s", self.node, exc)

    # ------------------------------------------------------------------ messages
    def _handle(self, item) -> None:
        if isinstance(item, ConnectionEvent):
            if not item.connected:
                log.warning("%s: broker connection lost (%s); the transport reconnects",
                            self.node, item.reason)
            elif self._connects > 0:
                # Every reconnect, not only when the session was lost: a broker that shut
                # down published our Last Will (Mosquitto sends the wills of connected
                # clients on shutdown), so our retained status says offline until we
                # correct it, and the aggregator would not wait for our updates.
                self._publish_status()
            self._connects += item.connected
            return
        if not isinstance(item, Message):
            return
        if item.topic.startswith(self._onnx_parts) \
                and part_index(self.topics, item.topic) is not None:
            self._on_onnx(item.topic, item.payload, part=True)
            return
        try:
            kind, node = self._topic_cache.parse(item.topic)
        except TopicError as exc:
            self._reject(f"message on an unexpected topic: {exc}")
            return
        if kind == "onnx":
            self._on_onnx(item.topic, item.payload, part=False)
        elif kind == "round" or (kind == "task" and node == self.node):
            # an asynchronous run's task is an announcement tasking this board alone
            self._on_announcement(item.payload)
        elif kind == "model" or (kind == "client_model" and node == self.node):
            self._on_model(kind, item.payload)
        elif kind == "secure_to" and node == self.node:
            self._on_secure(item.payload)
        else:
            self._reject(f"message on {item.topic}, which this client did not subscribe to")

    def _reject(self, reason: str) -> None:
        self.stats["rejected"] += 1
        log.warning("%s: rejected %s", self.node, reason)

    def _on_onnx(self, topic: str, payload: bytes, part: bool) -> None:
        """The exported model: its manifest (`onnx`) or a part (`onnx/<i>`), installed as
        <state_dir>/model.onnx once complete and checked (roles/onnx_channel.py), where
        `edgefl serve` on this board picks it up."""
        if self.onnx is None:
            self.onnx = OnnxReceiver(self.state_dir, verifier=self.downlink)
            if self.onnx.installed_sha is not None:
                self._publish_status()        # the model installed before a restart
        try:
            if not part:
                known = self.onnx.installed_round
                doc = self.onnx.on_manifest(payload)
                if doc is not None:
                    log.info("%s: ONNX model of round %d announced (sha256 %s, %d part(s))%s",
                             self.node, doc["round"], doc["sha256"][:12], doc["parts"],
                             "; installed already" if doc["sha256"] == self.onnx.installed_sha
                             else "")
                if self.onnx.installed_round != known:
                    self._publish_status()    # the installed model's round, known again
                return
            if self.onnx.on_part(payload) is not None:
                self.stats["onnx_installed"] = self.onnx.installs
                self._publish_status()        # the status names the model installed
        except (wire.FrameError, ModelFileError, SignatureError) as exc:
            self._reject(f"ONNX model on {topic}: {exc}")

    def _on_announcement(self, payload: bytes) -> None:
        if not payload:
            return                                  # cleared retained announcement
        try:
            doc = self._parse_announcement(payload)
        except MessageError as exc:
            self._reject(str(exc))                  # "announcement: <what is wrong>"
            return
        if self.downlink is not None and not self._signed_announcement(doc):
            return
        current = self.next_ann or self.ann
        if current is not None and current.get("announce") == doc["announce"]:
            return                                  # the same announcement again (QoS 1)
        if self.job is not None:
            self.next_ann = doc                     # acted on once the training is done
            return
        self._adopt(doc)

    def _signed_announcement(self, doc: dict) -> bool:
        """Whether `doc` is the aggregator's, for this federation, its own run and round,
        and not older than the announcement followed (a replay of an earlier run's or
        round's, which the aggregator signed then, is refused by its signing time)."""
        kind = "finished" if doc.get("finished") is True else "announce"
        try:
            env = self.downlink.verify_doc(doc, kind=kind, where="announcement",
                                           run=doc["run"], round=doc["round"],
                                           by=doc["aggregator"])
        except SignatureError as exc:
            self._reject(f"{exc}; the model this board has stays")
            return False
        if env["at"] < self._signed_at:
            self._reject(f"announcement of run {doc['run']} round {doc['round']}: signed at "
                         f"{env['at']:.3f}, before the announcement this board follows "
                         f"({self._signed_at:.3f}): a replay; the model this board has stays")
            return False
        if env["at"] > self._signed_at:
            self._signed_at = env["at"]
            # On disk only when the run changes: within a run, the progress file already
            # refuses an older round after a restart (a round is never trained twice), so
            # an fsync'ed write on every round's critical path would buy nothing.
            if doc["run"] != self._signed_run:
                self._signed_run = doc["run"]
                _save_signed_at(self.state_dir, env["at"], doc["run"])
        return True

    def _prepare_run(self, doc: dict) -> None:
        """Build the model and the strategy's client half the announcement describes, and
        check this client's data fits the model; otherwise remember why not."""
        model_doc = doc["model"]
        key = (doc["run"], model_doc["table"], repr(doc["strategy"]))
        if key == self._run_key:
            return
        self._run_key, self._unusable = key, None
        try:
            model = build_model(model_doc["spec"], tuple(model_doc["input_shape"]),
                                int(model_doc["num_classes"]))
        except (KernelError, TypeError, ValueError) as exc:
            self._unusable = f"cannot build the run's model {model_doc['spec']!r}: {exc}"
            return
        if model.table.digest != model_doc["table"]:
            self._unusable = (f"the run's model {model_doc['spec']!r} builds here with layer "
                              f"table {model.table.digest[:12]}, the announcement says "
                              f"{model_doc['table'][:12]} (another edgefl version?)")
            return
        if tuple(self.x.shape[1:]) != tuple(model.input_shape):
            self._unusable = (f"local data has samples of shape {tuple(self.x.shape[1:])}, the "
                              f"run's model takes {tuple(model.input_shape)}")
            return
        params = doc["strategy"]["params"]
        try:
            strategy = get_strategy(doc["strategy"]["name"], **params)
        except (StrategyError, TypeError) as exc:
            self._unusable = f"strategy of the run: {exc}"
            return
        self._unusable = self._over_limits(model, doc["train"].get("batch_size"))
        if self._unusable is None:
            self._model, self._strategy = model, strategy

    def _over_limits(self, model, batch_size) -> str | None:
        """Why the run asks more than this board allows (its profile's limits), or None.
        Memory: resident now plus a local round's -- three float32 copies of the parameters
        (model, update, strategy state) and the backend's workspace for the run's minibatch
        (kernels.workspace_bytes: activations, conv columns, gradients; a conv net's
        activations can be a hundred times its input) -- against memory_budget_mb."""
        s = self.settings
        if s.max_params is not None and model.n_params > s.max_params:
            return (f"the run's model has {model.n_params:,} parameters, this board's limit "
                    f"is compute.max_params = {s.max_params:,}")
        if isinstance(batch_size, int) and s.max_batch_size is not None \
                and batch_size > s.max_batch_size:
            return (f"the run's minibatch is {batch_size}, this board's limit is "
                    f"compute.max_batch_size = {s.max_batch_size}")
        if s.memory_budget_mb is not None:
            from ..service.profiles import resident_mb

            batch = batch_size if isinstance(batch_size, int) and batch_size > 0 \
                else len(self.x)
            need = (12 * model.n_params
                    + kernels.workspace_bytes(model, batch, len(self.x))) / 2 ** 20
            rss = resident_mb()
            if rss + need > s.memory_budget_mb:
                return (f"a local round of the run's model needs about {need:.0f} MiB on top "
                        f"of {rss:.0f} MiB resident, over compute.memory_budget_mb = "
                        f"{s.memory_budget_mb}")
        return None

    def _adopt(self, doc: dict) -> None:
        self.ann = doc
        self.waiting = None
        self._expect = {}
        if doc.get("finished"):
            self.finished = True
            log.info("%s: run %s finished after round %d (final model sha256 %s)", self.node,
                     doc["run"], doc["round"], doc["model_sha256"][:16])
            self._publish_status()
            return
        self.finished = False
        if doc["run"] != self.progress.run_id:
            if self.progress.run_id is not None:
                log.info("%s: a new run %s (was %s): local progress reset", self.node,
                         doc["run"], self.progress.run_id)
            self.progress = ClientProgress(run_id=doc["run"])
            self._answered = None
        self._prepare_run(doc)
        entry = doc["tasks"].get(self.node)
        r = int(doc["round"])
        if entry is None:
            log.debug("%s: not tasked in round %d", self.node, r)
            return
        if r < self.progress.trained:
            log.debug("%s: announcement of round %d, already at round %d: ignored", self.node,
                      r, self.progress.trained)
            return
        if r == self.progress.trained:
            if doc.get("secure") is not None:
                self._secure_attempt(doc, r)
                return
            if entry["upload"] and self.progress.upload is not None \
                    and self._answered != doc["announce"]:
                self._upload(self.progress.upload)
                self._answered = doc["announce"]
                self.stats["resent"] += 1
                log.info("%s: round %d announced again: its stored update re-sent (not "
                         "trained twice)", self.node, r)
            return
        if self._unusable is not None:
            log.error("%s: cannot take part in round %d: %s", self.node, r, self._unusable)
            # said in the retained status, so the aggregator does not wait for us and the
            # operator sees why (clients cannot publish events: broker/acl)
            self._publish_status(refused={"run": doc["run"], "round": r,
                                          "reason": self._unusable})
            return
        table = self._model.table
        senders = {doc["aggregator"]}
        self._expect = {
            "model": wire.Expectation(table, kinds="model", rounds=r, senders=senders),
            "client_model": wire.Expectation(table, kinds="client_model", rounds=r,
                                             senders=senders, topic_recipient=self.node)}
        self.waiting = [r, time.monotonic(), 0]
        early, self.early, self._early_bytes = list(self.early), deque(), 0
        for kind, payload in early:
            if self.waiting is None:
                break
            self._on_model(kind, payload)

    def _keep_early(self, kind: str, payload: bytes) -> None:
        self.early.append((kind, payload))
        self._early_bytes += len(payload)
        while self._early_bytes > self.settings.max_early_bytes and self.early:
            _, dropped = self.early.popleft()
            self._early_bytes -= len(dropped)

    def _on_model(self, kind: str, payload: bytes) -> None:
        if not payload:
            return
        peek = peek_frame(payload)
        if peek is None:
            try:
                wire.read_header(payload)          # says what is wrong with it
                raise wire.FrameError("magic", "not a frame")
            except wire.FrameError as exc:
                self._reject(f"{kind} frame: [{exc.code}] {exc.reason}")
            return
        frame_round = peek[0]
        current = int(self.ann["round"]) if self.ann and not self.ann.get("finished") else 0
        if kind == "client_model" and (self.ann is None or frame_round > current):
            # our copy of a round we have no task of yet: it may carry the task (an
            # aggregator's task_in_copy; docs/protocol.md section 1), taken as if it had
            # come on task/<client>
            task = _carried_task(payload)
            if task is not None:
                self._on_announcement(task)
                current = int(self.ann["round"]) if self.ann and not self.ann.get("finished") \
                    else 0
        if self.ann is None or frame_round > current:
            self._keep_early(kind, payload)         # its announcement has not come yet
            return
        if self.waiting is None or frame_round < current:
            log.debug("%s: %s frame of round %d not needed (round %d, %s)", self.node, kind,
                      frame_round, current, "waiting" if self.waiting else "not waiting")
            return
        try:
            frame = self.reassembler.add(payload, self._expect[kind])
        except wire.FrameError as exc:
            self._reject(f"{kind} frame: [{exc.code}] {exc.reason}")
            return
        if frame is not None:
            self._on_model_frame(kind, frame)

    def _on_model_frame(self, kind: str, frame) -> None:
        doc = self.ann
        entry = doc["tasks"][self.node]
        if entry["source"] == "client" and kind == "model":
            return                                  # FedMR: the shared model is not ours
        expected = _model_sha(doc, self.node)
        if self.downlink is not None:
            try:
                self.downlink.verify_frame(frame, where=f"{kind} frame of round {frame.round}",
                                           run=doc["run"], by=doc["aggregator"])
            except SignatureError as exc:
                self._reject(str(exc))
                return
        # The frame the announcement names is its model: only the aggregator publishes
        # model frames, with a fresh random id each (signed, the id is in what the
        # signature covers). Any other frame (an announcement without "model_frame", a
        # re-encoded model) is checked by content, which costs a sha256 over the whole
        # model (2 ms for 4 MB here, ten times that on a board without SHA instructions) on
        # every round's critical path. A signed copy under another id is no exception: a run
        # id names one run only while the aggregator's state lasts, and a copy an earlier
        # run of the same id signed for this round and board verifies as well as this one.
        if frame.message_id != announced_frame_id(doc, self.node):
            sha = buffers_sha256(frame.buffers)
            if sha != expected:
                self._reject(f"{kind} frame of round {frame.round}: content sha256 {sha[:16]} "
                             f"is not the announced {expected[:16]} (a stale or foreign "
                             "model)")
                return
        if frame.scalars.get("run") != doc["run"]:
            self._reject(f"{kind} frame of round {frame.round} names run "
                         f"{frame.scalars.get('run')!r}, the announcement run {doc['run']}")
            return
        try:
            task = task_from_announcement(doc, self.node, frame.buffers)
        except (MessageError, StrategyError) as exc:
            self._reject(f"task of round {frame.round}: {exc}")
            self.waiting = None
            # said in the retained status, as a model this board's limits refuse: a newer
            # aggregator's setting this edgefl does not know would otherwise have every
            # round wait for its deadline, with nothing to tell the operator why
            self._publish_status(refused={"run": doc["run"], "round": frame.round,
                                          "reason": f"task of round {frame.round}: {exc}"})
            return
        # the client's stop, if it is a StopFlag (a signal's), reaches the kernel directly
        stop = self.stop if isinstance(self.stop, kernels.StopFlag) else kernels.StopFlag()
        local = self._local_data(int(entry["client"]), stop)
        self.waiting = None
        self.job = _Job(doc, task, local, self._strategy, self.progress.client_state,
                        self.train_slots, self.transport.messages)
        self.job.start(self.train_pool)
        if self.notifier is not None:
            self.notifier.status(f"round {frame.round}: training")
        log.debug("%s: training round %d", self.node, frame.round)

    def _local_data(self, client: int, stop) -> LocalData:
        """The data of a local round. Its check against the model (x's shape and values, y's
        labels) is made once per run, not once per round: the first round's LocalData makes
        it when it trains (a failed check is that round's training error), and _finish_job
        keeps it for the rounds after."""
        checked = self._samples
        if checked is not None and checked.model is self._model:
            return LocalData.of_samples(client, checked, self.y, stop=stop)
        return LocalData(client, self._model, self.x, self.y, stop=stop)

    def _maybe_ask_for_model(self) -> None:
        if self.waiting is None or self.job is not None:
            return
        r, since, asked = self.waiting
        wait = min(self.settings.model_wait_s * 2 ** asked, 60.0)
        if time.monotonic() - since < wait:
            return
        self.waiting = [r, time.monotonic(), asked + 1]
        self.stats["asked"] += 1
        log.info("%s: no complete model for round %d after %.1f s: asking for it", self.node,
                 r, wait)
        self._publish_status(need_model=r)

    # ------------------------------------------------------------------ training done
    def _finish_job(self) -> None:
        job, self.job = self.job, None
        r, doc = job.round, job.announcement
        if isinstance(job.error, TrainingStopped):     # the client is stopping
            log.info("%s: stopping; round %d's training is abandoned after %d of %d local "
                     "steps (it is trained again after a restart)", self.node, r,
                     job.error.steps, job.planned_steps)
            return
        if job.error is not None:
            exc = job.error
            kind = "diverged" if isinstance(exc, NonFiniteError) else "failed"
            client = doc["tasks"][self.node]["client"]
            if self.settings.raise_on_error:
                if isinstance(exc, NonFiniteError):
                    raise NonFiniteError(exc.step, f"round {r}, client {client}: {exc}") from exc
                raise exc
            log.error("%s: round %d: training %s: %s", self.node, r, kind, exc)
            if not isinstance(exc, (StrategyError, KernelError, ValueError,
                                    FloatingPointError)):
                raise exc
            # no update will come: said in the retained status, as a refused round, so the
            # aggregator stops waiting for this board now instead of at the round's deadline
            # (every round it is tasked), and the operator reads why in client_refused
            # ("failed": this round's training, which the next task may not repeat, unlike
            # limits that rule the whole run out)
            self._publish_status(refused={"run": doc["run"], "round": r, "failed": True,
                                          "reason": f"round {r}: training {kind}: {exc}"})
            return
        update, new_state = job.result
        self._samples = vars(job.local).get("samples", self._samples)   # _local_data
        frame = None
        secure = doc.get("secure") is not None and job.task.upload
        if secure:
            try:
                hooks = NO_HOOKS if doc.get("dp") is None else \
                    DPHooks.from_client_settings(doc["dp"])
                contribution = client_contribution(self._strategy, job.task, update, hooks,
                                                   task_generator(job.task))
            except (StrategyError, ValueError) as exc:
                log.error("%s: round %d: no contribution to the secure sum: %s", self.node, r,
                          exc)
                return
            self._secure_held = (doc["run"], r, int(job.task.train["seed"]), contribution)
        elif job.task.upload:
            if not update.buffers:
                log.error("%s: round %d: the strategy produced no buffers to upload", self.node,
                          r)
                return
            try:
                frame = wire.encode("update", r, self.node, update.buffers,
                                    update_scalars(update, doc["run"], job.train_s,
                                                   base=_model_sha(doc, self.node)),
                                    self._model.table, self.settings.compression,
                                    sign=self.signer.frame_signer(doc["run"]) if self.signer
                                    else None)
            except wire.EncodeError as exc:
                log.error("%s: round %d: update not sent: %s", self.node, r, exc)
                return
        self._join_writer()
        self.progress = ClientProgress(run_id=doc["run"], trained=r, upload=frame,
                                       client_state=new_state)
        if self.settings.keep_progress:
            self.progress.save(self.state_dir)    # before the upload: never trained twice
        self.stats["trained"] += 1
        if frame is not None:
            self._upload(frame)
            self._answered = doc["announce"]
        if secure:
            self._secure_attempt(doc, r)
        # the frame itself is stored while the upload goes out (kept for re-sending)
        if self.settings.keep_progress:
            self._writer = threading.Thread(target=self._save_upload, args=(self.progress,),
                                            name=f"edgefl-save-{self.node}", daemon=True)
            self._writer.start()
        if self.settings.round_status:
            self._publish_status()
        log.debug("%s: round %d done (%.3f s training%s)", self.node, r, job.train_s,
                  ", uploaded" if frame is not None else ", nothing to upload")

    def _save_upload(self, progress: ClientProgress) -> None:
        try:
            progress.save_upload(self.state_dir)
        except OSError as exc:
            log.error("%s: the update of round %d could not be stored (%s); it cannot be "
                      "re-sent if this round is announced again", self.node, progress.trained,
                      exc)

    def _join_writer(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _upload(self, frame: bytes) -> None:
        topic = self.topics.update(self.node)
        try:
            for chunk in wire.split(frame, self.settings.max_payload):
                self.transport.publish(topic, chunk, qos=1)
            self.stats["uploads"] += 1
        except TransportError as exc:
            log.error("%s: upload failed: %s; it is re-sent when the round is announced "
                      "again", self.node, exc)

    # ------------------------------------------------------------------ secure aggregation
    def _secure_attempt(self, doc: dict, r: int) -> None:
        """Start the secure protocol for the attempt `doc` announces, with the contribution of
        round r held in memory: fresh keys, then our advertisement (docs/protocol.md section 10).
        Without it (the process restarted since training) we cannot take part: a dropout."""
        held = self._secure_held
        if held is None or held[0] != doc["run"] or held[1] != r:
            if not doc["tasks"][self.node].get("upload", True):
                return                               # not one of the round's participants
            why = "it revealed its shares in an earlier attempt of the round" \
                if self._secure_revealed == (doc["run"], r) else \
                "its contribution is not held (restarted since training)"
            log.warning("%s: round %d: %s: this client sits the secure round out", self.node,
                        r, why)
            # said in the retained status too: the aggregator then waits for us in no phase
            # of the round, and ends a run whose round cannot reach its threshold without
            # us instead of announcing it again at every deadline
            self._publish_status(refused={"run": doc["run"], "round": r,
                                          "reason": f"secure aggregation: {why}"})
            return
        tag = attempt_tag(doc["announce"])
        if self._secure is not None and self._secure_tag == tag:
            return                                   # this attempt is under way already
        try:
            setup = secagg.RoundSetup.from_dict(doc["secure"])
            self._secure = secagg.SecAggClient(int(doc["tasks"][self.node]["client"]), setup)
        except (secagg.SecAggError, KeyError, TypeError, ValueError) as exc:
            self._reject(f"secure aggregation setup of round {r}: {exc}")
            return
        self._secure_tag, self._secure_seq = tag, 0
        # what this attempt's messages are signed for, both ways (protocol.md section 11)
        self._secure_for = (doc["run"], r, secure_context(doc["announce"], self.node),
                            doc["aggregator"])
        self._secure_last = 0                        # message id of the last one acted on
        self._secure_in.clear()
        self._send_secure(self._secure.advertise())

    def _send_secure(self, msg) -> None:
        self._secure_seq += 1
        topic = self.topics.secure(self.node)
        run, r, context, _ = self._secure_for
        try:
            for chunk in secagg.to_chunks(msg, self.settings.max_payload,
                                          (self._secure_tag << 32) | self._secure_seq,
                                          secure_signer(self.signer, run, r, context)):
                self.transport.publish(topic, chunk, qos=1)
        except TransportError as exc:
            log.error("%s: secure aggregation message not sent: %s", self.node, exc)

    def _on_secure(self, payload: bytes) -> None:
        """A message of the aggregator's for the secure attempt under way: answer it. With
        keys.aggregator it must be the aggregator's, signed for this run, round, attempt and
        board, and later than the last one answered; a refused one changes nothing."""
        sa = self._secure
        if sa is None or len(payload) < 12 or int.from_bytes(payload[4:8], "big") != self._secure_tag:
            return                                   # no attempt under way, or an earlier one's
        try:
            sealed = self._secure_in.add_sealed("aggregator", payload)
            if sealed is None:
                return
            where = f"secure message {sealed.message_id & 0xffffffff} of round " \
                    f"{self._secure_for[1]}"
            if self.downlink is not None:
                run, r, context, aggregator = self._secure_for
                try:
                    verify_secure(self.downlink, sealed, context=context, run=run, round=r,
                                  by=aggregator, where=where)
                except SignatureError as exc:
                    self._secure_in.forget("aggregator", sealed.message_id)
                    self._reject(f"{exc}; the secure round goes on without it")
                    return
            if sealed.message_id <= self._secure_last:
                self._reject(f"{where}: an earlier message of this attempt again (a replay): "
                             "ignored")
                return
            msg = sealed.message()
            self._secure_last = sealed.message_id
            if isinstance(msg, secagg.KeysBroadcast):
                self._send_secure(sa.share_keys(msg))
            elif isinstance(msg, secagg.SharesForward):
                _, _, seed, contribution = self._secure_held
                self._send_secure(sa.masked_input(msg, contribution, seed))
            elif isinstance(msg, secagg.UnmaskRequest):
                self._send_secure(sa.unmask(msg))
                self._secure = None                  # one answer an attempt: done
                # and no later attempt of this round with this contribution: its sum may be
                # unmasked now, and a second sum over it with other survivors (the round
                # announced again by an aggregator restarted mid-round) could be subtracted
                run, r, _, _ = self._secure_for
                self._secure_held, self._secure_revealed = None, (run, r)
            else:
                raise secagg.SecAggError(f"a {msg.kind} message is not for a client")
        except (secagg.SecAggError, ValueError) as exc:
            self._reject(f"secure aggregation message: {exc}")


SIGNED_AT_FILE = "downlink-signed.json"    # the signing time of the first announcement
                                           # of the run followed, and that run
# what a client replaces atomically in its state directory (hold_state_dir removes what
# its writers killed mid-write left of them; update.frame is written in place)
STATE_FILES = (PROGRESS_FILE, SIGNED_AT_FILE) + INSTALLED_FILES


def _load_signed_at(state_dir: str) -> tuple:
    try:
        with open(os.path.join(state_dir, SIGNED_AT_FILE), encoding="utf-8") as f:
            doc = json.load(f)
        at = doc.get("at")
        if isinstance(at, (int, float)) and math.isfinite(at):
            return float(at), doc.get("run")
    except (OSError, ValueError, AttributeError):
        pass
    return -math.inf, None


def _save_signed_at(state_dir: str, at: float, run: str) -> None:
    from ..io import atomic_write

    try:
        atomic_write(os.path.join(state_dir, SIGNED_AT_FILE),
                     json.dumps({"at": at, "run": run}).encode())
    except OSError as exc:
        log.warning("the signing time of the followed announcement was not stored (%s): "
                    "after a restart, an older one replayed is refused only by its run and "
                    "round", exc)


def _model_sha(doc: dict, node: str) -> str | None:
    """The announced sha256 of the model `node` trains from in announcement `doc`: its
    per-client model's, or the global model's."""
    entry = doc["tasks"][node]
    return entry["model_sha256"] if entry["source"] == "client" else doc["model_sha256"]


def _carried_task(payload) -> bytes | None:
    """The task a copy of the model carries (its scalar "task", from an aggregator with
    task_in_copy), or None: no task, a chunk, or a frame the full checks will refuse."""
    try:
        task = wire.peek_scalars(payload).get("task")
    except wire.FrameError:
        return None
    return task.encode("utf-8") if isinstance(task, str) else None
