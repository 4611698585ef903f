// The instructions of an AMX host that the kernels use (AVX-512 F/BW/VL for simd.h's VecF,
// VecB and VecI, AVX512-VNNI, AVX512-BF16, AMX-BF16 and AMX-INT8), written out in plain C++
// from their definitions in Intel's SDM, so that the test build "emulated"
// (workbench/kernels/_build.py) runs the code such a host runs (the AVX-512 path of every
// kernel, and the bf16 engines) on any x86 CPU with AVX2, including the many that have none
// of it.
//
// That build forces this header into every unit (-include) and defines WBK_EMULATE_ISA, which
// makes simd.h take its AVX-512 and VNNI branches; it is never part of a build that a user
// runs. After <immintrin.h> each AVX-512 / AMX intrinsic the kernels use becomes a
// function-like macro calling its emulation below, and the target attributes that would let
// the compiler emit AVX-512 / AMX instructions are defined empty, so those functions compile
// for the build's AVX2. An intrinsic left out fails the build (GCC cannot inline it), so none
// runs as a real instruction. What the tests then check is the kernels' logic (16-lane
// vectors and their masked tails, packing, tiling, edges, the tile configuration) against
// float64; their speed means nothing here.
//
// Faithful where it decides a result: bf16 rounding is to nearest even with denormal inputs
// read as zero (VCVTNE*PS2BF16), the bf16 dot products are FP32 FMAs in the order of the SDM's
// pseudocode with denormals flushed (VDPBF16PS: the odd element, then the even one;
// TDPBF16PS: even and odd partial sums over all of K, added to C at the end), FMAs round once,
// MAXPS returns its second operand for NaNs and zeros, conversions to integers round to
// nearest even and saturate where the instruction does, masked loads never touch a masked-off
// element (the CPU suppresses their faults), aligned accesses must be aligned, and a tile
// instruction checks what the CPU checks: a configuration loaded, shapes that agree. Where
// the CPU would fault (#UD, #GP) the emulation throws std::runtime_error instead.
//
// With WBK_EMULATE_NO_VNNI too, simd.h takes its AVX-512 int8 branch for CPUs without VNNI
// (Skylake-SP's pmaddubsw + pmaddwd form): tests/test_int8_dot.py runs those dot products
// so. What it does not cover: the compiler's own code generation for AVX-512 (its register
// use, any auto-vectorized loop), which only a host with AVX-512 runs.
#pragma once

#ifndef WBK_EMULATE_ISA
#error "emulate_isa.h belongs to the 'emulated' test build, which defines WBK_EMULATE_ISA"
#endif

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

// The engines' functions compile for the build's ISA (their intrinsics are emulated below).
#define WBK_AMX_TARGET
#define WBK_AVX512_TARGET

namespace wbk_emu {

// A vector's lanes as an array (and back): the emulations work lane by lane.
template <typename E, int N>
struct Lanes {
  E v[N];
  E& operator[](int i) { return v[i]; }
  const E& operator[](int i) const { return v[i]; }
};

template <typename E, int N, typename V>
inline Lanes<E, N> lanes(const V& x) {
  static_assert(sizeof(Lanes<E, N>) == sizeof(V), "lanes must cover the vector exactly");
  Lanes<E, N> l;
  std::memcpy(&l, &x, sizeof(V));
  return l;
}

template <typename V, typename E, int N>
inline V vec(const Lanes<E, N>& l) {
  static_assert(sizeof(Lanes<E, N>) == sizeof(V), "lanes must cover the vector exactly");
  V x;
  std::memcpy(&x, &l, sizeof(V));
  return x;
}

[[noreturn]] inline void fault(const std::string& what) {
  throw std::runtime_error("emulated instruction: " + what + " (a real CPU would fault)");
}

inline void check_aligned(const void* p, const char* fn) {
  if (reinterpret_cast<uintptr_t>(p) % 64) fault(std::string(fn) + " on an address not 64-byte aligned");
}

// -- bf16 --------------------------------------------------------------------------------

inline float flush_denormal(float f) {  // DAZ / FTZ: a denormal becomes a zero of its sign
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return flush_denormal(f);
}

inline uint16_t to_bf16(float f) {  // nearest even; NaN stays a (quiet) NaN
  f = flush_denormal(f);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// acc + a b for bf16 a and b as the bf16 dot products do it: one FP32 FMA, denormal inputs
// read as zero and a denormal result flushed (DAZ, FTZ), round to nearest even.
inline float fma_bf16(float acc, uint16_t a, uint16_t b) {
  return flush_denormal(std::fma(from_bf16(a), from_bf16(b), acc));
}

// -- loads and stores ----------------------------------------------------------------------

template <typename V>
inline V load(const void* p) {
  V x;
  std::memcpy(&x, p, sizeof(V));
  return x;
}

template <typename V>
inline void store(void* p, const V& x) {
  std::memcpy(p, &x, sizeof(V));
}

// Elements whose mask bit is set are read; the others are zero and never touched.
template <typename V, typename E, int N>
inline V maskz_load(uint64_t mask, const void* p) {
  Lanes<E, N> l{};
  const E* src = static_cast<const E*>(p);
  for (int i = 0; i < N; ++i)
    if ((mask >> i) & 1) std::memcpy(&l[i], src + i, sizeof(E));
  return vec<V>(l);
}

template <typename E, int N, typename V>
inline void mask_store(void* p, uint64_t mask, const V& x) {
  const Lanes<E, N> l = lanes<E, N>(x);
  E* dst = static_cast<E*>(p);
  for (int i = 0; i < N; ++i)
    if ((mask >> i) & 1) std::memcpy(dst + i, &l[i], sizeof(E));
}

inline __m512 mm512_loadu_ps(const void* p) { return load<__m512>(p); }
inline __m512i mm512_loadu_si512(const void* p) { return load<__m512i>(p); }
inline __m512i mm512_load_si512(const void* p) {
  check_aligned(p, "_mm512_load_si512");
  return load<__m512i>(p);
}
inline __m512 mm512_maskz_loadu_ps(__mmask16 k, const void* p) { return maskz_load<__m512, float, 16>(k, p); }
inline __m512i mm512_maskz_loadu_epi16(__mmask32 k, const void* p) { return maskz_load<__m512i, uint16_t, 32>(k, p); }
inline __m256i mm256_maskz_loadu_epi16(__mmask16 k, const void* p) { return maskz_load<__m256i, uint16_t, 16>(k, p); }
inline __m128i mm_maskz_loadu_epi8(__mmask16 k, const void* p) { return maskz_load<__m128i, int8_t, 16>(k, p); }

inline void mm512_storeu_ps(void* p, __m512 a) { store(p, a); }
inline void mm512_storeu_si512(void* p, __m512i a) { store(p, a); }
inline void mm512_stream_ps(void* p, __m512 a) {
  check_aligned(p, "_mm512_stream_ps");
  store(p, a);
}
inline void mm512_mask_storeu_ps(void* p, __mmask16 k, __m512 a) { mask_store<float, 16>(p, k, a); }
inline void mm256_mask_storeu_epi16(void* p, __mmask16 k, __m256i a) { mask_store<uint16_t, 16>(p, k, a); }
inline void mm_mask_storeu_epi16(void* p, __mmask8 k, __m128i a) { mask_store<uint16_t, 8>(p, k, a); }

// -- arithmetic and conversions ------------------------------------------------------------

inline __m512 mm512_setzero_ps() { return vec<__m512>(Lanes<float, 16>{}); }
inline __m512i mm512_setzero_si512() { return vec<__m512i>(Lanes<int32_t, 16>{}); }

// A vector V of N lanes, each x.
template <typename V, typename E, int N>
inline V set1(E x) {
  Lanes<E, N> l;
  for (int i = 0; i < N; ++i) l[i] = x;
  return vec<V>(l);
}

inline __m512 mm512_set1_ps(float f) { return set1<__m512, float, 16>(f); }
inline __m512i mm512_set1_epi32(int v) { return set1<__m512i, int32_t, 16>(v); }

// The same bits as another vector type of the same size.
template <typename To, typename From>
inline To bitcast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
  To y;
  std::memcpy(&y, &x, sizeof(To));
  return y;
}

// op on the lanes of a and b (N elements E each), pairwise.
template <typename E = float, int N = 16, typename V, typename Op>
inline V lanewise(V a, V b, Op op) {
  Lanes<E, N> x = lanes<E, N>(a);
  const Lanes<E, N> y = lanes<E, N>(b);
  for (int i = 0; i < N; ++i) x[i] = static_cast<E>(op(x[i], y[i]));
  return vec<V>(x);
}

// Each of the N lanes of `a` (elements E) converted (or mapped) by f, as a vector V of N
// lanes of D.
template <typename D, typename E, int N, typename V, typename In, typename F>
inline V convert(const In& a, F f) {
  const Lanes<E, N> s = lanes<E, N>(a);
  Lanes<D, N> d;
  for (int i = 0; i < N; ++i) d[i] = f(s[i]);
  return vec<V>(d);
}

inline __m512 mm512_add_ps(__m512 a, __m512 b) { return lanewise(a, b, [](float x, float y) { return x + y; }); }
inline __m512 mm512_mul_ps(__m512 a, __m512 b) { return lanewise(a, b, [](float x, float y) { return x * y; }); }

inline float mm512_reduce_add_ps(__m512 a) {
  Lanes<float, 16> l = lanes<float, 16>(a);
  for (int width = 8; width >= 1; width /= 2)  // halves added pairwise, as the CPU's sequence does
    for (int i = 0; i < width; ++i) l[i] += l[i + width];
  return l[0];
}

inline __m512i mm512_cvtepi8_epi32(__m128i a) {
  return convert<int32_t, int8_t, 16, __m512i>(a, [](int8_t x) { return x; });
}

inline __m512 mm512_cvtepi32_ps(__m512i a) {
  return convert<float, int32_t, 16, __m512>(a, [](int32_t x) { return static_cast<float>(x); });
}

// bf16 lanes 0-15 from b, 16-31 from a (VCVTNE2PS2BF16's order).
inline __m512bh mm512_cvtne2ps_pbh(__m512 a, __m512 b) {
  const Lanes<float, 16> hi = lanes<float, 16>(a), lo = lanes<float, 16>(b);
  Lanes<uint16_t, 32> d;
  for (int i = 0; i < 16; ++i) {
    d[i] = to_bf16(lo[i]);
    d[16 + i] = to_bf16(hi[i]);
  }
  return vec<__m512bh>(d);
}

inline __m256bh mm512_cvtneps_pbh(__m512 a) { return convert<uint16_t, float, 16, __m256bh>(a, to_bf16); }

inline __m128bh mm256_cvtneps_pbh(__m256 a) { return convert<uint16_t, float, 8, __m128bh>(a, to_bf16); }

// Lane i: src[i] + a[2i+1] b[2i+1] + a[2i] b[2i] (the odd pair first, as the SDM writes it).
inline __m512 mm512_dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
  Lanes<float, 16> acc = lanes<float, 16>(src);
  const Lanes<uint16_t, 32> x = lanes<uint16_t, 32>(a), y = lanes<uint16_t, 32>(b);
  for (int i = 0; i < 16; ++i) acc[i] = fma_bf16(fma_bf16(acc[i], x[2 * i + 1], y[2 * i + 1]), x[2 * i], y[2 * i]);
  return vec<__m512>(acc);
}

// -- permutes --------------------------------------------------------------------------------

inline __m512i mm512_permutexvar_epi16(__m512i idx, __m512i a) {
  const Lanes<uint16_t, 32> i16 = lanes<uint16_t, 32>(idx), s = lanes<uint16_t, 32>(a);
  Lanes<uint16_t, 32> d;
  for (int i = 0; i < 32; ++i) d[i] = s[i16[i] & 31];
  return vec<__m512i>(d);
}

inline __m512i mm512_castsi256_si512(__m256i a) {  // the upper half is undefined: a pattern
  Lanes<int64_t, 8> d;                               // that no caller could mistake for data
  for (int i = 4; i < 8; ++i) d[i] = static_cast<int64_t>(0x7fc17fc17fc17fc1);  // bf16 NaNs
  std::memcpy(&d, &a, 32);
  return vec<__m512i>(d);
}

inline __m512i mm512_inserti64x4(__m512i a, __m256i b, int imm) {
  Lanes<int64_t, 8> d = lanes<int64_t, 8>(a);
  std::memcpy(&d[(imm & 1) * 4], &b, 32);
  return vec<__m512i>(d);
}

// Within each 128-bit lane: the low (or high) halves of a and b interleaved, `E` at a time.
template <typename E, bool High>
inline __m512i unpack(__m512i a, __m512i b) {
  constexpr int per = 16 / sizeof(E), half = per / 2;
  const Lanes<E, 4 * per> x = lanes<E, 4 * per>(a), y = lanes<E, 4 * per>(b);
  Lanes<E, 4 * per> d;
  for (int lane = 0; lane < 4; ++lane)
    for (int i = 0; i < half; ++i) {
      d[lane * per + 2 * i] = x[lane * per + (High ? half : 0) + i];
      d[lane * per + 2 * i + 1] = y[lane * per + (High ? half : 0) + i];
    }
  return vec<__m512i>(d);
}

// 128-bit lanes: the low two chosen from a, the high two from b, two bits of imm each.
inline __m512i mm512_shuffle_i32x4(__m512i a, __m512i b, int imm) {
  const Lanes<int64_t, 8> x = lanes<int64_t, 8>(a), y = lanes<int64_t, 8>(b);
  Lanes<int64_t, 8> d;
  for (int lane = 0; lane < 4; ++lane) {
    const int from = (imm >> (2 * lane)) & 3;
    const Lanes<int64_t, 8>& src = lane < 2 ? x : y;
    d[2 * lane] = src[2 * from];
    d[2 * lane + 1] = src[2 * from + 1];
  }
  return vec<__m512i>(d);
}

// -- the AVX-512 path of kernels/simd.h (VecF, VecB, VecI) --------------------------------

inline __m512i mm512_maskz_loadu_epi8(__mmask64 k, const void* p) { return maskz_load<__m512i, int8_t, 64>(k, p); }
inline __m512i mm512_maskz_loadu_epi32(__mmask16 k, const void* p) { return maskz_load<__m512i, int32_t, 16>(k, p); }
inline void mm_mask_storeu_epi8(void* p, __mmask16 k, __m128i a) { mask_store<int8_t, 16>(p, k, a); }

inline __m512i mm512_set1_epi8(char v) { return set1<__m512i, int8_t, 64>(static_cast<int8_t>(v)); }

inline __m512 mm512_sub_ps(__m512 a, __m512 b) { return lanewise(a, b, [](float x, float y) { return x - y; }); }
inline __m512 mm512_div_ps(__m512 a, __m512 b) { return lanewise(a, b, [](float x, float y) { return x / y; }); }
// MAXPS: the second operand where either is a NaN or both are zeros (of either sign).
inline __m512 mm512_max_ps(__m512 a, __m512 b) { return lanewise(a, b, [](float x, float y) { return x > y ? x : y; }); }

inline __m512 mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {  // one rounding
  Lanes<float, 16> x = lanes<float, 16>(a);
  const Lanes<float, 16> y = lanes<float, 16>(b), z = lanes<float, 16>(c);
  for (int i = 0; i < 16; ++i) x[i] = std::fma(x[i], y[i], z[i]);
  return vec<__m512>(x);
}

inline __m512i mm512_and_si512(__m512i a, __m512i b) {
  return lanewise<uint64_t, 8>(a, b, [](uint64_t x, uint64_t y) { return x & y; });
}
inline __m512i mm512_xor_si512(__m512i a, __m512i b) {
  return lanewise<uint64_t, 8>(a, b, [](uint64_t x, uint64_t y) { return x ^ y; });
}

inline __m512 mm512_abs_ps(__m512 a) {  // the sign bit cleared, NaNs included
  return convert<uint32_t, uint32_t, 16, __m512>(a, [](uint32_t x) { return x & 0x7fffffffu; });
}

inline __m512i mm512_add_epi32(__m512i a, __m512i b) {  // wrapping
  return lanewise<uint32_t, 16>(a, b, [](uint32_t x, uint32_t y) { return x + y; });
}

inline __m512i mm512_slli_epi32(__m512i a, unsigned imm) {  // counts past 31 give zeros
  return convert<uint32_t, uint32_t, 16, __m512i>(a, [imm](uint32_t x) { return imm > 31 ? 0u : x << imm; });
}

inline __m512 mm512_castsi512_ps(__m512i a) { return bitcast<__m512>(a); }

inline __m256 mm512_castps512_ps256(__m512 a) {
  __m256 d;
  std::memcpy(&d, &a, 32);
  return d;
}

inline __m512i mm512_cvtepu16_epi32(__m256i a) {
  return convert<int32_t, uint16_t, 16, __m512i>(a, [](uint16_t x) { return x; });
}

inline __m512 mm512_cvtph_ps(__m256i a) {  // binary16 to binary32 is exact (F16C's scalar form)
  return convert<float, uint16_t, 16, __m512>(a, [](uint16_t h) { return _cvtsh_ss(h); });
}

// CVTPS2DQ under the default rounding (nearest even); NaN and out-of-range lanes give the
// "integer indefinite" 0x80000000.
inline __m512i mm512_cvtps_epi32(__m512 a) {
  return convert<int32_t, float, 16, __m512i>(a, [](float x) {
    const float r = std::nearbyint(x);
    return (r >= -2147483648.0f && r < 2147483648.0f) ? static_cast<int32_t>(r) : INT32_MIN;
  });
}

inline __m128i mm512_cvtsepi32_epi8(__m512i a) {  // saturating
  return convert<int8_t, int32_t, 16, __m128i>(
      a, [](int32_t x) { return static_cast<int8_t>(x < -128 ? -128 : x > 127 ? 127 : x); });
}

// VRNDSCALEPS with scale 0: to an integral value, the rounding the immediate names.
inline __m512 mm512_roundscale_ps(__m512 a, int imm) {
  if ((imm & 0xf4) != 0 || (imm & 3) != _MM_FROUND_TO_NEAREST_INT) fault("vrndscaleps with an immediate the emulation does not write out");
  return convert<float, float, 16, __m512>(a, [](float x) { return std::nearbyint(x); });
}

inline __m512 mm512_shuffle_f32x4(__m512 a, __m512 b, int imm) {
  return bitcast<__m512>(mm512_shuffle_i32x4(bitcast<__m512i>(a), bitcast<__m512i>(b), imm));
}

// VPDPBUSD: lane i + the four products of a's unsigned and b's signed bytes of group i
// (32-bit wrapping sums, no saturation).
inline __m512i mm512_dpbusd_epi32(__m512i src, __m512i a, __m512i b) {
  Lanes<uint32_t, 16> acc = lanes<uint32_t, 16>(src);
  const Lanes<uint8_t, 64> u = lanes<uint8_t, 64>(a);
  const Lanes<int8_t, 64> v = lanes<int8_t, 64>(b);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 4; ++j) acc[i] += static_cast<uint32_t>(static_cast<int32_t>(u[4 * i + j]) * v[4 * i + j]);
  return vec<__m512i>(acc);
}

// -- AVX512BW byte and word arithmetic: simd.h's int8 dot products where there is no VNNI ------
// (compiled in only with WBK_EMULATE_NO_VNNI; see the header comment).

inline __m512i mm512_set1_epi16(short x) { return set1<__m512i, int16_t, 32>(x); }

inline __m512i mm512_abs_epi8(__m512i a) {  // VPABSB: |-128| is 0x80 (128 read unsigned)
  return convert<uint8_t, int8_t, 64, __m512i>(a, [](int8_t x) { return static_cast<uint8_t>(x < 0 ? -x : x); });
}

inline __mmask64 mm512_movepi8_mask(__m512i a) {  // VPMOVB2M: each byte's sign bit
  const Lanes<int8_t, 64> l = lanes<int8_t, 64>(a);
  __mmask64 m = 0;
  for (int i = 0; i < 64; ++i) m |= static_cast<__mmask64>(l[i] < 0) << i;
  return m;
}

// VPSUBB with a merge mask: a - b (wrapping) where k is set, src where it is clear.
inline __m512i mm512_mask_sub_epi8(__m512i src, __mmask64 k, __m512i a, __m512i b) {
  Lanes<uint8_t, 64> d = lanes<uint8_t, 64>(src);
  const Lanes<uint8_t, 64> x = lanes<uint8_t, 64>(a), y = lanes<uint8_t, 64>(b);
  for (int i = 0; i < 64; ++i)
    if ((k >> i) & 1) d[i] = static_cast<uint8_t>(x[i] - y[i]);
  return vec<__m512i>(d);
}

// VPMADDUBSW: word i = a's unsigned bytes 2i and 2i+1 times b's signed ones, the two
// products' sum saturated to int16.
inline __m512i mm512_maddubs_epi16(__m512i a, __m512i b) {
  const Lanes<uint8_t, 64> u = lanes<uint8_t, 64>(a);
  const Lanes<int8_t, 64> v = lanes<int8_t, 64>(b);
  Lanes<int16_t, 32> d;
  for (int i = 0; i < 32; ++i) {
    const int32_t s = u[2 * i] * v[2 * i] + u[2 * i + 1] * v[2 * i + 1];
    d[i] = static_cast<int16_t>(s < -32768 ? -32768 : s > 32767 ? 32767 : s);
  }
  return vec<__m512i>(d);
}

// VPMADDWD: dword i = the products of words 2i and 2i+1 added, wrapping (only two products
// of -32768 by -32768 overflow).
inline __m512i mm512_madd_epi16(__m512i a, __m512i b) {
  const Lanes<int16_t, 32> x = lanes<int16_t, 32>(a), y = lanes<int16_t, 32>(b);
  Lanes<uint32_t, 16> d;
  for (int i = 0; i < 16; ++i)
    d[i] = static_cast<uint32_t>(static_cast<int64_t>(x[2 * i]) * y[2 * i] + static_cast<int64_t>(x[2 * i + 1]) * y[2 * i + 1]);
  return vec<__m512i>(d);
}

// -- AMX: eight tiles per thread, and the configuration that shapes them ----------------------

struct TileState {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};

inline TileState& tile_state() {
  static thread_local TileState state;  // the tile registers are per thread, as on the CPU
  return state;
}

inline TileState& tiles_for(std::initializer_list<int> used, const char* fn) {
  TileState& s = tile_state();
  if (!s.configured) fault(std::string(fn) + " with no tile configuration loaded");
  for (int t : used) {
    if (t < 0 || t > 7) fault(std::string(fn) + " on tile " + std::to_string(t) + " (tiles are 0-7)");
    if (s.rows[t] == 0 || s.colsb[t] == 0) fault(std::string(fn) + " on tile " + std::to_string(t) + ", which the configuration leaves empty");
  }
  return s;
}

// LDTILECFG: palette 1 (8 tiles of up to 16 rows x 64 bytes), start_row 0; tiles 8-15 and the
// reserved bytes zero. Palette 0 returns to the initial state. Tile data starts zeroed.
inline void tile_loadconfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  TileState& s = tile_state();
  if (c[0] == 0) {
    s = TileState{};
    return;
  }
  if (c[0] != 1) fault("ldtilecfg with palette " + std::to_string(c[0]) + " (only palettes 0 and 1 exist)");
  for (int i = 1; i < 16; ++i)
    if (c[i]) fault("ldtilecfg with a nonzero start_row or reserved byte");
  TileState next;
  for (int t = 0; t < 16; ++t) {
    const uint16_t colsb = static_cast<uint16_t>(c[16 + 2 * t] | (c[17 + 2 * t] << 8));
    const uint8_t rows = c[48 + t];
    if (t >= 8 ? (colsb || rows) : (colsb > 64 || rows > 16 || (colsb == 0) != (rows == 0)))
      fault("ldtilecfg with tile " + std::to_string(t) + " of " + std::to_string(rows) + " rows x " +
            std::to_string(colsb) + " bytes");
    if (t < 8) {
      next.rows[t] = rows;
      next.colsb[t] = colsb;
    }
  }
  next.configured = true;
  s = next;
}

inline void tile_release() { tile_state() = TileState{}; }

inline void tile_zero(int t) {
  std::memset(tiles_for({t}, "tilezero").data[t], 0, sizeof(TileState::data[0]));
}

inline void tile_loadd(int t, const void* base, int64_t stride) {
  TileState& s = tiles_for({t}, "tileloadd");
  std::memset(s.data[t], 0, sizeof(TileState::data[0]));
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(s.data[t][r], static_cast<const uint8_t*>(base) + r * stride, s.colsb[t]);
}

inline void tile_stored(int t, void* base, int64_t stride) {
  TileState& s = tiles_for({t}, "tilestored");
  for (int r = 0; r < s.rows[t]; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[t][r], s.colsb[t]);
}

// The shapes a tile product needs: C is M x N (4-byte elements), A M x K (K groups of 4
// bytes), B K x N (groups of 4 bytes); three different tiles.
inline TileState& product_tiles(int c, int a, int b, const char* fn) {
  TileState& s = tiles_for({c, a, b}, fn);
  if (c == a || c == b || a == b) fault(std::string(fn) + " with a tile used twice");
  if (s.rows[c] != s.rows[a] || s.colsb[a] != 4 * s.rows[b] || s.colsb[c] != s.colsb[b] || s.colsb[c] % 4)
    fault(std::string(fn) + " on tiles whose shapes do not agree");
  return s;
}

// TDPBF16PS as the SDM's pseudocode has it (not the Intrinsics Guide's shorter form): per
// row, two fp32 partial sums per output, the even and the odd elements of the pairs, each
// built by FMAs over all of K from zero; then C[m][n] += even + odd.
inline void tile_dpbf16ps(int c, int a, int b) {
  TileState& s = product_tiles(c, a, b, "tdpbf16ps");
  const int M = s.rows[c], K = s.colsb[a] / 4, N = s.colsb[c] / 4;
  for (int m = 0; m < M; ++m) {
    float acc[16], even[16] = {}, odd[16] = {};
    std::memcpy(acc, s.data[c][m], 64);
    uint16_t arow[32], brow[32];
    std::memcpy(arow, s.data[a][m], 64);
    for (int k = 0; k < K; ++k) {
      std::memcpy(brow, s.data[b][k], 64);
      for (int n = 0; n < N; ++n) {
        even[n] = fma_bf16(even[n], arow[2 * k], brow[2 * n]);
        odd[n] = fma_bf16(odd[n], arow[2 * k + 1], brow[2 * n + 1]);
      }
    }
    for (int n = 0; n < N; ++n) acc[n] = flush_denormal(acc[n] + flush_denormal(even[n] + odd[n]));
    std::memset(s.data[c][m], 0, 64);
    std::memcpy(s.data[c][m], acc, 4 * N);
  }
}

// TDPBSSD: C[m][n] (int32, wrapping) += the four signed byte products of A[m] group k and
// B[k] group n, over all K.
inline void tile_dpbssd(int c, int a, int b) {
  TileState& s = product_tiles(c, a, b, "tdpbssd");
  const int M = s.rows[c], K = s.colsb[a] / 4, N = s.colsb[c] / 4;
  for (int m = 0; m < M; ++m) {
    uint32_t acc[16];
    std::memcpy(acc, s.data[c][m], 64);
    const int8_t* arow = reinterpret_cast<const int8_t*>(s.data[a][m]);
    for (int k = 0; k < K; ++k) {
      const int8_t* brow = reinterpret_cast<const int8_t*>(s.data[b][k]);
      for (int n = 0; n < N; ++n)
        for (int i = 0; i < 4; ++i) acc[n] += static_cast<uint32_t>(arow[4 * k + i] * brow[4 * n + i]);
    }
    std::memset(s.data[c][m], 0, 64);
    std::memcpy(s.data[c][m], acc, 4 * N);
  }
}

// VPDPWSSD on 256 bits (AVX512-VNNI with VL): each int32 lane plus the two int16 products of
// its lane pair, wrapping like the instruction (and like pmaddwd + paddd, which it equals).
inline __m256i mm256_dpwssd_epi32(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

}  // namespace wbk_emu

// The intrinsics, now calls of the emulations above.
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbssd
#define _tile_loadconfig(config) ::wbk_emu::tile_loadconfig(config)
#define _tile_release() ::wbk_emu::tile_release()
#define _tile_zero(t) ::wbk_emu::tile_zero(t)
#define _tile_loadd(t, base, stride) ::wbk_emu::tile_loadd(t, base, stride)
#define _tile_stored(t, base, stride) ::wbk_emu::tile_stored(t, base, stride)
#define _tile_dpbf16ps(c, a, b) ::wbk_emu::tile_dpbf16ps(c, a, b)
#define _tile_dpbssd(c, a, b) ::wbk_emu::tile_dpbssd(c, a, b)

#define _mm512_loadu_ps(...) ::wbk_emu::mm512_loadu_ps(__VA_ARGS__)
#define _mm512_loadu_si512(...) ::wbk_emu::mm512_loadu_si512(__VA_ARGS__)
#define _mm512_load_si512(...) ::wbk_emu::mm512_load_si512(__VA_ARGS__)
#define _mm512_maskz_loadu_ps(...) ::wbk_emu::mm512_maskz_loadu_ps(__VA_ARGS__)
#define _mm512_maskz_loadu_epi16(...) ::wbk_emu::mm512_maskz_loadu_epi16(__VA_ARGS__)
#define _mm256_maskz_loadu_epi16(...) ::wbk_emu::mm256_maskz_loadu_epi16(__VA_ARGS__)
#define _mm_maskz_loadu_epi8(...) ::wbk_emu::mm_maskz_loadu_epi8(__VA_ARGS__)
#define _mm512_storeu_ps(...) ::wbk_emu::mm512_storeu_ps(__VA_ARGS__)
#define _mm512_storeu_si512(...) ::wbk_emu::mm512_storeu_si512(__VA_ARGS__)
#define _mm512_stream_ps(...) ::wbk_emu::mm512_stream_ps(__VA_ARGS__)
#define _mm512_mask_storeu_ps(...) ::wbk_emu::mm512_mask_storeu_ps(__VA_ARGS__)
#define _mm256_mask_storeu_epi16(...) ::wbk_emu::mm256_mask_storeu_epi16(__VA_ARGS__)
#define _mm_mask_storeu_epi16(...) ::wbk_emu::mm_mask_storeu_epi16(__VA_ARGS__)
#define _mm512_setzero_ps() ::wbk_emu::mm512_setzero_ps()
#define _mm512_setzero_si512() ::wbk_emu::mm512_setzero_si512()
#define _mm512_set1_ps(...) ::wbk_emu::mm512_set1_ps(__VA_ARGS__)
#define _mm512_set1_epi32(...) ::wbk_emu::mm512_set1_epi32(__VA_ARGS__)
#define _mm512_add_ps(...) ::wbk_emu::mm512_add_ps(__VA_ARGS__)
#define _mm512_mul_ps(...) ::wbk_emu::mm512_mul_ps(__VA_ARGS__)
#define _mm512_reduce_add_ps(...) ::wbk_emu::mm512_reduce_add_ps(__VA_ARGS__)
#define _mm512_cvtepi8_epi32(...) ::wbk_emu::mm512_cvtepi8_epi32(__VA_ARGS__)
#define _mm512_cvtepi32_ps(...) ::wbk_emu::mm512_cvtepi32_ps(__VA_ARGS__)
#define _mm512_cvtne2ps_pbh(...) ::wbk_emu::mm512_cvtne2ps_pbh(__VA_ARGS__)
#define _mm512_cvtneps_pbh(...) ::wbk_emu::mm512_cvtneps_pbh(__VA_ARGS__)
#define _mm256_cvtneps_pbh(...) ::wbk_emu::mm256_cvtneps_pbh(__VA_ARGS__)
#define _mm512_dpbf16_ps(...) ::wbk_emu::mm512_dpbf16_ps(__VA_ARGS__)
#define _mm512_permutexvar_epi16(...) ::wbk_emu::mm512_permutexvar_epi16(__VA_ARGS__)
#define _mm512_castsi256_si512(...) ::wbk_emu::mm512_castsi256_si512(__VA_ARGS__)
#define _mm512_inserti64x4(...) ::wbk_emu::mm512_inserti64x4(__VA_ARGS__)
#define _mm512_unpacklo_epi32(a, b) ::wbk_emu::unpack<int32_t, false>(a, b)
#define _mm512_unpackhi_epi32(a, b) ::wbk_emu::unpack<int32_t, true>(a, b)
#define _mm512_unpacklo_epi64(a, b) ::wbk_emu::unpack<int64_t, false>(a, b)
#define _mm512_unpackhi_epi64(a, b) ::wbk_emu::unpack<int64_t, true>(a, b)
#define _mm512_shuffle_i32x4(...) ::wbk_emu::mm512_shuffle_i32x4(__VA_ARGS__)
#define _mm512_maskz_loadu_epi8(...) ::wbk_emu::mm512_maskz_loadu_epi8(__VA_ARGS__)
#define _mm512_maskz_loadu_epi32(...) ::wbk_emu::mm512_maskz_loadu_epi32(__VA_ARGS__)
#define _mm_mask_storeu_epi8(...) ::wbk_emu::mm_mask_storeu_epi8(__VA_ARGS__)
#define _mm512_set1_epi8(...) ::wbk_emu::mm512_set1_epi8(__VA_ARGS__)
#define _mm512_sub_ps(...) ::wbk_emu::mm512_sub_ps(__VA_ARGS__)
#define _mm512_div_ps(...) ::wbk_emu::mm512_div_ps(__VA_ARGS__)
#define _mm512_max_ps(...) ::wbk_emu::mm512_max_ps(__VA_ARGS__)
#define _mm512_fmadd_ps(...) ::wbk_emu::mm512_fmadd_ps(__VA_ARGS__)
#define _mm512_and_si512(...) ::wbk_emu::mm512_and_si512(__VA_ARGS__)
#define _mm512_xor_si512(...) ::wbk_emu::mm512_xor_si512(__VA_ARGS__)
#define _mm512_abs_ps(...) ::wbk_emu::mm512_abs_ps(__VA_ARGS__)
#define _mm512_add_epi32(...) ::wbk_emu::mm512_add_epi32(__VA_ARGS__)
#define _mm512_slli_epi32(...) ::wbk_emu::mm512_slli_epi32(__VA_ARGS__)
#define _mm512_castsi512_ps(...) ::wbk_emu::mm512_castsi512_ps(__VA_ARGS__)
#define _mm512_castps512_ps256(...) ::wbk_emu::mm512_castps512_ps256(__VA_ARGS__)
#define _mm512_cvtepu16_epi32(...) ::wbk_emu::mm512_cvtepu16_epi32(__VA_ARGS__)
#define _mm512_cvtph_ps(...) ::wbk_emu::mm512_cvtph_ps(__VA_ARGS__)
#define _mm512_cvtps_epi32(...) ::wbk_emu::mm512_cvtps_epi32(__VA_ARGS__)
#define _mm512_cvtsepi32_epi8(...) ::wbk_emu::mm512_cvtsepi32_epi8(__VA_ARGS__)
#define _mm512_roundscale_ps(...) ::wbk_emu::mm512_roundscale_ps(__VA_ARGS__)
#define _mm512_shuffle_f32x4(...) ::wbk_emu::mm512_shuffle_f32x4(__VA_ARGS__)
#define _mm512_dpbusd_epi32(...) ::wbk_emu::mm512_dpbusd_epi32(__VA_ARGS__)
#define _mm512_set1_epi16(...) ::wbk_emu::mm512_set1_epi16(__VA_ARGS__)
#define _mm512_abs_epi8(...) ::wbk_emu::mm512_abs_epi8(__VA_ARGS__)
#define _mm512_movepi8_mask(...) ::wbk_emu::mm512_movepi8_mask(__VA_ARGS__)
#define _mm512_mask_sub_epi8(...) ::wbk_emu::mm512_mask_sub_epi8(__VA_ARGS__)
#define _mm512_maddubs_epi16(...) ::wbk_emu::mm512_maddubs_epi16(__VA_ARGS__)
#define _mm512_madd_epi16(...) ::wbk_emu::mm512_madd_epi16(__VA_ARGS__)
#define _mm256_dpwssd_epi32(...) ::wbk_emu::mm256_dpwssd_epi32(__VA_ARGS__)
