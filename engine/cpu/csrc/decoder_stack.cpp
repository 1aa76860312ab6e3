// Every decoder layer of a Llama-shaped model over the CPU backend's packed KV pools, in one call.
//
// Why: the Python layer loop (engine/models/layers.py) costs ~40 us of interpreter time, argument
// parsing and dispatch per layer before any arithmetic, while the engine's other CPU thread spins
// idle; on W1 (bench/offline.py) that was ~11% of the main thread's time. Here the same ops run
// in the same order on the same tensors, called through the dispatcher from C++, so the result
// is the Python loop's bit for bit (tests/engine/cpu/test_decoder_stack.py) and Python pays one call
// per step. engine/models/decoder_stack.py decides which models qualify; the rest keep the loop.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

// One op, looked up once; called boxed (no C++ signature to keep in step with the schema).
class BoxedOp {
 public:
  explicit BoxedOp(const char* name) : handle_(c10::Dispatcher::singleton().findSchemaOrThrow(name, "")) {}

  std::vector<c10::IValue> operator()(std::vector<c10::IValue> stack) const {
    handle_.callBoxed(stack);
    return stack;
  }

 private:
  c10::OperatorHandle handle_;
};

enum LinearKind : int64_t { ONEDNN = 0, MKL = 1 };  // PackedLinear.kernel "onednn" / "mkl"

struct Ops {
  BoxedOp onednn_linear{"mkldnn::_linear_pointwise"};
  BoxedOp mkl_linear{"tokenloom_cpu::mkl_packed_linear"};
  BoxedOp rms_norm{"tokenloom_cpu::rms_norm"};
  BoxedOp add_rms_norm{"tokenloom_cpu::fused_add_rms_norm"};
  BoxedOp rotary{"tokenloom_cpu::rotary_embedding"};
  BoxedOp silu_and_mul{"tokenloom_cpu::silu_and_mul"};
  BoxedOp write_kv{"tokenloom_cpu::write_packed_kv"};
  BoxedOp attention{"tokenloom_cpu::packed_paged_attention"};

  static const Ops& get() {
    static const Ops ops;  // after every library fragment registered (first call, not load)
    return ops;
  }
};

// PackedLinear.forward for the two kernels served here.
at::Tensor linear(const Ops& ops, int64_t kind, const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features) {
  if (kind == MKL) return ops.mkl_linear({x, weight, in_features, out_features, bias})[0].toTensor();
  return ops.onednn_linear({x, weight, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                            std::optional<std::string>(std::string(""))})[0].toTensor();
}

constexpr int64_t WEIGHTS_PER_LAYER = 6;  // input norm, post-attention norm, qkv, o, gate_up, down (+ q/k norms)
constexpr int64_t BIASES_PER_LAYER = 4;   // qkv, o, gate_up, down (each may be None)

// engine/models/layer_ops.py's rms_norm_reference (transformers' RMSNorm), op for op: Qwen3's
// per-head q/k norms, which the Python loop runs in torch.
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor hidden = x.to(at::kFloat);
  const at::Tensor variance = hidden.pow(2).mean(-1, /*keepdim=*/true);
  hidden = hidden * at::rsqrt(variance + eps);
  return weight * hidden.to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> decoder_stack(
    at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::TensorList key_caches, at::TensorList value_caches,
    const at::Tensor& slot_mapping, const at::Tensor& query_start, const at::Tensor& block_table,
    const at::Tensor& context_lens, at::IntArrayRef windows, at::IntArrayRef shape, int64_t linear_kind, double scale,
    double eps, bool qk_norm) {
  const int64_t per_layer = WEIGHTS_PER_LAYER + (qk_norm ? 2 : 0);
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(shape.size() == 5, "shape: [num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == per_layer * num_layers &&
                  static_cast<int64_t>(biases.size()) == BIASES_PER_LAYER * num_layers &&
                  static_cast<int64_t>(value_caches.size()) == num_layers &&
                  static_cast<int64_t>(windows.size()) == num_layers,
              "decoder_stack: per-layer lists of the wrong length");
  const int64_t heads = shape[0], kv_heads = shape[1], head_dim = shape[2], size = shape[3], inner = shape[4];
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, tokens = hidden.size(0);
  const Ops& ops = Ops::get();
  at::Tensor residual;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + l * per_layer;
    auto bias = [&](int64_t i) { return biases.get(l * BIASES_PER_LAYER + i); };
    if (l == 0) {  // the embeddings become the residual stream
      residual = hidden;
      hidden = at::empty_like(residual);
      ops.rms_norm({hidden, residual, w[0], eps});
    } else {
      ops.add_rms_norm({hidden, residual, w[0], eps});
    }
    const at::Tensor qkv = linear(ops, linear_kind, hidden, w[2], bias(0), size, q_size + 2 * kv_size);
    const std::vector<at::Tensor> parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
    at::Tensor q = parts[0].view({tokens, heads, head_dim});
    at::Tensor k = parts[1].view({tokens, kv_heads, head_dim});
    const at::Tensor v = parts[2].view({tokens, kv_heads, head_dim});
    if (qk_norm) {
      q = rms_norm_reference(q, w[6], eps);
      k = rms_norm_reference(k, w[7], eps);
    }
    ops.rotary({q, k, cos, sin});
    ops.write_kv({k, v, key_caches[l], value_caches[l], slot_mapping});
    const at::Tensor attended = at::empty(q.sizes(), q.options());
    ops.attention({attended, q, key_caches[l], value_caches[l], query_start, block_table, context_lens, scale, windows[l]});
    hidden = linear(ops, linear_kind, attended.view({tokens, q_size}), w[3], bias(1), q_size, size);
    ops.add_rms_norm({hidden, residual, w[1], eps});
    const at::Tensor gate_up = linear(ops, linear_kind, hidden, w[4], bias(2), size, 2 * inner);
    const at::Tensor activated = at::empty({tokens, inner}, gate_up.options());
    ops.silu_and_mul({activated, gate_up});
    hidden = linear(ops, linear_kind, activated, w[5], bias(3), inner, size);
  }
  return {hidden, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("decoder_stack(Tensor(c!) hidden, Tensor cos, Tensor sin, Tensor[] weights, Tensor?[] biases, "
        "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor slot_mapping, Tensor query_start, "
        "Tensor block_table, Tensor context_lens, int[] windows, int[] shape, int linear_kind, float scale, "
        "float eps, bool qk_norm) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("decoder_stack", &decoder_stack);
}

// oneDNN's packed weights are MkldnnCPU tensors, which make the dispatcher pick that key.
TORCH_LIBRARY_IMPL(tokenloom_cpu, MkldnnCPU, m) {
  m.impl("decoder_stack", &decoder_stack);
}
