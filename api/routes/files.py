"""/v1/files (OpenAI Files API): upload a batch input file, read files back (metadata, content, list).

Uploads are multipart (`file`, `purpose`), as the openai SDK sends them, bounded by
[server] max_file_mb. Only purpose "batch" is accepted, and the file is checked at upload
(api/batch_file.py), so a malformed batch file is refused before any batch refers to it.
Batch output and error files (purposes batch_output, batch_error) are written by the worker.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from tokenloom.api.batch_file import parse_batch_file
from tokenloom.api.deps import Caller, State
from tokenloom.api.errors import ApiError
from tokenloom.api.file_schemas import FilePage, FilePublic
from tokenloom.store import file_queries

router = APIRouter(prefix="/v1/files", tags=["files"])



@router.post("", response_model=FilePublic)
async def upload_file(file: UploadFile, purpose: Annotated[str, Form(max_length=64)], state: State,
                      caller: Caller) -> FilePublic:
    """A batch input file (JSONL, one OpenAI batch request per line) with purpose "batch"."""
    if purpose != "batch":
        raise ApiError(400, f"purpose {purpose!r} is not supported: tokenloom stores batch input files only "
                            "(purpose \"batch\")", param="purpose", code="unsupported_purpose")
    content = await file.read()
    filename = "".join(c for c in (file.filename or "") if c.isprintable())[:512] or "batch.jsonl"

    def store():
        parse_batch_file(content, state.config.server.max_batch_lines)
        return file_queries.create_file(state.sessions, caller.project, purpose, filename, content)

    return FilePublic.of(await run_in_threadpool(store))


@router.get("", response_model=FilePage)
async def list_files(
    state: State, caller: Caller, purpose: Literal["batch", "batch_output", "batch_error"] | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100, after: Annotated[str | None, Query(max_length=64)] = None,
    order: Literal["asc", "desc"] = "desc",
) -> FilePage:
    """Newest first (order=desc) or oldest first; pass a page's `last_id` as `after` for the next one."""
    try:
        page = await run_in_threadpool(file_queries.list_files, state.sessions, _scope(caller), purpose=purpose,
                                       limit=limit, after=after, ascending=order == "asc")
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


@router.get("/{file_id}/content", response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}}}})
async def get_file_content(file_id: str, state: State, caller: Caller) -> Response:
    """The file's bytes: for batch outputs and errors, one JSON object per line (OpenAI's formats)."""
    content = await run_in_threadpool(file_queries.file_content, state.sessions, file_id, _scope(caller))
    if content is None:
        raise file_not_found(file_id, caller)
    return Response(content, media_type="application/octet-stream")


def _scope(caller) -> str | None:
    return None if caller.is_admin else caller.project


def file_not_found(file_id: str, caller) -> ApiError:
    where = "" if caller.is_admin else f" in project {caller.project!r}"
    return ApiError(404, f"no file {file_id!r}{where}: GET /v1/files lists yours", param="file_id",
                    code="file_not_found")
