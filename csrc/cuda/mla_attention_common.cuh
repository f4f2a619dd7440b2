// Private helpers of the CUDA MLA attention kernels (mla_attention_fwd.cu, mla_attention_bwd.cu).
//
// Tensor-core fragments follow the PTX layout of mma.sync.m16n8k16 (bf16 in, fp32 accumulate).
// With lane = 4 * g + t (g = groupID 0..7, t = thread in group 0..3):
//   A (16x16, row-major):  a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]
//                          a[2] = A[g][2t+8..+9]   a[3] = A[g+8][2t+8..+9]
//   B (16x8, k x n):       b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..+9][g]
//   C (16x8, fp32):        c[0..1] = C[g][2t..2t+1]   c[2..3] = C[g+8][2t..2t+1]
// Each 32-bit register holds two bf16, the lower index in the low half. A C fragment pair of two
// adjacent n-tiles is therefore exactly an A fragment of the next product (P V, dS K, ...).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_common.cuh"
#include "k2/attention.h"

namespace k2 {
namespace cuda {
namespace attn {

constexpr int kThreads = 128;  // 4 warps per block in every attention kernel
constexpr int kPad = 8;        // bf16 elements of padding per shared row: rows 16-byte aligned, no bank conflicts

// The head dims with a tensor-core instantiation; any other multiple of 16 up to 256 (and fp32 inputs)
// runs on the SIMT kernels.
constexpr int kMmaDims[][2] = {{192, 128}, {128, 128}, {64, 64}};

// ---- sequences ---------------------------------------------------------------------------------

// blockIdx.x enumerates (sequence, tile); the heaviest tiles of a causal sequence (the last) first.
struct TileCoord {
  int64_t seq_start;  // first token of the sequence
  int seq_len;
  int tile;           // tile index inside the sequence
};

__device__ __forceinline__ bool tile_coord(const int32_t* __restrict__ cu_seqlens, int tiles_per_seq, int tile_rows,
                                           TileCoord& tc) {
  const int b = int(blockIdx.x / unsigned(tiles_per_seq));
  const int tile = tiles_per_seq - 1 - int(blockIdx.x % unsigned(tiles_per_seq));
  const int start = cu_seqlens[b], end = cu_seqlens[b + 1];
  tc.seq_start = start;
  tc.seq_len = end - start;
  tc.tile = tile;
  return tile * tile_rows < tc.seq_len;
}

// ---- max logit: atomic max of a float through the integer orderings ----------------------------

// Valid for any initial value (the fill writes -inf); NaN is ignored.
__device__ __forceinline__ void atomic_max_float(float* addr, float v) {
  if (!(v == v)) return;
  if (v >= 0.0f)
    atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
  else
    atomicMin(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

// Max over the block (kThreads threads) of each thread's v, then one atomic per block.
__device__ __forceinline__ void block_max_to_global(float v, float* red_smem /* [kThreads / 32] */, float* out) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // red_smem may alias memory another warp still reads
  if (lane == 0) red_smem[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = red_smem[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, red_smem[w]);
    if (m > -INFINITY) atomic_max_float(out, m);
  }
}

// ---- element conversions -----------------------------------------------------------------------

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two bf16 from two addresses (a transposed fragment), lo in the low half.
__device__ __forceinline__ uint32_t pack_u16(const __nv_bfloat16* lo, const __nv_bfloat16* hi) {
  const uint32_t l = *reinterpret_cast<const uint16_t*>(lo), h = *reinterpret_cast<const uint16_t*>(hi);
  return l | (h << 16);
}

__device__ __forceinline__ uint32_t ld_u32(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// ---- tensor cores ------------------------------------------------------------------------------

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Fragment loads from shared memory. K2_ATTN_LDMATRIX=1 (default): ldmatrix(.trans), one
// instruction per fragment; 0: the same fragments from 32-bit and paired 16-bit loads (the
// first version; kept to rule ldmatrix out when a result looks wrong on a GPU). Either way a
// fragment covers 8 x 8 blocks whose rows start 16-byte aligned (ld and column offsets are
// multiples of 8 elements). ldmatrix: lanes 8j..8j+7 address the rows of block j; lane l
// receives block j's row l / 4, columns 2 (l % 4) and + 1 in register j (.trans: column l / 4,
// rows 2 (l % 4) and + 1), the layout of the fragment tables above.
#ifndef K2_ATTN_LDMATRIX
#define K2_ATTN_LDMATRIX 1
#endif

#if K2_ATTN_LDMATRIX
__device__ __forceinline__ unsigned smem_addr(const __nv_bfloat16* p) { return unsigned(__cvta_generic_to_shared(p)); }

// A fragment of rows [r0, r0 + 16) x cols [c0, c0 + 16) of a row-major shared matrix (ld elements a row):
// blocks (rows, cols) = (r0, c0), (r0 + 8, c0), (r0, c0 + 8), (r0 + 8, c0 + 8).
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int r0, int c0, int g,
                                       int t) {
  const int lane = 4 * g + t, i = lane & 7, j = lane >> 3;
  const unsigned addr = smem_addr(s + (r0 + i + (j & 1) * 8) * ld + c0 + (j >> 1) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

// A fragment of A = M^T where M is a row-major shared matrix: A[m][k] = M[c0 + k][r0 + m]; blocks of
// M (rows, cols) = (c0, r0), (c0, r0 + 8), (c0 + 8, r0), (c0 + 8, r0 + 8), transposed.
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int r0, int c0, int g,
                                             int t) {
  const int lane = 4 * g + t, i = lane & 7, j = lane >> 3;
  const unsigned addr = smem_addr(s + (c0 + i + (j >> 1) * 8) * ld + r0 + (j & 1) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

// B fragment (k in [k0, k0 + 16), n in [n0, n0 + 8)) with B[k][n] = M[n][k]: rows of M are n,
// contiguous in k (K in Q K^T); blocks (n0, k0), (n0, k0 + 8). Lanes 16..31 repeat 0..15's
// addresses (x2 reads only those of lanes 0..15).
__device__ __forceinline__ void load_b(uint32_t& b0, uint32_t& b1, const __nv_bfloat16* s, int ld, int n0, int k0,
                                       int g, int t) {
  const int lane = 4 * g + t, i = lane & 7, j = (lane >> 3) & 1;
  const unsigned addr = smem_addr(s + (n0 + i) * ld + k0 + j * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(b0), "=r"(b1) : "r"(addr));
}

// B fragment with B[k][n] = M[k][n]: rows of M are k (V in P V); blocks (k0, n0), (k0 + 8, n0), transposed.
__device__ __forceinline__ void load_b_trans(uint32_t& b0, uint32_t& b1, const __nv_bfloat16* s, int ld, int n0,
                                             int k0, int g, int t) {
  const int lane = 4 * g + t, i = lane & 7, j = (lane >> 3) & 1;
  const unsigned addr = smem_addr(s + (k0 + i + j * 8) * ld + n0);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(b0), "=r"(b1) : "r"(addr));
}
#else
// A fragment of rows [r0, r0 + 16) x cols [c0, c0 + 16) of a row-major shared matrix (ld elements a row).
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int r0, int c0, int g,
                                       int t) {
  const __nv_bfloat16* p = s + (r0 + g) * ld + c0 + 2 * t;
  a[0] = ld_u32(p);
  a[1] = ld_u32(p + 8 * ld);
  a[2] = ld_u32(p + 8);
  a[3] = ld_u32(p + 8 * ld + 8);
}

// A fragment of A = M^T where M is a row-major shared matrix: A[m][k] = M[c0 + k][r0 + m].
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int r0, int c0, int g,
                                             int t) {
  const __nv_bfloat16* p = s + (c0 + 2 * t) * ld + r0 + g;
  a[0] = pack_u16(p, p + ld);
  a[1] = pack_u16(p + 8, p + ld + 8);
  a[2] = pack_u16(p + 8 * ld, p + 9 * ld);
  a[3] = pack_u16(p + 8 * ld + 8, p + 9 * ld + 8);
}

// B fragment (k in [k0, k0 + 16), n in [n0, n0 + 8)) with B[k][n] = M[n][k]: rows of M are n,
// contiguous in k (K in Q K^T).
__device__ __forceinline__ void load_b(uint32_t& b0, uint32_t& b1, const __nv_bfloat16* s, int ld, int n0, int k0,
                                       int g, int t) {
  const __nv_bfloat16* p = s + (n0 + g) * ld + k0 + 2 * t;
  b0 = ld_u32(p);
  b1 = ld_u32(p + 8);
}

// B fragment with B[k][n] = M[k][n]: rows of M are k (V in P V).
__device__ __forceinline__ void load_b_trans(uint32_t& b0, uint32_t& b1, const __nv_bfloat16* s, int ld, int n0,
                                             int k0, int g, int t) {
  const __nv_bfloat16* p = s + (k0 + 2 * t) * ld + n0 + g;
  b0 = pack_u16(p, p + ld);
  b1 = pack_u16(p + 8 * ld, p + 9 * ld);
}

#endif  // K2_ATTN_LDMATRIX

// ---- asynchronous global -> shared copies (16 bytes, zero-filled when !valid) -----------------

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = unsigned(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Rows [row0, row0 + ROWS) of a [T, H, D] bf16 tensor (head h, tokens from seq_start) into a
// shared [ROWS][D + kPad] tile; rows at or past seq_len are zero-filled.
template <int ROWS, int D>
__device__ __forceinline__ void load_tile_async(__nv_bfloat16* s, const __nv_bfloat16* __restrict__ g, int64_t seq_start,
                                                int seq_len, int row0, int64_t H, int h) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < ROWS * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = row0 + r < seq_len;
    const __nv_bfloat16* src = valid ? g + ((seq_start + row0 + r) * H + h) * D + c * 8 : g;
    cp_async16(s + r * (D + kPad) + c * 8, src, valid);
  }
}

inline bool is_mma_dims(int64_t Dk, int64_t Dv) {
  for (const auto& d : kMmaDims)
    if (d[0] == Dk && d[1] == Dv) return true;
  return false;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Opt in to more than 48 KB of dynamic shared memory when needed.
template <typename K>
inline void set_smem(K kernel, size_t bytes, const char* what) {
  if (bytes > 48 * 1024)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), what);
}

}  // namespace attn
}  // namespace cuda
}  // namespace k2
