// KV cache kernels: per-vector int8 quantization and appends into a preallocated cache.
//
// INT8 (the paper's KV cache): each head's K or V vector of one token (D values) gets
// one symmetric scale, scale = max|x| / 127, q = round(x / scale) in [-127, 127],
// so |x - q * scale| <= scale / 2. An all-zero vector gets scale 0 and is exact.
// Appends write T new tokens per sequence at that sequence's own position
// (ragged batches), converting fp32 to the cache dtype (fp16/bf16 round to nearest even).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace wbk {
namespace {

constexpr int W = VecF::W;

void quantize_row(const float* x, int8_t* q, float* scale_out, int64_t D) {
  VecF amax_v = VecF::zero();
  int64_t d = 0;
  for (; d + W <= D; d += W) amax_v = vmax(amax_v, vabs(VecF::load(x + d)));
  float amax = reduce_max(amax_v);
  for (; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));

  const float scale = amax / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  *scale_out = scale;
  const VecF vinv = VecF::set1(inv);
  d = 0;
  for (; d + W <= D; d += W) store_i8(q + d, round_nearest(VecF::load(x + d) * vinv), W);
  for (; d < D; ++d) {
    const float r = std::nearbyint(x[d] * inv);
    q[d] = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
  }
}

// Byte offset of value (t, d) within a plane of the tiled layout (decode_tiled.cpp).
inline int64_t tiled_offset(CacheLayout layout, int64_t t, int64_t d, int64_t D) {
  if (layout == CacheLayout::kKTiles)
    return (t / kTileTokens) * kTileTokens * D + (d / 4) * (4 * kTileTokens) + (t % kTileTokens) * 4 + d % 4;
  return (t / kVGroupTokens) * kVGroupTokens * D + d * kVGroupTokens + t % kVGroupTokens;
}

}  // namespace

void quantize_int8(const float* x, int8_t* q, float* scales, int64_t rows, int64_t D) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(D, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x + r * D, q + r * D, scales + r, D);
  });
}

void kv_cache_append(const AppendArgs& a) {
  // One row = one (batch, kv head, new token) vector of D values.
  const int64_t rows = a.B * a.Hkv * a.T;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(a.D, 1)), [&](int64_t begin, int64_t end) {
    std::vector<int8_t> row(a.layout == CacheLayout::kRows ? 0 : a.D);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r % a.T, bk = r / a.T, b = bk / a.Hkv;
      const int64_t dst_row = bk * a.Lmax + a.positions[b] + t;
      const float* src = a.src + r * a.D;
      switch (a.dtype) {
        case CacheDtype::kFloat32:
          std::copy(src, src + a.D, static_cast<float*>(a.cache) + dst_row * a.D);
          break;
        case CacheDtype::kFloat16: {
          auto* dst = static_cast<c10::Half*>(a.cache) + dst_row * a.D;
          for (int64_t d = 0; d < a.D; ++d) dst[d] = c10::Half(src[d]);
          break;
        }
        case CacheDtype::kBFloat16: {
          auto* dst = static_cast<c10::BFloat16*>(a.cache) + dst_row * a.D;
          for (int64_t d = 0; d < a.D; ++d) dst[d] = c10::BFloat16(src[d]);
          break;
        }
        case CacheDtype::kInt8:
          if (a.layout == CacheLayout::kRows) {
            quantize_row(src, static_cast<int8_t*>(a.cache) + dst_row * a.D, a.scales + dst_row, a.D);
          } else {  // quantized as a row, then scattered into the plane's tiles or groups
            int8_t* plane = static_cast<int8_t*>(a.cache) + bk * a.Lmax * a.D;
            const int64_t pos = a.positions[b] + t;
            quantize_row(src, row.data(), a.scales + dst_row, a.D);
            for (int64_t d = 0; d < a.D; ++d) plane[tiled_offset(a.layout, pos, d, a.D)] = row[d];
          }
          break;
      }
    }
  });
}

}  // namespace wbk
