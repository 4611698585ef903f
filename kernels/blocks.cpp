// Block-quantized weights: layouts, dequantization, our quantizers, and the matrix-vector
// kernel of decode (blocks.h says what each format stores and how rows are laid out).
//
// block_matvec, y [M, N] = x [M, K] . w^T, memory-bound on w's bytes:
//   - each row of x is quantized once per call, one scale per 32 values, to int16 (the default,
//     set_block_activation_bits(16): scale = max |x| / 32767, relative error at most 1.5e-5 of
//     the chunk's largest value, offsets with the exact fp32 sums) or to int8 (8: scale =
//     max |x| / 127, as llama.cpp's q8 activations, whose error moves a model's logits
//     visibly; the formats' offsets and minimums taken with the sums of the rounded values, so
//     y is exactly the dequantized weights times the rounded x, up to fp32 accumulation);
//   - int8: a weight chunk of 32 is one vector of bytes (nibbles, fifth and sixth bits put
//     together), multiplied with the activations four products an int32 lane (pmaddubsw, or
//     VNNI's vpdpbusd), half the instructions of the int16 path a weight;
//   - a weight chunk of 32 is widened to int16 in registers (nibbles, fifth and sixth bits
//     put together) and multiplied with the activations in pairs into int32 lanes (pmaddwd, or
//     VNNI's vpdpwssd): exact integer sums, no float work per weight;
//   - each chunk's int32 lanes go into fp32 accumulators times the chunk's factor (weight scale
//     times activation scale), the factors of eight chunks computed together in fp32 lanes, and
//     the minimums and offsets likewise with the activations' sums. Hence the planar layout of
//     the blocks of 32: eight blocks' scales are one load. A K-quant super-block is eight
//     chunks (q6_k: sixteen 16-weight sub-blocks);
//   - parallel split: rows of w in tasks of 16, one contiguous range of tasks per thread (every
//     row costs the same), so each thread streams one run of memory. With M > 1 each row of w
//     is read from memory once and from L1 for the further rows of x.
#include "blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace wbk {

uint16_t float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504: inf
  if (abs < 0x38800000u) {  // a subnormal half (or zero): round the value times 2^24 to an integer
    float a;
    std::memcpy(&a, &abs, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  // normal: rebias the exponent, round the 23-bit mantissa to 10 bits, to nearest even
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float_fast(h);
}
inline void put_f16(uint8_t* p, float f) {
  const uint16_t h = float_to_half_bits(f);
  std::memcpy(p, &h, 2);
}
inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// -- layouts ------------------------------------------------------------------------------

// The fields of a GGUF block, in the order of the kernels' layout: where each sits in the GGUF
// block, its bytes, and what it is.
enum class Role { kQuants, kHigh, kScale, kMin };
struct Field {
  int64_t offset, size;
  Role role;
};
struct PlanarFormat {
  int n;  // fields
  Field f[4];
  int64_t bytes;   // per block
  int64_t block;   // weights per block
};
// Quants, [fifth bits], scales, [minimums]. i4_g128's block order (it has no GGUF type) is
// ours: fp16 scale, fp16 offset, 64 bytes of quants, the same fields as Q4_1's.
PlanarFormat planar(WeightDtype t) {
  constexpr Role Q = Role::kQuants, H = Role::kHigh, D = Role::kScale, M = Role::kMin;
  switch (t) {
    case WeightDtype::kQ4_0: return {2, {{2, 16, Q}, {0, 2, D}}, 18, 32};
    case WeightDtype::kQ4_1: return {3, {{4, 16, Q}, {0, 2, D}, {2, 2, M}}, 20, 32};
    case WeightDtype::kQ5_0: return {3, {{6, 16, Q}, {2, 4, H}, {0, 2, D}}, 22, 32};
    case WeightDtype::kQ5_1: return {4, {{8, 16, Q}, {4, 4, H}, {0, 2, D}, {2, 2, M}}, 24, 32};
    case WeightDtype::kQ8_0: return {2, {{2, 32, Q}, {0, 2, D}}, 34, 32};
    case WeightDtype::kI4G128: return {3, {{4, 64, Q}, {0, 2, D}, {2, 2, M}}, 68, kI4Group};
    default: return {0, {}, 0, 0};
  }
}

// The kernels' layout of these formats: a row in groups of 8 chunks of 32 weights (8 blocks of
// 32, or 2 of i4_g128's 128; the last group of a row may hold fewer), each group its blocks'
// quants one after another, then their fifth bits, scales and minimums. One forward stream a
// row (fully planar rows, quants then all scales, read measured 1.8x slower from memory on one
// core: the prefetchers followed two streams a row poorly), and a group's eight scales one load.
struct Group {
  const uint8_t *qs, *qh, *d, *m;  // null where the format has no such field
  int64_t blocks;
};
inline int64_t group_blocks(const PlanarFormat& pf) { return 8 * kBlockChunk / pf.block; }
Group group_at(const PlanarFormat& pf, const uint8_t* row, int64_t K, int64_t g) {
  const int64_t per = group_blocks(pf), n = std::min(per, K / pf.block - g * per);
  const uint8_t* p = row + g * per * pf.bytes;
  Group r{nullptr, nullptr, nullptr, nullptr, n};
  for (int i = 0; i < pf.n; ++i) {
    const uint8_t** field = pf.f[i].role == Role::kQuants ? &r.qs : pf.f[i].role == Role::kHigh ? &r.qh
                            : pf.f[i].role == Role::kScale  ? &r.d : &r.m;
    *field = p;
    p += n * pf.f[i].size;
  }
  return r;
}

// Where weight e (0-31) of a Q5 block keeps its fifth bit in the kernels' 32-bit word: the
// repack moves GGUF's bit e there, so that VecS::fifth_bits expands a half with one shift.
constexpr int q5_bit(int e) { return (e % 16) / 2 + 16 * (e % 2) + 8 * (e / 16); }

bool is_k_quant(WeightDtype t) {
  return t == WeightDtype::kQ4_K || t == WeightDtype::kQ5_K || t == WeightDtype::kQ6_K;
}

int64_t super_block_bytes(WeightDtype t) {
  return t == WeightDtype::kQ4_K ? 144 : t == WeightDtype::kQ5_K ? 176 : 210;
}

}  // namespace

BlockGeometry block_geometry(WeightDtype t) {
  if (!is_block(t)) return {0, 0};
  if (is_k_quant(t)) return {kSuperBlock, super_block_bytes(t)};
  return {planar(t).block, planar(t).bytes};
}

const char* block_row_error(WeightDtype t, int64_t K) {
  if (!is_block(t)) return "not a block-quantized dtype";
  if (is_k_quant(t)) return K > 0 && K % kSuperBlock == 0 ? "" : "a K-quant row must be whole super-blocks of 256";
  if (t == WeightDtype::kI4G128) return K > 0 && K % kI4Group == 0 ? "" : "an i4_g128 row must be whole groups of 128";
  return K > 0 && K % kBlockChunk == 0 ? "" : "a row must be whole blocks of 32";
}

int64_t block_row_bytes(WeightDtype t, int64_t K) {
  const BlockGeometry g = block_geometry(t);
  return K / g.weights * g.bytes;
}

void repack_block_rows(WeightDtype t, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t K, bool to_kernel) {
  const int64_t row_bytes = block_row_bytes(t, K);
  const PlanarFormat pf = planar(t);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* s = src + r * row_bytes;
      uint8_t* d = dst + r * row_bytes;
      if (pf.n == 0) {  // K-quants: the same bytes
        std::memcpy(d, s, static_cast<size_t>(row_bytes));
        continue;
      }
      const int64_t nb = K / pf.block, per = group_blocks(pf);
      uint8_t* kernel_row = to_kernel ? d : const_cast<uint8_t*>(s);
      uint8_t* gguf_row = to_kernel ? const_cast<uint8_t*>(s) : d;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t g = b / per, j = b % per, n = std::min(per, nb - g * per);
        int64_t at = g * per * pf.bytes;  // the group's start; then its fields, each n blocks long
        for (int i = 0; i < pf.n; ++i) {
          const Field f = pf.f[i];
          uint8_t* block_field = kernel_row + at + j * f.size;
          uint8_t* gguf_field = gguf_row + b * pf.bytes + f.offset;
          at += n * f.size;
          if (f.role == Role::kHigh) {  // the fifth bits: GGUF's bit e <-> the kernels' bit q5_bit(e)
            const uint32_t from = u32_at(to_kernel ? gguf_field : block_field);
            uint32_t to = 0;
            for (int e = 0; e < 32; ++e) {
              const int src = to_kernel ? e : q5_bit(e), dst = to_kernel ? q5_bit(e) : e;
              to |= ((from >> src) & 1u) << dst;
            }
            std::memcpy(to_kernel ? block_field : gguf_field, &to, 4);
          } else if (to_kernel) {
            std::memcpy(block_field, gguf_field, static_cast<size_t>(f.size));
          } else {
            std::memcpy(gguf_field, block_field, static_cast<size_t>(f.size));
          }
        }
      }
    }
  });
}

// -- dequantization (the reference every kernel is held to) --------------------------------

namespace {

// Q4_K / Q5_K: sub-block j's 6-bit scale and minimum from the super-block's 12 bytes.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The 32 weights of chunk c (weights 32 c .. 32 c + 31) of one row.
void dequantize_chunk(WeightDtype t, const uint8_t* row, int64_t K, int64_t c, float* out) {
  if (is_k_quant(t)) {
    const uint8_t* blk = row + (c / 8) * super_block_bytes(t);
    const int j = static_cast<int>(c % 8);
    if (t == WeightDtype::kQ6_K) {
      const float d = f16_at(blk + 208);
      const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const int n = j / 4, k = j % 4;  // half of the super-block, quarter of the half
      const uint8_t* ql = blk + 64 * n + (k % 2) * 32;
      const uint8_t* qh = blk + 128 + 32 * n;
      for (int l = 0; l < 32; ++l) {
        const int low = k < 2 ? (ql[l] & 0xF) : (ql[l] >> 4);
        const int q = (low | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
        out[l] = d * sc[8 * n + 2 * k + l / 16] * q;
      }
      return;
    }
    const float d = f16_at(blk), dmin = f16_at(blk + 2);
    uint8_t sc, m;
    scale_min_k4(j, blk + 4, &sc, &m);
    const float dl = d * sc, ml = dmin * m;
    const bool q5 = t == WeightDtype::kQ5_K;
    const uint8_t* qs = blk + (q5 ? 48 : 16) + 32 * (j / 2);
    const uint8_t* qh = blk + 16;
    for (int l = 0; l < 32; ++l) {
      int q = j % 2 ? qs[l] >> 4 : qs[l] & 0xF;
      if (q5) q += ((qh[l] >> j) & 1) << 4;
      out[l] = dl * q - ml;
    }
    return;
  }
  const PlanarFormat pf = planar(t);
  const Group g = group_at(pf, row, K, c / 8);
  const int64_t j = c % 8, b = j * kBlockChunk / pf.block;  // the chunk in its group, its block there
  const float d = f16_at(g.d + 2 * b);
  const float m = g.m ? f16_at(g.m + 2 * b) : 0.0f;
  if (t == WeightDtype::kQ8_0) {
    const auto* qs = reinterpret_cast<const int8_t*>(g.qs + 32 * j);
    for (int l = 0; l < 32; ++l) out[l] = d * qs[l];
    return;
  }
  const uint8_t* qs = g.qs + 16 * j;
  const uint32_t qh = g.qh ? u32_at(g.qh + 4 * j) : 0;
  const int offset = t == WeightDtype::kQ4_0 ? 8 : t == WeightDtype::kQ5_0 ? 16 : 0;
  for (int l = 0; l < 16; ++l) {
    const int lo = (qs[l] & 0xF) | (((qh >> q5_bit(l)) & 1) << 4);
    const int hi = (qs[l] >> 4) | (((qh >> q5_bit(l + 16)) & 1) << 4);
    out[l] = d * (lo - offset) + m;
    out[l + 16] = d * (hi - offset) + m;
  }
}

}  // namespace

void dequantize_block_range_reference(WeightDtype t, const uint8_t* row, int64_t K, int64_t k0, int64_t n,
                                      float* out) {
  for (int64_t c = k0 / kBlockChunk; c < (k0 + n) / kBlockChunk; ++c)
    dequantize_chunk(t, row, K, c, out + (c * kBlockChunk - k0));
}

void dequantize_block_rows(WeightDtype t, const uint8_t* w, const int64_t* index, int64_t count, int64_t K,
                           float* out, bool reference) {
  const int64_t row_bytes = block_row_bytes(t, K);
  at::parallel_for(0, count, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = w + (index ? index[r] : r) * row_bytes;
      if (reference)
        dequantize_block_range_reference(t, row, K, 0, K, out + r * K);
      else
        dequantize_block_range(t, row, K, 0, K, out + r * K);
    }
  });
}

// -- our quantizers ---------------------------------------------------------------------------

namespace {

// The scale and offset of an asymmetric fit x ~ scale q + offset, q in [0, qmax], searched
// as llama.cpp's K-quants do (a grid of candidate scales around (max - min) / qmax, each
// refitted by least squares with every weight counted by |x| plus the mean |x|). With
// clamp_min the offset is at most 0 (K-quants store -offset as an unsigned minimum).
void fit_affine(const float* x, int n, int qmax, bool clamp_min, float* scale, float* offset) {
  float lo = x[0], hi = x[0], sum_abs = 0.0f;
  for (int i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sum_abs += std::fabs(x[i]);
  }
  if (clamp_min) lo = std::min(lo, 0.0f);
  if (hi == lo) {
    *scale = 0.0f;
    *offset = lo;
    return;
  }
  const float mean_abs = sum_abs / n;
  float wsum = 0.0f, wx = 0.0f;
  std::vector<float> wts(n);
  for (int i = 0; i < n; ++i) {
    wts[i] = mean_abs + std::fabs(x[i]);
    wsum += wts[i];
    wx += wts[i] * x[i];
  }
  auto error = [&](float s, float o) {
    float e = 0.0f;
    const float inv = s != 0.0f ? 1.0f / s : 0.0f;
    for (int i = 0; i < n; ++i) {
      const int q = std::clamp(static_cast<int>(std::nearbyint((x[i] - o) * inv)), 0, qmax);
      const float r = s * q + o - x[i];
      e += wts[i] * r * r;
    }
    return e;
  };
  float best_s = (hi - lo) / qmax, best_o = lo;
  float best_e = error(best_s, best_o);
  for (int step = 0; step <= 20; ++step) {
    const float iscale = (qmax - 1.0f + 0.1f * step) / (hi - lo);
    float sq = 0.0f, sq2 = 0.0f, sqx = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int q = std::clamp(static_cast<int>(std::nearbyint(iscale * (x[i] - lo))), 0, qmax);
      sq += wts[i] * q;
      sq2 += wts[i] * q * q;
      sqx += wts[i] * q * x[i];
    }
    const float det = wsum * sq2 - sq * sq;
    if (det <= 0.0f) continue;
    float s = (wsum * sqx - sq * wx) / det, o = (sq2 * wx - sq * sqx) / det;
    if (clamp_min && o > 0.0f) {
      o = 0.0f;
      s = sqx / sq2;
    }
    if (s <= 0.0f) continue;
    const float e = error(s, o);
    if (e < best_e) {
      best_e = e;
      best_s = s;
      best_o = o;
    }
  }
  *scale = best_s;
  *offset = best_o;
}

// The scale of a symmetric fit x ~ scale q, q in [-qneg, qneg - 1] (Q6_K: 32; q4_0 / int4-g32:
// 8): candidates around the one mapping the largest-magnitude value to -qneg, each refitted by
// least squares; the one with the least squared error.
float fit_symmetric(const float* x, int n, int qneg) {
  float amax = 0.0f, vmax = 0.0f;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      vmax = x[i];
    }
  if (amax == 0.0f) return 0.0f;
  float best_s = vmax / -qneg, best_gain = -1.0f;
  for (int step = -9; step <= 9; ++step) {
    const float iscale = -(qneg + 0.1f * step) / vmax;
    float sxl = 0.0f, sll = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int q = std::clamp(static_cast<int>(std::nearbyint(iscale * x[i])), -qneg, qneg - 1);
      sxl += x[i] * q;
      sll += static_cast<float>(q) * q;
    }
    if (sll > 0.0f && sxl * sxl / sll > best_gain) {  // the least squared error: the largest (x.q)^2 / q.q
      best_gain = sxl * sxl / sll;
      best_s = sxl / sll;
    }
  }
  return best_s;
}

inline int round_clamp(float v, int lo, int hi) { return std::clamp(static_cast<int>(std::nearbyint(v)), lo, hi); }

// GGUF's reference quantizers of the blocks of 32 (gguf-py and ggml round the same way).
void quantize_block32(WeightDtype t, const float* x, uint8_t* out, bool search) {
  int q[32];
  float d = 0.0f, m = 0.0f;
  if (t == WeightDtype::kQ8_0) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; ++i) q[i] = static_cast<int>(std::round(x[i] * id));
    put_f16(out, d);
    for (int i = 0; i < 32; ++i) out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(q[i]));
    return;
  }
  const bool q5 = t == WeightDtype::kQ5_0 || t == WeightDtype::kQ5_1;
  const bool affine = t == WeightDtype::kQ4_1 || t == WeightDtype::kQ5_1;
  const int levels = q5 ? 32 : 16;
  if (affine) {
    float lo = x[0], hi = x[0];
    for (int i = 0; i < 32; ++i) {
      lo = std::min(lo, x[i]);
      hi = std::max(hi, x[i]);
    }
    d = (hi - lo) / (levels - 1);
    m = lo;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; ++i) q[i] = std::min(levels - 1, static_cast<int>(static_cast<int8_t>((x[i] - lo) * id + 0.5f)));
  } else if (search) {  // our symmetric int4 (int4-g32): the least-squares scale, stored in fp16
    d = half_to_float(float_to_half_bits(fit_symmetric(x, 32, levels / 2)));
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; ++i) q[i] = round_clamp(x[i] * id, -levels / 2, levels / 2 - 1) + levels / 2;
  } else {
    float amax = 0.0f, vmax = 0.0f;
    for (int i = 0; i < 32; ++i)
      if (std::fabs(x[i]) > amax) {
        amax = std::fabs(x[i]);
        vmax = x[i];
      }
    d = vmax / -(levels / 2);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; ++i)
      q[i] = std::min(levels - 1, static_cast<int>(static_cast<int8_t>(x[i] * id + (levels / 2 + 0.5f))));
  }
  const PlanarFormat pf = planar(t);
  put_f16(out, d);
  if (affine) put_f16(out + 2, m);
  uint8_t* qs = out + pf.f[0].offset;
  for (int i = 0; i < 16; ++i) qs[i] = static_cast<uint8_t>((q[i] & 0xF) | ((q[i + 16] & 0xF) << 4));
  if (q5) {
    uint32_t qh = 0;
    for (int i = 0; i < 32; ++i) qh |= static_cast<uint32_t>((q[i] >> 4) & 1) << i;
    std::memcpy(out + pf.f[1].offset, &qh, 4);
  }
}

void quantize_q4k_q5k(const float* x, uint8_t* out, bool q5) {
  const int qmax = q5 ? 31 : 15;
  float scales[8], mins[8];
  for (int j = 0; j < 8; ++j) {
    float offset;
    fit_affine(x + 32 * j, 32, qmax, true, &scales[j], &offset);
    mins[j] = -offset;
  }
  float max_scale = 0.0f, max_min = 0.0f;
  for (int j = 0; j < 8; ++j) {
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  uint8_t ls[8], lm[8];
  const float inv_s = max_scale > 0.0f ? 63.0f / max_scale : 0.0f, inv_m = max_min > 0.0f ? 63.0f / max_min : 0.0f;
  for (int j = 0; j < 8; ++j) {
    ls[j] = static_cast<uint8_t>(round_clamp(inv_s * scales[j], 0, 63));
    lm[j] = static_cast<uint8_t>(round_clamp(inv_m * mins[j], 0, 63));
  }
  put_f16(out, max_scale / 63.0f);
  put_f16(out + 2, max_min / 63.0f);
  uint8_t* sc = out + 4;
  std::memset(sc, 0, 12);
  for (int j = 0; j < 4; ++j) {
    sc[j] = ls[j];
    sc[j + 4] = lm[j];
  }
  for (int j = 4; j < 8; ++j) {
    sc[j + 4] = static_cast<uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
    sc[j - 4] |= static_cast<uint8_t>((ls[j] >> 4) << 6);
    sc[j] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
  }
  const float d = f16_at(out), dmin = f16_at(out + 2);
  int q[256];
  for (int j = 0; j < 8; ++j) {
    uint8_t s, m;
    scale_min_k4(j, sc, &s, &m);
    const float dl = d * s, ml = dmin * m;
    for (int l = 0; l < 32; ++l) q[32 * j + l] = dl != 0.0f ? round_clamp((x[32 * j + l] + ml) / dl, 0, qmax) : 0;
  }
  uint8_t* qh = out + 16;
  uint8_t* qs = out + (q5 ? 48 : 16);
  if (q5) std::memset(qh, 0, 32);
  for (int p = 0; p < 4; ++p)
    for (int l = 0; l < 32; ++l) {
      const int a = q[64 * p + l], b = q[64 * p + 32 + l];
      qs[32 * p + l] = static_cast<uint8_t>((a & 0xF) | ((b & 0xF) << 4));
      if (q5) qh[l] |= static_cast<uint8_t>((((a >> 4) & 1) << (2 * p)) | (((b >> 4) & 1) << (2 * p + 1)));
    }
}

void quantize_q6k(const float* x, uint8_t* out) {
  float scales[16], max_abs = 0.0f, max_scale = 0.0f;
  for (int i = 0; i < 16; ++i) {
    scales[i] = fit_symmetric(x + 16 * i, 16, 32);
    if (std::fabs(scales[i]) > max_abs) {
      max_abs = std::fabs(scales[i]);
      max_scale = scales[i];
    }
  }
  auto* sc = reinterpret_cast<int8_t*>(out + 192);
  const float iscale = max_scale != 0.0f ? -128.0f / max_scale : 0.0f;
  put_f16(out + 208, iscale != 0.0f ? 1.0f / iscale : 0.0f);
  for (int i = 0; i < 16; ++i) sc[i] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * scales[i]))));
  const float d = f16_at(out + 208);
  int q[256];
  for (int i = 0; i < 16; ++i) {
    const float dd = d * sc[i];
    for (int l = 0; l < 16; ++l) q[16 * i + l] = (dd != 0.0f ? round_clamp(x[16 * i + l] / dd, -32, 31) : 0) + 32;
  }
  uint8_t* ql = out;
  uint8_t* qh = out + 128;
  for (int n = 0; n < 2; ++n)
    for (int l = 0; l < 32; ++l) {
      const int q1 = q[128 * n + l], q2 = q[128 * n + l + 32], q3 = q[128 * n + l + 64], q4 = q[128 * n + l + 96];
      ql[64 * n + l] = static_cast<uint8_t>((q1 & 0xF) | ((q3 & 0xF) << 4));
      ql[64 * n + l + 32] = static_cast<uint8_t>((q2 & 0xF) | ((q4 & 0xF) << 4));
      qh[32 * n + l] = static_cast<uint8_t>((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
    }
}

// One group of 128 in its block order: fp16 scale, fp16 offset, 64 bytes of quants (chunk c
// of 32 in bytes 16 c .. 16 c + 15, as a Q4_1 block's).
void quantize_i4g128(const float* x, uint8_t* out) {
  float s, o;
  fit_affine(x, static_cast<int>(kI4Group), 15, false, &s, &o);
  put_f16(out, s);
  put_f16(out + 2, o);
  const float d = f16_at(out), m = f16_at(out + 2);
  for (int c = 0; c < kI4Group / 32; ++c) {
    uint8_t* qs = out + 4 + 16 * c;
    const float* xc = x + 32 * c;
    for (int l = 0; l < 16; ++l) {
      const int lo = d != 0.0f ? round_clamp((xc[l] - m) / d, 0, 15) : 0;
      const int hi = d != 0.0f ? round_clamp((xc[l + 16] - m) / d, 0, 15) : 0;
      qs[l] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

}  // namespace

void quantize_block_rows(WeightDtype t, const float* x, uint8_t* out, int64_t rows, int64_t K, bool search) {
  const int64_t row_bytes = block_row_bytes(t, K);
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * K;
      uint8_t* o = out + r * row_bytes;
      if (t == WeightDtype::kI4G128) {
        for (int64_t g = 0; g < K / kI4Group; ++g) quantize_i4g128(xr + g * kI4Group, o + g * 68);
      } else if (is_k_quant(t)) {
        const int64_t bytes = super_block_bytes(t);
        for (int64_t b = 0; b < K / kSuperBlock; ++b) {
          if (t == WeightDtype::kQ6_K)
            quantize_q6k(xr + b * kSuperBlock, o + b * bytes);
          else
            quantize_q4k_q5k(xr + b * kSuperBlock, o + b * bytes, t == WeightDtype::kQ5_K);
        }
      } else {
        const int64_t bytes = planar(t).bytes;
        for (int64_t b = 0; b < K / kBlockChunk; ++b) quantize_block32(t, xr + b * kBlockChunk, o + b * bytes, search);
      }
    }
  });
}

// -- the matrix-vector kernel ---------------------------------------------------------------

const char* block_dot_isa() { return kBlockDotIsa; }

namespace {

// One row of x quantized for the dot products: q [K] int16, and per chunk of 32 its scale
// and the exact fp32 sum of its values.
struct Acts {
  const int16_t* q;
  const float* scale;
  const float* sum;    // per chunk of 32
  const float* sum16;  // per 16 (q6_k's sub-blocks)
};

void quantize_acts(const float* x, int64_t K, int16_t* q, float* scale, float* sum, float* sum16) {
  for (int64_t c = 0; c < K / kBlockChunk; ++c) {
    const float* xc = x + c * kBlockChunk;
    float amax = 0.0f, s0 = 0.0f, s1 = 0.0f;
    for (int i = 0; i < 16; ++i) {
      amax = std::max(amax, std::max(std::fabs(xc[i]), std::fabs(xc[i + 16])));
      s0 += xc[i];
      s1 += xc[i + 16];
    }
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int i = 0; i < kBlockChunk; ++i) q[c * kBlockChunk + i] = static_cast<int16_t>(std::nearbyint(xc[i] * inv));
    scale[c] = amax / 32767.0f;
    sum[c] = s0 + s1;
    sum16[2 * c] = s0;
    sum16[2 * c + 1] = s1;
  }
}

// The same, quantized to int8 in [-127, 127]; the sums are of the rounded values (times the
// scale), so that the offsets and minimums are taken with the x the products see.
struct Acts8 {
  const int8_t* q;
  const float* scale;
  const float* sum;
  const float* sum16;
};

void quantize_acts8(const float* x, int64_t K, int8_t* q, float* scale, float* sum, float* sum16) {
  for (int64_t c = 0; c < K / kBlockChunk; ++c) {
    const float* xc = x + c * kBlockChunk;
    float amax = 0.0f;
    for (int i = 0; i < kBlockChunk; ++i) amax = std::max(amax, std::fabs(xc[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int s0 = 0, s1 = 0;
    for (int i = 0; i < kBlockChunk; ++i) {
      const int v = static_cast<int>(std::nearbyint(xc[i] * inv));
      q[c * kBlockChunk + i] = static_cast<int8_t>(v);
      (i < 16 ? s0 : s1) += v;
    }
    const float d = amax / 127.0f;
    scale[c] = d;
    sum[c] = d * static_cast<float>(s0 + s1);
    sum16[2 * c] = d * static_cast<float>(s0);
    sum16[2 * c + 1] = d * static_cast<float>(s1);
  }
}

std::atomic<int> g_activation_bits{16};

// 8 floats from p[0 .. n) (the rest 0), 8 halves likewise.
inline Vec8F load8(const float* p, int64_t n) {
  if (n >= 8) return Vec8F::load(p);
  float t[8] = {};
  std::copy(p, p + n, t);
  return Vec8F::load(t);
}
inline Vec8F load8_f16(const uint8_t* p, int64_t n) {
  if (n >= 8) return Vec8F::load_f16(reinterpret_cast<const uint16_t*>(p));
  uint16_t t[8] = {};
  std::memcpy(t, p, static_cast<size_t>(2 * n));
  return Vec8F::load_f16(t);
}
// A q4_k / q5_k super-block's 12 bytes of 6-bit scales and minimums as 8 scale bytes and 8
// minimum bytes (sub-block j in byte j): scale_min_k4 for all eight at once, on 32-bit words.
inline void scales_mins_k4(const uint8_t* q, uint64_t* scales, uint64_t* mins) {
  const uint32_t u0 = u32_at(q), u1 = u32_at(q + 4), u2 = u32_at(q + 8);
  constexpr uint32_t k6 = 0x3f3f3f3fu, k4 = 0x0f0f0f0fu, k2 = 0x03030303u;
  const uint32_t s_hi = (u2 & k4) | (((u0 >> 6) & k2) << 4), m_hi = ((u2 >> 4) & k4) | (((u1 >> 6) & k2) << 4);
  *scales = (u0 & k6) | (static_cast<uint64_t>(s_hi) << 32);
  *mins = (u1 & k6) | (static_cast<uint64_t>(m_hi) << 32);
}

// Every kernel below adds each chunk's int32 lanes into fp32 accumulators times that chunk's
// factor (its weight scale times its activation scale), the factors of eight chunks computed
// together in fp32 lanes and read back one at a time: measured 1.25x faster than summing the
// eight chunks' lanes horizontally first (phaddd is slow on the AVX2 hosts).
// Two chains of accumulators (an FMA's latency between chunks), as plain locals: kept in an
// object beside the factors' array, GCC kept them in memory, a store and a load in every
// chunk's chain.
#define WBK_ADD_CHUNK(j, sum) \
  (((j) & 1) ? (odd = fmadd(to_float(sum), Vec8F::bcast(factor + (j)), odd)) \
             : (even = fmadd(to_float(sum), Vec8F::bcast(factor + (j)), even)))

// The weights of each format as int16 lanes, 16 at a time in their order: what the dot products
// multiply and the dequantization scales, written once for both.

// Chunk j (32 weights) of a group of blocks of 32 (or of i4_g128's 128): lo = weights 0-15,
// hi = 16-31, before scale and offset.
template <WeightDtype T>
inline void unpack_chunk(const Group& G, int64_t j, VecS& lo, VecS& hi) {
  if constexpr (T == WeightDtype::kQ8_0) {
    const auto* qs = reinterpret_cast<const int8_t*>(G.qs + 32 * j);
    lo = VecS::widen_i8(qs);
    hi = VecS::widen_i8(qs + 16);
  } else {
    const VecS w = VecS::widen_u8(G.qs + 16 * j);
    lo = w & VecS::set1(0xF);
    hi = shr<4>(w);
    if constexpr (T == WeightDtype::kQ5_0 || T == WeightDtype::kQ5_1) {
      const uint32_t qh = u32_at(G.qh + 4 * j);
      lo = lo | VecS::fifth_bits<0>(qh);
      hi = hi | VecS::fifth_bits<1>(qh);
    }
  }
}

// Sub-blocks 2p and 2p + 1 (weights 64 p .. 64 p + 63) of a q4_k / q5_k super-block, q before
// scale and minimum: out[0], out[1] = sub-block 2p's halves, out[2], out[3] = 2p + 1's. For
// q5_k, ha / hb are qh[0..15] / qh[16..31] widened and shifted right by 2p (bit 0: sub-block
// 2p's fifth bit, bit 1: 2p + 1's).
template <bool kQ5>
inline void unpack_k4_pair(const uint8_t* qs, int p, VecS ha, VecS hb, VecS out[4]) {
  const VecS low4 = VecS::set1(0xF), bit4 = VecS::set1(0x10);
  const VecS wa = VecS::widen_u8(qs + 32 * p), wb = VecS::widen_u8(qs + 32 * p + 16);
  out[0] = wa & low4;
  out[1] = wb & low4;
  out[2] = shr<4>(wa);
  out[3] = shr<4>(wb);
  if constexpr (kQ5) {
    out[0] = out[0] | (shl<4>(ha) & bit4);
    out[1] = out[1] | (shl<4>(hb) & bit4);
    out[2] = out[2] | (shl<3>(ha) & bit4);
    out[3] = out[3] | (shl<3>(hb) & bit4);
  }
}

// Lanes 16 h .. 16 h + 15 of each quarter of half n of a q6_k super-block, q in 0-63 (the -32
// not taken off): out[k] = weights 128 n + 32 k + 16 h + 0..15, sub-block 8 n + 2 k + h.
inline void unpack_q6k(const uint8_t* blk, int n, int h, VecS out[4]) {
  const VecS low4 = VecS::set1(0xF), bits45 = VecS::set1(0x30);
  const VecS wa = VecS::widen_u8(blk + 64 * n + 16 * h), wb = VecS::widen_u8(blk + 64 * n + 32 + 16 * h);
  const VecS hh = VecS::widen_u8(blk + 128 + 32 * n + 16 * h);  // quarter k's two bits at 2k, 2k + 1
  out[0] = (wa & low4) | (shl<4>(hh) & bits45);
  out[1] = (wb & low4) | (shl<2>(hh) & bits45);
  out[2] = shr<4>(wa) | (hh & bits45);
  out[3] = shr<4>(wb) | (shr<2>(hh) & bits45);
}

// out[0..15] = d q + m for q the 16 int16 lanes of w, multiplied then added as ggml's own
// dequantization rounds them (an offset of q, q4_0's -8, is taken off in int16 first): the
// values are bit for bit what the file's format defines.
inline void store_scaled(VecS w, Vec8F d, Vec8F m, float* out) {
  Vec8F lo, hi;
  to_float(w, lo, hi);
  (lo * d + m).store(out);
  (hi * d + m).store(out + 8);
}

// Vector dequantization of chunks [c0, c1) of one row into out (the GEMM's fp32 slices): the
// kernels' own unpacking (unpack_chunk, unpack_k4_pair, unpack_q6k), then d q + m in fp32.
template <WeightDtype T>
void dequantize_chunks_block32(const uint8_t* row, int64_t K, int64_t c0, int64_t c1, float* out) {
  const PlanarFormat pf = planar(T);
  constexpr float kOffset = T == WeightDtype::kQ4_0 ? -8.0f : T == WeightDtype::kQ5_0 ? -16.0f : 0.0f;
  for (int64_t c = c0; c < c1; ++c) {
    const Group G = group_at(pf, row, K, c / 8);
    const int64_t j = c % 8, b = j * kBlockChunk / pf.block;
    const float d = f16_at(G.d + 2 * b), m = G.m ? f16_at(G.m + 2 * b) : 0.0f;
    VecS lo, hi;
    unpack_chunk<T>(G, j, lo, hi);
    if constexpr (kOffset != 0) {
      lo = lo - VecS::set1(static_cast<int16_t>(-kOffset));
      hi = hi - VecS::set1(static_cast<int16_t>(-kOffset));
    }
    const Vec8F vd = Vec8F::set1(d), vm = Vec8F::set1(m);
    store_scaled(lo, vd, vm, out + (c - c0) * 32);
    store_scaled(hi, vd, vm, out + (c - c0) * 32 + 16);
  }
}

template <bool kQ5>
void dequantize_chunks_k4(const uint8_t* row, int64_t c0, int64_t c1, float* out) {
  constexpr int64_t kBytes = kQ5 ? 176 : 144;
  for (int64_t sb = c0 / 8; sb <= (c1 - 1) / 8; ++sb) {
    const uint8_t* blk = row + sb * kBytes;
    uint64_t sc, mn;
    scales_mins_k4(blk + 4, &sc, &mn);
    const float d = f16_at(blk), dmin = f16_at(blk + 2);
    VecS ha, hb;
    if constexpr (kQ5) {
      ha = VecS::widen_u8(blk + 16);
      hb = VecS::widen_u8(blk + 32);
    }
    for (int p = 0; p < 4; ++p) {
      const int64_t c = sb * 8 + 2 * p;  // the pair's first chunk
      if (c + 2 > c0 && c < c1) {
        VecS w[4];
        unpack_k4_pair<kQ5>(blk + (kQ5 ? 48 : 16), p, ha, hb, w);
        for (int half = 0; half < 2; ++half) {
          if (c + half < c0 || c + half >= c1) continue;
          const int s = 2 * p + half;
          const Vec8F vd = Vec8F::set1(d * ((sc >> (8 * s)) & 0xFF)), vm = Vec8F::set1(-dmin * ((mn >> (8 * s)) & 0xFF));
          float* o = out + (c + half - c0) * 32;
          store_scaled(w[2 * half], vd, vm, o);
          store_scaled(w[2 * half + 1], vd, vm, o + 16);
        }
      }
      if constexpr (kQ5) {
        ha = shr<2>(ha);
        hb = shr<2>(hb);
      }
    }
  }
}

void dequantize_chunks_q6k(const uint8_t* row, int64_t c0, int64_t c1, float* out) {
  for (int64_t sb = c0 / 8; sb <= (c1 - 1) / 8; ++sb) {
    const uint8_t* blk = row + sb * 210;
    const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = f16_at(blk + 208);
    for (int n = 0; n < 2; ++n)
      for (int h = 0; h < 2; ++h) {
        VecS q[4];
        unpack_q6k(blk, n, h, q);
        for (int k = 0; k < 4; ++k) {
          const int64_t c = sb * 8 + 4 * n + k;  // quarter k of half n is chunk 4 n + k
          if (c < c0 || c >= c1) continue;
          const float ds = d * sc[8 * n + 2 * k + h];
          store_scaled(q[k] - VecS::set1(32), Vec8F::set1(ds), Vec8F::zero(), out + (c - c0) * 32 + 16 * h);
        }
      }
  }
}

}  // namespace

void dequantize_block_range(WeightDtype t, const uint8_t* row, int64_t K, int64_t k0, int64_t n, float* out) {
  const int64_t c0 = k0 / kBlockChunk, c1 = (k0 + n) / kBlockChunk;
  switch (t) {
    case WeightDtype::kQ4_0: return dequantize_chunks_block32<WeightDtype::kQ4_0>(row, K, c0, c1, out);
    case WeightDtype::kQ4_1: return dequantize_chunks_block32<WeightDtype::kQ4_1>(row, K, c0, c1, out);
    case WeightDtype::kQ5_0: return dequantize_chunks_block32<WeightDtype::kQ5_0>(row, K, c0, c1, out);
    case WeightDtype::kQ5_1: return dequantize_chunks_block32<WeightDtype::kQ5_1>(row, K, c0, c1, out);
    case WeightDtype::kQ8_0: return dequantize_chunks_block32<WeightDtype::kQ8_0>(row, K, c0, c1, out);
    case WeightDtype::kI4G128: return dequantize_chunks_block32<WeightDtype::kI4G128>(row, K, c0, c1, out);
    case WeightDtype::kQ4_K: return dequantize_chunks_k4<false>(row, c0, c1, out);
    case WeightDtype::kQ5_K: return dequantize_chunks_k4<true>(row, c0, c1, out);
    case WeightDtype::kQ6_K: return dequantize_chunks_q6k(row, c0, c1, out);
    default: return;
  }
}

namespace {

// Dot products of the blocks of 32 (q4_0, q4_1, q5_0, q5_1, q8_0, i4_g128) with one row of
// activations, eight blocks (chunks) at a time.
// Chunk j's integer dot product with its 32 activations, in 8 lanes: int16 activations (the
// weights widened to int16) or int8 (the weights as one vector of bytes).
template <WeightDtype T>
inline VecI8 chunk_dot(const Group& G, int64_t j, const int16_t* x) {
  VecS lo, hi;
  unpack_chunk<T>(G, j, lo, hi);
  return dot(dot(VecI8::zero(), lo, VecS::load(x)), hi, VecS::load(x + 16));
}
template <WeightDtype T>
inline VecI8 chunk_dot(const Group& G, int64_t j, const int8_t* x) {
  if constexpr (T == WeightDtype::kQ8_0) {
    return dot_ss(VecI8::zero(), Bytes32::load(G.qs + 32 * j), Bytes32::load(x));
  } else {
    Bytes32 w = Bytes32::nibbles(G.qs + 16 * j);
    if constexpr (T == WeightDtype::kQ5_0 || T == WeightDtype::kQ5_1) w = w | Bytes32::bits32(u32_at(G.qh + 4 * j));
    return dot_us(VecI8::zero(), w, Bytes32::load(x));
  }
}

template <WeightDtype T, typename A>
float dot_block32(const uint8_t* row, const A& a, int64_t K) {
  const PlanarFormat pf = planar(T);
  const int64_t nb = K / kBlockChunk;
  constexpr bool kHasMin = T == WeightDtype::kQ4_1 || T == WeightDtype::kQ5_1 || T == WeightDtype::kI4G128;
  constexpr float kOffset = T == WeightDtype::kQ4_0 ? -8.0f : T == WeightDtype::kQ5_0 ? -16.0f : 0.0f;
  alignas(32) float factor[8];
  Vec8F even = Vec8F::zero(), odd = Vec8F::zero(), off = Vec8F::zero();
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {  // chunk b0 + j is chunk j of group b0 / 8
    const int64_t n = std::min<int64_t>(8, nb - b0);
    const Group G = group_at(pf, row, K, b0 / 8);
    auto chunk = [&](int64_t j) { return chunk_dot<T>(G, j, a.q + (b0 + j) * 32); };
    Vec8F d, m = Vec8F::zero();
    if constexpr (T == WeightDtype::kI4G128) {  // a scale and offset per 4 chunks: 1 or 2 blocks
      const int64_t b1 = G.blocks > 1 ? 1 : 0;
      const float d0 = f16_at(G.d), d1 = f16_at(G.d + 2 * b1), m0 = f16_at(G.m), m1 = f16_at(G.m + 2 * b1);
      const float dt[8] = {d0, d0, d0, d0, d1, d1, d1, d1}, mt[8] = {m0, m0, m0, m0, m1, m1, m1, m1};
      d = Vec8F::load(dt);
      m = Vec8F::load(mt);
    } else {
      d = load8_f16(G.d, n);
      if constexpr (kHasMin) m = load8_f16(G.m, n);
    }
    (d * load8(a.scale + b0, n)).store(factor);
    const Vec8F xsum = load8(a.sum + b0, n);
    if constexpr (kHasMin) off = fmadd(m, xsum, off);
    if constexpr (kOffset != 0.0f) off = fmadd(d * Vec8F::set1(kOffset), xsum, off);
    if (n == 8) {
      for (int j = 0; j < 8; ++j) WBK_ADD_CHUNK(j, chunk(j));
    } else {
      for (int j = 0; j < n; ++j) WBK_ADD_CHUNK(j, chunk(j));
    }
  }
  return reduce_add(even + odd) + reduce_add(off);
}

// q4_k and q5_k: per super-block, each sub-block's sum times its scale, less the minimums
// times the activations' sums.
template <bool kQ5, typename A>
float dot_q4k_q5k(const uint8_t* row, const A& a, int64_t K) {
  constexpr bool kBytes8 = std::is_same_v<A, Acts8>;
  constexpr int64_t kBytes = kQ5 ? 176 : 144;
  alignas(32) float factor[8];
  Vec8F even = Vec8F::zero(), odd = Vec8F::zero(), off = Vec8F::zero();
  for (int64_t sb = 0; sb < K / kSuperBlock; ++sb) {
    const uint8_t* blk = row + sb * kBytes;
    const uint8_t* qs = blk + (kQ5 ? 48 : 16);
    const auto* x = a.q + sb * kSuperBlock;
    uint64_t sc, mn;
    scales_mins_k4(blk + 4, &sc, &mn);
    (Vec8F::from_u8(sc) * Vec8F::set1(f16_at(blk)) * Vec8F::load(a.scale + 8 * sb)).store(factor);
    off = fmadd(Vec8F::from_u8(mn) * Vec8F::set1(f16_at(blk + 2)), Vec8F::load(a.sum + 8 * sb), off);
    if constexpr (kBytes8) {  // sub-block 2p: the low nibbles of bytes 32 p .. 32 p + 31, 2p + 1: the high
      const Bytes32 low4 = Bytes32::set1(0x0F), bit4 = Bytes32::set1(0x10);
      Bytes32 h;
      if constexpr (kQ5) h = Bytes32::load(blk + 16);
      for (int p = 0; p < 4; ++p) {
        const Bytes32 b = Bytes32::load(qs + 32 * p);
        Bytes32 w0 = b & low4, w1 = shr<4>(b) & low4;
        if constexpr (kQ5) {
          w0 = w0 | (shl<4>(h) & bit4);
          w1 = w1 | (shl<3>(h) & bit4);
          h = shr<2>(h);
        }
        WBK_ADD_CHUNK(2 * p, dot_us(VecI8::zero(), w0, Bytes32::load(x + 64 * p)));
        WBK_ADD_CHUNK(2 * p + 1, dot_us(VecI8::zero(), w1, Bytes32::load(x + 64 * p + 32)));
      }
    } else {
    VecS ha, hb;
    if constexpr (kQ5) {
      ha = VecS::widen_u8(blk + 16);
      hb = VecS::widen_u8(blk + 32);
    }
    for (int p = 0; p < 4; ++p) {
      VecS w[4];
      unpack_k4_pair<kQ5>(qs, p, ha, hb, w);
      if constexpr (kQ5) {  // the next pair's bits down to bits 0 and 1
        ha = shr<2>(ha);
        hb = shr<2>(hb);
      }
      WBK_ADD_CHUNK(2 * p, dot(dot(VecI8::zero(), w[0], VecS::load(x + 64 * p)), w[1], VecS::load(x + 64 * p + 16)));
      WBK_ADD_CHUNK(2 * p + 1, dot(dot(VecI8::zero(), w[2], VecS::load(x + 64 * p + 32)), w[3],
                                   VecS::load(x + 64 * p + 48)));
    }
    }
  }
  return reduce_add(even + odd) - reduce_add(off);
}

// A q6_k super-block's sixteen factors (each sub-block's int8 scale times d times its chunk's
// activation scale) into factor, and its offsets' share (those scales times the sums of x over
// each sub-block) added to off: both activation widths alike.
template <typename A>
inline void q6k_factors(const uint8_t* blk, const A& a, int64_t sb, float* factor, Vec8F& off) {
  const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const Vec8F d = Vec8F::set1(f16_at(blk + 208));
  const Vec8F sc_lo = Vec8F::from_i8(sc) * d, sc_hi = Vec8F::from_i8(sc + 8) * d;
  const float* xs = a.scale + 8 * sb;
  (sc_lo * Vec8F::load4_doubled(xs)).store(factor);  // sub-block i reads chunk i / 2
  (sc_hi * Vec8F::load4_doubled(xs + 4)).store(factor + 8);
  off = fmadd(sc_lo, Vec8F::load(a.sum16 + 16 * sb), off);
  off = fmadd(sc_hi, Vec8F::load(a.sum16 + 16 * sb + 8), off);
}

// q6_k: per super-block, sixteen 16-weight sub-blocks (6-bit q, 0-63), each scaled by its int8
// scale and its chunk's activation scale; the -32 of every q is taken off in fp32 with the
// exact sums of x over each sub-block.
float dot_q6k(const uint8_t* row, const Acts& a, int64_t K) {
  alignas(32) float factor[16];
  Vec8F even = Vec8F::zero(), odd = Vec8F::zero(), off = Vec8F::zero();
  for (int64_t sb = 0; sb < K / kSuperBlock; ++sb) {
    const uint8_t* blk = row + sb * 210;
    const int16_t* x = a.q + sb * kSuperBlock;
    q6k_factors(blk, a, sb, factor, off);
    for (int n = 0; n < 2; ++n)
      for (int h = 0; h < 2; ++h) {  // weights 16 h .. 16 h + 15 of each quarter of half n
        VecS q[4];
        unpack_q6k(blk, n, h, q);
        const int16_t* xn = x + 128 * n + 16 * h;
        for (int k = 0; k < 4; ++k) WBK_ADD_CHUNK(8 * n + 2 * k + h, dot(VecI8::zero(), q[k], VecS::load(xn + 32 * k)));
      }
  }
  return reduce_add(even + odd) - 32.0f * reduce_add(off);
}

// q6_k with int8 activations: a quarter of a half (32 weights, sub-blocks 2k and 2k + 1 of
// the half) is one vector of bytes; its lanes 0-3 hold the first sub-block's products, 4-7
// the second's, so each takes its own factor.
float dot_q6k_i8(const uint8_t* row, const Acts8& a, int64_t K) {
  alignas(32) float factor[16];
  Vec8F even = Vec8F::zero(), odd = Vec8F::zero(), off = Vec8F::zero();
  const Bytes32 low4 = Bytes32::set1(0x0F), bits45 = Bytes32::set1(0x30);
  for (int64_t sb = 0; sb < K / kSuperBlock; ++sb) {
    const uint8_t* blk = row + sb * 210;
    const int8_t* x = a.q + sb * kSuperBlock;
    q6k_factors(blk, a, sb, factor, off);
    for (int n = 0; n < 2; ++n) {
      const Bytes32 la = Bytes32::load(blk + 64 * n), lb = Bytes32::load(blk + 64 * n + 32);
      const Bytes32 hh = Bytes32::load(blk + 128 + 32 * n);
      const Bytes32 q[4] = {(la & low4) | (shl<4>(hh) & bits45), (lb & low4) | (shl<2>(hh) & bits45),
                         (shr<4>(la) & low4) | (hh & bits45), (shr<4>(lb) & low4) | (shr<2>(hh) & bits45)};
      const float* f = factor + 8 * n;
      for (int k = 0; k < 4; ++k) {
        const Vec8F fk = Vec8F::halves(f[2 * k], f[2 * k + 1]);
        const Vec8F prod = to_float(dot_us(VecI8::zero(), q[k], Bytes32::load(x + 128 * n + 32 * k)));
        if (k & 1) odd = fmadd(prod, fk, odd);
        else even = fmadd(prod, fk, even);
      }
    }
  }
  return reduce_add(even + odd) - 32.0f * reduce_add(off);
}

// Weight-only int8 rows with int8 activations: each chunk's 32 signed products in one vector.
float dot_int8_i8(const int8_t* row, const float* gs, const Acts8& a, int64_t K) {
  const int64_t nc = K / kBlockChunk;
  alignas(32) float factor[8];
  Vec8F even = Vec8F::zero(), odd = Vec8F::zero();
  for (int64_t c0 = 0; c0 < nc; c0 += 8) {
    const int64_t n = std::min<int64_t>(8, nc - c0);
    const Vec8F xs = load8(a.scale + c0, n);
    (gs ? xs * load8(gs + c0, n) : xs).store(factor);
    for (int j = 0; j < n; ++j)
      WBK_ADD_CHUNK(j, dot_ss(VecI8::zero(), Bytes32::load(row + (c0 + j) * 32), Bytes32::load(a.q + (c0 + j) * 32)));
  }
  return reduce_add(even + odd);
}

// Weight-only int8 rows (the int8 / int8-g32 formats, linear.cpp's layout: K int8 a row, with
// fp32 scales per 32 of a row, gs, or one per row applied by the caller): the same int16
// products as q8_0's, each chunk's factor its group scale (or 1) times its activation scale.
float dot_int8(const int8_t* row, const float* gs, const Acts& a, int64_t K) {
  const int64_t nc = K / kBlockChunk;
  alignas(32) float factor[8];
  Vec8F even = Vec8F::zero(), odd = Vec8F::zero();
  for (int64_t c0 = 0; c0 < nc; c0 += 8) {
    const int64_t n = std::min<int64_t>(8, nc - c0);
    const Vec8F xs = load8(a.scale + c0, n);
    (gs ? xs * load8(gs + c0, n) : xs).store(factor);
    for (int j = 0; j < n; ++j) {
      const int8_t* w = row + (c0 + j) * 32;
      const int16_t* x = a.q + (c0 + j) * 32;
      WBK_ADD_CHUNK(j, dot(dot(VecI8::zero(), VecS::widen_i8(w), VecS::load(x)), VecS::widen_i8(w + 16),
                           VecS::load(x + 16)));
    }
  }
  return reduce_add(even + odd);
}

#undef WBK_ADD_CHUNK

template <typename A>
using RowDot = float (*)(const uint8_t*, const A&, int64_t);

template <typename A>
RowDot<A> row_dot(WeightDtype t) {
  switch (t) {
    case WeightDtype::kQ4_0: return dot_block32<WeightDtype::kQ4_0, A>;
    case WeightDtype::kQ4_1: return dot_block32<WeightDtype::kQ4_1, A>;
    case WeightDtype::kQ5_0: return dot_block32<WeightDtype::kQ5_0, A>;
    case WeightDtype::kQ5_1: return dot_block32<WeightDtype::kQ5_1, A>;
    case WeightDtype::kQ8_0: return dot_block32<WeightDtype::kQ8_0, A>;
    case WeightDtype::kI4G128: return dot_block32<WeightDtype::kI4G128, A>;
    case WeightDtype::kQ4_K: return dot_q4k_q5k<false, A>;
    case WeightDtype::kQ5_K: return dot_q4k_q5k<true, A>;
    case WeightDtype::kQ6_K:
      if constexpr (std::is_same_v<A, Acts8>) return dot_q6k_i8;
      else return dot_q6k;
    default: return nullptr;
  }
}

// The calling thread's scratch for the quantized activations (parallel.h's last slot, as
// the other kernels' prepared operands).
constexpr int kActsSlot = Scratch::kSlots - 1;
constexpr int64_t kRowsPerTask = 16;

// Rows of x quantized for the dot products (A: Acts, int16, or Acts8, int8), in the calling
// thread's scratch; `at(m)` is row m's.
template <typename A>
class QuantizedRows {
  using Q = std::remove_const_t<std::remove_pointer_t<decltype(A::q)>>;

 public:
  QuantizedRows(const float* x, int64_t M, int64_t K) : K_(K), chunks_(K / kBlockChunk) {
    // [M][K] quantized, then [M][chunks] scales, [M][chunks] sums and [M][2 chunks] half sums,
    // in one float buffer (it outlives the Scratch handle: parallel.h)
    const int64_t q_floats = (M * K * static_cast<int64_t>(sizeof(Q)) + 3) / 4;
    float* buf = Scratch(kActsSlot, q_floats + 4 * M * chunks_).data();
    q_ = reinterpret_cast<Q*>(buf);
    scale_ = buf + q_floats;
    sum_ = scale_ + M * chunks_;
    sum16_ = sum_ + M * chunks_;
    for (int64_t m = 0; m < M; ++m) {
      if constexpr (std::is_same_v<A, Acts8>)
        quantize_acts8(x + m * K, K, q_ + m * K, scale_ + m * chunks_, sum_ + m * chunks_, sum16_ + 2 * m * chunks_);
      else
        quantize_acts(x + m * K, K, q_ + m * K, scale_ + m * chunks_, sum_ + m * chunks_, sum16_ + 2 * m * chunks_);
    }
  }
  A at(int64_t m) const { return {q_ + m * K_, scale_ + m * chunks_, sum_ + m * chunks_, sum16_ + 2 * m * chunks_}; }

 private:
  int64_t K_, chunks_;
  Q* q_;
  float *scale_, *sum_, *sum16_;
};

// y[m][n] = dot(row n, x row m) for every row of w, rows in tasks of kRowsPerTask, one
// contiguous range of tasks per thread.
template <typename Dot>
void rows_times_x(int64_t M, int64_t N, float* y, Dot&& dot_row) {
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin * kRowsPerTask; n < std::min(N, end * kRowsPerTask); ++n)
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot_row(n, m);
  });
}

}  // namespace

namespace {

template <typename A>
void block_matvec_with(const float* x, const uint8_t* w, WeightDtype t, float* y, int64_t M, int64_t N, int64_t K) {
  const QuantizedRows<A> acts(x, M, K);
  const RowDot<A> dot_row = row_dot<A>(t);
  const int64_t row_bytes = block_row_bytes(t, K);
  rows_times_x(M, N, y, [&](int64_t n, int64_t m) { return dot_row(w + n * row_bytes, acts.at(m), K); });
}

}  // namespace

void set_block_activation_bits(int bits) { g_activation_bits.store(bits == 8 ? 8 : 16); }
int block_activation_bits() { return g_activation_bits.load(); }
const char* block_byte_dot_isa() { return kByteDotIsa; }

void block_matvec(const float* x, const uint8_t* w, WeightDtype t, float* y, int64_t M, int64_t N, int64_t K) {
  if (block_activation_bits() == 16) return block_matvec_with<Acts>(x, w, t, y, M, N, K);
  block_matvec_with<Acts8>(x, w, t, y, M, N, K);
}

namespace {

template <typename A, typename Dot>
void int8_matvec_with(const float* x, const int8_t* w, const float* group_scale, float* y, int64_t M, int64_t N,
                      int64_t K, Dot dot_row) {
  const int64_t groups = K / kBlockChunk;
  const QuantizedRows<A> acts(x, M, K);
  rows_times_x(M, N, y, [&](int64_t n, int64_t m) {
    return dot_row(w + n * K, group_scale ? group_scale + n * groups : nullptr, acts.at(m), K);
  });
}

}  // namespace

void int8_matvec(const float* x, const int8_t* w, const float* group_scale, float* y, int64_t M, int64_t N,
                 int64_t K) {
  if (block_activation_bits() == 16) return int8_matvec_with<Acts>(x, w, group_scale, y, M, N, K, dot_int8);
  int8_matvec_with<Acts8>(x, w, group_scale, y, M, N, K, dot_int8_i8);
}

bool matvec_job_format(WeightDtype dtype, int64_t K) {
  const bool int8 = dtype == WeightDtype::kInt8 || dtype == WeightDtype::kInt8Group;
  return (is_block(dtype) || int8) && K % kBlockChunk == 0;
}

namespace {

template <typename A>
void matvec_jobs_with(const float* x, int64_t M, int64_t K, const MatvecJob* jobs, int64_t n_jobs) {
  const QuantizedRows<A> acts(x, M, K);
  const int64_t groups = K / kBlockChunk;
  struct Task {
    int64_t job, lo, hi;  // rows [lo, hi) of the job's W
  };
  std::vector<Task> tasks;
  std::vector<RowDot<A>> dots(n_jobs);
  for (int64_t j = 0; j < n_jobs; ++j) {
    TORCH_CHECK(matvec_job_format(jobs[j].dtype, K), "matvec_jobs: job ", j, " has a format it does not take");
    if (is_block(jobs[j].dtype)) dots[j] = row_dot<A>(jobs[j].dtype);
    for (int64_t lo = 0; lo < jobs[j].N; lo += kRowsPerTask)
      tasks.push_back({j, lo, std::min(jobs[j].N, lo + kRowsPerTask)});
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const MatvecJob& job = jobs[tasks[t].job];
      for (int64_t n = tasks[t].lo; n < tasks[t].hi; ++n) {
        for (int64_t i = 0; i < job.n_rows; ++i) {
          const A a = acts.at(job.rows[i]);
          float v;
          if (is_block(job.dtype)) {
            const auto* w = static_cast<const uint8_t*>(job.w) + n * block_row_bytes(job.dtype, K);
            v = dots[tasks[t].job](w, a, K);
          } else {
            const auto* w = static_cast<const int8_t*>(job.w) + n * K;
            const bool grouped = job.dtype == WeightDtype::kInt8Group;
            if constexpr (std::is_same_v<A, Acts8>)
              v = dot_int8_i8(w, grouped ? job.scale + n * groups : nullptr, a, K);
            else
              v = dot_int8(w, grouped ? job.scale + n * groups : nullptr, a, K);
            if (!grouped) v *= job.scale[n];
          }
          job.y[i * job.ldy + n] = v;
        }
      }
    }
  });
}

}  // namespace

void matvec_jobs(const float* x, int64_t M, int64_t K, const MatvecJob* jobs, int64_t n_jobs) {
  if (n_jobs == 0) return;
  if (block_activation_bits() == 16) return matvec_jobs_with<Acts>(x, M, K, jobs, n_jobs);
  matvec_jobs_with<Acts8>(x, M, K, jobs, n_jobs);
}

}  // namespace wbk
