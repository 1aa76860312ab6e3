// Writes a step's new K/V rows into a packed bfloat16 pool (layout: packed_kv_layout.h).
//
// The packed layout scatters one token's K row over head_dim/2 words of its tile and its V row
// over half-words, which index_copy_ cannot express; this is the one place that does it.
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

void check_pool(const at::Tensor& pool, const char* name) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() && pool.scalar_type() == at::kBFloat16,
              name, " must be a contiguous bfloat16 [num_blocks, block_size, num_kv_heads, head_dim] pool");
  TORCH_CHECK(pool.size(1) % tokenloom::PACKED_KEY_GROUP == 0 && pool.size(3) % 2 == 0,
              name, ": the packed layout needs block_size a multiple of 16 and an even head_dim");
}

void write_packed_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                     const at::Tensor& slot_mapping) {
  check_pool(key_cache, "key_cache");
  check_pool(value_cache, "value_cache");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache must have one shape");
  for (const at::Tensor* rows : {&key, &value}) {
    TORCH_CHECK(rows->dim() == 3 && rows->stride(2) == 1 && rows->scalar_type() == at::kBFloat16,
                "key/value must be bfloat16 [num_tokens, num_kv_heads, head_dim] with contiguous rows");
    TORCH_CHECK(rows->size(1) == key_cache.size(2) && rows->size(2) == key_cache.size(3), "key/value: the pool's head shape");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "slot_mapping must be int64 [num_tokens]");
  const tokenloom::PackedKvPool pool{reinterpret_cast<uint32_t*>(key_cache.data_ptr()),
                                     reinterpret_cast<uint32_t*>(value_cache.data_ptr()), key_cache.size(1),
                                     key_cache.size(2), key_cache.size(3)};
  const int64_t num_slots = key_cache.size(0) * pool.block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const auto* k_base = reinterpret_cast<const uint16_t*>(key.data_ptr());
  const auto* v_base = reinterpret_cast<const uint16_t*>(value.data_ptr());
  const int64_t pairs = pool.head_dim / 2;
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the pool");
  // Tokens in one slot pair write different halves of the same V words: distinct 16-bit objects.
  at::parallel_for(0, key.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / pool.block_size, slot = slots[t] % pool.block_size;
      for (int64_t h = 0; h < pool.num_kv_heads; ++h) {
        const uint16_t* k = k_base + t * key.stride(0) + h * key.stride(1);
        const uint16_t* v = v_base + t * value.stride(0) + h * value.stride(1);
        uint16_t* k_tile = reinterpret_cast<uint16_t*>(pool.key_tile(block, h));
        uint16_t* v_tile = reinterpret_cast<uint16_t*>(pool.value_tile(block, h) + (slot / 2) * pool.head_dim);
        for (int64_t p = 0; p < pairs; ++p) {
          k_tile[2 * (p * pool.block_size + slot)] = k[2 * p];
          k_tile[2 * (p * pool.block_size + slot) + 1] = k[2 * p + 1];
        }
        for (int64_t d = 0; d < pool.head_dim; ++d) v_tile[2 * d + slot % 2] = v[d];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("packed_kv_supported() -> bool", &packed_kv_supported);
  m.def("write_packed_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("write_packed_kv", &write_packed_kv);
}
