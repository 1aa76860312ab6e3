"""A file's bytes as a sequence of `file_chunks` rows: written while the bytes arrive, read one
chunk at a time, so neither an upload, a download nor a batch output is ever whole in memory.

Every chunk but the last holds exactly CHUNK_BYTES. Tests lower CHUNK_BYTES (monkeypatch, in
the process that writes) to cross chunk boundaries with small files; readers do not depend on
it. Files written before chunks existed keep their bytes in `files.content`, which readers
return as one piece.
"""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import insert, select
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.models import File, FileChunk

CHUNK_BYTES = 1 << 20  # big enough that a 200 MB file is 200 rows, small enough to hold a few at once


class ChunkWriter:
    """Appends bytes to a file's chunks inside the caller's transaction (the File row must be
    flushed first). `close()` writes the last, shorter chunk."""

    def __init__(self, session: Session, file_id: str):
        self.session = session
        self.file_id = file_id
        self.chunk_bytes = CHUNK_BYTES  # read at construction so a test's lowered value applies
        self.num_bytes = 0
        self.num_chunks = 0
        self._pending = bytearray()

    def write(self, data: bytes) -> None:
        self._pending += data
        self.num_bytes += len(data)
        while len(self._pending) >= self.chunk_bytes:
            self._insert(bytes(self._pending[: self.chunk_bytes]))
            del self._pending[: self.chunk_bytes]

    def close(self) -> None:
        if self._pending:
            self._insert(bytes(self._pending))
            self._pending.clear()

    def _insert(self, data: bytes) -> None:
        self.session.execute(insert(FileChunk).values(file_id=self.file_id, seq=self.num_chunks, data=data))
        self.num_chunks += 1


def read_chunks(sessions: sessionmaker[Session], file_id: str) -> Iterator[bytes]:
    """The file's bytes in order, one chunk per query: memory holds one chunk whatever the file's size."""
    with sessions() as session:
        legacy = session.execute(select(File.content).where(File.id == file_id)).scalar_one_or_none()
        if legacy is not None:
            yield legacy
            return
        seq = 0
        while (
            data := session.execute(
                select(FileChunk.data).where(FileChunk.file_id == file_id, FileChunk.seq == seq)
            ).scalar_one_or_none()
        ) is not None:
            yield data
            seq += 1
