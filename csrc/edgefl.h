/* edgefl.h - the whole C API of edgefl's training core (C99, no globals, no allocation).
 *
 * Conventions (after Klipper's chelper): every exported name starts with ef_; arguments are
 * out-parameters first, then inputs, then sizes, then scalars. All buffers are contiguous and
 * owned by the caller (Python validates and allocates; kernels only read and write). Every
 * function is re-entrant, so the Cython layer calls it with the GIL released.
 */
#ifndef EDGEFL_H
#define EDGEFL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Hot loops get an AVX2 clone next to the baseline SSE2 code on x86-64 with GCC and glibc
 * (ifunc picks one at load time); everywhere else, plain C99 for the target. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__) && \
    !defined(EF_NO_MULTIVERSION)
#define EF_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define EF_MULTIVERSION
#endif

/* Samples per forward/backward pass (net.c). A minibatch larger than this (full-batch GD)
 * is processed in chunks whose gradients add up, so the workspace stays bounded; evaluation
 * and inference run over chunks of this many samples. Python reads it as _core.MAX_CHUNK. */
#define EF_MAX_CHUNK 128

/* ------------------------------------------------------------------------------------------
 * Vector kernels over flat float32 buffers (vec.c)
 * ---------------------------------------------------------------------------------------- */

/* out[j] = sum_k weights[k] * xs[k][j], one streaming pass, float64 accumulation in blocks. */
void ef_weighted_sum(float *out, const float *const *xs, const double *weights, int64_t k, int64_t n);
/* y += a * x */
void ef_axpy(float *restrict y, const float *restrict x, int64_t n, float a);
/* x *= a */
void ef_scale(float *x, int64_t n, float a);
/* sum x*y and sum x*x, accumulated in float64 */
double ef_dot(const float *x, const float *y, int64_t n);
double ef_sqnorm(const float *x, int64_t n);
/* Index of the first NaN or infinity in x[0..n), or -1 when every value is finite. */
int64_t ef_first_nonfinite(const float *x, int64_t n);
/* Coordinate-wise median of k buffers (mean of the two middle values for even k).
 * scratch: k floats. */
void ef_median(float *out, float *scratch, const float *const *xs, int64_t k, int64_t n);
/* Coordinate-wise trimmed mean: drop the `trim` smallest and `trim` largest, average the rest
 * (2*trim < k). scratch: k floats. */
void ef_trimmed_mean(float *out, float *scratch, const float *const *xs, int64_t k, int64_t n,
                     int64_t trim);

/* ------------------------------------------------------------------------------------------
 * Secure aggregation's ring arithmetic (secagg.c; the representation is stated there)
 * ---------------------------------------------------------------------------------------- */

/* out[i] = k_i * weight mod 2^bits (add: out[i] += it), k_i = x[i] clipped to [-clip, clip],
 * times scale, rounded stochastically (seeded counter stream) or to nearest. */
void ef_quantize_u32(uint32_t *out, const float *x, int64_t n, double clip, double scale,
                     int64_t weight, uint64_t seed, int stochastic, int add);
void ef_quantize_u64(uint64_t *out, const float *x, int64_t n, double clip, double scale,
                     int64_t weight, uint64_t seed, int stochastic, int add);
/* x += m (subtract = 0) or x -= m, mod 2^32 / 2^64. */
void ef_ring_add_u32(uint32_t *restrict x, const uint32_t *restrict m, int64_t n, int subtract);
void ef_ring_add_u64(uint64_t *restrict x, const uint64_t *restrict m, int64_t n, int subtract);
/* out[i] = signed(sum[i]) * unit, one rounding to float32. */
void ef_dequantize_u32(float *out, const uint32_t *sum, int64_t n, double unit);
void ef_dequantize_u64(float *out, const uint64_t *sum, int64_t n, double unit);
/* OpenSSL's EVP functions (EVP_CIPHER_CTX_new, EVP_CIPHER_CTX_free, EVP_aes_256_ctr,
 * EVP_EncryptInit_ex, EVP_EncryptUpdate), found at run time (edgefl/_openssl.py); EF_OK. */
int ef_set_aes_ctr(void *ctx_new, void *ctx_free, void *aes_256_ctr, void *init, void *update);
int ef_have_aes_ctr(void);
/* words (n words of `bits`) then scalars (m uint64) (+|-)= each of nkeys AES-256-CTR keystreams
 * (keys: 32 bytes each; subtract[k] 0/1), block by block; with x != NULL each block is first
 * quantised from x (as ef_quantize_*); the streams start at byte 16 * counter. EF_OK, or
 * EF_ERR_ARGS (no OpenSSL, an OpenSSL failure, 8 m > 16 kB). */
int ef_secagg_mask(void *words, int64_t n, int bits, uint64_t *scalars, int64_t m,
                   const unsigned char *keys, const unsigned char *subtract, int64_t nkeys,
                   const float *x, double clip, double scale, int64_t weight, uint64_t seed,
                   int stochastic, uint64_t counter);

/* ------------------------------------------------------------------------------------------
 * Codecs (codec.c)
 * ---------------------------------------------------------------------------------------- */

/* IEEE binary16 with round-to-nearest-even (same bits as numpy's astype(float16)). */
void ef_f32_to_f16(uint16_t *out, const float *in, int64_t n);
void ef_f16_to_f32(float *out, const uint16_t *in, int64_t n);
/* Symmetric int8 per segment (one segment per layer): scale_s = max|x| / 127 (1 if all zero),
 * q = clamp(rint(x / scale_s), -127, 127). seg_offsets has nseg + 1 entries, the last = n. */
void ef_f32_to_i8(int8_t *out, float *scales, const float *in, const int64_t *seg_offsets,
                  int64_t nseg);
void ef_i8_to_f32(float *out, const int8_t *in, const float *scales, const int64_t *seg_offsets,
                  int64_t nseg);

/* ------------------------------------------------------------------------------------------
 * Networks (net.c): a model is a sequence of layers over ONE flat parameter buffer.
 * ---------------------------------------------------------------------------------------- */

enum ef_op { EF_DENSE = 1, EF_CONV2D = 2, EF_MAXPOOL2D = 3, EF_RELU = 4, EF_FLATTEN = 5 };

enum ef_loss {
    EF_LOSS_SOFTMAX_CE = 1, /* labels: int class index; mean over samples */
    EF_LOSS_LOGISTIC = 2,   /* one output; labels 0/1 */
    EF_LOSS_MSE = 3,        /* targets float [n, n_out]; 1/2 * mean over samples of ||y - s||^2 */
    EF_LOSS_SQHINGE = 4     /* one-vs-rest squared hinge, 1/2 * sum_c max(0, 1 - y_c s_c)^2;
                               with one output, labels 0/1 map to y = -1/+1 (MFL's SVM) */
};

/* One layer. Shapes are per sample, channels-first (NCHW without the N). Dense layers use
 * c = features and h = w = 1. Weights follow PyTorch's layout: dense (out, in),
 * conv (out_c, in_c, k, k). Offsets index the flat parameter buffer; -1 means none. */
typedef struct {
    int32_t op;
    int32_t in_c, in_h, in_w;
    int32_t out_c, out_h, out_w;
    int32_t k, stride, pad;
    int64_t w_off, b_off;
} ef_layer;

typedef struct {
    const ef_layer *layers;
    int32_t n_layers;
    int32_t loss;      /* enum ef_loss */
    int64_t n_params;
    float l2;          /* lambda/2 * ||W||^2 added to the loss, weights only (the SVM's lambda) */
} ef_net;

/* Hyper-parameters of one local round. */
typedef struct {
    float lr;
    float momentum;      /* heavy ball, PyTorch convention: d = m*d + g; w -= lr*d */
    float weight_decay;  /* g += wd * w (all parameters), before momentum, as torch.optim.SGD */
    float prox_mu;       /* FedProx: g += mu * (w - anchor), after weight decay, the gradient of
                            mu/2 ||w - anchor||^2; 0 skips the term (plain SGD, bit for bit) */
    int32_t batch_size;  /* <= 0 or >= n: full-batch gradient descent */
    int32_t epochs;      /* passes over the data, used when steps == 0 */
    int32_t steps;       /* > 0: exactly this many minibatch steps, reshuffling at each pass */
    int32_t grad0_mode;  /* 0 none; 1 gradient at the start point on the first minibatch;
                            2 on all local data */
    uint64_t seed;
    /* NULL, or a stop word another thread (a signal's watcher) may write while the round
       runs; it is read before every step. 0: keep going. v > 0: stop before step v - 1,
       or before the next step if that one has passed: 1 means "stop now", k + 1 "stop
       after exactly k steps" (the deterministic stop the parity tests use). A stopped
       round returns EF_STOPPED with res->steps = the steps done, params as they left them. */
    const volatile int32_t *stop;
} ef_train_cfg;

/* Optional statistics; NULL pointers are skipped. */
typedef struct {
    float *grad0;       /* [n_params] gradient at the start point (see grad0_mode) */
    float *grad_sum;    /* [n_params] += every minibatch gradient (DUW's hypergradient, docs/algorithms.md#duw) */
    double *step_stats; /* [max_steps * 3]: per step s, before its update:
                           ||grad0 - g_s||, ||w_start - w_s||, ||sum_{r<=s} g_r||^2 (FedVeca) */
    int64_t max_steps;  /* rows available in step_stats */
    float *w_start;     /* [n_params] scratch holding the start point; needed for step_stats */
    float *run_sum;     /* [n_params] scratch for the running gradient sum; needed for step_stats */
} ef_train_stats;

typedef struct {
    double mean_loss;   /* mean of the minibatch losses seen (before each update) */
    int64_t steps;      /* updates done */
    int64_t samples;    /* samples processed */
    int64_t bad_step;   /* the step whose loss or gradient was not finite, or -1 */
} ef_train_result;

enum ef_status { EF_OK = 0, EF_ERR_NONFINITE = 1, EF_ERR_ARGS = 2, EF_STOPPED = 3 };

/* Workspace needed (in floats and in int64s) for a network processing `chunk` samples at a
 * time (1..128, as ef_chunk_for_batch gives; forward, loss_grad and evaluate take the same)
 * over a data set of n samples. Returns 0, or EF_ERR_ARGS for an inconsistent net or one
 * whose sizes pass what the kernels index: a per-sample activation, a conv's padded side or
 * its GEMM depth in_c * k * k past int32, a conv's per-sample scratch past 2^40 floats, more
 * than 2^62 parameters. */
int ef_workspace_size(int64_t *n_float, int64_t *n_int, const ef_net *net, int64_t chunk,
                      int64_t n);

/* The chunk (samples per forward/backward pass) the kernels use for a batch size. */
int64_t ef_chunk_for_batch(int64_t batch_size, int64_t n);

/* Forward pass: out [n, n_out] = network outputs (logits/scores, before the loss). */
int ef_forward(float *out, float *work, const ef_net *net, const float *params, const float *x,
               int64_t n, int64_t chunk);

/* Mean loss and its gradient over the given samples (the loss includes the l2 term). */
int ef_loss_grad(float *grad, double *loss, float *work, const ef_net *net, const float *params,
                 const float *x, const int32_t *labels, const float *targets, int64_t n,
                 int64_t chunk);

/* Summed loss (without l2) and the number of correctly classified samples. For MSE "correct"
 * means sign agreement of a single output (MFL's even/odd regression). */
int ef_evaluate(double *loss_sum, int64_t *correct, float *work, const ef_net *net,
                const float *params, const float *x, const int32_t *labels, const float *targets,
                int64_t n, int64_t chunk);

/* A whole local round: seeded shuffle, minibatch gather, forward, backward, update, for
 * cfg->epochs passes or cfg->steps steps, or until cfg->stop asks for a stop (EF_STOPPED). momentum may be NULL when cfg->momentum == 0.
 * anchor [n_params] is the proximal term's centre (the round's start point, read only; it must
 * not overlap params); it may be NULL when cfg->prox_mu == 0. */
int ef_local_train(float *params, float *momentum, ef_train_stats *stats, ef_train_result *res,
                   float *work, int64_t *iwork, const ef_net *net, const float *x,
                   const int32_t *labels, const float *targets, const float *anchor, int64_t n,
                   const ef_train_cfg *cfg);

/* The epoch permutation used by ef_local_train: sort i by key(seed, epoch, i) (then by i).
 * iwork: 4n int64. */
void ef_shuffle(int64_t *perm, int64_t *iwork, uint64_t seed, int64_t epoch, int64_t n);
uint64_t ef_shuffle_key(uint64_t seed, int64_t epoch, int64_t i);

/* Row-major C = alpha * op(A) op(B) + beta * C (gemm.c: scipy-openblas32 or portable C). */
void ef_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
              const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
              int64_t ldc);
int ef_have_blas(void);
void ef_blas_set_threads(int n);

#ifdef __cplusplus
}
#endif
#endif /* EDGEFL_H */
