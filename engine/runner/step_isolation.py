"""One engine step's forward pass that fails only the requests whose chunks fail.

When the packed forward raises, each chunk is re-run on its own (a chunk writes only its own KV
slots, so a repeat is harmless): the requests whose chunk still fails are failed, the rest carry
on as if nothing happened. A fault that is not request-specific (e.g. running out of device memory
for the packed step) therefore costs one slower step, not the batch.
"""

from __future__ import annotations

import logging

from tokenloom.engine.core.scheduler import ScheduledChunk, SchedulerOutput
from tokenloom.engine.runner.model_runner import ModelRunner
from tokenloom.engine.runner.step_logits import StepLogits
from tokenloom.engine.testing.fault_injection import FaultInjector

log = logging.getLogger("tokenloom.engine")


def describe_error(exc: BaseException) -> str:
    """The one-line reason a failed request carries."""
    return f"{type(exc).__name__}: {exc}"[:1000]


def forward_isolating(runner: ModelRunner, faults: FaultInjector, plan: SchedulerOutput):
    """(chunks that ran, their StepLogits or None, failed: request id -> reason)."""
    try:
        faults.check(c.seq.request_id for c in plan.chunks)
        return plan.chunks, runner.forward(plan), {}
    except Exception as exc:
        if len(plan.chunks) == 1:
            log.exception("engine step failed for request %s", plan.chunks[0].seq.request_id)
            return [], None, {plan.chunks[0].seq.request_id: f"the forward pass failed: {describe_error(exc)}"}
        log.warning(
            "engine step of %d chunks failed (%s); re-running each chunk alone to find the requests that fail",
            len(plan.chunks),
            describe_error(exc),
        )
    failed: dict[str, str] = {}
    ran: list[tuple[ScheduledChunk, StepLogits]] = []
    for chunk in plan.chunks:
        request_id = chunk.seq.request_id
        if request_id in failed:
            continue
        try:
            faults.check((request_id,))
            # clone: the runner reuses its logits buffer on the next forward
            ran.append((chunk, runner.forward(SchedulerOutput(chunks=[chunk], preempted=[])).clone()))
        except Exception as exc:
            log.exception("engine step failed for request %s", request_id)
            failed[request_id] = f"the forward pass failed: {describe_error(exc)}"
    ran = [(chunk, logits) for chunk, logits in ran if chunk.seq.request_id not in failed]
    return [chunk for chunk, _ in ran], StepLogits.concat([logits for _, logits in ran]), failed
