"""Result lines of an offline batch run, and the run's summary.

Every input line gets exactly one result line (a JSON object):

    custom_id, line             the input's id and 1-based line number
    status                      "succeeded" | "failed"
    model                       the model that ran the file
    text, token_ids             the first choice's text and generated token ids
    finish_reason               the first choice's "stop" | "length"
    choices                     [{index, text, token_ids, finish_reason, stop_reason, logprobs}]
                                logprobs: null | [{token_id, token, bytes, logprob,
                                  top: [[id, logprob], ...], top_tokens: [{token, bytes}, ...]}]
                                  (engine/outputs/logprob_tokens.py; lines without token/bytes/top_tokens
                                  are read too)
    prompt_tokens               prompt length in tokens
    completion_tokens           generated tokens over all choices
    echo                        null | the prompt's text, for a line that asked for `echo`
    prompt_logprobs             null | one entry per prompt token (as in choices' logprobs; the
                                  first has null logprob and top), for `prompt_logprobs` / echo
    ttft_s, tpot_s, queue_s, e2e_s   per-request latencies in seconds (null when undefined)
    error                       null | {"type": "invalid_request_error", "message": ...}

A failed line has status "failed", an error, `choices: []`, `completion_tokens: 0` and null for
every other output field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenloom.engine import CompletionOutput, EngineCounters, RequestOutput, TokenSpeller, finite
from tokenloom.openai_protocol.openai_response import StoredResult, batch_error_line, batch_output_line, completion_body


def success_record(
    custom_id: str,
    line_number: int,
    model: str,
    output: RequestOutput,
    speller: TokenSpeller,
    echo_text: str | None = None,
) -> dict:
    """A succeeded line; `speller` (the model's tokenizer) spells the logprob tokens; `echo_text`: the
    prompt's text when the line asked for `echo`."""
    m = output.metrics
    record = result_record(
        custom_id,
        line_number,
        model,
        "succeeded",
        [_choice(c, speller) for c in output.outputs],
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=output.num_output_tokens,
        ttft_s=m.ttft_s if m else None,
        tpot_s=m.tpot_s if m else None,
        queue_s=m.queue_s if m else None,
        e2e_s=m.e2e_s if m else None,
    )
    return {
        **record,
        "echo": echo_text,
        "prompt_logprobs": speller.prompt_entries(output.prompt_token_ids, output.prompt_logprobs),
    }


def failure_record(
    custom_id: str | None, line_number: int, model: str, message: str, error_type: str = "invalid_request_error"
) -> dict:
    """A failed line; `error_type` "server_error" when the engine (not the line) was at fault."""
    return result_record(custom_id, line_number, model, "failed", [], error=message, error_type=error_type)


def result_record(
    custom_id: str | None,
    line_number: int,
    model: str,
    status: str,
    choices: list[dict],
    *,
    prompt_tokens: int | None = None,
    completion_tokens: int = 0,
    ttft_s: float | None = None,
    tpot_s: float | None = None,
    queue_s: float | None = None,
    e2e_s: float | None = None,
    error: str | None = None,
    error_type: str = "invalid_request_error",
) -> dict:
    """One result line; `choices` are dicts shaped like `_choice` makes them."""
    first = choices[0] if choices else {}
    return {
        "custom_id": custom_id,
        "line": line_number,
        "status": status,
        "model": model,
        "text": first.get("text"),
        "token_ids": first.get("token_ids"),
        "finish_reason": first.get("finish_reason"),
        "choices": choices,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "ttft_s": finite(ttft_s),
        "tpot_s": finite(tpot_s),
        "queue_s": finite(queue_s),
        "e2e_s": finite(e2e_s),
        "error": None if error is None else {"type": error_type, "message": error},
        "echo": None,
        "prompt_logprobs": None,
    }


def _choice(c: CompletionOutput, speller: TokenSpeller) -> dict:
    return {
        "index": c.index,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "logprobs": speller.entries(c.logprobs),
    }


def openai_output_line(record: dict, chat: bool, created: int, id_hex: str) -> dict:
    """A result record as one line of an OpenAI Batch output file (`--output-format openai`): the
    same line /v1/batches writes, `response.body` for a succeeded line, an error body otherwise."""
    request_id = f"{record['model']}-line-{record['line']}"
    if record["status"] != "succeeded":
        error = record.get("error") or {}
        server_fault = error.get("type") == "server_error"
        return batch_error_line(
            id_hex,
            record["custom_id"],
            request_id,
            error.get("message") or "failed",
            error.get("type") or "invalid_request_error",
            500 if server_fault else 400,
        )
    body = completion_body(
        StoredResult(
            id_hex=id_hex,
            chat=chat,
            created=created,
            model=record["model"],
            choices=record["choices"],
            prompt_tokens=record["prompt_tokens"] or 0,
            completion_tokens=record["completion_tokens"] or 0,
            echo_text=record.get("echo"),
            prompt_logprobs=record.get("prompt_logprobs"),
        )
    )
    return batch_output_line(id_hex, record["custom_id"], request_id, body)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class RunSummary:
    requests_ok: int
    requests_failed: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    output_tok_s: float | None  # None: [metrics] enable_throughput = false
    total_tok_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    tpot_p99_s: float | None
    mean_batch_size: float
    preemptions: int
    prefix_cache_hit_rate: float
    # Lines whose stored result from an earlier attempt was written instead of generating them
    # (counted in requests_ok/failed; not in the token, throughput and latency figures).
    requests_reused: int = 0

    @property
    def requests_total(self) -> int:
        return self.requests_ok + self.requests_failed

    @property
    def requests_generated(self) -> int:
        return self.requests_total - self.requests_reused

    def resumed_line(self) -> str:
        """'resumed: 37 lines reused from an earlier run, 63 generated' ('' when nothing was reused)."""
        return f"resumed: {self._reused_text()}" if self.requests_reused else ""

    def _reused_text(self) -> str:
        n = self.requests_reused
        return f"{n:,} line{'' if n == 1 else 's'} reused from an earlier run, {self.requests_generated:,} generated"

    def format(self) -> str:
        rows = [
            ("requests", f"{self.requests_total:,} ({self.requests_ok:,} succeeded, {self.requests_failed:,} failed)"),
            ("wall time", f"{self.wall_s:,.2f} s"),
            ("tokens", f"{self.prompt_tokens:,} prompt, {self.output_tokens:,} output"),
            ("TTFT p50 / p90 / p99", _triple(self.ttft_p50_s, self.ttft_p90_s, self.ttft_p99_s)),
            ("TPOT p50 / p90 / p99", _triple(self.tpot_p50_s, self.tpot_p90_s, self.tpot_p99_s)),
            ("mean batch size", f"{self.mean_batch_size:,.1f} sequences per step"),
            ("preemptions", f"{self.preemptions:,}"),
            ("prefix cache hit rate", f"{self.prefix_cache_hit_rate:.1%}"),
        ]
        if self.output_tok_s is not None:
            rows.insert(
                3, ("throughput", f"{self.output_tok_s:,.1f} output tok/s, {self.total_tok_s:,.1f} total tok/s")
            )
        if self.requests_reused:
            rows.insert(1, ("resumed", self._reused_text()))
        width = max(len(name) for name, _ in rows)
        lines = [f"| {'metric':<{width}} | value", f"|{'-' * (width + 2)}|------"]
        lines += [f"| {name:<{width}} | {value}" for name, value in rows]
        return "\n".join(lines)


def _triple(*values: float | None) -> str:
    # The three percentiles come from one list, so they are None together (no samples).
    numbers = [v for v in values if v is not None]
    if len(numbers) < len(values):
        return "n/a"
    return " / ".join(f"{v * 1000:,.1f}" for v in numbers) + " ms"


@dataclass(slots=True)
class RunStats:
    """Accumulates per-line results during a run; `summary()` turns them into a RunSummary."""

    counters_at_start: EngineCounters
    ok: int = 0
    failed: int = 0
    reused: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)

    def add(self, record: dict, reused: bool = False) -> None:
        """Count one result line; a `reused` one counts as a line only (no work was done now)."""
        succeeded = record["status"] == "succeeded"
        self.ok += succeeded
        self.failed += not succeeded
        if reused:
            self.reused += 1
            return
        if not succeeded:
            return
        self.prompt_tokens += record["prompt_tokens"]
        self.output_tokens += record["completion_tokens"]
        if record["ttft_s"] is not None:
            self.ttfts.append(record["ttft_s"])
        if record["tpot_s"] is not None:
            self.tpots.append(record["tpot_s"])

    def summary(self, wall_s: float, counters: EngineCounters, throughput: bool = True) -> RunSummary:
        """Engine-wide figures are the change in `counters` since the run started; tokens per second
        only when `throughput` ([metrics] enable_throughput)."""
        start = self.counters_at_start
        steps = counters.num_steps - start.num_steps
        queries = counters.prefix_cache_queries - start.prefix_cache_queries
        hits = counters.prefix_cache_hits - start.prefix_cache_hits
        rate = lambda tokens: (tokens / wall_s if wall_s > 0 else 0.0) if throughput else None
        return RunSummary(
            requests_ok=self.ok,
            requests_failed=self.failed,
            wall_s=wall_s,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            output_tok_s=rate(self.output_tokens),
            total_tok_s=rate(self.output_tokens + self.prompt_tokens),
            ttft_p50_s=percentile(self.ttfts, 50),
            ttft_p90_s=percentile(self.ttfts, 90),
            ttft_p99_s=percentile(self.ttfts, 99),
            tpot_p50_s=percentile(self.tpots, 50),
            tpot_p90_s=percentile(self.tpots, 90),
            tpot_p99_s=percentile(self.tpots, 99),
            mean_batch_size=(counters.num_scheduled_seqs - start.num_scheduled_seqs) / steps if steps else 0.0,
            preemptions=counters.num_preemptions - start.num_preemptions,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            requests_reused=self.reused,
        )
