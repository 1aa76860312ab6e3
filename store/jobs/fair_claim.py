"""Which queued batch lines a worker claims next: fair shares between projects (tenants).

Batch messages are sent in submission order, so taking the lines a message names would run a
tenant's 10,000-line batch to its end before a batch submitted a minute later starts. Instead a
batch message only says how many lines to take, and the lines are chosen here: one at a time, each
to the project that holds the fewest of the model's batch lines running or chosen so far (ties to
the project whose oldest queued line is oldest), each project's lines in the order they were
submitted. Two tenants' batches therefore progress at the same rate whichever came first, and a
small batch is not held behind a huge one. Weights per project are not offered: every project's
share is equal.

Only the lines chosen are locked (FOR UPDATE SKIP LOCKED, Postgres); a line another worker locked
first is planned around. Workers claiming at the same moment therefore take different lines, and a
claim comes back short only when the queued lines run out.
"""

from __future__ import annotations

import heapq
import uuid
from collections import Counter
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus

# Workers claiming at the same moment plan the same oldest lines; each round locks what it can of
# its plan and plans again around the rest, so a claim comes back short only when lines run out.
MAX_ROUNDS = 16


def pick_fair(session: Session, model: str, count: int) -> list[uuid.UUID]:
    """Up to `count` queued batch lines of `model`, shared out across projects as the module says;
    locked until the caller's transaction ends (it claims them)."""
    batch_lines = (Job.model == model, Job.work_class == WorkClass.BATCH)
    # Read once: later rounds count what this claim picked on top (lines other workers take
    # meanwhile shift every project alike, so the order they give is the same).
    running: Counter[str] = Counter(
        dict(
            session.execute(
                select(Job.project, func.count())
                .where(*batch_lines, Job.status == JobStatus.RUNNING)
                .group_by(Job.project)
            ).all()
        )
    )
    oldest = queued_heads(session, model)
    picked: list[uuid.UUID] = []
    skipped: set[uuid.UUID] = set()  # planned, but locked by another worker's claim
    for _ in range(MAX_ROUNDS):
        if len(picked) >= count:
            break
        plan = _plan(session, batch_lines, oldest, running, count - len(picked), skipped | set(picked))
        if not plan:
            break
        # Only the planned rows are locked: a candidate left unlocked stays free for other workers.
        locked = set(
            session.scalars(
                select(Job.id)
                .where(Job.id.in_([job_id for job_id, _ in plan]), Job.status == JobStatus.QUEUED)
                .with_for_update(skip_locked=True)
            )
        )
        for job_id, project in plan:
            if job_id in locked:
                picked.append(job_id)
                running[project] += 1
            else:
                skipped.add(job_id)
    return picked


def queued_heads(session: Session, model: str) -> list[tuple[str, datetime]]:
    """(project, its oldest queued line) for each project with queued batch lines of `model`.

    Read by index probes, one pair per project (ix_jobs_fair_claim): a recursive query steps from
    each project to the next one above it (the loose index scan Postgres does not do by itself for a
    GROUP BY), so the cost follows the number of projects, never the number of queued lines.
    """
    queued = (Job.model == model, Job.work_class == WorkClass.BATCH, Job.status == JobStatus.QUEUED)
    first = select(Job.project).where(*queued).order_by(Job.project).limit(1).scalar_subquery()
    projects = select(first.label("project")).cte("queued_projects", recursive=True)
    above = select(Job.project).where(*queued, Job.project > projects.c.project).order_by(Job.project).limit(1)
    projects = projects.union_all(
        select(above.scalar_subquery().label("project")).where(projects.c.project.is_not(None))
    )
    oldest = select(Job.created_at).where(*queued, Job.project == projects.c.project).order_by(Job.created_at).limit(1)
    rows = session.execute(
        select(projects.c.project, oldest.scalar_subquery()).where(projects.c.project.is_not(None))
    ).all()
    return [(project, first_at) for project, first_at in rows if first_at is not None]


def _plan(
    session: Session, batch_lines: tuple, oldest, running: Counter[str], count: int, exclude: set[uuid.UUID]
) -> list[tuple[uuid.UUID, str]]:
    """Up to `count` (line, project) in fair order, read without locks. `oldest`: (project, its
    oldest queued line); `running`: lines each project holds, this claim's picks included."""
    # (lines held, oldest queued line, project): the heap's top is the project owed the next line.
    owed = [(running[project], first, project) for project, first in oldest]
    heapq.heapify(owed)
    candidates: dict[str, list[uuid.UUID]] = {}
    plan: list[tuple[uuid.UUID, str]] = []
    while owed and len(plan) < count:
        held, first, project = heapq.heappop(owed)
        if project not in candidates:
            # Enough for every remaining pick, in case the other projects run out.
            query = (
                select(Job.id)
                .where(*batch_lines, Job.status == JobStatus.QUEUED, Job.project == project)
                .order_by(Job.created_at, Job.line_number)
                .limit(count - len(plan) + len(exclude))
            )
            candidates[project] = [job_id for job_id in session.scalars(query) if job_id not in exclude]
            candidates[project].reverse()  # pop() from the end takes the oldest
        if candidates[project]:
            plan.append((candidates[project].pop(), project))
            heapq.heappush(owed, (held + 1, first, project))
    return plan
