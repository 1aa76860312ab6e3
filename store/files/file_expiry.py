"""Files that expire: a batch's output and error files, when its create request set OpenAI's
`output_expires_after` ({"anchor": "created_at", "seconds": 3600..2592000}).

At `expires_at` a file stops being visible (its GET, content and listing answer as for a deleted
file: store/files/file_queries.py reads no expired row). Its bytes are deleted by the next hourly
retention pass (store/retention.py), whatever `[database] retention_days` says; the row stays, a
few hundred bytes, until retention deletes it with its batch, so the batch's `output_file_id` keeps
naming a file that is gone, as OpenAI's does.
"""

from __future__ import annotations

from sqlalchemy import delete, exists, select, update
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.database import rowcount
from tokenloom.store.models import File, FileChunk, utcnow

MIN_SECONDS = 3600  # OpenAI's bounds for output_expires_after.seconds: one hour to thirty days
MAX_SECONDS = 30 * 24 * 3600


def purge_expired_files(sessions: sessionmaker[Session], batch_size: int = 100) -> int:
    """Delete the bytes of every file past its expiry; returns how many files were purged."""
    purged = 0
    while True:
        now = utcnow()
        has_bytes = exists().where(FileChunk.file_id == File.id) | File.content.is_not(None)
        with sessions.begin() as session:
            ids = list(session.scalars(select(File.id).where(File.expires_at < now, has_bytes).limit(batch_size)))
            if not ids:
                return purged
            session.execute(delete(FileChunk).where(FileChunk.file_id.in_(ids)))
            purged += rowcount(session.execute(update(File).where(File.id.in_(ids)).values(content=None)))
