"""/v1/files (OpenAI Files API): upload a batch input file, read files back (metadata, content, list).

Uploads are multipart (`file`, `purpose`), as the openai SDK sends them, bounded by
[server] max_file_mb. Only purpose "batch" is accepted, and the file is checked at upload
(api/batches/batch_file.py), so a malformed batch file is refused before any batch refers to it.
Batch output and error files (purposes batch_output, batch_error) are written by the worker.

Files of up to 200 MB never sit whole in memory: Starlette spools the multipart part to a
temporary file, which is read, checked and stored in chunks (store/files/file_chunks.py) in one
transaction; content is streamed back one stored chunk at a time.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from tokenloom.api.batches.batch_file import checked_chunks
from tokenloom.api.deps import Caller, State
from tokenloom.api.errors import ApiError, file_not_found
from tokenloom.api.files.file_schemas import FilePage, FilePublic
from tokenloom.store.files import file_chunks, file_queries

router = APIRouter(prefix="/v1/files", tags=["files"])


@router.post("", response_model=FilePublic)
async def upload_file(
    file: UploadFile, purpose: Annotated[str, Form(max_length=64)], state: State, caller: Caller
) -> FilePublic:
    """A batch input file (JSONL, one OpenAI batch request per line) with purpose "batch"."""
    if purpose != "batch":
        raise ApiError(
            400,
            f'purpose {purpose!r} is not supported: tokenloom stores batch input files only (purpose "batch")',
            param="purpose",
            code="unsupported_purpose",
        )
    filename = "".join(c for c in (file.filename or "") if c.isprintable())[:512] or "batch.jsonl"
    limits = state.config.server

    def store():
        reads = iter(lambda: file.file.read(file_chunks.CHUNK_BYTES), b"")
        chunks = checked_chunks(reads, limits.max_batch_lines, limits.max_body_mb * 2**20)
        return file_queries.create_file(state.sessions, caller.project, purpose, filename, chunks)

    return FilePublic.of(await run_in_threadpool(store))


@router.get("", response_model=FilePage)
async def list_files(
    state: State,
    caller: Caller,
    purpose: Literal["batch", "batch_output", "batch_error"] | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    after: Annotated[str | None, Query(max_length=64)] = None,
    order: Literal["asc", "desc"] = "desc",
) -> FilePage:
    """Newest first (order=desc) or oldest first; pass a page's `last_id` as `after` for the next one."""
    try:
        page = await run_in_threadpool(
            file_queries.list_files,
            state.sessions,
            _scope(caller),
            purpose=purpose,
            limit=limit,
            after=after,
            ascending=order == "asc",
        )
    except LookupError as exc:
        raise ApiError(404, f"{exc}: pass the last_id of a page you received", param="after") from None
    data = [FilePublic.of(row) for row in page.rows]
    return FilePage.of(data, page.has_more)


@router.get("/{file_id}", response_model=FilePublic)
async def get_file(file_id: str, state: State, caller: Caller) -> FilePublic:
    row = await run_in_threadpool(file_queries.visible_file, state.sessions, file_id, _scope(caller))
    if row is None:
        raise file_not_found(file_id, caller)
    return FilePublic.of(row)


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def get_file_content(file_id: str, state: State, caller: Caller) -> StreamingResponse:
    """The file's bytes: for batch outputs and errors, one JSON object per line (OpenAI's formats)."""
    row = await run_in_threadpool(file_queries.visible_file, state.sessions, file_id, _scope(caller))
    if row is None:
        raise file_not_found(file_id, caller)
    # A sync iterator: Starlette pulls each chunk (one query) in its thread pool.
    return StreamingResponse(
        file_chunks.read_chunks(state.sessions, row.id),
        media_type="application/octet-stream",
        headers={"Content-Length": str(row.bytes)},
    )


def _scope(caller) -> str | None:
    return None if caller.is_admin else caller.project
