// CUDA MoE router: one warp per token. Semantics: k2_kernels/reference.py::moe_route.
// Shape legend: T tokens, E experts, K experts per token, G groups.
#include <cfloat>
#include <climits>

#include "cuda_common.cuh"
#include "k2/moe.h"

namespace k2 {
namespace cuda {
namespace {

constexpr int kRouteThreads = 128;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// (value desc, index asc): a strict total order, so every lane agrees on the winner.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, v, off);
    const int oi = __shfl_xor_sync(kFullMask, i, off);
    if (better(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

// Each warp keeps its token's biased scores (E floats) and group scores (G floats) in shared
// memory. Live values are finite (NaN/-inf clamp to -FLT_MAX), so -inf marks "taken".
template <typename TL>
__global__ void __launch_bounds__(kRouteThreads) route_kernel(const TL* __restrict__ logits, int64_t row_stride,
                                                              const float* __restrict__ bias, int64_t T, int E, int K,
                                                              int G, int topk_group, float scale, bool norm,
                                                              int64_t* __restrict__ idx_out, float* __restrict__ w_out) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float* choice = smem + warp * (E + G);
  float* group = choice + E;
  const float kTaken = -INFINITY;

  for (int64_t t = int64_t(blockIdx.x) * warps + warp; t < T; t += int64_t(gridDim.x) * warps) {
    const TL* row = logits + t * row_stride;
    for (int e = lane; e < E; e += 32) {
      float c = sigmoid(to_f32(row[e]));
      if (bias != nullptr) c += bias[e];
      choice[e] = fmaxf(c, -FLT_MAX);
    }
    __syncwarp();

    if (G > 1) {
      // Group score = sum of its two best biased scores; keep the topk_group best groups.
      const int gsize = E / G;
      for (int g = lane; g < G; g += 32) {
        float m1 = -FLT_MAX, m2 = -FLT_MAX;
        for (int e = g * gsize; e < (g + 1) * gsize; ++e) {
          const float c = choice[e];
          if (c > m1) { m2 = m1; m1 = c; } else if (c > m2) { m2 = c; }
        }
        group[g] = fmaxf(m1 + m2, -FLT_MAX);
      }
      __syncwarp();
      for (int r = 0; r < topk_group; ++r) {
        float bv = kTaken;
        int bi = INT_MAX;
        for (int g = lane; g < G; g += 32) {
          const float v = group[g];
          if (v != kTaken && better(v, g, bv, bi)) { bv = v; bi = g; }
        }
        warp_argmax(bv, bi);  // bi < G: topk_group <= G and live scores are finite
        __syncwarp();
        if (lane == 0) group[bi] = kTaken;
        __syncwarp();
      }
      // Experts of the groups not kept score 0.0, as in the reference.
      for (int e = lane; e < E; e += 32)
        if (group[e / gsize] != kTaken) choice[e] = 0.0f;
      __syncwarp();
    }

    // Top-K by K rounds of warp argmax; lane k keeps the k-th expert.
    int my_idx = 0;
    for (int k = 0; k < K; ++k) {
      float bv = kTaken;
      int bi = INT_MAX;
      for (int e = lane; e < E; e += 32) {
        const float v = choice[e];
        if (v != kTaken && better(v, e, bv, bi)) { bv = v; bi = e; }
      }
      warp_argmax(bv, bi);
      if (lane == k) my_idx = bi;
      __syncwarp();
      if (lane == 0) choice[bi] = kTaken;
      __syncwarp();
    }

    // Weights from the unbiased scores; the xor-butterfly sum is identical on every lane.
    const float s = lane < K ? sigmoid(to_f32(row[my_idx])) : 0.0f;
    float sum = s;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kFullMask, sum, off);
    if (lane < K) {
      const float w = norm ? s / (sum + 1e-20f) : s;
      idx_out[t * K + lane] = my_idx;
      w_out[t * K + lane] = w * scale;
    }
    __syncwarp();  // the next token reuses this warp's shared memory
  }
}

}  // namespace
}  // namespace cuda

void moe_route_cuda(const RouteArgs& a, int device, uintptr_t stream) {
  using namespace cuda;
  validate(a);
  K2_CHECK(a.K <= kCudaRouteMaxK, "moe_route (CUDA): top_k must be <= " + std::to_string(kCudaRouteMaxK));
  K2_CHECK(a.E <= kCudaRouteMaxE, "moe_route (CUDA): n_experts must be <= " + std::to_string(kCudaRouteMaxE));
  K2_CHECK(a.bias == nullptr || a.bias_dtype == DType::kFloat32, "moe_route (CUDA): bias must be float32");
  if (a.T == 0) return;
  set_device(device);
  const int E = int(a.E), G = int(a.n_group);
  const size_t per_warp = size_t(E + G) * sizeof(float);
  int warps = kRouteThreads / 32;  // fewer warps per block when a token's scores are large
  while (warps > 1 && per_warp * warps > 48 * 1024) warps /= 2;
  K2_CHECK(per_warp <= 48 * 1024, "moe_route (CUDA): n_experts + n_group too large for shared memory");
  const unsigned grid = grid_1d(a.T, warps, 1 << 16);
  const cudaStream_t s = as_stream(stream);
  dispatch_float(a.logits_dtype, [&](auto tag) {
    using TL = decltype(tag);
    route_kernel<TL><<<grid, warps * 32, per_warp * warps, s>>>(
        static_cast<const TL*>(a.logits), a.logits_row_stride, static_cast<const float*>(a.bias), a.T, E, int(a.K), G,
        int(a.topk_group), a.routed_scaling_factor, a.norm_topk_prob, a.topk_idx, a.topk_weight);
  });
  check(cudaGetLastError(), "moe_route kernel launch");
}

}  // namespace k2
