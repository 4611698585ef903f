// The data caches' sizes as the OS reports them (glibc's sysconf), read once, for the kernels'
// block sizes. Python reads the same facts from sysfs (workbench/hw/machine.py) for what it
// decides; these are for what the C++ decides on its own.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

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

// The L3's bytes per CPU that shares it, from sysfs (glibc's sysconf can report a whole
// package's L3 where a core shares only its complex's); 0 where the OS does not say.
inline int64_t l3_bytes_per_cpu() {
  static const int64_t bytes = [] {
    for (int i = 0; i < 8; ++i) {
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
      int level = 0;
      if (!(std::ifstream(dir + "level") >> level) || level != 3) continue;
      std::string size, cpus;
      if (!(std::ifstream(dir + "size") >> size) || !(std::ifstream(dir + "shared_cpu_list") >> cpus)) return int64_t{0};
      int64_t kb = std::atoll(size.c_str()), count = 0;  // "32768K"
      if (size.back() == 'M') kb <<= 10;
      for (size_t at = 0; at < cpus.size();) {  // "0-7,16-23"
        const size_t end = std::min(cpus.find(',', at), cpus.size());
        const std::string range = cpus.substr(at, end - at);
        const size_t dash = range.find('-');
        count += dash == std::string::npos ? 1 : std::atoll(range.c_str() + dash + 1) - std::atoll(range.c_str()) + 1;
        at = end + 1;
      }
      return count > 0 ? (kb << 10) / count : int64_t{0};
    }
    return int64_t{0};
  }();
  return bytes;
}

}  // namespace wbk
