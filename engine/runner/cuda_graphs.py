"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed each step.

Why: eagerly, a decode step of a small model is hundreds of kernel launches whose launch time
exceeds the GPU work. A graph replays all of them with one launch.

How:
- Buckets are batch sizes 1, 2, 4, 8, 16, 24, ... up to max_num_seqs. A decode-only step of n
  sequences runs the graph of the smallest bucket >= n; its inputs are padded to the bucket with
  decodes that write no KV (slot -1) and attend to nothing (context 0), and the padded rows'
  outputs are ignored. A step with a prefill chunk, or more sequences than the largest bucket,
  runs eagerly.
- A graph captures the forward up to the final hidden states (after the last norm), written into
  ONE static [largest bucket, hidden_size] buffer that every graph shares, bucket b's graph
  writing rows [:b]. The LM head runs eagerly after the replay, on the step's own rows only. A
  graph's output outlives its capture, so [bucket, vocab] logits captured per bucket would each
  hold memory of their own: about 1.2 GiB at 35 buckets of a 152K vocabulary in bfloat16.
- Graphs read their inputs from the step buffers' device views and step block table
  (engine/runner/step_buffers.py), whose addresses never change, so a step only packs its inputs
  and replays.
- Capture goes largest first into ONE shared memory pool: smaller graphs reuse the largest one's
  activation memory, so the pool costs about one largest-decode step. That, with the shared
  hidden-state buffer, is reserved in the KV memory plan (`graph_memory_reserve_bytes`) before the
  pool is sized.
- Only backends whose launches depend on device data alone can be captured: the Triton backend
  reads the step through device tables. The torch reference loops over host-side chunk lists,
  so its launches change with the step, and it always runs eagerly. Nor can a model whose forward
  reads device data on the host (mixture-of-experts off torch's device-only grouped GEMM: see
  engine/models/moe.py); the engine names why as `capture_blocker`.
- A capture that fails (a kernel or op that capture rejects, an error on the device) turns
  graphs off rather than stopping start-up: the partial graphs are dropped, every decode step
  runs eagerly, and the start-up report says why (`GraphPlan.capture_failed`). Eager steps need
  nothing a graph holds, so an engine that cannot capture still serves.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from tokenloom.engine.attention.metadata import AttentionMetadata, VarlenTables
from tokenloom.engine.runner.step_buffers import StepBuffers

# Backends (by [model] attention_backend name) whose forward is a fixed launch sequence for a
# given batch size.
GRAPH_CAPTURABLE_BACKENDS = frozenset({"triton"})
# Per captured graph, beyond the shared pool: the executable graph's kernel parameters and nodes.
GRAPH_OVERHEAD_BYTES = 4 * 2**20


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """Whether decode steps run as graphs here, and over which batch sizes."""

    batch_sizes: tuple[int, ...]  # ascending; empty when graphs are off
    reason_off: str = ""  # why graphs are off, for the start-up report

    @property
    def enabled(self) -> bool:
        return bool(self.batch_sizes)

    def output_buffer_shape(self, hidden_size: int) -> tuple[int, int]:
        """The one buffer all graphs write their final hidden states to: [largest bucket, hidden_size]."""
        return (self.batch_sizes[-1], hidden_size)

    def capture_failed(self, error: BaseException) -> GraphPlan:
        """The plan in force after capturing this one raised `error`: graphs off, with the reason."""
        detail = " ".join(str(error).split())[:300] or "no message"
        return GraphPlan((), f"capture failed with {type(error).__name__}: {detail}; decode steps run eagerly")

    def describe(self) -> str:
        if not self.enabled:
            return f"CUDA graphs: off ({self.reason_off})"
        return (
            f"CUDA graphs: on for decode steps, {len(self.batch_sizes)} batch sizes "
            f"({', '.join(map(str, self.batch_sizes))}); prefill steps and larger batches run eagerly"
        )


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return tuple(sizes)


def bucket_for(num_seqs: int, batch_sizes: tuple[int, ...]) -> int | None:
    """The smallest captured batch size that holds `num_seqs` decodes; None beyond the largest."""
    index = bisect.bisect_left(batch_sizes, num_seqs)
    return batch_sizes[index] if index < len(batch_sizes) else None


def plan_graphs(
    device: torch.device, backend_name: str, enforce_eager: bool, max_num_seqs: int, capture_blocker: str | None = None
) -> GraphPlan:
    """`capture_blocker`: why the model's own forward cannot be captured here (None: nothing in it
    stops a capture), e.g. engine/models/moe.py's `moe_graph_blocker`."""
    if device.type != "cuda":
        return GraphPlan((), f"{device.type} device")
    if enforce_eager:
        return GraphPlan((), "[model] enforce_eager = true")
    if backend_name not in GRAPH_CAPTURABLE_BACKENDS:
        return GraphPlan((), f"the {backend_name} attention backend launches per chunk from the host")
    if capture_blocker is not None:
        return GraphPlan((), capture_blocker)
    return GraphPlan(graph_batch_sizes(max_num_seqs))


def graph_memory_reserve_bytes(
    plan: GraphPlan, largest_decode_activation_bytes: int, hidden_size: int, dtype: torch.dtype
) -> int:
    """Device memory to keep out of the KV pool for the graphs: the shared pool holds the largest
    bucket's activations up to the final hidden states (smaller buckets reuse it), plus the one
    hidden-state buffer all graphs write, plus each graph's own bookkeeping. No logits: the LM head
    runs eagerly, within the eager step's own reserve."""
    if not plan.enabled:
        return 0
    rows, hidden = plan.output_buffer_shape(hidden_size)
    return (
        largest_decode_activation_bytes + rows * hidden * dtype.itemsize + len(plan.batch_sizes) * GRAPH_OVERHEAD_BYTES
    )


class DecodeGraphs:
    """The captured graphs of one model runner, and their replay."""

    def __init__(self, plan: GraphPlan, buffers: StepBuffers | None):
        self.plan = plan
        self.batch_sizes = plan.batch_sizes
        self.buffers = buffers
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # [largest bucket, hidden_size] final hidden states, shared: bucket b's graph writes rows [:b].
        self._hidden: torch.Tensor | None = None

    def bucket_for_step(self, num_chunks: int, all_single_token_sampled: bool) -> int | None:
        if not all_single_token_sampled or not self._graphs:
            return None
        return bucket_for(num_chunks, self.batch_sizes)

    def capture(self, model, kv_caches, backend) -> None:
        """Capture every bucket, largest first. Raises on any failure; `release` then frees what was captured."""
        if self.buffers is None:
            raise RuntimeError("decode graphs read their inputs from the CUDA step buffers, and this runner has none")
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # Inference mode throughout: the forward's outputs and the shared buffer are inference
        # tensors, which may be written in place (the captured copy) only in inference mode.
        with torch.inference_mode():
            for batch_size in sorted(self.batch_sizes, reverse=True):
                # Padding-only inputs: every row writes nothing and attends to nothing.
                inputs = self.buffers.pack([], [], [], [], [], [], 0, pad_to=batch_size)
                torch.cuda.synchronize()
                metadata = self._static_metadata(batch_size)
                args = (inputs.input_ids, inputs.positions, kv_caches, metadata, backend, inputs.sample_indices)
                # Warm-up on a side stream, as torch requires before capture (kernels compile here).
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    warm = model.hidden_states(*args)  # [batch_size, hidden_size]
                torch.cuda.current_stream().wait_stream(stream)
                if self._hidden is None:  # the largest bucket comes first: its shape, the model's dtype
                    self._hidden = torch.empty(
                        self.plan.output_buffer_shape(warm.shape[1]), dtype=warm.dtype, device=warm.device
                    )
                del warm
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._hidden[:batch_size].copy_(model.hidden_states(*args))
                self._graphs[batch_size] = graph
        torch.cuda.synchronize()

    def release(self) -> None:
        """Drop every graph and the shared output buffer (after a failed capture: nothing replays them)."""
        self._graphs.clear()
        self._hidden = None

    def _static_metadata(self, batch_size: int) -> AttentionMetadata:
        assert self.buffers is not None  # capture checked
        d = self.buffers.device
        tables = VarlenTables(
            query_start=d.query_start[: batch_size + 1],
            context_lens=d.context_lens[:batch_size],
            block_table=self.buffers.block_table[:batch_size],
            max_query_len=1,
        )
        return AttentionMetadata(
            slot_mapping=d.slot_mapping[:batch_size], num_decodes=batch_size, chunks=[], tables=tables
        )

    def replay(self, batch_size: int, num_rows: int) -> torch.Tensor:
        """Run the bucket's graph on the packed inputs: the final hidden states of the step's own
        rows, [num_rows, hidden_size] (valid until the next replay), for the LM head to finish."""
        self._graphs[batch_size].replay()
        assert self._hidden is not None  # captured with the graphs
        return self._hidden[:num_rows]
