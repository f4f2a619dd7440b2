// k2::sgemm: an external cblas_sgemm when one was registered, else a built-in blocked kernel.
#include "k2/blas.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <vector>

#include "k2/bind.h"
#include "k2/common.h"

namespace k2 {
namespace {

std::atomic<CblasSgemmFn> g_sgemm{nullptr};
std::atomic<CblasSsyrkFn> g_ssyrk{nullptr};

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kUpper = 121;

// Built-in fallback: packs op(B) into a contiguous [K, N] panel, then C rows += a_ik * b_k rows
// (the inner loop over N vectorises). About a third of a tuned BLAS here; correctness first.
void builtin_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                   const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  std::vector<float> b(size_t(K) * size_t(N));
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) b[k * N + n] = tb ? B[n * ldb + k] : B[k * ldb + n];
  std::vector<float> acc(N);
  for (int64_t m = 0; m < M; ++m) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float a = ta ? A[k * lda + m] : A[m * lda + k];
      const float* br = &b[k * N];
      for (int64_t n = 0; n < N; ++n) acc[n] += a * br[n];
    }
    float* c = C + m * ldc;
    if (beta == 0.0f) {
      for (int64_t n = 0; n < N; ++n) c[n] = alpha * acc[n];
    } else {
      for (int64_t n = 0; n < N; ++n) c[n] = alpha * acc[n] + beta * c[n];
    }
  }
}

}  // namespace

void set_cblas_sgemm(CblasSgemmFn fn) { g_sgemm.store(fn); }
void set_cblas_ssyrk(CblasSsyrkFn fn) { g_ssyrk.store(fn); }
bool has_external_blas() { return g_sgemm.load() != nullptr; }

void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // an empty product: C = beta * C (BLAS semantics)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) C[m * ldc + n] = beta == 0.0f ? 0.0f : beta * C[m * ldc + n];
    return;
  }
  CblasSgemmFn fn = g_sgemm.load();
  const bool fits = std::max({M, N, K, lda, ldb, ldc}) <= INT_MAX;
  if (fn != nullptr && fits) {
    fn(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, int(M), int(N), int(K), alpha, A, int(lda), B,
       int(ldb), beta, C, int(ldc));
  } else {
    builtin_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}

namespace {
std::atomic<int> g_panel_columns{16};
}  // namespace

int sgemm_panel_columns() { return g_panel_columns.load(); }
void set_sgemm_panel_columns(int columns) { g_panel_columns.store(std::max(columns, 0)); }

void sgemm_few_rows(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                    const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const int64_t panel = g_panel_columns.load();
  // Larger panels than ~2^19 multiply-adds leave OpenBLAS's small-matrix range; measured, panels
  // then cost more than one call (A is re-packed per panel).
  if (ta || panel <= 0 || N <= panel || g_sgemm.load() == nullptr || M * panel * K > (int64_t(1) << 19)) {
    sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  for (int64_t n0 = 0; n0 < N; n0 += panel) {
    const float* b = tb ? B + n0 * ldb : B + n0;  // B's rows (trans_b) or columns [n0, n0 + panel)
    sgemm(false, tb, M, std::min(panel, N - n0), K, alpha, A, lda, b, ldb, beta, C + n0, ldc);
  }
}

void ssyrk_upper(bool trans, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, float beta, float* C,
                 int64_t ldc) {
  if (N <= 0) return;
  CblasSsyrkFn fn = g_ssyrk.load();
  const bool fits = std::max({N, K, lda, ldc}) <= INT_MAX;
  if (fn != nullptr && fits && K > 0) {
    fn(kRowMajor, kUpper, trans ? kTrans : kNoTrans, int(N), int(K), alpha, A, int(lda), beta, C, int(ldc));
    return;
  }
  // Fallback: the full product into scratch, then the upper triangle.
  std::vector<float> full(size_t(N) * size_t(N));
  sgemm(trans, !trans, N, N, K, alpha, A, lda, A, lda, 0.0f, full.data(), N);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = i; j < N; ++j)
      C[i * ldc + j] = full[i * N + j] + (beta == 0.0f ? 0.0f : beta * C[i * ldc + j]);
}

}  // namespace k2

K2_BINDINGS(blas) {
  m.def(
      "blas_set_panel_columns", [](int columns) { k2::set_sgemm_panel_columns(columns); },
      "column panel width of the few-row GEMMs (expert kernels); 0: one BLAS call");
  m.def("blas_panel_columns", &k2::sgemm_panel_columns);
  m.def(
      "blas_set_sgemm", [](uintptr_t fn) { k2::set_cblas_sgemm(reinterpret_cast<k2::CblasSgemmFn>(fn)); },
      "(address of a cblas_sgemm-compatible function, or 0 for the built-in kernel)");
  m.def(
      "blas_set_ssyrk", [](uintptr_t fn) { k2::set_cblas_ssyrk(reinterpret_cast<k2::CblasSsyrkFn>(fn)); },
      "(address of a cblas_ssyrk-compatible function, or 0 for the built-in path)");
  m.def("blas_external", &k2::has_external_blas, "True when an external cblas_sgemm is in use");
  m.def(
      "sgemm",
      [](bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, uintptr_t A, int64_t lda, uintptr_t B,
         int64_t ldb, float beta, uintptr_t C, int64_t ldc) {
        pybind11::gil_scoped_release nogil;
        k2::sgemm(ta, tb, M, N, K, alpha, k2::ptr<const float>(A), lda, k2::ptr<const float>(B), ldb, beta,
                  k2::ptr<float>(C), ldc);
      },
      "(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc): row-major fp32 GEMM (for tests)");
}
