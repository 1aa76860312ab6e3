// Paged decode attention for CPUs: every single-token query of a step in ONE call.
//
// Why this exists: torch has no CPU kernel that attends a batch of queries over paged K/V. Calling
// SDPA once per sequence and layer costs ~80 us of dispatch and threading per call, far more than
// its arithmetic, and a padded batched call must first gather every context into a new tensor.
// Here each sequence (or, with few sequences, each of its kv heads) is one work item on torch's
// own intra-op thread pool (the same OpenMP team as the GEMMs, so its threads stay warm): it reads
// its context once, straight from the pool through the block table, for all query heads of each
// GQA group, accumulating in float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "float_convert.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using tokenloom::load_row;
using tokenloom::store_row;

// HEAD_DIM > 0 fixes the row length at compile time (the common sizes), so every row loop is a
// few unrolled vector instructions; 0 means "read it at run time".
template <typename T, int HEAD_DIM>
void decode_attention(
    at::Tensor& out,                 // [num_seqs, num_heads, head_dim]
    const at::Tensor& query,         // [num_seqs, num_heads, head_dim], any row/head strides
    const at::Tensor& key_cache,     // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    const at::Tensor& value_cache,
    const at::Tensor& block_table,   // [num_seqs, max_blocks] int32
    const at::Tensor& context_lens,  // [num_seqs] int32
    double scale,
    int64_t sliding_window) {        // <= 0: none
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : query.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  const int64_t table_width = block_table.size(1);
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t o_seq_stride = out.stride(0), o_head_stride = out.stride(1);

  const T* q_base = query.data_ptr<T>();
  const T* k_base = key_cache.data_ptr<T>();
  const T* v_base = value_cache.data_ptr<T>();
  T* o_base = out.data_ptr<T>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  // A work item is one sequence and a range of its kv heads. With enough sequences to keep every
  // thread busy an item takes all heads, so it reads each slot's K/V as one contiguous run;
  // otherwise heads are split across items so a few long decodes still use every core.
  const int64_t heads_per_item = num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = heads_per_item * group;  // query heads of one item
    std::vector<float> q(rows * head_dim), acc(rows * head_dim), row(head_dim), scores, denominators(rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / items_per_seq;
      const int64_t first_kv_head = (item % items_per_seq) * heads_per_item;
      const int64_t context = lens[seq];
      const int64_t first = (sliding_window > 0 && context > sliding_window) ? context - sliding_window : 0;
      const int64_t span = context - first;
      const int32_t* table = tables + seq * table_width;
      scores.resize(rows * span);
      for (int64_t r = 0; r < rows; ++r) {  // the item's queries, scaled once
        float* qr = q.data() + r * head_dim;
        load_row(q_base + seq * q_seq_stride + (first_kv_head * group + r) * q_head_stride, qr, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qr[d] *= fscale;
      }
      // Walk the context block by block (no division per position). `visit(i, slot_ptr)` gets the
      // context index i (from `first`) and the pool row of that position at the item's first head.
      auto for_each_slot = [&](const T* pool, auto&& visit) {
        for (int64_t block = first / block_size; block * block_size < context; ++block) {
          const int64_t block_start = block * block_size;
          const int64_t lo = std::max(first, block_start), hi = std::min(context, block_start + block_size);
          const T* slots = pool + (static_cast<int64_t>(table[block]) * block_size) * slot_stride + first_kv_head * head_dim;
          for (int64_t pos = lo; pos < hi; ++pos) visit(pos - first, slots + (pos - block_start) * slot_stride);
        }
      };
      // Scores: each K row is read (and converted) once for its whole GQA group.
      for_each_slot(k_base, [&](int64_t i, const T* k) {
        for (int64_t h = 0; h < heads_per_item; ++h) {
          load_row(k + h * head_dim, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = h * group + g;
            const float* qr = q.data() + r * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * row[d];
            scores[r * span + i] = dot;
          }
        }
      });
      for (int64_t r = 0; r < rows; ++r) {  // softmax, max-subtracted
        float* s = scores.data() + r * span;
        float peak = s[0];  // span >= 1: a decode query always sees itself
        for (int64_t i = 1; i < span; ++i) peak = s[i] > peak ? s[i] : peak;
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < span; ++i) {
          s[i] = std::exp(s[i] - peak);
          total += s[i];
        }
        denominators[r] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_slot(v_base, [&](int64_t i, const T* v) {
        for (int64_t h = 0; h < heads_per_item; ++h) {
          load_row(v + h * head_dim, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = h * group + g;
            const float p = scores[r * span + i];
            float* a = acc.data() + r * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
          }
        }
      });
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / denominators[r];
        float* a = acc.data() + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) a[d] *= inv;
        store_row(a, o_base + seq * o_seq_stride + (first_kv_head * group + r) * o_head_stride, head_dim);
      }
    }
  });
}

template <typename T>
void dispatch_head_dim(int64_t head_dim, auto&&... args) {
  switch (head_dim) {
    case 64: return decode_attention<T, 64>(args...);
    case 128: return decode_attention<T, 128>(args...);
    default: return decode_attention<T, 0>(args...);
  }
}

void paged_decode_attention(
    at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_table, const at::Tensor& context_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "K/V pools must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be the innermost dimension");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == key_cache.scalar_type(),
              "query, out and the K/V pool must share one dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_table and context_lens must be int32");
  TORCH_CHECK(block_table.is_contiguous() && context_lens.is_contiguous(), "tables must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    dispatch_head_dim<scalar_t>(query.size(2), out, query, key_cache, value_cache, block_table, context_lens, scale, sliding_window);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor context_lens, float scale, int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
