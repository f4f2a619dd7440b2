// Python bindings of the CPU grouped GEMM (see k2_kernels/grouped_gemm_ops.py for the callers).
#include "k2/bind.h"
#include "k2/grouped_gemm.h"

namespace py = pybind11;
using namespace k2;

K2_BINDINGS(grouped_gemm_cpu) {
  // The kernels run without the GIL: they touch no Python objects.
  m.def(
      "grouped_mm_cpu",
      [](uintptr_t x, int64_t xs, uintptr_t w, int64_t wse, int64_t wsk, int64_t wsm, uintptr_t offs, int64_t E,
         int64_t N, int64_t K, int64_t M, uintptr_t y, int64_t ys, int threads) {
        GroupedMmArgs a{ptr<const float>(x), xs, ptr<const float>(w), wse, wsk, wsm, ptr<const int32_t>(offs),
                        E, N, K, M, ptr<float>(y), ys, threads};
        py::gil_scoped_release nogil;
        grouped_mm_cpu(a);
      },
      "(x, x_row_stride, w, w_stride_e, w_stride_k, w_stride_m, offsets, E, N, K, M, y_out, y_row_stride, "
      "num_threads): fp32 y[rows of e] = x[rows of e] @ w[e]");
  m.def(
      "grouped_mm_wgrad_cpu",
      [](uintptr_t x, int64_t xs, uintptr_t dy, int64_t dys, uintptr_t offs, int64_t E, int64_t N, int64_t K,
         int64_t M, bool trans_out, uintptr_t dw, int threads) {
        GroupedWgradArgs a{ptr<const float>(x), xs, ptr<const float>(dy), dys, ptr<const int32_t>(offs),
                           E, N, K, M, trans_out, ptr<float>(dw), threads};
        py::gil_scoped_release nogil;
        grouped_mm_wgrad_cpu(a);
      },
      "(x, x_row_stride, dy, dy_row_stride, offsets, E, N, K, M, trans_out, dw_out, num_threads): fp32 "
      "dw[e] = x[rows of e]^T @ dy[rows of e] ([E, K, M]; [E, M, K] when trans_out)");

  // Weights as (gate, gate_stride_e, gate_stride_r, up, ..., down, ...): nn.Linear layouts.
  m.def(
      "moe_swiglu_experts_cpu",
      [](uintptr_t x, int64_t xs, uintptr_t wg, int64_t wgse, int64_t wgsr, uintptr_t wu, int64_t wuse, int64_t wusr,
         uintptr_t wd, int64_t wdse, int64_t wdsr, uintptr_t offs, int64_t E, int64_t N, int64_t D, int64_t I,
         uintptr_t gu, uintptr_t y, int threads) {
        SwigluWeights w{ptr<const float>(wg), wgse, wgsr, ptr<const float>(wu), wuse, wusr, ptr<const float>(wd),
                        wdse, wdsr};
        SwigluExpertsArgs a{ptr<const float>(x), xs, w, ptr<const int32_t>(offs), E, N, D, I, ptr<float>(gu),
                            ptr<float>(y), threads};
        py::gil_scoped_release nogil;
        moe_swiglu_experts_cpu(a);
      },
      "(x, x_row_stride, gate, gate_stride_e, gate_stride_r, up, up_stride_e, up_stride_r, down, down_stride_e, "
      "down_stride_r, offsets, E, N, D, I, gate_up_out, y_out, num_threads): fused SwiGLU experts, fp32");
  m.def(
      "moe_swiglu_experts_backward_cpu",
      [](uintptr_t dy, int64_t dys, uintptr_t x, int64_t xs, uintptr_t gu, uintptr_t wg, int64_t wgse, int64_t wgsr,
         uintptr_t wu, int64_t wuse, int64_t wusr, uintptr_t wd, int64_t wdse, int64_t wdsr, uintptr_t offs, int64_t E,
         int64_t N, int64_t D, int64_t I, uintptr_t dx, uintptr_t dwg, uintptr_t dwu, uintptr_t dwd, uintptr_t h,
         uintptr_t dgu, int threads) {
        SwigluWeights w{ptr<const float>(wg), wgse, wgsr, ptr<const float>(wu), wuse, wusr, ptr<const float>(wd),
                        wdse, wdsr};
        SwigluExpertsBackwardArgs a{ptr<const float>(dy), dys, ptr<const float>(x), xs, ptr<const float>(gu), w,
                                    ptr<const int32_t>(offs), E, N, D, I, ptr<float>(dx), ptr<float>(dwg),
                                    ptr<float>(dwu), ptr<float>(dwd), ptr<float>(h), ptr<float>(dgu), threads};
        py::gil_scoped_release nogil;
        moe_swiglu_experts_backward_cpu(a);
      },
      "(dy, dy_row_stride, x, x_row_stride, gate_up, gate, gate_stride_e, gate_stride_r, up, ..., down, ..., "
      "offsets, E, N, D, I, dx_out or 0, d_gate_out or 0, d_up_out, d_down_out, h_scratch [N, I], "
      "dgu_scratch [N, 2I], num_threads)");
  m.def(
      "moe_swiglu_experts_bf16w_cpu",
      [](uintptr_t x, int64_t xs, uintptr_t wg, int64_t wgse, int64_t wgsr, uintptr_t wu, int64_t wuse, int64_t wusr,
         uintptr_t wd, int64_t wdse, int64_t wdsr, uintptr_t offs, int64_t E, int64_t N, int64_t D, int64_t I,
         uintptr_t gu, uintptr_t y, int threads) {
        SwigluWeightsBf16 w{ptr<const uint16_t>(wg), wgse, wgsr, ptr<const uint16_t>(wu), wuse, wusr,
                            ptr<const uint16_t>(wd), wdse, wdsr};
        SwigluExpertsBf16Args a{ptr<const float>(x), xs, w, ptr<const int32_t>(offs), E, N, D, I, ptr<float>(gu),
                                ptr<float>(y), threads};
        py::gil_scoped_release nogil;
        moe_swiglu_experts_bf16w_cpu(a);
      },
      "(x, x_row_stride, gate, gate_stride_e, gate_stride_r, up, ..., down, ..., offsets, E, N, D, I, "
      "gate_up_out, y_out, num_threads): fused SwiGLU experts with bf16 weights; x and outputs fp32");
}
