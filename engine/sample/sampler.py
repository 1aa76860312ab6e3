"""Batched token sampler: logits processors, greedy/random selection and logprobs.

One `Sampler.sample` call picks one token for every row of a `[num_rows, vocab]` logits
tensor. The order of operations follows vLLM / OpenAI semantics:

1. logits -> float32 (the caller's tensor is never modified);
2. min_tokens: eos_token_ids and stop_token_ids -> -inf while the row's output is shorter
   than `params.min_tokens`;
   logit_bias: the request's additive bias per token id (OpenAI's, before any penalty);
3. repetition_penalty (HF style) over every token in prompt + output: positive logits are
   divided by the penalty, negative ones multiplied;
4. frequency / presence penalty (OpenAI) over OUTPUT tokens only:
   `logits -= frequency * count + presence * (count > 0)`;
5. greedy rows (temperature == 0, or below 1e-5 where dividing would overflow): argmax of
   the processed logits (first max on ties);
6. random rows: / temperature, top_k and top_p (engine/sample/top_k_top_p.py), min_p, then the
   exponential race `argmax(probs / Exponential(1))`, which samples exactly from `probs`.

Steps 2-4 only run when some row in the batch needs them (fast path otherwise). Between 4 and 5,
rows under a structured-output constraint get every token their grammar forbids set to -inf
(the engine passes the step's token bitmask; no bitmask, no work).

Noise for a row whose `params.seed` is set comes from that sequence's own
`torch.Generator` (one `[vocab]` draw per sampled token), so a seeded sequence produces
the same tokens whatever else is in the batch. Unseeded rows share one engine-level
generator seeded from `Sampler(seed=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.engine.cpu import row_argmax
from tokenloom.engine.sample.pinned_copy import list_to_device, tensor_to_device
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.engine.sample.top_k_top_p import apply_top_k_top_p

# Temperatures below this are treated as greedy: dividing by them overflows float32.
_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingRow:
    """One sequence that gets a token this step."""

    seq_id: int
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (penalties read this)
    num_prompt_tokens: int
    # Blocked (together with params.stop_token_ids) while output length < params.min_tokens.
    eos_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-N (token_id, logprob), highest first


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row, in row order
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


@dataclass(slots=True)
class TokenConstraint:
    """Rows `rows` of the step may only take the tokens set in their row of `bitmask`."""

    rows: list[int]
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)], packed as xgrammar packs it

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` [B, V] with the forbidden tokens of the constrained rows at -inf."""
        vocab = logits.shape[1]
        allowed = unpack_bitmask(tensor_to_device(self.bitmask, logits.device), vocab)  # [C, V]
        index = list_to_device(self.rows, torch.long, logits.device)  # [C]
        constrained = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))  # [C, V]
        return logits.index_copy(0, index, constrained)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] packed bitmask -> bool [R, vocab_size] (True = allowed); bit b of word w is token 32w + b."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _padded_flat_index(
    num_rows: int, vocab: int, device: torch.device, rows: list[int], toks: list[int]
) -> torch.Tensor:
    """Flat indices [P] of (rows[i], toks[i]) into a [num_rows, vocab + 1] tensor whose spare last
    column takes every token outside the vocabulary: they are dropped by slicing it off, where
    filtering them out with a mask would make the host wait for the device (nonzero)."""
    r = list_to_device(rows, torch.long, device)  # [P]
    t = list_to_device(toks, torch.long, device)  # [P]
    t = torch.where((t >= 0) & (t < vocab), t, vocab)
    return r * (vocab + 1) + t


def _scatter_mask(shape: tuple[int, int], device: torch.device, rows: list[int], toks: list[int]) -> torch.Tensor:
    """Bool [num_rows, vocab] that is True at every (rows[i], toks[i]) with 0 <= tok < vocab."""
    num_rows, vocab = shape
    mask = torch.zeros(num_rows * (vocab + 1), dtype=torch.bool, device=device)
    if rows:
        mask.index_fill_(0, _padded_flat_index(num_rows, vocab, device, rows, toks), True)
    return mask.view(num_rows, vocab + 1)[:, :vocab]


def apply_logits_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min_tokens masking, repetition penalty, then frequency/presence penalty.

    `logits` is float32 [num_rows, vocab]; returns a new tensor of the same shape (the input is
    not modified). Returns `logits` itself when no row needs any processor.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    block_rows: list[int] = []
    block_toks: list[int] = []
    rep_rows: list[int] = []
    rep_toks: list[int] = []
    out_rows: list[int] = []
    out_toks: list[int] = []
    bias_rows: list[int] = []
    bias_toks: list[int] = []
    bias_values: list[float] = []
    rep = [1.0] * num_rows
    freq = [0.0] * num_rows
    pres = [0.0] * num_rows
    for i, row in enumerate(rows):
        p = row.params
        if p.min_tokens and len(row.token_ids) - row.num_prompt_tokens < p.min_tokens:
            blocked = set(row.eos_token_ids) | set(p.stop_token_ids)
            block_rows.extend([i] * len(blocked))
            block_toks.extend(blocked)
        if p.logit_bias:
            bias_rows.extend([i] * len(p.logit_bias))
            bias_toks.extend(p.logit_bias)
            bias_values.extend(p.logit_bias.values())
        if p.repetition_penalty != 1.0:
            rep[i] = p.repetition_penalty
            rep_rows.extend([i] * len(row.token_ids))
            rep_toks.extend(row.token_ids)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            freq[i] = p.frequency_penalty
            pres[i] = p.presence_penalty
            out = row.token_ids[row.num_prompt_tokens :]
            out_rows.extend([i] * len(out))
            out_toks.extend(out)
    if not (block_rows or rep_rows or out_rows or bias_rows):
        return logits

    if block_rows:
        logits = logits.masked_fill(_scatter_mask((num_rows, vocab), device, block_rows, block_toks), float("-inf"))
    if bias_rows:  # token ids were checked against the vocabulary when the request was added
        r = list_to_device(bias_rows, torch.long, device)  # [P]
        t = list_to_device(bias_toks, torch.long, device)  # [P]
        logits = logits.index_put((r, t), list_to_device(bias_values, torch.float32, device), accumulate=True)
    if rep_rows:
        seen = _scatter_mask((num_rows, vocab), device, rep_rows, rep_toks)  # [B, V]
        penalty = list_to_device(rep, torch.float32, device).unsqueeze(1)  # [B, 1]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # [B, V]
        logits = torch.where(seen, penalised, logits)
    if out_rows:
        flat = _padded_flat_index(num_rows, vocab, device, out_rows, out_toks)  # [P]
        counts = torch.zeros(num_rows * (vocab + 1), dtype=torch.float32, device=device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        counts = counts.view(num_rows, vocab + 1)[:, :vocab]  # [B, V]
        f = list_to_device(freq, torch.float32, device).unsqueeze(1)  # [B, 1]
        pr = list_to_device(pres, torch.float32, device).unsqueeze(1)  # [B, 1]
        logits = logits - f * counts - pr * (counts > 0).to(torch.float32)
    return logits


class Sampler:
    """Picks one token per row; owns the per-sequence generators for seeded requests."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0):
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._seq_generators: dict[int, torch.Generator] = {}

    def add_sequence(self, seq_id: int, params: SamplingParams) -> None:
        """Register a sequence; creates its own generator when `params.seed` is set."""
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._seq_generators[seq_id] = gen

    def remove_sequence(self, seq_id: int) -> None:
        self._seq_generators.pop(seq_id, None)

    def _generator_for(self, row: SamplingRow) -> torch.Generator:
        gen = self._seq_generators.get(row.seq_id)
        if gen is None:  # seeded row that was never registered: create it lazily
            self.add_sequence(row.seq_id, row.params)
            gen = self._seq_generators[row.seq_id]
        return gen

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], constraint: "TokenConstraint | None" = None
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [num_rows, vocab] (any float dtype); `constraint`
        limits some rows to the tokens their grammar allows.

        Logprobs (when `params.logprobs` is not None) are the log_softmax of the RAW model
        logits, before min_tokens masking, penalties, temperature and top-k/top-p/min-p: they
        describe the model's distribution, not the filtered one the token was drawn from
        (this matches vLLM's default "raw_logprobs" mode and stays finite for filtered tokens).
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [{len(rows)}, vocab], got {tuple(logits.shape)}")
        num_rows, vocab = logits.shape
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        raw = logits.to(device=self.device, dtype=torch.float32)  # [B, V]; never written to
        processed = apply_logits_processors(raw, rows)  # [B, V]
        if constraint is not None:
            processed = constraint.apply(processed)

        random_idx = [i for i, r in enumerate(rows) if r.params.temperature >= _GREEDY_EPS]
        if len(random_idx) == num_rows:
            chosen = self._sample_random(processed, rows)  # [B]
        else:
            # Greedy for everyone; random rows are overwritten below.
            chosen = row_argmax(processed)  # [B]
            if random_idx:
                index = list_to_device(random_idx, torch.long, processed.device)  # [R]
                sampled = self._sample_random(processed.index_select(0, index), [rows[i] for i in random_idx])
                chosen.index_copy_(0, index, sampled)

        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return SamplerOutput(token_ids=chosen.tolist(), logprobs=[None] * num_rows)
        # The chosen ids and the logprob tensors come back to the host together: one wait for the device.
        chosen_host, *logprob_host = _to_host(chosen, *_logprob_tensors(raw, rows, want, chosen))
        token_ids = chosen_host.tolist()
        return SamplerOutput(token_ids=token_ids, logprobs=_token_logprobs(rows, want, token_ids, *logprob_host))

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits [R, V] (processed) -> sampled token ids [R]."""
        num_rows, vocab = logits.shape
        device = logits.device
        params = [r.params for r in rows]
        temp = list_to_device([p.temperature for p in params], torch.float32, device)
        logits = logits / temp.unsqueeze(1)  # [R, V]

        logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])

        probs = logits.softmax(dim=1)  # [R, V]
        if any(p.min_p > 0.0 for p in params):
            min_p = list_to_device([p.min_p for p in params], torch.float32, device).unsqueeze(1)  # [R, 1]
            threshold = min_p * probs.amax(dim=1, keepdim=True)  # [R, 1]
            probs = probs.masked_fill(probs < threshold, 0.0)  # unnormalised is fine below

        # Exponential race: argmax(p_i / E_i), E_i ~ Exp(1), picks i with probability p_i.
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if len(unseeded) == num_rows:
            noise = torch.empty_like(probs).exponential_(generator=self._generator)  # [R, V]
        else:
            noise = torch.empty_like(probs)  # [R, V]
            if unseeded:
                noise.index_copy_(
                    0,
                    list_to_device(unseeded, torch.long, device),
                    torch.empty((len(unseeded), vocab), dtype=torch.float32, device=device).exponential_(
                        generator=self._generator
                    ),
                )
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                noise[i] = torch.empty(vocab, dtype=torch.float32, device=device).exponential_(
                    generator=self._generator_for(row)
                )
        noise.clamp_(min=torch.finfo(torch.float32).tiny)  # avoid 0/0 on filtered tokens
        return (probs / noise).argmax(dim=1)  # [R]


def _logprob_tensors(raw: torch.Tensor, rows: list[SamplingRow], want: list[int], chosen: torch.Tensor):
    """raw [B, V] float32 model logits -> (chosen logprobs [W], top logprobs [W, N], top ids [W, N])
    for the rows `want` that asked for logprobs; still on the logits' device."""
    if len(want) < raw.shape[0]:
        index = list_to_device(want, torch.long, raw.device)  # [W]
        raw, chosen = raw.index_select(0, index), chosen.index_select(0, index)
    logprobs = raw.log_softmax(dim=1)  # [W, V]
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)  # [W]
    # `want` holds only the rows that asked for logprobs (Sampler.sample), so the filter drops nothing.
    asked = [n for n in (rows[i].params.logprobs for i in want) if n is not None]
    n_max = min(max(asked), raw.shape[1])
    top_lp, top_ids = logprobs.topk(n_max, dim=1)  # [W, N], sorted highest first
    return chosen_lp, top_lp, top_ids


def _token_logprobs(
    rows: list[SamplingRow],
    want: list[int],
    token_ids: list[int],
    chosen_lp: torch.Tensor,
    top_lp: torch.Tensor,
    top_ids: torch.Tensor,
) -> list[TokenLogprobs | None]:
    """Per-row TokenLogprobs (None where not asked) from host tensors."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    chosen_lp_l, top_lp_l, top_ids_l = chosen_lp.tolist(), top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(want):
        n = rows[i].params.logprobs
        out[i] = TokenLogprobs(
            token_id=token_ids[i],
            logprob=chosen_lp_l[j],
            top=list(zip(top_ids_l[j][:n], top_lp_l[j][:n], strict=True)),  # one topk's ids and values
        )
    return out


def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the host. On CUDA every copy is queued non-blocking and the host waits once,
    instead of once per tensor."""
    if tensors[0].device.type != "cuda":
        return list(tensors)
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host
