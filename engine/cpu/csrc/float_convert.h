// Element <-> float conversions the compiler can vectorise.
//
// c10::BFloat16's own conversions are correct but opaque enough to keep gcc's loop vectoriser
// away; these are the same bit operations written out: a bfloat16 is the upper half of a float32,
// and float -> bfloat16 rounds to nearest even by adding 0x7FFF plus the lowest kept bit.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace tokenloom {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t wide = static_cast<uint32_t>(x.x) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// The bfloat16 bits of x, rounded to nearest even.
inline uint16_t bfloat16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  return c10::BFloat16(bfloat16_bits(x), c10::BFloat16::from_bits());
}

// What storing `x` in T and reading it back gives (an intermediate the reference keeps in T);
// for bfloat16 pure float/integer arithmetic, so loops around it vectorise.
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }
template <>
inline float round_to<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float rounded;
  std::memcpy(&rounded, &bits, sizeof(rounded));
  return rounded;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
}
// Stores through the raw 16-bit words: gcc does not vectorise stores of the c10::BFloat16 struct.
inline void store_row(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = bfloat16_bits(src[i]);
}

}  // namespace tokenloom
