// pybind11 entry point for k2_kernels._C. Kernels take raw pointers (as integers), sizes and
// dtype tags; the torch binding lives in Python (k2_kernels.ops), so this module links no libtorch.
// Each kernel family binds itself (K2_BINDINGS in its own file, see k2/bind.h).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>

#include "k2/bind.h"

#ifndef K2_CUDA_ARCHS_STR
#define K2_CUDA_ARCHS_STR ""
#endif

namespace k2 {
std::vector<std::pair<const char*, BindFn>>& binders() {
  static std::vector<std::pair<const char*, BindFn>> all;  // function-local: safe from init order
  return all;
}
}  // namespace k2

PYBIND11_MODULE(_C, m) {
  m.doc() = "k2 compiled kernels (framework-agnostic; driven from k2_kernels.ops)";
#ifdef K2_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("cuda_archs") = K2_CUDA_ARCHS_STR;
  auto all = k2::binders();
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return std::strcmp(a.first, b.first) < 0; });
  pybind11::list names;
  for (const auto& [name, fn] : all) {
    fn(m);
    names.append(name);
  }
  m.attr("bound_families") = names;
}
