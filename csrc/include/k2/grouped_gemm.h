// Grouped (per-expert) fp32 GEMMs for the MoE experts on CPU, with the semantics of
// torch._grouped_mm(x, w, offs=offsets) for a 2-D x and a 3-D w. Semantics: k2_kernels/grouped_gemm_ops.py.
//
// Shape legend: E experts, N rows grouped by expert, K inner size, M output columns. Expert e owns
// rows [offsets[e-1], offsets[e]) (offsets: int32 inclusive cumulative counts, offsets[-1] = 0).
// Row strides are in elements; the inner dimension of every 2-D operand is contiguous.
//
// Each expert's product is one single-threaded k2::sgemm call; OpenMP runs the experts in parallel,
// largest first (dynamic schedule), and an expert too large for one thread's share is split into
// row blocks (forward) or output-row blocks (weight gradient), so a skewed router keeps all cores busy.
#pragma once

#include <cstdint>

namespace k2 {

struct GroupedMmArgs {
  const float* x;          // [N, K], row stride x_row_stride
  int64_t x_row_stride;
  const float* w;          // [E, K, M], strides (w_stride_e, w_stride_k, w_stride_m): w_stride_k == 1
  int64_t w_stride_e;      // (a transposed view of [E, M, K]) or w_stride_m == 1 ([E, K, M] rows)
  int64_t w_stride_k;
  int64_t w_stride_m;
  const int32_t* offsets;  // [E]
  int64_t E, N, K, M;
  float* y;                // [N, M] out, row stride y_row_stride; rows >= offsets[E-1] are set to 0
  int64_t y_row_stride;
  int num_threads;         // <= 0: OpenMP's default
};

// y[rows of e] = x[rows of e] @ w[e] for every expert e.
void grouped_mm_cpu(const GroupedMmArgs& a);

struct GroupedWgradArgs {
  const float* x;          // [N, K], row stride x_row_stride
  int64_t x_row_stride;
  const float* dy;         // [N, M], row stride dy_row_stride
  int64_t dy_row_stride;
  const int32_t* offsets;  // [E]
  int64_t E, N, K, M;
  bool trans_out;          // false: dw is [E, K, M]; true: dw is [E, M, K] (each block transposed)
  float* dw;               // out, contiguous; experts without rows get 0
  int num_threads;
};

// dw[e] = x[rows of e]^T @ dy[rows of e] (or its transpose): the weight gradient of grouped_mm, and
// torch._grouped_mm(x.t(), dy, offs) for 2-D operands.
void grouped_mm_wgrad_cpu(const GroupedWgradArgs& a);

// Checks offsets (non-decreasing, within [0, N]); throws std::invalid_argument naming the bad entry.
void check_group_offsets(const int32_t* offsets, int64_t E, int64_t N);

}  // namespace k2
