// The one matrix-product building block that both prefill attention algorithms use.
//
//   C[M x N] (+)= A[M x K] . B[K x N]      all fp32, row-major, leading dims lda/ldb/ldc
//
// Register-blocked micro-kernel: an MR x (NV*W) tile of C lives in registers
// while the K loop broadcasts one A element per row and loads NV vectors of a B
// row. Loop order: column chunk (NV*W wide) outside, row panels inside, so one
// K x NR slice of B stays in L1/L2 while every row panel streams past it.
//
// Causal support without a materialised mask: with `diag`, row i of C may only
// see columns j <= i + diag. `gemm_packed_limit_n` stops each MR-row panel at the last
// column any of its rows can see (S = Q K^T: invisible keys are never computed,
// except inside the panel's own MR-wide triangle); `gemm_packed_limit_k` stops the
// reduction the same way (O = P V: P is zero beyond each row's limit).
//
// Both read B packed in NR-wide column panels (pack_b_panel, pack_b_columns), so each step
// of K loads one contiguous piece of B: rows of a plain row-major B a power of two apart
// (V's rows are D floats apart) fall into a few L1 sets, and every row panel of A then
// fetched the same block of B from L2 again.
#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace wbk {

#if defined(WBK_ISA_AVX512)
inline constexpr int kGemmMR = 12;  // 24 accumulators + 2 B vectors + 1 broadcast of 32 zmm
inline constexpr int kGemmNV = 2;
#elif defined(WBK_ISA_AVX2)
inline constexpr int kGemmMR = 6;  // 12 accumulators + 2 B vectors + 1 broadcast of 16 ymm
inline constexpr int kGemmNV = 2;
#else
inline constexpr int kGemmMR = 4;
inline constexpr int kGemmNV = 4;
#endif
inline constexpr int kGemmNR = kGemmNV * VecF::W;

// No causal limit.
inline constexpr int64_t kNoLimit = INT64_MAX / 4;

template <int MR, bool FullN>
inline void micro_tile(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                       int64_t ldc, int ncols, bool accumulate) {
  constexpr int NV = kGemmNV;
  constexpr int W = VecF::W;
  int nv_cols[NV];
  for (int v = 0; v < NV; ++v) nv_cols[v] = FullN ? W : std::clamp(ncols - v * W, 0, W);

  VecF acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = VecF::zero();

  for (int64_t p = 0; p < K; ++p) {
    const float* brow = B + p * ldb;
    VecF b[NV];
    for (int v = 0; v < NV; ++v) {
      if (FullN) {
        b[v] = VecF::load(brow + v * W);
      } else {
        b[v] = nv_cols[v] > 0 ? VecF::load(brow + v * W, nv_cols[v]) : VecF::zero();
      }
    }
    for (int r = 0; r < MR; ++r) {
      VecF a = VecF::set1(A[r * lda + p]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(a, b[v], acc[r][v]);
    }
  }

  for (int r = 0; r < MR; ++r) {
    float* crow = C + r * ldc;
    for (int v = 0; v < NV; ++v) {
      if (FullN) {
        VecF c = accumulate ? acc[r][v] + VecF::load(crow + v * W) : acc[r][v];
        c.store(crow + v * W);
      } else if (nv_cols[v] > 0) {
        VecF c = accumulate ? acc[r][v] + VecF::load(crow + v * W, nv_cols[v]) : acc[r][v];
        c.store(crow + v * W, nv_cols[v]);
      }
    }
  }
}

template <bool FullN>
inline void micro_tile_rows(int mr, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                            float* C, int64_t ldc, int ncols, bool accumulate) {
  // The row count is a template parameter so the accumulators stay in registers.
#define WBK_TILE(R)                                                               \
  case R:                                                                         \
    if constexpr (R <= kGemmMR)                                                   \
      micro_tile<R, FullN>(K, A, lda, B, ldb, C, ldc, ncols, accumulate);         \
    break;
  switch (mr) {
    WBK_TILE(1)
    WBK_TILE(2)
    WBK_TILE(3)
    WBK_TILE(4)
    WBK_TILE(5)
    WBK_TILE(6)
    WBK_TILE(7)
    WBK_TILE(8)
    WBK_TILE(9)
    WBK_TILE(10)
    WBK_TILE(11)
    WBK_TILE(12)
    default:
      break;
  }
#undef WBK_TILE
  static_assert(kGemmMR <= 12, "extend micro_tile_rows for a larger MR");
}

inline void tile(int mr, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc, int ncols, bool accumulate) {
  if (ncols == kGemmNR) {
    micro_tile_rows<true>(mr, K, A, lda, B, ldb, C, ldc, ncols, accumulate);
  } else {
    micro_tile_rows<false>(mr, K, A, lda, B, ldb, C, ldc, ncols, accumulate);
  }
}

// C = A . Bp (or C += A . Bp) with B packed in NR-wide column panels: panel p holds
// columns [p NR, p NR + NR) as K rows of NR floats (layout [ceil(N / NR)][K][NR], zero
// padded), so the micro-kernel streams it sequentially. Each row panel of C stops at
// the last NR-wide column panel its rows may see, and always computes whole column
// panels: up to NR - 1 columns past a row's limit (or past N) are computed and stored,
// which costs less than a masked tile. C must have room for round_up(N, NR) columns.
inline void gemm_packed_limit_n(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* Bp,
                                float* C, int64_t ldc, int64_t diag, bool accumulate) {
  for (int64_t j0 = 0; j0 < N; j0 += kGemmNR) {
    const float* panel = Bp + (j0 / kGemmNR) * K * kGemmNR;
    for (int64_t i0 = 0; i0 < M; i0 += kGemmMR) {
      int mr = static_cast<int>(std::min<int64_t>(kGemmMR, M - i0));
      if (j0 >= std::min<int64_t>(N, i0 + mr + diag)) continue;  // last row's columns: < i + diag + 1
      micro_tile_rows<true>(mr, K, A + i0 * lda, lda, panel, kGemmNR, C + i0 * ldc + j0, ldc, kGemmNR, accumulate);
    }
  }
}

// Pack rows x K row-major `src` (one row per output column, e.g. keys [Nk, D]) into the
// panel layout gemm_packed_limit_n reads: dst[p][k][j] = src[p NR + j][k], zero padded.
template <typename T, typename ToFloat>
inline void pack_b_panel(const T* src, int64_t rows, int64_t K, int64_t panel, float* dst, ToFloat to_float) {
  const int64_t j_begin = panel * kGemmNR;
  const int64_t n = std::min<int64_t>(kGemmNR, rows - j_begin);
  for (int64_t j = 0; j < kGemmNR; ++j) {
    if (j < n) {
      const T* row = src + (j_begin + j) * K;
      for (int64_t k = 0; k < K; ++k) dst[k * kGemmNR + j] = to_float(row[k]);
    } else {
      for (int64_t k = 0; k < K; ++k) dst[k * kGemmNR + j] = 0.0f;
    }
  }
}

// Pack row-major src [K][N] (e.g. values [Nk, D]) into NR-wide column panels:
// dst[p][k][j] = src[k][p NR + j], panel p at dst + p * panel_stride, zero padded past N.
template <typename T, typename ToFloat>
inline void pack_b_columns(const T* src, int64_t K, int64_t N, int64_t panel, int64_t panel_stride, float* dst,
                           ToFloat to_float) {
  const int64_t j_begin = panel * kGemmNR;
  const int64_t n = std::min<int64_t>(kGemmNR, N - j_begin);
  float* out = dst + panel * panel_stride;
  for (int64_t k = 0; k < K; ++k) {
    const T* row = src + k * N + j_begin;
    for (int64_t j = 0; j < n; ++j) out[k * kGemmNR + j] = to_float(row[j]);
    for (int64_t j = n; j < kGemmNR; ++j) out[k * kGemmNR + j] = 0.0f;
  }
}

// C = A . B (or C += A . B) with B packed by pack_b_columns (panel p of columns at
// Bp + p * panel_stride, its row k at + k NR), each row panel's reduction stopping at the
// last index its rows may see. The reduction is cut into kGemmKC-long blocks so the block
// of B in use (kGemmKC x N) stays in L2 while every row panel and column chunk passes over it.
inline constexpr int64_t kGemmKC = 256;

inline void gemm_packed_limit_k(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* Bp,
                                int64_t panel_stride, float* C, int64_t ldc, int64_t diag, bool accumulate) {
  for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += kGemmKC) {
    for (int64_t j0 = 0; j0 < N; j0 += kGemmNR) {
      int ncols = static_cast<int>(std::min<int64_t>(kGemmNR, N - j0));
      const float* panel = Bp + (j0 / kGemmNR) * panel_stride + k0 * kGemmNR;
      for (int64_t i0 = 0; i0 < M; i0 += kGemmMR) {
        int mr = static_cast<int>(std::min<int64_t>(kGemmMR, M - i0));
        int64_t k_end = std::min({k0 + kGemmKC, K, std::max<int64_t>(0, i0 + mr + diag)});
        if (k_end <= k0 && k0 > 0) continue;  // nothing visible in this block; C already written
        tile(mr, std::max<int64_t>(0, k_end - k0), A + i0 * lda + k0, lda, panel, kGemmNR, C + i0 * ldc + j0, ldc,
             ncols, accumulate || k0 > 0);
      }
    }
  }
}

}  // namespace wbk
