"""A run of a RunConfig, whoever runs its rounds: its preparation (`prepare`: data, split,
model, initial buffer, the strategy after its offline phase) and what it leaves on disk
(`outputs`: summary.json, model.npz, model.onnx, curves.png, the periodic ONNX exports).
`edgefl simulate` (edgefl.sim) and the aggregator role (edgefl.roles.runner) both use it, so
the two write the same files from the same preparation.
"""
