"""Vector kernels and codecs: the C core against its NumPy twin, their semantics, and the
argument checks in edgefl.kernels.

Every parity test calls the public edgefl.kernels function twice on identical arguments, once
with the compiled core as backend and once with edgefl.reference, then compares every
argument the kernel may write (and checks that the inputs were left alone).
"""
import contextlib
import math

import numpy as np
import pytest

from edgefl import kernels, reference
from edgefl.kernels import KernelError

try:
    from edgefl import (
        _blas,  # noqa: F401  (as kernels._load_c does)
        _core,
    )
    _NO_CORE = None
except ImportError as exc:  # the extension was not built (a non-strict install)
    _core = None
    _NO_CORE = (f"edgefl._core cannot be imported ({exc}); build it with "
                f"`EDGEFL_STRICT_BUILD=1 python setup.py build_ext --inplace` (CI does)")

needs_core = pytest.mark.skipif(_core is None, reason=_NO_CORE or "")

# How the C result must match reference.py on the same input, per kernel.
#   "bits": identical bit patterns (NaNs included).
#   ulp=n:  float32 results within n units in the last place (-0.0 == +0.0; NaN where NaN).
#   rtol=r: float64 scalars within relative error r.
TOLERANCE = {
    # Same float64 products and sums in k order, one rounding. Equal in practice; 1 ulp leaves
    # room for a compiler that contracts a*b+c into an FMA (setup.py's -std=c99 does not).
    "weighted_sum": {"ulp": 1},
    # float32 y + a*x; exact without FMA contraction, 1 ulp as above.
    "axpy": {"ulp": 1},
    "scale": {"ulp": 0},
    # Same 8-lane float64 order (vec.c); products are exact. The twin's lane sums use numpy's
    # axis-0 reduction, which is sequential; rtol only guards against a numpy that is not.
    "dot": {"rtol": 1e-12},
    "sqnorm": {"rtol": 1e-12},
    # Same sort and same arithmetic: float32 (a+b)*0.5 for even K; for the trimmed mean a
    # float64 sum in ascending order and one rounding. Exact, up to the sign of a zero (the
    # order of -0.0 and +0.0 after sorting is not specified).
    "median": {"ulp": 0},
    "trimmed_mean": {"ulp": 0},
    "f32_to_f16": "bits",
    "f16_to_f32": "bits",
    "f32_to_i8": "bits",  # q and scales
    "i8_to_f32": "bits",
}

RNG_SEED = 20240601
SIZES = [0, 1, 7, 8, 9, 127, 128, 129, 1025, 5003]  # dot lanes of 8, sum blocks of 128


@contextlib.contextmanager
def backend(impl):
    saved = kernels.impl
    kernels.impl = impl
    try:
        yield
    finally:
        kernels.impl = saved


def _ordered(a: np.ndarray) -> np.ndarray:
    """float32 -> int64 that orders like the floats (so differences count ulps)."""
    i = np.ascontiguousarray(a, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def assert_matches(kernel: str, got, want, what: str = "out"):
    tol = TOLERANCE[kernel]
    if tol == "bits":
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        u = np.dtype(f"u{got.dtype.itemsize}")
        bad = np.flatnonzero(got.reshape(-1).view(u) != want.reshape(-1).view(u))
        assert bad.size == 0, (f"{kernel} {what}: {bad.size} elements differ, first at {bad[0]}: "
                               f"C {got.reshape(-1)[bad[0]]!r} numpy {want.reshape(-1)[bad[0]]!r}")
    elif "rtol" in tol:
        assert math.isclose(got, want, rel_tol=tol["rtol"], abs_tol=1e-300), \
            f"{kernel}: C {got!r} numpy {want!r}"
    else:
        got = np.asarray(got, dtype=np.float32).reshape(-1)
        want = np.asarray(want, dtype=np.float32).reshape(-1)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{kernel} {what}: NaNs")
        ok = ~np.isnan(want)
        d = np.abs(_ordered(got[ok]) - _ordered(want[ok]))
        worst = int(d.max()) if d.size else 0
        assert worst <= tol["ulp"], f"{kernel} {what}: {worst} ulp apart (allowed {tol['ulp']})"


def _copy(a):
    if isinstance(a, np.ndarray):
        return a.copy()
    if isinstance(a, list):
        return [_copy(v) for v in a]
    return a


def _read_only(a):
    if isinstance(a, np.ndarray):
        a.setflags(write=False)
    elif isinstance(a, list):
        for v in a:
            _read_only(v)
    return a


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b


def run_both(kernel: str, args: list, outputs: tuple):
    """Calls kernels.<kernel>(*args) with each backend on fresh copies of args.

    Arguments whose index is in `outputs` are written by the kernel; the others are inputs,
    made read-only (so the C wrappers must accept read-only buffers) and checked unchanged.
    Returns (C return value, C args, reference return value, reference args).
    """
    results = []
    for impl in (_core, reference):
        a = [_copy(v) for v in args]
        for i, v in enumerate(a):
            if i not in outputs:
                _read_only(v)
        with backend(impl):
            ret = getattr(kernels, kernel)(*a)
        for i, v in enumerate(a):
            if i not in outputs:
                assert _same(v, args[i]), f"{kernel}: {impl.__name__} changed input argument {i}"
        results += [ret, a]
    return tuple(results)


def _values(rng, n, spread=3.0):
    """float32 values over several decades, both signs (stresses every rounding)."""
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-spread, spread, n)).astype(np.float32)


# ---------------------------------------------------------------------------------------
# parity: C core == NumPy twin
# ---------------------------------------------------------------------------------------

@needs_core
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 40])  # >= 13: prefetch
@pytest.mark.parametrize("n", SIZES)
def test_weighted_sum_parity(k, n):
    rng = np.random.default_rng([RNG_SEED, k, n])
    xs = [_values(rng, n) for _ in range(k)]
    w = rng.uniform(-1.0, 2.0, k)
    out = np.full(n, np.nan, np.float32)
    _, (out_c, *_), _, (out_r, *_) = run_both("weighted_sum", [out, xs, w], outputs=(0,))
    assert_matches("weighted_sum", out_c, out_r)


@needs_core
def test_weighted_sum_any_shape_and_in_place():
    rng = np.random.default_rng(RNG_SEED)
    xs = [_values(rng, 3 * 1500).reshape(3, 1500) for _ in range(6)]
    w = rng.uniform(0.0, 1.0, 6)
    want = np.empty((3, 1500), np.float32)
    with backend(reference):
        kernels.weighted_sum(want, xs, w)
    for impl in (_core, reference):
        ys = [x.copy() for x in xs]
        with backend(impl):
            kernels.weighted_sum(ys[2], ys, w)  # out is one of the inputs
        assert_matches("weighted_sum", ys[2], want, f"in place ({impl.__name__})")
        assert all(_same(ys[i], xs[i]) for i in (0, 1, 3, 4, 5))


@needs_core
@pytest.mark.parametrize("n", SIZES)
def test_axpy_scale_parity(n):
    rng = np.random.default_rng([RNG_SEED, n])
    y, x = _values(rng, n), _values(rng, n)
    for a in (0.0, -1.0, 0.37, 3.0e5):
        _, (y_c, _, _), _, (y_r, _, _) = run_both("axpy", [y, x, a], outputs=(0,))
        assert_matches("axpy", y_c, y_r)
        _, (x_c, _), _, (x_r, _) = run_both("scale", [x, a], outputs=(0,))
        assert_matches("scale", x_c, x_r)


@needs_core
@pytest.mark.parametrize("n", SIZES + [100_003])
def test_dot_sqnorm_parity(n):
    rng = np.random.default_rng([RNG_SEED, n])
    x, y = _values(rng, n), _values(rng, n)
    d_c, _, d_r, _ = run_both("dot", [x, y], outputs=())
    s_c, _, s_r, _ = run_both("sqnorm", [x], outputs=())
    assert isinstance(d_c, float) and isinstance(s_c, float)
    assert_matches("dot", d_c, d_r)
    assert_matches("sqnorm", s_c, s_r)
    exact = math.fsum(float(a) * float(b) for a, b in zip(x.tolist(), y.tolist()))
    assert math.isclose(d_c, exact, rel_tol=1e-9, abs_tol=1e-9 * s_c)


@needs_core
@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 300_001])   # 4096-float blocks; the
def test_first_nonfinite_parity(n):                              # GIL released >= 262144
    rng = np.random.default_rng([RNG_SEED, n, 7])
    x = _values(rng, n)
    x[rng.random(n) < 0.01] = 0.0                        # zeros, denormals, huge: all finite
    if n:
        x[rng.integers(n)] = np.float32(1e-42)
        x[rng.integers(n)] = np.finfo(np.float32).max
    c, _, r, _ = run_both("first_nonfinite", [x], outputs=())
    assert c is None and r is None
    specials = [np.nan, np.inf, -np.inf, np.frombuffer(b"\x01\x00\xc0\xff", np.float32)[0]]
    for at in sorted({0, n // 2, n - 1, 4095, 4096} & set(range(n))):
        for bad in specials:
            y = x.copy()
            y[at] = bad
            if at + 7 < n:
                y[at + 7] = np.nan                      # a later one never wins
            c, _, r, _ = run_both("first_nonfinite", [y], outputs=())
            assert c == r == at, (at, bad, c, r)


def test_first_nonfinite_checks_its_argument():
    with pytest.raises(KernelError, match="dtype float64"):
        kernels.first_nonfinite(np.zeros(3))
    with pytest.raises(KernelError, match="C-contiguous"):
        kernels.first_nonfinite(np.zeros((4, 4), np.float32)[:, 1])
    assert kernels.first_nonfinite(np.array([[1, 2], [3, np.inf]], np.float32)) == 3


def _misaligned(n, dtype):
    """n elements of `dtype` starting one byte into an allocation: a view NumPy accepts
    (C-contiguous, writable) whose data pointer is not aligned for the type."""
    a = np.zeros(n * np.dtype(dtype).itemsize + 1, np.uint8)[1:].view(dtype)
    assert not a.flags.aligned
    return a


@pytest.mark.parametrize("impl", [pytest.param(_core, marks=needs_core, id="c"),
                                  pytest.param(reference, id="numpy")])
def test_misaligned_buffers_are_refused_naming_the_argument(impl):
    """The C kernels read float32/uint64 through typed pointers: a buffer not aligned for its
    type is undefined behaviour there (UBSan reports it; an armhf NEON load may fault), so
    edgefl.kernels refuses it before either backend runs, as it does a strided one."""
    with backend(impl):
        with pytest.raises(KernelError, match=r"x: array is not aligned for float32"):
            kernels.axpy(np.zeros(9, np.float32), _misaligned(9, np.float32), 1.0)
        with pytest.raises(KernelError, match=r"y: array is not aligned for float32"):
            kernels.axpy(_misaligned(9, np.float32), np.zeros(9, np.float32), 1.0)
        with pytest.raises(KernelError, match=r"xs\[1\]: array is not aligned"):
            kernels.median(np.zeros(9, np.float32), [np.zeros(9, np.float32),
                                                      _misaligned(9, np.float32)])
        with pytest.raises(KernelError, match=r"h: array is not aligned for uint16"):
            kernels.f16_to_f32(np.zeros(9, np.float32), _misaligned(9, np.uint16))
        with pytest.raises(KernelError, match=r"m: array is not aligned for uint64"):
            kernels.ring_add(np.zeros(9, np.uint64), _misaligned(9, np.uint64))


def _robust_inputs(rng, k, n, ties):
    if ties:  # many equal values per coordinate
        return [rng.integers(-3, 4, n).astype(np.float32) for _ in range(k)]
    return [_values(rng, n) for _ in range(k)]


@needs_core
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 9, 32, 33, 40])  # > 32: the heapsort path
@pytest.mark.parametrize("ties", [False, True])
def test_median_parity(k, ties):
    rng = np.random.default_rng([RNG_SEED, k, ties])
    n = 777
    xs = _robust_inputs(rng, k, n, ties)
    out = np.full(n, np.nan, np.float32)
    _, (out_c, _), _, (out_r, _) = run_both("median", [out, xs], outputs=(0,))
    assert_matches("median", out_c, out_r)
    np.testing.assert_array_equal(out_c, np.median(np.stack(xs), axis=0))


@needs_core
@pytest.mark.parametrize("k,trim", [(1, 0), (2, 0), (3, 1), (5, 2), (8, 1), (10, 3), (33, 5),
                                    (40, 0), (40, 19)])
@pytest.mark.parametrize("ties", [False, True])
def test_trimmed_mean_parity(k, trim, ties):
    rng = np.random.default_rng([RNG_SEED, k, trim, ties])
    n = 777
    xs = _robust_inputs(rng, k, n, ties)
    out = np.full(n, np.nan, np.float32)
    _, (out_c, _, _), _, (out_r, _, _) = run_both("trimmed_mean", [out, xs, trim], outputs=(0,))
    assert_matches("trimmed_mean", out_c, out_r)


@needs_core
@pytest.mark.parametrize("k", range(2, 15))
def test_sorting_network_sorts_every_zero_one_column(k):
    """The 0-1 principle: a comparator network that sorts all 2^K columns of zeros and ones
    sorts everything; coordinate j holds the bits of j."""
    j = np.arange(1 << k)
    xs = [((j >> i) & 1).astype(np.float32) for i in range(k)]
    for kernel, args in (("median", []), ("trimmed_mean", [(k - 1) // 2]), ("trimmed_mean", [k // 4])):
        out = np.empty(j.size, np.float32)
        _, (out_c, *_), _, (out_r, *_) = run_both(kernel, [out, xs, *args], outputs=(0,))
        assert_matches(kernel, out_c, out_r)


@needs_core
@pytest.mark.parametrize("k", [255, 1024, 1025])  # tile widths 16 and 4; > 1024: heapsort
def test_robust_means_many_buffers(k):
    rng = np.random.default_rng([RNG_SEED, k])
    xs = _robust_inputs(rng, k, 37, ties=False)
    for kernel, args in (("median", []), ("trimmed_mean", [k // 3])):
        out = np.empty(37, np.float32)
        _, (out_c, *_), _, (out_r, *_) = run_both(kernel, [out, xs, *args], outputs=(0,))
        assert_matches(kernel, out_c, out_r)


@needs_core
def test_robust_means_with_nan_and_inf():
    xs = [np.array([np.nan, 1.0, np.inf, -np.inf, 2.0], np.float32),
          np.array([0.0, 2.0, 1.0, 1.0, 3.0], np.float32),
          np.array([1.0, 3.0, 2.0, 2.0, np.nan], np.float32),
          np.array([2.0, 4.0, 3.0, 3.0, 1.0], np.float32)]
    for kernel, args in (("median", []), ("trimmed_mean", [1])):
        out = np.zeros(5, np.float32)
        _, (out_c, *_), _, (out_r, *_) = run_both(kernel, [out, xs, *args], outputs=(0,))
        assert_matches(kernel, out_c, out_r)
        assert np.isnan(out_c[0]) and np.isnan(out_c[4])  # a NaN anywhere gives NaN
    np.testing.assert_array_equal(out_c[1:4], [2.5, 2.5, 1.5])  # trimmed: middle two of four


# ---------------------------------------------------------------------------------------
# f16 codec
# ---------------------------------------------------------------------------------------

def _numpy_f16_bits(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x.astype(np.float16).view(np.uint16)


def _c_f16(x):
    out = np.empty(x.size, np.uint16)
    with backend(_core):
        kernels.f32_to_f16(out, x)
    return out


def _c_f32(h):
    out = np.empty(h.size, np.float32)
    with backend(_core):
        kernels.f16_to_f32(out, h)
    return out


def _assert_f16_like_numpy(x: np.ndarray, what: str):
    x = x[~np.isnan(x)]
    assert_matches("f32_to_f16", _c_f16(x), _numpy_f16_bits(x), what)


ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@needs_core
def test_f16_all_halves_round_trip():
    h = ALL_HALVES
    f = _c_f32(h)
    nan = np.isnan(h.view(np.float16))
    want = h.view(np.float16).astype(np.float32)
    assert_matches("f16_to_f32", f[~nan], want[~nan], "all finite and infinite halves")
    assert_matches("f32_to_f16", _c_f16(f)[~nan], h[~nan], "round trip")
    # NaN halves: still NaN, quiet, same sign, payload kept
    fb = f[nan].view(np.uint32)
    assert np.isnan(f[nan]).all() and np.all(fb & 0x00400000)
    np.testing.assert_array_equal(fb >> 31, h[nan] >> 15)
    np.testing.assert_array_equal((fb >> 13) & 0x3FF, (h[nan] & 0x3FF) | 0x200)
    # the twin agrees bit for bit, NaNs included
    for name, arg, c in (("f16_to_f32", h, f), ("f32_to_f16", f, _c_f16(f))):
        out = np.empty(h.size, c.dtype)
        getattr(reference, name)(out, arg)
        assert_matches(name, c, out, "twin")


def _half_midpoints() -> np.ndarray:
    """The float32 values exactly halfway between neighbouring finite halves (where ties to
    even decide), including 0..min subnormal and 65504..65536 (the overflow threshold)."""
    pos = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    nxt = np.append(pos[1:], 65536.0)
    mid = ((pos + nxt) / 2).astype(np.float32)  # 12 significant bits: exact in float32
    assert np.array_equal(mid.astype(np.float64), (pos + nxt) / 2)
    return np.concatenate([mid, -mid])


@needs_core
def test_f16_rounding_boundaries():
    mid = _half_midpoints()
    near = [mid]
    up, down = mid.copy(), mid.copy()
    for _ in range(3):  # 1, 2 and 3 ulps either side of every midpoint
        up = np.nextafter(up, np.float32(np.inf))
        down = np.nextafter(down, np.float32(-np.inf))
        near += [up, down]
    _assert_f16_like_numpy(np.concatenate(near), "midpoints +- 3 ulp")


@needs_core
def test_f16_random_and_special_floats():
    rng = np.random.default_rng(RNG_SEED)
    bits = rng.integers(0, 1 << 32, 4_000_000, dtype=np.uint64).astype(np.uint32)
    _assert_f16_like_numpy(bits.view(np.float32), "random bit patterns")
    # exponents around the half range: subnormal halves (2^-25..2^-14) up to overflow (2^16)
    e = rng.integers(100, 145, 4_000_000).astype(np.uint32)
    m = rng.integers(0, 1 << 23, 4_000_000, dtype=np.uint64).astype(np.uint32)
    s = rng.integers(0, 2, 4_000_000).astype(np.uint32)
    _assert_f16_like_numpy(((s << 31) | (e << 23) | m).view(np.float32), "half range")
    # a sweep of the whole float32 line with a prime stride
    sweep = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    _assert_f16_like_numpy(sweep, "stride sweep")
    f = np.float32
    special = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.996, 65520.0, 65536.0, 1e10,
                        np.finfo(f).max, -np.finfo(f).max, np.finfo(f).tiny,
                        np.finfo(f).smallest_subnormal, 2.0 ** -24, 2.0 ** -25, 2.0 ** -26,
                        1.5 * 2.0 ** -25, 2.0 ** -14, 1.0, -1.0], f)
    _assert_f16_like_numpy(special, "special values")
    np.testing.assert_array_equal(_c_f16(np.array([65519.996, 65520.0, -1e10, 2.0 ** -25], f)),
                                  [0x7BFF, 0x7C00, 0xFC00, 0x0000])


@needs_core
def test_f16_nan_is_quiet_nan():
    nan_bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF,
                         0x7F802000], np.uint32)
    h = _c_f16(nan_bits.view(np.float32))
    assert np.isnan(h.view(np.float16)).all()
    assert np.all(h & 0x0200), "NaN must come out quiet"
    np.testing.assert_array_equal(h >> 15, nan_bits >> 31)
    out = np.empty_like(h)
    reference.f32_to_f16(out, nan_bits.view(np.float32))
    assert_matches("f32_to_f16", h, out, "NaN twin")


@needs_core
@pytest.mark.parametrize("n", SIZES)
def test_f16_parity(n):
    rng = np.random.default_rng([RNG_SEED, n])
    x = _values(rng, n, spread=6.0)
    _, (h_c, _), _, (h_r, _) = run_both("f32_to_f16", [np.zeros(n, np.uint16), x], outputs=(0,))
    assert_matches("f32_to_f16", h_c, h_r)
    _, (f_c, _), _, (f_r, _) = run_both("f16_to_f32", [np.zeros(n, np.float32), h_c], outputs=(0,))
    assert_matches("f16_to_f32", f_c, f_r)


# ---------------------------------------------------------------------------------------
# int8 codec
# ---------------------------------------------------------------------------------------

def _segments(rng, n):
    """Offsets with empty, one-element, all-zero, tiny and huge segments mixed in."""
    cuts = np.sort(rng.integers(0, n + 1, 6)) if n else np.zeros(0, np.int64)
    seg = np.concatenate([[0, 0], cuts, [n, n]]).astype(np.int64)
    return seg


def _int8_input(rng, seg):
    n = int(seg[-1])
    x = _values(rng, n)
    kinds = ["normal", "zero", "tiny", "huge", "ties"]
    for s in range(seg.size - 1):
        lo, hi = int(seg[s]), int(seg[s + 1])
        kind = kinds[s % len(kinds)]
        if kind == "zero":
            x[lo:hi] = 0.0
        elif kind == "tiny":  # the scale underflows to 0 -> 1
            x[lo:hi] = np.float32(1e-45) * rng.integers(-3, 4, hi - lo)
        elif kind == "huge":
            x[lo:hi] *= np.float32(1e30)
        elif kind == "ties" and hi > lo:  # scale exactly 1: x = k + 1/2 decides half-even
            x[lo:hi] = rng.integers(-127, 127, hi - lo) + np.float32(0.5)
            x[lo] = 127.0
    return x


@needs_core
@pytest.mark.parametrize("n", SIZES)
def test_int8_parity(n):
    rng = np.random.default_rng([RNG_SEED, n])
    seg = _segments(rng, n)
    x = _int8_input(rng, seg)
    q0 = np.full(n, 99, np.int8)
    s0 = np.full(seg.size - 1, np.nan, np.float32)
    _, (q_c, s_c, _, _), _, (q_r, s_r, _, _) = run_both("f32_to_i8", [q0, s0, x, seg],
                                                        outputs=(0, 1))
    assert_matches("f32_to_i8", q_c, q_r, "q")
    assert_matches("f32_to_i8", s_c, s_r, "scales")
    _, (y_c, *_), _, (y_r, *_) = run_both("i8_to_f32", [np.full(n, np.nan, np.float32), q_c, s_c, seg],
                                          outputs=(0,))
    assert_matches("i8_to_f32", y_c, y_r)


@needs_core
def test_int8_half_even_and_clamp():
    x = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.0, 0.0], np.float32)
    q = np.zeros(x.size, np.int8)
    scales = np.zeros(1, np.float32)
    with backend(_core):
        kernels.f32_to_i8(q, scales, x, np.array([0, x.size], np.int64))
    assert scales[0] == 1.0
    np.testing.assert_array_equal(q, [127, 0, 2, 2, 0, -2, 126, -127, 0])


# ---------------------------------------------------------------------------------------
# semantics, on both backends
# ---------------------------------------------------------------------------------------

BACKENDS = [pytest.param(reference, id="numpy"),
            pytest.param(_core, id="c", marks=needs_core)]


def test_weighted_sum_refuses_more_or_fewer_weights_than_buffers():
    # a weight too many (a buffer left out of the list) must not be dropped silently: the
    # result would be a sum over the other buffers with the wrong weights
    x = np.ones(8, np.float32)
    out = np.empty_like(x)
    for w in ([0.5], [0.5, 0.5, -1.0]):
        with pytest.raises(KernelError, match=f"weights: {len(w)} weights for 2 buffers"):
            kernels.weighted_sum(out, [x, x], w)


@pytest.mark.parametrize("impl", BACKENDS)
def test_weighted_sum_of_identical_buffers_is_the_buffer(impl):
    rng = np.random.default_rng(RNG_SEED)
    x = _values(rng, 3001, spread=20.0)
    for w in ([1.0], [0.5, 0.5], [0.1] * 10, rng.dirichlet(np.ones(7))):
        out = np.empty_like(x)
        with backend(impl):
            kernels.weighted_sum(out, [x] * len(w), w)
        np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("k", [1, 2, 5, 6, 35])
def test_median_equals_numpy_median(impl, k):
    rng = np.random.default_rng([RNG_SEED, k])
    xs = [_values(rng, 500).reshape(20, 25) for _ in range(k)]
    out = np.empty((20, 25), np.float32)
    with backend(impl):
        kernels.median(out, xs)
    np.testing.assert_array_equal(out, np.median(np.stack(xs), axis=0))


@pytest.mark.parametrize("impl", BACKENDS)
def test_trimmed_mean_with_no_trim_is_the_mean(impl):
    rng = np.random.default_rng(RNG_SEED)
    xs = [_values(rng, 999) for _ in range(7)]
    out = np.empty(999, np.float32)
    with backend(impl):
        kernels.trimmed_mean(out, xs, 0)
    want = np.mean(np.stack(xs).astype(np.float64), axis=0).astype(np.float32)
    d = np.abs(_ordered(out) - _ordered(want))
    assert d.max() <= 1  # float64 sums in a different order, then one rounding


@pytest.mark.parametrize("impl", BACKENDS)
def test_int8_round_trip_error_is_at_most_half_a_step(impl):
    rng = np.random.default_rng(RNG_SEED)
    n = 20_000
    seg = np.array([0, 0, 10, 5000, 5001, 12_000, n], np.int64)
    x = _values(rng, n)
    x[10:5000] = 0.0
    q = np.empty(n, np.int8)
    scales = np.empty(seg.size - 1, np.float32)
    y = np.empty(n, np.float32)
    with backend(impl):
        kernels.f32_to_i8(q, scales, x, seg)
        kernels.i8_to_f32(y, q, scales, seg)
    assert np.all(np.abs(q.astype(int)) <= 127)
    for s in range(seg.size - 1):
        lo, hi = seg[s], seg[s + 1]
        top = np.abs(x[lo:hi]).max(initial=0.0)
        assert scales[s] == (np.float32(top) / np.float32(127) if top > 0 else 1.0)
        err = np.abs(y[lo:hi].astype(np.float64) - x[lo:hi])
        # half a step, plus the float32 roundings of x/scale and q*scale (each <= 127 * 2^-24)
        assert np.all(err <= scales[s] * (0.5 + 2e-5)), f"segment {s}: {err.max()} > {scales[s]}/2"


@pytest.mark.parametrize("impl", BACKENDS)
def test_f16_round_trip_equals_numpy(impl):
    rng = np.random.default_rng(RNG_SEED)
    x = _values(rng, 100_000, spread=8.0)
    h = np.empty(x.size, np.uint16)
    y = np.empty(x.size, np.float32)
    with backend(impl):
        kernels.f32_to_f16(h, x)
        kernels.f16_to_f32(y, h)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    np.testing.assert_array_equal(h, want.view(np.uint16))
    np.testing.assert_array_equal(y, want.astype(np.float32))


@pytest.mark.parametrize("impl", BACKENDS)
def test_arrays_of_any_shape_are_written_in_place(impl):
    rng = np.random.default_rng(RNG_SEED)
    x = _values(rng, 60).reshape(3, 4, 5)
    y = _values(rng, 60).reshape(3, 4, 5)
    seg = np.array([0, 20, 60], np.int64)
    flat = {}
    with backend(reference):
        flat["axpy"] = kernels.axpy(y.reshape(-1).copy(), x.reshape(-1), 0.5)
        flat["scale"] = kernels.scale(x.reshape(-1).copy(), 3.0)
        flat["f16"] = kernels.f32_to_f16(np.empty(60, np.uint16), x.reshape(-1))
        flat["i8"] = kernels.f32_to_i8(np.empty(60, np.int8), np.empty(2, np.float32),
                                      x.reshape(-1), seg)
    with backend(impl):
        got = {"axpy": kernels.axpy(y.copy(), x, 0.5), "scale": kernels.scale(x.copy(), 3.0),
               "f16": kernels.f32_to_f16(np.empty((3, 4, 5), np.uint16), x),
               "i8": kernels.f32_to_i8(np.empty((60, 1), np.int8), np.empty(2, np.float32), x, seg)}
    for name, want in flat.items():
        np.testing.assert_array_equal(got[name].reshape(-1), want, err_msg=name)


@pytest.mark.parametrize("impl", BACKENDS)
def test_empty_buffers(impl):
    e = np.empty(0, np.float32)
    with backend(impl):
        kernels.weighted_sum(np.empty(0, np.float32), [e, e], [0.5, 0.5])
        assert kernels.dot(e, e) == 0.0 and kernels.sqnorm(e) == 0.0
        scales = np.zeros(2, np.float32)
        kernels.f32_to_i8(np.empty(0, np.int8), scales, e, np.zeros(3, np.int64))
        np.testing.assert_array_equal(scales, [1.0, 1.0])


# ---------------------------------------------------------------------------------------
# argument checks (edgefl.kernels, before any backend)
# ---------------------------------------------------------------------------------------

def _f(n=8):
    return np.zeros(n, np.float32)


def _ro(a):
    a.setflags(write=False)
    return a


SEG = np.array([0, 3, 8], np.int64)
BAD_CALLS = [
    # wrong dtype
    ("out", lambda: kernels.weighted_sum(np.zeros(8), [_f()], [1.0])),
    ("xs[1]", lambda: kernels.median(_f(), [_f(), np.zeros(8, np.float64)])),
    ("x", lambda: kernels.axpy(_f(), np.zeros(8, np.int32), 1.0)),
    ("h", lambda: kernels.f16_to_f32(_f(), np.zeros(8, np.int16))),
    ("q", lambda: kernels.i8_to_f32(_f(), np.zeros(8, np.uint8), np.ones(2, np.float32), SEG)),
    ("seg_offsets", lambda: kernels.f32_to_i8(np.zeros(8, np.int8), np.ones(2, np.float32), _f(),
                                              SEG.astype(np.int32))),
    # not a numpy array
    ("y", lambda: kernels.dot(_f(), [0.0] * 8)),
    # non-contiguous
    ("xs[0]", lambda: kernels.weighted_sum(_f(), [_f(16)[::2]], [1.0])),
    ("x", lambda: kernels.scale(_f(16)[::2], 2.0)),
    ("out", lambda: kernels.f32_to_f16(np.zeros(16, np.uint16)[::2], _f())),
    ("x", lambda: kernels.sqnorm(_f(64).reshape(8, 8)[:, 0])),
    # wrong size
    ("xs[1]", lambda: kernels.weighted_sum(_f(), [_f(), _f(9)], [0.5, 0.5])),
    ("weights", lambda: kernels.weighted_sum(_f(), [_f(), _f()], [1.0])),
    ("weights", lambda: kernels.weighted_sum(_f(), [_f()], [np.nan])),
    ("x", lambda: kernels.axpy(_f(), _f(7), 1.0)),
    ("y", lambda: kernels.dot(_f(), _f(9))),
    ("out", lambda: kernels.f16_to_f32(_f(7), np.zeros(8, np.uint16))),
    ("scales", lambda: kernels.f32_to_i8(np.zeros(8, np.int8), np.ones(3, np.float32), _f(), SEG)),
    ("out", lambda: kernels.i8_to_f32(_f(9), np.zeros(8, np.int8), np.ones(2, np.float32), SEG)),
    # read-only output
    ("out", lambda: kernels.weighted_sum(_ro(_f()), [_f()], [1.0])),
    ("y", lambda: kernels.axpy(_ro(_f()), _f(), 1.0)),
    ("x", lambda: kernels.scale(_ro(_f()), 2.0)),
    ("out", lambda: kernels.median(_ro(_f()), [_f()])),
    ("out", lambda: kernels.f32_to_f16(_ro(np.zeros(8, np.uint16)), _f())),
    ("scales", lambda: kernels.f32_to_i8(np.zeros(8, np.int8), _ro(np.ones(2, np.float32)), _f(),
                                         SEG)),
    # bad trim
    ("trim", lambda: kernels.trimmed_mean(_f(), [_f()] * 4, 2)),
    ("trim", lambda: kernels.trimmed_mean(_f(), [_f()] * 4, -1)),
    ("trim", lambda: kernels.trimmed_mean(_f(), [_f()], 1)),
    # bad seg_offsets
    ("seg_offsets", lambda: kernels.f32_to_i8(np.zeros(8, np.int8), np.ones(2, np.float32), _f(),
                                              np.array([0, 3, 7], np.int64))),
    ("seg_offsets", lambda: kernels.f32_to_i8(np.zeros(8, np.int8), np.ones(2, np.float32), _f(),
                                              np.array([1, 3, 8], np.int64))),
    ("seg_offsets", lambda: kernels.i8_to_f32(_f(), np.zeros(8, np.int8), np.ones(2, np.float32),
                                              np.array([0, 5, 3, 8], np.int64))),
    ("seg_offsets", lambda: kernels.i8_to_f32(_f(), np.zeros(8, np.int8), np.ones(0, np.float32),
                                              np.array([8], np.int64))),
    # empty buffer list
    ("xs", lambda: kernels.weighted_sum(_f(), [], [])),
    ("xs", lambda: kernels.median(_f(), [])),
    ("xs", lambda: kernels.trimmed_mean(_f(), iter([]), 0)),
]


@pytest.mark.parametrize("name,call", BAD_CALLS, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD_CALLS)])
def test_bad_arguments_are_named(name, call):
    with pytest.raises(KernelError) as info:
        call()
    assert str(info.value).startswith(f"{name}:"), str(info.value)
