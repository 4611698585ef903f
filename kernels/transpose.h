// A 16 x 16 transpose of 32-bit elements in AVX-512 registers, and the GEMMs' store of a
// finished block of y^T into y through it. The functions carry an avx512f target attribute,
// so every build (native, avx2, scalar) can include this header: the AMX / AVX512-BF16 units
// (compiled with their own targets in every build) and the AVX-512 build's fp32 GEMM call
// them; nothing else does.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#define WBK_AVX512_TARGET __attribute__((target("avx512f")))

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

}  // namespace wbk
