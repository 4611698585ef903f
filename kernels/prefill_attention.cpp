// Prefill attention: SlimAttention and the FlashAttention-2 baseline.
//
// Layout: q [B, H, N, D], kp [B, Hkv] x packed keys (pack_keys: NR-wide panels of K^T, so
// that S = Q K^T streams them sequentially), vp [B, Hkv] x packed values (pack_values:
// NR-wide panels of V, so that O = P V streams them too), all fp32.
// GQA: query head h reads KV head h / (H / Hkv).
//
// Parallel split (both): one task per (batch, head, block of block_m query rows),
// pulled dynamically by the torch threads, most expensive (last, for causal) first.
//
// SlimAttention (one-dimensional split, the paper's section on SlimAttention):
//   S[block_m x kvis] = Q_blk K^T over only the keys the block can see, into one
//   fp32 score buffer per thread, reused from task to task; an exact softmax per row
//   (max, exp, sum: no running statistics); O_blk = P V; rows scaled by 1/sum.
//
// FlashAttention-2 (two-dimensional tiles): for each block_n-wide key tile,
//   S_tile = Q_blk K_tile^T, a running max and sum per row, rescale of the output
//   accumulator when the max grows, O += P_tile V_tile; divide by the sum at the end.
//
// Both use the same micro-kernel (gemm.h) and the same vector exp (simd.h), and both
// skip the keys a causal row cannot see, so a comparison measures the algorithms.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gemm.h"
#include "kernels.h"
#include "parallel.h"
#include "rows.h"
#include "simd.h"

namespace wbk {
namespace {

constexpr int W = VecF::W;

void zero_row(float* x, int64_t n) { std::fill(x, x + n, 0.0f); }

// Row stride for a score buffer of n columns: room for whole micro-kernel panels
// (gemm_packed_limit_n writes round_up(n, NR) columns), plus 16 floats so that a
// power-of-two n does not put every row of a panel in the same cache set.
int64_t padded_ld(int64_t n) { return (n + kGemmNR - 1) / kGemmNR * kGemmNR + 16; }

// Task t -> (batch*head, query block), most expensive query block first.
struct TaskMap {
  int64_t BH, num_blocks;
  void at(int64_t t, int64_t* bh, int64_t* blk) const {
    *blk = num_blocks - 1 - t / BH;
    *bh = t % BH;
  }
};

struct HeadView {
  const float* q;   // [m, D] rows of this block
  const float* kp;  // packed K^T of this KV head
  const float* vp;  // packed V of this KV head
  float* out;       // [m, D]
  int64_t i0, m;    // first query row, rows in block
  int64_t kvis;     // keys visible to the block's last row
  int64_t diag;     // row r (local) sees keys j <= r + diag
  int64_t k0;       // first key the block computes (a panel start): 0, or with a window the panel
                    // holding its first row's first visible key
  int64_t window;   // row r sees keys j > r + diag - window (0: no window)
  // Row r's first visible key, relative to k0.
  int64_t lo(int64_t r) const { return window ? std::max<int64_t>(0, r + diag - window + 1) - k0 : 0; }
};

HeadView view(const PrefillArgs& a, int64_t bh, int64_t blk) {
  const int64_t b = bh / a.H, h = bh % a.H, group = a.H / a.Hkv;
  const int64_t kvh = b * a.Hkv + h / group;
  HeadView hv;
  hv.i0 = blk * a.block_m;
  hv.m = std::min(a.block_m, a.N - hv.i0);
  hv.q = a.q + (bh * a.N + hv.i0) * a.D;
  hv.out = a.out + (bh * a.N + hv.i0) * a.D;
  hv.kp = a.kp + kvh * packed_keys_floats(a.Nk, a.D);
  hv.vp = a.vp + kvh * packed_values_floats(a.Nk, a.D);
  hv.diag = a.causal ? hv.i0 + (a.Nk - a.N) : kNoLimit;
  hv.kvis = a.causal ? std::min(a.Nk, hv.i0 + hv.m + (a.Nk - a.N)) : a.Nk;
  hv.window = a.causal ? a.window : 0;
  hv.k0 = hv.window ? std::max<int64_t>(0, hv.diag - hv.window + 1) / kGemmNR * kGemmNR : 0;
  return hv;
}

}  // namespace

namespace {

// fn(bh, p, head, widen) for every KV head bh and panel p, in parallel: head is the KV head's
// data as stored (fp32, or bf16 bits when `bf16`), widen its conversion to fp32.
template <typename Fn>
void for_each_panel(const void* src, bool bf16, int64_t BHkv, int64_t panels, int64_t head_elems, Fn&& fn) {
  at::parallel_for(0, BHkv * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / panels, p = t % panels;
      if (bf16) {
        fn(bh, p, static_cast<const uint16_t*>(src) + bh * head_elems, bf16_to_float);
      } else {
        fn(bh, p, static_cast<const float*>(src) + bh * head_elems, [](float x) { return x; });
      }
    }
  });
}

}  // namespace

int64_t packed_keys_floats(int64_t Nk, int64_t D) { return (Nk + kGemmNR - 1) / kGemmNR * kGemmNR * D; }

void pack_keys(const void* k, bool bf16, float* kp, int64_t BHkv, int64_t Nk, int64_t D) {
  const int64_t panels = (Nk + kGemmNR - 1) / kGemmNR;
  for_each_panel(k, bf16, BHkv, panels, Nk * D, [&](int64_t bh, int64_t p, auto* head, auto widen) {
    pack_b_panel(head, Nk, D, p, kp + bh * packed_keys_floats(Nk, D) + p * D * kGemmNR, widen);
  });
}

int64_t packed_values_floats(int64_t Nk, int64_t D) { return (D + kGemmNR - 1) / kGemmNR * kGemmNR * Nk; }

void pack_values(const void* v, bool bf16, float* vp, int64_t BHkv, int64_t Nk, int64_t D) {
  const int64_t panels = (D + kGemmNR - 1) / kGemmNR;
  for_each_panel(v, bf16, BHkv, panels, Nk * D, [&](int64_t bh, int64_t p, auto* head, auto widen) {
    pack_b_columns(head, Nk, D, p, Nk * kGemmNR, vp + bh * packed_values_floats(Nk, D), widen);
  });
}

void slim_attention(const PrefillArgs& a) {
  const int64_t num_blocks = (a.N + a.block_m - 1) / a.block_m;
  const TaskMap tasks{a.B * a.H, num_blocks};
  const int64_t ld_s = padded_ld(a.Nk);

  run_tasks(a.B * a.H * num_blocks, [&] {
    // Per-thread score buffer, reused by every task this thread runs.
    return [&a, &tasks, ld_s, scores = Scratch(0, a.block_m * ld_s),
            inv_sum = Scratch(1, a.block_m)](int64_t t) mutable {
      int64_t bh, blk;
      tasks.at(t, &bh, &blk);
      const HeadView hv = view(a, bh, blk);
      float* S = scores.data();

      // S = Q_blk K^T, visible columns only (from k0: with a window, the block's first visible panel).
      const int64_t k0 = hv.k0, cols = hv.kvis - k0, diag = hv.diag == kNoLimit ? kNoLimit : hv.diag - k0;
      gemm_packed_limit_n(hv.m, cols, a.D, hv.q, a.D, hv.kp + (k0 / kGemmNR) * a.D * kGemmNR, S, ld_s, diag, false);

      // Exact softmax of each row in one pass over its visible columns [lo, lim).
      for (int64_t r = 0; r < hv.m; ++r) {
        float* s = S + r * ld_s;
        const int64_t lo = hv.lo(r), lim = std::min(hv.kvis, r + hv.diag + 1) - k0;
        const float mx = row_max(s + lo, lim - lo);
        const float sum = exp_and_sum(s + lo, lim - lo, a.scale, mx * a.scale);
        zero_row(s, lo);  // keys before the window
        zero_row(s + lim, cols - lim);  // the P V product reads up to the panel's limit
        inv_sum[r] = 1.0f / sum;
      }

      // O_blk = P V, then normalise each row.
      gemm_packed_limit_k(hv.m, a.D, cols, S, ld_s, hv.vp + k0 * kGemmNR, a.Nk * kGemmNR, hv.out, a.D, diag, false);
      for (int64_t r = 0; r < hv.m; ++r) scale_row(hv.out + r * a.D, a.D, inv_sum[r]);
    };
  });
}

void flash_attention(const PrefillArgs& a) {
  const int64_t num_blocks = (a.N + a.block_m - 1) / a.block_m;
  const TaskMap tasks{a.B * a.H, num_blocks};
  const int64_t bn = a.block_n;
  const int64_t ld_s = padded_ld(bn);

  run_tasks(a.B * a.H * num_blocks, [&] {
    // Per-thread score tile and running (max, sum) per row.
    return [&a, &tasks, bn, ld_s, tile = Scratch(2, a.block_m * ld_s),
            stats = Scratch(3, 2 * a.block_m)](int64_t t) mutable {
      int64_t bh, blk;
      tasks.at(t, &bh, &blk);
      const HeadView hv = view(a, bh, blk);
      float* S = tile.data();
      float* row_m = stats.data();
      float* row_l = row_m + a.block_m;
      std::fill(row_m, row_m + hv.m, -std::numeric_limits<float>::infinity());
      std::fill(row_l, row_l + hv.m, 0.0f);
      for (int64_t r = 0; r < hv.m; ++r) zero_row(hv.out + r * a.D, a.D);

      for (int64_t j0 = hv.k0; j0 < hv.kvis; j0 += bn) {
        const int64_t n = std::min(bn, hv.kvis - j0);
        const int64_t diag = hv.diag == kNoLimit ? kNoLimit : hv.diag - j0;
        gemm_packed_limit_n(hv.m, n, a.D, hv.q, a.D, hv.kp + (j0 / kGemmNR) * a.D * kGemmNR, S, ld_s, diag,
                            false);

        // Online softmax: update running max and sum, rescale the accumulator.
        for (int64_t r = 0; r < hv.m; ++r) {
          float* s = S + r * ld_s;
          const int64_t lim = std::clamp<int64_t>(r + diag + 1, 0, n);
          const int64_t lo = std::clamp<int64_t>(hv.lo(r) + hv.k0 - j0, 0, n);  // keys before the window
          if (lim <= lo) {
            zero_row(s, n);
            continue;
          }
          const float m_new = std::max(row_m[r], row_max(s + lo, lim - lo) * a.scale);
          const float alpha = std::exp(row_m[r] - m_new);
          const float sum = exp_and_sum(s + lo, lim - lo, a.scale, m_new);
          zero_row(s, lo);
          zero_row(s + lim, n - lim);
          row_l[r] = row_l[r] * alpha + sum;
          if (alpha != 1.0f) scale_row(hv.out + r * a.D, a.D, alpha);
          row_m[r] = m_new;
        }

        // O += P_tile V_tile
        gemm_packed_limit_k(hv.m, a.D, n, S, ld_s, hv.vp + j0 * kGemmNR, a.Nk * kGemmNR, hv.out, a.D, diag, true);
      }
      for (int64_t r = 0; r < hv.m; ++r) scale_row(hv.out + r * a.D, a.D, 1.0f / row_l[r]);
    };
  });
}

}  // namespace wbk
