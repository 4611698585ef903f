// Block-quantized weights (blocks.cpp): GGUF's block types and the workbench's own int4 format,
// one row of K weights at a time. What each format stores, and the value of a weight:
//
//   q4_0   blocks of 32: fp16 d, 32 4-bit q          w = d (q - 8)
//   q4_1   blocks of 32: fp16 d, fp16 m, 32 4-bit q  w = d q + m
//   q5_0   blocks of 32: fp16 d, 32 5-bit q          w = d (q - 16)
//   q5_1   blocks of 32: fp16 d, fp16 m, 5-bit q     w = d q + m
//   q8_0   blocks of 32: fp16 d, 32 int8 q           w = d q
//   q4_k   super-blocks of 256 (144 bytes): fp16 d, dmin; 8 sub-blocks of 32 with a 6-bit
//          scale s and minimum m each; 4-bit q       w = d s q - dmin m
//   q5_k   the same with 5-bit q (176 bytes)
//   q6_k   super-blocks of 256 (210 bytes): fp16 d; 16 sub-blocks of 16 with an int8 scale
//          s each; 6-bit q                           w = d s (q - 32)
//   i4_g128  ours (AWQ / GPTQ's granularity): groups of 128 with an fp16 scale d and an fp16
//          offset m (minus the zero point times d); 4-bit q          w = d q + m
//
// Layout in memory (the kernels' layout). The K-quants' super-blocks are read as the file has
// them. The blocks of 32 (q4_0 ... q8_0) are repacked at load into groups of eight blocks: the
// group's quants one after another, then each further field of its blocks (Q5's fifth bits as
// 4 bytes a block, in an order of ours; the fp16 scales; the fp16 minimums), so that a kernel
// reads eight blocks' scales with one load; the repack moves bytes and changes no value, and a
// row keeps GGUF's size (blocks.cpp: group_at). Within 32 weights the 4-bit formats keep GGUF's order: byte j holds weight j in its
// low nibble and weight j + 16 in its high one (q4_k and q5_k: weights j and j + 32 of a
// 64-weight pair of sub-blocks). i4_g128 is grouped the same way, two blocks of 128 a group.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace wbk {

inline constexpr int64_t kBlockChunk = 32;  // weights per activation scale; K is a multiple of it
inline constexpr int64_t kSuperBlock = 256;  // the K-quants' super-block
inline constexpr int64_t kI4Group = 128;

// A block of the format (weights, bytes): GGUF's (i4_g128: ours); a row is whole blocks.
struct BlockGeometry {
  int64_t weights, bytes;
};
BlockGeometry block_geometry(WeightDtype dtype);
// What a row of K weights of `dtype` requires of K ("" when it is fine), and its bytes.
const char* block_row_error(WeightDtype dtype, int64_t K);
int64_t block_row_bytes(WeightDtype dtype, int64_t K);

// rows rows of K weights between GGUF's byte order and the kernels' (to_kernel: GGUF -> ours);
// the same bytes for the K-quants and i4_g128.
void repack_block_rows(WeightDtype dtype, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t K, bool to_kernel);

// Weights [k0, k0 + n) of one row (the kernels' layout) as fp32; k0 and n multiples of 32: in
// vectors (the GEMM's slices, the embedding's rows), or weight by weight in plain C++ (the
// reference the tests hold the vectors to); the same bits either way, as ggml rounds them.
void dequantize_block_range(WeightDtype dtype, const uint8_t* row, int64_t K, int64_t k0, int64_t n, float* out);
void dequantize_block_range_reference(WeightDtype dtype, const uint8_t* row, int64_t K, int64_t k0, int64_t n,
                                      float* out);
// out [count, K] = the rows index[i] of w [N, K] (index null: rows 0 .. count - 1), in parallel.
void dequantize_block_rows(WeightDtype dtype, const uint8_t* w, const int64_t* index, int64_t count, int64_t K,
                           float* out, bool reference = false);

// Our quantizers: x [rows, K] fp32 -> rows in GGUF's byte order (i4_g128: its block order),
// rows in parallel. q8_0 / q4_0 / q4_1 / q5_0 / q5_1 round as GGUF's reference quantizers
// do, except q4_0 with `search` (our int4-g32): each block's least-squares scale. The
// K-quants and i4_g128 search each sub-block's scale (and minimum) for the least squared error.
void quantize_block_rows(WeightDtype dtype, const float* x, uint8_t* out, int64_t rows, int64_t K,
                         bool search = false);

// y [M, N] = x [M, K] . w^T for block-quantized w [N rows of block_row_bytes(K)]: each row of
// x is quantized to int16 per 32 values (scale = max |x| / 32767) and every block's integer
// dot products summed in int32, then scaled in fp32 (blocks.cpp). Memory-bound at small M.
void block_matvec(const float* x, const uint8_t* w, WeightDtype dtype, float* y, int64_t M, int64_t N, int64_t K);

// The same for weight-only int8 rows w [N, K] (K a multiple of 32): group_scale [N][K / 32]
// for int8-g32, or null (per-row scales: the caller's, applied to y).
void int8_matvec(const float* x, const int8_t* w, const float* group_scale, float* y, int64_t M, int64_t N,
                 int64_t K);

// Whether matvec_jobs takes a matrix of this format and width.
bool matvec_job_format(WeightDtype dtype, int64_t K);

// Every job's product in one parallel region over all of their rows of W, x [M, K] rounded
// once: a mixture's experts, each on the tokens routed to it, at the cost of one matrix of
// their summed rows (one region a kind of matrix where one a matrix paid each one's start
// and its threads' uneven ends).
void matvec_jobs(const float* x, int64_t M, int64_t K, const MatvecJob* jobs, int64_t n_jobs);

// The instructions block_matvec's dot products use in this build: with int16 activations,
// and with int8 (block_byte_dot_isa).
const char* block_dot_isa();
const char* block_byte_dot_isa();

// What block_matvec and int8_matvec round the activations to, per 32 values: 16 (int16, the
// default) or 8 (int8); every thread's calls from then on.
void set_block_activation_bits(int bits);
int block_activation_bits();

// fp32 -> IEEE fp16, rounding to nearest even (the quantizers' scales).
uint16_t float_to_half_bits(float f);

}  // namespace wbk
