// Vectorisable math for the CPU kernels' elementwise loops (shared by attention and the expert
// GEMMs). The build targets baseline x86-64 so that a wheel runs anywhere; hot loops are compiled
// once per ISA with K2_ISA_CLONES and the loader picks one, and exp is a polynomial because libm's
// expf is a scalar call that took as long as the GEMMs around it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

// AVX-512, AVX2 and the baseline clone of a function (GCC target_clones); a no-op elsewhere.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define K2_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define K2_ISA_CLONES
#endif

namespace k2 {

// Eight floats as one GCC vector: loops written on it run vectorised on every target (AVX-512,
// AVX2, the SSE2 baseline as two halves) without intrinsics.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

// Sum of the eight lanes.
inline float hsum8(v8f v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

inline float clamp_exp_arg(float x) { return std::min(std::max(x, -87.0f), 88.0f); }
inline v8f clamp_exp_arg(v8f x) {
  const v8f lo = v8f{} - 87.0f, hi = v8f{} + 88.0f;
  x = x < lo ? lo : x;
  return x > hi ? hi : x;
}

// 2^n for integral n in [-126, 127], by building the exponent bits.
inline float pow2i(float n) {
  const int32_t bits = (int32_t(n) + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline v8f pow2i(v8f n) { return (v8f)((__builtin_convertvector(n, v8i) + 127) << 23); }

// e^x without a libm call: Cephes' expf (reduction by ln 2, then a degree-6 polynomial), about
// 1 ulp; the argument is clamped to [-87, 88] (no overflow to inf, no subnormals). T: float or v8f.
template <typename T>
inline T exp_poly(const T& x_in) {
  const T x = clamp_exp_arg(x_in);
  const T n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  T r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  T p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  return p * pow2i(n);
}

}  // namespace k2
