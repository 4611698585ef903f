// Linear layers y = x W^T with fp32 activations and fp32 or bf16 weights, accumulating in fp32.
//
// Layout: x [M, K] fp32, w [N, K] fp32 or bf16 (torch's nn.Linear layout), y [M, N] fp32.
//
// This is the decode path (M = batch, small): matrix-vector products, memory-bound on
// the weight bytes. Parallel split: blocks of 16 rows of W, pulled dynamically. Within a
// block, K is cut into 1024-element chunks; for each chunk, four W rows are widened to
// fp32 in registers and multiplied with four rows of x at a time (16 accumulators), so
// every weight byte is read from memory once per call and from L1 at most M / 4 times;
// the next rows are prefetched 4 KB ahead.
//
// Prefill (M large) is compute-bound and goes through bindings.cpp instead: torch's
// tuned fp32 GEMM, on panels of W widened to fp32 once when W is bf16.
#include <algorithm>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace wbk {
namespace {

constexpr int W = VecF::W;
constexpr int64_t kRowsPerTask = 16;
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kChunk = 1024;  // K elements per chunk

// y[m][j] += x_m . w_j over one K-chunk, for MB rows of x and four rows of W: MB x 4
// accumulators, so each loaded (and widened) W vector feeds MB FMAs and each x vector 4.
template <typename T, int MB>
inline void block_dot(const float* x, int64_t ldx, const T* const* w, int64_t kc, float* y, int64_t ldy, int nr) {
  VecF acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = VecF::zero();
  int64_t k = 0;
  for (; k + W <= kc; k += W) {
    VecF wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = Load<T>::full(w[j] + k);
    for (int m = 0; m < MB; ++m) {
      const VecF xv = VecF::load(x + m * ldx + k);
      for (int j = 0; j < 4; ++j) acc[m][j] = fmadd(xv, wv[j], acc[m][j]);
    }
  }
  if (k < kc) {
    const int rem = static_cast<int>(kc - k);
    VecF wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = Load<T>::part(w[j] + k, rem);
    for (int m = 0; m < MB; ++m) {
      const VecF xv = VecF::load(x + m * ldx + k, rem);
      for (int j = 0; j < 4; ++j) acc[m][j] = fmadd(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    float out[4];
    reduce_add4(acc[m][0], acc[m][1], acc[m][2], acc[m][3], out);
    for (int j = 0; j < nr; ++j) y[m * ldy + j] += out[j];
  }
}

template <typename T>
void matvec(const float* x, const T* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
  run_tasks(tasks, [&] {
    return [&](int64_t t) {
      const int64_t n0 = t * kRowsPerTask, n1 = std::min(N, n0 + kRowsPerTask);
      const int64_t row_bytes = K * static_cast<int64_t>(sizeof(T));
      const int64_t ahead = std::min(N, n1 + kPrefetchBytes / row_bytes + 1);
      for (int64_t n = n1; n < ahead; ++n) {
        const char* row = reinterpret_cast<const char*>(w + n * K);
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off, 0, 0);
      }
      for (int64_t m = 0; m < M; ++m) std::fill(y + m * N + n0, y + m * N + n1, 0.0f);
      // K in chunks: four W rows and up to four x rows of a chunk stay in L1 while every
      // block of x rows passes over them.
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        for (int64_t n = n0; n < n1; n += 4) {
          const int nr = static_cast<int>(std::min<int64_t>(4, n1 - n));
          const T* rows[4];
          for (int j = 0; j < 4; ++j) rows[j] = w + (n + std::min(j, nr - 1)) * K + k0;  // short: repeat
          int64_t m = 0;
          for (; m + 4 <= M; m += 4) block_dot<T, 4>(x + m * K + k0, K, rows, kc, y + m * N + n, N, nr);
          for (; m < M; ++m) block_dot<T, 1>(x + m * K + k0, K, rows, kc, y + m * N + n, N, nr);
        }
      }
    };
  });
}

}  // namespace

void linear_matvec(const float* x, const void* w, bool bf16, float* y, int64_t M, int64_t N, int64_t K) {
  if (bf16) {
    matvec(x, static_cast<const BFloat16*>(w), y, M, N, K);
  } else {
    matvec(x, static_cast<const float*>(w), y, M, N, K);
  }
}

}  // namespace wbk
