// Python bindings of the CUDA MoE kernels (compiled only when CUDA is on).
#include "k2/moe_args.h"

namespace py = pybind11;
using namespace k2;

K2_BINDINGS(moe_cuda) {
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
}
