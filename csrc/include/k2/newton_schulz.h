// Batched Newton-Schulz iterations (Muon's orthogonalisation). Semantics:
// k2_kernels/newton_schulz_ops.py (newton_schulz_reference).
//
// Shape legend: B matrices, M rows, N columns, M <= N (the caller transposes tall matrices).
// One step with coefficients (a, b, c):  A = X X^T [M, M];  P = b A + c A A;  X <- a X + P X.
// The kernels run ALL steps of the schedule in place on x: the caller normalises X first (the
// iteration converges only for ||X||_2 <= 1; the norm and eps conventions belong to the caller,
// k2_optim). x holds B contiguous [M, N] row-major matrices, matrix_stride elements apart.
#pragma once

#include <cstddef>
#include <cstdint>

#include "k2/common.h"

namespace k2 {

struct NewtonSchulzArgs {
  void* x;                 // [B, M, N] in/out, dtype `dtype`, rows contiguous (row stride N)
  DType dtype;             // CPU: float32; CUDA: bfloat16 or float32
  int64_t B, M, N;
  int64_t matrix_stride;   // elements between matrices (>= M * N)
  const float* coeffs;     // [steps, 3] host memory: (a, b, c) of each step
  int64_t steps;
};

void validate(const NewtonSchulzArgs& a);

// CPU, fp32, OpenMP with `num_threads` threads (the Python side passes torch's thread count:
// torch and this module may not share an OpenMP runtime). With B >= num_threads each thread
// iterates whole matrices with single-threaded BLAS; otherwise the threads split each matrix's
// products into row blocks. Workspace: newton_schulz_cpu_workspace_floats(...) floats.
size_t newton_schulz_cpu_workspace_floats(int64_t B, int64_t M, int64_t N, int num_threads);
void newton_schulz_cpu(const NewtonSchulzArgs& a, float* workspace, int num_threads);

#ifdef K2_WITH_CUDA
// CUDA, bf16 (fp32 accumulation on tensor cores, each product rounded to bf16 like torch's
// bf16 bmm/baddbmm) or fp32 (fp32 FMAs, no TF32). Asynchronous on `stream` of `device`; never
// allocates: workspace of newton_schulz_cuda_workspace_bytes(...) bytes, 16-byte aligned.
// Per step three launches over blockIdx.z = matrix: X X^T and A A^T compute only the tiles on
// and above the diagonal and store each off-diagonal tile twice (mirrored); the epilogues fuse
// P = c (A A^T) + b A and X' = P X + a X.
size_t newton_schulz_cuda_workspace_bytes(int64_t B, int64_t M, int64_t N, DType dtype);
void newton_schulz_cuda(const NewtonSchulzArgs& a, void* workspace, int device, uintptr_t stream);
#endif

}  // namespace k2
