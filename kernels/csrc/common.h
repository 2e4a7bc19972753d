// Shared by the CPU kernels (kernels/csrc/*.cpp): float vectors, row loads in any float dtype, exp.
//
// Vectors are GCC's vector extension (16 floats): the compiler lowers them to whatever the build's
// -march offers (one AVX-512 register, two AVX2 ones), so the kernels hold their accumulators in
// registers without target-specific intrinsics. Loads and stores go through `vload`/`vstore`,
// which assume only a float's alignment (pool rows sit at any 4-byte offset of the arena).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace cairn {

constexpr int kLanes = 16;
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16u __attribute__((vector_size(64), aligned(4)));

inline vec16 vload(const float* p) { return *reinterpret_cast<const vec16u*>(p); }
inline void vstore(float* p, vec16 v) { *reinterpret_cast<vec16u*>(p) = v; }
inline vec16 vsplat(float x) { return vec16{} + x; }
inline float vsum(vec16 v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// bf16 <-> fp32 as integer ops on the bits, which vectorise (c10's conversions do not, well):
// widening is exact; narrowing rounds to nearest even, NaN staying a NaN, as c10 and torch do.
inline float bf16_bits_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
}

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) { return bf16_bits_to_f32(x.x); }
inline float to_f32(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_f32(float x) { return static_cast<T>(x); }
template <>
inline c10::BFloat16 from_f32<c10::BFloat16>(float x) {
  return c10::BFloat16(f32_to_bf16_bits(x), c10::BFloat16::from_bits());
}

// n values of any float dtype, as fp32.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_f32(bits[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <>
inline void store_row<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = f32_to_bf16_bits(src[i]);
}

// exp(x) for a vectorised loop: Cephes' expf (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6
// polynomial in r), scaled by 2^n as two powers of two so that n = 128 still overflows to +inf;
// within 2 ulp of expf; below -87.3 (where expf turns subnormal) it returns 0; NaN stays NaN.
// Branch-free, so loops that call it vectorise.
inline float pow2i(int32_t n) {  // 2^n for -126 <= n <= 127
  const int32_t bits = (n + 127) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline float exp_approx(float x) {
  const float lo = -87.33654475055310f, hi = 88.8f;
  const float c = x < lo ? lo : (x > hi ? hi : x);
  const float n = std::nearbyint(c * 1.44269504088896341f);
  const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t half = static_cast<int32_t>(n) / 2;
  const float out = p * pow2i(half) * pow2i(static_cast<int32_t>(n) - half);
  return x != x ? x : (x < lo ? 0.f : out);
}

inline float silu(float x) { return x / (1.f + exp_approx(-x)); }

}  // namespace cairn
