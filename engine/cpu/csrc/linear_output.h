// The output of a linear layer's op: input [..., in_features] -> empty [..., out_features], and the
// number of rows the GEMM sees. Shared by the MKL and brgemm linears.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace tokenloom {

struct LinearOutput {
  at::Tensor x;    // the input, contiguous
  at::Tensor out;  // uninitialised, x's dtype and device
  int64_t rows;
};

inline LinearOutput linear_output(const at::Tensor& input, int64_t in_features, int64_t out_features) {
  at::Tensor x = input.contiguous();
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = out_features;
  at::Tensor out = at::empty(sizes, x.options());
  return {x, out, x.numel() / in_features};
}

}  // namespace tokenloom
