"""Which queued batch lines a worker claims next: fair shares between projects (tenants).

Batch messages are sent in submission order, so taking the lines a message names would run a
tenant's 10,000-line batch to its end before a batch submitted a minute later starts. Instead a
batch message only says how many lines to take, and the lines are chosen here: one at a time, each
to the project that holds the fewest of the model's batch lines running or chosen so far (ties to
the project whose oldest queued line is oldest), each project's lines in the order they were
submitted. Two tenants' batches therefore progress at the same rate whichever came first, and a
small batch is not held behind a huge one. Weights per project are not offered: every project's
share is equal.

The candidate rows are locked with FOR UPDATE SKIP LOCKED (Postgres), so workers claiming at the
same moment take different lines instead of colliding on the same ones.
"""

from __future__ import annotations

import heapq
import uuid

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus


def pick_fair(session: Session, model: str, count: int) -> list[uuid.UUID]:
    """Up to `count` queued batch lines of `model`, shared out across projects as the module says;
    locked until the caller's transaction ends (it claims them)."""
    if count <= 0:
        return []
    batch_lines = (Job.model == model, Job.work_class == WorkClass.BATCH)
    running = dict(session.execute(
        select(Job.project, func.count()).where(*batch_lines, Job.status == JobStatus.RUNNING).group_by(Job.project)
    ).all())
    oldest = session.execute(
        select(Job.project, func.min(Job.created_at)).where(*batch_lines, Job.status == JobStatus.QUEUED)
        .group_by(Job.project)
    ).all()
    # (lines held, oldest queued line, project): the heap's top is the project owed the next line.
    owed = [(running.get(project, 0), first, project) for project, first in oldest]
    heapq.heapify(owed)
    candidates: dict[str, list[uuid.UUID]] = {}
    picked: list[uuid.UUID] = []
    while owed and len(picked) < count:
        held, first, project = heapq.heappop(owed)
        if project not in candidates:
            # Enough for every remaining pick, in case the other projects run out.
            candidates[project] = list(session.scalars(
                select(Job.id).where(*batch_lines, Job.status == JobStatus.QUEUED, Job.project == project)
                .order_by(Job.created_at, Job.line_number).limit(count - len(picked))
                .with_for_update(skip_locked=True)
            ))
            candidates[project].reverse()  # pop() from the end takes the oldest
        if candidates[project]:
            picked.append(candidates[project].pop())
            heapq.heappush(owed, (held + 1, first, project))
    return picked
