"""Pure-NumPy twin of every kernel in csrc/: same names, arguments and side effects.

It is the oracle the C core is tested against and the fallback when the extension is not
built (EDGEFL_BACKEND=numpy). Functions assume arguments already validated by
edgefl.kernels. Written for clarity first; it stays vectorised where that is free.
"""
from __future__ import annotations

import numpy as np

# ======================= vector kernels and codecs (vec.c, codec.c) =======================
# Each function follows the C kernel's arithmetic step by step (the comment in vec.c/codec.c
# above the kernel states it), so tests/test_vec.py can hold the two to tight tolerances.


# The C kernels never warn: overflow to inf and inf - inf follow IEEE arithmetic silently.
def _quiet():
    return np.errstate(over="ignore", invalid="ignore")


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)  # a view: every argument is C-contiguous (checked in kernels.py)


def weighted_sum(out, xs, weights):
    """out = sum_k weights[k] * xs[k]: float64 products and sums in k order, one rounding."""
    acc = np.multiply(_flat(xs[0]), weights[0], dtype=np.float64)
    term = np.empty_like(acc)
    for x, w in zip(xs[1:], weights[1:]):
        np.multiply(_flat(x), w, out=term, dtype=np.float64)
        acc += term
    with _quiet():  # C does not warn when a sum overflows float32 to inf
        _flat(out)[...] = acc  # one float64 -> float32 rounding, nearest even


def axpy(y, x, a):
    """y += a * x in float32 (product rounded, then sum rounded)."""
    yf = _flat(y)
    with _quiet():
        yf += np.float32(a) * _flat(x)


def scale(x, a):
    """x *= a in float32."""
    xf = _flat(x)
    with _quiet():
        xf *= np.float32(a)


_LANES = 8


def _lane_total(products: np.ndarray) -> float:
    """vec.c's order: 8 float64 lanes summed in index order, then a fixed pairwise tree."""
    pad = (-products.size) % _LANES
    if pad:
        products = np.concatenate([products, np.zeros(pad)])
    s = products.reshape(-1, _LANES).sum(axis=0)  # axis-0 sums run row after row
    return float(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])))


def dot(x, y):
    """sum x*y in float64 (each product exact)."""
    return _lane_total(_flat(x).astype(np.float64) * _flat(y).astype(np.float64))


def sqnorm(x):
    """sum x*x in float64 (each product exact)."""
    xd = _flat(x).astype(np.float64)
    return _lane_total(xd * xd)


_FINITE_BLOCK = 1 << 16      # elements per isfinite() block: stays in L2, no big temporary


def first_nonfinite(x):
    """Index of the first NaN/inf in x, or -1; blockwise, no big temporary."""
    x = _flat(x)
    mask = np.empty(min(_FINITE_BLOCK, x.size), dtype=bool)
    for start in range(0, x.size, _FINITE_BLOCK):
        block = x[start:start + _FINITE_BLOCK]
        m = mask[:block.size]
        np.isfinite(block, out=m)
        if not m.all():
            return start + int(np.argmin(m))
    return -1


def _sorted_columns(xs):
    """(K, n) stack sorted along K, and the mask of coordinates that hold a NaN."""
    stack = np.stack([_flat(x) for x in xs])
    return np.sort(stack, axis=0), np.isnan(stack).any(axis=0)


def median(out, xs):
    """Coordinate-wise median; mean of the two middle values in float32 for even K; NaN wins."""
    s, nan = _sorted_columns(xs)
    k = s.shape[0]
    if k % 2:
        m = s[k // 2]
    else:
        with _quiet():
            m = (s[k // 2 - 1] + s[k // 2]) * np.float32(0.5)
    m[nan] = np.nan
    _flat(out)[...] = m


def trimmed_mean(out, xs, trim):
    """Drop the `trim` smallest and largest per coordinate; float64 sum in ascending order,
    divided by K - 2*trim, one rounding to float32. NaN wins."""
    s, nan = _sorted_columns(xs)
    k = s.shape[0]
    acc = s[trim].astype(np.float64)
    with _quiet():  # inf - inf is NaN here as in C, without a warning
        for r in range(trim + 1, k - trim):
            acc += s[r]
    m = (acc / (k - 2 * trim)).astype(np.float32)
    m[nan] = np.nan
    _flat(out)[...] = m


def f32_to_f16(out, x):
    """IEEE binary16 bits, round to nearest even: numpy's cast. A NaN becomes the quiet NaN
    sign | 0x7e00 | top payload bits (numpy would keep a signalling NaN signalling)."""
    xf = _flat(x)
    with _quiet():  # |x| >= 65520 becomes inf, silently as in C
        h = xf.astype(np.float16).view(np.uint16)
    nan = np.isnan(xf)
    if nan.any():
        b = xf[nan].view(np.uint32)
        h[nan] = (((b >> 16) & 0x8000) | 0x7E00 | ((b >> 13) & 0x3FF)).astype(np.uint16)
    _flat(out)[...] = h


def f16_to_f32(out, h):
    """float32 values of binary16 bits: numpy's cast. A NaN keeps its payload and is quiet."""
    hf = _flat(h)
    f = hf.view(np.float16).astype(np.float32)
    nan = np.isnan(f)
    if nan.any():
        b = hf[nan].astype(np.uint32)
        f[nan] = (((b & 0x8000) << 16) | 0x7FC00000 | ((b & 0x3FF) << 13)).view(np.float32)
    _flat(out)[...] = f


_I8_MAX = np.float32(127.0)


def _segment_scale(seg: np.ndarray) -> np.float32:
    """max|x| / 127 in float32 (NaNs ignored), or 1 when that is not > 0."""
    top = np.fmax.reduce(np.abs(seg), initial=np.float32(0.0))
    s = np.float32(top) / _I8_MAX
    return s if s > 0 else np.float32(1.0)


def f32_to_i8(out, scales, x, seg_offsets):
    """q = clamp(rint(x / scale), -127, 127) per segment; writes out and scales."""
    xf, of = _flat(x), _flat(out)
    for s in range(seg_offsets.size - 1):
        lo, hi = int(seg_offsets[s]), int(seg_offsets[s + 1])
        sc = _segment_scale(xf[lo:hi])
        scales.reshape(-1)[s] = sc
        with _quiet():
            v = np.rint(xf[lo:hi] / sc)
        v = np.where(v < _I8_MAX, v, _I8_MAX)  # written like codec.c: a NaN becomes 127
        v = np.where(v > -_I8_MAX, v, -_I8_MAX)
        of[lo:hi] = v.astype(np.int8)


def i8_to_f32(out, q, scales, seg_offsets):
    """x = float32(q) * scale of its segment."""
    qf, of, sf = _flat(q), _flat(out), _flat(scales)
    for s in range(seg_offsets.size - 1):
        lo, hi = int(seg_offsets[s]), int(seg_offsets[s + 1])
        of[lo:hi] = qf[lo:hi].astype(np.float32) * sf[s]


# ======================= networks (net.c) =================================================
# Every function here works in the dtype of `params` (float32 to mirror the C core, float64 as
# the oracle for finite-difference gradient checks).

_DENSE, _CONV, _POOL, _RELU, _FLAT = 1, 2, 3, 4, 5
_CE, _LOGISTIC, _MSE, _SQHINGE = 1, 2, 3, 4
EVAL_CHUNK = 128        # the C core's too (_core.EVAL_CHUNK; a test keeps them equal)


def _rows(net):
    for r in net.layers:
        yield tuple(int(v) for v in r)


def _im2col(x, k, stride, pad, oh, ow):
    """(B, C, H, W) -> (B, C*k*k, oh*ow), rows ordered (c, ky, kx) like the C core."""
    b, c = x.shape[:2]
    if pad:
        x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))
    win = win[:, :, ::stride, ::stride][:, :, :oh, :ow]       # (B, C, oh, ow, k, k)
    return win.transpose(0, 1, 4, 5, 2, 3).reshape(b, c * k * k, oh * ow)


def _col2im(col, shape, k, stride, pad, oh, ow):
    b, c, h, w = shape
    cols = col.reshape(b, c, k, k, oh, ow)
    out = np.zeros((b, c, h + 2 * pad, w + 2 * pad), dtype=col.dtype)
    for ky in range(k):
        for kx in range(k):
            out[:, :, ky:ky + stride * oh:stride, kx:kx + stride * ow:stride] += cols[:, :, ky, kx]
    return out[:, :, pad:pad + h, pad:pad + w]


def _pool_windows(x, k, stride, oh, ow):
    win = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(2, 3))
    win = win[:, :, ::stride, ::stride][:, :, :oh, :ow]
    return win.reshape(*win.shape[:4], k * k)                 # (B, C, oh, ow, k*k)


def _forward_all(net, params, x):
    """Activations of every layer; acts[0] is the input, acts[i+1] the output of layer i."""
    acts = [x.reshape(x.shape[0], -1).astype(params.dtype, copy=False)]
    for op, ic, ih, iw, oc, oh, ow, k, st, pad, wo, bo in _rows(net):
        a = acts[-1]
        b = a.shape[0]
        if op == _DENSE:
            w = params[wo:wo + oc * ic * ih * iw].reshape(oc, -1)
            out = a @ w.T
            if bo >= 0:
                out = out + params[bo:bo + oc]
        elif op == _CONV:
            w = params[wo:wo + oc * ic * k * k].reshape(oc, -1)
            col = _im2col(a.reshape(b, ic, ih, iw), k, st, pad, oh, ow)
            out = np.matmul(w, col)
            if bo >= 0:
                out = out + params[bo:bo + oc][None, :, None]
            out = out.reshape(b, -1)
        elif op == _POOL:
            out = _pool_windows(a.reshape(b, ic, ih, iw), k, st, oh, ow).max(axis=-1).reshape(b, -1)
        elif op == _RELU:
            out = np.maximum(a, 0)
        else:
            out = a
        acts.append(np.ascontiguousarray(out))
    return acts


def workspace_bytes(net, batch_size, n):
    """Bytes this twin holds at once for a local round of `net` on n samples with minibatches
    of batch_size (<= 0: the whole set), what the compiled core's workspace_bytes is to it:
    the minibatch's activations of every layer kept for the backward pass, each conv
    layer's columns for the whole minibatch (with its zero-bordered input), the largest
    activation's gradient twice (the layer's and the one passed down) and the parameters'
    gradient, and the shuffle's permutation and keys."""
    b = n if batch_size <= 0 or batch_size >= n else batch_size
    acts, largest, passing = 0, 0, 0      # floats a sample
    for op, ic, ih, iw, oc, oh, ow, k, st, pad, wo, bo in _rows(net):
        size = ic * ih * iw
        acts += size
        largest = max(largest, size, oc * oh * ow)
        if op == _CONV:       # backward: the columns, their gradient, the padded input's
            passing = max(passing, 2 * ic * k * k * oh * ow + ic * (ih + 2 * pad) * (iw + 2 * pad))
        elif op == _POOL:     # the windows copied (twice: forward's max, backward's argmax),
            passing = max(passing, 2 * ic * oh * ow * k * k + 2 * ic * oh * ow + size)  # int64 arg
    acts += int(net.n_out)
    itemsize = 4
    return itemsize * (b * (acts + 2 * largest + passing) + 2 * int(net.n_params)) + 16 * n


def _loss(net, scores, labels, targets, with_grad):
    """Per-sample losses summed, the number correct, and d(sum loss)/d(scores)."""
    z = scores
    n, c = z.shape
    dz = None
    if net.loss == _CE:
        m = z.max(axis=1, keepdims=True)
        e = np.exp(z - m)
        se = e.sum(axis=1, keepdims=True)
        total = float(np.sum(np.log(se[:, 0]) + m[:, 0] - z[np.arange(n), labels]))
        correct = int(np.sum(z.argmax(axis=1) == labels))
        if with_grad:
            dz = e / se
            dz[np.arange(n), labels] -= 1
    elif net.loss == _LOGISTIC:
        zz = z[:, 0].astype(np.float64)
        y = (labels == 1).astype(np.float64)
        total = float(np.sum(np.maximum(zz, 0) - y * zz + np.log1p(np.exp(-np.abs(zz)))))
        correct = int(np.sum((zz > 0) == (y > 0.5)))
        if with_grad:
            dz = (1.0 / (1.0 + np.exp(-zz)) - y).astype(z.dtype)[:, None]
    elif net.loss == _MSE:
        r = z - targets.reshape(n, c)
        total = float(0.5 * np.sum(r.astype(np.float64) ** 2))
        correct = int(np.sum((z[:, 0] > 0) == (targets.reshape(n, c)[:, 0] > 0))) if c == 1 else 0
        dz = r if with_grad else None
    else:  # squared hinge, one-vs-rest (one output: labels 0/1 -> -1/+1)
        if c == 1:
            y = np.where(labels == 1, 1.0, -1.0)[:, None].astype(z.dtype)
            correct = int(np.sum((z[:, 0] > 0) == (labels == 1)))
        else:
            y = -np.ones_like(z)
            y[np.arange(n), labels] = 1
            correct = int(np.sum(z.argmax(axis=1) == labels))
        h = np.maximum(0, 1 - y * z)
        total = float(0.5 * np.sum(h.astype(np.float64) ** 2))
        dz = -y * h if with_grad else None
    return total, correct, dz


def _l2(net, params, grad):
    if not net.l2:
        return 0.0
    acc = 0.0
    for op, ic, ih, iw, oc, oh, ow, k, st, pad, wo, bo in _rows(net):
        if op not in (_DENSE, _CONV):
            continue
        nw = oc * ic * ih * iw if op == _DENSE else oc * ic * k * k
        w = params[wo:wo + nw]
        acc += float(np.dot(w.astype(np.float64), w))
        if grad is not None:
            grad[wo:wo + nw] += params.dtype.type(net.l2) * w
    return 0.5 * net.l2 * acc


def _backward(net, params, acts, dz, grad):
    """Accumulate parameter gradients into grad given d(loss)/d(scores) = dz."""
    rows = list(_rows(net))
    first_param = min(i for i, r in enumerate(rows) if r[0] in (_DENSE, _CONV))
    d = dz
    for i in range(len(rows) - 1, first_param - 1, -1):
        op, ic, ih, iw, oc, oh, ow, k, st, pad, wo, bo = rows[i]
        a, out = acts[i], acts[i + 1]
        b = a.shape[0]
        need_din = i > first_param
        if op == _DENSE:
            w = params[wo:wo + oc * ic * ih * iw].reshape(oc, -1)
            grad[wo:wo + w.size] += (d.T @ a).reshape(-1)
            if bo >= 0:
                grad[bo:bo + oc] += d.sum(axis=0)
            d = d @ w if need_din else None
        elif op == _CONV:
            w = params[wo:wo + oc * ic * k * k].reshape(oc, -1)
            col = _im2col(a.reshape(b, ic, ih, iw), k, st, pad, oh, ow)
            d3 = d.reshape(b, oc, oh * ow)
            grad[wo:wo + w.size] += np.einsum("bop,bqp->oq", d3, col).reshape(-1)
            if bo >= 0:
                grad[bo:bo + oc] += d3.sum(axis=(0, 2))
            if need_din:
                dcol = np.matmul(w.T, d3)
                d = _col2im(dcol, (b, ic, ih, iw), k, st, pad, oh, ow).reshape(b, -1)
        elif op == _POOL:
            win = _pool_windows(a.reshape(b, ic, ih, iw), k, st, oh, ow)
            arg = win.argmax(axis=-1)                          # first maximum, as in C
            d4 = d.reshape(b, ic, oh, ow)
            din = np.zeros((b, ic, ih, iw), dtype=d.dtype)
            for j in range(k * k):
                ky, kx = divmod(j, k)
                din[:, :, ky:ky + st * oh:st, kx:kx + st * ow:st] += np.where(arg == j, d4, 0)
            d = din.reshape(b, -1)
        elif op == _RELU:
            d = np.where(out > 0, d, 0).astype(d.dtype)
        # flatten: gradient passes through unchanged


def _batch_grad(grad, net, params, x, labels, targets):
    """Mean loss (with l2) and its gradient over all samples of x (grad overwritten)."""
    n = x.shape[0]
    acts = _forward_all(net, params, x)
    total, _, dz = _loss(net, acts[-1], labels, targets, True)
    grad[:] = 0
    _backward(net, params, acts, (dz / n).astype(params.dtype), grad)
    return total / n + _l2(net, params, grad)


def forward(out, net, params, x):
    out[...] = _forward_all(net, params, x)[-1].reshape(out.shape)
    return out


def loss_grad(grad, net, params, x, labels, targets):
    loss = _batch_grad(grad, net, params, x, labels, targets)
    if not np.isfinite(loss):
        from .errors import NonFiniteError
        raise NonFiniteError(0, f"loss_grad: loss is {loss} (not finite)")
    return loss


def evaluate(net, params, x, labels, targets):
    total, correct = 0.0, 0
    for s in range(0, x.shape[0], EVAL_CHUNK):
        sl = slice(s, s + EVAL_CHUNK)
        scores = _forward_all(net, params, x[sl])[-1]
        t, c, _ = _loss(net, scores, None if labels is None else labels[sl],
                        None if targets is None else targets[sl], False)
        total += t
        correct += c
    return total, correct


def _splitmix64(z):
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def shuffle_keys(seed, epoch, n):
    with np.errstate(over="ignore"):
        s = np.array([seed], dtype=np.uint64) ^ (np.array([0x9E3779B97F4A7C15], dtype=np.uint64)
                                                 * np.array([epoch + 1], dtype=np.uint64))
        stream = _splitmix64(s)
        return _splitmix64(stream + np.arange(n, dtype=np.uint64))


def shuffle(seed, epoch, n):
    """Indices sorted by (key(seed, epoch, i), i): the C core's epoch permutation."""
    return np.argsort(shuffle_keys(seed, epoch, n), kind="stable").astype(np.int64)


def local_train(params, momentum, net, x, labels, targets, cfg, grad0=None, grad_sum=None,
                step_stats=None, anchor=None, stop_word=None):
    # overflow is detected and reported as NonFiniteError below, not as NumPy warnings
    with np.errstate(over="ignore", invalid="ignore"):
        return _local_train(params, momentum, net, x, labels, targets, cfg, grad0, grad_sum,
                            step_stats, anchor, stop_word)


def _local_train(params, momentum, net, x, labels, targets, cfg, grad0, grad_sum, step_stats,
                 anchor, stop_word):
    from .errors import NonFiniteError, TrainingStopped

    n = x.shape[0]
    full = cfg["batch_size"] <= 0 or cfg["batch_size"] >= n
    bs = n if full else cfg["batch_size"]
    total = cfg["steps"] if cfg["steps"] > 0 else cfg["epochs"] * -(-n // bs)
    dt = params.dtype.type
    lr, mom, wd = dt(cfg["lr"]), dt(cfg["momentum"]), dt(cfg["weight_decay"])
    mu = dt(cfg["prox_mu"])
    g = np.empty_like(params)
    if step_stats is not None:
        w_start, run_sum = params.copy(), np.zeros_like(params)
    if grad0 is not None and cfg["grad0_mode"] == 2:
        l0 = _batch_grad(grad0, net, params, x, labels, targets)
        if not np.isfinite(l0) or not np.all(np.isfinite(grad0)):
            raise NonFiniteError(0, "local_train: non-finite start-point gradient")
    perm, epoch, pos, loss_acc, samples = None, 0, n, 0.0, 0
    for step in range(total):
        if stop_word is not None:     # net.c's rule: v > 0 stops before step v - 1 (or now)
            word = int(stop_word[0])
            if word > 0 and step >= word - 1:
                raise TrainingStopped(step, samples, loss_acc / step if step else 0.0)
        if full:
            idx = np.arange(n)
        else:
            if pos >= n:
                perm, epoch, pos = shuffle(cfg["seed"], epoch, n), epoch + 1, 0
            idx = perm[pos:pos + bs]
            pos += idx.size
        loss = _batch_grad(g, net, params, x[idx], None if labels is None else labels[idx],
                           None if targets is None else targets[idx])
        if not np.isfinite(loss) or not np.all(np.isfinite(g)):
            raise NonFiniteError(step, f"local_train: non-finite loss or gradient at step {step} "
                                       f"(loss {loss}); lower the learning rate")
        loss_acc += loss
        if grad0 is not None and step == 0 and cfg["grad0_mode"] != 2:
            grad0[:] = g
        if step_stats is not None and step < step_stats.shape[0]:
            run_sum += g
            step_stats[step, 0] = np.linalg.norm(grad0.astype(np.float64) - g)
            step_stats[step, 1] = np.linalg.norm(w_start.astype(np.float64) - params)
            step_stats[step, 2] = float(np.dot(run_sum.astype(np.float64), run_sum))
        if wd:
            g += wd * params
        if mu:  # FedProx's proximal term, in net.c's float32 order: g += mu * (w - anchor)
            g += mu * (params - anchor)
        if grad_sum is not None:
            grad_sum += g
        if momentum is not None:
            momentum *= mom
            momentum += g
            params -= lr * momentum
        else:
            params -= lr * g
        samples += idx.size
    return {"mean_loss": loss_acc / total if total else 0.0, "steps": total, "samples": samples}


# ======================= secure aggregation's ring arithmetic (secagg.c) =================
# The kernel's steps in the same order: clip and scale in float64, u from splitmix64's
# finaliser over the counter seed + (i + 1) * GOLDEN (uint64 wrap-around, as in C), floor,
# int64, times the weight mod 2^64, then the low bits.

_GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def quantize(out, x, clip, scale, weight, seed, stochastic, add=False):
    """out = floor(clip(x) * scale + u) * weight mod 2^bits (add: out += it) (secagg.c)."""
    v = np.clip(_flat(x).astype(np.float64), -clip, clip) * scale
    if stochastic:
        with np.errstate(over="ignore"):
            counter = np.uint64(seed) + np.arange(1, v.size + 1, dtype=np.uint64) * _GOLDEN64
            u = (_mix64(counter) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    else:
        u = 0.5
    k = np.floor(v + u).astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        words = k * np.uint64(weight)
    if add:
        np.add(_flat(out), words.astype(out.dtype), out=_flat(out))
    else:
        _flat(out)[...] = words.astype(out.dtype)


def ring_add(x, m, subtract):
    """x += m or x -= m, wrapping mod 2^bits (numpy's unsigned arithmetic wraps)."""
    xf = _flat(x)
    if subtract:
        np.subtract(xf, _flat(m), out=xf)
    else:
        np.add(xf, _flat(m), out=xf)


def dequantize(out, words, unit):
    """out = signed(words) * unit, one rounding to float32."""
    signed = _flat(words).view(np.int32 if words.dtype.itemsize == 4 else np.int64)
    _flat(out)[...] = signed.astype(np.float64) * unit


# AES-256-CTR masks (secagg.c's ef_secagg_mask): each key's keystream from `cryptography`
# (OpenSSL inside it), what it encrypts zeros to, over the words' bytes then 8 bytes per
# scalar, added (or subtracted) mod 2^bits. Walked in blocks, every key's stream over a block
# before the next, so the block stays in cache and the keystream buffer is one block.
MASK_BLOCK = 1 << 18


def _aes_ctr(key: bytes, counter: int = 0):
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    return Cipher(algorithms.AES(key), modes.CTR(counter.to_bytes(16, "big"))).encryptor()


def secagg_mask(words, scalars, keys, subtract, x, clip, scale, weight, seed, stochastic,
                counter=0):
    """words, scalars (+|-)= the AES-256-CTR keystream of each 32-byte key in `keys` (sign
    from the bytes of `subtract`), from byte 16 * counter of the streams, after quantising x
    into words when x is not None."""
    if x is not None:
        quantize(words, x, clip, scale, weight, seed, stochastic)
    streams = [_aes_ctr(keys[32 * k:32 * k + 32], counter) for k in range(len(subtract))]
    flat = _flat(words)
    block = max(1, MASK_BLOCK // flat.itemsize)
    zeros = memoryview(bytes(max(MASK_BLOCK, scalars.nbytes)))   # sliced without copying
    scratch = bytearray(len(zeros))
    for start in range(0, flat.size, block):
        part = flat[start:start + block]
        for encryptor, sub in zip(streams, subtract):
            encryptor.update_into(zeros[:part.nbytes], scratch)
            ring_add(part, np.frombuffer(scratch, flat.dtype, part.size), sub)
    for encryptor, sub in zip(streams, subtract):
        encryptor.update_into(zeros[:scalars.nbytes], scratch)
        ring_add(scalars, np.frombuffer(scratch, np.uint64, scalars.size), sub)
    return True
