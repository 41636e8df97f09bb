/* Fixed-order CPU kernels for parity's aligned backend (float32 in, float32 out).
 *
 * Every output element is computed by the same instruction sequence whatever the batch: loops
 * run over one query row / one row of a tensor at a time, reductions go in an order fixed by
 * the index (never by the batch size, the thread count or the memory address), and the file is
 * compiled with -ffp-contract=off so vector and scalar code round identically. Threads split
 * work by whole rows only, so the thread count never changes a value.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* exp(x): Cody-Waite reduction and a degree-6 polynomial, branch-free so loops vectorise.
 * Inputs below -87 give exactly 0; inputs above 88 are clamped. */
static inline float fixed_exp(float x) {
    float xc = x < -87.0f ? -87.0f : x;
    xc = xc > 88.0f ? 88.0f : xc;
    const float log2e = 1.44269504088896341f;
    const int32_t ni = (int32_t)(xc * log2e + 128.5f) - 128;  /* floor(x log2 e + 0.5) */
    const float n = (float)ni;
    float r = xc - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (ni + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x < -87.0f ? 0.0f : p * two_n;
}

/* sum of a[0..n) * b[0..n) in LANES interleaved partial sums, combined by a fixed tree */
static inline float fixed_dot(const float *a, const float *b, int n) {
    float acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = 0.0f;
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = acc[l] + a[i + l] * b[i + l];
    for (int l = 0; i + l < n; l++) acc[l] = acc[l] + a[i + l] * b[i + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];
    return acc[0];
}

/* Causal GQA attention. q [B, M, Hq, D], k/v [B, L, Hkv, D], q_pos [B, M], out [B, M, Hq, D].
 * Query (b, m, h) attends to keys 0..q_pos[b, m] of KV head h / (Hq / Hkv). For each key the
 * score is the dot product summed over d = 0..D-1 in order; the softmax max is exact; the
 * denominator and the value sum are accumulated key by key in key order. Work is split into
 * tasks of (b, KV head, QCHUNK queries); a task copies its keys transposed once so that scores
 * of many keys are computed side by side (each key's sum still runs over d in order). */
#define QCHUNK 16

/* One query row against its n visible keys (kt: keys transposed [D][ldk], v rows of stride vs).
 * Inlined with D a compile-time constant for the common head sizes, so accumulators stay in
 * registers; the arithmetic (and so every bit) is the same as the generic instantiation. */
static inline void attend_row(const float *qr, const float *kt, int64_t ldk, const float *v,
                              int64_t vs, int64_t n, const int64_t D, float scale,
                              float *scores, float *o) {
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        float s[LANES];
        for (int l = 0; l < LANES; l++) s[l] = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            const float qd = qr[d];
            const float *row = kt + d * ldk + j0;
            for (int l = 0; l < LANES; l++) s[l] = s[l] + qd * row[l];
        }
        for (int l = 0; l < LANES; l++) scores[j0 + l] = s[l] * scale;
    }
    float peak = -INFINITY;
    for (int64_t j = 0; j < n; j++) peak = scores[j] > peak ? scores[j] : peak;
    for (int64_t j = 0; j < n; j++) scores[j] = fixed_exp(scores[j] - peak);
    float denom = 0.0f;
    for (int64_t j = 0; j < n; j++) denom = denom + scores[j];
    for (int64_t d0 = 0; d0 < D; d0 += LANES) {  /* one vector of head dims at a time */
        float acc[LANES];
        for (int l = 0; l < LANES; l++) acc[l] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float p = scores[j];
            const float *vr = v + j * vs + d0;
            for (int l = 0; l < LANES; l++) acc[l] = acc[l] + p * vr[l];
        }
        for (int l = 0; l < LANES; l++) o[d0 + l] = acc[l] / denom;
    }
}

/* Causal GQA attention. q [B, M, Hq, D], k/v [B, L, Hkv, D], q_pos [B, M], out [B, M, Hq, D];
 * D a multiple of 16. Query (b, m, h) attends to keys 0..q_pos[b, m] of KV head h / (Hq / Hkv): its n =
 * q_pos + 1 keys are a property of the query alone, so every reduction below (each score summed
 * over d in order; the exact max; the denominator and the value sum accumulated key by key) is
 * the same whatever else is in the batch. Tasks are (b, KV head, QCHUNK queries); a task copies
 * its keys transposed once so that 16 keys' scores are computed side by side. */
void parity_attention(const float *q, const float *k, const float *v, const int64_t *q_pos,
                      float *out, int64_t B, int64_t M, int64_t Hq, int64_t Hkv, int64_t D,
                      int64_t L, float scale, int threads) {
    const int64_t rep = Hq / Hkv;
    const int64_t nchunk = (M + QCHUNK - 1) / QCHUNK;
    const int64_t tasks = B * Hkv * nchunk;
    const int64_t ldk = (L + LANES - 1) / LANES * LANES;
#pragma omp parallel num_threads(threads)
    {
        float *kt = (float *)calloc((size_t)(ldk > 0 ? ldk : LANES) * D, sizeof(float));
        float *scores = (float *)malloc(sizeof(float) * (ldk > 0 ? ldk : LANES));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t c = task % nchunk, bk = task / nchunk;
            const int64_t kh = bk % Hkv, b = bk / Hkv;
            const int64_t m0 = c * QCHUNK, m1 = m0 + QCHUNK < M ? m0 + QCHUNK : M;
            int64_t nmax = 1;
            for (int64_t m = m0; m < m1; m++) {
                const int64_t n = q_pos[b * M + m] + 1;
                if (n > nmax) nmax = n;
            }
            if (nmax > L) nmax = L;
            for (int64_t j = 0; j < nmax; j++) {
                const float *kr = k + ((b * L + j) * Hkv + kh) * D;
                for (int64_t d = 0; d < D; d++) kt[d * ldk + j] = kr[d];
            }
            const float *vb = v + (b * L * Hkv + kh) * D;
            for (int64_t m = m0; m < m1; m++) {
                int64_t n = q_pos[b * M + m] + 1;
                if (n > L) n = L;
                if (n < 1) n = 1;
                for (int64_t r = 0; r < rep; r++) {
                    const int64_t h = kh * rep + r;
                    const float *qr = q + ((b * M + m) * Hq + h) * D;
                    float *o = out + ((b * M + m) * Hq + h) * D;
                    switch (D) {
                    case 32: attend_row(qr, kt, ldk, vb, Hkv * D, n, 32, scale, scores, o); break;
                    case 64: attend_row(qr, kt, ldk, vb, Hkv * D, n, 64, scale, scores, o); break;
                    case 128: attend_row(qr, kt, ldk, vb, Hkv * D, n, 128, scale, scores, o); break;
                    default: attend_row(qr, kt, ldk, vb, Hkv * D, n, D, scale, scores, o);
                    }
                }
            }
        }
        free(kt);
        free(scores);
    }
}

/* RMSNorm statistics: inv[r] = 1 / sqrt(mean(x[r]^2) + eps) for rows of length n. */
void parity_rms_inv(const float *x, float *inv, int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        const float ms = fixed_dot(xr, xr, (int)n) / (float)n;
        inv[r] = 1.0f / sqrtf(ms + eps);
    }
}

/* Row log-sum-exp of z / temperature for rows of length n: lse[r] and the row max peak[r]. */
void parity_row_lse(const float *z, float *lse, int64_t rows, int64_t n, float inv_t, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *zr = z + r * n;
        float peak = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            const float s = zr[i] * inv_t;
            if (s > peak) peak = s;
        }
        float acc[LANES];
        for (int l = 0; l < LANES; l++) acc[l] = 0.0f;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int l = 0; l < LANES; l++) acc[l] = acc[l] + fixed_exp(zr[i + l] * inv_t - peak);
        for (int l = 0; i + l < n; l++) acc[l] = acc[l] + fixed_exp(zr[i + l] * inv_t - peak);
        for (int w = LANES / 2; w > 0; w /= 2)
            for (int l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];
        lse[r] = peak + logf(acc[0]);
    }
}

/* silu(g) * u, element by element (same arithmetic for every element). */
void parity_silu_mul(const float *g, const float *u, float *out, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        out[i] = x / (1.0f + fixed_exp(-x)) * u[i];
    }
}
