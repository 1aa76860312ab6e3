"""OpenAI's File object and list, as the Files API returns them (openai.types.FileObject)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from tokenloom.api.list_page import ListPage
from tokenloom.store.models import File


class FilePublic(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str  # batch (uploaded), batch_output, batch_error (written by the finalizer)
    status: Literal["processed"] = "processed"  # validated at upload, so never "uploaded" or "error"
    expires_at: int | None = None  # a batch's output files, when it set output_expires_after
    status_details: str | None = None

    @classmethod
    def of(cls, row: File) -> "FilePublic":
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=int(row.created_at.timestamp()),
            filename=row.filename,
            purpose=row.purpose,
            expires_at=None if row.expires_at is None else int(row.expires_at.timestamp()),
        )


FilePage = ListPage[FilePublic]
