// CUDA MLA attention forward (sm_90a) that also returns each head's maximum logit (QK-Clip's
// signal). Semantics: k2_kernels/reference.py::mla_attention; contract: k2/attention.h.
//
// Shape legend: T packed tokens, H heads, B sequences, Dk query/key head dim, Dv value head dim;
// BM query rows and BN keys per tile.
//
// Design (FlashAttention-2): one block of 4 warps per (query tile, head, sequence); blocks past a
// sequence's end exit at once. The block walks the key tiles its queries may see (causal: up to
// the diagonal tile, which is masked element-wise) with an online softmax: a running row max m
// and row sum l in fp32, the output rescaled by exp(m_old - m_new) when the max grows. The
// running max over allowed entries is also the row's max logit, so the head's max logit costs a
// block reduction and one atomic per block at the end.
//   - bf16 with (Dk, Dv) in attn::kMmaDims ((192, 128), (128, 128), (64, 64)) and 16-byte aligned
//     pointers: tensor cores, mma.sync m16n8k16 (bf16 in, fp32 accumulate), BM = BN = 64, each
//     warp owns 16 query rows, so row statistics need only the 4 lanes of a quad. Q, K and V
//     tiles sit in shared memory (rows padded by 16 bytes: conflict-free fragment loads);
//     cp.async loads V_j while S = Q K_j^T is computed and K_{j+1} while O += P V_j is.
//     P is rounded to bf16 for the P V product (as in FlashAttention); l stays fp32.
//   - fp32 inputs, other head dims (any multiple of 16 up to 256) and unaligned pointers: an
//     exact SIMT kernel, fp32 FMA throughout (no tf32), BM = BN = 32, each warp owns 8 query rows
//     and a lane one key of the tile (S) or up to 8 value columns (O).
// Next steps (speed, not correctness): wgmma with a warpgroup per 64 rows and TMA loads, two K/V
// stages, ldmatrix.x4 for pairs of B fragments, exp2 with the scale folded in, and an fp32 path on
// 3xTF32 if the fp32 forward ever matters.
#include <climits>
#include <cmath>

#include "mla_attention_common.cuh"

namespace k2 {
namespace cuda {
namespace attn {
namespace {

using bf16 = __nv_bfloat16;

__global__ void fill_kernel(float* __restrict__ p, int64_t n, float value) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) p[i] = value;
}

// ---- tensor-core kernel ------------------------------------------------------------------------

constexpr int kMmaBM = 64, kMmaBN = 64;

template <int DK, int DV>
constexpr size_t fwd_mma_smem() {
  return size_t(kMmaBM * (DK + kPad) + kMmaBN * (DK + kPad) + kMmaBN * (DV + kPad)) * sizeof(bf16);
}

template <int DK, int DV>
__global__ void __launch_bounds__(kThreads)
    fwd_mma_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                   const int32_t* __restrict__ cu_seqlens, int64_t T, int64_t H, int tiles_per_seq, float scale,
                   bool causal, bf16* __restrict__ out, float* __restrict__ lse, float* __restrict__ max_logit) {
  constexpr int BM = kMmaBM, BN = kMmaBN, LDK = DK + kPad, LDV = DV + kPad;
  static_assert(DK % 16 == 0 && DV % 16 == 0 && DK <= 256 && DV <= 256, "head dims: multiples of 16 up to 256");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float red[kThreads / 32];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);  // [BM][LDK]
  bf16* Ks = Qs + BM * LDK;                      // [BN][LDK]
  bf16* Vs = Ks + BN * LDK;                      // [BN][LDV]

  TileCoord tc;
  if (!tile_coord(cu_seqlens, tiles_per_seq, BM, tc)) return;
  const int h = int(blockIdx.y);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int len = tc.seq_len, q0 = tc.tile * BM;
  const int kv_end = causal ? min(q0 + BM, len) : len;
  const int n_kt = (kv_end + BN - 1) / BN;  // >= 1: q0 < len
  const int row_a = q0 + warp * 16 + g;     // this thread's rows: row_a and row_a + 8

  load_tile_async<BM, DK>(Qs, q, tc.seq_start, len, q0, H, h);
  load_tile_async<BN, DK>(Ks, k, tc.seq_start, len, 0, H, h);
  cp_async_commit();

  float o[DV / 8][4];
#pragma unroll
  for (int n = 0; n < DV / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};

  for (int j = 0; j < n_kt; ++j) {
    const int k0 = j * BN;
    load_tile_async<BN, DV>(Vs, v, tc.seq_start, len, k0, H, h);
    cp_async_commit();
    cp_async_wait<1>();  // Q and K_j have landed (V_j may still be in flight)
    __syncthreads();

    float s[BN / 8][4];
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
      uint32_t a[4];
      load_a(a, Qs, LDK, warp * 16, kk * 16, g, t);
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
        uint32_t b0, b1;
        load_b(b0, b1, Ks, LDK, n * 8, kk * 16, g, t);
        mma_bf16(s[n], a, b0, b1);
      }
    }

    // Scale and mask (rows past the sequence allow nothing), then the online softmax.
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row_a + (e >> 1) * 8, col = k0 + n * 8 + 2 * t + (e & 1);
        const bool ok = row < len && col < len && (!causal || col <= row);
        const float x = ok ? s[n][e] * scale : -INFINITY;
        s[n][e] = x;
        mt[e >> 1] = fmaxf(mt[e >> 1], x);
      }
    }
    float alpha[2], m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mt[r] = fmaxf(mt[r], __shfl_xor_sync(kFullMask, mt[r], 1));  // the quad shares the row
      mt[r] = fmaxf(mt[r], __shfl_xor_sync(kFullMask, mt[r], 2));
      const float m_new = fmaxf(m_r[r], mt[r]);
      m_use[r] = m_new == -INFINITY ? 0.0f : m_new;  // nothing allowed yet: avoid inf - inf
      alpha[r] = __expf(m_r[r] - m_use[r]);           // 0 while m_r is -inf
      m_r[r] = m_new;
    }
    float rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = __expf(s[n][e] - m_use[e >> 1]);  // masked: exp(-inf) = 0
        s[n][e] = p;
        rs[e >> 1] += p;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_r[r] = l_r[r] * alpha[r] + rs[r];  // per-lane partial; quad-summed at the end
#pragma unroll
    for (int n = 0; n < DV / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    cp_async_wait<0>();  // V_j has landed
    __syncthreads();     // ... for every thread, and every warp is done with K_j
    if (j + 1 < n_kt) load_tile_async<BN, DK>(Ks, k, tc.seq_start, len, k0 + BN, H, h);
    cp_async_commit();  // possibly empty: keeps the group count uniform

#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int n = 0; n < DV / 8; ++n) {
        uint32_t b0, b1;
        load_b_trans(b0, b1, Vs, LDV, n * 8, kk * 16, g, t);
        mma_bf16(o[n], a, b0, b1);
      }
    }
    __syncthreads();  // every warp is done with V_j before V_{j+1} is loaded
  }
  cp_async_wait<0>();  // nothing may still be writing shared memory when the block exits

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_r[r];
    l += __shfl_xor_sync(kFullMask, l, 1);
    l += __shfl_xor_sync(kFullMask, l, 2);
    const int row = row_a + 8 * r;
    if (row < len) {
      const int64_t tok = tc.seq_start + row;
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      bf16* orow = out + (tok * H + h) * DV + 2 * t;
#pragma unroll
      for (int n = 0; n < DV / 8; ++n)
        *reinterpret_cast<uint32_t*>(orow + n * 8) = pack_bf16(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
      if (t == 0) lse[h * T + tok] = l > 0.0f ? m_r[r] + logf(l) : -INFINITY;
    }
  }
  // max_logit == nullptr (uniform across the block): the caller measures the output's cost
  if (max_logit != nullptr) block_max_to_global(fmaxf(m_r[0], m_r[1]), red, max_logit + h);
}

// ---- exact SIMT kernel (fp32 arithmetic, any head dims) --------------------------------------

constexpr int kSimtBM = 32, kSimtBN = 32, kSimtRows = kSimtBM / (kThreads / 32), kMaxCols = 256 / 32;

inline size_t fwd_simt_smem(int Dk, int Dv) {
  return size_t(kSimtBM * Dk + kSimtBN * (Dk + 1) + kSimtBN * Dv + kSimtBM * kSimtBN) * sizeof(float);
}

template <typename E>
__global__ void __launch_bounds__(kThreads)
    fwd_simt_kernel(const E* __restrict__ q, const E* __restrict__ k, const E* __restrict__ v,
                    const int32_t* __restrict__ cu_seqlens, int64_t T, int64_t H, int Dk, int Dv, int tiles_per_seq,
                    float scale, bool causal, E* __restrict__ out, float* __restrict__ lse,
                    float* __restrict__ max_logit) {
  constexpr int BM = kSimtBM, BN = kSimtBN, R = kSimtRows;
  extern __shared__ float smem_f[];
  __shared__ float red[kThreads / 32];
  float* Qs = smem_f;               // [BM][Dk]
  float* Ks = Qs + BM * Dk;         // [BN][Dk + 1]: lane j reads row j, padded against bank conflicts
  float* Vs = Ks + BN * (Dk + 1);   // [BN][Dv]
  float* Ps = Vs + BN * Dv;         // [BM][BN]: probabilities, broadcast to the lanes owning columns

  TileCoord tc;
  if (!tile_coord(cu_seqlens, tiles_per_seq, BM, tc)) return;
  const int h = int(blockIdx.y);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int len = tc.seq_len, q0 = tc.tile * BM;
  const int kv_end = causal ? min(q0 + BM, len) : len;
  const int n_kt = (kv_end + BN - 1) / BN;

  for (int i = threadIdx.x; i < BM * Dk; i += kThreads) {
    const int r = i / Dk, c = i % Dk;
    Qs[i] = q0 + r < len ? to_f32(q[((tc.seq_start + q0 + r) * H + h) * Dk + c]) : 0.0f;
  }

  float o[R][kMaxCols], m_r[R], l_r[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    m_r[i] = -INFINITY;
    l_r[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < kMaxCols; ++c) o[i][c] = 0.0f;
  }
  const float* qrows = Qs + warp * R * Dk;
  float* prows = Ps + warp * R * BN;

  for (int j = 0; j < n_kt; ++j) {
    const int k0 = j * BN;
    __syncthreads();  // the previous tile's K and V are no longer read
    for (int i = threadIdx.x; i < BN * Dk; i += kThreads) {
      const int r = i / Dk, c = i % Dk;
      Ks[r * (Dk + 1) + c] = k0 + r < len ? to_f32(k[((tc.seq_start + k0 + r) * H + h) * Dk + c]) : 0.0f;
    }
    for (int i = threadIdx.x; i < BN * Dv; i += kThreads) {
      const int r = i / Dv, c = i % Dv;
      Vs[i] = k0 + r < len ? to_f32(v[((tc.seq_start + k0 + r) * H + h) * Dv + c]) : 0.0f;
    }
    __syncthreads();

    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.0f;
    const float* krow = Ks + lane * (Dk + 1);
    for (int d = 0; d < Dk; ++d) {
      const float kv = krow[d];
#pragma unroll
      for (int i = 0; i < R; ++i) acc[i] = __fmaf_rn(qrows[i * Dk + d], kv, acc[i]);
    }

    const int col = k0 + lane;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int row = q0 + warp * R + i;
      const bool ok = row < len && col < len && (!causal || col <= row);
      const float x = ok ? acc[i] * scale : -INFINITY;
      const float m_new = fmaxf(m_r[i], warp_max(x));
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = expf(m_r[i] - m_use);
      const float p = expf(x - m_use);
      l_r[i] = l_r[i] * alpha + warp_sum(p);
      m_r[i] = m_new;
      prows[i * BN + lane] = p;
#pragma unroll
      for (int c = 0; c < kMaxCols; ++c) o[i][c] *= alpha;
    }
    __syncwarp();

    for (int jj = 0; jj < BN; ++jj) {
#pragma unroll
      for (int c = 0; c < kMaxCols; ++c) {
        if (lane + 32 * c < Dv) {
          const float vv = Vs[jj * Dv + lane + 32 * c];
#pragma unroll
          for (int i = 0; i < R; ++i) o[i][c] = __fmaf_rn(prows[i * BN + jj], vv, o[i][c]);
        }
      }
    }
    __syncwarp();  // prows is rewritten by the next tile
  }

  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    mx = fmaxf(mx, m_r[i]);
    const int row = q0 + warp * R + i;
    if (row < len) {
      const int64_t tok = tc.seq_start + row;
      const float l = l_r[i], inv = l > 0.0f ? 1.0f / l : 0.0f;
      E* orow = out + (tok * H + h) * Dv;
#pragma unroll
      for (int c = 0; c < kMaxCols; ++c)
        if (lane + 32 * c < Dv) orow[lane + 32 * c] = from_f32<E>(o[i][c] * inv);
      if (lane == 0) lse[h * T + tok] = l > 0.0f ? m_r[i] + logf(l) : -INFINITY;
    }
  }
  if (max_logit != nullptr) block_max_to_global(mx, red, max_logit + h);
}

template <int DK, int DV>
bool launch_mma(const AttentionArgs& a, unsigned tiles_total, int tiles_per_seq, cudaStream_t s) {
  if (a.Dk != DK || a.Dv != DV) return false;
  constexpr size_t smem = fwd_mma_smem<DK, DV>();
  auto kernel = fwd_mma_kernel<DK, DV>;
  set_smem(kernel, smem, "mla_attention_fwd: cudaFuncSetAttribute");
  kernel<<<dim3(tiles_total, unsigned(a.H)), kThreads, smem, s>>>(
      static_cast<const bf16*>(a.q), static_cast<const bf16*>(a.k), static_cast<const bf16*>(a.v), a.cu_seqlens, a.T,
      a.H, tiles_per_seq, a.scale, a.causal, static_cast<bf16*>(a.out), a.lse, a.max_logit);
  return true;
}

}  // namespace
}  // namespace attn
}  // namespace cuda

void mla_attention_fwd_cuda(const AttentionArgs& a, int device, uintptr_t stream) {
  using namespace cuda;
  using namespace cuda::attn;
  validate(a);
  K2_CHECK(a.dtype == DType::kFloat32 || a.dtype == DType::kBFloat16,
           std::string("mla_attention (CUDA): dtype must be float32 or bfloat16, got ") + dtype_name(a.dtype));
  K2_CHECK(a.H <= 65535, "mla_attention (CUDA): H must be <= 65535");
  if (a.H == 0) return;
  set_device(device);
  const cudaStream_t s = as_stream(stream);
  if (a.max_logit != nullptr) {
    fill_kernel<<<grid_1d(a.H, 256), 256, 0, s>>>(a.max_logit, a.H, -INFINITY);
    check(cudaGetLastError(), "mla_attention_fwd: max_logit fill launch");
  }
  if (a.T == 0 || a.B == 0 || a.max_seqlen <= 0) return;

  const bool mma = a.dtype == DType::kBFloat16 && is_mma_dims(a.Dk, a.Dv) && aligned16(a.q) && aligned16(a.k) &&
                   aligned16(a.v) && aligned16(a.out);
  const int bm = mma ? kMmaBM : kSimtBM;
  const int64_t tiles_per_seq = (a.max_seqlen + bm - 1) / bm;
  K2_CHECK(tiles_per_seq * a.B <= INT_MAX, "mla_attention (CUDA): too many sequences x tiles for the grid");
  const unsigned tiles_total = unsigned(tiles_per_seq * a.B);

  if (mma) {
    const bool done = launch_mma<192, 128>(a, tiles_total, int(tiles_per_seq), s) ||
                      launch_mma<128, 128>(a, tiles_total, int(tiles_per_seq), s) ||
                      launch_mma<64, 64>(a, tiles_total, int(tiles_per_seq), s);
    K2_CHECK(done, "mla_attention (CUDA): internal error, no tensor-core instantiation for these head dims");
  } else {
    const size_t smem = fwd_simt_smem(int(a.Dk), int(a.Dv));
    const auto run = [&](auto tag) {
      using E = decltype(tag);
      auto kernel = fwd_simt_kernel<E>;
      set_smem(kernel, smem, "mla_attention_fwd: cudaFuncSetAttribute");
      kernel<<<dim3(tiles_total, unsigned(a.H)), kThreads, smem, s>>>(
          static_cast<const E*>(a.q), static_cast<const E*>(a.k), static_cast<const E*>(a.v), a.cu_seqlens, a.T, a.H,
          int(a.Dk), int(a.Dv), int(tiles_per_seq), a.scale, a.causal, static_cast<E*>(a.out), a.lse, a.max_logit);
    };
    if (a.dtype == DType::kFloat32)
      run(float{});
    else
      run(bf16{});
  }
  check(cudaGetLastError(), "mla_attention_fwd kernel launch");
}

}  // namespace k2
