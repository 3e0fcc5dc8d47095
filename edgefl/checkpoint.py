"""A trained model on disk: `model.npz`, and the hash that names a model.

`save_checkpoint` writes what a finished run (`edgefl simulate`, `edgefl aggregator`) or an
exported one leaves: the global float32 buffer, its layer table and model spec, the round,
the strategy with its hyperparameters and state, and the data set's input normalisation and
class names, so `edgefl export` can rebuild the model and its ONNX graph from the file alone.
No pickles: strings are NumPy unicode scalars holding JSON, so
`np.load(path, allow_pickle=False)` reads it. `load_checkpoint` is the inverse.

`model_sha256` is the sha256 of a model's float32 bytes: equal hashes are equal models,
the check that a run is the same in process, over loopback and over MQTT.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from .io import atomic_write, jsonable
from .params import LayerTable

__all__ = ["load_checkpoint", "model_sha256", "save_checkpoint"]


def model_sha256(params: np.ndarray) -> str:
    """sha256 of the float32 buffer's bytes."""
    return hashlib.sha256(np.ascontiguousarray(params, dtype=np.float32).tobytes()).hexdigest()


def save_checkpoint(path: str, model, strategy, result, dataset=None,
                    dataset_config=None) -> None:
    """model.npz of `model` (a models.Model) trained by `strategy` (a Strategy), written
    atomically. `result` carries the run's `params` (the global buffer), `history` (one
    record per round: the last one's round is stored) and `state` (the server State: its
    buffers and meta are stored). dataset: the run's Dataset, for the input normalisation
    and class names; dataset_config: the run's dataset section, so an export can reload the
    test data."""
    arrays = {
        "params": np.asarray(result.params),
        "table": np.array(json.dumps(model.table.to_json())),
        "model_spec": np.array(model.spec),
        "input_shape": np.array(model.input_shape, dtype=np.int64),
        "num_classes": np.array(model.num_classes, dtype=np.int64),
        "round": np.array(result.history[-1]["round"] if result.history else 0, dtype=np.int64),
        "strategy": np.array(json.dumps({"name": strategy.name, **strategy.hyperparameters()})),
        "state_meta": np.array(json.dumps(jsonable(dict(result.state.meta)))),
    }
    for name, buf in result.state.buffers.items():
        arrays[f"state.{name}"] = np.asarray(buf)
    if dataset is not None:
        arrays["norm_mean"] = np.asarray(dataset.norm_mean)
        arrays["norm_std"] = np.asarray(dataset.norm_std)
        arrays["class_names"] = np.array(json.dumps(list(dataset.class_names)))
    if dataset_config is not None:
        arrays["dataset"] = np.array(json.dumps(jsonable(dict(dataset_config))))
    atomic_write(path, lambda f: np.savez(f, **arrays))


def load_checkpoint(path: str) -> dict:
    """The arrays of a model.npz with its JSON fields decoded (table as a LayerTable)."""
    with np.load(path, allow_pickle=False) as z:
        out = {k: z[k] for k in z.files}
    for key in ("table", "strategy", "state_meta", "class_names", "model_spec", "dataset"):
        if key in out:
            out[key] = json.loads(str(out[key]))
    out["table"] = LayerTable.from_json(out["table"])
    out["round"] = int(out["round"])
    return out
