// Decode attention: one new query token per sequence against a KV cache of fp32,
// fp16, bf16 or int8 (the paper's hybrid-dtype kernel).
//
// Layout: q [B, H, D] fp32; k/v caches [B, Hkv, Lmax, D]; int8 scales [B, Hkv, Lmax]
// (one per head per token); lengths [B] (ragged batches). GQA: the query heads that share
// a KV head (H / Hkv of them, or as DecodeArgs::heads maps them) are handled by one task, so
// each cached token is read from memory once for all of them.
//
// Parallel split: one task per (batch, KV head, split), where each sequence's
// tokens are cut into `num_splits` equal chunks (split-KV) when there are too few
// (batch, head) pairs to keep every thread busy. A split writes its unnormalised
// output with its softmax max and sum; a merge pass rescales and adds them.
//
// Per task, three passes over the chunk, each touching a token's data once:
//   1. scores: 8 tokens at a time, K widened to fp32 in registers (int8 -> int32 ->
//      fp32, fp16/bf16 -> fp32), dotted with each query head; for int8 the token's
//      scale multiplies the finished dot product once (q.k = s_t (q.k8)).
//   2. exact softmax over the chunk; for int8 the V scale is folded into the
//      probabilities (sum_t p_t v_t = sum_t (p_t s_t) v8_t).
//   3. O += P V, 32 tokens at a time.
// With Int8Kernel::kDot (int8 cache only), pass 1 instead quantizes each query head to int8
// (scale = max|q| / 127) and computes q8 . k8 with integer dot products (VNNI vpdpbusd, or
// pmaddubsw + pmaddwd on sign-adjusted operands; simd.h), so a token's K costs one load and
// one instruction per query head instead of widening and FMAs; the score is then
// q_scale * k_scale_t * (q8 . k8_t). P.V stays fp32 with the V scales folded in.
// Widening happens in registers, once per token for all the query heads that share the
// KV head (GQA: up to 8 heads per pass, each with its own accumulators), so a grouped
// cache costs no more widening than a plain one. Each pass prefetches the rows ahead of
// the ones it reads, as far and with the hint measured for the host (prefetch.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <string>
#include <vector>

#include "decode_common.h"
#include "kernels.h"
#include "parallel.h"
#include "prefetch.h"
#include "rows.h"
#include "simd.h"

namespace wbk {
namespace {

constexpr int W = VecF::W;
constexpr int kTokensPerScoreStep = 8;  // a multiple of 4 (reduce_add4)
constexpr int kTokensPerValueBlock = 32;

// Software prefetch of the cache rows ahead of the one being read (prefetch.h: distance
// and hint tuned per host): one thread's stream of K or V otherwise waits on memory
// latency (profiled: the loads and the instructions right after them took most samples).
inline void prefetch_range(const void* p, int64_t bytes) { prefetch_bytes(p, bytes, g_prefetch.hint); }

// Accumulator registers the inner loops may use (of 32 zmm / 16 ymm). 24 of 32 lets GQA 3:1
// score 8 tokens per pass instead of 4 (measured 1.1x on int8 at SmolLM2's shapes).
#if defined(WBK_ISA_AVX512)
constexpr int kAccRegs = 24;
#else
constexpr int kAccRegs = 8;
#endif

// The GC query heads that share a KV head are handled together: each K or V vector is
// loaded and widened once and used by all of them (GQA), instead of once per head.

// out[g * ldo + i] = q_g . rows[i] for GC heads and kTokensPerScoreStep rows (out rows ldo
// apart, written straight into the score buffer).
template <typename T, int GC>
void dot_rows(const float* q, int64_t ldq, const T* const* rows, int64_t D, float* out, int64_t ldo) {
  // Rows per pass: the largest power of two (so it divides the step) that keeps R * GC
  // accumulators within kAccRegs.
  constexpr int R = kAccRegs / GC >= 8 ? 8 : kAccRegs / GC >= 4 ? 4 : kAccRegs / GC >= 2 ? 2 : 1;
  static_assert(kTokensPerScoreStep % R == 0);
  constexpr int N = ((R * GC + 3) / 4) * 4;  // accumulators, padded for reduce_add4
  for (int r0 = 0; r0 < kTokensPerScoreStep; r0 += R) {
    VecF acc[N];
    for (int i = 0; i < N; ++i) acc[i] = VecF::zero();
    int64_t d = 0;
    for (; d + W <= D; d += W) {
      VecF qv[GC];
      for (int g = 0; g < GC; ++g) qv[g] = VecF::load(q + g * ldq + d);
      for (int r = 0; r < R; ++r) {
        const VecF kv = Load<T>::full(rows[r0 + r] + d);
        for (int g = 0; g < GC; ++g) acc[r * GC + g] = fmadd(qv[g], kv, acc[r * GC + g]);
      }
    }
    if (d < D) {
      const int rem = static_cast<int>(D - d);
      VecF qv[GC];
      for (int g = 0; g < GC; ++g) qv[g] = VecF::load(q + g * ldq + d, rem);
      for (int r = 0; r < R; ++r) {
        const VecF kv = Load<T>::part(rows[r0 + r] + d, rem);
        for (int g = 0; g < GC; ++g) acc[r * GC + g] = fmadd(qv[g], kv, acc[r * GC + g]);
      }
    }
    if constexpr (R % 4 == 0) {
      // Four consecutive tokens of one head per reduction: their four sums are stored
      // together, in place.
      for (int g = 0; g < GC; ++g)
        for (int r = 0; r < R; r += 4)
          reduce_add4(acc[r * GC + g], acc[(r + 1) * GC + g], acc[(r + 2) * GC + g], acc[(r + 3) * GC + g],
                      out + g * ldo + r0 + r);
    } else {
      float sums[N];
      for (int i = 0; i < N; i += 4) reduce_add4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3], sums + i);
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < GC; ++g) out[g * ldo + r0 + r] = sums[r * GC + g];
    }
  }
}

// out[g * ldo + i] = qmul[g] * (q8_g . rows[i] - qbias[g]) for GC int8 query heads (q8 rows
// ldq bytes apart, zero-padded to whole VecB) and kTokensPerScoreStep int8 rows.
template <int GC>
void dot_rows_i8(const int8_t* q8, int64_t ldq, const float* qmul, const float* qbias, const int8_t* const* rows,
                 int64_t D, float* out, int64_t ldo) {
  constexpr int R = kAccRegs / GC >= 8 ? 8 : kAccRegs / GC >= 4 ? 4 : kAccRegs / GC >= 2 ? 2 : 1;
  static_assert(kTokensPerScoreStep % R == 0);
  constexpr int N = ((R * GC + 3) / 4) * 4;
  for (int r0 = 0; r0 < kTokensPerScoreStep; r0 += R) {
    VecI acc[N];
    for (int i = 0; i < N; ++i) acc[i] = VecI::zero();
    int64_t d = 0;
    for (; d + I8B <= D; d += I8B) {
      VecB qv[GC];
      for (int g = 0; g < GC; ++g) qv[g] = VecB::load(q8 + g * ldq + d);
      for (int r = 0; r < R; ++r) {
        const DotK kv = dot_operand(VecB::load(rows[r0 + r] + d));  // once for all GC heads
        for (int g = 0; g < GC; ++g) acc[r * GC + g] = dot_i8(acc[r * GC + g], kv, qv[g]);
      }
    }
    if (d < D) {
      const int rem = static_cast<int>(D - d);
      VecB qv[GC];
      for (int g = 0; g < GC; ++g) qv[g] = VecB::load(q8 + g * ldq + d);  // zero-padded past D
      for (int r = 0; r < R; ++r) {
        const DotK kv = dot_operand(VecB::load(rows[r0 + r] + d, rem));
        for (int g = 0; g < GC; ++g) acc[r * GC + g] = dot_i8(acc[r * GC + g], kv, qv[g]);
      }
    }
    float sums[N];
    for (int i = 0; i < N; i += 4)
      reduce_add4(to_float(acc[i]), to_float(acc[i + 1]), to_float(acc[i + 2]), to_float(acc[i + 3]), sums + i);
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GC; ++g) out[g * ldo + r0 + r] = qmul[g] * (sums[r * GC + g] - qbias[g]);
  }
}

// acc[g][d0 : d0 + C W] += sum_i p[g][i] * rows[i][d0 : ...] for GC heads and n rows of V:
// C vectors of each row are loaded and widened once and used by every head.
template <typename T, int GC, int C>
inline void pv_chunk(const float* p, int64_t ldp, const T* rows, int64_t n, int64_t D, int64_t d0, float* acc) {
  VecF o[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) o[g][c] = VecF::load(acc + g * D + d0 + c * W);
  for (int64_t i = 0; i < n; ++i) {
    VecF v[C];
    for (int c = 0; c < C; ++c) v[c] = Load<T>::full(rows + i * D + d0 + c * W);
    for (int g = 0; g < GC; ++g) {
      const VecF pi = VecF::set1(p[g * ldp + i]);
      for (int c = 0; c < C; ++c) o[g][c] = fmadd(pi, v[c], o[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) o[g][c].store(acc + g * D + d0 + c * W);
}

// acc[g][0:D] += sum_i p[g][i] * rows[i] for GC heads (p rows ldp apart) and n rows of V,
// in chunks of C vectors (the largest power of two with C * GC <= kAccRegs), then halving
// chunks for what is left of D; powers of two so that D = 64 or 128 takes whole chunks
// (GQA 3:1 at D = 64: one pass of 4 vectors, not two of 2).
template <typename T, int GC, int C = floor_pow2(std::max(1, kAccRegs / GC))>
void accumulate_pv(const float* p, int64_t ldp, const T* rows, int64_t n, int64_t D, float* acc, int64_t d = 0) {
  for (; d + C * W <= D; d += C * W) pv_chunk<T, GC, C>(p, ldp, rows, n, D, d, acc);
  if constexpr (C > 1) {
    accumulate_pv<T, GC, C / 2>(p, ldp, rows, n, D, acc, d);
  } else if (d < D) {  // a partial vector when D is not a multiple of W
    const int cnt = static_cast<int>(D - d);
    VecF o[GC];
    for (int g = 0; g < GC; ++g) o[g] = VecF::load(acc + g * D + d, cnt);
    for (int64_t i = 0; i < n; ++i) {
      const VecF v = Load<T>::part(rows + i * D + d, cnt);
      for (int g = 0; g < GC; ++g) o[g] = fmadd(VecF::set1(p[g * ldp + i]), v, o[g]);
    }
    for (int g = 0; g < GC; ++g) o[g].store(acc + g * D + d, cnt);
  }
}

template <typename T>
void decode_impl(const DecodeArgs& a) {
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  // Scratch for the most query heads one KV head has (uneven groups: HeadMap in kernels.h).
  const int64_t Gmax = a.heads.group_size(a.H, a.Hkv), S = a.num_splits, D = a.D;
  const int64_t max_chunk = (a.Lmax + S - 1) / S;
  // Score rows lds apart: a chunk rounded up to whole score steps, so a short last step may
  // write its repeated tokens past the chunk's end without touching the next head's row.
  const int64_t lds = (max_chunk + kTokensPerScoreStep - 1) / kTokensPerScoreStep * kTokensPerScoreStep;

  // Split-KV partial results: unnormalised outputs and (max, sum) per split.
  std::vector<float> part_o, part_ml;
  if (S > 1) {
    part_o.resize(a.B * a.H * S * D);
    part_ml.resize(a.B * a.H * S * 2);
  }

  const bool int8_query = kInt8 && a.int8_kernel == Int8Kernel::kDot;
  const int64_t ldq = (D + I8B - 1) / I8B * I8B;  // int8 query rows, padded to whole vectors

  run_tasks(a.B * a.Hkv * S, [&] {
    return [&, scores = Scratch(0, Gmax * lds), acc = Scratch(1, Gmax * D), stats = Scratch(2, 2 * Gmax),
            qint = Scratch(3, int8_query ? Gmax * ldq / 4 + 1 : 1),
            qstats = Scratch(4, int8_query ? 2 * Gmax : 1)](int64_t task) mutable {
      const int64_t s = task % S, bk = task / S;  // bk = b * Hkv + kv head
      const int64_t b = bk / a.Hkv, kvh = bk % a.Hkv;
      const int64_t len = a.lengths[b], chunk = (len + S - 1) / S;
      const int64_t t0 = std::min(len, s * chunk), t1 = std::min(len, t0 + chunk), n = t1 - t0;
      const T* kbase = k_cache + bk * a.Lmax * D;
      const T* vbase = v_cache + bk * a.Lmax * D;
      const int64_t h0 = a.heads.first_query(a.H, a.Hkv, kvh), G = a.heads.queries(a.H, a.Hkv, kvh);
      const float* qbase = a.q + (b * a.H + h0) * D;  // G consecutive query heads

      std::fill(acc.data(), acc.data() + G * D, 0.0f);
      float* m_g = stats.data();  // per query head: softmax max and sum over the chunk
      float* l_g = m_g + G;
      for (int64_t g = 0; g < G; ++g) {
        m_g[g] = -std::numeric_limits<float>::infinity();
        l_g[g] = 0.0f;
      }

      int8_t* q8 = reinterpret_cast<int8_t*>(qint.data());
      float* qmul = qstats.data();
      float* qbias = qmul + G;
      if (int8_query && n > 0) quantize_query(qbase, G, D, ldq, q8, qmul, qbias);

      if (n > 0) {
        // 1. scores[g][t] = q_g . k_t (for int8, q_g . k8_t), eight tokens per step.
        for (int64_t tb = t0; tb < t1; tb += kTokensPerScoreStep) {
          const int nt = static_cast<int>(std::min<int64_t>(kTokensPerScoreStep, t1 - tb));
          const int64_t ahead = tb + g_prefetch.bytes / static_cast<int64_t>(D * sizeof(T));
          if (g_prefetch.bytes > 0 && ahead < t1) prefetch_range(kbase + ahead * D, std::min<int64_t>(nt, t1 - ahead) * D * sizeof(T));
          const T* rows[kTokensPerScoreStep];
          for (int i = 0; i < kTokensPerScoreStep; ++i)
            rows[i] = kbase + (tb + std::min(i, nt - 1)) * D;  // a short step repeats its last token
          for (int64_t g0 = 0; g0 < G; g0 += 8) {  // heads sharing this KV head, up to 8 at a time
            with_group(std::min<int64_t>(8, G - g0), [&](auto gc) {
              constexpr int GC = decltype(gc)::value;
              if constexpr (kInt8) {
                if (int8_query) {
                  dot_rows_i8<GC>(q8 + g0 * ldq, ldq, qmul + g0, qbias + g0, rows, D,
                                  scores.data() + g0 * lds + (tb - t0), lds);
                  return;
                }
              }
              dot_rows<T, GC>(qbase + g0 * D, D, rows, D, scores.data() + g0 * lds + (tb - t0), lds);
            });
          }
        }

        // 2. exact softmax over the chunk of scale * q.k (times the token's scale for int8);
        //    then fold the int8 V scales into the probabilities.
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + g * lds;
          if constexpr (kInt8) {
            mul_rows_scaled(sg, a.k_scale + bk * a.Lmax + t0, a.scale, n);
          } else {
            scale_row(sg, n, a.scale);
          }
          m_g[g] = row_max(sg, n);
          l_g[g] = exp_and_sum(sg, n, 1.0f, m_g[g]);
          if constexpr (kInt8) mul_rows(sg, a.v_scale + bk * a.Lmax + t0, n);
        }

        // 3. acc[g] = sum_t p[g][t] v_t, a block of 32 tokens at a time.
        for (int64_t tb = t0; tb < t1; tb += kTokensPerValueBlock) {
          const int64_t nb = std::min<int64_t>(kTokensPerValueBlock, t1 - tb);
          const float* p = scores.data() + (tb - t0);
          const int64_t ahead = tb + std::max<int64_t>(kTokensPerValueBlock, g_prefetch.bytes / (D * sizeof(T)));
          if (g_prefetch.bytes > 0 && ahead < t1)
            prefetch_range(vbase + ahead * D, std::min<int64_t>(kTokensPerValueBlock, t1 - ahead) * D * sizeof(T));
          for (int64_t g0 = 0; g0 < G; g0 += 8) {
            with_group(std::min<int64_t>(8, G - g0), [&](auto gc) {
              accumulate_pv<T, decltype(gc)::value>(p + g0 * lds, lds, vbase + tb * D, nb, D,
                                                    acc.data() + g0 * D);
            });
          }
        }
      }

      for (int64_t g = 0; g < G; ++g)
        write_result(a, b, h0 + g, s, acc.data() + g * D, m_g[g], l_g[g], part_o, part_ml);
    };
  });
  if (S > 1) merge_splits(a, part_o, part_ml);
}

}  // namespace

std::string head_map_error(const HeadMap& m, int64_t H, int64_t Hkv) {
  const auto heads = " query heads onto " + std::to_string(Hkv) + " KV heads";
  if (H < 1 || Hkv < 1) return "H and Hkv must be >= 1, got " + std::to_string(H) + " and " + std::to_string(Hkv);
  if (m.group == 0) {
    if (m.q_offset != 0) return "q_offset needs group (the model's query heads per KV head), got group 0";
    if (H % Hkv) return "the number of query heads H (" + std::to_string(H) +
                        ") must be a multiple of the number of KV heads Hkv (" + std::to_string(Hkv) +
                        "), or group and q_offset must say how they map";
    return "";
  }
  if (m.group < 1 || m.q_offset < 0 || m.q_offset >= m.group)
    return "group must be >= 1 and q_offset in 0..group-1, got group " + std::to_string(m.group) + ", q_offset " +
           std::to_string(m.q_offset);
  // Every KV head read by at least one query head, every query head reading one of them.
  if ((Hkv - 1) * m.group >= H + m.q_offset || H + m.q_offset > Hkv * m.group)
    return "group " + std::to_string(m.group) + " with q_offset " + std::to_string(m.q_offset) + " cannot map " +
           std::to_string(H) + heads + " (it needs (Hkv - 1) group < H + q_offset <= Hkv group)";
  return "";
}

int64_t decode_default_splits(int64_t B, int64_t Hkv, int64_t max_length, int num_threads) {
  // The fewest splits that keep the threads evenly busy: the tasks (B Hkv splits, all the same
  // size) fill whole rounds of the threads to within 10%; never chunks shorter than 256
  // tokens. Each split costs a task start and a share of the merge, so more splits than fill
  // the threads only lose (the earlier rule, 16 tasks per thread, measured slower at batch 1).
  const int64_t base = std::max<int64_t>(1, B * Hkv), threads = std::max(1, num_threads);
  const int64_t most = std::max<int64_t>(1, max_length / 256);
  int64_t splits = 1;
  for (; splits < most; ++splits) {
    const int64_t tasks = base * splits, rounds = (tasks + threads - 1) / threads;
    if (10 * rounds * threads <= 11 * tasks) break;
  }
  return splits;
}

const char* decode_dot_isa() { return kDotIsa; }

void decode_attention(const DecodeArgs& a) {
  if (a.int8_kernel == Int8Kernel::kTile) return decode_attention_tiled(a);
  switch (a.dtype) {
    case CacheDtype::kFloat32:
      return decode_impl<float>(a);
    case CacheDtype::kFloat16:
      return decode_impl<Half16>(a);
    case CacheDtype::kBFloat16:
      return decode_impl<BFloat16>(a);
    case CacheDtype::kInt8:
      return decode_impl<int8_t>(a);
  }
}

}  // namespace wbk
