// The GEMM's matrix-engine micro-kernels: y [M, N] = x [M, K] . w^T for bf16 (or int8) weights
// w [N, K], with x rounded to bf16 and fp32 accumulation, on AMX tiles (tdpbf16ps) or, on CPUs
// with AVX512-BF16 and no AMX (Zen 4, Cooper Lake), with vdpbf16ps; both read the same packed x
// through one driver (tasks, packing, the transposed store). At the end of the file, W8A8: per-row
// int8 weights times x quantized per token, on the AMX int8 tiles (tdpbssd).
//
// This unit is compiled into every build (native, avx2, scalar): its functions carry their
// own target attributes, so a build for a CPU without AMX still compiles and links them, and
// gemm_engine_status() decides at run time, from CPUID, the OS's enabled state (XCR0) and the
// kernel's permission (arch_prctl), whether they may run. Nothing here runs unless it said yes.
// The test build "emulated" runs them on any AVX2 CPU, their AVX-512 and AMX instructions
// written out in C++ (emulate_isa.h), so the tests check this code even where no CPU can
// (it measures no peaks).
//
// Layout. The product is computed transposed, y^T = w x^T, as linear.cpp's FMA GEMM does:
//   - the A operand is w, a task's rows copied one slice of K at a time into tile order (each
//     16-row x 32-value tile 1 KB contiguous: pack_a_panel) and read from there for each 32
//     tokens of the task's block, so the model keeps one copy of the weights, row-major, which
//     the matrix-vector kernel of batch-1 decode reads as it is;
//   - the B operand is x^T in the VNNI pairing AMX wants, [K/2][tokens][2]: x is converted to
//     bf16 once per call and written in that order, tile by tile (x is small beside w);
//   - a task owns up to kRows rows of w (balanced_task_rows) and one block of up to kTokens
//     tokens; for each KC-long slice of K its 2 x 2 register block (32 rows of w by 32
//     tokens: four C tiles, two A, two B) accumulates in tiles, and the task's y^T tile lives
//     in an fp32 buffer across slices and is written transposed into y at the end.
// The AVX512-BF16 micro-kernel uses the same packed x: a row of a tile is one pair of K for 16
// tokens, exactly a vdpbf16ps operand; each row of w contributes one pair at a time as a
// 32-bit broadcast. An 8-row x 32-token block of y^T stays in 16 registers over all of K.
// Edges: tokens are zero padded to whole tiles in the packed x, and the packed panel of w is
// zero past N and past K, so a tile never reads past either matrix; the AVX512-BF16 blocks
// repeat w's last row for rows past N (never stored) and handle an odd K's last value alone.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cache.h"
#include "kernels.h"
#include "parallel.h"
#include "simd.h"
#include "tiles.h"

namespace wbk {
namespace {

constexpr int64_t kRows = 128;      // most rows of w per task (whole 32-row blocks)
constexpr int64_t kTokens = 512;    // tokens per block of packed x (whole 32-token blocks)
constexpr int64_t kKC = 1024;       // K per slice (a multiple of kTileK)
constexpr int64_t kStreamBytes = int64_t{2} << 20;  // outputs from this size on (about a core's L2) are streamed

// -- may the matrix engine run here? ---------------------------------------------------------

constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct Status {
  bool amx_bf16 = false;
  std::string reason;
  bool avx512_bf16 = false;
  std::string avx512_reason;
};

uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// vdpbf16ps needs AVX512-BF16 and the OS's AVX-512 state; no permission is asked for.
void probe_avx512_bf16(Status& s) {
  unsigned a, b, c, d;
  __get_cpuid_count(7, 1, &a, &b, &c, &d);
  const bool bf16 = a & (1u << 5);
  __get_cpuid_count(7, 0, &a, &b, &c, &d);
  const bool avx512bw = (b & (1u << 16)) && (b & (1u << 30)) && (b & (1u << 31));
  __get_cpuid(1, &a, &b, &c, &d);
  const bool osxsave = c & (1u << 27);
  if (!bf16 || !avx512bw) {
    s.avx512_reason = "this CPU has no AVX512-BF16 (CPUID avx512_bf16 and avx512f/bw/vl not all set)";
  } else if (!osxsave || (xgetbv0() & 0xe6) != 0xe6) {
    s.avx512_reason = "the OS has not enabled the AVX-512 register state (XCR0)";
  } else {
    s.avx512_bf16 = true;
    s.avx512_reason = "AVX512-BF16 (vdpbf16ps) available";
  }
}

Status probe_amx();

Status probe() {
#if defined(WBK_EMULATE_ISA)  // the test build whose AVX-512 and AMX instructions are C++ (emulate_isa.h)
  return Status{true, "AMX bf16 tiles emulated in software (the 'emulated' test build)", true,
                "AVX512-BF16 emulated in software (the 'emulated' test build)"};
#endif
  Status s = probe_amx();
  probe_avx512_bf16(s);
  return s;
}

Status probe_amx() {
  Status s;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    s.reason = "CPUID leaf 7 is not available";
    return s;
  }
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  const bool avx512 = b & (1u << 16);
  if (!tile) {
    s.reason = "this CPU has no AMX tiles (CPUID: amx_tile not set)";
    return s;
  }
  if (!bf16 || !avx512) {
    s.reason = !bf16 ? "this CPU has AMX tiles but no AMX bf16 (CPUID: amx_bf16 not set)"
                     : "this CPU has AMX tiles but no AVX-512 (CPUID: avx512f not set)";
    return s;
  }
  unsigned a1, b1, c1, d1;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  if (!(a1 & (1u << 5))) {
    s.reason = "this CPU has AMX but no AVX512-BF16 (needed to round x to bf16)";
    return s;
  }
  __get_cpuid(1, &a, &b, &c, &d);
  if (!(c & (1u << 27))) {
    s.reason = "the OS has not enabled XSAVE (OSXSAVE clear)";
    return s;
  }
  const uint64_t xcr0 = xgetbv0();
  if ((xcr0 & 0xe6) != 0xe6) {
    s.reason = "the OS has not enabled the AVX-512 register state (XCR0)";
    return s;
  }
  if ((xcr0 & (3u << 17)) != (3u << 17)) {
    s.reason = "the OS has not enabled the AMX tile state (XCR0 bits 17-18: a kernel older than 5.16?)";
    return s;
  }
  // Linux hands out the tile data state only on request, once per process (every thread).
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    s.reason = "the kernel refused AMX (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed)";
    return s;
  }
  unsigned long mask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) != 0 || !(mask & (1ul << kXfeatureXtiledata))) {
    s.reason = "the kernel did not grant the AMX tile state";
    return s;
  }
  s.amx_bf16 = true;
  s.reason = "AMX bf16 tiles available and permitted";
  return s;
}

const Status& status() {
  static const Status s = probe();  // asked once per process
  return s;
}

std::atomic<int> g_engine{static_cast<int>(GemmEngine::kAuto)};

// -- the tile micro-kernel (block_2x2, tiles.h) and its packing ------------------------------

// Packed x for one block of `tokens` tokens starting at m0: [K tiles][token tiles][16 pairs]
// [16 tokens][2] bf16 (a token tile of one k step is 1 KB; the token tiles of a step follow
// each other), zero past M and past K.
WBK_AMX_TARGET void pack_x_block(const float* x, int64_t M, int64_t K, int64_t m0, int64_t token_tiles,
                                 int64_t k_tiles, uint16_t* dst) {
  for (int64_t jt = 0; jt < token_tiles; ++jt) {
    for (int64_t kt = 0; kt < k_tiles; ++kt) {
      const int64_t k = kt * kTileK, n = std::min<int64_t>(kTileK, K - k);
      const __mmask16 lo_mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, n)) - 1);
      const __mmask16 hi_mask = n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0;
      // Row t: token m0 + 16 jt + t rounded to bf16 (nearest even), its 32 values of K as 16
      // pairs; transposed, row p is pair p of the 16 tokens: one row of the B tile.
      __m512i r[16];
      for (int t = 0; t < 16; ++t) {
        const int64_t m = m0 + jt * 16 + t;
        if (m >= M) {
          r[t] = _mm512_setzero_si512();
          continue;
        }
        const float* row = x + m * K + k;
        const __m512 lo = n == kTileK ? _mm512_loadu_ps(row) : _mm512_maskz_loadu_ps(lo_mask, row);
        const __m512 hi = n == kTileK ? _mm512_loadu_ps(row + 16) : _mm512_maskz_loadu_ps(hi_mask, row + 16);
        r[t] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
      }
      transpose16(r);
      uint16_t* tile = dst + (kt * token_tiles + jt) * 512;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + p * 32, r[p]);
    }
  }
}

// The weights a call multiplies by: bf16 rows, or int8 rows (weight-only int8) that the tasks
// convert to bf16 one slice of K at a time (into the tile-ordered panel on AMX, into a
// row-major buffer of their own on AVX512-BF16): q as it
// is with per-row scales (exact in bf16: |q| <= 127; the scale is applied to the finished
// outputs by the caller), q times its group's scale rounded to bf16 with group scales.
struct Weights {
  const uint16_t* bf16 = nullptr;
  const int8_t* q = nullptr;
  const float* group_scale = nullptr;  // [N][ceil(K / kWeightGroup)] with grouped int8, else nullptr
  int64_t K = 0;
};

constexpr int64_t kSliceAhead = 8;  // rows of w prefetched ahead of their copy / conversion

// Values [k, k + count) of int8 row n of w in bf16, zero past count (count <= 16, inside one
// group of the scales; `groups` of them a row): q as it is with per-row scales, q times its
// group's scale with group scales.
WBK_AMX_TARGET inline __m256i int8_piece_bf16(const Weights& w, int64_t groups, int64_t n, int64_t k, int64_t count) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w.q + n * w.K + k)));
  if (w.group_scale && count > 0) v = _mm512_mul_ps(v, _mm512_set1_ps(w.group_scale[n * groups + k / kWeightGroup]));
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
}

// dst[r][0 : k1 - k0] = row n0 + r of w over [k0, k1) in bf16, for r < rows (rows ld values
// apart). k0 is a multiple of kWeightGroup, so a 16-value piece never straddles two groups.
WBK_AMX_TARGET void weight_slice(const Weights& w, int64_t n0, int64_t rows, int64_t k0, int64_t k1, uint16_t* dst,
                                 int64_t ld) {
  const int64_t K = w.K, groups = (K + kWeightGroup - 1) / kWeightGroup;
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* out = dst + r * ld;
    if (w.bf16) {
      std::memcpy(out, w.bf16 + (n0 + r) * K + k0, (k1 - k0) * 2);
      continue;
    }
    const int8_t* row = w.q + (n0 + r) * K;
    // The rows are short pieces far apart (K bytes): the hardware prefetcher does not follow
    // them, so the piece kSliceAhead rows on is asked for while this one converts.
    if (r + kSliceAhead < rows)
      for (int64_t k = k0; k < k1; k += 64) _mm_prefetch(reinterpret_cast<const char*>(row + kSliceAhead * K + k), _MM_HINT_T0);
    for (int64_t k = k0; k < k1; k += 16) {
      const int64_t count = std::min<int64_t>(16, k1 - k);
      _mm256_mask_storeu_epi16(out + (k - k0), static_cast<__mmask16>((1u << count) - 1),
                               int8_piece_bf16(w, groups, n0 + r, k, count));
    }
  }
}

// The A operand of one task's slice of K for the tiles: rows [n0, n0 + rows) of w over
// [k0, k0 + kc) in bf16 (int8 converted as weight_slice does), tile by tile:
// [16-row group][32-value step of K][16 rows][32 values], each tile 1 KB contiguous, zero past
// `rows` (up to `groups` x 16) and past K. Loaded from w in place, a tile's 16 rows lie 2K bytes
// apart: with K a power of two they all map to one set of the L1 (and few of the L2), and each
// load touches 16 pages; packed, a tile load reads 16 consecutive lines.
WBK_AMX_TARGET void pack_a_panel(const Weights& w, int64_t n0, int64_t rows, int64_t groups, int64_t k0, int64_t kc,
                                 uint16_t* dst) {
  const int64_t K = w.K, steps = kc / kTileK, n_groups = (K + kWeightGroup - 1) / kWeightGroup;
  for (int64_t r = 0; r < groups * kTileRows; ++r) {
    uint16_t* out = dst + (r / kTileRows) * steps * 512 + (r % kTileRows) * kTileK;
    if (r >= rows) {
      for (int64_t s = 0; s < steps; ++s) _mm512_storeu_si512(out + s * 512, _mm512_setzero_si512());
      continue;
    }
    // The rows are short pieces far apart: the piece kSliceAhead rows on is asked for while
    // this one is copied (the hardware prefetcher does not follow them).
    const int64_t row_bytes = w.bf16 ? 2 * K : K;
    const char* row = w.bf16 ? reinterpret_cast<const char*>(w.bf16 + (n0 + r) * K)
                             : reinterpret_cast<const char*>(w.q + (n0 + r) * K);
    if (r + kSliceAhead < rows) {
      const int64_t first = (w.bf16 ? 2 : 1) * k0, last = (w.bf16 ? 2 : 1) * std::min(K, k0 + kc);
      for (int64_t b = first; b < last; b += 64)
        _mm_prefetch(row + kSliceAhead * row_bytes + b, _MM_HINT_T0);
    }
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k = k0 + s * kTileK, n = std::clamp<int64_t>(K - k, 0, kTileK);
      uint16_t* tile_row = out + s * 512;
      if (w.bf16) {
        const __mmask32 mask = n == kTileK ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << n) - 1);
        _mm512_storeu_si512(tile_row, _mm512_maskz_loadu_epi16(mask, w.bf16 + (n0 + r) * K + k));
        continue;
      }
      for (int h = 0; h < 2; ++h) {  // two 16-value halves, zero past K
        const int64_t kh = k + 16 * h;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile_row + 16 * h),
                            int8_piece_bf16(w, n_groups, n0 + r, kh, std::clamp<int64_t>(K - kh, 0, 16)));
      }
    }
  }
}

// One pair p of K for MR rows: acc[r][col + v] += w[r, pair p] . x[pair p, token vector v] for
// the NV token vectors (16 tokens each) from bp on.
//
// block_dp: acc over pairs [p0, p1) of K (p0 a multiple of 16), then stored
// to (or added into) c (rows ldc floats apart). w: MR rows ldw values apart (clamped to `rows`:
// a short block repeats its last row, never stored) holding K's values from pair `pbase` on
// (0: whole rows; p0: a converted slice); x packed as for the tiles: pair p of token tile
// jt at xb + ((p / 16) token_tiles + jt) 256 + (p % 16) 16 dwords, so the 16 pairs of one
// tile are 64 bytes apart and the pair of the next token tile 1 KB on. Its accumulators are MR
// rows x NV token vectors (NV = 3: 48 tokens; 2: 32), or, for 16 tokens alone (NV = 1), MR
// rows x the even and the odd pairs of K, added at the end, so there are always at least two
// independent chains per row; 8 row pointers either way (16 would not fit the general registers).
template <int MR, int NV, int NC>
WBK_AMX_TARGET inline void dp_step(__m512 (&acc)[MR][NC], int col, const uint32_t* bp,
                                   const uint16_t* const (&wr)[MR], int64_t p) {
  __m512bh b[NV];
  for (int v = 0; v < NV; ++v) b[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bp + v * 256));
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    uint32_t pair;
    std::memcpy(&pair, wr[r] + 2 * p, 4);  // rows need not be 4-byte aligned
    const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
    for (int v = 0; v < NV; ++v) acc[r][col + v] = _mm512_dpbf16_ps(acc[r][col + v], a, b[v]);
  }
}

template <int MR, int NV>
WBK_AMX_TARGET void block_dp(const uint16_t* w, int64_t ldw, int64_t pbase, int64_t K, int64_t rows,
                             const uint32_t* xb, int64_t token_tiles, int64_t jt, int64_t p0, int64_t p1, float* c,
                             int64_t ldc, bool accumulate) {
  const uint16_t* wr[MR];
  for (int r = 0; r < MR; ++r) wr[r] = w + std::min<int64_t>(r, rows - 1) * ldw;
  constexpr int NC = NV < 2 ? 2 : NV;  // accumulators per row
  __m512 acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t full_end = std::min(p1, K / 2);
  int64_t p = p0;
  for (; p + 16 <= full_end; p += 16) {  // whole tiles: the 16 steps at constant offsets
    const uint32_t* bt = xb + ((p / 16) * token_tiles + jt) * 256;
#pragma GCC unroll 16
    for (int q = 0; q < 16; ++q) dp_step<MR, NV, NC>(acc, NV > 1 ? 0 : q % 2, bt + q * 16, wr, p + q - pbase);
  }
  for (; p < full_end; ++p)
    dp_step<MR, NV, NC>(acc, 0, xb + ((p / 16) * token_tiles + jt) * 256 + (p % 16) * 16, wr, p - pbase);
  if (K % 2 && p1 > K / 2) {  // the last value alone, its pair's other half zero (never read past the row)
    const uint16_t* last[MR];
    uint16_t tail[MR][2] = {};
    for (int r = 0; r < MR; ++r) {
      tail[r][0] = wr[r][K - 1 - 2 * pbase];
      last[r] = tail[r];
    }
    dp_step<MR, NV, NC>(acc, 0, xb + ((p / 16) * token_tiles + jt) * 256 + (p % 16) * 16, last, 0);
  }
  if (NV == 1)
    for (int r = 0; r < MR; ++r) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][1]);
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    for (int v = 0; v < NV; ++v) {
      if (accumulate) acc[r][v] = _mm512_add_ps(acc[r][v], _mm512_loadu_ps(cr + 16 * v));
      _mm512_storeu_ps(cr + 16 * v, acc[r][v]);
    }
  }
}

// The AVX512-BF16 blocks: 8 rows of w x 48 tokens (24 accumulators, 3 x vectors and a broadcast:
// 28 of the 32 registers; 11 loads per 24 vdpbf16ps, where 8 x 32 needs 10 per 16; measured
// faster on the bundled model's and Llama-2-7B's shapes), then a last 32 or 16 tokens as 8 x 32
// or 8 x 16, so no vdpbf16ps is spent on zero padding past the tokens' last 16.
constexpr int kDpRows = 8;
static_assert(kRows % kDpRows == 0, "a task's rows are whole blocks");

// Rows of w per task: at most kRows, in whole blocks of `align` rows, and as many tasks as make
// every thread's share the same (at::parallel_for gives each thread one contiguous run of
// tasks). Fixed kRows-row tasks would give 576 rows (the bundled model's o_proj and down) to
// two threads as 384 and 192 whenever the tokens fit one block: the call then takes as long
// as the larger share.
int64_t balanced_task_rows(int64_t N, int64_t m_blocks, int64_t align) {
  const int64_t threads = std::max(1, at::get_num_threads());
  int64_t n_blocks = (N + kRows - 1) / kRows;
  while ((n_blocks * m_blocks) % threads && n_blocks < (N + align - 1) / align) ++n_blocks;
  const int64_t rows = (N + n_blocks - 1) / n_blocks;
  return (rows + align - 1) / align * align;
}

// The AVX512-BF16 tasks. K is cut into slices: within a slice, every kDpRows-row block of the
// task's rows passes over each 48-token piece of packed x in turn. A task's partial sums live
// in its fp32 buffer across slices; then the transposed store.
// Pairs of K per slice: the task's rows of w (kRows x 4 bytes a pair) and one piece of x (48 x 4
// bytes a pair) in a quarter of the L2, so both stay there with room for the partial sums and
// the next rows. Slices sized for the L1d instead (the piece of x alone in two thirds of it)
// measured 3-7% slower on the bundled model's shapes and Llama-2-7B's: each slice costs a
// load and store of every partial sum, and the piece of x streams from the L2 at the rate the
// micro-kernel needs it.
int64_t dp_pairs_per_slice() {
  static const int64_t pairs = std::max<int64_t>(64, l2_bytes() / 4 / ((kRows + 48) * 4) / 16 * 16);
  return pairs;
}

WBK_AMX_TARGET void run_tasks_dp(const Weights& w, float* y, int64_t M, int64_t N, int64_t task_rows,
                                 int64_t tokens_per_block,
                                 int64_t token_tiles, int64_t block_elems, int64_t n_blocks, const uint16_t* xp,
                                 bool stream, int64_t begin, int64_t end) {
  const int64_t K = w.K, pairs = (K + 1) / 2, slice = dp_pairs_per_slice();
  Scratch cs(0, kRows * tokens_per_block);
  float* ct = cs.data();
  Scratch ws(1, w.q ? (kRows * 2 * slice + 1) / 2 : 0);  // int8: the slice converted to bf16
  uint16_t* wbuf = reinterpret_cast<uint16_t*>(ws.data());
  for (int64_t t = begin; t < end; ++t) {
    const int64_t nb = t % n_blocks, mb = t / n_blocks;
    const int64_t n0 = nb * task_rows, rows = std::min(task_rows, N - n0);
    const int64_t m0 = mb * tokens_per_block, tokens = std::min(tokens_per_block, M - m0);
    const uint32_t* xb = reinterpret_cast<const uint32_t*>(xp + mb * block_elems);
    for (int64_t p0 = 0; p0 < pairs; p0 += slice) {
      const int64_t p1 = std::min(pairs, p0 + slice);
      const uint16_t* rows_w = w.bf16 ? w.bf16 + n0 * K : wbuf;
      const int64_t ldw = w.bf16 ? K : 2 * slice, pbase = w.bf16 ? 0 : p0;
      if (!w.bf16) weight_slice(w, n0, rows, 2 * p0, std::min(2 * p1, K), wbuf, ldw);
      const int64_t used_tiles = (tokens + 15) / 16;  // 16-token tiles holding a token
      for (int64_t jt = 0; jt < used_tiles;) {  // 48 tokens at a time, then 32 or 16
        const int64_t left = std::min<int64_t>(3, used_tiles - jt);
        for (int64_t r0 = 0; r0 < rows; r0 += kDpRows) {
          const uint16_t* wb = rows_w + r0 * ldw;
          float* cb = ct + r0 * tokens_per_block + jt * 16;
          if (left >= 3)
            block_dp<kDpRows, 3>(wb, ldw, pbase, K, rows - r0, xb, token_tiles, jt, p0, p1, cb, tokens_per_block, p0 > 0);
          else if (left == 2)
            block_dp<kDpRows, 2>(wb, ldw, pbase, K, rows - r0, xb, token_tiles, jt, p0, p1, cb, tokens_per_block, p0 > 0);
          else
            block_dp<kDpRows, 1>(wb, ldw, pbase, K, rows - r0, xb, token_tiles, jt, p0, p1, cb, tokens_per_block, p0 > 0);
        }
        jt += left;
      }
    }
    store_transposed(ct, tokens_per_block, rows, tokens, y + m0 * N + n0, N, stream);
  }
  if (stream) _mm_sfence();
}

// -- few tokens: dot products along K, no broadcasts -----------------------------------------
//
// With a handful of tokens (batched decode) the block above spends one broadcast of w per
// vdpbf16ps and pads the tokens to 16. Here a vector holds 32 consecutive values of K instead:
// one load of a row of w (as stored) and one of a row of x (rounded to bf16 once per call, K
// zero-padded to whole vectors) feed one vdpbf16ps whose 16 lanes each sum one pair of K; a
// block of kDotRows rows x kDotTokens tokens keeps 16 such accumulators, each reduced across
// its lanes once at the end of K. Loads per vdpbf16ps: (rows + tokens) / (rows x tokens), no
// broadcasts, and no lane is spent on a token that is not there.
constexpr int kDotRows = 4, kDotTokens = 4;
// Up to this many tokens the dot kernel runs for bf16 weights: it re-reads each block of w
// once per kDotTokens tokens, and measured against the blocks above at Llama-2-7B's shapes
// (2 to 16 tokens, interleaved) it was ahead up to 4 and behind from 8.
constexpr int64_t kDotMaxTokens = 4;

template <int R, int T>
WBK_AMX_TARGET void dot_block(const uint16_t* w, int64_t K, int64_t rows, const uint16_t* xb, int64_t kp,
                              int64_t tokens, float* y, int64_t N) {
  const uint16_t* wr[R];
  const uint16_t* xr[T];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(r, rows - 1) * K;
  for (int t = 0; t < T; ++t) xr[t] = xb + std::min<int64_t>(t, tokens - 1) * kp;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    // the last vector of a row is masked, so a row of w is never read past its end
    const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh a[R], b[T];
    for (int r = 0; r < R; ++r) a[r] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, wr[r] + k));
    for (int t = 0; t < T; ++t) b[t] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr[t] + k));
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a[r], b[t]);
  }
  // Reduced at constant indices (so the accumulators stay in registers), stored where they exist.
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      const float sum = _mm512_reduce_add_ps(acc[r][t]);
      if (r < rows && t < tokens) y[t * N + r] = sum;
    }
  }
}

WBK_AMX_TARGET void gemm_dot_bf16(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t kp = (K + 31) / 32 * 32;
  uint16_t* xb = reinterpret_cast<uint16_t*>(Scratch(Scratch::kSlots - 1, (M * kp + 1) / 2).data());
  for (int64_t m = 0; m < M; ++m) {  // x rounded to bf16 (nearest even, as for the tiles), zero past K
    for (int64_t k = 0; k < kp; k += 32) {
      const int64_t n = std::clamp<int64_t>(K - k, 0, 32);
      const __mmask16 lo = static_cast<__mmask16>((1u << std::min<int64_t>(16, n)) - 1);
      const __mmask16 hi = static_cast<__mmask16>((1u << std::max<int64_t>(0, n - 16)) - 1);
      const __m512 a = _mm512_maskz_loadu_ps(lo, x + m * K + k), b = _mm512_maskz_loadu_ps(hi, x + m * K + k + 16);
      _mm512_storeu_si512(xb + m * kp + k, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
    }
  }
  const int64_t blocks = (N + kDotRows - 1) / kDotRows;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kDotRows, rows = std::min<int64_t>(kDotRows, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kDotTokens) {
        const int64_t tokens = std::min<int64_t>(kDotTokens, M - m0);
        const uint16_t* xt = xb + m0 * kp;
        float* yt = y + m0 * N + n0;
        switch (tokens) {  // the token count is a template parameter: the accumulators stay in registers
          case 1: dot_block<kDotRows, 1>(w + n0 * K, K, rows, xt, kp, tokens, yt, N); break;
          case 2: dot_block<kDotRows, 2>(w + n0 * K, K, rows, xt, kp, tokens, yt, N); break;
          case 3: dot_block<kDotRows, 3>(w + n0 * K, K, rows, xt, kp, tokens, yt, N); break;
          default: dot_block<kDotRows, kDotTokens>(w + n0 * K, K, rows, xt, kp, tokens, yt, N); break;
        }
      }
    }
  });
}

struct Shape {
  const float* x;
  Weights w;
  float* y;
  int64_t M, N, K, kp, task_rows, tokens_per_block, token_tiles, block_elems, n_blocks;
  const uint16_t* xp;
  bool stream;
};

// Tasks [begin, end) of one thread: its tiles configured once, released at the end.
WBK_AMX_TARGET void run_tasks_amx(const Shape& s, int64_t begin, int64_t end) {
  const int64_t N = s.N, M = s.M, kp = s.kp, tokens_per_block = s.tokens_per_block;
  const int64_t token_tiles = s.token_tiles, n_blocks = s.n_blocks, task_rows = s.task_rows;
  configure_tiles();
  Scratch cs(0, kRows * tokens_per_block), ws(1, (kRows * kKC + 1) / 2);
  float* ct = cs.data();
  uint16_t* wpad = reinterpret_cast<uint16_t*>(ws.data());
  for (int64_t t = begin; t < end; ++t) {
    const int64_t nb = t % n_blocks, mb = t / n_blocks;
    const int64_t n0 = nb * task_rows, rows = std::min(task_rows, N - n0);
    const int64_t m0 = mb * tokens_per_block, tokens = std::min(tokens_per_block, M - m0);
    const int64_t used_tiles = (tokens + 31) / 32 * 2;  // token tiles this block computes
    const int64_t row_blocks = (rows + 31) / 32;
    const uint16_t* xb = s.xp + mb * s.block_elems;
    for (int64_t k0 = 0; k0 < kp; k0 += kKC) {
      const int64_t kc = std::min(kKC, kp - k0), steps = kc / kTileK;
      pack_a_panel(s.w, n0, rows, 2 * row_blocks, k0, kc, wpad);
      const uint16_t* bk = xb + (k0 / kTileK) * token_tiles * 512;
      for (int64_t j = 0; j < used_tiles; j += 2)
        for (int64_t r = 0; r < row_blocks; ++r) {
          const char* top = reinterpret_cast<const char*>(wpad + 2 * r * steps * 512);
          const TileA a{top, top + steps * 1024, 64, 1024};
          block_2x2(kc, a, bk + j * 512, token_tiles * 1024, ct + r * 32 * tokens_per_block + j * 16, tokens_per_block,
                    k0 > 0);
        }
    }
    store_transposed(ct, tokens_per_block, rows, tokens, s.y + m0 * N + n0, N, s.stream);
  }
  if (s.stream) _mm_sfence();
  _tile_release();
}

// Where a call's packed x goes (small beside w): up to 16 MB in the calling thread's last
// scratch slot (kept for the next call; the tasks use the first ones), a long prefill's
// allocated for this call only, into `owned`.
void* packed_x_buffer(int64_t bytes, std::unique_ptr<float[]>& owned) {
  const int64_t floats = (bytes + 3) / 4;
  if (floats <= (int64_t{1} << 22)) return Scratch(Scratch::kSlots - 1, floats).data();  // outlives the handle
  owned.reset(new float[static_cast<size_t>(floats)]);
  return owned.get();
}

void gemm_bf16(const float* x, const Weights& w, float* y, int64_t M, int64_t N, bool tiles) {
  const int64_t K = w.K;
  if (!tiles && w.bf16 && M <= kDotMaxTokens) return gemm_dot_bf16(x, w.bf16, y, M, N, K);
  const int64_t k_tiles = (K + kTileK - 1) / kTileK;
  const int64_t kp = k_tiles * kTileK;  // K padded to whole tiles
  // As few blocks as hold M at kTokens each, all the same size in whole 32-token blocks (so
  // that the threads' shares of whole tasks are equal; see TokenBlocks in linear.cpp, whose
  // blocks may differ by one vector where these share one packed-x layout).
  const int64_t m_blocks = (M + kTokens - 1) / kTokens;
  const int64_t tokens_per_block = ((M + m_blocks - 1) / m_blocks + 31) / 32 * 32;
  const int64_t token_tiles = tokens_per_block / 16;
  const int64_t block_elems = k_tiles * token_tiles * 512;  // bf16 values of one packed block
  const int64_t task_rows = balanced_task_rows(N, m_blocks, tiles ? 32 : kDpRows);
  const int64_t n_blocks = (N + task_rows - 1) / task_rows;

  std::unique_ptr<float[]> owned;
  uint16_t* xp = reinterpret_cast<uint16_t*>(packed_x_buffer(m_blocks * block_elems * 2, owned));
  at::parallel_for(0, m_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t mb = begin; mb < end; ++mb)
      pack_x_block(x, M, K, mb * tokens_per_block, token_tiles, k_tiles, xp + mb * block_elems);
  });

  // An output larger than a core's L2 is mostly evicted before anything reads it again: its lines
  // are written with non-temporal stores rather than each read in first (measured faster on the
  // prefill shapes against torch in the same run); a small one (batched decode) stays cached.
  const bool stream = M * N * 4 >= kStreamBytes;
  // Tasks: token block outer, so a thread's consecutive tasks share one block of packed x.
  if (!tiles) {
    at::parallel_for(0, n_blocks * m_blocks, 1, [&](int64_t begin, int64_t end) {
      run_tasks_dp(w, y, M, N, task_rows, tokens_per_block, token_tiles, block_elems, n_blocks, xp, stream, begin, end);
    });
    return;
  }
  const Shape shape{x, w, y, M, N, K, kp, task_rows, tokens_per_block, token_tiles, block_elems, n_blocks, xp, stream};
  at::parallel_for(0, n_blocks * m_blocks, 1, [&](int64_t begin, int64_t end) { run_tasks_amx(shape, begin, end); });
}

// -- W8A8: per-row int8 weights x per-token int8 activations on the AMX int8 tiles ------------
//
// x is quantized per token (row m of x): s[m] = max|x[m]| / 127 and q[m][k] = x[m][k] times
// 127 / max|x[m]|, rounded to nearest even (so |q| <= 127). tdpbssd multiplies the int8 weights
// (the A operand: 16 rows x 64 values of K a tile, copied into tile order per task and slice of
// K, as pack_a_panel does for bf16) by q (the B operand: 16 quads of K x 16 tokens x 4 values,
// the order tdpbssd reads) with exact int32 sums, and the finished sums become
// y^T[n][m] = sum * s[m]; the caller applies the weights' row scales, as for the bf16 engines.
// K is zero padded to whole 64-value tiles in both operands. No sum can overflow int32: each is
// at most 128 x 127 x K in size (an int8 weight may be -128), below 2^31 up to K = kW8A8MaxK;
// a longer K is refused. A token whose x is not finite gets a non-finite scale, so its outputs
// are not finite either (never silently finite).
constexpr int64_t kTileK8 = 64;    // int8 values of K per tile row
constexpr int64_t kKC8 = 2 * kKC;  // K per slice: the same bytes of w as a bf16 slice
constexpr int64_t kW8A8MaxK = (int64_t{1} << 31) / (128 * 127);

// inv[m] = 127 / max|x[m]| (0 for a row of zeros) and s[m] = max|x[m]| / 127 for rows [m0, m1).
WBK_AMX_TARGET void token_scales(const float* x, int64_t K, int64_t m0, int64_t m1, float* inv, float* s) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* row = x + m * K;
    // max|x| lane by lane, and x * 0 summed: NaN exactly when some x is not finite (MAXPS
    // would pass a NaN over rather than keep it)
    __m512 mx = _mm512_setzero_ps(), nonfinite = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, K - k)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(mask, row + k);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
      nonfinite = _mm512_add_ps(nonfinite, _mm512_mul_ps(v, _mm512_setzero_ps()));
    }
    alignas(64) float lanes[16];
    _mm512_storeu_ps(lanes, mx);
    float amax = 0.0f;
    for (float v : lanes) amax = std::max(amax, v);
    if (std::isnan(_mm512_reduce_add_ps(nonfinite))) amax = std::numeric_limits<float>::quiet_NaN();
    // A row so small that 127 / max|x| overflows (max|x| < 127 / FLT_MAX) counts as zeros.
    const float up = 127.0f / amax;
    s[m] = std::isfinite(up) || !std::isfinite(amax) ? amax / 127.0f : 0.0f;
    inv[m] = amax > 0.0f && std::isfinite(up) ? up : 0.0f;
  }
}

// Packed q for one block of tokens from m0: [K / 64 steps][token tiles][16 quads][16 tokens][4],
// zero past M and past K.
WBK_AMX_TARGET void quantize_x_block(const float* x, int64_t M, int64_t K, int64_t m0, int64_t token_tiles,
                                          int64_t k_steps, const float* inv, int8_t* dst) {
  for (int64_t jt = 0; jt < token_tiles; ++jt) {
    for (int64_t ks = 0; ks < k_steps; ++ks) {
      const int64_t k = ks * kTileK8;
      // Row t: token m0 + 16 jt + t's 64 values of K as 16 quads; transposed, row p is quad p
      // of the 16 tokens: one row of the B tile.
      __m512i r[16];
      for (int t = 0; t < 16; ++t) {
        const int64_t m = m0 + jt * 16 + t;
        if (m >= M) {
          r[t] = _mm512_setzero_si512();
          continue;
        }
        const __m512 scale = _mm512_set1_ps(inv[m]);
        alignas(64) int8_t row[kTileK8];
        for (int c = 0; c < 4; ++c) {
          const int64_t n = std::clamp<int64_t>(K - k - 16 * c, 0, 16);
          const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
          const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + m * K + k + 16 * c), scale);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 16 * c), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
        }
        r[t] = _mm512_loadu_si512(row);
      }
      transpose16(r);
      int8_t* tile = dst + (ks * token_tiles + jt) * 1024;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + p * 64, r[p]);
    }
  }
}

// pack_a_panel for int8 weights on the int8 tiles: rows [n0, n0 + rows) of w over [k0, k0 + kc)
// as [16-row group][64-value step][16 rows][64 values], zero past `rows` and past K.
WBK_AMX_TARGET void pack_a_panel_int8(const int8_t* w, int64_t K, int64_t n0, int64_t rows, int64_t groups,
                                           int64_t k0, int64_t kc, int8_t* dst) {
  const int64_t steps = kc / kTileK8;
  for (int64_t r = 0; r < groups * kTileRows; ++r) {
    int8_t* out = dst + (r / kTileRows) * steps * 1024 + (r % kTileRows) * kTileK8;
    if (r >= rows) {
      for (int64_t s = 0; s < steps; ++s) _mm512_storeu_si512(out + s * 1024, _mm512_setzero_si512());
      continue;
    }
    const int8_t* row = w + (n0 + r) * K;
    if (r + kSliceAhead < rows)  // the piece kSliceAhead rows on (as pack_a_panel)
      for (int64_t b = k0; b < std::min(K, k0 + kc); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + kSliceAhead * K + b), _MM_HINT_T0);
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k = k0 + s * kTileK8, n = std::clamp<int64_t>(K - k, 0, kTileK8);
      const __mmask64 mask = n == kTileK8 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
      _mm512_storeu_si512(out + s * 1024, _mm512_maskz_loadu_epi8(mask, row + k));
    }
  }
}

struct ShapeW8A8 {
  const int8_t* w;
  float* y;
  int64_t M, N, K, kp, task_rows, tokens_per_block, token_tiles, block_bytes, n_blocks;
  const int8_t* xq;  // packed q, block after block
  const float* s;    // per-token scales, 0 past M
  bool stream;
};

// Tasks [begin, end) of one thread, as run_tasks_amx: the int32 sums of a task live in its
// buffer across slices of K, then become fp32 (times each token's scale) in place before the
// transposed store.
WBK_AMX_TARGET void run_tasks_w8a8(const ShapeW8A8& s, int64_t begin, int64_t end) {
  const int64_t tokens_per_block = s.tokens_per_block, token_tiles = s.token_tiles;
  configure_tiles();
  Scratch cs(0, kRows * tokens_per_block), ws(1, (kRows * kKC8 + 3) / 4);
  int32_t* ct = reinterpret_cast<int32_t*>(cs.data());
  float* cf = cs.data();
  int8_t* wpad = reinterpret_cast<int8_t*>(ws.data());
  for (int64_t t = begin; t < end; ++t) {
    const int64_t nb = t % s.n_blocks, mb = t / s.n_blocks;
    const int64_t n0 = nb * s.task_rows, rows = std::min(s.task_rows, s.N - n0);
    const int64_t m0 = mb * tokens_per_block, tokens = std::min(tokens_per_block, s.M - m0);
    const int64_t used_tiles = (tokens + 31) / 32 * 2;
    const int64_t row_blocks = (rows + 31) / 32;
    const int8_t* xb = s.xq + mb * s.block_bytes;
    for (int64_t k0 = 0; k0 < s.kp; k0 += kKC8) {
      const int64_t kc = std::min(kKC8, s.kp - k0), steps = kc / kTileK8;
      pack_a_panel_int8(s.w, s.K, n0, rows, 2 * row_blocks, k0, kc, wpad);
      const int8_t* bk = xb + (k0 / kTileK8) * token_tiles * 1024;
      for (int64_t j = 0; j < used_tiles; j += 2)
        for (int64_t r = 0; r < row_blocks; ++r) {
          const int8_t* top = wpad + 2 * r * steps * 1024;
          const TileA a{reinterpret_cast<const char*>(top), reinterpret_cast<const char*>(top + steps * 1024), 64, 1024};
          block_2x2<true>(kc, a, bk + j * 1024, token_tiles * 1024, ct + r * 32 * tokens_per_block + j * 16,
                          tokens_per_block, k0 > 0);
        }
    }
    for (int64_t r = 0; r < row_blocks * 32; ++r)  // whole 16-row blocks: store_transposed reads them
      for (int64_t m = 0; m < used_tiles * 16; m += 16) {
        const int64_t i = r * tokens_per_block + m;
        const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(ct + i));
        _mm512_storeu_ps(cf + i, _mm512_mul_ps(v, _mm512_loadu_ps(s.s + m0 + m)));
      }
    store_transposed(cf, tokens_per_block, rows, tokens, s.y + m0 * s.N + n0, s.N, s.stream);
  }
  if (s.stream) _mm_sfence();
  _tile_release();
}

void gemm_w8a8(const float* x, const int8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (K > kW8A8MaxK)
    throw std::invalid_argument("amx_int8: rows of K = " + std::to_string(K) + " values are longer than " +
                                std::to_string(kW8A8MaxK) + ", the most whose int32 sums cannot overflow; "
                                "set_gemm_engine('amx_bf16') runs them");
  const int64_t k_steps = (K + kTileK8 - 1) / kTileK8, kp = k_steps * kTileK8;
  // Token blocks and tasks as gemm_bf16's.
  const int64_t m_blocks = (M + kTokens - 1) / kTokens;
  const int64_t tokens_per_block = ((M + m_blocks - 1) / m_blocks + 31) / 32 * 32;
  const int64_t token_tiles = tokens_per_block / 16;
  const int64_t block_bytes = k_steps * token_tiles * 1024;
  const int64_t task_rows = balanced_task_rows(N, m_blocks, 32);
  const int64_t n_blocks = (N + task_rows - 1) / task_rows;

  std::vector<float> inv(M), scale(m_blocks * tokens_per_block, 0.0f);
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) { token_scales(x, K, begin, end, inv.data(), scale.data()); });
  std::unique_ptr<float[]> owned;
  int8_t* xq = reinterpret_cast<int8_t*>(packed_x_buffer(m_blocks * block_bytes, owned));
  at::parallel_for(0, m_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t mb = begin; mb < end; ++mb)
      quantize_x_block(x, M, K, mb * tokens_per_block, token_tiles, k_steps, inv.data(), xq + mb * block_bytes);
  });
  const ShapeW8A8 shape{w, y, M, N, K, kp, task_rows, tokens_per_block, token_tiles, block_bytes, n_blocks,
                        xq, scale.data(), M * N * 4 >= kStreamBytes};
  at::parallel_for(0, n_blocks * m_blocks, 1, [&](int64_t begin, int64_t end) { run_tasks_w8a8(shape, begin, end); });
}


}  // namespace

GemmEngine gemm_engine() {
  const auto chosen = static_cast<GemmEngine>(g_engine.load(std::memory_order_relaxed));
  if (chosen != GemmEngine::kAuto) return chosen;
  // auto: the tiles where they may run, in a build for an AVX-512 CPU. The AVX2 and scalar
  // builds stand for CPUs without AMX and stay on FMAs unless asked.
#if defined(WBK_ISA_AVX512)
  return status().amx_bf16 ? GemmEngine::kAmxBf16 : status().avx512_bf16 ? GemmEngine::kAvx512Bf16 : GemmEngine::kFma;
#else
  return GemmEngine::kFma;
#endif
}

GemmEngine gemm_engine_for(WeightDtype dtype) {
  // fp32 weights: the exact path. Block-quantized ones (blocks.h) are dequantized to fp32 slices
  // for the FMA GEMM: their values are exact there, where a bf16 engine would round them.
  if (dtype == WeightDtype::kFloat32 || is_block(dtype)) return GemmEngine::kFma;
  const GemmEngine engine = gemm_engine();
  if (engine != GemmEngine::kAmxInt8) return engine;
  return dtype == WeightDtype::kInt8 ? GemmEngine::kAmxInt8 : GemmEngine::kAmxBf16;  // W8A8: per-row int8 only
}

bool set_gemm_engine(GemmEngine engine, std::string* why_not) {
  if (engine == GemmEngine::kAmxBf16 && !status().amx_bf16) {
    if (why_not) *why_not = status().reason;
    return false;
  }
  if (engine == GemmEngine::kAvx512Bf16 && !status().avx512_bf16) {
    if (why_not) *why_not = status().avx512_reason;
    return false;
  }
  if (engine == GemmEngine::kAmxInt8 && !amx_int8_available(why_not)) return false;
  g_engine.store(static_cast<int>(engine), std::memory_order_relaxed);
  return true;
}

bool amx_bf16_available(std::string* reason) {
  if (reason) *reason = status().reason;
  return status().amx_bf16;
}

bool avx512_bf16_available(std::string* reason) {
  if (reason) *reason = status().avx512_reason;
  return status().avx512_bf16;
}

void linear_gemm_bf16(GemmEngine engine, const float* x, const uint16_t* w, float* y, int64_t M, int64_t N,
                      int64_t K) {
  gemm_bf16(x, Weights{w, nullptr, nullptr, K}, y, M, N, engine == GemmEngine::kAmxBf16);
}

void linear_gemm_w8a8(const float* x, const int8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  gemm_w8a8(x, w, y, M, N, K);
}

void linear_gemm_int8_bf16(GemmEngine engine, const float* x, const int8_t* w, const float* group_scale, float* y,
                           int64_t M, int64_t N, int64_t K) {
  gemm_bf16(x, Weights{nullptr, w, group_scale, K}, y, M, N, engine == GemmEngine::kAmxBf16);
}

// The matrix engine's peak: independent tdpbf16ps on tiles already loaded, on every thread.
namespace {
// Four independent tile products per iteration on tiles already loaded (zeros): tdpbssd
// (int8 x int8 -> int32) with Int8, else tdpbf16ps. The matrix engine's peak on one thread.
template <bool Int8>
WBK_AMX_TARGET double tile_loop_thread(int64_t iterations) {
  configure_tiles();
  alignas(64) static const uint8_t zeros[1024] = {};
  _tile_loadd(4, zeros, 64);
  _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64);
  _tile_loadd(7, zeros, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iterations; ++i) {
    if constexpr (Int8) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) int32_t sink[256];  // kept, so the loop is not optimised away
  _tile_stored(0, sink, 64);
  _tile_release();
  return sink[0];
}
}  // namespace

namespace {
WBK_AMX_TARGET double dp_loop_thread(int64_t iterations) {
  constexpr int kChains = 16;  // independent accumulators: more than vdpbf16ps' latency x throughput
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f803f80));  // (1.0, 1.0)
  const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x00010001));  // tiny: no overflow
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  return _mm512_reduce_add_ps(sum);
}
}  // namespace

// Run `loop(iterations)` once on every torch thread; the FLOPs all of them executed.
template <typename Loop>
double on_every_thread(int64_t iterations, double flops_per_iteration, Loop loop) {
#if defined(WBK_EMULATE_ISA)
  return 0.0;  // the test build's emulated instructions: their speed is no peak
#endif
  std::atomic<int> threads{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      volatile double sink = loop(iterations);  // kept, so the loop is not optimised away
      (void)sink;
      threads.fetch_add(1);
    }
  });
  return static_cast<double>(threads.load()) * static_cast<double>(iterations) * flops_per_iteration;
}

double avx512_bf16_loop(int64_t iterations_per_thread) {
  if (!status().avx512_bf16) return 0.0;
  // Each vdpbf16ps: 16 lanes, 2 products each, 2 FLOPs a product; 16 chains per iteration.
  return on_every_thread(iterations_per_thread, 16.0 * 16 * 2 * 2, dp_loop_thread);
}

namespace {
bool amx_int8_cpu() {
#if defined(WBK_EMULATE_ISA)
  return true;
#endif
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
}
}  // namespace

bool amx_int8_available(std::string* reason) {
  if (!status().amx_bf16) {
    if (reason) *reason = status().reason;  // the tiles themselves may not run
    return false;
  }
  const bool ok = amx_int8_cpu();
#if defined(WBK_EMULATE_ISA)
  if (reason) *reason = "AMX int8 tiles emulated in software (the 'emulated' test build)";
#else
  if (reason) *reason = ok ? "AMX int8 tiles available and permitted" : "this CPU has AMX bf16 but no AMX int8";
#endif
  return ok;
}

double amx_int8_loop(int64_t iterations_per_thread) {
  if (!amx_int8_available(nullptr)) return 0.0;
  // Each tdpbssd: 16 x 16 outputs, 64 products each, 2 ops a product; 4 per iteration.
  return on_every_thread(iterations_per_thread, 4.0 * 16 * 16 * 64 * 2, tile_loop_thread<true>);
}

double amx_bf16_loop(int64_t iterations_per_thread) {
  if (!status().amx_bf16) return 0.0;
  // Each tdpbf16ps: 16 x 16 outputs, 32 products each, 2 FLOPs a product; 4 per iteration.
  return on_every_thread(iterations_per_thread, 4.0 * 16 * 16 * 32 * 2, tile_loop_thread<false>);
}

}  // namespace wbk
