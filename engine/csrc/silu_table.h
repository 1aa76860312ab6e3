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

}  // namespace tokenloom
