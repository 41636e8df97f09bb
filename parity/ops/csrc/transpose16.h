/* A 16 x 16 float32 transpose in AVX-512 registers, shared by the GEMMs (amx_gemm.c, gemm_f32.c).
 * Included where the compiler targets AVX-512F; parity hashes this file with the sources, so a
 * change to it rebuilds the kernels. */
#ifndef PARITY_TRANSPOSE16_H
#define PARITY_TRANSPOSE16_H
#include <immintrin.h>

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

#endif
