// Shared-memory collectives between processes of one host (shm_comm.cpp has the layout
// and the algorithm). Raw pointers, no argument checks: bindings.cpp validates.
#pragma once

#include <cstdint>
#include <stdexcept>

namespace wbk {

constexpr int kShmMaxRanks = 64;
constexpr int64_t kShmLine = 64;  // one arrival counter per cache line
constexpr int64_t kShmHeaderBytes = kShmLine * kShmMaxRanks;

struct ShmArgs {
  uint8_t* seg;      // the mapped segment: header, world input slots, one result slot
  int rank, world;
  int64_t capacity;  // bytes per slot
  double timeout_s;  // how long a barrier waits for the others before it raises
};

// A rank did not arrive at a barrier in time (dead or stuck): Python sees it as
// CollectiveError, a RuntimeError, wherever the collective was called from.
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Segment bytes for `world` ranks with slots of `capacity` bytes: the collectives' header and
// slots, then the handoff's (a second header of one counter per rank, one slot per rank).
inline int64_t shm_segment_bytes(int world, int64_t capacity) {
  return 2 * kShmHeaderBytes + (2 * world + 1) * capacity;
}

// Each uses barriers seq and seq + 1, and returns the seconds this rank waited at the first
// for the others to arrive (shm_comm.cpp).
double shm_all_reduce_sum(const ShmArgs& a, float* data, int64_t n, int64_t seq);
double shm_broadcast(const ShmArgs& a, void* data, int64_t bytes, int root, int64_t seq);
double shm_all_gather(const ShmArgs& a, const void* data, int64_t bytes, void* out, int64_t seq);

// The one-sided handoff (no barrier): shm_put copies n floats into this rank's handoff slot and
// then marks it as its `count`-th put; shm_get waits until rank `from` has made its `count`-th
// put, copies its n floats out, and returns the seconds it waited.
void shm_put(const ShmArgs& a, const float* data, int64_t n, int64_t count);
double shm_get(const ShmArgs& a, int from, float* data, int64_t n, int64_t count);

}  // namespace wbk
