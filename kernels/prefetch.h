// Software prefetch of the rows a streaming kernel will read next, with the distance and
// the hint chosen per host at run time (workbench/hw/prefetch.py times decode attention
// with each candidate and sets the fastest): on one Xeon host prefetchnta 4 KB ahead halved a
// stream's bandwidth while prefetcht0 1 KB ahead gained 10%; on the AMD hosts the first
// was the better one. A constant tuned on one machine is wrong on the other.
#pragma once

#include <cstdint>
#include <type_traits>

namespace wbk {

struct PrefetchConfig {
  int64_t bytes = 4096;  // how far ahead of the row being read; 0 = no software prefetch
  int hint = 0;          // 0 prefetchnta, 1 prefetcht2, 2 prefetcht1, 3 prefetcht0
  // The tiled int8 kernel (decode_tiled.cpp): its prefetches run on past the end of a task's
  // K and V into the next task's, instead of stopping there. Measured per host like the rest
  // (where it was measured, it changed little either way).
  bool pipeline = false;
};

inline PrefetchConfig g_prefetch;  // set by set_prefetch (bindings), read by the attention kernels

// The matrix-vector kernel's own (linear.cpp), one per weight element type, each measured
// per host with that kernel at small K (workbench/hw/prefetch.py): W rows about `bytes`
// ahead, for row chunks of at most `max_chunk_bytes` (longer chunks are one long stream each,
// which the hardware prefetcher follows by itself on the hosts measured so far). Per type
// because the best choice differs with the arithmetic per byte: fp32 rows, the least work per
// byte, can stream fastest with no software prefetch while bf16 and int8 rows gain from it.
// The same probe chooses the order the kernel reads a task's rows in at one row of x: row
// chunks of at most `serial_max_chunk_bytes` one row after another (one ascending stream),
// longer ones four rows side by side (0: always side by side).
// The defaults stand until a host's own probe has run.
struct MatvecPrefetch {
  int64_t bytes = 8192;
  int hint = 3;
  int64_t max_chunk_bytes = 3072;
  int64_t serial_max_chunk_bytes = 0;
};
enum MatvecWeights { kMatvecF32, kMatvecBF16, kMatvecInt8, kMatvecKinds };
inline MatvecPrefetch g_matvec_prefetch[kMatvecKinds];

// One cache line's prefetch with the hint as a constant. On x86 as inline asm: GCC 12 dropped
// every __builtin_prefetch inside a switch over the hint (measured: the decode kernels'
// object code had no prefetch instruction at all, so the per-host choice changed nothing),
// and an asm statement can be neither merged nor removed.
template <int Hint>
inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  if constexpr (Hint == 3) {
    asm volatile("prefetcht0 %0" : : "m"(*p));
  } else if constexpr (Hint == 2) {
    asm volatile("prefetcht1 %0" : : "m"(*p));
  } else if constexpr (Hint == 1) {
    asm volatile("prefetcht2 %0" : : "m"(*p));
  } else {
    asm volatile("prefetchnta %0" : : "m"(*p));
  }
#else
  __builtin_prefetch(p, 0, Hint);
#endif
}

// Every line of [p, p + bytes) with the hint as a constant.
template <int Hint>
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) prefetch_line<Hint>(c + off);
}

// f(std::integral_constant<int, hint>{}): a hot loop compiled once per hint, so it carries
// no switch over the hint per line (in the tiled int8 kernel's K loop at Llama-2-7B shapes
// the switch had been 6 of ~14 instructions per 64-byte line).
template <typename F>
decltype(auto) with_hint(int hint, F&& f) {
  switch (hint) {
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 1:
      return f(std::integral_constant<int, 1>{});
    default:
      return f(std::integral_constant<int, 0>{});
  }
}

inline void prefetch_bytes(const void* p, int64_t bytes, int hint) {
  with_hint(hint, [&](auto h) { prefetch_span<decltype(h)::value>(p, bytes); });
}

}  // namespace wbk
