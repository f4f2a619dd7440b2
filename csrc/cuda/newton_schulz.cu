// CUDA Newton-Schulz: all steps of the schedule on a batch of [M, N] matrices (M <= N), in place.
//
// Per step three launches, blockIdx.z = matrix, square output tiles:
//   A  = X X^T              "syrk": only tiles (ti, tj) with ti <= tj are computed (blockIdx.x
//                           enumerates the upper triangle of tiles); an off-diagonal tile is
//                           stored twice, at (ti, tj) and mirrored at (tj, ti)
//   P  = c A A^T + b A      syrk again (A is symmetric, A A = A A^T), the epilogue adds b A
//   X' = P X + a X          a plain tile GEMM whose epilogue adds a X, into a ping-pong buffer
// Each product is rounded once to the storage dtype after the fp32 epilogue, like torch's bf16
// bmm / baddbmm (and torch.optim.Muon's addmm).
//
// bf16: tensor cores through nvcuda::wmma (16x16x16 bf16 fragments, fp32 accumulators); 64 x 64
// tiles of 4 warps (32 x 32 each) below M = 512, 128 x 128 tiles of 8 warps (64 x 32 each) from
// there (more blocks for small matrices, more reuse per loaded tile for large ones). The
// accumulators go through a per-warp shared staging tile so that both the direct and the mirrored
// stores are row-contiguous.
// fp32: plain fp32 FMAs (no TF32, so results stay within fp32 rounding), 256 threads x 4 x 4.
// Correctness first: single-buffered shared-memory tiles, bounds checks on every edge.
#include <mma.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "cuda_common.cuh"
#include "k2/newton_schulz.h"

namespace k2 {
namespace cuda {
namespace {

constexpr int kTile = 64;       // output tile of the fp32 kernel (both dims)
constexpr int kBkF32 = 16;      // K slice, fp32
constexpr int kPadBf16 = 8;     // row padding (elements): keeps wmma's 32-byte alignment, spreads banks
constexpr int kStageLd = 20;    // staging row stride (floats), a multiple of 4 as wmma requires
constexpr int kMaxGridZ = 65535;

// bf16 block shapes: WARPS_M x WARPS_N warps, each FRAG_M x FRAG_N 16x16 fragments, K slice BK.
// Square tiles (the syrk grid enumerates the same tiles along rows and columns).
template <int WARPS_M, int WARPS_N, int FRAG_M, int FRAG_N, int BK_, int MIN_BLOCKS>
struct Bf16Cfg {
  static constexpr int kWarpsM = WARPS_M, kWarpsN = WARPS_N, kFragM = FRAG_M, kFragN = FRAG_N, BK = BK_;
  static constexpr int kThreads = 32 * WARPS_M * WARPS_N, kMinBlocks = MIN_BLOCKS;
  static constexpr int kTileM = WARPS_M * FRAG_M * 16, kTileN = WARPS_N * FRAG_N * 16;
  static_assert(kTileM == kTileN, "square tiles");
};
using SmallTile = Bf16Cfg<2, 2, 2, 2, 64, 4>;  // 64 x 64, 4 warps of 32 x 32
using LargeTile = Bf16Cfg<2, 4, 4, 2, 32, 2>;  // 128 x 128, 8 warps of 64 x 32 (twice the reuse per load)
#ifndef K2_NS_LARGE_TILE_MIN_M
#define K2_NS_LARGE_TILE_MIN_M 512  // below this the 128-tiles leave too few blocks for the SMs
#endif

// out = alpha * (L R) + beta * Cin over one matrix per blockIdx.z. kSyrk: R = L^T (L is [rows, K]
// and rows == cols), only upper-triangle tiles. Otherwise L [rows, K], R [K, cols], row-major.
template <typename T>
struct GemmParams {
  const T* L;
  int64_t l_mat, l_ld;
  const T* R;
  int64_t r_mat, r_ld;
  const T* Cin;  // may be null when beta == 0
  int64_t c_mat, c_ld;
  T* out;
  int64_t o_mat, o_ld;
  int rows, cols, K;
  int tiles;  // kSyrk: tiles per side
  float alpha, beta;
  bool vec_l, vec_r;  // 16-byte loads allowed (aligned base, row and matrix strides)
};

// Upper-triangle tile (ti <= tj) of linear index idx, row by row.
__device__ __forceinline__ void tri_tile(int idx, int tiles, int& ti, int& tj) {
  ti = 0;
  while (idx >= tiles - ti) {
    idx -= tiles - ti;
    ++ti;
  }
  tj = ti + idx;
}

// Copy g[r0 + r][c0 + c] (r < ROWS, c < COLS; zero outside rmax x cmax) into s[r][c], bf16.
template <int ROWS, int COLS, int LD>
__device__ __forceinline__ void load_tile_bf16(__nv_bfloat16 (*s)[LD], const __nv_bfloat16* g, int64_t ldg, int64_t r0,
                                               int64_t c0, int64_t rmax, int64_t cmax, bool vec) {
  constexpr int kChunksPerRow = COLS / 8;
  const __nv_bfloat16 zero = __ushort_as_bfloat16(0);
  for (int ch = threadIdx.x; ch < ROWS * kChunksPerRow; ch += blockDim.x) {
    const int r = ch / kChunksPerRow, c = (ch % kChunksPerRow) * 8;
    const int64_t gr = r0 + r, gc = c0 + c;
    if (vec && gr < rmax && gc + 8 <= cmax) {
      *reinterpret_cast<uint4*>(&s[r][c]) = *reinterpret_cast<const uint4*>(g + gr * ldg + gc);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) s[r][c + e] = (gr < rmax && gc + e < cmax) ? g[gr * ldg + gc + e] : zero;
    }
  }
}

template <bool kSyrk, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) ns_gemm_bf16(GemmParams<__nv_bfloat16> p) {
  using namespace nvcuda;
  using BLayout = typename std::conditional<kSyrk, wmma::col_major, wmma::row_major>::type;
  constexpr int BK = Cfg::BK, kTile = Cfg::kTileM, FM = Cfg::kFragM, FN = Cfg::kFragN;
  constexpr int kLdK = BK + kPadBf16;     // [row][k] tiles
  constexpr int kLdN = kTile + kPadBf16;  // [k][col] tile (plain GEMM's R)
  __shared__ __align__(128) __nv_bfloat16 Ls[kTile][kLdK];
  // kSyrk: R^T rows [col][k] (col_major B); else R rows [k][col] (row_major B). One buffer, two views.
  __shared__ __align__(128) __nv_bfloat16 Rs[kTile * kLdK > BK * kLdN ? kTile * kLdK : BK * kLdN];
  __shared__ __align__(128) float stage[Cfg::kWarpsM * Cfg::kWarpsN][16 * kStageLd];

  int ti, tj;
  if constexpr (kSyrk) {
    tri_tile(int(blockIdx.x), p.tiles, ti, tj);
  } else {
    ti = int(blockIdx.y);
    tj = int(blockIdx.x);
  }
  const int64_t z = blockIdx.z;
  const __nv_bfloat16* L = p.L + z * p.l_mat;
  const __nv_bfloat16* R = kSyrk ? L : p.R + z * p.r_mat;
  const __nv_bfloat16* Cin = p.Cin == nullptr ? nullptr : p.Cin + z * p.c_mat;
  __nv_bfloat16* out = p.out + z * p.o_mat;
  const int64_t row0 = int64_t(ti) * kTile, col0 = int64_t(tj) * kTile;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = warp / Cfg::kWarpsN, wc = warp % Cfg::kWarpsN;  // the warp's (16 FM) x (16 FN) sub-tile
  constexpr int WM = 16 * FM, WN = 16 * FN;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  auto Rk = reinterpret_cast<__nv_bfloat16(*)[kLdK]>(Rs);  // kSyrk view: [col][k]
  auto Rn = reinterpret_cast<__nv_bfloat16(*)[kLdN]>(Rs);  // plain view: [k][col]
  for (int64_t k0 = 0; k0 < p.K; k0 += BK) {
    load_tile_bf16<kTile, BK, kLdK>(Ls, L, p.l_ld, row0, k0, p.rows, p.K, p.vec_l);
    if constexpr (kSyrk) {
      load_tile_bf16<kTile, BK, kLdK>(Rk, R, p.l_ld, col0, k0, p.rows, p.K, p.vec_l);
    } else {
      load_tile_bf16<BK, kTile, kLdN>(Rn, R, p.r_ld, k0, col0, p.K, p.cols, p.vec_r);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[FM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> b[FN];
#pragma unroll
      for (int i = 0; i < FM; ++i) wmma::load_matrix_sync(a[i], &Ls[wr * WM + i * 16][kk], kLdK);
#pragma unroll
      for (int j = 0; j < FN; ++j) {
        if constexpr (kSyrk) {
          wmma::load_matrix_sync(b[j], &Rk[wc * WN + j * 16][kk], kLdK);  // B(k, n) at [n][k]
        } else {
          wmma::load_matrix_sync(b[j], &Rn[kk][wc * WN + j * 16], kLdN);  // B(k, n) at [k][n]
        }
      }
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }

  // Epilogue, one 16 x 16 fragment at a time through the warp's staging tile.
  const bool mirror = kSyrk && ti != tj;
  float* st = stage[warp];
#pragma unroll
  for (int i = 0; i < FM; ++i) {
#pragma unroll
    for (int j = 0; j < FN; ++j) {
      wmma::store_matrix_sync(st, acc[i][j], kStageLd, wmma::mem_row_major);
      __syncwarp();
      const int64_t fr = row0 + wr * WM + i * 16, fc = col0 + wc * WN + j * 16;  // fragment origin
      {  // direct store: lane -> row lane / 2, 8 consecutive columns
        const int r = lane / 2, c0 = (lane % 2) * 8;
        const int64_t gi = fr + r;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int64_t gj = fc + c0 + e;
          float v = p.alpha * st[r * kStageLd + c0 + e];
          if (gi < p.rows && gj < p.cols) {
            if (p.beta != 0.0f) v += p.beta * __bfloat162float(Cin[gi * p.c_ld + gj]);
            out[gi * p.o_ld + gj] = __float2bfloat16_rn(v);
          }
          st[r * kStageLd + c0 + e] = v;
        }
      }
      __syncwarp();
      if (mirror) {  // (gi, gj) -> (gj, gi): lane -> fragment column lane / 2, 8 consecutive rows
        const int c = lane / 2, r0 = (lane % 2) * 8;
        const int64_t gj = fc + c;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int64_t gi = fr + r0 + e;
          if (gi < p.rows && gj < p.cols) out[gj * p.o_ld + gi] = __float2bfloat16_rn(st[(r0 + e) * kStageLd + c]);
        }
      }
      __syncwarp();
    }
  }
}

template <bool kSyrk>
__global__ void __launch_bounds__(256) ns_gemm_f32(GemmParams<float> p) {
  constexpr int BK = kBkF32;
  __shared__ float Lk[BK][kTile + 4];  // [k][row]
  __shared__ float Rk[BK][kTile + 4];  // [k][col]
  int ti, tj;
  if constexpr (kSyrk) {
    tri_tile(int(blockIdx.x), p.tiles, ti, tj);
  } else {
    ti = int(blockIdx.y);
    tj = int(blockIdx.x);
  }
  const int64_t z = blockIdx.z;
  const float* L = p.L + z * p.l_mat;
  const float* R = kSyrk ? L : p.R + z * p.r_mat;
  const float* Cin = p.Cin == nullptr ? nullptr : p.Cin + z * p.c_mat;
  float* out = p.out + z * p.o_mat;
  const int64_t row0 = int64_t(ti) * kTile, col0 = int64_t(tj) * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;  // outputs (ty + 16 i, tx + 16 j)

  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

  for (int64_t k0 = 0; k0 < p.K; k0 += BK) {
    for (int q = threadIdx.x; q < kTile * BK; q += blockDim.x) {  // [row][k] rows, k fastest: coalesced
      const int r = q / BK, k = q % BK;
      const int64_t gk = k0 + k;
      const int64_t gi = row0 + r;
      Lk[k][r] = (gi < p.rows && gk < p.K) ? L[gi * p.l_ld + gk] : 0.0f;
      if constexpr (kSyrk) {
        const int64_t gj = col0 + r;
        Rk[k][r] = (gj < p.rows && gk < p.K) ? L[gj * p.l_ld + gk] : 0.0f;
      }
    }
    if constexpr (!kSyrk) {
      for (int q = threadIdx.x; q < kTile * BK; q += blockDim.x) {  // [k][col] rows, col fastest
        const int kr = q / kTile, c = q % kTile;
        const int64_t gk = k0 + kr, gj = col0 + c;
        Rk[kr][c] = (gk < p.K && gj < p.cols) ? R[gk * p.r_ld + gj] : 0.0f;
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = Lk[k][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Rk[k][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = __fmaf_rn(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }

  const bool mirror = kSyrk && ti != tj;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t gi = row0 + ty + 16 * i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t gj = col0 + tx + 16 * j;
      if (gi < p.rows && gj < p.cols) {
        float v = p.alpha * acc[i][j];
        if (p.beta != 0.0f) v += p.beta * Cin[gi * p.c_ld + gj];
        out[gi * p.o_ld + gj] = v;
        if (mirror) out[gj * p.o_ld + gi] = v;
      }
    }
  }
}

// A batch of matrices: pointer, elements between matrices, row stride.
template <typename T>
struct Mat {
  T* ptr;
  int64_t mat, ld;
};

template <typename T>
bool vec_ok(const Mat<T>& m) {
  constexpr int64_t kPer16 = 16 / int64_t(sizeof(T));
  return reinterpret_cast<uintptr_t>(m.ptr) % 16 == 0 && m.ld % kPer16 == 0 && m.mat % kPer16 == 0;
}

// out = alpha * L L^T + beta * Cin (kSyrk; L [rows, K]) or alpha * L R + beta * Cin, for B matrices.
template <typename T, bool kSyrk, int TILE = kTile, typename Cfg = SmallTile>
void launch_gemm(int64_t B, int64_t rows, int64_t cols, int64_t K, Mat<T> L, Mat<T> R, Mat<T> Cin, Mat<T> out,
                 float alpha, float beta, cudaStream_t stream) {
  const int64_t tr = (rows + TILE - 1) / TILE, tc = (cols + TILE - 1) / TILE;
  for (int64_t b0 = 0; b0 < B; b0 += kMaxGridZ) {
    const int64_t nb = std::min<int64_t>(kMaxGridZ, B - b0);
    GemmParams<T> p{};
    p.L = L.ptr + b0 * L.mat;
    p.l_mat = L.mat;
    p.l_ld = L.ld;
    p.R = R.ptr == nullptr ? nullptr : R.ptr + b0 * R.mat;
    p.r_mat = R.mat;
    p.r_ld = R.ld;
    p.Cin = Cin.ptr == nullptr ? nullptr : Cin.ptr + b0 * Cin.mat;
    p.c_mat = Cin.mat;
    p.c_ld = Cin.ld;
    p.out = out.ptr + b0 * out.mat;
    p.o_mat = out.mat;
    p.o_ld = out.ld;
    p.rows = int(rows);
    p.cols = int(cols);
    p.K = int(K);
    p.tiles = int(tr);
    p.alpha = alpha;
    p.beta = beta;
    p.vec_l = vec_ok(L);
    p.vec_r = R.ptr != nullptr && vec_ok(R);
    const dim3 grid = kSyrk ? dim3(unsigned(tr * (tr + 1) / 2), 1u, unsigned(nb)) : dim3(unsigned(tc), unsigned(tr), unsigned(nb));
    if constexpr (std::is_same<T, float>::value) {
      ns_gemm_f32<kSyrk><<<grid, 256, 0, stream>>>(p);
    } else {
      static_assert(std::is_same<T, float>::value || TILE == Cfg::kTileM, "bf16 tile of the config");
      ns_gemm_bf16<kSyrk, Cfg><<<grid, Cfg::kThreads, 0, stream>>>(p);
    }
    check(cudaGetLastError(), kSyrk ? "newton_schulz syrk launch" : "newton_schulz gemm launch");
  }
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// One NS schedule with tile config TILE / Cfg (Cfg: bf16 only).
template <typename T, int TILE, typename Cfg>
void run_steps(const NewtonSchulzArgs& a, void* workspace, cudaStream_t stream) {
  const int64_t B = a.B, M = a.M, N = a.N;
  char* ws = static_cast<char*>(workspace);
  const size_t gram_bytes = align256(size_t(B * M * M) * sizeof(T));
  Mat<T> A{reinterpret_cast<T*>(ws), M * M, M};
  Mat<T> P{reinterpret_cast<T*>(ws + gram_bytes), M * M, M};
  Mat<T> cur{static_cast<T*>(a.x), a.matrix_stride, N};
  Mat<T> nxt{reinterpret_cast<T*>(ws + 2 * gram_bytes), M * N, N};
  const Mat<T> none{nullptr, 0, 0};
  for (int64_t s = 0; s < a.steps; ++s) {
    const float ca = a.coeffs[3 * s], cb = a.coeffs[3 * s + 1], cc = a.coeffs[3 * s + 2];
    launch_gemm<T, true, TILE, Cfg>(B, M, M, N, cur, none, none, A, 1.0f, 0.0f, stream);  // A = X X^T
    launch_gemm<T, true, TILE, Cfg>(B, M, M, M, A, none, A, P, cc, cb, stream);           // P = c A A^T + b A
    launch_gemm<T, false, TILE, Cfg>(B, M, N, M, P, cur, cur, nxt, 1.0f, ca, stream);     // X' = P X + a X
    std::swap(cur, nxt);
  }
  if (cur.ptr != static_cast<T*>(a.x)) {  // an odd number of steps ends in the workspace
    check(cudaMemcpy2DAsync(a.x, size_t(a.matrix_stride) * sizeof(T), cur.ptr, size_t(M * N) * sizeof(T),
                            size_t(M * N) * sizeof(T), size_t(B), cudaMemcpyDeviceToDevice, stream),
          "newton_schulz result copy");
  }
}

}  // namespace
}  // namespace cuda

size_t newton_schulz_cuda_workspace_bytes(int64_t B, int64_t M, int64_t N, DType dtype) {
  const size_t es = dtype == DType::kBFloat16 ? 2 : 4;
  return 2 * cuda::align256(size_t(B * M * M) * es) + cuda::align256(size_t(B * M * N) * es);
}

void newton_schulz_cuda(const NewtonSchulzArgs& a, void* workspace, int device, uintptr_t stream) {
  validate(a);
  K2_CHECK(a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat32,
           std::string("newton_schulz_cuda: x must be bfloat16 or float32, got ") + dtype_name(a.dtype));
  K2_CHECK(a.N <= (int64_t(1) << 30), "newton_schulz_cuda: N too large (int32 tile indices)");
  if (a.B == 0 || a.steps == 0) return;
  K2_CHECK(workspace != nullptr, "newton_schulz_cuda: workspace is null");
  cuda::set_device(device);
  const cudaStream_t s = cuda::as_stream(stream);
  if (a.dtype == DType::kFloat32) {
    cuda::run_steps<float, cuda::kTile, cuda::SmallTile>(a, workspace, s);
  } else if (a.M >= K2_NS_LARGE_TILE_MIN_M) {
    cuda::run_steps<__nv_bfloat16, cuda::LargeTile::kTileM, cuda::LargeTile>(a, workspace, s);
  } else {
    cuda::run_steps<__nv_bfloat16, cuda::SmallTile::kTileM, cuda::SmallTile>(a, workspace, s);
  }
}

}  // namespace k2
