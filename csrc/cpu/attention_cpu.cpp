// CPU (OpenMP) fused attention with per-head max logit: FlashAttention-2's blocked online softmax
// with the block products in k2::sgemm (OpenBLAS at run time, one thread per call).
//
// Forward: one work item per (sequence, head, query block), largest first; no score matrix
// beyond one [BQ, BK] block per thread, so memory is linear in sequence length. The running row
// max of the online softmax is the row's max logit once all keys are seen, so the per-head max
// costs one comparison per row.
// Backward: one work item per (sequence, head), walking key blocks outside and query blocks
// inside, so dK/dV of a key block and dQ of the whole sequence are private to the item (no
// atomics, deterministic). P is recomputed from the saved LSE.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "k2/attention.h"
#include "k2/blas.h"
#include "k2/cpu_math.h"
#include "k2/cpu_rows.h"
#include "k2/threads.h"

namespace k2 {
namespace {

// Block sizes (rows). Forward: query blocks of kFQ against key blocks of kFK; backward: key
// blocks of kBK (outer) against query blocks of kBQ (inner). Larger blocks mean fewer BLAS
// re-packs of the same operand; smaller ones less wasted work on the causal diagonal. Chosen by
// a sweep at T = 2048, H = 8, Dk = 192, Dv = 128 (32..512): forward 128x256 and backward
// 128x128 were within noise of the best, 64x64 was 15% slower.
// Short sequences take 64-row blocks: a causal block on the diagonal computes twice the pairs it
// keeps, which at S = 256 with 128-row blocks is 1.5x the needed work (measured at B = 4, S = 256,
// H = 4: forward 3.9 -> 3.3 ms, backward 9.2 -> 9.0 ms; at S = 2048 64-row blocks cost ~8%).
// With the forward's probabilities kept (sequences <= kProbsMaxSeqlen) the backward no longer
// recomputes q k^T, and 32-row blocks, wasting less of the diagonal, won: forward + backward at
// B = 4, S = 256, H = 4 went 10.1 -> 9.4 ms per layer (median of 55, interleaved builds).
constexpr int64_t kFQ = 128, kFK = 256, kBQ = 128, kBK = 128, kSmallBlock = 64, kShortSeq = 512;
constexpr int64_t kKeptProbsBlock = 32;
static_assert(kProbsMaxSeqlen <= kFK, "kept probabilities need one forward key block per query block");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp of a softmax argument (<= 0 here: logit - running max); exactly 0 for masked (-inf) and
// negligible (< -87) entries, so a masked pair never contributes.
inline float softmax_exp(float x) { return x < -87.0f ? 0.0f : exp_poly(x); }

K2_ISA_CLONES float row_max(const float* s, int64_t n, float init) {
  float mx = init;
#pragma omp simd reduction(max : mx)
  for (int64_t c = 0; c < n; ++c) mx = s[c] > mx ? s[c] : mx;
  return mx;
}

// s = exp(s - mx) in place; returns the sum.
K2_ISA_CLONES float exp_sub_sum(float* s, int64_t n, float mx) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < n; ++c) {
    const float e = softmax_exp(s[c] - mx);
    s[c] = e;
    sum += e;
  }
  return sum;
}

K2_ISA_CLONES void exp_sub(float* s, int64_t n, float lse) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) s[c] = softmax_exp(s[c] - lse);
}

// ds = p * (ds - delta)
K2_ISA_CLONES void softmax_grad_row(float* ds, const float* p, int64_t n, float delta) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) ds[c] = p[c] * (ds[c] - delta);
}

// Causal mask of a score block whose rows are queries qpos.. and columns keys kpos..: query
// qpos + r may see key kpos + c iff kpos + c <= qpos + r; the rest become -inf.
inline void mask_block(float* S, int64_t ld, int64_t nq, int64_t nk, int64_t qpos, int64_t kpos) {
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t first_masked = std::max<int64_t>(0, qpos + r - kpos + 1);
    for (int64_t c = first_masked; c < nk; ++c) S[r * ld + c] = kNegInf;
  }
}

void check_cu_seqlens(const int32_t* cu, int64_t B, int64_t T, int64_t max_seqlen) {
  K2_CHECK(cu[0] == 0, "mla_attention: cu_seqlens[0] must be 0, got " + std::to_string(cu[0]));
  for (int64_t b = 0; b < B; ++b) {
    K2_CHECK(cu[b + 1] >= cu[b], "mla_attention: cu_seqlens must be non-decreasing (index " + std::to_string(b + 1) + ")");
    K2_CHECK(cu[b + 1] - cu[b] <= max_seqlen, "mla_attention: sequence " + std::to_string(b) + " has length " +
                                                 std::to_string(cu[b + 1] - cu[b]) + " > max_seqlen " +
                                                 std::to_string(max_seqlen));
  }
  K2_CHECK(cu[B] == T, "mla_attention: cu_seqlens[-1] = " + std::to_string(cu[B]) + " must equal the token count " +
                           std::to_string(T));
}

struct Item {
  int64_t b, h, q0, nq;
  int64_t cost;
};

}  // namespace

void validate(const AttentionArgs& a) {
  K2_CHECK(a.dtype == DType::kFloat32 || a.dtype == DType::kBFloat16,
           std::string("mla_attention: dtype must be float32 or bfloat16, got ") + dtype_name(a.dtype));
  K2_CHECK(a.T >= 0 && a.B >= 0 && a.H >= 1, "mla_attention: need T >= 0, B >= 0, H >= 1");
  K2_CHECK(a.Dk >= 1 && a.Dv >= 1, "mla_attention: head dims must be >= 1");
  K2_CHECK(a.max_seqlen >= 0, "mla_attention: max_seqlen must be >= 0");
  K2_CHECK(a.T == 0 || (a.q && a.k && a.v && a.out && a.lse), "mla_attention: null tensor pointer");
  K2_CHECK(a.cu_seqlens != nullptr, "mla_attention: null cu_seqlens pointer");
}

void validate(const AttentionBackwardArgs& a) {
  K2_CHECK(a.dtype == DType::kFloat32 || a.dtype == DType::kBFloat16,
           std::string("mla_attention_backward: dtype must be float32 or bfloat16, got ") + dtype_name(a.dtype));
  K2_CHECK(a.T >= 0 && a.B >= 0 && a.H >= 1, "mla_attention_backward: need T >= 0, B >= 0, H >= 1");
  K2_CHECK(a.Dk >= 1 && a.Dv >= 1, "mla_attention_backward: head dims must be >= 1");
  K2_CHECK(a.T == 0 || (a.q && a.k && a.v && a.out && a.dout && a.lse && a.dq && a.dk && a.dv),
           "mla_attention_backward: null tensor pointer");
  K2_CHECK(a.cu_seqlens != nullptr, "mla_attention_backward: null cu_seqlens pointer");
}

void mla_attention_fwd_cpu(const AttentionArgs& a) {
  validate(a);
  K2_CHECK(a.dtype == DType::kFloat32, "mla_attention (CPU kernel): float32 only; the Python side converts bf16");
  check_cu_seqlens(a.cu_seqlens, a.B, a.T, a.max_seqlen);
  K2_CHECK(a.probs == nullptr || (a.max_seqlen <= kProbsMaxSeqlen && a.probs_ld >= a.max_seqlen),
           "mla_attention: keeping the probabilities needs max_seqlen <= " + std::to_string(kProbsMaxSeqlen) +
               " and probs_ld >= max_seqlen");
  const int64_t H = a.H, Dk = a.Dk, Dv = a.Dv, T = a.T;
  const float* q = static_cast<const float*>(a.q);
  const float* k = static_cast<const float*>(a.k);
  const float* v = static_cast<const float*>(a.v);
  float* out = static_cast<float*>(a.out);
  for (int64_t h = 0; a.max_logit != nullptr && h < H; ++h) a.max_logit[h] = kNegInf;

  std::vector<Item> items;
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t s0 = a.cu_seqlens[b], L = a.cu_seqlens[b + 1] - s0;
    const int64_t bq = a.probs != nullptr ? kKeptProbsBlock : L <= kShortSeq ? kSmallBlock : kFQ;
    for (int64_t i0 = 0; i0 < L; i0 += bq)
      for (int64_t h = 0; h < H; ++h)
        items.push_back({b, h, s0 + i0, std::min(bq, L - i0), a.causal ? i0 + bq : L});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t n_items = int64_t(items.size());

#pragma omp parallel num_threads(num_threads())
  {
    std::vector<float> S(kFQ * kFK), acc(kFQ * Dv), m(kFQ), l(kFQ);
    std::vector<float> head_max(H, kNegInf);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[it];
      const int64_t s0 = a.cu_seqlens[w.b], s1 = a.cu_seqlens[w.b + 1];
      const int64_t nq = w.nq, q0 = w.q0;
      const float* Q = q + (q0 * H + w.h) * Dk;
      std::fill(m.begin(), m.begin() + nq, kNegInf);
      std::fill(l.begin(), l.begin() + nq, 0.0f);
      std::fill(acc.begin(), acc.begin() + nq * Dv, 0.0f);
      const int64_t k_end = a.causal ? q0 + nq : s1;
      for (int64_t k0 = s0; k0 < k_end; k0 += kFK) {
        const int64_t nk = std::min(kFK, k_end - k0);
        sgemm(false, true, nq, nk, Dk, a.scale, Q, H * Dk, k + (k0 * H + w.h) * Dk, H * Dk, 0.0f, S.data(), kFK);
        if (a.causal && k0 + nk - 1 > q0) mask_block(S.data(), kFK, nq, nk, q0, k0);
        for (int64_t r = 0; r < nq; ++r) {
          float* s = &S[r * kFK];
          // finite after the first key block: every query sees at least its sequence's first key
          const float mx = row_max(s, nk, m[r]);
          const float alpha = softmax_exp(m[r] - mx);
          l[r] = l[r] * alpha + exp_sub_sum(s, nk, mx);
          m[r] = mx;
          if (alpha != 1.0f) scale_row(&acc[r * Dv], &acc[r * Dv], Dv, alpha);
        }
        sgemm(false, false, nq, Dv, nk, 1.0f, S.data(), kFK, v + (k0 * H + w.h) * Dv, H * Dv, 1.0f, acc.data(), Dv);
        if (a.probs != nullptr) {  // one key block (max_seqlen <= kFK): the final probabilities are S / l
          for (int64_t r = 0; r < nq; ++r) {
            float* row = a.probs + (w.h * T + q0 + r) * a.probs_ld;
            scale_row(row, &S[r * kFK], nk, 1.0f / l[r]);
            std::fill(row + nk, row + a.probs_ld, 0.0f);  // later keys and past the sequence: 0
          }
        }
      }
      for (int64_t r = 0; r < nq; ++r) {
        const int64_t t = q0 + r;
        scale_row(out + (t * H + w.h) * Dv, &acc[r * Dv], Dv, 1.0f / l[r]);
        a.lse[w.h * T + t] = m[r] + std::log(l[r]);
        head_max[w.h] = m[r] > head_max[w.h] ? m[r] : head_max[w.h];
      }
    }
#pragma omp critical(k2_attention_max)
    for (int64_t h = 0; a.max_logit != nullptr && h < H; ++h) a.max_logit[h] = std::fmax(a.max_logit[h], head_max[h]);
  }
}

void mla_attention_bwd_cpu(const AttentionBackwardArgs& a) {
  validate(a);
  K2_CHECK(a.dtype == DType::kFloat32, "mla_attention_backward (CPU kernel): float32 only");
  check_cu_seqlens(a.cu_seqlens, a.B, a.T, a.max_seqlen);
  K2_CHECK(a.probs == nullptr || (a.max_seqlen <= kProbsMaxSeqlen && a.probs_ld >= a.max_seqlen),
           "mla_attention_backward: kept probabilities need max_seqlen <= " + std::to_string(kProbsMaxSeqlen));
  const int64_t H = a.H, Dk = a.Dk, Dv = a.Dv, T = a.T;
  const float* q = static_cast<const float*>(a.q);
  const float* k = static_cast<const float*>(a.k);
  const float* v = static_cast<const float*>(a.v);
  const float* o = static_cast<const float*>(a.out);
  const float* dO = static_cast<const float*>(a.dout);
  float* dq = static_cast<float*>(a.dq);
  float* dk = static_cast<float*>(a.dk);
  float* dv = static_cast<float*>(a.dv);

  std::vector<Item> items;  // (sequence, head), longest first
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t L = a.cu_seqlens[b + 1] - a.cu_seqlens[b];
    for (int64_t h = 0; h < H && L > 0; ++h) items.push_back({b, h, a.cu_seqlens[b], L, L});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t n_items = int64_t(items.size());

#pragma omp parallel num_threads(num_threads())
  {
    std::vector<float> P(kBQ * kBK), dP(kBQ * kBK), delta;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[it];
      const int64_t s0 = w.q0, L = w.nq, h = w.h;
      // delta_t = dot(dout_t, out_t): the softmax backward's row term
      delta.assign(L, 0.0f);
      for (int64_t t = 0; t < L; ++t) {
        delta[t] = dot_row(dO + ((s0 + t) * H + h) * Dv, o + ((s0 + t) * H + h) * Dv, Dv);
      }
      for (int64_t t = 0; t < L; ++t) {  // zero this item's rows of dq, dk, dv
        std::fill_n(dq + ((s0 + t) * H + h) * Dk, Dk, 0.0f);
        std::fill_n(dk + ((s0 + t) * H + h) * Dk, Dk, 0.0f);
        std::fill_n(dv + ((s0 + t) * H + h) * Dv, Dv, 0.0f);
      }
      const int64_t small = a.probs != nullptr ? kKeptProbsBlock : kSmallBlock;
      const int64_t bk = L <= kShortSeq ? small : kBK, bq = L <= kShortSeq ? small : kBQ;
      for (int64_t j0 = 0; j0 < L; j0 += bk) {
        const int64_t nk = std::min(bk, L - j0), k0 = s0 + j0;
        const float* Kj = k + (k0 * H + h) * Dk;
        const float* Vj = v + (k0 * H + h) * Dv;
        float* dKj = dk + (k0 * H + h) * Dk;
        float* dVj = dv + (k0 * H + h) * Dv;
        for (int64_t i0 = a.causal ? (j0 / bq) * bq : 0; i0 < L; i0 += bq) {
          const int64_t nq = std::min(bq, L - i0), q0 = s0 + i0;
          const float* Qi = q + (q0 * H + h) * Dk;
          const float* dOi = dO + (q0 * H + h) * Dv;
          // P: the forward's kept probabilities, or recomputed from q k^T and the saved LSE
          const float* Pb = P.data();
          int64_t ldp = kBK;
          if (a.probs != nullptr) {
            Pb = a.probs + (h * T + q0) * a.probs_ld + j0;
            ldp = a.probs_ld;
          } else {
            sgemm(false, true, nq, nk, Dk, a.scale, Qi, H * Dk, Kj, H * Dk, 0.0f, P.data(), kBK);
            if (a.causal && k0 + nk - 1 > q0) mask_block(P.data(), kBK, nq, nk, q0, k0);
            for (int64_t r = 0; r < nq; ++r) exp_sub(&P[r * kBK], nk, a.lse[h * T + q0 + r]);
          }
          sgemm(true, false, nk, Dv, nq, 1.0f, Pb, ldp, dOi, H * Dv, 1.0f, dVj, H * Dv);  // dV += P^T dO
          sgemm(false, true, nq, nk, Dv, 1.0f, dOi, H * Dv, Vj, H * Dv, 0.0f, dP.data(), kBK);  // dP = dO V^T
          for (int64_t r = 0; r < nq; ++r)  // dS = P * (dP - delta), kept in dP
            softmax_grad_row(&dP[r * kBK], Pb + r * ldp, nk, delta[i0 + r]);
          sgemm(true, false, nk, Dk, nq, a.scale, dP.data(), kBK, Qi, H * Dk, 1.0f, dKj, H * Dk);  // dK += s dS^T Q
          sgemm(false, false, nq, Dk, nk, a.scale, dP.data(), kBK, Kj, H * Dk, 1.0f, dq + (q0 * H + h) * Dk,
                H * Dk);  // dQ += s dS K
        }
      }
    }
  }
}

}  // namespace k2
