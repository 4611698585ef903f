// One decode step of the whole decoder stack in C++: for every layer,
//
//   h = RMSNorm(x) * attn_norm
//   qkv = h W_qkv^T; RoPE on the q and k heads; k, v appended to the layer's cache
//   x += decode_attention(q, cache) W_o^T
//   h = RMSNorm(x) * mlp_norm
//   x += (SiLU(h W_gate^T) * (h W_up^T)) W_down^T   (or a mixture of experts: mixture())
//
// with the same kernels the Python model calls one by one (linear.cpp, rope.cpp,
// kv_cache.cpp, decode_attention.cpp / decode_tiled.cpp), but without a Python call, a
// tensor allocation or the GIL between them. workbench/model/llama.py stays the readable
// reference of the same step (LlamaModel.decode with decode="python").
//
// On a rank of a tensor-parallel model (StepArgs::comm), o_proj and down_proj produce partial
// sums: each is all-reduced before the residual add, written straight into the collective's
// buffer where it offers one (zero copy).
//
// Per-part timers (attention, MLP, norms and adds, communication: the parts the Python path
// records) are steady_clock reads around each part, added into `timers` when asked for.
#include <algorithm>
#include <chrono>

#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

#include "blocks.h"
#include "kernels.h"
#include "simd.h"

namespace wbk {
namespace {

constexpr int W = VecF::W;

// y [n] = x [n] / sqrt(mean(x^2) + eps) * w, one row.
void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const VecF v = VecF::load(x + i);
    acc = fmadd(v, v, acc);
  }
  float ss = reduce_add(acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const VecF vinv = VecF::set1(inv);
  i = 0;
  for (; i + W <= n; i += W) (VecF::load(x + i) * vinv * VecF::load(w + i)).store(y + i);
  for (; i < n; ++i) y[i] = x[i] * inv * w[i];
}

// x [n] += y [n].
void add_row(float* x, const float* y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) (VecF::load(x + i) + VecF::load(y + i)).store(x + i);
  for (; i < n; ++i) x[i] += y[i];
}

// out [n] = SiLU(g) * u = g / (1 + exp(-g)) * u for one row of [gate | up].
void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  const VecF one = VecF::set1(1.0f), zero = VecF::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const VecF gv = VecF::load(g + i);
    (gv / (one + vexp(zero - gv)) * VecF::load(u + i)).store(out + i);
  }
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// out [n] = GELU(g) * u with GELU's tanh form, 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3)
// (Gemma's GeGLU), computed as g / (1 + exp(-2z)), the same value without 1 + tanh's
// cancellation where tanh is near -1 (the clamped exp saturates, giving -0 for large -g).
void gelu_tanh_mul_row(const float* g, const float* u, float* out, int64_t n) {
  constexpr float kC = 0.7978845608028654f, kA = 0.044715f;
  const VecF one = VecF::set1(1.0f), zero = VecF::zero();
  const VecF c2 = VecF::set1(2.0f * kC), a = VecF::set1(kA);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const VecF gv = VecF::load(g + i);
    const VecF z2 = c2 * gv * fmadd(a * gv, gv, one);  // 2z
    (gv / (one + vexp(zero - z2)) * VecF::load(u + i)).store(out + i);
  }
  for (; i < n; ++i) {
    const float x = g[i];
    out[i] = x / (1.0f + std::exp(-2.0f * kC * (x + kA * x * x * x))) * u[i];
  }
}

void act_mul_row(Activation act, const float* g, const float* u, float* out, int64_t n) {
  if (act == Activation::kGeluTanh)
    gelu_tanh_mul_row(g, u, out, n);
  else
    silu_mul_row(g, u, out, n);
}

// y [M, w.N] = x . w^T for one part of a linear layer (rows w.N apart).
void linear_part(const float* x, const WeightRef& w, float* y, int64_t M) {
  if (M <= matvec_max_rows(w.dtype)) {
    linear_matvec(x, w.w, w.dtype, w.scale, y, M, w.N, w.K);
  } else {
    linear_gemm(x, w.w, w.dtype, w.scale, y, M, w.N, w.K);
  }
}

// Rows [lo, lo + n) of one part's weights (row-major [N, K] elements or block rows, scales
// per row or per row and group): a part of its own.
WeightRef weight_rows(const WeightRef& w, int64_t lo, int64_t n) {
  const int64_t row_bytes = is_block(w.dtype)                     ? block_row_bytes(w.dtype, w.K)
                            : w.dtype == WeightDtype::kFloat32     ? 4 * w.K
                            : w.dtype == WeightDtype::kBFloat16    ? 2 * w.K
                                                                   : w.K;
  const int64_t scales = w.dtype == WeightDtype::kInt8Group ? (w.K + kWeightGroup - 1) / kWeightGroup : 1;
  return {static_cast<const uint8_t*>(w.w) + lo * row_bytes, w.dtype, w.scale ? w.scale + lo * scales : nullptr, n,
          w.K};
}

// Output rows [lo, lo + n) of a linear layer: the parts (or pieces of parts) that hold them.
LinearRef linear_rows_of(const LinearRef& L, int64_t lo, int64_t n) {
  LinearRef out;
  out.K = L.K;
  int64_t first = 0;  // the first output row of the part
  for (const WeightRef& part : L.parts) {
    const int64_t a = std::max(lo, first), b = std::min(lo + n, first + part.N);
    if (a < b) {
      out.parts.push_back(weight_rows(part, a - first, b - a));
      out.N += b - a;
    }
    first += part.N;
  }
  return out;
}

// y [M, L.N] (rows ldy apart) = x . L^T: each part's outputs in its columns of y. One part
// writing whole rows runs straight into y; otherwise a part's rows of x are computed into
// `scratch` and copied (except at M = 1, where its columns are one contiguous piece of y).
void linear(const float* x, const LinearRef& L, float* y, int64_t ldy, int64_t M, std::vector<float>& scratch) {
  if (L.parts.size() == 1 && (ldy == L.N || M == 1)) {
    linear_part(x, L.parts[0], y, M);
    return;
  }
  int64_t col = 0;
  for (const WeightRef& part : L.parts) {
    if (M == 1) {
      linear_part(x, part, y + col, 1);
    } else {
      scratch.resize(M * part.N);
      linear_part(x, part, scratch.data(), M);
      for (int64_t m = 0; m < M; ++m)
        std::copy(scratch.data() + m * part.N, scratch.data() + (m + 1) * part.N, y + m * ldy + col);
    }
    col += part.N;
  }
}

// y[b, 0:n] (rows ldy apart) = x[b] times output rows [lo, lo + n) of L, for the B rows of x.
void linear_rows(const float* x, const LinearRef& L, int64_t lo, int64_t n, float* y, int64_t ldy, int64_t B,
                 std::vector<float>& scratch) {
  linear(x, linear_rows_of(L, lo, n), y, ldy, B, scratch);
}

using Clock = std::chrono::steady_clock;
inline double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Where o_proj / down_proj write: the collective's own buffer when it offers one (zero copy),
// else the step's.
float* output_buffer(StepCollective* comm, float* own, int64_t n) {
  float* shared = comm ? comm->buffer(n) : nullptr;
  return shared ? shared : own;
}

// The all-reduce of a partial o_proj / down_proj output (tensor parallel); its seconds.
double all_reduce(StepCollective* comm, float* data, int64_t n) {
  if (!comm) return 0.0;
  const auto c0 = Clock::now();
  comm->all_reduce(data, n);
  return seconds(c0, Clock::now());
}

// The k and v of one KV head, hand [B, 2, D], into each row of qkv (width floats apart) at
// k_unit and v_unit (in units of D floats).
void place_head(const float* hand, float* qkv, int64_t B, int64_t D, int64_t width, int64_t k_unit, int64_t v_unit) {
  for (int64_t b = 0; b < B; ++b) {
    const float* kv = hand + b * 2 * D;
    std::copy(kv, kv + D, qkv + b * width + k_unit * D);
    std::copy(kv + D, kv + 2 * D, qkv + b * width + v_unit * D);
  }
}

// qkv [B, (H + 2 Hkv) D] = h W_qkv^T, with the shared KV head handed off where the rank shares
// one (StackShape::kv_send / kv_recv) and the collective can: the sending rank computes that
// head's k and v rows first and puts them, then its other rows; the receiving rank computes
// every row but that head's and then gets them. The rows are the ones the rank would compute
// itself, from the same weights, so its k and v are the same numbers either way. Returns the
// seconds spent in put and get (the step's communication).
double qkv_projection(const float* h, const LinearRef& w, const StackShape& s, StepCollective* comm, int64_t B,
                      float* qkv, StepBuffers& buf) {
  const int64_t H = s.H, Hkv = s.Hkv, D = s.D, width = (H + 2 * Hkv) * D, n = B * 2 * D;
  const bool send = s.kv_send, recv = s.kv_recv;
  if (!comm || !(send || recv) || !comm->hands_off(n)) {
    linear(h, w, qkv, width, B, buf.rows);
    return 0.0;
  }
  // In units of D rows: k of KV head j is unit H + j, its v unit H + Hkv + j. The units not
  // computed in order below: the sent head's (computed first) and the received head's.
  const int64_t units = H + 2 * Hkv;
  auto handed = [&](int64_t u) {
    return (send && (u == H || u == H + Hkv)) || (recv && (u == H + Hkv - 1 || u == units - 1));
  };
  double comm_s = 0.0;
  buf.handoff.resize(n);
  float* hand = buf.handoff.data();  // [B, 2, D]: k then v of each row
  if (send) {
    linear_rows(h, w, H * D, D, hand, 2 * D, B, buf.rows);
    linear_rows(h, w, (H + Hkv) * D, D, hand + D, 2 * D, B, buf.rows);
    const auto c0 = Clock::now();
    comm->put(hand, n);
    comm_s += seconds(c0, Clock::now());
    place_head(hand, qkv, B, D, width, H, H + Hkv);
  }
  for (int64_t u = 0; u < units;) {  // every run of rows not handed off, in order
    if (handed(u)) {
      ++u;
      continue;
    }
    int64_t end = u;
    while (end < units && !handed(end)) ++end;
    linear_rows(h, w, u * D, (end - u) * D, qkv + u * D, width, B, buf.rows);
    u = end;
  }
  if (recv) {
    const auto c0 = Clock::now();
    comm->get(hand, n);
    comm_s += seconds(c0, Clock::now());
    place_head(hand, qkv, B, D, width, H + Hkv - 1, units - 1);
  }
  return comm_s;
}

// The mixture of experts in place of the MLP, for the B rows of h: out [B, dim] = for each
// token, the sum over its top_k experts of weight * down(act(gate) * up)(h). The router's
// softmax and top-k per token (ties to the lower expert), then each expert that any token
// chose runs once on all of its rows (its weights read once a step), its outputs weighted
// into those rows.
void mixture(const float* h, const LayerRef& L, const StackShape& s, int64_t B, float* out, StepBuffers& buf) {
  const int64_t dim = s.dim, E = L.router.N, K = L.top_k, F = s.ffn;
  buf.probs.resize(B * E);
  linear(h, L.router, buf.probs.data(), E, B, buf.rows);
  buf.choice.resize(B * K);
  buf.choice_weight.resize(B * K);
  for (int64_t b = 0; b < B; ++b) {
    float* p = buf.probs.data() + b * E;
    const float top = *std::max_element(p, p + E);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - top));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    int64_t* c = buf.choice.data() + b * K;
    float* w = buf.choice_weight.data() + b * K;
    float chosen = 0.0f;
    for (int64_t k = 0; k < K; ++k) {  // the k-th largest, ties to the lower expert
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (std::find(c, c + k, e) != c + k) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      c[k] = best;
      w[k] = p[best];
      chosen += p[best];
    }
    if (L.norm_topk)
      for (int64_t k = 0; k < K; ++k) w[k] /= chosen;
  }
  // The rows routed to each expert, expert by expert: expert e's are moe_rows[off[e], off[e + 1]).
  auto& off = buf.moe_offsets;
  off.assign(E + 1, 0);
  for (int64_t i = 0; i < B * K; ++i) ++off[buf.choice[i] + 1];
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  const int64_t total = off[E];
  buf.moe_rows.resize(total);
  buf.moe_row_weight.resize(total);
  buf.moe_index.assign(off.begin(), off.end() - 1);  // a cursor per expert while filling
  for (int64_t i = 0; i < B * K; ++i) {
    const int64_t at = buf.moe_index[buf.choice[i]]++;
    buf.moe_rows[at] = i / K;
    buf.moe_row_weight[at] = buf.choice_weight[i];
  }
  buf.moe_index.resize(total);  // then the rows 0 .. total - 1 of the down products' input
  for (int64_t r = 0; r < total; ++r) buf.moe_index[r] = r;
  bool grouped = true;  // every routed expert's matrices in a format matvec_jobs takes, few rows each
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = off[e + 1] - off[e];
    if (L.expert_hits) L.expert_hits[e] = static_cast<int32_t>(n);
    if (n == 0 || L.experts[e].gate_up.parts.empty()) continue;  // not routed to, or held by another rank
    for (const LinearRef* lin : {&L.experts[e].gate_up, &L.experts[e].down})
      for (const WeightRef& part : lin->parts)
        grouped = grouped && matvec_job_format(part.dtype, part.K) && n <= matvec_max_rows(part.dtype);
  }
  buf.moe_gate_up.resize(total * 2 * F);
  buf.moe_act.resize(total * F);
  buf.moe_out.resize(total * dim);
  // Expert e's outputs for its rows go to rows off[e] .. of moe_gate_up and moe_out: the jobs of
  // one kind of matrix (each expert's parts) in one parallel region, or expert by expert.
  auto run = [&](const float* x, int64_t M, int64_t Kx, bool gate_up, const int64_t* rows_of, float* y, int64_t ldy) {
    buf.moe_jobs.clear();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = off[e + 1] - off[e];
      if (n == 0 || L.experts[e].gate_up.parts.empty()) continue;  // another rank's expert: its rows stay 0
      const LinearRef& lin = gate_up ? L.experts[e].gate_up : L.experts[e].down;
      if (!grouped) {  // the expert's rows gathered, then its matrices as any linear layer
        buf.moe_in.resize(n * Kx);
        for (int64_t r = 0; r < n; ++r)
          std::copy(x + rows_of[off[e] + r] * Kx, x + (rows_of[off[e] + r] + 1) * Kx, buf.moe_in.data() + r * Kx);
        linear(buf.moe_in.data(), lin, y + off[e] * ldy, ldy, n, buf.rows);
        continue;
      }
      int64_t col = 0;
      for (const WeightRef& part : lin.parts) {
        buf.moe_jobs.push_back({part.w, part.dtype, part.scale, part.N, rows_of + off[e], n, y + off[e] * ldy + col, ldy});
        col += part.N;
      }
    }
    if (grouped) matvec_jobs(x, M, Kx, buf.moe_jobs.data(), static_cast<int64_t>(buf.moe_jobs.size()));
  };
  // The rows of the experts this rank holds (all, in one process): [lo, hi) runs of rows.
  auto each_held_row = [&](auto&& f) {
    for (int64_t e = 0; e < E; ++e)
      if (!L.experts[e].gate_up.parts.empty())
        for (int64_t r = off[e]; r < off[e + 1]; ++r) f(r);
  };
  run(h, B, dim, true, buf.moe_rows.data(), buf.moe_gate_up.data(), 2 * F);
  each_held_row([&](int64_t r) {
    const float* gu = buf.moe_gate_up.data() + r * 2 * F;
    act_mul_row(s.act, gu, gu + F, buf.moe_act.data() + r * F, F);
  });
  run(buf.moe_act.data(), total, F, false, buf.moe_index.data(), buf.moe_out.data(), dim);
  std::fill(out, out + B * dim, 0.0f);
  each_held_row([&](int64_t r) {  // each token's experts' outputs, weighted (expert parallel: the ones held here)
    float* o = out + buf.moe_rows[r] * dim;
    const float* y = buf.moe_out.data() + r * dim;
    const float w = buf.moe_row_weight[r];
    for (int64_t i = 0; i < dim; ++i) o[i] += w * y[i];
  });
}

}  // namespace

double wake_threads() {
  // After an idle gap between steps (sampling, streamed output, a notebook's widgets) the
  // pool's workers sleep, and the first parallel region pays their wake-up: an empty one,
  // timed on its own, keeps that out of layer 0's clock.
  const auto w0 = Clock::now();
  at::parallel_for(0, at::get_num_threads(), 1, [](int64_t, int64_t) {});
  return seconds(w0, Clock::now());
}

double decode_stack_step(const StackShape& s, const std::vector<LayerRef>& layers, const StepArgs& a,
                         StepBuffers& buf) {
  const double wake_s = wake_threads();
  const int64_t B = a.B, dim = s.dim, D = s.D, H = s.H, Hkv = s.Hkv, ffn = s.ffn;
  const int64_t qkv_w = (H + 2 * Hkv) * D;
  buf.ring_positions.resize(B);
  buf.ring_lengths.resize(B);
  int64_t ring = 0;  // the ring size the slots below are for (windowed layers all share one so far)
  buf.h.resize(B * dim);
  buf.qkv.resize(B * qkv_w);
  buf.q.resize(B * H * D);
  buf.k.resize(B * Hkv * D);
  buf.v.resize(B * Hkv * D);
  buf.attn.resize(B * H * D);
  buf.out.resize(B * dim);
  buf.gate_up.resize(B * 2 * ffn);
  buf.act.resize(B * ffn);
  float *h = buf.h.data(), *qkv = buf.qkv.data(), *out = buf.out.data();

  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerRef& L = layers[l];
    const auto t0 = Clock::now();
    for (int64_t b = 0; b < B; ++b) rms_norm_row(a.x + b * dim, L.attn_norm, h + b * dim, dim, s.eps);
    const auto t1 = Clock::now();

    // Attention block: QKV (+ bias, per-head norms), RoPE, cache append, attention, o_proj.
    const double handoff_s = qkv_projection(h, L.qkv, s, a.comm, B, qkv, buf);
    for (int64_t b = 0; b < B; ++b) {
      float* row = qkv + b * qkv_w;
      if (L.qkv_bias) add_row(row, L.qkv_bias, qkv_w);
      if (L.q_norm)
        for (int64_t hh = 0; hh < H; ++hh) rms_norm_row(row + hh * D, L.q_norm, row + hh * D, D, s.eps);
      if (L.k_norm)
        for (int64_t hh = H; hh < H + Hkv; ++hh) rms_norm_row(row + hh * D, L.k_norm, row + hh * D, D, s.eps);
    }
    rope_rotate_half(qkv, B, qkv_w, H + Hkv, D, s.rotary, a.cos[L.rope], a.sin[L.rope]);
    // A windowed layer's cache is a ring: the token goes to slot position % window, and
    // attention reads every slot filled so far (the last `window` tokens, in slot order).
    const int64_t* positions = a.positions;
    const int64_t* lengths = a.lengths;
    if (L.window) {
      if (ring != L.Lmax) {
        for (int64_t b = 0; b < B; ++b) {
          buf.ring_positions[b] = a.positions[b] % L.Lmax;
          buf.ring_lengths[b] = std::min(a.lengths[b], L.Lmax);
        }
        ring = L.Lmax;
      }
      positions = buf.ring_positions.data();
      lengths = buf.ring_lengths.data();
    }
    for (int64_t b = 0; b < B; ++b) {  // q, k, v as [B, heads, D] for the cache and attention kernels
      const float* row = qkv + b * qkv_w;
      std::copy(row, row + H * D, buf.q.data() + b * H * D);
      std::copy(row + H * D, row + (H + Hkv) * D, buf.k.data() + b * Hkv * D);
      std::copy(row + (H + Hkv) * D, row + qkv_w, buf.v.data() + b * Hkv * D);
    }
    kv_cache_append({buf.k.data(), L.k_cache, L.k_scale, positions, B, Hkv, 1, L.Lmax, D, s.dtype, s.k_layout});
    kv_cache_append({buf.v.data(), L.v_cache, L.v_scale, positions, B, Hkv, 1, L.Lmax, D, s.dtype, s.v_layout});
    DecodeArgs da{buf.q.data(), L.k_cache, L.v_cache, L.k_scale, L.v_scale, lengths, buf.attn.data(), B, H, Hkv,
                  L.Lmax, D, s.dtype, s.scale, std::min(a.num_splits, L.Lmax), s.int8_kernel, s.heads};
    decode_attention(da);
    float* o_out = output_buffer(a.comm, out, B * dim);
    linear(buf.attn.data(), L.o, o_out, dim, B, buf.rows);
    const double attn_comm_s = handoff_s + all_reduce(a.comm, o_out, B * dim);
    const auto t2 = Clock::now();

    for (int64_t b = 0; b < B; ++b) {
      if (L.post_attn_norm) rms_norm_row(o_out + b * dim, L.post_attn_norm, o_out + b * dim, dim, s.eps);
      add_row(a.x + b * dim, o_out + b * dim, dim);
      rms_norm_row(a.x + b * dim, L.mlp_norm, h + b * dim, dim, s.eps);
    }
    const auto t3 = Clock::now();

    // MLP: [gate | up], SiLU(gate) * up, down; or the mixture of experts in its place.
    float* d_out = output_buffer(a.comm, out, B * dim);
    if (!L.experts.empty()) {
      mixture(h, L, s, B, d_out, buf);
    } else {
      linear(h, L.gate_up, buf.gate_up.data(), 2 * ffn, B, buf.rows);
      for (int64_t b = 0; b < B; ++b) {
        const float* gu = buf.gate_up.data() + b * 2 * ffn;
        act_mul_row(s.act, gu, gu + ffn, buf.act.data() + b * ffn, ffn);
      }
      linear(buf.act.data(), L.down, d_out, dim, B, buf.rows);
    }
    const double mlp_comm_s = all_reduce(a.comm, d_out, B * dim);
    const auto t4 = Clock::now();
    for (int64_t b = 0; b < B; ++b) {
      if (L.post_mlp_norm) rms_norm_row(d_out + b * dim, L.post_mlp_norm, d_out + b * dim, dim, s.eps);
      add_row(a.x + b * dim, d_out + b * dim, dim);
    }
    if (a.timers) {
      const auto t5 = Clock::now();
      double* t = a.timers + kTimerParts * l;
      t[0] += seconds(t1, t2) - attn_comm_s;
      t[1] += seconds(t3, t4) - mlp_comm_s;
      t[2] += seconds(t0, t1) + seconds(t2, t3) + seconds(t4, t5);
      t[3] += attn_comm_s + mlp_comm_s;
    }
  }
  return wake_s;
}

void rms_norm_rows(const float* x, const float* w, float* y, int64_t T, int64_t n, float eps) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(x + t * n, w, y + t * n, n, eps);
  });
}

void act_mul_rows(Activation act, const float* gate_up, float* out, int64_t T, int64_t F) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      act_mul_row(act, gate_up + t * 2 * F, gate_up + t * 2 * F + F, out + t * F, F);
  });
}

}  // namespace wbk
