// MoE routing and token permutation kernels. Semantics: k2_kernels/reference.py.
//
// Shape legend: T tokens, E routed experts, K experts per token, G expert groups, D hidden size,
// N = T * K permuted rows. Row strides are in elements; the inner dimension is contiguous.
#pragma once

#include <cstddef>
#include <cstdint>

#include "k2/common.h"

namespace k2 {

struct RouteArgs {
  const void* logits;      // [T, E], dtype logits_dtype, row stride logits_row_stride
  DType logits_dtype;
  int64_t logits_row_stride;
  const void* bias;        // [E] or nullptr
  DType bias_dtype;
  int64_t T, E, K, n_group, topk_group;
  float routed_scaling_factor;
  bool norm_topk_prob;
  int64_t* topk_idx;       // [T, K] out
  float* topk_weight;      // [T, K] out
};

// Gradient of the routing weights w.r.t. the router logits (the indices are piecewise constant):
// with s = sigmoid(logit) at the K chosen experts, S = sum_k s_k + 1e-20, g the weights' gradient,
// c the scaling factor: d s_j = c (g_j - sum_k g_k s_k / S) / S (c g_j without normalisation),
// d logit_j = d s_j s_j (1 - s_j) at the chosen experts, 0 elsewhere. fp32.
struct RouteBackwardArgs {
  const float* logits;       // [T, E], row stride logits_row_stride
  int64_t logits_row_stride;
  const int64_t* topk_idx;   // [T, K], contiguous
  const float* grad_weight;  // [T, K], contiguous
  int64_t T, E, K;
  float routed_scaling_factor;
  bool norm_topk_prob;
  float* grad_logits;        // [T, E] out, contiguous
};

struct PermuteArgs {
  const void* x;           // [T, D], elements of elem_bytes (any dtype: the rows are copied)
  int64_t elem_bytes;
  int64_t x_row_stride;
  const void* topk_idx;    // [T, K] int32/int64, contiguous
  DType idx_dtype;
  int64_t T, K, D, E;
  void* x_out;             // [N, D] contiguous, out
  int64_t* row_to_slot;    // [N] out
  int32_t* counts;         // [E] out
  int32_t* offsets;        // [E] out, inclusive cumulative counts
};

struct UnpermuteArgs {
  const void* y;           // [N, D]
  DType y_dtype;
  int64_t y_row_stride;
  const int64_t* row_to_slot;  // [N], a permutation of 0..N-1
  const void* weight;      // [T, K] contiguous
  DType weight_dtype;
  int64_t T, K, D;
  void* out;               // [T, D] contiguous, dtype y_dtype, out
};

// Backward of the unpermute: grad_y[n] = w[s] * grad_out[s / K] and grad_w[s] = <grad_out[s / K], y[n]>
// with s = row_to_slot[n]; fp32 accumulation. grad_out has y's dtype. Either output may be null.
struct UnpermuteBackwardArgs {
  const void* grad_out;    // [T, D], dtype y_dtype
  int64_t grad_row_stride;
  const void* y;           // [N, D]
  DType y_dtype;
  int64_t y_row_stride;
  const int64_t* row_to_slot;  // [N]
  const void* weight;      // [T, K] contiguous
  DType weight_dtype;
  int64_t T, K, D;
  void* grad_y;            // [N, D] contiguous, dtype y_dtype, out (or null)
  float* grad_weight;      // [T, K] fp32, out (or null)
};

void validate(const RouteArgs& a);
void validate(const PermuteArgs& a);
void validate(const UnpermuteArgs& a);
void validate(const UnpermuteBackwardArgs& a);

// CPU (OpenMP). moe_permute_cpu throws std::invalid_argument on an out-of-range expert index,
// moe_unpermute_cpu when row_to_slot is not a permutation.
void moe_route_cpu(const RouteArgs& a);
void moe_route_backward_cpu(const RouteBackwardArgs& a);
void moe_permute_cpu(const PermuteArgs& a);
void moe_unpermute_cpu(const UnpermuteArgs& a);
void moe_unpermute_backward_cpu(const UnpermuteBackwardArgs& a);

#ifdef K2_WITH_CUDA
// CUDA: asynchronous on `stream` (a cudaStream_t as an integer) of device `device`. Scratch
// memory comes from the caller (workspace of *_workspace_bytes). Out-of-range expert indices
// cannot raise on the device: such entries go to rows after all valid ones and are excluded from
// counts/offsets; row_to_slot entries outside [0, N) contribute nothing to the unpermute.
size_t moe_permute_workspace_bytes(int64_t T, int64_t K, int64_t E);
size_t moe_unpermute_workspace_bytes(int64_t T, int64_t K);
void moe_route_cuda(const RouteArgs& a, int device, uintptr_t stream);
void moe_permute_cuda(const PermuteArgs& a, void* workspace, int device, uintptr_t stream);
void moe_unpermute_cuda(const UnpermuteArgs& a, void* workspace, int device, uintptr_t stream);
void moe_unpermute_backward_cuda(const UnpermuteBackwardArgs& a, int device, uintptr_t stream);
// Limits of the CUDA kernels (the Python side falls back to the reference beyond them).
constexpr int64_t kCudaRouteMaxK = 32;
constexpr int64_t kCudaRouteMaxE = 4096;
constexpr int64_t kCudaPermuteMaxE = 2048;  // 4 warps x (E + 1) int32 counters in 48 KB of shared memory
constexpr int64_t kCudaUnpermuteMaxK = 64;
#endif

}  // namespace k2
