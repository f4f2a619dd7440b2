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

// The same product for few rows (M up to a few hundred, as in one expert's tokens): C is computed in
// column panels of `sgemm_panel_columns()` (default 16) columns, one BLAS call each. At such shapes
// OpenBLAS's full path spends a large share packing B from memory, while a 16-column panel is small
// enough for its packing-free small-matrix kernel (measured at issue 2's expert shapes, M = 40-100,
// K = 128-256, weights not in cache: 115-135 -> 130-150 GFLOP/s on 2 cores; an expert layer's forward
// + backward 39 -> 35 ms). Transposed A (weight gradients) gained nothing and keeps one call.
// Panel width 0 turns this off (one call, as sgemm).
void sgemm_few_rows(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
int sgemm_panel_columns();
void set_sgemm_panel_columns(int columns);

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
