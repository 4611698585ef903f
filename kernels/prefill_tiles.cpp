// Prefill attention on the bf16 engines: SlimAttention and FlashAttention-2 with Q K^T and
// P V as bf16 products accumulated in fp32 (AMX tiles, or vdpbf16ps where there is no AMX),
// and the softmax in fp32 vector code: the algorithms of prefill_attention.cpp, whose comment
// describes them, on the matrix engine.
//
// Operands, all bf16, each product a sequence of block_2x2 calls (tiles.h: 32 x 32 of C per
// call, two B tiles side by side at every 32-long step of the reduction):
//   S = Q K^T   A = the query block, row-major [rows][Dp] (a copy, zero padded to whole 32-row
//               pairs and D to Dp, a multiple of 32); B = the keys packed per KV head as
//               [Nk / 32 key blocks][Dp / 32 steps][2 tiles of 16 keys][16 pairs of d][16 keys][2]
//   O = P V     A = the probabilities, rounded to bf16 row by row after the fp32 softmax;
//               B = the values packed per KV head as
//               [Dp / 32 column blocks][Nk / 32 steps][2 tiles of 16 d][16 pairs of keys][16 d][2]
// Keys past Nk are zero in both packs, and P is zero past each row's last visible key, so whole
// 32-key blocks are always computed. A 32-row pair of queries stops at the last key block any
// of its rows can see (the causal skip); inside that block the softmax masks per row.
//
// Every function carries the AMX / AVX512-BF16 target attributes (tiles.h), so every build
// compiles this unit; the binding calls it only for an engine gemm_engine_status() allows.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "gemm.h"  // kNoLimit
#include "kernels.h"
#include "parallel.h"
#include "rows.h"
#include "tiles.h"

namespace wbk {
namespace {

// Packed elements of one KV head's keys (and, the same count, its values).
int64_t head_elems(int64_t Nk, int64_t D) { return round_up(Nk, 32) * round_up(D, 32); }

// e's first n lanes (n <= VecF::W) -> bf16 (round to nearest even) at dst.
WBK_AMX_TARGET inline void store_bf16(VecF e, uint16_t* dst, int n) {
#if defined(WBK_ISA_AVX512)
  const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e.v));
  if (n == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), b);
  } else {
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << n) - 1), b);
  }
#elif defined(WBK_ISA_AVX2)
  _mm_mask_storeu_epi16(dst, static_cast<__mmask8>((1u << n) - 1), reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(e.v)));
#else
  (void)n;
  uint32_t bits;
  std::memcpy(&bits, &e.v, 4);
  *dst = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // finite inputs only
#endif
}

// The softmax numerators of one row in one pass: e[j] = exp(s[j] * scale - shift) for j < n,
// written to p as bf16 (zero from n to width); returns their fp32 sum (before rounding).
WBK_AMX_TARGET float exp_to_bf16(const float* s, int64_t n, float scale, float shift, uint16_t* p, int64_t width) {
  constexpr int W = VecF::W;
  const VecF vs = VecF::set1(scale), vshift = VecF::set1(-shift);
  VecF acc = VecF::zero();
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const VecF e = vexp_nonpositive(fmadd(VecF::load(s + j), vs, vshift));
    store_bf16(e, p + j, W);
    acc = acc + e;
  }
  float sum = reduce_add(acc);
  if (j < n) {
    const int rem = static_cast<int>(n - j);
    const VecF e = vexp_nonpositive(fmadd(VecF::load(s + j, rem), vs, vshift));
    store_bf16(e, p + j, rem);
    float tail[W];
    e.store(tail, rem);
    for (int i = 0; i < rem; ++i) sum += tail[i];
  }
  std::fill(p + n, p + std::max(n, width), uint16_t{0});
  return sum;
}

// out[0, D) = o[0, D) * f in bf16: a finished row of the output.
WBK_AMX_TARGET void write_row(const float* o, int64_t D, float f, uint16_t* out) {
  constexpr int W = VecF::W;
  const VecF vf = VecF::set1(f);
  int64_t d = 0;
  for (; d + W <= D; d += W) store_bf16(VecF::load(o + d) * vf, out + d, W);
  if (d < D) store_bf16(VecF::load(o + d, static_cast<int>(D - d)) * vf, out + d, static_cast<int>(D - d));
}

// One 32 x 32 block on the engine that runs: tiles, or vdpbf16ps for the rows that matter.
WBK_AMX_TARGET inline void block(bool amx, int64_t kc, const uint16_t* a, int64_t lda_bytes, const uint16_t* b,
                                 float* c, int64_t ldc, bool accumulate, int64_t rows) {
  if (amx) {
    block_2x2(kc, row_major_a(a, lda_bytes), b, 2048, c, ldc, accumulate);
  } else {
    block_2x2_dp(kc, a, lda_bytes, b, 2048, c, ldc, accumulate, rows);
  }
}

struct Task {
  const uint16_t* q;   // [m, D] query rows of this block
  const uint16_t* kp;  // packed keys of its KV head
  const uint16_t* vp;  // packed values
  uint16_t* out;       // [m, D]
  int64_t m, kvis, diag;
  int64_t k0, window;  // the first key computed (a 32-key block start), the window (0: none)
  // Row r's first visible key, relative to k0 (0 without a window).
  int64_t lo(int64_t r) const { return window ? std::max<int64_t>(0, r + diag - window + 1) - k0 : 0; }
};

Task task_at(const PrefillTileArgs& a, int64_t t) {
  const int64_t blocks = (a.N + a.block_m - 1) / a.block_m;
  const int64_t blk = blocks - 1 - t / (a.B * a.H), bh = t % (a.B * a.H);  // longest (last) blocks first
  const int64_t b = bh / a.H, h = bh % a.H, kvh = b * a.Hkv + h / (a.H / a.Hkv);
  const int64_t i0 = blk * a.block_m;
  Task k;
  k.m = std::min(a.block_m, a.N - i0);
  k.q = a.q + (bh * a.N + i0) * a.D;
  k.out = a.out + (bh * a.N + i0) * a.D;
  k.kp = a.kp + kvh * head_elems(a.Nk, a.D);
  k.vp = a.vp + kvh * head_elems(a.Nk, a.D);
  k.diag = a.causal ? i0 + (a.Nk - a.N) : kNoLimit;
  k.kvis = a.causal ? std::min(a.Nk, i0 + k.m + (a.Nk - a.N)) : a.Nk;
  k.window = a.causal ? a.window : 0;
  k.k0 = k.window ? std::max<int64_t>(0, k.diag - k.window + 1) / 32 * 32 : 0;
  return k;
}

// Per-thread buffers of one task. A task walks its query rows 32 at a time (a pair of tile
// rows): scores, softmax and P V of one pair finish before the next starts, so its scores and
// probabilities stay in L2 however long the prompt.
struct Buffers {
  uint16_t* q;   // [rows][Dp] the task's queries, zero padded
  float* s;      // [32][ld_s] one pair's scores
  uint16_t* p;   // [32][ld_p] its probabilities
  float* o;      // [rows][Dp] the output accumulator
  float* stats;  // [2 rows]: 1 / sum (slim), or running max and sum (flash)
  int64_t ld_s, ld_p;
};

// The query rows of a task as a zero-padded bf16 block.
void copy_queries(const Task& k, int64_t D, int64_t Dp, int64_t rows, uint16_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* row = dst + r * Dp;
    if (r < k.m) {
      std::memcpy(row, k.q + r * D, D * 2);
      std::fill(row + D, row + Dp, uint16_t{0});
    } else {
      std::fill(row, row + Dp, uint16_t{0});
    }
  }
}

// Keys [j0, j0 + n) that any row of the pair starting at r0 can see, in whole 32-key blocks
// (0: none).
int64_t visible_cols(const Task& k, int64_t r0, int64_t j0, int64_t n) {
  const int64_t last = std::min(k.m, r0 + 32) - 1;
  const int64_t end = std::min(n, last + k.diag + 1 - j0);
  return end > 0 ? round_up(end, 32) : 0;
}

// S[32][0, cols) = Q K^T of the pair at r0, keys from j0 on.
WBK_AMX_TARGET void pair_scores(bool amx, const Task& k, const Buffers& buf, int64_t Dp, int64_t r0, int64_t j0,
                                int64_t cols) {
  for (int64_t c = 0; c < cols; c += 32)
    block(amx, Dp, buf.q + r0 * Dp, Dp * 2, k.kp + (j0 + c) / 32 * Dp * 32, buf.s + c, buf.ld_s, false,
          std::min<int64_t>(32, k.m - r0));
}

// O[r0 .. r0 + 32) (+)= P V over the pair's cols keys from j0 on. Keys in chunks of kValueChunk,
// every 32-wide block of d inside: the chunk of P (32 rows, 16 KB) is read from L1 by each.
constexpr int64_t kValueChunk = 256;

WBK_AMX_TARGET void pair_values(bool amx, const Task& k, const Buffers& buf, int64_t Dp, int64_t Nk32, int64_t r0,
                                int64_t j0, int64_t cols, bool accumulate) {
  for (int64_t c0 = 0; c0 < cols; c0 += kValueChunk) {
    const int64_t kc = std::min(kValueChunk, cols - c0);
    for (int64_t c = 0; c < Dp; c += 32)
      block(amx, kc, buf.p + c0, buf.ld_p * 2, k.vp + ((c / 32) * Nk32 + (j0 + c0) / 32) * 1024, buf.o + r0 * Dp + c,
            Dp, accumulate || c0 > 0, std::min<int64_t>(32, k.m - r0));
  }
}

WBK_AMX_TARGET void slim_task(bool amx, const PrefillTileArgs& a, const Task& k, const Buffers& buf) {
  const int64_t Dp = round_up(a.D, 32), rows = round_up(k.m, 32), Nk32 = round_up(a.Nk, 32) / 32;
  copy_queries(k, a.D, Dp, rows, buf.q);
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    const int64_t cols = visible_cols(k, r0, k.k0, k.kvis - k.k0);
    pair_scores(amx, k, buf, Dp, r0, k.k0, cols);
    // The exact softmax of each row over its visible keys [lo, lim), rounded to bf16 for P V.
    for (int64_t i = 0; i < 32; ++i) {
      const int64_t r = r0 + i;
      uint16_t* p = buf.p + i * buf.ld_p;
      if (r >= k.m) {
        std::fill(p, p + cols, uint16_t{0});
        continue;
      }
      const float* s = buf.s + i * buf.ld_s;
      const int64_t lo = k.lo(r), lim = std::min(k.kvis, r + k.diag + 1) - k.k0;
      const float mx = row_max(s + lo, lim - lo) * a.scale;
      std::fill(p, p + lo, uint16_t{0});
      buf.stats[r] = 1.0f / exp_to_bf16(s + lo, lim - lo, a.scale, mx, p + lo, cols - lo);
    }
    pair_values(amx, k, buf, Dp, Nk32, r0, k.k0, cols, false);
  }
  for (int64_t r = 0; r < k.m; ++r) write_row(buf.o + r * Dp, a.D, buf.stats[r], k.out + r * a.D);
}

WBK_AMX_TARGET void flash_task(bool amx, const PrefillTileArgs& a, const Task& k, const Buffers& buf) {
  const int64_t Dp = round_up(a.D, 32), rows = round_up(k.m, 32), Nk32 = round_up(a.Nk, 32) / 32;
  float* row_m = buf.stats;
  float* row_l = buf.stats + rows;
  copy_queries(k, a.D, Dp, rows, buf.q);
  std::fill(row_m, row_m + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_l, row_l + rows, 0.0f);
  std::fill(buf.o, buf.o + rows * Dp, 0.0f);
  // Key tiles outside, pairs of query rows inside: a tile of K and V stays in L2 while every
  // pair of the task passes over it.
  for (int64_t j0 = k.k0; j0 < k.kvis; j0 += a.block_n) {
    const int64_t n = std::min(a.block_n, k.kvis - j0);
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
      const int64_t cols = visible_cols(k, r0, j0, n);
      if (cols == 0) continue;
      pair_scores(amx, k, buf, Dp, r0, j0, cols);
      // Online softmax: running max and sum per row, the accumulator rescaled when the max grows.
      for (int64_t i = 0; i < 32; ++i) {
        const int64_t r = r0 + i;
        uint16_t* p = buf.p + i * buf.ld_p;
        const int64_t lim = r < k.m ? std::clamp<int64_t>(r + k.diag + 1 - j0, 0, n) : 0;
        const int64_t lo = r < k.m ? std::clamp<int64_t>(k.lo(r) + k.k0 - j0, 0, n) : 0;  // keys before the window
        if (lim <= lo) {
          std::fill(p, p + cols, uint16_t{0});
          continue;
        }
        const float* s = buf.s + i * buf.ld_s;
        const float m_new = std::max(row_m[r], row_max(s + lo, lim - lo) * a.scale);
        const float alpha = std::exp(row_m[r] - m_new);
        std::fill(p, p + lo, uint16_t{0});
        row_l[r] = row_l[r] * alpha + exp_to_bf16(s + lo, lim - lo, a.scale, m_new, p + lo, cols - lo);
        if (alpha != 1.0f) scale_row(buf.o + r * Dp, Dp, alpha);
        row_m[r] = m_new;
      }
      pair_values(amx, k, buf, Dp, Nk32, r0, j0, cols, true);
    }
  }
  for (int64_t r = 0; r < k.m; ++r) write_row(buf.o + r * Dp, a.D, 1.0f / row_l[r], k.out + r * a.D);
}

// The tasks pulled from one counter by every thread, most expensive first (as run_tasks);
// a thread configures its tiles once and releases them when the queue is empty.
WBK_AMX_TARGET void run_thread(bool amx, bool slim, const PrefillTileArgs& a, std::atomic<int64_t>& next,
                               int64_t num_tasks) {
  const int64_t Dp = round_up(a.D, 32), rows = a.block_m;
  const int64_t width = slim ? round_up(a.Nk, 32) : a.block_n;
  const int64_t ld_s = width + 16, ld_p = width + 32;  // padded: rows of a power-of-two width apart in cache sets
  Scratch qs(0, rows * Dp / 2), ss(1, 32 * ld_s), ps(2, 32 * ld_p / 2), os(3, rows * Dp), st(4, 2 * rows);
  const Buffers buf{reinterpret_cast<uint16_t*>(qs.data()), ss.data(), reinterpret_cast<uint16_t*>(ps.data()),
                    os.data(), st.data(), ld_s, ld_p};
  if (amx) configure_tiles();
  for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) {
    const Task k = task_at(a, t);
    if (slim) {
      slim_task(amx, a, k, buf);
    } else {
      flash_task(amx, a, k, buf);
    }
  }
  if (amx) _tile_release();
}

void run(bool amx, bool slim, const PrefillTileArgs& a) {
  const int64_t num_tasks = a.B * a.H * ((a.N + a.block_m - 1) / a.block_m);
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { run_thread(amx, slim, a, next, num_tasks); });
}

// The keys of one 32-key block as B tiles of S = Q K^T: for each 32-long step of d, a tile of
// 16 keys is their 16 rows of 16 d pairs transposed (32-bit elements), so row p holds pair p
// of the 16 keys. Keys past Nk and d past D are zero.
WBK_AMX_TARGET void pack_key_block(const uint16_t* k, int64_t Nk, int64_t D, int64_t block, uint16_t* dst) {
  const int64_t Dp = round_up(D, 32);
  for (int64_t step = 0; step < Dp / 32; ++step)
    for (int64_t tile = 0; tile < 2; ++tile) {
      const int64_t j = block * 32 + tile * 16;
      pack_b_tile(k + j * D + step * 32, std::clamp<int64_t>(Nk - j, 0, 16), D, D - step * 32,
                  dst + (step * 2 + tile) * 512);
    }
}

// The values of one 32-key step as B tiles of O = P V: for each 32-wide block of d, a tile of
// 16 d has 16 rows, row p the 16 values of keys 2p and 2p + 1 interleaved. Keys past Nk and d
// past D are zero.
WBK_AMX_TARGET void pack_value_step(const uint16_t* v, int64_t Nk, int64_t D, int64_t step, int64_t Nk32,
                                    uint16_t* dst) {
  const int64_t Dp = round_up(D, 32);
  alignas(64) uint16_t order[32];  // out[2i] = row j's value i, out[2i + 1] = row j + 1's
  for (int i = 0; i < 16; ++i) {
    order[2 * i] = static_cast<uint16_t>(i);
    order[2 * i + 1] = static_cast<uint16_t>(16 + i);
  }
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t cb = 0; cb < Dp / 32; ++cb)
    for (int64_t tile = 0; tile < 2; ++tile) {
      const int64_t d0 = cb * 32 + tile * 16, n = std::clamp<int64_t>(D - d0, 0, 16);
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      uint16_t* t = dst + ((cb * Nk32 + step) * 2 + tile) * 512;
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t j = step * 32 + 2 * p;
        const __m256i lo = j < Nk ? _mm256_maskz_loadu_epi16(mask, v + j * D + d0) : _mm256_setzero_si256();
        const __m256i hi = j + 1 < Nk ? _mm256_maskz_loadu_epi16(mask, v + (j + 1) * D + d0) : _mm256_setzero_si256();
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        _mm512_storeu_si512(t + p * 32, _mm512_permutexvar_epi16(interleave, both));
      }
    }
}

}  // namespace

int64_t packed_kv_tile_elems(int64_t Nk, int64_t D) { return head_elems(Nk, D); }

void pack_kv_tiles(const uint16_t* k, const uint16_t* v, uint16_t* kp, uint16_t* vp, int64_t BHkv, int64_t Nk,
                   int64_t D) {
  const int64_t Nk32 = round_up(Nk, 32) / 32, per_head = head_elems(Nk, D), Dp = round_up(D, 32);
  at::parallel_for(0, BHkv * Nk32, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / Nk32, blk = t % Nk32;
      pack_key_block(k + bh * Nk * D, Nk, D, blk, kp + bh * per_head + blk * Dp * 32);
      pack_value_step(v + bh * Nk * D, Nk, D, blk, Nk32, vp + bh * per_head);
    }
  });
}

void attention_tiles(GemmEngine engine, const PrefillTileArgs& a, bool slim) {
  run(engine == GemmEngine::kAmxBf16, slim, a);
}

}  // namespace wbk
