// Building the MoE kernels' argument structs from the integers the Python side passes
// (shared by the CPU and CUDA binders).
#pragma once

#include "k2/bind.h"
#include "k2/moe.h"

namespace k2 {

inline RouteArgs route_args(uintptr_t logits, int logits_dtype, int64_t logits_row_stride, uintptr_t bias, int bias_dtype,
                         int64_t T, int64_t E, int64_t K, int64_t n_group, int64_t topk_group, double scale, bool norm,
                         uintptr_t idx, uintptr_t weight) {
  return RouteArgs{ptr<const void>(logits), DType(logits_dtype), logits_row_stride, ptr<const void>(bias),
                       DType(bias_dtype), T, E, K, n_group, topk_group, float(scale), norm,
                       ptr<int64_t>(idx), ptr<float>(weight)};
}

inline PermuteArgs permute_args(uintptr_t x, int64_t elem_bytes, int64_t x_row_stride, uintptr_t idx, int idx_dtype,
                             int64_t T, int64_t K, int64_t D, int64_t E, uintptr_t x_out, uintptr_t row_to_slot,
                             uintptr_t counts, uintptr_t offsets) {
  return PermuteArgs{ptr<const void>(x), elem_bytes, x_row_stride, ptr<const void>(idx), DType(idx_dtype),
                         T, K, D, E, ptr<void>(x_out), ptr<int64_t>(row_to_slot), ptr<int32_t>(counts),
                         ptr<int32_t>(offsets)};
}

inline UnpermuteArgs unpermute_args(uintptr_t y, int y_dtype, int64_t y_row_stride, uintptr_t row_to_slot,
                                 uintptr_t weight, int weight_dtype, int64_t T, int64_t K, int64_t D, uintptr_t out) {
  return UnpermuteArgs{ptr<const void>(y), DType(y_dtype), y_row_stride, ptr<const int64_t>(row_to_slot),
                           ptr<const void>(weight), DType(weight_dtype), T, K, D, ptr<void>(out)};
}

inline UnpermuteBackwardArgs unpermute_bwd_args(uintptr_t g, int64_t g_row_stride, uintptr_t y, int y_dtype,
                                             int64_t y_row_stride, uintptr_t row_to_slot, uintptr_t weight,
                                             int weight_dtype, int64_t T, int64_t K, int64_t D, uintptr_t grad_y,
                                             uintptr_t grad_w) {
  return UnpermuteBackwardArgs{ptr<const void>(g), g_row_stride, ptr<const void>(y), DType(y_dtype),
                                   y_row_stride, ptr<const int64_t>(row_to_slot), ptr<const void>(weight),
                                   DType(weight_dtype), T, K, D, ptr<void>(grad_y), ptr<float>(grad_w)};
}

}  // namespace k2
