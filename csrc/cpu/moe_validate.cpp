// Argument checks shared by the CPU and CUDA entry points (errors name the argument).
#include <string>

#include "k2/moe.h"

namespace k2 {

void validate(const RouteArgs& a) {
  using std::to_string;
  K2_CHECK(a.logits != nullptr || a.T == 0, "moe_route: logits is null");
  K2_CHECK(is_float_activation(a.logits_dtype) || a.logits_dtype == DType::kFloat64,
           std::string("moe_route: logits dtype must be float32/bfloat16/float16, got ") + dtype_name(a.logits_dtype));
  K2_CHECK(a.bias == nullptr || is_float_activation(a.bias_dtype) || a.bias_dtype == DType::kFloat64,
           std::string("moe_route: bias dtype must be floating, got ") + dtype_name(a.bias_dtype));
  K2_CHECK(a.T >= 0 && a.E >= 1, "moe_route: need T >= 0 and E >= 1, got T=" + to_string(a.T) + " E=" + to_string(a.E));
  K2_CHECK(a.logits_row_stride >= a.E || a.T <= 1, "moe_route: logits row stride " + to_string(a.logits_row_stride) + " < E");
  K2_CHECK(a.K >= 1 && a.K <= a.E, "moe_route: top_k=" + to_string(a.K) + " must be in [1, E=" + to_string(a.E) + "]");
  K2_CHECK(a.n_group >= 1 && a.E % a.n_group == 0,
           "moe_route: n_group=" + to_string(a.n_group) + " must be >= 1 and divide E=" + to_string(a.E));
  if (a.n_group > 1) {
    K2_CHECK(a.topk_group >= 1 && a.topk_group <= a.n_group,
             "moe_route: topk_group=" + to_string(a.topk_group) + " must be in [1, n_group]");
    K2_CHECK(a.E / a.n_group >= 2, "moe_route: every group needs >= 2 experts");
  }
  K2_CHECK(a.T == 0 || (a.topk_idx != nullptr && a.topk_weight != nullptr), "moe_route: null output");
}

void validate(const PermuteArgs& a) {
  using std::to_string;
  K2_CHECK(is_index(a.idx_dtype), std::string("moe_permute: topk_idx must be int32/int64, got ") + dtype_name(a.idx_dtype));
  K2_CHECK(a.T >= 0 && a.K >= 1 && a.D >= 0 && a.E >= 1,
           "moe_permute: bad sizes T=" + to_string(a.T) + " K=" + to_string(a.K) + " D=" + to_string(a.D) + " E=" + to_string(a.E));
  K2_CHECK(a.elem_bytes >= 1 && a.elem_bytes <= 16, "moe_permute: element size must be in [1, 16] bytes");
  K2_CHECK(a.x_row_stride >= a.D || a.T <= 1, "moe_permute: x row stride < D");
  K2_CHECK(a.T * a.K < (int64_t(1) << 31), "moe_permute: T*K must fit int32 (offsets are int32)");
}

void validate(const UnpermuteArgs& a) {
  using std::to_string;
  K2_CHECK(is_float_activation(a.y_dtype), std::string("moe_unpermute: y dtype must be float32/bfloat16/float16, got ") + dtype_name(a.y_dtype));
  K2_CHECK(is_float_activation(a.weight_dtype),
           std::string("moe_unpermute: weight dtype must be float32/bfloat16/float16, got ") + dtype_name(a.weight_dtype));
  K2_CHECK(a.T >= 0 && a.K >= 1 && a.D >= 0, "moe_unpermute: bad sizes T=" + to_string(a.T) + " K=" + to_string(a.K));
  K2_CHECK(a.y_row_stride >= a.D || a.T * a.K <= 1, "moe_unpermute: y row stride < D");
  K2_CHECK(a.T * a.K < (int64_t(1) << 31), "moe_unpermute: T*K must fit int32");
}

void validate(const UnpermuteBackwardArgs& a) {
  using std::to_string;
  K2_CHECK(is_float_activation(a.y_dtype),
           std::string("moe_unpermute_backward: y dtype must be float32/bfloat16/float16, got ") + dtype_name(a.y_dtype));
  K2_CHECK(is_float_activation(a.weight_dtype), "moe_unpermute_backward: weight dtype must be float32/bfloat16/float16");
  K2_CHECK(a.T >= 0 && a.K >= 1 && a.D >= 0, "moe_unpermute_backward: bad sizes T=" + to_string(a.T) + " K=" + to_string(a.K));
  K2_CHECK(a.y_row_stride >= a.D || a.T * a.K <= 1, "moe_unpermute_backward: y row stride < D");
  K2_CHECK(a.grad_row_stride >= a.D || a.T <= 1, "moe_unpermute_backward: grad_out row stride < D");
}

}  // namespace k2
