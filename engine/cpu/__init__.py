"""tokenloom's CPU backend, behind one door: generic engine modules import from this package only,
never from its modules (pyproject.toml's import-linter contract checks it).

Inside: the C++ kernels and their build (kernels.py, csrc/), the attention backend over them
(attention_backend.py, an AttentionBackend), the fused layer ops (layer_ops.py), packed linears
for oneDNN, MKL and AMX brgemm (linear.py), all decoder layers in one C++ call (decoder_stack.py),
the greedy row argmax (argmax.py), glibc malloc thresholds for CPU steps (malloc.py) and the
OpenMP thread-team guard (openmp_threads.py).
"""

from tokenloom.engine.cpu.argmax import row_argmax
from tokenloom.engine.cpu.attention_backend import CpuAttentionBackend
from tokenloom.engine.cpu.decoder_stack import DecoderStack, build_decoder_stack, decoder_stack_enabled
from tokenloom.engine.cpu.kernels import CpuKernelsUnavailable, cpu_kernels_loaded, load_cpu_kernels
from tokenloom.engine.cpu.linear import PackedLinear, can_pack, onednn_bfloat16_supported, pack_linears
from tokenloom.engine.cpu.malloc import keep_step_buffers_in_heap
from tokenloom.engine.cpu.openmp_threads import in_passing_thread

__all__ = [
    "CpuAttentionBackend",
    "CpuKernelsUnavailable",
    "DecoderStack",
    "PackedLinear",
    "build_decoder_stack",
    "can_pack",
    "cpu_kernels_loaded",
    "decoder_stack_enabled",
    "in_passing_thread",
    "keep_step_buffers_in_heap",
    "load_cpu_kernels",
    "onednn_bfloat16_supported",
    "pack_linears",
    "row_argmax",
]
