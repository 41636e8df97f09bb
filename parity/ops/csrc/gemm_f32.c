/* A float32 GEMM in the matrix-vector kernel's order, for strict products of any row count.
 *
 * y[m, n] = bias[n] (or nothing) + B_1 + B_2 + ..., left to right, where B_j is a chain of fused
 * multiply-adds from zero over the j-th block of `kc` input positions (the last block holds the
 * rest), k ascending: per element the order of `parity_gemv_f32` (aligned_kernels.c), which serves
 * 1-8 rows, so that a row's bits are the same in a product of any size, at any offset, on any thread
 * count. Strict mode (the AMX Xeon, whose MKL GEMM orders a row by M) ran these products as one-
 * thread library calls handed to a Python thread pool (~90 us a hand-off), so a product too small
 * to be worth slicing ran on one core; here both cores share every product.
 *
 * The weights are repacked per call into panels of 32 outputs, [k][32] (zeros past N), so that a
 * K step of 8 rows x 32 outputs is 2 vector loads, 8 broadcasts and 16 independent fused
 * multiply-add chains (each lane its own output's chain). Threads take (chunk of ~1 MB of x, panel)
 * items, chunk major, each packing its own panel (a copy of the weights the size of the product's
 * weight, kept per thread, would be 600 MB at a 151,936 x 1,024 LM head); each output is computed
 * by one thread, whole. Built where the compiler
 * targets AVX-512F; elsewhere `parity_gemm_f32` says -2 and the library's path runs.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

#include "transpose16.h"

#define NR 32     /* outputs of a panel */
#define MR 8      /* rows of a tile: 16 chains (4 rows ran 5-10% slower) */

static __thread float *panel_buf;
static __thread size_t panel_len;

static float *panels(size_t elems) {
    if (elems > panel_len) {
        free(panel_buf);
        panel_buf = aligned_alloc(64, (elems * 4 + 63) / 64 * 64);
        panel_len = panel_buf ? elems : 0;
    }
    return panel_buf;
}

/* Panel p of w (outputs 32 p .. + 31) as [k][32], zeros past n: 16 x 16 blocks transposed in
 * registers (bits moved, not computed). */
static void pack_panel(const float *w, int64_t k, int64_t n, int64_t p, float *dst) {
    const int64_t n0 = p * NR;
    for (int h = 0; h < 2; h++) {
        const int64_t rows = n - n0 - 16 * h < 16 ? n - n0 - 16 * h : 16;
        for (int64_t c0 = 0; c0 < k; c0 += 16) {
            const int cols = k - c0 < 16 ? (int)(k - c0) : 16;
            const __mmask16 mask = (__mmask16)(cols == 16 ? 0xFFFFu : (1u << cols) - 1u);
            __m512 t[16];
            for (int j = 0; j < 16; j++)
                t[j] = j < rows ? _mm512_maskz_loadu_ps(mask, w + (n0 + 16 * h + j) * k + c0) : _mm512_setzero_ps();
            transpose16(t);
            for (int i = 0; i < cols; i++) _mm512_store_ps(dst + (c0 + i) * NR + 16 * h, t[i]);
        }
    }
}

/* Rows r0 .. r0 + R - 1, outputs n0 .. n0 + width - 1, from panel `wt`. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *wt, const float *bias,
                                                       float *y, const int R, int64_t r0, int64_t k,
                                                       int64_t n, int64_t kc, int64_t n0, int64_t width) {
    const __mmask16 m0 = (__mmask16)(width >= 16 ? 0xFFFFu : (1u << width) - 1u);
    const __mmask16 m1 = (__mmask16)(width >= 32 ? 0xFFFFu : width <= 16 ? 0u : (1u << (width - 16)) - 1u);
    for (int64_t b0 = 0; b0 < k; b0 += kc) {
        const int64_t b1 = b0 + kc < k ? b0 + kc : k;
        __m512 acc[MR][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t c = b0; c < b1; c++) {
            const __m512 w0 = _mm512_load_ps(wt + c * NR), w1 = _mm512_load_ps(wt + c * NR + 16);
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_set1_ps(x[(r0 + r) * k + c]);
                acc[r][0] = _mm512_fmadd_ps(w0, xv, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, xv, acc[r][1]);
            }
        }
        for (int r = 0; r < R; r++)  /* the running total lives in y */
            for (int h = 0; h < 2; h++) {
                const __mmask16 mask = h ? m1 : m0;
                if (!mask) continue;
                float *yr = y + (r0 + r) * n + n0 + 16 * h;
                __m512 total;
                if (b0 > 0) total = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, yr), acc[r][h]);
                else total = bias ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask, bias + n0 + 16 * h), acc[r][h])
                                  : acc[r][h];
                _mm512_mask_storeu_ps(yr, mask, total);
            }
    }
}

/* Returns 0, -1 where a packed panel could not be allocated (nothing written then), -2 where not
 * built. */
int parity_gemm_f32(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t k,
                    int64_t n, int64_t kc, int threads) {
    if (m <= 0 || n <= 0) return 0;
    if (k <= 0) {  /* each output its bias, or zero */
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++) y[r * n + j] = bias ? bias[j] : 0.0f;
        return 0;
    }
    if (kc <= 0) kc = k;
    int64_t chunk = ((int64_t)1 << 20) / (k * 4) / MR * MR;  /* rows: ~1 MB of x stays in L2 */
    chunk = chunk < 64 ? 64 : chunk > 1024 ? 1024 : chunk;
    const int64_t np = (n + NR - 1) / NR, chunks = (m + chunk - 1) / chunk;
    /* equal shares of the rows (a row's bits do not depend on its chunk): a few rows past a whole
     * chunk made a chunk of their own, and the static schedule gave one thread every full one */
    chunk = (m + chunks - 1) / chunks;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        const unsigned int mode = _mm_getcsr();
        _mm_setcsr(0x1F80);  /* round to nearest, no flush-to-zero: the same on every thread */
        float *pt = panels((size_t)(k * NR));  /* this thread's packed panel */
        int64_t packed = -1;
        if (!pt) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < (failed ? 0 : chunks * np); it++) {  /* chunk major */
            const int64_t p = it % np, r1 = (it / np + 1) * chunk < m ? (it / np + 1) * chunk : m;
            const int64_t n0 = p * NR, width = n - n0 < NR ? n - n0 : NR;
            if (p != packed) pack_panel(w, k, n, p, pt), packed = p;
            int64_t r = it / np * chunk;
            for (; r + MR <= r1; r += MR) tile(x, pt, bias, y, MR, r, k, n, kc, n0, width);
            switch (r1 - r) {  /* the last rows of the item */
            case 7: tile(x, pt, bias, y, 7, r, k, n, kc, n0, width); break;
            case 6: tile(x, pt, bias, y, 6, r, k, n, kc, n0, width); break;
            case 5: tile(x, pt, bias, y, 5, r, k, n, kc, n0, width); break;
            case 4: tile(x, pt, bias, y, 4, r, k, n, kc, n0, width); break;
            case 3: tile(x, pt, bias, y, 3, r, k, n, kc, n0, width); break;
            case 2: tile(x, pt, bias, y, 2, r, k, n, kc, n0, width); break;
            case 1: tile(x, pt, bias, y, 1, r, k, n, kc, n0, width); break;
            default: break;
            }
        }
        _mm_setcsr(mode);
    }
    return failed ? -1 : 0;
}

#else
int parity_gemm_f32(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t k,
                    int64_t n, int64_t kc, int threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)k, (void)n, (void)kc, (void)threads;
    return -2;
}
#endif
