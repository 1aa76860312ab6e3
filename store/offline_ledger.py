"""`tokenloom run`'s ledger on `[database] url`: which lines of an offline run have finished.

A run (offline/run_ledger.py `run_key`: model + absolute output path) is one `batches` row; each
finished line is one `jobs` row of it holding the exact result line in `result_record`. The
schema is the job queue's (store/models.py), so `tokenloom status <batch id>` works on a run.

    prepare_database(url)                      # SQLite: upgrade to head; others: must be at head
    ledger = open_ledger(url, model, output_path, fresh=False)
    run_file(engine, input_path, output_path, ledger=ledger)
    ledger.finish(total, failed); ledger.close()
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import Engine as SqlEngine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.offline.run_ledger import LedgerEntry, LedgerError, LineKey, run_key
from tokenloom.store import migrate
from tokenloom.store.database import make_session_factory, make_sql_engine, normalize_url
from tokenloom.store.models import Batch, BatchStatus, Job, JobErrorCode, JobStatus, utcnow

CUSTOM_ID_MAX = 512  # jobs.custom_id is String(512)
MODEL_MAX = 256  # jobs.model / batches.model are String(256)


def prepare_database(url: str) -> None:
    """Bring a SQLite file to the current schema; require a shared database to be there already.

    SQLite is this machine's own file, so upgrading it silently is safe; a Postgres database is
    shared with workers and the API, so its schema changes only through `tokenloom db upgrade`."""
    try:
        if normalize_url(url).startswith("sqlite"):
            migrate.upgrade(url, quiet=True)
            return
        at, head = migrate.current(url), migrate.head()
    except RuntimeError as err:  # unreachable / unusable: migrate's message names the url and the settings
        raise LedgerError(str(err)) from err
    except SQLAlchemyError as err:
        raise LedgerError(
            f"cannot use the database at [database] url / TOKENLOOM_DATABASE_URL: {_reason(err)}"
        ) from err
    if at != head:
        raise LedgerError(
            f"the database schema is at revision {at or 'none (empty database)'} but this tokenloom needs "
            f"{head}: run `tokenloom db upgrade` (same [database] url / TOKENLOOM_DATABASE_URL) first"
        )


def open_ledger(url: str, model: str, output_path: str | os.PathLike, fresh: bool = False) -> SqlRunLedger:
    """The ledger of the run writing `model`'s results to `output_path`, created on first use.

    `fresh`: forget (delete) every line an earlier attempt of this run finished."""
    sql_engine = make_sql_engine(url)
    sessions = make_session_factory(sql_engine)
    key = run_key(model, output_path)
    try:
        with sessions.begin() as session:
            batch = session.execute(
                select(Batch).where(Batch.run_key == key).order_by(Batch.created_at).limit(1)
            ).scalar_one_or_none()
            if batch is None:
                batch = Batch(
                    run_key=key,
                    model=model[:MODEL_MAX],
                    metadata_={
                        "kind": "offline_run",
                        "output": _safe_text(str(Path(output_path).resolve())),
                    },
                )
                session.add(batch)
            elif fresh:
                session.execute(delete(Job).where(Job.batch_id == batch.id))
            batch.status, batch.in_progress_at, batch.completed_at = BatchStatus.IN_PROGRESS, utcnow(), None
            session.flush()
            batch_id = batch.id
    except SQLAlchemyError as err:
        sql_engine.dispose()
        raise LedgerError(
            f"could not open the run ledger in [database] url / TOKENLOOM_DATABASE_URL: {_reason(err)}"
        ) from err
    return SqlRunLedger(sql_engine, sessions, batch_id, model[:MODEL_MAX])


@dataclass
class SqlRunLedger:
    """tokenloom.offline.run_ledger.RunLedger on SQLAlchemy: one batch's job rows."""

    sql_engine: SqlEngine
    sessions: sessionmaker[Session]
    batch_id: uuid.UUID
    model: str

    def lookup(self, keys: Sequence[LineKey]) -> dict[LineKey, dict]:
        # By (batch_id, custom_id): the unique constraint's index finds each row directly.
        wanted: dict[str, list[LineKey]] = {}
        for key in keys:
            wanted.setdefault(stored_custom_id(key.custom_id), []).append(key)
        query = select(Job.custom_id, Job.input_hash, Job.result_record).where(
            Job.batch_id == self.batch_id, Job.custom_id.in_(list(wanted))
        )
        found: dict[LineKey, dict] = {}
        with _errors("read"), self.sessions() as session:
            for custom_id, input_hash, record in session.execute(query):
                for key in wanted.get(custom_id, ()):
                    if key.input_hash == input_hash and record is not None:  # an edited line runs again
                        found[key] = record
        return found

    def record(self, entries: Sequence[LedgerEntry]) -> None:
        # One row per custom_id: the newest entry wins (a file that repeats a custom_id keeps
        # only its last finished line; the others are generated again on a resume).
        rows = {stored_custom_id(e.key.custom_id): self._row(e) for e in entries}
        with _errors("store finished lines in"), self.sessions.begin() as session:
            # Replace, don't skip: a row with this custom_id but another hash is an edited line's
            # earlier result, and (batch_id, custom_id) is unique.
            session.execute(delete(Job).where(Job.batch_id == self.batch_id, Job.custom_id.in_(list(rows))))
            session.execute(insert(Job), list(rows.values()))

    def finish(self, total: int, failed: int) -> None:
        """Mark the run's batch completed with its counts (informational; a rerun reopens it)."""
        with _errors("update"), self.sessions.begin() as session:
            batch = session.get(Batch, self.batch_id)
            if batch is not None:
                batch.status, batch.completed_at = BatchStatus.COMPLETED, utcnow()
                batch.total, batch.completed, batch.failed = total, total - failed, failed

    def close(self) -> None:
        self.sql_engine.dispose()

    def _row(self, entry: LedgerEntry) -> dict:
        record = entry.record
        error = record.get("error")
        return dict(
            id=uuid.uuid4(),
            batch_id=self.batch_id,
            model=self.model,
            custom_id=stored_custom_id(entry.key.custom_id),
            line_number=entry.line_number,
            input_hash=entry.key.input_hash,
            status=JobStatus.SUCCEEDED if record["status"] == "succeeded" else JobStatus.FAILED,
            result_record=record,
            prompt_tokens=record.get("prompt_tokens"),
            completion_tokens=record.get("completion_tokens"),
            finish_reason=record.get("finish_reason"),
            error=_safe_text(error["message"]) if error else None,
            error_code=None
            if not error
            else (JobErrorCode.ENGINE_ERROR if error.get("type") == "server_error" else JobErrorCode.INVALID_REQUEST),
            queue_s=record.get("queue_s"),
            ttft_s=record.get("ttft_s"),
            tpot_s=record.get("tpot_s"),
            attempts=1,
            finished_at=utcnow(),
        )


@contextmanager
def _errors(what: str) -> Iterator[None]:
    """A database failure becomes a LedgerError the CLI reports without a traceback."""
    try:
        yield
    except SQLAlchemyError as err:
        raise LedgerError(
            f"could not {what} the run ledger in [database] url / TOKENLOOM_DATABASE_URL: {_reason(err)}"
        ) from err


def stored_custom_id(custom_id: str) -> str:
    """The custom_id as the jobs row holds it.

    Postgres text cannot hold NUL or lone surrogates (JSON allows both) and the column holds 512
    characters; such an id is stored as its digest, which is still one value per id."""
    if len(custom_id) <= CUSTOM_ID_MAX and _safe_text(custom_id) == custom_id:
        return custom_id
    return "sha256:" + hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).hexdigest()


def _safe_text(text: str) -> str:
    """`text` with what a Postgres text column rejects (lone surrogates, NUL) backslash-escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def _reason(err: BaseException) -> str:
    reason = str(getattr(err, "orig", None) or err).strip()
    return reason.splitlines()[0] if reason else type(err).__name__
