"""File rows (OpenAI Files API: batch inputs, batch outputs and errors) for online callers.

`project=None` means every project (the admin). A file's bytes (up to 200 MB) go in and out as
chunks (store/files/file_chunks.py): listings and metadata never load them, and `create_file` stores
them while they are read.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, defer, sessionmaker

from tokenloom.store.files.file_chunks import ChunkWriter
from tokenloom.store.models import File, utcnow
from tokenloom.store.pagination import Page, page_after


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"  # the shape store/batches/batch_finalizer.py gives its files


def create_file(
    sessions: sessionmaker[Session],
    project: str,
    purpose: str,
    filename: str,
    chunks: Iterable[bytes],
) -> File:
    """Store the bytes `chunks` yields, in one transaction: if the iterable raises (a check of the
    content, a refused upload), nothing is stored."""
    row = File(id=new_file_id(), project=project, purpose=purpose, filename=filename, bytes=0)
    with sessions.begin() as session:
        session.add(row)
        session.flush()
        writer = ChunkWriter(session, row.id)
        for chunk in chunks:
            writer.write(chunk)
        writer.close()
        row.bytes = writer.num_bytes
    return row


def _visible(query, project: str | None):
    """What `project` (None: every project) may see: never a file past its expiry (store/files/file_expiry.py)."""
    query = query.where(or_(File.expires_at.is_(None), File.expires_at > utcnow()))
    return query if project is None else query.where(File.project == project)


def visible_file(sessions: sessionmaker[Session], file_id: str, project: str | None) -> File | None:
    """The row without its content, if it exists and `project` may see it."""
    with sessions() as session:
        return session.execute(
            _visible(select(File).options(defer(File.content)), project).where(File.id == file_id)
        ).scalar_one_or_none()


def list_files(
    sessions: sessionmaker[Session],
    project: str | None,
    *,
    purpose: str | None = None,
    limit: int = 100,
    after: str | None = None,
    ascending: bool = False,
) -> Page:
    query = _visible(select(File).options(defer(File.content)), project)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    with sessions() as session:
        cursor = None
        if after is not None:
            cursor = session.execute(
                _visible(select(File).options(defer(File.content)), project).where(File.id == after)
            ).scalar_one_or_none()
            if cursor is None:
                raise LookupError(f"after={after}: no such file")
        return page_after(session, query, File, cursor, limit, ascending=ascending)
