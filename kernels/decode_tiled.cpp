// Decode attention over the tiled int8 cache: integer dot products for the scores and for
// P.V, in a layout that lets a SIMD lane hold one token (for Q.K) or one output element (for
// P.V), so no horizontal sums are needed anywhere.
//
// Layout of one (batch, KV head) plane of Lmax tokens x D values (Lmax a multiple of 32,
// D a multiple of 4; kernels.h: kTileTokens, kVGroupTokens):
//   K  tiles of 16 tokens, token-interleaved in groups of 4 values: byte (t, d) at
//        (t / 16) * 16 D + (d / 4) * 64 + (t % 16) * 4 + d % 4
//      so the 64 bytes of (tile, d / 4) are 16 tokens x 4 values: one 32-bit lane per token.
//   V  groups of 4 tokens, value-interleaved: byte (t, d) at (t / 4) * 4 D + d * 4 + t % 4
//      so the 4 bytes of one lane are 4 tokens of one output element.
//   Scales stay [Lmax] fp32 per plane (one per head per token, as in the row layout).
//
// Per (batch, KV head, split) task, as in decode_attention.cpp:
//   1. scores: the query heads quantized to int8 (one scale per head); for each d / 4, one
//      64-byte load of K is dotted with the broadcast 4 query bytes of each head sharing the
//      KV head (VNNI vpdpbusd, or pmaddubsw + pmaddwd: simd.h), 16 tokens' dot products
//      accumulating in the lanes. One float multiply per 16 tokens applies both scales.
//   2. exact softmax over the chunk, the V scales folded into the probabilities; then each
//      32-token block of probabilities is quantized to [0, 127] with one scale per block
//      and head (p8 = round(127 p / max p of the block)).
//   3. O += P.V: for each group of 4 tokens, one load of 4 tokens x (I8B / 4) values is
//      dotted with the 4 broadcast probability bytes of each head (unsigned x signed, no
//      bias); int32 sums per block, then one multiply-add by the block's scale into fp32.
// Tokens past a sequence's length inside its last tile or group get probability 0, so
// whatever those cache bytes hold contributes exactly 0 (integer arithmetic: no NaN).
//
// Pipelined streams (g_prefetch.pipeline, chosen per host; only while a task's K and V fit in
// half the L2): step 1 also prefetches the task's V into L2, line for line with K, and step 3
// the next task this thread will run (run_tasks_ahead), as much K as it reads V. Memory then
// keeps streaming through the softmax and each task's start, where it otherwise idles.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <unistd.h>

#include "decode_common.h"
#include "kernels.h"
#include "parallel.h"
#include "prefetch.h"
#include "rows.h"
#include "simd.h"

namespace wbk {
namespace {

constexpr int W = VecF::W;          // fp32 / int32 lanes = tokens per K vector
constexpr int KV = 64 / I8B;        // vectors per 64-byte unit (16 tokens x 4 values)
constexpr int kBlock = kTiledAlign;  // tokens per probability scale (a multiple of 16 and 4)
static_assert(W * KV == kTileTokens, "one 64-byte unit holds a tile's 16 tokens");

#if defined(WBK_ISA_AVX512)
constexpr int kAccRegs = 24;   // of 32 zmm
constexpr int kHeadsPerPass = 8;
#elif defined(WBK_ISA_AVX2)
constexpr int kAccRegs = 8;    // of 16 ymm
constexpr int kHeadsPerPass = 4;
#else
constexpr int kAccRegs = 8;
constexpr int kHeadsPerPass = 8;
#endif

// scores[g][i] = qmul[g] * kscale[i] * (q8_g . k_i - qbias[g]) for the 16 tokens i of one
// tile and GC heads. The tile's D / 4 lines (KV vectors each) are read in address order, R
// independent accumulator chains per head taking every R-th line (summed at the end: int32,
// exact), which hides the dot product's latency while K stays one sequential stream (R tiles
// side by side, line by line, streamed 6% slower at Llama-2-7B shapes on host C).
// Software prefetch: the line `ahead` bytes on (0: none) with hint Hint, and, given vpf, the
// line of V at the same offset into L2.
template <int GC, int R, int Hint>
inline void score_tile(const int8_t* tile, int64_t D, const int8_t* q8, int64_t ldq,
                           const float* qmul, const float* qbias, const float* kscale, float* out, int64_t ldo,
                           int64_t ahead, const int8_t* vpf) {
  VecI acc[R][GC][KV];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < GC; ++g)
      for (int u = 0; u < KV; ++u) acc[r][g][u] = VecI::zero();
  auto line = [&](int r, int64_t dg) {
    VecB qb[GC];
    for (int g = 0; g < GC; ++g) qb[g] = VecB::bcast4(q8 + g * ldq + 4 * dg);
    const int64_t at = dg * 64;
    // The line `ahead` bytes on from each line of K read: spread out, never a burst (bursts
    // of a whole tile measured slower); and, pipelined, this task's V line for line into L2.
    if (ahead > 0) prefetch_line<Hint>(reinterpret_cast<const char*>(tile + at + ahead));
    if (vpf) prefetch_line<2>(reinterpret_cast<const char*>(vpf + at));
    for (int u = 0; u < KV; ++u) {
      const DotK k = dot_operand(VecB::load(tile + at + u * I8B));
      for (int g = 0; g < GC; ++g) acc[r][g][u] = dot_i8(acc[r][g][u], k, qb[g]);
    }
  };
  const int64_t lines = D / 4;
  int64_t dg = 0;
  for (; dg + R <= lines; dg += R)
    for (int r = 0; r < R; ++r) line(r, dg + r);
  for (; dg < lines; ++dg) line(0, dg);
  for (int g = 0; g < GC; ++g) {
    const VecF bias = VecF::set1(qbias[g]), mul = VecF::set1(qmul[g]);
    for (int u = 0; u < KV; ++u) {
      VecI sum = acc[0][g][u];
      for (int r = 1; r < R; ++r) sum = sum + acc[r][g][u];
      const int64_t i = u * W;
      ((to_float(sum) - bias) * VecF::load(kscale + i) * mul).store(out + g * ldo + i);
    }
  }
}

// All n_tiles tiles from `tiles`, one after another. Half the register budget goes to the
// R accumulator chains per head, the rest to the query broadcasts and the K operand.
// vpf: the chunk's V (prefetched line for line as K is read), or nullptr.
template <int GC, int Hint>
void score_all_tiles(const int8_t* tiles, int64_t n_tiles, int64_t D, const int8_t* q8,
                     int64_t ldq, const float* qmul, const float* qbias, const float* kscale, float* out,
                     int64_t ldo, int64_t ahead, const int8_t* vpf) {
  constexpr int R = std::clamp(kAccRegs / (2 * GC * KV), 1, 4);
  const int64_t tile_bytes = kTileTokens * D;
  for (int64_t t = 0; t < n_tiles; ++t)
    score_tile<GC, R, Hint>(tiles + t * tile_bytes, D, q8, ldq, qmul, qbias, kscale + t * kTileTokens,
                            out + t * kTileTokens, ldo, ahead, vpf ? vpf + t * tile_bytes : nullptr);
}

// acc[g][d0 : d0 + C W] += ps[g] * sum over `groups` groups of 4 tokens of p8[g] . v, with the
// int32 sums kept per call (one block); `part` > 0: a single partial vector of `part` values.
// Prefetch as in score_tile: V `ahead` bytes on with hint Hint, and the next task's K (kpf).
template <int GC, int C, int Hint>
inline void pv_chunk(const int8_t* p8, int64_t ldp, const float* ps, const int8_t* v, int64_t groups, int64_t D,
                     int64_t d0, float* acc, int64_t ahead, const int8_t* kpf, int part = 0) {
  VecI ai[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) ai[g][c] = VecI::zero();
  for (int64_t j = 0; j < groups; ++j) {
    const int8_t* grp = v + j * 4 * D + d0 * 4;
    // The group `ahead` bytes further on (first pass over the block only), spread over the
    // loads rather than one burst per block.
    if (d0 == 0 && ahead > 0) prefetch_span<Hint>(v + j * 4 * D + ahead, 4 * D);
    if (d0 == 0 && kpf) prefetch_span<2>(kpf + j * 4 * D, 4 * D);  // the next task's K, as much as this V
    VecB vv[C];
    for (int c = 0; c < C; ++c) vv[c] = part ? VecB::load(grp, 4 * part) : VecB::load(grp + c * I8B);
    for (int g = 0; g < GC; ++g) {
      const VecB pb = VecB::bcast4(p8 + g * ldp + 4 * j);
      for (int c = 0; c < C; ++c) ai[g][c] = dot_u7(ai[g][c], pb, vv[c]);
    }
  }
  for (int g = 0; g < GC; ++g) {
    const VecF s = VecF::set1(ps[g]);
    float* o = acc + g * D + d0;
    for (int c = 0; c < C; ++c) {
      if (part) {
        fmadd(to_float(ai[g][c]), s, VecF::load(o, part)).store(o, part);
      } else {
        fmadd(to_float(ai[g][c]), s, VecF::load(o + c * W)).store(o + c * W);
      }
    }
  }
}

// One block: acc[g][0 : D] += ps[g] * sum_j p8[g][4j : 4j + 4] . V group j, in chunks of C
// vectors (the largest power of two with C * GC <= kAccRegs), halving for what is left of D.
// kpf: the next task's K at this block's offset (prefetched as much as this V is read), or nullptr.
template <int GC, int Hint, int C = floor_pow2(std::max(1, kAccRegs / GC))>
void pv_block(const int8_t* p8, int64_t ldp, const float* ps, const int8_t* v, int64_t groups, int64_t D, float* acc,
              int64_t ahead, const int8_t* kpf, int64_t d = 0) {
  for (; d + C * W <= D; d += C * W) pv_chunk<GC, C, Hint>(p8, ldp, ps, v, groups, D, d, acc, ahead, kpf);
  if constexpr (C > 1) {
    pv_block<GC, Hint, C / 2>(p8, ldp, ps, v, groups, D, acc, ahead, kpf, d);
  } else if (d < D) {
    pv_chunk<GC, 1, Hint>(p8, ldp, ps, v, groups, D, d, acc, ahead, kpf, static_cast<int>(D - d));
  }
}

// Half the L2 (sysconf's, 256 KiB if it does not say): the most bytes of K and V one task
// prefetches into it ahead of use.
int64_t pipeline_budget() {
  static const int64_t budget = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return static_cast<int64_t>(l2 > 0 ? l2 : 256 << 10) / 2;
  }();
  return budget;
}

// p [n] fp32 >= 0 -> p8 [round up to kBlock] in [0, 127] (zero past n), one scale per block.
void quantize_probabilities(const float* p, int64_t n, int8_t* p8, float* ps) {
  for (int64_t b0 = 0, blk = 0; b0 < n; b0 += kBlock, ++blk) {
    const int64_t nb = std::min<int64_t>(kBlock, n - b0);
    const float pmax = row_max(p + b0, nb);
    const float inv = pmax > 0.0f ? 127.0f / pmax : 0.0f;
    ps[blk] = pmax / 127.0f;
    const VecF vinv = VecF::set1(inv);
    int64_t i = 0;
    for (; i + W <= nb; i += W) store_i8(p8 + b0 + i, round_nearest(VecF::load(p + b0 + i) * vinv), W);
    for (; i < nb; ++i) p8[b0 + i] = static_cast<int8_t>(std::nearbyint(p[b0 + i] * inv));
    std::fill(p8 + b0 + nb, p8 + b0 + kBlock, int8_t{0});
  }
}

}  // namespace

void decode_attention_tiled(const DecodeArgs& a) {
  const int8_t* k_cache = static_cast<const int8_t*>(a.k_cache);
  const int8_t* v_cache = static_cast<const int8_t*>(a.v_cache);
  const int64_t G = a.H / a.Hkv, S = a.num_splits, D = a.D;
  // Chunks start on whole blocks (so on whole tiles and groups): a split of chunk tokens.
  auto chunk_of = [&](int64_t len) {
    const int64_t c = (len + S - 1) / S;
    return (c + kBlock - 1) / kBlock * kBlock;
  };
  const int64_t lds = chunk_of(a.Lmax), nblk = lds / kBlock;

  std::vector<float> part_o, part_ml;
  if (S > 1) {
    part_o.resize(a.B * a.H * S * D);
    part_ml.resize(a.B * a.H * S * 2);
  }
  const int64_t ldq = (D + 3) / 4 * 4;

  // A task's tokens: split s of plane bk = (batch, KV head), tokens [t0, t0 + n) of it.
  struct Span {
    int64_t s, bk, t0, n;
  };
  auto span_of = [&](int64_t task) {
    const int64_t s = task % S, bk = task / S;
    const int64_t len = a.lengths[bk / a.Hkv], chunk = chunk_of(len);
    const int64_t t0 = std::min(len, s * chunk);
    return Span{s, bk, t0, std::min(len, t0 + chunk) - t0};
  };
  run_tasks_ahead(a.B * a.Hkv * S, [&] {
    return [&, scores = Scratch(0, G * lds), acc = Scratch(1, G * D), stats = Scratch(2, 4 * G + G * nblk),
            qint = Scratch(3, G * ldq / 4 + 1),
            pint = Scratch(4, G * lds / 4 + 1)](int64_t task, int64_t next_task) mutable {
      const auto [s, bk, t0, n] = span_of(task);
      const int64_t b = bk / a.Hkv, kvh = bk % a.Hkv;
      const int8_t* kbase = k_cache + bk * a.Lmax * D;
      const int8_t* vbase = v_cache + bk * a.Lmax * D;
      // Pipelined streams (g_prefetch.pipeline, while both chunks fit in half the L2): V is
      // prefetched into L2 as K is scored, and the next task's K as V is read, so memory keeps
      // streaming through the softmax and each task's start instead of idling there.
      const bool pipelined = g_prefetch.pipeline && 2 * n * D <= pipeline_budget();
      const int8_t* knext = nullptr;
      int64_t next_bytes = 0;
      if (pipelined && next_task >= 0) {
        const Span next = span_of(next_task);
        knext = k_cache + next.bk * a.Lmax * D + next.t0 * D;
        next_bytes = next.n * D;
      }
      const float* qbase = a.q + (b * a.H + kvh * G) * D;

      std::fill(acc.data(), acc.data() + G * D, 0.0f);
      float* m_g = stats.data();
      float* l_g = m_g + G;
      float* qmul = l_g + G;
      float* qbias = qmul + G;
      float* ps = qbias + G;  // [G, nblk]
      int8_t* q8 = reinterpret_cast<int8_t*>(qint.data());
      int8_t* p8 = reinterpret_cast<int8_t*>(pint.data());  // [G, lds]
      for (int64_t g = 0; g < G; ++g) {
        m_g[g] = -std::numeric_limits<float>::infinity();
        l_g[g] = 0.0f;
      }

      if (n > 0) {
        // The first rows of both streams, which the in-loop prefetches (always some distance
        // ahead) never cover: without this each task's K and V start with a latency-bound ramp.
        if (g_prefetch.bytes > 0) {
          const int64_t head = std::min<int64_t>(g_prefetch.bytes, n * D);
          prefetch_bytes(kbase + t0 * D, head, g_prefetch.hint);
          prefetch_bytes(vbase + t0 * D, head, g_prefetch.hint);
        }
        quantize_query(qbase, G, D, ldq, q8, qmul, qbias);
        for (int64_t g = 0; g < G; ++g) qmul[g] *= a.scale;
        // 1. scores of every tile of the chunk (the last one may run past t1: ignored).
        const int64_t n_tiles = (n + kTileTokens - 1) / kTileTokens;
        const float* kscale = a.k_scale + bk * a.Lmax + t0;
        for (int64_t g0 = 0; g0 < G; g0 += kHeadsPerPass) {
          with_hint(g_prefetch.hint, [&](auto hint) {
            with_group(std::min<int64_t>(kHeadsPerPass, G - g0), [&](auto gc) {
              score_all_tiles<decltype(gc)::value, decltype(hint)::value>(
                  kbase + t0 * D, n_tiles, D, q8 + g0 * ldq, ldq, qmul + g0, qbias + g0, kscale,
                  scores.data() + g0 * lds, lds, g_prefetch.bytes, pipelined && g0 == 0 ? vbase + t0 * D : nullptr);
            });
          });
        }
        // 2. softmax, V scales folded in, probabilities quantized per block.
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + g * lds;
          m_g[g] = row_max(sg, n);
          l_g[g] = exp_and_sum(sg, n, 1.0f, m_g[g]);
          mul_rows(sg, a.v_scale + bk * a.Lmax + t0, n);
          quantize_probabilities(sg, n, p8 + g * lds, ps + g * nblk);
        }
        // 3. O += P.V one block at a time (int32 within the block, fp32 across blocks).
        for (int64_t tb = 0, blk = 0; tb < n; tb += kBlock, ++blk) {
          const int64_t groups = (std::min<int64_t>(kBlock, n - tb) + kVGroupTokens - 1) / kVGroupTokens;
          const int8_t* vblock = vbase + (t0 + tb) * D;
          const int8_t* kpf = tb * D < next_bytes ? knext + tb * D : nullptr;
          for (int64_t g0 = 0; g0 < G; g0 += kHeadsPerPass) {
            with_hint(g_prefetch.hint, [&](auto hint) {
              with_group(std::min<int64_t>(kHeadsPerPass, G - g0), [&](auto gc) {
                constexpr int GC = decltype(gc)::value;
                float psb[GC];
                for (int g = 0; g < GC; ++g) psb[g] = ps[(g0 + g) * nblk + blk];
                pv_block<GC, decltype(hint)::value>(p8 + g0 * lds + tb, lds, psb, vblock, groups, D,
                                                    acc.data() + g0 * D, g_prefetch.bytes, g0 == 0 ? kpf : nullptr);
              });
            });
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        write_result(a, b, kvh * G + g, s, acc.data() + g * D, m_g[g], l_g[g], part_o, part_ml);
    };
  });
  if (S > 1) merge_splits(a, part_o, part_ml);
}

}  // namespace wbk
