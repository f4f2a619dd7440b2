// CPU (OpenMP) MoE kernels: routing, permute (stable counting sort), unpermute (gather).
// Shape legend: T tokens, E experts, K experts per token, G groups, D hidden, N = T * K.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "k2/cpu_math.h"
#include "k2/cpu_rows.h"
#include "k2/moe.h"

namespace k2 {
namespace {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Strictly better: larger value, ties to the lower index (deterministic).
inline bool better(float v, int64_t i, float bv, int64_t bi) { return v > bv || (v == bv && i < bi); }

// Indices of the k largest values of v[0..n) in descending order, ties to lower index.
void topk_desc(const float* v, int64_t n, int64_t k, int64_t* out, float* out_val) {
  int64_t filled = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i];
    if (filled == k && !better(x, i, out_val[k - 1], out[k - 1])) continue;
    int64_t j = filled < k ? filled++ : k - 1;  // insertion position search from the end
    while (j > 0 && better(x, i, out_val[j - 1], out[j - 1])) {
      out_val[j] = out_val[j - 1];
      out[j] = out[j - 1];
      --j;
    }
    out_val[j] = x;
    out[j] = i;
  }
}

// choice[e] = sigmoid(logit[e]) + bias[e] for fp32 logits, E at a time: the scalar loop's libm exp
// was most of the router's time. The same values as the scalar path up to exp's rounding (~1 ulp).
K2_ISA_CLONES void biased_scores(const float* logits, const float* bias, int64_t E, float* choice) {
  int64_t e = 0;
  const v8f one = v8f{} + 1.0f, lowest = v8f{} - FLT_MAX;
  for (; e + 8 <= E; e += 8) {
    const v8f c = one / (one + exp_poly(-load8(logits + e))) + load8(bias + e);
    store8(choice + e, c > lowest ? c : lowest);  // NaN compares false: -FLT_MAX, like fmax
  }
  for (; e < E; ++e) choice[e] = std::fmax(1.0f / (1.0f + exp_poly(-logits[e])) + bias[e], -FLT_MAX);
}

}  // namespace

void moe_route_backward_cpu(const RouteBackwardArgs& a) {
  K2_CHECK(a.T >= 0 && a.E >= 1 && a.K >= 1 && a.K <= a.E, "moe_route_backward: need T >= 0 and 1 <= K <= E");
  const int64_t E = a.E, K = a.K;
  const float c = a.routed_scaling_factor;
  for (int64_t i = 0; i < a.T * K; ++i)  // checked before the parallel loop (no throwing inside it)
    K2_CHECK(a.topk_idx[i] >= 0 && a.topk_idx[i] < E,
             "moe_route_backward: topk_idx[" + std::to_string(i / K) + ", " + std::to_string(i % K) + "] = " +
                 std::to_string(a.topk_idx[i]) + " is outside [0, " + std::to_string(E) + ")");
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < a.T; ++t) {
    const float* logits = a.logits + t * a.logits_row_stride;
    const int64_t* idx = a.topk_idx + t * K;
    const float* g = a.grad_weight + t * K;
    float* out = a.grad_logits + t * E;
    std::fill(out, out + E, 0.0f);
    float sum = 0.0f, gs = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float s = sigmoid(logits[idx[k]]);
      sum += s;
      gs += g[k] * s;
    }
    const float denom = sum + 1e-20f, dot = gs / denom;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = idx[k];
      const float s = sigmoid(logits[e]);
      const float ds = a.norm_topk_prob ? c * (g[k] - dot) / denom : c * g[k];
      out[e] = ds * s * (1.0f - s);
    }
  }
}

void moe_route_cpu(const RouteArgs& a) {
  validate(a);
  const int64_t T = a.T, E = a.E, K = a.K, G = a.n_group;
  const int64_t gsize = E / G;
  std::vector<float> bias(E, 0.0f);
  for (int64_t e = 0; a.bias != nullptr && e < E; ++e) bias[e] = load_f32(a.bias, a.bias_dtype, e);

#pragma omp parallel
  {
    std::vector<float> choice_E(E), group_G(G), gval(G), kval(K);
    std::vector<int64_t> gidx(G), kidx(K);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = t * a.logits_row_stride;
      if (a.logits_dtype == DType::kFloat32) {
        biased_scores(static_cast<const float*>(a.logits) + row, bias.data(), E, choice_E.data());
      } else {
        for (int64_t e = 0; e < E; ++e) {
          // NaN/-inf choices become -FLT_MAX: never preferred, always finite (same as the CUDA kernel).
          const float c = sigmoid(load_f32(a.logits, a.logits_dtype, row + e)) + bias[e];
          choice_E[e] = std::fmax(c, -FLT_MAX);
        }
      }
      if (G > 1) {
        // Group score: sum of the group's two best biased scores; keep the topk_group best groups.
        for (int64_t g = 0; g < G; ++g) {
          float m1 = -FLT_MAX, m2 = -FLT_MAX;
          for (int64_t e = g * gsize; e < (g + 1) * gsize; ++e) {
            const float c = choice_E[e];
            if (c > m1) { m2 = m1; m1 = c; } else if (c > m2) { m2 = c; }
          }
          group_G[g] = std::fmax(m1 + m2, -FLT_MAX);
        }
        topk_desc(group_G.data(), G, a.topk_group, gidx.data(), gval.data());
        std::vector<char> keep(G, 0);
        for (int64_t j = 0; j < a.topk_group; ++j) keep[gidx[j]] = 1;
        for (int64_t g = 0; g < G; ++g)
          if (!keep[g]) std::fill(choice_E.begin() + g * gsize, choice_E.begin() + (g + 1) * gsize, 0.0f);
      }
      topk_desc(choice_E.data(), E, K, kidx.data(), kval.data());
      // Weights from the unbiased scores of the chosen experts.
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        kval[k] = sigmoid(load_f32(a.logits, a.logits_dtype, row + kidx[k]));
        sum += kval[k];
      }
      const float denom = sum + 1e-20f;
      for (int64_t k = 0; k < K; ++k) {
        const float w = a.norm_topk_prob ? kval[k] / denom : kval[k];
        a.topk_idx[t * K + k] = kidx[k];
        a.topk_weight[t * K + k] = w * a.routed_scaling_factor;
      }
    }
  }
}

void moe_permute_cpu(const PermuteArgs& a) {
  validate(a);
  const int64_t N = a.T * a.K, E = a.E;
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = load_index(a.topk_idx, a.idx_dtype, i);
    K2_CHECK(e >= 0 && e < E, "moe_permute: topk_idx[" + std::to_string(i / a.K) + ", " + std::to_string(i % a.K) +
                                  "] = " + std::to_string(e) + " is outside [0, num_experts=" + std::to_string(E) + ")");
    ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    a.counts[e] = int32_t(start[e + 1]);
    start[e + 1] += start[e];
    a.offsets[e] = int32_t(start[e + 1]);
  }
  // Stable placement: scanning slots in order keeps (token, slot) order within each expert.
  for (int64_t i = 0; i < N; ++i) a.row_to_slot[start[load_index(a.topk_idx, a.idx_dtype, i)]++] = i;

  const int64_t row_bytes = a.D * a.elem_bytes, K = a.K;
  const char* x = static_cast<const char*>(a.x);
  char* out = static_cast<char*>(a.x_out);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(out + n * row_bytes, x + (a.row_to_slot[n] / K) * a.x_row_stride * a.elem_bytes, size_t(row_bytes));
}

namespace {

// Typed element access for the unpermute inner loop (bf16 and fp16 are both 16-bit words).
struct BF16 { uint16_t v; };
struct F16 { uint16_t v; };
inline float to_f32(float x) { return x; }
inline float to_f32(BF16 x) { return bf16_to_f32(x.v); }
inline float to_f32(F16 x) { return f16_to_f32(x.v); }
inline void from_f32(float x, float* o) { *o = x; }
inline void from_f32(float x, BF16* o) { o->v = f32_to_bf16(x); }
inline void from_f32(float x, F16* o) { o->v = f32_to_f16(x); }

template <typename Y>
void unpermute_impl(const UnpermuteArgs& a, const std::vector<int32_t>& slot_to_row) {
  const int64_t T = a.T, K = a.K, D = a.D;
  const Y* y = static_cast<const Y*>(a.y);
  Y* out = static_cast<Y*>(a.out);
#pragma omp parallel
  {
    std::vector<float> acc(D);
    std::vector<int32_t> rows(K);
    std::vector<float> w(K);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      // Add the K rows in row order, as the reference's index_add does: bit-identical sums.
      for (int64_t k = 0; k < K; ++k) {
        int64_t j = k;
        const int32_t r = slot_to_row[t * K + k];
        const float wk = load_f32(a.weight, a.weight_dtype, t * K + k);
        while (j > 0 && rows[j - 1] > r) { rows[j] = rows[j - 1]; w[j] = w[j - 1]; --j; }
        rows[j] = r;
        w[j] = wk;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const Y* yr = y + int64_t(rows[k]) * a.y_row_stride;
        const float wk = w[k];
        if constexpr (std::is_same_v<Y, float>) {
          scaled_add_row(acc.data(), yr, D, wk);  // product rounded, then added
          continue;
        }
        for (int64_t d = 0; d < D; ++d) {
          const float p = wk * to_f32(yr[d]);  // product rounded, then added (no contraction)
          acc[d] += p;
        }
      }
      if constexpr (std::is_same_v<Y, float>)
        std::memcpy(out + t * D, acc.data(), size_t(D) * sizeof(float));
      else
        for (int64_t d = 0; d < D; ++d) from_f32(acc[d], out + t * D + d);
    }
  }
}

}  // namespace

void moe_unpermute_cpu(const UnpermuteArgs& a) {
  validate(a);
  const int64_t N = a.T * a.K;
  std::vector<int32_t> slot_to_row(N, -1);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t s = a.row_to_slot[n];
    K2_CHECK(s >= 0 && s < N && slot_to_row[s] < 0,
             "moe_unpermute: row_to_slot is not a permutation of 0..T*K-1 (entry " + std::to_string(n) + " = " +
                 std::to_string(s) + ")");
    slot_to_row[s] = int32_t(n);
  }
  switch (a.y_dtype) {
    case DType::kFloat32: unpermute_impl<float>(a, slot_to_row); break;
    case DType::kBFloat16: unpermute_impl<BF16>(a, slot_to_row); break;
    default: unpermute_impl<F16>(a, slot_to_row); break;
  }
}

namespace {

template <typename Y>
void unpermute_backward_impl(const UnpermuteBackwardArgs& a) {
  const int64_t N = a.T * a.K, D = a.D;
  const Y* g = static_cast<const Y*>(a.grad_out);
  const Y* y = static_cast<const Y*>(a.y);
  Y* gy = static_cast<Y*>(a.grad_y);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t s = a.row_to_slot[n];
    const Y* gr = g + (s / a.K) * a.grad_row_stride;
    const Y* yr = y + n * a.y_row_stride;
    if (gy != nullptr) {
      const float w = load_f32(a.weight, a.weight_dtype, s);
      if constexpr (std::is_same_v<Y, float>)
        scale_row(gy + n * D, gr, D, w);
      else
        for (int64_t d = 0; d < D; ++d) from_f32(w * to_f32(gr[d]), gy + n * D + d);
    }
    if (a.grad_weight != nullptr) {
      // a SIMD reduction (lane-wise partial sums): the serial sum's add latency made this loop
      // the slowest part of the MoE token path; fp32 result within rounding of the serial order
      if constexpr (std::is_same_v<Y, float>) {
        a.grad_weight[s] = dot_row(gr, yr, D);
      } else {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += to_f32(gr[d]) * to_f32(yr[d]);
        a.grad_weight[s] = dot;
      }
    }
  }
}

}  // namespace

void moe_unpermute_backward_cpu(const UnpermuteBackwardArgs& a) {
  validate(a);
  const int64_t N = a.T * a.K;
  std::vector<char> seen(N, 0);
  for (int64_t n = 0; n < N; ++n) {  // the gradient w.r.t. w writes each slot once
    const int64_t s = a.row_to_slot[n];
    K2_CHECK(s >= 0 && s < N && !seen[s], "moe_unpermute_backward: row_to_slot is not a permutation of 0..T*K-1");
    seen[s] = 1;
  }
  switch (a.y_dtype) {
    case DType::kFloat32: unpermute_backward_impl<float>(a); break;
    case DType::kBFloat16: unpermute_backward_impl<BF16>(a); break;
    default: unpermute_backward_impl<F16>(a); break;
  }
}

}  // namespace k2
