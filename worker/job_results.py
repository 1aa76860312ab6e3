"""Engine outputs to job results: the row values the ResultWriter records for a finished request.

A request's future resolves on the engine thread; its outcome is read later, on the writer's
thread (worker/result_writer.py), so converting outputs never costs the engine thread time. What
the outcome depends on besides the output (was the job cancelled, is the worker handing its jobs
back) is therefore asked when it is read, not when the request ended.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timedelta

from tokenloom.engine import InvalidRequestError, RequestOutput, TokenSpeller, compact_prompt_logprobs
from tokenloom.store.jobs.job_store import JobResult
from tokenloom.store.models import Job, JobErrorCode, JobStatus

log = logging.getLogger("tokenloom.worker")


@dataclass(frozen=True, slots=True)
class ResultMapper:
    # Logprob tokens are stored spelled (text and bytes), so readers need no tokenizer.
    speller: TokenSpeller
    is_cancelled: Callable[[uuid.UUID], bool]  # a cancel was seen while the job ran (the cancel watcher)
    is_handing_back: Callable[[], bool]  # the worker aborts its jobs to hand them back to the queue

    def outcome(self, job: Job, future: Future[RequestOutput], submitted_wall: datetime) -> JobResult | None:
        """The row values for a finished request; None when it was aborted to hand it back."""
        try:
            output = future.result()
        except InvalidRequestError as exc:
            return JobResult.failed(JobErrorCode.INVALID_REQUEST, str(exc))
        except Exception as exc:  # the engine failed this request; the worker carries on
            log.error("job %s failed in the engine: %s", job.id, exc)
            return JobResult.failed(JobErrorCode.ENGINE_ERROR, f"engine error: {exc}")
        cancelled = self.is_cancelled(job.id)
        aborted = any(c.finish_reason == "abort" for c in output.outputs)
        if aborted and not cancelled and self.is_handing_back():
            return None
        status = JobStatus.CANCELLED if cancelled else JobStatus.SUCCEEDED
        return result_from_output(output, status, job, submitted_wall, self.speller)


def result_from_output(
    output: RequestOutput, status: JobStatus, job: Job, submitted_wall: datetime, speller: TokenSpeller
) -> JobResult:
    """A finished request's row values; `submitted_wall` is when it went to the engine."""
    first = output.outputs[0]
    metrics = output.metrics
    assert metrics is not None  # only finished outputs come here, and the engine sets metrics on finishing
    # The job arrived when its row was created; the engine measures from submission.
    created = job.created_at if job.created_at.tzinfo else job.created_at.replace(tzinfo=submitted_wall.tzinfo)
    waited_s = (submitted_wall - created).total_seconds()
    choices = [
        {
            "index": c.index,
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "logprobs": speller.entries(c.logprobs),
        }
        for c in output.outputs
    ]
    return JobResult(
        status=status,
        output_text=first.text,
        output_token_ids=first.token_ids,
        choices=choices,
        # Stored compactly (engine/outputs/compact_prompt_logprobs.py): a long prompt's are the bulk of a row.
        prompt_logprobs=compact_prompt_logprobs(speller, output.prompt_token_ids, output.prompt_logprobs),
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=output.num_output_tokens,
        finish_reason=first.finish_reason,
        first_token_at=None if metrics.ttft_s is None else submitted_wall + timedelta(seconds=metrics.ttft_s),
        queue_s=None if metrics.queue_s is None else waited_s + metrics.queue_s,
        ttft_s=None if metrics.ttft_s is None else waited_s + metrics.ttft_s,
        tpot_s=metrics.tpot_s,
        e2e_s=None if metrics.e2e_s is None else waited_s + metrics.e2e_s,
    )
