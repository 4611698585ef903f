// Vector loops over one row of fp32 values, shared by the attention kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace wbk {

inline float row_max(const float* x, int64_t n) {
  VecF m = VecF::set1(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + VecF::W <= n; j += VecF::W) m = vmax(m, VecF::load(x + j));
  float r = reduce_max(m);
  for (; j < n; ++j) r = std::max(r, x[j]);
  return r;
}

// x[j] = exp(x[j] * scale - shift) for j < n; returns the sum.
inline float exp_and_sum(float* x, int64_t n, float scale, float shift) {
  const VecF vs = VecF::set1(scale), vshift = VecF::set1(-shift);
  VecF acc = VecF::zero();
  int64_t j = 0;
  for (; j + VecF::W <= n; j += VecF::W) {
    VecF e = vexp(fmadd(VecF::load(x + j), vs, vshift));
    e.store(x + j);
    acc = acc + e;
  }
  if (j < n) {
    int rem = static_cast<int>(n - j);
    VecF e = vexp(fmadd(VecF::load(x + j, rem), vs, vshift));
    e.store(x + j, rem);
    float tail[VecF::W];
    e.store(tail, rem);
    float s = reduce_add(acc);
    for (int i = 0; i < rem; ++i) s += tail[i];
    return s;
  }
  return reduce_add(acc);
}

inline void scale_row(float* x, int64_t n, float f) {
  const VecF vf = VecF::set1(f);
  int64_t j = 0;
  for (; j + VecF::W <= n; j += VecF::W) (VecF::load(x + j) * vf).store(x + j);
  for (; j < n; ++j) x[j] *= f;
}

// x[j] *= y[j] for j < n.
inline void mul_rows(float* x, const float* y, int64_t n) {
  int64_t j = 0;
  for (; j + VecF::W <= n; j += VecF::W) (VecF::load(x + j) * VecF::load(y + j)).store(x + j);
  for (; j < n; ++j) x[j] *= y[j];
}

// x[j] *= y[j] * f for j < n.
inline void mul_rows_scaled(float* x, const float* y, float f, int64_t n) {
  const VecF vf = VecF::set1(f);
  int64_t j = 0;
  for (; j + VecF::W <= n; j += VecF::W) (VecF::load(x + j) * VecF::load(y + j) * vf).store(x + j);
  for (; j < n; ++j) x[j] *= y[j] * f;
}

}  // namespace wbk
