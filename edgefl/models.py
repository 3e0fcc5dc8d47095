"""The model zoo: architectures as layer programs over one LayerTable.

A `Model` is what the kernels run: an int64 layer program (one row per layer, the C core's
`ef_layer`), a loss, an optional L2 term, and the LayerTable naming the parameter slices. It
holds no parameters; a parameter vector is a flat float32 buffer of `model.n_params`.

Kinds: linear (regression), logreg (binary), softmax, svm (squared hinge + L2: the MFL
paper's Table 2 SVM with the hinge squared, so that it is smooth), mlp (hidden sizes), cnn
(a conv stack from config) and the presets cnn-mnist (FedAvg paper), cnn-cifar (the CIFAR CNN
of the FedUmf paper's Appendix A) and lenet-cifar (the CNN of FedMR's §5.1 as its authors'
code defines it, `CNNCifar`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from math import prod, sqrt

import numpy as np

from .errors import KernelError
from .params import LayerTable

# layer program columns (must match ef_layer in csrc/edgefl.h)
OP_DENSE, OP_CONV2D, OP_MAXPOOL2D, OP_RELU, OP_FLATTEN = 1, 2, 3, 4, 5
LOSS_SOFTMAX_CE, LOSS_LOGISTIC, LOSS_MSE, LOSS_SQHINGE = 1, 2, 3, 4
LOSS_NAMES = {LOSS_SOFTMAX_CE: "softmax-ce", LOSS_LOGISTIC: "logistic", LOSS_MSE: "mse",
              LOSS_SQHINGE: "squared-hinge"}
COLUMNS = ("op", "in_c", "in_h", "in_w", "out_c", "out_h", "out_w", "k", "stride", "pad",
           "w_off", "b_off")


@dataclass(frozen=True)
class Model:
    kind: str
    spec: str                 # canonical JSON of the options it was built from
    input_shape: tuple        # per sample, channels first
    num_classes: int          # 0 for regression
    n_out: int
    loss: int
    l2: float
    layers: np.ndarray        # int64 (L, 12) layer program, read-only
    table: LayerTable
    units: tuple              # FedMR recombination units: tuples of table entry names per layer

    @property
    def n_params(self) -> int:
        return self.table.size

    @property
    def in_size(self) -> int:
        return prod(self.input_shape)

    def init(self, seed: int = 0, zero: bool = False) -> np.ndarray:
        """A fresh parameter buffer: PyTorch's default initialisation (weights and biases
        ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), i.e. kaiming_uniform(a=sqrt(5))), seeded; or zeros."""
        buf = self.table.zeros()
        if zero:
            return buf
        rng = np.random.default_rng(seed)
        for row in self.layers:
            op, w_off, b_off = int(row[0]), int(row[10]), int(row[11])
            if op == OP_DENSE:
                fan_in, n_w = int(row[1] * row[2] * row[3]), int(row[1] * row[2] * row[3] * row[4])
            elif op == OP_CONV2D:
                fan_in = int(row[1] * row[7] * row[7])
                n_w = int(row[4]) * fan_in
            else:
                continue
            bound = 1.0 / sqrt(fan_in)
            buf[w_off:w_off + n_w] = rng.uniform(-bound, bound, n_w)
            if b_off >= 0:
                buf[b_off:b_off + int(row[4])] = rng.uniform(-bound, bound, int(row[4]))
        return buf

    def describe(self) -> str:
        lines = [f"{self.kind}: input {self.input_shape}, {self.n_params:,} parameters, "
                 f"loss {LOSS_NAMES[self.loss]}" + (f", l2 {self.l2}" if self.l2 else "")]
        for e in self.table.entries:
            lines.append(f"  {e.name:<16} {str(e.shape):<20} @ {e.offset}")
        return "\n".join(lines)


# What the kernels index (csrc/net.c, check_net, which refuses a table past these with a
# general message; the builder names the layer): a per-sample activation and a conv's padded
# side or GEMM depth (in_c * k * k) within int32, a conv's per-sample scratch (its padded
# input, and its columns with the output block) within 2^40 floats, and a max pool's input
# within int32 over a chunk of 128 samples (its argmax is int32 over the chunk).
MAX_VALUES = 2 ** 31 - 1
MAX_CONV_SCRATCH = 2 ** 40
KERNEL_CHUNK = 128      # the C core's EF_MAX_CHUNK (_core.MAX_CHUNK; a test keeps them equal)


class _Builder:
    """Appends layers, tracking the activation shape and laying out parameters."""

    def __init__(self, input_shape):
        shape = tuple(int(d) for d in input_shape)
        if len(shape) == 1:
            shape = (shape[0], 1, 1)
        if len(shape) != 3 or min(shape) <= 0:
            raise KernelError(f"model: input_shape {tuple(input_shape)} must be (features,) or (C, H, W)")
        if prod(shape) > MAX_VALUES:
            raise KernelError(f"model: input_shape {tuple(input_shape)} has {prod(shape)} values "
                              f"per sample; the kernels take at most 2^31 - 1")
        self.shape = shape
        self.rows, self.entries, self.units = [], [], []
        self.n_params = 0
        self.counts = {}

    def _param(self, name, shape):
        off = self.n_params
        self.entries.append((name, tuple(shape), off))
        self.n_params += prod(shape)
        return off

    def _name(self, prefix):
        self.counts[prefix] = self.counts.get(prefix, 0) + 1
        return f"{prefix}{self.counts[prefix]}"

    def _check_output(self, where, out_shape):
        if prod(out_shape) > MAX_VALUES:
            raise KernelError(f"{where}: output {tuple(out_shape)} has {prod(out_shape)} values "
                              f"per sample; the kernels take at most 2^31 - 1")

    def _row(self, op, out_shape, k=0, stride=0, pad=0, w_off=-1, b_off=-1):
        c, h, w = self.shape
        oc, oh, ow = out_shape
        name = {OP_DENSE: "dense", OP_CONV2D: "conv", OP_MAXPOOL2D: "maxpool", OP_RELU: "relu",
                OP_FLATTEN: "flatten"}[op]
        self._check_output(f"model: layer {len(self.rows)} ({name}) on input {self.shape}",
                           out_shape)
        self.rows.append([op, c, h, w, oc, oh, ow, k, stride, pad, w_off, b_off])
        self.shape = tuple(out_shape)

    def dense(self, out, bias=True):
        if self.shape[1:] != (1, 1):
            self.flatten()
        name = self._name("fc")
        fan_in = self.shape[0]
        w = self._param(f"{name}.weight", (out, fan_in))
        b = self._param(f"{name}.bias", (out,)) if bias else -1
        self.units.append((f"{name}.weight",) + ((f"{name}.bias",) if bias else ()))
        self._row(OP_DENSE, (out, 1, 1), w_off=w, b_off=b)

    def conv(self, out, k, stride=1, pad=0, bias=True):
        c, h, w_ = self.shape
        oh, ow = (h + 2 * pad - k) // stride + 1, (w_ + 2 * pad - k) // stride + 1
        if oh <= 0 or ow <= 0:
            raise KernelError(f"model: conv k={k} pad={pad} does not fit input {self.shape}")
        where = f"model: conv k={k} stride={stride} pad={pad} on input {self.shape}"
        ph, pw = h + 2 * pad, w_ + 2 * pad
        if max(ph, pw) > MAX_VALUES:
            raise KernelError(f"{where}: padded input {ph} x {pw} passes the kernels' int32 "
                              f"sides (2^31 - 1)")
        self._check_output(where, (out, oh, ow))
        depth = c * k * k
        if depth > MAX_VALUES:
            raise KernelError(f"{where}: in_c * k * k = {depth} passes the kernels' int32 GEMM "
                              f"depth (2^31 - 1)")
        if c * ph * pw > MAX_CONV_SCRATCH or (depth + out) * oh * ow > MAX_CONV_SCRATCH:
            raise KernelError(f"{where}: needs {max(c * ph * pw, (depth + out) * oh * ow)} "
                              f"floats of scratch per sample, more than the kernels' 2^40")
        name = self._name("conv")
        w = self._param(f"{name}.weight", (out, c, k, k))
        b = self._param(f"{name}.bias", (out,)) if bias else -1
        self.units.append((f"{name}.weight",) + ((f"{name}.bias",) if bias else ()))
        self._row(OP_CONV2D, (out, oh, ow), k=k, stride=stride, pad=pad, w_off=w, b_off=b)

    def pool(self, k, stride=None):
        stride = stride or k
        c, h, w = self.shape
        oh, ow = (h - k) // stride + 1, (w - k) // stride + 1
        if oh <= 0 or ow <= 0:
            raise KernelError(f"model: maxpool k={k} does not fit input {self.shape}")
        if KERNEL_CHUNK * c * h * w > MAX_VALUES:
            raise KernelError(f"model: maxpool k={k} on input {self.shape} ({c * h * w} values "
                              f"per sample): its argmax is int32 over {KERNEL_CHUNK} samples, "
                              f"so at most {MAX_VALUES // KERNEL_CHUNK} values per sample")
        self._row(OP_MAXPOOL2D, (c, oh, ow), k=k, stride=stride)

    def relu(self):
        self._row(OP_RELU, self.shape)

    def flatten(self):
        self._row(OP_FLATTEN, (prod(self.shape), 1, 1))

    def build(self, kind, spec, input_shape, num_classes, loss, l2=0.0) -> Model:
        layers = np.array(self.rows, dtype=np.int64).reshape(-1, len(COLUMNS))
        layers.setflags(write=False)
        return Model(kind=kind, spec=json.dumps(spec, sort_keys=True), input_shape=tuple(input_shape),
                     num_classes=num_classes, n_out=self.shape[0], loss=loss, l2=float(l2),
                     layers=layers, table=LayerTable(tuple(self.entries)), units=tuple(self.units))


# ------------------------------------------------------------------------------ model kinds

def _binary_outputs(kind, num_classes):
    if num_classes != 2:
        raise KernelError(f"model {kind}: needs a binary task (2 classes, labels 0/1), dataset has "
                          f"{num_classes}; use dataset option binary: even-odd")
    return 1


def _linear(b, num_classes, *, bias=True, outputs=1):
    b.dense(int(outputs), bias=bool(bias))
    return LOSS_MSE, 0.0


def _logreg(b, num_classes, *, bias=True):
    b.dense(_binary_outputs("logreg", num_classes), bias=bool(bias))
    return LOSS_LOGISTIC, 0.0


def _softmax(b, num_classes, *, bias=True):
    b.dense(num_classes, bias=bool(bias))
    return LOSS_SOFTMAX_CE, 0.0


def _svm(b, num_classes, *, l2=0.1, bias=False):
    b.dense(1 if num_classes == 2 else num_classes, bias=bool(bias))
    return LOSS_SQHINGE, float(l2)


def _mlp(b, num_classes, *, hidden=(200, 200)):
    for h in hidden:
        b.dense(int(h))
        b.relu()
    b.dense(num_classes)
    return LOSS_SOFTMAX_CE, 0.0


def _cnn(b, num_classes, *, conv=(), fc=()):
    """conv: list of {out, k, stride=1, pad=0, pool=0}; each conv is followed by ReLU and,
    if pool > 0, a pool x pool max-pool; fc: hidden sizes of the dense layers after it."""
    for opts in conv:          # checked by check_model_spec
        b.conv(int(opts["out"]), int(opts["k"]), int(opts.get("stride", 1)), int(opts.get("pad", 0)))
        b.relu()
        if int(opts.get("pool", 0)) > 0:
            b.pool(int(opts["pool"]))
    for h in fc:
        b.dense(int(h))
        b.relu()
    b.dense(num_classes)
    return LOSS_SOFTMAX_CE, 0.0


PRESETS = {
    # McMahan et al. (FedAvg) MNIST CNN: 1,663,370 parameters at 28x28x1, 10 classes.
    "cnn-mnist": dict(conv=[dict(out=32, k=5, pad=2, pool=2), dict(out=64, k=5, pad=2, pool=2)],
                      fc=[512]),
    # FedUmf paper, Appendix A: two 5x5 conv layers, then FC 384 and 192; 797,962 parameters
    # at 32x32x3.
    "cnn-cifar": dict(conv=[dict(out=64, k=5, pool=2), dict(out=64, k=5, pool=2)], fc=[384, 192]),
    # FedMR's CNN as its authors' code (`CNNCifar`) defines it: 2 conv + 3 FC, although the
    # paper's §5.1 says two FC layers; 62,006 parameters at 32x32x3.
    "lenet-cifar": dict(conv=[dict(out=6, k=5, pool=2), dict(out=16, k=5, pool=2)], fc=[120, 84]),
}

KINDS = {"linear": _linear, "logreg": _logreg, "softmax": _softmax, "svm": _svm, "mlp": _mlp,
         "cnn": _cnn}


def model_names() -> list:
    return sorted(KINDS) + sorted(PRESETS)


class ModelSpecError(KernelError):
    """A model option the builder cannot take: `key` is its path inside the model's options
    ("hidden", "conv[0].k"), `problem` what is wrong with it. Run configs name it as
    "model.<key>" (edgefl.runconfig), at the file's reading."""

    def __init__(self, name, key: str, problem: str):
        super().__init__(f"model {name}: {key}: {problem}")
        self.key, self.problem = key, problem


CONV_KEYS = ("out", "k", "stride", "pad", "pool")
_CONV_MINIMUM = {"out": 1, "k": 1, "stride": 1, "pad": 0, "pool": 0}


def _whole(value, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) \
        and value >= minimum


def _check_sizes(name, key, value) -> None:
    # a string is refused, not iterated: hidden: "64" was two layers, [6, 4]; 6.5 was 6
    if not isinstance(value, (list, tuple)) or not all(_whole(h, 1) for h in value):
        raise ModelSpecError(name, key, f"must be a list of positive integers, got {value!r}")


def _check_conv(name, value) -> None:
    if not isinstance(value, (list, tuple)):
        raise ModelSpecError(name, "conv", f"must be a list of layers {{{', '.join(CONV_KEYS)}}}, "
                                           f"got {value!r}")
    for i, layer in enumerate(value):
        if not isinstance(layer, dict):
            raise ModelSpecError(name, f"conv[{i}]", f"must be a mapping of out, k and optionally "
                                                     f"stride, pad, pool; got {layer!r}")
        unknown = sorted(set(layer) - set(CONV_KEYS))
        if unknown:
            raise ModelSpecError(name, f"conv[{i}].{unknown[0]}", f"unknown key; valid: "
                                                                  f"{', '.join(CONV_KEYS)}")
        if "out" not in layer or "k" not in layer:
            raise ModelSpecError(name, f"conv[{i}]", f"needs out and k (optionally stride, "
                                                     f"pad, pool), got {layer!r}")
        for key, minimum in _CONV_MINIMUM.items():
            if key in layer and not _whole(layer[key], minimum):
                raise ModelSpecError(name, f"conv[{i}].{key}", f"must be an integer >= "
                                                               f"{minimum}, got {layer[key]!r}")


def _check_option(name, key, value) -> None:
    if key in ("hidden", "fc"):
        _check_sizes(name, key, value)
    elif key == "conv":
        _check_conv(name, value)
    elif key == "bias" and not isinstance(value, bool):
        raise ModelSpecError(name, key, f"must be true or false, got {value!r}")
    elif key == "outputs" and not _whole(value, 1):
        raise ModelSpecError(name, key, f"must be a positive integer, got {value!r}")
    elif key == "l2" and not _finite_at_least_zero(value):
        raise ModelSpecError(name, key, f"must be a finite number >= 0, got {value!r}")


def _finite_at_least_zero(value) -> bool:
    # a number written as text is taken: before edgefl read YAML 1.2 floats, `l2: 1e-4`
    # was the string '1e-4' (float() took it), and checkpoints, summaries and queued runs
    # of then still hold it
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return not isinstance(value, bool) and isinstance(value, (int, float)) \
        and 0 <= value < float("inf")


def check_model_spec(spec, extra=()) -> tuple:
    """(name, kind, options) of a model spec (a name, or a mapping {name, options...}), a
    preset's options filled in; ModelSpecError naming the option when one is unknown or of
    the wrong type or range, before any layer is built (so a config's reader can check it
    without a dataset, and every entry point that reads a run config does). `extra`: keys
    of the caller's that may stand beside the options (a run config's `init`), named among
    the valid ones and left out of the options."""
    spec = {"name": spec} if isinstance(spec, str) else dict(spec)
    name = spec.pop("name", None)
    for key in extra:
        spec.pop(key, None)
    if name in PRESETS:
        opts = dict(PRESETS[name])
        opts.update(spec)
        kind = "cnn"
    elif name in KINDS:
        opts, kind = spec, name
    else:
        raise ModelSpecError(name, "name", f"unknown model {name!r}; valid: "
                                           f"{', '.join(model_names())}")
    fn = KINDS[kind]
    allowed = fn.__code__.co_varnames[2:fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]
    for key in opts:
        if key not in allowed:
            raise ModelSpecError(name, key, f"unknown option of model {name}; valid: "
                                            f"{', '.join(('name', *extra, *allowed))}")
    for key, value in spec.items():        # (a preset's own options are right)
        _check_option(name, key, value)
    return name, kind, opts


def model_options(spec) -> dict:
    """{"name": ..., option: value, ...} of a model spec (a name, a mapping, or a Model's
    `spec` JSON) with a preset's options and the builder's defaults filled in, as JSON data:
    two specs of one model with the same options give equal dicts (svm and {name: svm, l2:
    0.1} do). ModelSpecError as check_model_spec."""
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        spec = json.loads(spec)
    name, kind, opts = check_model_spec(spec)
    return json.loads(json.dumps({"name": name, **(KINDS[kind].__kwdefaults__ or {}), **opts}))


def build_model(spec, input_shape, num_classes: int) -> Model:
    """spec: a name ("mlp") or a mapping {name: ..., options...}."""
    name, kind, opts = check_model_spec(spec)
    fn = KINDS[kind]
    if kind not in ("linear",) and int(num_classes) < 2:
        raise KernelError(f"model {name}: needs a classification dataset (num_classes >= 2)")
    b = _Builder(input_shape)
    loss, l2 = fn(b, int(num_classes), **opts)
    return b.build(name, dict(name=name, **opts), input_shape, int(num_classes), loss, l2)
