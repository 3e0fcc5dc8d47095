/* net.c - layer-table networks: forward, backward, losses, evaluation and the local training round. */
#include "edgefl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A convolution can lower a group of samples into one GEMM (N = group * out_h * out_w), with
 * the group's columns plus its output block capped at this many floats. Per-sample GEMMs
 * (budget 0, the default) need no copies: a sample's GEMM output [out_c, ohw] is its NCHW
 * activation and its dout is the GEMM operand as it stands. Measured on cnn-mnist at batch 32
 * (x86-64, OpenBLAS, one thread) they beat 1 MB groups by 2-5% once im2col stopped calling
 * memcpy; 16 MB groups were 35% slower (columns out of cache). Kept as a build switch for
 * boards whose GEMM prefers wider N. */
#ifndef EF_CONV_COL_BUDGET
#define EF_CONV_COL_BUDGET 0
#endif

/* ---------------------------------------------------------------- shapes and workspace */

static int64_t in_size(const ef_layer *l) { return (int64_t)l->in_c * l->in_h * l->in_w; }
static int64_t out_size(const ef_layer *l) { return (int64_t)l->out_c * l->out_h * l->out_w; }

/* Where each piece of the float workspace starts, for a given chunk size. */
typedef struct {
    float *x;           /* gathered input chunk  [chunk * in_size(layer 0)] */
    float *act[64];     /* output of each layer  [chunk * out_size(l)] (flatten aliases its input;
                           a ReLU fused into the pool after it, see relu_then_pool, stays unwritten) */
    float *delta_a;     /* backward ping-pong    [chunk * max act size] */
    float *delta_b;
    float *col;         /* a conv group's columns and output block (conv_group()), then
                           one sample's zero-bordered input (padded_size()) */
    float *grad;        /* per-step gradient     [n_params] */
    int32_t *arg[64];   /* max-pool layers: where each output's maximum sits in the chunk's
                           input [chunk * out_size(l)], so backward scatters without searching */
    int64_t total;
} layout;

/* One sample's input with its zero border, which im2col copies rows from (floats). */
static int64_t padded_size(const ef_layer *l)
{
    return (int64_t)l->in_c * (l->in_h + 2 * l->pad) * (l->in_w + 2 * l->pad);
}

/* Samples lowered together by a conv layer, and the floats that takes. */
static int64_t conv_group(const ef_layer *l, int64_t chunk)
{
    const int64_t per = ((int64_t)l->in_c * l->k * l->k + l->out_c) * l->out_h * l->out_w;
    int64_t g = EF_CONV_COL_BUDGET / per;
    if (g > chunk) g = chunk;
    return g < 1 ? 1 : g;
}

/* Sizes the kernels index. A per-sample activation and a GEMM dimension stay within int32
 * (scipy-openblas32 takes int32 sizes; a dense layer's input is a GEMM dimension; the pool's
 * argmax and im2col's row arithmetic are int32); a conv's per-sample scratch within 2^40
 * floats; the parameter count within 2^62. With chunk <= EF_MAX_CHUNK and at most 64
 * layers, every offset make_layout sums then stays far inside int64. */
#define EF_MAX_SCRATCH ((int64_t)1 << 40)
#define EF_MAX_PARAMS ((int64_t)1 << 62)

/* a * b * c of positive int32s, or -1 when it passes `limit` (no intermediate overflows:
 * a * b < 2^62, and the second product is taken only when a * b <= limit / c) */
static int64_t bounded_product(int64_t a, int64_t b, int64_t c, int64_t limit)
{
    const int64_t ab = a * b;
    return ab > limit / c ? -1 : ab * c;
}

static int check_net(const ef_net *net)
{
    if (!net || net->n_layers <= 0 || net->n_layers > 64 || !net->layers) return EF_ERR_ARGS;
    if (net->n_params < 0 || net->n_params > EF_MAX_PARAMS) return EF_ERR_ARGS;
    for (int32_t i = 0; i < net->n_layers; i++) {
        const ef_layer *l = &net->layers[i];
        /* dimensions first, so in_size and out_size below cannot overflow */
        if (l->in_c <= 0 || l->in_h <= 0 || l->in_w <= 0 || l->out_c <= 0 || l->out_h <= 0 ||
            l->out_w <= 0)
            return EF_ERR_ARGS;
        if (bounded_product(l->in_c, l->in_h, l->in_w, INT32_MAX) < 0 ||
            bounded_product(l->out_c, l->out_h, l->out_w, INT32_MAX) < 0)
            return EF_ERR_ARGS;
        if (i > 0 && in_size(l) != out_size(&net->layers[i - 1])) return EF_ERR_ARGS;
        switch (l->op) {
        case EF_DENSE: /* [out_c] per sample: forward writes out_c values, no more */
            if (l->out_h != 1 || l->out_w != 1) return EF_ERR_ARGS;
            /* weights in_size * out_c < 2^62; compared without forming w_off + weights */
            if (l->w_off < 0 || in_size(l) * l->out_c > net->n_params - l->w_off)
                return EF_ERR_ARGS;
            break;
        case EF_CONV2D: {
            /* in int64 (2 * pad may not fit an int32), and the window within the padded input:
             * C's division truncates toward zero, so (1 - 3) / 3 + 1 = 1 where the builder's
             * floor gives 0, and the window would read past the input */
            if (l->k <= 0 || l->stride <= 0 || l->pad < 0) return EF_ERR_ARGS;
            const int64_t ph = (int64_t)l->in_h + 2 * (int64_t)l->pad;
            const int64_t pw = (int64_t)l->in_w + 2 * (int64_t)l->pad;
            if (ph < l->k || pw < l->k) return EF_ERR_ARGS;
            if (l->out_h != (ph - l->k) / l->stride + 1) return EF_ERR_ARGS;
            if (l->out_w != (pw - l->k) / l->stride + 1) return EF_ERR_ARGS;
            /* the padded sides are int32 in padded_size and im2col's row arithmetic; the GEMM
             * depth in_c * k * k is a BLAS dimension; the per-sample scratch (the padded input,
             * the columns and the output block, conv_group) is bounded */
            if (ph > INT32_MAX || pw > INT32_MAX) return EF_ERR_ARGS;
            const int64_t ckk = bounded_product(l->in_c, l->k, l->k, INT32_MAX);
            if (ckk < 0 || bounded_product(l->in_c, ph, pw, EF_MAX_SCRATCH) < 0) return EF_ERR_ARGS;
            if ((ckk + l->out_c) > EF_MAX_SCRATCH / ((int64_t)l->out_h * l->out_w))
                return EF_ERR_ARGS;
            if (l->w_off < 0 || (int64_t)l->out_c * ckk > net->n_params - l->w_off)
                return EF_ERR_ARGS;
            break;
        }
        case EF_MAXPOOL2D: /* the window within the input, as for a conv */
            if (l->k <= 0 || l->stride <= 0 || l->pad != 0 || l->in_c != l->out_c) return EF_ERR_ARGS;
            if (l->in_h < l->k || l->in_w < l->k) return EF_ERR_ARGS;
            if (l->out_h != (l->in_h - l->k) / l->stride + 1) return EF_ERR_ARGS;
            if (l->out_w != (l->in_w - l->k) / l->stride + 1) return EF_ERR_ARGS;
            if (EF_MAX_CHUNK * in_size(l) > INT32_MAX) return EF_ERR_ARGS; /* int32 argmax */
            break;
        case EF_RELU:
        case EF_FLATTEN:
            if (in_size(l) != out_size(l)) return EF_ERR_ARGS;
            break;
        default:
            return EF_ERR_ARGS;
        }
        if (l->b_off >= 0 && l->out_c > net->n_params - l->b_off) return EF_ERR_ARGS;
    }
    return EF_OK;
}

static int64_t make_layout(layout *lay, float *base, const ef_net *net, int64_t chunk)
{
    int64_t off = 0, max_act = in_size(&net->layers[0]), max_col = 0;
    lay->x = base ? base + off : NULL;
    off += chunk * in_size(&net->layers[0]);
    for (int32_t i = 0; i < net->n_layers; i++) {
        const ef_layer *l = &net->layers[i];
        if (l->op == EF_FLATTEN) {
            lay->act[i] = i == 0 ? lay->x : lay->act[i - 1];
        } else {
            lay->act[i] = base ? base + off : NULL;
            off += chunk * out_size(l);
        }
        if (out_size(l) > max_act) max_act = out_size(l);
        if (l->op == EF_CONV2D) {
            int64_t c = conv_group(l, chunk) * ((int64_t)l->in_c * l->k * l->k + l->out_c) *
                            l->out_h * l->out_w + padded_size(l);
            if (c > max_col) max_col = c;
        }
    }
    lay->delta_a = base ? base + off : NULL;
    off += chunk * max_act;
    lay->delta_b = base ? base + off : NULL;
    off += chunk * max_act;
    lay->col = base ? base + off : NULL;
    off += max_col;
    lay->grad = base ? base + off : NULL;
    off += net->n_params;
    /* int32 indices stored in float-sized slots of the same (allocated, untyped) buffer */
    for (int32_t i = 0; i < net->n_layers; i++) {
        const ef_layer *l = &net->layers[i];
        lay->arg[i] = NULL;
        if (l->op != EF_MAXPOOL2D) continue;
        lay->arg[i] = base ? (int32_t *)(void *)(base + off) : NULL;
        off += chunk * out_size(l);
    }
    lay->total = off;
    return off;
}

int64_t ef_chunk_for_batch(int64_t batch_size, int64_t n)
{
    int64_t b = (batch_size <= 0 || batch_size > n) ? n : batch_size;
    if (b > EF_MAX_CHUNK) b = EF_MAX_CHUNK;
    return b < 1 ? 1 : b;
}

int ef_workspace_size(int64_t *n_float, int64_t *n_int, const ef_net *net, int64_t chunk,
                      int64_t n)
{
    layout lay;
    if (check_net(net) != EF_OK || chunk <= 0 || chunk > EF_MAX_CHUNK) return EF_ERR_ARGS;
    if (n > INT64_MAX / 8) return EF_ERR_ARGS; /* 5n int64s, then bytes */
    *n_float = make_layout(&lay, NULL, net, chunk);
    *n_int = 5 * (n > 0 ? n : 0); /* permutation + (key, index) pairs + radix-sort buffer */
    return EF_OK;
}

/* ---------------------------------------------------------------- layers */

/* Output columns ox whose input column ox*stride - pad + kx lies inside [0, in_w). */
static void valid_cols(int32_t *lo, int32_t *hi, const ef_layer *l, int32_t kx)
{
    int32_t a = 0, b = l->out_w;
    while (a < b && a * l->stride - l->pad + kx < 0) a++;
    while (b > a && (b - 1) * l->stride - l->pad + kx >= l->in_w) b--;
    *lo = a;
    *hi = b;
}

/* dst[0..n) = src[0..n) for 8 <= n, as fixed 8-float blocks (the last one overlapping) that
 * compile to a vector move each: rows of 14 or 28 floats made memcpy calls a tenth of the
 * training time. */
static inline void copy_row8(float *restrict dst, const float *restrict src, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int t = 0; t < 8; t++) dst[j + t] = src[j + t];
    if (j < n)
        for (int t = 0; t < 8; t++) dst[n - 8 + t] = src[n - 8 + t];
}

/* Stride 1 with rows of at least 8: copy the image into a zero-bordered buffer once, then
 * every column row is out_h plain copies with no bounds checks. */
static void im2col_padded(float *restrict col, const float *restrict img, float *restrict padded,
                          const ef_layer *l, int64_t ld)
{
    const int64_t ph = l->in_h + 2 * l->pad, pw = l->in_w + 2 * l->pad;
    for (int32_t c = 0; c < l->in_c; c++) {
        float *pc = padded + (int64_t)c * ph * pw;
        const float *ic = img + (int64_t)c * l->in_h * l->in_w;
        for (int64_t y = 0; y < ph; y++) {
            float *prow = pc + y * pw;
            const int64_t iy = y - l->pad;
            if (iy < 0 || iy >= l->in_h) {
                for (int64_t x = 0; x < pw; x++) prow[x] = 0.0f;
                continue;
            }
            for (int64_t x = 0; x < l->pad; x++) prow[x] = prow[pw - 1 - x] = 0.0f;
            if (l->in_w >= 8) copy_row8(prow + l->pad, ic + iy * l->in_w, l->in_w);
            else for (int64_t x = 0; x < l->in_w; x++) prow[l->pad + x] = ic[iy * l->in_w + x];
        }
    }
    for (int32_t c = 0; c < l->in_c; c++)
        for (int32_t ky = 0; ky < l->k; ky++)
            for (int32_t kx = 0; kx < l->k; kx++) {
                float *row = col + (((int64_t)c * l->k + ky) * l->k + kx) * ld;
                const float *src = padded + ((int64_t)c * ph + ky) * pw + kx;
                for (int32_t oy = 0; oy < l->out_h; oy++)
                    copy_row8(row + (int64_t)oy * l->out_w, src + (int64_t)oy * pw, l->out_w);
            }
}

/* One sample's image -> columns (rows ordered c, ky, kx; row stride ld, so a group of samples
 * sits side by side), bounds hoisted out of the inner loop so the copy is contiguous.
 * padded: padded_size(l) floats of scratch. */
static void im2col(float *restrict col, const float *restrict img, float *restrict padded,
                   const ef_layer *l, int64_t ld)
{
    if (l->stride == 1 && l->out_w >= 8) {
        im2col_padded(col, img, padded, l, ld);
        return;
    }
    const int64_t ohw = ld;
    for (int32_t c = 0; c < l->in_c; c++)
        for (int32_t ky = 0; ky < l->k; ky++)
            for (int32_t kx = 0; kx < l->k; kx++) {
                float *row = col + (((int64_t)c * l->k + ky) * l->k + kx) * ohw;
                const float *plane = img + (int64_t)c * l->in_h * l->in_w;
                int32_t lo, hi;
                valid_cols(&lo, &hi, l, kx);
                for (int32_t oy = 0; oy < l->out_h; oy++) {
                    int32_t iy = oy * l->stride - l->pad + ky;
                    float *dst = row + (int64_t)oy * l->out_w;
                    if (iy < 0 || iy >= l->in_h) {
                        memset(dst, 0, sizeof(float) * (size_t)l->out_w);
                        continue;
                    }
                    const float *src = plane + (int64_t)iy * l->in_w - l->pad + kx;
                    for (int32_t ox = 0; ox < lo; ox++) dst[ox] = 0.0f;
                    if (l->stride == 1) {
                        memcpy(dst + lo, src + lo, sizeof(float) * (size_t)(hi - lo));
                    } else {
                        for (int32_t ox = lo; ox < hi; ox++) dst[ox] = src[ox * l->stride];
                    }
                    for (int32_t ox = hi; ox < l->out_w; ox++) dst[ox] = 0.0f;
                }
            }
}

/* Stride 1: accumulate into the zero-bordered buffer with no bounds checks, then copy its
 * interior out (the mirror of im2col_padded). */
static void col2im_padded(float *restrict img, const float *restrict col, float *restrict padded,
                          const ef_layer *l, int64_t ld)
{
    const int64_t ph = l->in_h + 2 * l->pad, pw = l->in_w + 2 * l->pad;
    memset(padded, 0, sizeof(float) * (size_t)padded_size(l));
    for (int32_t c = 0; c < l->in_c; c++)
        for (int32_t ky = 0; ky < l->k; ky++)
            for (int32_t kx = 0; kx < l->k; kx++) {
                const float *row = col + (((int64_t)c * l->k + ky) * l->k + kx) * ld;
                float *dst = padded + ((int64_t)c * ph + ky) * pw + kx;
                for (int32_t oy = 0; oy < l->out_h; oy++) {
                    const float *restrict src = row + (int64_t)oy * l->out_w;
                    float *restrict d = dst + (int64_t)oy * pw;
                    for (int32_t ox = 0; ox < l->out_w; ox++) d[ox] += src[ox];
                }
            }
    for (int32_t c = 0; c < l->in_c; c++)
        for (int32_t iy = 0; iy < l->in_h; iy++) {
            float *restrict d = img + ((int64_t)c * l->in_h + iy) * l->in_w;
            const float *restrict src = padded + ((int64_t)c * ph + iy + l->pad) * pw + l->pad;
            if (l->in_w >= 8) copy_row8(d, src, l->in_w);
            else for (int32_t x = 0; x < l->in_w; x++) d[x] = src[x];
        }
}

/* padded: padded_size(l) floats of scratch (used for stride 1). */
static void col2im(float *restrict img, const float *restrict col, float *restrict padded,
                   const ef_layer *l, int64_t ld)
{
    if (l->stride == 1) {
        col2im_padded(img, col, padded, l, ld);
        return;
    }
    const int64_t ohw = ld;
    memset(img, 0, sizeof(float) * (size_t)in_size(l));
    for (int32_t c = 0; c < l->in_c; c++)
        for (int32_t ky = 0; ky < l->k; ky++)
            for (int32_t kx = 0; kx < l->k; kx++) {
                const float *row = col + (((int64_t)c * l->k + ky) * l->k + kx) * ohw;
                float *plane = img + (int64_t)c * l->in_h * l->in_w;
                int32_t lo, hi;
                valid_cols(&lo, &hi, l, kx);
                for (int32_t oy = 0; oy < l->out_h; oy++) {
                    int32_t iy = oy * l->stride - l->pad + ky;
                    if (iy < 0 || iy >= l->in_h) continue;
                    const float *restrict src = row + (int64_t)oy * l->out_w;
                    float *restrict dst = plane + (int64_t)iy * l->in_w - l->pad + kx;
                    if (l->stride == 1) {
                        for (int32_t ox = lo; ox < hi; ox++) dst[ox] += src[ox];
                    } else {
                        for (int32_t ox = lo; ox < hi; ox++) dst[ox * l->stride] += src[ox];
                    }
                }
            }
}

/* Separate restrict-qualified loops so the compiler vectorises the select. */
static void relu_forward(float *restrict out, const float *restrict in, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        const float v = in[i];
        out[i] = v > 0.0f ? v : 0.0f;
    }
}

static void relu_backward(float *restrict din, const float *restrict out,
                          const float *restrict dout, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        const float d = dout[i]; /* unconditional load: lets the select vectorise */
        din[i] = out[i] > 0.0f ? d : 0.0f;
    }
}

/* Sum of n floats with eight independent partial sums (vectorisable, fixed order). */
static float sum8(const float *x, int64_t n)
{
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j];
    float t = 0.0f;
    for (; i < n; i++) t += x[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + t;
}

/* Max pooling, recording where each output's maximum sits in the chunk's input (the first
 * maximum of the window, as the NumPy reference picks), so backward scatters without
 * searching again. 2x2 windows with stride 2 (every pool of cnn-mnist) take a branch-free
 * loop the compiler vectorises: random activations made the generic loop's compares
 * mispredict. The pair-wise tree keeps first-maximum order: ties go to the earlier element.
 * relu: apply a ReLU to the maxima (see relu_then_pool) and record -1 where the maximum is
 * <= 0, since the ReLU passes no gradient there. */
static void maxpool_forward(float *restrict out, int32_t *restrict arg, const float *restrict in,
                            const ef_layer *l, int64_t b, int relu)
{
    const int64_t isz = in_size(l), osz = out_size(l), iw = l->in_w;
    for (int64_t s = 0; s < b; s++)
        for (int32_t c = 0; c < l->in_c; c++) {
            const int64_t poff = s * isz + (int64_t)c * l->in_h * l->in_w;
            const float *plane = in + poff;
            for (int32_t oy = 0; oy < l->out_h; oy++) {
                float *restrict o = out + s * osz + ((int64_t)c * l->out_h + oy) * l->out_w;
                int32_t *restrict a = arg + s * osz + ((int64_t)c * l->out_h + oy) * l->out_w;
                const int64_t row = (int64_t)oy * l->stride * iw;
                if (l->k == 2 && l->stride == 2) {
                    const float *restrict r0 = plane + row, *restrict r1 = r0 + iw;
                    const int32_t at0 = (int32_t)(poff + row);
                    for (int32_t ox = 0; ox < l->out_w; ox++) {
                        const float v0 = r0[2 * ox], v1 = r0[2 * ox + 1];
                        const float v2 = r1[2 * ox], v3 = r1[2 * ox + 1];
                        const int32_t i0 = at0 + 2 * ox, i2 = i0 + (int32_t)iw;
                        const float m01 = v1 > v0 ? v1 : v0, m23 = v3 > v2 ? v3 : v2;
                        const int32_t a01 = v1 > v0 ? i0 + 1 : i0, a23 = v3 > v2 ? i2 + 1 : i2;
                        const float m = m23 > m01 ? m23 : m01;
                        const int32_t at = m23 > m01 ? a23 : a01;
                        o[ox] = relu ? (m > 0.0f ? m : 0.0f) : m;
                        a[ox] = relu ? (m > 0.0f ? at : -1) : at;
                    }
                    continue;
                }
                for (int32_t ox = 0; ox < l->out_w; ox++) {
                    const int64_t q = row + (int64_t)ox * l->stride;
                    int64_t at = q;
                    float m = plane[q];
                    for (int32_t ky = 0; ky < l->k; ky++)
                        for (int32_t kx = 0; kx < l->k; kx++) {
                            const int64_t p = q + (int64_t)ky * iw + kx;
                            if (plane[p] > m) { m = plane[p]; at = p; }
                        }
                    o[ox] = relu ? (m > 0.0f ? m : 0.0f) : m;
                    a[ox] = relu && !(m > 0.0f) ? -1 : (int32_t)(poff + at);
                }
            }
        }
}

/* din = dout routed to each window's recorded maximum (none for arg -1), zero elsewhere: one
 * memset, then one scatter. The scatter is branch-free (a masked output adds 0 to din[0]):
 * after a fused ReLU about half the outputs are masked at random, and a branch on it, like
 * the compare-per-input loop it replaced, mispredicted its way to 6% of a cnn-mnist step.
 * += keeps overlapping windows (stride < k) right. */
static void maxpool_backward(float *restrict din, const float *restrict dout,
                             const int32_t *restrict arg, const ef_layer *l, int64_t b)
{
    const int64_t n = b * out_size(l);
    memset(din, 0, sizeof(float) * (size_t)(b * in_size(l)));
    for (int64_t j = 0; j < n; j++) {
        const int32_t a = arg[j];
        const float g = a >= 0 ? dout[j] : 0.0f;
        din[a >= 0 ? a : 0] += g;
    }
}

static void layer_forward(float *out, int32_t *arg, const float *in, float *col,
                          const ef_layer *l, const float *params, int64_t b)
{
    const int64_t isz = in_size(l), osz = out_size(l);
    switch (l->op) {
    case EF_DENSE: {
        const float *w = params + l->w_off;
        ef_sgemm(0, 1, b, l->out_c, isz, 1.0f, in, isz, w, isz, 0.0f, out, l->out_c);
        if (l->b_off >= 0) {
            const float *bias = params + l->b_off;
            for (int64_t s = 0; s < b; s++)
                for (int32_t o = 0; o < l->out_c; o++) out[s * l->out_c + o] += bias[o];
        }
        break;
    }
    case EF_CONV2D: {
        const float *w = params + l->w_off;
        const int64_t ohw = (int64_t)l->out_h * l->out_w, ckk = (int64_t)l->in_c * l->k * l->k;
        const int64_t g = conv_group(l, b);
        for (int64_t s0 = 0; s0 < b; s0 += g) {
            const int64_t nb = b - s0 < g ? b - s0 : g, ld = nb * ohw;
            if (nb == 1) { /* one sample: its GEMM output [out_c, ohw] is already NCHW */
                float *o = out + s0 * osz;
                im2col(col, in + s0 * isz, col + ckk * ohw, l, ohw);
                ef_sgemm(0, 0, l->out_c, ohw, ckk, 1.0f, w, ckk, col, ohw, 0.0f, o, ohw);
                if (l->b_off >= 0)
                    for (int32_t c = 0; c < l->out_c; c++) {
                        const float bc = params[l->b_off + c];
                        for (int64_t p = 0; p < ohw; p++) o[c * ohw + p] += bc;
                    }
                continue;
            }
            float *res = col + ckk * ld; /* [out_c, nb * ohw] */
            float *padded = col + (ckk + l->out_c) * g * ohw;
            for (int64_t s = 0; s < nb; s++)
                im2col(col + s * ohw, in + (s0 + s) * isz, padded, l, ld);
            ef_sgemm(0, 0, l->out_c, ld, ckk, 1.0f, w, ckk, col, ld, 0.0f, res, ld);
            for (int64_t s = 0; s < nb; s++)
                for (int32_t c = 0; c < l->out_c; c++) {
                    float *o = out + (s0 + s) * osz + c * ohw;
                    const float *r = res + c * ld + s * ohw;
                    const float bc = l->b_off >= 0 ? params[l->b_off + c] : 0.0f;
                    for (int64_t p = 0; p < ohw; p++) o[p] = r[p] + bc;
                }
        }
        break;
    }
    case EF_MAXPOOL2D:
        maxpool_forward(out, arg, in, l, b, 0);
        break;
    case EF_RELU:
        relu_forward(out, in, b * osz);
        break;
    case EF_FLATTEN:
        break; /* the output aliases the input */
    }
}

/* dout -> parameter gradients (accumulated into grad) and, if din, the input gradient. */
static void layer_backward(float *din, float *grad, float *col, const float *dout,
                           const float *in, const float *out, const int32_t *arg, const ef_layer *l,
                           const float *params, int64_t b)
{
    const int64_t isz = in_size(l), osz = out_size(l);
    switch (l->op) {
    case EF_DENSE: {
        const float *w = params + l->w_off;
        ef_sgemm(1, 0, l->out_c, isz, b, 1.0f, dout, l->out_c, in, isz, 1.0f, grad + l->w_off, isz);
        if (l->b_off >= 0) {
            float *gb = grad + l->b_off;
            for (int64_t s = 0; s < b; s++)
                for (int32_t o = 0; o < l->out_c; o++) gb[o] += dout[s * l->out_c + o];
        }
        if (din) ef_sgemm(0, 0, b, isz, l->out_c, 1.0f, dout, l->out_c, w, isz, 0.0f, din, isz);
        break;
    }
    case EF_CONV2D: {
        const float *w = params + l->w_off;
        const int64_t ohw = (int64_t)l->out_h * l->out_w, ckk = (int64_t)l->in_c * l->k * l->k;
        const int64_t g = conv_group(l, b);
        for (int64_t s0 = 0; s0 < b; s0 += g) {
            const int64_t nb = b - s0 < g ? b - s0 : g, ld = nb * ohw;
            const float *dres = dout + s0 * osz; /* one sample: dout is [out_c, ohw] already */
            if (nb > 1) { /* regroup dout as [out_c, nb * ohw] next to the columns */
                float *reg = col + ckk * ld;
                for (int64_t s = 0; s < nb; s++)
                    for (int32_t c = 0; c < l->out_c; c++)
                        memcpy(reg + c * ld + s * ohw, dout + (s0 + s) * osz + c * ohw,
                               sizeof(float) * (size_t)ohw);
                dres = reg;
            }
            float *padded = col + (ckk + l->out_c) * g * ohw;
            for (int64_t s = 0; s < nb; s++)
                im2col(col + s * ohw, in + (s0 + s) * isz, padded, l, ld);
            ef_sgemm(0, 1, l->out_c, ckk, ld, 1.0f, dres, ld, col, ld, 1.0f, grad + l->w_off, ckk);
            if (l->b_off >= 0)
                for (int32_t c = 0; c < l->out_c; c++) grad[l->b_off + c] += sum8(dres + c * ld, ld);
            if (din) {
                ef_sgemm(1, 0, ckk, ld, l->out_c, 1.0f, w, ckk, dres, ld, 0.0f, col, ld);
                for (int64_t s = 0; s < nb; s++)
                    col2im(din + (s0 + s) * isz, col + s * ohw, padded, l, ld);
            }
        }
        break;
    }
    case EF_MAXPOOL2D:
        if (din) maxpool_backward(din, dout, arg, l, b);
        break;
    case EF_RELU:
        if (din) relu_backward(din, out, dout, b * osz);
        break;
    case EF_FLATTEN:
        if (din && din != dout) memcpy(din, dout, sizeof(float) * (size_t)(b * osz));
        break;
    }
}

/* ---------------------------------------------------------------- losses */

#define LABEL(s) (labels[idx ? idx[s] : base + (s)])
#define TARGET(s) (targets + (idx ? idx[s] : base + (s)) * nout)

/* Sum over the chunk of per-sample losses; if dlogits, writes d(loss)/d(scores) * scale. */
static double loss_chunk(float *dlogits, int64_t *correct, const float *scores, int32_t loss,
                         int64_t nout, const int32_t *labels, const float *targets,
                         const int64_t *idx, int64_t base, int64_t b, float scale)
{
    double total = 0.0;
    int64_t ok = 0;
    for (int64_t s = 0; s < b; s++) {
        const float *z = scores + s * nout;
        float *dz = dlogits ? dlogits + s * nout : NULL;
        switch (loss) {
        case EF_LOSS_SOFTMAX_CE: {
            int32_t y = LABEL(s);
            int64_t arg = 0;
            float m = z[0], se = 0.0f;
            for (int64_t c = 1; c < nout; c++)
                if (z[c] > m) { m = z[c]; arg = c; }
            for (int64_t c = 0; c < nout; c++) se += expf(z[c] - m);
            total += (double)logf(se) + m - z[y];
            ok += arg == y;
            if (dz) {
                const float inv = scale / se;
                for (int64_t c = 0; c < nout; c++) dz[c] = expf(z[c] - m) * inv;
                dz[y] -= scale;
            }
            break;
        }
        case EF_LOSS_LOGISTIC: {
            double zz = z[0], y = LABEL(s) == 1 ? 1.0 : 0.0;
            total += (zz > 0 ? zz : 0.0) - y * zz + log1p(exp(-fabs(zz)));
            ok += (zz > 0) == (y > 0.5);
            if (dz) dz[0] = (float)(1.0 / (1.0 + exp(-zz)) - y) * scale;
            break;
        }
        case EF_LOSS_MSE: {
            const float *t = TARGET(s);
            double acc = 0.0;
            for (int64_t c = 0; c < nout; c++) {
                double r = (double)z[c] - t[c];
                acc += r * r;
                if (dz) dz[c] = (float)r * scale;
            }
            total += 0.5 * acc;
            if (nout == 1) ok += (z[0] > 0) == (t[0] > 0);
            break;
        }
        case EF_LOSS_SQHINGE: {
            int32_t y = LABEL(s);
            double acc = 0.0;
            if (nout == 1) {
                double yy = y == 1 ? 1.0 : -1.0, h = 1.0 - yy * z[0];
                if (h > 0) acc += h * h;
                if (dz) dz[0] = h > 0 ? (float)(-yy * h) * scale : 0.0f;
                ok += (z[0] > 0) == (y == 1);
            } else {
                int64_t arg = 0;
                for (int64_t c = 0; c < nout; c++) {
                    double yy = c == y ? 1.0 : -1.0, h = 1.0 - yy * z[c];
                    if (h > 0) acc += h * h;
                    if (dz) dz[c] = h > 0 ? (float)(-yy * h) * scale : 0.0f;
                    if (z[c] > z[arg]) arg = c;
                }
                ok += arg == y;
            }
            total += 0.5 * acc;
            break;
        }
        }
    }
    if (correct) *correct += ok;
    return total;
}

/* lambda/2 * ||W||^2 over weight tensors; adds lambda * W to grad when grad != NULL. */
static double l2_term(float *grad, const ef_net *net, const float *params)
{
    double acc = 0.0;
    if (net->l2 == 0.0f) return 0.0;
    for (int32_t i = 0; i < net->n_layers; i++) {
        const ef_layer *l = &net->layers[i];
        int64_t nw;
        if (l->op == EF_DENSE) nw = in_size(l) * l->out_c;
        else if (l->op == EF_CONV2D) nw = (int64_t)l->out_c * l->in_c * l->k * l->k;
        else continue;
        const float *w = params + l->w_off;
        for (int64_t j = 0; j < nw; j++) {
            acc += (double)w[j] * w[j];
            if (grad) grad[l->w_off + j] += net->l2 * w[j];
        }
    }
    return 0.5 * net->l2 * acc;
}

/* ---------------------------------------------------------------- passes over a set of samples */

static void gather(float *dst, const float *x, const int64_t *idx, int64_t base, int64_t b,
                   int64_t isz)
{
    if (!idx) {
        memcpy(dst, x + base * isz, sizeof(float) * (size_t)(b * isz));
        return;
    }
    for (int64_t s = 0; s < b; s++)
        memcpy(dst + s * isz, x + idx[s] * isz, sizeof(float) * (size_t)isz);
}

/* A ReLU at i feeding a max pool: max(relu(x)) = relu(max(x)), so the pair runs as one pool
 * over the ReLU's input (its output is never written) and one scatter backward, which
 * saves two passes over the largest activations of a conv net. The ReLU's gradient is zero
 * exactly where the pooled maximum is <= 0, which forward records as argmax -1, so the pool's
 * scatter is then the exact backward of the pair. */
static int relu_then_pool(const ef_net *net, int32_t i)
{
    return i + 1 < net->n_layers && net->layers[i].op == EF_RELU &&
           net->layers[i + 1].op == EF_MAXPOOL2D;
}

static const float *forward_chunk(const layout *lay, const ef_net *net, const float *params,
                                  int64_t b)
{
    const float *in = lay->x;
    for (int32_t i = 0; i < net->n_layers; i++) {
        if (relu_then_pool(net, i)) {
            maxpool_forward(lay->act[i + 1], lay->arg[i + 1], in, &net->layers[i + 1], b, 1);
            in = lay->act[++i];
            continue;
        }
        layer_forward(lay->act[i], lay->arg[i], in, lay->col, &net->layers[i], params, b);
        in = lay->act[i];
    }
    return in;
}

static void backward_chunk(const layout *lay, float *grad, const ef_net *net,
                           const float *params, int64_t b)
{
    float *d = lay->delta_a, *other = lay->delta_b;
    for (int32_t i = net->n_layers - 1; i >= 0; i--) {
        const ef_layer *l = &net->layers[i];
        const float *in = i == 0 ? lay->x : lay->act[i - 1];
        float *din = i == 0 ? NULL : other;
        if (l->op == EF_FLATTEN) { /* same memory layout: pass the gradient through */
            continue;
        }
        const int fused = i > 0 && relu_then_pool(net, i - 1);
        /* skip the input gradient below the first layer with parameters */
        int need_din = 0;
        for (int32_t j = 0; j < i - fused; j++)
            if (net->layers[j].op == EF_DENSE || net->layers[j].op == EF_CONV2D) need_din = 1;
        if (fused) { /* the pool's scatter is the ReLU's input gradient too */
            if (!need_din) break;
            maxpool_backward(din, d, lay->arg[i], l, b);
            other = d;
            d = din;
            i--;
            continue;
        }
        layer_backward(need_din ? din : NULL, grad, lay->col, d, in, lay->act[i], lay->arg[i], l,
                       params, b);
        if (!need_din) break;
        other = d;
        d = din;
    }
}

static int64_t out_dim(const ef_net *net) { return out_size(&net->layers[net->n_layers - 1]); }

/* Mean loss (with l2) and gradient over samples idx[0..n) (or base..base+n). grad is zeroed. */
static double batch_grad(float *grad, const layout *lay, int64_t chunk, const ef_net *net,
                         const float *params, const float *x, const int32_t *labels,
                         const float *targets, const int64_t *idx, int64_t base, int64_t n)
{
    const int64_t isz = in_size(&net->layers[0]), nout = out_dim(net);
    const float scale = 1.0f / (float)n;
    double total = 0.0;
    memset(grad, 0, sizeof(float) * (size_t)net->n_params);
    for (int64_t s0 = 0; s0 < n; s0 += chunk) {
        int64_t b = n - s0 < chunk ? n - s0 : chunk;
        gather(lay->x, x, idx ? idx + s0 : NULL, base + s0, b, isz);
        const float *scores = forward_chunk(lay, net, params, b);
        total += loss_chunk(lay->delta_a, NULL, scores, net->loss, nout, labels, targets,
                            idx ? idx + s0 : NULL, base + s0, b, scale);
        backward_chunk(lay, grad, net, params, b);
    }
    return total / (double)n + l2_term(grad, net, params);
}

int ef_forward(float *out, float *work, const ef_net *net, const float *params, const float *x,
               int64_t n, int64_t chunk)
{
    layout lay;
    if (check_net(net) != EF_OK || chunk <= 0 || chunk > EF_MAX_CHUNK) return EF_ERR_ARGS;
    make_layout(&lay, work, net, chunk);
    const int64_t isz = in_size(&net->layers[0]), nout = out_dim(net);
    for (int64_t s0 = 0; s0 < n; s0 += chunk) {
        int64_t b = n - s0 < chunk ? n - s0 : chunk;
        gather(lay.x, x, NULL, s0, b, isz);
        const float *scores = forward_chunk(&lay, net, params, b);
        memcpy(out + s0 * nout, scores, sizeof(float) * (size_t)(b * nout));
    }
    return EF_OK;
}

int ef_loss_grad(float *grad, double *loss, float *work, const ef_net *net, const float *params,
                 const float *x, const int32_t *labels, const float *targets, int64_t n,
                 int64_t chunk)
{
    layout lay;
    if (check_net(net) != EF_OK || chunk <= 0 || chunk > EF_MAX_CHUNK || n <= 0) return EF_ERR_ARGS;
    make_layout(&lay, work, net, chunk);
    *loss = batch_grad(grad, &lay, chunk, net, params, x, labels, targets, NULL, 0, n);
    return isfinite(*loss) ? EF_OK : EF_ERR_NONFINITE;
}

int ef_evaluate(double *loss_sum, int64_t *correct, float *work, const ef_net *net,
                const float *params, const float *x, const int32_t *labels, const float *targets,
                int64_t n, int64_t chunk)
{
    layout lay;
    if (check_net(net) != EF_OK || chunk <= 0 || chunk > EF_MAX_CHUNK) return EF_ERR_ARGS;
    make_layout(&lay, work, net, chunk);
    const int64_t isz = in_size(&net->layers[0]), nout = out_dim(net);
    *loss_sum = 0.0;
    *correct = 0;
    for (int64_t s0 = 0; s0 < n; s0 += chunk) {
        int64_t b = n - s0 < chunk ? n - s0 : chunk;
        gather(lay.x, x, NULL, s0, b, isz);
        const float *scores = forward_chunk(&lay, net, params, b);
        *loss_sum += loss_chunk(NULL, correct, scores, net->loss, nout, labels, targets, NULL,
                                s0, b, 1.0f);
    }
    return EF_OK;
}

/* ---------------------------------------------------------------- seeded shuffle */

static uint64_t splitmix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

uint64_t ef_shuffle_key(uint64_t seed, int64_t epoch, int64_t i)
{
    /* epoch + 1 in uint64 (wraps as reference.py's does; int64 would overflow at INT64_MAX) */
    uint64_t stream = splitmix64(seed ^ (0x9E3779B97F4A7C15ULL * ((uint64_t)epoch + 1u)));
    return splitmix64(stream + (uint64_t)i);
}

typedef struct { uint64_t key; int64_t idx; } keyed;

/* Stable LSD radix sort by key, 8 bits per pass: pairs enter in index order, so equal keys
 * stay in index order and the result is the (key, index) order reference.shuffle computes.
 * Linear time; measured at a tenth of qsort's cost for an epoch of 8192 samples. */
static void radix_sort(keyed *restrict a, keyed *restrict tmp, int64_t n)
{
    for (int shift = 0; shift < 64; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < n; i++) count[((a[i].key >> shift) & 0xff) + 1]++;
        if (count[((a[0].key >> shift) & 0xff) + 1] == n) continue; /* one bucket: no-op pass */
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (int64_t i = 0; i < n; i++) tmp[count[(a[i].key >> shift) & 0xff]++] = a[i];
        memcpy(a, tmp, sizeof(keyed) * (size_t)n);
    }
}

void ef_shuffle(int64_t *perm, int64_t *iwork, uint64_t seed, int64_t epoch, int64_t n)
{
    keyed *pairs = (keyed *)(void *)iwork, *tmp = pairs + n;
    if (n <= 0) return;
    for (int64_t i = 0; i < n; i++) {
        pairs[i].key = ef_shuffle_key(seed, epoch, i);
        pairs[i].idx = i;
    }
    radix_sort(pairs, tmp, n);
    for (int64_t i = 0; i < n; i++) perm[i] = pairs[i].idx;
}

/* ---------------------------------------------------------------- the local round */

/* params -= lr * g, or with a momentum buffer d = m d + g; params -= lr d (PyTorch's
 * convention, as MFL's heavy ball, docs/algorithms.md#mfl), kept also at m = 0 so MFL's buffer holds the last
 * direction. */
EF_MULTIVERSION
static void sgd_update(float *restrict params, float *restrict momentum, const float *restrict g,
                       float m, float lr, int64_t P)
{
    if (momentum) {
        for (int64_t j = 0; j < P; j++) {
            momentum[j] = m * momentum[j] + g[j];
            params[j] -= lr * momentum[j];
        }
    } else {
        for (int64_t j = 0; j < P; j++) params[j] -= lr * g[j];
    }
}

/* FedProx's proximal term (Li et al., MLSys 2020): g += mu * (w - anchor), the gradient of
 * mu/2 ||w - anchor||^2. Three float32 roundings per coordinate (difference, product, sum), no
 * FMA (see vec.c), which reference.local_train repeats. The caller skips it when mu == 0, so
 * FedAvg's step is untouched; restrict lets the loop vectorise without overlap checks, and it
 * gets the AVX2 clone as all_finite below does (the same bits: no FMA in either). */
EF_MULTIVERSION
static void add_proximal(float *restrict g, const float *restrict params,
                         const float *restrict anchor, float mu, int64_t P)
{
    for (int64_t j = 0; j < P; j++) g[j] += mu * (params[j] - anchor[j]);
}

/* Every step checks its whole gradient and updates every parameter: two passes over the
 * model per step, a tenth of an MLP's training time, so they get the AVX2 clone (twice the
 * width of the SSE2 baseline) where the CPU has it; the results are the same bits. */
EF_MULTIVERSION
static int all_finite(const float *g, int64_t n)
{
    uint32_t bad = 0; /* an all-ones exponent is inf or nan; integer OR vectorises */
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, g + i, sizeof u);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}

int ef_local_train(float *params, float *momentum, ef_train_stats *stats, ef_train_result *res,
                   float *work, int64_t *iwork, const ef_net *net, const float *x,
                   const int32_t *labels, const float *targets, const float *anchor, int64_t n,
                   const ef_train_cfg *cfg)
{
    layout lay;
    const int64_t P = net ? net->n_params : 0;
    res->mean_loss = 0.0;
    res->steps = 0;
    res->samples = 0;
    res->bad_step = -1;
    if (check_net(net) != EF_OK || n <= 0 || cfg->lr < 0) return EF_ERR_ARGS;
    if (cfg->momentum != 0.0f && !momentum) return EF_ERR_ARGS;
    if (!isfinite(cfg->prox_mu) || cfg->prox_mu < 0.0f || (cfg->prox_mu != 0.0f && !anchor))
        return EF_ERR_ARGS;
    const int proximal = cfg->prox_mu != 0.0f;
    const int full_batch = cfg->batch_size <= 0 || cfg->batch_size >= n;
    const int64_t bs = full_batch ? n : cfg->batch_size;
    const int64_t chunk = ef_chunk_for_batch(bs, n);
    const int64_t per_epoch = (n + bs - 1) / bs;
    const int64_t total = cfg->steps > 0 ? cfg->steps : (int64_t)cfg->epochs * per_epoch;
    make_layout(&lay, work, net, chunk);
    float *g = lay.grad, *grad0 = stats ? stats->grad0 : NULL;
    double *st = stats ? stats->step_stats : NULL;
    if (st && (!grad0 || !stats->w_start || !stats->run_sum)) return EF_ERR_ARGS;
    if (st) {
        memcpy(stats->w_start, params, sizeof(float) * (size_t)P);
        memset(stats->run_sum, 0, sizeof(float) * (size_t)P);
    }
    if (grad0 && cfg->grad0_mode == 2) {
        double l0 = batch_grad(grad0, &lay, chunk, net, params, x, labels, targets, NULL, 0, n);
        if (!isfinite(l0) || !all_finite(grad0, P)) { res->bad_step = 0; return EF_ERR_NONFINITE; }
    }
    int64_t *perm = iwork, epoch = 0, pos = n;
    double loss_acc = 0.0;
    for (int64_t step = 0; step < total; step++) {
        if (cfg->stop) {
            const int32_t word = *cfg->stop;    /* one read: a writer may change it between */
            if (word > 0 && step >= (int64_t)word - 1) {
                res->mean_loss = step ? loss_acc / (double)step : 0.0;
                return EF_STOPPED;
            }
        }
        const int64_t *idx = NULL;
        int64_t b = bs, base = 0;
        if (full_batch) {
            b = n;
        } else {
            if (pos >= n) {
                ef_shuffle(perm, iwork + n, cfg->seed, epoch++, n);
                pos = 0;
            }
            b = n - pos < bs ? n - pos : bs;
            idx = perm + pos;
            pos += b;
        }
        double loss = batch_grad(g, &lay, chunk, net, params, x, labels, targets, idx, base, b);
        if (!isfinite(loss) || !all_finite(g, P)) {
            res->bad_step = step;
            res->mean_loss = loss;
            return EF_ERR_NONFINITE;
        }
        loss_acc += loss;
        if (grad0 && step == 0 && cfg->grad0_mode != 2)
            memcpy(grad0, g, sizeof(float) * (size_t)P);
        if (st && step < stats->max_steps) {
            double dg = 0.0, dw = 0.0, ss = 0.0;
            float *rs = stats->run_sum;
            const float *w0 = stats->w_start;
            for (int64_t j = 0; j < P; j++) {
                double a = (double)grad0[j] - g[j], c = (double)w0[j] - params[j];
                rs[j] += g[j];
                dg += a * a;
                dw += c * c;
                ss += (double)rs[j] * rs[j];
            }
            st[3 * step] = sqrt(dg);
            st[3 * step + 1] = sqrt(dw);
            st[3 * step + 2] = ss;
        }
        if (cfg->weight_decay != 0.0f)
            for (int64_t j = 0; j < P; j++) g[j] += cfg->weight_decay * params[j];
        if (proximal)
            add_proximal(g, params, anchor, cfg->prox_mu, P);
        if (stats && stats->grad_sum)
            for (int64_t j = 0; j < P; j++) stats->grad_sum[j] += g[j];
        sgd_update(params, momentum, g, cfg->momentum, cfg->lr, P);
        res->steps = step + 1;
        res->samples += b;
    }
    res->mean_loss = res->steps ? loss_acc / (double)res->steps : 0.0;
    return EF_OK;
}
