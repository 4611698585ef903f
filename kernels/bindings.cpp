// The Python module: the functions and classes of ops.h (where every argument is checked),
// PyCollective (the one collective that calls into Python), and the constants Python reads
// from this side. torch/csrc/utils/pybind.h (pybind11 with torch's tensor type casters), not
// torch/extension.h or torch/python.h: those add the whole C++ frontend (nn, optim, data),
// which the module does not use and which was most of its compile time.
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "blocks.h"
#include "kernels.h"
#include "ops.h"
#include "prefetch.h"

namespace {

using at::Tensor;
using namespace wbk::ops;

// The same all-reduce through a Python callable (gloo: a communicator that lives in Python):
// called with a float32 tensor viewing the data, which it reduces in place. The GIL is taken
// for the call only.
class PyCollective : public wbk::StepCollective {
 public:
  explicit PyCollective(py::function fn) : fn_(std::move(fn)) {}
  ~PyCollective() override {
    py::gil_scoped_acquire gil;
    fn_ = py::function();
  }

  float* buffer(int64_t) override { return nullptr; }

  void all_reduce(float* data, int64_t n) override {
    py::gil_scoped_acquire gil;
    fn_(at::from_blob(data, {n}, at::kFloat));
  }

 private:
  py::function fn_;
};

// The step's collective called `calls` times on `floats` values (every rank makes the same
// calls): the seconds each call took. With stream_bytes 0 the calls follow one another with
// nothing between, the least a decode step's all-reduces can cost; otherwise each rank first
// reads stream_bytes of its own memory (a buffer larger than the caches, as the step's
// matrix-vector kernels stream their weights between two all-reduces), so each call starts
// with the caches holding what a step leaves in them. The values are zeros, so the sums stay
// finite.
std::vector<double> time_collective(wbk::StepCollective& collective, int64_t floats, int64_t calls,
                                    int64_t stream_bytes) {
  TORCH_CHECK_VALUE(floats >= 1, "time_collective: floats must be at least 1, got ", floats);
  TORCH_CHECK_VALUE(calls >= 1, "time_collective: calls must be at least 1, got ", calls);
  TORCH_CHECK_VALUE(stream_bytes >= 0, "time_collective: stream_bytes must be 0 or more, got ", stream_bytes);
  std::vector<float> own;
  float* data = collective.buffer(floats);  // where the step's kernels would write (zero copy)
  if (data == nullptr) {
    own.assign(floats, 0.0f);
    data = own.data();
  } else {
    std::fill(data, data + floats, 0.0f);
  }
  // Streamed as 16 lanes summed apart, so the reads are not one dependent chain.
  const int64_t lanes = 16, rows = stream_bytes / static_cast<int64_t>(sizeof(float) * lanes);
  std::vector<float> stream(static_cast<size_t>(rows * lanes), 1.0f);
  float sink = 0.0f;
  std::vector<double> seconds(static_cast<size_t>(calls));
  for (int64_t i = 0; i < calls; ++i) {
    float acc[lanes] = {};
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t l = 0; l < lanes; ++l) acc[l] += stream[r * lanes + l];
    for (int64_t l = 0; l < lanes; ++l) sink += acc[l];
    const auto t0 = std::chrono::steady_clock::now();
    collective.all_reduce(data, floats);
    seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  volatile float keep = sink;  // the reads stay
  (void)keep;
  return seconds;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "workbench attention and KV-cache kernels (see workbench.kernels for the documented API)";
  py::class_<WeightPart>(m, "WeightPart", py::module_local())  // one row-wise part of a linear layer
      .def(py::init<Tensor, std::optional<Tensor>, std::string>(), py::arg("w"), py::arg("scale") = py::none(),
           py::arg("kernel") = "");
  py::class_<DecodeLayer>(m, "DecodeLayer", py::module_local())  // one layer's tensors for DecodeStack
      .def(py::init<Tensor, Tensor, std::vector<WeightPart>, std::vector<WeightPart>, std::vector<WeightPart>,
                    std::vector<WeightPart>, Tensor, Tensor, std::optional<Tensor>, std::optional<Tensor>,
                    std::optional<Tensor>, std::optional<Tensor>, std::optional<Tensor>, std::optional<Tensor>,
                    std::optional<Tensor>, int64_t, int64_t, std::vector<WeightPart>,
                    std::vector<std::vector<WeightPart>>, std::vector<std::vector<WeightPart>>, int64_t, bool>(),
           py::arg("attn_norm"), py::arg("mlp_norm"), py::arg("wqkv"), py::arg("wo"), py::arg("w_gate_up"),
           py::arg("w_down"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),
           py::arg("qkv_bias") = py::none(), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("post_attn_norm") = py::none(), py::arg("post_mlp_norm") = py::none(), py::arg("window") = 0,
           py::arg("rope") = 0, py::arg("router") = std::vector<WeightPart>{},
           py::arg("experts_gate_up") = std::vector<std::vector<WeightPart>>{},
           py::arg("experts_down") = std::vector<std::vector<WeightPart>>{}, py::arg("top_k") = 0,
           py::arg("norm_topk") = true);
  py::register_exception<wbk::CollectiveError>(m, "CollectiveError", PyExc_RuntimeError);
  // The collectives a tensor-parallel rank's DecodeStack.step takes (comm=).
  py::class_<wbk::StepCollective>(m, "StepCollective", py::module_local());
  py::class_<ShmCollective, wbk::StepCollective>(m, "ShmCollective", py::module_local())
      .def(py::init<Tensor, int64_t, int64_t, int64_t, double>(), py::arg("segment"), py::arg("rank"),
           py::arg("world"), py::arg("capacity"), py::arg("timeout_s"))
      .def_readwrite("seq", &ShmCollective::seq)
      .def_readwrite("zero_copy", &ShmCollective::zero_copy)
      .def_readwrite("kv_handoff", &ShmCollective::kv_handoff)
      .def_readonly("puts", &ShmCollective::puts)
      .def_readonly("gets", &ShmCollective::gets)
      .def_readonly("put_floats", &ShmCollective::put_floats)
      .def_readwrite("wait_s", &ShmCollective::wait_s);
  py::class_<ForeignCollective, wbk::StepCollective>(m, "ForeignCollective", py::module_local())
      .def(py::init<uintptr_t>(), py::arg("address"));
  py::class_<PyCollective, wbk::StepCollective>(m, "PyCollective", py::module_local())
      .def(py::init<py::function>(), py::arg("all_reduce"));
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())  // one per build (native, avx2, scalar)
      .def(py::init<const std::vector<DecodeLayer>&, int64_t, double, const std::string&, int64_t, int64_t, bool,
                    bool, std::optional<double>, int64_t, const std::string&>(),
           py::arg("layers"), py::arg("heads"), py::arg("eps"), py::arg("int8_kernel"), py::arg("group") = 0,
           py::arg("q_offset") = 0, py::arg("kv_send") = false, py::arg("kv_recv") = false,
           py::arg("scale") = py::none(), py::arg("rotary") = 0, py::arg("activation") = "silu")
      .def("step", &DecodeStack::step, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("positions"),
           py::arg("timers"), py::arg("comm") = nullptr, py::arg("cos_local") = py::none(),
           py::arg("sin_local") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("layers", &DecodeStack::layers)
      .def_property_readonly("expert_hits", &DecodeStack::expert_hits);
  m.def("slim_attention", &slim_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("causal"),
        py::arg("scale"), py::arg("block_m"), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("flash_attention", &flash_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("causal"),
        py::arg("scale"), py::arg("block_m"), py::arg("block_n"), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention", &decode_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("lengths"), py::arg("k_scale"), py::arg("v_scale"), py::arg("scale"), py::arg("num_splits"),
        py::arg("int8_kernel") = "widen", py::arg("group") = 0, py::arg("q_offset") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_dot_isa", &wbk::decode_dot_isa);
  m.def("wake_threads", &wbk::wake_threads, py::call_guard<py::gil_scoped_release>());
  m.def("time_collective", &time_collective, py::arg("collective"), py::arg("floats"), py::arg("calls"),
        py::arg("stream_bytes") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("set_prefetch", [](int64_t bytes, int hint, bool pipeline) {
    TORCH_CHECK_VALUE(bytes >= 0 && hint >= 0 && hint <= 3, "set_prefetch: bytes >= 0 and hint in 0..3, got ",
                      bytes, ", ", hint);
    wbk::g_prefetch = wbk::PrefetchConfig{bytes, hint, pipeline};
  }, py::arg("bytes"), py::arg("hint"), py::arg("pipeline") = false);
  m.def("get_prefetch", [] {
    return std::make_tuple(wbk::g_prefetch.bytes, wbk::g_prefetch.hint, wbk::g_prefetch.pipeline);
  });
  m.def("set_matvec_prefetch", [](const std::string& weights, int64_t bytes, int hint, int64_t max_chunk_bytes,
                                  int64_t serial_max_chunk_bytes) {
    TORCH_CHECK_VALUE(bytes >= 0 && hint >= 0 && hint <= 3 && max_chunk_bytes >= 0 && serial_max_chunk_bytes >= 0,
                      "set_matvec_prefetch: bytes >= 0, hint in 0..3, max_chunk_bytes >= 0, "
                      "serial_max_chunk_bytes >= 0, got ", bytes, ", ", hint, ", ", max_chunk_bytes, ", ",
                      serial_max_chunk_bytes);
    wbk::g_matvec_prefetch[matvec_weights(weights)] = {bytes, hint, max_chunk_bytes, serial_max_chunk_bytes};
  }, py::arg("weights"), py::arg("bytes"), py::arg("hint"), py::arg("max_chunk_bytes"),
     py::arg("serial_max_chunk_bytes") = 0);
  m.def("get_matvec_prefetch", [](const std::string& weights) {
    const auto& p = wbk::g_matvec_prefetch[matvec_weights(weights)];
    return std::make_tuple(p.bytes, p.hint, p.max_chunk_bytes, p.serial_max_chunk_bytes);
  }, py::arg("weights"));
  m.def("decode_default_splits", [](int64_t B, int64_t Hkv, int64_t max_length) {
    return wbk::decode_default_splits(B, Hkv, max_length, at::get_num_threads());
  });
  m.def("quantize_kv_int8", &quantize_kv_int8, py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
  m.def("fill_normal_", &fill_normal_, py::arg("out"), py::arg("seed"), py::arg("stream"), py::arg("std"),
        py::call_guard<py::gil_scoped_release>());
  m.def("act_mul", &act_mul, py::arg("gate_up"), py::arg("activation") = "silu",
        py::call_guard<py::gil_scoped_release>());
  m.def("topk_pairs", &topk_pairs, py::arg("logits"), py::arg("k"), py::arg("offset"),
        py::call_guard<py::gil_scoped_release>());
  m.def("merge_topk", &merge_topk, py::arg("pairs"), py::arg("vocab"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("rope_", &rope_, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("heads"), py::arg("head_dim"),
        py::call_guard<py::gil_scoped_release>());
  m.def("kv_cache_append", &kv_cache_append, py::arg("cache"), py::arg("values"), py::arg("positions"),
        py::arg("scales"), py::arg("layout") = "rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("fma_loop", &wbk::fma_loop, py::arg("iterations"),
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &linear, py::arg("x"), py::arg("w"), py::arg("matvec_max_rows"), py::arg("out") = py::none(),
        py::arg("scale") = py::none(), py::arg("kernel") = "", py::call_guard<py::gil_scoped_release>());
  m.def("grouped_matvec", &grouped_matvec, py::arg("x"), py::arg("weights"), py::arg("scales"), py::arg("kernels"),
        py::arg("rows"), py::call_guard<py::gil_scoped_release>());
  m.def("block_row_bytes", &block_row_bytes, py::arg("kernel"), py::arg("K"));
  m.def("quantize_blocks", &quantize_blocks, py::arg("x"), py::arg("kernel"), py::arg("search") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("repack_blocks", &repack_blocks, py::arg("w"), py::arg("kernel"), py::arg("K"), py::arg("to_kernel"),
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_blocks", &dequantize_blocks, py::arg("w"), py::arg("kernel"), py::arg("K"),
        py::arg("rows") = py::none(), py::arg("reference") = false, py::call_guard<py::gil_scoped_release>());
  m.def("block_dot_isa", &wbk::block_dot_isa);
  m.def("block_byte_dot_isa", &wbk::block_byte_dot_isa);
  m.def("set_block_activation_bits", [](int bits) {
    TORCH_CHECK_VALUE(bits == 8 || bits == 16, "set_block_activation_bits: bits must be 8 or 16, got ", bits);
    wbk::set_block_activation_bits(bits);
  });
  m.def("block_activation_bits", &wbk::block_activation_bits);
  m.def("shm_segment_bytes", [](int64_t world, int64_t capacity) { return wbk::shm_segment_bytes(world, capacity); });
  m.def("shm_all_reduce", &shm_all_reduce, py::call_guard<py::gil_scoped_release>());
  m.def("shm_broadcast", &shm_broadcast, py::call_guard<py::gil_scoped_release>());
  m.def("shm_all_gather", &shm_all_gather, py::call_guard<py::gil_scoped_release>());
  m.def("triad", &triad, py::call_guard<py::gil_scoped_release>());
  m.def("read_sum", &read_sum, py::call_guard<py::gil_scoped_release>());
  m.def("isa", &wbk::isa);
  // The GEMM's engine in force: "fma", "amx_bf16", "avx512_bf16" or "amx_int8" (chosen at run time).
  m.def("gemm_engine", [] { return engine_name(wbk::gemm_engine()); });
  // The engine the GEMM runs a weight kernel (WeightFormat.kernel) on.
  m.def("gemm_engine_for", [](const std::string& kernel) {
    return engine_name(wbk::gemm_engine_for(weight_kernel(kernel, "gemm_engine_for")));
  });
  // The matrix-vector / GEMM crossover in force for a weight kernel (workbench/kernels/crossover.py).
  m.def("matvec_max_rows", [](const std::string& kernel) {
    return wbk::matvec_max_rows(weight_kernel(kernel, "matvec_max_rows"));
  });
  m.def("set_matvec_max_rows", [](const std::string& kernel, int64_t rows) {
    TORCH_CHECK_VALUE(rows >= 1, "set_matvec_max_rows: rows must be >= 1 (batch-1 decode is the matrix-vector ",
                      "kernel), got ", rows);
    wbk::set_matvec_max_rows(weight_kernel(kernel, "set_matvec_max_rows"), rows);
  });
  m.def("set_gemm_engine", [](const std::string& name) {
    wbk::GemmEngine e = name == "auto" ? wbk::GemmEngine::kAuto
                        : name == "fma" ? wbk::GemmEngine::kFma
                        : name == "amx_bf16" ? wbk::GemmEngine::kAmxBf16
                        : name == "avx512_bf16" ? wbk::GemmEngine::kAvx512Bf16
                        : name == "amx_int8" ? wbk::GemmEngine::kAmxInt8
                                             : static_cast<wbk::GemmEngine>(-1);
    TORCH_CHECK_VALUE(static_cast<int>(e) >= 0, "set_gemm_engine: engine must be 'auto', 'fma', 'amx_bf16', ",
                      "'avx512_bf16' or 'amx_int8', got '", name, "'");
    std::string why;
    TORCH_CHECK(wbk::set_gemm_engine(e, &why), "set_gemm_engine: ", name, " cannot run here: ", why);
  });
  m.def("gemm_engines", [] {
    py::dict d;
    std::string why;
    const bool amx = wbk::amx_bf16_available(&why);
    d["fma"] = py::make_tuple(true, "fp32 FMA micro-kernel (every build)");
    d["amx_bf16"] = py::make_tuple(amx, why);
    std::string why512;
    const bool dp = wbk::avx512_bf16_available(&why512);
    d["avx512_bf16"] = py::make_tuple(dp, why512);
    std::string why8;
    const bool int8 = wbk::amx_int8_available(&why8);
    d["amx_int8"] = py::make_tuple(int8, int8 ? why8 + ": per-row int8 weights as W8A8 (x quantized per token), "
                                                       "the rest on amx_bf16"
                                              : why8);
    return d;
  });
  m.def("amx_bf16_loop", &wbk::amx_bf16_loop, py::arg("iterations"), py::call_guard<py::gil_scoped_release>());
  m.def("avx512_bf16_loop", &wbk::avx512_bf16_loop, py::arg("iterations"), py::call_guard<py::gil_scoped_release>());
  m.def("amx_int8_loop", &wbk::amx_int8_loop, py::arg("iterations"), py::call_guard<py::gil_scoped_release>());
  m.def("amx_int8_status", [] {
    std::string why;
    const bool ok = wbk::amx_int8_available(&why);
    return py::make_tuple(ok, why);
  });
  // The constants Python needs from this side, so none is copied there by hand.
  m.def("constants", [] {
    py::dict d, weights, parts;
    d["weight_group"] = wbk::kWeightGroup;
    d["tile_max_block_m"] = wbk::kMaxTileBlockM;
    d["tiled_align"] = wbk::kTiledAlign;
    d["int8_kernels"] = std::vector<std::string>(std::begin(wbk::kInt8KernelNames), std::end(wbk::kInt8KernelNames));
    d["tile_tokens"] = wbk::kTileTokens;
    d["v_group_tokens"] = wbk::kVGroupTokens;
    d["matvec_max_rows_default"] = wbk::kMatvecMaxRowsDefault;
    d["gemm_panel_bytes"] = wbk::gemm_panel_bytes();
    d["shm_header_bytes"] = wbk::kShmHeaderBytes;
    py::dict blocks;
    for (int i = 0; i < wbk::kWeightDtypes; ++i) {
      weights[wbk::kWeightDtypeNames[i]] = i;
      const auto g = wbk::block_geometry(static_cast<wbk::WeightDtype>(i));
      if (g.weights) blocks[wbk::kWeightDtypeNames[i]] = py::make_tuple(g.weights, g.bytes);
    }
    d["weight_blocks"] = blocks;  // block kernels: (weights, bytes) of a block
    d["weight_kernels"] = weights;
    py::list names;
    for (const char* n : wbk::kTimerPartNames) names.append(n);
    d["timer_parts"] = names;
    return d;
  });
  m.def("gemm_mr", &wbk::gemm_mr);
  m.def("gemm_nr", &wbk::gemm_nr);
}
