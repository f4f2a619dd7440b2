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

// 16-byte vector access through uint4 words, unpacked with compile-time indices (no local memory).
__device__ __forceinline__ float bits_to_f32(float, uint32_t b) { return __uint_as_float(b); }
__device__ __forceinline__ float bits_to_f32(__nv_bfloat16, uint32_t b) { return __uint_as_float((b & 0xffffu) << 16); }
__device__ __forceinline__ float bits_to_f32(__half, uint32_t b) { return __half2float(__ushort_as_half(uint16_t(b))); }
__device__ __forceinline__ uint32_t f32_to_bits(float, float x) { return __float_as_uint(x); }
__device__ __forceinline__ uint32_t f32_to_bits(__nv_bfloat16, float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
__device__ __forceinline__ uint32_t f32_to_bits(__half, float x) { return __half_as_ushort(__float2half_rn(x)); }

template <typename Y, int VEC>
__device__ __forceinline__ void load_vec(const Y* p, float (&v)[VEC]) {
  if constexpr (VEC == 1) {
    v[0] = to_f32(*p);
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    constexpr int per = VEC / 4;  // elements per 32-bit word
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = bits_to_f32(Y{}, w[j / per] >> (32 / per * (j % per)));
  }
}

template <typename Y, int VEC>
__device__ __forceinline__ void store_vec(Y* p, const float (&v)[VEC]) {
  if constexpr (VEC == 1) {
    *p = from_f32<Y>(v[0]);
  } else {
    constexpr int per = VEC / 4;
    uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j / per] |= f32_to_bits(Y{}, v[j]) << (32 / per * (j % per));
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace cuda
}  // namespace k2
