/* codec.c - wire codecs for float32 buffers: IEEE binary16 and per-segment symmetric int8. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "edgefl.h"

/* ------------------------------------------------------------------------------------------
 * binary16. Integer bit manipulation with round-to-nearest-even, so the bits equal numpy's
 * astype(np.float16) for every finite and infinite float32: checked once over all 2^32
 * float32 bit patterns (no difference outside NaNs); tests/test_vec.py keeps checking all
 * 2^16 halves, every rounding midpoint +-3 ulp and millions of random floats. NaNs stay NaN
 * and come out quiet, sign | 0x7e00 | top payload bits (numpy keeps a signalling NaN
 * signalling, so NaN bits may differ from numpy's; reference.py follows this file).
 * ---------------------------------------------------------------------------------------- */

static uint32_t float_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint16_t half_from_bits(uint32_t x)
{
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t a = x & 0x7fffffffu;

    if (a >= 0x7f800000u) /* inf, or NaN made quiet with the top of its payload kept */
        return (uint16_t)(sign | (a == 0x7f800000u ? 0x7c00u : 0x7e00u | ((a >> 13) & 0x3ffu)));
    if (a >= 0x38800000u) {
        /* normal half (|x| >= 2^-14): rebias the exponent (127 -> 15), round the 13 dropped
         * mantissa bits to nearest even; a carry into the exponent is the correct result,
         * and |x| >= 65520 carries into 0x7c00 (inf). */
        uint32_t r = a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u);
        r >>= 13;
        return (uint16_t)(sign | (r > 0x7c00u ? 0x7c00u : r));
    }
    {
        /* subnormal half (or zero): the result counts units of 2^-24. */
        const uint32_t e = a >> 23; /* biased float exponent, 0..112 */
        if (e < 102)                /* |x| < 2^-25 rounds to zero */
            return (uint16_t)sign;
        {
            const uint32_t mant = (a & 0x7fffffu) | 0x800000u; /* |x| = mant * 2^(e-150) */
            const uint32_t shift = 126u - e;                    /* 14..24 */
            const uint32_t rem = mant & ((1u << shift) - 1u);
            const uint32_t half = 1u << (shift - 1u);
            uint32_t q = mant >> shift;
            q += (rem > half) | ((rem == half) & q);
            return (uint16_t)(sign | q); /* q == 0x400 is the smallest normal: also right */
        }
    }
}

static float float_from_half(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu;
    const uint32_t m = h & 0x3ffu;

    if (e == 0x1fu) /* inf, or NaN (made quiet) */
        return bits_float(sign | 0x7f800000u | (m ? 0x00400000u | (m << 13) : 0u));
    if (e != 0)
        return bits_float(sign | ((e + 112u) << 23) | (m << 13));
    {
        /* zero or subnormal: m * 2^-24, exact in float32 (and never a float subnormal) */
        const float v = (float)m * 5.9604644775390625e-8f;
        return bits_float(sign | float_bits(v));
    }
}

void ef_f32_to_f16(uint16_t *out, const float *in, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        out[j] = half_from_bits(float_bits(in[j]));
}

void ef_f16_to_f32(float *out, const uint16_t *in, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        out[j] = float_from_half(in[j]);
}

/* ------------------------------------------------------------------------------------------
 * int8, one symmetric scale per segment (layer):
 *   scale = max|x| / 127 in float32, or 1 when that is not > 0 (all-zero or empty segment,
 *           or a segment so small the scale underflows); NaNs are ignored by the max;
 *   q     = clamp(rint(x / scale), -127, 127), x / scale a float32 division, rint half-even;
 *           a NaN encodes as 127 (finite inputs are expected: the wire rejects NaN anyway).
 *   decode: x = (float)q * scale.
 * ---------------------------------------------------------------------------------------- */

/* Round half to even, exact for |v| < 2^22: adding and subtracting 1.5 * 2^23 leaves the
 * integer part rounded by the FPU's default mode. Larger |v| stay larger than 127 in
 * magnitude with their sign, and inf/NaN pass through, so the clamp that follows is still
 * right. Written this way so the loop vectorises instead of calling rintf per element; it
 * needs float arithmetic done in float (FLT_EVAL_METHOD 0: SSE2, NEON, VFP), else rintf. */
static float round_half_even(float v)
{
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD == 0
    const float magic = 12582912.0f;
    return (v + magic) - magic;
#else
    return rintf(v);
#endif
}

/* max|x| over the bit patterns: for non-NaN floats |x| orders like its bits read as a
 * non-negative int32, and an integer max is a reduction gcc vectorises without -ffast-math
 * (a float max is not, and unsigned compares miss on SSE2). NaNs are skipped. */
static float segment_scale(const float *x, int64_t n)
{
    int32_t top = 0;
    for (int64_t j = 0; j < n; j++) {
        int32_t a;
        memcpy(&a, &x[j], sizeof a);
        a &= 0x7fffffff;
        a = (a > 0x7f800000) ? 0 : a;
        top = (a > top) ? a : top;
    }
    {
        const float s = bits_float((uint32_t)top) / 127.0f;
        return (s > 0.0f) ? s : 1.0f;
    }
}

static void quantize(int8_t *restrict q, const float *restrict x, int64_t n, float scale)
{
    for (int64_t j = 0; j < n; j++) {
        float v = round_half_even(x[j] / scale);
        v = (v < 127.0f) ? v : 127.0f; /* NaN -> 127 */
        v = (v > -127.0f) ? v : -127.0f;
        q[j] = (int8_t)v;
    }
}

void ef_f32_to_i8(int8_t *out, float *scales, const float *in, const int64_t *seg_offsets,
                  int64_t nseg)
{
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t lo = seg_offsets[s], len = seg_offsets[s + 1] - seg_offsets[s];
        const float scale = segment_scale(in + lo, len);
        scales[s] = scale;
        quantize(out + lo, in + lo, len, scale);
    }
}

void ef_i8_to_f32(float *out, const int8_t *in, const float *scales, const int64_t *seg_offsets,
                  int64_t nseg)
{
    for (int64_t s = 0; s < nseg; s++) {
        const float scale = scales[s];
        const int64_t hi = seg_offsets[s + 1];
        for (int64_t j = seg_offsets[s]; j < hi; j++)
            out[j] = (float)in[j] * scale;
    }
}
