// Python bindings of the CPU attention kernels (callers: k2_kernels/attention_ops.py).
#include "k2/attention.h"
#include "k2/bind.h"

namespace py = pybind11;
using k2::ptr;

K2_BINDINGS(attention_cpu) {
  m.def(
      "mla_attention_fwd_cpu",
      [](uintptr_t q, uintptr_t k, uintptr_t v, int dtype, uintptr_t cu, int64_t T, int64_t H, int64_t B, int64_t Dk,
         int64_t Dv, int64_t max_seqlen, double scale, bool causal, uintptr_t out, uintptr_t lse, uintptr_t mx,
         uintptr_t probs, int64_t probs_ld) {
        k2::AttentionArgs a{ptr<const void>(q), ptr<const void>(k), ptr<const void>(v), k2::DType(dtype),
                            ptr<const int32_t>(cu), T, H, B, Dk, Dv, max_seqlen, float(scale), causal,
                            ptr<void>(out), ptr<float>(lse), ptr<float>(mx), ptr<float>(probs), probs_ld};
        py::gil_scoped_release nogil;
        k2::mla_attention_fwd_cpu(a);
      },
      "(q, k, v, dtype, cu_seqlens, T, H, B, Dk, Dv, max_seqlen, scale, causal, out, lse, max_logit, "
      "probs or 0, probs_ld)");
  m.def(
      "mla_attention_bwd_cpu",
      [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t dout, int dtype, uintptr_t lse, uintptr_t cu,
         int64_t T, int64_t H, int64_t B, int64_t Dk, int64_t Dv, int64_t max_seqlen, double scale, bool causal,
         uintptr_t dq, uintptr_t dk, uintptr_t dv, uintptr_t probs, int64_t probs_ld) {
        k2::AttentionBackwardArgs a{ptr<const void>(q), ptr<const void>(k), ptr<const void>(v), ptr<const void>(out),
                                    ptr<const void>(dout), k2::DType(dtype), ptr<const float>(lse),
                                    ptr<const int32_t>(cu), T, H, B, Dk, Dv, max_seqlen, float(scale), causal,
                                    ptr<void>(dq), ptr<void>(dk), ptr<void>(dv), ptr<const float>(probs), probs_ld};
        py::gil_scoped_release nogil;
        k2::mla_attention_bwd_cpu(a);
      },
      "(q, k, v, out, dout, dtype, lse, cu_seqlens, T, H, B, Dk, Dv, max_seqlen, scale, causal, dq, dk, dv, "
      "probs or 0, probs_ld)");
}
