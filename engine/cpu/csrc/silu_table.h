// torch's own silu of every value of a 16-bit float type, indexed by the value's bits.
//
// Why: SwiGLU MLPs in bfloat16/float16 apply silu to a value already rounded to that type (the
// gate GEMM's output), so silu has only 65,536 inputs. Looking them up replaces an exp and a
// division per element, and the result is torch's bit for bit by construction (at::silu computes
// the table), which a vectorised exp under -ffast-math was not. The values a model produces hit a
// few KB of the 128 KB table, which stay in L1. One padding entry: AVX-512 gathers read 32 bits
// at each 16-bit entry.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tokenloom {

template <typename T>  // c10::BFloat16 or c10::Half
const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = [] {  // once per process and type (an inline function's static)
    const at::Tensor every_value = at::arange(0, 1 << 16, at::kInt).to(at::kShort).view(c10::CppTypeToScalarType<T>::value);
    const at::Tensor silu = at::silu(every_value).contiguous();
    std::vector<uint16_t> entries((1 << 16) + 1, 0);
    std::memcpy(entries.data(), silu.data_ptr(), (1 << 16) * sizeof(uint16_t));
    return entries;
  }();
  return table.data();
}

#if defined(__AVX512F__)
// silu of 16 bfloat16 values given as their bits (one per 32-bit lane), widened to float32: one
// gather from silu_table<c10::BFloat16>(). It reads 32 bits at each 16-bit entry; the low half is
// the entry, and a bfloat16 is the upper half of a float32.
inline __m512 bfloat16_silu(__m512i bits, const uint16_t* table) {
  const __m512i entries = _mm512_i32gather_epi32(bits, reinterpret_cast<const int*>(table), 2);
  return _mm512_castsi512_ps(_mm512_slli_epi32(entries, 16));
}
#endif

}  // namespace tokenloom
