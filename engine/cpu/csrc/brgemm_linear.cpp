// bfloat16 linear layers through oneDNN's brgemm micro-kernel (torch's at::native::cpublas::brgemm),
// reading the weight in the VNNI blocks of BLOCK_N output columns that oneDNN's own AMX packing
// already is (engine/models/cpu_linear.py checks that byte for byte and aliases it: one copy).
//
// Why: on a CPU with AMX, oneDNN's prepacked linear (mkldnn::_linear_pointwise) spends ~20 us per
// call outside the GEMM (primitive lookup, memory descriptors), which at a decode step of a small
// model is as long as the GEMM itself: 121 calls per step of bench-135m. The micro-kernel is JIT'ed
// once per (rows, BLOCK_N, K) and then called directly, one output block per call, on torch's
// intra-op threads. Each row's sum runs in the same order whatever the other rows, so outputs do
// not depend on the batch. Owning the epilogue also lets a SwiGLU MLP compute silu(gate) * up on
// the float32 tiles of its gate and up blocks with transformers' roundings, instead of writing
// gate|up out and reading it back.
//
// oneDNN's bfloat16 micro-kernel needs AMX (amx_brgemm.h): brgemm_linear_fast() says whether this
// CPU runs it, and the engine keeps oneDNN's linear everywhere else.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "amx_brgemm.h"
#include "float_convert.h"
#include "linear_output.h"
#include "silu_table.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include <unistd.h>  // sysconf: the L2 size

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK_N = 32;  // output columns per packed block and per micro-kernel call
constexpr int64_t BLOCK_M = 32;  // rows per micro-kernel call (a kernel per row count is JIT'ed once)

// Weight bytes a thread multiplies by every row block in turn (see for_each_tile): half of this
// CPU's L2 (2 MB per core on the AMX Xeons seen here), 1 MB where the C library cannot say.
int64_t panel_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? static_cast<int64_t>(l2) / 2 : int64_t{1} << 20;
  }();
  return bytes;
}

bool brgemm_linear_fast() { return tokenloom::amx_brgemm_usable(); }

// weight [N, K] (nn.Linear's) -> [N / BLOCK_N, K / 2, BLOCK_N, 2]: block b holds columns
// b*BLOCK_N.. of B = weight.T in VNNI order (pairs of consecutive k side by side), as brgemm reads it.
at::Tensor brgemm_pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "brgemm_pack_linear_weight takes a bfloat16 CPU [out_features, in_features] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % BLOCK_N == 0 && k % 2 == 0, "brgemm linear needs out_features a multiple of ", BLOCK_N,
              " and an even in_features, got ", n, " x ", k);
  return weight.view({n / BLOCK_N, BLOCK_N, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// oneDNN's prepacked linear weight (at `address`, `nbytes` long) as this kernel's packing, when its
// bytes are exactly brgemm_pack_linear_weight(weight); an empty tensor when they are not. The view
// does not own the memory: the caller keeps oneDNN's tensor alive and never moves it.
// Why: one copy of the weights serves both GEMMs (oneDNN's stays usable beside this one).
at::Tensor brgemm_view_onednn_weight(int64_t address, int64_t nbytes, const at::Tensor& weight) {
  const at::Tensor expected = brgemm_pack_linear_weight(weight);
  if (address == 0 || nbytes != expected.numel() * 2 ||
      std::memcmp(reinterpret_cast<const void*>(address), expected.data_ptr(), nbytes) != 0)
    return at::empty({0}, weight.options());
  return at::from_blob(reinterpret_cast<void*>(address), expected.sizes(), weight.options());
}

#ifdef __AVX512BF16__
// 16 float32 lanes rounded to bfloat16 (nearest even, as tokenloom::bfloat16_bits), stored at out.
inline void store_bf16(__m512 x, c10::BFloat16* out) {
  const __m256bh rounded = _mm512_cvtneps_pbh(x);
  std::memcpy(out, &rounded, sizeof(rounded));
}

// The bfloat16 value of 16 float32 lanes, widened back: an intermediate transformers keeps in bfloat16.
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
#endif

// out[:, block] from the float32 tile: + bias, rounded once to bfloat16 (what oneDNN's linear stores).
// Written with intrinsics: the epilogue touches every output element, and the compiler's version of
// this loop took as long as the micro-kernel itself at 64 rows.
void store_block(const float* tile, int64_t rows, const c10::BFloat16* bias, c10::BFloat16* out, int64_t ldo) {
  float b[BLOCK_N] = {};
  if (bias) tokenloom::load_row(bias, b, BLOCK_N);
#ifdef __AVX512BF16__
  static_assert(BLOCK_N == 32, "two vectors per tile row");
  const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
  for (int64_t r = 0; r < rows; ++r) {
    store_bf16(_mm512_add_ps(_mm512_loadu_ps(tile + r * BLOCK_N), b0), out + r * ldo);
    store_bf16(_mm512_add_ps(_mm512_loadu_ps(tile + r * BLOCK_N + 16), b1), out + r * ldo + 16);
  }
#else
  for (int64_t r = 0; r < rows; ++r) {
    float row[BLOCK_N];
    for (int64_t j = 0; j < BLOCK_N; ++j) row[j] = tile[r * BLOCK_N + j] + b[j];
    tokenloom::store_row(row, out + r * ldo, BLOCK_N);
  }
#endif
}

// out[:, block] = silu(bf16(gate)) * bf16(up), rounded: transformers' SwiGLU on the two tiles, the
// activation looked up in torch's own silu of every bfloat16 value (silu_table.h; gate|up at 512 rows:
// 1156-1185 us per bench-135m layer vs 1520-1567 with SLEEF's exp and a division, AMX Xeon).
void store_swiglu_block(const float* gate, const float* up, int64_t rows, c10::BFloat16* out, int64_t ldo,
                        const uint16_t* table) {
#ifdef __AVX512BF16__
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < BLOCK_N; v += 16) {
      const __m512i bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(gate + r * BLOCK_N + v)));
      const __m512 act = tokenloom::bfloat16_silu(bits, table);
      store_bf16(_mm512_mul_ps(act, round_bf16(_mm512_loadu_ps(up + r * BLOCK_N + v))), out + r * ldo + v);
    }
  }
#else  // for completeness: brgemm runs on AMX CPUs, which all have AVX512-BF16
  using tokenloom::round_to;
  for (int64_t r = 0; r < rows; ++r) {
    float act[BLOCK_N];
    for (int64_t j = 0; j < BLOCK_N; ++j) {
      const float g = round_to<c10::BFloat16>(gate[r * BLOCK_N + j]);
      const float silu = static_cast<float>(c10::BFloat16(table[c10::BFloat16(g).x], c10::BFloat16::from_bits()));
      act[j] = silu * round_to<c10::BFloat16>(up[r * BLOCK_N + j]);
    }
    tokenloom::store_row(act, out + r * ldo, BLOCK_N);
  }
#endif
}

void check_input(const at::Tensor& x, const at::Tensor& packed, int64_t in_features) {
  TORCH_CHECK(brgemm_linear_fast(), "brgemm_linear needs a CPU with AMX (see brgemm_linear_fast)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.size(-1) == in_features,
              "brgemm_linear takes a bfloat16 CPU input whose last dimension is in_features (", in_features, ")");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == in_features && packed.size(2) == BLOCK_N,
              "packed weight does not match in_features ", in_features, " (pack it with brgemm_pack_linear_weight)");
}

// Runs `epilogue(row0, rows, unit, tiles)` for every (row block, unit) after the micro-kernel filled
// `tiles`: tile t is the float32 BLOCK_M x BLOCK_N product with packed block unit + t * tile_stride.
template <int TILES, typename Epilogue>
void for_each_tile(const c10::BFloat16* x, int64_t rows, int64_t k, const c10::BFloat16* packed, int64_t num_units,
                   int64_t tile_stride, Epilogue epilogue) {
  const int64_t block_elems = k * BLOCK_N;
  const int64_t row_blocks = (rows + BLOCK_M - 1) / BLOCK_M;
  // Threads split the column blocks (each streams only its own slice of the weight). Within a
  // thread, a panel of units whose weight fits half of L2 is multiplied by every row block before
  // the next panel: each weight byte comes from memory once and from L2 once per row block, and a
  // row block of the input stays in L1 across the panel. Why: walking the thread's whole slice per
  // row block (1.8 MB of gate|up for bench-135m) re-read it from L3 for every 32 rows, and a
  // 512-row step ran at 0.7 TFLOP/s per core against the micro-kernel's 1.9 cache-hot.
  // The loop order changes no arithmetic: each (row block, unit) is the same micro-kernel call.
  const int64_t unit_bytes = TILES * block_elems * static_cast<int64_t>(sizeof(c10::BFloat16));
  const int64_t panel = std::max<int64_t>(1, panel_bytes() / unit_bytes);
  at::parallel_for(0, num_units, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float tiles[TILES][BLOCK_M * BLOCK_N];
    for (int64_t panel_start = begin; panel_start < end; panel_start += panel) {
      const int64_t panel_end = std::min(end, panel_start + panel);
      for (int64_t mb = 0; mb < row_blocks; ++mb) {
        const int64_t row0 = mb * BLOCK_M, m = std::min(BLOCK_M, rows - row0);
        for (int64_t unit = panel_start; unit < panel_end; ++unit) {
          for (int t = 0; t < TILES; ++t) {
            at::native::cpublas::brgemm(m, BLOCK_N, k, k, BLOCK_N, BLOCK_N, false, x + row0 * k,
                                        packed + (unit + t * tile_stride) * block_elems, tiles[t]);
          }
          epilogue(row0, m, unit, tiles);
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

at::Tensor brgemm_linear(const at::Tensor& input, const at::Tensor& packed, int64_t in_features,
                         const std::optional<at::Tensor>& bias) {
  check_input(input, packed, in_features);
  const int64_t n = packed.size(0) * BLOCK_N;
  const auto [x, out, rows] = tokenloom::linear_output(input, in_features, n);
  if (rows == 0) return out;
  const c10::BFloat16* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(),
                "bias must be a contiguous bfloat16 [out_features]");
    bias_data = bias->data_ptr<c10::BFloat16>();
  }
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  for_each_tile<1>(x.data_ptr<c10::BFloat16>(), rows, in_features, packed.data_ptr<c10::BFloat16>(), packed.size(0), 0,
                   [&](int64_t row0, int64_t m, int64_t block, float (&tiles)[1][BLOCK_M * BLOCK_N]) {
                     store_block(tiles[0], m, bias_data ? bias_data + block * BLOCK_N : nullptr,
                                 o + row0 * n + block * BLOCK_N, n);
                   });
  return out;
}

// packed: a gate|up weight (gate rows first, as SwiGLU MLPs fuse them): column block j of the gate
// and column block j of the up projection are packed blocks j and j + half; returns silu(gate) * up.
at::Tensor brgemm_swiglu(const at::Tensor& input, const at::Tensor& packed, int64_t in_features) {
  check_input(input, packed, in_features);
  TORCH_CHECK(packed.size(0) % 2 == 0, "a gate|up weight has an even number of column blocks");
  const int64_t n = packed.size(0) / 2 * BLOCK_N;
  const auto [x, out, rows] = tokenloom::linear_output(input, in_features, n);
  if (rows == 0) return out;
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const uint16_t* table = tokenloom::silu_table<c10::BFloat16>();
  for_each_tile<2>(x.data_ptr<c10::BFloat16>(), rows, in_features, packed.data_ptr<c10::BFloat16>(), packed.size(0) / 2,
                   packed.size(0) / 2, [&](int64_t row0, int64_t m, int64_t unit, float (&tiles)[2][BLOCK_M * BLOCK_N]) {
                     store_swiglu_block(tiles[0], tiles[1], m, o + row0 * n + unit * BLOCK_N, n, table);
                   });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("brgemm_linear_fast() -> bool", &brgemm_linear_fast);
  m.def("brgemm_pack_linear_weight(Tensor weight) -> Tensor");
  m.def("brgemm_view_onednn_weight(int address, int nbytes, Tensor weight) -> Tensor");
  m.def("brgemm_linear(Tensor input, Tensor packed, int in_features, Tensor? bias) -> Tensor");
  m.def("brgemm_swiglu(Tensor input, Tensor packed, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("brgemm_pack_linear_weight", &brgemm_pack_linear_weight);
  m.impl("brgemm_view_onednn_weight", &brgemm_view_onednn_weight);
  m.impl("brgemm_linear", &brgemm_linear);
  m.impl("brgemm_swiglu", &brgemm_swiglu);
}
