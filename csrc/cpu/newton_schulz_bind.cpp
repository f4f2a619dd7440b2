// Python bindings of the CPU Newton-Schulz kernel (see k2_kernels/newton_schulz_ops.py).
#include <pybind11/stl.h>

#include <vector>

#include "k2/bind.h"
#include "k2/newton_schulz.h"

namespace py = pybind11;

K2_BINDINGS(newton_schulz_cpu) {
  m.def("newton_schulz_cpu_workspace_floats", &k2::newton_schulz_cpu_workspace_floats,
        "(B, M, N, num_threads) -> floats of workspace for newton_schulz_cpu");
  m.def(
      "newton_schulz_cpu",
      [](uintptr_t x, int dtype, int64_t B, int64_t M, int64_t N, int64_t matrix_stride, std::vector<float> coeffs,
         uintptr_t workspace, int num_threads) {
        K2_CHECK(coeffs.size() % 3 == 0, "newton_schulz_cpu: coeffs must hold (a, b, c) triples, got " +
                                             std::to_string(coeffs.size()) + " values");
        k2::NewtonSchulzArgs a{k2::ptr<void>(x), k2::DType(dtype), B, M, N, matrix_stride, coeffs.data(),
                               int64_t(coeffs.size() / 3)};
        py::gil_scoped_release nogil;
        k2::newton_schulz_cpu(a, k2::ptr<float>(workspace), num_threads);
      },
      "(x, dtype, B, M, N, matrix_stride, coeffs [a0, b0, c0, a1, ...], workspace, num_threads): all NS steps "
      "in place on B contiguous fp32 [M, N] matrices (M <= N, already normalised)");
}
