# cython: language_level=3
"""Cython binding of csrc/ (the only Cython file). Arguments arrive validated by
edgefl.kernels; every kernel runs with the GIL released."""
from libc.stdint cimport int8_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t, INT32_MIN, INT32_MAX
from libc.stdlib cimport malloc, free
import threading

import numpy as np
cimport numpy as cnp

cnp.import_array()

cdef extern from "edgefl.h" nogil:
    void ef_weighted_sum(float *out, const float *const *xs, const double *weights, int64_t k, int64_t n)
    void ef_axpy(float *y, const float *x, int64_t n, float a)
    void ef_scale(float *x, int64_t n, float a)
    double ef_dot(const float *x, const float *y, int64_t n)
    double ef_sqnorm(const float *x, int64_t n)
    int64_t ef_first_nonfinite(const float *x, int64_t n)
    void ef_median(float *out, float *scratch, const float *const *xs, int64_t k, int64_t n)
    void ef_trimmed_mean(float *out, float *scratch, const float *const *xs, int64_t k, int64_t n, int64_t trim)
    void ef_f32_to_f16(uint16_t *out, const float *inp, int64_t n)
    void ef_f16_to_f32(float *out, const uint16_t *inp, int64_t n)
    void ef_f32_to_i8(int8_t *out, float *scales, const float *inp, const int64_t *seg_offsets, int64_t nseg)
    void ef_i8_to_f32(float *out, const int8_t *inp, const float *scales, const int64_t *seg_offsets, int64_t nseg)
    void ef_quantize_u32(uint32_t *out, const float *x, int64_t n, double clip, double scale, int64_t weight, uint64_t seed, int stochastic, int add)
    void ef_quantize_u64(uint64_t *out, const float *x, int64_t n, double clip, double scale, int64_t weight, uint64_t seed, int stochastic, int add)
    void ef_ring_add_u32(uint32_t *x, const uint32_t *m, int64_t n, int subtract)
    void ef_ring_add_u64(uint64_t *x, const uint64_t *m, int64_t n, int subtract)
    void ef_dequantize_u32(float *out, const uint32_t *sum, int64_t n, double unit)
    void ef_dequantize_u64(float *out, const uint64_t *sum, int64_t n, double unit)
    int ef_set_aes_ctr(void *ctx_new, void *ctx_free, void *aes_256_ctr, void *init, void *update)
    int ef_have_aes_ctr()
    int ef_secagg_mask(void *words, int64_t n, int bits, uint64_t *scalars, int64_t m, const unsigned char *keys, const unsigned char *subtract, int64_t nkeys, const float *x, double clip, double scale, int64_t weight, uint64_t seed, int stochastic, uint64_t counter)
    int ef_have_blas()
    void ef_blas_set_threads(int n)


def have_blas():
    return bool(ef_have_blas())


def blas_set_threads(int n):
    ef_blas_set_threads(n)

# ======================= vector kernels and codecs =======================================

# Arrays may have any shape: kernels.py has checked dtype, contiguity and size, and
# `.reshape(-1)` of a C-contiguous array is a view, so kernels write straight into the
# caller's buffers. Inputs are `const` memoryviews so read-only buffers (received payloads)
# are accepted. Pointer tables and scratch are allocated here; kernels allocate nothing.

cdef inline float *_f32(float[::1] v) noexcept:
    return &v[0] if v.shape[0] > 0 else NULL


cdef inline const float *_cf32(const float[::1] v) noexcept:
    return &v[0] if v.shape[0] > 0 else NULL


cdef const float **_pointer_table(list xs, list keep) except NULL:
    """malloc'ed table of the K buffers' data pointers; `keep` holds the views alive."""
    cdef Py_ssize_t i, k = len(xs)
    cdef const float[::1] v
    cdef const float **ptrs = <const float **> malloc(max(k, 1) * sizeof(float *))
    if ptrs == NULL:
        raise MemoryError(f"pointer table for {k} buffers")
    try:
        for i in range(k):
            v = xs[i].reshape(-1)
            keep.append(v)
            ptrs[i] = _cf32(v)
    except BaseException:
        free(ptrs)
        raise
    return ptrs


def weighted_sum(out, xs, weights):
    """out = sum_k weights[k] * xs[k] (ef_weighted_sum)."""
    cdef float[::1] o = out.reshape(-1)
    cdef const double[::1] w = weights
    cdef list keep = []
    cdef int64_t k = len(xs), n = o.shape[0]
    cdef const float **ptrs = _pointer_table(list(xs), keep)
    cdef float *po = _f32(o)
    try:
        with nogil:
            ef_weighted_sum(po, <const float *const *> ptrs, &w[0], k, n)
    finally:
        free(ptrs)


def axpy(y, x, float a):
    """y += a * x (ef_axpy)."""
    cdef float[::1] vy = y.reshape(-1)
    cdef const float[::1] vx = x.reshape(-1)
    cdef float *py = _f32(vy)
    cdef const float *px = _cf32(vx)
    with nogil:
        ef_axpy(py, px, vy.shape[0], a)


def scale(x, float a):
    """x *= a (ef_scale)."""
    cdef float[::1] vx = x.reshape(-1)
    cdef float *px = _f32(vx)
    with nogil:
        ef_scale(px, vx.shape[0], a)


def dot(x, y):
    """sum x*y in float64 (ef_dot)."""
    cdef const float[::1] vx = x.reshape(-1)
    cdef const float[::1] vy = y.reshape(-1)
    cdef const float *px = _cf32(vx)
    cdef const float *py = _cf32(vy)
    cdef double r
    with nogil:
        r = ef_dot(px, py, vx.shape[0])
    return r


def sqnorm(x):
    """sum x*x in float64 (ef_sqnorm)."""
    cdef const float[::1] vx = x.reshape(-1)
    cdef const float *px = _cf32(vx)
    cdef double r
    with nogil:
        r = ef_sqnorm(px, vx.shape[0])
    return r


def first_nonfinite(x):
    """Index of the first NaN/inf, or -1 (ef_first_nonfinite). The GIL is released only for
    large buffers: in a process whose threads contend for it, giving it up costs a wait to
    get it back, far more than scanning a few thousand floats."""
    cdef const float[::1] vx = x.reshape(-1)
    cdef const float *px = _cf32(vx)
    cdef int64_t n = vx.shape[0], r
    if n < 262144:
        return ef_first_nonfinite(px, n)
    with nogil:
        r = ef_first_nonfinite(px, n)
    return r


def median(out, xs):
    """Coordinate-wise median of the K buffers (ef_median)."""
    cdef float[::1] o = out.reshape(-1)
    cdef list keep = []
    cdef int64_t k = len(xs), n = o.shape[0]
    cdef float *po = _f32(o)
    cdef float *scratch = <float *> malloc(max(k, 1) * sizeof(float))
    if scratch == NULL:
        raise MemoryError(f"scratch for {k} buffers")
    cdef const float **ptrs
    try:
        ptrs = _pointer_table(list(xs), keep)
        try:
            with nogil:
                ef_median(po, scratch, <const float *const *> ptrs, k, n)
        finally:
            free(ptrs)
    finally:
        free(scratch)


def trimmed_mean(out, xs, int64_t trim):
    """Coordinate-wise mean without the `trim` smallest and largest values (ef_trimmed_mean)."""
    cdef float[::1] o = out.reshape(-1)
    cdef list keep = []
    cdef int64_t k = len(xs), n = o.shape[0]
    cdef float *po = _f32(o)
    cdef float *scratch = <float *> malloc(max(k, 1) * sizeof(float))
    if scratch == NULL:
        raise MemoryError(f"scratch for {k} buffers")
    cdef const float **ptrs
    try:
        ptrs = _pointer_table(list(xs), keep)
        try:
            with nogil:
                ef_trimmed_mean(po, scratch, <const float *const *> ptrs, k, n, trim)
        finally:
            free(ptrs)
    finally:
        free(scratch)


def f32_to_f16(out, x):
    """IEEE binary16 bits of x, round to nearest even (ef_f32_to_f16)."""
    cdef uint16_t[::1] o = out.reshape(-1)
    cdef const float[::1] vx = x.reshape(-1)
    cdef int64_t n = vx.shape[0]
    if n == 0:
        return
    with nogil:
        ef_f32_to_f16(&o[0], &vx[0], n)


def f16_to_f32(out, h):
    """float32 values of binary16 bits (ef_f16_to_f32)."""
    cdef float[::1] o = out.reshape(-1)
    cdef const uint16_t[::1] vh = h.reshape(-1)
    cdef int64_t n = vh.shape[0]
    if n == 0:
        return
    with nogil:
        ef_f16_to_f32(&o[0], &vh[0], n)


def f32_to_i8(out, scales, x, seg_offsets):
    """Symmetric int8 with one scale per segment; writes out and scales (ef_f32_to_i8)."""
    cdef int8_t[::1] o = out.reshape(-1)
    cdef float[::1] sc = scales.reshape(-1)
    cdef const float[::1] vx = x.reshape(-1)
    cdef const int64_t[::1] seg = seg_offsets
    cdef int64_t nseg = seg.shape[0] - 1
    cdef int8_t *po = &o[0] if o.shape[0] > 0 else NULL
    cdef float *psc = _f32(sc)
    cdef const float *px = _cf32(vx)
    with nogil:
        ef_f32_to_i8(po, psc, px, &seg[0], nseg)


def i8_to_f32(out, q, scales, seg_offsets):
    """x = q * scale of its segment (ef_i8_to_f32)."""
    cdef float[::1] o = out.reshape(-1)
    cdef const int8_t[::1] vq = q.reshape(-1)
    cdef const float[::1] sc = scales.reshape(-1)
    cdef const int64_t[::1] seg = seg_offsets
    cdef int64_t nseg = seg.shape[0] - 1
    cdef float *po = _f32(o)
    cdef const int8_t *pq = &vq[0] if vq.shape[0] > 0 else NULL
    cdef const float *psc = _cf32(sc)
    with nogil:
        ef_i8_to_f32(po, pq, psc, &seg[0], nseg)


# ======================= networks =========================================================

cdef extern from "edgefl.h" nogil:
    ctypedef struct ef_layer:
        int32_t op, in_c, in_h, in_w, out_c, out_h, out_w, k, stride, pad
        int64_t w_off, b_off
    ctypedef struct ef_net:
        const ef_layer *layers
        int32_t n_layers
        int32_t loss
        int64_t n_params
        float l2
    ctypedef struct ef_train_cfg:
        float lr, momentum, weight_decay, prox_mu
        int32_t batch_size, epochs, steps, grad0_mode
        uint64_t seed
        const int32_t *stop
    ctypedef struct ef_train_stats:
        float *grad0
        float *grad_sum
        double *step_stats
        int64_t max_steps
        float *w_start
        float *run_sum
    ctypedef struct ef_train_result:
        double mean_loss
        int64_t steps, samples, bad_step
    int EF_OK, EF_ERR_NONFINITE, EF_ERR_ARGS, EF_STOPPED
    int ef_workspace_size(int64_t *n_float, int64_t *n_int, const ef_net *net, int64_t chunk, int64_t n)
    int64_t ef_chunk_for_batch(int64_t batch_size, int64_t n)
    int ef_forward(float *out, float *work, const ef_net *net, const float *params, const float *x,
                   int64_t n, int64_t chunk)
    int ef_loss_grad(float *grad, double *loss, float *work, const ef_net *net, const float *params,
                     const float *x, const int32_t *labels, const float *targets, int64_t n, int64_t chunk)
    int ef_evaluate(double *loss_sum, int64_t *correct, float *work, const ef_net *net,
                    const float *params, const float *x, const int32_t *labels, const float *targets,
                    int64_t n, int64_t chunk)
    int ef_local_train(float *params, float *momentum, ef_train_stats *stats, ef_train_result *res,
                       float *work, int64_t *iwork, const ef_net *net, const float *x,
                       const int32_t *labels, const float *targets, const float *anchor,
                       int64_t n, const ef_train_cfg *cfg)
    void ef_shuffle(int64_t *perm, int64_t *iwork, uint64_t seed, int64_t epoch, int64_t n)

from .errors import KernelError, NonFiniteError, TrainingStopped

cdef extern from "edgefl.h":
    int EF_MAX_CHUNK

cdef enum:
    MAX_LAYERS = 64
# Samples per forward/backward pass; evaluation and inference run over chunks of this many.
MAX_CHUNK = EF_MAX_CHUNK
EVAL_CHUNK = EF_MAX_CHUNK


cdef struct NetBox:
    ef_net net
    ef_layer layers[MAX_LAYERS]


_INT32_COLUMNS = ("op", "in_c", "in_h", "in_w", "out_c", "out_h", "out_w", "k", "stride", "pad")


cdef int fill_net(NetBox *box, object net) except -1:
    cdef const int64_t[:, ::1] t = net.layers
    cdef Py_ssize_t i
    if t.shape[0] > MAX_LAYERS or t.shape[1] != 12:
        raise KernelError(f"net.layers: shape ({t.shape[0]}, {t.shape[1]}), need (<= {MAX_LAYERS}, 12)")
    cdef Py_ssize_t j
    for i in range(t.shape[0]):
        # the first ten fields are int32 in C: cast down, 2**32 + 10 became 10 and the C core
        # found the table consistent and ran it (the offsets are int64 there)
        for j in range(10):
            if t[i, j] < INT32_MIN or t[i, j] > INT32_MAX:
                raise KernelError(f"net.layers[{i}, {j}] ({_INT32_COLUMNS[j]}): {t[i, j]} "
                                  f"is outside int32")
        box.layers[i].op = <int32_t>t[i, 0]
        box.layers[i].in_c = <int32_t>t[i, 1]
        box.layers[i].in_h = <int32_t>t[i, 2]
        box.layers[i].in_w = <int32_t>t[i, 3]
        box.layers[i].out_c = <int32_t>t[i, 4]
        box.layers[i].out_h = <int32_t>t[i, 5]
        box.layers[i].out_w = <int32_t>t[i, 6]
        box.layers[i].k = <int32_t>t[i, 7]
        box.layers[i].stride = <int32_t>t[i, 8]
        box.layers[i].pad = <int32_t>t[i, 9]
        box.layers[i].w_off = t[i, 10]
        box.layers[i].b_off = t[i, 11]
    box.net.layers = box.layers
    box.net.n_layers = <int32_t>t.shape[0]
    box.net.loss = <int32_t>net.loss
    box.net.n_params = <int64_t>net.n_params
    box.net.l2 = <float>net.l2
    return 0


# Workspaces up to this many floats are kept per thread and reused by the next call: a fresh
# multi-MB buffer costs a page fault per 4 KB touched, measured at ~3% of a cnn-mnist epoch.
# Bigger ones (full-batch rounds on large sets) are allocated per call so they do not pin RAM.
# Safe because no C kernel reads workspace it has not written in the same call.
WORKSPACE_CACHE_FLOATS = 16 * 1024 * 1024
_cache = threading.local()


cdef object workspace(NetBox *box, int64_t chunk, int64_t n):
    cdef int64_t nf = 0, ni = 0
    if ef_workspace_size(&nf, &ni, &box.net, chunk, n) != EF_OK:
        raise KernelError("net: inconsistent layer table (shapes, offsets or parameter count)")
    nf = max(nf, 1)
    iwork = np.empty(max(ni, 1), dtype=np.int64)
    if nf > WORKSPACE_CACHE_FLOATS:
        return np.empty(nf, dtype=np.float32), iwork
    work = getattr(_cache, "work", None)
    if work is None or work.shape[0] < nf:
        work = np.empty(nf, dtype=np.float32)
        _cache.work = work
    return work, iwork    # at least nf floats


cdef void *array_data(object a, int typenum, bint writable, int64_t min_size,
                      str what) except? NULL:
    """The data pointer of a C-contiguous NumPy array of `typenum` holding at least
    `min_size` elements, checked with the NumPy C API's macros: local_train runs once per
    client per round, and a typed memoryview per argument cost microseconds of buffer
    protocol each (issue #3's overhead target)."""
    cdef cnp.ndarray arr
    if not cnp.PyArray_Check(a):
        raise KernelError(f"{what}: expected a numpy array, got {type(a).__name__}")
    arr = <cnp.ndarray>a
    if cnp.PyArray_TYPE(arr) != typenum or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        want = {cnp.NPY_FLOAT32: "float32", cnp.NPY_INT32: "int32",
                cnp.NPY_INT64: "int64"}.get(typenum, str(typenum))
        raise KernelError(f"{what}: need a C-contiguous {want} array, got {arr.dtype} "
                          f"(C-contiguous: {bool(cnp.PyArray_IS_C_CONTIGUOUS(arr))})")
    if writable and not cnp.PyArray_ISWRITEABLE(arr):
        raise KernelError(f"{what}: array is read-only but the kernel writes into it")
    if cnp.PyArray_SIZE(arr) < min_size:
        raise KernelError(f"{what}: {cnp.PyArray_SIZE(arr)} elements, need {min_size}")
    return cnp.PyArray_DATA(arr)


cdef inline float *opt_data_f32(object a, int64_t n, str what) except? NULL:
    if a is None:
        return NULL
    return <float *>array_data(a, cnp.NPY_FLOAT32, True, n, what)


cdef const int32_t *label_ptr(object labels) except? NULL:
    cdef const int32_t[::1] v
    if labels is None:
        return NULL
    v = labels.reshape(-1)
    return &v[0] if v.shape[0] else NULL


cdef const float *target_ptr(object targets) except? NULL:
    cdef const float[::1] v
    if targets is None:
        return NULL
    v = targets.reshape(-1)
    return &v[0] if v.shape[0] else NULL


def chunk_for_batch(batch_size, n):
    return ef_chunk_for_batch(batch_size, n)


def workspace_bytes(net, int64_t batch_size, int64_t n):
    """Bytes of the workspace local_train allocates for a local round of `net` on n samples
    with minibatches of batch_size (<= 0: the whole set): ef_workspace_size's layout."""
    cdef NetBox box
    fill_net(&box, net)
    cdef int64_t nf = 0, ni = 0
    if ef_workspace_size(&nf, &ni, &box.net, ef_chunk_for_batch(batch_size, max(n, 1)),
                         max(n, 0)) != EF_OK:
        raise KernelError("net: inconsistent layer table (shapes, offsets or parameter count)")
    return 4 * max(nf, 1) + 8 * max(ni, 1)


def forward(out, net, params, x):
    """out[n, n_out] = network scores for x[n, ...]."""
    cdef NetBox box
    fill_net(&box, net)
    cdef float[::1] o = out.reshape(-1)
    cdef const float[::1] p = params.reshape(-1)
    cdef const float[::1] xv = x.reshape(-1)
    cdef int64_t n = x.shape[0], chunk = min(EVAL_CHUNK, max(n, 1))
    work, _ = workspace(&box, chunk, 0)
    cdef float[::1] w = work
    cdef int rc
    if n == 0:
        return out
    with nogil:
        rc = ef_forward(&o[0], &w[0], &box.net, &p[0], &xv[0], n, chunk)
    if rc != EF_OK:
        raise KernelError("forward: the C core rejected the arguments")
    return out


def loss_grad(grad, net, params, x, labels, targets):
    """grad = d(mean loss)/d(params) over all given samples; returns the mean loss (with l2)."""
    cdef NetBox box
    fill_net(&box, net)
    cdef float[::1] g = grad.reshape(-1)
    cdef const float[::1] p = params.reshape(-1)
    cdef const float[::1] xv = x.reshape(-1)
    cdef const int32_t *lab = label_ptr(labels)
    cdef const float *tgt = target_ptr(targets)
    cdef int64_t n = x.shape[0], chunk = ef_chunk_for_batch(n, n)
    work, _ = workspace(&box, chunk, 0)
    cdef float[::1] w = work
    cdef double loss = 0
    cdef int rc
    with nogil:
        rc = ef_loss_grad(&g[0], &loss, &w[0], &box.net, &p[0], &xv[0], lab, tgt, n, chunk)
    if rc == EF_ERR_NONFINITE:
        raise NonFiniteError(0, f"loss_grad: loss is {loss} (not finite)")
    if rc != EF_OK:
        raise KernelError("loss_grad: the C core rejected the arguments")
    return loss


def evaluate(net, params, x, labels, targets):
    """(summed loss without the l2 term, number of correct predictions) over x."""
    cdef NetBox box
    fill_net(&box, net)
    cdef const float[::1] p = params.reshape(-1)
    cdef const float[::1] xv = x.reshape(-1)
    cdef const int32_t *lab = label_ptr(labels)
    cdef const float *tgt = target_ptr(targets)
    cdef int64_t n = x.shape[0], chunk = min(EVAL_CHUNK, max(n, 1)), correct = 0
    cdef double loss = 0
    cdef int rc
    if n == 0:
        return 0.0, 0
    work, _ = workspace(&box, chunk, 0)
    cdef float[::1] w = work
    with nogil:
        rc = ef_evaluate(&loss, &correct, &w[0], &box.net, &p[0], &xv[0], lab, tgt, n, chunk)
    if rc != EF_OK:
        raise KernelError("evaluate: the C core rejected the arguments")
    return loss, correct


def shuffle(seed, epoch, n):
    """The permutation ef_local_train uses for (seed, epoch)."""
    perm = np.empty(max(n, 1), dtype=np.int64)
    iwork = np.empty(max(4 * n, 1), dtype=np.int64)
    cdef int64_t[::1] pv = perm, iv = iwork
    cdef uint64_t s = seed
    cdef int64_t e = epoch, nn = n
    with nogil:
        ef_shuffle(&pv[0], &iv[0], s, e, nn)
    return perm[:n]


cdef float *opt_f32(object a) except? NULL:
    cdef float[::1] v
    if a is None:
        return NULL
    v = a.reshape(-1)
    return &v[0]


def local_train(params, momentum, net, x, labels, targets, cfg, grad0=None, grad_sum=None,
                step_stats=None, anchor=None, stop_word=None):
    """One local round in C (see ef_local_train); params/momentum/stat buffers are updated in
    place. `anchor` is the proximal term's centre, read only and only when cfg["prox_mu"] > 0.
    `stop_word`: None or an int32 array of one element read before every step (edgefl.h,
    ef_train_cfg.stop). Returns {"mean_loss", "steps", "samples"}; raises NonFiniteError
    naming the step, TrainingStopped with the steps done when the word stopped it."""
    cdef NetBox box
    fill_net(&box, net)
    cdef ef_train_cfg c
    c.lr = cfg["lr"]
    c.momentum = cfg["momentum"]
    c.weight_decay = cfg["weight_decay"]
    c.prox_mu = cfg["prox_mu"]
    c.batch_size = cfg["batch_size"]
    c.epochs = cfg["epochs"]
    c.steps = cfg["steps"]
    c.grad0_mode = cfg["grad0_mode"]
    c.seed = <uint64_t>cfg["seed"]
    c.stop = NULL
    if stop_word is not None:
        # read by the C loop while another thread may write it: the array outlives the call
        c.stop = <const int32_t *>array_data(stop_word, cnp.NPY_INT32, False, 1, "stop_word")
    cdef int64_t n = x.shape[0], np_ = box.net.n_params
    cdef int64_t bs = n if (c.batch_size <= 0 or c.batch_size >= n) else c.batch_size
    cdef const ef_layer *first = &box.layers[0]
    work, iwork = workspace(&box, ef_chunk_for_batch(bs, n), n)
    cdef float *w = <float *>array_data(work, cnp.NPY_FLOAT32, True, 1, "workspace")
    cdef int64_t *iw = <int64_t *>array_data(iwork, cnp.NPY_INT64, True, 1, "workspace")
    cdef float *p = <float *>array_data(params, cnp.NPY_FLOAT32, True, np_, "params")
    cdef const float *xv = <const float *>array_data(
        x, cnp.NPY_FLOAT32, False, n * first.in_c * first.in_h * first.in_w, "x")
    cdef const int32_t *lab = NULL
    cdef const float *tgt = NULL
    if labels is not None:
        lab = <const int32_t *>array_data(labels, cnp.NPY_INT32, False, n, "labels")
    if targets is not None:
        tgt = <const float *>array_data(targets, cnp.NPY_FLOAT32, False, n, "targets")
    cdef float *mom = opt_data_f32(momentum, np_, "momentum")
    cdef const float *anc = NULL
    if c.prox_mu != 0.0:
        anc = <const float *>array_data(anchor, cnp.NPY_FLOAT32, False, np_, "anchor")
    cdef ef_train_stats st
    cdef ef_train_stats *stp = NULL
    cdef double[:, ::1] ss
    w_start = run_sum = None
    st.grad0 = opt_data_f32(grad0, np_, "grad0")
    st.grad_sum = opt_data_f32(grad_sum, np_, "grad_sum")
    st.step_stats = NULL
    st.max_steps = 0
    st.w_start = NULL
    st.run_sum = NULL
    if step_stats is not None:
        ss = step_stats
        st.step_stats = &ss[0, 0]
        st.max_steps = ss.shape[0]
        w_start = np.empty(box.net.n_params, dtype=np.float32)
        run_sum = np.empty(box.net.n_params, dtype=np.float32)
        st.w_start = opt_f32(w_start)
        st.run_sum = opt_f32(run_sum)
    if st.grad0 != NULL or st.grad_sum != NULL or st.step_stats != NULL:
        stp = &st
    cdef ef_train_result res
    cdef int rc
    with nogil:
        rc = ef_local_train(p, mom, stp, &res, w, iw, &box.net, xv, lab, tgt, anc, n, &c)
    if rc == EF_ERR_NONFINITE:
        raise NonFiniteError(res.bad_step, f"local_train: non-finite loss or gradient at step "
                             f"{res.bad_step} (loss {res.mean_loss}); lower the learning rate")
    if rc == EF_STOPPED:
        raise TrainingStopped(res.steps, res.samples, res.mean_loss)
    if rc != EF_OK:
        raise KernelError("local_train: the C core rejected the arguments")
    return {"mean_loss": res.mean_loss, "steps": res.steps, "samples": res.samples}


# ======================= secure aggregation's ring arithmetic (secagg.c) =================

def quantize(out, x, double clip, double scale, int64_t weight, uint64_t seed, bint stochastic,
             bint add=False):
    """out = x quantised into the ring of out's dtype, times weight (add: out += it)
    (ef_quantize_u32/u64)."""
    cdef const float[::1] vx = x.reshape(-1)
    cdef uint32_t[::1] o32
    cdef uint64_t[::1] o64
    cdef int64_t n = vx.shape[0]
    if n == 0:
        return
    if out.dtype.itemsize == 4:
        o32 = out.reshape(-1)
        with nogil:
            ef_quantize_u32(&o32[0], &vx[0], n, clip, scale, weight, seed, stochastic, add)
    else:
        o64 = out.reshape(-1)
        with nogil:
            ef_quantize_u64(&o64[0], &vx[0], n, clip, scale, weight, seed, stochastic, add)


def ring_add(x, m, bint subtract):
    """x += m (or -= m) mod 2^bits, bits from the dtype (ef_ring_add_u32/u64)."""
    cdef uint32_t[::1] x32
    cdef const uint32_t[::1] m32
    cdef uint64_t[::1] x64
    cdef const uint64_t[::1] m64
    cdef int64_t n = x.size
    if n == 0:
        return
    if x.dtype.itemsize == 4:
        x32 = x.reshape(-1)
        m32 = m.reshape(-1)
        with nogil:
            ef_ring_add_u32(&x32[0], &m32[0], n, subtract)
    else:
        x64 = x.reshape(-1)
        m64 = m.reshape(-1)
        with nogil:
            ef_ring_add_u64(&x64[0], &m64[0], n, subtract)


def dequantize(out, words, double unit):
    """out = signed(words) * unit in float32 (ef_dequantize_u32/u64)."""
    cdef float[::1] o = out.reshape(-1)
    cdef const uint32_t[::1] w32
    cdef const uint64_t[::1] w64
    cdef int64_t n = o.shape[0]
    if n == 0:
        return
    if words.dtype.itemsize == 4:
        w32 = words.reshape(-1)
        with nogil:
            ef_dequantize_u32(&o[0], &w32[0], n, unit)
    else:
        w64 = words.reshape(-1)
        with nogil:
            ef_dequantize_u64(&o[0], &w64[0], n, unit)


def set_aes_ctr(size_t ctx_new, size_t ctx_free, size_t aes_256_ctr, size_t init, size_t update):
    """Hand the core OpenSSL's EVP function addresses (edgefl/_openssl.py); True when set."""
    return ef_set_aes_ctr(<void *>ctx_new, <void *>ctx_free, <void *>aes_256_ctr, <void *>init,
                          <void *>update) == 0


def have_aes_ctr():
    return bool(ef_have_aes_ctr())


def secagg_mask(words, scalars, bytes keys, bytes subtract, x, double clip, double scale,
                int64_t weight, uint64_t seed, bint stochastic, uint64_t counter=0):
    """words, scalars (+|-)= the keys' AES-256-CTR streams from byte 16 * counter, after
    quantising x into words when x is not None (ef_secagg_mask). False when the core has no OpenSSL or OpenSSL failed."""
    cdef uint32_t[::1] w32
    cdef uint64_t[::1] w64
    cdef uint64_t[::1] sv = scalars.reshape(-1)
    cdef const float[::1] vx
    cdef const float *px = NULL
    cdef void *pw = NULL
    cdef uint64_t *ps = NULL
    cdef int64_t n = words.size, m = scalars.size, nkeys = len(subtract)
    cdef int bits = words.dtype.itemsize * 8
    cdef const unsigned char *pk = keys
    cdef const unsigned char *pm = subtract
    cdef int rc
    if n:
        if bits == 32:
            w32 = words.reshape(-1)
            pw = &w32[0]
        else:
            w64 = words.reshape(-1)
            pw = &w64[0]
    if m:
        ps = &sv[0]
    if x is not None and n:
        vx = x.reshape(-1)
        px = &vx[0]
    with nogil:
        rc = ef_secagg_mask(pw, n, bits, ps, m, pk, pm, nkeys, px, clip, scale, weight, seed,
                            stochastic, counter)
    return rc == 0
