// Raw-pointer entry points of the kernels. bindings.cpp validates tensors and
// calls these; nothing here checks its arguments.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace wbk {

// The MLP's gate activation (the model family's: workbench.model.arch).
enum class Activation { kSilu, kGeluTanh };
inline constexpr const char* kActivationNames[] = {"silu", "gelu_tanh"};

// x rounded up to a multiple of m.
inline constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Prefill attention over contiguous fp32 tensors.
//   q [B, H, N, D], kp: keys packed by pack_keys, vp: values packed by pack_values,
//   out [B, H, N, D].
// With `causal`, query row i (0-based) sees keys 0 .. i + (Nk - N): the queries are the
// last N of Nk positions, so Nk == N is ordinary causal prefill. With a sliding `window` too
// (> 0), only the last `window` of those: keys i + (Nk - N) - window + 1 .. i + (Nk - N).
struct PrefillArgs {
  const float* q;
  const float* kp;
  const float* vp;
  float* out;
  int64_t B, H, Hkv, N, Nk, D;
  bool causal;
  float scale;
  int64_t block_m;  // query rows per task
  int64_t block_n;  // key columns per tile (FlashAttention only), a multiple of gemm_nr()
  int64_t window = 0;  // causal only: each query sees at most this many keys (0: all before it)
};

// Keys k [B*Hkv, Nk, D] (fp32, or bf16 bits when `bf16`) -> kp, per KV head the
// micro-kernel's NR-wide panels of K^T: [ceil(Nk / NR)][D][NR], zero padded.
int64_t packed_keys_floats(int64_t Nk, int64_t D);  // per KV head
void pack_keys(const void* k, bool bf16, float* kp, int64_t BHkv, int64_t Nk, int64_t D);
// Values v [B*Hkv, Nk, D] (fp32, or bf16 bits when `bf16`) -> vp, per KV head the
// micro-kernel's NR-wide panels of V: [ceil(D / NR)][Nk][NR], zero padded.
int64_t packed_values_floats(int64_t Nk, int64_t D);  // per KV head
void pack_values(const void* v, bool bf16, float* vp, int64_t BHkv, int64_t Nk, int64_t D);

void slim_attention(const PrefillArgs& a);
void flash_attention(const PrefillArgs& a);

// Decode attention: one new query token per sequence against a KV cache.
//   q [B, H, D] fp32; caches [B, Hkv, Lmax, D] of `CacheT`; k_scale / v_scale [B, Hkv, Lmax]
//   (int8 only); lengths [B] in 1..Lmax; out [B, H, D] fp32.
enum class CacheDtype { kFloat32, kFloat16, kBFloat16, kInt8 };

// How a decode kernel reads an int8 cache (workbench.model.kv_formats names them):
//   kWiden  K and V widened to fp32 in registers (the paper's kernel);
//   kDot    the query quantized to int8 too (one scale per head), scores by integer dot
//           products, P.V in fp32;
//   kTile   the cache in the tiled layout (decode_tiled.cpp): integer scores and integer P.V.
// Every other cache dtype is widened (kWiden).
enum class Int8Kernel { kWiden = 0, kDot = 1, kTile = 2 };
inline constexpr const char* kInt8KernelNames[] = {"widen", "dot", "tile"};

// Which query heads read which KV head (GQA). In a whole model the H query heads fall in Hkv
// equal groups of G = H / Hkv: KV head j is read by query heads [j G, (j + 1) G). A tensor-
// parallel rank whose shard splits a group (workbench/distributed/shard.py) holds groups of
// uneven size; it passes the model's group size and q_offset, how many of its first KV head's
// query heads are on an earlier rank: its query head h then reads its KV head
// (h + q_offset) / group. group 0 means H / Hkv (and q_offset 0).
struct HeadMap {
  int64_t group = 0;
  int64_t q_offset = 0;
  int64_t group_size(int64_t H, int64_t Hkv) const { return group > 0 ? group : H / Hkv; }
  // The first of the query heads that read KV head kvh, and how many there are.
  int64_t first_query(int64_t H, int64_t Hkv, int64_t kvh) const {
    const int64_t lo = kvh * group_size(H, Hkv) - q_offset;
    return lo > 0 ? lo : 0;
  }
  int64_t queries(int64_t H, int64_t Hkv, int64_t kvh) const {
    const int64_t hi = (kvh + 1) * group_size(H, Hkv) - q_offset;
    return (hi < H ? hi : H) - first_query(H, Hkv, kvh);
  }
};
// Why `m` cannot map H query heads onto Hkv KV heads ("" if it can).
std::string head_map_error(const HeadMap& m, int64_t H, int64_t Hkv);

struct DecodeArgs {
  const float* q;
  const void* k_cache;
  const void* v_cache;
  const float* k_scale;
  const float* v_scale;
  const int64_t* lengths;
  float* out;
  int64_t B, H, Hkv, Lmax, D;
  CacheDtype dtype;
  float scale;
  int64_t num_splits;  // KV-length splits per (batch, kv head); >= 1
  Int8Kernel int8_kernel = Int8Kernel::kWiden;  // how an int8 cache is read (other caches: kWiden)
  HeadMap heads = {};
};

// The tiled int8 layout (decode_tiled.cpp): K in tiles of 16 tokens, V in groups of 4, a
// plane's Lmax a multiple of kTiledAlign (splits start on whole blocks of that many tokens,
// each with its own probability scale), D a multiple of 4.
inline constexpr int kTileTokens = 16;
inline constexpr int kVGroupTokens = 4;
inline constexpr int kTiledAlign = 32;
void decode_attention_tiled(const DecodeArgs& a);

// Which integer dot-product instructions the int8-query scores use in this build.
const char* decode_dot_isa();


void decode_attention(const DecodeArgs& a);
int64_t decode_default_splits(int64_t B, int64_t Hkv, int64_t max_length, int num_threads);

// Symmetric per-vector int8 quantization of `rows` vectors of length D:
//   scale = max|x| / 127, q = round(x / scale); an all-zero vector gets scale 0.
void quantize_int8(const float* x, int8_t* q, float* scales, int64_t rows, int64_t D);

// How a cache plane [Lmax, D] is laid out: token rows, or (int8 only) the tiled layout's K
// tiles or V groups (decode_tiled.cpp).
enum class CacheLayout { kRows, kKTiles, kVGroups };

// Append T new tokens per sequence into a preallocated cache at per-sequence positions.
//   src [B, Hkv, T, D] fp32; cache [B, Hkv, Lmax, D]; scales [B, Hkv, Lmax] (int8 only).
struct AppendArgs {
  const float* src;
  void* cache;
  float* scales;
  const int64_t* positions;
  int64_t B, Hkv, T, Lmax, D;
  CacheDtype dtype;
  CacheLayout layout = CacheLayout::kRows;
};

void kv_cache_append(const AppendArgs& a);

// y [M, N] = x [M, K] . w^T with w [N, K] fp32 (or bf16 bits when `bf16`), fp32
// accumulation: the decode-side (small M) matrix-vector kernel; every weight byte is read once.
// Weights of a linear layer: fp32, bf16, int8 with one fp32 scale per output row
// (weight-only int8: dequantized in registers, fp32 accumulation, the row's scale applied
// once to each finished output), or int8 with one fp32 scale per 32 weights of a row
// (scales [N][ceil(K / 32)], applied in registers as each vector is widened). `row_scale`
// points at whichever scales the dtype has.
// The block-quantized dtypes after kInt8Group (blocks.h: GGUF's block types Q4_0 ... Q6_K and
// the workbench's own i4_g128) are rows of bytes in their own layouts, read by blocks.cpp.
enum class WeightDtype { kFloat32, kBFloat16, kInt8, kInt8Group, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K,
                         kQ6_K, kI4G128 };
inline constexpr int kWeightDtypes = 13;
// The enumerators' names, in order (WeightFormat.kernel, constants()["weight_kernels"]).
inline constexpr const char* kWeightDtypeNames[kWeightDtypes] = {
    "float32", "bfloat16", "int8", "int8_group", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k",
    "i4_g128"};
inline bool is_block(WeightDtype d) { return static_cast<int>(d) >= static_cast<int>(WeightDtype::kQ4_0); }
// Weights per scale of grouped int8 weights (kInt8Group; llama.cpp's Q8_0 granularity).
inline constexpr int64_t kWeightGroup = 32;
void linear_matvec(const float* x, const void* w, WeightDtype dtype, const float* row_scale, float* y, int64_t M,
                   int64_t N, int64_t K);
// The same product for more rows (batched decode, prefill): a packed, register-blocked GEMM
// computing y^T = w x^T, widening w slice by slice (compute-bound).
void linear_gemm(const float* x, const void* w, WeightDtype dtype, const float* row_scale, float* y, int64_t M,
                 int64_t N, int64_t K);

// Which micro-kernel the GEMM runs for bf16 and int8 weights (gemm_bf16.cpp): chosen at run
// time from the CPU's flags and the kernel's permission, never fixed at compile time. kAuto
// picks the fastest that may run (AMX, then AVX512-BF16, in a build for an AVX-512 CPU).
// kAmxBf16 and kAvx512Bf16 round x to bf16 (fp32 accumulation; int8 weights converted to bf16
// slice by slice); kFma is linear.cpp's fp32 FMA GEMM, x kept in fp32. kAmxInt8 (never chosen
// by kAuto) runs per-row int8 weights as W8A8 on the AMX int8 tiles (x quantized to int8 per
// token, int32 sums) and everything else as kAmxBf16.
enum class GemmEngine { kAuto, kFma, kAmxBf16, kAvx512Bf16, kAmxInt8 };
GemmEngine gemm_engine();  // the engine in force (kAuto resolved)
// The engine the GEMM runs a weight dtype on: fp32 weights always on FMAs (the exact path),
// the others on the engine in force (under kAmxInt8: per-row int8 on it, the rest on kAmxBf16).
GemmEngine gemm_engine_for(WeightDtype dtype);
// Set the engine; false (with the reason) when the CPU, the OS or the kernel refuses it.
bool set_gemm_engine(GemmEngine engine, std::string* why_not);
bool amx_bf16_available(std::string* reason);
bool avx512_bf16_available(std::string* reason);
void linear_gemm_bf16(GemmEngine engine, const float* x, const uint16_t* w, float* y, int64_t M, int64_t N,
                      int64_t K);
// int8 weights on a bf16 engine; group_scale [N][ceil(K / kWeightGroup)] for grouped int8, else
// nullptr (per-row scales are the caller's, applied to the outputs).
void linear_gemm_int8_bf16(GemmEngine engine, const float* x, const int8_t* w, const float* group_scale, float* y,
                           int64_t M, int64_t N, int64_t K);
// Per-row int8 weights times x quantized per token on the AMX int8 tiles (W8A8): y = the int32
// sums times each token's scale; the row scales are the caller's, applied to the outputs.
void linear_gemm_w8a8(const float* x, const int8_t* w, float* y, int64_t M, int64_t N, int64_t K);
// Prefill attention on a bf16 engine (prefill_tiles.cpp): SlimAttention (slim) or
// FlashAttention-2 with Q K^T and P V as bf16 products accumulated in fp32, the softmax in
// fp32. q [B, H, N, D] bf16 bits; kp / vp: k and v [B*Hkv, Nk, D] packed by pack_kv_tiles;
// out [B, H, N, D] bf16 bits. block_m (query rows per task) and block_n (flash's key tile) are
// multiples of 32, block_m at most kMaxTileBlockM. `engine` is kAmxBf16 or kAvx512Bf16 and
// may run here (the caller checked).
inline constexpr int64_t kMaxTileBlockM = 512;
struct PrefillTileArgs {
  const uint16_t* q;
  const uint16_t* kp;
  const uint16_t* vp;
  uint16_t* out;
  int64_t B, H, Hkv, N, Nk, D;
  bool causal;
  float scale;
  int64_t block_m, block_n;
  int64_t window = 0;  // as PrefillArgs::window
};
int64_t packed_kv_tile_elems(int64_t Nk, int64_t D);  // bf16 values per KV head, of K and of V each
void pack_kv_tiles(const uint16_t* k, const uint16_t* v, uint16_t* kp, uint16_t* vp, int64_t BHkv, int64_t Nk,
                   int64_t D);
void attention_tiles(GemmEngine engine, const PrefillTileArgs& a, bool slim);
// tdpbf16ps on tiles already loaded, `iterations` x 4 per thread; returns the FLOPs executed
// (0 where AMX may not run). The matrix engine's peak, timed by the caller (bench/peaks.py).
double amx_bf16_loop(int64_t iterations_per_thread);
// The same for tdpbssd (int8 products, int32 sums): the AMX int8 peak in ops (0 where it may not
// run; amx_int8_available says why).
bool amx_int8_available(std::string* reason);
double amx_int8_loop(int64_t iterations_per_thread);
// The same for vdpbf16ps on 16 independent accumulators (0 where AVX512-BF16 may not run).
double avx512_bf16_loop(int64_t iterations_per_thread);

// y [T, n] = each row of x [T, n] / sqrt(mean(row^2) + eps) * w [n] (decode_step.cpp's row
// function, rows in parallel): a prefill's norms in one pass each.
void rms_norm_rows(const float* x, const float* w, float* y, int64_t T, int64_t n, float eps);

// out [T, F] = act(gate) * up for each row [gate | up] of gate_up [T, 2F] (decode_step.cpp's
// row function, rows in parallel): the MLP's activation of a prefill in one pass.
void act_mul_rows(Activation act, const float* gate_up, float* out, int64_t T, int64_t F);

// The n values of random stream `stream` under `seed`, times std (random.cpp): approximately
// N(0, std^2), the same on any number of threads; the bf16 fill is the fp32 one rounded.
void fill_normal_f32(float* out, int64_t n, uint64_t seed, uint64_t stream, float std);
void fill_normal_bf16(uint16_t* out, int64_t n, uint64_t seed, uint64_t stream, float std);

// RoPE, rotate-half layout, in place: the first R values of each of the first `heads` vectors
// of D values in each of the T rows of x (ldx apart) rotated by cos / sin [T, R] (rope.cpp;
// R = D but for partial rotary).
void rope_rotate_half(float* x, int64_t T, int64_t ldx, int64_t heads, int64_t D, int64_t R, const float* cos,
                      const float* sin);

// Up to how many rows of x a linear layer runs the matrix-vector kernel, above it the GEMM, per
// weight dtype: the crossover depends on the dtype and on the GEMM's engine, so it is measured
// on each host when the kernels load (workbench/kernels/crossover.py) and set here; the default
// holds until then (and in a build nobody measured). Batch-1 decode is always the matrix-vector
// kernel (at least 1).
inline constexpr int64_t kMatvecMaxRowsDefault = 10;
// The FMA GEMM's budget for one block of x^T over a panel of K (linear.cpp, panel_length).
int64_t gemm_panel_bytes();
int64_t matvec_max_rows(WeightDtype dtype);
void set_matvec_max_rows(WeightDtype dtype, int64_t rows);

// The fused decode step (decode_step.cpp): every layer of the stack in one call.
struct WeightRef {  // one linear layer's weights, as linear_matvec / linear_gemm take them
  const void* w;
  WeightDtype dtype;
  const float* scale;  // int8 scales (per row or per 32 weights), else null
  int64_t N, K;
};
// One matrix of a grouped matrix-vector product (matvec_jobs): y[i * ldy + n] = W[n] . x[rows[i]]
// for the n_rows rows of the shared activations x it takes, W [N, K] in a block format or int8
// (scale: per row for kInt8, per 32 weights for kInt8Group, else null).
struct MatvecJob {
  const void* w;
  WeightDtype dtype;
  const float* scale;
  int64_t N;
  const int64_t* rows;
  int64_t n_rows;
  float* y;
  int64_t ldy;
};

struct LinearRef {  // a linear layer: row-wise parts (formats may differ), outputs concatenated
  std::vector<WeightRef> parts;
  int64_t N = 0, K = 0;
};
struct ExpertRef {  // one expert of a mixture: [gate; up] and down
  LinearRef gate_up, down;
};
struct LayerRef {  // one layer's weights and KV cache
  const float* attn_norm;
  const float* mlp_norm;
  LinearRef qkv, o, gate_up, down;
  // A mixture of experts in place of the MLP (gate_up and down then unused): the router's
  // fp32 weights [E, dim], each token's top_k experts by softmax probability (their weights
  // renormalized to sum to 1 where norm_topk), each expert run once on the rows routed to it;
  // expert_hits [E] (may be null) gets the number of tokens the step routed to each expert.
  LinearRef router;
  std::vector<ExpertRef> experts;
  int64_t top_k = 0;
  bool norm_topk = true;
  int32_t* expert_hits = nullptr;
  void* k_cache;
  void* v_cache;
  float* k_scale;  // int8 caches only
  float* v_scale;
  // What the model's family adds (workbench.model.arch; null where it has none):
  const float* qkv_bias = nullptr;        // [(H + 2 Hkv) D] added to the qkv product (Qwen2)
  const float* q_norm = nullptr;          // [D] an RMSNorm of each q head before RoPE (Qwen3, Gemma 3)
  const float* k_norm = nullptr;          // [D] the same for each k head
  const float* post_attn_norm = nullptr;  // [dim] on the attention's output before the residual add (Gemma 3)
  const float* post_mlp_norm = nullptr;   // [dim] on the MLP's output likewise
  int64_t Lmax = 0;    // this layer's cache length; a windowed layer's is a ring of `window` slots
  int64_t window = 0;  // sliding window (0: none): token p at slot p % window, the ring attended whole
  int rope = 0;        // its RoPE table: 0 the global one, 1 the local layers' (StepArgs::cos / sin)
};
struct StackShape {
  int64_t dim, H, Hkv, D, ffn;  // local heads (a tensor-parallel rank's share)
  float eps, scale;             // RMSNorm epsilon, attention scale
  int64_t rotary;               // dims of each head RoPE rotates (D, or fewer: partial rotary)
  Activation act;
  CacheDtype dtype;
  CacheLayout k_layout, v_layout;
  Int8Kernel int8_kernel;
  HeadMap heads;
  // A tensor-parallel rank that shares a KV head with a neighbour (the query-head split cuts
  // its group, workbench/distributed/shard.py): kv_send, its first KV head is also the
  // previous rank's last, and it computes that head's k and v and puts them for that rank;
  // kv_recv, its last KV head is also the next rank's first, and it gets that head's k and v
  // instead of computing them. Where the collective cannot hand off, both compute the head.
  bool kv_send = false, kv_recv = false;
};
// The all-reduce (sum) a tensor-parallel rank's fused step runs after o_proj and after
// down_proj, whose rows it holds only partial sums of. buffer(n) is where the producing
// kernel may write its n floats so that the collective reads them in place (zero copy), or
// null for the step's own buffer; all_reduce leaves the sum in `data` on every rank.
//
// The KV-head handoff (StackShape::kv_send / kv_recv): hands_off(n) says whether this
// collective hands n floats from a rank to the previous one, one-sided (the sender does not
// wait); put(data, n) gives the previous rank n floats, get(data, n) takes the next rank's,
// waiting until they are there. Both ranks must get the same answer from hands_off for the
// same n (it depends only on the collective's settings, which every rank shares). Where it
// says no, both ranks compute the shared KV head. Added after all_reduce, so that a
// collective built from an older kernels.h (ForeignCollective's target) keeps its layout;
// ForeignCollective does not hand off (oneCCL's send and receive, tried, cost more in the
// step than computing the head on both ranks: docs/distributed.md).
struct StepCollective {
  virtual ~StepCollective() = default;
  virtual float* buffer(int64_t n) = 0;
  virtual void all_reduce(float* data, int64_t n) = 0;
  virtual bool hands_off(int64_t n) { return false; }
  virtual void put(const float* data, int64_t n) {}
  virtual void get(float* data, int64_t n) {}
};

struct StepArgs {
  float* x;  // [B, dim] the residual stream, updated in place
  int64_t B;
  const float* cos[2];  // [B, rotary] each sequence's RoPE row: the global table's, the local layers'
  const float* sin[2];
  const int64_t* positions;  // [B] where each sequence's new token goes
  const int64_t* lengths;    // [B] positions + 1
  int64_t num_splits;
  double* timers;  // [layers, kTimerParts] seconds added per part (kTimerPartNames), or null
  StepCollective* comm = nullptr;  // tensor parallel: the layers' all-reduces; null in one process
};
// The parts the fused step's timers split a layer into, in their column order (exported to
// Python by constants(); the names are workbench.model.timing's PARTS).
// "comm" (the all-reduces) is taken out of attention's and the MLP's times; 0 in one process.
inline constexpr int kTimerParts = 4;
inline constexpr const char* kTimerPartNames[kTimerParts] = {"attention", "mlp", "other", "comm"};
struct StepBuffers {  // scratch reused from step to step
  std::vector<float> h, qkv, q, k, v, attn, out, gate_up, act;
  std::vector<float> handoff, rows;  // the shared KV head's k and v; a run of rows of qkv
  std::vector<int64_t> ring_positions, ring_lengths;  // a windowed layer's slots and lengths
  // a mixture's router probabilities [B, E], each token's choices and weights [B, top_k],
  // one expert's rows gathered, its [gate | up], activation and output
  std::vector<float> probs, choice_weight, moe_in, moe_gate_up, moe_act, moe_out;
  std::vector<int64_t> choice, moe_rows, moe_offsets, moe_index;
  std::vector<float> moe_row_weight;
  std::vector<MatvecJob> moe_jobs;
};
// Wakes the thread pool (an empty parallel region) and returns the seconds it took.
double wake_threads();
// Runs every layer for one token per sequence; returns the seconds spent waking the thread
// pool before layer 0 (wake_threads, kept out of the layers' timers).
double decode_stack_step(const StackShape& s, const std::vector<LayerRef>& layers, const StepArgs& a,
                         StepBuffers& buf);

// Machine-peak probes used by the benchmarks (bench/peaks.py).
// fma_loop runs `iterations` steps of independent FMA chains on every torch thread and
// returns the flops executed; the caller times it (a clock read here could be reordered).
double fma_loop(int64_t iterations_per_thread);
void triad(float* a, const float* b, const float* c, float s, int64_t n);
double read_sum(const float* x, int64_t n);

const char* isa();
int gemm_mr();
int gemm_nr();

}  // namespace wbk
