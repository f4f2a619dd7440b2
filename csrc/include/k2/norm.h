// RMSNorm for the CPU training path: y = w * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps) per row.
// fp32, rows contiguous. The backward is fused: torch's composite RMSNorm backward (several
// elementwise passes and a column reduction for dw) took 15-30x the forward on this CPU.
// Semantics: k2_kernels/reference.py (rms_norm).
#pragma once

#include <cstdint>

namespace k2 {

struct RmsNormArgs {
  const float* x;    // [N, D]
  const float* w;    // [D]
  int64_t N, D;
  float eps;
  float* y;          // [N, D] out
  float* rstd;       // [N] out (saved for the backward)
};

struct RmsNormBackwardArgs {
  const float* g;    // [N, D], d loss / d y
  const float* x;    // [N, D]
  const float* w;    // [D]
  const float* rstd; // [N], the forward's
  int64_t N, D;
  float* dx;         // [N, D] out (or null)
  float* dw;         // [D] out (or null); deterministic for a given thread count
};

void rms_norm_fwd_cpu(const RmsNormArgs& a);
void rms_norm_bwd_cpu(const RmsNormBackwardArgs& a);

}  // namespace k2
