"""Which queued batch lines a worker claims next: fair shares between projects (tenants).

Batch messages are sent in submission order, so taking the lines a message names would run a
tenant's 10,000-line batch to its end before a batch submitted a minute later starts. Instead a
batch message only says how many lines to take, and the lines are chosen here: one at a time, each
to the project that holds the fewest of the model's batch lines running or chosen so far (ties to
the project whose oldest queued line is oldest), each project's lines in the order they were
submitted. Two tenants' batches therefore progress at the same rate whichever came first, and a
small batch is not held behind a huge one. Weights per project are not offered: every project's
share is equal.

Each project's share is locked in one statement that skips lines other workers hold (FOR UPDATE
SKIP LOCKED, Postgres): workers claiming at the same moment take different lines without planning
around each other, and a claim comes back short only when the lines not held by another claim run
out.
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


def pick_fair(session: Session, model: str, count: int) -> list[uuid.UUID]:
    """Up to `count` queued batch lines of `model`, shared out across projects as the module says;
    locked until the caller's transaction ends (it claims them), in the order of the shares."""
    batch_lines = (Job.model == model, Job.work_class == WorkClass.BATCH)
    # Lines each project holds running (this claim's picks are counted on top as they are made).
    running: Counter[str] = Counter(
        dict(
            session.execute(
                select(Job.project, func.count())
                .where(*batch_lines, Job.status == JobStatus.RUNNING)
                .group_by(Job.project)
            ).all()
        )
    )
    heads = dict(queued_heads(session, model))  # the projects with queued lines, and their oldest
    picked: list[uuid.UUID] = []
    # Each round hands the lines still wanted out in fair order and locks each project's share in
    # one statement; a project that yields fewer than its share (its lines ran out, or other
    # workers hold the rest) is dropped and the next round gives the rest to the others: at most
    # one round per project, however many workers claim at once.
    while heads and len(picked) < count:
        order = fair_order(running, heads, count - len(picked))
        shares = Counter(order)
        taken: dict[str, list[uuid.UUID]] = {}
        for project, share in shares.items():
            taken[project] = list(
                session.scalars(
                    select(Job.id)
                    .where(*batch_lines, Job.status == JobStatus.QUEUED, Job.project == project)
                    .order_by(Job.created_at, Job.line_number)
                    .limit(share)
                    .with_for_update(skip_locked=True)
                )
            )
            if len(taken[project]) < share:
                del heads[project]
        for project in order:  # interleaved as the shares were handed out
            if taken[project]:
                picked.append(taken[project].pop(0))
                running[project] += 1
    return picked


def fair_order(running: Counter[str], heads: dict[str, datetime], count: int) -> list[str]:
    """`count` lines handed out one at a time, each to the project holding the fewest (ties to the
    oldest queued line): the project of each, in order. Pure arithmetic: no query."""
    owed = [(running[project], first, project) for project, first in heads.items()]
    heapq.heapify(owed)
    order: list[str] = []
    while owed and len(order) < count:
        held, first, project = heapq.heappop(owed)
        order.append(project)
        heapq.heappush(owed, (held + 1, first, project))
    return order


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
