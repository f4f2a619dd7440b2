// Python bindings of the CUDA Newton-Schulz kernel (compiled only when CUDA is on).
#include <pybind11/stl.h>

#include <vector>

#include "k2/bind.h"
#include "k2/newton_schulz.h"

namespace py = pybind11;

K2_BINDINGS(newton_schulz_cuda) {
  m.def(
      "newton_schulz_cuda_workspace_bytes",
      [](int64_t B, int64_t M, int64_t N, int dtype) {
        return k2::newton_schulz_cuda_workspace_bytes(B, M, N, k2::DType(dtype));
      },
      "(B, M, N, dtype) -> bytes of workspace for newton_schulz_cuda");
  m.def(
      "newton_schulz_cuda",
      [](int dev, uintptr_t stream, uintptr_t x, int dtype, int64_t B, int64_t M, int64_t N, int64_t matrix_stride,
         std::vector<float> coeffs, uintptr_t workspace) {
        K2_CHECK(coeffs.size() % 3 == 0, "newton_schulz_cuda: coeffs must hold (a, b, c) triples, got " +
                                             std::to_string(coeffs.size()) + " values");
        k2::NewtonSchulzArgs a{k2::ptr<void>(x), k2::DType(dtype), B, M, N, matrix_stride, coeffs.data(),
                               int64_t(coeffs.size() / 3)};
        py::gil_scoped_release nogil;
        k2::newton_schulz_cuda(a, k2::ptr<void>(workspace), dev, stream);
      },
      "(device, stream, x, dtype, B, M, N, matrix_stride, coeffs, workspace): asynchronous on the stream; "
      "bf16 or fp32; see newton_schulz_cpu");
}
