// Writes a step's new K/V rows into a packed pool (layout: packed_kv_layout.h).
//
// The packed layout scatters one token's K row down a column of its tile (and a bfloat16 V row
// over half-words), which index_copy_ cannot express; this is the one place that does it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "packed_kv_layout.h"

#include <cstdint>

namespace {

bool packed_kv_supported() {
#ifdef TOKENLOOM_PACKED_KV
  return true;
#else
  return false;
#endif
}

// Whether bfloat16 pools are attended with vdpbf16ps (AVX512-BF16) rather than widened to float32 FMAs.
bool packed_kv_bf16_dot() {
#ifdef TOKENLOOM_BF16_DOT
  return true;
#else
  return false;
#endif
}

void check_pool(const at::Tensor& pool, const char* name) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() &&
                  (pool.scalar_type() == at::kBFloat16 || pool.scalar_type() == at::kFloat),
              name, " must be a contiguous bfloat16 or float32 [num_blocks, block_size, num_kv_heads, head_dim] pool");
  TORCH_CHECK(pool.size(1) % tokenloom::PACKED_KEY_GROUP == 0 && pool.size(3) % 2 == 0,
              name, ": the packed layout needs block_size a multiple of 16 and an even head_dim");
}

// One token's K and V rows (all kv heads) into their tiles. bfloat16: K words [dim pair][slot]
// (two halves each), V words [slot pair][dim] (this slot's half); float32: K [dim][slot], V [slot][dim].
template <typename Elem>
void write_token(const tokenloom::PackedKvPool<Elem>& pool, int64_t block, int64_t slot, const Elem* k_row,
                 const Elem* v_row, int64_t k_head_stride, int64_t v_head_stride) {
  const int64_t bs = pool.block_size, dim = pool.head_dim;
  for (int64_t h = 0; h < pool.num_kv_heads; ++h) {
    const Elem* k = k_row + h * k_head_stride;
    const Elem* v = v_row + h * v_head_stride;
    Elem* k_tile = pool.key_tile(block, h);
    Elem* v_tile = pool.value_tile(block, h);
    if constexpr (sizeof(Elem) == 2) {
      for (int64_t p = 0; p < dim / 2; ++p) {
        k_tile[2 * (p * bs + slot)] = k[2 * p];
        k_tile[2 * (p * bs + slot) + 1] = k[2 * p + 1];
      }
      Elem* v_words = v_tile + (slot / 2) * 2 * dim;
      for (int64_t d = 0; d < dim; ++d) v_words[2 * d + slot % 2] = v[d];
    } else {
      for (int64_t d = 0; d < dim; ++d) k_tile[d * bs + slot] = k[d];
      for (int64_t d = 0; d < dim; ++d) v_tile[slot * dim + d] = v[d];
    }
  }
}

template <typename Elem>
void write_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                const int64_t* slots) {
  const tokenloom::PackedKvPool<Elem> pool{static_cast<Elem*>(key_cache.data_ptr()), static_cast<Elem*>(value_cache.data_ptr()),
                                           key_cache.size(1), key_cache.size(2), key_cache.size(3)};
  const auto* k_base = static_cast<const Elem*>(key.data_ptr());
  const auto* v_base = static_cast<const Elem*>(value.data_ptr());
  // Tokens in one slot pair of a bfloat16 pool write different halves of the same V words:
  // distinct 16-bit objects, so threads never write the same memory.
  at::parallel_for(0, key.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      write_token(pool, slots[t] / pool.block_size, slots[t] % pool.block_size, k_base + t * key.stride(0),
                  v_base + t * value.stride(0), key.stride(1), value.stride(1));
  });
}

void write_packed_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                     const at::Tensor& slot_mapping) {
  check_pool(key_cache, "key_cache");
  check_pool(value_cache, "value_cache");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == value_cache.scalar_type(),
              "key_cache and value_cache must have one shape and dtype");
  for (const at::Tensor* rows : {&key, &value}) {
    TORCH_CHECK(rows->dim() == 3 && rows->stride(2) == 1 && rows->scalar_type() == key_cache.scalar_type(),
                "key/value must be [num_tokens, num_kv_heads, head_dim] in the pool's dtype with contiguous rows");
    TORCH_CHECK(rows->size(1) == key_cache.size(2) && rows->size(2) == key_cache.size(3), "key/value: the pool's head shape");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "slot_mapping must be int64 [num_tokens]");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the pool");
  if (key_cache.scalar_type() == at::kFloat) {
    write_rows<float>(key, value, key_cache, value_cache, slots);
  } else {
    write_rows<uint16_t>(key, value, key_cache, value_cache, slots);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("packed_kv_supported() -> bool", &packed_kv_supported);
  m.def("packed_kv_bf16_dot() -> bool", &packed_kv_bf16_dot);
  m.def("write_packed_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("write_packed_kv", &write_packed_kv);
}
