// Row primitives shared by the CPU kernels (attention, MoE unpermute), compiled once per ISA in
// csrc/cpu/cpu_rows.cpp: the build's baseline is SSE2, and these loops run at the vector width.
// fp32; products are rounded before they are added (-ffp-contract=off), as PyTorch computes them.
#pragma once

#include <cstdint>

namespace k2 {

// out[i] = x[i] * a (out may be x).
void scale_row(float* out, const float* x, int64_t n, float a);
// acc[i] += x[i] * a.
void scaled_add_row(float* acc, const float* x, int64_t n, float a);
// sum of x[i] * y[i], in eight lane-wise partial sums (within rounding of the serial order).
float dot_row(const float* x, const float* y, int64_t n);

}  // namespace k2
