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
// Per (batch, KV head, split) task, one 32-token block at a time (online softmax, as in
// FlashAttention), so the task reads its K and V as two streams side by side:
//   1. scores of the block: the query heads quantized to int8 (one scale per head); for each
//      d / 4, one 64-byte load of K is dotted with the broadcast 4 query bytes of each head
//      sharing the KV head (VNNI vpdpbusd, or pmaddubsw + pmaddwd: simd.h), 16 tokens' dot
//      products accumulating in the lanes. One float multiply per 16 tokens applies both scales.
//   2. softmax, online: a new running maximum rescales the output and the sum so far; the
//      block's probabilities exp(s - m), with the V scales folded in, are quantized to
//      [0, 127] with one scale per block and head (p8 = round(127 p / max p of the block)).
//   3. O += P.V: for each group of 4 tokens, one load of 4 tokens x (I8B / 4) values is
//      dotted with the 4 broadcast probability bytes of each head (unsigned x signed, no
//      bias); int32 sums over the block, then one multiply-add by the block's scale into fp32.
// Tokens past a sequence's length inside its last tile or group get probability 0, so
// whatever those cache bytes hold contributes exactly 0 (integer arithmetic: no NaN).
// This order (K and V block by block, side by side) streams faster than the earlier one (all
// of a task's K, an exact softmax over the whole chunk, then all of its V): K and V are read
// while both are still in flight, and the chunk's scores never leave registers.
//
// Software prefetch (g_prefetch, chosen per host): each stream `bytes` ahead of the line read
// with the chosen hint. Pipelined (g_prefetch.pipeline): past the end of a task's K or V the
// prefetches run on into the K or V of the next task this thread will run (run_tasks_ahead),
// so the streams do not stop and start again at every task.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

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
// Tokens per online-softmax step and per probability scale. Steps of 64 and 128 tokens (one
// softmax over more scores at a time, the scale still per 32) measured slower at both the
// bundled model's and Llama-2-7B's shapes: the larger step's scores spill registers.
constexpr int kBlock = kTiledAlign;
static_assert(W * KV == kTileTokens, "one 64-byte unit holds a tile's 16 tokens");
static_assert(kBlock % kTileTokens == 0 && kBlock % kVGroupTokens == 0, "a block is whole tiles and groups");

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

// One stream's software prefetch: `bytes` ahead of the line being read, which past the end of
// this task's chunk [base, base + len) continues into the next task's chunk of the same
// stream ([next, next + next_len), or nowhere when next is null). Offsets are compared, so
// no pointer is formed outside the cache.
struct Ahead {
  const int8_t* base;
  int64_t len;
  const int8_t* next;
  int64_t next_len;
  int64_t bytes;
  const int8_t* at(const int8_t* line) const {
    const int64_t off = (line - base) + bytes;
    if (off < len) return base + off;
    return next && off - len < next_len ? next + (off - len) : nullptr;
  }
};

// Prefetch the line `ahead` points to from `line` (Hint < 0: no software prefetch).
template <int Hint>
inline void prefetch_ahead(const Ahead& ahead, const int8_t* line) {
  if constexpr (Hint >= 0) {
    if (const int8_t* p = ahead.at(line)) prefetch_line<Hint>(reinterpret_cast<const char*>(p));
  }
}

// scores[g][i] = qmul[g] * kscale[i] * (q8_g . k_i - qbias[g]) for the 16 tokens i of one
// tile and GC heads. The tile's D / 4 lines (KV vectors each) are read in address order, R
// independent accumulator chains per head taking every R-th line (summed at the end: int32,
// exact), which hides the dot product's latency while K stays one sequential stream (R tiles
// side by side, line by line, measured slower: R streams instead of one).
// score_tile and pv_block are functions of their own ([[gnu::noinline]]), pv_chunk is
// inlined into pv_block: the code GCC 12 chose by itself in the fastest build, fixed so that
// it no longer depends on its inlining heuristics (with pv_block inlined into the task loop
// the kernel measured slower).
template <int GC, int R, int Hint>
[[gnu::noinline]] void score_tile(const int8_t* tile, int64_t D, const int8_t* q8, int64_t ldq, const float* qmul,
                                  const float* qbias, const float* kscale, float* out, int64_t ldo,
                                  const Ahead& ahead) {
  VecI acc[R][GC][KV];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < GC; ++g)
      for (int u = 0; u < KV; ++u) acc[r][g][u] = VecI::zero();
  auto line = [&](int r, int64_t dg) {
    VecB qb[GC];
    for (int g = 0; g < GC; ++g) qb[g] = VecB::bcast4(q8 + g * ldq + 4 * dg);
    const int8_t* at = tile + dg * 64;
    // One line ahead per line read: spread out, never a burst (bursts of a whole tile
    // measured slower).
    prefetch_ahead<Hint>(ahead, at);
    for (int u = 0; u < KV; ++u) {
      const DotK k = dot_operand(VecB::load(at + u * I8B));
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

// The n_tiles tiles of one block from `tiles`, one after another. Half the register budget
// goes to the R accumulator chains per head, the rest to the query broadcasts and the K operand.
template <int GC, int Hint>
void score_block(const int8_t* tiles, int64_t n_tiles, int64_t D, const int8_t* q8, int64_t ldq, const float* qmul,
                 const float* qbias, const float* kscale, float* out, int64_t ldo, const Ahead& ahead) {
  constexpr int R = std::clamp(kAccRegs / (2 * GC * KV), 1, 4);
  const int64_t tile_bytes = kTileTokens * D;
  for (int64_t t = 0; t < n_tiles; ++t)
    score_tile<GC, R, Hint>(tiles + t * tile_bytes, D, q8, ldq, qmul, qbias, kscale + t * kTileTokens,
                            out + t * kTileTokens, ldo, ahead);
}

// acc[g][d0 : d0 + C W] += ps[g] * sum over `groups` groups of 4 tokens of p8[g] . v, with the
// int32 sums kept per call (one block); `part` > 0: a single partial vector of `part` values.
// Prefetch as in score_tile, on the first pass over the block only (d0 = 0).
template <int GC, int C, int Hint>
[[gnu::always_inline]] inline void pv_chunk(const int8_t* p8, int64_t ldp, const float* ps, const int8_t* v,
                                            int64_t groups, int64_t D, int64_t d0, float* acc, const Ahead& ahead,
                                            int part = 0) {
  VecI ai[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) ai[g][c] = VecI::zero();
  for (int64_t j = 0; j < groups; ++j) {
    const int8_t* group = v + j * 4 * D;
    const int8_t* grp = group + d0 * 4;
    if (d0 == 0)
      for (int64_t off = 0; off < 4 * D; off += 64) prefetch_ahead<Hint>(ahead, group + off);
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
template <int GC, int Hint, int C = floor_pow2(std::max(1, kAccRegs / GC))>
[[gnu::noinline]] void pv_block(const int8_t* p8, int64_t ldp, const float* ps, const int8_t* v, int64_t groups,
                                int64_t D, float* acc, const Ahead& ahead, int64_t d = 0) {
  for (; d + C * W <= D; d += C * W) pv_chunk<GC, C, Hint>(p8, ldp, ps, v, groups, D, d, acc, ahead);
  if constexpr (C > 1) {
    pv_block<GC, Hint, C / 2>(p8, ldp, ps, v, groups, D, acc, ahead, d);
  } else if (d < D) {
    pv_chunk<GC, 1, Hint>(p8, ldp, ps, v, groups, D, d, acc, ahead, static_cast<int>(D - d));
  }
}

// p [n] fp32 >= 0 (n <= kBlock) -> p8 [kBlock] in [0, 127] (zero past n) with the one scale
// *ps such that p ~ *ps * p8.
void quantize_probabilities(const float* p, int64_t n, int8_t* p8, float* ps) {
  const float pmax = row_max(p, n);
  const float inv = pmax > 0.0f ? 127.0f / pmax : 0.0f;
  *ps = pmax / 127.0f;
  const VecF vinv = VecF::set1(inv);
  int64_t i = 0;
  for (; i + W <= n; i += W) store_i8(p8 + i, round_nearest(VecF::load(p + i) * vinv), W);
  for (; i < n; ++i) p8[i] = static_cast<int8_t>(std::nearbyint(p[i] * inv));
  std::fill(p8 + n, p8 + kBlock, int8_t{0});
}

// f(std::integral_constant<int, hint>{}) for the host's prefetch setting, hint -1 when
// software prefetch is off: every hot loop is compiled once per case.
template <typename F>
void with_prefetch(F&& f) {
  if (g_prefetch.bytes <= 0) return f(std::integral_constant<int, -1>{});
  with_hint(g_prefetch.hint, f);
}

}  // namespace

void decode_attention_tiled(const DecodeArgs& a) {
  const int8_t* k_cache = static_cast<const int8_t*>(a.k_cache);
  const int8_t* v_cache = static_cast<const int8_t*>(a.v_cache);
  // Scratch for the most query heads one KV head has (uneven groups: HeadMap in kernels.h).
  const int64_t Gmax = a.heads.group_size(a.H, a.Hkv), S = a.num_splits, D = a.D;
  // Chunks start on whole blocks (so on whole tiles and groups): a split of chunk tokens.
  auto chunk_of = [&](int64_t len) {
    const int64_t c = (len + S - 1) / S;
    return (c + kBlock - 1) / kBlock * kBlock;
  };

  std::vector<float> part_o, part_ml;
  if (S > 1) {
    part_o.resize(a.B * a.H * S * D);
    part_ml.resize(a.B * a.H * S * 2);
  }
  const int64_t ldq = (D + 3) / 4 * 4;

  // A task's tokens: split s of plane bk = (batch, KV head), tokens [t0, t0 + n) of it; its K
  // and V are the bytes [t0 D, t0 D + bytes) of the plane (whole blocks: bytes covers n).
  struct Span {
    int64_t s, bk, t0, n, bytes;
  };
  auto span_of = [&](int64_t task) {
    const int64_t s = task % S, bk = task / S;
    const int64_t len = a.lengths[bk / a.Hkv], chunk = chunk_of(len);
    const int64_t t0 = std::min(len, s * chunk), n = std::min(len, t0 + chunk) - t0;
    return Span{s, bk, t0, n, (n + kBlock - 1) / kBlock * kBlock * D};
  };
  // Where a task's chunk of the K or V cache starts.
  auto chunk_in = [&](const int8_t* cache, const Span& sp) { return cache + (sp.bk * a.Lmax + sp.t0) * D; };
  run_tasks_ahead(a.B * a.Hkv * S, [&] {
    return [&, scores = Scratch(0, Gmax * kBlock), acc = Scratch(1, Gmax * D), stats = Scratch(2, 5 * Gmax),
            qint = Scratch(3, Gmax * ldq / 4 + 1), pint = Scratch(4, Gmax * kBlock / 4 + 1),
            streamed = false](int64_t task, int64_t next_task) mutable {
      const Span span = span_of(task);
      const auto [s, bk, t0, n, bytes] = span;
      const int64_t b = bk / a.Hkv, kvh = bk % a.Hkv;
      const int8_t* kchunk = chunk_in(k_cache, span);
      const int8_t* vchunk = chunk_in(v_cache, span);
      const float* kscale = a.k_scale + bk * a.Lmax + t0;
      const float* vscale = a.v_scale + bk * a.Lmax + t0;
      // Pipelined: where the prefetches go on to past this task's end.
      const int8_t *knext = nullptr, *vnext = nullptr;
      int64_t next_bytes = 0;
      if (g_prefetch.pipeline && next_task >= 0) {
        const Span nx = span_of(next_task);
        if (nx.n > 0) {
          knext = chunk_in(k_cache, nx);
          vnext = chunk_in(v_cache, nx);
          next_bytes = nx.bytes;
        }
      }
      const Ahead kahead{kchunk, bytes, knext, next_bytes, g_prefetch.bytes};
      const Ahead vahead{vchunk, bytes, vnext, next_bytes, g_prefetch.bytes};
      const int64_t h0 = a.heads.first_query(a.H, a.Hkv, kvh), G = a.heads.queries(a.H, a.Hkv, kvh);
      const float* qbase = a.q + (b * a.H + h0) * D;

      std::fill(acc.data(), acc.data() + G * D, 0.0f);
      float* m_g = stats.data();
      float* l_g = m_g + G;
      float* qmul = l_g + G;
      float* qbias = qmul + G;
      float* ps = qbias + G;  // [G]: the block's probability scale per head
      int8_t* q8 = reinterpret_cast<int8_t*>(qint.data());
      int8_t* p8 = reinterpret_cast<int8_t*>(pint.data());  // [G, kBlock]
      for (int64_t g = 0; g < G; ++g) {
        m_g[g] = -std::numeric_limits<float>::infinity();
        l_g[g] = 0.0f;
      }

      if (n > 0) {
        // The first lines of both streams, which the prefetches (always some distance ahead)
        // never cover, unless the previous task's prefetches already ran on into them.
        if (g_prefetch.bytes > 0 && !streamed) {
          const int64_t head = std::min(g_prefetch.bytes, bytes);
          prefetch_bytes(kchunk, head, g_prefetch.hint);
          prefetch_bytes(vchunk, head, g_prefetch.hint);
        }
        quantize_query(qbase, G, D, ldq, q8, qmul, qbias);
        for (int64_t g = 0; g < G; ++g) qmul[g] *= a.scale;
        with_prefetch([&](auto hint) {
          constexpr int Hint = decltype(hint)::value;
          for (int64_t tb = 0; tb < n; tb += kBlock) {
            const int64_t nb = std::min<int64_t>(kBlock, n - tb);
            // 1. scores of the block's tiles (the last one may run past n: ignored).
            for (int64_t g0 = 0; g0 < G; g0 += kHeadsPerPass) {
              with_group(std::min<int64_t>(kHeadsPerPass, G - g0), [&](auto gc) {
                score_block<decltype(gc)::value, Hint>(kchunk + tb * D, (nb + kTileTokens - 1) / kTileTokens, D,
                                                       q8 + g0 * ldq, ldq, qmul + g0, qbias + g0, kscale + tb,
                                                       scores.data() + g0 * kBlock, kBlock, kahead);
              });
            }
            // 2. online softmax; the block's probabilities, V scales folded in, quantized.
            for (int64_t g = 0; g < G; ++g) {
              float* sg = scores.data() + g * kBlock;
              const float bm = row_max(sg, nb);
              if (bm > m_g[g]) {  // a new maximum: rescale what was summed so far (nothing at first)
                const float f = std::exp(m_g[g] - bm);
                scale_row(acc.data() + g * D, D, f);
                l_g[g] *= f;
                m_g[g] = bm;
              }
              l_g[g] += exp_and_sum(sg, nb, 1.0f, m_g[g]);
              mul_rows(sg, vscale + tb, nb);
              quantize_probabilities(sg, nb, p8 + g * kBlock, ps + g);
            }
            // 3. O += P.V over the block (int32 within it, fp32 across blocks).
            const int64_t groups = (nb + kVGroupTokens - 1) / kVGroupTokens;
            for (int64_t g0 = 0; g0 < G; g0 += kHeadsPerPass) {
              with_group(std::min<int64_t>(kHeadsPerPass, G - g0), [&](auto gc) {
                pv_block<decltype(gc)::value, Hint>(p8 + g0 * kBlock, kBlock, ps + g0, vchunk + tb * D, groups, D,
                                                    acc.data() + g0 * D, vahead);
              });
            }
          }
        });
      }
      streamed = n > 0 && knext != nullptr && g_prefetch.bytes > 0;  // the next task's first lines are on their way
      for (int64_t g = 0; g < G; ++g)
        write_result(a, b, h0 + g, s, acc.data() + g * D, m_g[g], l_g[g], part_o, part_ml);
    };
  });
  if (S > 1) merge_splits(a, part_o, part_ml);
}

}  // namespace wbk
