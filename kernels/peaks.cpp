// Probes of the machine's peaks, the yardsticks every benchmark result is divided by:
// fp32 FMA throughput (independent FMA chains in registers) and memory bandwidth
// (a STREAM-style triad and a read-only sum over arrays far larger than the caches).
#include <vector>

#include "gemm.h"
#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace wbk {

double fma_loop(int64_t iterations) {
  // 12 independent accumulators cover the FMA latency x issue width of current cores.
  constexpr int kChains = 12;
  const int threads = at::get_num_threads();
  std::vector<float> sink(threads, 0.0f);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      VecF acc[kChains];
      for (int c = 0; c < kChains; ++c) acc[c] = VecF::set1(static_cast<float>(c) * 1e-3f);
      const VecF x = VecF::set1(0.999999f), y = VecF::set1(1e-7f);
      for (int64_t i = 0; i < iterations; ++i)
        for (int c = 0; c < kChains; ++c) acc[c] = fmadd(acc[c], x, y);
      VecF total = VecF::zero();
      for (int c = 0; c < kChains; ++c) total = total + acc[c];
      sink[t] = reduce_add(total);
    }
  });
  volatile float keep = sink[0];
  (void)keep;
  return 2.0 * kChains * VecF::W * static_cast<double>(iterations) * threads;
}

void triad(float* a, const float* b, const float* c, float s, int64_t n) {
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    const VecF vs = VecF::set1(s);
    int64_t i = begin;
    for (; i + VecF::W <= end; i += VecF::W) fmadd(vs, VecF::load(c + i), VecF::load(b + i)).store(a + i);
    for (; i < end; ++i) a[i] = b[i] + s * c[i];
  });
}

double read_sum(const float* x, int64_t n) {
  const int threads = at::get_num_threads();
  std::vector<double> partial(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
      VecF acc[4] = {VecF::zero(), VecF::zero(), VecF::zero(), VecF::zero()};
      int64_t i = lo;
      for (; i + 4 * VecF::W <= hi; i += 4 * VecF::W)
        for (int k = 0; k < 4; ++k) acc[k] = acc[k] + VecF::load(x + i + k * VecF::W);
      double s = reduce_add(acc[0] + acc[1] + acc[2] + acc[3]);
      for (; i < hi; ++i) s += x[i];
      partial[t] = s;
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

const char* isa() { return kIsa; }
int gemm_mr() { return kGemmMR; }
int gemm_nr() { return kGemmNR; }

}  // namespace wbk
