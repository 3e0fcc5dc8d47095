"""Secure aggregation's ring arithmetic (csrc/secagg.c): the C core against its NumPy twin bit
for bit, what the representation promises (|k| <= levels, unbiased stochastic rounding,
negative values wrapping so that sums read back exactly), and the argument checks."""
import contextlib

import numpy as np
import pytest

from edgefl import kernels, reference
from edgefl.kernels import KernelError, NonFiniteError

try:
    from edgefl import _core
except ImportError:   # a non-strict install without the core: the parity tests skip
    _core = None

needs_core = pytest.mark.skipif(_core is None, reason="edgefl._core is not built")
SIZES = [0, 1, 7, 8, 9, 127, 1025, 5003]
IMPLS = [pytest.param(_core, marks=needs_core, id="c"), pytest.param(reference, id="numpy")]


@contextlib.contextmanager
def backend(impl):
    saved = kernels.impl
    kernels.impl = impl
    try:
        yield
    finally:
        kernels.impl = saved


def values(n, seed=1, spread=3.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * spread).astype(np.float32)
    if n > 4:   # the clip edges and beyond, exactly
        x[:4] = [8.0, -8.0, 1e30, -1e30]
    return x


@needs_core
@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_quantize_parity(bits, stochastic, n):
    x = values(n)
    x.setflags(write=False)                    # the C wrapper takes read-only inputs
    outs = []
    for impl in (_core, reference):
        out = np.zeros(n, kernels.RING_DTYPES[bits])
        with backend(impl):
            kernels.quantize(out, x, 8.0, 1000, weight=37, seed=12345, stochastic=stochastic)
        outs.append(out)
    assert outs[0].tobytes() == outs[1].tobytes()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("n", SIZES)
def test_quantize_add_is_quantize_then_ring_add(impl, bits, n):
    """add=True puts the quantised words on top of the words already there (masks expanded
    ahead), wrapping mod 2^bits: the same bytes as quantising apart and ring_add, in C and
    in the twin."""
    x = values(n, seed=5)
    x.setflags(write=False)
    base = np.random.default_rng(n).integers(0, 2 ** 63, n, dtype=np.uint64).astype(
        kernels.RING_DTYPES[bits])
    with backend(impl):
        got = kernels.quantize(base.copy(), x, 8.0, 1000, weight=37, seed=2 ** 64 - 9,
                               add=True)
        want = kernels.ring_add(base.copy(), kernels.quantize(
            np.zeros(n, base.dtype), x, 8.0, 1000, weight=37, seed=2 ** 64 - 9))
    assert got.tobytes() == want.tobytes()


@needs_core
@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("stochastic", [True, False])
def test_quantize_parity_at_the_rounding_edges(bits, stochastic):
    """The C floor is a truncation stepped down for negative fractions (and an AVX-512 clone
    on CPUs that have it): exact integers, halves and negative values on both sides of
    them, and the largest level counts, must round as numpy's floor does."""
    k = np.arange(-3000, 3000, dtype=np.float64)
    grid = np.concatenate([k, k + 0.5, k - 0.5, k + 0.25, k + 1e-9, k - 1e-9]) / 128.0
    x = np.concatenate([grid, [0.0, -0.0], values(20001, seed=3)]).astype(np.float32)
    for clip, levels in ((8.0, 1024), (1.0, 2 ** 30 - 1 if bits == 32 else 2 ** 40)):
        outs = []
        for impl in (_core, reference):
            out = np.zeros(x.size, kernels.RING_DTYPES[bits])
            with backend(impl):
                kernels.quantize(out, x, clip, levels, weight=1, seed=99, stochastic=stochastic)
            outs.append(out)
        assert outs[0].tobytes() == outs[1].tobytes(), (clip, levels)


@needs_core
@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("subtract", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_ring_add_and_dequantize_parity(bits, subtract, n):
    rng = np.random.default_rng(n)
    dtype = kernels.RING_DTYPES[bits]
    x = rng.integers(0, 2 ** bits, n, dtype=dtype, endpoint=False)
    m = rng.integers(0, 2 ** bits, n, dtype=dtype, endpoint=False)
    m.setflags(write=False)
    got = []
    for impl in (_core, reference):
        y = x.copy()
        out = np.empty(n, np.float32)
        with backend(impl):
            kernels.ring_add(y, m, subtract)
            kernels.dequantize(out, y, 1.0 / 3000)
        got.append((y, out))
    assert got[0][0].tobytes() == got[1][0].tobytes()
    assert got[0][1].tobytes() == got[1][1].tobytes()
    want = (x.astype(object) + (-1 if subtract else 1) * m.astype(object)) % 2 ** bits
    assert [int(v) for v in got[0][0]] == list(want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [32, 64])
def test_a_ring_sum_of_signed_contributions_reads_back_exactly(impl, bits):
    """Negative values wrap to the top of the ring; the sum of n contributions of weights w_i
    reads back as the true integer sum while sum_i w_i * levels < 2^(bits-1)."""
    levels = min(2 ** (bits - 1) // 60 - 1, kernels.MAX_QUANT_LEVELS)
    weights = [1, 7, 2, 30, 19]                      # sum 59 * (levels + 1) fits
    dtype = kernels.RING_DTYPES[bits]
    with backend(impl):
        total = np.zeros(5003, dtype)
        want = np.zeros(5003, object)
        for i, w in enumerate(weights):
            x = values(5003, seed=i, spread=5.0)
            q = np.empty(5003, dtype)
            kernels.quantize(q, x, 8.0, levels, weight=w, seed=i, stochastic=True)
            kernels.ring_add(total, q)
            unweighted = np.empty(5003, dtype)
            kernels.quantize(unweighted, x, 8.0, levels, weight=1, seed=i, stochastic=True)
            k = unweighted.view(np.int32 if bits == 32 else np.int64).astype(object)
            assert max(abs(int(v)) for v in k) <= levels + 1      # rounding's +1 at most
            want += w * k
        signed = total.view(np.int32 if bits == 32 else np.int64)
        assert [int(v) for v in signed] == list(want)
        assert any(v < 0 for v in want) and any(v > 0 for v in want)


@pytest.mark.parametrize("impl", IMPLS)
def test_stochastic_rounding_is_unbiased_and_nearest_is_within_half_a_step(impl):
    x = np.full(200_000, 0.25, np.float32)           # 2.5 steps of 0.1: 2 or 3, half each
    q = np.empty(x.size, np.uint32)
    out = np.empty(x.size, np.float32)
    with backend(impl):
        kernels.quantize(q, x, 1.0, 10, seed=7, stochastic=True)
        kernels.dequantize(out, q, 0.1)
        assert set(q.tolist()) == {2, 3}
        # the mean of 200k draws of 0.2 / 0.3 is within 5 standard errors (1.1e-4) of 0.25
        assert abs(float(out.astype(np.float64).mean()) - 0.25) < 5 * 0.05 / np.sqrt(x.size)
        y = values(5003, spread=0.5)
        kernels.quantize(q[:5003], y, 8.0, 1000, stochastic=False)
        kernels.dequantize(out[:5003], q[:5003], 8.0 / 1000)
        err = np.abs(out[:5003].astype(np.float64) - np.clip(y, -8, 8))
        assert float(err.max()) <= 0.5 * 8.0 / 1000 + 1e-6


def test_bad_arguments_are_named():
    x = np.zeros(4, np.float32)
    with pytest.raises(KernelError, match="out: ring words must be uint32 or uint64, got int32"):
        kernels.quantize(np.zeros(4, np.int32), x, 1.0, 10)
    with pytest.raises(KernelError, match="x: expected 4 elements"):
        kernels.quantize(np.zeros(4, np.uint32), np.zeros(5, np.float32), 1.0, 10)
    with pytest.raises(KernelError, match="clip: 0"):
        kernels.quantize(np.zeros(4, np.uint32), x, 0, 10)
    with pytest.raises(KernelError, match="levels: 0"):
        kernels.quantize(np.zeros(4, np.uint32), x, 1.0, 0)
    with pytest.raises(KernelError, match=r"\(levels \+ 1\) \* weight = 4295032832: must be "
                                          r"below 2\^31"):
        kernels.quantize(np.zeros(4, np.uint32), x, 1.0, 2 ** 16, weight=2 ** 16)
    # in a 64-bit ring levels * weight < 2^63 left room for levels near 2^63, where
    # x * levels / clip + u reaches 2^63 and its conversion to int64 overflows: +clip came
    # back as -2^63 from both backends (and C's conversion is undefined behaviour)
    with pytest.raises(KernelError, match=r"levels: 9223372036854775807 must be at most 2\^52"):
        kernels.quantize(np.zeros(4, np.uint64), x, 1.0, 2 ** 63 - 1)
    with pytest.raises(KernelError, match=r"levels: 4503599627370497 must be at most 2\^52"):
        kernels.secagg_mask(np.zeros(4, np.uint64), np.zeros(0, np.uint64), bytes(32), b"\0",
                            x, 1.0, 2 ** 52 + 1)
    # past 2^53 x * levels / clip is rounded to a float64 above levels: 2^62 - 1 levels of
    # weight 2 passed the product check (2^63 - 2) and +clip came back as -2^63
    with pytest.raises(KernelError, match=r"levels: 4611686018427387903 must be at most 2\^52"):
        kernels.quantize(np.zeros(4, np.uint64), x, 1.0, 2 ** 62 - 1, weight=2)
    q = kernels.quantize(np.zeros(2, np.uint64), np.array([1, -1], np.float32), 1.0,
                         2 ** 52, weight=2 ** 10, stochastic=False)
    assert q.view(np.int64).tolist() == [2 ** 62, -2 ** 62]
    with pytest.raises(NonFiniteError, match=r"x\[2\] = nan"):
        kernels.quantize(np.zeros(4, np.uint32), np.array([0, 1, np.nan, 0], np.float32), 1.0, 10)
    with pytest.raises(KernelError, match="m: dtype uint64 where uint32"):
        kernels.ring_add(np.zeros(4, np.uint32), np.zeros(4, np.uint64))
    with pytest.raises(KernelError, match="x: array is read-only"):
        ro = np.zeros(4, np.uint32)
        ro.setflags(write=False)
        kernels.ring_add(ro, np.zeros(4, np.uint32))
    with pytest.raises(KernelError, match="out: expected 4 elements"):
        kernels.dequantize(np.zeros(3, np.float32), np.zeros(4, np.uint64), 1.0)


@pytest.mark.parametrize("impl", ["c", "numpy"])
def test_a_clip_too_small_for_its_levels_is_refused(impl, monkeypatch):
    """scale = levels / clip overflows float64 to inf below clip ~ levels / 1.8e308: x * inf
    (or 0 * inf = nan) then went to int64, undefined behaviour in C (UBSan: "inf is outside
    the range of representable values of type 'long int'") and -2^63 in both backends, so a
    +clip value entered the ring as the most negative word. A secure aggregation run took
    clip_range 1e-300 from its config and summed garbage."""
    if impl == "c" and kernels.backend != "c":
        pytest.skip("compiled core not built")
    monkeypatch.setattr(kernels, "impl", reference if impl == "numpy" else kernels.impl)
    x = np.array([1.0, 0.0, -1.0], np.float32)
    for dtype, clip, levels in ((np.uint64, 1e-300, 2 ** 40), (np.uint32, 5e-324, 100)):
        out = np.full(3, 7, dtype)
        with pytest.raises(KernelError, match=rf"clip: {clip!r} is too small for "
                                              rf"{levels} levels"):
            kernels.quantize(out, x, clip, levels)
        assert out.tolist() == [7, 7, 7]
        with pytest.raises(KernelError, match=rf"clip: {clip!r} is too small"):
            kernels.secagg_mask(out, np.zeros(0, np.uint64), bytes(32), b"\0", x, clip, levels)
        assert out.tolist() == [7, 7, 7]
    # the smallest clips that keep levels / clip finite still quantise +-clip to +-levels
    q = kernels.quantize(np.zeros(3, np.uint64), x, 1e-290, 2 ** 40, stochastic=False)
    assert q.view(np.int64).tolist() == [2 ** 40, 0, -2 ** 40]


@pytest.mark.parametrize("dtype, levels, weight", [(np.uint32, 2 ** 30 - 2, 2),
                                                   (np.uint64, 2 ** 52 - 1, 2 ** 11 - 1)])
def test_levels_times_weight_stays_below_the_rings_sign_bit(dtype, levels, weight):
    # the ring sum reads back signed, and a value rounds to at most levels + 1 (stochastic
    # rounding of a float64 product that came out a hair above levels): (levels + 1) *
    # weight must stay below 2^(bits-1), or +clip could come back as -2^(bits-1); just
    # below it reads back as it is
    top = 2 ** (np.dtype(dtype).itemsize * 8 - 1)
    x = np.array([1, -1], np.float32)
    with pytest.raises(KernelError, match=rf"\(levels \+ 1\) \* weight = {(levels + 1) * (weight + 1)}: "
                                          rf"must be below 2\^{top.bit_length() - 1}"):
        kernels.quantize(np.zeros(2, dtype), x, 1.0, levels, weight=weight + 1, stochastic=False)
    q = kernels.quantize(np.zeros(2, dtype), x, 1.0, levels, weight=weight, stochastic=False)
    signed = np.int32 if dtype is np.uint32 else np.int64
    assert q.view(signed).tolist() == [levels * weight, -levels * weight]
    assert (levels + 1) * weight < top <= (levels + 1) * (weight + 1)


# ------------------------------------------------------------------ masks (ef_secagg_mask)
@pytest.fixture
def c_masks(monkeypatch):
    """The C core's masks (OpenSSL's AES-CTR found at run time), or skip; state restored."""
    monkeypatch.setattr(kernels, "_MASKS", dict(kernels._MASKS))
    kernels.use_c_masks(True)
    if not kernels.masks_in_c():
        pytest.skip("no C core or no usable libcrypto in this process")


@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("n", SIZES + [kernels.MASK_PIECE_WORDS * 2 + 5, 1_000_003])
@pytest.mark.parametrize("threads", ["1", "2", "5"])
def test_mask_parity_with_cryptography(c_masks, monkeypatch, bits, n, threads):
    """The C core's keystream (OpenSSL through EVP, 16 kB blocks, the vector in pieces whose
    CTR counters start at their byte offsets) adds the same bytes as the twin's
    `cryptography` AES-256-CTR over the whole vector, and the fused quantisation the same
    words as kernels.quantize; words, then the scalars, with each key's sign."""
    monkeypatch.setenv("EDGEFL_MASK_THREADS", threads)
    rng = np.random.default_rng(n + bits)
    dtype = kernels.RING_DTYPES[bits]
    words = rng.integers(0, 2 ** 63, n, dtype=np.uint64).astype(dtype)
    scalars = rng.integers(0, 2 ** 63, 4, dtype=np.uint64)
    keys = bytes(rng.integers(0, 256, 32 * 4, dtype=np.uint8))
    subtract = bytes([0, 1, 1, 0])
    x = values(n)
    x.setflags(write=False)
    got_w, got_s = words.copy(), scalars.copy()
    kernels.secagg_mask(got_w, got_s, keys, subtract)
    want_w, want_s = words.copy(), scalars.copy()
    reference.secagg_mask(want_w, want_s, keys, subtract, None, 1.0, 1.0, 1, 0, False)
    assert got_w.tobytes() == want_w.tobytes() and got_s.tobytes() == want_s.tobytes()
    # fused: quantise then mask, in one pass, against quantize followed by the twin's masks
    got_w, got_s = words.copy(), scalars.copy()
    kernels.secagg_mask(got_w, got_s, keys, subtract, x, 8.0, 1000, weight=37, seed=2 ** 64 - 3)
    want_w, want_s = np.zeros(n, dtype), scalars.copy()
    kernels.quantize(want_w, x, 8.0, 1000, weight=37, seed=2 ** 64 - 3)
    reference.secagg_mask(want_w, want_s, keys, subtract, None, 1.0, 1.0, 1, 0, False)
    assert got_w.tobytes() == want_w.tobytes() and got_s.tobytes() == want_s.tobytes()


def test_mask_keystream_is_aes_256_ctr_from_cryptography(c_masks):
    """One key's mask on zero words is its AES-256-CTR keystream (zero IV) from
    `cryptography` directly: no edgefl code between the oracle and the bytes."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    key = bytes(range(100, 132))
    words, scalars = np.zeros(70_001, np.uint32), np.zeros(2, np.uint64)
    kernels.secagg_mask(words, scalars, key, b"\0")
    stream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(
        bytes(words.nbytes + scalars.nbytes))
    assert words.tobytes() + scalars.tobytes() == stream


@pytest.mark.parametrize("impl", IMPLS)
def test_mask_argument_checks(impl, monkeypatch):
    with backend(impl):
        words, scalars = np.zeros(8, np.uint32), np.zeros(1, np.uint64)
        with pytest.raises(KernelError, match="keys / subtract"):
            kernels.secagg_mask(words, scalars, bytes(31), b"\0")
        with pytest.raises(KernelError, match="keys / subtract"):
            kernels.secagg_mask(words, scalars, bytes(32), b"\2")
        with pytest.raises(KernelError, match="words"):
            kernels.secagg_mask(np.zeros(8, np.int32), scalars, bytes(32), b"\0")
        with pytest.raises(KernelError, match="scalars"):
            kernels.secagg_mask(words, np.zeros(1, np.uint32), bytes(32), b"\0")
        with pytest.raises(KernelError, match="x"):
            kernels.secagg_mask(words, scalars, bytes(32), b"\0", np.zeros(7, np.float32))
        bad = np.zeros(8, np.float32)
        bad[3] = np.nan
        with pytest.raises(NonFiniteError, match=r"x\[3\]"):
            kernels.secagg_mask(words, scalars, bytes(32), b"\0", bad, 1.0, 10)
        with pytest.raises(KernelError, match="threads"):
            kernels.secagg_mask(words, scalars, bytes(32), b"\0", threads=0)
        monkeypatch.setenv("EDGEFL_MASK_THREADS", "two")
        with pytest.raises(KernelError, match="EDGEFL_MASK_THREADS"):
            kernels.mask_threads()


def test_masks_fall_back_to_cryptography_without_libcrypto(monkeypatch):
    """No libcrypto found (another platform, a static Python): the masks come from the
    twin, with the same bytes."""
    from edgefl import _openssl
    words, scalars = np.arange(300_001, dtype=np.uint32), np.arange(2, dtype=np.uint64)
    keys, subtract = bytes(range(64)), b"\0\1"
    want_w, want_s = words.copy(), scalars.copy()
    reference.secagg_mask(want_w, want_s, keys, subtract, None, 1.0, 1.0, 1, 0, False)
    monkeypatch.setattr(kernels, "_MASKS", dict(kernels._MASKS, found=None, off=False))
    monkeypatch.setattr(_openssl, "evp_addresses", lambda: None)
    assert not kernels.masks_in_c()
    kernels.secagg_mask(words, scalars, keys, subtract)
    assert words.tobytes() == want_w.tobytes() and scalars.tobytes() == want_s.tobytes()
