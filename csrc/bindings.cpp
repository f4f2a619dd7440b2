// pybind11 entry point for k2_kernels._C. Kernels take raw pointers (as integers), sizes and
// dtype tags; the torch binding lives in Python (k2_kernels.ops), so this module links no libtorch.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "k2/moe.h"

namespace py = pybind11;

#ifndef K2_CUDA_ARCHS_STR
#define K2_CUDA_ARCHS_STR ""
#endif

namespace {

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

k2::RouteArgs route_args(uintptr_t logits, int logits_dtype, int64_t logits_row_stride, uintptr_t bias, int bias_dtype,
                         int64_t T, int64_t E, int64_t K, int64_t n_group, int64_t topk_group, double scale, bool norm,
                         uintptr_t idx, uintptr_t weight) {
  return k2::RouteArgs{ptr<const void>(logits), k2::DType(logits_dtype), logits_row_stride, ptr<const void>(bias),
                       k2::DType(bias_dtype), T, E, K, n_group, topk_group, float(scale), norm,
                       ptr<int64_t>(idx), ptr<float>(weight)};
}

k2::PermuteArgs permute_args(uintptr_t x, int64_t elem_bytes, int64_t x_row_stride, uintptr_t idx, int idx_dtype,
                             int64_t T, int64_t K, int64_t D, int64_t E, uintptr_t x_out, uintptr_t row_to_slot,
                             uintptr_t counts, uintptr_t offsets) {
  return k2::PermuteArgs{ptr<const void>(x), elem_bytes, x_row_stride, ptr<const void>(idx), k2::DType(idx_dtype),
                         T, K, D, E, ptr<void>(x_out), ptr<int64_t>(row_to_slot), ptr<int32_t>(counts),
                         ptr<int32_t>(offsets)};
}

k2::UnpermuteArgs unpermute_args(uintptr_t y, int y_dtype, int64_t y_row_stride, uintptr_t row_to_slot,
                                 uintptr_t weight, int weight_dtype, int64_t T, int64_t K, int64_t D, uintptr_t out) {
  return k2::UnpermuteArgs{ptr<const void>(y), k2::DType(y_dtype), y_row_stride, ptr<const int64_t>(row_to_slot),
                           ptr<const void>(weight), k2::DType(weight_dtype), T, K, D, ptr<void>(out)};
}

k2::UnpermuteBackwardArgs unpermute_bwd_args(uintptr_t g, int64_t g_row_stride, uintptr_t y, int y_dtype,
                                             int64_t y_row_stride, uintptr_t row_to_slot, uintptr_t weight,
                                             int weight_dtype, int64_t T, int64_t K, int64_t D, uintptr_t grad_y,
                                             uintptr_t grad_w) {
  return k2::UnpermuteBackwardArgs{ptr<const void>(g), g_row_stride, ptr<const void>(y), k2::DType(y_dtype),
                                   y_row_stride, ptr<const int64_t>(row_to_slot), ptr<const void>(weight),
                                   k2::DType(weight_dtype), T, K, D, ptr<void>(grad_y), ptr<float>(grad_w)};
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "k2 compiled kernels (framework-agnostic; driven from k2_kernels.ops)";
#ifdef K2_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("cuda_archs") = K2_CUDA_ARCHS_STR;

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

#ifdef K2_WITH_CUDA
  m.attr("cuda_route_max_k") = k2::kCudaRouteMaxK;
  m.attr("cuda_route_max_e") = k2::kCudaRouteMaxE;
  m.attr("cuda_permute_max_e") = k2::kCudaPermuteMaxE;
  m.attr("cuda_unpermute_max_k") = k2::kCudaUnpermuteMaxK;
  m.def("moe_permute_workspace_bytes", &k2::moe_permute_workspace_bytes, "(T, K, E) -> bytes");
  m.def("moe_unpermute_workspace_bytes", &k2::moe_unpermute_workspace_bytes, "(T, K) -> bytes");
  m.def(
      "moe_route_cuda",
      [](int dev, uintptr_t stream, uintptr_t l, int ld, int64_t ls, uintptr_t b, int bd, int64_t T, int64_t E,
         int64_t K, int64_t G, int64_t TG, double s, bool n, uintptr_t i, uintptr_t w) {
        auto a = route_args(l, ld, ls, b, bd, T, E, K, G, TG, s, n, i, w);
        py::gil_scoped_release nogil;
        k2::moe_route_cuda(a, dev, stream);
      },
      "(device, stream, ...) asynchronous on the stream; see moe_route_cpu");
  m.def(
      "moe_permute_cuda",
      [](int dev, uintptr_t stream, uintptr_t x, int64_t eb, int64_t xs, uintptr_t i, int id, int64_t T, int64_t K,
         int64_t D, int64_t E, uintptr_t xo, uintptr_t r, uintptr_t c, uintptr_t o, uintptr_t ws) {
        auto a = permute_args(x, eb, xs, i, id, T, K, D, E, xo, r, c, o);
        py::gil_scoped_release nogil;
        k2::moe_permute_cuda(a, ptr<void>(ws), dev, stream);
      },
      "(device, stream, ..., workspace) asynchronous; see moe_permute_cpu");
  m.def(
      "moe_unpermute_cuda",
      [](int dev, uintptr_t stream, uintptr_t y, int yd, int64_t ys, uintptr_t r, uintptr_t w, int wd, int64_t T,
         int64_t K, int64_t D, uintptr_t o, uintptr_t ws) {
        auto a = unpermute_args(y, yd, ys, r, w, wd, T, K, D, o);
        py::gil_scoped_release nogil;
        k2::moe_unpermute_cuda(a, ptr<void>(ws), dev, stream);
      },
      "(device, stream, ..., workspace) asynchronous; see moe_unpermute_cpu");
  m.def(
      "moe_unpermute_backward_cuda",
      [](int dev, uintptr_t stream, uintptr_t g, int64_t gs, uintptr_t y, int yd, int64_t ys, uintptr_t r, uintptr_t w,
         int wd, int64_t T, int64_t K, int64_t D, uintptr_t gy, uintptr_t gw) {
        auto a = unpermute_bwd_args(g, gs, y, yd, ys, r, w, wd, T, K, D, gy, gw);
        py::gil_scoped_release nogil;
        k2::moe_unpermute_backward_cuda(a, dev, stream);
      },
      "(device, stream, ...) asynchronous; see moe_unpermute_backward_cpu");
#endif
}
