// Rotary position embedding (RoPE), rotate-half layout, in place.
//
// x [T, C] fp32 with rows ldx apart holds each token's head vectors side by side (for
// the model: the fused QKV output, [q heads | k heads | v heads]); the first `heads`
// vectors of D values in every row are rotated by their token's angles:
//
//   out[i]         = x[i] cos[i]         - x[i + D/2] sin[i]          (i < D/2)
//   out[i + D/2]   = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]
//
// with cos / sin [T, D] (Hugging Face's tables, both halves of a row equal). One call
// rotates q and k of every token, in place, instead of a chain of tensor ops per tensor.
// Partial rotary (Phi-4-mini): only the first R of each head's D values rotate (pairs i and
// i + R/2, tables [T, R]); the rest pass through.
#include <algorithm>

#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

namespace wbk {
namespace {

constexpr int W = VecF::W;

inline void rotate(float* v, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + W <= half; i += W) {
    const VecF a = VecF::load(v + i), b = VecF::load(v + half + i);
    (a * VecF::load(c + i) - b * VecF::load(s + i)).store(v + i);
    (b * VecF::load(c + half + i) + a * VecF::load(s + half + i)).store(v + half + i);
  }
  if (i < half) {
    const int n = static_cast<int>(half - i);
    const VecF a = VecF::load(v + i, n), b = VecF::load(v + half + i, n);
    (a * VecF::load(c + i, n) - b * VecF::load(s + i, n)).store(v + i, n);
    (b * VecF::load(c + half + i, n) + a * VecF::load(s + half + i, n)).store(v + half + i, n);
  }
}

}  // namespace

void rope_rotate_half(float* x, int64_t T, int64_t ldx, int64_t heads, int64_t D, int64_t R, const float* cos,
                      const float* sin) {
  const int64_t half = R / 2;
  // Parallel only when there is enough work to pay for waking the pool (prefill).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, heads * D));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) rotate(x + t * ldx + h * D, cos + t * R, sin + t * R, half);
  });
}

}  // namespace wbk
