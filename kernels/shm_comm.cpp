// Shared-memory collectives between the ranks of one host (what xFasterTransformer and
// DeepSpeed's CPU inference use between the sockets of a machine): no sockets, no copies
// through the kernel, two flag barriers per collective.
//
// Segment layout (created by Python in /dev/shm and mapped by every rank, shm_comm.h):
//   [0, 4096)                      header: one arrival counter per rank, each on its own
//                                  64-byte line (std::atomic<int64_t>: lock-free, so it
//                                  works across processes)
//   slot r, r in [0, R)            `capacity` bytes: rank r's contribution
//   result slot                    `capacity` bytes: the reduced (or broadcast) data
//   handoff header                 one counter per rank: how many handoffs it has put
//   handoff slot r, r in [0, R)    `capacity` bytes: rank r's latest handoff
//
// all_reduce (sum of n floats): rank r's data is in slot r (copied there, or written there
//   by the kernel that produced it: zero copy); barrier; rank r sums its slice of every
//   slot into the result slot (a reduce-scatter); barrier; each rank copies the result
//   into its output (an all-gather from the one result slot).
// broadcast: the root copies into the result slot; barrier; the others copy out; barrier.
// all_gather: slot r <- rank r's bytes; barrier; out <- all slots; barrier.
// The second barrier of each keeps any rank from overwriting a slot another still reads.
// handoff (the fused step's shared KV head, decode_step.cpp): rank r copies into handoff slot
//   r and counts it; the rank that takes it waits for the count and copies out. One-sided.
//
// Barriers count: every rank's counter holds the number of barriers it has passed; barrier
// number `seq` waits until every counter is >= seq (acquire), after storing seq (release).
// The caller numbers them (shm_comm.py), so no state lives here. A rank that does not
// arrive within `timeout_s` (dead, or stuck) raises an error naming the missing ranks.
//
// Each collective returns the seconds this rank spent in its first barrier: waiting for the
// other ranks to arrive with their data. That is not the collective's own cost but the
// ranks' imbalance (a rank with less work before the collective waits there for the others);
// the rest of the call (the reduction, the second barrier, the copies) is its own cost.
#include "shm_comm.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define WBK_PAUSE() _mm_pause()
#else
#define WBK_PAUSE() ((void)0)
#endif

namespace wbk {
namespace {

using Counter = std::atomic<int64_t>;
static_assert(Counter::is_always_lock_free, "shared-memory barriers need lock-free 64-bit atomics");

Counter* counter(uint8_t* seg, int rank) { return reinterpret_cast<Counter*>(seg + kShmLine * rank); }

uint8_t* slot(const ShmArgs& a, int r) { return a.seg + kShmHeaderBytes + static_cast<int64_t>(r) * a.capacity; }

uint8_t* result_slot(const ShmArgs& a) { return slot(a, a.world); }

// The handoff's counters and slots, after the result slot (shm_comm.h).
uint8_t* handoff_header(const ShmArgs& a) { return result_slot(a) + a.capacity; }

uint8_t* handoff_slot(const ShmArgs& a, int r) { return handoff_header(a) + kShmHeaderBytes + r * a.capacity; }

using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Spins until c holds at least seq, then yields between looks (more ranks than free cores: let
// the one we wait for run); past timeout_s, raises the error `late(waited seconds)` words.
template <class Late>
void wait_until(const ShmArgs& a, const Counter* c, int64_t seq, Clock::time_point start, Late late) {
  int64_t spins = 0;
  while (c->load(std::memory_order_acquire) < seq) {
    if (++spins < 2000) {
      WBK_PAUSE();
      continue;
    }
    sched_yield();
    if ((spins & 255) == 0) {
      const double waited = since(start);
      if (waited > a.timeout_s) throw CollectiveError(late(static_cast<int>(waited)));
    }
  }
}

// Returns the seconds it waited.
double barrier(const ShmArgs& a, int64_t seq) {
  counter(a.seg, a.rank)->store(seq, std::memory_order_release);
  const auto start = Clock::now();
  for (int r = 0; r < a.world; ++r) {
    wait_until(a, counter(a.seg, r), seq, start, [&](int waited) {
      std::string missing;
      for (int j = 0; j < a.world; ++j)
        if (counter(a.seg, j)->load(std::memory_order_acquire) < seq)
          missing += (missing.empty() ? "" : ", ") + std::to_string(j);
      return "shm collective: rank " + std::to_string(a.rank) + " waited " + std::to_string(waited) +
             " s for rank(s) " + missing + " (barrier " + std::to_string(seq) + "); a rank died or is stuck";
    });
  }
  return since(start);
}

}  // namespace

double shm_all_reduce_sum(const ShmArgs& a, float* data, int64_t n, int64_t seq) {
  float* mine = reinterpret_cast<float*>(slot(a, a.rank));
  if (data != mine) std::memcpy(mine, data, n * sizeof(float));  // zero copy: the producer wrote it here
  const double waited = barrier(a, seq);
  // Reduce-scatter: this rank sums its slice of every slot, in rank order (the same sum on
  // every rank, so results are bitwise identical across ranks).
  const int64_t per = (n + a.world - 1) / a.world;
  const int64_t lo = std::min<int64_t>(n, per * a.rank), hi = std::min<int64_t>(n, lo + per);
  float* out = reinterpret_cast<float*>(result_slot(a));
  const float* src[kShmMaxRanks];
  for (int r = 0; r < a.world; ++r) src[r] = reinterpret_cast<const float*>(slot(a, r));
  if (a.world == 2) {
    for (int64_t i = lo; i < hi; ++i) out[i] = src[0][i] + src[1][i];
  } else {
    for (int64_t i = lo; i < hi; ++i) out[i] = src[0][i];
    for (int r = 1; r < a.world; ++r)
      for (int64_t i = lo; i < hi; ++i) out[i] += src[r][i];
  }
  barrier(a, seq + 1);
  std::memcpy(data, out, n * sizeof(float));
  return waited;
}

double shm_broadcast(const ShmArgs& a, void* data, int64_t bytes, int root, int64_t seq) {
  if (a.rank == root) std::memcpy(result_slot(a), data, bytes);
  const double waited = barrier(a, seq);
  if (a.rank != root) std::memcpy(data, result_slot(a), bytes);
  barrier(a, seq + 1);
  return waited;
}

double shm_all_gather(const ShmArgs& a, const void* data, int64_t bytes, void* out, int64_t seq) {
  std::memcpy(slot(a, a.rank), data, bytes);
  const double waited = barrier(a, seq);
  for (int r = 0; r < a.world; ++r) std::memcpy(static_cast<uint8_t*>(out) + r * bytes, slot(a, r), bytes);
  barrier(a, seq + 1);
  return waited;
}

// The handoff needs no barrier. Rank r writes its slot again only for the next layer, after
// the all-reduce that ends this layer's attention; the rank that gets from it enters that
// all-reduce only after its get, so a slot is never rewritten before it has been read.
void shm_put(const ShmArgs& a, const float* data, int64_t n, int64_t count) {
  std::memcpy(handoff_slot(a, a.rank), data, n * sizeof(float));
  counter(handoff_header(a), a.rank)->store(count, std::memory_order_release);
}

double shm_get(const ShmArgs& a, int from, float* data, int64_t n, int64_t count) {
  const auto start = Clock::now();
  wait_until(a, counter(handoff_header(a), from), count, start, [&](int waited) {
    return "shm handoff: rank " + std::to_string(a.rank) + " waited " + std::to_string(waited) + " s for rank " +
           std::to_string(from) + "'s KV head (handoff " + std::to_string(count) + "); a rank died or is stuck";
  });
  const double waited = since(start);
  std::memcpy(data, handoff_slot(a, from), n * sizeof(float));
  return waited;
}

}  // namespace wbk
