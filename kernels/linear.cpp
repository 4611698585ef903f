// Linear layers y = x W^T with fp32 activations and fp32, bf16 or int8 weights (int8: one
// scale per output row, applied to each finished output), accumulating in fp32.
//
// Layout: x [M, K] fp32, w [N, K] fp32 or bf16 (torch's nn.Linear layout), y [M, N] fp32.
// Two kernels, chosen on M against the measured crossover for the weight dtype
// (matvec_max_rows below; bindings.cpp's `matvec_max_rows` argument overrides it):
//
// linear_matvec, for a few rows (decode at batch 1-4): memory-bound on the weight bytes.
//   Parallel split: blocks of 16 rows of W, one contiguous range of blocks per thread.
//   Within a block, K is cut into 1024-element chunks (whole rows up to 4 rows of x); for each
//   chunk, four W rows are widened to fp32 in registers and multiplied with a block of rows
//   of x at a time (4, or 2 on AVX2 for fp32 and int8 weights: kMatvecMB), so every weight
//   byte is read from memory once per call and again from cache once per further block of
//   x rows. With fewer than 4 rows of x, short rows may instead be read one after another
//   (serial_dot). The row order and the software prefetch of short row chunks are measured
//   per host (MatvecPrefetch, workbench/kernels/prefetch.py).
//
// linear_gemm, for more rows (batched decode, prefill): compute-bound. It computes
//   y^T = W x^T with a register-blocked micro-kernel whose broadcast operand is W and whose
//   vector operand is x^T, so W never needs transposing, only widening:
//   - x is transposed once per call into blocks of up to MC tokens (zero padded), each cut
//     into panels [K][2 W] of tokens, so a micro-tile's vector operand is contiguous;
//   - K is cut into panels whose block of x^T fits the L2 (panel_length), one parallel pass
//     over all tasks each: the first pass writes y, the later ones add to it;
//   - a task owns NB rows of W and one block of tokens; for each KC-long slice of K it
//     widens its NB x KC slice of W into an fp32 buffer (L1-sized, rows kKC apart), or,
//     for fp32 W and a task of NB whole rows, reads the slice where it is (rows K apart):
//     copying it cost a fifth of a 90-token product at the bundled model's shapes. Not
//     when the rows are a whole number of L1 ways apart (K = 1024, 2048, 4096, 14336 ...):
//     then every row's slice falls into the same few L1 sets, the micro-kernel's broadcasts
//     miss L1 on every new line, and copying the slice measured faster (in_place_fits);
//   - the micro-kernel keeps an MR x (NV W) tile of y^T in registers: per step of K one
//     or two vector loads of x^T and MR broadcasts of W feed MR x NV FMAs. NV = 2 with
//     MR = kGemmMR for token blocks wider than one vector, NV = 1 with twice the rows for
//     the last (or only) vector of tokens, so batch 16 decode wastes no lanes;
//   - the task's y^T tile, accumulated over the K slices in a small buffer, is written
//     transposed into y.
//   Vectorizing over output features instead (x broadcast, W transposed per task into
//   panels of whole vectors of features, gemm.h's micro-kernel) wastes no lanes on a token
//   count that is not whole vectors; it measured faster on a lone product of a prompt's
//   shape but no faster inside a prefill, where the transposing reads W from memory, so it
//   is not here. Weights packed that way at load would remove the transposing.
#include <algorithm>
#include <atomic>
#include <memory>
#include <type_traits>

#include "blocks.h"
#include "cache.h"
#include "gemm.h"
#include "kernels.h"
#include "parallel.h"
#include "prefetch.h"
#include "simd.h"
#include "transpose.h"

namespace wbk {
namespace {

constexpr int W = VecF::W;
constexpr int64_t kRowsPerTask = 16;
// The calling thread's scratch for what a call prepares before its tasks run (the GEMM's x^T,
// the bf16 matrix-vector kernel's permuted x), apart from the tasks' slots.
constexpr int kCallerSlot = Scratch::kSlots - 1;
// Software prefetch in the matrix-vector kernel: the rows about g_matvec_prefetch[T].bytes
// further on, only for row chunks of at most its max_chunk_bytes (short chunks are where the
// hardware prefetcher falls behind), with its hint as a template argument (the prefetch
// instruction takes it as a constant). Distance, hint and cut-off are measured per host and
// weight type (prefetch.h, workbench/hw/prefetch.py), not constants from one machine.
constexpr int64_t kChunk = 1024;  // K elements per chunk (a multiple of the int8 weight group)

// y[m][j] += x_m . w_j over one K-chunk, for MB rows of x and four rows of W: MB x 4
// accumulators, so each loaded (and widened) W vector feeds MB FMAs and each x vector 4.
// Grouped int8 weights (kGroup values per scale): gs[j] points at row j's scales for this
// chunk (the chunk starts on a group boundary, and W divides kGroup, so no vector straddles
// two groups); nullptr: plain weights.
constexpr int64_t kGroup = kWeightGroup;

template <typename T>
inline VecF load_w(const T* p, const float* gs, int64_t k) {
  const VecF v = Load<T>::full(p + k);
  return gs ? v * VecF::set1(gs[k / kGroup]) : v;
}

template <typename T>
inline VecF load_w_part(const T* p, const float* gs, int64_t k, int n) {
  const VecF v = Load<T>::part(p + k, n);
  return gs ? v * VecF::set1(gs[k / kGroup]) : v;
}

template <typename T, int MB>
inline void block_dot(const float* x, int64_t ldx, const T* const* w, int64_t kc, float* y, int64_t ldy, int nr,
                      const float* const* gs = nullptr) {
  VecF acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = VecF::zero();
  int64_t k = 0;
  for (; k + W <= kc; k += W) {
    VecF wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = load_w(w[j], gs ? gs[j] : nullptr, k);
    for (int m = 0; m < MB; ++m) {
      const VecF xv = VecF::load(x + m * ldx + k);
      for (int j = 0; j < 4; ++j) acc[m][j] = fmadd(xv, wv[j], acc[m][j]);
    }
  }
  if (k < kc) {
    const int rem = static_cast<int>(kc - k);
    VecF wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = load_w_part(w[j], gs ? gs[j] : nullptr, k, rem);
    for (int m = 0; m < MB; ++m) {
      const VecF xv = VecF::load(x + m * ldx + k, rem);
      for (int j = 0; j < 4; ++j) acc[m][j] = fmadd(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    float out[4];
    reduce_add4(acc[m][0], acc[m][1], acc[m][2], acc[m][3], out);
    for (int j = 0; j < nr; ++j) y[m * ldy + j] += out[j];
  }
}

// block_dot for bf16 weights: each load of 2W weights is widened in place into its even and
// odd elements (a shift and a mask, VecF::load_bf16_pairs) instead of W at a time with a
// cross-lane widening, against x permuted to match (xp: per block of 2W, the W even then
// the W odd elements; permute_pairs). The tail of a chunk that is not whole blocks reads x.
template <int MB>
inline void block_dot_bf16(const float* x, const float* xp, int64_t ldx, const BFloat16* const* w, int64_t kc,
                           float* y, int64_t ldy, int nr) {
  // One row of x: the odd elements get their own accumulators (8 independent chains, not 4
  // chains of two dependent FMAs); with 4 rows of x there are 16 chains already.
  constexpr bool kSplit = MB == 1;
  VecF acc[MB][4], odd[kSplit ? 4 : 1];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = VecF::zero();
  for (auto& o : odd) o = VecF::zero();
  int64_t k = 0;
  for (; k + 2 * W <= kc; k += 2 * W) {
    VecF we[4], wo[4];
    for (int j = 0; j < 4; ++j) VecF::load_bf16_pairs(reinterpret_cast<const uint16_t*>(w[j] + k), we[j], wo[j]);
    for (int m = 0; m < MB; ++m) {
      const VecF xe = VecF::load(xp + m * ldx + k), xo = VecF::load(xp + m * ldx + k + W);
      for (int j = 0; j < 4; ++j) {
        if constexpr (kSplit) {
          acc[m][j] = fmadd(xe, we[j], acc[m][j]);
          odd[j] = fmadd(xo, wo[j], odd[j]);
        } else {
          acc[m][j] = fmadd(xo, wo[j], fmadd(xe, we[j], acc[m][j]));
        }
      }
    }
  }
  if constexpr (kSplit)
    for (int j = 0; j < 4; ++j) acc[0][j] = acc[0][j] + odd[j];
  for (; k < kc; k += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, kc - k));
    VecF wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = Load<BFloat16>::part(w[j] + k, n);
    for (int m = 0; m < MB; ++m) {
      const VecF xv = VecF::load(x + m * ldx + k, n);
      for (int j = 0; j < 4; ++j) acc[m][j] = fmadd(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    float out[4];
    reduce_add4(acc[m][0], acc[m][1], acc[m][2], acc[m][3], out);
    for (int j = 0; j < nr; ++j) y[m * ldy + j] += out[j];
  }
}

// block_dot<T, 1> and block_dot_bf16<1> with the nr rows of W read one after another
// instead of side by side. The rows of a task are adjacent in memory, so this reads them as
// one ascending stream, where side by side is four streams a row apart. Which is faster
// depends on the host's prefetchers and the row chunk's length (short rows: few lines per
// stream for the hardware prefetcher to follow), so it is measured per host and weight type
// like the software prefetch (MatvecPrefetch::serial_max_chunk_bytes). Four accumulators per
// row keep as many independent FMA chains as the side-by-side kernel's four rows.
template <typename T>
inline VecF row_dot(const float* x, const T* w, const float* gs, int64_t kc) {
  VecF a[4] = {VecF::zero(), VecF::zero(), VecF::zero(), VecF::zero()};
  int64_t k = 0;
  for (; k + 4 * W <= kc; k += 4 * W)
    for (int i = 0; i < 4; ++i) a[i] = fmadd(VecF::load(x + k + i * W), load_w(w, gs, k + i * W), a[i]);
  for (; k + W <= kc; k += W) a[0] = fmadd(VecF::load(x + k), load_w(w, gs, k), a[0]);
  if (k < kc) {
    const int n = static_cast<int>(kc - k);
    a[1] = fmadd(VecF::load(x + k, n), load_w_part(w, gs, k, n), a[1]);
  }
  return (a[0] + a[1]) + (a[2] + a[3]);
}

inline VecF row_dot_bf16(const float* x, const float* xp, const BFloat16* w, int64_t kc) {
  VecF a[4] = {VecF::zero(), VecF::zero(), VecF::zero(), VecF::zero()};
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(w);
  int64_t k = 0;
  for (; k + 4 * W <= kc; k += 4 * W)
    for (int i = 0; i < 2; ++i) {
      VecF we, wo;
      VecF::load_bf16_pairs(bits + k + 2 * i * W, we, wo);
      a[2 * i] = fmadd(VecF::load(xp + k + 2 * i * W), we, a[2 * i]);
      a[2 * i + 1] = fmadd(VecF::load(xp + k + 2 * i * W + W), wo, a[2 * i + 1]);
    }
  for (; k + 2 * W <= kc; k += 2 * W) {
    VecF we, wo;
    VecF::load_bf16_pairs(bits + k, we, wo);
    a[0] = fmadd(VecF::load(xp + k), we, a[0]);
    a[1] = fmadd(VecF::load(xp + k + W), wo, a[1]);
  }
  for (; k < kc; k += W) {  // what is not whole pair blocks: x as it is (permute_pairs copied it)
    const int n = static_cast<int>(std::min<int64_t>(W, kc - k));
    a[2] = fmadd(VecF::load(x + k, n), Load<BFloat16>::part(w + k, n), a[2]);
  }
  return (a[0] + a[1]) + (a[2] + a[3]);
}

template <typename T>
inline void serial_dot(const float* x, const float* xp, const T* const* w, int64_t kc, float* y, int nr,
                       const float* const* gs) {
  VecF acc[4] = {VecF::zero(), VecF::zero(), VecF::zero(), VecF::zero()};
  for (int j = 0; j < nr; ++j) {
    if constexpr (std::is_same_v<T, BFloat16>)
      acc[j] = row_dot_bf16(x, xp, w[j], kc);
    else
      acc[j] = row_dot(x, w[j], gs ? gs[j] : nullptr, kc);
  }
  float out[4];
  reduce_add4(acc[0], acc[1], acc[2], acc[3], out);
  for (int j = 0; j < nr; ++j) y[j] += out[j];
}

// xp [M, K]: each row of x with every whole block of 2W elements (from k = 0) reordered to
// its W even then its W odd elements; what is left of a row is copied as it is.
void permute_pairs(const float* x, float* xp, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* o = xp + m * K;
    int64_t k = 0;
    for (; k + 2 * W <= K; k += 2 * W)
      for (int i = 0; i < W; ++i) {
        o[k + i] = xr[k + 2 * i];
        o[k + W + i] = xr[k + 2 * i + 1];
      }
    for (; k < K; ++k) o[k] = xr[k];
  }
}

// Rows of x per block: MB x 4 accumulators, the 4 rows of W and a row of x should fit the
// vector registers. 4 x 4 fits AVX-512's 32; in AVX2's 16 they spill to the stack, and fp32 and
// int8 weights ran 1.1-1.2x faster at 4 and 8 rows of x with 2 x 4. bf16 weights keep 4 x 4:
// each pair of their vectors is widened (two more instructions) once per block, and halving
// the rows of x that share it measured no faster. Below 4 rows of x, rows go one at a time
// (int8 weights ran 2 and 3 rows 0.8-0.9x as fast in blocks of 2).
template <typename T>
constexpr int kMatvecMB = (W == 8 && !std::is_same_v<T, BFloat16>) ? 2 : 4;  // 8: the AVX2 build

template <typename T, int kLocality>
void matvec_with(const float* x, const T* w, float* y, int64_t M, int64_t N, int64_t K, const float* gscale,
                 const MatvecPrefetch pf) {
  constexpr bool kBf16 = std::is_same_v<T, BFloat16>;
  static_assert(kChunk % (2 * W) == 0, "chunks start on whole pair blocks");
  float* xp = nullptr;  // the buffer outlives the Scratch handle (parallel.h)
  if constexpr (kBf16) {
    xp = Scratch(kCallerSlot, M * K).data();
    permute_pairs(x, xp, M, K);
  }
  const int64_t groups = (K + kGroup - 1) / kGroup;  // grouped int8: scales per row
  // One contiguous range of 16-row tasks per thread (they cost the same), so a thread knows
  // which rows it reads next: each 4-row group prefetches the same K-chunk of the rows
  // about g_matvec_prefetch.bytes further on. The hardware prefetcher alone does poorly on short
  // row chunks, each its own stream (1152 bytes for a bf16 row of K = 576).
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t last_row = std::min(N, end * kRowsPerTask);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRowsPerTask, n1 = std::min(N, n0 + kRowsPerTask);
      for (int64_t m = 0; m < M; ++m) std::fill(y + m * N + n0, y + m * N + n1, 0.0f);
      // K in chunks: four W rows and up to four x rows of a chunk stay in L1 while every
      // block of x rows passes over them. With at most four rows of x each row of W is read
      // whole (one long stream per row, not pieces); a second block of x rows (rows one at
      // a time below 4, blocks of 2 on AVX2) finds the four rows in L1 or L2.
      const int64_t chunk = M <= 4 ? K : kChunk;
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t kc = std::min(chunk, K - k0);
        const int64_t chunk_bytes = kc * static_cast<int64_t>(sizeof(T));
        const int64_t ahead_rows = 4 * std::max<int64_t>(1, pf.bytes / (4 * chunk_bytes));
        const bool prefetch = pf.bytes > 0 && chunk_bytes <= pf.max_chunk_bytes;
        const bool serial = chunk_bytes <= pf.serial_max_chunk_bytes;
        for (int64_t n = n0; n < n1; n += 4) {
          const int64_t pf_end = prefetch ? std::min(last_row, n + ahead_rows + 4) : 0;
          for (int64_t r = n + ahead_rows; r < pf_end; ++r) {
            const char* row = reinterpret_cast<const char*>(w + r * K + k0);
            for (int64_t off = 0; off < chunk_bytes; off += 64) prefetch_line<kLocality>(row + off);
          }
          const int nr = static_cast<int>(std::min<int64_t>(4, n1 - n));
          const T* rows[4];
          const float* gs[4];
          for (int j = 0; j < 4; ++j) {
            const int64_t r = n + std::min(j, nr - 1);  // a short group repeats its last row
            rows[j] = w + r * K + k0;
            gs[j] = gscale ? gscale + r * groups + k0 / kGroup : nullptr;
          }
          const float* const* g = gscale ? gs : nullptr;
          int64_t m = 0;
          if (serial && M < 4) {  // rows of x one at a time, each against the rows one after another
            for (; m < M; ++m)
              serial_dot<T>(x + m * K + k0, xp ? xp + m * K + k0 : nullptr, rows, kc, y + m * N + n, nr, g);
          } else if constexpr (kBf16) {
            for (; M >= 4 && m + kMatvecMB<T> <= M; m += kMatvecMB<T>)
              block_dot_bf16<kMatvecMB<T>>(x + m * K + k0, xp + m * K + k0, K, rows, kc, y + m * N + n, N, nr);
            for (; m < M; ++m)
              block_dot_bf16<1>(x + m * K + k0, xp + m * K + k0, K, rows, kc, y + m * N + n, N, nr);
          } else {
            for (; M >= 4 && m + kMatvecMB<T> <= M; m += kMatvecMB<T>)
              block_dot<T, kMatvecMB<T>>(x + m * K + k0, K, rows, kc, y + m * N + n, N, nr, g);
            for (; m < M; ++m) block_dot<T, 1>(x + m * K + k0, K, rows, kc, y + m * N + n, N, nr, g);
          }
        }
      }
    }
  });
}

template <typename T>
void matvec(const float* x, const T* w, float* y, int64_t M, int64_t N, int64_t K, const float* gscale = nullptr) {
  constexpr int kKind = std::is_same_v<T, float> ? kMatvecF32 : std::is_same_v<T, BFloat16> ? kMatvecBF16 : kMatvecInt8;
  const MatvecPrefetch pf = g_matvec_prefetch[kKind];
  with_hint(pf.hint, [&](auto hint) { matvec_with<T, decltype(hint)::value>(x, w, y, M, N, K, gscale, pf); });
}

// -- linear_gemm -------------------------------------------------------------------------

constexpr int kWideMR = kGemmMR;      // rows of W per tile when the tile is 2 vectors of tokens wide
constexpr int kNarrowMR = 2 * kGemmMR;  // ... and when it is one vector wide
constexpr int64_t kTaskRows = 2 * kNarrowMR;  // rows of W per task: whole tiles of either shape
constexpr int64_t kKC = 128;                  // most K elements per packed slice of W
static_assert(kKC % W == 0, "slices are whole vectors (pack_w_slice stores whole vectors)");
constexpr int64_t kTokensPerBlock = 256;      // MC: most tokens per block of x^T (a multiple of 2 W)
constexpr int64_t kXtScratchFloats = int64_t{1} << 22;
// The task's y^T tile has rows a block of tokens plus one cache line apart: a whole block apart
// (a multiple of 1 KB), its rows fell into a few L1 sets.
constexpr int64_t kCtPad = 64 / sizeof(float);

// The next slice of W (rows of kc values, K apart), prefetched a line at a time. Issued at
// once, a slice's lines (up to kTaskRows x kKC values) outnumber the misses a core keeps in
// flight and the prefetches stall the work they were meant to overlap: with few tokens
// (batched decode) reading W and the arithmetic took turns. Where the block's slice of x^T
// fits in L1 (spread_prefetch), the micro-tiles issue one line every kSpreadSteps steps of k.
// With more tokens the tiles read x^T from L2, spread prefetches' misses compete with theirs
// (measured slower), and the slice is issued at once before them.
constexpr int kSpreadSteps = 2;
inline bool spread_prefetch(int64_t tokens, int64_t kc) {
  return tokens * kc * static_cast<int64_t>(sizeof(float)) <= l1d_bytes();
}
class SlicePrefetch {
 public:
  SlicePrefetch() = default;
  // `rows` rows of `row_bytes` bytes from `row`, `pitch` bytes apart.
  SlicePrefetch(const void* row, int64_t pitch, int64_t row_bytes, int64_t rows)
      : row_(static_cast<const char*>(row)), pitch_(pitch), row_bytes_(row_bytes), rows_left_(rows) {}
  void one() {
    if (rows_left_ == 0) return;
    prefetch_line<2>(row_ + off_);  // prefetcht1, as before the spread
    if ((off_ += 64) >= row_bytes_) {
      off_ = 0;
      row_ += pitch_;
      --rows_left_;
    }
  }
  void rest() {
    while (rows_left_ > 0) one();
  }

 private:
  const char* row_ = nullptr;
  int64_t pitch_ = 0, row_bytes_ = 0, off_ = 0, rows_left_ = 0;
};

// acc (MR x NV vectors) = or += sum_p a[r][p] * b[p][0 : NV W] over p < kc, for the MR rows
// of a packed W slice (rows kKC apart) and kc rows of x^T (ldb apart); c is [MR][ldc].
template <int MR, int NV, typename Prefetch = void>
inline void gemm_tile(int64_t kc, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                      bool accumulate, Prefetch* ahead = nullptr) {
  // Every loop over r and v is unrolled (GCC otherwise keeps a 24-row tile in memory).
  VecF acc[MR][NV];
#pragma GCC unroll 32
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? VecF::load(c + r * ldc + v * W) : VecF::zero();
  for (int64_t p = 0; p < kc; ++p) {
    if constexpr (!std::is_void_v<Prefetch>) {
      if (p % kSpreadSteps == 0) ahead->one();
    }
    VecF bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = VecF::load(b + p * ldb + v * W);
#pragma GCC unroll 32
    for (int r = 0; r < MR; ++r) {
      const VecF av = VecF::set1(a[r * lda + p]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(av, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v].store(c + r * ldc + v * W);
}

// dst[r][0:kc] = fp32(w[r][k0 : k0 + kc]) for rows < nrows, zero rows up to kTaskRows; grouped
// int8 (gscale: [N][groups]) times each value's group scale. k0 is a multiple of W (slices are
// whole vectors) and W divides kGroup, so every vector lies in one group: one scale per vector.
static_assert(kGroup % W == 0, "a vector of a slice must not straddle two weight groups");
template <typename T>
void pack_w_slice(const T* w, int64_t K, int64_t k0, int64_t kc, int64_t nrows, float* dst,
                  const float* gscale = nullptr) {
  const int64_t groups = (K + kGroup - 1) / kGroup;
  for (int64_t r = 0; r < kTaskRows; ++r) {
    float* out = dst + r * kKC;
    if (r >= nrows) {
      std::fill(out, out + kc, 0.0f);
      continue;
    }
    const T* row = w + r * K + k0;
    const int64_t full = kc / W * W;
    const float* s = gscale ? gscale + r * groups : nullptr;  // this row's group scales
    if (s) {
      for (int64_t k = 0; k < full; k += W) (Load<T>::full(row + k) * VecF::set1(s[(k0 + k) / kGroup])).store(out + k);
    } else {
      for (int64_t k = 0; k < full; k += W) Load<T>::full(row + k).store(out + k);
    }
    // The tail (K not whole vectors, last slice only): a whole vector stored, zeros past kc
    // (rows are kKC >= kc rounded up to a vector apart; the tiles read only p < kc).
    if (full < kc) {
      const VecF v = Load<T>::part(row + full, static_cast<int>(kc - full));
      (s ? v * VecF::set1(s[(k0 + full) / kGroup]) : v).store(out + full);
    }
  }
}

// M tokens as blocks of whole vectors, as few as hold them at kTokensPerBlock each and as
// equal as whole vectors allow (the first ones one vector wider): threads take whole tasks,
// so 270 tokens cut 256 + 14 would leave one of two threads idle for most of the call, and
// 680 tokens in equal blocks of 240 would pad 40 where 240 + 224 + 224 pads 8.
struct TokenBlocks {
  int64_t count, vecs, extra;  // blocks; vectors in each; the first `extra` blocks hold one more
  explicit TokenBlocks(int64_t M) {
    const int64_t total = (M + W - 1) / W;
    count = (total * W + kTokensPerBlock - 1) / kTokensPerBlock;
    vecs = total / count;
    extra = total % count;
  }
  int64_t start(int64_t b) const { return W * (b * vecs + std::min(b, extra)); }  // first token
  int64_t width(int64_t b) const { return W * (vecs + (b < extra)); }             // tokens, padded
  int64_t padded() const { return start(count); }
};

// xt holds block b of x^T at xt + start(b) K, in panels of kXtPanel tokens (the last one of a
// block narrower when the block is not whole panels): the panel starting at token j of the
// block is [K][its width] at xt + (start(b) + j) K, holding x[start(b) + j + i][k] at
// [k][i], zero past M. A micro-tile then reads its tokens' values of one k as one contiguous
// piece; with the block's rows of x^T a whole block wide apart (a multiple of 1 KB at 256
// tokens), the kc rows a tile reads fell into a few L1 sets and came from L2 for every tile.
constexpr int64_t kXtPanel = 2 * W;

// The panel of x^T holding token j (a multiple of kXtPanel) of a block of mc tokens, and its width.
inline const float* xt_panel(const float* xblock, int64_t K, int64_t mc, int64_t j, int64_t* width) {
  *width = std::min(kXtPanel, mc - j);
  return xblock + j * K;
}

// Cache-blocked (16 tokens x 64 k at a time, in 8 x 8 or 16 x 16 blocks in registers where
// the build has the vectors), in parallel when there is enough.
void transpose_x(const float* x, int64_t M, int64_t K, const TokenBlocks& tb, float* xt) {
  const int64_t blocks = tb.count;
  const int64_t kchunks = (K + 63) / 64;
  const int64_t grain = M * K >= (int64_t{1} << 16) ? 1 : blocks * kchunks;
  static_assert(kXtPanel % 16 == 0 || 16 % kXtPanel == 0, "16-token steps and panels must nest");
  at::parallel_for(0, blocks * kchunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t blk = t / kchunks, k0 = (t % kchunks) * 64, k1 = std::min(K, k0 + 64);
      const int64_t m0 = tb.start(blk), mc = tb.width(blk), valid = std::min(mc, M - m0);
      float* block = xt + m0 * K;
#if defined(WBK_ISA_AVX512)  // 16 tokens x 16 k at a time, transposed in registers (mc: whole vectors)
      for (int64_t j0 = 0; j0 < mc; j0 += 16) {
        const int64_t q = j0 / kXtPanel * kXtPanel, pw = std::min(kXtPanel, mc - q);
        float* dst = block + q * K + (j0 - q);
        for (int64_t k = k0; k < k1; k += 16) {
          const int64_t kt = std::min<int64_t>(16, k1 - k);
          const __mmask16 mask = static_cast<__mmask16>((1u << kt) - 1);
          __m512i r[16];
          for (int64_t i = 0; i < 16; ++i)
            r[i] = j0 + i < valid ? _mm512_maskz_loadu_epi32(mask, x + (m0 + j0 + i) * K + k) : _mm512_setzero_si512();
          transpose16(r);
          for (int64_t p = 0; p < kt; ++p) _mm512_storeu_si512(dst + (k + p) * pw, r[p]);
        }
      }
#elif defined(WBK_ISA_AVX2)  // 8 tokens x 8 k at a time, transposed in registers (mc: whole vectors)
      for (int64_t j0 = 0; j0 < mc; j0 += 8) {
        const int64_t q = j0 / kXtPanel * kXtPanel, pw = std::min(kXtPanel, mc - q);
        float* dst = block + q * K + (j0 - q);
        for (int64_t k = k0; k < k1; k += 8) {
          const int kt = static_cast<int>(std::min<int64_t>(8, k1 - k));
          const __m256i mask = VecF::mask(kt);
          __m256 r[8];
          for (int64_t i = 0; i < 8; ++i)
            r[i] = j0 + i < valid ? _mm256_maskload_ps(x + (m0 + j0 + i) * K + k, mask) : _mm256_setzero_ps();
          transpose8(r);
          for (int p = 0; p < kt; ++p) _mm256_storeu_ps(dst + (k + p) * pw, r[p]);
        }
      }
#else
      for (int64_t j0 = 0; j0 < mc; j0 += 16) {
        const int64_t j1 = std::min(mc, j0 + 16);
        for (int64_t k = k0; k < k1; ++k) {
          for (int64_t j = j0; j < j1; ++j) {
            const int64_t q = j / kXtPanel * kXtPanel, pw = std::min(kXtPanel, mc - q);
            block[q * K + k * pw + (j - q)] = j < valid ? x[(m0 + j) * K + k] : 0.0f;
          }
        }
      }
#endif
    }
  });
}

// May a task read its rows of fp32 W where they are? Not when the row pitch is a whole number
// of L1 ways: all of the task's rows then share the same few sets of L1.
bool in_place_fits(int64_t K) { return (K * static_cast<int64_t>(sizeof(float))) % l1_way_bytes() != 0; }

// K in panels of whole slices, so that a thread's block of x^T over one panel stays in its
// caches while its tasks' rows of W pass, instead of coming from memory once per task (measured
// up to 1.8x on Llama-2-7B's down projection, K = 11008, at 1024 tokens). Each panel is one
// parallel pass over all tasks, the first writing y and the later ones adding to it, so every
// panel more reads and writes y once more. The budget is a quarter of the thread's share of the
// L3 (the rest for W streaming past, y and the other threads' blocks), or the L2 where that is
// more or the OS gives no L3: held to the L2, the passes over y cost Llama-2-7B's shapes 6-8%
// at 1024 tokens on Zen 3 (K = 4096 ran as 8 panels, where 1 was faster).
int64_t panel_length(int64_t K, int64_t slice, int64_t tokens) {
  const int64_t fit = gemm_panel_bytes() / (tokens * static_cast<int64_t>(sizeof(float)));  // K values of x^T that fit
  return std::min(K, std::max<int64_t>(1, fit / slice) * slice);
}

// One slice of a task: every micro-tile of the task's kTaskRows rows of W (a, lda apart) by
// the block's panels of x^T (block of mc tokens, from k0), into the y^T tile ct.
template <typename Prefetch>
inline void task_tiles(int64_t kc, const float* a, int64_t lda, const float* xblock, int64_t K, int64_t mc, int64_t k0,
                       float* ct, int64_t ldct, int64_t width, bool accumulate, Prefetch* ahead) {
  for (int64_t j = 0; j < width; j += kXtPanel) {
    int64_t ldb;
    const float* b = xt_panel(xblock, K, mc, j, &ldb) + k0 * ldb;
    if (width - j >= 2 * W) {
      for (int64_t r = 0; r < kTaskRows; r += kWideMR)
        gemm_tile<kWideMR, 2>(kc, a + r * lda, lda, b, ldb, ct + r * ldct + j, ldct, accumulate, ahead);
    } else {
      for (int64_t r = 0; r < kTaskRows; r += kNarrowMR)
        gemm_tile<kNarrowMR, 1>(kc, a + r * lda, lda, b, ldb, ct + r * ldct + j, ldct, accumulate, ahead);
    }
  }
}

// Where a GEMM task's rows of W come from, as fp32 slices of kKC-apart rows (pack) and as the
// bytes to prefetch (prefetch): typed rows (fp32, bf16, int8 with grouped int8's scales), or
// block-quantized rows dequantized 32 weights at a time (blocks.h; their slices start on a
// multiple of 32, kUnit).
template <typename T>
struct TypedRows {
  static constexpr int64_t kUnit = W;  // slices are whole vectors
  static constexpr bool kFp32 = std::is_same_v<T, float>;
  const T* w;
  int64_t K;
  const float* gscale;  // grouped int8: [N][groups], else null
  const T* row(int64_t n) const { return w + n * K; }
  void pack(int64_t n0, int64_t k0, int64_t kc, int64_t rows, float* dst) const {
    const int64_t groups = (K + kGroup - 1) / kGroup;
    pack_w_slice(w + n0 * K, K, k0, kc, rows, dst, gscale ? gscale + n0 * groups : nullptr);
  }
  SlicePrefetch prefetch(int64_t n0, int64_t k0, int64_t kc, int64_t rows) const {
    const int64_t e = sizeof(T);
    return SlicePrefetch(w + n0 * K + k0, K * e, kc * e, rows);
  }
};

struct BlockRows {
  static constexpr int64_t kUnit = kBlockChunk;
  static constexpr bool kFp32 = false;
  const uint8_t* w;
  WeightDtype dtype;
  int64_t K, row_bytes;
  const float* row(int64_t) const { return nullptr; }
  void pack(int64_t n0, int64_t k0, int64_t kc, int64_t rows, float* dst) const {
    for (int64_t r = 0; r < kTaskRows; ++r) {
      float* out = dst + r * kKC;
      if (r < rows)
        dequantize_block_range(dtype, w + (n0 + r) * row_bytes, K, k0, kc, out);
      else
        std::fill(out, out + kc, 0.0f);
    }
  }
  SlicePrefetch prefetch(int64_t n0, int64_t k0, int64_t kc, int64_t rows) const {
    // the slice's share of each row (its quants; a K-quant super-block holds its scales too)
    return SlicePrefetch(w + n0 * row_bytes + k0 * row_bytes / K, row_bytes, std::max<int64_t>(64, kc * row_bytes / K),
                         rows);
  }
};
static_assert(kKC % kBlockChunk == 0, "a slice of block-quantized rows is whole chunks of 32");

template <typename Rows>
void gemm(const float* x, const Rows& src, float* y, int64_t M, int64_t N, int64_t K) {
  const TokenBlocks tb(M);  // a batch of 16 decodes as one block of 16
  const int64_t m_blocks = tb.count;
  const int64_t n_blocks = (N + kTaskRows - 1) / kTaskRows;
  // Slices of at most kKC, as equal as whole vectors allow: a slice of K = 576 is 120 (AVX2)
  // or 128, not 115.2 rounded up, so packing a slice of bf16 / int8 rows ends no row with a
  // masked store (slow on AVX2: perf put one per row above the widening itself).
  const int64_t slices = (K + kKC - 1) / kKC, slice = round_up((K + slices - 1) / slices, Rows::kUnit);
  // x^T: up to 16 MB in the calling thread's scratch (kept for the next call); a long
  // prefill's is allocated for this call only, not held for the thread's lifetime.
  const int64_t xt_size = tb.padded() * K;
  std::unique_ptr<float[]> xt_owned;
  float* xt;
  if (xt_size <= kXtScratchFloats) {
    xt = Scratch(kCallerSlot, xt_size).data();  // the buffer outlives the handle
  } else {
    xt_owned.reset(new float[static_cast<size_t>(xt_size)]);
    xt = xt_owned.get();
  }
  transpose_x(x, M, K, tb, xt);  // writes every element
  const bool rows_fit = in_place_fits(K);
  const int64_t panel = panel_length(K, slice, tb.width(0));
  const bool spread = m_blocks == 1 && spread_prefetch(tb.width(0), slice);  // see SlicePrefetch

  for (int64_t kp0 = 0; kp0 < K; kp0 += panel) {
    const int64_t kp1 = std::min(K, kp0 + panel);
    // Tasks (token block outer, so a thread's consecutive tasks reuse one block of x^T) are
    // cut into one contiguous range per thread: they cost the same, and a thread then knows
    // which rows of W it reads next and can prefetch them.
    at::parallel_for(0, n_blocks * m_blocks, 1, [&](int64_t begin, int64_t end) {
      Scratch wp(0, kTaskRows * kKC), ct(1, kTaskRows * (tb.width(0) + kCtPad));
      for (int64_t t = begin; t < end; ++t) {
        const int64_t nb = t % n_blocks, mb = t / n_blocks;
        const int64_t n0 = nb * kTaskRows, rows = std::min(kTaskRows, N - n0);
        const int64_t m0 = tb.start(mb), mc = tb.width(mb), tokens = std::min(mc, M - m0);
        const int64_t width = ((tokens + W - 1) / W) * W;  // columns of the y^T tile, whole vectors
        const int64_t ldct = mc + kCtPad;
        const float* xblock = xt + m0 * K;
        const bool in_place = Rows::kFp32 && rows == kTaskRows && rows_fit;
        for (int64_t k0 = kp0; k0 < kp1; k0 += slice) {
          const int64_t kc = std::min(slice, kp1 - k0);
          // fp32 weights of a whole task are read in place (rows K apart); others are widened
          // (and scaled) into the packed slice, rows kKC apart.
          const float* a = wp.data();
          int64_t lda = kKC;
          if constexpr (Rows::kFp32) {
            if (in_place) {
              a = src.row(n0) + k0;
              lda = K;
            }
          }
          if (!in_place) src.pack(n0, k0, kc, rows, wp.data());
          // Fetch the next slice of W (this task's, or the next task's first) while the
          // micro-kernels run: the packing loop otherwise waits on memory latency.
          SlicePrefetch ahead;
          if (k0 + slice < kp1) {
            ahead = src.prefetch(n0, k0 + slice, std::min(slice, kp1 - k0 - slice), rows);
          } else if (t + 1 < end) {
            const int64_t next = ((t + 1) % n_blocks) * kTaskRows;
            ahead = src.prefetch(next, kp0, std::min(slice, kp1 - kp0), std::min(kTaskRows, N - next));
          }
          if (spread) {  // a line every kSpreadSteps steps of the tiles, then what they left
            task_tiles(kc, a, lda, xblock, K, mc, k0, ct.data(), ldct, width, k0 > kp0, &ahead);
            ahead.rest();
          } else {  // all at once, before the tiles
            ahead.rest();
            task_tiles<void>(kc, a, lda, xblock, K, mc, k0, ct.data(), ldct, width, k0 > kp0, nullptr);
          }
        }
#if defined(WBK_ISA_AVX512)
        static_assert(kTaskRows % 16 == 0, "store_transposed reads whole 16-row blocks of ct");
        store_transposed(ct.data(), ldct, rows, tokens, y + m0 * N + n0, N, false, kp0 > 0);  // in registers
#elif defined(WBK_ISA_AVX2)
        static_assert(kTaskRows % 8 == 0, "store_transposed8 reads whole 8-row blocks of ct");
        store_transposed8(ct.data(), ldct, rows, tokens, y + m0 * N + n0, N, kp0 > 0);  // in registers
#else
        for (int64_t m = 0; m < tokens; ++m) {
          float* out = y + (m0 + m) * N + n0;
          for (int64_t r = 0; r < rows; ++r) out[r] = (kp0 > 0 ? out[r] : 0.0f) + ct[r * ldct + m];
        }
#endif
      }
    });
  }
}

}  // namespace

int64_t gemm_panel_bytes() { return std::max(l2_bytes(), l3_bytes_per_cpu() / 4); }  // both read once

namespace {

// y[m][n] *= row_scale[n]: the int8 weights' per-row scale, once per finished output.
void scale_columns(float* y, const float* row_scale, int64_t M, int64_t N) {
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = y + m * N;
      int64_t n = 0;
      for (; n + W <= N; n += W) (VecF::load(row + n) * VecF::load(row_scale + n)).store(row + n);
      for (; n < N; ++n) row[n] *= row_scale[n];
    }
  });
}

}  // namespace

namespace {

// run(typed weights, group scales or nullptr) for the weights' dtype; per-row int8 scales
// are applied to the finished outputs afterwards.
template <typename Run>
void with_weights(const void* w, WeightDtype dtype, const float* scale, float* y, int64_t M, int64_t N, Run&& run) {
  switch (dtype) {
    case WeightDtype::kBFloat16:
      return run(static_cast<const BFloat16*>(w), nullptr);
    case WeightDtype::kInt8:
      run(static_cast<const int8_t*>(w), nullptr);
      return scale_columns(y, scale, M, N);
    case WeightDtype::kInt8Group:
      return run(static_cast<const int8_t*>(w), scale);
    case WeightDtype::kFloat32:
      return run(static_cast<const float*>(w), nullptr);
    default:  // block-quantized: the callers take them first (blocks.cpp)
      return;
  }
}

}  // namespace

namespace {
std::atomic<int64_t> g_matvec_max_rows[kWeightDtypes];  // one per WeightDtype; kMatvecMaxRowsDefault until set
struct MatvecRowsDefaults {
  MatvecRowsDefaults() {
    for (auto& r : g_matvec_max_rows) r.store(kMatvecMaxRowsDefault);
  }
} g_matvec_rows_defaults;
}  // namespace

int64_t matvec_max_rows(WeightDtype dtype) {
  return g_matvec_max_rows[static_cast<int>(dtype)].load(std::memory_order_relaxed);
}

void set_matvec_max_rows(WeightDtype dtype, int64_t rows) {
  g_matvec_max_rows[static_cast<int>(dtype)].store(std::max<int64_t>(1, rows), std::memory_order_relaxed);
}

void linear_matvec(const float* x, const void* w, WeightDtype dtype, const float* row_scale, float* y, int64_t M,
                   int64_t N, int64_t K) {
  if (is_block(dtype)) return block_matvec(x, static_cast<const uint8_t*>(w), dtype, y, M, N, K);
  if ((dtype == WeightDtype::kInt8 || dtype == WeightDtype::kInt8Group) && K % kBlockChunk == 0) {
    // int8 weights times int16 activations (blocks.cpp): integer products, memory-bound where the
    // fp32 FMA path below, widening every weight to fp32, was bound by its arithmetic
    int8_matvec(x, static_cast<const int8_t*>(w), dtype == WeightDtype::kInt8Group ? row_scale : nullptr, y, M, N, K);
    if (dtype == WeightDtype::kInt8) scale_columns(y, row_scale, M, N);
    return;
  }
  with_weights(w, dtype, row_scale, y, M, N, [&](auto* tw, const float* gs) { matvec(x, tw, y, M, N, K, gs); });
}

void linear_gemm(const float* x, const void* w, WeightDtype dtype, const float* row_scale, float* y, int64_t M,
                 int64_t N, int64_t K) {
  const GemmEngine engine = gemm_engine_for(dtype);
  if (engine == GemmEngine::kAmxInt8) {  // per-row int8 weights only (gemm_engine_for)
    linear_gemm_w8a8(x, static_cast<const int8_t*>(w), y, M, N, K);
    return scale_columns(y, row_scale, M, N);
  }
  if (engine == GemmEngine::kAmxBf16 || engine == GemmEngine::kAvx512Bf16) {
    if (dtype == WeightDtype::kBFloat16) return linear_gemm_bf16(engine, x, static_cast<const uint16_t*>(w), y, M, N, K);
    const bool grouped = dtype == WeightDtype::kInt8Group;
    linear_gemm_int8_bf16(engine, x, static_cast<const int8_t*>(w), grouped ? row_scale : nullptr, y, M, N, K);
    if (!grouped) scale_columns(y, row_scale, M, N);
    return;
  }
  if (is_block(dtype)) {  // dequantized 32 weights at a time into the FMA GEMM's fp32 slices (gemm_engine_for)
    const auto* wb = static_cast<const uint8_t*>(w);
    return gemm(x, BlockRows{wb, dtype, K, block_row_bytes(dtype, K)}, y, M, N, K);
  }
  with_weights(w, dtype, row_scale, y, M, N,
               [&](auto* tw, const float* gs) { gemm(x, TypedRows<std::remove_const_t<std::remove_pointer_t<decltype(tw)>>>{tw, K, gs}, y, M, N, K); });
}

}  // namespace wbk
