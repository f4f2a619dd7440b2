// CPU grouped GEMM over experts: single-threaded k2::sgemm calls per (expert, block), OpenMP across them.
// Row-side products go through k2::sgemm_few_rows (column panels for OpenBLAS's small-matrix kernel).
// Shape legend: E experts, N grouped rows, K inner size, M output columns (see k2/grouped_gemm.h).
#include "k2/grouped_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "k2/blas.h"
#include "k2/cpu_math.h"
#include "k2/common.h"

namespace k2 {
namespace {

// One unit of work: expert e, the block [lo, hi) of the dimension that is split.
struct Task {
  int64_t e, lo, hi;
  double cost;
};

int resolve_threads(int requested) {
#ifdef _OPENMP
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

inline int64_t rows_of(const int32_t* offsets, int64_t e) { return offsets[e] - (e ? offsets[e - 1] : 0); }
inline int64_t start_of(const int32_t* offsets, int64_t e) { return e ? offsets[e - 1] : 0; }

// Splits each expert's extent[e] (rows, or output rows) into blocks so that no block costs more than
// about half of one thread's share: with 128 experts on 2 threads nothing is split, while one expert
// holding most rows is cut into pieces every thread can take. Blocks are multiples of `align` and
// come sorted by cost, largest first, for the dynamic schedule.
std::vector<Task> make_tasks(int64_t E, const std::vector<int64_t>& extent, const std::vector<double>& unit_cost,
                             int threads, int64_t align, bool keep_empty) {
  double total = 0.0;
  for (int64_t e = 0; e < E; ++e) total += double(extent[e]) * unit_cost[e];
  const double share = total / double(2 * std::max(threads, 1));
  std::vector<Task> tasks;
  tasks.reserve(size_t(E) + size_t(2 * threads));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = extent[e];
    const double cost = double(n) * unit_cost[e];
    if (cost <= 0.0) {
      if (keep_empty) tasks.push_back({e, 0, n, 0.0});
      continue;
    }
    int64_t pieces = threads > 1 && share > 0.0 ? int64_t(cost / share + 0.999) : 1;
    pieces = std::max<int64_t>(1, std::min(pieces, n / align));
    const int64_t step = (n / pieces + align - 1) / align * align;
    for (int64_t lo = 0; lo < n; lo += step) {
      const int64_t hi = std::min(n, lo + step);
      tasks.push_back({e, lo, hi, double(hi - lo) * unit_cost[e]});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

template <typename F>
void run_tasks(const std::vector<Task>& tasks, int threads, F&& body) {
  const int64_t n = int64_t(tasks.size());
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) body(tasks[size_t(i)]);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) body(tasks[size_t(i)]);
}

// h = silu(g) * u, as torch computes it: g / (1 + e^-g) * u.
template <typename T>
inline T swiglu(const T& g, const T& u) {
  return g / (1.0f + exp_poly(-g)) * u;
}

// h = silu(gate) * up for R rows of gate_up ([gate | up], row stride 2I).
K2_ISA_CLONES void swiglu_rows(const float* gu, int64_t R, int64_t I, float* h) {
  for (int64_t r = 0; r < R; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    float* hr = h + r * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) store8(hr + i, swiglu(load8(g + i), load8(u + i)));
    for (; i < I; ++i) hr[i] = swiglu(g[i], u[i]);
  }
}

// One element of the activation's backward: h = silu(g) u, d up = dh silu(g) and
// d gate = dh u s (1 + g (1 - s)) with s = sigmoid(g) (torch's silu_backward formula).
template <typename T>
inline void swiglu_backward(const T& g, const T& u, const T& d, T& h, T& dg, T& du) {
  const T s = 1.0f / (1.0f + exp_poly(-g));
  const T silu = g * s;
  h = silu * u;
  du = d * silu;
  dg = d * u * s * (1.0f + g * (1.0f - s));
}

// From dh (R x I, contiguous): h (R x I) and [d gate | d up] (R x 2I).
K2_ISA_CLONES void swiglu_backward_rows(const float* gu, const float* dh, int64_t R, int64_t I, float* h,
                                         float* dgu) {
  for (int64_t r = 0; r < R; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    const float* d = dh + r * I;
    float* hr = h + r * I;
    float* dg = dgu + r * 2 * I;
    float* du = dg + I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
      v8f hv, dgv, duv;
      swiglu_backward(load8(g + i), load8(u + i), load8(d + i), hv, dgv, duv);
      store8(hr + i, hv);
      store8(dg + i, dgv);
      store8(du + i, duv);
    }
    for (; i < I; ++i) swiglu_backward(g[i], u[i], d[i], hr[i], dg[i], du[i]);
  }
}

// Reads `rows` rows of `cols` floats (row stride ld) once, sequentially, so that they sit in this core's
// cache before the BLAS calls that use them. On this kind of machine an expert's operands come from
// memory (a layer's experts hold ~50 MB of weights), and OpenBLAS's packing reads them in a pattern
// the hardware prefetcher follows poorly: one streaming pass first, at full bandwidth, then
// cache-hot GEMMs took a 64-row expert's forward from 203 to 173 us and a 16-row one's from 99 to
// 75 us (single thread). Tried and not kept: software prefetches of the thread's next expert spread
// over the current one's GEMMs (better single-threaded, no gain with two threads sharing memory).
K2_ISA_CLONES void warm_rows(const float* p, int64_t rows, int64_t cols, int64_t ld) {
  v8f acc{};
  for (int64_t r = 0; r < rows; ++r) {
    const float* q = p + r * ld;
    for (int64_t c = 0; c + 8 <= cols; c += 16) acc += load8(q + c);  // one load per 64-byte line
  }
  static thread_local volatile float sink;  // keeps the loads
  sink = acc[0];
}

// An expert's three weight matrices into cache (its rows follow when they fit in kWarmBytes).
void warm_expert_weights(const SwigluWeights& w, int64_t e, int64_t I, int64_t D) {
  warm_rows(w.gate + e * w.gate_stride_e, I, D, w.gate_stride_r);
  warm_rows(w.up + e * w.up_stride_e, I, D, w.up_stride_r);
  warm_rows(w.down + e * w.down_stride_e, D, I, w.down_stride_r);
}

// Warm-up budget per expert (L2 is 1 MB per core here): rows beyond it are left where they are
// rather than evict the weights.
constexpr int64_t kWarmBytes = 768 * 1024;

// Per-thread scratch buffers (slot 0..3) that grow as needed and are kept across calls.
float* scratch(size_t n, int slot = 0) {
  thread_local std::vector<float> bufs[4];
  std::vector<float>& buf = bufs[slot];
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// dst[0, n) = src[0, n) with non-temporal stores: a weight gradient is written once and read only by
// the optimizer, so streaming it past the cache saves the read-for-ownership of every line (about 6%
// of the backward at issue 2's sizes, which move ~200 MB per layer). Other threads read it after the
// OpenMP barrier; the sfence orders the streaming stores before that.
void stream_copy(float* dst, const float* src, int64_t n) {
#if defined(__SSE2__)
  int64_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 15) != 0; ++i) dst[i] = src[i];
  for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
  _mm_sfence();
#else
  std::memcpy(dst, src, size_t(n) * sizeof(float));
#endif
}

}  // namespace

void check_group_offsets(const int32_t* offsets, int64_t E, int64_t N) {
  int64_t prev = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t o = offsets[e];
    K2_CHECK(o >= prev && o <= N, "grouped_mm: offsets must be non-decreasing and within [0, " + std::to_string(N) +
                                      "], got offsets[" + std::to_string(e) + "] = " + std::to_string(o) +
                                      " after " + std::to_string(prev));
    prev = o;
  }
}

void grouped_mm_cpu(const GroupedMmArgs& a) {
  K2_CHECK(a.w_stride_k == 1 || a.w_stride_m == 1, "grouped_mm: w needs a unit stride in its last two dims");
  check_group_offsets(a.offsets, a.E, a.N);
  const int threads = resolve_threads(a.num_threads);
  const bool trans_w = a.w_stride_m != 1;  // w[e] stored as [M, K] rows (a transposed view)
  const int64_t ldw = trans_w ? a.w_stride_m : a.w_stride_k;
  std::vector<int64_t> rows(size_t(a.E));
  std::vector<double> unit(size_t(a.E), 1.0);
  for (int64_t e = 0; e < a.E; ++e) rows[size_t(e)] = rows_of(a.offsets, e);
  const auto tasks = make_tasks(a.E, rows, unit, threads, 8, false);
  run_tasks(tasks, threads, [&](const Task& t) {
    const int64_t r0 = start_of(a.offsets, t.e) + t.lo;
    sgemm_few_rows(false, trans_w, t.hi - t.lo, a.M, a.K, 1.0f, a.x + r0 * a.x_row_stride, a.x_row_stride,
                   a.w + t.e * a.w_stride_e, ldw, 0.0f, a.y + r0 * a.y_row_stride, a.y_row_stride);
  });
  // Rows after the last group belong to no expert: defined as 0 (torch leaves them unset).
  for (int64_t r = a.E ? a.offsets[a.E - 1] : 0; r < a.N; ++r)
    std::memset(a.y + r * a.y_row_stride, 0, size_t(a.M) * sizeof(float));
}

void grouped_mm_wgrad_cpu(const GroupedWgradArgs& a) {
  check_group_offsets(a.offsets, a.E, a.N);
  const int threads = resolve_threads(a.num_threads);
  // Split the output rows of each block: K of x^T @ dy, or M of dy^T @ x when transposed.
  const int64_t out_rows = a.trans_out ? a.M : a.K, out_cols = a.trans_out ? a.K : a.M;
  std::vector<int64_t> extent(size_t(a.E), out_rows);
  std::vector<double> unit(size_t(a.E));
  for (int64_t e = 0; e < a.E; ++e) unit[size_t(e)] = double(rows_of(a.offsets, e));
  const auto tasks = make_tasks(a.E, extent, unit, threads, 16, true);
  // op(A) = A^T of the block's columns [lo, hi): rows of the output block, contracted over the rows.
  const float* lhs = a.trans_out ? a.dy : a.x;
  const float* rhs = a.trans_out ? a.x : a.dy;
  const int64_t ld_lhs = a.trans_out ? a.dy_row_stride : a.x_row_stride;
  const int64_t ld_rhs = a.trans_out ? a.x_row_stride : a.dy_row_stride;
  run_tasks(tasks, threads, [&](const Task& t) {
    const int64_t r0 = start_of(a.offsets, t.e), n = rows_of(a.offsets, t.e);
    float* out = a.dw + t.e * out_rows * out_cols + t.lo * out_cols;
    if (n == 0) {
      std::memset(out, 0, size_t(t.hi - t.lo) * size_t(out_cols) * sizeof(float));
      return;
    }
    sgemm(true, false, t.hi - t.lo, out_cols, n, 1.0f, lhs + r0 * ld_lhs + t.lo, ld_lhs, rhs + r0 * ld_rhs, ld_rhs,
          0.0f, out, out_cols);
  });
}

}  // namespace k2

namespace k2 {

void moe_swiglu_experts_cpu(const SwigluExpertsArgs& a) {
  check_group_offsets(a.offsets, a.E, a.N);
  const int threads = resolve_threads(a.num_threads);
  const int64_t D = a.D, I = a.I;
  const SwigluWeights& w = a.w;
  std::vector<int64_t> rows(size_t(a.E));
  std::vector<double> unit(size_t(a.E), 1.0);
  for (int64_t e = 0; e < a.E; ++e) rows[size_t(e)] = rows_of(a.offsets, e);
  const auto tasks = make_tasks(a.E, rows, unit, threads, 8, false);
  run_tasks(tasks, threads, [&](const Task& t) {
    const int64_t r0 = start_of(a.offsets, t.e) + t.lo, R = t.hi - t.lo;
    const float* x = a.x + r0 * a.x_row_stride;
    float* gu = a.gate_up + r0 * 2 * I;
    float* h = scratch(size_t(R * I));
    warm_expert_weights(w, t.e, I, D);
    if ((3 * I * D + R * D) * 4 <= kWarmBytes) warm_rows(x, R, D, a.x_row_stride);
    sgemm_few_rows(false, true, R, I, D, 1.0f, x, a.x_row_stride, w.gate + t.e * w.gate_stride_e, w.gate_stride_r,
                   0.0f, gu, 2 * I);
    sgemm_few_rows(false, true, R, I, D, 1.0f, x, a.x_row_stride, w.up + t.e * w.up_stride_e, w.up_stride_r, 0.0f,
                   gu + I, 2 * I);
    swiglu_rows(gu, R, I, h);
    sgemm_few_rows(false, true, R, D, I, 1.0f, h, I, w.down + t.e * w.down_stride_e, w.down_stride_r, 0.0f,
                   a.y + r0 * D, D);
  });
  const int64_t end = a.E ? a.offsets[a.E - 1] : 0;
  std::memset(a.y + end * D, 0, size_t(a.N - end) * size_t(D) * sizeof(float));
  std::memset(a.gate_up + end * 2 * I, 0, size_t(a.N - end) * size_t(2 * I) * sizeof(float));
}

void moe_swiglu_experts_backward_cpu(const SwigluExpertsBackwardArgs& a) {
  check_group_offsets(a.offsets, a.E, a.N);
  const int threads = resolve_threads(a.num_threads);
  const int64_t D = a.D, I = a.I;
  const SwigluWeights& w = a.w;
  const bool need_dw = a.dw_gate != nullptr;

  // Rows [r0, r0 + R) of expert e: dh = dy Wd, the activation's backward into h (ld I) and
  // dgu = [d gate | d up] (ld 2I), then dx = dg Wg + du Wu.
  auto rows_part = [&](int64_t e, int64_t r0, int64_t R, float* h, float* dgu) {
    float* dh = scratch(size_t(R * I), 0);
    warm_expert_weights(w, e, I, D);
    if ((3 * I * D + R * 2 * D + R * 2 * I) * 4 <= kWarmBytes) {
      warm_rows(a.dy + r0 * a.dy_row_stride, R, D, a.dy_row_stride);
      warm_rows(a.gate_up + r0 * 2 * I, R, 2 * I, 2 * I);
      warm_rows(a.x + r0 * a.x_row_stride, R, D, a.x_row_stride);
    }
    sgemm_few_rows(false, false, R, I, D, 1.0f, a.dy + r0 * a.dy_row_stride, a.dy_row_stride,
                   w.down + e * w.down_stride_e, w.down_stride_r, 0.0f, dh, I);
    swiglu_backward_rows(a.gate_up + r0 * 2 * I, dh, R, I, h, dgu);
    if (a.dx != nullptr) {
      sgemm_few_rows(false, false, R, D, I, 1.0f, dgu, 2 * I, w.gate + e * w.gate_stride_e, w.gate_stride_r, 0.0f,
                     a.dx + r0 * D, D);
      sgemm_few_rows(false, false, R, D, I, 1.0f, dgu + I, 2 * I, w.up + e * w.up_stride_e, w.up_stride_r, 1.0f,
                     a.dx + r0 * D, D);
    }
  };
  // Output rows [lo, hi) of one weight gradient of expert e (which: 0 down, 1 gate, 2 up) from all its
  // rows, whose h and dgu start at h_e and dgu_e.
  auto weight_part = [&](int64_t e, int which, int64_t lo, int64_t hi, const float* h_e, const float* dgu_e) {
    const int64_t r0 = start_of(a.offsets, e), R = rows_of(a.offsets, e);
    const int64_t cols = which == 0 ? I : D;
    float* out = (which == 0 ? a.dw_down : which == 1 ? a.dw_gate : a.dw_up) + e * D * I + lo * cols;
    if (R == 0) {
      std::memset(out, 0, size_t(hi - lo) * size_t(cols) * sizeof(float));
      return;
    }
    float* buf = scratch(size_t(hi - lo) * size_t(cols), 3);  // in cache, then streamed to `out`
    if (which == 0) {  // d down_e = dy_e^T h_e
      sgemm(true, false, hi - lo, I, R, 1.0f, a.dy + r0 * a.dy_row_stride + lo, a.dy_row_stride, h_e, I, 0.0f, buf,
            I);
    } else {  // d gate_e = dg_e^T x_e, d up_e = du_e^T x_e
      const float* dg = dgu_e + (which == 2 ? I : 0) + lo;
      sgemm(true, false, hi - lo, D, R, 1.0f, dg, 2 * I, a.x + r0 * a.x_row_stride, a.x_row_stride, 0.0f, buf, D);
    }
    stream_copy(out, buf, (hi - lo) * cols);
  };

  std::vector<int64_t> rows(size_t(a.E));
  std::vector<double> unit(size_t(a.E), 1.0);
  for (int64_t e = 0; e < a.E; ++e) rows[size_t(e)] = rows_of(a.offsets, e);
  const auto tasks = make_tasks(a.E, rows, unit, threads, 8, true);
  std::vector<int64_t> pieces(size_t(a.E), 0);
  for (const Task& t : tasks) ++pieces[size_t(t.e)];
  // An expert in one piece does everything in one task (its rows are still in cache for the weight
  // gradients); the pieces of a split expert do their rows, then its weight gradients are split by
  // output rows in a second pass.
  // A whole expert keeps h and dgu in this thread's scratch (in cache, never written to memory); the
  // pieces of a split expert write them to the caller's [N, I] and [N, 2I] buffers for the second pass.
  run_tasks(tasks, threads, [&](const Task& t) {
    const int64_t r0 = start_of(a.offsets, t.e) + t.lo, R = t.hi - t.lo;
    const bool whole = pieces[size_t(t.e)] == 1;
    float* h = whole ? scratch(size_t(R * I), 1) : a.h_scratch + r0 * I;
    float* dgu = whole ? scratch(size_t(R * 2 * I), 2) : a.dgu_scratch + r0 * 2 * I;
    if (R > 0) rows_part(t.e, r0, R, h, dgu);
    if (need_dw && whole)
      for (int which = 0; which < 3; ++which) weight_part(t.e, which, 0, which == 0 ? D : I, h, dgu);
  });
  if (need_dw) {
    std::vector<Task> split;  // Task::lo/hi: output rows; cost: its share of the expert's work
    for (int64_t e = 0; e < a.E; ++e) {
      const int64_t p = pieces[size_t(e)];
      if (p <= 1) continue;
      for (int which = 0; which < 3; ++which) {
        const int64_t out_rows = which == 0 ? D : I;
        const int64_t step = std::max<int64_t>(16, (out_rows / p + 15) / 16 * 16);
        for (int64_t lo = 0; lo < out_rows; lo += step) {
          const int64_t hi = std::min(out_rows, lo + step);
          // e and which packed into Task::e (3 e + which)
          split.push_back({3 * e + which, lo, hi, double(hi - lo) * double(rows_of(a.offsets, e))});
        }
      }
    }
    std::stable_sort(split.begin(), split.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
    run_tasks(split, threads, [&](const Task& t) {
      const int64_t e = t.e / 3, r0 = start_of(a.offsets, e);
      weight_part(e, int(t.e % 3), t.lo, t.hi, a.h_scratch + r0 * I, a.dgu_scratch + r0 * 2 * I);
    });
  }
  if (a.dx != nullptr) {
    const int64_t end = a.E ? a.offsets[a.E - 1] : 0;
    std::memset(a.dx + end * D, 0, size_t(a.N - end) * size_t(D) * sizeof(float));
  }
}

namespace {

typedef uint16_t v8u16 __attribute__((vector_size(16)));

// Eight bf16 values as fp32 (bf16 is the top half of an fp32's bits).
inline v8f widen8(const uint16_t* p) {
  v8u16 h;
  std::memcpy(&h, p, sizeof(h));
  return (v8f)(__builtin_convertvector(h, v8i) << 16);
}

// dst [rows, cols] (contiguous fp32) = src's bf16 rows (row stride ld).
K2_ISA_CLONES void widen_rows(const uint16_t* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* s = src + r * ld;
    float* d = dst + r * cols;
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) store8(d + c, widen8(s + c));
    for (; c < cols; ++c) d[c] = bf16_to_f32(s[c]);
  }
}

}  // namespace

void moe_swiglu_experts_bf16w_cpu(const SwigluExpertsBf16Args& a) {
  check_group_offsets(a.offsets, a.E, a.N);
  const int threads = resolve_threads(a.num_threads);
  const int64_t D = a.D, I = a.I;
  const SwigluWeightsBf16& w = a.w;
  std::vector<int64_t> rows(size_t(a.E));
  std::vector<double> unit(size_t(a.E), 1.0);
  for (int64_t e = 0; e < a.E; ++e) rows[size_t(e)] = rows_of(a.offsets, e);
  const auto tasks = make_tasks(a.E, rows, unit, threads, 8, false);
  run_tasks(tasks, threads, [&](const Task& t) {
    const int64_t r0 = start_of(a.offsets, t.e) + t.lo, R = t.hi - t.lo;
    const float* x = a.x + r0 * a.x_row_stride;
    float* gu = a.gate_up + r0 * 2 * I;
    float* h = scratch(size_t(R * I));
    const uint16_t* wg = w.gate + t.e * w.gate_stride_e;
    const uint16_t* wu = w.up + t.e * w.up_stride_e;
    const uint16_t* wd = w.down + t.e * w.down_stride_e;
    float* g32 = scratch(size_t(I * D), 1);
    float* u32 = scratch(size_t(I * D), 2);
    float* d32 = scratch(size_t(D * I), 3);
    widen_rows(wg, I, D, w.gate_stride_r, g32);
    widen_rows(wu, I, D, w.up_stride_r, u32);
    widen_rows(wd, D, I, w.down_stride_r, d32);
    sgemm_few_rows(false, true, R, I, D, 1.0f, x, a.x_row_stride, g32, D, 0.0f, gu, 2 * I);
    sgemm_few_rows(false, true, R, I, D, 1.0f, x, a.x_row_stride, u32, D, 0.0f, gu + I, 2 * I);
    swiglu_rows(gu, R, I, h);
    sgemm_few_rows(false, true, R, D, I, 1.0f, h, I, d32, I, 0.0f, a.y + r0 * D, D);
  });
  const int64_t end = a.E ? a.offsets[a.E - 1] : 0;
  std::memset(a.y + end * D, 0, size_t(a.N - end) * size_t(D) * sizeof(float));
  std::memset(a.gate_up + end * 2 * I, 0, size_t(a.N - end) * size_t(2 * I) * sizeof(float));
}

}  // namespace k2
