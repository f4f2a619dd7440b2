// CUDA backward of the MoE unpermute. For row n with slot s = row_to_slot[n], t = s / K:
//   grad_y[n] = w[s] * grad_out[t]          (in y's dtype)
//   grad_w[s] = <grad_out[t], y[n]>          (fp32 accumulation, warp reduction)
// One warp per row; 16-byte vector accesses when rows are aligned. No atomics: each slot is
// written by exactly one row (row_to_slot is a permutation); rows with an out-of-range slot
// get a zero gradient.
#include <cstdint>

#include "cuda_common.cuh"
#include "k2/moe.h"

namespace k2 {
namespace cuda {
namespace {

constexpr int kBwdThreads = 256;

template <typename Y, int VEC>
__global__ void __launch_bounds__(kBwdThreads) unpermute_backward_kernel(
    const Y* __restrict__ grad_out, int64_t g_row_stride, const Y* __restrict__ y, int64_t y_row_stride,
    const int64_t* __restrict__ row_to_slot, const float* __restrict__ weight, int64_t N, int64_t K, int64_t D,
    Y* __restrict__ grad_y, float* __restrict__ grad_w) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int64_t vecs = D / VEC;
  for (int64_t n = int64_t(blockIdx.x) * warps + (threadIdx.x >> 5); n < N; n += int64_t(gridDim.x) * warps) {
    const int64_t s = row_to_slot[n];
    const bool ok = s >= 0 && s < N;
    const Y* g = grad_out + (ok ? s / K : 0) * g_row_stride;
    const Y* yr = y + n * y_row_stride;
    const float w = ok ? weight[s] : 0.0f;
    float dot = 0.0f;
    for (int64_t v = lane; v < vecs; v += 32) {
      float gv[VEC];
      load_vec<Y, VEC>(g + v * VEC, gv);
      if (grad_y != nullptr) {
        float out[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = w * gv[j];
        store_vec<Y, VEC>(grad_y + n * D + v * VEC, out);
      }
      if (grad_w != nullptr) {
        float yv[VEC];
        load_vec<Y, VEC>(yr + v * VEC, yv);
#pragma unroll
        for (int j = 0; j < VEC; ++j) dot += gv[j] * yv[j];
      }
    }
    if (grad_w != nullptr) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(kFullMask, dot, off);
      if (lane == 0 && ok) grad_w[s] = dot;
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace
}  // namespace cuda

void moe_unpermute_backward_cuda(const UnpermuteBackwardArgs& a, int device, uintptr_t stream) {
  using namespace cuda;
  validate(a);
  K2_CHECK(a.weight_dtype == DType::kFloat32, "moe_unpermute_backward (CUDA): weights must be float32");
  const int64_t N = a.T * a.K;
  if (N == 0) return;
  set_device(device);
  const cudaStream_t s = as_stream(stream);
  if (a.grad_weight != nullptr && a.D == 0) {
    check(cudaMemsetAsync(a.grad_weight, 0, size_t(N) * sizeof(float), s), "memset grad_weight");
    return;
  }
  const unsigned grid = grid_1d(N, kBwdThreads / 32, 1 << 16);
  dispatch_float(a.y_dtype, [&](auto tag) {
    using Y = decltype(tag);
    constexpr int kVec = 16 / sizeof(Y);
    const Y* g = static_cast<const Y*>(a.grad_out);
    const Y* y = static_cast<const Y*>(a.y);
    Y* gy = static_cast<Y*>(a.grad_y);
    const bool vec = a.D % kVec == 0 && a.y_row_stride % kVec == 0 && a.grad_row_stride % kVec == 0 &&
                     aligned16(g) && aligned16(y) && (gy == nullptr || aligned16(gy));
    const float* w = static_cast<const float*>(a.weight);
    if (vec)
      unpermute_backward_kernel<Y, kVec><<<grid, kBwdThreads, 0, s>>>(g, a.grad_row_stride, y, a.y_row_stride,
                                                                     a.row_to_slot, w, N, a.K, a.D, gy, a.grad_weight);
    else
      unpermute_backward_kernel<Y, 1><<<grid, kBwdThreads, 0, s>>>(g, a.grad_row_stride, y, a.y_row_stride,
                                                                  a.row_to_slot, w, N, a.K, a.D, gy, a.grad_weight);
  });
  check(cudaGetLastError(), "moe_unpermute_backward kernel launch");
}

}  // namespace k2
