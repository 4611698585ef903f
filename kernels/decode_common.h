// Pieces shared by the two decode-attention kernels (decode_attention.cpp: rows of any
// cache dtype; decode_tiled.cpp: the tiled int8 layout with integer scores and P.V).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace wbk {

// q [G, D] fp32 -> q8 [G, ldq] int8 (zero-padded), qmul[g] = the head's scale max|q| / 127,
// qbias[g] = kDotBias * sum(q8_g) (what dot_i8 adds, see simd.h).
inline void quantize_query(const float* q, int64_t G, int64_t D, int64_t ldq, int8_t* q8, float* qmul,
                           float* qbias) {
  for (int64_t g = 0; g < G; ++g) {
    const float* x = q + g * D;
    float amax = 0.0f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float s = amax / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
    int8_t* o = q8 + g * ldq;
    int64_t sum = 0;
    for (int64_t d = 0; d < D; ++d) {
      const int v = static_cast<int>(std::clamp(std::nearbyint(x[d] * inv), -127.0f, 127.0f));
      o[d] = static_cast<int8_t>(v);
      sum += v;
    }
    std::fill(o + D, o + ldq, int8_t{0});
    qmul[g] = s;
    qbias[g] = static_cast<float>(kDotBias * sum);
  }
}

// Split-KV: each (batch, head, split) left its unnormalised output in part_o [B H S, D] and
// its softmax (max, sum) in part_ml [B H S, 2]; rescale by exp(m_s - m), add, normalise.
inline void merge_splits(const DecodeArgs& a, const std::vector<float>& part_o, const std::vector<float>& part_ml) {
  const int64_t S = a.num_splits, D = a.D;
  at::parallel_for(0, a.B * a.H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < S; ++s)
        if (part_ml[(bh * S + s) * 2 + 1] > 0.0f) m = std::max(m, part_ml[(bh * S + s) * 2]);
      float* o = a.out + bh * D;
      std::fill(o, o + D, 0.0f);
      float l = 0.0f;
      for (int64_t s = 0; s < S; ++s) {
        const float ls = part_ml[(bh * S + s) * 2 + 1];
        if (ls == 0.0f) continue;  // an empty split (sequence shorter than the split count)
        const float w = std::exp(part_ml[(bh * S + s) * 2] - m);
        l += ls * w;
        const float* os = part_o.data() + (bh * S + s) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * os[d];
      }
      const float inv = 1.0f / l;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
}

// Where one (batch, head, split) task's result goes: out[b, h] normalised when there is one
// split, else its slot of part_o / part_ml for merge_splits.
inline void write_result(const DecodeArgs& a, int64_t b, int64_t h, int64_t s, const float* acc, float m, float l,
                         std::vector<float>& part_o, std::vector<float>& part_ml) {
  const int64_t D = a.D;
  if (a.num_splits == 1) {
    float* o = a.out + (b * a.H + h) * D;
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
  } else {
    const int64_t slot = (b * a.H + h) * a.num_splits + s;
    std::copy(acc, acc + D, part_o.begin() + slot * D);
    part_ml[slot * 2] = m;
    part_ml[slot * 2 + 1] = l;
  }
}

// Calls f(std::integral_constant<int, GC>) with GC = G for 1 <= G <= 8; larger groups
// are processed 8 heads at a time by the caller.
template <typename F>
void with_group(int64_t G, F&& f) {
  switch (G) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// The largest power of two <= n (n >= 1).
constexpr int floor_pow2(int n) { return n < 2 ? 1 : 2 * floor_pow2(n / 2); }

}  // namespace wbk
