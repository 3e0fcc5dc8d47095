"""On-board inference: an onnxruntime session over an exported model file that follows the
file when it is atomically replaced (docs/onnx.md "Predictor and hot reload").

A board's inference service keeps one `Predictor` on the path the client writes each new
global model to. Every call (or every `check_interval` seconds) stats the path; when the
(device, inode, size, mtime_ns) signature changes, the calling thread reads the new file,
builds a complete session from those bytes and only then swaps it in under a lock. Calls
already running finish on the session they started with. A file that does not load (half
written by a non-atomic writer, corrupt, a different input shape) or does not run on one
zero sample (an op that fails at run time) is never served: the old session stays and the
reason is logged once per file version. Before onnxruntime sees a file (from disk or
received), it is checked to hold only what edgefl's exporter writes (edgefl.onnxcheck: its
ops, no external data, no functions) and to be no larger than MAX_MODEL_BYTES.

Needs onnxruntime only (not the `onnx` package). `install_model` is the writing side: how an
MQTT client puts a received model where a Predictor watches (exporters write with
edgefl.io.atomic_write, the same atomic replace).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from .io import atomic_write
from .onnxcheck import Malformed, NotExported, check_model_bytes

__all__ = [
    "IMAGE_SUFFIXES",
    "InputError",
    "ModelFileError",
    "Predictor",
    "install_model",
    "probabilities_from_scores",
    "read_inputs",
]

log = logging.getLogger("edgefl.infer")

RACY_WINDOW_NS = 2_000_000_000   # file timestamps are coarse: see Predictor._changed
RACY_RECHECK_S = 0.05
# Samples per onnxruntime call. onnxruntime holds every activation of the batch it runs, and
# `edgefl serve` takes any batch that fits infer.max_request_bytes (16 MiB: 5,349 cnn-mnist
# samples, 1.08 GB resident in one call); in slices of 64 a batch needs what 64 samples
# need, at batch 64's throughput (docs/onnx.md, "Speed").
RUN_BATCH = 64


# The most bytes a model file may have: what a board's client reassembles from MQTT at most
# (roles/onnx_channel.py OnnxReceiver max_bytes), far beyond any edge model (cnn-cifar's
# fp32 export is a few MB). A larger file is refused before it is read.
MAX_MODEL_BYTES = 512 << 20

class ModelFileError(ValueError):
    """A model file that cannot be served; the message names the file and the cause."""


class InputError(ValueError):
    """Input a model cannot take; the message names the expected shape."""


# ---------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------

def install_model(data: bytes, state_dir, name: str = "model.onnx", *,
                  sha256: str | None = None) -> str:
    """Install received model bytes as `state_dir/name` (atomic replace) after checking them:
    the sha256 when the sender gave one, and that onnxruntime builds a session from them
    that a Predictor can serve and that runs (`_smoke_run`), so a corrupt, truncated or
    unrunnable payload never replaces a working model. Returns the path.
    What a client runs on a received model (roles/onnx_channel.py; edgefl.export.model_payload
    is the sending half)."""
    target = os.path.join(os.fspath(state_dir), name)
    if sha256 is not None:
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise ModelFileError(f"{target}: received {len(data)} bytes with sha256 {got[:12]}, "
                                 f"the sender announced {sha256[:12]}; not installed")
    what = f"{target} (received)"
    # a model that loads but does not run would replace a working one: run it first
    _smoke_run(_describe(_session_from_bytes(data, what, threads=1), what, None, data), what)
    try:
        os.makedirs(os.fspath(state_dir), exist_ok=True)
        atomic_write(target, data)
    except OSError as exc:   # a full disk, no permission: the installed file is as it was
        raise ModelFileError(f"{target}: cannot write the received model ({exc}); not "
                             f"installed, the model there before is kept") from exc
    return target


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------

def _signature(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _read_file(path: str) -> tuple[bytes, tuple]:
    """The file's bytes and the signature of exactly the inode they came from."""
    with open(path, "rb") as f:
        before = os.fstat(f.fileno())
        if before.st_size > MAX_MODEL_BYTES:
            raise ModelFileError(f"{path}: {before.st_size} bytes, more than the "
                                 f"{MAX_MODEL_BYTES} a model file may have "
                                 f"(edgefl.infer.MAX_MODEL_BYTES); not read")
        data = f.read()
        after = os.fstat(f.fileno())
    if _signature(before) != _signature(after) or len(data) != after.st_size:
        raise ModelFileError(f"{path}: changed while being read ({before.st_size} -> "
                             f"{after.st_size} bytes); it is being written in place, not "
                             f"atomically replaced")
    return data, _signature(after)


def session_options(threads: int):
    """The onnxruntime SessionOptions of a Predictor's session (tools/bench_onnx.py builds
    its session of a file edgefl does not export with them)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = int(threads)
    # The graphs are chains: no independent branches for an inter-op pool to run.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    return options


def _session_from_bytes(data: bytes, what: str, threads: int):
    import onnxruntime as ort

    if not data:
        raise ModelFileError(f"{what}: empty file (0 bytes), not an ONNX model")
    if len(data) > MAX_MODEL_BYTES:
        raise ModelFileError(f"{what}: {len(data)} bytes, more than the {MAX_MODEL_BYTES} a "
                             "model file may have (edgefl.infer.MAX_MODEL_BYTES)")
    try:
        check_model_bytes(data)
    except Malformed as exc:
        raise ModelFileError(f"{what}: not a loadable ONNX model ({len(data)} bytes; not a "
                             f"well-formed protobuf: {exc})") from None
    except NotExported as exc:
        raise ModelFileError(f"{what}: {exc}; refused before onnxruntime loads it") from None
    try:
        return ort.InferenceSession(data, session_options(threads),
                                    providers=["CPUExecutionProvider"])
    except Exception as exc:   # onnxruntime raises its own pybind11 types (InvalidProtobuf, ...)
        raise ModelFileError(f"{what}: not a loadable ONNX model ({len(data)} bytes; "
                             f"{_ort_reason(exc)})") from exc


def _ort_reason(exc: Exception) -> str:
    """onnxruntime's error in one line: its type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else '(no message)'}"


@dataclass(frozen=True)
class _Loaded:
    session: object
    signature: tuple
    sha256: str
    loaded_ns: int
    input_name: str
    input_shape: tuple          # per sample
    scores_name: str
    has_probabilities: bool
    n_out: int
    decision: str               # argmax | positive-score | none
    class_names: tuple
    metadata: dict


def _describe(session, path: str, signature: tuple, data: bytes) -> _Loaded:
    inputs = session.get_inputs()
    if len(inputs) != 1:
        raise ModelFileError(f"{path}: has {len(inputs)} inputs "
                             f"({', '.join(i.name for i in inputs)}); a Predictor needs one")
    dims = tuple(inputs[0].shape[1:])
    if not dims or not all(isinstance(d, int) and d > 0 for d in dims):
        raise ModelFileError(f"{path}: input {inputs[0].name!r} has shape {inputs[0].shape}; "
                             f"a Predictor needs (batch, fixed per-sample dimensions)")
    if inputs[0].type != "tensor(float)":
        raise ModelFileError(f"{path}: input {inputs[0].name!r} is {inputs[0].type}; "
                             f"a Predictor feeds float32")
    outputs = {o.name: o for o in session.get_outputs()}
    scores = "scores" if "scores" in outputs else session.get_outputs()[0].name
    width = outputs[scores].shape[-1] if outputs[scores].shape else None
    if not isinstance(width, int):
        raise ModelFileError(f"{path}: output {scores!r} has shape {outputs[scores].shape}; "
                             f"a Predictor needs (batch, outputs)")
    meta = dict(session.get_modelmeta().custom_metadata_map)
    decision = meta.get("decision") or ("argmax" if width > 1 else "positive-score")
    if decision not in ("argmax", "positive-score", "none"):
        raise ModelFileError(f"{path}: metadata decision {decision!r} is not one of argmax, "
                             f"positive-score, none")
    try:
        names = tuple(json.loads(meta["class_names"])) if meta.get("class_names") else ()
    except ValueError as exc:
        raise ModelFileError(f"{path}: metadata class_names is not JSON ({exc})") from exc
    if not names and decision != "none":
        names = tuple(str(i) for i in range(2 if width == 1 else width))
    return _Loaded(session=session, signature=signature, sha256=hashlib.sha256(data).hexdigest(),
                   loaded_ns=time.time_ns(), input_name=inputs[0].name, input_shape=dims,
                   scores_name=scores, has_probabilities="probabilities" in outputs,
                   n_out=width, decision=decision, class_names=names, metadata=meta)


def _smoke_run(m: "_Loaded", what: str) -> "_Loaded":
    """`m` once it has answered one zero sample of its declared input shape. onnxruntime
    builds a session from a graph it cannot run (a Reshape or a layer that does not fit the
    declared input, an op that fails at run time), and such a model, swapped in, fails every
    request. No sample is stored with an export (only the count of calibration samples), and
    zeros are inside every export's input range (pixels, digits, a CSV's own units)."""
    import onnxruntime as ort

    quiet = ort.RunOptions()
    quiet.log_severity_level = 4       # the error is ours to report, once, naming the file
    try:
        m.session.run([m.scores_name], {m.input_name: np.zeros((1, *m.input_shape),
                                                               np.float32)}, quiet)
    except Exception as exc:   # noqa: BLE001 -- onnxruntime's pybind11 types (Fail, ...)
        raise ModelFileError(f"{what}: loads but does not run on one zero sample of shape "
                             f"{(1, *m.input_shape)} ({_ort_reason(exc)})") from exc
    return m


def probabilities_from_scores(scores: np.ndarray, decision: str) -> np.ndarray:
    """What the graph's `probabilities` output computes, in NumPy, for a graph exported
    without it (--no-softmax): softmax for argmax models, [sigmoid(-s), sigmoid(s)] for
    one-output models."""
    s = scores.astype(np.float64)
    if decision == "positive-score":
        p1 = 1.0 / (1.0 + np.exp(-s[:, 0]))
        return np.stack([1.0 - p1, p1], axis=1).astype(np.float32)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


# ---------------------------------------------------------------------------------------
# the predictor
# ---------------------------------------------------------------------------------------

class Predictor:
    """An onnxruntime session over `path` that reloads when the file is atomically replaced.

    threads: onnxruntime intra-op threads (a board's device profile sets it).
    check_interval: seconds between stats of the path (0: every call; None: never reload).
    require_same_input: refuse (and log) a new file whose input shape differs, since the
    service feeding this predictor was built for the old one.
    """

    def __init__(self, path, threads: int = 1, *, check_interval: float | None = 1.0,
                 require_same_input: bool = True):
        if int(threads) < 1:
            raise ValueError(f"Predictor: threads = {threads}: need at least 1")
        self.path = os.fspath(path)
        self.threads = int(threads)
        self.check_interval = check_interval
        self.require_same_input = require_same_input
        self._swap_lock = threading.Lock()     # guards _current
        self._load_lock = threading.Lock()     # one thread loads a new file at a time
        self._last_check = time.monotonic()
        self._last_racy_check = 0.0
        self._rejected: tuple | None = None    # signature of a file that failed to load
        self._settled: tuple | None = None     # signature known not to hide a racy replace
        self.last_error: str | None = None
        self.reloads = 0
        if not os.path.exists(self.path):
            raise ModelFileError(f"{self.path}: model file does not exist")
        self._current = self._load()

    # -------------------------------------------------------------------- properties
    @property
    def metadata(self) -> dict:
        return dict(self._model().metadata)

    @property
    def input_shape(self) -> tuple:
        return self._model().input_shape

    @property
    def class_names(self) -> tuple:
        return self._model().class_names

    @property
    def sha256(self) -> str:
        """sha256 of the file bytes being served."""
        return self._model().sha256

    @property
    def session(self):
        """The onnxruntime InferenceSession being served (replaced on reload)."""
        return self._model().session

    def _model(self) -> _Loaded:
        with self._swap_lock:
            return self._current

    # -------------------------------------------------------------------- prediction
    def predict(self, x) -> tuple[np.ndarray, np.ndarray]:
        """(classes (n,) int64, probabilities (n, K) float32) for raw inputs x of shape
        (n, *input_shape), one sample (*input_shape) or (n, prod(input_shape))."""
        m = self._serving()
        if m.decision == "none":
            raise ModelFileError(f"{self.path}: a regression model (decision none) has no "
                                 f"classes; use Predictor.scores(x)")
        return self._classify(x, m)

    def answer(self, x) -> dict:
        """Everything about one prediction from ONE model, even while a reload swaps in
        another: {sha256, metadata, class_names} of the model that answered, plus classes
        and probabilities (classifiers) or values (regression). What a service returns."""
        m = self._serving()
        out = {"sha256": m.sha256, "metadata": dict(m.metadata), "class_names": m.class_names}
        if m.decision == "none":
            out["values"] = self._run(m, [m.scores_name], x)[0]
        else:
            out["classes"], out["probabilities"] = self._classify(x, m)
        return out

    def _classify(self, x, m: _Loaded) -> tuple[np.ndarray, np.ndarray]:
        names = [m.scores_name] + (["probabilities"] if m.has_probabilities else [])
        out = self._run(m, names, x)
        scores = out[0]
        if m.decision == "positive-score":
            classes = (scores[:, 0] > 0).astype(np.int64)
        else:
            classes = np.argmax(scores, axis=1).astype(np.int64)
        probs = out[1] if m.has_probabilities else probabilities_from_scores(scores, m.decision)
        return classes, probs

    def scores(self, x) -> np.ndarray:
        """The graph's `scores` output (logits, margins or regression predictions)."""
        m = self._serving()
        return self._run(m, [m.scores_name], x)[0]

    def _run(self, m: _Loaded, names: list, x) -> list:
        """The outputs `names` of model `m` for raw inputs x, run in slices of RUN_BATCH
        samples so that memory does not grow with the batch; every slice on the same `m`."""
        a = self._prepare(x, m)
        if len(a) <= RUN_BATCH:
            return m.session.run(names, {m.input_name: a})
        parts = [m.session.run(names, {m.input_name: a[i:i + RUN_BATCH]})
                 for i in range(0, len(a), RUN_BATCH)]
        return [np.concatenate([part[k] for part in parts]) for k in range(len(names))]

    def _prepare(self, x, m: _Loaded) -> np.ndarray:
        shape, size = m.input_shape, math.prod(m.input_shape)
        want = (f"expected (n, {', '.join(map(str, shape))}), one sample {shape}"
                + (f" or (n, {size}) flattened" if len(shape) > 1 else ""))
        a = np.asarray(x)
        # real numbers only: numpy counts complex (cast to float32 it loses the imaginary
        # part) and timedelta64 (cast, a count of its unit) as numbers too
        if a.dtype.kind not in "biuf":
            raise InputError(f"input: dtype {a.dtype} is not numeric (need real numbers: bool, "
                             f"integer or float); {want}")
        if a.shape == shape:
            a = a[None]
        elif a.shape[1:] != shape:
            if a.ndim == 2 and a.shape[1] == size:
                a = a.reshape((a.shape[0],) + shape)
            else:
                raise InputError(f"input: shape {a.shape} does not fit model input {shape} "
                                 f"({self.path}); {want}")
        if a.shape[0] == 0:
            raise InputError(f"input: no samples (shape {a.shape})")
        rows = a.reshape(a.shape[0], -1)
        finite = np.isfinite(rows).all(axis=1)
        if not finite.all():
            raise InputError(f"input: sample {int(np.argmin(finite))} has non-finite values")
        if a.dtype.kind == "f" and a.dtype.itemsize > 4:   # float64 may not fit float32
            big = np.abs(rows).max(axis=1) > np.finfo(np.float32).max
            if big.any():
                i = int(np.argmax(big))
                raise InputError(f"input: sample {i} has values beyond float32 (largest "
                                 f"magnitude {float(np.abs(rows[i]).max()):g}, float32 holds "
                                 f"{float(np.finfo(np.float32).max):g}); the model computes "
                                 f"in float32")
        return np.ascontiguousarray(a, dtype=np.float32)

    # -------------------------------------------------------------------- reloading
    def _serving(self) -> _Loaded:
        if self.check_interval is not None:
            now = time.monotonic()
            if now - self._last_check >= self.check_interval:
                self._last_check = now
                self._check(blocking=False)
        return self._model()

    def reload(self) -> bool:
        """Check the file now (waiting for a load in progress); True if a new model was
        swapped in. A file that fails to load leaves the old one and sets last_error."""
        return self._check(blocking=True)

    def _changed(self, st: os.stat_result, current: _Loaded) -> bool:
        sig = _signature(st)
        if sig != current.signature:
            return sig != self._rejected
        # Same signature. File timestamps come from a coarse clock (ms) and a freed inode
        # number can be reused, so a replace in the same tick as the file we loaded can look
        # identical ("racy", as git calls it for its index). While that is possible, compare
        # contents now and then; once the file is older than the window, it is settled.
        if sig == self._settled or current.loaded_ns - st.st_mtime_ns > RACY_WINDOW_NS:
            self._settled = sig
            return False
        now = time.monotonic()
        if now - self._last_racy_check < RACY_RECHECK_S:
            return False
        self._last_racy_check = now
        try:
            with open(self.path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != current.sha256:
                    return True
        except OSError:
            return False
        if time.time_ns() - st.st_mtime_ns > RACY_WINDOW_NS:
            self._settled = sig
        return False

    def _check(self, blocking: bool) -> bool:
        if not self._load_lock.acquire(blocking=blocking):
            return False   # another thread is loading; keep serving meanwhile
        try:
            current = self._model()
            try:
                st = os.stat(self.path)
            except OSError as exc:
                self._fail(None, f"{self.path}: cannot stat ({exc.strerror}); serving the "
                                 f"model loaded before")
                return False
            if not self._changed(st, current):
                return False
            try:
                new = self._load()
            except ModelFileError as exc:
                self._fail(_signature(st), f"{exc}; still serving the previous model "
                                           f"(sha256 {current.sha256[:12]})")
                return False
            if self.require_same_input and new.input_shape != current.input_shape:
                self._fail(new.signature, f"{self.path}: new model takes input "
                                          f"{new.input_shape}, the served one "
                                          f"{current.input_shape}; not swapped in "
                                          f"(require_same_input)")
                return False
            with self._swap_lock:
                self._current = new
            self.reloads += 1
            self._rejected, self.last_error = None, None
            log.info("%s: reloaded (sha256 %s, round %s)", self.path, new.sha256[:12],
                     new.metadata.get("round", "?"))
            return True
        finally:
            self._load_lock.release()

    def _fail(self, signature, message: str) -> None:
        if (signature, message) != (self._rejected, self.last_error):   # once per cause
            log.warning("%s", message)
        self._rejected, self.last_error = signature, message

    def _load(self) -> _Loaded:
        try:
            data, signature = _read_file(self.path)
        except FileNotFoundError:
            raise ModelFileError(f"{self.path}: model file does not exist") from None
        except IsADirectoryError:
            raise ModelFileError(f"{self.path}: is a directory, not a model file") from None
        except OSError as exc:
            raise ModelFileError(f"{self.path}: cannot read ({exc.strerror})") from exc
        session = _session_from_bytes(data, self.path, self.threads)
        return _smoke_run(_describe(session, self.path, signature, data), self.path)


# ---------------------------------------------------------------------------------------
# input files (`edgefl predict --input FILE`)
# ---------------------------------------------------------------------------------------

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm",
                  ".ppm")


def read_inputs(path, input_shape: tuple, input_range=None) -> np.ndarray:
    """Raw samples from a file, as float32 (n, *input_shape) or anything Predictor accepts:

    .npy    an array of (n, *input_shape), one sample, or (n, prod(input_shape))
    .csv    one sample per row, prod(input_shape) numbers (a non-numeric first row is a
            header and skipped)
    image   PNG/JPEG/... (needs Pillow) for image models: converted to grayscale (1 channel)
            or RGB (3), resized to the model's H x W (area mean when shrinking, bilinear when
            enlarging), and scaled from 0..255 to the
            model's raw input range (metadata input_range, e.g. digits' 0..16). One sample.
    """
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        raise InputError(f"{path}: a directory; give one input file (.npy, .csv or an image)")
    if not os.path.isfile(path):
        raise InputError(f"{path}: input file does not exist")
    if suffix == ".npy":
        try:
            return np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise InputError(f"{path}: not a numeric .npy array ({exc})") from exc
    if suffix in (".csv", ".txt"):
        return _read_csv_rows(path)
    if suffix in IMAGE_SUFFIXES:
        return _read_image(path, tuple(input_shape), input_range)
    raise InputError(f"{path}: unknown input type {suffix or '(no suffix)'}; use .npy, .csv or "
                     f"an image ({', '.join(IMAGE_SUFFIXES)})")


def _read_csv_rows(path: str) -> np.ndarray:
    from .data.datasets import read_csv_table     # imported here: only a CSV input needs it

    try:
        _, table, _ = read_csv_table(path)
    except (ValueError, OSError) as exc:
        raise InputError(str(exc)) from None
    return table.astype(np.float32)


def _read_image(path: str, input_shape: tuple, input_range) -> np.ndarray:
    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        raise InputError(f"{path}: an image needs a model with 1- or 3-channel image input, "
                         f"this one takes {input_shape}")
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(f"{path}: reading images needs Pillow (pip install pillow), or pass "
                          f"the pixels as .npy/.csv") from exc
    c, h, w = input_shape
    try:
        with Image.open(path) as im:
            im = im.convert("L" if c == 1 else "RGB")
            if im.size != (w, h):
                # shrinking: the mean of each source area (no aliasing); enlarging: bilinear
                shrink = im.size[0] >= w and im.size[1] >= h
                im = im.resize((w, h), Image.BOX if shrink else Image.BILINEAR)
            pixels = np.asarray(im, dtype=np.float32)
    except OSError as exc:   # PIL.UnidentifiedImageError is an OSError
        raise InputError(f"{path}: not a readable image ({exc})") from exc
    pixels = pixels[None] if c == 1 else pixels.transpose(2, 0, 1)
    lo, hi = (0.0, 255.0) if not input_range else (float(input_range[0]), float(input_range[1]))
    if (lo, hi) != (0.0, 255.0):
        pixels = lo + pixels * ((hi - lo) / 255.0)
    return np.ascontiguousarray(pixels[None], dtype=np.float32)
