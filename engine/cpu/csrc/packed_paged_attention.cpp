// Paged attention over a packed pool (packed_kv_layout.h): every chunk of a step, decodes and
// prefill chunks alike, in ONE call per layer.
//
// Why: on the plain layout a CPU computes each score as a head_dim-long dot product and a
// horizontal sum, and torch's SDPA for prefill chunks reaches 50-75 GFLOP/s (and needs float32
// copies of bfloat16 q/k/v). With the packed layout each vector instruction yields 16 partial
// scores (one lane per key) or 16 output dims (one lane per dim), straight from the pool.
//
// Three element policies share the kernel: bfloat16 with vdpbf16ps (AVX512-BF16), bfloat16 on an
// AVX-512 CPU without it (each bfloat16 pair widened to two float32 vectors by a shift and a mask,
// then two FMAs: bfloat16 products are exact in float32, so this adds the same products), and
// float32 (FMAs). bfloat16 numerics follow torch's bfloat16 flash attention: float32 scores and
// softmax (max-subtracted), probabilities rounded to bfloat16 for the P.V product, float32
// accumulation, the denominator from the unrounded probabilities, the output rounded once; float32
// keeps every intermediate in float32. Pool slots past a sequence's context (or before its sliding
// window) may hold anything, even NaN bits: they are never read as scores and their V entries are
// masked to zero, so they cannot leak into another sequence's output.
//
// Work items: (chunk, kv head, tile of QUERY_TILE query positions) with every query head of the
// GQA group or, when decodes are many, one decode with all its kv heads; taken costliest first
// from a shared counter on torch's intra-op threads. The scores of an item's whole key range fit
// in its buffers, so the softmax is exact (no rescaling passes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx_brgemm.h"
#include "float_convert.h"
#include "packed_kv_layout.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef TOKENLOOM_PACKED_KV
#include <immintrin.h>
#endif

namespace {

#ifdef TOKENLOOM_PACKED_KV

using tokenloom::PACKED_KEY_GROUP;
using tokenloom::PackedKvPool;

constexpr int64_t QUERY_TILE = 16;  // query positions per work item
constexpr int64_t QK_ROWS = 8;      // score rows per pass: 8 accumulators
constexpr int64_t PREFETCH_GROUPS = 1;  // decodes prefetch K/V this many key groups ahead
// Into L2, not L1: an L1 prefetch holds one of the core's few L1 miss buffers until its line
// arrives, and a decode's whole next block (96 lines for bench-135m) is in flight at once; one group
// ahead hides the memory latency of decodes reading K/V from DRAM, and more groups ahead do not.
constexpr auto PREFETCH_HINT = _MM_HINT_T1;
constexpr int64_t AMX_MAX_GROUP = 8;    // AMX prefill items hold QUERY_TILE x group rows (bounded tile buffer)

struct Chunk {
  int64_t query_start, num_queries, context, start;  // start: position of the chunk's first query
  const int32_t* table;
};

struct Item {
  int64_t chunk, kv_head, first_query, num_queries, cost;  // kv_head ALL_HEADS: a decode, every head
};

constexpr int64_t ALL_HEADS = -1;

// Two float32 vectors from 16 words of two bfloat16 each: the low halves and the high halves.
struct Widened {
  __m512 low, high;
};

inline Widened widen(__m512i words) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(words, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}

// Halves of a V word pair that may be read: slot pair (key, key + 1) against [first_key, context).
inline __mmask32 valid_halves(int64_t key, int64_t first_key, int64_t context) {
  __mmask32 keep = 0xFFFFFFFFu;
  if (key < first_key) keep &= 0xAAAAAAAAu;    // even slot (low halves) invalid
  if (key + 1 >= context) keep &= 0x55555555u;  // odd slot (high halves) invalid
  return keep;
}

// The line a bfloat16 policy's load_keys reads: 16 words (dims 2p, 2p + 1) of the keys at `slot`.
inline void prefetch_key_words(const uint16_t* tile, int64_t slot, int64_t block_size, int64_t p) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<const uint32_t*>(tile) + p * block_size + slot), PREFETCH_HINT);
}

// One element policy per pool dtype / instruction set. Each says how a query row is held
// (QUERY_WORDS QueryWords), how the K of one dim pair for 16 keys is loaded and dotted with a
// query row's pair, how probabilities are kept (Prob), how one slot pair of V is added into R
// accumulator rows, and how an output row is stored. score_rows below is shared by all three.

#ifdef TOKENLOOM_BF16_DOT
template <int HEAD_DIM>
struct Bf16DotOps {  // vdpbf16ps: one instruction per bfloat16 pair
  using Elem = uint16_t;
  using QueryWord = uint32_t;  // dims 2p, 2p+1
  using Prob = uint16_t;       // bfloat16 bits
  using Keys = __m512bh;       // 16 words: dims 2p, 2p+1 of 16 keys
  static constexpr bool FMA_VALUES = false;  // its own add_value_pair (below)
  static constexpr int64_t QUERY_WORDS = HEAD_DIM / 2, V_VECS = HEAD_DIM / 16;
  static constexpr int64_t PV_ROWS = 24 / V_VECS > 0 ? 24 / V_VECS : 1;  // + V_VECS value registers

  static __m512bh as_bh(__m512i x) { return (__m512bh)x; }

  static void load_query(const Elem* src, QueryWord* dst) { std::memcpy(dst, src, HEAD_DIM * sizeof(Elem)); }

  static Keys load_keys(const Elem* tile, int64_t slot, int64_t block_size, int64_t p) {
    return as_bh(_mm512_loadu_si512(reinterpret_cast<const uint32_t*>(tile) + p * block_size + slot));
  }

  static void prefetch_keys(const Elem* tile, int64_t slot, int64_t block_size, int64_t p) {
    prefetch_key_words(tile, slot, block_size, p);
  }

  static __m512 dot_pair(__m512 acc, const QueryWord* q, int64_t p, Keys k) {
    return _mm512_dpbf16_ps(acc, as_bh(_mm512_set1_epi32(static_cast<int>(q[p]))), k);
  }

  static Prob to_prob(float e) { return tokenloom::bfloat16_bits(e); }

  // acc[i] += P(row i; slots key, key + 1) . V(slots key, key + 1); key even, probs at row 0's
  // slot `key`. Every V vector is loaded before the rows (V_VECS registers, PV_ROWS sized for it).
  template <int R>
  __attribute__((always_inline)) static void add_value_pair(__m512 (&acc)[R][V_VECS], const Elem* tile, int64_t key_in_block,
                                                            __mmask32 keep, const Prob* probs, int64_t width) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(tile) + (key_in_block / 2) * HEAD_DIM;
    __m512bh values[V_VECS];
    for (int v = 0; v < V_VECS; ++v) values[v] = as_bh(_mm512_maskz_mov_epi16(keep, _mm512_loadu_si512(words + v * 16)));
    for (int i = 0; i < R; ++i) {
      uint32_t pair;
      std::memcpy(&pair, probs + i * width, sizeof(pair));
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int v = 0; v < V_VECS; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], p, values[v]);
    }
  }

  static void store_output(const __m512* acc, float sum, Elem* o) {
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    for (int v = 0; v < V_VECS; ++v) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[v], inv));
      std::memcpy(o + v * 16, &rounded, sizeof(rounded));
    }
  }
};
#endif  // TOKENLOOM_BF16_DOT

// The P.V step of the two FMA policies: per output vector, the two slots' values (Ops::values:
// low = slot key, high = slot key + 1, invalid ones zero) times each row's two float32 probabilities.
template <typename Ops, int R, int V_VECS>
__attribute__((always_inline)) inline void add_value_pair_fma(__m512 (&acc)[R][V_VECS], const typename Ops::Elem* tile,
                                                              int64_t key_in_block, __mmask32 keep, const float* probs,
                                                              int64_t width) {
  for (int v = 0; v < V_VECS; ++v) {
    const Widened values = Ops::values(tile, key_in_block, keep, v);
    for (int i = 0; i < R; ++i) {
      acc[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(probs[i * width + 1]), values.high, acc[i][v]);
      acc[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(probs[i * width]), values.low, acc[i][v]);
    }
  }
}

template <int HEAD_DIM>
struct Bf16WidenedOps {  // bfloat16 pool, AVX-512 without AVX512-BF16: each pair as two float32 FMAs
  using Elem = uint16_t;
  using QueryWord = float;  // the query widened once per item
  using Prob = float;       // rounded to bfloat16 values, kept as float32 for the FMAs
  using Keys = Widened;     // dims 2p (low) and 2p + 1 (high) of 16 keys
  static constexpr bool FMA_VALUES = true;  // P.V through add_value_pair_fma over values()
  static constexpr int64_t QUERY_WORDS = HEAD_DIM, V_VECS = HEAD_DIM / 16;
  static constexpr int64_t PV_ROWS = 24 / V_VECS > 0 ? 24 / V_VECS : 1;  // values widened one vector at a time

  static void load_query(const Elem* src, QueryWord* dst) {
    tokenloom::load_row(reinterpret_cast<const c10::BFloat16*>(src), dst, HEAD_DIM);
  }

  static Keys load_keys(const Elem* tile, int64_t slot, int64_t block_size, int64_t p) {
    return widen(_mm512_loadu_si512(reinterpret_cast<const uint32_t*>(tile) + p * block_size + slot));
  }

  static void prefetch_keys(const Elem* tile, int64_t slot, int64_t block_size, int64_t p) {
    prefetch_key_words(tile, slot, block_size, p);
  }

  static __m512 dot_pair(__m512 acc, const QueryWord* q, int64_t p, const Keys& k) {  // high first, as vdpbf16ps
    acc = _mm512_fmadd_ps(_mm512_set1_ps(q[2 * p + 1]), k.high, acc);
    return _mm512_fmadd_ps(_mm512_set1_ps(q[2 * p]), k.low, acc);
  }

  static Prob to_prob(float e) { return tokenloom::round_to<c10::BFloat16>(e); }

  static Widened values(const Elem* tile, int64_t key_in_block, __mmask32 keep, int v) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(tile) + (key_in_block / 2) * HEAD_DIM;
    return widen(_mm512_maskz_mov_epi16(keep, _mm512_loadu_si512(words + v * 16)));
  }

  static void store_output(const __m512* acc, float sum, Elem* o) {
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    for (int v = 0; v < V_VECS; ++v) {  // round to nearest even, then keep the upper halves
      const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(acc[v], inv));
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + v * 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
    }
  }
};

template <int HEAD_DIM>
struct Float32Ops {  // float32 pool: K [dim][slot], V [slot][dim]
  using Elem = float;
  using QueryWord = float;
  using Prob = float;
  using Keys = Widened;  // dims 2p (low) and 2p + 1 (high) of 16 keys
  static constexpr bool FMA_VALUES = true;  // P.V through add_value_pair_fma over values()
  static constexpr int64_t QUERY_WORDS = HEAD_DIM, V_VECS = HEAD_DIM / 16;
  static constexpr int64_t PV_ROWS = 24 / V_VECS > 0 ? 24 / V_VECS : 1;

  static void load_query(const Elem* src, QueryWord* dst) { std::memcpy(dst, src, HEAD_DIM * sizeof(Elem)); }

  static Keys load_keys(const Elem* tile, int64_t slot, int64_t block_size, int64_t p) {
    const float* keys = tile + 2 * p * block_size + slot;
    return {_mm512_loadu_ps(keys), _mm512_loadu_ps(keys + block_size)};
  }

  static void prefetch_keys(const Elem* tile, int64_t slot, int64_t block_size, int64_t p) {
    const float* keys = tile + 2 * p * block_size + slot;
    _mm_prefetch(reinterpret_cast<const char*>(keys), PREFETCH_HINT);
    _mm_prefetch(reinterpret_cast<const char*>(keys + block_size), PREFETCH_HINT);
  }

  static __m512 dot_pair(__m512 acc, const QueryWord* q, int64_t p, const Keys& k) {
    acc = _mm512_fmadd_ps(_mm512_set1_ps(q[2 * p]), k.low, acc);
    return _mm512_fmadd_ps(_mm512_set1_ps(q[2 * p + 1]), k.high, acc);
  }

  static Prob to_prob(float e) { return e; }

  static Widened values(const Elem* tile, int64_t key_in_block, __mmask32 keep, int v) {
    const float* even = tile + key_in_block * HEAD_DIM + v * 16;  // slots key, key + 1: consecutive rows
    return {_mm512_maskz_loadu_ps((keep & 1u) ? 0xFFFF : 0, even), _mm512_maskz_loadu_ps((keep & 2u) ? 0xFFFF : 0, even + HEAD_DIM)};
  }

  static void store_output(const __m512* acc, float sum, Elem* o) {
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    for (int v = 0; v < V_VECS; ++v) _mm512_storeu_ps(o + v * 16, _mm512_mul_ps(acc[v], inv));
  }
};

// Scores of R query rows (QUERY_WORDS apart in q) against the 16 keys at `slot` of a K tile.
// `next_tile`/`next_slot` (next_tile may be null): the keys a later call will read, prefetched
// line by line as these are read, so a decode's next block is in cache when it gets there.
template <typename Ops, int HEAD_DIM, int R>
void score_rows(const typename Ops::Elem* tile, int64_t slot, int64_t block_size, const typename Ops::QueryWord* q,
                float* scores, int64_t width, const typename Ops::Elem* next_tile = nullptr, int64_t next_slot = 0) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < HEAD_DIM / 2; ++p) {
    if (next_tile) Ops::prefetch_keys(next_tile, next_slot, block_size, p);
    const typename Ops::Keys k = Ops::load_keys(tile, slot, block_size, p);
    for (int i = 0; i < R; ++i) acc[i] = Ops::dot_pair(acc[i], q + i * Ops::QUERY_WORDS, p, k);
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(scores + i * width, acc[i]);
}

template <typename Ops>
struct Buffers {
  std::vector<typename Ops::QueryWord> query;  // rows x QUERY_WORDS
  std::vector<float> scores;                   // rows x width
  std::vector<typename Ops::Prob> probs;       // rows x width
  std::vector<float> sums;
  std::vector<float> acc;  // rows x head_dim: P.V partial sums between key groups (all-heads decodes)
  std::vector<typename Ops::Prob> grouped;  // AMX prefill: probs as [key group][rows][16], a fixed stride
};

template <typename Ops, int HEAD_DIM>
struct PackedAttention {
  using Elem = typename Ops::Elem;
  using Prob = typename Ops::Prob;
  static constexpr int64_t QUERY_WORDS = Ops::QUERY_WORDS;
  static constexpr int64_t V_VECS = Ops::V_VECS;
  static constexpr int64_t PV_ROWS = Ops::PV_ROWS;  // rows per P.V pass

  PackedKvPool<Elem> pool;
  const Elem* query;
  Elem* out;
  int64_t group, q_row_stride, q_head_stride, o_row_stride, o_head_stride;
  float scale;
  int64_t window;  // <= 0: none

  // Prefill chunks on AMX tiles: bfloat16 pools with 16-slot blocks, where the micro-kernel runs.
  bool use_amx() const {
#ifdef TOKENLOOM_BF16_DOT
    return std::is_same_v<Ops, Bf16DotOps<HEAD_DIM>> && pool.block_size == PACKED_KEY_GROUP && group <= AMX_MAX_GROUP &&
           tokenloom::amx_brgemm_usable();
#else
    return false;
#endif
  }

  // probs[0..visible) = exp((scores - max) * scale) as Ops keeps them; returns the float32 sum of the unrounded values.
  float softmax_row(const float* scores, Prob* probs, int64_t visible) const {
    float peak = scores[0];
    for (int64_t k = 1; k < visible; ++k) peak = std::max(peak, scores[k]);
    float total = 0.f;
    float e[64];
    for (int64_t k0 = 0; k0 < visible; k0 += 64) {
      const int64_t n = std::min<int64_t>(64, visible - k0);
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < n; ++i) {
        e[i] = std::exp((scores[k0 + i] - peak) * scale);
        total += e[i];
      }
      for (int64_t i = 0; i < n; ++i) probs[k0 + i] = Ops::to_prob(e[i]);
    }
    return total;
  }

  template <int R>
  void score_tile(const Chunk& c, int64_t head, int64_t key_lo, int64_t key_hi, const typename Ops::QueryWord* q,
                  float* scores, int64_t width) const {
    for (int64_t key = key_lo; key < key_hi; key += PACKED_KEY_GROUP) {
      const int64_t block = c.table[key / pool.block_size];
      score_rows<Ops, HEAD_DIM, R>(pool.key_tile(block, head), key % pool.block_size, pool.block_size, q,
                                  scores + (key - key_lo), width);
    }
  }

  // acc[i] += P(row i; slots key, key + 1) . V(slots key, key + 1) for R rows (key even); `probs`
  // points at row 0's probability of slot `key`, rows `width` apart. A slot outside
  // [first_key, context) is masked: it may hold stale or NaN bits, and 0 * NaN is NaN.
  template <int R>
  __attribute__((always_inline)) void add_value_pair(__m512 (&acc)[R][V_VECS], const Chunk& c, int64_t head, int64_t key,
                                                     int64_t first_key, const Prob* probs, int64_t width) const {
    const int64_t block = c.table[key / pool.block_size];
    add_tile_value_pair<R>(acc, pool.value_tile(block, head), key % pool.block_size,
                           valid_halves(key, first_key, c.context), probs, width);
  }

  template <int R>
  __attribute__((always_inline)) static void add_tile_value_pair(__m512 (&acc)[R][V_VECS], const Elem* tile,
                                                                 int64_t key_in_block, __mmask32 keep, const Prob* probs,
                                                                 int64_t width) {
    if constexpr (Ops::FMA_VALUES) {
      add_value_pair_fma<Ops, R, V_VECS>(acc, tile, key_in_block, keep, probs, width);
    } else {
      Ops::template add_value_pair<R>(acc, tile, key_in_block, keep, probs, width);
    }
  }

  // The V of a slot pair (key_in_block even) in both layouts: 2 * HEAD_DIM elements from key_in_block * HEAD_DIM.
  static void prefetch_value_pair(const Elem* tile, int64_t key_in_block) {
    const char* start = reinterpret_cast<const char*>(tile + key_in_block * HEAD_DIM);
    for (int64_t offset = 0; offset < 2 * HEAD_DIM * static_cast<int64_t>(sizeof(Elem)); offset += 64)
      _mm_prefetch(start + offset, PREFETCH_HINT);
  }

  // (block, slot) of the key group PREFETCH_GROUPS after the one at `key`; block -1 past key_hi.
  std::pair<int64_t, int64_t> prefetch_target(const Chunk& c, int64_t key, int64_t key_hi) const {
    const int64_t ahead = key + PREFETCH_GROUPS * PACKED_KEY_GROUP;
    return {ahead < key_hi ? c.table[ahead / pool.block_size] : -1, ahead % pool.block_size};
  }

  // A decode (one query) with every kv head in one item, G query heads per kv head: each block's
  // tiles are read head after head, one dense stream through the pool per sequence, which the
  // hardware prefetcher follows; per-head items read every third 2 KB and ran ~2x below it.
  template <int G>
  void attend_decode(const Chunk& c, Buffers<Ops>& buf) const {
    const int64_t heads = pool.num_kv_heads, rows = heads * G;  // row = kv head * G + g = query head
    const int64_t pos = c.context - 1;
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    const int64_t key_lo = first_key / PACKED_KEY_GROUP * PACKED_KEY_GROUP;
    const int64_t key_hi = (pos / PACKED_KEY_GROUP + 1) * PACKED_KEY_GROUP, width = key_hi - key_lo;
    buf.query.resize(rows * QUERY_WORDS);
    buf.scores.resize(rows * width);
    buf.probs.assign(rows * width, 0);
    buf.sums.resize(rows);
    buf.acc.assign(rows * HEAD_DIM, 0.f);
    for (int64_t r = 0; r < rows; ++r)
      Ops::load_query(query + c.query_start * q_row_stride + r * q_head_stride, buf.query.data() + r * QUERY_WORDS);
    // The pool's blocks are scattered, so the hardware prefetcher stalls at every block boundary:
    // each key group prefetches the group PREFETCH_GROUPS ahead (K here, V in the P.V loop).
    for (int64_t key = key_lo; key < key_hi; key += PACKED_KEY_GROUP) {
      const int64_t block = c.table[key / pool.block_size], slot = key % pool.block_size;
      const auto [next_block, next_slot] = prefetch_target(c, key, key_hi);
      for (int64_t h = 0; h < heads; ++h)
        score_rows<Ops, HEAD_DIM, G>(pool.key_tile(block, h), slot, pool.block_size, buf.query.data() + h * G * QUERY_WORDS,
                                    buf.scores.data() + h * G * width + (key - key_lo), width,
                                    next_block >= 0 ? pool.key_tile(next_block, h) : nullptr, next_slot);
    }
    for (int64_t r = 0; r < rows; ++r)
      buf.sums[r] = softmax_row(buf.scores.data() + r * width + (first_key - key_lo),
                                buf.probs.data() + r * width + (first_key - key_lo), pos + 1 - first_key);
    for (int64_t group_start = key_lo; group_start < key_hi; group_start += PACKED_KEY_GROUP) {
      const int64_t block = c.table[group_start / pool.block_size], slot = group_start % pool.block_size;
      const auto [next_block, next_slot] = prefetch_target(c, group_start, key_hi);
      for (int64_t h = 0; h < heads; ++h) {
        const Elem* tile = pool.value_tile(block, h);
        float* partial = buf.acc.data() + h * G * HEAD_DIM;
        __m512 acc[G][V_VECS];
        for (int i = 0; i < G; ++i)
          for (int v = 0; v < V_VECS; ++v) acc[i][v] = _mm512_loadu_ps(partial + i * HEAD_DIM + v * 16);
        for (int64_t key = std::max(group_start, first_key / 2 * 2); key < group_start + PACKED_KEY_GROUP && key <= pos; key += 2) {
          if (next_block >= 0) prefetch_value_pair(pool.value_tile(next_block, h), next_slot + (key - group_start));
          add_tile_value_pair<G>(acc, tile, slot + (key - group_start), valid_halves(key, first_key, c.context),
                                 buf.probs.data() + h * G * width + (key - key_lo), width);
        }
        for (int i = 0; i < G; ++i)
          for (int v = 0; v < V_VECS; ++v) _mm512_storeu_ps(partial + i * HEAD_DIM + v * 16, acc[i][v]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      __m512 acc[V_VECS];
      for (int v = 0; v < V_VECS; ++v) acc[v] = _mm512_loadu_ps(buf.acc.data() + r * HEAD_DIM + v * 16);
      Ops::store_output(acc, buf.sums[r], out + c.query_start * o_row_stride + r * o_head_stride);
    }
  }

  void attend_decode_all_heads(const Chunk& c, Buffers<Ops>& buf) const {
    switch (group) {
      case 1: return attend_decode<1>(c, buf);
      case 2: return attend_decode<2>(c, buf);
      case 3: return attend_decode<3>(c, buf);
      case 4: return attend_decode<4>(c, buf);
      case 5: return attend_decode<5>(c, buf);
      case 6: return attend_decode<6>(c, buf);
      case 7: return attend_decode<7>(c, buf);
      default: return attend_decode<8>(c, buf);  // run() makes all-heads items only for groups <= 8
    }
  }

  // out rows = (P . V) / sums for R rows, over the key pairs [pair_lo, pair_hi).
  template <int R>
  void weigh_values(const Chunk& c, int64_t head, int64_t key_lo, int64_t pair_lo, int64_t pair_hi, int64_t first_key,
                    const Prob* probs, int64_t width, const float* sums, int64_t first_row, const Item& item) const {
    __m512 acc[R][V_VECS];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < V_VECS; ++v) acc[i][v] = _mm512_setzero_ps();
    for (int64_t j = pair_lo; j < pair_hi; ++j) {
      const int64_t key = 2 * j;
      add_value_pair<R>(acc, c, head, key, first_key, probs + (key - key_lo), width);
    }
    for (int i = 0; i < R; ++i) {
      const int64_t r = first_row + i;
      const int64_t token = c.query_start + item.first_query + r / group;
      Ops::store_output(acc[i], sums[i], out + token * o_row_stride + (item.kv_head * group + r % group) * o_head_stride);
    }
  }

  // The rows (position-major: row = query * group + g) and key range of a per-head item.
  struct ItemRange {
    int64_t rows, first_pos, last_pos, first_key, key_lo, key_hi, width;  // key_hi: group-aligned end
  };

  // Sizes the buffers for `item` and loads its query rows.
  ItemRange load_item(const Chunk& c, const Item& item, Buffers<Ops>& buf) const {
    ItemRange r;
    r.rows = item.num_queries * group;
    r.first_pos = c.start + item.first_query;
    r.last_pos = r.first_pos + item.num_queries - 1;
    r.first_key = window > 0 ? std::max<int64_t>(0, r.first_pos - window + 1) : 0;
    r.key_lo = r.first_key / PACKED_KEY_GROUP * PACKED_KEY_GROUP;
    r.key_hi = (r.last_pos / PACKED_KEY_GROUP + 1) * PACKED_KEY_GROUP;
    r.width = r.key_hi - r.key_lo;
    buf.query.resize(r.rows * QUERY_WORDS);
    buf.scores.resize(r.rows * r.width);
    buf.probs.assign(r.rows * r.width, 0);
    buf.sums.resize(r.rows);
    for (int64_t row = 0; row < r.rows; ++row) {
      const int64_t token = c.query_start + item.first_query + row / group;
      const int64_t head = item.kv_head * group + row % group;
      Ops::load_query(query + token * q_row_stride + head * q_head_stride, buf.query.data() + row * QUERY_WORDS);
    }
    return r;
  }

  // Exact softmax of each row over its visible keys [lo, pos]; other probabilities stay 0.
  void softmax_rows(const ItemRange& r, Buffers<Ops>& buf) const {
    for (int64_t row = 0; row < r.rows; ++row) {
      const int64_t pos = r.first_pos + row / group;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      buf.sums[row] = softmax_row(buf.scores.data() + row * r.width + (lo - r.key_lo),
                                  buf.probs.data() + row * r.width + (lo - r.key_lo), pos + 1 - lo);
    }
  }

  void attend(const Chunk& c, const Item& item, Buffers<Ops>& buf) const {
    const ItemRange range = load_item(c, item, buf);
    const int64_t rows = range.rows, first_key = range.first_key, last_pos = range.last_pos;
    const int64_t key_lo = range.key_lo, key_hi = range.key_hi, width = range.width;
    for (int64_t r0 = 0; r0 < rows; r0 += QK_ROWS) {
      const typename Ops::QueryWord* q = buf.query.data() + r0 * QUERY_WORDS;
      float* s = buf.scores.data() + r0 * width;
      switch (std::min<int64_t>(QK_ROWS, rows - r0)) {
        case 8: score_tile<8>(c, item.kv_head, key_lo, key_hi, q, s, width); break;
        case 7: score_tile<7>(c, item.kv_head, key_lo, key_hi, q, s, width); break;
        case 6: score_tile<6>(c, item.kv_head, key_lo, key_hi, q, s, width); break;
        case 5: score_tile<5>(c, item.kv_head, key_lo, key_hi, q, s, width); break;
        case 4: score_tile<4>(c, item.kv_head, key_lo, key_hi, q, s, width); break;
        case 3: score_tile<3>(c, item.kv_head, key_lo, key_hi, q, s, width); break;
        case 2: score_tile<2>(c, item.kv_head, key_lo, key_hi, q, s, width); break;
        default: score_tile<1>(c, item.kv_head, key_lo, key_hi, q, s, width); break;
      }
    }
    softmax_rows(range, buf);
    const int64_t pair_lo = first_key / 2, pair_hi = (last_pos + 2) / 2;  // pairs covering [first_key, last_pos]
    for (int64_t r0 = 0; r0 < rows; r0 += PV_ROWS) {
      const Prob* p = buf.probs.data() + r0 * width;
      const float* sums = buf.sums.data() + r0;
      switch (std::min<int64_t>(PV_ROWS, rows - r0)) {
#define TOKENLOOM_PV_CASE(R) \
  case R: if constexpr (R <= PV_ROWS) weigh_values<R>(c, item.kv_head, key_lo, pair_lo, pair_hi, first_key, p, width, sums, r0, item); break;
        TOKENLOOM_PV_CASE(12) TOKENLOOM_PV_CASE(11) TOKENLOOM_PV_CASE(10) TOKENLOOM_PV_CASE(9)
        TOKENLOOM_PV_CASE(8) TOKENLOOM_PV_CASE(7) TOKENLOOM_PV_CASE(6) TOKENLOOM_PV_CASE(5)
        TOKENLOOM_PV_CASE(4) TOKENLOOM_PV_CASE(3) TOKENLOOM_PV_CASE(2) TOKENLOOM_PV_CASE(1)
#undef TOKENLOOM_PV_CASE
      }
    }
  }

#ifdef TOKENLOOM_BF16_DOT
  // attend() on AMX tiles (bfloat16 pools, block_size 16): the packed K tile of a block is B of
  // Q.K^T in the VNNI layout the micro-kernel reads (dim pairs x keys) and the V tile is B of P.V
  // (key pairs x dims), so each block is two brgemm calls: [rows x 16] scores, [rows x head_dim]
  // added into the output. Same roundings as attend(): float32 scores and softmax, probabilities
  // rounded to bfloat16, float32 P.V, one rounding of the output.
  void attend_amx(const Chunk& c, const Item& item, Buffers<Ops>& buf) const {
    using BF16 = c10::BFloat16;
    const ItemRange range = load_item(c, item, buf);
    const int64_t rows = range.rows, first_key = range.first_key, last_pos = range.last_pos;
    const int64_t key_lo = range.key_lo, key_hi = range.key_hi, width = range.width;
    buf.acc.resize(rows * HEAD_DIM);
    // Every micro-kernel call keeps fixed leading dimensions (the kernel is JIT'ed per shape AND
    // stride, so strides that follow the context length would JIT one per step): scores land in a
    // [rows x 16] tile first, and the probabilities are regrouped key group by key group below.
    const BF16* q = reinterpret_cast<const BF16*>(buf.query.data());
    alignas(64) float tile[QUERY_TILE * AMX_MAX_GROUP * PACKED_KEY_GROUP];  // rows <= QUERY_TILE * group
    for (int64_t key = key_lo; key < key_hi; key += PACKED_KEY_GROUP) {  // one block per group (block_size 16)
      const BF16* keys = reinterpret_cast<const BF16*>(pool.key_tile(c.table[key / pool.block_size], item.kv_head));
      at::native::cpublas::brgemm(rows, PACKED_KEY_GROUP, HEAD_DIM, HEAD_DIM, PACKED_KEY_GROUP, PACKED_KEY_GROUP, false, q,
                                  keys, tile);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(buf.scores.data() + r * width + (key - key_lo), tile + r * PACKED_KEY_GROUP, PACKED_KEY_GROUP * sizeof(float));
    }
    softmax_rows(range, buf);
    // Slots outside [first_key, last_pos] may hold stale or NaN bits, and 0 * NaN is NaN: an edge
    // block's V goes through a copy with those slots zeroed.
    alignas(64) uint16_t edge[PACKED_KEY_GROUP * HEAD_DIM];
    buf.grouped.resize(rows * width);
    for (int64_t g = 0; g < width / PACKED_KEY_GROUP; ++g)
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(buf.grouped.data() + (g * rows + r) * PACKED_KEY_GROUP, buf.probs.data() + r * width + g * PACKED_KEY_GROUP,
                    PACKED_KEY_GROUP * sizeof(Prob));
    for (int64_t key = key_lo; key < key_hi; key += PACKED_KEY_GROUP) {
      const uint16_t* values = pool.value_tile(c.table[key / pool.block_size], item.kv_head);
      if (key < first_key || key + PACKED_KEY_GROUP > last_pos + 1) {
        for (int64_t pair = 0; pair < PACKED_KEY_GROUP / 2; ++pair) {
          const int64_t slot_key = key + 2 * pair;  // the pair (slot_key, slot_key + 1)
          const __mmask32 keep = slot_key > last_pos || slot_key + 1 < first_key ? 0 : valid_halves(slot_key, first_key, last_pos + 1);
          for (int64_t v = 0; v < HEAD_DIM; v += 16)
            _mm512_storeu_si512(edge + (pair * HEAD_DIM + v) * 2,
                                _mm512_maskz_mov_epi16(keep, _mm512_loadu_si512(values + (pair * HEAD_DIM + v) * 2)));
        }
        values = edge;
      }
      const BF16* p = reinterpret_cast<const BF16*>(buf.grouped.data()) + (key - key_lo) * rows;
      at::native::cpublas::brgemm(rows, HEAD_DIM, PACKED_KEY_GROUP, PACKED_KEY_GROUP, HEAD_DIM, HEAD_DIM, key > key_lo, p,
                                  reinterpret_cast<const BF16*>(values), buf.acc.data());
    }
    for (int64_t r = 0; r < rows; ++r) {
      __m512 acc[V_VECS];
      for (int v = 0; v < V_VECS; ++v) acc[v] = _mm512_loadu_ps(buf.acc.data() + r * HEAD_DIM + v * 16);
      const int64_t token = c.query_start + item.first_query + r / group;
      Ops::store_output(acc, buf.sums[r], out + token * o_row_stride + (item.kv_head * group + r % group) * o_head_stride);
    }
  }
#endif

  void run(const std::vector<Chunk>& chunks, int64_t num_kv_heads) const {
    // Decodes take every kv head per item when there are enough of them to keep all threads busy;
    // a few long decodes are split by head so they still use every core.
    int64_t num_decodes = 0;
    for (const Chunk& c : chunks) num_decodes += c.num_queries == 1;
    const bool whole_decodes = group <= 8 && num_decodes >= 4 * at::get_num_threads();
    std::vector<Item> items;
    for (size_t ci = 0; ci < chunks.size(); ++ci) {
      const Chunk& c = chunks[ci];
      if (whole_decodes && c.num_queries == 1) {
        const int64_t keys = window > 0 ? std::min<int64_t>(window, c.context) : c.context;
        items.push_back({static_cast<int64_t>(ci), ALL_HEADS, 0, 1, keys * num_kv_heads});
        continue;
      }
      for (int64_t q0 = 0; q0 < c.num_queries; q0 += QUERY_TILE) {
        const int64_t n = std::min(QUERY_TILE, c.num_queries - q0);
        const int64_t keys = window > 0 ? std::min<int64_t>(window + n, c.start + q0 + n) : c.start + q0 + n;
        for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({static_cast<int64_t>(ci), h, q0, n, n * keys});
      }
    }
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    std::atomic<int64_t> next{0};
    const int64_t num_items = static_cast<int64_t>(items.size());
    const bool amx = use_amx();
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
      Buffers<Ops> buf;
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        if (items[i].kv_head == ALL_HEADS) {
          attend_decode_all_heads(chunks[items[i].chunk], buf);
        } else if (amx && chunks[items[i].chunk].num_queries > 1) {
#ifdef TOKENLOOM_BF16_DOT
          if constexpr (std::is_same_v<Ops, Bf16DotOps<HEAD_DIM>>) attend_amx(chunks[items[i].chunk], items[i], buf);
#endif
        } else {
          attend(chunks[items[i].chunk], items[i], buf);
        }
      }
      if (amx) at::native::cpublas::brgemm_release();
    });
  }
};

template <typename Ops, int HEAD_DIM>
void run_packed(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& query_start, const at::Tensor& block_table, const at::Tensor& context_lens,
                double scale, int64_t sliding_window) {
  using Elem = typename Ops::Elem;
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < context_lens.size(0); ++i) {
    const int64_t num_queries = starts[i + 1] - starts[i];
    TORCH_CHECK(num_queries >= 1 && lens[i] >= num_queries, "chunk ", i, ": context_len must cover its queries");
    TORCH_CHECK((lens[i] + block_size - 1) / block_size <= block_table.size(1), "chunk ", i, ": block table too short");
    chunks.push_back({starts[i], num_queries, lens[i], lens[i] - num_queries, tables + i * block_table.size(1)});
  }
  if (chunks.empty()) return;
  const PackedAttention<Ops, HEAD_DIM> attention{
      {static_cast<Elem*>(key_cache.data_ptr()), static_cast<Elem*>(value_cache.data_ptr()), block_size, num_kv_heads,
       HEAD_DIM},
      static_cast<const Elem*>(query.data_ptr()), static_cast<Elem*>(out.data_ptr()),
      query.size(1) / num_kv_heads, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
      static_cast<float>(scale), sliding_window};
  attention.run(chunks, num_kv_heads);
}

#ifdef TOKENLOOM_BF16_DOT
template <int HEAD_DIM>
using Bf16Ops = Bf16DotOps<HEAD_DIM>;
#else
template <int HEAD_DIM>
using Bf16Ops = Bf16WidenedOps<HEAD_DIM>;
#endif

template <template <int> class Ops>
void run_for_head_dim(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& query_start, const at::Tensor& block_table, const at::Tensor& context_lens,
                      double scale, int64_t sliding_window) {
  switch (query.size(2)) {
    case 32: return run_packed<Ops<32>, 32>(out, query, key_cache, value_cache, query_start, block_table, context_lens, scale, sliding_window);
    case 64: return run_packed<Ops<64>, 64>(out, query, key_cache, value_cache, query_start, block_table, context_lens, scale, sliding_window);
    case 128: return run_packed<Ops<128>, 128>(out, query, key_cache, value_cache, query_start, block_table, context_lens, scale, sliding_window);
    default: TORCH_CHECK(false, "packed_paged_attention supports head_dim 32, 64 and 128, not ", query.size(2));
  }
}

#endif  // TOKENLOOM_PACKED_KV

void packed_paged_attention(
    at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& query_start, const at::Tensor& block_table, const at::Tensor& context_lens,
    double scale, int64_t sliding_window) {
#ifndef TOKENLOOM_PACKED_KV
  TORCH_CHECK(false, "packed_paged_attention needs a CPU with AVX-512 (see packed_kv_supported)");
#else
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && out.sizes() == query.sizes(),
              "query and out must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "K/V pools must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] of one shape");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be the innermost dimension");
  const at::ScalarType dtype = key_cache.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && query.scalar_type() == dtype &&
                  out.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "packed_paged_attention takes bfloat16 or float32 queries, outputs and K/V pools, all of one dtype");
  TORCH_CHECK(key_cache.size(1) % PACKED_KEY_GROUP == 0, "the packed layout needs block_size a multiple of 16");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt,
              "query_start, block_table and context_lens must be int32");
  TORCH_CHECK(query_start.is_contiguous() && block_table.is_contiguous() && context_lens.is_contiguous(),
              "tables must be contiguous");
  TORCH_CHECK(query_start.size(0) == context_lens.size(0) + 1, "query_start must have one entry more than context_lens");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query and pool head_dim differ");
  if (dtype == at::kFloat) {
    run_for_head_dim<Float32Ops>(out, query, key_cache, value_cache, query_start, block_table, context_lens, scale, sliding_window);
  } else {
    run_for_head_dim<Bf16Ops>(out, query, key_cache, value_cache, query_start, block_table, context_lens, scale, sliding_window);
  }
#endif
}

}  // namespace

// Whether bfloat16 prefill chunks over 16-slot blocks run on AMX tiles here (for the start-up report).
bool packed_prefill_amx() {
#ifdef TOKENLOOM_BF16_DOT
  return tokenloom::amx_brgemm_usable();
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("packed_prefill_amx() -> bool", &packed_prefill_amx);
  m.def("packed_paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor query_start, Tensor block_table, Tensor context_lens, float scale, int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("packed_paged_attention", &packed_paged_attention);
}
