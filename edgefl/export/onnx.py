"""A LayerTable and its flat float32 buffer as an ONNX graph, built with the `onnx` package.

Graph (opset OPSET, IR IR_VERSION; every tensor float32, batch dimension "batch" dynamic):

    input  (batch, *input_shape)   raw features as the dataset stores them (digits 0..16,
                                   pixels 0..255, a CSV's own units)
      Sub(norm_mean) -> Div(norm_std)          the dataset's normalisation, per channel (images)
                                               or per feature (tabular); left out if identity
      one node per layer-program row:          dense -> Gemm(transB=1), weight (out, in)
                                               conv2d -> Conv(pads, strides), NCHW
                                               maxpool2d -> MaxPool (no padding, floor)
                                               relu -> Relu, flatten -> Flatten(axis=1)
    scores (batch, n_out)          the network's outputs: logits; margins (SVM); predictions
                                   (regression)
    probabilities (batch, K)       classification models, unless softmax=False:
                                     n_out > 1: Softmax(scores)
                                     n_out = 1: [Sigmoid(-s), Sigmoid(s)] (class 1 = s > 0)
                                   For logistic regression these are the model's
                                   probabilities; for the SVM and a linear model used as a
                                   classifier, a monotone squashing of the margins that keeps
                                   the decision, not a calibrated probability.

Normalisation is Sub then Div (not folded into the first layer's weights), because that is the
float32 arithmetic the dataset loader does, so the graph sees bit-identical normalised inputs,
and because a zero-padded convolution cannot absorb a shift.

Metadata (`metadata_props`, all strings; JSON where structured): see METADATA_KEYS.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .. import __version__
from ..checkpoint import model_sha256, read_model
from ..errors import CheckpointError, ExportError
from ..infer import Predictor
from ..io import atomic_write, replace_atomic, temporary_path
from .calibration import CALIBRATION_SAMPLES
from ..models import (
    LOSS_NAMES,
    OP_CONV2D,
    OP_DENSE,
    OP_FLATTEN,
    OP_MAXPOOL2D,
    OP_RELU,
    Model,
)

OPSET = 17        # pinned: onnxruntime >= 1.13 runs it (pyproject asks for >= 1.16)
IR_VERSION = 8    # the IR that goes with opset 17; newer IRs do not load in older runtimes

FORMAT = "edgefl-onnx/1"
# key -> meaning; every exported file carries all of them ("" when unknown).
METADATA_KEYS = {
    "format": "edgefl-onnx/1: the layout this module documents",
    "edgefl_version": "edgefl version that exported the file",
    "model_kind": "models.build_model name (mlp, cnn-mnist, ...)",
    "model_spec": "JSON of the model options the layer table was built from",
    "loss": "softmax-ce | logistic | mse | squared-hinge",
    "task": "classification | regression",
    "decision": "argmax (n_out > 1) | positive-score (one output: class 1 iff score > 0) | none",
    "outputs": "JSON list of the graph's outputs",
    "algorithm": "the FL strategy that trained it (fedavg, mfl, ...)",
    "round": "the federated round of the parameters",
    "dataset": "JSON of the dataset section (name and options)",
    "input_shape": "JSON per-sample input shape, channels first",
    "input_range": "JSON [lo, hi] of raw feature values in the training data",
    "norm_mean": "JSON per-channel/feature mean subtracted in the graph",
    "norm_std": "JSON per-channel/feature std divided by in the graph",
    "class_names": "JSON list, index = class",
    "accuracy": "test accuracy at export (of this graph, via onnxruntime, when the test set "
                "was available; else the run's final C-kernel accuracy)",
    "accuracy_source": "onnxruntime:<n> test samples | run-summary | ''",
    "table_digest": "sha256 of the layer table (params.LayerTable.digest)",
    "params_sha256": "sha256 of the float32 parameter buffer",
    "quantization": "none | int8-static-qdq: <quantization_mode>-<quantization_method>, the "
                    "value `edgefl export --json` reports under the same key",
    "quantization_mode": "none | int8: what --quantize (export.quantize) was given",
    "quantization_method": "none | static-qdq: onnxruntime static quantisation, QDQ format, "
                           "weights int8 symmetric per output channel, activations uint8 "
                           "with MinMax ranges from calibration_samples training samples",
}
MIN_OPSET = 13
QUANTIZATION_NONE = "none"
QUANTIZATION_INT8 = "int8-static-qdq"
# mode (--quantize) -> the quantization / quantization_mode / quantization_method keys, the
# same in an exported file's metadata and in export_run's report
QUANTIZATION_KEYS = {
    None: {"quantization": QUANTIZATION_NONE, "quantization_mode": "none",
           "quantization_method": "none"},
    "int8": {"quantization": QUANTIZATION_INT8, "quantization_mode": "int8",
             "quantization_method": "static-qdq"},
}


# ---------------------------------------------------------------------------------------
# graph
# ---------------------------------------------------------------------------------------

def _norm_arrays(model: Model, norm_mean, norm_std):
    """mean/std as broadcastable float32 initialisers, or None when they are the identity."""
    mean = np.asarray(norm_mean, dtype=np.float32).reshape(-1)
    std = np.asarray(norm_std, dtype=np.float32).reshape(-1)
    shape = tuple(model.input_shape)
    width = shape[0]    # channels of an image, features of a tabular input
    for name, a in (("norm_mean", mean), ("norm_std", std)):
        if a.size not in (1, width):
            raise ExportError(f"{name}: {a.size} values for input shape {shape}; need 1 or "
                              f"{width} (one per {'channel' if len(shape) == 3 else 'feature'})")
        if not np.all(np.isfinite(a)):
            raise ExportError(f"{name}: not finite: {a.tolist()}")
    if np.any(std == 0):
        raise ExportError(f"norm_std: has zeros: {std.tolist()}")
    bshape = (1, -1) + (1,) * (len(shape) - 1)
    if not np.any(mean) and np.all(std == 1):
        return None
    return mean.reshape(bshape), std.reshape(bshape)


def _check_params(model: Model, params) -> np.ndarray:
    if not isinstance(params, np.ndarray) or params.dtype != np.float32 or params.ndim != 1:
        got = f"{params.dtype} {params.shape}" if isinstance(params, np.ndarray) else \
            type(params).__name__
        raise ExportError(f"params: need a flat float32 buffer, got {got}")
    if params.size != model.n_params:
        raise ExportError(f"params: {params.size} values but model {model.kind} has "
                          f"{model.n_params} parameters (layer table {model.table.digest[:12]})")
    for name, view in model.table.views(np.ascontiguousarray(params)).items():
        if not np.all(np.isfinite(view)):
            raise ExportError(f"params: layer {name!r} has non-finite values")
    return np.ascontiguousarray(params)


class _Graph:
    def __init__(self):
        self.nodes, self.inits, self.count = [], [], 0

    def name(self, stem):
        self.count += 1
        return f"{stem}_{self.count}"

    def const(self, name, array):
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op, inputs, output=None, **attrs):
        output = output or self.name(op.lower())
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=output, **attrs))
        return output


def build_graph(model: Model, params: np.ndarray, *, norm_mean, norm_std, softmax: bool = True,
                metadata: dict | None = None, opset: int = OPSET) -> onnx.ModelProto:
    """The ONNX model of `model` with `params` (a flat float32 buffer of model.n_params),
    checked by onnx.checker (full_check). See the module docstring for the layout."""
    params = _check_params(model, params)
    opset = int(opset)
    if not MIN_OPSET <= opset <= onnx.defs.onnx_opset_version():
        raise ExportError(f"opset {opset}: need {MIN_OPSET}..{onnx.defs.onnx_opset_version()} "
                          f"(Softmax over one axis and bias-less Gemm need {MIN_OPSET}; "
                          f"edgefl pins {OPSET})")
    views = model.table.views(params)
    by_offset = {e.offset: e.name for e in model.table.entries}
    g = _Graph()
    batch = "batch"
    shape = tuple(int(d) for d in model.input_shape)
    x = "input"
    rank = 1 + len(shape)
    norm = _norm_arrays(model, norm_mean, norm_std)
    if norm is not None:
        x = g.node("Sub", [x, g.const("norm_mean", norm[0])], "input_centred")
        x = g.node("Div", [x, g.const("norm_std", norm[1])], "input_normalised")

    for i, row in enumerate(model.layers):
        op, in_c, in_h, in_w, _, _, _, k, stride, pad, w_off, b_off = map(int, row)
        if op in (OP_CONV2D, OP_MAXPOOL2D) and rank != 4:
            # a tabular input (d,) runs as (d, 1, 1) in the C core
            x = g.node("Reshape", [x, g.const(g.name("shape"),
                                              np.array([0, in_c, in_h, in_w], np.int64))])
            rank = 4
        if op == OP_DENSE:
            if rank != 2:
                x = g.node("Flatten", [x], axis=1)
                rank = 2
            inputs = [x, by_offset[w_off]]
            if b_off >= 0:
                inputs.append(by_offset[b_off])
            x = g.node("Gemm", inputs, transB=1)
        elif op == OP_CONV2D:
            inputs = [x, by_offset[w_off]] + ([by_offset[b_off]] if b_off >= 0 else [])
            x = g.node("Conv", inputs, kernel_shape=[k, k], strides=[stride, stride],
                       pads=[pad] * 4)
        elif op == OP_MAXPOOL2D:
            x = g.node("MaxPool", [x], kernel_shape=[k, k], strides=[stride, stride])
        elif op == OP_RELU:
            x = g.node("Relu", [x])
        elif op == OP_FLATTEN:
            if rank != 2:
                x = g.node("Flatten", [x], axis=1)
                rank = 2
        else:
            raise ExportError(f"model {model.kind}: layer {i} has op {op}, which has no ONNX "
                              f"mapping (known: dense, conv2d, maxpool2d, relu, flatten)")
    if rank != 2:
        x = g.node("Flatten", [x], axis=1)
    g.nodes.append(helper.make_node("Identity", [x], ["scores"], name="scores"))
    for name, view in views.items():
        g.const(name, view)

    classify = model.num_classes >= 2
    outputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch, model.n_out])]
    if classify and softmax:
        if model.n_out == 1:
            p0 = g.node("Sigmoid", [g.node("Neg", ["scores"])], "probability_0")
            p1 = g.node("Sigmoid", ["scores"], "probability_1")
            g.node("Concat", [p0, p1], "probabilities", axis=1)
        else:
            g.node("Softmax", ["scores"], "probabilities", axis=1)
        width = 2 if model.n_out == 1 else model.n_out
        outputs.append(helper.make_tensor_value_info("probabilities", TensorProto.FLOAT,
                                                     [batch, width]))
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, *shape])]
    graph = helper.make_graph(g.nodes, f"edgefl_{model.kind}", inputs, outputs, g.inits)
    opsets = [helper.make_opsetid("", opset)]
    # the oldest IR that carries this opset (IR_VERSION for OPSET), so older runtimes load it
    proto = helper.make_model(graph, opset_imports=opsets,
                              producer_name="edgefl", producer_version=__version__,
                              ir_version=helper.find_min_ir_version_for(opsets),
                              doc_string=f"edgefl {model.kind}: {model.spec}")
    meta = graph_metadata(model, params, norm_mean=norm_mean, norm_std=norm_std,
                          outputs=[o.name for o in outputs], extra=metadata)
    helper.set_model_props(proto, meta)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(f"model {model.kind}: the generated graph fails onnx.checker: "
                          f"{exc}") from exc
    return proto


def graph_metadata(model: Model, params: np.ndarray, *, norm_mean, norm_std, outputs,
                   extra: dict | None = None) -> dict:
    """The metadata_props of an export: METADATA_KEYS filled from the model and `extra`
    (algorithm, round, dataset, class_names, accuracy, accuracy_source, input_range, ...;
    unknown keys are kept as well). Values are strings; structured ones JSON."""
    extra = dict(extra or {})
    classify = model.num_classes >= 2
    class_names = extra.pop("class_names", None)
    if class_names is None:
        class_names = [str(i) for i in range(model.num_classes)] if classify else []
    class_names = [str(c) for c in class_names]
    if classify and model.n_out == 1 and model.num_classes > 2 and \
            len(class_names) == model.num_classes:
        # one output on a multi-class dataset (linear on +-1 targets): label 1 against the
        # rest, as the C core scores it
        class_names = [f"not {class_names[1]}", class_names[1]]
    elif classify and len(class_names) != model.num_classes:
        raise ExportError(f"metadata class_names: {len(class_names)} names for a model with "
                          f"{model.num_classes} classes")
    meta = {
        "format": FORMAT,
        "edgefl_version": __version__,
        "model_kind": model.kind,
        "model_spec": model.spec,
        "loss": LOSS_NAMES[model.loss],
        "task": "classification" if classify else "regression",
        "decision": ("none" if not classify else
                     "positive-score" if model.n_out == 1 else "argmax"),
        "outputs": json.dumps(list(outputs)),
        "algorithm": "",
        "round": "",
        "dataset": "",
        "input_shape": json.dumps(list(model.input_shape)),
        "input_range": "",
        "norm_mean": json.dumps(np.asarray(norm_mean, np.float32).reshape(-1).tolist()),
        "norm_std": json.dumps(np.asarray(norm_std, np.float32).reshape(-1).tolist()),
        "class_names": json.dumps(class_names),
        "accuracy": "",
        "accuracy_source": "",
        "table_digest": model.table.digest,
        "params_sha256": hashlib.sha256(params.tobytes()).hexdigest(),
        **QUANTIZATION_KEYS[None],
    }
    for key, value in extra.items():
        if value is None:
            continue
        meta[str(key)] = value if isinstance(value, str) else json.dumps(value)
    return meta


def export_onnx(model: Model, params: np.ndarray, path, *, norm_mean, norm_std,
                softmax: bool = True, metadata: dict | None = None,
                opset: int = OPSET) -> onnx.ModelProto:
    """Build the graph (build_graph) and write it to `path` atomically (edgefl.io.atomic_write),
    so a reader (a Predictor watching the path) sees the old file or the new one, never a
    part."""
    proto = build_graph(model, params, norm_mean=norm_mean, norm_std=norm_std, softmax=softmax,
                        metadata=metadata, opset=opset)
    atomic_write(path, proto.SerializeToString())
    return proto


def set_metadata(path, updates: dict) -> None:
    """Rewrite `path` atomically with metadata_props updated from `updates`."""
    proto = onnx.load(os.fspath(path))
    meta = {p.key: p.value for p in proto.metadata_props}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in updates.items()})
    del proto.metadata_props[:]
    helper.set_model_props(proto, meta)
    atomic_write(path, proto.SerializeToString())


# ---------------------------------------------------------------------------------------
# int8
# ---------------------------------------------------------------------------------------

def quantize_int8(src, dst, calibration: np.ndarray, *, batch: int = 64) -> None:
    """Static int8 quantisation of the fp32 export `src` into `dst` (atomic replace) with
    onnxruntime.quantization: QDQ format, weights int8 symmetric per output channel,
    activations uint8 with MinMax ranges from `calibration` (raw inputs, a few hundred
    training samples). Sub/Div (normalisation), Softmax and Sigmoid stay float32.

    Static rather than dynamic, by measurement (`python tools/bench_onnx.py`, the
    onnxruntime-int8-dynamic rows; docs/onnx.md): dynamic quantisation turns Conv into
    ConvInteger and re-quantises activations on every call, which makes cnn-mnist several
    times slower than fp32 in onnxruntime, while QDQ Conv/Gemm pairs fuse into
    QLinearConv/QGemm, faster than fp32 and the fast path on Arm boards too. The price is
    calibration data at export time, which the aggregator has.

    The result carries the metadata QUANTIZATION_KEYS["int8"] and calibration_samples, and
    passes onnx.checker.check_model(full_check=True) like the fp32 export.
    """
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    src, dst = os.fspath(src), os.fspath(dst)
    calibration = np.ascontiguousarray(calibration, dtype=np.float32)
    if calibration.ndim < 2 or calibration.shape[0] == 0:
        raise ExportError(f"quantize int8: calibration data of shape {calibration.shape}: "
                          f"need (n, *input_shape) with n > 0")

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([calibration[i:i + batch]
                                 for i in range(0, len(calibration), batch)])

        def get_next(self):
            chunk = next(self.batches, None)
            return None if chunk is None else {"input": chunk}

    # named as atomic_write's temporaries, which the owner of the directory removes when a
    # kill left them (roles.state.hold_state_dir)
    prepared = tmp = None
    try:
        prepared, tmp = temporary_path(dst), temporary_path(dst)
        # ONNX shape inference only: the graph has nothing for onnxruntime's optimiser to fold,
        # and its optimised output drags in unrelated opset imports
        quant_pre_process(src, prepared, skip_optimization=True, skip_symbolic_shape=True)
        quantize_static(prepared, tmp, Reader(), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=["Conv", "Gemm", "MaxPool", "Relu", "Flatten"],
                        per_channel=True, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax)
        proto = onnx.load(tmp)
    finally:
        # (.data: onnxruntime's external weights file of a model past 2 GB, beside it)
        for leftover in (prepared, tmp) + ((tmp + ".data",) if tmp else ()):
            if leftover and os.path.exists(leftover):
                os.unlink(leftover)
    meta = {p.key: p.value for p in proto.metadata_props}
    meta.update(QUANTIZATION_KEYS["int8"], calibration_samples=str(len(calibration)))
    del proto.metadata_props[:]
    helper.set_model_props(proto, meta)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(f"quantize int8: the quantised graph of {src} fails onnx.checker: "
                          f"{exc}") from exc
    atomic_write(dst, proto.SerializeToString())


# ---------------------------------------------------------------------------------------
# checkpoints and run directories (what `edgefl export` runs)
# ---------------------------------------------------------------------------------------

@dataclass
class Run:
    """A checkpoint with its model rebuilt and checked against the stored layer table."""
    checkpoint: str
    model: Model
    params: np.ndarray
    round: int
    algorithm: str
    norm_mean: np.ndarray
    norm_std: np.ndarray
    class_names: list
    dataset: dict | None = None          # the run's dataset section, when known
    summary: dict | None = None          # summary.json of the same run, when present


def load_run(source) -> Run:
    """A run directory (holding model.npz from `edgefl simulate`) or a model.npz path.

    Read and checked by edgefl.checkpoint.read_model (the model rebuilt from the
    checkpoint's spec, refused unless its stored layer table and buffer size match what that
    spec builds); an export also needs the input normalisation. summary.json next to the
    checkpoint is used (final accuracy, the dataset section) only if its model_sha256 is the
    checkpoint's buffer's."""
    try:
        found = read_model(source)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc
    path, ck, model, params = found.path, found.arrays, found.model, found.params
    for key in ("norm_mean", "norm_std"):
        if key not in ck:
            raise ExportError(f"{path}: checkpoint lacks {key} (the input normalisation the "
                              f"graph must include); it was saved without its dataset")
    summary = None
    summary_path = os.path.join(os.path.dirname(os.path.abspath(path)), "summary.json")
    if os.path.isfile(summary_path):
        try:
            with open(summary_path, encoding="utf-8") as f:
                candidate = json.load(f)
        except (OSError, ValueError):
            candidate = None
        if isinstance(candidate, dict) and candidate.get("model_sha256") == model_sha256(params):
            summary = candidate
    dataset = ck.get("dataset")
    if dataset is not None and not isinstance(dataset, dict):
        dataset = json.loads(str(dataset))
    if dataset is None and summary is not None:
        dataset = summary.get("config", {}).get("dataset")
    strategy = ck.get("strategy") or {}
    num = model.num_classes
    names = ck.get("class_names") or [str(i) for i in range(num)]
    return Run(checkpoint=path, model=model, params=params, round=int(ck.get("round", 0)),
               algorithm=str(strategy.get("name", "")) if isinstance(strategy, dict) else "",
               norm_mean=np.asarray(ck["norm_mean"], np.float32),
               norm_std=np.asarray(ck["norm_std"], np.float32), class_names=list(names),
               dataset=dict(dataset) if dataset else None, summary=summary)


def raw_inputs(dataset, x: np.ndarray) -> np.ndarray:
    """Undo a Dataset's normalisation: raw = x * std + mean (per channel or feature), rounded
    to whole numbers when the dataset stores integers (pixels, digits' 0..16), which
    recovers the stored values exactly."""
    shape = (1, -1) + (1,) * (x.ndim - 2)
    raw = x * dataset.norm_std.reshape(shape) + dataset.norm_mean.reshape(shape)
    lo, hi = dataset.raw_range
    if float(lo).is_integer() and float(hi).is_integer():
        rounded = np.rint(raw)
        if np.max(np.abs(raw - rounded), initial=0.0) < 1e-2:
            raw = rounded
    return np.ascontiguousarray(raw, dtype=np.float32)


def onnx_accuracy(path, x_raw: np.ndarray, y: np.ndarray, *, batch: int = 256) -> float:
    """Share of `y` that onnxruntime's classes for `x_raw` (raw inputs) get right."""
    predictor = Predictor(path, threads=1, check_interval=None)
    hits = 0
    for i in range(0, len(x_raw), batch):
        classes, _ = predictor.predict(x_raw[i:i + batch])
        hits += int(np.sum(classes == y[i:i + batch]))
    return hits / len(x_raw)


def export_checkpoint(source, out, *, quantize: str | None = None, softmax: bool = True,
                      evaluate: bool = True,
                      calibration_samples: int = CALIBRATION_SAMPLES, dataset=None) -> dict:
    """Export a run directory or model.npz to `out` (ONNX), optionally int8-quantised.

    The test set of the run's dataset (when it loads) gives the fp32 graph's accuracy via
    onnxruntime, recorded in the metadata; with quantize="int8" the calibration data are the
    first `calibration_samples` training samples, and the report holds both accuracies.
    Returns {out, model, n_params, round, algorithm, quantization, quantization_mode,
    quantization_method (the values the file's metadata holds under the same keys),
    accuracy_fp32, accuracy_int8, ...}. `dataset`: the run's dataset when the caller holds
    it (the end of a training run), so it is not loaded again."""
    if quantize not in (None, "int8"):
        raise ExportError(f"export: --quantize {quantize!r}; valid: int8")
    return export_run(load_run(source), out, quantize=quantize, softmax=softmax,
                      evaluate=evaluate, calibration_samples=calibration_samples,
                      dataset=dataset)


def run_from_params(model: Model, params: np.ndarray, *, round: int, algorithm: str,
                    dataset, dataset_config: dict | None = None,
                    checkpoint: str = "<in memory>") -> Run:
    """A Run of live parameters (a round of `edgefl simulate` or `edgefl aggregator`, no
    model.npz written): the normalisation and class names come from the loaded `dataset`."""
    return Run(checkpoint=checkpoint, model=model,
               params=_check_params(model, np.asarray(params)), round=int(round),
               algorithm=algorithm, norm_mean=np.asarray(dataset.norm_mean, np.float32),
               norm_std=np.asarray(dataset.norm_std, np.float32),
               class_names=list(dataset.class_names) or [str(i) for i in
                                                         range(model.num_classes)],
               dataset=dict(dataset_config) if dataset_config else None)


def export_run(run: Run, out, *, quantize: str | None = None, softmax: bool = True,
               evaluate: bool = True, calibration_samples: int = CALIBRATION_SAMPLES,
               dataset=None) -> dict:
    """Export a Run (load_run, run_from_params) to `out` by one atomic replace; what
    export_checkpoint does after loading. `dataset`: the run's dataset already loaded (a
    process that trains has it; the periodic export of a run then reloads nothing); None
    loads it from the run's dataset section when evaluating or quantising."""
    if quantize not in (None, "int8"):
        raise ExportError(f"export: quantize {quantize!r}; valid: int8")
    model = run.model
    classify = model.num_classes >= 2
    why_no_data = ""
    if dataset is not None:
        if tuple(dataset.input_shape) != tuple(model.input_shape):
            raise ExportError(f"export: dataset {dataset.name!r} has input shape "
                              f"{dataset.input_shape}, the model {model.input_shape}")
    elif run.dataset and (evaluate or quantize):
        from ..data import load_dataset

        options = dict(run.dataset)
        name = options.pop("name", None)
        try:
            dataset = load_dataset(name, **options)
        except (ValueError, OSError, ImportError) as exc:
            why_no_data = f"dataset {name!r} did not load ({exc})"
        else:
            if tuple(dataset.input_shape) != tuple(model.input_shape):
                why_no_data = (f"dataset {name!r} has input shape {dataset.input_shape}, the "
                               f"model {model.input_shape}")
                dataset = None
    elif not run.dataset and (evaluate or quantize):
        why_no_data = ("the checkpoint does not name its dataset and there is no summary.json "
                       "of the same run next to it")
    if quantize and dataset is None:
        raise ExportError(f"export --quantize int8: needs calibration and test data, but "
                          f"{why_no_data}")
    report = {"out": os.fspath(out), "checkpoint": run.checkpoint, "model": model.kind,
              "n_params": model.n_params, "round": run.round, "algorithm": run.algorithm,
              "table_digest": model.table.digest, **QUANTIZATION_KEYS[quantize],
              "accuracy_fp32": None, "accuracy_int8": None, "test_samples": 0,
              "bytes_fp32": None,
              "note": why_no_data if dataset is None else ""}
    meta = {"algorithm": run.algorithm, "round": str(run.round),
            "dataset": json.dumps(run.dataset, sort_keys=True) if run.dataset else "",
            "class_names": run.class_names if classify else None}
    if dataset is not None:
        meta["input_range"] = list(dataset.raw_range)
    elif run.summary and run.summary.get("final_accuracy") is not None:
        meta["accuracy"] = str(run.summary["final_accuracy"])
        meta["accuracy_source"] = "run-summary"
        report["accuracy_fp32"] = run.summary["final_accuracy"]

    # Build, measure and annotate in temporaries next to `out`; then one atomic replace, so
    # a Predictor watching `out` sees only the finished file.
    out = os.fspath(out)
    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory):
        # said before the temporaries' names could stand in for `out` in the error
        raise ExportError(f"{out}: no directory {directory} to write it in")
    # named as atomic_write's temporaries, which the owner of the directory (the aggregator
    # service's run directories) removes when a kill left them (roles.state.hold_state_dir)
    fp32_path = int8_path = None
    try:
        fp32_path = temporary_path(out)
        int8_path = temporary_path(out) if quantize else None
        export_onnx(model, run.params, fp32_path, norm_mean=run.norm_mean,
                    norm_std=run.norm_std, softmax=softmax, metadata=meta)
        if dataset is not None and classify and (evaluate or quantize):
            x_test, y_test = raw_inputs(dataset, dataset.x_test), dataset.y_test
            if model.n_out == 1:   # positive-score models predict "label 1" or not
                y_test = (y_test == 1).astype(np.int64)
            report["test_samples"] = len(x_test)
            report["accuracy_fp32"] = onnx_accuracy(fp32_path, x_test, y_test)
            set_metadata(fp32_path, {"accuracy": repr(report["accuracy_fp32"]),
                                     "accuracy_source": f"onnxruntime:{len(x_test)}"})
        final = fp32_path
        if quantize:
            report["bytes_fp32"] = os.path.getsize(fp32_path)
            calibration = raw_inputs(dataset, dataset.first_train(calibration_samples))
            quantize_int8(fp32_path, int8_path, calibration)
            if classify:
                report["accuracy_int8"] = onnx_accuracy(int8_path, x_test, y_test)
                set_metadata(int8_path, {"accuracy": repr(report["accuracy_int8"]),
                                         "accuracy_source": f"onnxruntime:{len(x_test)}",
                                         "accuracy_fp32": repr(report["accuracy_fp32"])})
            final = int8_path
        replace_atomic(final, out)
    finally:
        for leftover in (fp32_path, int8_path):
            if leftover and os.path.exists(leftover):
                os.unlink(leftover)
    report["bytes"] = os.path.getsize(out)
    return report


# ---------------------------------------------------------------------------------------
# publishing (Aggregator.publish_onnx, roles/onnx_channel.py; issue #5 item 4)
# ---------------------------------------------------------------------------------------

def model_payload(path) -> tuple[bytes, dict]:
    """(file bytes, metadata) of an exported model, ready to publish retained on the
    `edgefl/<fed>/onnx` topic: the metadata is the file's metadata_props plus `sha256` and
    `bytes` of the payload, which the receiver checks before installing it
    (edgefl.infer.install_model). The file is read once, so the digest matches the bytes."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        proto = onnx.load_from_string(data)
    except Exception as exc:   # protobuf DecodeError
        raise ExportError(f"{path}: not an ONNX model ({type(exc).__name__}: {exc})") from exc
    meta = {p.key: p.value for p in proto.metadata_props}
    if meta.get("format") != FORMAT:
        raise ExportError(f"{path}: not an edgefl export (metadata format "
                          f"{meta.get('format')!r}, expected {FORMAT!r})")
    meta.update(sha256=hashlib.sha256(data).hexdigest(), bytes=str(len(data)))
    return data, meta
