// MLA decode attention over the paged latent cache, read in place (absorbed form).
// Semantics: k2_kernels/reference.py (mla_decode_paged).
//
// Shape legend: n sequences (one new token each), H heads, K = C + R cache row (the normalised
// latent c, C values, then the roped shared key, R values), NB blocks in the pool, B rows per
// block, M entries per block table.
// For each sequence i and head h, over the cache rows j < len[i] (row j of sequence i lives in
// block table[i, j / B] at offset j % B):
//   s_j = scale * q[i, h] . row_j                  (all K values: latent and rope parts)
//   out[i, h] = sum_j softmax(s)_j * row_j[:C]      (the latent part: W_UV is applied outside)
// Each row is read once per sequence for all its heads; nothing is gathered or padded.
// Accumulation in fp32 with an online softmax per block of rows.
#pragma once

#include <cstdint>

#include "k2/common.h"

namespace k2 {

struct MlaDecodeArgs {
  const float* q;         // [n, H, K] fp32
  const void* cache;      // [NB, B, K] of cache_dtype (fp32 or bf16): one layer of the pool
  DType cache_dtype;
  const int64_t* table;   // [n, M] block ids (entries past a sequence's blocks are ignored)
  const int64_t* lens;    // [n] rows per sequence, 1..M * B
  int64_t n, H, K, C, NB, B, M;
  float scale;
  float* out;             // [n, H, C] fp32 out
};

void mla_decode_paged_cpu(const MlaDecodeArgs& a);  // OpenMP over sequences; checks its arguments

}  // namespace k2
