"""Idempotent submission: one `Idempotency-Key` per project creates its jobs or batch once.

A create request that carries a key inserts one `idempotency_keys` row in the SAME transaction
as the rows it creates, before them. Its primary key (project, key) settles races: of two
concurrent requests with one key, the second INSERT waits for the first transaction (Postgres)
or the database lock (SQLite) and then fails with a unique violation, rolling back everything
it would have created (KeyTakenError); that request then reads the first one's row and replays
it. A request refused before its rows were written (a 4xx) stores no key.

The row stores a hash of the endpoint and the canonical request body: the same key with another
body is refused (IdempotencyKeyReusedError), as Stripe and the IETF Idempotency-Key draft do.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass

from celery import Celery
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.jobs import job_queries
from tokenloom.store.models import IdempotencyKey, Job

MAX_KEY_LENGTH = 255  # the column's width; UUIDs (36) and the SDKs' generated keys fit easily


class KeyTakenError(Exception):
    """Another request stored this key first (it committed while this one was inserting)."""


class IdempotencyKeyReusedError(Exception):
    """The key was stored by a request with another body or endpoint."""

    def __init__(self, key: str, endpoint: str, stored_endpoint: str):
        self.key, self.endpoint, self.stored_endpoint = key, endpoint, stored_endpoint
        super().__init__(
            f"Idempotency-Key {key!r} was already used with a different request"
            + ("" if endpoint == stored_endpoint else f" to {stored_endpoint}")
        )


@dataclass(slots=True, frozen=True)
class IdempotencyClaim:
    """What a request with a key would store: who, which key, and a fingerprint of the request."""

    project: str
    key: str
    endpoint: str
    request_hash: str

    @classmethod
    def of(cls, project: str, key: str, endpoint: str, body: object) -> "IdempotencyClaim":
        return cls(project, key, endpoint, request_hash(endpoint, body))

    def record(self, *, job_ids: list[uuid.UUID] | None = None, batch_id: uuid.UUID | None = None) -> IdempotencyKey:
        return IdempotencyKey(
            project=self.project,
            idempotency_key=self.key,
            endpoint=self.endpoint,
            request_hash=self.request_hash,
            job_ids=None if job_ids is None else [str(i) for i in job_ids],
            batch_id=batch_id,
        )


@dataclass(slots=True, frozen=True)
class PreviousRequest:
    """What the first request with a key created: its jobs (in request order) or its batch."""

    job_ids: list[uuid.UUID]
    batch_id: uuid.UUID | None


def request_hash(endpoint: str, body: object) -> str:
    """sha256 of the endpoint and the body as canonical JSON (sorted keys, no spaces), so a
    retry that serializes the same fields differently still matches."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(f"{endpoint}\0{canonical}".encode("utf-8", "surrogatepass")).hexdigest()


def find_previous(sessions: sessionmaker[Session], claim: IdempotencyClaim) -> PreviousRequest | None:
    """The request that stored `claim`'s key in its project, or None; raises
    IdempotencyKeyReusedError when that request differs from this one."""
    with sessions() as session:
        row = session.get(IdempotencyKey, (claim.project, claim.key))
    if row is None:
        return None
    if (row.endpoint, row.request_hash) != (claim.endpoint, claim.request_hash):
        raise IdempotencyKeyReusedError(claim.key, claim.endpoint, row.endpoint)
    return PreviousRequest([uuid.UUID(i) for i in row.job_ids or []], row.batch_id)


def insert_claim(session: Session, record: IdempotencyKey) -> None:
    """Add `record` and flush at once, so a key taken by a concurrent request fails here, before
    this transaction writes anything else (the caller's transaction then rolls back). Call it
    before adding the rows the key creates."""
    session.add(record)
    try:
        session.flush()
    except IntegrityError as exc:
        raise KeyTakenError(f"Idempotency-Key {record.idempotency_key!r} is taken") from exc


def enqueue_jobs_once(
    sessions: sessionmaker[Session], app: Celery, claim: IdempotencyClaim, jobs: list[Job]
) -> list[Job]:
    """job_queries.enqueue_jobs, with the key's row inserted first in the jobs' transaction."""
    with sessions.begin() as session:
        insert_claim(session, claim.record(job_ids=[job.id for job in jobs]))
        session.add_all(jobs)
    return job_queries.send_queued(sessions, app, jobs)


def jobs_in_order(sessions: sessionmaker[Session], job_ids: list[uuid.UUID]) -> list[Job]:
    """The rows of `job_ids` in that order; a row deleted meanwhile (retention) is left out."""
    with sessions() as session:
        found = {job.id: job for job in session.execute(select(Job).where(Job.id.in_(job_ids))).scalars()}
    return [found[i] for i in job_ids if i in found]
