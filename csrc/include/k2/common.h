// Shared definitions for the k2 kernels: dtype tags, host-side float conversions, argument checks.
// Framework-agnostic: no torch, no pybind11 here. Keep DType in sync with k2_kernels/_lib.py.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace k2 {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat64 = 3, kInt32 = 4, kInt64 = 5 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

// Thrown for bad arguments; pybind11 maps std::invalid_argument to ValueError.
#define K2_CHECK(cond, msg)                                                  \
  do {                                                                       \
    if (!(cond)) throw std::invalid_argument(std::string("k2: ") + (msg));   \
  } while (0)

inline bool is_float_activation(DType t) {
  return t == DType::kFloat32 || t == DType::kBFloat16 || t == DType::kFloat16;
}
inline bool is_index(DType t) { return t == DType::kInt32 || t == DType::kInt64; }

// ---- host conversions (round to nearest even, like torch) --------------------------------------

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x0040u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_f32(sign);
    int shift = 0;  // subnormal: normalise the mantissa
    while (!(mant & 0x400u)) { mant <<= 1; ++shift; }
    return bits_f32(sign | (uint32_t(113 - shift) << 23) | ((mant & 0x3ffu) << 13));
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;          // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;         // rounds to inf (>= 65520)
  if (ax < 0x38800000u)                                 // below 2^-14: subnormal half
    return sign | uint16_t(std::nearbyint(bits_f32(ax) * 16777216.0f));
  const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);   // round the 13 dropped bits to even
  return sign | uint16_t((r - 0x38000000u) >> 13);
}

// Load element i of a float activation array of dtype t as float.
inline float load_f32(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kBFloat16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat64: return float(static_cast<const double*>(p)[i]);
    default: throw std::invalid_argument("k2: expected a floating dtype");
  }
}

inline int64_t load_index(const void* p, DType t, int64_t i) {
  return t == DType::kInt32 ? int64_t(static_cast<const int32_t*>(p)[i]) : static_cast<const int64_t*>(p)[i];
}

}  // namespace k2
