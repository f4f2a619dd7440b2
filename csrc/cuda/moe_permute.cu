// CUDA token permute (stable counting sort by expert) and unpermute (weighted gather).
// Semantics: k2_kernels/reference.py::moe_permute / moe_unpermute.
// Shape legend: T tokens, K experts per token, E experts, D hidden, N = T * K rows.
//
// Permute: the N (token, slot) entries are cut into chunks, one warp per chunk.
//   1. hist:  per-chunk expert counts (shared-memory atomics; counts are order-free).
//   2. scan:  per expert, an exclusive scan over chunks; an exclusive scan over experts gives
//             each expert's first row; counts/offsets come out here.
//   3. place: each warp walks its chunk in order, 32 entries at a time; __match_any_sync groups
//             lanes with the same expert and the rank among them is the number of lower lanes,
//             so rows keep (token, slot) order within an expert: stable, unlike atomic order.
//   4. gather: x_ND[n] = x_TD[row_to_slot[n] / K], a warp per row, 16-byte accesses if aligned.
// Out-of-range expert ids go to a virtual expert E after all real ones (memory-safe, not counted).
#include <algorithm>
#include <cstdint>

#include "cuda_common.cuh"
#include "k2/moe.h"

namespace k2 {
namespace cuda {
namespace {

constexpr int kWarps = 4;         // warps per block for the chunked kernels
constexpr int kMaxChunks = 1024;  // bounds the serial per-expert scan over chunks
constexpr int kMinTiles = 8;      // 32-entry tiles per chunk, at least

struct Geometry {
  int64_t tiles, chunks;
};

Geometry geometry(int64_t N) {
  const int64_t per = int64_t(32) * kMaxChunks;
  const int64_t tiles = std::max<int64_t>(kMinTiles, (N + per - 1) / per);
  const int64_t chunks = std::max<int64_t>(1, (N + tiles * 32 - 1) / (tiles * 32));
  return {tiles, chunks};
}

template <typename I>
__device__ __forceinline__ int bucket(I e, int E) { return (e >= 0 && e < E) ? int(e) : E; }

template <typename I>
__global__ void __launch_bounds__(kWarps * 32) hist_kernel(const I* __restrict__ idx, int64_t N, int E, int64_t tiles,
                                                           int64_t chunks, int32_t* __restrict__ hist) {
  extern __shared__ int32_t cnt[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t* my = cnt + warp * (E + 1);
  const int64_t chunk = int64_t(blockIdx.x) * kWarps + warp;
  if (chunk >= chunks) return;  // uniform per warp; no block-wide barrier below
  for (int j = lane; j <= E; j += 32) my[j] = 0;
  __syncwarp();
  const int64_t begin = chunk * tiles * 32, end = min(begin + tiles * 32, N);
  for (int64_t i = begin + lane; i < end; i += 32) atomicAdd(&my[bucket(idx[i], E)], 1);
  __syncwarp();
  for (int j = lane; j <= E; j += 32) hist[chunk * (E + 1) + j] = my[j];
}

// One block. hist[c][e] becomes the number of entries of expert e in chunks before c;
// start[e] the first row of expert e (start[E] = number of valid entries).
__global__ void scan_kernel(int32_t* __restrict__ hist, int64_t chunks, int E, int32_t* __restrict__ start,
                            int32_t* __restrict__ counts, int32_t* __restrict__ offsets) {
  extern __shared__ int32_t total[];
  for (int e = threadIdx.x; e <= E; e += blockDim.x) {
    int32_t run = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t v = hist[c * (E + 1) + e];
      hist[c * (E + 1) + e] = run;
      run += v;
    }
    total[e] = run;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int32_t carry = 0;
    for (int base = 0; base <= E; base += 32) {
      const int e = base + lane;
      const int32_t v = e <= E ? total[e] : 0;
      int32_t inc = v;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int32_t n = __shfl_up_sync(kFullMask, inc, off);
        if (lane >= off) inc += n;
      }
      if (e <= E) start[e] = carry + inc - v;
      if (e < E) {
        counts[e] = v;
        offsets[e] = carry + inc;  // inclusive: the `offs` of torch._grouped_mm
      }
      carry += __shfl_sync(kFullMask, inc, 31);
    }
  }
}

template <typename I>
__global__ void __launch_bounds__(kWarps * 32) place_kernel(const I* __restrict__ idx, int64_t N, int E, int64_t tiles,
                                                            int64_t chunks, const int32_t* __restrict__ hist,
                                                            const int32_t* __restrict__ start,
                                                            int64_t* __restrict__ row_to_slot) {
  extern __shared__ int32_t cursor[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t* my = cursor + warp * (E + 1);
  const int64_t chunk = int64_t(blockIdx.x) * kWarps + warp;
  if (chunk >= chunks) return;
  for (int j = lane; j <= E; j += 32) my[j] = start[j] + hist[chunk * (E + 1) + j];
  __syncwarp();
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t first = (chunk * tiles + tile) * 32;
    if (first >= N) break;  // uniform per warp
    const int64_t i = first + lane;
    const bool valid = i < N;
    const int b = valid ? bucket(idx[i], E) : -1;
    const unsigned peers = __match_any_sync(kFullMask, b);
    const int rank = __popc(peers & lanes_below);
    const int32_t base = valid ? my[b] : 0;
    __syncwarp();  // every peer has read the cursor before the lowest lane moves it
    if (valid) {
      if (rank == 0) my[b] = base + __popc(peers);
      row_to_slot[base + rank] = i;
    }
    __syncwarp();
  }
}

template <typename V>
__global__ void gather_kernel(const char* __restrict__ x, int64_t x_row_bytes, const int64_t* __restrict__ row_to_slot,
                              int64_t N, int64_t K, int64_t row_vecs, char* __restrict__ out) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int64_t n = int64_t(blockIdx.x) * warps + (threadIdx.x >> 5); n < N; n += int64_t(gridDim.x) * warps) {
    const V* src = reinterpret_cast<const V*>(x + (row_to_slot[n] / K) * x_row_bytes);
    V* dst = reinterpret_cast<V*>(out) + n * row_vecs;
#pragma unroll 4
    for (int64_t j = lane; j < row_vecs; j += 32) dst[j] = src[j];
  }
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) == 0; }

// ---- unpermute ----------------------------------------------------------------------------------

constexpr int kUnpermuteThreads = 128;

__global__ void invert_kernel(const int64_t* __restrict__ row_to_slot, int64_t N, int32_t* __restrict__ slot_to_row) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = row_to_slot[n];
    if (s >= 0 && s < N) slot_to_row[s] = int32_t(n);
  }
}

// One block per token: the token's K rows sorted by row index (the reference's index_add
// order, so the fp32 sums match it), then y rows weighted and summed in fp32.
// -fmad=false (CMakeLists) keeps the multiply and the add separately rounded, like the reference.
template <typename Y, int VEC>
__global__ void __launch_bounds__(kUnpermuteThreads) unpermute_kernel(const Y* __restrict__ y, int64_t y_row_stride,
                                                                      const int32_t* __restrict__ slot_to_row,
                                                                      const float* __restrict__ weight, int64_t T, int K,
                                                                      int64_t D, Y* __restrict__ out) {
  __shared__ int32_t raw[kCudaUnpermuteMaxK], rows[kCudaUnpermuteMaxK];
  __shared__ float raw_w[kCudaUnpermuteMaxK], ws[kCudaUnpermuteMaxK];
  __shared__ int nrows;
  const int tid = threadIdx.x;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    if (tid < K) {
      raw[tid] = slot_to_row[t * K + tid];
      raw_w[tid] = weight[t * K + tid];
    }
    __syncthreads();
    if (tid < K) {  // rank sort; slots without a row (-1, invalid input) are dropped
      const int32_t r = raw[tid];
      int pos = 0, valid = 0;
      for (int j = 0; j < K; ++j) {
        const int32_t o = raw[j];
        valid += o >= 0;
        pos += o >= 0 && (o < r || (o == r && j < tid));
      }
      if (r >= 0) {
        rows[pos] = r;
        ws[pos] = raw_w[tid];
      }
      if (tid == 0) nrows = valid;
    }
    __syncthreads();
    const int m = nrows;
    for (int64_t v = tid; v < D / VEC; v += blockDim.x) {
      float acc[VEC], in[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
      for (int k = 0; k < m; ++k) {
        load_vec<Y, VEC>(y + int64_t(rows[k]) * y_row_stride + v * VEC, in);
        const float wk = ws[k];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += wk * in[j];
      }
      store_vec<Y, VEC>(out + t * D + v * VEC, acc);
    }
    __syncthreads();  // rows/ws are rewritten for the next token
  }
}

}  // namespace
}  // namespace cuda

size_t moe_permute_workspace_bytes(int64_t T, int64_t K, int64_t E) {
  const auto g = cuda::geometry(T * K);
  return size_t(g.chunks + 1) * size_t(E + 1) * sizeof(int32_t);
}

size_t moe_unpermute_workspace_bytes(int64_t T, int64_t K) { return size_t(std::max<int64_t>(T * K, 1)) * sizeof(int32_t); }

void moe_permute_cuda(const PermuteArgs& a, void* workspace, int device, uintptr_t stream) {
  using namespace cuda;
  validate(a);
  K2_CHECK(a.E <= kCudaPermuteMaxE, "moe_permute (CUDA): num_experts must be <= " + std::to_string(kCudaPermuteMaxE));
  K2_CHECK(workspace != nullptr, "moe_permute (CUDA): null workspace");
  set_device(device);
  const cudaStream_t s = as_stream(stream);
  const int64_t N = a.T * a.K;
  const int E = int(a.E);
  if (N == 0) {
    check(cudaMemsetAsync(a.counts, 0, size_t(E) * sizeof(int32_t), s), "memset counts");
    check(cudaMemsetAsync(a.offsets, 0, size_t(E) * sizeof(int32_t), s), "memset offsets");
    return;
  }
  const Geometry g = geometry(N);
  int32_t* hist = static_cast<int32_t*>(workspace);
  int32_t* start = hist + g.chunks * (E + 1);
  const unsigned blocks = unsigned((g.chunks + kWarps - 1) / kWarps);
  const size_t smem = size_t(kWarps) * (E + 1) * sizeof(int32_t);
  auto run = [&](auto tag) {
    using I = decltype(tag);
    const I* idx = static_cast<const I*>(a.topk_idx);
    hist_kernel<I><<<blocks, kWarps * 32, smem, s>>>(idx, N, E, g.tiles, g.chunks, hist);
    scan_kernel<<<1, 1024, size_t(E + 1) * sizeof(int32_t), s>>>(hist, g.chunks, E, start, a.counts, a.offsets);
    place_kernel<I><<<blocks, kWarps * 32, smem, s>>>(idx, N, E, g.tiles, g.chunks, hist, start, a.row_to_slot);
  };
  if (a.idx_dtype == DType::kInt32) run(int32_t{}); else run(int64_t{});
  check(cudaGetLastError(), "moe_permute sort kernels launch");

  const int64_t row_bytes = a.D * a.elem_bytes, x_row_bytes = a.x_row_stride * a.elem_bytes;
  if (row_bytes == 0) return;
  const unsigned grid = grid_1d(N, 8, 1 << 16);
  auto gather = [&](auto vtag) {
    using V = decltype(vtag);
    gather_kernel<V><<<grid, 256, 0, s>>>(static_cast<const char*>(a.x), x_row_bytes, a.row_to_slot, N, a.K,
                                          row_bytes / int64_t(sizeof(V)), static_cast<char*>(a.x_out));
  };
  auto fits = [&](int64_t w) {
    return row_bytes % w == 0 && x_row_bytes % w == 0 && aligned(a.x, w) && aligned(a.x_out, w);
  };
  if (fits(16)) gather(int4{});
  else if (fits(4)) gather(int32_t{});
  else if (fits(2)) gather(int16_t{});
  else gather(char{});
  check(cudaGetLastError(), "moe_permute gather launch");
}

void moe_unpermute_cuda(const UnpermuteArgs& a, void* workspace, int device, uintptr_t stream) {
  using namespace cuda;
  validate(a);
  K2_CHECK(a.K <= kCudaUnpermuteMaxK, "moe_unpermute (CUDA): top_k must be <= " + std::to_string(kCudaUnpermuteMaxK));
  K2_CHECK(a.weight_dtype == DType::kFloat32, "moe_unpermute (CUDA): weights must be float32");
  K2_CHECK(workspace != nullptr, "moe_unpermute (CUDA): null workspace");
  const int64_t N = a.T * a.K;
  if (a.T == 0 || a.D == 0) return;
  set_device(device);
  const cudaStream_t s = as_stream(stream);
  int32_t* slot_to_row = static_cast<int32_t*>(workspace);
  check(cudaMemsetAsync(slot_to_row, 0xff, size_t(N) * sizeof(int32_t), s), "memset slot_to_row");  // -1
  invert_kernel<<<grid_1d(N, 256, 1 << 16), 256, 0, s>>>(a.row_to_slot, N, slot_to_row);
  const unsigned grid = grid_1d(a.T, 1, 1 << 20);
  dispatch_float(a.y_dtype, [&](auto tag) {
    using Y = decltype(tag);
    constexpr int kVec = 16 / sizeof(Y);
    const Y* y = static_cast<const Y*>(a.y);
    Y* out = static_cast<Y*>(a.out);
    const bool vec = a.D % kVec == 0 && a.y_row_stride % kVec == 0 && aligned(y, 16) && aligned(out, 16);
    if (vec)
      unpermute_kernel<Y, kVec><<<grid, kUnpermuteThreads, 0, s>>>(y, a.y_row_stride, slot_to_row,
                                                                   static_cast<const float*>(a.weight), a.T, int(a.K), a.D, out);
    else
      unpermute_kernel<Y, 1><<<grid, kUnpermuteThreads, 0, s>>>(y, a.y_row_stride, slot_to_row,
                                                                static_cast<const float*>(a.weight), a.T, int(a.K), a.D, out);
  });
  check(cudaGetLastError(), "moe_unpermute kernel launch");
}

}  // namespace k2
