// The packed bfloat16 KV layout: a paged pool laid out for the CPU's bfloat16 dot-product instruction.
//
// vdpbf16ps (AVX512-BF16) multiplies 16 pairs of bfloat16 and adds each pair's two products into
// one float32 lane. Attention wants one lane per KEY (16 scores at once, no horizontal sums), so
// the pool stores each (block, kv head) tile of `block_size` slots as:
//   K: word (dim pair p, slot s) at p * block_size + s   -- a word is two bfloat16: dims 2p, 2p+1
//   V: word (slot pair j, dim d) at j * head_dim + d     -- a word is two bfloat16: slots 2j, 2j+1
// Tiles follow each other kv head by kv head inside a block, so a block still occupies the same
// bytes as in the plain [block, slot, kv head, dim] layout: whole-block copies (swap, prefix
// sharing) are unchanged; only the writer and the attention kernel know what is inside a block.
// Used for bfloat16 pools when block_size is a multiple of 16 and the CPU has AVX512-BF16.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TOKENLOOM_PACKED_KV 1
#endif

namespace tokenloom {

constexpr int64_t PACKED_KEY_GROUP = 16;  // keys per score vector: block_size must be a multiple

struct PackedKvPool {
  uint32_t* keys;
  uint32_t* values;
  int64_t block_size, num_kv_heads, head_dim;

  int64_t tile_words() const { return block_size * head_dim / 2; }
  uint32_t* key_tile(int64_t block, int64_t head) const { return keys + (block * num_kv_heads + head) * tile_words(); }
  uint32_t* value_tile(int64_t block, int64_t head) const { return values + (block * num_kv_heads + head) * tile_words(); }
};

}  // namespace tokenloom
