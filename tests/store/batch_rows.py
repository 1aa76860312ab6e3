"""A batch row and its lines, written straight to the database for the store's batch tests: each line
in the state asked for, with what a row in that state carries (a running line's worker and lease, a
succeeded line's output)."""

from __future__ import annotations

import uuid
from datetime import timedelta

from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Batch, Job, JobStatus, utcnow


def add_batch(
    sessions, statuses: list[JobStatus], *, model: str = "m", **batch_values
) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """The new batch's id and its lines' ids, in line order (custom ids `line-<n>`)."""
    batch_id = uuid.uuid4()
    ids = [uuid.uuid4() for _ in statuses]
    now = utcnow()
    with sessions.begin() as session:
        session.add(Batch(id=batch_id, model=model, total=len(statuses), created_at=now, **batch_values))
        session.flush()
        for line, (job_id, status) in enumerate(zip(ids, statuses, strict=True)):
            running = status is JobStatus.RUNNING
            done = status is JobStatus.SUCCEEDED
            session.add(
                Job(
                    id=job_id,
                    batch_id=batch_id,
                    custom_id=f"line-{line}",
                    line_number=line,
                    model=model,
                    project="p",
                    endpoint="/v1/completions",
                    prompt="x",
                    params={},
                    work_class=WorkClass.BATCH,
                    status=status,
                    worker_id="w" if running else None,
                    lease_expires_at=now + timedelta(minutes=5) if running else None,
                    output_text="done" if done else None,
                    choices=[{"index": 0, "text": "done", "finish_reason": "length"}] if done else None,
                    finished_at=now if done else None,
                )
            )
    return batch_id, ids
