// Argument checks and calls of the kernels for the Python module (see ops.h).
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "blocks.h"
#include "prefetch.h"

namespace wbk::ops {

// -- the checks shared by several of ops.h's functions (this file only) ----------------------

namespace {

void check_tensor(const Tensor& t, const char* fn, const char* name, int64_t dim, const char* layout,
                  bool need_contiguous = true) {
  TORCH_CHECK_VALUE(t.defined(), fn, ": ", name, " is missing");
  TORCH_CHECK_VALUE(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.dim() == dim, fn, ": ", name, " must be a ", dim, "-D tensor ", layout, ", got shape ",
                    t.sizes());
  TORCH_CHECK_VALUE(!need_contiguous || t.is_contiguous(), fn, ": ", name,
                    " must be contiguous (call .contiguous()), got shape ", t.sizes(), " with strides ",
                    t.strides());
}

void check_float_input(const Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, fn, ": ", name,
                   " must be float32 or bfloat16, got ", t.scalar_type());
}

float checked_scale(std::optional<double> scale, int64_t D, const char* fn) {
  if (!scale) return static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  TORCH_CHECK_VALUE(std::isfinite(*scale) && *scale > 0.0, fn, ": scale must be a finite number > 0, got ",
                    *scale);
  return static_cast<float>(*scale);
}

wbk::CacheDtype cache_dtype(const Tensor& t, const char* fn, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return wbk::CacheDtype::kFloat32;
    case at::kHalf:
      return wbk::CacheDtype::kFloat16;
    case at::kBFloat16:
      return wbk::CacheDtype::kBFloat16;
    case at::kChar:
      return wbk::CacheDtype::kInt8;
    default:
      TORCH_CHECK_TYPE(false, fn, ": ", name, " must be int8, float16, bfloat16 or float32, got ",
                       t.scalar_type());
  }
}

// lengths / positions: a 1-D integer tensor of B values in [lo, hi]; returned as contiguous int64.
Tensor checked_positions(const Tensor& t, const char* fn, const char* name, int64_t B, int64_t lo, int64_t hi,
                         const char* meaning) {
  check_tensor(t, fn, name, 1, "[B]");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, fn, ": ", name,
                   " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.size(0) == B, fn, ": ", name, " must have one entry per sequence (B = ", B, "), got ",
                    t.size(0));
  Tensor r = t.to(at::kLong).contiguous();
  if (B > 0) {
    // A plain loop: B is small, and torch reductions cost tens of microseconds per call here.
    const int64_t* p = r.data_ptr<int64_t>();
    const int64_t mn = *std::min_element(p, p + B), mx = *std::max_element(p, p + B);
    TORCH_CHECK_VALUE(mn >= lo && mx <= hi, fn, ": every entry of ", name, " must be in [", lo, ", ", hi, "] (",
                      meaning, "), got values in [", mn, ", ", mx, "]");
  }
  return r;
}

// The packed keys and values of one call live in a buffer kept by the calling thread, so
// repeated calls do not page-fault tens of megabytes in each time (profiled: first-touch page
// clearing took a sixth of a decode benchmark's time). The cap holds a 4096-token prompt of
// 32 KV heads of 128 (K and V in bf16 tiles, or in fp32 panels); buffers above it are
// allocated per call.
constexpr int64_t kWorkspaceCapFloats = int64_t{32} << 20;  // 128 MiB

float* packed_kv_workspace(int64_t floats, Tensor& fallback) {
  thread_local std::unique_ptr<float[]> buffer;
  thread_local int64_t size = 0;
  if (floats > kWorkspaceCapFloats) {
    fallback = at::empty({floats}, at::kFloat);
    return fallback.data_ptr<float>();
  }
  if (size < floats) {
    buffer.reset(new float[static_cast<size_t>(floats)]);
    size = floats;
  }
  return buffer.get();
}

Tensor prefill(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, std::optional<double> scale,
               int64_t block_m, int64_t block_n, bool slim, int64_t window) {
  const char* fn = slim ? "slim_attention" : "flash_attention";
  check_tensor(q, fn, "q", 4, "[B, H, N, D]");
  check_tensor(k, fn, "k", 4, "[B, Hkv, Nk, D]");
  check_tensor(v, fn, "v", 4, "[B, Hkv, Nk, D]");
  check_float_input(q, fn, "q");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), fn,
                   ": q, k and v must have the same dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
                   v.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Nk = k.size(2);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), fn, ": k and v must have the same shape, got ", k.sizes(), " and ",
                    v.sizes());
  TORCH_CHECK_VALUE(k.size(0) == B, fn, ": k has batch ", k.size(0), " but q has batch ", B);
  TORCH_CHECK_VALUE(k.size(3) == D, fn, ": k has head dim ", k.size(3), " but q has head dim ", D);
  TORCH_CHECK_VALUE(D >= 1, fn, ": head dim D must be >= 1, got ", D);
  TORCH_CHECK_VALUE(Hkv >= 1 && H % Hkv == 0, fn, ": the number of query heads H (", H,
                    ") must be a multiple of the number of KV heads Hkv (", Hkv, ")");
  TORCH_CHECK_VALUE(!causal || Nk >= N, fn, ": causal attention needs at least as many keys as queries ",
                    "(the queries are the last N of Nk positions), got N = ", N, ", Nk = ", Nk);
  TORCH_CHECK_VALUE(N == 0 || Nk >= 1, fn, ": k and v have no keys (Nk = 0)");
  TORCH_CHECK_VALUE(block_m >= 1, fn, ": block_m must be >= 1, got ", block_m);
  TORCH_CHECK_VALUE(block_n >= 1, fn, ": block_n must be >= 1, got ", block_n);
  TORCH_CHECK_VALUE(window >= 0, fn, ": window must be >= 0 (0: none), got ", window);
  TORCH_CHECK_VALUE(window == 0 || causal, fn, ": a sliding window needs causal attention");
  const float s = checked_scale(scale, D, fn);

  if (q.numel() == 0) return at::empty({B, H, N, D}, q.options());
  // bf16 inputs run on the bf16 engine in force (prefill_tiles.cpp), as the GEMM does for bf16
  // weights; set_gemm_engine("fma") sends them to the fp32 kernels below.
  const wbk::GemmEngine engine = wbk::gemm_engine_for(wbk::WeightDtype::kBFloat16);
  if (q.scalar_type() == at::kBFloat16 &&
      (engine == wbk::GemmEngine::kAmxBf16 || engine == wbk::GemmEngine::kAvx512Bf16)) {
    Tensor qb = q.contiguous(), kb = k.contiguous(), vb = v.contiguous();
    const int64_t per_head = wbk::packed_kv_tile_elems(Nk, D);
    Tensor fallback;
    auto* kp = reinterpret_cast<uint16_t*>(packed_kv_workspace(B * Hkv * per_head, fallback));  // K, then V
    uint16_t* vp = kp + B * Hkv * per_head;
    const auto bits = [](const Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
    wbk::pack_kv_tiles(bits(kb), bits(vb), kp, vp, B * Hkv, Nk, D);
    // Whole 32-row pairs of queries and whole 32-key blocks: the tiles' granularity.
    const int64_t bm = std::clamp<int64_t>((std::min(block_m, N) + 31) / 32 * 32, 32, wbk::kMaxTileBlockM);
    Tensor out16 = at::empty({B, H, N, D}, q.options());  // written in bf16 by the kernel
    const wbk::PrefillTileArgs a{bits(qb), kp, vp, reinterpret_cast<uint16_t*>(out16.data_ptr()), B, H, Hkv, N, Nk,
                                 D, causal, s, bm, (block_n + 31) / 32 * 32, window};
    wbk::attention_tiles(engine, a, slim);
    return out16;
  }
  Tensor out = at::empty({B, H, N, D}, q.options().dtype(at::kFloat));
  // bf16 is widened once up front: O(N D) work against the O(N^2 D) of attention. Keys and
  // values are packed into the micro-kernel's panels (and widened) in one pass each.
  Tensor qf = q.to(at::kFloat).contiguous();
  Tensor fallback;
  const int64_t key_floats = B * Hkv * wbk::packed_keys_floats(Nk, D);
  float* kp = packed_kv_workspace(key_floats + B * Hkv * wbk::packed_values_floats(Nk, D), fallback);
  float* vp = kp + key_floats;
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  wbk::pack_keys(k.data_ptr(), bf16, kp, B * Hkv, Nk, D);  // k and v: checked contiguous above
  wbk::pack_values(v.data_ptr(), bf16, vp, B * Hkv, Nk, D);
  // Key tiles start on micro-kernel panels: block_n rounds up to a multiple of gemm_nr().
  const int64_t nr = wbk::gemm_nr();
  wbk::PrefillArgs a{qf.data_ptr<float>(), kp, vp, out.data_ptr<float>(),
                     B, H, Hkv, N, Nk, D, causal, s, std::min(block_m, N), (block_n + nr - 1) / nr * nr, window};
  if (slim) {
    wbk::slim_attention(a);
  } else {
    wbk::flash_attention(a);
  }
  return out.to(q.scalar_type());
}

// The int8 decode kernel called `name` ("widen", "dot" or "tile"); an int8 kernel other than
// "widen" needs an int8 cache.
wbk::Int8Kernel int8_kernel_named(const std::string& name, bool is_int8, const char* fn, at::ScalarType dtype) {
  int found = -1;
  for (int i = 0; i < 3; ++i)
    if (name == wbk::kInt8KernelNames[i]) found = i;
  TORCH_CHECK_VALUE(found >= 0, fn, ": int8_kernel must be one of widen, dot, tile, got '", name, "'");
  const auto kernel = static_cast<wbk::Int8Kernel>(found);
  TORCH_CHECK_VALUE(kernel == wbk::Int8Kernel::kWiden || is_int8, fn, ": int8_kernel '", name,
                    "' needs an int8 cache, but the cache is ", dtype);
  return kernel;
}

// The tiled int8 layout's shape rules (kernels.h), checked before any kernel runs.
void check_tiled_shape(int64_t Lmax, int64_t D, const char* fn, const char* name) {
  TORCH_CHECK_VALUE(Lmax % wbk::kTiledAlign == 0, fn, ": the tiled layout needs ", name,
                    "'s Lmax to be a multiple of ", wbk::kTiledAlign, ", got ", Lmax);
  TORCH_CHECK_VALUE(D % 4 == 0, fn, ": the tiled layout needs the head dim D to be a multiple of 4, got ", D);
}

// head_map(group, q_offset): the HeadMap of a decode call or a fused step, checked against its
// H query heads and Hkv KV heads (group 0: the uniform H / Hkv).
wbk::HeadMap checked_head_map(int64_t group, int64_t q_offset, int64_t H, int64_t Hkv, const char* fn) {
  const wbk::HeadMap m{group, q_offset};
  const std::string why = wbk::head_map_error(m, H, Hkv);
  TORCH_CHECK_VALUE(why.empty(), fn, ": ", why);
  return m;
}

// A linear layer's weights w [N, K] (fp32, bf16, or int8 with `scale` [N] per row or
// [N, ceil(K / 32)] per 32 weights), or block-quantized rows: uint8 [N, row bytes] with the
// block `kernel` named (blocks.h), checked, as the linear kernels take them.
wbk::WeightRef checked_weight(const Tensor& w, const std::optional<Tensor>& scale, const char* fn,
                              const std::string& name, int64_t K, const std::string& kernel = "") {
  const char* nm = name.c_str();
  if (w.defined() && w.scalar_type() == at::kByte) {
    check_tensor(w, fn, nm, 2, "[N, row bytes]");
    TORCH_CHECK_VALUE(!kernel.empty(), fn, ": ", nm, " is uint8, block-quantized rows: name their kernel (",
                      "q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k or i4_g128)");
    const wbk::WeightDtype kind = weight_kernel(kernel, fn);
    TORCH_CHECK_VALUE(wbk::is_block(kind), fn, ": ", nm, " is uint8 but kernel '", kernel,
                      "' is not a block-quantized one");
    const std::string why = wbk::block_row_error(kind, K);
    TORCH_CHECK_VALUE(why.empty(), fn, ": ", nm, " (", kernel, ") with K = ", K, ": ", why);
    TORCH_CHECK_VALUE(w.size(1) == wbk::block_row_bytes(kind, K), fn, ": ", nm, " (", kernel, ") rows of K = ", K,
                      " weights take ", wbk::block_row_bytes(kind, K), " bytes, but its rows have ", w.size(1));
    TORCH_CHECK_VALUE(!scale.has_value(), fn, ": ", nm, " (", kernel, ") holds its scales in its blocks; scale must be None");
    return {w.data_ptr(), kind, nullptr, w.size(0), K};
  }
  check_tensor(w, fn, nm, 2, "[N, K]");
  TORCH_CHECK_TYPE(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat || w.scalar_type() == at::kChar,
                   fn, ": ", nm, " must be float32, bfloat16 or int8 (with scale), got ", w.scalar_type());
  const int64_t N = w.size(0);
  TORCH_CHECK_VALUE(w.size(1) == K, fn, ": x has K = ", K, " columns but ", nm, " has ", w.size(1),
                    " (w is [out_features, in_features])");
  wbk::WeightDtype kind = w.scalar_type() == at::kBFloat16 ? wbk::WeightDtype::kBFloat16
                          : w.scalar_type() == at::kChar   ? wbk::WeightDtype::kInt8
                                                           : wbk::WeightDtype::kFloat32;
  const float* row_scale = nullptr;
  if (kind == wbk::WeightDtype::kInt8) {
    TORCH_CHECK_VALUE(scale.has_value(), fn, ": int8 weights need scale: one float32 per output row [N], or per "
                      "32 weights of a row [N, ceil(K / 32)]");
    TORCH_CHECK_TYPE(scale->scalar_type() == at::kFloat, fn, ": scale must be float32, got ", scale->scalar_type());
    const int64_t groups = (K + wbk::kWeightGroup - 1) / wbk::kWeightGroup;
    if (scale->dim() == 2) {
      check_tensor(*scale, fn, "scale", 2, "[N, ceil(K / 32)]");
      TORCH_CHECK_VALUE(scale->size(0) == N && scale->size(1) == groups, fn, ": grouped scale must be [N, ceil(K / 32)] = [",
                        N, ", ", groups, "], got ", scale->sizes());
      kind = wbk::WeightDtype::kInt8Group;
    } else {
      check_tensor(*scale, fn, "scale", 1, "[N]");
      TORCH_CHECK_VALUE(scale->size(0) == N, fn, ": scale must have N = ", N, " entries (one per row of w), got ",
                        scale->size(0));
    }
    row_scale = scale->data_ptr<float>();
  } else {
    TORCH_CHECK_VALUE(!scale.has_value(), fn, ": scale is only for int8 weights, but ", nm, " is ", w.scalar_type());
  }
  TORCH_CHECK_VALUE(kernel.empty() || weight_kernel(kernel, fn) == kind, fn, ": ", nm, " is ", w.scalar_type(),
                    " but kernel '", kernel, "' was named");
  return {w.data_ptr(), kind, row_scale, N, K};
}

// A linear layer of one or more row-wise parts (the fused step's q / k / v or gate / up when
// their formats differ), each checked for K columns.
wbk::LinearRef checked_linear(const std::vector<WeightPart>& parts, const char* fn, const std::string& name,
                              int64_t K) {
  TORCH_CHECK_VALUE(!parts.empty(), fn, ": ", name, " needs at least one weight part");
  wbk::LinearRef ref;
  ref.K = K;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string at = parts.size() == 1 ? name : name + "[" + std::to_string(i) + "]";
    ref.parts.push_back(checked_weight(parts[i].w, parts[i].scale, fn, at, K, parts[i].kernel));
    ref.N += ref.parts.back().N;
  }
  return ref;
}

// shared-memory collectives

wbk::ShmArgs shm_args(const Tensor& seg, int64_t rank, int64_t world, int64_t capacity, double timeout_s,
                      const char* fn) {
  check_tensor(seg, fn, "segment", 1, "[bytes] uint8");
  TORCH_CHECK_TYPE(seg.scalar_type() == at::kByte, fn, ": segment must be uint8, got ", seg.scalar_type());
  TORCH_CHECK_VALUE(world >= 1 && world <= wbk::kShmMaxRanks, fn, ": world must be in 1..", wbk::kShmMaxRanks,
                    ", got ", world);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world, fn, ": rank must be in 0..", world - 1, ", got ", rank);
  TORCH_CHECK_VALUE(capacity > 0 && capacity % 64 == 0, fn, ": capacity must be a positive multiple of 64, got ",
                    capacity);
  TORCH_CHECK_VALUE(seg.numel() >= wbk::shm_segment_bytes(world, capacity), fn, ": segment has ", seg.numel(),
                    " bytes, ", world, " ranks with ", capacity, "-byte slots need ",
                    wbk::shm_segment_bytes(world, capacity));
  TORCH_CHECK_VALUE(timeout_s > 0, fn, ": timeout_s must be > 0, got ", timeout_s);
  return {seg.data_ptr<uint8_t>(), static_cast<int>(rank), static_cast<int>(world), capacity, timeout_s};
}

void check_shm_data(const Tensor& t, const char* fn, int64_t capacity) {
  TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu() && t.is_contiguous(), fn,
                    ": data must be a contiguous CPU tensor");
  TORCH_CHECK_VALUE(t.nbytes() <= static_cast<size_t>(capacity), fn, ": data has ", t.nbytes(),
                    " bytes, more than a slot's ", capacity);
}

void check_probe_buffer(const Tensor& t, const char* name) {
  check_tensor(t, "triad", name, 1, "[n]");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "triad: ", name, " must be float32");
}

}  // namespace

// -- what ops.h declares -------------------------------------------------------------------

const char* engine_name(wbk::GemmEngine e) {
  return e == wbk::GemmEngine::kAmxBf16      ? "amx_bf16"
         : e == wbk::GemmEngine::kAvx512Bf16 ? "avx512_bf16"
         : e == wbk::GemmEngine::kAmxInt8    ? "amx_int8"
                                             : "fma";
}

// A weight kernel by its name (WeightFormat.kernel, constants()["weight_kernels"]).
wbk::WeightDtype weight_kernel(const std::string& kernel, const char* fn) {
  std::string names;
  for (int i = 0; i < wbk::kWeightDtypes; ++i) {
    if (kernel == wbk::kWeightDtypeNames[i]) return static_cast<wbk::WeightDtype>(i);
    names += std::string(i ? ", '" : "'") + wbk::kWeightDtypeNames[i] + "'";
  }
  TORCH_CHECK_VALUE(false, fn, ": kernel must be one of ", names, ", got '", kernel, "'");
  return wbk::WeightDtype::kFloat32;  // not reached: the check throws
}

Tensor slim_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, std::optional<double> scale,
                      int64_t block_m, int64_t window) {
  return prefill(q, k, v, causal, scale, block_m, 1, true, window);
}

Tensor flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                       std::optional<double> scale, int64_t block_m, int64_t block_n, int64_t window) {
  return prefill(q, k, v, causal, scale, block_m, block_n, false, window);
}

Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                        const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale,
                        std::optional<double> scale, std::optional<int64_t> num_splits,
                        const std::string& int8_kernel_name, int64_t group, int64_t q_offset) {
  const char* fn = "decode_attention";
  check_tensor(q, fn, "q", 3, "[B, H, D]");
  check_float_input(q, fn, "q");
  check_tensor(k_cache, fn, "k_cache", 4, "[B, Hkv, Lmax, D]");
  check_tensor(v_cache, fn, "v_cache", 4, "[B, Hkv, Lmax, D]");
  const wbk::CacheDtype dtype = cache_dtype(k_cache, fn, "k_cache");
  TORCH_CHECK_TYPE(v_cache.scalar_type() == k_cache.scalar_type(), fn,
                   ": k_cache and v_cache must have the same dtype, got ", k_cache.scalar_type(), " and ",
                   v_cache.scalar_type());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), fn, ": k_cache and v_cache must have the same shape, got ",
                    k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), Lmax = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(0) == B, fn, ": k_cache has batch ", k_cache.size(0), " but q has batch ", B);
  TORCH_CHECK_VALUE(k_cache.size(3) == D, fn, ": k_cache has head dim ", k_cache.size(3), " but q has head dim ",
                    D);
  TORCH_CHECK_VALUE(D >= 1, fn, ": head dim D must be >= 1, got ", D);
  const wbk::HeadMap heads = checked_head_map(group, q_offset, H, Hkv, fn);
  TORCH_CHECK_VALUE(Lmax >= 1, fn, ": the cache has no positions (Lmax = 0)");
  Tensor len = checked_positions(lengths, fn, "lengths", B, 1, Lmax, "each sequence attends to 1..Lmax tokens");

  const bool is_int8 = dtype == wbk::CacheDtype::kInt8;
  if (is_int8) {
    TORCH_CHECK_VALUE(k_scale.has_value() && v_scale.has_value(), fn,
                      ": an int8 cache needs k_scale and v_scale [B, Hkv, Lmax] float32");
    for (auto [t, name] : {std::pair{*k_scale, "k_scale"}, std::pair{*v_scale, "v_scale"}}) {
      check_tensor(t, fn, name, 3, "[B, Hkv, Lmax]");
      TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, fn, ": ", name, " must be float32, got ", t.scalar_type());
      TORCH_CHECK_VALUE(t.sizes() == k_cache.sizes().slice(0, 3), fn, ": ", name, " must have shape ",
                        k_cache.sizes().slice(0, 3), " (B, Hkv, Lmax of the cache), got ", t.sizes());
    }
  } else {
    TORCH_CHECK_VALUE(!k_scale.has_value() && !v_scale.has_value(), fn,
                      ": k_scale / v_scale are only used with an int8 cache, but the cache is ",
                      k_cache.scalar_type());
  }
  const wbk::Int8Kernel int8_kernel = int8_kernel_named(int8_kernel_name, is_int8, fn, k_cache.scalar_type());
  if (int8_kernel == wbk::Int8Kernel::kTile) check_tiled_shape(Lmax, D, fn, "k_cache");
  const float s = checked_scale(scale, D, fn);
  int64_t splits = num_splits.value_or(0);
  if (num_splits) {
    TORCH_CHECK_VALUE(splits >= 1, fn, ": num_splits must be >= 1 (or None for automatic), got ", splits);
  } else {
    const int64_t* lp = len.data_ptr<int64_t>();
    const int64_t longest = B > 0 ? *std::max_element(lp, lp + B) : 1;
    splits = wbk::decode_default_splits(B, Hkv, longest, at::get_num_threads());
  }
  splits = std::min(splits, Lmax);

  Tensor out = at::empty({B, H, D}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return out.to(q.scalar_type());
  Tensor qf = q.to(at::kFloat).contiguous();
  wbk::DecodeArgs a{qf.data_ptr<float>(),
                    k_cache.data_ptr(),
                    v_cache.data_ptr(),
                    is_int8 ? k_scale->data_ptr<float>() : nullptr,
                    is_int8 ? v_scale->data_ptr<float>() : nullptr,
                    len.data_ptr<int64_t>(),
                    out.data_ptr<float>(),
                    B,
                    H,
                    Hkv,
                    Lmax,
                    D,
                    dtype,
                    s,
                    splits,
                    int8_kernel,
                    heads};
  wbk::decode_attention(a);
  return out.to(q.scalar_type());
}

std::tuple<Tensor, Tensor> quantize_kv_int8(const Tensor& x) {
  const char* fn = "quantize_kv_int8";
  TORCH_CHECK_VALUE(x.defined() && x.device().is_cpu(), fn, ": x must be a CPU tensor");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) >= 1, fn, ": x must have a last dimension D >= 1, got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), fn, ": x must be contiguous (call .contiguous()), got strides ",
                    x.strides());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                       x.scalar_type() == at::kHalf,
                   fn, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D;
  Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  Tensor scales = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  if (rows > 0) wbk::quantize_int8(xf.data_ptr<float>(), q.data_ptr<int8_t>(), scales.data_ptr<float>(), rows, D);
  return {q, scales};
}

void kv_cache_append(Tensor& cache, const Tensor& values, const Tensor& positions,
                     const std::optional<Tensor>& scales, const std::string& layout) {
  const char* fn = "kv_cache_append";
  wbk::CacheLayout lay = wbk::CacheLayout::kRows;
  if (layout == "k_tiles") {
    lay = wbk::CacheLayout::kKTiles;
  } else if (layout == "v_groups") {
    lay = wbk::CacheLayout::kVGroups;
  } else {
    TORCH_CHECK_VALUE(layout == "rows", fn, ": layout must be 'rows', 'k_tiles' or 'v_groups', got '", layout, "'");
  }
  check_tensor(cache, fn, "cache", 4, "[B, Hkv, Lmax, D]");
  // values are converted to fp32 on the way in anyway, so any strides are accepted
  // (new K / V usually arrive as views of a projection's output).
  check_tensor(values, fn, "values", 4, "[B, Hkv, T, D]", /*need_contiguous=*/false);
  const wbk::CacheDtype dtype = cache_dtype(cache, fn, "cache");
  TORCH_CHECK_TYPE(values.scalar_type() == at::kFloat || values.scalar_type() == at::kBFloat16 ||
                       values.scalar_type() == at::kHalf,
                   fn, ": values must be float32, bfloat16 or float16, got ", values.scalar_type());
  const int64_t B = cache.size(0), Hkv = cache.size(1), Lmax = cache.size(2), D = cache.size(3);
  const int64_t T = values.size(2);
  TORCH_CHECK_VALUE(values.size(0) == B && values.size(1) == Hkv && values.size(3) == D, fn,
                    ": values must have shape [B, Hkv, T, D] = [", B, ", ", Hkv, ", T, ", D,
                    "] to match the cache, got ", values.sizes());
  Tensor pos = checked_positions(positions, fn, "positions", B, 0, Lmax - T,
                                 "the T new tokens must fit in the cache's Lmax positions");
  const bool is_int8 = dtype == wbk::CacheDtype::kInt8;
  if (is_int8) {
    TORCH_CHECK_VALUE(scales.has_value(), fn, ": an int8 cache needs scales [B, Hkv, Lmax] float32");
    check_tensor(*scales, fn, "scales", 3, "[B, Hkv, Lmax]");
    TORCH_CHECK_TYPE(scales->scalar_type() == at::kFloat, fn, ": scales must be float32, got ",
                     scales->scalar_type());
    TORCH_CHECK_VALUE(scales->sizes() == cache.sizes().slice(0, 3), fn, ": scales must have shape ",
                      cache.sizes().slice(0, 3), ", got ", scales->sizes());
  } else {
    TORCH_CHECK_VALUE(!scales.has_value(), fn, ": scales are only used with an int8 cache, but the cache is ",
                      cache.scalar_type());
    TORCH_CHECK_VALUE(lay == wbk::CacheLayout::kRows, fn, ": layout '", layout,
                      "' needs an int8 cache, but the cache is ", cache.scalar_type());
  }
  if (lay != wbk::CacheLayout::kRows) check_tiled_shape(Lmax, D, fn, "cache");
  if (values.numel() == 0) return;
  Tensor src = values.to(at::kFloat).contiguous();
  wbk::AppendArgs a{src.data_ptr<float>(), cache.data_ptr(), is_int8 ? scales->data_ptr<float>() : nullptr,
                    pos.data_ptr<int64_t>(), B, Hkv, T, Lmax, D, dtype, lay};
  wbk::kv_cache_append(a);
}

Tensor linear(const Tensor& x, const Tensor& w, int64_t matvec_max_rows, const std::optional<Tensor>& out,
              const std::optional<Tensor>& scale, const std::string& kernel) {
  const char* fn = "linear";
  check_tensor(x, fn, "x", 2, "[M, K]");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, fn, ": x must be float32, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  const wbk::WeightRef wr = checked_weight(w, scale, fn, "w", K, kernel);
  const int64_t N = wr.N;
  const wbk::WeightDtype kind = wr.dtype;
  const float* row_scale = wr.scale;
  Tensor y;
  if (out.has_value()) {  // write into the caller's buffer (e.g. a collective's: zero copy)
    check_tensor(*out, fn, "out", 2, "[M, N]");
    TORCH_CHECK_TYPE(out->scalar_type() == at::kFloat, fn, ": out must be float32, got ", out->scalar_type());
    TORCH_CHECK_VALUE(out->size(0) == M && out->size(1) == N, fn, ": out must be [M, N] = [", M, ", ", N,
                      "], got ", out->sizes());
    y = *out;
  } else {
    y = at::empty({M, N}, x.options());
  }
  if (y.numel() == 0) return y;
  if (K == 0) return y.zero_();
  if (M <= (matvec_max_rows < 0 ? wbk::matvec_max_rows(kind) : matvec_max_rows)) {
    wbk::linear_matvec(x.data_ptr<float>(), w.data_ptr(), kind, row_scale, y.data_ptr<float>(), M, N, K);
    return y;
  }
  wbk::linear_gemm(x.data_ptr<float>(), w.data_ptr(), kind, row_scale, y.data_ptr<float>(), M, N, K);
  return y;
}

std::vector<Tensor> grouped_matvec(const Tensor& x, const std::vector<Tensor>& weights,
                                   const std::vector<std::optional<Tensor>>& scales,
                                   const std::vector<std::string>& kernels, const std::vector<Tensor>& rows) {
  const char* fn = "grouped_matvec";
  check_tensor(x, fn, "x", 2, "[M, K]");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, fn, ": x must be float32, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  const size_t n = weights.size();
  TORCH_CHECK_VALUE(scales.size() == n && kernels.size() == n && rows.size() == n, fn, ": weights, scales, kernels "
                    "and rows must be lists of one length, got ", n, ", ", scales.size(), ", ", kernels.size(), ", ",
                    rows.size());
  std::vector<wbk::MatvecJob> jobs;
  std::vector<Tensor> out;
  for (size_t j = 0; j < n; ++j) {
    const std::string at = "weights[" + std::to_string(j) + "]";
    const wbk::WeightRef w = checked_weight(weights[j], scales[j], fn, at, K, kernels[j]);
    TORCH_CHECK_VALUE(wbk::matvec_job_format(w.dtype, K), fn, ": ", at, " must be block rows or int8 with K a "
                      "multiple of 32, got K = ", K);
    check_tensor(rows[j], fn, "rows", 1, "[n]");
    TORCH_CHECK_TYPE(rows[j].scalar_type() == at::kLong, fn, ": rows[", j, "] must be int64, got ",
                     rows[j].scalar_type());
    const int64_t* r = rows[j].data_ptr<int64_t>();
    for (int64_t i = 0; i < rows[j].numel(); ++i)
      TORCH_CHECK_VALUE(r[i] >= 0 && r[i] < M, fn, ": rows[", j, "] holds ", r[i], ", not a row of x (0 .. ", M - 1, ")");
    out.push_back(at::empty({rows[j].numel(), w.N}, x.options()));
    jobs.push_back({w.w, w.dtype, w.scale, w.N, r, rows[j].numel(), out.back().data_ptr<float>(), w.N});
  }
  wbk::matvec_jobs(x.data_ptr<float>(), M, K, jobs.data(), static_cast<int64_t>(jobs.size()));
  return out;
}

int64_t block_row_bytes(const std::string& kernel, int64_t K) {
  const char* fn = "block_row_bytes";
  const wbk::WeightDtype kind = weight_kernel(kernel, fn);
  TORCH_CHECK_VALUE(wbk::is_block(kind), fn, ": '", kernel, "' is not a block-quantized kernel");
  const std::string why = wbk::block_row_error(kind, K);
  TORCH_CHECK_VALUE(why.empty(), fn, ": ", kernel, " with K = ", K, ": ", why);
  return wbk::block_row_bytes(kind, K);
}

namespace {
// Block rows w [N, row bytes] of `kernel` holding K weights a row, checked.
wbk::WeightDtype checked_block_rows(const Tensor& w, const std::string& kernel, int64_t K, const char* fn) {
  check_tensor(w, fn, "w", 2, "[N, row bytes]");
  TORCH_CHECK_TYPE(w.scalar_type() == at::kByte, fn, ": w must be uint8 rows of blocks, got ", w.scalar_type());
  const int64_t bytes = block_row_bytes(kernel, K);
  TORCH_CHECK_VALUE(w.size(1) == bytes, fn, ": ", kernel, " rows of K = ", K, " take ", bytes, " bytes, w has ",
                    w.size(1));
  return weight_kernel(kernel, fn);
}
}  // namespace

Tensor quantize_blocks(const Tensor& x, const std::string& kernel, bool search) {
  const char* fn = "quantize_blocks";
  check_tensor(x, fn, "x", 2, "[rows, K]");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, fn, ": x must be float32, got ", x.scalar_type());
  const int64_t K = x.size(1);
  const int64_t bytes = block_row_bytes(kernel, K);
  TORCH_CHECK_VALUE(!search || kernel == "q4_0", fn, ": search is for q4_0 (int4-g32) only, got '", kernel, "'");
  Tensor out = at::empty({x.size(0), bytes}, x.options().dtype(at::kByte));
  wbk::quantize_block_rows(weight_kernel(kernel, fn), x.data_ptr<float>(), out.data_ptr<uint8_t>(), x.size(0), K, search);
  return out;
}

Tensor repack_blocks(const Tensor& w, const std::string& kernel, int64_t K, bool to_kernel) {
  const wbk::WeightDtype kind = checked_block_rows(w, kernel, K, "repack_blocks");
  Tensor out = at::empty_like(w);
  wbk::repack_block_rows(kind, w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), w.size(0), K, to_kernel);
  return out;
}

Tensor dequantize_blocks(const Tensor& w, const std::string& kernel, int64_t K, const std::optional<Tensor>& rows,
                         bool reference) {
  const char* fn = "dequantize_blocks";
  const wbk::WeightDtype kind = checked_block_rows(w, kernel, K, fn);
  const int64_t* index = nullptr;
  int64_t count = w.size(0);
  Tensor idx;
  if (rows) {
    check_tensor(*rows, fn, "rows", 1, "[count]");
    TORCH_CHECK_TYPE(rows->scalar_type() == at::kLong, fn, ": rows must be int64, got ", rows->scalar_type());
    idx = *rows;
    count = idx.size(0);
    index = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i)
      TORCH_CHECK_INDEX(index[i] >= 0 && index[i] < w.size(0), fn, ": rows[", i, "] = ", index[i], " is not a row of w (",
                        w.size(0), " rows)");
  }
  Tensor out = at::empty({count, K}, w.options().dtype(at::kFloat));
  wbk::dequantize_block_rows(kind, w.data_ptr<uint8_t>(), index, count, K, out.data_ptr<float>(), reference);
  return out;
}

void fill_normal_(Tensor& out, int64_t seed, int64_t stream, double std) {
  const char* fn = "fill_normal_";
  TORCH_CHECK(out.is_contiguous(), fn, ": out must be contiguous");
  TORCH_CHECK(seed >= 0 && stream >= 0, fn, ": seed and stream must be >= 0, got seed=", seed, ", stream=", stream);
  TORCH_CHECK(std >= 0 && std::isfinite(std), fn, ": std must be finite and >= 0, got ", std);
  const auto s = static_cast<uint64_t>(seed), k = static_cast<uint64_t>(stream);
  if (out.scalar_type() == at::kFloat) {
    wbk::fill_normal_f32(out.data_ptr<float>(), out.numel(), s, k, static_cast<float>(std));
  } else if (out.scalar_type() == at::kBFloat16) {
    wbk::fill_normal_bf16(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), out.numel(), s, k,
                          static_cast<float>(std));
  } else {
    TORCH_CHECK(false, fn, ": out must be float32 or bfloat16, got ", out.scalar_type());
  }
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const char* fn = "rms_norm";
  check_tensor(x, fn, "x", 2, "[T, n]");
  check_tensor(weight, fn, "weight", 1, "[n]");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, fn, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kFloat, fn, ": weight must be float32, got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.size(0) == x.size(1), fn, ": weight has ", weight.size(0), " values for rows of ", x.size(1));
  TORCH_CHECK_VALUE(eps > 0 && std::isfinite(eps), fn, ": eps must be a finite number > 0, got ", eps);
  Tensor out = at::empty_like(x);
  if (out.numel() > 0)
    wbk::rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
                       static_cast<float>(eps));
  return out;
}

// The MLP activation by its name ("silu" or "gelu_tanh").
wbk::Activation activation_named(const std::string& name, const char* fn) {
  for (int i = 0; i < 2; ++i)
    if (name == wbk::kActivationNames[i]) return static_cast<wbk::Activation>(i);
  TORCH_CHECK_VALUE(false, fn, ": activation must be 'silu' or 'gelu_tanh', got '", name, "'");
  return wbk::Activation::kSilu;  // not reached: the check throws
}

Tensor act_mul(const Tensor& gate_up, const std::string& activation) {
  const char* fn = "act_mul";
  const wbk::Activation act = activation_named(activation, fn);
  check_tensor(gate_up, fn, "gate_up", 2, "[T, 2F]");
  TORCH_CHECK_TYPE(gate_up.scalar_type() == at::kFloat, fn, ": gate_up must be float32, got ", gate_up.scalar_type());
  TORCH_CHECK_VALUE(gate_up.size(1) % 2 == 0, fn, ": gate_up must have an even number of columns [gate | up], got ",
                    gate_up.size(1));
  const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2;
  Tensor out = at::empty({T, F}, gate_up.options());
  if (out.numel() > 0) wbk::act_mul_rows(act, gate_up.data_ptr<float>(), out.data_ptr<float>(), T, F);
  return out;
}

// -- the tensor-parallel LM head's exchange: each rank's best k, then the best k of them all -----

namespace {

// Candidate a ranks before b: the larger logit first (NaN above every number, as torch.topk
// and argmax have it), equal logits by the lower token id (argmax's first index).
inline bool ranks_before(float va, int64_t ia, float vb, int64_t ib) {
  const bool na = std::isnan(va), nb = std::isnan(vb);
  if (na != nb) return na;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}

// Keep (v, id) in the best-first run vals / ids of `have` <= k entries if it belongs there.
inline void offer(float* vals, int64_t* ids, int64_t k, int64_t& have, float v, int64_t id) {
  if (have == k && !ranks_before(v, id, vals[k - 1], ids[k - 1])) return;
  int64_t j = have < k ? have++ : k - 1;
  for (; j > 0 && ranks_before(v, id, vals[j - 1], ids[j - 1]); --j) {
    vals[j] = vals[j - 1];
    ids[j] = ids[j - 1];
  }
  vals[j] = v;
  ids[j] = id;
}

constexpr int64_t kExactIds = int64_t{1} << 24;  // token ids travel as fp32: exact below 2^24

}  // namespace

Tensor topk_pairs(const Tensor& logits, int64_t k, int64_t offset) {
  const char* fn = "topk_pairs";
  check_tensor(logits, fn, "logits", 2, "[rows, n]");
  TORCH_CHECK_TYPE(logits.scalar_type() == at::kFloat, fn, ": logits must be float32, got ", logits.scalar_type());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK_VALUE(k >= 1 && k <= n, fn, ": k must be in [1, n] = [1, ", n, "], got ", k);
  TORCH_CHECK_VALUE(offset >= 0 && offset <= kExactIds - n, fn, ": offset + n must be in [n, 2^24] (token ids "
                    "travel as float32), got offset ", offset, " and n ", n);
  Tensor out = at::empty({rows, 2 * k}, logits.options());
  const float* x = logits.data_ptr<float>();
  float* o = out.data_ptr<float>();
  std::vector<int64_t> ids(k);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    float* vals = o + r * 2 * k;
    int64_t have = 0;
    for (int64_t i = 0; i < n; ++i) offer(vals, ids.data(), k, have, row[i], i);
    for (int64_t j = 0; j < k; ++j) vals[k + j] = static_cast<float>(ids[j] + offset);
  }
  return out;
}

Tensor merge_topk(const Tensor& pairs, int64_t vocab) {
  const char* fn = "merge_topk";
  check_tensor(pairs, fn, "pairs", 3, "[world, rows, 2k]");
  TORCH_CHECK_TYPE(pairs.scalar_type() == at::kFloat, fn, ": pairs must be float32, got ", pairs.scalar_type());
  const int64_t world = pairs.size(0), rows = pairs.size(1), k = pairs.size(2) / 2;
  TORCH_CHECK_VALUE(pairs.size(2) % 2 == 0 && k >= 1, fn, ": pairs' last dimension must be 2k >= 2 (k values, "
                    "then their k ids), got ", pairs.size(2));
  TORCH_CHECK_VALUE(vocab >= 1 && vocab <= kExactIds, fn, ": vocab must be in [1, 2^24], got ", vocab);
  Tensor out = at::full({rows, vocab}, -std::numeric_limits<float>::infinity(), pairs.options());
  const float* p = pairs.data_ptr<float>();
  float* o = out.data_ptr<float>();
  std::vector<float> vals(k);
  std::vector<int64_t> ids(k);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t have = 0;
    for (int64_t w = 0; w < world; ++w) {
      const float* c = p + (w * rows + r) * 2 * k;
      for (int64_t j = 0; j < k; ++j) {
        const float id = c[k + j];
        TORCH_CHECK_VALUE(id >= 0 && id < static_cast<float>(vocab) && id == std::floor(id), fn, ": pairs[", w, ", ",
                          r, "] holds token id ", id, ", not an integer in [0, ", vocab, ")");
        offer(vals.data(), ids.data(), k, have, c[j], static_cast<int64_t>(id));
      }
    }
    for (int64_t j = 0; j < have; ++j) o[r * vocab + ids[j]] = vals[j];
  }
  return out;
}

void rope_(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t heads, int64_t head_dim) {
  const char* fn = "rope_";
  check_tensor(x, fn, "x", 2, "[T, C]", /*need_contiguous=*/false);
  check_tensor(cos, fn, "cos", 2, "[T, rotary dims]");
  check_tensor(sin, fn, "sin", 2, "[T, rotary dims]");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, fn, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK_TYPE(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, fn,
                   ": cos and sin must be float32, got ", cos.scalar_type(), " and ", sin.scalar_type());
  TORCH_CHECK_VALUE(x.stride(1) == 1, fn, ": x rows must be contiguous (stride 1 along C), got strides ",
                    x.strides());
  TORCH_CHECK_VALUE(head_dim > 0 && head_dim % 2 == 0, fn, ": head_dim must be a positive even number, got ",
                    head_dim);
  TORCH_CHECK_VALUE(heads >= 0 && heads * head_dim <= x.size(1), fn, ": heads must be in 0..",
                    x.size(1) / head_dim, " (x has ", x.size(1), " columns, head_dim ", head_dim, "), got ", heads);
  const int64_t T = x.size(0), R = cos.size(1);
  TORCH_CHECK_VALUE(cos.size(0) == T && R >= 2 && R % 2 == 0 && R <= head_dim && sin.sizes() == cos.sizes(), fn,
                    ": cos and sin must be [T, R] with T = ", T, " and R an even number of rotary dims up to head_dim (",
                    head_dim, "), got ", cos.sizes(), " and ", sin.sizes());
  if (T == 0 || heads == 0) return;
  wbk::rope_rotate_half(x.data_ptr<float>(), T, x.stride(0), heads, head_dim, R, cos.data_ptr<float>(),
                        sin.data_ptr<float>());
}
ShmCollective::ShmCollective(Tensor seg, int64_t rank, int64_t world, int64_t capacity, double timeout_s)
    : seg_(std::move(seg)), a_(shm_args(seg_, rank, world, capacity, timeout_s, "ShmCollective")) {}


double shm_all_reduce(const Tensor& seg, int64_t rank, int64_t world, int64_t capacity, double timeout_s,
                    Tensor& data, int64_t seq) {
  const char* fn = "shm_all_reduce";
  auto a = shm_args(seg, rank, world, capacity, timeout_s, fn);
  check_shm_data(data, fn, capacity);
  TORCH_CHECK_TYPE(data.scalar_type() == at::kFloat, fn, ": data must be float32, got ", data.scalar_type());
  return wbk::shm_all_reduce_sum(a, data.data_ptr<float>(), data.numel(), seq);
}

double shm_broadcast(const Tensor& seg, int64_t rank, int64_t world, int64_t capacity, double timeout_s,
                   Tensor& data, int64_t root, int64_t seq) {
  const char* fn = "shm_broadcast";
  auto a = shm_args(seg, rank, world, capacity, timeout_s, fn);
  check_shm_data(data, fn, capacity);
  TORCH_CHECK_VALUE(root >= 0 && root < world, fn, ": root must be in 0..", world - 1, ", got ", root);
  return wbk::shm_broadcast(a, data.data_ptr(), static_cast<int64_t>(data.nbytes()), static_cast<int>(root), seq);
}

double shm_all_gather(const Tensor& seg, int64_t rank, int64_t world, int64_t capacity, double timeout_s,
                    const Tensor& data, Tensor& out, int64_t seq) {
  const char* fn = "shm_all_gather";
  auto a = shm_args(seg, rank, world, capacity, timeout_s, fn);
  check_shm_data(data, fn, capacity);
  TORCH_CHECK_VALUE(out.defined() && out.is_contiguous() && out.scalar_type() == data.scalar_type() &&
                        out.nbytes() == data.nbytes() * world,
                    fn, ": out must be a contiguous ", data.scalar_type(), " tensor of world x data's size");
  return wbk::shm_all_gather(a, data.data_ptr(), static_cast<int64_t>(data.nbytes()), out.data_ptr(), seq);
}

void triad(Tensor& a, const Tensor& b, const Tensor& c, double s) {
  check_probe_buffer(a, "a");
  check_probe_buffer(b, "b");
  check_probe_buffer(c, "c");
  TORCH_CHECK_VALUE(a.numel() == b.numel() && b.numel() == c.numel(), "triad: a, b, c must have equal sizes");
  wbk::triad(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), static_cast<float>(s), a.numel());
}

double read_sum(const Tensor& x) {
  check_probe_buffer(x, "x");
  return wbk::read_sum(x.data_ptr<float>(), x.numel());
}

// The matrix-vector kernel's weight types, each with its own prefetch setting (prefetch.h);
// int8 covers both scale granularities (per row and per group).
int matvec_weights(const std::string& name) {
  if (name == "float32") return wbk::kMatvecF32;
  if (name == "bfloat16") return wbk::kMatvecBF16;
  if (name == "int8") return wbk::kMatvecInt8;
  TORCH_CHECK_VALUE(false, "matvec prefetch: weights must be 'float32', 'bfloat16' or 'int8', got '", name, "'");
}

DecodeStack::DecodeStack(const std::vector<DecodeLayer>& layers, int64_t heads, double eps,
                         const std::string& int8_kernel_name, int64_t group, int64_t q_offset, bool kv_send,
                         bool kv_recv, std::optional<double> scale, int64_t rotary, const std::string& activation) {
  const char* fn = "DecodeStack";
  const size_t n = layers.size();
  TORCH_CHECK_VALUE(n >= 1, fn, ": needs at least one layer");
  const DecodeLayer& first = layers[0];
  check_tensor(first.k_cache, fn, "layers[0].k_cache", 4, "[B, Hkv, Lmax, D]");
  const int64_t B = first.k_cache.size(0), Hkv = first.k_cache.size(1), D = first.k_cache.size(3);
  check_tensor(first.attn_norm, fn, "layers[0].attn_norm", 1, "[dim]");
  const int64_t dim = first.attn_norm.size(0);
  const wbk::HeadMap head_map = checked_head_map(group, q_offset, heads, Hkv, fn);
  const bool moe = !first.router.empty();
  // a mixture's first expert this rank holds (expert parallel: a rank holds some, the others' lists empty)
  auto held = std::find_if(first.experts_gate_up.begin(), first.experts_gate_up.end(),
                           [](const std::vector<WeightPart>& parts) { return !parts.empty(); });
  const auto& first_gate_up = moe ? (held == first.experts_gate_up.end() ? first.w_gate_up : *held) : first.w_gate_up;
  TORCH_CHECK_VALUE(!first_gate_up.empty(), fn, ": layers[0].w_gate_up (or its first expert's) needs at least one "
                    "weight part");
  int64_t gate_up_rows = 0;
  for (const WeightPart& part : first_gate_up) {
    check_tensor(part.w, fn, "layers[0].w_gate_up", 2, "[rows, K]");
    gate_up_rows += part.w.size(0);
  }
  const int64_t n_experts = moe ? first.router[0].w.size(0) : 0;
  expert_hits_ = at::zeros({static_cast<int64_t>(n), n_experts}, at::kInt);
  const int64_t ffn = gate_up_rows / 2;
  const wbk::CacheDtype dtype = cache_dtype(first.k_cache, fn, "layers[0].k_cache");
  const bool is_int8 = dtype == wbk::CacheDtype::kInt8;
  const wbk::Int8Kernel int8_kernel =
      int8_kernel_named(int8_kernel_name, is_int8, fn, first.k_cache.scalar_type());
  const bool tiled = int8_kernel == wbk::Int8Kernel::kTile;
  const int64_t rd = rotary > 0 ? rotary : D;
  TORCH_CHECK_VALUE(rd % 2 == 0 && rd <= D, fn, ": rotary must be an even number of dims up to D (", D, "), got ", rd);
  shape_ = {dim, heads, Hkv, D, ffn, static_cast<float>(eps), static_cast<float>(checked_scale(scale, D, fn)), rd,
            activation_named(activation, fn), dtype, tiled ? wbk::CacheLayout::kKTiles : wbk::CacheLayout::kRows,
            tiled ? wbk::CacheLayout::kVGroups : wbk::CacheLayout::kRows, int8_kernel, head_map, kv_send, kv_recv};
  TORCH_CHECK_VALUE(!(kv_send && kv_recv) || Hkv >= 2, fn, ": kv_send and kv_recv name the first and the last "
                    "KV head, so both need at least 2 KV heads, got ", Hkv);
  batch_ = B;
  for (size_t l = 0; l < n; ++l) {
    const DecodeLayer& in = layers[l];
    const std::string at = "layers[" + std::to_string(l) + "].";
    for (auto [t, name] : {std::pair{in.attn_norm, "attn_norm"}, std::pair{in.mlp_norm, "mlp_norm"}}) {
      check_tensor(t, fn, (at + name).c_str(), 1, "[dim]");
      TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, fn, ": ", at, name, " must be float32, got ", t.scalar_type());
      TORCH_CHECK_VALUE(t.size(0) == dim, fn, ": ", at, name, " has ", t.size(0), " values, expected dim = ", dim);
    }
    wbk::LayerRef r{};
    r.attn_norm = in.attn_norm.data_ptr<float>();
    r.mlp_norm = in.mlp_norm.data_ptr<float>();
    r.qkv = checked_linear(in.wqkv, fn, at + "wqkv", dim);
    r.o = checked_linear(in.wo, fn, at + "wo", heads * D);
    TORCH_CHECK_VALUE(in.router.empty() != moe, fn, ": ", at, "router: every layer is a mixture of experts or none is");
    if (moe) {
      r.router = checked_linear(in.router, fn, at + "router", dim);
      TORCH_CHECK_VALUE(r.router.N == n_experts && r.router.parts.size() == 1 &&
                        r.router.parts[0].dtype == wbk::WeightDtype::kFloat32, fn, ": ", at, "router must be one fp32 [",
                        n_experts, ", ", dim, "] matrix");
      TORCH_CHECK_VALUE(static_cast<int64_t>(in.experts_gate_up.size()) == n_experts &&
                        in.experts_down.size() == in.experts_gate_up.size(), fn, ": ", at, "needs ", n_experts,
                        " experts' gate_up and down (one per router row), got ", in.experts_gate_up.size(), " and ",
                        in.experts_down.size());
      TORCH_CHECK_VALUE(in.top_k >= 1 && in.top_k <= n_experts, fn, ": ", at, "top_k must be in 1..", n_experts,
                        ", got ", in.top_k);
      for (int64_t e = 0; e < n_experts; ++e) {
        const std::string ex = at + "experts[" + std::to_string(e) + "].";
        if (in.experts_gate_up[e].empty() && in.experts_down[e].empty()) {  // held by another rank
          r.experts.emplace_back();
          continue;
        }
        wbk::ExpertRef x{checked_linear(in.experts_gate_up[e], fn, ex + "gate_up", dim),
                         checked_linear(in.experts_down[e], fn, ex + "down", ffn)};
        TORCH_CHECK_VALUE(x.gate_up.N == 2 * ffn && x.down.N == dim, fn, ": ", ex, "weights do not fit dim ", dim,
                          " and ffn ", ffn);
        r.experts.push_back(std::move(x));
      }
      r.top_k = in.top_k;
      r.norm_topk = in.norm_topk;
      r.expert_hits = expert_hits_.data_ptr<int32_t>() + l * n_experts;
    } else {
      r.gate_up = checked_linear(in.w_gate_up, fn, at + "w_gate_up", dim);
      r.down = checked_linear(in.w_down, fn, at + "w_down", ffn);
    }
    TORCH_CHECK_VALUE(r.qkv.N == (heads + 2 * Hkv) * D && r.o.N == dim && (moe || (r.gate_up.N == 2 * ffn &&
                      r.down.N == dim)), fn, ": layer ", l, "'s weights do not fit dim ", dim, ", ", heads, " heads, ",
                      Hkv, " KV heads of ", D, " and ffn ", ffn);
    // the family's vectors: each optional, float32, of the length its place needs
    auto vector = [&](const std::optional<Tensor>& t, const char* name, int64_t len) -> const float* {
      if (!t) return nullptr;
      check_tensor(*t, fn, (at + name).c_str(), 1, "[n]");
      TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, fn, ": ", at, name, " must be float32, got ", t->scalar_type());
      TORCH_CHECK_VALUE(t->size(0) == len, fn, ": ", at, name, " has ", t->size(0), " values, expected ", len);
      return t->data_ptr<float>();
    };
    r.qkv_bias = vector(in.qkv_bias, "qkv_bias", (heads + 2 * Hkv) * D);
    r.q_norm = vector(in.q_norm, "q_norm", D);
    r.k_norm = vector(in.k_norm, "k_norm", D);
    r.post_attn_norm = vector(in.post_attn_norm, "post_attn_norm", dim);
    r.post_mlp_norm = vector(in.post_mlp_norm, "post_mlp_norm", dim);
    for (auto [t, name] : {std::pair{in.k_cache, "k_cache"}, std::pair{in.v_cache, "v_cache"}}) {
      check_tensor(t, fn, (at + name).c_str(), 4, "[B, Hkv, Lmax, D]");
      TORCH_CHECK_VALUE(t.size(0) == B && t.size(1) == Hkv && t.size(3) == D &&
                        t.scalar_type() == first.k_cache.scalar_type() && t.sizes() == in.k_cache.sizes(), fn,
                        ": ", at, name, " must be [", B, ", ", Hkv, ", Lmax, ", D, "] ", first.k_cache.scalar_type(),
                        " as layers[0].k_cache, and k and v alike, got ", t.sizes(), " ", t.scalar_type());
    }
    r.Lmax = in.k_cache.size(2);
    if (tiled) check_tiled_shape(r.Lmax, D, fn, (at + "k_cache").c_str());
    TORCH_CHECK_VALUE(in.window >= 0 && (in.window == 0 || in.window == r.Lmax), fn, ": ", at,
                      "window must be 0 or its cache's length (a windowed layer's cache is a ring of window slots), "
                      "got ", in.window, " for a cache of ", r.Lmax);
    TORCH_CHECK_VALUE(in.rope == 0 || in.rope == 1, fn, ": ", at, "rope must be 0 (the global table) or 1 (the "
                      "local one), got ", in.rope);
    r.window = in.window;
    r.rope = static_cast<int>(in.rope);
    r.k_cache = in.k_cache.data_ptr();
    r.v_cache = in.v_cache.data_ptr();
    for (auto [t, name] : {std::pair{in.k_scale, "k_scale"}, std::pair{in.v_scale, "v_scale"}}) {
      TORCH_CHECK_VALUE(t.has_value() == is_int8, fn, ": ", at, name, is_int8 ? " is needed (int8 cache)" :
                        " is only for an int8 cache");
      if (t) {
        check_tensor(*t, fn, (at + name).c_str(), 3, "[B, Hkv, Lmax]");
        TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, fn, ": ", at, name, " must be float32");
        TORCH_CHECK_VALUE(t->sizes() == in.k_cache.sizes().slice(0, 3), fn, ": ", at, name, " must be ",
                          in.k_cache.sizes().slice(0, 3), ", got ", t->sizes());
      }
    }
    r.k_scale = in.k_scale ? in.k_scale->data_ptr<float>() : nullptr;
    r.v_scale = in.v_scale ? in.v_scale->data_ptr<float>() : nullptr;
    uses_local_rope_ = uses_local_rope_ || r.rope == 1;
    if (!r.window) full_length_ = full_length_ ? std::min(full_length_, r.Lmax) : r.Lmax;
    layers_.push_back(r);
    keep_.push_back(in);  // the stack holds its tensors, not copies
  }
}


double DecodeStack::step(Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                         const std::optional<Tensor>& timers, wbk::StepCollective* comm,
                         const std::optional<Tensor>& cos_local, const std::optional<Tensor>& sin_local) {
  const char* fn = "DecodeStack.step";
  const int64_t B = batch_, R = shape_.rotary;
  check_tensor(x, fn, "x", 2, "[B, dim]");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, fn, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.size(0) == B && x.size(1) == shape_.dim, fn, ": x must be [B, dim] = [", B, ", ",
                    shape_.dim, "], got ", x.sizes());
  auto table = [&](const Tensor& t, const char* name) {
    check_tensor(t, fn, name, 2, "[B, rotary]");
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, fn, ": ", name, " must be float32");
    TORCH_CHECK_VALUE(t.size(0) == B && t.size(1) == R, fn, ": ", name, " must be [", B, ", ", R, "], got ",
                      t.sizes());
    return t.data_ptr<float>();
  };
  const float* c0 = table(cos, "cos");
  const float* s0 = table(sin, "sin");
  TORCH_CHECK_VALUE(!uses_local_rope_ || (cos_local && sin_local), fn, ": some layers use the local RoPE table: "
                    "cos_local and sin_local are needed");
  const float* c1 = cos_local ? table(*cos_local, "cos_local") : c0;
  const float* s1 = sin_local ? table(*sin_local, "sin_local") : s0;
  // Only the full-length layers bound a position; a windowed layer's ring wraps.
  const int64_t limit = full_length_ ? full_length_ : std::numeric_limits<int64_t>::max();
  Tensor pos = checked_positions(positions, fn, "positions", B, 0, limit - 1, "each new token must fit in the cache");
  Tensor len = pos + 1;
  double* tm = nullptr;
  if (timers) {
    check_tensor(*timers, fn, "timers", 2, "[layers, parts]");
    TORCH_CHECK_TYPE(timers->scalar_type() == at::kDouble, fn, ": timers must be float64");
    TORCH_CHECK_VALUE(timers->size(0) == static_cast<int64_t>(layers_.size()) && timers->size(1) == wbk::kTimerParts, fn,
                      ": timers must be [", layers_.size(), ", ", wbk::kTimerParts, "], got ", timers->sizes());
    tm = timers->data_ptr<double>();
  }
  const int64_t* lp = len.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(lp, lp + B);
  const int64_t splits = wbk::decode_default_splits(B, shape_.Hkv, longest, at::get_num_threads());
  wbk::StepArgs a{x.data_ptr<float>(), B, {c0, c1}, {s0, s1}, pos.data_ptr<int64_t>(), lp, splits, tm, comm};
  return wbk::decode_stack_step(shape_, layers_, a, buffers_);
}

}  // namespace wbk::ops
