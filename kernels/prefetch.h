// Software prefetch of the rows a streaming kernel will read next, with the distance and
// the hint chosen per host at run time (workbench/hw/prefetch.py times decode attention
// with each candidate and sets the fastest): on one Xeon host prefetchnta 4 KB ahead halved a
// stream's bandwidth while prefetcht0 1 KB ahead gained 10%; on the AMD hosts the first
// was the better one. A constant tuned on one machine is wrong on the other.
#pragma once

#include <cstdint>

namespace wbk {

struct PrefetchConfig {
  int64_t bytes = 4096;  // how far ahead of the row being read; 0 = no software prefetch
  int hint = 0;          // 0 prefetchnta, 1 prefetcht2, 2 prefetcht1, 3 prefetcht0
};

inline PrefetchConfig g_prefetch;  // set by set_prefetch (bindings), read by the kernels

inline void prefetch_bytes(const void* p, int64_t bytes, int hint) {
  const char* c = static_cast<const char*>(p);
  switch (hint) {  // __builtin_prefetch needs its locality as a constant
    case 3:
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
      break;
    case 2:
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
      break;
    case 1:
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
      break;
    default:
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 0);
  }
}

}  // namespace wbk
