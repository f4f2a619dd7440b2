// MLA's attention inputs from the projections, in one pass: RoPE on the rotary parts and the packing
// of q, k, v into the contiguous [T, H, *] tensors the attention kernel reads. In PyTorch this was
// ~20 small ops per layer (strided slices, four products, two concatenations, a v copy) and twice
// as many in the backward (zero-filled slice gradients, an expand's sum over heads), about 9 ms of
// a 300 ms training step of the tiny model on 2 cores.
//
// Rotary layout: the checkpoint's interleaved pairs (x0, x1), (x2, x3), ... are rotated and written
// as [rotated evens | rotated odds]: out[i] = x[2i] cos_i - x[2i+1] sin_i and
// out[R/2 + i] = x[2i+1] cos_i + x[2i] sin_i. Semantics: k2_kernels/reference.py (mla_rope_pack).
// fp32; each row's last dim contiguous, rows at the given strides.
#pragma once

#include <cstdint>

namespace k2 {

struct RopePackArgs {
  const float* q;        // [T, H, P + R], row (token) stride q_stride; heads contiguous
  int64_t q_stride;
  const float* kv;       // [T, H, P + V] (k_nope | v), row stride kv_stride
  int64_t kv_stride;
  const float* k_rope;   // [T, R], shared by all heads, row stride k_rope_stride
  int64_t k_rope_stride;
  const float* cos;      // [T, R / 2], contiguous
  const float* sin;      // [T, R / 2]
  int64_t T, H, P, R, V;
  float* q_out;          // [T, H, P + R] out
  float* k_out;          // [T, H, P + R] out
  float* v_out;          // [T, H, V] out
};

struct RopePackBackwardArgs {
  const float* dq;       // [T, H, P + R], contiguous
  const float* dk;       // [T, H, P + R]
  const float* dv;       // [T, H, V]
  const float* cos;      // [T, R / 2]
  const float* sin;
  int64_t T, H, P, R, V;
  float* dq_in;          // [T, H, P + R] out, gradient of q
  float* dkv_in;         // [T, H, P + V] out, gradient of kv
  float* dk_rope_in;     // [T, R] out, gradient of k_rope (summed over heads)
};

void rope_pack_fwd_cpu(const RopePackArgs& a);
void rope_pack_bwd_cpu(const RopePackBackwardArgs& a);

}  // namespace k2
