"""Turns a scheduler plan into flat tensors and runs ONE forward pass for the whole packed step.

On CUDA (when the engine gives `step_limits`) the step's inputs go to the device through the
persistent pinned buffers of engine/runner/step_buffers.py in one copy, and decode-only steps replay a
CUDA graph (engine/runner/cuda_graphs.py) when a plan of graphs is given and captured; the graph stops at
the final hidden states, and the LM head runs after it. On a CPU the inputs are plain tensors built from
the step's lists.
"""

from __future__ import annotations

import logging

import torch

from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext, VarlenTables
from tokenloom.engine.core.prompt_scoring import scored_positions
from tokenloom.engine.core.scheduler import SchedulerOutput
from tokenloom.engine.models.decoder import DecoderModel
from tokenloom.engine.runner.copy_fence import copy_fence_for
from tokenloom.engine.runner.cuda_graphs import DecodeGraphs, GraphPlan
from tokenloom.engine.runner.step_buffers import StepBuffers, StepLimits
from tokenloom.engine.runner.step_logits import StepLogits
from tokenloom.engine.runner.swap_copier import SwapCopier

log = logging.getLogger("tokenloom.engine")


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        backend,
        device: torch.device,
        dtype: torch.dtype,
        num_swap_blocks: int = 0,
        step_limits: StepLimits | None = None,
    ):
        self.model = model
        self._logits_buffer: torch.Tensor | None = None  # see _as_float32
        self.block_size = block_size
        self.backend = backend
        self.device = device
        shape = model.shape
        # One pool per layer, K and V: [num_blocks, block_size, num_kv_heads, head_dim].
        pool = torch.zeros(
            shape.num_layers,
            2,
            num_blocks,
            block_size,
            shape.num_kv_heads,
            shape.head_dim,
            dtype=dtype,
            device=device,
        )
        self.kv_caches = [(pool[i, 0], pool[i, 1]) for i in range(shape.num_layers)]
        self.pool = pool
        # Host copy target for swapped-out sequences, block-major (engine/runner/swap_copier.py); pinned on
        # CUDA so copies are DMA; torch.empty: on a CPU the OS commits pages only when a swap writes them.
        self.host_pool = (
            None
            if not num_swap_blocks
            else torch.empty(
                num_swap_blocks,
                shape.num_layers,
                2,
                block_size,
                shape.num_kv_heads,
                shape.head_dim,
                dtype=dtype,
                pin_memory=device.type == "cuda",
            )
        )
        self.swaps = None if self.host_pool is None else SwapCopier(pool, self.host_pool, copy_fence_for(device))
        self.step_buffers = None
        if step_limits is not None and device.type == "cuda":
            self.step_buffers = StepBuffers(step_limits, device, copy_fence_for(device))
        self.graphs: DecodeGraphs | None = None

    def capture_graphs(self, plan: GraphPlan) -> GraphPlan:
        """Capture the decode graphs of `plan`; the plan in force: `plan`, or graphs off with the reason
        when capture fails (engine/runner/cuda_graphs.py), in which case every step runs eagerly."""
        if not plan.enabled:
            return plan
        graphs = DecodeGraphs(plan, self.step_buffers)
        try:
            graphs.capture(self.model, self.kv_caches, self.backend)
        except Exception as error:  # any failure of capture leaves eager steps, which need no graph
            graphs.release()
            _settle_device(self.device)
            fallback = plan.capture_failed(error)
            log.warning("%s", fallback.describe(), exc_info=True)
            return fallback
        self.graphs = graphs
        return plan

    def copy_swaps(self, plan: SchedulerOutput) -> None:
        """The plan's swap copies, which must precede its forward pass. Split from `forward` so
        that a failed forward can be re-run chunk by chunk (engine.py) without copying twice."""
        if not (plan.swap_out or plan.swap_in):
            return
        if self.swaps is None:  # the scheduler swaps only when the engine gave it swap blocks
            raise RuntimeError("plan swaps blocks, but this runner has no host swap space")
        if plan.swap_out:
            self.swaps.swap_out(plan.swap_out)
        if plan.swap_in:
            self.swaps.swap_in(plan.swap_in)

    def forward(self, plan: SchedulerOutput) -> StepLogits:
        """The forward pass of `plan`'s chunks (swaps already copied): logits of the sampled chunks
        and of the positions that score a prompt (engine/core/prompt_scoring.py).

        Each chunk writes only its own KV slots (positions start..end), so running a chunk again
        after a failed pass rewrites the same slots with the same values."""
        bucket = None
        num_sampled = sum(1 for c in plan.chunks if c.samples)
        graphs = self.graphs
        if graphs is not None:
            bucket = graphs.bucket_for_step(len(plan.chunks), all(c.num_tokens == 1 and c.samples for c in plan.chunks))
        input_ids, positions, sample_indices, metadata = self.prepare(plan, pad_to=bucket)
        if graphs is not None and bucket is not None:  # decodes only: nothing scores a prompt
            hidden = graphs.replay(bucket, len(plan.chunks))  # [num_chunks, hidden_size]; padding rows left out
            return StepLogits(self._as_float32(self.model.compute_logits(hidden)), None, self.model.compute_logits)
        # The LM head runs on the sampled rows only; the rows scoring a prompt keep their hidden
        # states, whose logits engine/sample/prompt_logprobs.py computes a slice at a time.
        hidden = self.model.hidden_states(input_ids, positions, self.kv_caches, metadata, self.backend, sample_indices)
        sampled = self._as_float32(self.model.compute_logits(hidden[:num_sampled]))
        scored = hidden[num_sampled:] if hidden.shape[0] > num_sampled else None
        return StepLogits(sampled, scored, self.model.compute_logits)

    def _as_float32(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits in float32, in a buffer reused by every step: VALID UNTIL THE NEXT FORWARD.

        A fresh float32 tensor per step (12 MB at 64 rows of a 49K vocabulary) is fresh memory
        for the OS to fault in on every step; a reused buffer is faulted in once. Callers that keep
        logits across forwards clone them.
        """
        if logits.dtype == torch.float32:
            return logits
        rows, vocab = logits.shape
        buffer = self._logits_buffer
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != vocab or buffer.device != logits.device:
            buffer = self._logits_buffer = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
        out = buffer[:rows]
        out.copy_(logits)
        return out

    def prepare(self, plan: SchedulerOutput, pad_to: int | None = None):
        """(input ids, positions, logit rows, metadata) of the step; `pad_to` (a graph's batch
        size, step buffers only) pads a decode-only step with decodes that write nothing. The logit
        rows are the sampled chunks' last positions, then the positions scoring a prompt."""
        block_size = self.block_size
        # Only backends that read a contiguous context as a view of the pool use the chunk's first
        # slot; finding it walks the chunk's block list, which the Triton backend never needs.
        find_contiguous = self.backend.prefers_contiguous_blocks
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_indices: list[int] = []
        scored_rows: list[int] = []
        contexts: list[ChunkContext] = []
        for chunk in plan.chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.end
            table = seq.block_table
            offset = len(token_ids)
            token_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            if chunk.samples:
                sample_indices.append(offset + chunk.num_tokens - 1)
            scored_rows.extend(offset + p - start for p in scored_positions(seq, start, end))
            context_blocks = table[: -(-end // block_size)]
            contiguous_start = _contiguous_start(context_blocks, block_size) if find_contiguous else None
            contexts.append(ChunkContext(offset, chunk.num_tokens, end, context_blocks, contiguous_start))
        num_decodes = sum(1 for c in plan.chunks if c.num_tokens == 1)
        sample_indices += scored_rows
        if self.step_buffers is not None:
            seq_ids = [chunk.seq.seq_id for chunk in plan.chunks]
            inputs = self.step_buffers.pack(
                token_ids, positions, slots, sample_indices, contexts, seq_ids, num_decodes, pad_to
            )
            return inputs.input_ids, inputs.positions, inputs.sample_indices, inputs.metadata
        tables = None
        # Only kernels that take the whole step in one launch read the device-side tables; the
        # torch reference walks `chunks` on the host and has no `needs_varlen_tables` attribute.
        if self.backend.needs_varlen_tables:
            tables = VarlenTables.build(contexts, self.device)
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decodes=num_decodes,
            chunks=contexts,
            tables=tables,
        )
        return self._tensor(token_ids), self._tensor(positions), self._tensor(sample_indices), metadata

    def _tensor(self, values, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)


def _settle_device(device: torch.device) -> None:
    """After a failed capture: wait for the device and return the failed graphs' memory to it. An
    error that poisoned the CUDA context shows again at the first eager step, where it fails requests."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    except RuntimeError:
        pass


def _contiguous_start(blocks: list[int], block_size: int) -> int | None:
    first = blocks[0]
    if blocks[-1] - first != len(blocks) - 1 or any(b != first + i for i, b in enumerate(blocks)):
        return None
    return first * block_size
