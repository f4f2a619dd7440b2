// MLA RoPE + q/k/v packing on CPU (OpenMP over tokens; see k2/rope_pack.h).
// Forward per pair i:  out_i = x_2i c - x_2i+1 s,  out_{R/2+i} = x_2i+1 c + x_2i s  (c, s: cos_i, sin_i)
// Backward, from (a, b) = (d out_i, d out_{R/2+i}):  d x_2i = a c + b s,  d x_2i+1 = b c - a s.
// Products are rounded before they are added (-ffp-contract=off), as PyTorch's composition does.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "k2/bind.h"
#include "k2/common.h"
#include "k2/rope_pack.h"
#include "k2/threads.h"

namespace k2 {
namespace {

inline void rope_forward(const float* x, const float* c, const float* s, int64_t R2, float* out) {
  for (int64_t i = 0; i < R2; ++i) {
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    out[i] = x0 * c[i] - x1 * s[i];
    out[R2 + i] = x1 * c[i] + x0 * s[i];
  }
}

inline void rope_backward(const float* d, const float* c, const float* s, int64_t R2, float* dx) {
  for (int64_t i = 0; i < R2; ++i) {
    const float a = d[i], b = d[R2 + i];
    dx[2 * i] = a * c[i] + b * s[i];
    dx[2 * i + 1] = b * c[i] - a * s[i];
  }
}

void check_dims(int64_t T, int64_t H, int64_t P, int64_t R, int64_t V) {
  K2_CHECK(T >= 0 && H >= 1 && P >= 0 && V >= 0 && R >= 0 && R % 2 == 0,
           "mla_rope_pack: need T >= 0, H >= 1, P, V >= 0 and an even rotary size R, got R = " + std::to_string(R));
}

}  // namespace

void rope_pack_fwd_cpu(const RopePackArgs& a) {
  check_dims(a.T, a.H, a.P, a.R, a.V);
  const int64_t H = a.H, P = a.P, R = a.R, V = a.V, R2 = R / 2, Dh = P + R;
#pragma omp parallel for schedule(static) num_threads(num_threads())
  for (int64_t t = 0; t < a.T; ++t) {
    const float* c = a.cos + t * R2;
    const float* s = a.sin + t * R2;
    float* k_t = a.k_out + t * H * Dh;
    rope_forward(a.k_rope + t * a.k_rope_stride, c, s, R2, k_t + P);  // head 0's slot, copied below
    for (int64_t h = 0; h < H; ++h) {
      const float* q = a.q + t * a.q_stride + h * Dh;
      float* qo = a.q_out + (t * H + h) * Dh;
      std::memcpy(qo, q, size_t(P) * sizeof(float));
      rope_forward(q + P, c, s, R2, qo + P);
      const float* kv = a.kv + t * a.kv_stride + h * (P + V);
      float* ko = k_t + h * Dh;
      std::memcpy(ko, kv, size_t(P) * sizeof(float));
      if (h > 0) std::memcpy(ko + P, k_t + P, size_t(R) * sizeof(float));
      std::memcpy(a.v_out + (t * H + h) * V, kv + P, size_t(V) * sizeof(float));
    }
  }
}

void rope_pack_bwd_cpu(const RopePackBackwardArgs& a) {
  check_dims(a.T, a.H, a.P, a.R, a.V);
  const int64_t H = a.H, P = a.P, R = a.R, V = a.V, R2 = R / 2, Dh = P + R;
#pragma omp parallel num_threads(num_threads())
  {
    std::vector<float> sum(static_cast<size_t>(R));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.T; ++t) {
      const float* c = a.cos + t * R2;
      const float* s = a.sin + t * R2;
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t h = 0; h < H; ++h) {
        const float* dq = a.dq + (t * H + h) * Dh;
        float* dqi = a.dq_in + (t * H + h) * Dh;
        std::memcpy(dqi, dq, size_t(P) * sizeof(float));
        rope_backward(dq + P, c, s, R2, dqi + P);
        const float* dk = a.dk + (t * H + h) * Dh;
        float* dkv = a.dkv_in + (t * H + h) * (P + V);
        std::memcpy(dkv, dk, size_t(P) * sizeof(float));
        std::memcpy(dkv + P, a.dv + (t * H + h) * V, size_t(V) * sizeof(float));
        for (int64_t r = 0; r < R; ++r) sum[size_t(r)] += dk[P + r];  // heads in order
      }
      rope_backward(sum.data(), c, s, R2, a.dk_rope_in + t * R);
    }
  }
}

}  // namespace k2

K2_BINDINGS(rope_pack_cpu) {
  m.def(
      "rope_pack_fwd_cpu",
      [](uintptr_t q, int64_t qs, uintptr_t kv, int64_t kvs, uintptr_t kr, int64_t krs, uintptr_t cos,
         uintptr_t sin, int64_t T, int64_t H, int64_t P, int64_t R, int64_t V, uintptr_t qo, uintptr_t ko,
         uintptr_t vo) {
        k2::RopePackArgs a{k2::ptr<const float>(q), qs, k2::ptr<const float>(kv), kvs, k2::ptr<const float>(kr),
                           krs, k2::ptr<const float>(cos), k2::ptr<const float>(sin), T, H, P, R, V,
                           k2::ptr<float>(qo), k2::ptr<float>(ko), k2::ptr<float>(vo)};
        pybind11::gil_scoped_release nogil;
        k2::rope_pack_fwd_cpu(a);
      },
      "(q, q_row_stride, kv, kv_row_stride, k_rope, k_rope_row_stride, cos, sin, T, H, P, R, V, q_out, k_out, "
      "v_out): fp32");
  m.def(
      "rope_pack_bwd_cpu",
      [](uintptr_t dq, uintptr_t dk, uintptr_t dv, uintptr_t cos, uintptr_t sin, int64_t T, int64_t H, int64_t P,
         int64_t R, int64_t V, uintptr_t dqi, uintptr_t dkvi, uintptr_t dkri) {
        k2::RopePackBackwardArgs a{k2::ptr<const float>(dq), k2::ptr<const float>(dk), k2::ptr<const float>(dv),
                                   k2::ptr<const float>(cos), k2::ptr<const float>(sin), T, H, P, R, V,
                                   k2::ptr<float>(dqi), k2::ptr<float>(dkvi), k2::ptr<float>(dkri)};
        pybind11::gil_scoped_release nogil;
        k2::rope_pack_bwd_cpu(a);
      },
      "(dq, dk, dv, cos, sin, T, H, P, R, V, dq_in, dkv_in, dk_rope_in): fp32, contiguous");
}
