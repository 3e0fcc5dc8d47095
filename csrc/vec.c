/* vec.c - streaming vector kernels over flat float32 buffers: aggregation, axpy, norms, robust means. */
#include <math.h>
#include <string.h>

#include "edgefl.h"

/* ------------------------------------------------------------------------------------------
 * Weighted sum of K separate buffers.
 *
 * The output is produced block by block: for each block of EF_SUM_BLOCK coordinates a float64
 * accumulator (1 KB, stays in L1) receives w[0]*xs[0], then + w[1]*xs[1], ... in k order, and
 * is then rounded once to float32. Every coordinate therefore sees exactly
 *     acc = w0*x0;  acc = acc + w1*x1;  ...;  out = (float)acc
 * (products and sums in float64; a float32 times a float64 product is exact), which is what
 * reference.weighted_sum computes. Buffers are consumed four at a time, which keeps that order
 * (((acc + a) + b) + c) + d while touching the accumulator a quarter as often; the input is
 * read once, in order, with no stacking copy.
 *
 * The block is fully accumulated before it is stored, so `out` may be one of the xs (the
 * in-place case: new global model written over an old buffer); partial overlaps are not
 * supported.
 *
 * Block size and prefetch were chosen by measurement (tools/bench_kernels.py and a C harness,
 * x86-64 SSE2, one core, GB/s = bytes read + written per second): short blocks keep the K
 * input streams advancing together, which the hardware prefetcher follows for up to about a
 * dozen streams (K=10, P=10M: 29 GB/s with 128 floats, 26 with 256, 18 with 1024, 17 with
 * 2048). Beyond that it loses track and every block starts with demand misses (K=100 and 128
 * floats: 3 GB/s), so for K >= EF_PREFETCH_MIN_K the next block of each stream is prefetched
 * explicitly just before the stream is read (K=100: 15 GB/s); for K=10 the same prefetches
 * cost a fifth of the speed, hence the threshold (at K=13 both are even).
 *
 * These loops contract to FMA only under -ffp-contract=fast; setup.py builds with -std=c99,
 * whose default is no contraction, so the result is the same on x86-64 and Arm.
 * ---------------------------------------------------------------------------------------- */

#ifndef EF_SUM_BLOCK
#define EF_SUM_BLOCK 128
#endif
#ifndef EF_PREFETCH_MIN_K
#define EF_PREFETCH_MIN_K 13
#endif

#if defined(__GNUC__)
#define EF_PREFETCH(p) __builtin_prefetch((p), 0, 3)
#else
#define EF_PREFETCH(p) ((void)(p))
#endif

/* Prefetches x[j0 + EF_SUM_BLOCK .. j0 + 2*EF_SUM_BLOCK) (clipped to n), one touch per 64 B. */
static void prefetch_next_block(const float *x, int64_t j0, int64_t n)
{
    const int64_t lo = j0 + EF_SUM_BLOCK;
    const int64_t hi = (n - lo < EF_SUM_BLOCK) ? n : lo + EF_SUM_BLOCK;
    for (int64_t j = lo; j < hi; j += 16)
        EF_PREFETCH(x + j);
}

static void acc_init1(double *restrict acc, const float *restrict a, double wa, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        acc[j] = wa * (double)a[j];
}

static void acc_init2(double *restrict acc, const float *restrict a, const float *restrict b,
                      double wa, double wb, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        acc[j] = wa * (double)a[j] + wb * (double)b[j];
}

static void acc_init4(double *restrict acc, const float *restrict a, const float *restrict b,
                      const float *restrict c, const float *restrict d, double wa, double wb,
                      double wc, double wd, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        acc[j] = ((wa * (double)a[j] + wb * (double)b[j]) + wc * (double)c[j]) + wd * (double)d[j];
}

static void acc_add1(double *restrict acc, const float *restrict a, double wa, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        acc[j] = acc[j] + wa * (double)a[j];
}

static void acc_add2(double *restrict acc, const float *restrict a, const float *restrict b,
                     double wa, double wb, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        acc[j] = (acc[j] + wa * (double)a[j]) + wb * (double)b[j];
}

static void acc_add4(double *restrict acc, const float *restrict a, const float *restrict b,
                     const float *restrict c, const float *restrict d, double wa, double wb,
                     double wc, double wd, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        acc[j] = (((acc[j] + wa * (double)a[j]) + wb * (double)b[j]) + wc * (double)c[j])
                 + wd * (double)d[j];
}

static void acc_store(float *restrict out, const double *restrict acc, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        out[j] = (float)acc[j];
}

EF_MULTIVERSION
void ef_weighted_sum(float *out, const float *const *xs, const double *weights, int64_t k, int64_t n)
{
    double acc[EF_SUM_BLOCK];
    const int prefetch = k >= EF_PREFETCH_MIN_K;

    if (k <= 0) {
        for (int64_t j = 0; j < n; j++)
            out[j] = 0.0f;
        return;
    }
    for (int64_t j0 = 0; j0 < n; j0 += EF_SUM_BLOCK) {
        const int64_t m = (n - j0 < EF_SUM_BLOCK) ? n - j0 : EF_SUM_BLOCK;
        const int64_t first = (k >= 4) ? 4 : (k >= 2) ? 2 : 1;
        int64_t i;

        if (prefetch)
            for (i = 0; i < first; i++)
                prefetch_next_block(xs[i], j0, n);
        if (first == 4)
            acc_init4(acc, xs[0] + j0, xs[1] + j0, xs[2] + j0, xs[3] + j0, weights[0],
                      weights[1], weights[2], weights[3], m);
        else if (first == 2)
            acc_init2(acc, xs[0] + j0, xs[1] + j0, weights[0], weights[1], m);
        else
            acc_init1(acc, xs[0] + j0, weights[0], m);
        for (i = first; i + 4 <= k; i += 4) {
            if (prefetch)
                for (int64_t p = i; p < i + 4; p++)
                    prefetch_next_block(xs[p], j0, n);
            acc_add4(acc, xs[i] + j0, xs[i + 1] + j0, xs[i + 2] + j0, xs[i + 3] + j0,
                     weights[i], weights[i + 1], weights[i + 2], weights[i + 3], m);
        }
        if (prefetch)
            for (int64_t p = i; p < k; p++)
                prefetch_next_block(xs[p], j0, n);
        if (i + 2 <= k) {
            acc_add2(acc, xs[i] + j0, xs[i + 1] + j0, weights[i], weights[i + 1], m);
            i += 2;
        }
        if (i < k)
            acc_add1(acc, xs[i] + j0, weights[i], m);
        acc_store(out + j0, acc, m);
    }
}

/* ------------------------------------------------------------------------------------------
 * axpy, scale: plain float32 arithmetic, one rounding per operation (no FMA, see above).
 * ---------------------------------------------------------------------------------------- */

void ef_axpy(float *restrict y, const float *restrict x, int64_t n, float a)
{
    for (int64_t j = 0; j < n; j++)
        y[j] = y[j] + a * x[j];
}

void ef_scale(float *x, int64_t n, float a)
{
    for (int64_t j = 0; j < n; j++)
        x[j] = x[j] * a;
}

/* ------------------------------------------------------------------------------------------
 * dot, sqnorm. Summation order (reference.dot mirrors it):
 *   lane l (l = 0..7) sums, in float64 and in increasing j, the products x[j]*y[j] with
 *   j % 8 == l (each product of two floats is exact in float64); the result is
 *   ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).
 * Eight independent lanes let the compiler keep four 2-double vectors in flight (SSE2, NEON)
 * without reassociating anything.
 * ---------------------------------------------------------------------------------------- */

#define EF_LANES 8

static double lanes_total(const double *s)
{
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

double ef_dot(const float *x, const float *y, int64_t n)
{
    double s[EF_LANES] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int64_t j = 0;

    for (; j + EF_LANES <= n; j += EF_LANES)
        for (int l = 0; l < EF_LANES; l++)
            s[l] += (double)x[j + l] * (double)y[j + l];
    for (int l = 0; j < n; j++, l++)
        s[l] += (double)x[j] * (double)y[j];
    return lanes_total(s);
}

double ef_sqnorm(const float *x, int64_t n)
{
    double s[EF_LANES] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int64_t j = 0;

    for (; j + EF_LANES <= n; j += EF_LANES)
        for (int l = 0; l < EF_LANES; l++)
            s[l] += (double)x[j + l] * (double)x[j + l];
    for (int l = 0; j < n; j++, l++)
        s[l] += (double)x[j] * (double)x[j];
    return lanes_total(s);
}

/* ------------------------------------------------------------------------------------------
 * The first NaN or infinity: every frame received and every update encoded is checked for
 * one (transport/wire/). An all-ones exponent field is inf or nan; blocks are ORed
 * branch-free (integer ops vectorise, AVX2 clone where the CPU has it), and only a block that
 * holds one is scanned again for its index.
 * ---------------------------------------------------------------------------------------- */

#define EF_FINITE_BLOCK 4096

EF_MULTIVERSION
static int block_has_nonfinite(const float *x, int64_t n)
{
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return bad != 0;
}

int64_t ef_first_nonfinite(const float *x, int64_t n)
{
    for (int64_t start = 0; start < n; start += EF_FINITE_BLOCK) {
        const int64_t m = n - start < EF_FINITE_BLOCK ? n - start : EF_FINITE_BLOCK;
        if (!block_has_nonfinite(x + start, m))
            continue;
        for (int64_t i = start; i < start + m; i++) {
            uint32_t u;
            memcpy(&u, x + i, sizeof u);
            if ((u & 0x7f800000u) == 0x7f800000u)
                return i;
        }
    }
    return -1;
}

/* ------------------------------------------------------------------------------------------
 * Coordinate-wise median and trimmed mean.
 *
 * Both sort the K values of each coordinate ascending, then read the sorted values:
 *   median: s[K/2] for odd K; (s[K/2-1] + s[K/2]) * 0.5f in float32 for even K (numpy.median's
 *           float32 mean of the two middle values, bit for bit).
 *   trimmed mean: float64 sum of s[trim], s[trim+1], ..., s[K-trim-1] in that (ascending)
 *           order, divided by K - 2*trim in float64, rounded once to float32.
 * A coordinate holding a NaN in any buffer gives NaN (as numpy.median does).
 *
 * For K <= EF_NETWORK_MAX_K the coordinates go in blocks: each buffer's slice of the block is
 * copied into a row of a stack tile (K rows of B floats, at most EF_TILE floats), and the rows
 * are sorted with Batcher's merge-exchange network (Knuth 5.2.2, Algorithm M), whose
 * compare-exchanges are data independent and so run as vector min/max across the B
 * coordinates, with no branches to mispredict. Measured on x86-64 (ns per coordinate, random
 * data): K=10: 12-17 (a per-coordinate insertion sort took 108, the NumPy twin's np.sort ~60);
 * K=100: ~330-470 (np.sort ~270); K=1000: ~11000 (np.sort ~3400): the network does
 * O(K log^2 K) work against numpy's vectorised O(K log K) sort, which wins from K ~ 100 on.
 * K > EF_NETWORK_MAX_K (the tile would not fit the stack) sorts each coordinate in `scratch`
 * with heapsort: O(K log K) but branchy, ~60 us per coordinate at K=1500.
 * ---------------------------------------------------------------------------------------- */

#define EF_TILE 4096         /* floats: the 16 KB stack tile */
#define EF_TILE_MAX_B 512    /* coordinates per tile at most */
#define EF_NETWORK_MAX_K 1024 /* K rows of at least EF_TILE / K = 4 coordinates */

/* Rows a and b (distinct) become their element-wise min and max; written as two selects on
 * one comparison so gcc vectorises it (and each column stays a permutation of its values). */
static void compare_exchange(float *restrict a, float *restrict b, int64_t m)
{
    for (int64_t j = 0; j < m; j++) {
        const float x = a[j], y = b[j];
        const float lo = (x < y) ? x : y;
        const float hi = (x < y) ? y : x;
        a[j] = lo;
        b[j] = hi;
    }
}

/* Sorts each column of the k x m tile (rows `stride` apart) ascending. */
static void network_sort(float *tile, int64_t k, int64_t stride, int64_t m)
{
    int64_t t = 0;
    while (((int64_t)1 << t) < k)
        t++;
    if (t == 0)
        return;
    for (int64_t p = (int64_t)1 << (t - 1); p > 0; p >>= 1) {
        int64_t q = (int64_t)1 << (t - 1), r = 0, d = p;
        for (;;) {
            for (int64_t i = 0; i + d < k; i++)
                if ((i & p) == r)
                    compare_exchange(tile + i * stride, tile + (i + d) * stride, m);
            if (q == p)
                break;
            d = q - p;
            q >>= 1;
            r = p;
        }
    }
}

/* Copies coordinates j0..j0+m of the k buffers into the tile rows; nan[j] = a NaN among them. */
static void load_tile(float *restrict tile, unsigned char *restrict nan, const float *const *xs,
                      int64_t k, int64_t stride, int64_t j0, int64_t m)
{
    for (int64_t j = 0; j < m; j++)
        nan[j] = 0;
    for (int64_t i = 0; i < k; i++) {
        const float *restrict x = xs[i] + j0;
        float *restrict row = tile + i * stride;
        for (int64_t j = 0; j < m; j++) {
            row[j] = x[j];
            nan[j] |= (unsigned char)(x[j] != x[j]);
        }
    }
}

/* Coordinates per tile: as many as fit, a multiple of 4 (whole SSE/NEON vectors). */
static int64_t tile_width(int64_t k)
{
    const int64_t b = (EF_TILE / k) & ~(int64_t)3;
    return b < EF_TILE_MAX_B ? b : EF_TILE_MAX_B;
}

static void sift_down(float *v, int64_t root, int64_t end)
{
    const float x = v[root];
    int64_t i = root;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= end)
            break;
        if (c + 1 < end && v[c + 1] > v[c])
            c++;
        if (!(v[c] > x))
            break;
        v[i] = v[c];
        i = c;
    }
    v[i] = x;
}

/* Gathers coordinate j of the K buffers into v and heapsorts it; returns 0 if one is NaN. */
static int gather_sorted(float *v, const float *const *xs, int64_t k, int64_t j)
{
    int no_nan = 1;
    for (int64_t i = 0; i < k; i++) {
        const float x = xs[i][j];
        no_nan &= !isnan(x);
        v[i] = x;
    }
    if (!no_nan)
        return 0;
    for (int64_t i = k / 2 - 1; i >= 0; i--)
        sift_down(v, i, k);
    for (int64_t end = k - 1; end > 0; end--) {
        const float t = v[0];
        v[0] = v[end];
        v[end] = t;
        sift_down(v, 0, end);
    }
    return 1;
}

static void median_tile(float *restrict out, const float *tile, const unsigned char *nan,
                        int64_t k, int64_t stride, int64_t m)
{
    const float *hi = tile + (k / 2) * stride;
    const float *lo = (k % 2) ? hi : tile + (k / 2 - 1) * stride;
    for (int64_t j = 0; j < m; j++)
        out[j] = (k % 2) ? hi[j] : (lo[j] + hi[j]) * 0.5f;
    for (int64_t j = 0; j < m; j++)
        if (nan[j])
            out[j] = NAN;
}

void ef_median(float *out, float *scratch, const float *const *xs, int64_t k, int64_t n)
{
    if (k <= EF_NETWORK_MAX_K) {
        float tile[EF_TILE];
        unsigned char nan[EF_TILE_MAX_B];
        const int64_t b = tile_width(k);
        for (int64_t j0 = 0; j0 < n; j0 += b) {
            const int64_t m = (n - j0 < b) ? n - j0 : b;
            load_tile(tile, nan, xs, k, b, j0, m);
            network_sort(tile, k, b, m);
            median_tile(out + j0, tile, nan, k, b, m);
        }
        return;
    }
    for (int64_t j = 0; j < n; j++) {
        if (!gather_sorted(scratch, xs, k, j))
            out[j] = NAN;
        else if (k % 2)
            out[j] = scratch[k / 2];
        else
            out[j] = (scratch[k / 2 - 1] + scratch[k / 2]) * 0.5f;
    }
}

static void trimmed_tile(float *restrict out, const float *tile, const unsigned char *nan,
                         int64_t k, int64_t stride, int64_t m, int64_t trim)
{
    double acc[EF_TILE_MAX_B];
    const double keep = (double)(k - 2 * trim);
    const float *row = tile + trim * stride;
    for (int64_t j = 0; j < m; j++)
        acc[j] = row[j];
    for (int64_t i = trim + 1; i < k - trim; i++) {
        row = tile + i * stride;
        for (int64_t j = 0; j < m; j++)
            acc[j] += row[j];
    }
    for (int64_t j = 0; j < m; j++)
        out[j] = nan[j] ? NAN : (float)(acc[j] / keep);
}

void ef_trimmed_mean(float *out, float *scratch, const float *const *xs, int64_t k, int64_t n,
                     int64_t trim)
{
    if (k <= EF_NETWORK_MAX_K) {
        float tile[EF_TILE];
        unsigned char nan[EF_TILE_MAX_B];
        const int64_t b = tile_width(k);
        for (int64_t j0 = 0; j0 < n; j0 += b) {
            const int64_t m = (n - j0 < b) ? n - j0 : b;
            load_tile(tile, nan, xs, k, b, j0, m);
            network_sort(tile, k, b, m);
            trimmed_tile(out + j0, tile, nan, k, b, m, trim);
        }
        return;
    }
    for (int64_t j = 0; j < n; j++) {
        if (!gather_sorted(scratch, xs, k, j)) {
            out[j] = NAN;
            continue;
        }
        double s = scratch[trim];
        for (int64_t i = trim + 1; i < k - trim; i++)
            s += scratch[i];
        out[j] = (float)(s / (double)(k - 2 * trim));
    }
}
