"""A trained model on disk: `model.npz`, and the hash that names a model.

`save_checkpoint` writes what a finished run (`edgefl simulate`, `edgefl aggregator`) or an
exported one leaves: the global float32 buffer, its layer table and model spec, the round,
the strategy with its hyperparameters and state, and the data set's input normalisation and
class names, so `edgefl export` can rebuild the model and its ONNX graph from the file alone.
No pickles: strings are NumPy unicode scalars holding JSON, so
`np.load(path, allow_pickle=False)` reads it. `load_checkpoint` is the inverse.

`read_model` finds and checks one: a run directory (its model.npz) or a model.npz path, the
model rebuilt from its spec and refused unless it has the stored layer table and a buffer of
that size. What reads an earlier run's model reads it so: `edgefl export`
(edgefl.export.load_run) and a run that starts from it (`model.init`, edgefl.runs.prepare).

`model_sha256` is the sha256 of a model's float32 bytes: equal hashes are equal models,
the check that a run is the same in process, over loopback and over MQTT.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from .errors import CheckpointError
from .io import atomic_write, jsonable
from .models import Model, build_model
from .params import LayerTable

__all__ = ["CheckpointError", "ModelFile", "load_checkpoint", "model_sha256", "read_model",
           "save_checkpoint"]


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


@dataclass
class ModelFile:
    """A checkpoint read and checked by `read_model`."""
    path: str                 # the model.npz
    arrays: dict              # load_checkpoint's: the arrays, JSON fields decoded
    model: Model              # rebuilt from the stored spec; its table is the stored one
    params: np.ndarray        # float32, contiguous, model.n_params values


def read_model(source) -> ModelFile:
    """A run directory (holding model.npz from `edgefl simulate`) or a model.npz path, read
    and checked: the model is rebuilt from the checkpoint's spec, and a checkpoint whose
    stored layer table (or buffer) does not match what that spec builds is refused.
    CheckpointError names the file and what is wrong."""
    source = os.fspath(source)
    path = os.path.join(source, "model.npz") if os.path.isdir(source) else source
    if not os.path.exists(path):
        where = f"run directory {source} has no model.npz" if os.path.isdir(source) else \
            f"{source} does not exist"
        raise CheckpointError(f"{where} (expected a run directory from `edgefl simulate` or "
                              f"its model.npz)")
    try:
        ck = load_checkpoint(path)
    except Exception as exc:   # zipfile.BadZipFile, KeyError, JSONDecodeError, OSError, ...
        raise CheckpointError(f"{path}: not a readable edgefl checkpoint "
                              f"({type(exc).__name__}: {exc})") from exc
    missing = [k for k in ("params", "table", "model_spec", "input_shape", "num_classes")
               if k not in ck]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {', '.join(missing)}")
    spec = ck["model_spec"]
    # the file is anyone's: a field of the wrong type is named, not a TypeError traceback
    if not isinstance(spec, dict):
        raise CheckpointError(f"{path}: model_spec must be a JSON object (the model config), "
                              f"got {json.dumps(spec)[:200]}")
    shape, classes = ck["input_shape"], ck["num_classes"]
    if shape.ndim != 1 or shape.dtype.kind not in "iu":
        raise CheckpointError(f"{path}: input_shape must be a list of integers, got "
                              f"{shape.dtype} of shape {shape.shape}")
    if classes.ndim != 0 or classes.dtype.kind not in "iu":
        raise CheckpointError(f"{path}: num_classes must be one integer, got {classes.dtype} "
                              f"of shape {classes.shape}")
    try:
        model = build_model(spec, tuple(int(d) for d in shape), int(classes))
    except ValueError as exc:
        raise CheckpointError(f"{path}: model_spec {json.dumps(spec)} does not build: "
                              f"{exc}") from exc
    table = ck["table"]
    if table.digest != model.table.digest:
        raise CheckpointError(
            f"{path}: the checkpoint's layer table (digest {table.digest[:12]}, {len(table)} "
            f"entries, {table.size} parameters) does not match the table its model config "
            f"{json.dumps(spec)} builds (digest {model.table.digest[:12]}, {len(model.table)} "
            f"entries, {model.n_params} parameters)")
    params = np.ascontiguousarray(ck["params"])
    if params.dtype != np.float32 or params.ndim != 1 or params.size != model.n_params:
        raise CheckpointError(f"{path}: params is {params.dtype} {params.shape} but layer "
                              f"table {model.table.digest[:12]} needs float32 "
                              f"({model.n_params},)")
    finite = np.isfinite(params)
    if not finite.all():
        # a diverged run's model: as round 0 every board's training would diverge at once
        first = next(name for name, view in model.table.views(params).items()
                     if not np.isfinite(view).all())
        raise CheckpointError(f"{path}: {params.size - int(finite.sum())} of the "
                              f"{params.size} parameters are not finite (NaN or infinite; "
                              f"the first in layer {first!r}): a diverged model")
    return ModelFile(path=path, arrays=ck, model=model, params=params)
