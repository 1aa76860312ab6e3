// Whether oneDNN's bfloat16 brgemm micro-kernel (torch's at::native::cpublas::brgemm) runs on this
// CPU: it needs AMX, and torch raises where it cannot run. Checked once per process by a tiny product
// against its known value; the linear layers (brgemm_linear.cpp) and prefill attention
// (packed_paged_attention.cpp) use it only where this says so.
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <exception>
#include <vector>

namespace tokenloom {

inline bool amx_brgemm_usable() {
#ifndef __AMX_BF16__
  return false;  // built for a CPU without AMX (-march=native): oneDNN's linear is the faster path there
#else
  static const bool usable = [] {  // one instance per process: an inline function's static
    if (!at::native::cpublas::could_pack(at::kBFloat16)) return false;
    try {  // one row of ones times a VNNI block of twos: every output must be 2 * K
      constexpr int64_t K = 32, N = 32;
      std::vector<c10::BFloat16> a(K, c10::BFloat16(1.f)), b(K * N, c10::BFloat16(2.f));
      std::vector<float> c(N, 0.f);
      at::native::cpublas::brgemm(1, N, K, K, N, N, false, a.data(), b.data(), c.data());
      at::native::cpublas::brgemm_release();
      return std::all_of(c.begin(), c.end(), [](float v) { return v == 2.f * K; });
    } catch (const std::exception&) {
      return false;
    }
  }();
  return usable;
#endif
}

}  // namespace tokenloom
