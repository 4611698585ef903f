// The kernels' tensor-level face, for the Python module (bindings.cpp): every tensor argument
// is validated here (ops.cpp), before any pointer is formed, so a user's mistake becomes a
// Python exception (ValueError / TypeError) that names the argument, what it was and what is
// accepted, never a crash. The kernels themselves (kernels.h) trust their arguments.
//
// Apart from the module so that the two compile side by side: these checks need ATen's
// headers, the module pybind11's and torch's type casters, and the two together in one unit
// were the longest compile of the build by far.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "shm_comm.h"

namespace wbk::ops {

using at::Tensor;

const char* engine_name(wbk::GemmEngine e);

// A weight kernel by its name (WeightFormat.kernel, constants()["weight_kernels"]).
wbk::WeightDtype weight_kernel(const std::string& kernel, const char* fn);

Tensor slim_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, std::optional<double> scale,
                      int64_t block_m, int64_t window);

Tensor flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                       std::optional<double> scale, int64_t block_m, int64_t block_n, int64_t window);

Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                        const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale,
                        std::optional<double> scale, std::optional<int64_t> num_splits,
                        const std::string& int8_kernel_name, int64_t group, int64_t q_offset);

std::tuple<Tensor, Tensor> quantize_kv_int8(const Tensor& x);

void kv_cache_append(Tensor& cache, const Tensor& values, const Tensor& positions,
                     const std::optional<Tensor>& scales, const std::string& layout);

Tensor linear(const Tensor& x, const Tensor& w, int64_t matvec_max_rows, const std::optional<Tensor>& out,
              const std::optional<Tensor>& scale, const std::string& kernel);

// Several matrices, each times its own rows of x [M, K], in one parallel region (matvec_jobs:
// a mixture's experts on the tokens routed to each): y_j [rows_j, N_j] = x[rows_j] . w_j^T,
// the weights block rows (kernel named) or int8 with scale.
std::vector<Tensor> grouped_matvec(const Tensor& x, const std::vector<Tensor>& weights,
                                   const std::vector<std::optional<Tensor>>& scales,
                                   const std::vector<std::string>& kernels, const std::vector<Tensor>& rows);

// Block-quantized rows (blocks.h), by the kernel's name: a row's bytes; our quantizer (x fp32
// [rows, K] -> uint8 [rows, row bytes] in GGUF's block order, search: q4_0 with least-squares
// scales); GGUF's order <-> the kernels' (to_kernel); the rows (all, or `rows`) as fp32.
int64_t block_row_bytes(const std::string& kernel, int64_t K);
Tensor quantize_blocks(const Tensor& x, const std::string& kernel, bool search);
Tensor repack_blocks(const Tensor& w, const std::string& kernel, int64_t K, bool to_kernel);
Tensor dequantize_blocks(const Tensor& w, const std::string& kernel, int64_t K, const std::optional<Tensor>& rows,
                         bool reference);

void fill_normal_(Tensor& out, int64_t seed, int64_t stream, double std);

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);

// The MLP's activation of each row [gate | up]: act(gate) * up, act "silu" or "gelu_tanh".
Tensor act_mul(const Tensor& gate_up, const std::string& activation);
wbk::Activation activation_named(const std::string& name, const char* fn);

// The tensor-parallel LM head's exchange. topk_pairs: each row's k best logits of [rows, n],
// best first (NaN first, ties by the lower index), as [rows, 2k]: the k values, then their
// indices + offset as float32 (the rank's first token id). merge_topk: the k best of every
// rank's pairs [world, rows, 2k] (same order), as logits [rows, vocab] that are -inf elsewhere.
Tensor topk_pairs(const Tensor& logits, int64_t k, int64_t offset);
Tensor merge_topk(const Tensor& pairs, int64_t vocab);

void rope_(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t heads, int64_t head_dim);

// The shared-memory collectives (shm_comm.h); each returns the seconds this rank waited for
// the others to arrive.
double shm_all_reduce(const Tensor& seg, int64_t rank, int64_t world, int64_t capacity, double timeout_s,
                      Tensor& data, int64_t seq);

double shm_broadcast(const Tensor& seg, int64_t rank, int64_t world, int64_t capacity, double timeout_s,
                     Tensor& data, int64_t root, int64_t seq);

double shm_all_gather(const Tensor& seg, int64_t rank, int64_t world, int64_t capacity, double timeout_s,
                      const Tensor& data, Tensor& out, int64_t seq);

void triad(Tensor& a, const Tensor& b, const Tensor& c, double s);

double read_sum(const Tensor& x);

// The matrix-vector kernel's weight types, each with its own prefetch setting (prefetch.h);
// int8 covers both scale granularities (per row and per group).
int matvec_weights(const std::string& name);

// The fused decode step's all-reduce over our shared-memory segment, called from C++ with no
// Python in between. Its barrier numbers are the communicator's (`seq`, which the Python side
// reads and advances for its own collectives: ShmComm). With zero_copy, o_proj / down_proj
// write into this rank's input slot, which the all-reduce then reads in place. `wait_s` adds up
// the seconds its all-reduces (and handoff gets) waited for the other ranks to arrive (the
// caller resets it).
class ShmCollective : public wbk::StepCollective {
 public:
  ShmCollective(Tensor seg, int64_t rank, int64_t world, int64_t capacity, double timeout_s);

  float* buffer(int64_t n) override {
    if (!zero_copy || n * static_cast<int64_t>(sizeof(float)) > a_.capacity) return nullptr;
    return reinterpret_cast<float*>(a_.seg + wbk::kShmHeaderBytes + a_.rank * a_.capacity);
  }

  void all_reduce(float* data, int64_t n) override {
    const int64_t chunk = a_.capacity / static_cast<int64_t>(sizeof(float));
    for (int64_t lo = 0; lo < n; lo += chunk) {
      wait_s += wbk::shm_all_reduce_sum(a_, data + lo, std::min(chunk, n - lo), seq);
      seq += 2;
    }
  }

  // The shared KV head's handoff (StackShape::kv_send / kv_recv), one-sided through the
  // segment's handoff slots; kv_handoff off: both ranks compute the head (to measure it).
  bool hands_off(int64_t n) override {
    return kv_handoff && n * static_cast<int64_t>(sizeof(float)) <= a_.capacity;
  }
  void put(const float* data, int64_t n) override {
    wbk::shm_put(a_, data, n, ++puts);
    put_floats += n;
  }
  void get(float* data, int64_t n) override { wait_s += wbk::shm_get(a_, a_.rank + 1, data, n, ++gets); }

  int64_t seq = 1;  // the next barrier number
  bool zero_copy = true;
  bool kv_handoff = true;
  int64_t puts = 0, gets = 0;  // handoffs made and taken so far (the segment counts them too)
  int64_t put_floats = 0;      // and the floats handed over
  double wait_s = 0.0;

 private:
  Tensor seg_;  // keeps the mapping alive
  wbk::ShmArgs a_;
};

// A StepCollective that another extension of ours built from the same kernels.h (the oneCCL
// binding, ccl_comm.cpp: a separate library, built only with the ccl extra), handed over as its
// address: the fused step calls it natively, with the GIL released, as it calls ShmCollective.
// The object lives in that extension for the life of the process.
class ForeignCollective : public wbk::StepCollective {
 public:
  explicit ForeignCollective(uintptr_t address) : target_(reinterpret_cast<wbk::StepCollective*>(address)) {
    TORCH_CHECK_VALUE(address != 0, "ForeignCollective: address is null");
  }
  float* buffer(int64_t n) override { return target_->buffer(n); }
  void all_reduce(float* data, int64_t n) override {
    try {
      target_->all_reduce(data, n);
    } catch (const std::exception& e) {  // raised in the other library: the step's own error type
      throw wbk::CollectiveError(e.what());
    }
  }

 private:
  wbk::StepCollective* target_;
};

// One row-wise part of a linear layer: its weights, int8's scales, and for block-quantized rows
// (uint8) their kernel's name ("" otherwise: the dtype says).
struct WeightPart {
  Tensor w;
  std::optional<Tensor> scale;
  std::string kernel;
};

// One decoder layer's tensors as the fused step reads them: its norms, its four linears (each
// one or more parts, whose outputs are concatenated), its KV cache (scales for int8), and what
// its family adds (workbench.model.arch): q / k / v biases, per-head q / k norms, norms after
// attention and the MLP; its sliding window (its cache then a ring of that many slots) and
// which RoPE table it reads (0 global, 1 the local layers').
struct DecodeLayer {
  Tensor attn_norm, mlp_norm;
  std::vector<WeightPart> wqkv, wo, w_gate_up, w_down;
  Tensor k_cache, v_cache;
  std::optional<Tensor> k_scale, v_scale;
  std::optional<Tensor> qkv_bias, q_norm, k_norm, post_attn_norm, post_mlp_norm;
  int64_t window = 0, rope = 0;
  // A mixture of experts (w_gate_up and w_down then empty): the router's fp32 part, each
  // expert's [gate; up] and down parts, top_k, and whether the chosen weights renormalize.
  std::vector<WeightPart> router;
  std::vector<std::vector<WeightPart>> experts_gate_up, experts_down;
  int64_t top_k = 0;
  bool norm_topk = true;
};

// The fused decode step's Python face: built once per (model, cache) with every layer's
// weights and cache tensors (checked here, kept alive here), then step() runs all layers
// in one call with the GIL released (decode_step.cpp).
class DecodeStack {
 public:
  DecodeStack(const std::vector<DecodeLayer>& layers, int64_t heads, double eps,
              const std::string& int8_kernel_name, int64_t group, int64_t q_offset, bool kv_send,
              bool kv_recv, std::optional<double> scale, int64_t rotary, const std::string& activation);

  // x [B, dim] fp32 (updated in place), cos / sin [B, rotary] (and the local layers' table,
  // where some layers read it), positions [B]; timers [layers, kTimerParts] float64 (attention,
  // mlp, other seconds added) or None. Returns the seconds spent waking the thread pool before
  // layer 0.
  double step(Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
              const std::optional<Tensor>& timers, wbk::StepCollective* comm,
              const std::optional<Tensor>& cos_local, const std::optional<Tensor>& sin_local);

  int64_t layers() const { return static_cast<int64_t>(layers_.size()); }
  // [layers, experts] int32: 1 where the last step ran that expert (a mixture; else [layers, 0])
  Tensor expert_hits() const { return expert_hits_; }

 private:
  wbk::StackShape shape_{};
  int64_t batch_ = 0;
  int64_t full_length_ = 0;  // the shortest cache of the layers without a window (0: none)
  bool uses_local_rope_ = false;
  std::vector<wbk::LayerRef> layers_;
  std::vector<DecodeLayer> keep_;  // every tensor a pointer above points into
  Tensor expert_hits_;
  wbk::StepBuffers buffers_;
};

}  // namespace wbk::ops
