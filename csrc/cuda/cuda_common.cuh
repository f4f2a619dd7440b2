// Device helpers shared by the k2 CUDA kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "k2/common.h"

namespace k2 {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(double x) { return float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("k2 CUDA: ") + what + ": " + cudaGetErrorString(err));
}

// Make `device` current for this runtime (torch's runtime and ours share the primary context).
inline void set_device(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

inline cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

inline unsigned grid_1d(int64_t work, int64_t per_block, int64_t cap = 1 << 20) {
  int64_t g = (work + per_block - 1) / per_block;
  if (g < 1) g = 1;
  return unsigned(g < cap ? g : cap);
}

// Call f with the C++ element type of a float activation dtype tag (fp32, bf16, fp16).
template <typename F>
void dispatch_float(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: f(float{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
    case DType::kFloat16: f(__half{}); break;
    default: throw std::invalid_argument(std::string("k2: unsupported dtype ") + dtype_name(t));
  }
}

}  // namespace cuda
}  // namespace k2
