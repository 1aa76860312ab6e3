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
    expires_at: int | None = None  # files are kept until deleted from the database
    status_details: str | None = None

    @classmethod
    def of(cls, row: File) -> "FilePublic":
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=int(row.created_at.timestamp()),
            filename=row.filename,
            purpose=row.purpose,
        )


FilePage = ListPage[FilePublic]
