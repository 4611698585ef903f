// SIMD building blocks shared by every kernel in this folder.
//
// One vector type, `VecF` (W fp32 lanes), with the handful of operations the
// attention kernels need: loads that widen int8 / fp16 / bf16 to fp32 in
// registers, FMA, reductions and a polynomial exp. The instruction set is chosen
// at compile time from the compiler's target macros:
//
//   AVX-512 (F+BW+VL)  W = 16, masked tails
//   AVX2 + FMA + F16C  W = 8,  masked tails via maskload / scalar tails
//   scalar             W = 1,  the portable fallback (any CPU)
//
// The kernels are written once against this interface, so the three builds run
// the same algorithm; the tests build and run each path that the host can execute.
// The test build "emulated" (WBK_EMULATE_ISA) takes the AVX-512 path with its instructions
// written out in C++ (emulate_isa.h), so that path runs, slowly, on an AVX2 host too.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace wbk {

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || defined(WBK_EMULATE_ISA)
#define WBK_ISA_AVX512 1
inline constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define WBK_ISA_AVX2 1
inline constexpr const char* kIsa = "avx2";
#else
#define WBK_ISA_SCALAR 1
inline constexpr const char* kIsa = "scalar";
#endif

// Scalar conversions, used by the tails of every path and by the scalar path.
inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float half_to_float(uint16_t h) {
  // IEEE binary16 -> binary32, including subnormals, inf and NaN.
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      u = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// half_to_float with the F16C instruction where the build has it (the block kernels' scales).
inline float half_to_float_fast(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

#if defined(WBK_ISA_AVX512)

struct VecF {
  static constexpr int W = 16;
  __m512 v;

  static inline __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static inline VecF zero() { return {_mm512_setzero_ps()}; }
  static inline VecF set1(float x) { return {_mm512_set1_ps(x)}; }
  static inline VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static inline VecF load(const float* p, int n) { return {_mm512_maskz_loadu_ps(mask(n), p)}; }
  static inline VecF load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static inline VecF load(const int8_t* p, int n) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask(n), p)))};
  }
  static inline VecF load_f16(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static inline VecF load_f16(const uint16_t* p, int n) {
    return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p))};
  }
  static inline VecF load_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static inline VecF load_bf16(const uint16_t* p, int n) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask(n), p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  // 2W bf16 values in one load, widened in place: even = p[0], p[2], ...; odd = p[1], p[3], ...
  // (a shift and a mask per vector, no cross-lane widening).
  static inline void load_bf16_pairs(const uint16_t* p, VecF& even, VecF& odd) {
    const __m512i w = _mm512_loadu_si512(p);
    even = {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
    odd = {_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  inline void store(float* p) const { _mm512_storeu_ps(p, v); }
  inline void store(float* p, int n) const { _mm512_mask_storeu_ps(p, mask(n), v); }
};

// Upper 8 lanes, with AVX512F alone (_mm512_extractf32x8_ps needs DQ, and GCC 12's
// extract intrinsics warn about an uninitialised temporary).
inline __m256 hi256(VecF a) {
  return _mm512_castps512_ps256(_mm512_shuffle_f32x4(a.v, a.v, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VecF fmadd(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF vmax(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
inline VecF vabs(VecF a) { return {_mm512_abs_ps(a.v)}; }
inline float reduce_add(VecF a) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v), hi256(a));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(VecF a) {
  __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a.v), hi256(a));
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VecF round_nearest(VecF a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline VecF exp2_int(VecF n) {  // 2^n for integral n in [-126, 127]
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
  return {_mm512_castsi512_ps(e)};
}
// Sums of four vectors, returned as four floats (out[i] = reduce_add(x_i)).
inline void reduce_add4(VecF a, VecF b, VecF c, VecF d, float* out) {
  __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a.v), hi256(a));
  __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b.v), hi256(b));
  __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c.v), hi256(c));
  __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d.v), hi256(d));
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
// Store W floats as int8 after rounding to nearest (values already in [-127, 127]).
inline void store_i8(int8_t* p, VecF a, int n) {
  __m128i q = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(a.v));
  _mm_mask_storeu_epi8(p, VecF::mask(n), q);
}

#elif defined(WBK_ISA_AVX2)

struct VecF {
  static constexpr int W = 8;
  __m256 v;

  static inline __m256i mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static inline VecF zero() { return {_mm256_setzero_ps()}; }
  static inline VecF set1(float x) { return {_mm256_set1_ps(x)}; }
  static inline VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static inline VecF load(const float* p, int n) { return {_mm256_maskload_ps(p, mask(n))}; }
  static inline VecF load(const int8_t* p) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))};
  }
  static inline VecF load(const int8_t* p, int n) {
    alignas(16) int8_t tmp[16] = {0};
    std::memcpy(tmp, p, n);
    return load(tmp);
  }
  static inline VecF load_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static inline VecF load_f16(const uint16_t* p, int n) {
    alignas(16) uint16_t tmp[8] = {0};
    std::memcpy(tmp, p, n * sizeof(uint16_t));
    return load_f16(tmp);
  }
  static inline VecF load_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  static inline VecF load_bf16(const uint16_t* p, int n) {
    alignas(16) uint16_t tmp[8] = {0};
    std::memcpy(tmp, p, n * sizeof(uint16_t));
    return load_bf16(tmp);
  }
  static inline void load_bf16_pairs(const uint16_t* p, VecF& even, VecF& odd) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
    odd = {_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
  inline void store(float* p) const { _mm256_storeu_ps(p, v); }
  inline void store(float* p, int n) const { _mm256_maskstore_ps(p, mask(n), v); }
};

inline VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VecF fmadd(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF vmax(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
inline VecF vabs(VecF a) {
  return {_mm256_and_ps(a.v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)))};
}
inline float reduce_add(VecF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(VecF a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VecF round_nearest(VecF a) {
  return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline VecF exp2_int(VecF n) {
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_castsi256_ps(e)};
}
inline void reduce_add4(VecF a, VecF b, VecF c, VecF d, float* out) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a.v, b.v), _mm256_hadd_ps(c.v, d.v));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
inline void store_i8(int8_t* p, VecF a, int n) {
  __m256i i = _mm256_cvtps_epi32(a.v);
  __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  __m128i b = _mm_packs_epi16(w, w);
  alignas(16) int8_t tmp[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), b);
  std::memcpy(p, tmp, n);
}

#else  // scalar fallback

struct VecF {
  static constexpr int W = 1;
  float v;

  static inline VecF zero() { return {0.0f}; }
  static inline VecF set1(float x) { return {x}; }
  static inline VecF load(const float* p) { return {*p}; }
  static inline VecF load(const float* p, int) { return {*p}; }
  static inline VecF load(const int8_t* p) { return {static_cast<float>(*p)}; }
  static inline VecF load(const int8_t* p, int) { return load(p); }
  static inline VecF load_f16(const uint16_t* p) { return {half_to_float(*p)}; }
  static inline VecF load_f16(const uint16_t* p, int) { return load_f16(p); }
  static inline VecF load_bf16(const uint16_t* p) { return {bf16_to_float(*p)}; }
  static inline VecF load_bf16(const uint16_t* p, int) { return load_bf16(p); }
  static inline void load_bf16_pairs(const uint16_t* p, VecF& even, VecF& odd) {
    even = load_bf16(p);
    odd = load_bf16(p + 1);
  }
  inline void store(float* p) const { *p = v; }
  inline void store(float* p, int) const { *p = v; }
};

inline VecF operator+(VecF a, VecF b) { return {a.v + b.v}; }
inline VecF operator-(VecF a, VecF b) { return {a.v - b.v}; }
inline VecF operator*(VecF a, VecF b) { return {a.v * b.v}; }
inline VecF operator/(VecF a, VecF b) { return {a.v / b.v}; }
inline VecF fmadd(VecF a, VecF b, VecF c) { return {std::fma(a.v, b.v, c.v)}; }
inline VecF vmax(VecF a, VecF b) { return {a.v > b.v ? a.v : b.v}; }
inline VecF vabs(VecF a) { return {std::fabs(a.v)}; }
inline float reduce_add(VecF a) { return a.v; }
inline float reduce_max(VecF a) { return a.v; }
inline VecF round_nearest(VecF a) { return {std::nearbyint(a.v)}; }
inline VecF exp2_int(VecF n) { return {std::ldexp(1.0f, static_cast<int>(n.v))}; }
inline void reduce_add4(VecF a, VecF b, VecF c, VecF d, float* out) {
  out[0] = a.v;
  out[1] = b.v;
  out[2] = c.v;
  out[3] = d.v;
}
inline void store_i8(int8_t* p, VecF a, int) { *p = static_cast<int8_t>(std::nearbyint(a.v)); }

#endif

// exp(x) for a vector: Cody-Waite range reduction x = n ln2 + r, a degree-6
// polynomial for exp(r) on |r| <= ln2/2 (relative error ~1e-7), then scaling by
// 2^n built in the exponent bits. Inputs are clamped to [-87.3, 88.37] so 2^n is
// a normal float: exp(-inf) comes out as ~1e-38, which is 0 for softmax purposes.
inline VecF vexp(VecF x) {
  const VecF hi = VecF::set1(88.3762626647949f), lo = VecF::set1(-87.3365447504f);
  x = vmax(x, lo);
  x = VecF{x.v} - vmax(x - hi, VecF::zero());  // min(x, hi) with the same ops on every path
  VecF n = round_nearest(x * VecF::set1(1.44269504088896341f));
  VecF r = fmadd(n, VecF::set1(-0.693359375f), x);
  r = fmadd(n, VecF::set1(2.12194440e-4f), r);
  VecF p = VecF::set1(1.9875691500e-4f);
  p = fmadd(p, r, VecF::set1(1.3981999507e-3f));
  p = fmadd(p, r, VecF::set1(8.3334519073e-3f));
  p = fmadd(p, r, VecF::set1(4.1665795894e-2f));
  p = fmadd(p, r, VecF::set1(1.6666665459e-1f));
  p = fmadd(p, r, VecF::set1(5.0000001201e-1f));
  p = fmadd(p, r * r, r + VecF::set1(1.0f));
  return p * exp2_int(n);
}

// exp(x) for x <= 0 where the result is rounded to bf16 next (softmax numerators on the
// matrix engines): vexp's range reduction with a degree-5 Taylor polynomial for exp(r)
// (relative error below 3e-6 on |r| <= ln2/2, far under bf16's 2^-9) and no upper clamp.
inline VecF vexp_nonpositive(VecF x) {
  x = vmax(x, VecF::set1(-87.3365447504f));
  VecF n = round_nearest(x * VecF::set1(1.44269504088896341f));
  VecF r = fmadd(n, VecF::set1(-0.693359375f), x);
  r = fmadd(n, VecF::set1(2.12194440e-4f), r);
  VecF p = VecF::set1(1.0f / 120);
  p = fmadd(p, r, VecF::set1(1.0f / 24));
  p = fmadd(p, r, VecF::set1(1.0f / 6));
  p = fmadd(p, r, VecF::set1(0.5f));
  p = fmadd(p, r * r, r + VecF::set1(1.0f));  // 1 + r + r^2 / 2 + ... + r^5 / 120
  return p * exp2_int(n);
}

// Integer dot products of int8 vectors, for decode attention with an int8 query (scores
// as llama.cpp computes q8_0 x q8_0: integer products, one float scale per token):
//   VecB          I8B int8 values; VecB::load(p), VecB::load(p, n) (the rest zero),
//                 VecB::bcast4(p) (the 4 bytes at p in every 32-bit lane)
//   VecI          W int32 lanes (as many as VecF has floats)
//   DotK          a K vector prepared once (dot_operand(k)) for the dot products with
//                 several query heads
//   dot_i8(acc, k, q)   acc += k . q in groups of 4 adjacent bytes per lane, plus
//                       kDotBias * (the same groups of q): the caller subtracts
//                       kDotBias * sum(q) from each finished dot product
//   dot_u7(acc, p, v)   acc += p . v in groups of 4 bytes per lane, p unsigned in [0, 127],
//                       v signed: exact, no bias (P.V with quantized probabilities)
//   to_float(acc)  the lanes as a VecF
// VNNI (AVX-512 VNNI, AVX-VNNI) multiplies unsigned by signed bytes: k is made unsigned by
// flipping its sign bit (k + 128), hence the bias 128. Without VNNI, pmaddubsw on
// sign-adjusted operands (|k| times q with k's sign) keeps every 16-bit pair sum within
// 2 x 128 x 127 < 2^15 (no saturation), and pmaddwd widens the pairs: bias 0. dot_u7's
// 127 limit is what keeps pmaddubsw's pair sums (2 x 127 x 127) below 2^15 on that path.
#if defined(WBK_ISA_AVX512)
inline constexpr int I8B = 64;
struct VecB {
  __m512i v;
  static inline VecB load(const int8_t* p) { return {_mm512_loadu_si512(p)}; }
  static inline VecB load(const int8_t* p, int n) {
    return {_mm512_maskz_loadu_epi8(n >= 64 ? ~0ull : ((1ull << n) - 1ull), p)};
  }
  static inline VecB bcast4(const int8_t* p) {
    int32_t x;
    std::memcpy(&x, p, 4);
    return {_mm512_set1_epi32(x)};
  }
};
struct VecI {
  __m512i v;
  static inline VecI zero() { return {_mm512_setzero_si512()}; }
};
inline VecI operator+(VecI a, VecI b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline VecF to_float(VecI a) { return {_mm512_cvtepi32_ps(a.v)}; }
#if defined(__AVX512VNNI__) || (defined(WBK_EMULATE_ISA) && !defined(WBK_EMULATE_NO_VNNI))
inline constexpr int kDotBias = 128;
inline constexpr const char* kDotIsa = "avx512-vnni";
struct DotK {
  __m512i biased;  // k + 128 as unsigned bytes
};
inline DotK dot_operand(VecB k) { return {_mm512_xor_si512(k.v, _mm512_set1_epi8(static_cast<char>(0x80)))}; }
inline VecI dot_i8(VecI acc, const DotK& k, VecB q) { return {_mm512_dpbusd_epi32(acc.v, k.biased, q.v)}; }
inline VecI dot_u7(VecI acc, VecB p, VecB v) { return {_mm512_dpbusd_epi32(acc.v, p.v, v.v)}; }
#else
inline constexpr int kDotBias = 0;
inline constexpr const char* kDotIsa = "avx512bw-maddubs";
struct DotK {
  __m512i magnitude;  // |k|
  __mmask64 negative;  // k < 0
};
inline DotK dot_operand(VecB k) { return {_mm512_abs_epi8(k.v), _mm512_movepi8_mask(k.v)}; }
inline VecI dot_i8(VecI acc, const DotK& k, VecB q) {
  const __m512i sq = _mm512_mask_sub_epi8(q.v, k.negative, _mm512_setzero_si512(), q.v);
  const __m512i pairs = _mm512_maddubs_epi16(k.magnitude, sq);
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}
inline VecI dot_u7(VecI acc, VecB p, VecB v) {
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(p.v, v.v), _mm512_set1_epi16(1)))};
}
#endif
#elif defined(WBK_ISA_AVX2)
inline constexpr int I8B = 32;
struct VecB {
  __m256i v;
  static inline VecB load(const int8_t* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
  static inline VecB load(const int8_t* p, int n) {
    alignas(32) int8_t tmp[32] = {};
    std::memcpy(tmp, p, static_cast<size_t>(n < 32 ? n : 32));
    return {_mm256_load_si256(reinterpret_cast<const __m256i*>(tmp))};
  }
  static inline VecB bcast4(const int8_t* p) {
    int32_t x;
    std::memcpy(&x, p, 4);
    return {_mm256_set1_epi32(x)};
  }
};
struct VecI {
  __m256i v;
  static inline VecI zero() { return {_mm256_setzero_si256()}; }
};
inline VecI operator+(VecI a, VecI b) { return {_mm256_add_epi32(a.v, b.v)}; }
inline VecF to_float(VecI a) { return {_mm256_cvtepi32_ps(a.v)}; }
#if defined(__AVXVNNI__)
inline constexpr int kDotBias = 128;
inline constexpr const char* kDotIsa = "avx-vnni";
struct DotK {
  __m256i biased;  // k + 128 as unsigned bytes
};
inline DotK dot_operand(VecB k) { return {_mm256_xor_si256(k.v, _mm256_set1_epi8(static_cast<char>(0x80)))}; }
inline VecI dot_i8(VecI acc, const DotK& k, VecB q) { return {_mm256_dpbusd_avx_epi32(acc.v, k.biased, q.v)}; }
inline VecI dot_u7(VecI acc, VecB p, VecB v) { return {_mm256_dpbusd_avx_epi32(acc.v, p.v, v.v)}; }
#else
inline constexpr int kDotBias = 0;
inline constexpr const char* kDotIsa = "avx2-maddubs";
struct DotK {
  __m256i magnitude, k;  // |k|, and k for its signs
};
inline DotK dot_operand(VecB k) { return {_mm256_sign_epi8(k.v, k.v), k.v}; }
inline VecI dot_i8(VecI acc, const DotK& k, VecB q) {
  const __m256i pairs = _mm256_maddubs_epi16(k.magnitude, _mm256_sign_epi8(q.v, k.k));
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))};
}
inline VecI dot_u7(VecI acc, VecB p, VecB v) {
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(_mm256_maddubs_epi16(p.v, v.v), _mm256_set1_epi16(1)))};
}
#endif
#else
inline constexpr int I8B = 4;
inline constexpr int kDotBias = 0;
inline constexpr const char* kDotIsa = "scalar";
struct VecB {
  int8_t b[4];
  static inline VecB load(const int8_t* p) { return load(p, 4); }
  static inline VecB load(const int8_t* p, int n) {
    VecB r{{0, 0, 0, 0}};
    for (int i = 0; i < n && i < 4; ++i) r.b[i] = p[i];
    return r;
  }
  static inline VecB bcast4(const int8_t* p) { return load(p, 4); }
};
struct VecI {
  int32_t v;
  static inline VecI zero() { return {0}; }
};
inline VecI operator+(VecI a, VecI b) { return {a.v + b.v}; }
inline VecF to_float(VecI a) { return {static_cast<float>(a.v)}; }
struct DotK {
  VecB k;
};
inline DotK dot_operand(VecB k) { return {k}; }
inline VecI dot_i8(VecI acc, const DotK& k, VecB q) {
  return {acc.v + k.k.b[0] * q.b[0] + k.k.b[1] * q.b[1] + k.k.b[2] * q.b[2] + k.k.b[3] * q.b[3]};
}
inline VecI dot_u7(VecI acc, VecB p, VecB v) {
  int32_t s = acc.v;
  for (int i = 0; i < 4; ++i) s += static_cast<uint8_t>(p.b[i]) * v.b[i];
  return {s};
}
#endif
inline VecI dot_i8(VecI acc, VecB k, VecB q) { return dot_i8(acc, dot_operand(k), q); }

// Typed loads for templated kernels: load_as<T>(p) widens T to fp32.
template <typename T>
struct Load;
template <>
struct Load<float> {
  static inline VecF full(const float* p) { return VecF::load(p); }
  static inline VecF part(const float* p, int n) { return VecF::load(p, n); }
};
template <>
struct Load<int8_t> {
  static inline VecF full(const int8_t* p) { return VecF::load(p); }
  static inline VecF part(const int8_t* p, int n) { return VecF::load(p, n); }
};
struct Half16 {  // tag type: IEEE fp16 bits
  uint16_t bits;
};
struct BFloat16 {  // tag type: bfloat16 bits
  uint16_t bits;
};
template <>
struct Load<Half16> {
  static inline VecF full(const Half16* p) { return VecF::load_f16(reinterpret_cast<const uint16_t*>(p)); }
  static inline VecF part(const Half16* p, int n) {
    return VecF::load_f16(reinterpret_cast<const uint16_t*>(p), n);
  }
};
template <>
struct Load<BFloat16> {
  static inline VecF full(const BFloat16* p) { return VecF::load_bf16(reinterpret_cast<const uint16_t*>(p)); }
  static inline VecF part(const BFloat16* p, int n) {
    return VecF::load_bf16(reinterpret_cast<const uint16_t*>(p), n);
  }
};

// 16-bit integer lanes, for the dot products of block-quantized weights (blocks.cpp): a block's
// 4-, 5-, 6- or 8-bit values widened to int16 and multiplied with the activations quantized to
// int16 (one scale per 32 values), pairs of products summed into int32 lanes (pmaddwd, or
// VNNI's vpdpwssd). Every x86 build uses 256-bit vectors here, AVX-512 ones included: a 32-weight
// chunk of a block is two of them, and the kernels are bound by memory, not by vector width.
//   VecS    16 int16 lanes: widen_u8 / widen_i8 (16 bytes), load (16 int16), set1, &, |, -,
//           shr<n> / shl<n> (logical shifts of each lane)
//   VecI8   8 int32 lanes: dot(acc, a, b) adds a . b in pairs of lanes
//   Vec8F   8 fp32 lanes: load, bcast, store, load_f16 (8 IEEE halves), from_u8 / from_i8,
//           load4_doubled, set1, +, *, fmadd, reduce_add, to_float(VecI8), to_float(VecS, lo, hi)
#if defined(__AVX2__)
struct VecS {
  __m256i v;
  static inline VecS widen_u8(const uint8_t* p) {
    return {_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static inline VecS widen_i8(const int8_t* p) {
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static inline VecS load(const int16_t* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
  static inline VecS set1(int16_t x) { return {_mm256_set1_epi16(x)}; }
  // Q5's fifth bits of one half (kHalf 0: weights 0-15 of a block, 1: 16-31) as 0x10 in each
  // lane, from the block's 32-bit word in the kernels' order (blocks.cpp q5_bit: lane pair i of
  // half 0 at bits i and 16 + i, of half 1 at bits 8 + i and 24 + i), so that one variable shift
  // of each 32-bit lane puts both of its weights' bits at bit 4 of their 16-bit halves.
  template <int kHalf>
  static inline VecS fifth_bits(uint32_t qh) {
    const __m256i w = _mm256_set1_epi32(static_cast<int>(qh));
    const __m256i shifted = kHalf ? _mm256_srlv_epi32(w, _mm256_setr_epi32(4, 5, 6, 7, 8, 9, 10, 11))
                                  : _mm256_srlv_epi32(_mm256_slli_epi32(w, 4), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return {_mm256_and_si256(shifted, _mm256_set1_epi32(0x00100010))};
  }
};
inline VecS operator&(VecS a, VecS b) { return {_mm256_and_si256(a.v, b.v)}; }
inline VecS operator|(VecS a, VecS b) { return {_mm256_or_si256(a.v, b.v)}; }
inline VecS operator-(VecS a, VecS b) { return {_mm256_sub_epi16(a.v, b.v)}; }
template <int N>
inline VecS shr(VecS a) { return {_mm256_srli_epi16(a.v, N)}; }
template <int N>
inline VecS shl(VecS a) { return {_mm256_slli_epi16(a.v, N)}; }

struct VecI8 {
  __m256i v;
  static inline VecI8 zero() { return {_mm256_setzero_si256()}; }
};
inline VecI8 operator+(VecI8 a, VecI8 b) { return {_mm256_add_epi32(a.v, b.v)}; }
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(WBK_EMULATE_ISA)
inline constexpr const char* kBlockDotIsa = "avx512-vnni (vpdpwssd)";
inline VecI8 dot(VecI8 acc, VecS a, VecS b) { return {_mm256_dpwssd_epi32(acc.v, a.v, b.v)}; }
#elif defined(__AVXVNNI__)
inline constexpr const char* kBlockDotIsa = "avx-vnni (vpdpwssd)";
inline VecI8 dot(VecI8 acc, VecS a, VecS b) { return {_mm256_dpwssd_avx_epi32(acc.v, a.v, b.v)}; }
#else
inline constexpr const char* kBlockDotIsa = "avx2 (pmaddwd)";
inline VecI8 dot(VecI8 acc, VecS a, VecS b) { return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(a.v, b.v))}; }
#endif
// 32 byte lanes, for the dot products with activations quantized to int8 (blocks.cpp): a
// chunk of 32 weights in one vector, as unsigned bytes (a block's 4-, 5- or 6-bit values, at
// most 63) or signed (q8_0, the int8 formats), the activations int8 in [-127, 127].
//   Bytes32 load (32 bytes), nibbles (16 bytes: low nibbles in lanes 0-15, high in 16-31),
//           set1, &, |, shr<n> / shl<n> (per byte: 16-bit shifts whose bleed the masks drop),
//           bits32 (lane e = 0x10 where bit q5_bit(e) of a 32-bit word is set)
//   dot_us(acc, u, s): u unsigned, s signed, four products a lane; dot_ss: both signed
struct Bytes32 {
  __m256i v;
  static inline Bytes32 load(const void* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
  static inline Bytes32 nibbles(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F))};
  }
  static inline Bytes32 set1(uint8_t x) { return {_mm256_set1_epi8(static_cast<char>(x))}; }
  // Lane e = 0x10 where the 32-bit word's bit for weight e is set, in the kernels' Q5 order
  // (blocks.cpp q5_bit: weight e at byte 2 (e % 2) + e / 16, bit (e % 16) / 2).
  static inline Bytes32 bits32(uint32_t qh) {
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                              _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                                               1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3));
    const __m256i mask = _mm256_setr_epi8(1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, -128, -128,
                                          1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, -128, -128);
    return {_mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask), _mm256_set1_epi8(0x10))};
  }
};
inline Bytes32 operator&(Bytes32 a, Bytes32 b) { return {_mm256_and_si256(a.v, b.v)}; }
inline Bytes32 operator|(Bytes32 a, Bytes32 b) { return {_mm256_or_si256(a.v, b.v)}; }
template <int N>
inline Bytes32 shr(Bytes32 a) { return {_mm256_srli_epi16(a.v, N)}; }
template <int N>
inline Bytes32 shl(Bytes32 a) { return {_mm256_slli_epi16(a.v, N)}; }
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__))
inline constexpr const char* kByteDotIsa = "avx512-vnni (vpdpbusd)";
inline VecI8 dot_us(VecI8 acc, Bytes32 u, Bytes32 s) { return {_mm256_dpbusd_epi32(acc.v, u.v, s.v)}; }
#elif defined(__AVXVNNI__)
inline constexpr const char* kByteDotIsa = "avx-vnni (vpdpbusd)";
inline VecI8 dot_us(VecI8 acc, Bytes32 u, Bytes32 s) { return {_mm256_dpbusd_avx_epi32(acc.v, u.v, s.v)}; }
#else
inline constexpr const char* kByteDotIsa = "avx2 (pmaddubsw)";
// pairs of products summed to int16 (at most 2 x 63 x 127, or 2 x 128 x 127 for dot_ss: no
// saturation), then pairs of those to int32
inline VecI8 dot_us(VecI8 acc, Bytes32 u, Bytes32 s) {
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(_mm256_maddubs_epi16(u.v, s.v), _mm256_set1_epi16(1)))};
}
#endif
inline VecI8 dot_ss(VecI8 acc, Bytes32 a, Bytes32 s) {
  return dot_us(acc, Bytes32{_mm256_sign_epi8(a.v, a.v)}, Bytes32{_mm256_sign_epi8(s.v, a.v)});
}
struct Vec8F {
  __m256 v;
  static inline Vec8F zero() { return {_mm256_setzero_ps()}; }
  static inline Vec8F set1(float x) { return {_mm256_set1_ps(x)}; }
  static inline Vec8F load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static inline Vec8F bcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
  inline void store(float* p) const { _mm256_storeu_ps(p, v); }
  static inline Vec8F load_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  // The 8 bytes of `bytes` (little-endian: byte i is lane i), unsigned / signed.
  static inline Vec8F from_u8(uint64_t bytes) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))))};
  }
  static inline Vec8F from_i8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  // Lanes p[0], p[0], p[1], p[1], ..., p[3], p[3].
  static inline Vec8F load4_doubled(const float* p) {
    return {_mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3))};
  }
  // Lanes 0-3 = a, 4-7 = b.
  static inline Vec8F halves(float a, float b) { return {_mm256_setr_ps(a, a, a, a, b, b, b, b)}; }
};
inline Vec8F operator+(Vec8F a, Vec8F b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec8F operator*(Vec8F a, Vec8F b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec8F fmadd(Vec8F a, Vec8F b, Vec8F c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec8F to_float(VecI8 a) { return {_mm256_cvtepi32_ps(a.v)}; }
// Lanes 0-7 and 8-15 of 16 int16 lanes as fp32.
inline void to_float(VecS a, Vec8F& lo, Vec8F& hi) {
  lo = {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a.v)))};
  hi = {_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(a.v, 1)))};
}
inline float reduce_add(Vec8F a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else  // the portable fallback: the same lanes as arrays
struct VecS {
  int16_t v[16];
  static inline VecS widen_u8(const uint8_t* p) {
    VecS r;
    for (int i = 0; i < 16; ++i) r.v[i] = p[i];
    return r;
  }
  static inline VecS widen_i8(const int8_t* p) {
    VecS r;
    for (int i = 0; i < 16; ++i) r.v[i] = p[i];
    return r;
  }
  static inline VecS load(const int16_t* p) {
    VecS r;
    std::memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static inline VecS set1(int16_t x) {
    VecS r;
    for (auto& e : r.v) e = x;
    return r;
  }
  template <int kHalf>
  static inline VecS fifth_bits(uint32_t qh) {
    VecS r;
    for (int i = 0; i < 16; ++i) {
      const int bit = i / 2 + 16 * (i % 2) + 8 * kHalf;
      r.v[i] = static_cast<int16_t>((qh >> bit) & 1 ? 0x10 : 0);
    }
    return r;
  }
};
template <typename F>
inline VecS lanewise(VecS a, VecS b, F f) {
  VecS r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<int16_t>(f(a.v[i], b.v[i]));
  return r;
}
inline VecS operator&(VecS a, VecS b) { return lanewise(a, b, [](int x, int y) { return x & y; }); }
inline VecS operator|(VecS a, VecS b) { return lanewise(a, b, [](int x, int y) { return x | y; }); }
inline VecS operator-(VecS a, VecS b) { return lanewise(a, b, [](int x, int y) { return x - y; }); }
template <int N>
inline VecS shr(VecS a) {
  for (auto& e : a.v) e = static_cast<int16_t>(static_cast<uint16_t>(e) >> N);
  return a;
}
template <int N>
inline VecS shl(VecS a) {
  for (auto& e : a.v) e = static_cast<int16_t>(static_cast<uint16_t>(e) << N);
  return a;
}
struct VecI8 {
  int32_t v[8];
  static inline VecI8 zero() { return {{0, 0, 0, 0, 0, 0, 0, 0}}; }
};
inline VecI8 operator+(VecI8 a, VecI8 b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline constexpr const char* kBlockDotIsa = "scalar";
inline VecI8 dot(VecI8 acc, VecS a, VecS b) {
  for (int i = 0; i < 8; ++i) acc.v[i] += a.v[2 * i] * b.v[2 * i] + a.v[2 * i + 1] * b.v[2 * i + 1];
  return acc;
}
struct Bytes32 {
  uint8_t v[32];
  static inline Bytes32 load(const void* p) {
    Bytes32 r;
    std::memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static inline Bytes32 nibbles(const uint8_t* p) {
    Bytes32 r;
    for (int i = 0; i < 16; ++i) {
      r.v[i] = p[i] & 0x0F;
      r.v[i + 16] = p[i] >> 4;
    }
    return r;
  }
  static inline Bytes32 set1(uint8_t x) {
    Bytes32 r;
    for (auto& e : r.v) e = x;
    return r;
  }
  static inline Bytes32 bits32(uint32_t qh) {
    Bytes32 r;
    for (int e = 0; e < 32; ++e) r.v[e] = (qh >> (8 * (2 * (e % 2) + e / 16) + (e % 16) / 2)) & 1 ? 0x10 : 0;
    return r;
  }
};
inline Bytes32 operator&(Bytes32 a, Bytes32 b) {
  for (int i = 0; i < 32; ++i) a.v[i] &= b.v[i];
  return a;
}
inline Bytes32 operator|(Bytes32 a, Bytes32 b) {
  for (int i = 0; i < 32; ++i) a.v[i] |= b.v[i];
  return a;
}
// the x86 builds' 16-bit lane shifts, bleed between byte pairs included (the masks drop it)
template <int N>
inline Bytes32 shr(Bytes32 a) {
  Bytes32 r;
  for (int i = 0; i < 32; i += 2) {
    const uint16_t w = static_cast<uint16_t>((a.v[i] | (a.v[i + 1] << 8)) >> N);
    r.v[i] = w & 0xFF;
    r.v[i + 1] = w >> 8;
  }
  return r;
}
template <int N>
inline Bytes32 shl(Bytes32 a) {
  Bytes32 r;
  for (int i = 0; i < 32; i += 2) {
    const uint16_t w = static_cast<uint16_t>((a.v[i] | (a.v[i + 1] << 8)) << N);
    r.v[i] = w & 0xFF;
    r.v[i + 1] = w >> 8;
  }
  return r;
}
inline constexpr const char* kByteDotIsa = "scalar";
inline VecI8 dot_us(VecI8 acc, Bytes32 u, Bytes32 s) {
  for (int i = 0; i < 32; ++i) acc.v[i / 4] += u.v[i] * static_cast<int8_t>(s.v[i]);
  return acc;
}
inline VecI8 dot_ss(VecI8 acc, Bytes32 a, Bytes32 s) {
  for (int i = 0; i < 32; ++i) acc.v[i / 4] += static_cast<int8_t>(a.v[i]) * static_cast<int8_t>(s.v[i]);
  return acc;
}
struct Vec8F {
  float v[8];
  static inline Vec8F zero() { return set1(0.0f); }
  static inline Vec8F set1(float x) {
    Vec8F r;
    for (auto& e : r.v) e = x;
    return r;
  }
  static inline Vec8F load(const float* p) {
    Vec8F r;
    std::memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static inline Vec8F bcast(const float* p) { return set1(*p); }
  inline void store(float* p) const { std::memcpy(p, v, sizeof v); }
  static inline Vec8F load_f16(const uint16_t* p) {
    Vec8F r;
    for (int i = 0; i < 8; ++i) r.v[i] = half_to_float(p[i]);
    return r;
  }
  static inline Vec8F from_u8(uint64_t bytes) {
    Vec8F r;
    for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>((bytes >> (8 * i)) & 0xFF);
    return r;
  }
  static inline Vec8F from_i8(const int8_t* p) {
    Vec8F r;
    for (int i = 0; i < 8; ++i) r.v[i] = p[i];
    return r;
  }
  static inline Vec8F load4_doubled(const float* p) {
    Vec8F r;
    for (int i = 0; i < 8; ++i) r.v[i] = p[i / 2];
    return r;
  }
  static inline Vec8F halves(float a, float b) {
    Vec8F r;
    for (int i = 0; i < 8; ++i) r.v[i] = i < 4 ? a : b;
    return r;
  }
};
inline Vec8F operator+(Vec8F a, Vec8F b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline Vec8F operator*(Vec8F a, Vec8F b) {
  for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
  return a;
}
inline Vec8F fmadd(Vec8F a, Vec8F b, Vec8F c) {
  for (int i = 0; i < 8; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline Vec8F to_float(VecI8 a) {
  Vec8F r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(a.v[i]);
  return r;
}
inline void to_float(VecS a, Vec8F& lo, Vec8F& hi) {
  for (int i = 0; i < 8; ++i) {
    lo.v[i] = a.v[i];
    hi.v[i] = a.v[i + 8];
  }
}
inline float reduce_add(Vec8F a) {
  float s = 0.0f;
  for (float e : a.v) s += e;
  return s;
}
#endif

}  // namespace wbk
