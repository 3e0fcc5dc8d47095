/* test_core.c - C unit tests of csrc/ without Python: built natively by tests/test_c_core.py
 * and for aarch64/armhf under qemu-user by tools/check_arm.sh. Prints one line per failed
 * check and ends with "N passed, N failed". */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "edgefl.h"

static int passed, failed;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (cond) {                                                                        \
            passed++;                                                                      \
        } else {                                                                           \
            failed++;                                                                      \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                    \
            printf(__VA_ARGS__);                                                           \
            printf("\n");                                                                  \
        }                                                                                  \
    } while (0)

static uint64_t rng_state = 0x2545F4914F6CDD1DULL;

static double urand(void) /* xorshift64*, uniform in [0, 1) */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 0x2545F4914F6CDD1DULL) >> 11) / 9007199254740992.0;
}

static float nrand(void) { return (float)(2.0 * urand() - 1.0); }

/* ------------------------------------------------------------------ first_nonfinite */

static void test_first_nonfinite(void)
{
    enum { N = 10000 };
    static float x[N];
    for (int i = 0; i < N; i++) x[i] = nrand() * 1e30f;
    x[17] = 1e-42f; /* a denormal: finite */
    CHECK(ef_first_nonfinite(x, N) == -1, "all finite: got %lld",
          (long long)ef_first_nonfinite(x, N));
    CHECK(ef_first_nonfinite(x, 0) == -1, "empty: got %lld", (long long)ef_first_nonfinite(x, 0));
    const int at[] = {0, 4095, 4096, 9999};
    const float bad[] = {NAN, INFINITY, -INFINITY};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 3; b++) {
            float keep = x[at[a]];
            x[at[a]] = bad[b];
            if (at[a] + 3 < N) x[at[a] + 3] = NAN;
            int64_t got = ef_first_nonfinite(x, N);
            CHECK(got == at[a], "first non-finite at %d (kind %d): got %lld", at[a], b,
                  (long long)got);
            x[at[a]] = keep;
            if (at[a] + 3 < N) x[at[a] + 3] = 0.5f;
        }
}

/* ------------------------------------------------------------------ gemm */

static void test_gemm(void)
{
    enum { M = 7, N = 13, K = 70 };
    static float a[M * K], b[K * N], c[M * N];
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            for (int i = 0; i < M * K; i++) a[i] = nrand();
            for (int i = 0; i < K * N; i++) b[i] = nrand();
            for (int i = 0; i < M * N; i++) c[i] = 1.0f;
            const int lda = ta ? M : K, ldb = tb ? K : N;
            ef_sgemm(ta, tb, M, N, K, 0.5f, a, lda, b, ldb, 2.0f, c, N);
            double worst = 0.0;
            for (int i = 0; i < M; i++)
                for (int j = 0; j < N; j++) {
                    double acc = 0.0;
                    for (int p = 0; p < K; p++)
                        acc += (double)(ta ? a[p * M + i] : a[i * K + p]) *
                               (tb ? b[j * K + p] : b[p * N + j]);
                    double want = 0.5 * acc + 2.0, d = fabs(want - c[i * N + j]);
                    if (d > worst) worst = d;
                }
            CHECK(worst < 1e-4, "sgemm ta=%d tb=%d: max error %g", ta, tb, worst);
        }
}

/* ------------------------------------------------------------------ vector kernels, codecs */

static int cmp_float(const void *x, const void *y)
{
    float a = *(const float *)x, b = *(const float *)y;
    return (a > b) - (a < b);
}

static void test_vec(void)
{
    enum { K = 9, N = 1000 };
    static float bufs[K][N], out[N], col[K], scratch[K];
    const float *xs[K];
    double w[K];
    for (int k = 0; k < K; k++) {
        for (int j = 0; j < N; j++) bufs[k][j] = nrand();
        xs[k] = bufs[k];
        w[k] = urand();
    }
    ef_weighted_sum(out, xs, w, K, N);
    double worst = 0.0;
    for (int j = 0; j < N; j++) {
        double acc = 0.0;
        for (int k = 0; k < K; k++) acc += w[k] * (double)bufs[k][j];
        if (fabs(acc - out[j]) > worst) worst = fabs(acc - out[j]);
    }
    CHECK(worst < 1e-6, "weighted_sum: max error %g", worst);

    ef_median(out, scratch, xs, K, N);
    int bad_median = 0, bad_trim = 0;
    for (int j = 0; j < N; j++) {
        for (int k = 0; k < K; k++) col[k] = bufs[k][j];
        qsort(col, K, sizeof(float), cmp_float);
        bad_median += out[j] != col[K / 2];
    }
    CHECK(bad_median == 0, "median: %d coordinates differ from sorting", bad_median);
    ef_trimmed_mean(out, scratch, xs, K, N, 2);
    for (int j = 0; j < N; j++) {
        for (int k = 0; k < K; k++) col[k] = bufs[k][j];
        qsort(col, K, sizeof(float), cmp_float);
        double acc = 0.0;
        for (int k = 2; k < K - 2; k++) acc += col[k];
        bad_trim += fabs(acc / (K - 4) - out[j]) > 1e-6;
    }
    CHECK(bad_trim == 0, "trimmed_mean: %d coordinates off", bad_trim);

    double dot = ef_dot(bufs[0], bufs[1], N), naive = 0.0;
    for (int j = 0; j < N; j++) naive += (double)bufs[0][j] * bufs[1][j];
    CHECK(fabs(dot - naive) < 1e-9, "dot: %g vs %g", dot, naive);

    static uint16_t h[N];
    static float back[N];
    ef_f32_to_f16(h, bufs[2], N);
    ef_f16_to_f32(back, h, N);
    worst = 0.0;
    for (int j = 0; j < N; j++) {
        double rel = fabs(back[j] - bufs[2][j]) / fmax(fabs(bufs[2][j]), 6.1e-5);
        if (rel > worst) worst = rel;
    }
    CHECK(worst <= 1.0 / 2048, "f16 round trip: relative error %g", worst);
    const float specials[4] = {1.0f, 65504.0f, 1e6f, -0.0f};
    const uint16_t want[4] = {0x3c00, 0x7bff, 0x7c00, 0x8000};
    ef_f32_to_f16(h, specials, 4);
    CHECK(!memcmp(h, want, sizeof want), "f16 specials: %04x %04x %04x %04x", h[0], h[1], h[2],
          h[3]);

    static int8_t q[N];
    float scales[2];
    const int64_t seg[3] = {0, 400, N};
    ef_f32_to_i8(q, scales, bufs[3], seg, 2);
    ef_i8_to_f32(back, q, scales, seg, 2);
    int bad_i8 = 0;
    for (int j = 0; j < N; j++) bad_i8 += fabs(back[j] - bufs[3][j]) > 0.5 * scales[j >= 400] + 1e-7;
    CHECK(bad_i8 == 0, "int8 round trip: %d values beyond scale/2", bad_i8);
}

/* ------------------------------------------------------------------ networks */

/* conv(2->3, k3, pad1, stride1) -> relu -> maxpool 2 -> flatten -> dense(48->4) on 2x8x8. */
static ef_layer cnn_layers[5];

static ef_net make_cnn(void)
{
    const ef_layer conv = {EF_CONV2D, 2, 8, 8, 3, 8, 8, 3, 1, 1, 0, 54};
    const ef_layer relu = {EF_RELU, 3, 8, 8, 3, 8, 8, 0, 0, 0, -1, -1};
    const ef_layer pool = {EF_MAXPOOL2D, 3, 8, 8, 3, 4, 4, 2, 2, 0, -1, -1};
    const ef_layer flat = {EF_FLATTEN, 3, 4, 4, 48, 1, 1, 0, 0, 0, -1, -1};
    const ef_layer fc = {EF_DENSE, 48, 1, 1, 4, 1, 1, 0, 0, 0, 57, 57 + 192};
    ef_net net;
    cnn_layers[0] = conv;
    cnn_layers[1] = relu;
    cnn_layers[2] = pool;
    cnn_layers[3] = flat;
    cnn_layers[4] = fc;
    net.layers = cnn_layers;
    net.n_layers = 5;
    net.loss = EF_LOSS_SOFTMAX_CE;
    net.n_params = 57 + 192 + 4;
    net.l2 = 0.0f;
    return net;
}

enum { NS = 24, IN = 2 * 8 * 8 };

static void test_gradient_and_training(void)
{
    ef_net net = make_cnn();
    const int64_t P = net.n_params;
    static float x[NS * IN], params[300], grad[300], probe[300], work[200000];
    static int64_t iwork[5 * NS];
    static int32_t labels[NS];
    int64_t nf = 0, ni = 0;
    CHECK(ef_workspace_size(&nf, &ni, &net, NS, NS) == EF_OK && nf <= 200000,
          "workspace: %lld floats", (long long)nf);
    for (int i = 0; i < NS * IN; i++) x[i] = nrand();
    for (int s = 0; s < NS; s++) labels[s] = s % 4;
    for (int64_t j = 0; j < P; j++) params[j] = 0.3f * nrand();

    double loss = 0.0;
    CHECK(ef_loss_grad(grad, &loss, work, &net, params, x, labels, NULL, NS, 8) == EF_OK,
          "loss_grad status");
    /* central differences in float on a few coordinates of every tensor */
    const int64_t probes[6] = {0, 31, 54, 56, 100, 250};
    for (int t = 0; t < 6; t++) {
        const int64_t j = probes[t];
        const float h = 1e-3f;
        double lp, lm;
        memcpy(probe, params, sizeof(float) * (size_t)P);
        probe[j] += h;
        ef_loss_grad(work + 100000, &lp, work, &net, probe, x, labels, NULL, NS, 8);
        probe[j] -= 2 * h;
        ef_loss_grad(work + 100000, &lm, work, &net, probe, x, labels, NULL, NS, 8);
        double fd = (lp - lm) / (2.0 * h);
        CHECK(fabs(fd - grad[j]) < 2e-3 + 2e-2 * fabs(fd), "grad[%lld]: analytic %g, fd %g",
              (long long)j, grad[j], fd);
    }

    /* a local round lowers the loss, and is deterministic for a seed */
    ef_train_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.lr = 0.1f;
    cfg.momentum = 0.9f;
    cfg.batch_size = 6;
    cfg.epochs = 15;
    cfg.seed = 7;
    static float p1[300], p2[300], m1[300], m2[300];
    memcpy(p1, params, sizeof(float) * (size_t)P);
    memcpy(p2, params, sizeof(float) * (size_t)P);
    memset(m1, 0, sizeof m1);
    memset(m2, 0, sizeof m2);
    ef_train_result r1, r2;
    CHECK(ef_local_train(p1, m1, NULL, &r1, work, iwork, &net, x, labels, NULL, NULL, NS,
                         &cfg) == EF_OK,
          "local_train status");
    ef_local_train(p2, m2, NULL, &r2, work, iwork, &net, x, labels, NULL, NULL, NS, &cfg);
    CHECK(!memcmp(p1, p2, sizeof(float) * (size_t)P), "local_train not deterministic");
    CHECK(r1.steps == 15 * 4 && r1.samples == 15 * NS, "steps %lld samples %lld",
          (long long)r1.steps, (long long)r1.samples);
    double after = 0.0;
    ef_loss_grad(grad, &after, work, &net, p1, x, labels, NULL, NS, 8);
    CHECK(after < 0.5 * loss, "loss %g -> %g after training", loss, after);
    int64_t correct = 0;
    double sum = 0.0;
    ef_evaluate(&sum, &correct, work, &net, p1, x, labels, NULL, NS, 5);
    CHECK(correct >= NS - 2, "evaluate: %lld of %d correct after fitting", (long long)correct, NS);

    /* a huge learning rate stops with EF_ERR_NONFINITE and names the step */
    cfg.lr = 1e30f;
    cfg.momentum = 0.0f;
    memcpy(p1, params, sizeof(float) * (size_t)P);
    int rc = ef_local_train(p1, NULL, NULL, &r1, work, iwork, &net, x, labels, NULL, NULL, NS,
                            &cfg);
    CHECK(rc == EF_ERR_NONFINITE && r1.bad_step >= 1, "non-finite: rc %d bad_step %lld", rc,
          (long long)r1.bad_step);
}

/* FedProx's proximal term: one full-batch step from w0 with anchor a is exactly
 * w0 - lr * (g + mu * (w0 - a)) in float32, mu = 0 is plain SGD to the bit whether or not an
 * anchor is given, and a bad mu or a missing anchor is refused. */
static void test_proximal_term(void)
{
    ef_net net = make_cnn();
    const int64_t P = net.n_params;
    static float x[NS * IN], w0[300], anchor[300], grad[300], p1[300], p2[300], work[200000];
    static int64_t iwork[5 * NS];
    static int32_t labels[NS];
    for (int i = 0; i < NS * IN; i++) x[i] = nrand();
    for (int s = 0; s < NS; s++) labels[s] = s % 4;
    for (int64_t j = 0; j < P; j++) {
        w0[j] = 0.3f * nrand();
        anchor[j] = w0[j] + 0.2f * nrand();
    }
    ef_train_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.lr = 0.1f;
    cfg.batch_size = 0;
    cfg.steps = 1;
    cfg.prox_mu = 0.3f; /* not a power of two: every rounding shows */
    ef_train_result r;

    double loss = 0.0;
    ef_loss_grad(grad, &loss, work, &net, w0, x, labels, NULL, NS, ef_chunk_for_batch(NS, NS));
    memcpy(p1, w0, sizeof(float) * (size_t)P);
    CHECK(ef_local_train(p1, NULL, NULL, &r, work, iwork, &net, x, labels, NULL, anchor, NS,
                         &cfg) == EF_OK, "proximal step status");
    int64_t differs = -1;
    float want = 0.0f;
    for (int64_t j = 0; j < P && differs < 0; j++) {
        const float d = w0[j] - anchor[j];
        const float t = cfg.prox_mu * d;
        const float g = grad[j] + t;
        want = w0[j] - cfg.lr * g;
        if (memcmp(&want, &p1[j], sizeof want)) differs = j;
    }
    CHECK(differs < 0, "proximal step [%lld]: %.9g, by hand %.9g", (long long)differs,
          differs < 0 ? 0.0 : p1[differs], want);

    /* mu = 0: the same bits as plain SGD, with or without an anchor */
    cfg.prox_mu = 0.0f;
    cfg.batch_size = 6;
    cfg.steps = 0;
    cfg.epochs = 3;
    cfg.seed = 5;
    memcpy(p1, w0, sizeof(float) * (size_t)P);
    memcpy(p2, w0, sizeof(float) * (size_t)P);
    ef_local_train(p1, NULL, NULL, &r, work, iwork, &net, x, labels, NULL, NULL, NS, &cfg);
    ef_local_train(p2, NULL, NULL, &r, work, iwork, &net, x, labels, NULL, anchor, NS, &cfg);
    CHECK(!memcmp(p1, p2, sizeof(float) * (size_t)P), "mu = 0 with an anchor is not plain SGD");
    /* mu > 0 pulls the end point towards the anchor */
    cfg.prox_mu = 1.0f;
    memcpy(p2, w0, sizeof(float) * (size_t)P);
    ef_local_train(p2, NULL, NULL, &r, work, iwork, &net, x, labels, NULL, anchor, NS, &cfg);
    double d_sgd = 0.0, d_prox = 0.0;
    for (int64_t j = 0; j < P; j++) {
        d_sgd += (double)(p1[j] - anchor[j]) * (p1[j] - anchor[j]);
        d_prox += (double)(p2[j] - anchor[j]) * (p2[j] - anchor[j]);
    }
    CHECK(d_prox < d_sgd, "mu = 1 left the model at %g from the anchor, plain SGD at %g",
          sqrt(d_prox), sqrt(d_sgd));

    /* refused: mu > 0 without an anchor, a negative or NaN or infinite mu */
    const float bad[] = {0.5f, -0.5f, NAN, INFINITY};
    for (int b = 0; b < 4; b++) {
        cfg.prox_mu = bad[b];
        memcpy(p1, w0, sizeof(float) * (size_t)P);
        int rc = ef_local_train(p1, NULL, NULL, &r, work, iwork, &net, x, labels, NULL,
                                b == 0 ? NULL : anchor, NS, &cfg);
        CHECK(rc == EF_ERR_ARGS && !memcmp(p1, w0, sizeof(float) * (size_t)P),
              "prox_mu %g (anchor %s): rc %d", bad[b], b == 0 ? "NULL" : "given", rc);
    }
}

/* The stop word: read before every step. v = k + 1 stops after exactly k steps, with the
 * parameters those k steps leave (the same as a round of cfg.steps = k), EF_STOPPED and
 * res.steps = k; 1 stops before the first step with the parameters untouched; 0 runs the
 * whole round. */
static void test_stop_word(void)
{
    ef_net net = make_cnn();
    const int64_t P = net.n_params;
    static float x[NS * IN], w0[300], p1[300], p2[300], m1[300], m2[300], work[200000];
    static int64_t iwork[5 * NS];
    static int32_t labels[NS];
    for (int i = 0; i < NS * IN; i++) x[i] = nrand();
    for (int s = 0; s < NS; s++) labels[s] = s % 4;
    for (int64_t j = 0; j < P; j++) w0[j] = 0.3f * nrand();
    ef_train_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.lr = 0.05f;
    cfg.momentum = 0.9f;
    cfg.batch_size = 5;
    cfg.epochs = 4;          /* 5 steps a pass over NS = 24 samples: 20 steps */
    cfg.seed = 11;
    ef_train_result r1, r2;
    int32_t word = 7 + 1;    /* stop after 7 steps: inside the second pass over NS samples */
    cfg.stop = &word;
    memcpy(p1, w0, sizeof(float) * (size_t)P);
    memset(m1, 0, sizeof m1);
    int rc = ef_local_train(p1, m1, NULL, &r1, work, iwork, &net, x, labels, NULL, NULL, NS,
                            &cfg);
    CHECK(rc == EF_STOPPED && r1.steps == 7, "stop after 7: rc %d steps %lld", rc,
          (long long)r1.steps);
    cfg.stop = NULL;
    cfg.epochs = 0;
    cfg.steps = 7;
    memcpy(p2, w0, sizeof(float) * (size_t)P);
    memset(m2, 0, sizeof m2);
    CHECK(ef_local_train(p2, m2, NULL, &r2, work, iwork, &net, x, labels, NULL, NULL, NS,
                         &cfg) == EF_OK, "7 steps status");
    CHECK(!memcmp(p1, p2, sizeof(float) * (size_t)P) && !memcmp(m1, m2, sizeof m1)
          && r1.mean_loss == r2.mean_loss && r1.samples == r2.samples,
          "stopped after 7 steps differs from 7 steps");
    word = 1;                /* "stop now": nothing trained */
    cfg.stop = &word;
    cfg.momentum = 0.0f;
    memcpy(p1, w0, sizeof(float) * (size_t)P);
    rc = ef_local_train(p1, NULL, NULL, &r1, work, iwork, &net, x, labels, NULL, NULL, NS, &cfg);
    CHECK(rc == EF_STOPPED && r1.steps == 0 && !memcmp(p1, w0, sizeof(float) * (size_t)P),
          "stop now: rc %d steps %lld", rc, (long long)r1.steps);
    word = 0;                /* a clear word: the whole round */
    rc = ef_local_train(p1, NULL, NULL, &r1, work, iwork, &net, x, labels, NULL, NULL, NS, &cfg);
    CHECK(rc == EF_OK && r1.steps == 7, "clear word: rc %d steps %lld", rc, (long long)r1.steps);
}

static void test_shuffle(void)
{
    enum { N = 1000 };
    static int64_t perm[N], iwork[4 * N];
    static int seen[N];
    ef_shuffle(perm, iwork, 42, 3, N);
    int ok = 1, moved = 0;
    for (int i = 0; i < N; i++) {
        if (perm[i] < 0 || perm[i] >= N || seen[perm[i]]++) ok = 0;
        moved += perm[i] != i;
    }
    CHECK(ok, "shuffle is not a permutation");
    CHECK(moved > N / 2, "shuffle left %d of %d in place", N - moved, N);
    /* the last epoch an int64 holds: its key (epoch + 1 wraps to 2^63, as reference.py's
     * uint64) without signed overflow; run under -fsanitize=undefined by test_c_core.py */
    uint64_t k0 = ef_shuffle_key(42, INT64_MAX, 0), k1 = ef_shuffle_key(42, INT64_MAX, 1);
    CHECK(k0 != k1, "shuffle key at epoch INT64_MAX: %llu twice", (unsigned long long)k0);
}

/* A layer table whose window is larger than its input passed check_net where C's division
 * truncates toward zero ((1 - 2) / 2 + 1 = 1 output row, where Python's builder floors to 0
 * and refuses): a pool or conv read past its input plane, and the pool's recorded argmax
 * scattered its gradient past the input's. A dense layer's output is [out_c] per sample. */
static int64_t table_status(ef_layer l0, ef_layer l1, ef_layer l2, int32_t n_layers,
                            int64_t n_params)
{
    static ef_layer t[3];
    int64_t nf = 0, ni = 0;
    ef_net net;
    t[0] = l0;
    t[1] = l1;
    t[2] = l2;
    net.layers = t;
    net.n_layers = n_layers;
    net.loss = EF_LOSS_SOFTMAX_CE;
    net.n_params = n_params;
    net.l2 = 0.0f;
    return ef_workspace_size(&nf, &ni, &net, 4, 4);
}

static void test_layer_table_checks(void)
{
    const ef_layer fc = {EF_DENSE, 1, 1, 1, 2, 1, 1, 0, 0, 0, 0, 2};
    const ef_layer fc9 = {EF_DENSE, 1, 1, 1, 2, 1, 1, 0, 0, 0, 9, 11}; /* after 9 conv weights */
    const ef_layer none = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1};
    /* the consistent tables these are made from */
    const ef_layer pool_ok = {EF_MAXPOOL2D, 1, 2, 2, 1, 1, 1, 2, 2, 0, -1, -1};
    const ef_layer conv_ok = {EF_CONV2D, 1, 3, 3, 1, 1, 1, 3, 3, 0, 0, -1};
    CHECK(table_status(pool_ok, fc, none, 2, 4) == EF_OK, "2x2 pool of a 2x2 input refused");
    CHECK(table_status(conv_ok, fc9, none, 2, 13) == EF_OK, "3x3 conv of a 3x3 input refused");
    /* a 2x2 pool over a 1x1 (and a 1x3, 3x1) input */
    const ef_layer pool_1x1 = {EF_MAXPOOL2D, 1, 1, 1, 1, 1, 1, 2, 2, 0, -1, -1};
    const ef_layer pool_1x3 = {EF_MAXPOOL2D, 1, 1, 3, 1, 1, 1, 2, 2, 0, -1, -1};
    const ef_layer pool_3x1 = {EF_MAXPOOL2D, 1, 3, 1, 1, 1, 1, 2, 2, 0, -1, -1};
    CHECK(table_status(pool_1x1, fc, none, 2, 4) == EF_ERR_ARGS, "2x2 pool of 1x1 accepted");
    CHECK(table_status(pool_1x3, fc, none, 2, 4) == EF_ERR_ARGS, "2x2 pool of 1x3 accepted");
    CHECK(table_status(pool_3x1, fc, none, 2, 4) == EF_ERR_ARGS, "2x2 pool of 3x1 accepted");
    /* a 3x3 conv, stride 3, over a 1x1 input without padding */
    const ef_layer conv_1x1 = {EF_CONV2D, 1, 1, 1, 1, 1, 1, 3, 3, 0, 0, -1};
    CHECK(table_status(conv_1x1, fc9, none, 2, 13) == EF_ERR_ARGS, "3x3 conv of 1x1 accepted");
    /* a padding whose 2 * pad overflows int32 */
    const ef_layer conv_pad = {EF_CONV2D, 1, 1, 1, 1, 1, 1, 1, 1, 0x40000000, 0, -1};
    CHECK(table_status(conv_pad, fc, none, 2, 4) == EF_ERR_ARGS, "pad 2^30 accepted");
    /* a dense layer claiming a spatial output: forward wrote out_c values per sample, the
     * next layer read out_c * out_h * out_w */
    const ef_layer fc_2x1 = {EF_DENSE, 1, 1, 1, 1, 2, 1, 0, 0, 0, 0, -1};
    const ef_layer fc_after = {EF_DENSE, 2, 1, 1, 2, 1, 1, 0, 0, 0, 1, -1};
    CHECK(table_status(fc_2x1, fc_after, none, 2, 5) == EF_ERR_ARGS,
          "dense with a 2x1 output accepted");
    /* Sizes past what the kernels index: before, check_net passed these and the layout's size
     * arithmetic overflowed (UBSan: signed overflow) into a workspace smaller than the
     * kernels then wrote. A 1x1 input with pad 2^30 at stride 2 is consistent (out 2^30 + 1)
     * but its padded side 1 + 2^31 overflowed int32 in padded_size, and its 2^60-float
     * activation overflowed int64 times the chunk. */
    const int32_t big = 0x40000001; /* 2^30 + 1 */
    const ef_layer conv_wide = {EF_CONV2D, 1, 1, 1, 1, big, big, 1, 2, 0x40000000, 0, -1};
    const ef_layer conv_narrow = {EF_CONV2D, 1, big, big, 1, 1, 1, 1, big, 0, 1, -1};
    const ef_layer fc_1 = {EF_DENSE, 1, 1, 1, 2, 1, 1, 0, 0, 0, 2, 4};
    CHECK(table_status(conv_wide, conv_narrow, fc_1, 3, 6) == EF_ERR_ARGS,
          "a conv with a 2^60-float output (padded side 2^31 + 1) accepted");
    /* a per-sample size whose product of three int32 dimensions overflows int64 */
    const int32_t d21 = 0x200000; /* 2^21 */
    const ef_layer relu_huge = {EF_RELU, d21, d21, d21, d21, d21, d21, 0, 0, 0, -1, -1};
    CHECK(table_status(relu_huge, fc, none, 2, 4) == EF_ERR_ARGS,
          "a 2^63-value activation accepted");
    /* offsets near INT64_MAX: w_off + weights and b_off + out_c overflowed */
    const ef_layer fc_woff = {EF_DENSE, 1, 1, 1, 2, 1, 1, 0, 0, 0, INT64_MAX - 1, -1};
    const ef_layer fc_boff = {EF_DENSE, 1, 1, 1, 2, 1, 1, 0, 0, 0, 0, INT64_MAX - 1};
    CHECK(table_status(fc_woff, none, none, 1, 4) == EF_ERR_ARGS, "w_off 2^63 - 2 accepted");
    CHECK(table_status(fc_boff, none, none, 1, 4) == EF_ERR_ARGS, "b_off 2^63 - 2 accepted");
    /* a conv whose weight count out_c * in_c * k * k overflows int64 (2^20 * 2^20 * k^2,
     * k = 2^31 - 1 on a padded side of 2^31 - 1) */
    const int32_t k31 = INT32_MAX, d20 = 0x100000;
    const ef_layer conv_k = {EF_CONV2D, d20, 1, 1, d20, 1, 1, k31, 1, 0x3FFFFFFF, 0, -1};
    CHECK(table_status(conv_k, none, none, 1, INT64_MAX) == EF_ERR_ARGS,
          "a conv with 2^102 weights accepted");
    /* a conv whose GEMM depth in_c * k * k = 2 * 2^30 passes int32 (scipy-openblas32 takes
     * int32 sizes: the depth was cast down), k = 2^15 on a 1x1 input padded by 2^15 */
    const ef_layer conv_deep = {EF_CONV2D, 2, 1, 1, 1, 1, 1, 0x8000, 0x10000, 0x8000, 0, -1};
    CHECK(table_status(conv_deep, none, none, 1, (int64_t)1 << 33) == EF_ERR_ARGS,
          "a conv with GEMM depth 2^31 accepted");
    /* a chunk past the kernels' (the pool's int32 argmax assumes at most EF_MAX_CHUNK) */
    {
        static ef_layer t1[1];
        ef_net net1 = {t1, 1, EF_LOSS_SOFTMAX_CE, 4, 0.0f};
        int64_t nf = 0, ni = 0;
        t1[0] = fc;
        CHECK(ef_workspace_size(&nf, &ni, &net1, 4, 4) == EF_OK, "a 1-layer table refused");
        CHECK(ef_workspace_size(&nf, &ni, &net1, INT64_MAX / 2, 4) == EF_ERR_ARGS,
              "chunk 2^62 accepted");
        CHECK(ef_workspace_size(&nf, &ni, &net1, 4, INT64_MAX / 2) == EF_ERR_ARGS,
              "n 2^62 (5n int64s of shuffle workspace) accepted");
    }
}

int main(void)
{
    test_gemm();
    test_vec();
    test_first_nonfinite();
    test_gradient_and_training();
    test_proximal_term();
    test_stop_word();
    test_shuffle();
    test_layer_table_checks();
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
