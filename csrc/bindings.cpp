// pybind11 entry point for k2_kernels._C. Kernels take raw pointers (as integers), sizes and
// dtype tags; the torch binding lives in Python (k2_kernels.ops), so this module links no libtorch.
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "k2 compiled kernels (framework-agnostic; driven from k2_kernels.ops)";
#ifdef K2_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
