// Seeded random weights for the presets' random models, counter-based.
//
// Element i of stream `stream` under `seed` is a function of (seed, stream, i) alone, so a
// tensor fills on every thread at once with the same values whatever the thread count, and
// each tensor of a model is its own stream (no generator state carried from one to the next).
//
// The values are approximately normal: the sum of four 16-bit uniforms taken from one 64-bit
// hash (Irwin-Hall with n = 4), centred and scaled to unit variance, then times `std`. They are
// bounded by 2 sqrt(3) std, which random weights never miss; what a random model is for (the
// shapes, the bytes, the kernels' speed and the agreement of two ways of computing the same
// thing) does not depend on the tails. torch's normal_ with a seeded generator runs on one thread
// at about a tenth of the speed, which made a 7B random model take a minute to create.
#include <cstring>

#include "kernels.h"

#include <ATen/Parallel.h>

namespace wbk {
namespace {

inline uint64_t mix64(uint64_t z) {  // splitmix64's finaliser: a bijection that scatters every bit
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// Four uniforms (k + 1/2) / 2^16 sum to (s + 2) / 2^16 with mean 2 and variance 4 (1 - 2^-32) / 12.
inline float unit_normal(uint64_t key, uint64_t i) {
  const uint64_t h = mix64(key + kGolden * (i + 1));
  const uint32_t s = static_cast<uint32_t>((h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48));
  constexpr float kSqrt3 = 1.7320508075688772f;
  return ((static_cast<float>(s) + 2.0f) * (1.0f / 65536.0f) - 2.0f) * kSqrt3;
}

inline uint16_t to_bf16(float f) {  // round to nearest even (the values are finite)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename Out, typename Store>
void fill(Out* out, int64_t n, uint64_t seed, uint64_t stream, float std, Store store) {
  const uint64_t key = mix64(seed ^ mix64(stream + kGolden));
  at::parallel_for(0, n, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = store(unit_normal(key, static_cast<uint64_t>(i)) * std);
  });
}

}  // namespace

void fill_normal_f32(float* out, int64_t n, uint64_t seed, uint64_t stream, float std) {
  fill(out, n, seed, stream, std, [](float v) { return v; });
}

void fill_normal_bf16(uint16_t* out, int64_t n, uint64_t seed, uint64_t stream, float std) {
  fill(out, n, seed, stream, std, to_bf16);
}

}  // namespace wbk
