// The AMX bf16 building block shared by the GEMM (gemm_bf16.cpp) and prefill attention on
// tiles (prefill_tiles.cpp). Functions here carry their own target attributes, so every build
// (native, avx2, scalar) compiles them; gemm_engine_status() decides at run time whether they
// may run, and nothing calls them unless it said yes.
//
// A tile is 16 rows of 64 bytes: 16 x 32 bf16 values as an operand, 16 x 16 fp32 as an
// accumulator. tdpbf16ps C += A . B reads A as 16 rows of 32 values of the reduction and B in
// the VNNI pairing, 16 rows (pairs of the reduction) of 16 columns x 2 values.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "transpose.h"

// Every AMX CPU so far has both AMX-BF16 and AMX-INT8; the attribute only lets the compiler
// emit those instructions where a function asks for them.
#ifndef WBK_AMX_TARGET  // (the emulated test build defines it empty: emulate_isa.h)
#define WBK_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace wbk {

inline constexpr int64_t kTileRows = 16;  // rows of a tile
inline constexpr int64_t kTileK = 32;     // bf16 values of the reduction per tile row (64 bytes)

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles as 16 rows of 64 bytes. Once per thread before its first tile instruction;
// _tile_release() when the thread is done with them. Call it, and every tile instruction, from
// a WBK_AMX_TARGET function: a lambda does not take its enclosing function's attributes, and
// in the avx2 build configure_tiles called from one faulted.
WBK_AMX_TARGET inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTileRows;
  }
  _tile_loadconfig(&cfg);
}

// Where block_2x2 reads its A operand: at each 32-long step of the reduction, the top and the
// bottom 16-row tile, their rows `pitch` bytes apart, the next step's tiles `step` bytes on.
// Row-major A (rows lda_bytes apart) is {a, a + 16 rows, lda_bytes, 64}; A packed tile by tile
// (each tile's 1 KB contiguous) is {top, bottom, 64, 1024}.
struct TileA {
  const char* top;
  const char* bottom;
  int64_t pitch;
  int64_t step;
};

inline TileA row_major_a(const uint16_t* a, int64_t lda_bytes) {
  const char* p = reinterpret_cast<const char*>(a);
  return {p, p + 16 * lda_bytes, lda_bytes, 2 * kTileK};
}

// C (32 rows x 32 columns, ldc elements a row) = or += the product over kc values of the
// reduction (a multiple of 32, or with Int8 of 64) of A (32 rows, read as `a` says) and packed
// B: at each step of the reduction, two 1 KB tiles side by side (columns 0-15, then 16-31),
// b_step bytes apart from one step to the next. bf16 operands and fp32 sums (tdpbf16ps: A
// rows of 32 values, B rows of 16 pairs), or with Int8 int8 operands and int32 sums (tdpbssd:
// A rows of 64 values, B rows of 16 quads). Tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B.
template <bool Int8 = false>
WBK_AMX_TARGET inline void block_2x2(int64_t kc, const TileA& a, const void* b, int64_t b_step, void* c, int64_t ldc,
                                     bool accumulate) {
  const int64_t ldc_bytes = ldc * 4;
  char* c0 = static_cast<char*>(c);
  char* c2 = c0 + 16 * ldc_bytes;  // the bottom 16 rows
  if (accumulate) {
    _tile_loadd(0, c0, ldc_bytes);
    _tile_loadd(1, c0 + 64, ldc_bytes);
    _tile_loadd(2, c2, ldc_bytes);
    _tile_loadd(3, c2 + 64, ldc_bytes);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const char* a0 = a.top;
  const char* a1 = a.bottom;
  const char* bp = static_cast<const char*>(b);
  for (int64_t k = 0; k < kc; k += Int8 ? 2 * kTileK : kTileK) {
    _tile_loadd(4, a0, a.pitch);
    _tile_loadd(5, a1, a.pitch);
    _tile_loadd(6, bp, 64);
    _tile_loadd(7, bp + 1024, 64);
    if constexpr (Int8) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    a0 += a.step;
    a1 += a.step;
    bp += b_step;
  }
  _tile_stored(0, c0, ldc_bytes);
  _tile_stored(1, c0 + 64, ldc_bytes);
  _tile_stored(2, c2, ldc_bytes);
  _tile_stored(3, c2 + 64, ldc_bytes);
}

// The same block on AVX512-BF16 (vdpbf16ps), for CPUs without AMX: identical operands and
// result. A row of a B tile is one pair of the reduction for 16 columns, exactly a vdpbf16ps
// operand; each row of A contributes its pair as a 32-bit broadcast. 8 rows x 32 columns stay
// in 16 registers over all of kc; `rows` (1..32) skips the 8-row groups past it.
WBK_AMX_TARGET inline void block_2x2_dp(int64_t kc, const uint16_t* a, int64_t lda_bytes, const uint16_t* b,
                                        int64_t b_step, float* c, int64_t ldc, bool accumulate, int64_t rows) {
  const int64_t lda = lda_bytes / 2, step = b_step / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    __m512 acc[8][2];
    for (int r = 0; r < 8; ++r) {
      acc[r][0] = accumulate ? _mm512_loadu_ps(c + (r0 + r) * ldc) : _mm512_setzero_ps();
      acc[r][1] = accumulate ? _mm512_loadu_ps(c + (r0 + r) * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < kc; k += kTileK) {
      const uint16_t* tile = b + (k / kTileK) * step;
      for (int p = 0; p < 16; ++p) {
        const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(tile + p * 32));
        const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(tile + 512 + p * 32));
        for (int r = 0; r < 8; ++r) {
          int32_t pair;
          __builtin_memcpy(&pair, a + (r0 + r) * lda + k + 2 * p, 4);
          const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
        }
      }
    }
    for (int r = 0; r < 8; ++r) {
      _mm512_storeu_ps(c + (r0 + r) * ldc, acc[r][0]);
      _mm512_storeu_ps(c + (r0 + r) * ldc + 16, acc[r][1]);
    }
  }
}

// One B tile from 16 rows of bf16 values (row r at src + r ld, 32 values of the reduction
// each, the first `kvalid` read, the rest zero; rows from `rows` on zero): the rows become the
// tile's 16 columns, their 16 pairs its rows (a 16 x 16 transpose of 32-bit pairs).
WBK_AMX_TARGET inline void pack_b_tile(const uint16_t* src, int64_t rows, int64_t ld, int64_t kvalid, uint16_t* dst) {
  const __mmask32 mask = kvalid >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << kvalid) - 1);
  __m512i r[16];
  for (int64_t i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_maskz_loadu_epi16(mask, src + i * ld) : _mm512_setzero_si512();
  transpose16(r);
  for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * 32, r[p]);
}

}  // namespace wbk
