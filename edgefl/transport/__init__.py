"""Transport: how the aggregator and clients reach each other (docs/protocol.md).

topics.py builds and parses every MQTT topic; wire/ encodes, checks, chunks and reassembles
the binary frames that carry models and updates (byte layout in docs/protocol.md).
"""
