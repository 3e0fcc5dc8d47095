"""The same rounds as `run_federation`, through an MQTT broker: `run_over_broker` runs the
real roles (edgefl.roles: the aggregator and one client per shard, each with its own
connection and session). The aggregator runs in this process; the clients are driven by one
thread per process (sim.hosting.ClientHost), in this process or spread over forked worker
processes (`client_processes`), each process with one network thread for its connections.
What `edgefl simulate --transport mqtt` runs; the final model equals the in-process one bit
for bit when compression is "none".
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..io import lock_exclusive
from ..runs.prepare import PreparedRun, RunResult

__all__ = ["run_over_broker", "check_options", "reach_broker", "ScratchDirectory"]

log = logging.getLogger("edgefl.sim")

SCRATCH_PREFIX = "edgefl-sim-held-"   # a scratch directory whose owner holds its flock
_MAKING_PREFIX = "edgefl-sim-new-"    # one made, not yet locked and renamed
_MAKING_GRACE_S = 60.0                # a "new" one older than this was never finished


class ScratchDirectory:
    """A new directory in `parent` (None: the system's temporary directory) for the roles'
    state of one simulation, removed by cleanup(), made after removing those in `parent` of
    simulations killed before theirs ran (kill -9 skips cleanup(); in /dev/shm they held
    memory until reboot). Its owner is whoever holds an flock on it: this process, and the
    worker processes forked from it, which share the open directory. The kernel lets the
    lock go when the last of them dies, however it dies. A pid says nothing here: /dev/shm
    may be shared by containers that cannot see each other's processes, but they share the
    directory's inode and so its lock. It is made under a name no cleaner takes
    (edgefl-sim-new-), locked, then renamed (the rename keeps the inode and the lock): there
    is no instant when it bears the owned name and is not held."""

    def __init__(self, parent: str | None):
        remove_dead_scratch(parent or tempfile.gettempdir())
        making = tempfile.mkdtemp(prefix=_MAKING_PREFIX, dir=parent)
        self.name = os.path.join(os.path.dirname(making), SCRATCH_PREFIX +
                                 os.path.basename(making)[len(_MAKING_PREFIX):])
        fd = os.open(making, os.O_RDONLY | os.O_DIRECTORY)
        try:
            lock_exclusive(fd)         # "unsupported": no lock, and no cleaner can take it
            os.rename(making, self.name)
        except BaseException:
            os.close(fd)
            shutil.rmtree(making, ignore_errors=True)
            raise
        # cleanup() once, by the caller or, failing that, when this object goes or the
        # interpreter exits (a forked worker's copy is never finalised: os._exit)
        self._finalizer = weakref.finalize(self, _remove_held, self.name, fd)

    def cleanup(self) -> None:
        self._finalizer()


def _remove_held(path: str, fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)                       # (lets the lock go)


def remove_dead_scratch(parent: str) -> int:
    """Remove the scratch directories in `parent` whose owner is gone (ScratchDirectory):
    this account's only (/dev/shm is shared), and only those whose flock this process can
    take, which it holds while it removes them. A live simulation's is never touched, nor
    one in the instant between its mkdtemp and its lock. An older edgefl's (edgefl-sim-
    and letters, no lock) is left: remove it by hand. Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    for name in names:
        making = name.startswith(_MAKING_PREFIX)
        if not (making or name.startswith(SCRATCH_PREFIX)):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue                    # removed by another simulation starting with this one
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or (
                making and time.time() - st.st_mtime < _MAKING_GRACE_S):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if lock_exclusive(fd) == "locked":
                shutil.rmtree(path, ignore_errors=True)
                removed += not os.path.lexists(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d %s in %s left by simulations that were killed", removed,
                 "directory" if removed == 1 else "directories", parent)
    return removed


def check_options(url: str | None = None, *, max_payload: int = 128 * 1024,
                  compression: str = "none", round_timeout_s: float = 120.0,
                  client_processes: int | None = None, **_others) -> None:
    """Refuse settings of `run_over_broker` that would fail it only once it has started
    (a bad broker URL, a chunk size below the minimum, an unknown compression), with the
    same errors the roles would raise: `simulate` calls it before it loads the data or
    touches its output directory. Options not checked here are accepted (`_others`)."""
    from ..roles import AggregatorSettings, ClientSettings
    from ..transport.mqtt import parse_broker_url

    if client_processes is not None and int(client_processes) < 0:
        raise ValueError(f"client_processes = {client_processes!r}: need >= 0 (0: the "
                         "clients are hosted in this process)")
    if url is not None:
        parse_broker_url(url)
    # the settings every role of the run is built with, built once here to be checked
    ClientSettings("check", "check", max_payload=max_payload, compression=compression)
    AggregatorSettings(federation="check", round_timeout_s=round_timeout_s,
                       max_payload=max_payload, compression=compression)


def reach_broker(url: str, client_id: str, timeout: float) -> None:
    """Connect to the broker at `url` once (as the roles will: credentials, TLS) and
    disconnect. Raises TransportError naming the broker and the cause. `simulate` calls it
    before the run is prepared (a strategy's offline phase writes into the run's directory)
    and before any worker process is forked: one clear error at once, not one per worker.
    Its network thread is joined by close(), so none is left running at the fork."""
    from ..transport.mqtt import MqttTransport

    probe = MqttTransport(url, client_id, clean_session=True, connect_timeout=timeout)
    try:
        probe.connect()
    finally:
        probe.close(timeout=min(5.0, timeout), announce_offline=False)


def default_client_processes(clients: int) -> int:
    """How many worker processes host the clients of a simulation over a broker by default:
    two, and one more per 2,500 clients beyond 5,000, at most four; none (the clients are
    hosted in this process) where processes cannot be forked. Two beat one process, and
    both beat the simulating process, at 100 clients on two cores (docs/scaling.md)."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        return 0
    return min(4, max(2, -(-clients // 2500)))


def run_over_broker(run: "PreparedRun", url: str | None = None, *, broker_kind: str = "auto",
                    workers: int | None = None, on_round: Callable[[dict], None] | None = None,
                    on_model: Callable[[int, np.ndarray], None] | None = None,
                    max_payload: int = 128 * 1024, compression: str = "none",
                    round_timeout_s: float = 120.0, federation: str | None = None,
                    state_dir: str | None = None, connect_timeout: float = 30.0,
                    client_processes: int | None = None, task_topics: bool = True,
                    stop=None):
    """Run `run` through an MQTT broker: the aggregator role in this thread and one client
    role per shard, each with its own MQTT connection, as a fleet would (edgefl.roles).
    url: the broker (None: an EmbeddedBroker of `broker_kind` for the run). At most
    `workers` clients train at once. The clients are driven by a ClientHost (sim.hosting) in
    this process (`client_processes` 0) or in that many forked worker processes, each
    hosting a contiguous share of them (None: default_client_processes). `task_topics`
    (synchronous runs): the aggregator sends each tasked client its task alone on its
    task/<client> topic and the clients do not follow the round topic, so a client is
    woken only in the rounds that task it (docs/protocol.md section 1); False: every client
    receives every announcement on the round topic, as boards do. Returns
    (RunResult, a description of the transport for the summary). The final model equals
    run_federation's bit for bit when compression is "none", however the clients are
    hosted.

    `stop`: a kernels.StopFlag shared by every role of this process (None: one of its own).
    Set by a signal, the clients' local rounds stop before their next step, the aggregator
    abandons the open round, and RunStopped is raised with the rounds aggregated. It is set
    when the run ends in any case: that is how the clients are told to finish (worker
    processes by a message on their pipe)."""
    import threading

    from ..roles.asynchronous import aggregator_class
    from ..roles import (AggregatorSettings, Client, ClientSettings, RunPlan,
                        default_client_ids)
    from ..roles.aggregator import secure_plan
    from ..roles.messages import AnnouncementCache
    from ..transport.base import DEFAULT_QUEUE_MESSAGES
    from ..transport.broker import EmbeddedBroker, packet_bytes_for
    from ..transport.mqtt import MqttTransport, parse_broker_url
    from ..transport.netloop import NetworkLoop
    from .hosting import ClientHost, ConnectStopped, start_clients, tick_for

    from ..roles.aggregator import Aggregator

    config = run.config
    federation = federation or f"sim-{os.urandom(4).hex()}"   # fresh topics: no leftovers
    ids = default_client_ids(len(run.setup.clients))
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    # bad settings fail before anything starts
    check_options(url, max_payload=max_payload, compression=compression,
                  round_timeout_s=round_timeout_s, client_processes=client_processes)
    processes = default_client_processes(len(ids)) if client_processes is None \
        else int(client_processes)
    processes = min(processes, len(ids))
    from ..errors import RunStopped
    from ..kernels import StopFlag

    stop = StopFlag() if stop is None else stop     # the clients' kernels read its word
    errors: list = []
    broker, scratch, network, hosting, pool, procs = None, None, None, None, None, []
    clients: list = []
    client_states: dict = {}
    try:
        if url is None:
            broker = EmbeddedBroker(kind=broker_kind,
                                    max_packet_bytes=packet_bytes_for(max_payload)).start()
            url = broker.url
        # (a broker of the user's was reached by `simulate` before the run was prepared;
        # a worker whose clients cannot connect reports the broker's own error)
        address = parse_broker_url(url)
        if state_dir is None:
            # The roles' state (client progress, checkpoints, journal) is thrown away with
            # the run, so its fsyncs protect nothing: in memory when the machine has a
            # tmpfs, where an fsync returns at once (on this machine's virtual disk each
            # was a cache flush, and every tasked client makes one a round).
            shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
                else None
            scratch = ScratchDirectory(shm)
        root = scratch.name if scratch is not None else state_dir

        # A keepalive only guards against a busy interpreter missing it (10,000 clients'
        # pings, every 30 s, did), not against a peer gone silently: every role is ours.
        keepalive = max(30, len(ids) // 20)
        # and a SUBACK, through a broker and a network loop each serving thousands, can take
        # longer than a board's 30 s (10,000 clients: it did, past 5,000 connected)
        wait_s = max(connect_timeout, len(ids) / 50)

        def transport(node, loop):
            return MqttTransport(url, f"edgefl-{federation}-{node}", clean_session=True,
                                 keepalive=keepalive,
                                 connect_timeout=wait_s, reconnect_min=0.1,
                                 reconnect_max=2.0, network_loop=loop)

        plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                       config.clients_per_round, ids,
                       test=(run.dataset.x_test, run.dataset.y_test),
                       eval_every=config.eval_every, description=config.to_dict(),
                       hooks=run.hooks, **secure_plan(run))
        aggregator_cls = aggregator_class(plan)
        # per-client tasks are the synchronous aggregator's (an asynchronous run's tasks go
        # on task/<client> anyway)
        task_topics = bool(task_topics) and aggregator_cls is Aggregator

        # A client's progress on disk is what lets it resume after a restart without
        # training a round twice; a simulated client is never restarted, and with no
        # state_dir given its directory is deleted with the run: in memory only.
        keep_progress = state_dir is not None

        # round_status False: no status after each trained round (it only moves `last_round`
        # on, which nobody watches in a simulation); with task_in_copy (below), a tasked
        # client's messages are its copy of the model in, its task in it, and its update out
        def make_clients(indices, client_stop, slots, loop, pool) -> list:
            announcements = AnnouncementCache()      # each announcement parsed once
            return [Client(ClientSettings(ids[c], federation, max_payload=max_payload,
                                          compression=compression, exit_when_finished=True,
                                          raise_on_error=True, keep_progress=keep_progress,
                                          follow_round=not task_topics,
                                          round_status=False),
                           (run.clients[c].x, run.clients[c].y), transport(ids[c], loop),
                           os.path.join(root, ids[c]), stop=client_stop, train_slots=slots,
                           announcements=announcements, train_pool=pool)
                    for c in indices]

        try:
            if processes == 0:
                # One network thread for every connection, which also drives every client
                # (sim.hosting): thousands of role threads, each woken by every
                # announcement, used to saturate the interpreter (docs/scaling.md).
                network = NetworkLoop(name=f"edgefl-{federation}-net")
                pool = ThreadPoolExecutor(max_workers=max(1, workers),
                                          thread_name_prefix="edgefl-train")
                clients = make_clients(range(len(ids)), stop,
                                       threading.Semaphore(max(1, workers)), network, pool)
                host = ClientHost(clients, stop, errors, tick_s=tick_for(len(clients)),
                                  network=network)
                hosting = threading.Thread(target=host.run, name="edgefl-client-host",
                                           daemon=True)
                hosting.start()
                start_clients(clients, host, errors, stop, connect_timeout, address)
            else:
                procs = _fork_workers(processes, len(ids), workers, make_clients,
                                      connect_timeout, address)
                _wait_ready(procs, len(ids), stop, connect_timeout, address)
                # after the fork: a child has no copy of this loop or its thread
                network = NetworkLoop(name=f"edgefl-{federation}-net")
        except ConnectStopped:
            # a Ctrl-C while a large fleet connects is the same stop as one in round 1
            # (exit 130, summary.json saying so), not an error; a worker's own stop, with
            # this process's flag not set, stays the error it is
            if not stop.is_set():
                raise
            raise RunStopped(1, None, run.setup.rounds) from None
        # overlap_evaluation: a round's test-set evaluation runs while the next round does,
        # as run_federation's does (its record then reaches on_round a round later, as there).
        # task_in_copy: a tasked client's task comes in its copy of the model, not on its
        # own (every client here is this version: docs/protocol.md section 1)
        # checkpoint_rounds: the rounds' checkpoints protect nothing in a state directory
        # that is deleted with the run, as the clients' progress (keep_progress, above)
        settings = AggregatorSettings(federation=federation, round_timeout_s=round_timeout_s,
                                      max_payload=max_payload, compression=compression,
                                      task_topics=task_topics, overlap_evaluation=True,
                                      task_in_copy=True, checkpoint_rounds=keep_progress)

        def after_round(record, history):
            if on_round is not None:
                on_round(record)

        uplink = transport("aggregator", network)
        # every client's retained status arrives at once when the aggregator subscribes
        # (10,000 clients: the default queue of 10,000 messages dropped the last of them)
        uplink.set_queue_limits(max(DEFAULT_QUEUE_MESSAGES, 4 * len(ids)))
        aggregator = aggregator_cls(plan, uplink, os.path.join(root, "aggregator"), settings,
                                    stop=stop, on_round=after_round, on_model=on_model)
        result = aggregator.run()
        if not result.finished:
            _tell_workers(procs, "stop")     # their clients do not hear of a run's end
        if hosting is not None:
            hosting.join(timeout=30.0)
            client_states = {c: role.client_state for c, role in enumerate(clients)}
        else:
            client_states = _collect(procs, {node: c for c, node in enumerate(ids)}, errors,
                                     timeout=max(30.0, len(ids) / 100))
        if errors:
            raise errors[0]
        if not result.finished and stop.is_set():
            raise RunStopped(len(result.history) + 1,
                             RunResult(result.state, {}, result.history, result.params),
                             run.setup.rounds)
        if not result.finished:
            raise RuntimeError(f"simulation over {address} stopped after round "
                               f"{len(result.history)} of {run.setup.rounds}")
    finally:
        stop.set()
        if hosting is not None:
            hosting.join(timeout=30.0)
        if pool is not None:
            pool.shutdown(wait=False)
        try:
            _end_workers(procs)
            if network is not None:
                network.close()
            if broker is not None:
                broker.stop()
        finally:
            if scratch is not None:          # whatever stopping the rest raised
                scratch.cleanup()
    info = {"name": "mqtt", "broker": str(address),
            "broker_kind": broker.kind if broker is not None else "external",
            "federation": federation, "max_payload": max_payload, "compression": compression,
            "client_processes": processes, "task_topics": task_topics,
            "run_id": result.run_id, "late": result.stats["late"],
            "duplicates": result.stats["duplicates"], "rejected": result.stats["rejected"],
            "resends": result.stats["resends"]}
    return RunResult(result.state, client_states, result.history, result.params,
                     result.stopped), info


def _fork_workers(processes: int, clients: int, workers: int, make_clients, stall_s: float,
                  address) -> list:
    """Fork `processes` workers, each hosting a contiguous share of the clients
    (sim.hosting.serve_clients). Forked, not spawned: the children share the clients' data
    with this process instead of receiving a copy. Called before this process starts any
    thread of its own for the run. Returns [(process, connection, share size)]."""
    import multiprocessing
    import threading

    from ..transport.netloop import NetworkLoop
    from .hosting import serve_clients

    ctx = multiprocessing.get_context("fork")
    # the training slots of the run, shared out: at most `workers` train at once in all
    slots_each = max(1, -(-workers // processes))
    bounds = [clients * k // processes for k in range(processes + 1)]
    procs = []
    for k in range(processes):
        indices = range(bounds[k], bounds[k + 1])

        def make(stop, indices=indices, k=k):
            loop = NetworkLoop(name=f"edgefl-worker{k}-net")
            pool = ThreadPoolExecutor(max_workers=slots_each, thread_name_prefix="edgefl-train")
            return make_clients(indices, stop, threading.Semaphore(slots_each), loop,
                                pool), loop

        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=serve_clients, args=(make, child_end, stall_s, address),
                           name=f"edgefl-clients-{k}", daemon=True)
        proc.start()
        child_end.close()
        procs.append((proc, parent_end, len(indices)))
    return procs


def _wait_ready(procs: list, clients: int, stop, stall_s: float, address) -> None:
    """Until every worker reports all its clients connected and subscribed. Fails on a
    worker's error, a worker that died, or no progress for `stall_s` seconds."""
    from .hosting import ConnectStopped

    ready = [0] * len(procs)
    progress_at = time.monotonic()
    while sum(ready) < clients:
        if stop.is_set():
            raise ConnectStopped()
        for k, (proc, conn, share) in enumerate(procs):
            done = None
            try:
                while done is None and conn.poll(0):
                    msg = conn.recv()
                    if msg[0] == "ready":
                        if msg[1] > ready[k]:
                            ready[k] = msg[1]
                            progress_at = time.monotonic()
                    elif msg[0] == "done":
                        done = msg
            except (EOFError, OSError):
                raise RuntimeError(f"client worker {k} (pid {proc.pid}) died with exit code "
                                   f"{proc.exitcode} while its clients were connecting") \
                    from None
            if done is not None:
                # raised here, outside the try: the worker's error is most often a
                # TransportError (cannot reach the broker), an OSError, which the except
                # above would have turned into "died", losing the cause
                raise done[2] if done[2] is not None else RuntimeError(
                    f"client worker {k} ended before its clients connected")
        if time.monotonic() - progress_at > stall_s + 5:
            raise TimeoutError(f"simulation clients did not connect to {address}: "
                               f"none became ready for {stall_s:g} s ({sum(ready)} of "
                               f"{clients} were)")
        time.sleep(0.05)


def _collect(procs: list, index: dict, errors: list, timeout: float) -> dict:
    """The workers' last word: each client's state (by client index), and their errors."""
    states: dict = {}
    deadline = time.monotonic() + timeout
    for k, (proc, conn, _share) in enumerate(procs):
        try:
            while conn.poll(max(0.0, deadline - time.monotonic())):
                msg = conn.recv()
                if msg[0] == "done":
                    states.update({index[node]: state for node, state in msg[1].items()})
                    if msg[2] is not None:
                        errors.append(msg[2])
                    break
            else:
                errors.append(TimeoutError(f"client worker {k} did not finish within "
                                           f"{timeout:g} s of the run's end"))
        except (EOFError, OSError):
            errors.append(RuntimeError(f"client worker {k} (pid {proc.pid}) died with exit "
                                       f"code {proc.exitcode}"))
    return states


def _tell_workers(procs: list, what: str) -> None:
    for _proc, conn, _share in procs:
        try:
            conn.send(what)
        except (OSError, ValueError):
            pass                             # that worker is gone already


def _end_workers(procs: list) -> None:
    _tell_workers(procs, "stop")
    for proc, conn, _share in procs:
        proc.join(timeout=15.0)
        if proc.is_alive():
            proc.terminate()                 # its clients stop and close
            proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
        conn.close()
