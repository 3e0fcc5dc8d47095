/* secagg.c - the per-parameter work of secure aggregation: quantising float32 updates into the
 * ring Z_(2^32) or Z_(2^64), adding and removing mask words, and turning a sum of quantised
 * contributions back into floats.
 *
 * Representation. A value x is clipped to [-clip, clip] and scaled to s = x * scale
 * (scale = levels / clip), then rounded to an integer k in [-levels, levels]:
 *     stochastic:    k = floor(s + u), u uniform in [0, 1), so E[k] = s (unbiased);
 *     deterministic: k = floor(s + 0.5).
 * u for coordinate i is (mix64(seed + (i + 1) * GOLDEN) >> 11) * 2^-53 (splitmix64's
 * finaliser over a counter), so the C kernel and reference.py draw the same u. The word
 * stored is k * weight in two's complement mod 2^bits: a negative value wraps to the top of
 * the ring, which IS the offset that makes negative values add correctly. A sum of
 * contributions is exact in the ring, and read back as a signed integer it is the true
 * integer sum as long as |sum| <= sum_i weight_i * levels < 2^(bits-1): the caller chooses
 * levels so (edgefl.privacy.secagg.quantiser; configs that cannot are refused there).
 * All arithmetic is in double then int64 (no contraction under -std=c99), then unsigned,
 * where wrap-around is defined behaviour.
 * ---------------------------------------------------------------------------------------- */
#include "edgefl.h"

#define EF_GOLDEN64 0x9E3779B97F4A7C15ULL

/* The quantiser is per-coordinate 64-bit integer work (mix64's multiplies, double <-> int64
 * conversions) that AVX2 cannot vectorise and AVX-512 (x86-64-v4: vpmullq, vcvttpd2qq) can:
 * about 3x faster again than the AVX2 clone where the CPU has it. Results are bit-identical
 * across clones (-std=c99 forbids contracting into FMAs, and every step is exact or one
 * correctly rounded IEEE operation). GCC 12 is the first to accept the arch level here. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) && \
    defined(__GLIBC__) && !defined(EF_NO_MULTIVERSION)
#define EF_QUANTIZE_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define EF_QUANTIZE_CLONES EF_MULTIVERSION
#endif

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline int64_t quantum(float xf, double clip, double scale, int64_t i, uint64_t seed,
                              int stochastic)
{
    double v = (double)xf;
    if (v > clip)
        v = clip;
    if (v < -clip)
        v = -clip;
    const double s = v * scale;
    const double u = stochastic
        ? (double)(mix64(seed + (uint64_t)(i + 1) * EF_GOLDEN64) >> 11) * 0x1.0p-53
        : 0.5;
    /* floor without libm's call (the baseline x86-64 target has no rounding instruction, so
     * floor() is an out-of-line call per coordinate): truncate, then step down when the
     * truncation went up. Exact for |s + u| < 2^63, and |s + u| <= levels + 1 <= 2^40 + 1. */
    const double d = s + u;
    const int64_t t = (int64_t)d;
    return t - ((double)t > d);
}

EF_QUANTIZE_CLONES
void ef_quantize_u32(uint32_t *out, const float *x, int64_t n, double clip, double scale,
                     int64_t weight, uint64_t seed, int stochastic)
{
    const uint64_t w = (uint64_t)weight;
    for (int64_t i = 0; i < n; i++)
        out[i] = (uint32_t)((uint64_t)quantum(x[i], clip, scale, i, seed, stochastic) * w);
}

EF_QUANTIZE_CLONES
void ef_quantize_u64(uint64_t *out, const float *x, int64_t n, double clip, double scale,
                     int64_t weight, uint64_t seed, int stochastic)
{
    const uint64_t w = (uint64_t)weight;
    for (int64_t i = 0; i < n; i++)
        out[i] = (uint64_t)quantum(x[i], clip, scale, i, seed, stochastic) * w;
}

/* x += m (or x -= m) word by word mod 2^32 / 2^64: adding a mask stream, or removing one.
 * Unsigned arithmetic wraps by definition; the loops vectorise. */
EF_MULTIVERSION
void ef_ring_add_u32(uint32_t *restrict x, const uint32_t *restrict m, int64_t n, int subtract)
{
    if (subtract)
        for (int64_t i = 0; i < n; i++)
            x[i] -= m[i];
    else
        for (int64_t i = 0; i < n; i++)
            x[i] += m[i];
}

EF_MULTIVERSION
void ef_ring_add_u64(uint64_t *restrict x, const uint64_t *restrict m, int64_t n, int subtract)
{
    if (subtract)
        for (int64_t i = 0; i < n; i++)
            x[i] -= m[i];
    else
        for (int64_t i = 0; i < n; i++)
            x[i] += m[i];
}

/* out = (signed value of the word) * unit, rounded once to float32: a ring sum of quantised
 * contributions back in the units of the inputs (unit = 1 / scale). */
void ef_dequantize_u32(float *out, const uint32_t *sum, int64_t n, double unit)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = (float)((double)(int32_t)sum[i] * unit);
}

void ef_dequantize_u64(float *out, const uint64_t *sum, int64_t n, double unit)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = (float)((double)(int64_t)sum[i] * unit);
}
