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

namespace wbk {

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

}  // namespace wbk
