#include "k2/threads.h"

#include <atomic>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "k2/bind.h"

namespace k2 {
namespace {
std::atomic<int> g_threads{0};
}

void set_num_threads(int n) { g_threads.store(n > 0 ? n : 0); }

int num_threads() {
  const int n = g_threads.load();
#ifdef _OPENMP
  return n > 0 ? n : omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace k2

K2_BINDINGS(threads) {
  m.def("set_num_threads", &k2::set_num_threads, "(n): threads of the CPU kernels' parallel regions (0: default)");
  m.def("get_num_threads", &k2::num_threads, "threads the CPU kernels' parallel regions use");
}
