// Fused attention for MLA's training shapes that also returns each head's maximum logit
// (the QK-Clip signal). Semantics: k2_kernels/reference.py (mla_attention).
//
// Shape legend: T packed tokens (all sequences back to back), H heads, B sequences,
// Dk query/key head dim (K2: 128 nope + 64 rope = 192), Dv value head dim (K2: 128).
// Sequence b holds tokens [cu_seqlens[b], cu_seqlens[b + 1]); tokens attend only inside their
// sequence, and with `causal` only to keys at or before their own position.
// q, k, v, out and the gradients are contiguous [T, H, D*] arrays of one dtype (fp32 or bf16);
// lse and max_logit are fp32. Accumulation is fp32 everywhere.
#pragma once

#include <cstddef>
#include <cstdint>

#include "k2/common.h"

namespace k2 {

struct AttentionArgs {
  const void* q;              // [T, H, Dk]
  const void* k;              // [T, H, Dk]
  const void* v;              // [T, H, Dv]
  DType dtype;                // of q, k, v, out
  const int32_t* cu_seqlens;  // [B + 1], cu_seqlens[0] = 0, non-decreasing, cu_seqlens[B] = T
  int64_t T, H, B, Dk, Dv;
  int64_t max_seqlen;         // max over b of the sequence length (sizes the CUDA grid)
  float scale;                // softmax scale: logits = scale * q . k
  bool causal;
  void* out;                  // [T, H, Dv] out
  float* lse;                 // [H, T] out: log-sum-exp of each row's logits (natural log)
  float* max_logit;           // [H] out: max logit of head h over every (query, key) pair that
                              // may attend, over the whole batch; -inf when there is none.
                              // nullptr: not computed (to measure what the output costs)
  // CPU, optional (nullptr: not kept): the softmax probabilities, row (h, t) at
  // probs + (h * T + t) * probs_ld, column j = key j of t's sequence, for the backward to reuse
  // instead of recomputing q k^T and the exponentials. Needs max_seqlen <= kProbsMaxSeqlen (one
  // key block per query block). Masked keys and columns past the sequence hold 0.
  float* probs = nullptr;
  int64_t probs_ld = 0;
};

// Longest sequence whose probabilities the CPU forward can keep (its key block size).
constexpr int64_t kProbsMaxSeqlen = 256;

struct AttentionBackwardArgs {
  const void* q;              // [T, H, Dk]
  const void* k;              // [T, H, Dk]
  const void* v;              // [T, H, Dv]
  const void* out;            // [T, H, Dv], the forward's output
  const void* dout;           // [T, H, Dv]
  DType dtype;                // of q, k, v, out, dout, dq, dk, dv
  const float* lse;           // [H, T], the forward's
  const int32_t* cu_seqlens;  // [B + 1]
  int64_t T, H, B, Dk, Dv, max_seqlen;
  float scale;
  bool causal;
  void* dq;                   // [T, H, Dk] out
  void* dk;                   // [T, H, Dk] out
  void* dv;                   // [T, H, Dv] out
  const float* probs = nullptr;  // CPU, optional: the forward's kept probabilities (AttentionArgs)
  int64_t probs_ld = 0;
};

// Checks shared by both devices (head dims multiples of 16 up to 256, dtype, sizes).
void validate(const AttentionArgs& a);
void validate(const AttentionBackwardArgs& a);

// CPU (OpenMP; block products through k2::sgemm). fp32 only: the Python side converts bf16.
// cu_seqlens is host memory and is checked (std::invalid_argument when malformed).
void mla_attention_fwd_cpu(const AttentionArgs& a);
void mla_attention_bwd_cpu(const AttentionBackwardArgs& a);

#ifdef K2_WITH_CUDA
// CUDA sm_90a: asynchronous on `stream` (cudaStream_t as an integer) of `device`; cu_seqlens is
// device memory. fp32 and bf16. The backward needs `workspace` of the given size (fp32 dq
// accumulation and the per-row dot(dout, out)).
size_t mla_attention_bwd_workspace_bytes(int64_t T, int64_t H, int64_t Dk);
void mla_attention_fwd_cuda(const AttentionArgs& a, int device, uintptr_t stream);
void mla_attention_bwd_cuda(const AttentionBackwardArgs& a, void* workspace, int device, uintptr_t stream);
#endif

}  // namespace k2
