"""The same rounds as `run_federation`, through an MQTT broker: `run_over_broker` runs the
real roles (edgefl.roles: the aggregator and one client per shard, each with its own
connection) as threads of this process, sharing one network thread. What
`edgefl simulate --transport mqtt` runs; the final model equals the in-process one bit for
bit when compression is "none".
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from ..runs.prepare import PreparedRun, RunResult

__all__ = ["run_over_broker"]

CONNECTING = 64        # clients connecting and subscribing at once (run_over_broker)


class _ReadyWaiter:
    """Waits until fewer than n of the client roles started so far are not yet ready
    (connected and subscribed). Fails when one raised, or when none became ready for
    `stall_s` seconds: a fleet of any size connects as long as it keeps making progress."""

    def __init__(self, roles: list, errors: list, stop, stall_s: float, address):
        self.roles, self.errors, self.stop = roles, errors, stop
        self.stall_s, self.address = stall_s, address
        self.ready = 0                 # roles[:ready] are all ready
        self.progress_at = time.monotonic()
        self.last_waiting = 0

    def wait_below(self, n: int) -> None:
        while True:
            while self.ready < len(self.roles) and self.roles[self.ready].ready.is_set():
                self.ready += 1
                self.progress_at = time.monotonic()
            waiting = [r for r in self.roles[self.ready:] if not r.ready.is_set()]
            if len(waiting) < self.last_waiting:
                self.progress_at = time.monotonic()
            self.last_waiting = len(waiting)
            if len(waiting) < n:
                return
            if self.errors:
                self.stop.set()
                raise self.errors[0]
            if time.monotonic() - self.progress_at > self.stall_s:
                self.stop.set()
                raise TimeoutError(f"simulation clients did not connect to {self.address}: "
                                   f"none became ready for {self.stall_s:g} s "
                                   f"({self.ready} of {len(self.roles)} started were)")
            waiting[0].ready.wait(0.05)


def run_over_broker(run: "PreparedRun", url: str | None = None, *, broker_kind: str = "auto",
                    workers: int | None = None, on_round: Callable[[dict], None] | None = None,
                    on_model: Callable[[int, np.ndarray], None] | None = None,
                    max_payload: int = 128 * 1024, compression: str = "none",
                    round_timeout_s: float = 120.0, federation: str | None = None,
                    state_dir: str | None = None, connect_timeout: float = 30.0,
                    stop=None):
    """Run `run` through an MQTT broker: the aggregator role in this thread and one client
    role per shard in its own thread, each with its own MQTT connection, as a fleet would
    (edgefl.roles). url: the broker (None: an EmbeddedBroker of `broker_kind` for the run).
    At most `workers` clients train at once. Returns (RunResult, a description of the
    transport for the summary). The final model equals run_federation's bit for bit when
    compression is "none".

    `stop`: a kernels.StopFlag shared by every role (None: one of its own). Set by a
    signal, the clients' local rounds stop before their next step, the aggregator abandons
    the open round, and RunStopped is raised with the rounds aggregated. It is set when the
    run ends in any case: that is how the role threads are told to finish."""
    import tempfile
    import threading

    from ..roles.asynchronous import aggregator_class
    from ..roles import (AggregatorSettings, Client, ClientSettings, RunPlan,
                        default_client_ids)
    from ..roles.aggregator import secure_plan
    from ..transport.broker import EmbeddedBroker, packet_bytes_for
    from ..transport.mqtt import MqttTransport, parse_broker_url
    from ..transport.netloop import NetworkLoop

    config = run.config
    federation = federation or f"sim-{os.urandom(4).hex()}"   # fresh topics: no leftovers
    ids = default_client_ids(len(run.setup.clients))
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if url is not None:
        parse_broker_url(url)                      # a bad URL fails before anything starts
    from ..errors import RunStopped
    from ..kernels import StopFlag

    stop = StopFlag() if stop is None else stop     # the clients' kernels read its word
    slots = threading.Semaphore(max(1, workers))
    errors: list = []
    broker, scratch, roles, threads = None, None, [], []
    # One network thread for every role's connection instead of one each: eleven roles of
    # one process otherwise wake two threads per message (docs/scaling.md).
    network = NetworkLoop(name=f"edgefl-{federation}-net")
    try:
        if url is None:
            broker = EmbeddedBroker(kind=broker_kind,
                                    max_packet_bytes=packet_bytes_for(max_payload)).start()
            url = broker.url
        address = parse_broker_url(url)
        if state_dir is None:
            # The roles' state (client progress, checkpoints, journal) is thrown away with
            # the run, so its fsyncs protect nothing: in memory when the machine has a
            # tmpfs, where an fsync returns at once (on this machine's virtual disk each
            # was a cache flush, and every tasked client makes one a round).
            shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
                else None
            scratch = tempfile.TemporaryDirectory(prefix="edgefl-sim-", dir=shm)
        root = scratch.name if scratch is not None else state_dir

        def transport(node):
            return MqttTransport(url, f"edgefl-{federation}-{node}", clean_session=True,
                                 keepalive=keepalive,
                                 connect_timeout=wait_s, reconnect_min=0.1,
                                 reconnect_max=2.0, network_loop=network)

        # An idle client role wakes every poll_s (messages and finished training wake it at
        # once; the poll only bounds how soon it sees `stop`). 10,000 of them at 0.25 s were
        # 40,000 wake-ups a second, which starved the network loop until the broker dropped
        # every connection for a missed keepalive: the fleet's wake-ups are kept near 400/s.
        poll_s = min(5.0, max(0.25, len(ids) / 400))
        # Every role is a thread of this process: a keepalive only guards against a busy
        # interpreter missing it (10,000 clients' pings, every 30 s, did), not against a
        # peer gone silently
        keepalive = max(30, len(ids) // 20)
        # and a SUBACK, through a broker and a network loop each serving thousands, can take
        # longer than a board's 30 s (10,000 clients: it did, past 5,000 connected)
        wait_s = max(connect_timeout, len(ids) / 50)
        waiter = _ReadyWaiter(roles, errors, stop, connect_timeout, address)
        for c, node in enumerate(ids):
            data = run.clients[c]
            role = Client(ClientSettings(node, federation, max_payload=max_payload,
                                         compression=compression, exit_when_finished=True,
                                         raise_on_error=True, poll_s=poll_s),
                          (data.x, data.y), transport(node), os.path.join(root, node),
                          stop=stop, train_slots=slots)

            def body(role=role):
                try:
                    role.run()
                except BaseException as exc:       # noqa: BLE001 -- re-raised below
                    errors.append(exc)
                    stop.set()

            thread = threading.Thread(target=body, name=f"edgefl-{node}", daemon=True)
            # In waves: at most CONNECTING clients between start and subscribed. Thousands
            # of threads connecting at once starve each other and the network loop of the
            # interpreter lock (10,000 at once: 50 s only to start the threads, keepalives
            # missed) and overflow the broker's listen backlog.
            waiter.wait_below(CONNECTING)
            thread.start()
            roles.append(role)
            threads.append(thread)
        waiter.wait_below(1)
        plan = RunPlan(run.strategy, run.init_params, run.setup, run.model,
                       config.clients_per_round, ids,
                       test=(run.dataset.x_test, run.dataset.y_test),
                       eval_every=config.eval_every, description=config.to_dict(),
                       hooks=run.hooks, **secure_plan(run))
        settings = AggregatorSettings(federation=federation, round_timeout_s=round_timeout_s,
                                      max_payload=max_payload, compression=compression)
        def after_round(record, history):
            if on_round is not None:
                on_round(record)
            if on_model is not None:
                on_model(record["round"], aggregator.plan.strategy.global_model(
                    aggregator.ckpt.state))

        aggregator = aggregator_class(plan)(plan, transport("aggregator"), os.path.join(root, "aggregator"),
                                settings, stop=stop, on_round=after_round)
        result = aggregator.run()
        for thread in threads:
            thread.join(timeout=30.0)
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
        for thread in threads:
            thread.join(timeout=10.0)
        network.close()
        if broker is not None:
            broker.stop()
        if scratch is not None:
            scratch.cleanup()
    client_states = {c: role.client_state for c, role in enumerate(roles)}
    info = {"name": "mqtt", "broker": str(address),
            "broker_kind": broker.kind if broker is not None else "external",
            "federation": federation, "max_payload": max_payload, "compression": compression,
            "run_id": result.run_id, "late": result.stats["late"],
            "duplicates": result.stats["duplicates"], "rejected": result.stats["rejected"],
            "resends": result.stats["resends"]}
    return RunResult(result.state, client_states, result.history, result.params,
                     result.stopped), info
