/* A bfloat16 GEMM on AMX tiles whose per-element order is fixed whatever the row count.
 *
 * y[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]) for bf16 x [M, K], w [N, K] (nn.Linear's
 * layout), bias [N] or none, y [M, N], all row-major. Tiles compute the transposed product: an A
 * tile is 16 weight rows x 32 input positions, loaded in place (a row of w is contiguous), a B tile
 * is 32 input positions x 16 rows of x, repacked in pairs (the layout TDPBF16PS reads), and a C
 * tile is 16 outputs x 16 rows of float32 sums; a product of at least as many rows as outputs swaps
 * the roles (rows of x in place, the weights packed). Every output element is one float32
 * accumulator that TDPBF16PS adds its 32 products to, K chunk after K chunk from zero, in ascending
 * order; then the bias is added and the sum rounded to bf16 once. That sequence is the same for a
 * row of a 1-row product and of a 4,096-row one, for any thread count, and for whichever tile (and
 * tile neighbours) holds the row: rows past M, inputs past K and outputs past N are zeros in padded
 * copies, never a different instruction. Threads share whole pairs of the in-place operand's 16-row
 * blocks (outputs, or rows of x when swapped), each with the same floating-point mode (MXCSR set to
 * its default for the call, so that a caller's flush-to-zero never reaches only some threads' bias
 * adds). As TDPBF16PS does, denormal inputs count as zero and denormal sums are flushed: the same
 * on every row, unlike PyTorch's sums.
 *
 * Built only where the compiler targets AMX-BF16 (-march=native on such a CPU); elsewhere, and
 * where the kernel refuses (Linux must grant the process the tile state), `parity_amx_ready`
 * says 0 and parity keeps its other strict bf16 path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
    && defined(__linux__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define MCHUNK 256 /* rows of x whose packed tiles stay in cache while a thread walks its outputs */


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

typedef struct {
    const uint16_t *w, *wk, *wn;  /* the operand loaded in place (A tiles), its padded edges */
    int64_t k, kc, nb;
    int swap;  /* 0: A tiles are weight rows, B tiles rows of x; 1: A tiles are rows of x */
} weights;

/* Where the A tile of output block `b`, K chunk `c` lies (and its row stride in bytes): in place,
 * or in a padded copy at the edges. (A tile register must be named by a constant: the caller
 * loads.) */
static inline const uint16_t *a_tile(const weights *W, int64_t b, int64_t c, int64_t *stride) {
    if (W->wn && b == W->nb - 1) {
        *stride = W->kc * 64;
        return W->wn + c * 32;
    }
    if (W->wk && c == W->kc - 1) {
        *stride = 64;
        return W->wk + b * 512;
    }
    *stride = W->k * 2;
    return W->w + b * 16 * W->k + c * 32;
}

/* A 16 x 16 float32 transpose in registers: r[i] lane j -> r[j] lane i. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int g = 0; g < 16; g += 8)
        for (int i = 0; i < 4; i++) {
            t[g + i] = _mm512_shuffle_f32x4(r[g + i], r[g + 4 + i], 0x88);
            t[g + 4 + i] = _mm512_shuffle_f32x4(r[g + i], r[g + 4 + i], 0xDD);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    }
}

/* Sums in `cbuf` (16 outputs x 16 rows) -> y, bias added, rounded once (to nearest even, as
 * PyTorch rounds; NaN stays NaN): transposed in registers, one vector per row of y. */
static inline __m256i rounded_bf16(__m512 s) {
    const __m512i bits = _mm512_castps_si512(s);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i biased = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
    __m512i rounded = _mm512_srli_epi32(biased, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(rounded);
}

static inline __m512 bias_block(const uint16_t *bias, int64_t at, __mmask16 cols) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, bias + at)), 16));
}

/* Sums in `cbuf` (tile rows x 16 columns of float32) -> y, bias added, rounded once (to nearest
 * even, as PyTorch rounds; NaN stays NaN). Unswapped, a tile is 16 outputs (block b) x 16 rows of
 * y (block mb): transposed in registers, one vector per row of y. Swapped, it is 16 rows of y
 * (block b) x 16 outputs (block mb): each tile row is a row of y's outputs as it is. The same
 * additions and rounding either way. */
static void emit(const float *cbuf, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                 int64_t b, int64_t mb, int swap) {
    if (swap) {
        const int64_t width = n - mb * 16 < 16 ? n - mb * 16 : 16;
        const __mmask16 cols = (__mmask16)((1u << width) - 1u);
        const __m512 bv = bias ? bias_block(bias, mb * 16, cols) : _mm512_setzero_ps();
        for (int i = 0; i < 16 && b * 16 + i < m; i++) {
            const __m512 r = _mm512_load_ps(cbuf + 16 * i);
            _mm256_mask_storeu_epi16(y + (b * 16 + i) * n + mb * 16, cols,
                                     rounded_bf16(bias ? _mm512_add_ps(r, bv) : r));
        }
        return;
    }
    const int64_t width = n - b * 16 < 16 ? n - b * 16 : 16;
    const __mmask16 cols = (__mmask16)((1u << width) - 1u);
    const __m512 bv = bias ? bias_block(bias, b * 16, cols) : _mm512_setzero_ps();
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(cbuf + 16 * i);
    transpose16(r);
    for (int j = 0; j < 16 && mb * 16 + j < m; j++)
        _mm256_mask_storeu_epi16(y + (mb * 16 + j) * n + b * 16, cols,
                                 rounded_bf16(bias ? _mm512_add_ps(r[j], bv) : r[j]));
}

/* Output blocks b0 (and b0 + 1 if `two`) for row blocks mb0 (and mb0 + 1 if `two_m`). Tiles:
 * 0-3 sums, 4-5 weights, 6-7 rows. */
static void block(const weights *W, const uint16_t *xp, const uint16_t *bias, uint16_t *y, int64_t m,
                  int64_t n, int64_t b0, int two, int64_t mb0, int two_m) {
    float cbuf[256] __attribute__((aligned(64)));
    const uint16_t *x0 = xp + mb0 * W->kc * 512, *x1 = x0 + W->kc * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < W->kc; c++) {
        int64_t s0, s1;
        const uint16_t *a0 = a_tile(W, b0, c, &s0);
        _tile_loadd(4, a0, s0);
        _tile_loadd(6, x0 + c * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_m) {
            _tile_loadd(7, x1 + c * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two) {
            const uint16_t *a1 = a_tile(W, b0 + 1, c, &s1);
            _tile_loadd(5, a1, s1);
            _tile_dpbf16ps(2, 5, 6);
            if (two_m) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, cbuf, 64);
    emit(cbuf, bias, y, m, n, b0, mb0, W->swap);
    if (two_m) {
        _tile_stored(1, cbuf, 64);
        emit(cbuf, bias, y, m, n, b0, mb0 + 1, W->swap);
    }
    if (two) {
        _tile_stored(2, cbuf, 64);
        emit(cbuf, bias, y, m, n, b0 + 1, mb0, W->swap);
        if (two_m) {
            _tile_stored(3, cbuf, 64);
            emit(cbuf, bias, y, m, n, b0 + 1, mb0 + 1, W->swap);
        }
    }
}

/* The calling thread's packed copy of x, grown on demand and kept: allocating it per call cost
 * fresh pages and their faults (a third of a 2,048-row product at the small preset's shapes). */
static __thread uint16_t *packed_buf;
static __thread size_t packed_len;

static uint16_t *packed(size_t elems) {
    if (elems > packed_len) {
        free(packed_buf);
        packed_buf = aligned_alloc(64, (elems * 2 + 63) / 64 * 64);
        packed_len = packed_buf ? elems : 0;
    }
    return packed_buf;
}

/* Returns 0, -1 where memory for the packed copies could not be had, or -2 where the tiles may
 * not be used (`parity_amx_ready` says 0); nothing is written then. */
int parity_amx_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                           int64_t m, int64_t k, int64_t n, int threads) {
    if (!parity_amx_ready()) return -2;
    if (m <= 0 || n <= 0) return 0;
    /* At least as many rows as outputs: the rows of x in place and the weights packed, so that
     * threads share rows and the smaller operand is the one reused (2,048 x 256 -> 256: 231 ->
     * 110 us; 2,048 x 256 -> 1,536: 883 -> 656; never slower where measured). The tiles sum each
     * element alike either way (TDPBF16PS multiplies exactly and adds in pair order, whichever
     * operand is A): the same bits, tests/parity/test_amx_gemm.py. */
    const int swap = m >= n;
    const uint16_t *in_place = swap ? x : w, *to_pack = swap ? w : x;
    const int64_t na = swap ? m : n, np = swap ? n : m;  /* rows of each */
    const int64_t mblocks = (np + 15) / 16, kc = (k + 31) / 32, nb = (na + 15) / 16;
    uint16_t *xp = packed((size_t)mblocks * kc * 512);
    uint16_t *wk = k % 32 && na >= 16 ? zeroed((size_t)nb * 512 * 2) : NULL;
    uint16_t *wn = na % 16 ? zeroed((size_t)16 * kc * 32 * 2) : NULL;
    if (!xp || (k % 32 && na >= 16 && !wk) || (na % 16 && !wn)) {
        free(wk), free(wn);
        return -1;
    }
    if (wk)  /* each in-place block's last, partial K chunk, zero-padded */
        for (int64_t r = 0; r < (na / 16) * 16; r++)
            memcpy(wk + r * 32, in_place + r * k + (kc - 1) * 32, (k % 32) * 2);
    if (wn)  /* the last, partial in-place block, zero-padded in both directions */
        for (int64_t r = nb * 16 - 16; r < na; r++)
            memcpy(wn + (r - (nb * 16 - 16)) * kc * 32, in_place + r * k, k * 2);
    const weights W = {in_place, wk, wn, k, kc, nb, swap};
    const int64_t pairs = (nb + 1) / 2;
    #pragma omp parallel num_threads(threads)
    {
        const unsigned int mode = _mm_getcsr();
        _mm_setcsr(0x1F80);  /* round to nearest, no flush-to-zero, exceptions masked */
        /* the packed operand in pairs: tile (mb, c), row r, column j = row 16 mb + j, inputs
         * 32 c + 2 r .. + 1 (one 32-bit pair); the padding (rows past its end, inputs past K)
         * zeroed first */
        #pragma omp for schedule(static)
        for (int64_t mb = 0; mb < mblocks; mb++) {
            uint16_t *dst = xp + mb * kc * 512;
            if (mb * 16 + 16 > np) memset(dst, 0, (size_t)kc * 1024);
            else if (k % 32) memset(dst + (kc - 1) * 512, 0, 1024);
            const int64_t rows = np - mb * 16 < 16 ? np - mb * 16 : 16;
            const uint16_t *xb = to_pack + mb * 16 * k;
            for (int64_t c = 0; c < k / 32; c++) {  /* 16 rows' pairs, transposed: bits moved, not computed */
                __m512 t[16];
                for (int j = 0; j < 16; j++)
                    t[j] = j < rows ? _mm512_castsi512_ps(_mm512_loadu_si512(xb + j * k + c * 32))
                                    : _mm512_setzero_ps();
                transpose16(t);
                for (int r = 0; r < 16; r++) _mm512_store_ps((float *)(dst + c * 512 + r * 32), t[r]);
            }
            for (int j = 0; j < rows; j++)
                for (int64_t p = k / 32 * 32; p < k; p++)
                    dst[(p / 32) * 512 + ((p % 32) / 2) * 32 + j * 2 + (p % 2)] = xb[j * k + p];
        }  /* (the for's barrier: every tile packed before any is read) */
        configure();
        for (int64_t m0 = 0; m0 < mblocks; m0 += MCHUNK / 16) {
            const int64_t m1 = m0 + MCHUNK / 16 < mblocks ? m0 + MCHUNK / 16 : mblocks;
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++)
                for (int64_t mb = m0; mb < m1; mb += 2)
                    block(&W, xp, bias, y, m, n, 2 * p, 2 * p + 1 < nb, mb, mb + 1 < m1);
        }
        _tile_release();
        _mm_setcsr(mode);
    }
    free(wk), free(wn);
    return 0;
}

#else
int parity_amx_ready(void) { return 0; }

int parity_amx_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                           int64_t m, int64_t k, int64_t n, int threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)k, (void)n, (void)threads;
    return -2;
}
#endif
