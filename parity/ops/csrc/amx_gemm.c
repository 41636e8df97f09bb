/* A bfloat16 GEMM on AMX tiles whose per-element order is fixed whatever the row count.
 *
 * y[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]) for bf16 x [M, K], w [N, K] (nn.Linear's
 * layout), bias [N] or none, y [M, N], all row-major. Every output element is one float32
 * accumulator that TDPBF16PS adds its 32 products to, K chunk after K chunk from zero, in ascending
 * order; then the bias is added and the sum rounded to bf16 once (VCVTNEPS2BF16: to nearest even,
 * a result in the denormal range flushed to zero, as the tiles flush theirs). That sequence is the
 * same for a row of a 1-row product and of a 4,096-row one, for any thread count, and for whichever
 * tile (and tile neighbours) holds the row: rows past M, inputs past K and outputs past N are zeros
 * in padded copies, never a different instruction.
 *
 * Two schedules, chosen by M alone; they give the same bits, since TDPBF16PS multiplies exactly and
 * adds in pair order whichever operand is A (tests/parity/test_amx_gemm.py crosses the switch):
 * - narrow (fewer than WIDE_MIN rows, decode): an A tile is 16 weight rows x 32 inputs loaded in
 *   place, a B tile 32 inputs x 16 rows of x repacked in pairs (the layout TDPBF16PS reads), a C tile
 *   16 outputs x 16 rows, transposed in registers on the way out. Nothing the size of w is copied.
 * - wide (prefill, the learner): an A tile is 16 rows of x loaded in place, a B tile 32 inputs x 16
 *   outputs repacked in pairs (all of w up front where it fits a core's L2, else one pair of output
 *   blocks at a time by the thread that uses it), a C tile 16 rows x 16 outputs, written as it is:
 *   a row's 32 outputs are one store, with no transpose (which had cost as much as the multiplies
 *   at K = 256).
 * Each thread runs with the same floating-point mode (MXCSR set to its default for the call, so
 * that a caller's denormals-are-zero never reaches only some threads' bias adds).
 *
 * Built only where the compiler targets AMX-BF16 and AVX512-BF16 (-march=native on such a CPU);
 * elsewhere, and where the kernel refuses (Linux must grant the process the tile state),
 * `parity_amx_ready` says 0 and parity keeps its other strict bf16 path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
    && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>

#include "transpose16.h"
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define WIDE_MIN 256   /* rows from which the wide schedule runs (below, narrow measured faster) */
#define MCHUNK 256     /* narrow: rows of x whose packed tiles stay in cache while a thread walks w */
#define XCHUNK (1 << 20)  /* wide: bytes of x a thread keeps in its L2 while it walks output pairs */
#define W_ALL (1 << 20)  /* wide: bytes of w packed up front where it fits a core's L2 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 1 if this process may use the tiles (asked of Linux once), else 0. */
int parity_amx_ready(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

static void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

static void *zeroed(size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    void *p = aligned_alloc(64, bytes ? bytes : 64);
    if (p) memset(p, 0, bytes);
    return p;
}

/* Per-thread buffers grown on demand and kept: allocating them per call cost fresh pages and their
 * faults (a third of a 2,048-row product at the small preset's shapes). */
static __thread uint16_t *packed_buf, *pair_buf;
static __thread size_t packed_len, pair_len;

static uint16_t *grown(uint16_t **buf, size_t *len, size_t elems) {
    if (elems > *len) {
        free(*buf);
        *buf = aligned_alloc(64, (elems * 2 + 63) / 64 * 64);
        *len = *buf ? elems : 0;
    }
    return *buf;
}

/* The operand whose A tiles are loaded in place (row stride k), with its edges in padded copies:
 * `pk`, each 16-row block's last, partial K chunk; `pn`, a last block of fewer than 16 rows. */
typedef struct {
    const uint16_t *p, *pk, *pn;
    int64_t k, kc, nb;
} operand;

static int in_place(operand *A, const uint16_t *p, int64_t rows, int64_t k) {
    const int64_t kc = (k + 31) / 32, nb = (rows + 15) / 16;
    uint16_t *pk = k % 32 && rows >= 16 ? zeroed((size_t)nb * 512 * 2) : NULL;
    uint16_t *pn = rows % 16 ? zeroed((size_t)16 * kc * 32 * 2) : NULL;
    *A = (operand){p, pk, pn, k, kc, nb};
    if ((k % 32 && rows >= 16 && !pk) || (rows % 16 && !pn)) return -1;
    if (pk)
        for (int64_t r = 0; r < (rows / 16) * 16; r++)
            memcpy(pk + r * 32, p + r * k + (kc - 1) * 32, (k % 32) * 2);
    if (pn)
        for (int64_t r = nb * 16 - 16; r < rows; r++)
            memcpy(pn + (r - (nb * 16 - 16)) * kc * 32, p + r * k, k * 2);
    return 0;
}

/* Where the A tile of block `b`, K chunk `c` lies, and its row stride in bytes. (A tile register
 * must be named by a constant: the caller loads.) */
static inline const uint16_t *a_tile(const operand *A, int64_t b, int64_t c, int64_t *stride) {
    if (A->pn && b == A->nb - 1) {
        *stride = A->kc * 64;
        return A->pn + c * 32;
    }
    if (A->pk && c == A->kc - 1) {
        *stride = 64;
        return A->pk + b * 512;
    }
    *stride = A->k * 2;
    return A->p + b * 16 * A->k + c * 32;
}

/* 16 rows of `src` (row stride k, the first `rows` real) -> kc tiles in pairs: tile c, row r,
 * column j = src row j, inputs 32 c + 2 r .. + 1 (one 32-bit pair, the layout of a B tile); zeros
 * past `rows` and past k. Bits moved, not computed. */
static void pack_pairs(const uint16_t *src, int64_t rows, int64_t k, int64_t kc, uint16_t *dst) {
    if (rows < 16) memset(dst, 0, (size_t)kc * 1024);
    else if (k % 32) memset(dst + (kc - 1) * 512, 0, 1024);
    for (int64_t c = 0; c < k / 32; c++) {
        __m512 t[16];
        for (int j = 0; j < 16; j++)
            t[j] = j < rows ? _mm512_castsi512_ps(_mm512_loadu_si512(src + j * k + c * 32)) : _mm512_setzero_ps();
        transpose16(t);
        for (int r = 0; r < 16; r++) _mm512_store_ps((float *)(dst + c * 512 + r * 32), t[r]);
    }
    for (int j = 0; j < rows; j++)
        for (int64_t p = k / 32 * 32; p < k; p++)
            dst[(p / 32) * 512 + ((p % 32) / 2) * 32 + j * 2 + (p % 2)] = src[j * k + p];
}

static inline __m512 bias_block(const uint16_t *bias, int64_t at, int64_t width) {
    if (!bias || width <= 0) return _mm512_setzero_ps();
    const __mmask16 cols = (__mmask16)(width >= 16 ? 0xFFFFu : (1u << width) - 1u);
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, bias + at)), 16));
}

/* Narrow: sums in `cbuf` (16 outputs of block b x 16 rows of block mb) -> y, transposed in
 * registers, bias added, rounded once, one store per row of y. */
static void emit_columns(const float *cbuf, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                         int64_t b, int64_t mb) {
    const int64_t width = n - b * 16 < 16 ? n - b * 16 : 16;
    const __mmask16 cols = (__mmask16)((1u << width) - 1u);
    const __m512 bv = bias_block(bias, b * 16, width);
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(cbuf + 16 * i);
    transpose16(r);
    for (int j = 0; j < 16 && mb * 16 + j < m; j++)
        _mm256_mask_storeu_epi16(y + (mb * 16 + j) * n + b * 16, cols,
                                 (__m256i)_mm512_cvtneps_pbh(bias ? _mm512_add_ps(r[j], bv) : r[j]));
}

/* Narrow: output blocks b0 (and b0 + 1 if `two`) for row blocks mb0 (and mb0 + 1 if `two_m`).
 * Tiles: 0-3 sums, 4-5 weights, 6-7 rows. */
static void narrow_block(const operand *W, const uint16_t *xp, const uint16_t *bias, uint16_t *y,
                         int64_t m, int64_t n, int64_t b0, int two, int64_t mb0, int two_m) {
    float cbuf[256] __attribute__((aligned(64)));
    const uint16_t *x0 = xp + mb0 * W->kc * 512, *x1 = x0 + W->kc * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < W->kc; c++) {
        int64_t s0, s1;
        _tile_loadd(4, a_tile(W, b0, c, &s0), s0);
        _tile_loadd(6, x0 + c * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_m) {
            _tile_loadd(7, x1 + c * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two) {
            _tile_loadd(5, a_tile(W, b0 + 1, c, &s1), s1);
            _tile_dpbf16ps(2, 5, 6);
            if (two_m) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, cbuf, 64);
    emit_columns(cbuf, bias, y, m, n, b0, mb0);
    if (two_m) {
        _tile_stored(1, cbuf, 64);
        emit_columns(cbuf, bias, y, m, n, b0, mb0 + 1);
    }
    if (two) {
        _tile_stored(2, cbuf, 64);
        emit_columns(cbuf, bias, y, m, n, b0 + 1, mb0);
        if (two_m) {
            _tile_stored(3, cbuf, 64);
            emit_columns(cbuf, bias, y, m, n, b0 + 1, mb0 + 1);
        }
    }
}

static int narrow(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t m,
                  int64_t k, int64_t n, int threads) {
    operand W;
    const int64_t mblocks = (m + 15) / 16, kc = (k + 31) / 32;
    uint16_t *xp = grown(&packed_buf, &packed_len, (size_t)mblocks * kc * 512);
    if (in_place(&W, w, n, k) || !xp) {
        free((void *)W.pk), free((void *)W.pn);
        return -1;
    }
    const int64_t pairs = (W.nb + 1) / 2;
    #pragma omp parallel num_threads(threads)
    {
        const unsigned int mode = _mm_getcsr();
        _mm_setcsr(0x1F80);  /* round to nearest, no flush-to-zero, exceptions masked */
        #pragma omp for schedule(static)
        for (int64_t mb = 0; mb < mblocks; mb++)
            pack_pairs(x + mb * 16 * k, m - mb * 16 < 16 ? m - mb * 16 : 16, k, kc, xp + mb * kc * 512);
        /* (the for's barrier: every tile packed before any is read) */
        configure();
        for (int64_t m0 = 0; m0 < mblocks; m0 += MCHUNK / 16) {
            const int64_t m1 = m0 + MCHUNK / 16 < mblocks ? m0 + MCHUNK / 16 : mblocks;
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++)
                for (int64_t mb = m0; mb < m1; mb += 2)
                    narrow_block(&W, xp, bias, y, m, n, 2 * p, 2 * p + 1 < W.nb, mb, mb + 1 < m1);
        }
        _tile_release();
        _mm_setcsr(mode);
    }
    free((void *)W.pk), free((void *)W.pn);
    return 0;
}

/* Wide: rows 16 mb .. + 15 of y, outputs 16 b0 .. + 31, from tile rows c0 (outputs of block b0)
 * and c1 (block b0 + 1, or NULL): bias added, rounded once, one store per row. */
static void emit_rows(const float *c0, const float *c1, const uint16_t *bias, uint16_t *y, int64_t m,
                      int64_t n, int64_t mb, int64_t b0) {
    const int64_t width = n - b0 * 16 < 32 ? n - b0 * 16 : 32;
    const __mmask32 cols = width == 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << width) - 1u);
    const __m512 bv0 = bias_block(bias, b0 * 16, width), bv1 = bias_block(bias, b0 * 16 + 16, width - 16);
    for (int i = 0; i < 16 && mb * 16 + i < m; i++) {
        __m512 v0 = _mm512_load_ps(c0 + 16 * i), v1 = c1 ? _mm512_load_ps(c1 + 16 * i) : _mm512_setzero_ps();
        if (bias) v0 = _mm512_add_ps(v0, bv0), v1 = _mm512_add_ps(v1, bv1);  /* (no bias: -0 stays -0) */
        _mm512_mask_storeu_epi16(y + (mb * 16 + i) * n + b0 * 16, cols, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
}

static int wide(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t m,
                int64_t k, int64_t n, int threads) {
    const int64_t mblocks = (m + 15) / 16, kc = (k + 31) / 32, nb = (n + 15) / 16, pairs = (nb + 1) / 2;
    /* A small w is packed whole up front and an item is a pair of x's row blocks, held while it
     * meets every output pair; a large one is packed a pair of output blocks at a time by the thread
     * that uses it, and an item is (x chunk, output pair), chunk major, so that a thread's chunk of
     * x stays in its L2 while it walks the pairs. */
    const int all_w = n * k * 2 <= W_ALL;
    int64_t cb = XCHUNK / (k * 32);  /* row blocks per x chunk: an even number, 16 to 64 */
    cb = cb < 16 ? 16 : cb > 64 ? 64 : cb & ~(int64_t)1;
    if (!all_w) {  /* chunks of equal shares, still even (a few row blocks past a whole chunk made a
                    * chunk of their own, and the static schedule gave one thread every full one) */
        const int64_t chunks = (mblocks + cb - 1) / cb;
        cb = ((mblocks + chunks - 1) / chunks + 1) & ~(int64_t)1;
    }
    const int64_t items = all_w ? (mblocks + 1) / 2 : (mblocks + cb - 1) / cb * pairs;
    operand X;
    uint16_t *wall = all_w ? grown(&packed_buf, &packed_len, (size_t)pairs * 2 * kc * 512) : NULL;
    if (in_place(&X, x, m, k) || (all_w && !wall)) {
        free((void *)X.pk), free((void *)X.pn);
        return -1;
    }
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        const unsigned int mode = _mm_getcsr();
        _mm_setcsr(0x1F80);  /* round to nearest, no flush-to-zero, exceptions masked */
        if (all_w) {
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < nb; b++)
                pack_pairs(w + b * 16 * k, n - b * 16 < 16 ? n - b * 16 : 16, k, kc, wall + b * kc * 512);
        }
        uint16_t *wp = all_w ? wall : grown(&pair_buf, &pair_len, (size_t)kc * 1024);
        if (!wp) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (!failed) {
            float cbuf[1024] __attribute__((aligned(64)));
            int64_t packed_pair = -1;
            configure();
            #pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++)
                for (int64_t p = all_w ? 0 : it % pairs; p < (all_w ? pairs : it % pairs + 1); p++) {
                    const int64_t b0 = 2 * p, rows0 = n - b0 * 16 < 16 ? n - b0 * 16 : 16;
                    const int64_t mb0 = all_w ? 2 * it : it / pairs * cb;
                    const int64_t mb1 = all_w ? 2 * it + 2 : mb0 + cb;
                    const int two = b0 + 1 < nb;
                    const uint16_t *wq = all_w ? wall + b0 * kc * 512 : wp;
                    if (!all_w && p != packed_pair) {
                        pack_pairs(w + b0 * 16 * k, rows0, k, kc, wp);
                        if (two) pack_pairs(w + (b0 + 1) * 16 * k, n - b0 * 16 - 16 < 16 ? n - b0 * 16 - 16 : 16,
                                            k, kc, wp + kc * 512);
                        packed_pair = p;
                    }
                    for (int64_t mb = mb0; mb < mb1 && mb < mblocks; mb += 2) {
                        const int two_m = mb + 1 < mblocks;
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        for (int64_t c = 0; c < kc; c++) {  /* tiles: 0-3 sums, 4-5 rows, 6-7 weights */
                            int64_t s0, s1;
                            _tile_loadd(4, a_tile(&X, mb, c, &s0), s0);
                            _tile_loadd(6, wq + c * 512, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            if (two) {
                                _tile_loadd(7, wq + (kc + c) * 512, 64);
                                _tile_dpbf16ps(1, 4, 7);
                            }
                            if (two_m) {
                                _tile_loadd(5, a_tile(&X, mb + 1, c, &s1), s1);
                                _tile_dpbf16ps(2, 5, 6);
                                if (two) _tile_dpbf16ps(3, 5, 7);
                            }
                        }
                        _tile_stored(0, cbuf, 64);
                        if (two) _tile_stored(1, cbuf + 256, 64);
                        emit_rows(cbuf, two ? cbuf + 256 : NULL, bias, y, m, n, mb, b0);
                        if (two_m) {
                            _tile_stored(2, cbuf + 512, 64);
                            if (two) _tile_stored(3, cbuf + 768, 64);
                            emit_rows(cbuf + 512, two ? cbuf + 768 : NULL, bias, y, m, n, mb + 1, b0);
                        }
                    }
                }
            _tile_release();
        }
        _mm_setcsr(mode);
    }
    free((void *)X.pk), free((void *)X.pn);
    return failed ? -1 : 0;
}

/* Returns 0, -1 where memory for the packed copies could not be had, or -2 where the tiles may
 * not be used (`parity_amx_ready` says 0); nothing is written then. */
int parity_amx_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                           int64_t m, int64_t k, int64_t n, int threads) {
    if (!parity_amx_ready()) return -2;
    if (m <= 0 || n <= 0) return 0;
    return (m >= WIDE_MIN ? wide : narrow)(x, w, bias, y, m, k, n, threads);
}

#else
int parity_amx_ready(void) { return 0; }

int parity_amx_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                           int64_t m, int64_t k, int64_t n, int threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)k, (void)n, (void)threads;
    return -2;
}
#endif
