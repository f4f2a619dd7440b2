// Single-precision GEMM for the CPU kernels, row-major, called from inside OpenMP regions.
//
// The BLAS is chosen at run time, not link time: k2_kernels (Python) hands over the address of
// `cblas_sgemm` from the OpenBLAS in the scipy-openblas32 wheel when it is installed (set to one
// thread, since the kernels parallelise with OpenMP around it). Without it a built-in blocked
// kernel runs (correct, slower). So the build needs no BLAS, and a wheel works with or without one.
#pragma once

#include <cstdint>

namespace k2 {

// C[M, N] = alpha * op(A) @ op(B) + beta * C; op(X) = X or X^T; ld* are row strides (elements).
// A is [M, K] (trans_a: [K, M]), B is [K, N] (trans_b: [N, K]).
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Symmetric rank-k update, C[N, N] = alpha * A @ A^T + beta * C with A [N, K] (trans: A^T @ A
// with A [K, N]). Only the upper triangle of C (row <= col) is written; the lower is left as is.
void ssyrk_upper(bool trans, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, float beta, float* C,
                 int64_t ldc);

// The cblas_sgemm-compatible function to use (nullptr: the built-in kernel).
using CblasSgemmFn = void (*)(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float* A,
                              int lda, const float* B, int ldb, float beta, float* C, int ldc);
using CblasSsyrkFn = void (*)(int order, int uplo, int trans, int N, int K, float alpha, const float* A, int lda,
                              float beta, float* C, int ldc);
void set_cblas_sgemm(CblasSgemmFn fn);
void set_cblas_ssyrk(CblasSsyrkFn fn);
bool has_external_blas();

}  // namespace k2
