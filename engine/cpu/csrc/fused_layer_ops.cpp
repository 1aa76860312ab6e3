// Fused elementwise ops of a decoder layer for CPUs: residual add + RMSNorm, RoPE, SiLU-and-mul.
//
// Why: a CPU step over a few dozen tokens spends more time dispatching small elementwise ops
// (each one a trip through the dispatcher and an OpenMP fork/join) than computing them: RMSNorm
// alone is eight ops in eager torch. Each op here is one pass over its rows. They round exactly
// where transformers' eager code rounds (every intermediate it keeps in the model dtype is rounded
// to that dtype here too), so half-precision models produce the same values as the reference
// except for float32 summation order inside the norm's mean.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "float_convert.h"
#include "silu_table.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using tokenloom::load_row;
using tokenloom::round_to;
using tokenloom::silu_table;
using tokenloom::store_row;
using tokenloom::to_float;

int64_t row_grain(int64_t row_size) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_size));  // ~32K elements per task
}

// residual (optional) += input; then out = weight * T(x * rsqrt(mean(x^2) + eps)), x the (new) residual.
template <typename T>
void rms_norm_rows(T* out, int64_t out_stride, T* input, int64_t in_stride, T* residual, int64_t res_stride,
                   const T* weight, int64_t num_rows, int64_t size, double eps) {
  at::parallel_for(0, num_rows, row_grain(size), [&](int64_t begin, int64_t end) {
    std::vector<float> x(size), w(size), y(size);
    load_row(weight, w.data(), size);
    for (int64_t r = begin; r < end; ++r) {
      load_row(input + r * in_stride, x.data(), size);
      if (residual != nullptr) {
        T* res = residual + r * res_stride;
        load_row(res, y.data(), size);
#pragma omp simd
        for (int64_t i = 0; i < size; ++i) x[i] = round_to<T>(x[i] + y[i]);
        store_row(x.data(), res, size);  // exact: x already holds T values
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < size; ++i) squares += x[i] * x[i];
      const float inv_rms = static_cast<float>(1.0 / std::sqrt(static_cast<double>(squares / size) + eps));
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) y[i] = w[i] * round_to<T>(x[i] * inv_rms);
      store_row(y.data(), out + r * out_stride, size);
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, size] with a contiguous last dimension");
}

void rms_norm(at::Tensor out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_rows(out, "out");
  check_rows(input, "input");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == input.scalar_type(), "weight: contiguous, input's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), const_cast<scalar_t*>(input.data_ptr<scalar_t>()),
                            input.stride(0), nullptr, 0, weight.data_ptr<scalar_t>(), input.size(0), input.size(1), eps);
  });
}

// residual += input; input = rms_norm(residual): the two tensors a decoder layer carries between its halves.
void fused_add_rms_norm(at::Tensor input, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(input, "input");
  check_rows(residual, "residual");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == input.scalar_type(), "weight: contiguous, input's dtype");
  TORCH_CHECK(residual.scalar_type() == input.scalar_type() && residual.sizes() == input.sizes(), "residual: input's shape and dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "fused_add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(input.data_ptr<scalar_t>(), input.stride(0), input.data_ptr<scalar_t>(), input.stride(0),
                            residual.data_ptr<scalar_t>(), residual.stride(0), weight.data_ptr<scalar_t>(),
                            input.size(0), input.size(1), eps);
  });
}

// In place, every head of every token: x*cos + rotate_half(x)*sin ("neox" layout: the two halves of
// head_dim are the pairs), with transformers' roundings (each product, then the sum).
template <typename T>
void rotate_heads(T* x, int64_t token_stride, int64_t head_stride, int64_t num_heads, int64_t num_tokens,
                  int64_t head_dim, const T* cos, const T* sin) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, num_tokens, row_grain(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> row(head_dim), rotated(head_dim), c(head_dim), s(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      load_row(cos + t * head_dim, c.data(), head_dim);
      load_row(sin + t * head_dim, s.data(), head_dim);
      for (int64_t h = 0; h < num_heads; ++h) {
        T* v = x + t * token_stride + h * head_stride;
        load_row(v, row.data(), head_dim);
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {  // first half: x*cos - x[i+half]*sin
          rotated[i] = round_to<T>(row[i] * c[i]) + round_to<T>(-row[i + half] * s[i]);
        }
#pragma omp simd
        for (int64_t i = half; i < head_dim; ++i) {  // second half: x*cos + x[i-half]*sin
          rotated[i] = round_to<T>(row[i] * c[i]) + round_to<T>(row[i - half] * s[i]);
        }
        store_row(rotated.data(), v, head_dim);
      }
    }
  });
}

void rotary_embedding(at::Tensor query, at::Tensor key, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3, "query/key must be [num_tokens, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1, "head_dim must be the innermost dimension");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == query.size(2), "cos/sin: contiguous [num_tokens, head_dim]");
  TORCH_CHECK(query.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == query.scalar_type() && key.scalar_type() == query.scalar_type(), "one dtype for all");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    for (const at::Tensor* x : {&query, &key}) {
      rotate_heads<scalar_t>(x->data_ptr<scalar_t>(), x->stride(0), x->stride(1), x->size(1), x->size(0), x->size(2),
                             cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
    }
  });
}

// out = T(silu(gate)) * up, gate_up = [gate | up] per row, as SwiGLU MLPs compute it; for 16-bit
// types silu is looked up in torch's own (silu_table.h).
template <typename T>
void silu_and_mul_rows(T* out, int64_t out_stride, const T* gate_up, int64_t in_stride, int64_t num_rows, int64_t size) {
  constexpr bool LOOKED_UP = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
  const uint16_t* table = nullptr;
  if constexpr (LOOKED_UP) table = silu_table<T>();  // built before the threads start
  at::parallel_for(0, num_rows, row_grain(size), [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<T, float>) {  // nothing to widen or round: one pass, no copies
      for (int64_t r = begin; r < end; ++r) {
        const float* gate = gate_up + r * in_stride;
        const float* up = gate + size;
        float* o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < size; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
      }
    } else if constexpr (LOOKED_UP) {
      std::vector<float> act(size), up(size);
      for (int64_t r = begin; r < end; ++r) {
        const uint16_t* gate_bits = reinterpret_cast<const uint16_t*>(gate_up + r * in_stride);
        load_row(gate_up + r * in_stride + size, up.data(), size);
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          for (; i + 16 <= size; i += 16) {
            const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate_bits + i)));
            _mm512_storeu_ps(act.data() + i, _mm512_mul_ps(tokenloom::bfloat16_silu(bits, table), _mm512_loadu_ps(up.data() + i)));
          }
        }
#endif
        for (; i < size; ++i) act[i] = to_float(T(table[gate_bits[i]], T::from_bits())) * up[i];
        store_row(act.data(), out + r * out_stride, size);
      }
    } else {  // double
      std::vector<float> gate(size), up(size);
      for (int64_t r = begin; r < end; ++r) {
        load_row(gate_up + r * in_stride, gate.data(), size);
        load_row(gate_up + r * in_stride + size, up.data(), size);
        for (int64_t i = 0; i < size; ++i) gate[i] = round_to<T>(gate[i] / (1.f + std::exp(-gate[i]))) * up[i];
        store_row(gate.data(), out + r * out_stride, size);
      }
    }
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_rows(out, "out");
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) == 2 * out.size(1) && gate_up.size(0) == out.size(0), "gate_up must be [rows, 2 * out size]");
  TORCH_CHECK(gate_up.scalar_type() == out.scalar_type(), "gate_up and out must share one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), gate_up.data_ptr<scalar_t>(), gate_up.stride(0),
                                out.size(0), out.size(1));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
