// CPU Newton-Schulz (fp32): all steps of the schedule on a batch of [M, N] matrices, in place.
//
// One step as BLAS calls (a, b, c the step's coefficients):
//   A  = X X^T                  ssyrk, upper triangle only (half the FLOPs of a GEMM), mirrored
//   P' = c A A^T + (b A + a I)  ssyrk again (A is symmetric, so A A = A A^T), with beta = 1 on a
//                               prefilled b A + a I: the polynomial costs no separate pass
//   X' = P' X                   sgemm; a X rides on P's diagonal, so no copy of X is needed
// X and X' ping-pong between the caller's matrix and a workspace matrix. That is 3 M^2 N + M^3
// multiply-adds per step against 4 M^2 N + 2 M^3 for three plain GEMMs.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "k2/blas.h"
#include "k2/newton_schulz.h"

namespace k2 {
namespace {

constexpr int64_t kTile = 32;  // mirror tile: keeps the column reads of the upper part in cache

// Lower triangle of rows [r0, r1) of the symmetric C [M, M] from its upper triangle.
void mirror_upper(float* C, int64_t M, int64_t r0, int64_t r1) {
  for (int64_t i0 = r0; i0 < r1; i0 += kTile) {
    const int64_t i1 = std::min(i0 + kTile, r1);
    for (int64_t j0 = 0; j0 < i1; j0 += kTile) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t j1 = std::min(j0 + kTile, i);
        for (int64_t j = j0; j < j1; ++j) C[i * M + j] = C[j * M + i];
      }
    }
  }
}

// Rows [r0, r1) of the upper triangle of C = alpha * S S^T + beta * C, S [M, K]: the diagonal
// block by ssyrk, the rectangle right of it by sgemm.
void syrk_rows(const float* S, int64_t M, int64_t K, int64_t r0, int64_t r1, float alpha, float beta, float* C) {
  if (r1 <= r0) return;
  ssyrk_upper(false, r1 - r0, K, alpha, S + r0 * K, K, beta, C + r0 * M + r0, M);
  if (r1 < M) sgemm(false, true, r1 - r0, M - r1, K, alpha, S + r0 * K, K, S + r1 * K, K, beta, C + r0 * M + r1, M);
}

// Rows [r0, r1) of the upper triangle of P = b A + a I (the ssyrk of A A^T then adds c A A^T).
void prefill_poly(const float* A, float* P, int64_t M, int64_t r0, int64_t r1, float a, float b) {
  for (int64_t i = r0; i < r1; ++i) {
    const float* ar = A + i * M;
    float* pr = P + i * M;
    for (int64_t j = i; j < M; ++j) pr[j] = b * ar[j];
    pr[i] += a;
  }
}

// Row split of an upper triangle into `parts` blocks of about equal area: row i holds M - i
// entries, so block t ends at M (1 - sqrt(1 - (t + 1) / parts)).
int64_t tri_split(int64_t M, int parts, int t) {
  if (t >= parts) return M;
  const double f = double(t) / double(parts);
  return std::min<int64_t>(M, int64_t(std::llround(double(M) * (1.0 - std::sqrt(1.0 - f)))));
}

// All steps on one matrix, single-threaded BLAS. A, P: [M, M]; Y: [M, N].
void ns_one(float* X, int64_t M, int64_t N, const float* coeffs, int64_t steps, float* A, float* P, float* Y) {
  float* cur = X;
  float* nxt = Y;
  for (int64_t s = 0; s < steps; ++s) {
    const float a = coeffs[3 * s], b = coeffs[3 * s + 1], c = coeffs[3 * s + 2];
    ssyrk_upper(false, M, N, 1.0f, cur, N, 0.0f, A, M);
    mirror_upper(A, M, 0, M);
    prefill_poly(A, P, M, 0, M, a, b);
    ssyrk_upper(false, M, M, c, A, M, 1.0f, P, M);
    mirror_upper(P, M, 0, M);
    sgemm(false, false, M, N, M, 1.0f, P, M, cur, N, 0.0f, nxt, N);
    std::swap(cur, nxt);
  }
  if (cur != X) std::memcpy(X, cur, sizeof(float) * size_t(M) * size_t(N));
}

// All steps on one matrix with every thread of the enclosing parallel region (row blocks).
void ns_one_parallel(float* X, int64_t M, int64_t N, const float* coeffs, int64_t steps, float* A, float* P,
                     float* Y) {
  const int nt = omp_get_num_threads(), t = omp_get_thread_num();
  const int64_t tr0 = tri_split(M, nt, t), tr1 = tri_split(M, nt, t + 1);  // triangle rows
  const int64_t rows = (M + nt - 1) / nt;
  const int64_t gr0 = std::min<int64_t>(M, t * rows), gr1 = std::min<int64_t>(M, gr0 + rows);  // GEMM rows
  float* cur = X;
  float* nxt = Y;
  for (int64_t s = 0; s < steps; ++s) {
    const float a = coeffs[3 * s], b = coeffs[3 * s + 1], c = coeffs[3 * s + 2];
    syrk_rows(cur, M, N, tr0, tr1, 1.0f, 0.0f, A);
#pragma omp barrier
    mirror_upper(A, M, gr0, gr1);
#pragma omp barrier
    prefill_poly(A, P, M, tr0, tr1, a, b);
    syrk_rows(A, M, M, tr0, tr1, c, 1.0f, P);
#pragma omp barrier
    mirror_upper(P, M, gr0, gr1);
#pragma omp barrier
    if (gr1 > gr0) sgemm(false, false, gr1 - gr0, N, M, 1.0f, P + gr0 * M, M, cur, N, 0.0f, nxt + gr0 * N, N);
#pragma omp barrier
    std::swap(cur, nxt);
  }
  if (cur != X && gr1 > gr0) std::memcpy(X + gr0 * N, cur + gr0 * N, sizeof(float) * size_t(gr1 - gr0) * size_t(N));
#pragma omp barrier
}

}  // namespace

void validate(const NewtonSchulzArgs& a) {
  K2_CHECK(a.x != nullptr || a.B == 0, "newton_schulz: x is null");
  K2_CHECK(a.B >= 0, "newton_schulz: B (number of matrices) must be >= 0, got " + std::to_string(a.B));
  K2_CHECK(a.M >= 1 && a.N >= a.M,
           "newton_schulz: need 1 <= M <= N (transpose tall matrices first), got M=" + std::to_string(a.M) +
               " N=" + std::to_string(a.N));
  K2_CHECK(a.matrix_stride >= a.M * a.N || a.B <= 1,
           "newton_schulz: matrix_stride " + std::to_string(a.matrix_stride) + " < M * N = " + std::to_string(a.M * a.N));
  K2_CHECK(a.steps >= 0, "newton_schulz: steps must be >= 0, got " + std::to_string(a.steps));
  K2_CHECK(a.coeffs != nullptr || a.steps == 0, "newton_schulz: coeffs is null");
}

size_t newton_schulz_cpu_workspace_floats(int64_t B, int64_t M, int64_t N, int num_threads) {
  const int64_t sets = (num_threads > 1 && B >= num_threads) ? num_threads : 1;
  return size_t(sets) * size_t(2 * M * M + M * N);
}

void newton_schulz_cpu(const NewtonSchulzArgs& a, float* workspace, int num_threads) {
  validate(a);
  K2_CHECK(a.dtype == DType::kFloat32,
           std::string("newton_schulz_cpu: x must be float32, got ") + dtype_name(a.dtype));
  K2_CHECK(workspace != nullptr, "newton_schulz_cpu: workspace is null");
  if (a.B == 0 || a.steps == 0) return;
  const int nt = std::max(1, num_threads);
  const int64_t M = a.M, N = a.N, per_set = 2 * M * M + M * N;
  float* x = static_cast<float*>(a.x);
  // Whole matrices per thread for the first floor(B / nt) * nt; the rest one at a time with all
  // threads inside each (a batch smaller than the thread count would leave threads idle).
  const int64_t whole = nt > 1 ? (a.B / nt) * nt : a.B;
  if (whole > 0) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < whole; ++i) {
      float* ws = workspace + (nt > 1 ? omp_get_thread_num() : 0) * per_set;
      ns_one(x + i * a.matrix_stride, M, N, a.coeffs, a.steps, ws, ws + M * M, ws + 2 * M * M);
    }
  }
  if (whole < a.B) {
#pragma omp parallel num_threads(nt)
    for (int64_t i = whole; i < a.B; ++i)
      ns_one_parallel(x + i * a.matrix_stride, M, N, a.coeffs, a.steps, workspace, workspace + M * M,
                      workspace + 2 * M * M);
  }
}

}  // namespace k2
