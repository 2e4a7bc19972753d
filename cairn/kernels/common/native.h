// Shared by the CPU kernels (cairn/kernels/<op>/*.cpp): float vectors, row loads in any float dtype, exp.
//
// Vectors are GCC's vector extension (16 floats): the compiler lowers them to whatever the build's
// -march offers (one AVX-512 register, two AVX2 ones), so the kernels hold their accumulators in
// registers without target-specific intrinsics. Loads and stores go through `vload`/`vstore`,
// which assume only a float's alignment (pool rows sit at any 4-byte offset of the arena).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <vector>

namespace cairn {

constexpr int kLanes = 16;
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16u __attribute__((vector_size(64), aligned(4)));

inline vec16 vload(const float* p) { return *reinterpret_cast<const vec16u*>(p); }
inline void vstore(float* p, vec16 v) { *reinterpret_cast<vec16u*>(p) = v; }
inline vec16 vsplat(float x) {  // a broadcast (`vec16{} + x` adds 0.f first: -0 + 0 is +0)
  return vec16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
inline float vsum(vec16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

inline float vmax(vec16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
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

// A small tensor (a weight vector) as fp32 values, converted here rather than by an ATen op:
// an op costs microseconds of dispatch, which a decode step pays per call.
inline std::vector<float> as_floats(const at::Tensor& t) {
  const at::Tensor c = t.is_contiguous() ? t : t.contiguous();
  std::vector<float> out(c.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.scalar_type(), "as_floats",
                                  [&] { load_row(c.data_ptr<scalar_t>(), out.data(), c.numel()); });
  return out;
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

// exp(n ln 2 + r) / 2^n for |r| <= ln 2 / 2: Cephes' polynomial, for a float or a vector of them.
template <typename V>
inline V exp_reduced(V c, V n) {
  const V r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
  V p = r * 0.f + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

inline float exp_approx(float x) {
  const float lo = -87.33654475055310f, hi = 88.8f;
  const float c = x < lo ? lo : (x > hi ? hi : x);
  const float n = std::nearbyint(c * 1.44269504088896341f);
  const float p = exp_reduced(c, n);
  const int32_t half = static_cast<int32_t>(n) / 2;
  const float out = p * pow2i(half) * pow2i(static_cast<int32_t>(n) - half);
  return x != x ? x : (x < lo ? 0.f : out);
}

inline float silu(float x) { return x / (1.f + exp_approx(-x)); }

// ---- whole vectors of 16 (the elementwise loops' body; a scalar loop takes the tail)

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

template <typename T>
inline vec16 vload_as_f32(const T* p) {
  vec16 out;
  for (int i = 0; i < kLanes; ++i) out[i] = to_f32(p[i]);
  return out;
}
template <>
inline vec16 vload_as_f32<float>(const float* p) { return vload(p); }
template <>
inline vec16 vload_as_f32<c10::BFloat16>(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<vec16>(_mm512_slli_epi32(wide, 16));
#else
  const u16x16 bits = *reinterpret_cast<const u16x16*>(p);
  return reinterpret_cast<vec16>(__builtin_convertvector(bits, u32x16) << 16);
#endif
}

inline u16x16 f32_to_bf16_bits(vec16 v) {  // round to nearest even; NaN stays a NaN
#if defined(__AVX512BF16__)
  return reinterpret_cast<u16x16>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v)));
#else
  const u32x16 u = reinterpret_cast<u32x16>(v);
  const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const u32x16 out = v != v ? u32x16{} + 0x7fc0u : rounded;
#if defined(__AVX512F__)
  return reinterpret_cast<u16x16>(_mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(out)));
#else
  return __builtin_convertvector(out, u16x16);
#endif
#endif
}

template <typename T>
inline void vstore_from_f32(T* p, vec16 v) {
  for (int i = 0; i < kLanes; ++i) p[i] = from_f32<T>(v[i]);
}
template <>
inline void vstore_from_f32<float>(float* p, vec16 v) { vstore(p, v); }
template <>
inline void vstore_from_f32<c10::BFloat16>(c10::BFloat16* p, vec16 v) {
  *reinterpret_cast<u16x16*>(p) = f32_to_bf16_bits(v);
}

// v rounded to T's precision and back (the reference's casts between ops)
template <typename T>
inline vec16 vround(vec16 v) {
  vec16 out;
  for (int i = 0; i < kLanes; ++i) out[i] = to_f32(from_f32<T>(v[i]));
  return out;
}
template <>
inline vec16 vround<float>(vec16 v) { return v; }
template <>
inline vec16 vround<c10::BFloat16>(vec16 v) {
  const u16x16 bits = f32_to_bf16_bits(v);
  return vload_as_f32(reinterpret_cast<const c10::BFloat16*>(&bits));
}

inline vec16 vexp(vec16 x) {  // exp_approx, a vector at a time
#if defined(__AVX512F__)
  // 2^n by scalef, which over- and underflows as exp does (to inf, to subnormals and 0) and keeps NaN
  const vec16 c = x < -104.f ? vsplat(-104.f) : (x > 89.f ? vsplat(89.f) : x);
  const vec16 n = reinterpret_cast<vec16>(_mm512_roundscale_ps(reinterpret_cast<__m512>(c * 1.44269504088896341f),
                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  const vec16 lo = vsplat(-87.33654475055310f), hi = vsplat(88.8f);
  const vec16 c = x < lo ? lo : (x > hi ? hi : x);
  vec16 n;
  for (int i = 0; i < kLanes; ++i) n[i] = std::nearbyint(c[i] * 1.44269504088896341f);
#endif
  const vec16 p = exp_reduced(c, n);
#if defined(__AVX512F__)
  return reinterpret_cast<vec16>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
#else
  const i32x16 ni = __builtin_convertvector(n, i32x16), half = ni / 2;
  const vec16 s1 = reinterpret_cast<vec16>((half + 127) << 23), s2 = reinterpret_cast<vec16>((ni - half + 127) << 23);
  const vec16 out = p * s1 * s2;
  return x != x ? x : (x < lo ? vec16{} : out);
#endif
}

// exp(x) to about 1e-4 relative (2^f by a cubic on [-1/2, 1/2]), for values rounded to bf16
// next (whose own rounding is 4e-3): attention's probabilities. 0 for -inf, as exp.
inline vec16 vexp_coarse(vec16 x) {
#if defined(__AVX512F__)
  const vec16 t = (x < -150.f ? vsplat(-150.f) : x) * 1.44269504088896341f;
  const vec16 n = reinterpret_cast<vec16>(_mm512_roundscale_ps(reinterpret_cast<__m512>(t),
                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const vec16 f = t - n;
  const vec16 p = 1.0f + f * (0.69314718f + f * (0.24022650f + f * (0.05550411f + f * 0.00961813f)));
  return reinterpret_cast<vec16>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
#else
  return vexp(x);
#endif
}

inline vec16 vrecip(vec16 y) {  // 1 / y for y >= 1 (a sigmoid's denominator), +inf included
#if defined(__AVX512F__)
  const vec16 r = reinterpret_cast<vec16>(_mm512_rcp14_ps(reinterpret_cast<__m512>(y)));
  const vec16 refined = r * (2.f - y * r);  // one Newton step: about 2^-28 relative error, before rounding
  return y == INFINITY ? vec16{} : refined;  // rcp14(inf) = 0, where the step would make 0 * inf
#else
  return 1.f / y;
#endif
}

// x / y for y >= 1 (+inf included), as a division rounds it (one FMA correction of x * (1 / y)
// gives the correctly rounded quotient but for the rarest ties): torch's silu divides.
inline vec16 vdiv(vec16 x, vec16 y) {
#if defined(__AVX512F__)
  const vec16 r = vrecip(y);
  const vec16 q = x * r;
  const vec16 corrected = q + (x - y * q) * r;  // NaN where q is infinite: q is the quotient there
  return y == INFINITY ? x / y : (corrected != corrected ? q : corrected);
#else
  return x / y;
#endif
}

inline vec16 vsilu(vec16 x) { return vdiv(x, 1.f + vexp(-x)); }
inline vec16 vsigmoid(vec16 x) { return vdiv(vsplat(1.f), 1.f + vexp(-x)); }

// at::parallel_for over n items of `cost` scalar operations each, in grains of about 256k
// operations (tens of microseconds): a small op (a decode step's rows) runs on the calling
// thread, sparing the other threads' wake-up, which costs more than such work.
template <typename F>
inline void parallel_items(int64_t n, int64_t cost, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, cost));
  at::parallel_for(0, n, grain, f);
}

}  // namespace cairn
