// The data caches' sizes as the OS reports them (glibc's sysconf), read once, for the kernels'
// block sizes. Python reads the same facts from sysfs (workbench/hw/machine.py) for what it
// decides; these are for what the C++ decides on its own.
#pragma once

#include <unistd.h>

#include <cstdint>

namespace wbk {

// L1d bytes; 32 KB where the OS does not say (the smallest L1d of a core with AVX2 or AVX-512).
inline int64_t l1d_bytes() {
  static const int64_t bytes = [] {
    const long size = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return size > 0 ? static_cast<int64_t>(size) : int64_t{32} << 10;
  }();
  return bytes;
}

// The bytes of one L1d way (size / associativity): addresses this far apart map to the same
// set. 4 KB where the OS does not say (every x86 core with AVX2 or AVX-512 so far).
inline int64_t l1_way_bytes() {
  static const int64_t bytes = [] {
    const long ways = sysconf(_SC_LEVEL1_DCACHE_ASSOC);
    return ways > 0 && l1d_bytes() % ways == 0 ? l1d_bytes() / ways : int64_t{4096};
  }();
  return bytes;
}

// One core's L2 bytes; 1 MB where the OS does not say (as workbench/hw/machine.py assumes).
inline int64_t l2_bytes() {
  static const int64_t bytes = [] {
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return size > 0 ? static_cast<int64_t>(size) : int64_t{1} << 20;
  }();
  return bytes;
}

}  // namespace wbk
