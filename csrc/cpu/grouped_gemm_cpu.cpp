// CPU grouped GEMM over experts: one single-threaded k2::sgemm per (expert, block), OpenMP across them.
// Shape legend: E experts, N grouped rows, K inner size, M output columns (see k2/grouped_gemm.h).
#include "k2/grouped_gemm.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "k2/blas.h"
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
    sgemm(false, trans_w, t.hi - t.lo, a.M, a.K, 1.0f, a.x + r0 * a.x_row_stride, a.x_row_stride,
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
