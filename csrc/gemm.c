/* gemm.c - row-major single-precision GEMM: scipy-openblas32 when linked, portable C99 otherwise. */
#include "edgefl.h"

#ifdef EF_HAVE_BLAS
#include <cblas.h>
/* scipy-openblas32's cblas.h declares the scipy_-prefixed symbols the wheel exports. */

void ef_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
              const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
              int64_t ldc)
{
    if (m <= 0 || n <= 0) return;
    scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                      trans_b ? CblasTrans : CblasNoTrans, (blasint)m, (blasint)n, (blasint)k,
                      alpha, a, (blasint)lda, b, (blasint)ldb, beta, c, (blasint)ldc);
}

int ef_have_blas(void) { return 1; }
void ef_blas_set_threads(int n) { scipy_openblas_set_num_threads(n > 0 ? n : 1); }

#else /* portable C99 GEMM: pack op(A) and op(B) blocks, then a loop gcc vectorises over j */

#define GEMM_MB 64
#define GEMM_KB 64
#define GEMM_NB 256

static inline float at(const float *x, int64_t ld, int trans, int64_t r, int64_t col)
{
    return trans ? x[col * ld + r] : x[r * ld + col];
}

void ef_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
              const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
              int64_t ldc)
{
    float apack[GEMM_MB * GEMM_KB];
    float bpack[GEMM_KB * GEMM_NB];
    if (m <= 0 || n <= 0) return;
    for (int64_t i = 0; i < m; i++) {
        float *ci = c + i * ldc;
        if (beta == 0.0f) {
            for (int64_t j = 0; j < n; j++) ci[j] = 0.0f;
        } else if (beta != 1.0f) {
            for (int64_t j = 0; j < n; j++) ci[j] *= beta;
        }
    }
    if (k <= 0 || alpha == 0.0f) return;
    for (int64_t j0 = 0; j0 < n; j0 += GEMM_NB) {
        int64_t nb = n - j0 < GEMM_NB ? n - j0 : GEMM_NB;
        for (int64_t p0 = 0; p0 < k; p0 += GEMM_KB) {
            int64_t kb = k - p0 < GEMM_KB ? k - p0 : GEMM_KB;
            for (int64_t p = 0; p < kb; p++)
                for (int64_t j = 0; j < nb; j++)
                    bpack[p * nb + j] = at(b, ldb, trans_b, p0 + p, j0 + j);
            for (int64_t i0 = 0; i0 < m; i0 += GEMM_MB) {
                int64_t mb = m - i0 < GEMM_MB ? m - i0 : GEMM_MB;
                for (int64_t i = 0; i < mb; i++)
                    for (int64_t p = 0; p < kb; p++)
                        apack[i * kb + p] = alpha * at(a, lda, trans_a, i0 + i, p0 + p);
                for (int64_t i = 0; i < mb; i++) {
                    float *restrict ci = c + (i0 + i) * ldc + j0;
                    const float *ai = apack + i * kb;
                    for (int64_t p = 0; p < kb; p++) {
                        const float av = ai[p];
                        const float *restrict bp = bpack + p * nb;
                        for (int64_t j = 0; j < nb; j++) ci[j] += av * bp[j];
                    }
                }
            }
        }
    }
}

int ef_have_blas(void) { return 0; }
void ef_blas_set_threads(int n) { (void)n; }

#endif
