"""The two roles of a federation over MQTT: the aggregator (the only round loop) and the
client (train when tasked, upload, never train a round twice), plus what they persist.

    aggregator.py  Aggregator(plan, transport, state_dir, settings).run()
    client.py      Client(settings, (x, y), transport, state_dir).run()
    messages.py    the JSON documents: round announcement, status, update scalars
    state.py       atomic persistence: the aggregator's checkpoint and journal, a client's
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
