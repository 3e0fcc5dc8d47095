/* secagg.c - the per-parameter work of secure aggregation: quantising float32 updates into the
 * ring Z_(2^32) or Z_(2^64), adding and removing mask words, and turning a sum of quantised
 * contributions back into floats.
 *
 * Representation. A value x is clipped to [-clip, clip] and scaled to s = x * scale
 * (scale = levels / clip), then rounded to an integer k in [-levels - 1, levels + 1] (levels
 * + 1 only where s came out a hair above levels in float64 and u was within that hair of 1):
 *     stochastic:    k = floor(s + u), u uniform in [0, 1), so E[k] = s (unbiased);
 *     deterministic: k = floor(s + 0.5).
 * u for coordinate i is (mix64(seed + (i + 1) * GOLDEN) >> 11) * 2^-53 (splitmix64's
 * finaliser over a counter), so the C kernel and reference.py draw the same u. The word
 * stored is k * weight in two's complement mod 2^bits: a negative value wraps to the top of
 * the ring, which IS the offset that makes negative values add correctly. A sum of
 * contributions is exact in the ring, and read back as a signed integer it is the true
 * integer sum as long as |sum| <= sum_i weight_i * (levels + 1) < 2^(bits-1): the caller chooses
 * levels so (edgefl.privacy.secagg.quantiser; configs that cannot are refused there).
 * All arithmetic is in double then int64 (no contraction under -std=c99), then unsigned,
 * where wrap-around is defined behaviour.
 * ---------------------------------------------------------------------------------------- */
#include "edgefl.h"

#include <stdlib.h>

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

/* add: out += the words instead of out = them, so words already in out (masks expanded
 * ahead of the contribution) take the quantised vector in the same pass, with no temporary. */
EF_QUANTIZE_CLONES
void ef_quantize_u32(uint32_t *out, const float *x, int64_t n, double clip, double scale,
                     int64_t weight, uint64_t seed, int stochastic, int add)
{
    const uint64_t w = (uint64_t)weight;
    if (add)
        for (int64_t i = 0; i < n; i++)
            out[i] += (uint32_t)((uint64_t)quantum(x[i], clip, scale, i, seed, stochastic) * w);
    else
        for (int64_t i = 0; i < n; i++)
            out[i] = (uint32_t)((uint64_t)quantum(x[i], clip, scale, i, seed, stochastic) * w);
}

EF_QUANTIZE_CLONES
void ef_quantize_u64(uint64_t *out, const float *x, int64_t n, double clip, double scale,
                     int64_t weight, uint64_t seed, int stochastic, int add)
{
    const uint64_t w = (uint64_t)weight;
    if (add)
        for (int64_t i = 0; i < n; i++)
            out[i] += (uint64_t)quantum(x[i], clip, scale, i, seed, stochastic) * w;
    else
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

/* ------------------------------------------------------------------------------------------
 * Masks: words (+|-)= the AES-256-CTR keystream of each key, mod 2^bits, with the GIL released.
 *
 * The keystream comes from OpenSSL's EVP interface (a maintained library; nothing
 * cryptographic is written here): the process's libcrypto is found at run time by
 * edgefl/_openssl.py, which hands its EVP function addresses to ef_set_aes_ctr, so building
 * the core needs no OpenSSL headers and a core without them still loads (the masks then come
 * from `cryptography` through reference.py, which is also the oracle the parity tests hold
 * this to). Each key's stream is AES-256-CTR with a zero IV, the bytes it encrypts zeros to:
 * the words' bytes first, then 8 bytes per 64-bit scalar, exactly as secagg's PRG.
 *
 * The vector is walked in EF_MASK_BLOCK-byte blocks; every key's stream is run over a block
 * (into a keystream buffer the size of a block) and added before the next block, so the
 * block, the buffer and the zeros stay in L1/L2 and the words cross memory once. With `x`
 * (not NULL) the block is first quantised into the words (the ring's quantiser above, the
 * same u per coordinate as a whole-vector ef_quantize_*), so quantisation and masking are one
 * pass. `counter` starts the streams at byte 16 * counter (a piece of a longer vector: CTR's
 * counter block is the 128-bit big-endian block index), so threads can mask pieces of one
 * vector (kernels.secagg_mask).
 * ---------------------------------------------------------------------------------------- */
#define EF_MASK_BLOCK (16 * 1024)

typedef void *(*ef_ctx_new_fn)(void);
typedef void (*ef_ctx_free_fn)(void *);
typedef const void *(*ef_cipher_fn)(void);
typedef int (*ef_init_fn)(void *, const void *, void *, const unsigned char *,
                          const unsigned char *);
typedef int (*ef_update_fn)(void *, unsigned char *, int *, const unsigned char *, int);

static struct {
    ef_ctx_new_fn ctx_new;
    ef_ctx_free_fn ctx_free;
    ef_cipher_fn aes_256_ctr;
    ef_init_fn init;
    ef_update_fn update;
} ef_evp;

static const unsigned char ef_zeros[EF_MASK_BLOCK];

int ef_set_aes_ctr(void *ctx_new, void *ctx_free, void *aes_256_ctr, void *init, void *update)
{
    ef_evp.ctx_new = (ef_ctx_new_fn)ctx_new;
    ef_evp.ctx_free = (ef_ctx_free_fn)ctx_free;
    ef_evp.aes_256_ctr = (ef_cipher_fn)aes_256_ctr;
    ef_evp.init = (ef_init_fn)init;
    ef_evp.update = (ef_update_fn)update;
    return ef_have_aes_ctr() ? EF_OK : EF_ERR_ARGS;
}

int ef_have_aes_ctr(void)
{
    return ef_evp.ctx_new && ef_evp.ctx_free && ef_evp.aes_256_ctr && ef_evp.init &&
           ef_evp.update;
}

/* keystream bytes [at the context's position, + nbytes) into ks; 0 on an OpenSSL failure */
static int keystream(void *ctx, unsigned char *ks, int nbytes)
{
    int got = 0;
    return ef_evp.update(ctx, ks, &got, ef_zeros, nbytes) == 1 && got == nbytes;
}

static void add_bytes(void *dst, const unsigned char *ks, int64_t nbytes, int bits, int subtract)
{
    if (bits == 32)
        ef_ring_add_u32((uint32_t *)dst, (const uint32_t *)(const void *)ks, nbytes / 4, subtract);
    else
        ef_ring_add_u64((uint64_t *)dst, (const uint64_t *)(const void *)ks, nbytes / 8, subtract);
}

int ef_secagg_mask(void *words, int64_t n, int bits, uint64_t *scalars, int64_t m,
                   const unsigned char *keys, const unsigned char *subtract, int64_t nkeys,
                   const float *x, double clip, double scale, int64_t weight, uint64_t seed,
                   int stochastic, uint64_t counter)
{
    unsigned char iv[16] = {0};
    for (int b = 0; b < 8; b++)        /* the 128-bit big-endian counter of the first block */
        iv[15 - b] = (unsigned char)(counter >> (8 * b));
    const int64_t itemsize = bits / 8, per_block = EF_MASK_BLOCK / itemsize;
    if (!ef_have_aes_ctr() || (bits != 32 && bits != 64) || n < 0 || m < 0 || nkeys < 0 ||
        8 * m > EF_MASK_BLOCK)
        return EF_ERR_ARGS;
    int status = EF_OK;
    void **ctx = calloc((size_t)(nkeys > 0 ? nkeys : 1), sizeof *ctx);
    unsigned char *ks = malloc(EF_MASK_BLOCK);
    if (!ctx || !ks) {
        status = EF_ERR_ARGS;
        goto done;
    }
    for (int64_t k = 0; k < nkeys; k++)
        if (!(ctx[k] = ef_evp.ctx_new()) ||
            ef_evp.init(ctx[k], ef_evp.aes_256_ctr(), NULL, keys + 32 * k, iv) != 1) {
            status = EF_ERR_ARGS;
            goto done;
        }
    for (int64_t start = 0; start < n; start += per_block) {
        const int64_t count = n - start < per_block ? n - start : per_block;
        unsigned char *block = (unsigned char *)words + start * itemsize;
        if (x) {
            const uint64_t at = seed + (uint64_t)start * EF_GOLDEN64;  /* u of coordinate start+j */
            if (bits == 32)
                ef_quantize_u32((uint32_t *)(void *)block, x + start, count, clip, scale,
                                weight, at, stochastic, 0);
            else
                ef_quantize_u64((uint64_t *)(void *)block, x + start, count, clip, scale,
                                weight, at, stochastic, 0);
        }
        for (int64_t k = 0; k < nkeys; k++) {
            if (!keystream(ctx[k], ks, (int)(count * itemsize))) {
                status = EF_ERR_ARGS;
                goto done;
            }
            add_bytes(block, ks, count * itemsize, bits, subtract[k]);
        }
    }
    if (m > 0)
        for (int64_t k = 0; k < nkeys; k++) {
            if (!keystream(ctx[k], ks, (int)(8 * m))) {
                status = EF_ERR_ARGS;
                goto done;
            }
            add_bytes(scalars, ks, 8 * m, 64, subtract[k]);
        }
done:
    if (ctx)
        for (int64_t k = 0; k < nkeys; k++)
            if (ctx[k])
                ef_evp.ctx_free(ctx[k]);
    free(ctx);
    free(ks);
    return status;
}
