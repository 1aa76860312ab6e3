"""How much GPU memory one step's activations take, measured before the KV pool is sized.

vLLM's approach: after the weights are loaded, run a forward pass of the largest step the
scheduler can plan (`largest_step`) on a throw-away pool, then sample its logits the most
expensive way a request can ask for (top-k, top-p, a repetition penalty, 20 logprobs), read the
CUDA allocator's peak, and leave that much free when the KV pool takes the rest of
`gpu_memory_utilization`. Without it the pool would take memory the first big step needs, and
that step would fail with "CUDA out of memory".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext
from tokenloom.engine.models.decoder import DecoderModel
from tokenloom.engine.runner.cuda_graphs import GraphPlan, graph_memory_reserve_bytes
from tokenloom.engine.runner.model_runner import ModelRunner
from tokenloom.engine.sample.sampler import Sampler, SamplingRow
from tokenloom.engine.sample.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenloom.engine.config import SchedulerConfig
    from tokenloom.engine.runner.model_setup import LoadedModel

# The costliest sampling a request can ask for: a full-vocabulary sort (top-p without top-k; with a
# top-k only the k best are sorted) under a top-k mask (another row's), a seen-token mask
# (repetition penalty) and the most logprobs an API accepts. Rows alternate between the two.
_WORST_CASE_PARAMS = (
    SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1, logprobs=20),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, logprobs=20),
)


@dataclass(frozen=True, slots=True)
class ProfileStep:
    """A prefill-only step the profile runs: fresh sequences, each from position 0."""

    seq_lens: tuple[int, ...]  # prompt tokens of each sequence
    num_sampled: int  # rows whose logits are computed and sampled (the step's last rows)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)


def largest_step(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> ProfileStep:
    """The step with the most activation memory the scheduler can plan.

    Its token count is what one step can take (max_num_batched_tokens), unless max_num_seqs
    sequences of max_model_len tokens hold fewer. The tokens go into as few sequences as
    possible (full max_model_len chunks, then the rest): activations grow with the tokens, and
    attention's per-chunk work with a chunk's length. Its sampled rows are the most any step
    samples, one per sequence of a step of max_num_seqs prompts: not this layout's own count, so
    that the worst token count and the worst sampling are measured together.
    """
    num_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    num_full, rest = divmod(num_tokens, max_model_len)
    seq_lens = (max_model_len,) * num_full + ((rest,) if rest else ())
    return ProfileStep(seq_lens, num_sampled=min(num_tokens, max_num_seqs))


def largest_decode_step(max_num_seqs: int) -> ProfileStep:
    """The step the largest CUDA graph captures: `max_num_seqs` one-token decodes.

    Its activations are those of as many prefill tokens, but as decodes every position is 0, so the
    profile never reads a RoPE row past max_model_len, however max_num_seqs compares to the
    model's max_position_embeddings; and the attention kernel runs its decode tile, the one the
    graphs replay.
    """
    return ProfileStep((1,) * max_num_seqs, num_sampled=max_num_seqs)


def profile_inputs(
    step: ProfileStep, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, sample indices, metadata) of `step`, each sequence in its own
    consecutive blocks of a pool of `profile_num_blocks(step, block_size)` blocks."""
    positions: list[int] = []
    slots: list[int] = []
    chunks: list[ChunkContext] = []
    first_block = 0
    for seq_len in step.seq_lens:
        num_blocks = -(-seq_len // block_size)
        chunks.append(
            ChunkContext(
                len(positions),
                seq_len,
                seq_len,
                list(range(first_block, first_block + num_blocks)),
                first_block * block_size,
            )
        )
        positions.extend(range(seq_len))
        slots.extend(range(first_block * block_size, first_block * block_size + seq_len))
        first_block += num_blocks
    num_tokens = len(positions)
    metadata = AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), num_decodes=0, chunks=chunks)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    sample_indices = torch.arange(num_tokens - step.num_sampled, num_tokens, device=device)
    return ids, torch.tensor(positions, device=device), sample_indices, metadata


def profile_num_blocks(step: ProfileStep, block_size: int) -> int:
    return sum(-(-seq_len // block_size) for seq_len in step.seq_lens)


class ProfiledSpan(Enum):
    """How much of a step a measurement runs."""

    WHOLE_STEP = "the forward, the LM head and the costliest sampling: an eager step"
    GRAPH_BODY = "the forward up to the final hidden states: what a CUDA graph captures"


def peak_step_activation_bytes(
    model: DecoderModel,
    backend,
    step: ProfileStep,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    span: ProfiledSpan = ProfiledSpan.WHOLE_STEP,
) -> int:
    """Peak bytes allocated above the current level by `span` of one run of `step` (CUDA only; 0 elsewhere)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_profile_step(model, backend, step, block_size, device, dtype, span)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    torch.cuda.empty_cache()
    return max(peak, 0)


def run_profile_step(
    model: DecoderModel,
    backend,
    step: ProfileStep,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    span: ProfiledSpan = ProfiledSpan.WHOLE_STEP,
) -> None:
    """`span` of one run of `step` on a throw-away KV pool (any device: the measuring is the caller's)."""
    runner = ModelRunner(model, profile_num_blocks(step, block_size), block_size, backend, device, dtype)
    ids, positions, sample_indices, metadata = profile_inputs(step, block_size, device)
    with torch.inference_mode():
        args = (ids, positions, runner.kv_caches, metadata, backend, sample_indices)
        if span is ProfiledSpan.GRAPH_BODY:
            runner.model.hidden_states(*args)
        else:
            output = runner.model(*args)
            rows = [SamplingRow(i, _WORST_CASE_PARAMS[i % 2], [0], 1) for i in range(step.num_sampled)]
            Sampler(device).sample(output.float(), rows)


def reserved_device_bytes(
    loaded: LoadedModel, backend, scheduler: SchedulerConfig, block_size: int, max_model_len: int, graph_plan: GraphPlan
) -> int:
    """Device memory the KV pool must leave free (CUDA; 0 elsewhere): the largest step's
    activations and sampler temporaries, plus the CUDA graphs' pool."""
    step = largest_step(scheduler.max_num_batched_tokens, max_model_len, scheduler.max_num_seqs)
    reserved = peak_step_activation_bytes(loaded.model, backend, step, block_size, loaded.device, loaded.dtype)
    if graph_plan.enabled:
        reserved += graph_memory_reserve_bytes(
            graph_plan,
            peak_step_activation_bytes(
                loaded.model,
                backend,
                largest_decode_step(graph_plan.batch_sizes[-1]),
                block_size,
                loaded.device,
                loaded.dtype,
                span=ProfiledSpan.GRAPH_BODY,
            ),
            loaded.shape.hidden_size,
            loaded.dtype,
        )
    return reserved
