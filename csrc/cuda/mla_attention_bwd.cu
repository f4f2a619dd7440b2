// CUDA MLA attention backward (sm_90a): dq, dk, dv from the forward's out and lse, without
// materialising the scores. Semantics: k2_kernels/reference.py::mla_attention; contract:
// k2/attention.h. Shape legend as in mla_attention_fwd.cu; BN keys per block, BM queries per step.
//
// Design (FlashAttention-2 backward), three launches on the caller's stream:
//   1. delta_kernel: delta[h, t] = sum_d dout * out (fp32, in the workspace), one warp per row;
//      the fp32 dq accumulator in the workspace is zeroed with cudaMemsetAsync.
//   2. the main kernel, one block of 4 warps per (key tile, head, sequence): K_j and V_j stay in
//      shared memory while the block walks the query tiles that may see them (causal: from the
//      diagonal tile on) and recomputes S = scale Q K^T, P = exp(S - lse) (masked),
//      dV += P^T dO, dP = dO V^T, dS = P (dP - delta), dK += scale dS^T Q, and
//      dQ += scale dS K, added into the fp32 workspace with atomics (blocks of other key tiles
//      add into the same rows).
//   3. convert_kernel: the fp32 dq to the output dtype. dk and dv are written directly.
//   - bf16 with (Dk, Dv) in attn::kMmaDims and 16-byte aligned pointers: tensor cores (mma.sync
//     m16n8k16, fp32 accumulate), BN = BM = 64. Each warp owns 16 keys and computes S^T and dP^T
//     for them (so its P^T and dS^T fragments are directly the A operands of dV and dK); dV is
//     accumulated in registers, dK in fp32 shared memory (the registers would spill); dS^T goes
//     through shared memory (bf16) so that each warp can then take 16 query rows of dQ.
//     P and scale * dS are rounded to bf16 as tensor-core inputs, as in FlashAttention.
//   - fp32 inputs, other head dims and unaligned pointers: an exact SIMT kernel (fp32 FMA), BN =
//     BM = 32, each warp owns 8 keys and a lane one query of the step.
// Next steps: wgmma (dV/dK as 64-row warpgroup products), ldmatrix.x4 for pairs of B fragments, a second query-tile stage (cp.async overlap), dK in
// registers with 8 warps, and a deterministic dq (per-key-tile partials, then a reduction).
#include <climits>
#include <cmath>

#include "mla_attention_common.cuh"

namespace k2 {
namespace cuda {
namespace attn {
namespace {

using bf16 = __nv_bfloat16;

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// ---- 1. delta = rowsum(dout * out); 3. fp32 dq -> output dtype --------------------------------

template <typename E>
__global__ void __launch_bounds__(kThreads)
    delta_kernel(const E* __restrict__ out, const E* __restrict__ dout, int64_t T, int64_t H, int Dv,
                 float* __restrict__ delta) {
  const int lane = threadIdx.x & 31, warps = kThreads / 32;
  for (int64_t row = int64_t(blockIdx.x) * warps + (threadIdx.x >> 5); row < T * H; row += int64_t(gridDim.x) * warps) {
    const E* o = out + row * Dv;
    const E* d = dout + row * Dv;
    float acc = 0.0f;
    for (int c = lane; c < Dv; c += 32) acc = __fmaf_rn(to_f32(o[c]), to_f32(d[c]), acc);
    acc = warp_sum(acc);
    if (lane == 0) delta[(row % H) * T + row / H] = acc;  // row = t * H + h; delta is [H, T]
  }
}

template <typename E>
__global__ void convert_kernel(const float* __restrict__ src, int64_t n, E* __restrict__ dst) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f32<E>(src[i]);
}

// ---- 2a. tensor-core kernel --------------------------------------------------------------------

constexpr int kMmaBM = 64, kMmaBN = 64;

template <int DK, int DV>
struct BwdSmem {
  static constexpr int LDK = DK + kPad, LDV = DV + kPad, LDS = kMmaBM + kPad, LDA = DK + kPad;
  static constexpr size_t kK = 0;                                        // bf16 [BN][LDK]
  static constexpr size_t kV = kK + size_t(kMmaBN) * LDK * 2;           // bf16 [BN][LDV]
  static constexpr size_t kQ = kV + size_t(kMmaBN) * LDV * 2;           // bf16 [BM][LDK]
  static constexpr size_t kdO = kQ + size_t(kMmaBM) * LDK * 2;          // bf16 [BM][LDV]
  static constexpr size_t kdS = kdO + size_t(kMmaBM) * LDV * 2;         // bf16 [BN][LDS]: scale * dS^T
  static constexpr size_t kdK = kdS + size_t(kMmaBN) * LDS * 2;         // fp32 [BN][LDA]: dK accumulator
  static constexpr size_t kLse = kdK + size_t(kMmaBN) * LDA * 4;        // fp32 [BM]
  static constexpr size_t kDelta = kLse + size_t(kMmaBM) * 4;           // fp32 [BM]
  static constexpr size_t kBytes = kDelta + size_t(kMmaBM) * 4;
  static_assert(kV % 16 == 0 && kQ % 16 == 0 && kdO % 16 == 0 && kdS % 16 == 0 && kdK % 16 == 0, "16-byte rows");
};

template <int DK, int DV>
__global__ void __launch_bounds__(kThreads)
    bwd_mma_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                   const bf16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                   const int32_t* __restrict__ cu_seqlens, int64_t T, int64_t H, int tiles_per_seq, float scale,
                   bool causal, float* __restrict__ dq_acc, bf16* __restrict__ dk, bf16* __restrict__ dv) {
  using L = BwdSmem<DK, DV>;
  constexpr int BM = kMmaBM, BN = kMmaBN, LDK = L::LDK, LDV = L::LDV, LDS = L::LDS, LDA = L::LDA;
  static_assert(BM == BN, "the causal start tile assumes square tiles");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw + L::kK);
  bf16* Vs = reinterpret_cast<bf16*>(smem_raw + L::kV);
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw + L::kQ);
  bf16* dOs = reinterpret_cast<bf16*>(smem_raw + L::kdO);
  bf16* dSs = reinterpret_cast<bf16*>(smem_raw + L::kdS);
  float* dKa = reinterpret_cast<float*>(smem_raw + L::kdK);
  float* lse_s = reinterpret_cast<float*>(smem_raw + L::kLse);
  float* delta_s = reinterpret_cast<float*>(smem_raw + L::kDelta);

  TileCoord tc;
  if (!tile_coord(cu_seqlens, tiles_per_seq, BN, tc)) return;
  const int h = int(blockIdx.y);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int len = tc.seq_len, k0 = tc.tile * BN;
  const int key_a = k0 + warp * 16 + g;  // this thread's keys: key_a and key_a + 8

  load_tile_async<BN, DK>(Ks, k, tc.seq_start, len, k0, H, h);
  load_tile_async<BN, DV>(Vs, v, tc.seq_start, len, k0, H, h);
  cp_async_commit();
  for (int i = threadIdx.x; i < BN * LDA; i += kThreads) dKa[i] = 0.0f;

  float dv_acc[DV / 8][4];
#pragma unroll
  for (int n = 0; n < DV / 8; ++n) dv_acc[n][0] = dv_acc[n][1] = dv_acc[n][2] = dv_acc[n][3] = 0.0f;

  const int q_begin = causal ? tc.tile : 0;  // earlier query tiles see none of these keys
  const int n_qt = (len + BM - 1) / BM;
  for (int qt = q_begin; qt < n_qt; ++qt) {
    const int q0 = qt * BM;
    load_tile_async<BM, DK>(Qs, q, tc.seq_start, len, q0, H, h);
    load_tile_async<BM, DV>(dOs, dout, tc.seq_start, len, q0, H, h);
    cp_async_commit();
    for (int r = threadIdx.x; r < BM; r += kThreads) {
      const bool valid = q0 + r < len;
      const int64_t idx = h * T + tc.seq_start + q0 + r;
      lse_s[r] = valid ? lse[idx] : 0.0f;
      delta_s[r] = valid ? delta[idx] : 0.0f;
    }
    cp_async_wait<0>();
    __syncthreads();

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x BM queries.
    float st[BM / 8][4], dpt[BM / 8][4];
#pragma unroll
    for (int n = 0; n < BM / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
      uint32_t a[4];
      load_a(a, Ks, LDK, warp * 16, kk * 16, g, t);
#pragma unroll
      for (int n = 0; n < BM / 8; ++n) {
        uint32_t b0, b1;
        load_b(b0, b1, Qs, LDK, n * 8, kk * 16, g, t);
        mma_bf16(st[n], a, b0, b1);
      }
    }
#pragma unroll
    for (int kk = 0; kk < DV / 16; ++kk) {
      uint32_t a[4];
      load_a(a, Vs, LDV, warp * 16, kk * 16, g, t);
#pragma unroll
      for (int n = 0; n < BM / 8; ++n) {
        uint32_t b0, b1;
        load_b(b0, b1, dOs, LDV, n * 8, kk * 16, g, t);
        mma_bf16(dpt[n], a, b0, b1);
      }
    }

    // P^T and scale * dS^T (masked entries: 0), as bf16 A fragments of 16 keys x 16 queries.
#pragma unroll
    for (int n = 0; n < BM / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key_a + (e >> 1) * 8, ql = n * 8 + 2 * t + (e & 1), qq = q0 + ql;
        const bool ok = key < len && qq < len && (!causal || key <= qq);
        const float p = ok ? __expf(st[n][e] * scale - lse_s[ql]) : 0.0f;
        st[n][e] = p;
        dpt[n][e] = p * (dpt[n][e] - delta_s[ql]) * scale;
      }
    }
    uint32_t pa[BM / 16][4], da[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      pa[kk][0] = pack_bf16(st[2 * kk][0], st[2 * kk][1]);
      pa[kk][1] = pack_bf16(st[2 * kk][2], st[2 * kk][3]);
      pa[kk][2] = pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]);
      pa[kk][3] = pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3]);
      da[kk][0] = pack_bf16(dpt[2 * kk][0], dpt[2 * kk][1]);
      da[kk][1] = pack_bf16(dpt[2 * kk][2], dpt[2 * kk][3]);
      da[kk][2] = pack_bf16(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
      da[kk][3] = pack_bf16(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
      // scale * dS^T into shared memory [key][query] for the dQ product: da[kk][0] holds keys
      // (g) x queries (16 kk + 2t, +1), da[kk][1] key g + 8, da[kk][2..3] queries + 8.
      bf16* drow = dSs + (warp * 16 + g) * LDS + kk * 16 + 2 * t;
      *reinterpret_cast<uint32_t*>(drow) = da[kk][0];
      *reinterpret_cast<uint32_t*>(drow + 8 * LDS) = da[kk][1];
      *reinterpret_cast<uint32_t*>(drow + 8) = da[kk][2];
      *reinterpret_cast<uint32_t*>(drow + 8 * LDS + 8) = da[kk][3];
    }

    // dV += P^T dO (registers).
#pragma unroll
    for (int n = 0; n < DV / 8; ++n) {
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t b0, b1;
        load_b_trans(b0, b1, dOs, LDV, n * 8, kk * 16, g, t);
        mma_bf16(dv_acc[n], pa[kk], b0, b1);
      }
    }
    // dK += (scale dS^T) Q (shared fp32; this warp's rows only).
#pragma unroll
    for (int n = 0; n < DK / 8; ++n) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t b0, b1;
        load_b_trans(b0, b1, Qs, LDK, n * 8, kk * 16, g, t);
        mma_bf16(c, da[kk], b0, b1);
      }
      float* r0 = dKa + (warp * 16 + g) * LDA + n * 8 + 2 * t;
      float2 lo = *reinterpret_cast<float2*>(r0), hi = *reinterpret_cast<float2*>(r0 + 8 * LDA);
      lo.x += c[0];
      lo.y += c[1];
      hi.x += c[2];
      hi.y += c[3];
      *reinterpret_cast<float2*>(r0) = lo;
      *reinterpret_cast<float2*>(r0 + 8 * LDA) = hi;
    }
    __syncthreads();  // dS^T complete

    // dQ (this warp's 16 queries) += (scale dS) K, into the fp32 workspace.
    uint32_t qa[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) load_a_trans(qa[kk], dSs, LDS, warp * 16, kk * 16, g, t);
    const int qrow = q0 + warp * 16 + g;
    float* dq0 = dq_acc + ((tc.seq_start + qrow) * H + h) * DK + 2 * t;
    float* dq8 = dq0 + 8 * H * DK;
#pragma unroll
    for (int n = 0; n < DK / 8; ++n) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t b0, b1;
        load_b_trans(b0, b1, Ks, LDK, n * 8, kk * 16, g, t);
        mma_bf16(c, qa[kk], b0, b1);
      }
      if (qrow < len) {
        atomicAdd(dq0 + n * 8, c[0]);
        atomicAdd(dq0 + n * 8 + 1, c[1]);
      }
      if (qrow + 8 < len) {
        atomicAdd(dq8 + n * 8, c[2]);
        atomicAdd(dq8 + n * 8 + 1, c[3]);
      }
    }
    __syncthreads();  // Q, dO, dS^T, lse and delta are reloaded next step
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_a + 8 * r;
    if (key < len) {
      bf16* vrow = dv + ((tc.seq_start + key) * H + h) * DV + 2 * t;
#pragma unroll
      for (int n = 0; n < DV / 8; ++n)
        *reinterpret_cast<uint32_t*>(vrow + n * 8) = pack_bf16(dv_acc[n][2 * r], dv_acc[n][2 * r + 1]);
    }
  }
  cp_async_wait<0>();  // (only when no query step ran: K and V copies)
  __syncthreads();     // dK accumulator complete (and zeroed, when no query step ran)
  for (int i = threadIdx.x; i < BN * (DK / 2); i += kThreads) {
    const int r = i / (DK / 2), c = (i % (DK / 2)) * 2;
    if (k0 + r < len)
      *reinterpret_cast<uint32_t*>(dk + ((tc.seq_start + k0 + r) * H + h) * DK + c) =
          pack_bf16(dKa[r * LDA + c], dKa[r * LDA + c + 1]);
  }
}

// ---- 2b. exact SIMT kernel ---------------------------------------------------------------------

constexpr int kSimtBM = 32, kSimtBN = 32, kSimtKeys = kSimtBN / (kThreads / 32);

inline size_t bwd_simt_smem(int Dk, int Dv) {
  const size_t floats = size_t(kSimtBN) * Dk + size_t(kSimtBN) * Dv            // K, V
                        + size_t(kSimtBM) * (Dk + 1) + size_t(kSimtBM) * (Dv + 1)  // Q, dO (padded)
                        + size_t(kSimtBN) * Dk + size_t(kSimtBN) * Dv            // dK, dV accumulators
                        + 2 * size_t(kSimtBN) * kSimtBM + 2 * size_t(kSimtBM);   // P, dS, lse, delta
  return floats * sizeof(float);
}

template <typename E>
__global__ void __launch_bounds__(kThreads)
    bwd_simt_kernel(const E* __restrict__ q, const E* __restrict__ k, const E* __restrict__ v,
                    const E* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                    const int32_t* __restrict__ cu_seqlens, int64_t T, int64_t H, int Dk, int Dv, int tiles_per_seq,
                    float scale, bool causal, float* __restrict__ dq_acc, E* __restrict__ dk, E* __restrict__ dv) {
  constexpr int BM = kSimtBM, BN = kSimtBN, KW = kSimtKeys;
  static_assert(BM == BN && BM == 32, "a lane per query of the step; square tiles for the causal start");
  extern __shared__ float smem_f[];
  float* Ks = smem_f;                 // [BN][Dk]
  float* Vs = Ks + BN * Dk;           // [BN][Dv]
  float* Qs = Vs + BN * Dv;           // [BM][Dk + 1]: lane j reads row j
  float* dOs = Qs + BM * (Dk + 1);    // [BM][Dv + 1]
  float* dKa = dOs + BM * (Dv + 1);   // [BN][Dk]
  float* dVa = dKa + BN * Dk;         // [BN][Dv]
  float* Ps = dVa + BN * Dv;          // [BN][BM]
  float* dSs = Ps + BN * BM;          // [BN][BM]
  float* lse_s = dSs + BN * BM;       // [BM]
  float* delta_s = lse_s + BM;        // [BM]

  TileCoord tc;
  if (!tile_coord(cu_seqlens, tiles_per_seq, BN, tc)) return;
  const int h = int(blockIdx.y);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int len = tc.seq_len, k0 = tc.tile * BN;

  for (int i = threadIdx.x; i < BN * Dk; i += kThreads) {
    const int r = i / Dk, c = i % Dk;
    Ks[i] = k0 + r < len ? to_f32(k[((tc.seq_start + k0 + r) * H + h) * Dk + c]) : 0.0f;
    dKa[i] = 0.0f;
  }
  for (int i = threadIdx.x; i < BN * Dv; i += kThreads) {
    const int r = i / Dv, c = i % Dv;
    Vs[i] = k0 + r < len ? to_f32(v[((tc.seq_start + k0 + r) * H + h) * Dv + c]) : 0.0f;
    dVa[i] = 0.0f;
  }

  const int q_begin = causal ? tc.tile : 0;
  const int n_qt = (len + BM - 1) / BM;
  for (int qt = q_begin; qt < n_qt; ++qt) {
    const int q0 = qt * BM;
    __syncthreads();  // the previous step's Q, dO, dS are no longer read
    for (int i = threadIdx.x; i < BM * Dk; i += kThreads) {
      const int r = i / Dk, c = i % Dk;
      Qs[r * (Dk + 1) + c] = q0 + r < len ? to_f32(q[((tc.seq_start + q0 + r) * H + h) * Dk + c]) : 0.0f;
    }
    for (int i = threadIdx.x; i < BM * Dv; i += kThreads) {
      const int r = i / Dv, c = i % Dv;
      dOs[r * (Dv + 1) + c] = q0 + r < len ? to_f32(dout[((tc.seq_start + q0 + r) * H + h) * Dv + c]) : 0.0f;
    }
    for (int r = threadIdx.x; r < BM; r += kThreads) {
      const bool valid = q0 + r < len;
      const int64_t idx = h * T + tc.seq_start + q0 + r;
      lse_s[r] = valid ? lse[idx] : 0.0f;
      delta_s[r] = valid ? delta[idx] : 0.0f;
    }
    __syncthreads();

    // Lane = query q0 + lane; this warp's keys k0 + KW * warp + i.
    float s[KW], dp[KW];
#pragma unroll
    for (int i = 0; i < KW; ++i) s[i] = dp[i] = 0.0f;
    const float* kw = Ks + warp * KW * Dk;
    const float* vw = Vs + warp * KW * Dv;
    const float* qrow = Qs + lane * (Dk + 1);
    const float* orow = dOs + lane * (Dv + 1);
    for (int d = 0; d < Dk; ++d) {
      const float qv = qrow[d];
#pragma unroll
      for (int i = 0; i < KW; ++i) s[i] = __fmaf_rn(qv, kw[i * Dk + d], s[i]);
    }
    for (int d = 0; d < Dv; ++d) {
      const float ov = orow[d];
#pragma unroll
      for (int i = 0; i < KW; ++i) dp[i] = __fmaf_rn(ov, vw[i * Dv + d], dp[i]);
    }
    const int qq = q0 + lane;
#pragma unroll
    for (int i = 0; i < KW; ++i) {
      const int kl = warp * KW + i, key = k0 + kl;
      const bool ok = key < len && qq < len && (!causal || key <= qq);
      const float p = ok ? expf(s[i] * scale - lse_s[lane]) : 0.0f;
      Ps[kl * BM + lane] = p;
      dSs[kl * BM + lane] = p * (dp[i] - delta_s[lane]);
    }
    __syncwarp();

    // dV[key] += sum_j P[key][j] dO[j]; dK[key] += sum_j dS[key][j] Q[j] (lane = column).
    for (int i = 0; i < KW; ++i) {
      const int kl = warp * KW + i;
      const float* prow = Ps + kl * BM;
      const float* srow = dSs + kl * BM;
      for (int c = lane; c < Dv; c += 32) {
        float acc = 0.0f;
        for (int j = 0; j < BM; ++j) acc = __fmaf_rn(prow[j], dOs[j * (Dv + 1) + c], acc);
        dVa[kl * Dv + c] += acc;
      }
      for (int c = lane; c < Dk; c += 32) {
        float acc = 0.0f;
        for (int j = 0; j < BM; ++j) acc = __fmaf_rn(srow[j], Qs[j * (Dk + 1) + c], acc);
        dKa[kl * Dk + c] += acc;
      }
    }
    __syncthreads();  // every warp's dS rows written

    // dQ[j] += scale * sum_key dS[key][j] K[key], into the fp32 workspace.
    for (int i = threadIdx.x; i < BM * Dk; i += kThreads) {
      const int j = i / Dk, c = i % Dk;
      if (q0 + j >= len) continue;
      float acc = 0.0f;
      for (int kl = 0; kl < BN; ++kl) acc = __fmaf_rn(dSs[kl * BM + j], Ks[kl * Dk + c], acc);
      atomicAdd(dq_acc + ((tc.seq_start + q0 + j) * H + h) * Dk + c, acc * scale);
    }
  }
  __syncthreads();  // dK, dV accumulators complete

  for (int i = threadIdx.x; i < BN * Dk; i += kThreads) {
    const int r = i / Dk, c = i % Dk;
    if (k0 + r < len) dk[((tc.seq_start + k0 + r) * H + h) * Dk + c] = from_f32<E>(dKa[i] * scale);
  }
  for (int i = threadIdx.x; i < BN * Dv; i += kThreads) {
    const int r = i / Dv, c = i % Dv;
    if (k0 + r < len) dv[((tc.seq_start + k0 + r) * H + h) * Dv + c] = from_f32<E>(dVa[i]);
  }
}

template <int DK, int DV>
bool launch_mma(const AttentionBackwardArgs& a, float* dq_acc, const float* delta, unsigned tiles_total,
                int tiles_per_seq, cudaStream_t s) {
  if (a.Dk != DK || a.Dv != DV) return false;
  constexpr size_t smem = BwdSmem<DK, DV>::kBytes;
  auto kernel = bwd_mma_kernel<DK, DV>;
  set_smem(kernel, smem, "mla_attention_bwd: cudaFuncSetAttribute");
  kernel<<<dim3(tiles_total, unsigned(a.H)), kThreads, smem, s>>>(
      static_cast<const bf16*>(a.q), static_cast<const bf16*>(a.k), static_cast<const bf16*>(a.v),
      static_cast<const bf16*>(a.dout), a.lse, delta, a.cu_seqlens, a.T, a.H, tiles_per_seq, a.scale, a.causal, dq_acc,
      static_cast<bf16*>(a.dk), static_cast<bf16*>(a.dv));
  return true;
}

}  // namespace
}  // namespace attn
}  // namespace cuda

size_t mla_attention_bwd_workspace_bytes(int64_t T, int64_t H, int64_t Dk) {
  using cuda::attn::align256;
  if (T <= 0 || H <= 0 || Dk <= 0) return 0;
  return align256(size_t(T) * size_t(H) * size_t(Dk) * sizeof(float)) + align256(size_t(H) * size_t(T) * sizeof(float));
}

void mla_attention_bwd_cuda(const AttentionBackwardArgs& a, void* workspace, int device, uintptr_t stream) {
  using namespace cuda;
  using namespace cuda::attn;
  validate(a);
  K2_CHECK(a.dtype == DType::kFloat32 || a.dtype == DType::kBFloat16,
           std::string("mla_attention_backward (CUDA): dtype must be float32 or bfloat16, got ") + dtype_name(a.dtype));
  K2_CHECK(a.H <= 65535, "mla_attention_backward (CUDA): H must be <= 65535");
  if (a.T == 0 || a.H == 0) return;
  K2_CHECK(workspace != nullptr && aligned16(workspace),
           "mla_attention_backward (CUDA): workspace must be a 16-byte aligned buffer of "
           "mla_attention_bwd_workspace_bytes(T, H, Dk) bytes");
  set_device(device);
  const cudaStream_t s = as_stream(stream);
  const size_t dq_bytes = size_t(a.T) * size_t(a.H) * size_t(a.Dk) * sizeof(float);
  float* dq_acc = static_cast<float*>(workspace);
  float* delta = reinterpret_cast<float*>(static_cast<char*>(workspace) + align256(dq_bytes));

  check(cudaMemsetAsync(dq_acc, 0, dq_bytes, s), "mla_attention_bwd: cudaMemsetAsync(dq workspace)");
  const bool is_bf16 = a.dtype == DType::kBFloat16;
  const unsigned rows_grid = grid_1d(a.T * a.H, kThreads / 32, 1 << 16);
  if (is_bf16)
    delta_kernel<bf16><<<rows_grid, kThreads, 0, s>>>(static_cast<const bf16*>(a.out), static_cast<const bf16*>(a.dout),
                                                      a.T, a.H, int(a.Dv), delta);
  else
    delta_kernel<float><<<rows_grid, kThreads, 0, s>>>(static_cast<const float*>(a.out),
                                                       static_cast<const float*>(a.dout), a.T, a.H, int(a.Dv), delta);
  check(cudaGetLastError(), "mla_attention_bwd: delta kernel launch");

  if (a.B > 0 && a.max_seqlen > 0) {
    const bool mma = is_bf16 && is_mma_dims(a.Dk, a.Dv) && aligned16(a.q) && aligned16(a.k) && aligned16(a.v) &&
                     aligned16(a.dout) && aligned16(a.dk) && aligned16(a.dv);
    const int bn = mma ? kMmaBN : kSimtBN;
    const int64_t tiles_per_seq = (a.max_seqlen + bn - 1) / bn;
    K2_CHECK(tiles_per_seq * a.B <= INT_MAX, "mla_attention_backward (CUDA): too many sequences x tiles for the grid");
    const unsigned tiles_total = unsigned(tiles_per_seq * a.B);
    if (mma) {
      const bool done = launch_mma<192, 128>(a, dq_acc, delta, tiles_total, int(tiles_per_seq), s) ||
                        launch_mma<128, 128>(a, dq_acc, delta, tiles_total, int(tiles_per_seq), s) ||
                        launch_mma<64, 64>(a, dq_acc, delta, tiles_total, int(tiles_per_seq), s);
      K2_CHECK(done, "mla_attention_backward (CUDA): internal error, no tensor-core instantiation for these head dims");
    } else {
      const size_t smem = bwd_simt_smem(int(a.Dk), int(a.Dv));
      const auto run = [&](auto tag) {
        using E = decltype(tag);
        auto kernel = bwd_simt_kernel<E>;
        set_smem(kernel, smem, "mla_attention_bwd: cudaFuncSetAttribute");
        kernel<<<dim3(tiles_total, unsigned(a.H)), kThreads, smem, s>>>(
            static_cast<const E*>(a.q), static_cast<const E*>(a.k), static_cast<const E*>(a.v),
            static_cast<const E*>(a.dout), a.lse, delta, a.cu_seqlens, a.T, a.H, int(a.Dk), int(a.Dv),
            int(tiles_per_seq), a.scale, a.causal, dq_acc, static_cast<E*>(a.dk), static_cast<E*>(a.dv));
      };
      if (is_bf16)
        run(bf16{});
      else
        run(float{});
    }
    check(cudaGetLastError(), "mla_attention_bwd: main kernel launch");
  }

  const int64_t n = a.T * a.H * a.Dk;
  const unsigned grid = grid_1d(n, 256, 1 << 16);
  if (is_bf16)
    convert_kernel<bf16><<<grid, 256, 0, s>>>(dq_acc, n, static_cast<bf16*>(a.dq));
  else
    convert_kernel<float><<<grid, 256, 0, s>>>(dq_acc, n, static_cast<float*>(a.dq));
  check(cudaGetLastError(), "mla_attention_bwd: dq conversion launch");
}

}  // namespace k2
