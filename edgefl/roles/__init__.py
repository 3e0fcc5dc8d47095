"""The two roles of a federation over MQTT: the aggregator (the only round loop) and the
client (train when tasked, upload, never train a round twice), plus the aggregator service
that queues and steers runs, and what they persist.

    aggregator.py    Aggregator(plan, transport, state_dir, settings).run(): one run's rounds
    client.py        Client(settings, (x, y), transport, state_dir).run()
    daemon.py        Daemon(DaemonSettings(...), state_dir, transport_factory).run(): the
                     `edgefl aggregator` service: a run queue on disk, one run at a time,
                     operator commands on the control topic (docs/orchestration.md)
    control.py       the control topic's commands, their checks and replies; RunControl
                     (pause/stop of the active run); ControlClient (`edgefl ctl`)
    onnx_channel.py  the exported ONNX model over MQTT: retained parts and manifest
                     (published by the aggregator, installed by OnnxReceiver on a client)
    messages.py      the JSON documents: round announcement, status, update scalars
    state.py         atomic persistence: the aggregator's checkpoint and journal, a client's
                     progress

Roles talk to a `Transport` (edgefl.transport: MQTT through paho, or the in-process
loopback) and never import paho; `edgefl.sim` and `edgefl.cli` build the transports, load
configs and data, and write the run's outputs.
"""
from .aggregator import (Aggregator, AggregatorResult, AggregatorSettings, RunPlan,
                         default_client_ids)
from .client import Client, ClientSettings
from .messages import MessageError
from .state import AggregatorCheckpoint, ClientProgress, StateError

__all__ = ["Aggregator", "AggregatorResult", "AggregatorSettings", "RunPlan", "Client",
           "ClientSettings", "AggregatorCheckpoint", "ClientProgress", "StateError",
           "MessageError", "default_client_ids"]
