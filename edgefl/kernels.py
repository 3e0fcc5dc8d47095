"""Picks the kernel backend and validates every call before it reaches a kernel.

The compiled core (`edgefl._core`, C behind Cython) and the pure-NumPy twin
(`edgefl.reference`) expose the same functions with the same arguments and side effects and
assume valid input. This module checks dtypes, shapes, contiguity and sizes once, in Python,
and raises errors that name the argument, so both backends fail the same way.

EDGEFL_BACKEND=numpy selects the reference; EDGEFL_BACKEND=c requires the compiled core;
unset, the compiled core is used when it was built and the reference otherwise.
"""
from __future__ import annotations

import os
import threading
import warnings

import numpy as np

from . import reference
from .errors import KernelError, NonFiniteError, TrainingStopped  # noqa: F401  (re-exported)
from .forksafe import openssl

_REQUESTED = os.environ.get("EDGEFL_BACKEND", "").strip().lower()
if _REQUESTED not in ("", "c", "numpy"):
    raise ImportError(f"EDGEFL_BACKEND={_REQUESTED!r} is not a backend; use 'c' or 'numpy'")


def _load_c():
    # Preload the BLAS the core links here, not only in edgefl/__init__: when a folder named
    # `edgefl` in the working directory shadows an editable install, `edgefl` is a namespace
    # package, its __init__ never runs, and the core would not find libscipy_openblas.
    from . import _blas  # noqa: F401
    from . import _core

    _core.blas_set_threads(1)  # one GEMM thread per caller: clients run in their own threads
    return _core


if _REQUESTED == "numpy":
    impl = reference
    backend_reason = "EDGEFL_BACKEND=numpy"
else:
    try:
        impl = _load_c()
        backend_reason = "compiled core"
    except ImportError as exc:
        if _REQUESTED == "c":
            raise ImportError(f"EDGEFL_BACKEND=c but the compiled core did not load: {exc}") from exc
        backend_reason = f"fallback: compiled core unavailable ({exc})"
        warnings.warn(f"edgefl: compiled core unavailable ({exc}); using the NumPy reference",
                      RuntimeWarning, stacklevel=2)
        impl = reference

backend = "numpy" if impl is reference else "c"
# the NumPy reference was not asked for: every run says so (check_run_backend)
fallback = backend == "numpy" and _REQUESTED != "numpy"

# A run that trains more client-rounds than this on an unrequested fallback is refused: at
# ~4x the compiled core's time it is a mistake to find out about at the end.
LONG_RUN_CLIENT_ROUNDS = 1000


def check_run_backend(client_rounds: int, where: str, stream=None) -> None:
    """Make an unrequested fallback to the NumPy reference visible to a run: a line on
    `stream`, and a KernelError for a run of more than LONG_RUN_CLIENT_ROUNDS client-rounds
    (rounds x clients per round), naming the cause and the two ways out."""
    if not fallback:
        return
    if client_rounds > LONG_RUN_CLIENT_ROUNDS:
        raise KernelError(f"{where}: {client_rounds} client-rounds on the NumPy reference, which "
                          f"was not asked for ({backend_reason}); rebuild the core "
                          f"(pip install -e .) and run from outside a folder holding an "
                          f"'edgefl' directory, or set EDGEFL_BACKEND=numpy to accept it")
    if stream is not None:
        print(f"edgefl: backend numpy, not the compiled core ({backend_reason})", file=stream,
              flush=True)


# ---------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------

_DTYPES = {t: np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64, np.uint16,
                                     np.int8)}
_F32 = _DTYPES[np.float32]


def check_array(name: str, a, dtype, *, size: int | None = None, ndim: int | None = None,
                shape: tuple | None = None, writable: bool = False) -> np.ndarray:
    """Return `a` if it is a C-contiguous ndarray of `dtype` (and the given size/shape)."""
    # on every kernel call: dtype objects are looked up, not built, and the flags object is
    # made once (each `a.flags` makes a new one)
    want = _DTYPES.get(dtype) or np.dtype(dtype)
    if not isinstance(a, np.ndarray):
        raise KernelError(f"{name}: expected a numpy array of {want.name}, "
                          f"got {type(a).__name__}")
    if a.dtype is not want and a.dtype != want:
        raise KernelError(f"{name}: dtype {a.dtype} where {want.name} is required")
    flags = a.flags
    if not flags.c_contiguous:
        raise KernelError(f"{name}: array is not C-contiguous (strides {a.strides}); "
                          f"pass np.ascontiguousarray({name})")
    if not flags.aligned:
        # the C kernels read it through typed pointers: undefined behaviour, and a fault
        # where the CPU wants aligned vector loads (armhf NEON)
        raise KernelError(f"{name}: array is not aligned for {want.name} (data at byte "
                          f"{a.ctypes.data % want.alignment} of {want.alignment}); pass a "
                          f"copy, np.array({name})")
    if writable and not flags.writeable:
        raise KernelError(f"{name}: array is read-only but the kernel writes into it")
    if ndim is not None and a.ndim != ndim:
        raise KernelError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise KernelError(f"{name}: expected shape {tuple(shape)}, got {a.shape}")
    if size is not None and a.size != size:
        raise KernelError(f"{name}: expected {size} elements, got {a.size} (shape {a.shape})")
    return a


def _check_buffers(name: str, xs, n: int) -> list:
    xs = list(xs)
    if not xs:
        raise KernelError(f"{name}: need at least one buffer")
    for i, x in enumerate(xs):
        check_array(f"{name}[{i}]", x, np.float32, size=n)
    return xs


# ---------------------------------------------------------------------------------------
# vector kernels
# ---------------------------------------------------------------------------------------

def weighted_sum(out: np.ndarray, xs, weights) -> np.ndarray:
    """out = sum_k weights[k] * xs[k] over K separate buffers, in one streaming pass."""
    check_array("out", out, np.float32, writable=True)
    xs = _check_buffers("xs", xs, out.size)
    w = np.ascontiguousarray(weights, dtype=np.float64).reshape(-1)
    if w.size != len(xs):
        raise KernelError(f"weights: {w.size} weights for {len(xs)} buffers")
    if not np.all(np.isfinite(w)):
        raise KernelError(f"weights: not finite: {w.tolist()}")
    impl.weighted_sum(out, xs, w)
    return out


def axpy(y: np.ndarray, x: np.ndarray, a: float) -> np.ndarray:
    """y += a * x"""
    check_array("y", y, np.float32, writable=True)
    check_array("x", x, np.float32, size=y.size)
    impl.axpy(y, x, float(a))
    return y


def scale(x: np.ndarray, a: float) -> np.ndarray:
    """x *= a"""
    check_array("x", x, np.float32, writable=True)
    impl.scale(x, float(a))
    return x


def dot(x: np.ndarray, y: np.ndarray) -> float:
    check_array("x", x, np.float32)
    check_array("y", y, np.float32, size=x.size)
    return impl.dot(x, y)


def sqnorm(x: np.ndarray) -> float:
    check_array("x", x, np.float32)
    return impl.sqnorm(x)


def first_nonfinite(x: np.ndarray) -> int | None:
    """Index of the first NaN or infinity in a float32 buffer (flat order), None if none."""
    check_array("x", x, np.float32)
    i = impl.first_nonfinite(x)
    return None if i < 0 else int(i)


def median(out: np.ndarray, xs) -> np.ndarray:
    """Coordinate-wise median of K buffers."""
    check_array("out", out, np.float32, writable=True)
    xs = _check_buffers("xs", xs, out.size)
    impl.median(out, xs)
    return out


def trimmed_mean(out: np.ndarray, xs, trim: int) -> np.ndarray:
    """Coordinate-wise mean after dropping the `trim` largest and smallest values."""
    check_array("out", out, np.float32, writable=True)
    xs = _check_buffers("xs", xs, out.size)
    trim = int(trim)
    if trim < 0 or 2 * trim >= len(xs):
        raise KernelError(f"trim: {trim} leaves nothing to average of {len(xs)} buffers "
                          f"(need 0 <= trim < {len(xs)}/2)")
    impl.trimmed_mean(out, xs, trim)
    return out


# ---------------------------------------------------------------------------------------
# secure aggregation's ring arithmetic (csrc/secagg.c states the representation)
# ---------------------------------------------------------------------------------------

RING_DTYPES = {32: np.dtype(np.uint32), 64: np.dtype(np.uint64)}
# The quantiser converts x * levels / clip + u (float64) to int64. Where float64 holds every
# integer near levels (levels <= 2^52), that rounds to at most levels + 1; past 2^53 it can
# land well above levels: 2^62 - 1 levels of weight 2 passed levels * weight < 2^63 and
# +clip came back as -2^63 from both backends (and levels near 2^63 overflowed the
# conversion, undefined in C). Secure aggregation uses at most 2^40 (secagg.MAX_LEVELS).
MAX_QUANT_LEVELS = 2 ** 52


def _ring_bits(name: str, a) -> int:
    if not isinstance(a, np.ndarray) or a.dtype not in (RING_DTYPES[32], RING_DTYPES[64]):
        got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
        raise KernelError(f"{name}: ring words must be uint32 or uint64, got {got}")
    return a.dtype.itemsize * 8


def _check_quantize_args(op: str, x, size: int, bits: int, clip, levels, weight) -> None:
    """The checks `quantize` and `secagg_mask` (which quantises in the same pass) share:
    x float32 of `size` finite values, clip > 0, levels >= 1, weight >= 0, and
    (levels + 1) * weight below 2^(bits-1) so the ring sum reads back signed."""
    check_array("x", x, np.float32, size=size)
    if not (isinstance(clip, (int, float, np.floating)) and np.isfinite(clip) and clip > 0):
        raise KernelError(f"clip: {clip!r} must be a finite number > 0")
    for name, value, low in (("levels", levels, 1), ("weight", weight, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise KernelError(f"{name}: {value!r} must be a whole number >= {low}")
    if int(levels) > MAX_QUANT_LEVELS:
        raise KernelError(f"levels: {levels!r} must be at most 2^52: the quantiser rounds "
                          f"x * levels / clip in float64, which past that holds too few "
                          f"integers to keep the result within levels")
    # scale = levels / clip overflowed to inf below clip ~ levels / 1.8e308: x * inf (0 * inf
    # = nan) converted to int64 is undefined behaviour in C and -2^63 in NumPy, so +clip
    # entered the ring as its most negative word
    if not np.isfinite(float(levels) / float(clip)):
        raise KernelError(f"clip: {clip!r} is too small for {levels} levels: levels / clip "
                          f"overflows float64")
    # a value rounds to at most levels + 1 (stochastic rounding of a float64 product that
    # came out a hair above levels), and the ring's signed read-back must hold it
    if (int(levels) + 1) * max(int(weight), 1) >= 2 ** (bits - 1):
        raise KernelError(f"(levels + 1) * weight = {(int(levels) + 1) * int(weight)}: must be "
                          f"below 2^{bits - 1} for the ring's signed read-back (a value "
                          f"rounds to at most levels + 1)")
    bad = impl.first_nonfinite(x)
    if bad >= 0:
        raise NonFiniteError(op, f"x[{bad}] = {x.reshape(-1)[bad]} is not finite")


def quantize(out: np.ndarray, x: np.ndarray, clip: float, levels: int, weight: int = 1,
             seed: int = 0, stochastic: bool = True, add: bool = False) -> np.ndarray:
    """out = round(clip(x, -clip, clip) * levels / clip) * weight mod 2^bits (bits from out's
    dtype, uint32 or uint64): rounded stochastically (unbiased; u from a counter stream
    seeded by `seed`) or to nearest. |round(...)| <= levels; the caller keeps the sum of
    the weights times levels below 2^(bits-1) so the ring sum reads back exactly. add=True:
    out += those words (mod 2^bits), in the same pass."""
    bits = _ring_bits("out", out)
    check_array("out", out, out.dtype, writable=True)
    _check_quantize_args("quantize", x, out.size, bits, clip, levels, weight)
    impl.quantize(out, x, float(clip), float(levels) / float(clip), int(weight),
                  int(seed) & 0xFFFFFFFFFFFFFFFF, bool(stochastic), bool(add))
    return out


def ring_add(x: np.ndarray, m: np.ndarray, subtract: bool = False) -> np.ndarray:
    """x += m (or x -= m) word by word mod 2^bits: adding a mask stream, or removing it."""
    _ring_bits("x", x)
    check_array("x", x, x.dtype, writable=True)
    check_array("m", m, x.dtype, size=x.size)
    impl.ring_add(x, m, bool(subtract))
    return x


# The C core's masks need OpenSSL's libcrypto, found at run time (edgefl/_openssl.py) and
# checked once against the twin's `cryptography` keystream before its first use.
_MASKS = {"found": None, "off": False, "lock": threading.Lock()}   # found: None = not yet looked
MAX_MASK_SCALARS = 2048                                 # 8 bytes each: the C block's size


def masks_in_c() -> bool:
    """True when secagg_mask runs in the C core (OpenSSL's AES through EVP, the GIL released);
    False: the twin's `cryptography` loop. The library is looked for and checked once."""
    if _MASKS["off"]:
        return False
    if _MASKS["found"] is None:
        with _MASKS["lock"]:
            if _MASKS["found"] is None:
                _MASKS["found"] = _enable_c_masks()
    return _MASKS["found"]


def use_c_masks(enabled: bool) -> None:
    """Tests and benchmarks: False forces the twin's masks, True allows the core's again
    (when masks_in_c finds them)."""
    _MASKS["off"] = not enabled


def _enable_c_masks() -> bool:
    if impl is reference or os.environ.get("EDGEFL_MASKS", "").strip().lower() == "cryptography":
        return False
    from . import _openssl
    found = _openssl.evp_addresses()
    if found is None or not impl.set_aes_ctr(*found[0]):
        return False
    # the core's keystream must be the twin's, byte for byte: a libcrypto that differs
    # (or fails) is not used
    keys, subtract = bytes(range(32)) + bytes(range(32, 64)), bytes([0, 1])
    got = [np.arange(1000, dtype=np.uint32), np.arange(3, dtype=np.uint64)]
    want = [a.copy() for a in got]
    with openssl():
        ok = impl.secagg_mask(*got, keys, subtract, None, 1.0, 1.0, 1, 0, False)
        reference.secagg_mask(*want, keys, subtract, None, 1.0, 1.0, 1, 0, False)
    if not (ok and all(np.array_equal(a, b) for a, b in zip(got, want))):
        warnings.warn(f"edgefl: the C core's AES-CTR through {found[1]} does not match "
                      f"`cryptography`; secure aggregation masks use `cryptography`",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def secagg_mask(words: np.ndarray, scalars: np.ndarray, keys: bytes, subtract: bytes,
                x: np.ndarray | None = None, clip: float = 1.0, levels: int = 1,
                weight: int = 1, seed: int = 0, stochastic: bool = True,
                threads: int | None = None) -> np.ndarray:
    """words, scalars (+|-)= PRG(key) mod 2^bits for each 32-byte key of `keys` (subtract[k]
    0 or 1), the PRG being AES-256-CTR with a zero IV over the words' bytes then 8 bytes per
    scalar; with `x`, words are first set to `quantize(words, x, clip, levels, weight, seed,
    stochastic)`, in the same pass. The C core (OpenSSL's AES, the GIL released) when
    `masks_in_c()`, the twin (`cryptography`) otherwise: the same bytes. `threads`: at most
    that many mask threads (None: `mask_threads()`); 1 runs in the calling thread, for a
    caller that is itself a background thread beside other work."""
    bits = _ring_bits("words", words)
    check_array("words", words, words.dtype, writable=True)
    check_array("scalars", scalars, np.uint64, writable=True)
    if not isinstance(keys, bytes) or not isinstance(subtract, bytes) \
            or len(keys) != 32 * len(subtract) or any(s > 1 for s in subtract):
        raise KernelError(f"keys / subtract: {len(subtract)} signs (0 or 1) and 32 bytes of "
                          f"key each ({type(keys).__name__} of {len(keys)} bytes)")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise KernelError(f"threads: {threads!r} must be a whole number >= 1 or None")
    scale = 1.0
    if x is not None:
        _check_quantize_args("secagg_mask", x, words.size, bits, clip, levels, weight)
        scale = float(levels) / float(clip)
    seed = int(seed) & _U64
    if impl is reference or not (scalars.size <= MAX_MASK_SCALARS and masks_in_c()):
        with openssl():
            reference.secagg_mask(words, scalars, keys, subtract, x, float(clip), scale,
                                  int(weight), seed, bool(stochastic))
        return words
    # In C the GIL is released, so a long vector is cut into one piece per mask thread, each
    # piece's streams starting at its own byte offset (a multiple of 16: CTR's block) and its
    # quantiser's u at its own coordinate; the last piece takes the scalars.
    flat = words.reshape(-1)
    xf = None if x is None else x.reshape(-1)
    per16 = 16 // flat.itemsize
    pieces = min(mask_threads() if threads is None else threads,
                 max(1, flat.size // MASK_PIECE_WORDS))
    cuts = [flat.size * i // pieces // per16 * per16 for i in range(pieces)] + [flat.size]
    empty = np.zeros(0, np.uint64)

    def piece(i):
        a, b = cuts[i], cuts[i + 1]
        return impl.secagg_mask(flat[a:b], scalars if i == pieces - 1 else empty, keys,
                                subtract, None if xf is None else xf[a:b], float(clip), scale,
                                int(weight), (seed + a * _GOLDEN64) & _U64, bool(stochastic),
                                a * flat.itemsize // 16)

    pool = None if pieces == 1 else _mask_pool()
    with openssl():          # the pieces run OpenSSL in this thread or the pool's
        done = [piece(0)] if pool is None else list(pool.map(piece, range(pieces)))
    if not all(done):
        raise KernelError("secagg_mask: OpenSSL's AES-CTR failed in the C core")
    return words


_U64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN64 = 0x9E3779B97F4A7C15
MASK_PIECE_WORDS = 1 << 17          # a piece of fewer words is not worth a thread hand-off


def mask_threads() -> int:
    """Threads secagg_mask uses in C: EDGEFL_MASK_THREADS, else the usable cores."""
    env = os.environ.get("EDGEFL_MASK_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise KernelError(f"EDGEFL_MASK_THREADS={env!r}: must be a whole number") from None
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _mask_pool():
    """The mask threads, made on first use (again in a forked child, whose copy of the pool
    has no threads, and when EDGEFL_MASK_THREADS asks for more)."""
    want = mask_threads()
    pool, pid = _MASKS.get("pool"), _MASKS.get("pid")
    if pool is None or pid != os.getpid() or pool._max_workers < want:
        with _MASKS["lock"]:
            pool, pid = _MASKS.get("pool"), _MASKS.get("pid")
            if pool is None or pid != os.getpid() or pool._max_workers < want:
                from concurrent.futures import ThreadPoolExecutor
                pool = _MASKS["pool"] = ThreadPoolExecutor(want, thread_name_prefix="edgefl-masks")
                _MASKS["pid"] = os.getpid()
    return pool


def dequantize(out: np.ndarray, words: np.ndarray, unit: float) -> np.ndarray:
    """out = (words read as signed integers) * unit, rounded once to float32."""
    _ring_bits("words", words)
    check_array("words", words, words.dtype)
    check_array("out", out, np.float32, size=words.size, writable=True)
    impl.dequantize(out, words, float(unit))
    return out


def f32_to_f16(out: np.ndarray, x: np.ndarray) -> np.ndarray:
    check_array("x", x, np.float32)
    check_array("out", out, np.uint16, size=x.size, writable=True)
    impl.f32_to_f16(out, x)
    return out


def f16_to_f32(out: np.ndarray, h: np.ndarray) -> np.ndarray:
    check_array("h", h, np.uint16)
    check_array("out", out, np.float32, size=h.size, writable=True)
    impl.f16_to_f32(out, h)
    return out


def _check_segments(seg_offsets, n: int) -> np.ndarray:
    seg = check_array("seg_offsets", seg_offsets, np.int64, ndim=1)
    if seg.size < 2 or seg[0] != 0 or seg[-1] != n or np.any(np.diff(seg) < 0):
        raise KernelError(f"seg_offsets: must rise from 0 to {n}, got {seg.tolist()[:8]}...")
    return seg


def f32_to_i8(out: np.ndarray, scales: np.ndarray, x: np.ndarray, seg_offsets) -> np.ndarray:
    """Symmetric int8 with one scale per segment (layer)."""
    check_array("x", x, np.float32)
    check_array("out", out, np.int8, size=x.size, writable=True)
    seg = _check_segments(seg_offsets, x.size)
    check_array("scales", scales, np.float32, size=seg.size - 1, writable=True)
    impl.f32_to_i8(out, scales, x, seg)
    return out


def i8_to_f32(out: np.ndarray, q: np.ndarray, scales: np.ndarray, seg_offsets) -> np.ndarray:
    check_array("q", q, np.int8)
    check_array("out", out, np.float32, size=q.size, writable=True)
    seg = _check_segments(seg_offsets, q.size)
    check_array("scales", scales, np.float32, size=seg.size - 1)
    impl.i8_to_f32(out, q, scales, seg)
    return out


# ---------------------------------------------------------------------------------------
# networks
# ---------------------------------------------------------------------------------------

def _check_net(model):
    layers = getattr(model, "layers", None)
    if not isinstance(layers, np.ndarray) or layers.dtype != np.int64 or layers.ndim != 2:
        raise KernelError("model: not an edgefl Model (no int64 layer program)")
    return model


def check_inputs(model, x, what: str = "x") -> np.ndarray:
    """x must be float32, C-contiguous, (n, *input_shape) or any shape with that per-sample size."""
    _check_net(model)
    check_array(what, x, np.float32)
    if x.ndim < 1 or x.shape[0] == 0:
        raise KernelError(f"{what}: no samples (shape {x.shape})")
    per_sample = int(np.prod(x.shape[1:], dtype=np.int64)) if x.ndim > 1 else 1
    if per_sample != model.in_size:
        raise KernelError(f"{what}: samples of shape {x.shape[1:]} ({per_sample} values) do not fit "
                          f"model {model.kind} with input shape {model.input_shape} "
                          f"({model.in_size} values)")
    return x


def labels_and_targets(model, y, n: int, what: str = "y"):
    """Split y into (int32 labels, None) for classification losses or (None, float32 targets)
    for MSE. MSE on integer labels with one output uses y = +1 for label 1 and -1 otherwise
    (MFL's even/odd linear regression, Liu et al. 2020, Sec. 3.1 and 7.1)."""
    if not isinstance(y, np.ndarray):
        raise KernelError(f"{what}: expected a numpy array, got {type(y).__name__}")
    if y.ndim == 0:
        raise KernelError(f"{what}: a scalar (shape ()), not one label a sample")
    if y.shape[0] != n:
        raise KernelError(f"{what}: {y.shape[0]} labels for {n} samples")
    if model.loss == 3:  # MSE
        if np.issubdtype(y.dtype, np.integer):
            if model.n_out != 1:
                # one-hot: a label outside 0..n_out-1 would index past the row, and a
                # negative one would set a column from the end
                if y.ndim != 1 or (y.size and (int(y.min()) < 0
                                               or int(y.max()) >= model.n_out)):
                    raise KernelError(f"{what}: labels span [{int(y.min())}, {int(y.max())}] "
                                      f"but model {model.kind} with {model.n_out} outputs "
                                      f"takes 0..{model.n_out - 1}")
                t = np.zeros((n, model.n_out), dtype=np.float32)
                t[np.arange(n), y] = 1.0
            else:
                t = np.where(y == 1, 1.0, -1.0).astype(np.float32)
        else:
            t = np.ascontiguousarray(y, dtype=np.float32)
        if t.size != n * model.n_out:
            raise KernelError(f"{what}: targets of shape {y.shape} for {model.n_out} outputs")
        if not np.all(np.isfinite(t)):
            raise KernelError(f"{what}: targets are not all finite")
        return None, t.reshape(n, model.n_out)
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise KernelError(f"{what}: class labels must be a 1-D integer array, got {y.dtype} {y.shape}")
    hi = 2 if model.n_out == 1 else model.n_out
    if y.size and (int(y.min()) < 0 or int(y.max()) >= hi):
        raise KernelError(f"{what}: labels span [{int(y.min())}, {int(y.max())}] but model "
                          f"{model.kind} takes 0..{hi - 1}")
    return np.ascontiguousarray(y, dtype=np.int32), None


def _check_params(model, params, what="params", writable=False):
    check_array(what, params, np.float32, writable=writable)
    if params.size != model.n_params:
        raise KernelError(f"{what}: {params.size} values but model {model.kind} has "
                          f"{model.n_params} parameters (layer table {model.table.digest[:12]})")
    return params


def workspace_bytes(model, batch_size: int, n: int) -> int:
    """Bytes the backend holds at once, beyond the parameters and the data, for a local round
    of `model` on n samples with minibatches of batch_size (<= 0: the whole set): the
    activations, the conv layers' columns, the gradients and the shuffle. What a board
    checks against its memory budget before it trains a run's model."""
    _check_net(model)
    return int(impl.workspace_bytes(model, int(batch_size), int(n)))


def forward(model, params, x) -> np.ndarray:
    """Network scores (logits, or the raw output for regression), shape (n, n_out)."""
    _check_params(model, params)
    check_inputs(model, x)
    out = np.empty((x.shape[0], model.n_out), dtype=np.float32)
    impl.forward(out, model, params, x)
    return out


def loss_grad(model, params, x, y):
    """(mean loss including the L2 term, gradient buffer) over all of x."""
    _check_params(model, params)
    check_inputs(model, x)
    labels, targets = labels_and_targets(model, y, x.shape[0])
    grad = np.empty(model.n_params, dtype=np.float32)
    loss = impl.loss_grad(grad, model, params, x, labels, targets)
    return loss, grad


class Samples:
    """A data set checked once against a model, as the kernels take it: x (float32,
    C-contiguous, the model's input size per sample) and int32 labels or float32 targets,
    both private read-only copies of what the caller passed as y, so the check cannot go
    stale. A client trains on the same shard every round and the aggregator evaluates on
    the same test set: `train_samples` and `evaluate_samples` skip the per-call checks and
    conversions that `local_train` and `evaluate` repeat (issue #3's overhead target)."""
    __slots__ = ("model", "x", "labels", "targets")

    def __init__(self, model, x, y):
        check_inputs(model, x)
        labels, targets = labels_and_targets(model, y, x.shape[0])
        self.model, self.x = model, x
        self.labels = None if labels is None else _read_only(labels, y)
        self.targets = None if targets is None else _read_only(targets, y)

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    def rows(self, start: int, stop: int) -> "Samples":
        """Samples start..stop-1 of this checked set, as views and without a check: rows of
        checked arrays are checked (a simulation checks its whole training set once and
        hands each client its shard this way, edgefl.runs.prepare.ShardClients)."""
        # once per client trained per round (ShardClients): ints pass as they are
        if type(start) is not int or type(stop) is not int:
            start, stop = int(start), int(stop)
        if not 0 <= start < stop <= self.x.shape[0]:
            raise KernelError(f"Samples.rows: {start}..{stop} is not a non-empty range of "
                              f"the {self.n} samples")
        out = object.__new__(Samples)
        out.model, out.x = self.model, self.x[start:stop]
        out.labels = None if self.labels is None else self.labels[start:stop]
        out.targets = None if self.targets is None else self.targets[start:stop]
        return out


def _read_only(a: np.ndarray, source) -> np.ndarray:
    """`a`, or a copy of it when it shares memory with the caller's `source`, made read-only."""
    if isinstance(source, np.ndarray) and np.shares_memory(a, source):
        a = a.copy()
    a.flags.writeable = False
    return a


def evaluate(model, params, x, y) -> dict:
    """Mean loss (with the L2 term) and accuracy on a data set, computed by the kernels."""
    return evaluate_samples(Samples(model, x, y), params)


def evaluate_samples(data: Samples, params) -> dict:
    """`evaluate` on a data set checked once (`Samples`)."""
    model = data.model
    _check_params(model, params)
    loss_sum, correct = impl.evaluate(model, params, data.x, data.labels, data.targets)
    l2 = 0.0
    if model.l2:
        for row in model.layers:
            if row[0] in (1, 2):
                n_w = int(row[1] * row[2] * row[3] * row[4]) if row[0] == 1 else \
                    int(row[4] * row[1] * row[7] * row[7])
                w = params[int(row[10]):int(row[10]) + n_w]
                l2 += 0.5 * model.l2 * float(np.dot(w.astype(np.float64), w))
    n = data.n
    return {"loss": loss_sum / n + l2, "accuracy": correct / n, "correct": int(correct), "n": n}


TRAIN_DEFAULTS = dict(lr=0.01, momentum=0.0, weight_decay=0.0, prox_mu=0.0, batch_size=32,
                      epochs=1, steps=0, grad0_mode=0, seed=0)
GRAD0_MODES = {"none": 0, "batch": 1, "full": 2}


def train_config(**kw) -> dict:
    """Validated local-round hyper-parameters (see ef_train_cfg in csrc/edgefl.h)."""
    unknown = set(kw) - set(TRAIN_DEFAULTS)
    if unknown:
        raise KernelError(f"train config: unknown key(s) {sorted(unknown)}; valid: {sorted(TRAIN_DEFAULTS)}")
    cfg = dict(TRAIN_DEFAULTS, **kw)
    if isinstance(cfg["grad0_mode"], str):
        if cfg["grad0_mode"] not in GRAD0_MODES:
            raise KernelError(f"train config: grad0_mode {cfg['grad0_mode']!r}; valid: {list(GRAD0_MODES)}")
        cfg["grad0_mode"] = GRAD0_MODES[cfg["grad0_mode"]]
    for key in ("lr", "momentum", "weight_decay", "prox_mu"):
        cfg[key] = float(cfg[key])
        if not np.isfinite(cfg[key]) or cfg[key] < 0:
            raise KernelError(f"train config: {key} = {cfg[key]} must be finite and >= 0")
    if cfg["momentum"] >= 1:
        raise KernelError(f"train config: momentum = {cfg['momentum']} must be < 1")
    for key in ("batch_size", "epochs", "steps", "grad0_mode", "seed"):
        cfg[key] = int(cfg[key])
    # int32 in the C core's ef_train_cfg (the binding raised an OverflowError naming no key)
    for key in ("batch_size", "epochs", "steps"):
        if not -2 ** 31 <= cfg[key] < 2 ** 31:
            raise KernelError(f"train config: {key} = {cfg[key]} must be within int32 "
                              f"(|{key}| < 2^31)")
    if cfg["steps"] < 0 or cfg["epochs"] < 0 or (cfg["steps"] == 0 and cfg["epochs"] == 0):
        raise KernelError(f"train config: need epochs > 0 or steps > 0 (got epochs={cfg['epochs']}, "
                          f"steps={cfg['steps']})")
    if cfg["grad0_mode"] not in (0, 1, 2):
        raise KernelError(f"train config: grad0_mode {cfg['grad0_mode']} not in 0, 1, 2")
    if not 0 <= cfg["seed"] < 2 ** 64:
        raise KernelError(f"train config: seed {cfg['seed']} must be in [0, 2**64)")
    return cfg


def planned_steps(cfg: dict, n: int) -> int:
    bs = n if cfg["batch_size"] <= 0 or cfg["batch_size"] >= n else cfg["batch_size"]
    return cfg["steps"] if cfg["steps"] > 0 else cfg["epochs"] * -(-n // bs)


class StopFlag:
    """A stop request that local training sees within one step. It is a threading.Event (set,
    is_set, wait, clear) and a one-element int32 array, the stop word, that `local_train`
    hands to the kernel: the C loop (and the NumPy twin) reads it before every step, with
    the interpreter lock released, so a thread other than the training one -- a signal's
    watcher (edgefl.service.signals), a role's main loop -- stops a long local round without
    waiting for it to end. A stopped round raises TrainingStopped with the steps it did."""

    def __init__(self):
        self._event = threading.Event()
        # the kernel keeps a pointer to this buffer while it trains: never replaced
        self.word = np.zeros(1, dtype=np.int32)

    def set(self) -> None:
        self.word[0] = 1            # first: the training thread may be the one that waits
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def clear(self) -> None:
        self._event.clear()
        self.word[0] = 0

    def stop_after_steps(self, steps: int) -> None:
        """Stop every local round that sees this flag after exactly `steps` steps, without
        setting the event: the deterministic stop of the tests (edgefl.h, ef_train_cfg.stop)."""
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
            raise KernelError(f"stop_after_steps: steps = {steps!r}, need an integer >= 0")
        self.word[0] = int(steps) + 1


def local_train(model, params, x, y, cfg: dict, momentum=None, grad0=None, grad_sum=None,
                step_stats=None, anchor=None, stop: StopFlag | None = None) -> dict:
    """One local round in one kernel call; params (and momentum, grad0, grad_sum, step_stats)
    are updated in place. cfg comes from train_config(). With cfg["prox_mu"] > 0 every step
    adds the proximal gradient prox_mu * (w - anchor) (FedProx): `anchor` is the round's start
    point, read and never written, a buffer of its own (not `params`, which moves away from
    it). `stop`: a StopFlag read before every step. Raises NonFiniteError naming the step,
    TrainingStopped (the steps done) when `stop` stopped the round."""
    return train_samples(Samples(model, x, y), params, cfg, momentum=momentum, grad0=grad0,
                         grad_sum=grad_sum, step_stats=step_stats, anchor=anchor, stop=stop)


def train_samples(data: Samples, params, cfg: dict, momentum=None, grad0=None, grad_sum=None,
                  step_stats=None, anchor=None, stop: StopFlag | None = None) -> dict:
    """`local_train` on a data set checked once (`Samples`)."""
    if stop is not None and not isinstance(stop, StopFlag):
        raise KernelError(f"stop: need an edgefl.kernels.StopFlag, got {type(stop).__name__}")
    model = data.model
    # once per client per round: the usual params (a fresh private float32 buffer) pass
    # these tests, which are check_array's, without its call; anything else gets its message
    if not (type(params) is np.ndarray and params.dtype is _F32
            and params.size == model.n_params and (flags := params.flags).c_contiguous
            and flags.writeable and flags.aligned):
        _check_params(model, params, writable=True)
    if cfg.get("momentum", 0.0) and momentum is None:
        raise KernelError("momentum: a momentum buffer is required when momentum > 0")
    if cfg.get("prox_mu", 0.0):
        if anchor is None:
            raise KernelError(f"anchor: the proximal term (prox_mu = {cfg['prox_mu']}) needs "
                              f"the round's start point as anchor")
        _check_params(model, anchor, "anchor")
        if np.may_share_memory(anchor, params):
            raise KernelError("anchor: shares memory with params, which training overwrites; "
                              "pass the round's start point as a buffer of its own")
    if momentum is not None:
        _check_params(model, momentum, "momentum", writable=True)
    if grad0 is not None:
        _check_params(model, grad0, "grad0", writable=True)
    if grad_sum is not None:
        _check_params(model, grad_sum, "grad_sum", writable=True)
    if step_stats is not None:
        check_array("step_stats", step_stats, np.float64, ndim=2, writable=True)
        if step_stats.shape[1] != 3:
            raise KernelError(f"step_stats: shape {step_stats.shape}, need (steps, 3)")
        if grad0 is None:
            raise KernelError("step_stats: needs grad0 (the start-point gradient)")
    return impl.local_train(params, momentum, model, data.x, data.labels, data.targets, cfg,
                            grad0=grad0, grad_sum=grad_sum, step_stats=step_stats, anchor=anchor,
                            stop_word=None if stop is None else stop.word)


def shuffle(seed: int, epoch: int, n: int) -> np.ndarray:
    """The permutation local_train visits samples in for (seed, epoch)."""
    seed, epoch, n = int(seed), int(epoch), int(n)
    if not 0 <= seed < 2 ** 64:
        raise KernelError(f"shuffle: seed {seed} must be in [0, 2^64)")
    if not 0 <= epoch < 2 ** 63:
        raise KernelError(f"shuffle: epoch {epoch} must be in [0, 2^63)")
    if n < 0:
        raise KernelError(f"shuffle: n {n} must be >= 0")
    return impl.shuffle(seed, epoch, n)
