// MLA decode attention over the paged latent cache on CPU (see k2/mla_decode.h).
// One sequence per OpenMP iteration: for each block of its table, the scores of the block's rows
// for every head (tiles of 4 heads x 4 rows), then an online-softmax update of the H accumulators
// with the same rows while they are in cache (each row chunk loaded once for 4 heads). The engine's PyTorch
// path gathered every sequence's rows into a padded copy per layer and step and read it twice.
#include <cmath>
#include <limits>
#include <vector>

#include "k2/bind.h"
#include "k2/blas.h"
#include "k2/common.h"
#include "k2/cpu_math.h"
#include "k2/mla_decode.h"
#include "k2/threads.h"

namespace k2 {
namespace {

// Tiles of 4 heads x 4 rows: each loaded chunk of a row serves 4 heads and each chunk of a query 4
// rows (16 accumulators in registers). Out-of-range heads and rows repeat the last one and are
// not stored, so no load leaves the arrays.
constexpr int kT = 4;
// From this many heads on (with OpenBLAS attached) a block's two products go to the BLAS: at K2's
// 64 heads they are compute-bound GEMMs, which the tiles above run at half its speed.
constexpr int64_t kGemmHeads = 16;

// s[h * ld + r] = scale * q[h] . row_r for heads [0, H) and rows [0, nrows) of `blk`.
K2_ISA_CLONES void block_scores(const float* q, const float* blk, int64_t H, int64_t nrows, int64_t K, float scale,
                                float* s, int64_t ld) {
  const int64_t K8 = K / 8 * 8;
  for (int64_t h0 = 0; h0 < H; h0 += kT) {
    const float* qh[kT];
    for (int h = 0; h < kT; ++h) qh[h] = q + std::min<int64_t>(h0 + h, H - 1) * K;
    for (int64_t r0 = 0; r0 < nrows; r0 += kT) {
      const float* rr[kT];
      for (int r = 0; r < kT; ++r) rr[r] = blk + std::min<int64_t>(r0 + r, nrows - 1) * K;
      v8f acc[kT][kT] = {};
      for (int64_t k = 0; k < K8; k += 8) {
        v8f rv[kT], qv[kT];
        for (int r = 0; r < kT; ++r) rv[r] = load8(rr[r] + k);
        for (int h = 0; h < kT; ++h) qv[h] = load8(qh[h] + k);
        for (int h = 0; h < kT; ++h)
          for (int r = 0; r < kT; ++r) acc[h][r] += qv[h] * rv[r];
      }
      for (int h = 0; h < kT && h0 + h < H; ++h)
        for (int r = 0; r < kT && r0 + r < nrows; ++r) {
          float v = hsum8(acc[h][r]);
          for (int64_t k = K8; k < K; ++k) v += qh[h][k] * rr[r][k];
          s[(h0 + h) * ld + r0 + r] = scale * v;
        }
    }
  }
}

// acc[h] = acc[h] * alpha[h] + sum_r p[h * ld + r] * row_r[:C] for heads [0, H).
K2_ISA_CLONES void block_accumulate(float* acc, const float* alpha, const float* p, int64_t ld, const float* blk,
                                    int64_t H, int64_t nrows, int64_t K, int64_t C) {
  const int64_t C8 = C / 8 * 8;
  for (int64_t h0 = 0; h0 < H; h0 += kT) {
    const int hn = int(std::min<int64_t>(kT, H - h0));
    for (int64_t c = 0; c < C8; c += 8) {
      v8f a[kT];
      for (int h = 0; h < hn; ++h) a[h] = load8(acc + (h0 + h) * C + c) * alpha[h0 + h];
      for (int64_t r = 0; r < nrows; ++r) {
        const v8f rv = load8(blk + r * K + c);
        for (int h = 0; h < hn; ++h) a[h] += rv * p[(h0 + h) * ld + r];
      }
      for (int h = 0; h < hn; ++h) store8(acc + (h0 + h) * C + c, a[h]);
    }
    for (int64_t c = C8; c < C; ++c)
      for (int h = 0; h < hn; ++h) {
        float v = acc[(h0 + h) * C + c] * alpha[h0 + h];
        for (int64_t r = 0; r < nrows; ++r) v += p[(h0 + h) * ld + r] * blk[r * K + c];
        acc[(h0 + h) * C + c] = v;
      }
  }
}

void load_rows(const MlaDecodeArgs& a, int64_t block, int64_t rows, float* dst) {
  const int64_t K = a.K, base = block * a.B * K;
  if (a.cache_dtype == DType::kFloat32) {
    const float* src = static_cast<const float*>(a.cache) + base;
    std::memcpy(dst, src, size_t(rows * K) * sizeof(float));
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(a.cache) + base;
  for (int64_t i = 0; i < rows * K; ++i) dst[i] = bf16_to_f32(src[i]);
}

void one_sequence(const MlaDecodeArgs& a, int64_t i, float* rows, float* scores, float* acc, float* mx,
                  float* l, float* alpha) {
  const int64_t H = a.H, K = a.K, C = a.C, B = a.B, len = a.lens[i];
  const float* q = a.q + i * H * K;
  for (int64_t h = 0; h < H; ++h) {
    mx[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.0f;
  }
  std::fill(acc, acc + H * C, 0.0f);
  for (int64_t m = 0; m * B < len; ++m) {
    const int64_t nrows = std::min(B, len - m * B);
    const bool direct = a.cache_dtype == DType::kFloat32;
    const float* blk = direct ? static_cast<const float*>(a.cache) + a.table[i * a.M + m] * B * K : rows;
    if (!direct) load_rows(a, a.table[i * a.M + m], nrows, rows);
    const bool gemm = H >= kGemmHeads && has_external_blas();
    if (gemm)  // many heads: the block is a GEMM [H, K] x [K, nrows]
      sgemm(false, true, H, nrows, K, a.scale, q, K, blk, K, 0.0f, scores, B);
    else
      block_scores(q, blk, H, nrows, K, a.scale, scores, B);
    for (int64_t h = 0; h < H; ++h) {  // online softmax: the block's probabilities, in place
      float bmax = mx[h];
      for (int64_t r = 0; r < nrows; ++r) bmax = std::max(bmax, scores[h * B + r]);
      alpha[h] = std::exp(mx[h] - bmax);  // 0 on the first block (mx = -inf)
      float sum = 0.0f;
      for (int64_t r = 0; r < nrows; ++r) sum += scores[h * B + r] = std::exp(scores[h * B + r] - bmax);
      l[h] = l[h] * alpha[h] + sum;
      mx[h] = bmax;
    }
    if (gemm) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t c = 0; c < C; ++c) acc[h * C + c] *= alpha[h];
      sgemm(false, false, H, C, nrows, 1.0f, scores, B, blk, K, 1.0f, acc, C);
    } else {
      block_accumulate(acc, alpha, scores, B, blk, H, nrows, K, C);
    }
  }
  float* out = a.out + i * H * C;
  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.0f / l[h];
    for (int64_t c = 0; c < C; ++c) out[h * C + c] = acc[h * C + c] * inv;
  }
}

}  // namespace

void mla_decode_paged_cpu(const MlaDecodeArgs& a) {
  K2_CHECK(a.n >= 0 && a.H >= 1 && a.B >= 1 && a.M >= 1 && a.NB >= 1, "mla_decode_paged: bad sizes");
  K2_CHECK(a.C >= 1 && a.C <= a.K, "mla_decode_paged: need 1 <= C <= K");
  K2_CHECK(a.cache_dtype == DType::kFloat32 || a.cache_dtype == DType::kBFloat16,
           std::string("mla_decode_paged: cache must be float32 or bfloat16, got ") + dtype_name(a.cache_dtype));
  for (int64_t i = 0; i < a.n; ++i) {
    K2_CHECK(a.lens[i] >= 1 && a.lens[i] <= a.M * a.B,
             "mla_decode_paged: sequence " + std::to_string(i) + " has length " + std::to_string(a.lens[i]) +
                 ", expected 1.." + std::to_string(a.M * a.B));
    for (int64_t m = 0; m * a.B < a.lens[i]; ++m) {
      const int64_t b = a.table[i * a.M + m];
      K2_CHECK(b >= 0 && b < a.NB, "mla_decode_paged: sequence " + std::to_string(i) + " names block " +
                                       std::to_string(b) + " of a pool of " + std::to_string(a.NB));
    }
  }
  const int threads = num_threads();
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> rows(size_t(a.B * a.K)), scores(size_t(a.H * a.B)), acc(size_t(a.H * a.C));
    std::vector<float> mx(size_t(a.H)), l(size_t(a.H)), alpha(size_t(a.H));
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < a.n; ++i)
      one_sequence(a, i, rows.data(), scores.data(), acc.data(), mx.data(), l.data(), alpha.data());
  }
}

}  // namespace k2

K2_BINDINGS(mla_decode_cpu) {
  m.def(
      "mla_decode_paged_cpu",
      [](uintptr_t q, uintptr_t cache, int cache_dtype, uintptr_t table, uintptr_t lens, int64_t n, int64_t H,
         int64_t K, int64_t C, int64_t NB, int64_t B, int64_t M, double scale, uintptr_t out) {
        k2::MlaDecodeArgs a{k2::ptr<const float>(q), k2::ptr<const void>(cache), k2::DType(cache_dtype),
                            k2::ptr<const int64_t>(table), k2::ptr<const int64_t>(lens), n, H, K, C, NB, B, M,
                            float(scale), k2::ptr<float>(out)};
        pybind11::gil_scoped_release nogil;
        k2::mla_decode_paged_cpu(a);
      },
      "(q fp32 [n,H,K], cache [NB,B,K], cache_dtype, table int64 [n,M], lens int64 [n], n, H, K, C, NB, B, M, "
      "scale, out fp32 [n,H,C])");
}
