// Python bindings of the CUDA MLA attention kernels (compiled only when CUDA is on).
// Pointers are torch data_ptr() integers; cu_seqlens is int32 device memory; both launches are
// asynchronous on `stream`.
#include <pybind11/stl.h>

#include <utility>
#include <vector>

#include "k2/attention.h"
#include "k2/bind.h"

namespace py = pybind11;
using namespace k2;

K2_BINDINGS(attention_cuda) {
  // Every (Dk, Dv) the CUDA kernels take: multiples of 16 up to 256 (validate's range). bf16 with
  // the pairs of cuda_attention_mma_head_dims runs on tensor cores (keep in sync with
  // attn::kMmaDims in mla_attention_common.cuh); fp32 and the other pairs on exact SIMT kernels.
  std::vector<std::pair<int, int>> dims;
  for (int dk = 16; dk <= 256; dk += 16)
    for (int dv = 16; dv <= 256; dv += 16) dims.emplace_back(dk, dv);
  m.attr("cuda_attention_head_dims") = dims;
  m.attr("cuda_attention_max_logit_optional") = true;  // max_logit = 0 skips it (benchmarks/attention.py)
  m.attr("cuda_attention_mma_head_dims") = std::vector<std::pair<int, int>>{{192, 128}, {128, 128}, {64, 64}};

  m.def(
      "mla_attention_fwd_cuda",
      [](int device, uintptr_t stream, uintptr_t q, uintptr_t k, uintptr_t v, int dtype, uintptr_t cu_seqlens,
         int64_t T, int64_t H, int64_t B, int64_t Dk, int64_t Dv, int64_t max_seqlen, double scale, bool causal,
         uintptr_t out, uintptr_t lse, uintptr_t max_logit) {
        const AttentionArgs a{ptr<const void>(q), ptr<const void>(k), ptr<const void>(v), DType(dtype),
                              ptr<const int32_t>(cu_seqlens), T, H, B, Dk, Dv, max_seqlen, float(scale), causal,
                              ptr<void>(out), ptr<float>(lse), ptr<float>(max_logit)};
        py::gil_scoped_release nogil;
        mla_attention_fwd_cuda(a, device, stream);
      },
      "(device, stream, q, k, v, dtype, cu_seqlens, T, H, B, Dk, Dv, max_seqlen, scale, causal, out, lse, "
      "max_logit) asynchronous on the stream; see k2/attention.h");
  m.def("mla_attention_bwd_workspace_bytes", &mla_attention_bwd_workspace_bytes, "(T, H, Dk) -> bytes");
  m.def(
      "mla_attention_bwd_cuda",
      [](int device, uintptr_t stream, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t dout, int dtype,
         uintptr_t lse, uintptr_t cu_seqlens, int64_t T, int64_t H, int64_t B, int64_t Dk, int64_t Dv,
         int64_t max_seqlen, double scale, bool causal, uintptr_t dq, uintptr_t dk, uintptr_t dv,
         uintptr_t workspace) {
        const AttentionBackwardArgs a{ptr<const void>(q), ptr<const void>(k), ptr<const void>(v), ptr<const void>(out),
                                      ptr<const void>(dout), DType(dtype), ptr<const float>(lse),
                                      ptr<const int32_t>(cu_seqlens), T, H, B, Dk, Dv, max_seqlen, float(scale),
                                      causal, ptr<void>(dq), ptr<void>(dk), ptr<void>(dv)};
        py::gil_scoped_release nogil;
        mla_attention_bwd_cuda(a, ptr<void>(workspace), device, stream);
      },
      "(device, stream, q, k, v, out, dout, dtype, lse, cu_seqlens, T, H, B, Dk, Dv, max_seqlen, scale, causal, "
      "dq, dk, dv, workspace) asynchronous on the stream; workspace of mla_attention_bwd_workspace_bytes(T, H, Dk)");
}
