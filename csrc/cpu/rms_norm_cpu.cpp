// Fused RMSNorm forward and backward on CPU (OpenMP over rows; see k2/norm.h).
//   forward:  rstd = 1 / sqrt(mean(x^2) + eps);  y = w * x * rstd
//   backward: xhat = x * rstd;  gw = g * w
//             dx = rstd * (gw - xhat * mean(gw * xhat));   dw = sum over rows of g * xhat
// dw is summed per thread over a static block of rows, then the partial sums are added in thread
// order, so the result does not depend on scheduling.
#include <cmath>
#include <vector>

#include "k2/bind.h"
#include "k2/common.h"
#include "k2/cpu_math.h"
#include "k2/norm.h"
#include "k2/threads.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace k2 {
namespace {

// Rows [lo, hi): rstd and y. Compiled per ISA (the build's baseline is SSE2; the loops are
// memory-light, so the vector width decides their speed).
K2_ISA_CLONES void fwd_rows(const RmsNormArgs& a, int64_t lo, int64_t hi) {
  const int64_t D = a.D, D8 = D / 8 * 8;
  const float* w = a.w;
  for (int64_t n = lo; n < hi; ++n) {
    const float* x = a.x + n * D;
    float* y = a.y + n * D;
    v8f acc{};
    for (int64_t d = 0; d < D8; d += 8) {
      const v8f xv = load8(x + d);
      acc += xv * xv;
    }
    float ss = hsum8(acc);
    for (int64_t d = D8; d < D; ++d) ss += x[d] * x[d];
    const float r = 1.0f / std::sqrt(ss / float(D) + a.eps);
    a.rstd[n] = r;
    for (int64_t d = 0; d < D8; d += 8) store8(y + d, load8(w + d) * (load8(x + d) * r));
    for (int64_t d = D8; d < D; ++d) y[d] = w[d] * (x[d] * r);
  }
}

// Rows [lo, hi) of the backward: dx (when asked) and this block's partial dw (when dw_part).
K2_ISA_CLONES void bwd_rows(const RmsNormBackwardArgs& a, int64_t lo, int64_t hi, float* dw_part) {
  const int64_t D = a.D, D8 = D / 8 * 8;
  const float* w = a.w;
  for (int64_t n = lo; n < hi; ++n) {
    const float* g = a.g + n * D;
    const float* x = a.x + n * D;
    const float r = a.rstd[n];
    if (a.dx != nullptr) {
      v8f acc{};  // sum of (g * w) * xhat
      for (int64_t d = 0; d < D8; d += 8) acc += load8(g + d) * load8(w + d) * (load8(x + d) * r);
      float dot = hsum8(acc);
      for (int64_t d = D8; d < D; ++d) dot += g[d] * w[d] * (x[d] * r);
      const float c = dot / float(D);
      float* dx = a.dx + n * D;
      for (int64_t d = 0; d < D8; d += 8)
        store8(dx + d, r * (load8(g + d) * load8(w + d) - (load8(x + d) * r) * c));
      for (int64_t d = D8; d < D; ++d) dx[d] = r * (g[d] * w[d] - (x[d] * r) * c);
    }
    if (dw_part != nullptr) {
      for (int64_t d = 0; d < D8; d += 8) store8(dw_part + d, load8(dw_part + d) + load8(g + d) * (load8(x + d) * r));
      for (int64_t d = D8; d < D; ++d) dw_part[d] += g[d] * (x[d] * r);
    }
  }
}

// fn(lo, hi, tid) on one static block of the N rows per thread: per-thread partial sums are then
// the same for a given thread count, whatever the scheduling.
template <typename F>
void row_blocks(int64_t N, int threads, F&& fn) {
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int tid = 0, nt = 1;
#endif
    fn(N * tid / nt, N * (tid + 1) / nt, tid);
  }
}

}  // namespace

void rms_norm_fwd_cpu(const RmsNormArgs& a) {
  K2_CHECK(a.N >= 0 && a.D >= 1, "rms_norm: need N >= 0 and D >= 1");
  row_blocks(a.N, num_threads(), [&](int64_t lo, int64_t hi, int) { fwd_rows(a, lo, hi); });
}

void rms_norm_bwd_cpu(const RmsNormBackwardArgs& a) {
  K2_CHECK(a.N >= 0 && a.D >= 1, "rms_norm_backward: need N >= 0 and D >= 1");
  const int64_t N = a.N, D = a.D;
  const int threads = num_threads();
  std::vector<float> partial(a.dw != nullptr ? size_t(threads) * size_t(D) : 0, 0.0f);
  row_blocks(N, threads, [&](int64_t lo, int64_t hi, int tid) {
    bwd_rows(a, lo, hi, a.dw != nullptr ? partial.data() + size_t(tid) * size_t(D) : nullptr);
  });
  if (a.dw != nullptr) {
    for (int64_t d = 0; d < D; ++d) a.dw[d] = 0.0f;
    for (int t = 0; t < threads; ++t)
      for (int64_t d = 0; d < D; ++d) a.dw[d] += partial[size_t(t) * size_t(D) + size_t(d)];
  }
}

}  // namespace k2

K2_BINDINGS(rms_norm_cpu) {
  m.def(
      "rms_norm_fwd_cpu",
      [](uintptr_t x, uintptr_t w, int64_t N, int64_t D, double eps, uintptr_t y, uintptr_t rstd) {
        k2::RmsNormArgs a{k2::ptr<const float>(x), k2::ptr<const float>(w), N, D, float(eps), k2::ptr<float>(y),
                          k2::ptr<float>(rstd)};
        pybind11::gil_scoped_release nogil;
        k2::rms_norm_fwd_cpu(a);
      },
      "(x, w, N, D, eps, y, rstd): fp32, rows contiguous");
  m.def(
      "rms_norm_bwd_cpu",
      [](uintptr_t g, uintptr_t x, uintptr_t w, uintptr_t rstd, int64_t N, int64_t D, uintptr_t dx, uintptr_t dw) {
        k2::RmsNormBackwardArgs a{k2::ptr<const float>(g), k2::ptr<const float>(x), k2::ptr<const float>(w),
                                  k2::ptr<const float>(rstd), N, D, k2::ptr<float>(dx), k2::ptr<float>(dw)};
        pybind11::gil_scoped_release nogil;
        k2::rms_norm_bwd_cpu(a);
      },
      "(grad_y, x, w, rstd, N, D, dx or 0, dw or 0): fp32");
}
