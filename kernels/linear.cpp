// Linear layers y = x W^T with fp32 activations and fp32 or bf16 weights, accumulating in fp32.
//
// Layout: x [M, K] fp32, w [N, K] fp32 or bf16 (torch's nn.Linear layout), y [M, N] fp32.
//
// This is the decode path (M = batch, small): matrix-vector products, memory-bound on
// the weight bytes. Parallel split: blocks of 16 rows of W, pulled dynamically. Each
// block widens its W rows to fp32 in registers, four rows at a time (four FMA chains),
// against every row of x (which stays in L1/L2), so every weight byte is read from
// memory once per call; rows are prefetched 4 KB ahead.
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

// out[i] = x . w_i for four rows of length K, widened to fp32 in registers.
template <typename T>
inline void dot4(const float* x, const T* const* w, int64_t K, float* out) {
  VecF acc[4] = {VecF::zero(), VecF::zero(), VecF::zero(), VecF::zero()};
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    VecF xv = VecF::load(x + k);
    for (int i = 0; i < 4; ++i) acc[i] = fmadd(xv, Load<T>::full(w[i] + k), acc[i]);
  }
  if (k < K) {
    int rem = static_cast<int>(K - k);
    VecF xv = VecF::load(x + k, rem);
    for (int i = 0; i < 4; ++i) acc[i] = fmadd(xv, Load<T>::part(w[i] + k, rem), acc[i]);
  }
  reduce_add4(acc[0], acc[1], acc[2], acc[3], out);
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
      for (int64_t n = n0; n < n1; n += 4) {
        const int nr = static_cast<int>(std::min<int64_t>(4, n1 - n));
        const T* rows[4];
        for (int i = 0; i < 4; ++i) rows[i] = w + (n + std::min(i, nr - 1)) * K;  // short step: repeat
        for (int64_t m = 0; m < M; ++m) {
          float out[4];
          dot4<T>(x + m * K, rows, K, out);
          std::copy(out, out + nr, y + m * N + n);
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
