// Python bindings of the CPU MoE kernels (see k2_kernels/_launch.py for the callers).
#include "k2/moe_args.h"

namespace py = pybind11;
using namespace k2;

K2_BINDINGS(moe_cpu) {
  const char* route_doc = "(logits, logits_dtype, logits_row_stride, bias, bias_dtype, T, E, K, n_group, "
                          "topk_group, routed_scaling_factor, norm_topk_prob, topk_idx_out, topk_weight_out)";
  const char* permute_doc = "(x, elem_bytes, x_row_stride, topk_idx, idx_dtype, T, K, D, E, x_out, row_to_slot_out, "
                            "counts_out, offsets_out)";
  const char* unpermute_doc = "(y, y_dtype, y_row_stride, row_to_slot, weight, weight_dtype, T, K, D, out)";

  // The kernels run without the GIL: they touch no Python objects.
  m.def(
      "moe_route_cpu",
      [](uintptr_t l, int ld, int64_t ls, uintptr_t b, int bd, int64_t T, int64_t E, int64_t K, int64_t G, int64_t TG,
         double s, bool n, uintptr_t i, uintptr_t w) {
        auto a = route_args(l, ld, ls, b, bd, T, E, K, G, TG, s, n, i, w);
        py::gil_scoped_release nogil;
        k2::moe_route_cpu(a);
      },
      route_doc);
  m.def(
      "moe_route_backward_cpu",
      [](uintptr_t l, int64_t ls, uintptr_t i, uintptr_t g, int64_t T, int64_t E, int64_t K, double s, bool n,
         uintptr_t out) {
        RouteBackwardArgs a{ptr<const float>(l), ls, ptr<const int64_t>(i), ptr<const float>(g), T, E, K, float(s),
                            n, ptr<float>(out)};
        py::gil_scoped_release nogil;
        k2::moe_route_backward_cpu(a);
      },
      "(logits fp32, logits_row_stride, topk_idx int64, grad_weight fp32, T, E, K, routed_scaling_factor, "
      "norm_topk_prob, grad_logits_out): fp32, [T, K] inputs contiguous");
  m.def(
      "moe_permute_cpu",
      [](uintptr_t x, int64_t eb, int64_t xs, uintptr_t i, int id, int64_t T, int64_t K, int64_t D, int64_t E,
         uintptr_t xo, uintptr_t r, uintptr_t c, uintptr_t o) {
        auto a = permute_args(x, eb, xs, i, id, T, K, D, E, xo, r, c, o);
        py::gil_scoped_release nogil;
        k2::moe_permute_cpu(a);
      },
      permute_doc);
  m.def(
      "moe_unpermute_cpu",
      [](uintptr_t y, int yd, int64_t ys, uintptr_t r, uintptr_t w, int wd, int64_t T, int64_t K, int64_t D,
         uintptr_t o) {
        auto a = unpermute_args(y, yd, ys, r, w, wd, T, K, D, o);
        py::gil_scoped_release nogil;
        k2::moe_unpermute_cpu(a);
      },
      unpermute_doc);
  const char* unpermute_bwd_doc = "(grad_out, grad_row_stride, y, y_dtype, y_row_stride, row_to_slot, weight, "
                                  "weight_dtype, T, K, D, grad_y_out or 0, grad_weight_out (fp32) or 0)";
  m.def(
      "moe_unpermute_backward_cpu",
      [](uintptr_t g, int64_t gs, uintptr_t y, int yd, int64_t ys, uintptr_t r, uintptr_t w, int wd, int64_t T,
         int64_t K, int64_t D, uintptr_t gy, uintptr_t gw) {
        auto a = unpermute_bwd_args(g, gs, y, yd, ys, r, w, wd, T, K, D, gy, gw);
        py::gil_scoped_release nogil;
        k2::moe_unpermute_backward_cpu(a);
      },
      unpermute_bwd_doc);

}
