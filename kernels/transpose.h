// A 16 x 16 transpose of 32-bit elements in AVX-512 registers, and the GEMMs' store of a
// finished block of y^T into y through it; the same with 8 x 8 blocks in AVX2 registers for
// the AVX2 build's fp32 GEMM. The functions carry their ISA's target attribute, so every build
// (native, avx2, scalar) can include this header: the AMX / AVX512-BF16 units (compiled with
// their own targets in every build) and the AVX-512 and AVX2 builds' fp32 GEMMs call them;
// nothing else does.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#ifndef WBK_AVX512_TARGET  // (the emulated test build defines it empty: emulate_isa.h)
#define WBK_AVX512_TARGET __attribute__((target("avx512f")))
#endif
#define WBK_AVX2_TARGET __attribute__((target("avx2")))

namespace wbk {

// r[i][j] -> r[j][i] for a 16 x 16 block of 32-bit elements, in registers.
WBK_AVX512_TARGET inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// y[m0 + m][n0 + r] = ct[r][m] for r < rows, m < tokens: 16 x 16 blocks transposed in
// registers, each stored as 16 consecutive outputs of one token. With `stream`, whole aligned
// 64-byte pieces of y are written with non-temporal stores (the caller fences once at the end).
// With `add`, y[m0 + m][n0 + r] += ct[r][m] instead (never streamed).
WBK_AVX512_TARGET inline void store_transposed(const float* ct, int64_t ldc, int64_t rows, int64_t tokens, float* y,
                                                int64_t ldy, bool stream, bool add = false) {
  for (int64_t m = 0; m < tokens; m += 16) {
    const int64_t mt = std::min<int64_t>(16, tokens - m);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int64_t rt = std::min<int64_t>(16, rows - r0);
      const __mmask16 mask = static_cast<__mmask16>((1u << rt) - 1);
      __m512i v[16];
      for (int i = 0; i < 16; ++i)  // rows past `rows` hold what ct holds there: never stored
        v[i] = _mm512_loadu_si512(ct + (r0 + i) * ldc + m);
      transpose16(v);
      for (int64_t i = 0; i < mt; ++i) {
        float* dst = y + (m + i) * ldy + r0;
        if (add) {
          const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), reinterpret_cast<__m512>(v[i]));
          _mm512_mask_storeu_ps(dst, mask, sum);
        } else if (stream && rt == 16 && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
          _mm512_stream_ps(dst, reinterpret_cast<__m512>(v[i]));
        } else {
          _mm512_mask_storeu_ps(dst, mask, reinterpret_cast<__m512>(v[i]));
        }
      }
    }
  }
}

// r[i][j] -> r[j][i] for an 8 x 8 block of floats, in registers.
WBK_AVX2_TARGET inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// store_transposed's AVX2 counterpart: y[m0 + m][n0 + r] (+)= ct[r][m] for r < rows, m < tokens,
// through 8 x 8 blocks. ct must hold whole blocks of 8 rows and 8 tokens (what is read past
// `rows` or `tokens` is never stored).
WBK_AVX2_TARGET inline void store_transposed8(const float* ct, int64_t ldc, int64_t rows, int64_t tokens, float* y,
                                              int64_t ldy, bool add) {
  for (int64_t m = 0; m < tokens; m += 8) {
    const int64_t mt = std::min<int64_t>(8, tokens - m);
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const int rt = static_cast<int>(std::min<int64_t>(8, rows - r0));
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(ct + (r0 + i) * ldc + m);
      transpose8(v);
      for (int64_t i = 0; i < mt; ++i) {
        float* dst = y + (m + i) * ldy + r0;
        if (rt == 8) {
          _mm256_storeu_ps(dst, add ? _mm256_add_ps(_mm256_loadu_ps(dst), v[i]) : v[i]);
        } else {
          const __m256 out = add ? _mm256_add_ps(_mm256_maskload_ps(dst, mask), v[i]) : v[i];
          _mm256_maskstore_ps(dst, mask, out);
        }
      }
    }
  }
}

}  // namespace wbk
