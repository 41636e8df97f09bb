/* Fixed-order CPU kernels for parity's aligned backend (float32 math; float32 or bfloat16 data).
 *
 * Every output element is computed by the same instruction sequence whatever the batch: loops
 * run over one query row / one row of a tensor at a time, reductions go in an order fixed by
 * the index (never by the batch size, the thread count or the memory address), and the file is
 * compiled with -ffp-contract=off so vector and scalar code round identically. Threads split
 * work by whole rows only, so the thread count never changes a value.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define F32_ID(v) (v)

/* Every thread of a parallel region computes in the default float mode (round to nearest, no
 * flush-to-zero) for the call and then gets its own back: MXCSR is per thread, and a caller's
 * flush-to-zero (PyTorch's set_flush_denormal) reached only the rows the calling thread took, so a
 * denormal's fate followed the thread count. FP_ENTER/FP_LEAVE open and close each region's body
 * (its `omp for` then needs no barrier of its own: the region's end is one). */
#if defined(__SSE__)
#include <xmmintrin.h>
#define FP_ENTER const unsigned int fp_mode_ = _mm_getcsr(); _mm_setcsr(0x1F80);
#define FP_LEAVE _mm_setcsr(fp_mode_);
#else
#define FP_ENTER
#define FP_LEAVE
#endif

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

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> bfloat16, round to nearest even (NaN inputs stay NaN), as PyTorch rounds. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (f != f) ? (uint16_t)((bits >> 16) | 0x40u) : (uint16_t)rounded;
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

/* Per-thread scratch buffers, grown on demand and kept (no allocation per call). */
static __thread float *scratch_buf;
static __thread size_t scratch_cap;
static float *scratch(size_t n) {
    if (scratch_cap < n) {
        free(scratch_buf);
        scratch_buf = (float *)malloc(sizeof(float) * n);
        scratch_cap = scratch_buf ? n : 0;
        if (!scratch_buf) abort(); /* out of memory: fail loudly rather than write through NULL */
    }
    return scratch_buf;
}

/* Causal GQA attention over a paged KV store, read in place. q [B, M, Hq, D] float32 (or bf16);
 * key blocks [NB, Hkv, D, bs] (transposed inside a block) and value blocks [NB, Hkv, bs, D],
 * float32 or bfloat16; tables [B, nblk] block ids; q_pos [B, M]; out [B, M, Hq, D] float32
 * (rows with q_pos < 0 are padding: zeros); D and bs multiples of 16. When lse is
 * not NULL it receives each row's natural log-sum-exp of the scaled scores, [B, M, Hq] (+inf on
 * padding rows), for the learner's backward pass.
 * Query (b, m, h) attends to keys n0..q_pos of KV head h / (Hq / Hkv), n0 = 0, or with a sliding
 * window W > 0 max(0, q_pos + 1 - W): its keys are a property of the query alone, so every
 * reduction (each score summed over d in order; the exact max; the denominator and the value sum
 * accumulated key by key) is the same whatever else is in the batch and wherever its keys are
 * stored. Scores are q.k * scale; with softcap > 0 they are capped to softcap * tanhf(score /
 * softcap) (Gemma 2), element by element.
 * The query heads that share a KV head are computed together, R at a time (R = 1, 2 or 4: the
 * group's sums are independent chains over one load of each key and value, which a lone row's
 * chain of dependent adds could not overlap); each head's sums run in the same order as alone.
 * Vectors are written with GCC's vector extensions, VL floats wide (16 where the compiler targets
 * AVX-512, 8 with AVX, else 4), so that the compiler neither splits nor scalarises them. */
#if defined(__AVX512F__)
#define VL 16      /* floats per vector register */
#define ACC_REGS 16 /* of the 32, for a group's value sums */
#elif defined(__AVX__)
#define VL 8
#define ACC_REGS 8
#else
#define VL 4
#define ACC_REGS 8
#endif
#define PV_CHUNK (8 * VL) /* outputs of a head summed at a time */
#define R_MAX(DIM) ((ACC_REGS * VL) / ((DIM) < PV_CHUNK ? (DIM) : PV_CHUNK))
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

/* VL consecutive keys or values from element i on, as float32 (a bf16 widened exactly). */
static inline __attribute__((always_inline)) vf kv_load(const void *p, int64_t i, const int bf16) {
    vf f;
    if (bf16) {
        vh h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)p + i, sizeof f);
    }
    return f;
}

/* max(sc[n0..n)) as the loop `peak = sc[j] > peak ? sc[j] : peak` from -inf gives it, VL lanes
 * at a time: the same value (a NaN is never taken, either way; of +0 and -0 either may be kept,
 * and no result depends on which: exp(s - peak) and peak + log(denom) are the same for both). */
static inline float row_max(const float *sc, int64_t n0, int64_t n) {
    float peak = -INFINITY;
    int64_t j = n0;
    if (n - n0 >= VL) {
        vf pv = {0};
        pv = pv - INFINITY;
        for (; j + VL <= n; j += VL) {
            vf x;
            memcpy(&x, sc + j, sizeof x);
            const vi take = x > pv;
            pv = (vf)(((vi)x & take) | ((vi)pv & ~take));
        }
        for (int l = 0; l < VL; l++) peak = pv[l] > peak ? pv[l] : peak;
    }
    for (; j < n; j++) peak = sc[j] > peak ? sc[j] : peak;
    return peak;
}

static inline __attribute__((always_inline)) void attend_group(
    const float *qr, const void *k, const void *v, const int bf16, const int64_t *tab, int64_t n0, int64_t n,
    int64_t bm, int64_t h0, const int R, const int64_t DIM, int64_t Hq, int64_t Hkv, int64_t kh, int64_t bs,
    float scale, float softcap, float *scores, int64_t stride, float *out, float *lse) {
    const int64_t nb = (n + bs - 1) / bs;
    for (int64_t i = n0 / bs; i < nb; i++) { /* scores: each summed over d in order */
        const int64_t kb = (tab[i] * Hkv + kh) * DIM * bs;
        for (int64_t j0 = 0; j0 < bs; j0 += LANES) {
            vf s[4][LANES / VL] = {{0}};
            for (int64_t d = 0; d < DIM; d++)
                for (int u = 0; u < LANES / VL; u++) {
                    const vf kd = kv_load(k, kb + d * bs + j0 + u * VL, bf16);
                    for (int r = 0; r < R; r++) s[r][u] = s[r][u] + qr[r * DIM + d] * kd;
                }
            for (int r = 0; r < R; r++)
                for (int u = 0; u < LANES / VL; u++) {
                    const vf x = s[r][u] * scale;
                    memcpy(scores + r * stride + i * bs + j0 + u * VL, &x, sizeof x);
                }
        }
    }
    if (softcap > 0.0f)
        for (int r = 0; r < R; r++)
            for (int64_t j = n0 / bs * bs; j < nb * bs; j++)
                scores[r * stride + j] = tanhf(scores[r * stride + j] / softcap) * softcap;
    float peak[4], denom[4];
    for (int r = 0; r < R; r++) {
        float *sc = scores + r * stride;
        peak[r] = row_max(sc, n0, n);
        for (int64_t j = n0; j < n; j++) sc[j] = fixed_exp(sc[j] - peak[r]);
        denom[r] = 0.0f;
    }
    for (int64_t j = n0; j < n; j++) /* each denominator key by key, in order */
        for (int r = 0; r < R; r++) denom[r] = denom[r] + scores[r * stride + j];
    for (int64_t dc = 0; dc < DIM; dc += PV_CHUNK) {
        const int64_t dn = (DIM - dc < PV_CHUNK ? DIM - dc : PV_CHUNK) / VL;
        vf acc[4][PV_CHUNK / VL] = {{0}};
        for (int64_t i = n0 / bs; i * bs < n; i++) { /* value sums key by key, in order */
            const int64_t vb = (tab[i] * Hkv + kh) * bs * DIM + dc;
            const int64_t j0 = i * bs > n0 ? i * bs : n0, j1 = (i + 1) * bs < n ? (i + 1) * bs : n;
            for (int64_t j = j0; j < j1; j++)
                for (int64_t c = 0; c < dn; c++) {
                    const vf vd = kv_load(v, vb + (j - i * bs) * DIM + c * VL, bf16);
                    for (int r = 0; r < R; r++) acc[r][c] = acc[r][c] + scores[r * stride + j] * vd;
                }
        }
        for (int r = 0; r < R; r++)
            for (int64_t c = 0; c < dn; c++) {
                const vf o = acc[r][c] / denom[r];
                memcpy(out + (bm * Hq + h0 + r) * DIM + dc + c * VL, &o, sizeof o);
            }
    }
    if (lse)
        for (int r = 0; r < R; r++) lse[bm * Hq + h0 + r] = peak[r] + logf(denom[r]);
}

#define GROUP(R_, DIM_)                                                                        \
    attend_group(qg + (h - kh * rep) * DIM_, k, v, bf16, tab, n0, n, bm, h, R_, DIM_, Hq, Hkv, kh, bs, scale,   \
                 softcap, scores, L, out, lse)
#define GROUPS(DIM_)                                                                           \
    for (; h + 4 <= h1 && R_MAX(DIM_) >= 4; h += 4) GROUP(4, DIM_);                            \
    for (; h + 2 <= h1 && R_MAX(DIM_) >= 2; h += 2) GROUP(2, DIM_);                            \
    for (; h < h1; h++) GROUP(1, DIM_);

static inline __attribute__((always_inline)) void attention_body(
    const void *q, const int q_bf16, const void *k, const void *v, const int bf16, const int64_t *tables,
    const int64_t *q_pos, float *out, float *lse, int64_t B, int64_t M, int64_t Hq, int64_t Hkv, int64_t D,
    int64_t nblk, int64_t bs,
    int64_t window, float scale, float softcap, int threads) {
    const int64_t rep = Hq / Hkv;
    const int64_t L = nblk * bs > 0 ? nblk * bs : LANES;
    #pragma omp parallel num_threads(threads)
    {
        FP_ENTER
        float *scores = scratch((size_t)L * 4 + (size_t)rep * D), *qbuf = scores + L * 4;
        #pragma omp for schedule(dynamic, 4) nowait
        for (int64_t row = 0; row < B * M * Hkv; row++) {
            const int64_t kh = row % Hkv, bm = row / Hkv, b = bm / M;
            int64_t n = q_pos[bm] + 1;
            if (n > nblk * bs) n = nblk * bs;
            if (n < 1) { /* a padding row: zeros out, never read; exp(s - inf) = 0 */
                memset(out + (bm * Hq + kh * rep) * D, 0, sizeof(float) * (size_t)(rep * D));
                if (lse)
                    for (int64_t r = 0; r < rep; r++) lse[bm * Hq + kh * rep + r] = INFINITY;
                continue;
            }
            const int64_t n0 = (window > 0 && n > window) ? n - window : 0;
            const int64_t *tab = tables + b * nblk;
            const float *qg = (const float *)q + (bm * Hq + kh * rep) * D;  /* the group's q rows */
            if (q_bf16) { /* widened once per group (exact) */
                const uint16_t *qh = (const uint16_t *)q + (bm * Hq + kh * rep) * D;
                for (int64_t i = 0; i < rep * D; i++) qbuf[i] = bf16_to_f32(qh[i]);
                qg = qbuf;
            }
            int64_t h = kh * rep;
            const int64_t h1 = h + rep;
            switch (D) {
            case 32: GROUPS(32) break;
            case 64: GROUPS(64) break;
            case 128: GROUPS(128) break;
            default: GROUPS(D)
            }
        }
        FP_LEAVE
    }
}

#define ATTENTION_ARGS(KV_T)                                                                   \
    const void *q, int q_bf16, const KV_T *k, const KV_T *v, const int64_t *tables,           \
        const int64_t *q_pos, float *out, float *lse, int64_t B, int64_t M, int64_t Hq, int64_t Hkv, int64_t D,      \
        int64_t nblk, int64_t bs, int64_t window, float scale, float softcap, int threads
#define ATTENTION_CALL(BF16)                                                                   \
    attention_body(q, q_bf16, k, v, BF16, tables, q_pos, out, lse, B, M, Hq, Hkv, D, nblk, bs, window, scale,  \
                   softcap, threads)

void parity_attention_f32(ATTENTION_ARGS(float)) { ATTENTION_CALL(0); }

void parity_attention_bf16(ATTENTION_ARGS(uint16_t)) { ATTENTION_CALL(1); }

/* Row log-sum-exp of z * inv_t for rows of length n, into lse[r] (z float32 or bfloat16). */
#define ROW_LSE_BODY(LOAD)                                                                     \
    _Pragma("omp parallel num_threads(threads)")                                             \
    { FP_ENTER _Pragma("omp for schedule(static) nowait")                                    \
    for (int64_t r = 0; r < rows; r++) {                                                     \
        const __typeof__(z[0]) *zr = z + r * n;                                              \
        float peak = -INFINITY;                                                              \
        for (int64_t i = 0; i < n; i++) {                                                    \
            const float s = LOAD(zr[i]) * inv_t;                                             \
            if (s > peak) peak = s;                                                          \
        }                                                                                    \
        float acc[LANES];                                                                    \
        for (int l = 0; l < LANES; l++) acc[l] = 0.0f;                                       \
        int64_t i = 0;                                                                       \
        for (; i + LANES <= n; i += LANES)                                                   \
            for (int l = 0; l < LANES; l++) acc[l] = acc[l] + fixed_exp(LOAD(zr[i + l]) * inv_t - peak); \
        for (int l = 0; i + l < n; l++) acc[l] = acc[l] + fixed_exp(LOAD(zr[i + l]) * inv_t - peak); \
        for (int w = LANES / 2; w > 0; w /= 2)                                               \
            for (int l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];                        \
        lse[r] = peak + logf(acc[0]);                                                        \
    }                                                                                        \
    FP_LEAVE }

void parity_row_lse(const float *z, float *lse, int64_t rows, int64_t n, float inv_t, int threads) {
    ROW_LSE_BODY(F32_ID)
}

void parity_row_lse_bf16(const uint16_t *z, float *lse, int64_t rows, int64_t n, float inv_t,
                         int threads) {
    ROW_LSE_BODY(bf16_to_f32)
}

/* Qwen3 RMSNorm over rows of length n: out = w * cast(x * inv), inv = 1/sqrt(mean(x^2)+eps),
 * the statistics in float32. Row (o, i) starts at x + o*so + i*si (so q/k heads can be read
 * straight out of a fused QKV output); out is contiguous [outer, inner, n]. */
#define RMS_BODY(LOAD, STORE, ROPE)                                                          \
    _Pragma("omp parallel num_threads(threads)")                                           \
    { FP_ENTER _Pragma("omp for schedule(static) nowait")                                  \
    for (int64_t row = 0; row < outer * inner; row++) {                                    \
        const int64_t o = row / inner, i = row % inner;                                    \
        const int64_t base = o * so + i * si;                                              \
        float acc[LANES];                                                                  \
        for (int l = 0; l < LANES; l++) acc[l] = 0.0f;                                     \
        int64_t k = 0;                                                                     \
        for (; k + LANES <= n; k += LANES)                                                 \
            for (int l = 0; l < LANES; l++) {                                              \
                const float xv = LOAD(x[base + k + l]);                                    \
                acc[l] = acc[l] + xv * xv;                                                 \
            }                                                                              \
        for (int l = 0; k + l < n; l++) {                                                  \
            const float xv = LOAD(x[base + k + l]);                                        \
            acc[l] = acc[l] + xv * xv;                                                     \
        }                                                                                  \
        for (int w2 = LANES / 2; w2 > 0; w2 /= 2)                                          \
            for (int l = 0; l < w2; l++) acc[l] = acc[l] + acc[l + w2];                    \
        const float inv = 1.0f / sqrtf(acc[0] / (float)n + eps);                           \
        for (int64_t c = 0; c < n; c++) {                                                  \
            const float t = LOAD(STORE(LOAD(x[base + c]) * inv));                          \
            out[row * n + c] = STORE(LOAD(w[c]) * t);                                      \
        }                                                                                  \
        if (ROPE) { /* rotate halves: y*cos + rotate_half(y)*sin, in float32 */            \
            const float *cr = cos_t + o * n, *sr = sin_t + o * n;                          \
            const int64_t half = n / 2;                                                    \
            float y[512];                                                                  \
            for (int64_t c = 0; c < n; c++) y[c] = LOAD(out[row * n + c]);                 \
            for (int64_t c = 0; c < half; c++)                                             \
                out[row * n + c] = STORE(y[c] * cr[c] + (-y[c + half]) * sr[c]);           \
            for (int64_t c = half; c < n; c++)                                             \
                out[row * n + c] = STORE(y[c] * cr[c] + y[c - half] * sr[c]);              \
        }                                                                                  \
    }                                                                                      \
    FP_LEAVE }

/* With cos_t/sin_t ([outer, n] float32 rows, per token) the normalised rows are also rotated
 * (RoPE on q/k heads: row (o, i) is head i of token o); n <= 512 then. */
void parity_rms_norm_f32(const float *x, const float *w, float *out, int64_t outer, int64_t inner,
                         int64_t n, int64_t so, int64_t si, float eps, const float *cos_t,
                         const float *sin_t, int threads) {
    RMS_BODY(F32_ID, F32_ID, cos_t != 0)
}

void parity_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t outer,
                          int64_t inner, int64_t n, int64_t so, int64_t si, float eps,
                          const float *cos_t, const float *sin_t, int threads) {
    RMS_BODY(bf16_to_f32, f32_to_bf16, cos_t != 0)
}

/* SwiGLU silu(g) * u in float32, one rounding to the output type; g and u are [rows, cols]
 * with row stride ld (both halves of a fused gate/up output), out is contiguous. */
void parity_silu_mul_f32(const float *g, const float *u, float *out, int64_t rows, int64_t cols,
                         int64_t ld, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        FP_ENTER
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) {
                const float x = g[r * ld + c];
                out[r * cols + c] = x / (1.0f + fixed_exp(-x)) * u[r * ld + c];
            }
        FP_LEAVE
    }
}

void parity_silu_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t rows,
                          int64_t cols, int64_t ld, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        FP_ENTER
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) {
                const float x = bf16_to_f32(g[r * ld + c]);
                out[r * cols + c] = f32_to_bf16(x / (1.0f + fixed_exp(-x)) * bf16_to_f32(u[r * ld + c]));
            }
        FP_LEAVE
    }
}

/* ---------------------------------------------------------------------------------------------
 * Backward passes for the learner. Gradients only need to be correct, not batch-invariant, but
 * one pass over the data instead of autograd's many is most of the aligned learner's speed.
 * Threads still split by whole rows (static schedule), so a run repeats bit for bit. */

/* SwiGLU backward: for act = silu(g) * u with g, u the halves of one [rows, 2 * cols] tensor
 * (row stride ld), grad [rows, cols] contiguous -> grad_gu [rows, 2 * cols] contiguous:
 * d g = grad * u * s * (1 + g * (1 - s)), d u = grad * g * s, s = sigmoid(g), in float32. */
#define SWIGLU_BACKWARD_BODY(LOAD, STORE)                                                     \
    _Pragma("omp parallel num_threads(threads)")                                            \
    { FP_ENTER _Pragma("omp for schedule(static) nowait")                                   \
    for (int64_t r = 0; r < rows; r++)                                                      \
        for (int64_t c = 0; c < cols; c++) {                                                \
            const float x = LOAD(g[r * ld + c]), up = LOAD(u[r * ld + c]);                  \
            const float dy = LOAD(grad[r * cols + c]);                                      \
            const float s = 1.0f / (1.0f + fixed_exp(-x));                                  \
            out[r * 2 * cols + c] = STORE(dy * up * (s * (1.0f + x * (1.0f - s))));         \
            out[r * 2 * cols + cols + c] = STORE(dy * (x * s));                             \
        }                                                                                   \
    FP_LEAVE }

void parity_swiglu_backward_f32(const float *g, const float *u, const float *grad, float *out,
                                int64_t rows, int64_t cols, int64_t ld, int threads) {
    SWIGLU_BACKWARD_BODY(F32_ID, F32_ID)
}

void parity_swiglu_backward_bf16(const uint16_t *g, const uint16_t *u, const uint16_t *grad,
                                 uint16_t *out, int64_t rows, int64_t cols, int64_t ld,
                                 int threads) {
    SWIGLU_BACKWARD_BODY(bf16_to_f32, f32_to_bf16)
}

/* RMSNorm backward for y = w * cast(x * inv), rows laid out as in the forward (row (o, i) at
 * x + o*so + i*si, length n); grad [outer * inner, n] contiguous -> grad_x contiguous like grad,
 * and grad_w_parts [threads, n] float32 (one partial sum per thread, summed by the caller):
 * d x = inv * (gw - xhat * mean(gw * xhat)), gw = grad * w, xhat = x * inv; d w = sum grad * xhat. */
#define RMS_BACKWARD_BODY(LOAD, STORE)                                                        \
    _Pragma("omp parallel num_threads(threads)")                                            \
    {                                                                                         \
        FP_ENTER                                                                              \
        float *gw_acc = grad_w_parts + (int64_t)omp_get_thread_num() * n;                     \
        _Pragma("omp for schedule(static) nowait")                                          \
        for (int64_t row = 0; row < outer * inner; row++) {                                 \
            const int64_t o = row / inner, i = row % inner;                                 \
            const int64_t base = o * so + i * si;                                           \
            float sq = 0.0f, dot = 0.0f;                                                    \
            for (int64_t c = 0; c < n; c++) {                                               \
                const float xv = LOAD(x[base + c]);                                         \
                sq = sq + xv * xv;                                                          \
            }                                                                               \
            const float inv = 1.0f / sqrtf(sq / (float)n + eps);                            \
            for (int64_t c = 0; c < n; c++) {                                               \
                const float xh = LOAD(x[base + c]) * inv, dy = LOAD(grad[row * n + c]);     \
                dot = dot + dy * LOAD(w[c]) * xh;                                           \
                gw_acc[c] = gw_acc[c] + dy * xh;                                            \
            }                                                                               \
            const float mean = dot / (float)n;                                              \
            for (int64_t c = 0; c < n; c++) {                                               \
                const float xh = LOAD(x[base + c]) * inv, dy = LOAD(grad[row * n + c]);     \
                grad_x[row * n + c] = STORE(inv * (dy * LOAD(w[c]) - xh * mean));           \
            }                                                                               \
        }                                                                                   \
        FP_LEAVE                                                                            \
    }

void parity_rms_norm_backward_f32(const float *x, const float *w, const float *grad, float *grad_x,
                                  float *grad_w_parts, int64_t outer, int64_t inner, int64_t n,
                                  int64_t so, int64_t si, float eps, int threads) {
    RMS_BACKWARD_BODY(F32_ID, F32_ID)
}

void parity_rms_norm_backward_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *grad,
                                   uint16_t *grad_x, float *grad_w_parts, int64_t outer,
                                   int64_t inner, int64_t n, int64_t so, int64_t si, float eps,
                                   int threads) {
    RMS_BACKWARD_BODY(bf16_to_f32, f32_to_bf16)
}

/* Backward of lp[r] = z[r, t_r] * inv_t - lse[r] (the learner's token log-probs): for the output
 * gradient grad [rows] float32, d z[r, i] = grad[r] * inv_t * ([i == t_r] - exp(z[r, i] * inv_t -
 * lse[r])), written once per element into out [rows, n] (z's dtype). */
#define TOKEN_LP_BACKWARD_BODY(LOAD, STORE)                                                   \
    _Pragma("omp parallel num_threads(threads)")                                            \
    { FP_ENTER _Pragma("omp for schedule(static) nowait")                                   \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        const float g = grad[r] * inv_t, m = lse[r];                                        \
        const int64_t t = tokens[r];                                                        \
        for (int64_t i = 0; i < n; i++) {                                                   \
            const float p = fixed_exp(LOAD(z[r * n + i]) * inv_t - m);                      \
            out[r * n + i] = STORE(((i == t) ? 1.0f - p : -p) * g);                         \
        }                                                                                   \
    }                                                                                       \
    FP_LEAVE }

void parity_token_lp_backward_f32(const float *z, const int64_t *tokens, const float *lse,
                                  const float *grad, float *out, int64_t rows, int64_t n,
                                  float inv_t, int threads) {
    TOKEN_LP_BACKWARD_BODY(F32_ID, F32_ID)
}

void parity_token_lp_backward_bf16(const uint16_t *z, const int64_t *tokens, const float *lse,
                                   const float *grad, uint16_t *out, int64_t rows, int64_t n,
                                   float inv_t, int threads) {
    TOKEN_LP_BACKWARD_BODY(bf16_to_f32, f32_to_bf16)
}

/* Matrix-vector products in the order of the BLAS's GEMM (the engine's decode at 1-8 rows).
 *
 * y[r, n] = bias[n] (or nothing) + B_1 + B_2 + ..., left to right, where B_j is a chain of fused
 * multiply-adds from zero over the j-th block of `kc` input positions (the last block holds the
 * rest), k ascending: the per-element order that MKL's float32 GEMM of 4 or more rows follows on
 * the machines probed (`gemm._gemv_order_holds` checks it at first use for each K, and the
 * GEMM is used instead where it does not hold). x [m, K], w [N, K] and y [m, N] are row-major;
 * each thread takes whole 16-output blocks, so the thread count never changes a value. */
#if defined(__AVX512F__)
#include <immintrin.h>

/* Columns c0..c0+15 of 16 rows (r[j] = w + (n0 + j) * K) as t[i] = w[n0..n0+15, c0 + i];
 * only the first `cols` columns are read (masked loads). */
static inline void load_tile(const float *w, int64_t k, int64_t n0, int64_t c0, int cols,
                             __m512 t[16]) {
    const __mmask16 mask = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1u);
    __m512 r[16], u[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_maskz_loadu_ps(mask, w + (n0 + j) * k + c0);
    /* per 128-bit lane l (columns 4l..4l+3): interleave row pairs, then row quads, so that
     * u[4g + c] holds column 4l + c of rows 4g..4g+3 */
    for (int g = 0; g < 4; g++) {
        const __m512 *q = r + 4 * g;
        const __m512d lo01 = _mm512_castps_pd(_mm512_unpacklo_ps(q[0], q[1]));
        const __m512d hi01 = _mm512_castps_pd(_mm512_unpackhi_ps(q[0], q[1]));
        const __m512d lo23 = _mm512_castps_pd(_mm512_unpacklo_ps(q[2], q[3]));
        const __m512d hi23 = _mm512_castps_pd(_mm512_unpackhi_ps(q[2], q[3]));
        u[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo01, lo23));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo01, lo23));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi01, hi23));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi01, hi23));
    }
    /* then move 128-bit lanes: r[c] = lanes (0, 2) of row groups (0, 1), r[c + 4] = lanes
     * (1, 3) (and r[8 + c], r[12 + c] for groups 2, 3); t[c] gathers lane 0 of all four */
    for (int c = 0; c < 4; c++) {
        r[c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
        r[4 + c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        r[8 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    }
    for (int j = 0; j < 8; j++) {
        t[j] = _mm512_shuffle_f32x4(r[j], r[8 + j], 0x88);
        t[8 + j] = _mm512_shuffle_f32x4(r[j], r[8 + j], 0xDD);
    }
}
#endif

/* Outputs j0..j0+cnt-1 (cnt <= 8) without wide vectors: the same per-element order, `cnt`
 * independent chains side by side so that the FMA latency is hidden. W_LOAD reads one weight
 * as float32 (bf16 widened exactly). */
#define GEMV_COLUMNS(name, wtype, W_LOAD)                                                          \
static void name(const float *x, const wtype *w, const float *bias, float *y, int64_t m,          \
                 int64_t k, int64_t n, int64_t kc, int64_t j0, int cnt) {                         \
    for (int64_t r = 0; r < m; r++) {                                                            \
        const float *xr = x + r * k;                                                             \
        float total[8], acc[8];                                                                  \
        for (int q = 0; q < cnt; q++) total[q] = bias ? bias[j0 + q] : 0.0f;                     \
        for (int64_t b0 = 0; b0 < k; b0 += kc) {                                                 \
            const int64_t b1 = b0 + kc < k ? b0 + kc : k;                                        \
            for (int q = 0; q < cnt; q++) acc[q] = 0.0f;                                         \
            for (int64_t c = b0; c < b1; c++) {                                                  \
                const float xv = xr[c];                                                          \
                for (int q = 0; q < cnt; q++) acc[q] = fmaf(W_LOAD(w[(j0 + q) * k + c]), xv, acc[q]); \
            }                                                                                    \
            for (int q = 0; q < cnt; q++) total[q] = (b0 == 0 && !bias) ? acc[q] : total[q] + acc[q]; \
        }                                                                                        \
        for (int q = 0; q < cnt; q++) y[r * n + j0 + q] = total[q];                              \
    }                                                                                            \
}
GEMV_COLUMNS(gemv_columns, float, F32_ID)
GEMV_COLUMNS(gemv_columns_bf16w, uint16_t, bf16_to_f32)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Row j's weights at columns c0..c0+cols-1 (cols <= 8, the rest zero) as 8 float32 lanes. */
static inline __m256 load_row8(const void *w, int bf16, int64_t at, int cols) {
    if (cols == 8) {
        if (!bf16) return _mm256_loadu_ps((const float *)w + at);
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    float buf[8] = {0};
    for (int i = 0; i < cols; i++)
        buf[i] = bf16 ? bf16_to_f32(((const uint16_t *)w)[at + i]) : ((const float *)w)[at + i];
    return _mm256_loadu_ps(buf);
}

/* Outputs n0..n0 + 8 * NB - 1 of all m rows with 8-wide vectors: t[i] holds column c0 + i of 8
 * weight rows (an 8 x 8 transpose), so lane q is its output's own chain, in the scalar order.
 * Inlined with constant m, bf16 and NB (blocks side by side: more chains in flight at m = 1), so
 * the accumulators live in registers. */
static inline __attribute__((always_inline)) void gemv_tile8(
        const float *x, const void *w, const int bf16, const float *bias, float *y, const int64_t m,
        int64_t k, int64_t n, int64_t kc, int64_t n0, const int NB) {
    __m256 acc[2][8];
    for (int64_t b0 = 0; b0 < k; b0 += kc) {
        const int64_t b1 = b0 + kc < k ? b0 + kc : k;
        for (int nb = 0; nb < NB; nb++)
            for (int64_t i = 0; i < m; i++) acc[nb][i] = _mm256_setzero_ps();
        for (int64_t c0 = b0; c0 < b1; c0 += 8) {
            const int cols = b1 - c0 < 8 ? (int)(b1 - c0) : 8;
            for (int nb = 0; nb < NB; nb++) {
                __m256 r[8], u[4], v[8], t[8];
                for (int j = 0; j < 8; j++) r[j] = load_row8(w, bf16, (n0 + 8 * nb + j) * k + c0, cols);
                for (int g = 0; g < 2; g++) {  /* rows 4g..4g+3: v[4g + c] = columns c, c + 4 */
                    const __m256 *q = r + 4 * g;
                    u[0] = _mm256_unpacklo_ps(q[0], q[1]);
                    u[1] = _mm256_unpackhi_ps(q[0], q[1]);
                    u[2] = _mm256_unpacklo_ps(q[2], q[3]);
                    u[3] = _mm256_unpackhi_ps(q[2], q[3]);
                    v[4 * g + 0] = _mm256_shuffle_ps(u[0], u[2], 0x44);
                    v[4 * g + 1] = _mm256_shuffle_ps(u[0], u[2], 0xEE);
                    v[4 * g + 2] = _mm256_shuffle_ps(u[1], u[3], 0x44);
                    v[4 * g + 3] = _mm256_shuffle_ps(u[1], u[3], 0xEE);
                }
                for (int c = 0; c < 4; c++) {
                    t[c] = _mm256_permute2f128_ps(v[c], v[4 + c], 0x20);
                    t[c + 4] = _mm256_permute2f128_ps(v[c], v[4 + c], 0x31);
                }
                for (int i = 0; i < cols; i++)
                    for (int64_t row = 0; row < m; row++)
                        acc[nb][row] = _mm256_fmadd_ps(t[i], _mm256_set1_ps(x[row * k + c0 + i]), acc[nb][row]);
            }
        }
        for (int nb = 0; nb < NB; nb++)
            for (int64_t row = 0; row < m; row++) {  /* the running total lives in y */
                float *yr = y + row * n + n0 + 8 * nb;
                __m256 total;
                if (b0 > 0) total = _mm256_add_ps(_mm256_loadu_ps(yr), acc[nb][row]);
                else total = bias ? _mm256_add_ps(_mm256_loadu_ps(bias + n0 + 8 * nb), acc[nb][row])
                                  : acc[nb][row];
                _mm256_storeu_ps(yr, total);
            }
    }
}

#define GEMV_TILE_CASES(BF16, NB)                                                                  \
    switch (m) {                                                                                   \
        case 1: gemv_tile8(x, w, BF16, bias, y, 1, k, n, kc, n0, NB); break;                       \
        case 2: gemv_tile8(x, w, BF16, bias, y, 2, k, n, kc, n0, NB); break;                       \
        case 3: gemv_tile8(x, w, BF16, bias, y, 3, k, n, kc, n0, NB); break;                       \
        case 4: gemv_tile8(x, w, BF16, bias, y, 4, k, n, kc, n0, NB); break;                       \
        case 5: gemv_tile8(x, w, BF16, bias, y, 5, k, n, kc, n0, NB); break;                       \
        case 6: gemv_tile8(x, w, BF16, bias, y, 6, k, n, kc, n0, NB); break;                       \
        case 7: gemv_tile8(x, w, BF16, bias, y, 7, k, n, kc, n0, NB); break;                       \
        case 8: gemv_tile8(x, w, BF16, bias, y, 8, k, n, kc, n0, NB); break;                       \
        default: break;  /* the entry points take 1-8 rows */                                      \
    }

/* `nb` (1 or 2) 8-output blocks from n0, specialised by weight type, block count and rows. */
static void gemv_block8(const float *x, const void *w, int bf16, const float *bias, float *y,
                        int64_t m, int64_t k, int64_t n, int64_t kc, int64_t n0, int nb) {
    if (bf16 && nb == 2) { GEMV_TILE_CASES(1, 2) }
    else if (bf16) { GEMV_TILE_CASES(1, 1) }
    else if (nb == 2) { GEMV_TILE_CASES(0, 2) }
    else { GEMV_TILE_CASES(0, 1) }
}
#endif

#if defined(__AVX512F__)
/* Outputs n0..n0+15 of float32 weights with 16-wide vectors (t[i] = column c0 + i of 16 rows). */
static void gemv_block16(const float *x, const float *w, const float *bias, float *y, int64_t m,
                         int64_t k, int64_t n, int64_t kc, int64_t n0) {
    __m512 acc[8], t[16];
    for (int64_t b0 = 0; b0 < k; b0 += kc) {
        const int64_t b1 = b0 + kc < k ? b0 + kc : k;
        for (int64_t r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t c0 = b0; c0 < b1; c0 += 16) {
            const int cols = b1 - c0 < 16 ? (int)(b1 - c0) : 16;
            load_tile(w, k, n0, c0, cols, t);
            for (int i = 0; i < cols; i++)
                for (int64_t r = 0; r < m; r++)
                    acc[r] = _mm512_fmadd_ps(t[i], _mm512_set1_ps(x[r * k + c0 + i]), acc[r]);
        }
        for (int64_t r = 0; r < m; r++) {  /* the running total lives in y */
            float *yr = y + r * n + n0;
            __m512 total;
            if (b0 > 0) total = _mm512_add_ps(_mm512_loadu_ps(yr), acc[r]);
            else total = bias ? _mm512_add_ps(_mm512_loadu_ps(bias + n0), acc[r]) : acc[r];
            _mm512_storeu_ps(yr, total);
        }
    }
}
#endif

/* One 16-output block (or the narrower last one) of either weight type, 8 outputs at a time. */
static void gemv_block(const float *x, const void *w, int bf16, const float *bias, float *y,
                       int64_t m, int64_t k, int64_t n, int64_t kc, int64_t n0, int64_t width) {
#if defined(__AVX512F__)
    if (!bf16 && width == 16) {
        gemv_block16(x, (const float *)w, bias, y, m, k, n, kc, n0);
        return;
    }
#endif
    int64_t j = n0;
#if defined(__AVX2__) && defined(__FMA__)
    if (width == 16 && m <= 2) {  /* two blocks side by side: enough chains in flight */
        gemv_block8(x, w, bf16, bias, y, m, k, n, kc, j, 2);
        j += 16;
    }
    for (; j + 8 <= n0 + width; j += 8) gemv_block8(x, w, bf16, bias, y, m, k, n, kc, j, 1);
#endif
    for (; j < n0 + width; j += 8) {
        const int cnt = n0 + width - j < 8 ? (int)(n0 + width - j) : 8;
        if (bf16) gemv_columns_bf16w(x, (const uint16_t *)w, bias, y, m, k, n, kc, j, cnt);
        else gemv_columns(x, (const float *)w, bias, y, m, k, n, kc, j, cnt);
    }
}

/* Whether there is nothing to multiply: rows outside 1-8 (nothing written; the caller gives 1-8)
 * or K = 0, where each output is its bias (or 0). */
static int gemv_degenerate(const float *bias, float *y, int64_t m, int64_t k, int64_t n) {
    if (m < 1 || m > 8) return 1;
    if (k > 0) return 0;
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++) y[r * n + j] = bias ? bias[j] : 0.0f;
    return 1;
}

static void gemv_run(const float *x, const void *w, int bf16, const float *bias, float *y, int64_t m,
                     int64_t k, int64_t n, int64_t kc, int threads) {
    if (gemv_degenerate(bias, y, m, k, n)) return;
    const int64_t nvec = n / 16;
    #pragma omp parallel num_threads(threads)
    {
        FP_ENTER
        #pragma omp for schedule(static) nowait
        for (int64_t blk = 0; blk < nvec + 1; blk++) {
            const int64_t n0 = blk * 16, width = blk < nvec ? 16 : n - nvec * 16;
            if (width > 0) gemv_block(x, w, bf16, bias, y, m, k, n, kc, n0, width);
        }
        FP_LEAVE
    }
}

void parity_gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t m,
                     int64_t k, int64_t n, int64_t kc, int threads) {
    gemv_run(x, w, 0, bias, y, m, k, n, kc, threads);
}

/* The same products with bfloat16 weights widened as they are read (exactly): the bits of
 * parity_gemv_f32 on the float32 copy of w, without making that copy (CPUs without a bf16 GEMM,
 * where a bf16 product runs as float32: `ops.common.gemm_linear`). */
void parity_gemv_bf16w(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m,
                       int64_t k, int64_t n, int64_t kc, int threads) {
    gemv_run(x, w, 1, bias, y, m, k, n, kc, threads);
}

/* A mixture-of-experts layer's routed experts, in one call, for the experts that got 1-`max_rows`
 * slots (decode: `ops/moe.py`). The slots (token i's rank j is slot i * topk + j) come sorted by
 * expert: order[offs[e] .. offs[e + 1]) are expert e's, ascending. Per such expert, the chain
 * `gemm.linear` (gate/up) -> `silu_mul` -> `gemm.linear` (down) of the per-expert loop, each
 * product by gemv_block (the matrix-vector kernel, per element its fixed K order, whoever computes
 * it) and the activation by parity_silu_mul_f32's expression, so every value has the loop's bits.
 * The scratch rows xs/gu/act/ys hold the served experts' slots one after another, in expert order
 * (the caller sizes them: the sum of those experts' slot counts); out[slot] receives the expert's
 * output row; the other experts' slots are left as they are. Returns the number of experts served,
 * -1 without memory for two lists of n_exp entries. */
int64_t parity_moe_experts_f32(const float *x, const int64_t *order, const int64_t *offs, int64_t n_exp,
                               int64_t topk, const float *w1, const float *w2, int64_t h, int64_t inter,
                               int64_t kc1, int64_t kc2, int64_t max_rows, float *xs, float *gu,
                               float *act, float *ys, float *out, int threads) {
    int64_t *sel = (int64_t *)malloc((size_t)(2 * n_exp + 1) * sizeof(int64_t));
    if (!sel) return -1;
    int64_t *at = sel + n_exp;  /* at[s]: the first scratch row of the s-th served expert */
    int64_t g = 0, rows = 0;
    for (int64_t e = 0; e < n_exp; e++) {
        const int64_t m = offs[e + 1] - offs[e];
        if (m >= 1 && m <= max_rows && m <= 8) {
            sel[g] = e;
            at[g++] = rows;
            rows += m;
        }
    }
    const int64_t n1 = 2 * inter, nb1 = n1 / 16 + 1, nb2 = h / 16 + 1;
    #pragma omp parallel num_threads(threads)
    {
        FP_ENTER
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < g; s++)
            for (int64_t p = offs[sel[s]]; p < offs[sel[s] + 1]; p++)
                memcpy(xs + (at[s] + p - offs[sel[s]]) * h, x + (order[p] / topk) * h,
                       (size_t)h * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < g * nb1; item++) {
            const int64_t s = item / nb1, e = sel[s], n0 = (item % nb1) * 16;
            const int64_t width = n1 - n0 < 16 ? n1 - n0 : 16;
            if (width > 0)
                gemv_block(xs + at[s] * h, w1 + e * n1 * h, 0, 0, gu + at[s] * n1, offs[e + 1] - offs[e], h,
                           n1, kc1, n0, width);
        }
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < rows; q++)
            for (int64_t c = 0; c < inter; c++) {
                const float v = gu[q * n1 + c];
                act[q * inter + c] = v / (1.0f + fixed_exp(-v)) * gu[q * n1 + inter + c];
            }
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < g * nb2; item++) {
            const int64_t s = item / nb2, e = sel[s], n0 = (item % nb2) * 16;
            const int64_t width = h - n0 < 16 ? h - n0 : 16;
            if (width > 0)
                gemv_block(act + at[s] * inter, w2 + e * h * inter, 0, 0, ys + at[s] * h, offs[e + 1] - offs[e],
                           inter, h, kc2, n0, width);
        }
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < g; s++)
            for (int64_t p = offs[sel[s]]; p < offs[sel[s] + 1]; p++)
                memcpy(out + order[p] * h, ys + (at[s] + p - offs[sel[s]]) * h, (size_t)h * sizeof(float));
        FP_LEAVE
    }
    free(sel);
    return g;
}
