// oneCCL collectives for the tensor-parallel runs (backend "ccl"), through oneCCL's v1 C++
// API (oneapi/ccl.hpp) from the oneccl-cpu wheels. A separate extension from the kernels:
// it is built only when the ccl extra is installed (workbench/distributed/ccl.py links it
// against the wheel's libccl.so.1), so the kernels never depend on oneCCL.
//
// One communicator per process (an engine is one rank):
//   rank 0: main_kvs_address() creates the key-value store the ranks meet at and returns
//           its address (256 bytes, e.g. "127.0.0.1_4096..."), which the client hands to
//           the others out of band (through ipyparallel);
//   all:    connect(rank, world, address) creates the communicator (collective);
//   then    all_reduce (fp32 sum, in place), broadcast (bytes, in place), all_gather;
//           step_collective(): the address of this process's StepCollective (kernels.h), the
//           all-reduce the fused decode step calls natively between its kernels (the kernels'
//           ForeignCollective wraps it).
// oneCCL errors become Python RuntimeErrors naming the call. oneCCL has no timeout of its
// own: a dead rank is detected by the client (workbench.distributed.cluster), which stops
// the engines.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h or torch/python.h: see bindings.cpp

#include <cstring>
#include <memory>
#include <oneapi/ccl.hpp>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels.h"  // wbk::StepCollective: the kernels' extension calls ours through it

namespace {

using at::Tensor;

struct State {
  bool initialised = false;
  std::shared_ptr<ccl::kvs> kvs;
  std::unique_ptr<ccl::communicator> comm;
  int rank = -1, world = 0;
  int generation = 0;  // communicators connected so far: the step's cached operations are per communicator
  std::unordered_map<int64_t, ccl::allreduce_attr> step_attrs;  // this communicator's, by element count
};

State& state() {
  static State s;
  return s;
}

template <typename F>
void guarded(const char* what, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("oneCCL ") + what + " failed: " + e.what());
  }
}

void init_once() {
  if (!state().initialised) {
    guarded("init", [] { ccl::init(); });
    state().initialised = true;
  }
}

py::bytes main_kvs_address() {
  init_once();
  ccl::kvs::address_type address;
  guarded("create_main_kvs", [&] {
    state().kvs = ccl::create_main_kvs();
    address = state().kvs->get_address();
  });
  return py::bytes(address.data(), address.size());
}

void connect(int64_t rank, int64_t world, const std::string& address) {
  init_once();
  TORCH_CHECK_VALUE(world >= 1 && rank >= 0 && rank < world, "ccl connect: rank must be in 0..", world - 1,
                    ", got ", rank);
  ccl::kvs::address_type addr{};
  TORCH_CHECK_VALUE(address.size() == addr.size(), "ccl connect: the KVS address must be ", addr.size(),
                    " bytes, got ", address.size());
  std::memcpy(addr.data(), address.data(), addr.size());
  py::gil_scoped_release release;  // collective: every rank waits here for the others
  guarded("create_communicator", [&] {
    if (rank != 0 || !state().kvs) state().kvs = ccl::create_kvs(addr);
    state().comm = std::make_unique<ccl::communicator>(ccl::create_communicator(world, rank, state().kvs));
  });
  state().rank = static_cast<int>(rank);
  state().world = static_cast<int>(world);
  state().generation++;
  state().step_attrs.clear();
}

ccl::communicator& comm(const char* fn) {
  TORCH_CHECK(state().comm != nullptr, fn, ": not connected (call connect first)");
  return *state().comm;
}

void check_data(const Tensor& t, const char* fn) {
  TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu() && t.is_contiguous(), fn,
                    ": data must be a contiguous CPU tensor");
}

void all_reduce(Tensor& t) {
  const char* fn = "ccl all_reduce";
  check_data(t, fn);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, fn, ": data must be float32, got ", t.scalar_type());
  auto& c = comm(fn);
  py::gil_scoped_release release;
  guarded("allreduce", [&] {
    ccl::allreduce(t.data_ptr<float>(), t.data_ptr<float>(), t.numel(), ccl::reduction::sum, c).wait();
  });
}

void broadcast(Tensor& t, int64_t root) {
  const char* fn = "ccl broadcast";
  check_data(t, fn);
  auto& c = comm(fn);
  TORCH_CHECK_VALUE(root >= 0 && root < state().world, fn, ": root must be in 0..", state().world - 1);
  py::gil_scoped_release release;
  guarded("broadcast", [&] {
    ccl::broadcast(static_cast<uint8_t*>(t.data_ptr()), t.nbytes(), static_cast<int>(root), c).wait();
  });
}

void all_gather(const Tensor& t, Tensor& out) {
  const char* fn = "ccl all_gather";
  check_data(t, fn);
  check_data(out, fn);
  TORCH_CHECK_VALUE(out.nbytes() == t.nbytes() * state().world, fn, ": out must hold world x data's bytes");
  auto& c = comm(fn);
  std::vector<size_t> counts(state().world, t.nbytes());
  py::gil_scoped_release release;
  guarded("allgatherv", [&] {
    ccl::allgatherv(static_cast<const uint8_t*>(t.data_ptr()), t.nbytes(), static_cast<uint8_t*>(out.data_ptr()),
                    counts, c)
        .wait();
  });
}

// The fused step's all-reduce: oneCCL's, in place; no buffer of its own (the step reduces its
// own). Errors propagate as C++ exceptions through the step to its Python caller.
//
// The step makes the same all-reduce (batch x hidden floats) twice a layer, every token, so
// it asks oneCCL to cache the operation (its "persistent" collectives: to_cache with a
// match_id): oneCCL then builds the operation's schedule once and reuses it, where each
// uncached call builds and frees one. oneCCL finds a cached operation by its match_id alone
// (not by its communicator or size) and takes the buffers of each call, so the id names the
// communicator and the element count: every rank makes the same calls with the same counts,
// and so the same ids. (The Python path's collectives, whose sizes follow the prompt, stay
// uncached.)
class StepAllReduce : public wbk::StepCollective {
 public:
  float* buffer(int64_t) override { return nullptr; }
  void all_reduce(float* data, int64_t n) override {
    auto& c = comm("ccl step all_reduce");
    guarded("allreduce", [&] { ccl::allreduce(data, data, n, ccl::reduction::sum, c, cached(n)).wait(); });
  }

 private:
  static const ccl::allreduce_attr& cached(int64_t n) {
    auto& attrs = state().step_attrs;  // cleared by connect(): a new communicator, new ids
    auto found = attrs.find(n);
    if (found == attrs.end()) {
      auto attr = ccl::create_operation_attr<ccl::allreduce_attr>();
      attr.set<ccl::operation_attr_id::to_cache>(true);
      attr.set<ccl::operation_attr_id::match_id>(ccl::string_class(
          "workbench-step-allreduce-" + std::to_string(state().generation) + "-" + std::to_string(n)));
      found = attrs.emplace(n, std::move(attr)).first;
    }
    return found->second;
  }
};

uintptr_t step_collective() {
  static StepAllReduce collective;
  comm("ccl step_collective");  // connected first
  return reinterpret_cast<uintptr_t>(static_cast<wbk::StepCollective*>(&collective));
}

void disconnect() {
  state().comm.reset();
  state().kvs.reset();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "oneCCL collectives for workbench.distributed (backend 'ccl')";
  m.def("main_kvs_address", &main_kvs_address);
  m.def("connect", &connect, py::arg("rank"), py::arg("world"), py::arg("address"));
  m.def("all_reduce", &all_reduce);
  m.def("broadcast", &broadcast);
  m.def("all_gather", &all_gather);
  m.def("step_collective", &step_collective);
  m.def("disconnect", &disconnect);
}
