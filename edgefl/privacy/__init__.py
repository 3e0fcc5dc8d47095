"""Privacy of what leaves a board: secure aggregation (SecAgg+) and differential privacy.

The round engine (`edgefl.rounds`) calls into this package; nothing here knows about
transports or roles.
"""
