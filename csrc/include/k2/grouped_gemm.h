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

// ---- fused SwiGLU experts: y_e = (silu(x_e Wg_e^T) * (x_e Wu_e^T)) Wd_e^T --------------------------
//
// Shape legend (model names): D hidden, I expert intermediate size. Weights in nn.Linear's [out, in]
// layout, as the model stores them: gate/up [E, I, D], down [E, D, I]; each expert's matrix has a
// contiguous inner dimension and the given row and expert strides. One task per (expert, row block)
// runs the three GEMMs and the activation while the block is in cache.

struct SwigluWeights {
  const float* gate;       // [E, I, D]
  int64_t gate_stride_e, gate_stride_r;
  const float* up;         // [E, I, D]
  int64_t up_stride_e, up_stride_r;
  const float* down;       // [E, D, I]
  int64_t down_stride_e, down_stride_r;
};

struct SwigluExpertsArgs {
  const float* x;          // [N, D], row stride x_row_stride
  int64_t x_row_stride;
  SwigluWeights w;
  const int32_t* offsets;  // [E]
  int64_t E, N, D, I;
  float* gate_up;          // [N, 2I] out, contiguous: the pre-activations [gate | up], kept for the backward
  float* y;                // [N, D] out, contiguous; rows >= offsets[E-1] are set to 0
  int num_threads;
};

void moe_swiglu_experts_cpu(const SwigluExpertsArgs& a);

// The forward for bf16 weights (serving in bf16 on CPU): the same weight layouts, bf16 bits; x, gate_up
// and y are fp32 (the caller widens x and narrows the outputs). Each task widens its expert's three
// matrices into per-thread fp32 scratch (L2-sized; the pass also brings them into cache, reading half
// the bytes of fp32 weights) and runs the fp32 GEMMs on it, accumulating in fp32. Measured at a decode
// step's few rows per expert, this beat a kernel that widens each weight row in registers (78 vs 110 us
// for 8 rows over 16 experts of 128x256): OpenBLAS's small-matrix kernel on cached fp32 wins.
struct SwigluWeightsBf16 {
  const uint16_t* gate;    // [E, I, D]
  int64_t gate_stride_e, gate_stride_r;
  const uint16_t* up;      // [E, I, D]
  int64_t up_stride_e, up_stride_r;
  const uint16_t* down;    // [E, D, I]
  int64_t down_stride_e, down_stride_r;
};

struct SwigluExpertsBf16Args {
  const float* x;          // [N, D], row stride x_row_stride
  int64_t x_row_stride;
  SwigluWeightsBf16 w;
  const int32_t* offsets;  // [E]
  int64_t E, N, D, I;
  float* gate_up;          // [N, 2I] out, contiguous
  float* y;                // [N, D] out, contiguous; rows >= offsets[E-1] are set to 0
  int num_threads;
};

void moe_swiglu_experts_bf16w_cpu(const SwigluExpertsBf16Args& a);

struct SwigluExpertsBackwardArgs {
  const float* dy;         // [N, D], row stride dy_row_stride
  int64_t dy_row_stride;
  const float* x;          // [N, D], row stride x_row_stride
  int64_t x_row_stride;
  const float* gate_up;    // [N, 2I] contiguous, from the forward
  SwigluWeights w;
  const int32_t* offsets;
  int64_t E, N, D, I;
  float* dx;               // [N, D] contiguous out, or nullptr
  float* dw_gate;          // [E, I, D] contiguous out, or nullptr (with dw_up and dw_down)
  float* dw_up;            // [E, I, D]
  float* dw_down;          // [E, D, I]
  float* h_scratch;        // [N, I] scratch: silu(gate) * up (written only for experts split across threads)
  float* dgu_scratch;      // [N, 2I] scratch: [d gate | d up] (likewise)
  int num_threads;
};

void moe_swiglu_experts_backward_cpu(const SwigluExpertsBackwardArgs& a);
}  // namespace k2
