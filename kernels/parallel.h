// Dynamic task scheduling on the torch intra-op thread pool.
//
// at::parallel_for hands each thread one contiguous range, which balances badly
// when task costs differ (causal prefill, ragged decode lengths). Here every
// thread of the pool pulls task indices from one atomic counter until none are
// left; callers order tasks from most to least expensive so the tail is short.
// `torch.set_num_threads` governs how many threads take part.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace wbk {

// Per-thread scratch floats that live as long as the thread (torch's pool threads are
// reused from call to call), so a kernel call does not allocate, page-fault and free
// megabytes of buffers each time. Deliberately uninitialised: every kernel writes a
// buffer before reading it. `slot` keeps the buffers of one worker apart; a buffer only
// grows, to the largest size any call on this thread asked for.
class Scratch {
 public:
  Scratch(int slot, int64_t n) {
    thread_local std::unique_ptr<float[]> buffers[kSlots];
    thread_local int64_t sizes[kSlots] = {};
    n = std::max<int64_t>(n, 1);
    if (sizes[slot] < n) {
      buffers[slot].reset(new float[static_cast<size_t>(n)]);
      sizes[slot] = n;
    }
    p_ = buffers[slot].get();
  }
  float* data() { return p_; }
  float& operator[](int64_t i) { return p_[i]; }

  static constexpr int kSlots = 6;

 private:
  float* p_;
};

// make_worker() is called once per participating thread and returns a callable
// `worker(task_index)` that may own per-thread scratch buffers.
template <typename MakeWorker>
void run_tasks(int64_t num_tasks, MakeWorker&& make_worker) {
  if (num_tasks <= 0) return;
  std::atomic<int64_t> next{0};
  int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto worker = make_worker();
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < num_tasks;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      worker(t);
    }
  });
}

// run_tasks for workers that look one task ahead: worker(task, next) also gets the task this
// thread runs after it (-1: none left), claimed before `task` starts, so the worker can
// prefetch the next task's data while it finishes this one (decode_tiled.cpp).
template <typename MakeWorker>
void run_tasks_ahead(int64_t num_tasks, MakeWorker&& make_worker) {
  if (num_tasks <= 0) return;
  std::atomic<int64_t> next{0};
  int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto worker = make_worker();
    int64_t t = next.fetch_add(1, std::memory_order_relaxed);
    while (t < num_tasks) {
      const int64_t after = next.fetch_add(1, std::memory_order_relaxed);
      worker(t, after < num_tasks ? after : int64_t{-1});
      t = after;
    }
  });
}

}  // namespace wbk
