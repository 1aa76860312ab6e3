// float32 linear layers through MKL's packed GEMM (cblas_sgemm_pack once at load, then
// cblas_sgemm_compute every step).
//
// Why: with the model's weights streamed from memory every step (they do not fit the cache), MKL's
// packed GEMM ran the bench model's decoder GEMMs 1.1-1.5x faster than oneDNN's prepacked linear
// at 1-128 rows (decode steps) on the 2-core Xeon of bench/README.md, and at par at 512 rows.
// torch's own wrapper (torch.ops.mkl._mkl_linear) uses the packed weight only for the one row count
// it was packed for; the packed form of B does not depend on m (the format is sized for n and k, and
// every row count 1..600 was checked against a float64 reference), so here one pack serves all.
//
// MKL lives inside libtorch_cpu on x86 builds of torch; its symbols are looked up at run time, so a
// torch without MKL only makes mkl_packed_linear_supported() false (oneDNN then packs the layers).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <dlfcn.h>

#include "linear_output.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, PACKED = 151, B_MATRIX = 162;  // MKL's CBLAS enums
constexpr int PACK_ROWS_HINT = 64;  // the m cblas_sgemm_pack is told; the packed B serves any m

using PackGetSize = size_t (*)(int identifier, int m, int n, int k);
using Pack = void (*)(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src, int ld,
                      float* dest);
using Compute = void (*)(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc);

struct Mkl {
  PackGetSize get_size = nullptr;
  Pack pack = nullptr;
  Compute compute = nullptr;
  bool found() const { return get_size && pack && compute; }
};

const Mkl& mkl() {
  static const Mkl functions = [] {
    Mkl m;
    // torch's library is already loaded by the time an op runs; RTLD_NOLOAD only looks it up.
    void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    void* scope = torch_cpu ? torch_cpu : RTLD_DEFAULT;
    m.get_size = reinterpret_cast<PackGetSize>(dlsym(scope, "cblas_sgemm_pack_get_size"));
    m.pack = reinterpret_cast<Pack>(dlsym(scope, "cblas_sgemm_pack"));
    m.compute = reinterpret_cast<Compute>(dlsym(scope, "cblas_sgemm_compute"));
    return m;
  }();
  return functions;
}

bool mkl_packed_linear_supported() { return mkl().found(); }

int checked_int(int64_t value, const char* what) {
  TORCH_CHECK(value > 0 && value <= INT32_MAX, what, " must fit MKL's 32-bit sizes, got ", value);
  return static_cast<int>(value);
}

// weight [out_features, in_features] (nn.Linear's) -> MKL's packed B for x @ weight.T. The buffer
// must stay where it is: MKL's packed data holds alignment-dependent metadata (never copy it).
at::Tensor mkl_pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(mkl().found(), "this torch has no MKL packed GEMM (see mkl_packed_linear_supported)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "mkl_pack_linear_weight takes a float32 CPU [out_features, in_features] weight");
  const at::Tensor w = weight.contiguous();
  const int n = checked_int(w.size(0), "out_features"), k = checked_int(w.size(1), "in_features");
  const size_t bytes = mkl().get_size(B_MATRIX, PACK_ROWS_HINT, n, k);
  at::Tensor packed = at::empty({static_cast<int64_t>((bytes + sizeof(float) - 1) / sizeof(float))}, w.options());
  mkl().pack(ROW_MAJOR, B_MATRIX, TRANS, PACK_ROWS_HINT, n, k, 1.0f, w.data_ptr<float>(), k, packed.data_ptr<float>());
  return packed;
}

// input [..., in_features] @ weight.T (+ bias) with the weight packed by mkl_pack_linear_weight.
at::Tensor mkl_packed_linear(const at::Tensor& input, const at::Tensor& packed, int64_t in_features, int64_t out_features,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(mkl().found(), "this torch has no MKL packed GEMM (see mkl_packed_linear_supported)");
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.device().is_cpu() && input.size(-1) == in_features,
              "mkl_packed_linear takes a float32 CPU input whose last dimension is in_features (", in_features, ")");
  const auto [x, out, rows] = tokenloom::linear_output(input, in_features, out_features);
  if (rows == 0) return out;
  const int m = checked_int(rows, "rows"), n = checked_int(out_features, "out_features"),
            k = checked_int(in_features, "in_features");
  float beta = 0.f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features && bias->scalar_type() == at::kFloat, "bias must be float32 [out_features]");
    out.view({rows, out_features}).copy_(bias->view({1, out_features}).expand({rows, out_features}));
    beta = 1.f;  // C = A @ B + 1 * C: the bias rides in the output
  }
  mkl().compute(ROW_MAJOR, NO_TRANS, PACKED, m, n, k, x.data_ptr<float>(), k, packed.data_ptr<float>(), k, beta,
                out.data_ptr<float>(), n);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("mkl_packed_linear_supported() -> bool", &mkl_packed_linear_supported);
  m.def("mkl_pack_linear_weight(Tensor weight) -> Tensor");
  m.def("mkl_packed_linear(Tensor input, Tensor packed, int in_features, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("mkl_pack_linear_weight", &mkl_pack_linear_weight);
  m.impl("mkl_packed_linear", &mkl_packed_linear);
}
