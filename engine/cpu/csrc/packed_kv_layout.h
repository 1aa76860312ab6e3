// The packed KV layout: a paged pool laid out so that attention needs no horizontal sums.
//
// A plain [block, slot, kv head, dim] pool makes a CPU compute each score as a head_dim-long dot
// product followed by a horizontal sum. The packed layout stores each (block, kv head) tile of
// `block_size` slots transposed for SIMD, one lane per KEY for scores and one lane per DIM for
// the P.V product, 16 keys or 16 dims per vector instruction:
//
// bfloat16 pools, for vdpbf16ps (AVX512-BF16: 16 pairs of bfloat16 products summed into float32
// lanes; emulated with two FMAs per pair on AVX-512 CPUs without it):
//   K: word (dim pair p, slot s) at p * block_size + s   -- a word is two bfloat16: dims 2p, 2p+1
//   V: word (slot pair j, dim d) at j * head_dim + d     -- a word is two bfloat16: slots 2j, 2j+1
// float32 pools (FMA):
//   K: element (dim d, slot s) at d * block_size + s
//   V: element (slot s, dim d) at s * head_dim + d
//
// Tiles follow each other kv head by kv head inside a block, so a block still occupies the same
// bytes as in the plain layout: whole-block copies (swap, prefix sharing) are unchanged; only the
// writer and the attention kernel know what is inside a block. Used for bfloat16 and float32 pools
// when block_size is a multiple of 16, head_dim is 32/64/128 and the CPU has AVX-512 (F and BW).
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TOKENLOOM_PACKED_KV 1
#if defined(__AVX512BF16__)
#define TOKENLOOM_BF16_DOT 1  // the bfloat16 kernels use vdpbf16ps; without it, float32 FMAs
#endif
#endif

namespace tokenloom {

constexpr int64_t PACKED_KEY_GROUP = 16;  // keys per score vector: block_size must be a multiple

// Elem: uint16_t (bfloat16 bits) or float; a tile holds block_size * head_dim elements either way.
template <typename Elem>
struct PackedKvPool {
  Elem* keys;
  Elem* values;
  int64_t block_size, num_kv_heads, head_dim;

  int64_t tile_elems() const { return block_size * head_dim; }
  Elem* key_tile(int64_t block, int64_t head) const { return keys + (block * num_kv_heads + head) * tile_elems(); }
  Elem* value_tile(int64_t block, int64_t head) const { return values + (block * num_kv_heads + head) * tile_elems(); }
};

}  // namespace tokenloom
