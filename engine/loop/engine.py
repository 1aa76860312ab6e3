"""The offline engine: add requests, step, read outputs. No Celery, SQL or HTTP in here.

One step is: schedule -> one packed forward -> sample -> append tokens and stop-check.

A failure inside a step fails only the requests it hits (finish_reason "error", `RequestOutput.error`
says why) and frees their KV blocks; the engine carries on with the rest. When the packed forward
raises, each chunk is re-run alone to find which requests fail (engine/runner/step_isolation.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from tokenloom.engine.attention.selection import select_backend
from tokenloom.engine.config import EngineConfig
from tokenloom.engine.core.block_pool import BlockPool
from tokenloom.engine.core.counters import EngineCounters
from tokenloom.engine.core.kv_cache_manager import KVCacheManager
from tokenloom.engine.core.prompt_scoring import scored_positions
from tokenloom.engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from tokenloom.engine.core.seat_share import guaranteed_seats
from tokenloom.engine.core.sequence import FinishReason, Sequence, SequenceTimes
from tokenloom.engine.core.swap_space import SwapSpace
from tokenloom.engine.cpu import keep_step_buffers_in_heap
from tokenloom.engine.inputs.context_fit import fit_to_context
from tokenloom.engine.loop.request_state import RequestState
from tokenloom.engine.models.moe import moe_graph_blocker
from tokenloom.engine.outputs.detokenizer import IncrementalDetokenizer
from tokenloom.engine.outputs.logprob_tokens import TokenSpeller, speller_for
from tokenloom.engine.outputs.outputs import RequestMetrics, RequestOutput
from tokenloom.engine.runner.cuda_graphs import plan_graphs
from tokenloom.engine.runner.device import kv_cache_dtype
from tokenloom.engine.runner.kv_plan import plan_kv_pool
from tokenloom.engine.runner.memory_profile import reserved_device_bytes
from tokenloom.engine.runner.model_runner import ModelRunner
from tokenloom.engine.runner.model_setup import LoadedModel, load_for_config, startup_report
from tokenloom.engine.runner.step_buffers import StepLimits
from tokenloom.engine.runner.step_isolation import describe_error, forward_isolating
from tokenloom.engine.runner.step_logits import StepLogits
from tokenloom.engine.sample.prompt_logprobs import prompt_token_logprobs
from tokenloom.engine.sample.sampler import Sampler, SamplerOutput, SamplingRow
from tokenloom.engine.sample.sampling_params import InvalidRequestError, SamplingParams
from tokenloom.engine.structured_output.guided_sequences import GuidedSequences
from tokenloom.engine.testing.fault_injection import FaultInjector

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tokenloom.engine")


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, faults: FaultInjector | None = None):
        self.config = config
        self.loaded = loaded or load_for_config(config.model, quantization=config.quantization)
        if self.loaded.device.type == "cpu":
            keep_step_buffers_in_heap()  # no page faults for each step's tensors (engine/cpu/malloc.py)
        self.max_model_len = self.loaded.max_model_len
        device = self.loaded.device
        # [scheduler] limits left at 0 (auto) take the device's defaults; self.config holds the result.
        self.config = config = replace(config, scheduler=config.scheduler.resolved_for(device.type))
        self.backend = select_backend(config.model, device, self.loaded.dtype)
        self.kv_dtype = kv_cache_dtype(self.loaded.dtype, device, self.backend.name)
        planned_graphs = plan_graphs(
            device,
            self.backend.name,
            config.model.enforce_eager,
            config.scheduler.max_num_seqs,
            capture_blocker=moe_graph_blocker(self.loaded.shape.moe, device, self.loaded.dtype),
        )
        self.kv_plan = plan_kv_pool(
            config.kv_cache,
            self.loaded.shape,
            self.kv_dtype,
            device,
            self.max_model_len,
            config.scheduler.max_num_seqs,
            activation_bytes=reserved_device_bytes(
                self.loaded,
                self.backend,
                config.scheduler,
                config.kv_cache.block_size,
                self.max_model_len,
                planned_graphs,
            ),
        )
        pool = BlockPool(
            self.kv_plan.num_blocks,
            config.kv_cache.enable_prefix_caching,
            prefer_contiguous=self.backend.prefers_contiguous_blocks,
        )
        self.kv_manager = KVCacheManager(pool, self.kv_plan.block_size)
        self.scheduler = Scheduler(
            self.kv_manager,
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            swap=SwapSpace(self.kv_plan.num_swap_blocks) if self.kv_plan.num_swap_blocks else None,
            guaranteed_seats_per_class=guaranteed_seats(config.scheduler.max_num_seqs, config.scheduler.min_seat_share),
        )
        self.runner = ModelRunner(
            self.loaded.model,
            self.kv_plan.num_blocks,
            self.kv_plan.block_size,
            self.backend,
            device,
            self.kv_dtype,
            num_swap_blocks=self.kv_plan.num_swap_blocks,
            step_limits=StepLimits(
                max_num_tokens=max(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs),
                max_num_seqs=config.scheduler.max_num_seqs,
                max_blocks_per_seq=-(-self.max_model_len // self.kv_plan.block_size),
            ),
        )
        # A failed capture leaves graphs off, with the reason in the report: eager steps still serve.
        self.graph_plan = self.runner.capture_graphs(planned_graphs)
        self.sampler = Sampler(self.loaded.device, seed=config.model.seed)
        self.counters = EngineCounters()
        d = config.sampling  # fills what a request leaves unset (its max_tokens caps at add_request)
        self.default_params = SamplingParams(
            temperature=d.temperature,
            top_p=d.top_p,
            top_k=d.top_k,
            min_p=d.min_p,
            repetition_penalty=d.repetition_penalty,
            presence_penalty=d.presence_penalty,
            frequency_penalty=d.frequency_penalty,
        )
        self._requests: dict[str, RequestState] = {}
        self._guided: GuidedSequences | None = None  # built by the first structured-output request
        self._seq_ids = itertools.count()
        self.faults = faults or FaultInjector()  # a test hook; inert unless armed
        self._record_token_times = config.metrics.enable_tpot
        backend_label = self.backend.name
        if kernels := self.backend.describe(self.runner.kv_caches[0][0]):  # which kernels the pool gets
            backend_label += f" ({kernels})"
        if self.runner.model.decoder_stack_for(self.backend, self.runner.kv_caches) is not None:
            backend_label += ", decoder layers in one C++ call"
        self.startup_report = startup_report(self.loaded, self.kv_plan, backend_label, self.kv_dtype)
        if device.type == "cuda" or planned_graphs.enabled:
            self.startup_report += (
                f"\n{self.graph_plan.describe()}; batches of up to "
                f"{config.scheduler.max_num_seqs} sequences and {config.scheduler.max_num_batched_tokens} tokens per step"
            )
        log.info("%s", self.startup_report)

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def encode_prompt(self, prompt: str | list[int] | None = None, messages: list | None = None) -> list[int]:
        return self.loaded.encoder.encode_prompt(prompt, messages, self.loaded.shape.vocab_size)

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens dropped (how an echoed token-id prompt reads)."""
        return self.loaded.encoder.decode(token_ids, skip_special_tokens=True)

    def request_params(self, fields: dict) -> SamplingParams:
        """A request's sampling fields over this engine's defaults (the checkpoint's generation
        config, then [sampling]); not validated here: add_request validates what it is given."""
        return SamplingParams.merged(fields, self.default_params)

    @property
    def token_speller(self) -> TokenSpeller:
        """Spells token ids as text and bytes (for stored and streamed logprobs) with this model's tokenizer."""
        return speller_for(self.loaded.encoder.backend)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None = None,
        *,
        messages: list | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
        share_rank: int = 0,
        seat_class: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises InvalidRequestError (nothing queued) when it cannot run. `priority`: lower
        runs first, preempting worse; `share_rank`: order among equal priorities, never a cause to preempt;
        `seat_class`: the class of work whose guaranteed seats it draws from ([scheduler] min_seat_share)."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        params = (params if params is not None else self.default_params).validate()
        prompt_ids = self.encode_prompt(prompt, messages)
        params = self._fit_to_context(params, len(prompt_ids))
        params.check_token_ids(self.loaded.shape.vocab_size)
        grammar = (
            None if params.structured_outputs is None else self._guided_sequences().compile(params.structured_outputs)
        )
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        state = RequestState(request_id, [], [], [])
        for index in range(params.n):
            # Siblings of a seeded request get seed + index, so they are not clones of each other.
            seq_params = replace(params, seed=params.seed + index) if params.seed is not None and index else params
            state.seqs.append(
                Sequence(
                    seq_id=next(self._seq_ids),
                    request_id=request_id,
                    index=index,
                    token_ids=list(prompt_ids),
                    num_prompt_tokens=len(prompt_ids),
                    params=seq_params,
                    times=SequenceTimes(arrival=arrival),
                    priority=priority,
                    share_rank=share_rank,
                    seat_class=seat_class,
                )
            )
            state.detokenizers.append(
                IncrementalDetokenizer(self.loaded.encoder.backend, params.stop, params.skip_special_tokens)
            )
            state.logprobs.append([] if params.logprobs is not None else None)
            state.num_reported_tokens.append(0)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_ids)
        if self.faults.marker is not None:
            self.faults.note_request(request_id, self.loaded.encoder.decode(prompt_ids, skip_special_tokens=False))
        # Registered only once everything above was built, so a failure leaves nothing half-queued.
        for seq in state.seqs:
            self.sampler.add_sequence(seq.seq_id, seq.params)
            if grammar is not None:
                self._guided_sequences().add(seq.seq_id, grammar)
            self.scheduler.add(seq)
        self._requests[request_id] = state

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its final output (partial text kept) or None if unknown."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
        return self._output(state)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> forward -> sample -> outputs (of the requests it touched)."""
        plan = self.scheduler.schedule()
        if plan.is_empty:  # it may still swap out the victims that made room for a swapped sequence
            self.runner.copy_swaps(plan)
            return []
        chunks, logits, outputs = self._forward(plan)
        outputs += self._score_prompts(chunks, logits)
        sampled = [chunk.seq for chunk in chunks if chunk.samples]
        result, sampling_failures = self._sample(sampled, None if logits is None else logits.sampled)
        outputs += sampling_failures + self._append_sampled(sampled, result)
        self._sync_counters()
        return outputs

    def _forward(self, plan: SchedulerOutput) -> tuple[list[ScheduledChunk], StepLogits | None, list[RequestOutput]]:
        """Run the plan: (the chunks that ran, their logits, outputs of requests the forward failed)."""
        now = time.perf_counter()
        for chunk in plan.chunks:
            if chunk.seq.times.admitted is None:
                chunk.seq.times.admitted = now
        # A failed swap copy leaves KV of unknown content: that propagates (EngineHost fails
        # everything in flight). Failures past this point fail only the requests they hit.
        self.runner.copy_swaps(plan)
        self.counters.record_step(plan)
        chunks, logits, failed = forward_isolating(self.runner, self.faults, plan)
        outputs = [o for rid, reason in failed.items() if (o := self._fail_request(rid, reason)) is not None]
        self.scheduler.advance(SchedulerOutput(chunks=chunks, preempted=[]))
        return chunks, logits, outputs

    def _score_prompts(self, chunks: list[ScheduledChunk], logits: StepLogits | None) -> list[RequestOutput]:
        """Record the prompt logprobs the step's scoring rows give, then finish the score-only
        (max_tokens 0) sequences whose prompt is done; the outputs of those that finished."""
        scored = [(chunk.seq, scored_positions(chunk.seq, chunk.start, chunk.end)) for chunk in chunks]
        scored = [(seq, positions) for seq, positions in scored if positions]
        outputs: list[RequestOutput] = []
        if scored and logits is not None and logits.scored_hidden is not None:
            targets = [seq.token_ids[p + 1] for seq, positions in scored for p in positions]
            top_k = [seq.params.prompt_logprobs or 0 for seq, positions in scored for _ in positions]  # set: scored
            try:
                entries = iter(prompt_token_logprobs(logits.scored_hidden, logits.lm_head, targets, top_k))
            except Exception as exc:  # these requests have no prompt logprobs: fail them, keep the rest
                log.exception("computing prompt logprobs failed")
                return self._fail_requests([seq for seq, _ in scored], f"prompt logprobs failed: {describe_error(exc)}")
            for seq, positions in scored:
                prompt_logprobs = self._requests[seq.request_id].prompt_logprobs
                assert prompt_logprobs is not None  # a scored sequence's request asked for prompt logprobs
                for p in positions:
                    prompt_logprobs[p + 1] = next(entries)
                seq.prompt_scored_until = positions.stop
        for chunk in chunks:
            seq = chunk.seq
            if chunk.completes and not seq.generates and not seq.is_finished:
                self._finish(seq, FinishReason.LENGTH)
                finished_state = self._requests.get(seq.request_id)
                if finished_state is not None and finished_state.finished:
                    outputs.append(self._output(finished_state))
        return outputs

    def _sample(
        self, sampled: list[Sequence], logits: torch.Tensor | None
    ) -> tuple[SamplerOutput | None, list[RequestOutput]]:
        """The next token of each sampled sequence; on a sampler failure none, and the failed requests' outputs."""
        if not sampled:
            return None, []
        assert logits is not None  # a step that samples computed the sampled rows' logits
        rows = [
            SamplingRow(s.seq_id, s.params, s.token_ids, s.num_prompt_tokens, self.loaded.eos_token_ids)
            for s in sampled
        ]
        try:
            constraint = self._guided.constraint([s.seq_id for s in sampled]) if self._guided else None
            return self.sampler.sample(logits, rows, constraint), []
        except Exception as exc:  # the sampled requests have no next token: fail them, keep the rest
            log.exception("sampling failed; failing the %d request(s) it held", len(sampled))
            return None, self._fail_requests(sampled, f"sampling failed: {describe_error(exc)}")

    def _append_sampled(self, sampled: list[Sequence], result: SamplerOutput | None) -> list[RequestOutput]:
        """Append each sampled token to its sequence; the outputs of the requests that changed."""
        if result is None:
            return []
        now = time.perf_counter()
        touched: dict[str, RequestState] = {}
        failures: list[RequestOutput] = []
        for seq, token_id, logprobs in zip(sampled, result.token_ids, result.logprobs):
            state = self._requests.get(seq.request_id)
            if state is None or state.error is not None:
                continue  # a sibling sequence of this request already failed it
            try:
                self._append_token(state, seq, token_id, logprobs, now)
            except Exception as exc:  # e.g. a detokenizer problem: this request only
                log.exception("request %s failed while appending a token", seq.request_id)
                touched.pop(seq.request_id, None)
                failed = self._fail_request(seq.request_id, f"appending a token failed: {describe_error(exc)}")
                failures += [failed] if failed is not None else []
                continue
            touched[seq.request_id] = state
        return failures + [self._output(state) for state in touched.values()]

    def _guided_sequences(self) -> GuidedSequences:
        if self._guided is None:
            self._guided = GuidedSequences(
                self.loaded.encoder.tokenizer, self.loaded.shape.vocab_size, tuple(self.loaded.eos_token_ids)
            )
        return self._guided

    def _fail_requests(self, seqs: list[Sequence], reason: str) -> list[RequestOutput]:
        """Fail the requests these sequences belong to (each once); their outputs."""
        request_ids = dict.fromkeys(seq.request_id for seq in seqs)
        return [o for rid in request_ids if (o := self._fail_request(rid, reason)) is not None]

    def _fail_request(self, request_id: str, reason: str) -> RequestOutput | None:
        """Finish every sequence of the request with "error" (freeing its KV) and report it."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        state.error = reason
        for seq in state.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ERROR)
        return self._output(state)

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion, all batched together; outputs in input order (a request the
        engine failed comes back finished with finish_reason "error" and `error` set)."""
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._seq_ids)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, request_params in zip(ids, prompts, param_list):
            self.add_request(request_id, prompt, params=request_params)
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(ids):
            for output in self.step():
                if output.finished:
                    finals[output.request_id] = output
        return [finals[request_id] for request_id in ids]

    def _fit_to_context(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        return fit_to_context(params, num_prompt_tokens, self.max_model_len, self.config.sampling.max_tokens)

    def _append_token(self, state: RequestState, seq: Sequence, token_id: int, logprobs, now: float) -> None:
        seq.token_ids.append(token_id)
        times = seq.times
        if times.first_token is None:
            times.first_token = now
        if self._record_token_times:  # TPOT and ITL come from these; [metrics] enable_tpot = false skips them
            times.token_times.append(now)
        self.counters.num_generated_tokens += 1
        sequence_logprobs = state.logprobs[seq.index]
        if sequence_logprobs is not None and logprobs is not None:
            sequence_logprobs.append(logprobs)
        detokenizer = state.detokenizers[seq.index]
        detokenizer.add_token(token_id)
        reason = self._stop_reason(seq, token_id, detokenizer)
        if self._guided is not None and self._guided.advance(seq.seq_id, token_id) and reason is None:
            reason = FinishReason.STOP  # the constraint is complete (its stop token, kept by ignore_eos)
        if reason is not None:
            self._finish(seq, reason)

    def _stop_reason(self, seq: Sequence, token_id: int, detokenizer) -> FinishReason | None:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.loaded.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return FinishReason.STOP
            if detokenizer.matched_stop is not None:
                seq.stop_reason = detokenizer.matched_stop
                return FinishReason.STOP
        assert params.max_tokens is not None  # add_request fitted every request's max_tokens to the context
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        self.sampler.remove_sequence(seq.seq_id)
        if self._guided is not None:
            self._guided.remove(seq.seq_id)
        seq.times.finished = time.perf_counter()

    def _output(self, state: RequestState) -> RequestOutput:
        finished = state.finished
        completions = state.take_completions()
        metrics = None
        if finished:
            metrics = RequestMetrics.from_sequences(state.seqs, self.config.metrics)
            del self._requests[state.request_id]
            self.faults.forget(state.request_id)
            self.counters.num_finished_requests += 1
        return RequestOutput(
            state.request_id,
            state.seqs[0].token_ids[: state.seqs[0].num_prompt_tokens],
            completions,
            finished,
            metrics,
            error=state.error,
            prompt_logprobs=state.prompt_logprobs if finished else None,
        )

    def _sync_counters(self) -> None:
        self.counters.num_preemptions = self.scheduler.num_preemptions
        self.counters.num_swap_outs = self.scheduler.num_swap_outs
        self.counters.prefix_cache_queries = self.kv_manager.num_prefix_queries
        self.counters.prefix_cache_hits = self.kv_manager.num_prefix_hits
