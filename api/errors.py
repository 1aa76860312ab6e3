"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, for every failure.

Clients (the openai SDK included) read `error.message`; ours always says what to change. FastAPI's
own 422 validation errors and Starlette's 404/405 are rewritten into the same shape.
"""

from __future__ import annotations

import logging

import redis.exceptions
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenloom.store.models import Job, JobErrorCode

log = logging.getLogger("tokenloom.api")

DATABASE_RETRY_AFTER_S = 5

# OpenAI's error `type` per status code; the SDK maps the status to its exception class.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """Raise from a route or dependency; rendered by `api_error_handler`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def file_not_found(file_id: str, caller) -> ApiError:
    """404 for a file id the caller cannot see (unknown, or another project's)."""
    where = "" if caller.is_admin else f" in project {caller.project!r}"
    return ApiError(
        404, f"no file {file_id!r}{where}: GET /v1/files lists yours", param="file_id", code="file_not_found"
    )


def failed_job_error(job: Job) -> ApiError:
    """The error a request answers with when its job ended without output: one mapping from the
    row's error code (JobErrorCode.http_status) for streamed and non-streamed requests alike."""
    code = job.failure_code or JobErrorCode.ENGINE_ERROR
    return ApiError(code.http_status, f"job {job.id} failed: {job.error or code.value}", code=code.value)


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status_code, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status_code: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param, code), status_code=status_code, headers=headers)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """FastAPI's error list -> one sentence naming each bad field, and the first field as `param`."""
    parts, first_param = [], None
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        first_param = first_param or field
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field '{field}': remove it (see the API reference at /docs)")
        elif err.get("type") == "missing":
            parts.append(f"'{field}' is required")
        elif err.get("type") in ("json_invalid", "model_attributes_type") and field == "body":
            parts.append("the body must be a JSON object (send Content-Type: application/json)")
        else:
            parts.append(f"'{field}': {err.get('msg', 'invalid value')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more, first_param


async def api_error_handler(_request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status_code, exc.message, exc.param, exc.code, exc.headers)


async def validation_error_handler(_request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(list(exc.errors()))
    return error_response(422, message, param)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}: see /docs for the endpoints"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}: see /docs for the methods"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


async def database_unavailable_handler(_request: Request, exc: Exception) -> JSONResponse:
    # Connection refused or dropped, pool exhausted: a Postgres restart looks like this. Every write
    # is one transaction, so a refused submission left nothing behind and the client can retry.
    log.warning("database unavailable: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return error_response(
        503,
        f"the database is unavailable ({type(exc).__name__}): retry after {DATABASE_RETRY_AFTER_S} s",
        code="database_unavailable",
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )


async def redis_unavailable_handler(_request: Request, exc: Exception) -> JSONResponse:
    log.warning("Redis unavailable: %s", exc)
    return error_response(
        503,
        f"the job queue (Redis) is unavailable ({type(exc).__name__}): retry after {DATABASE_RETRY_AFTER_S} s",
        code="queue_unavailable",
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )


async def database_data_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    # A value the database cannot store or compare (e.g. U+0000 in text): the request's fault.
    return error_response(
        400,
        "a value in the request cannot be stored (for example a NUL character, U+0000, "
        "in a text field or id): remove it",
        code="invalid_value",
    )


async def unexpected_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); the server log has the details")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    for unavailable in (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, sqlalchemy.exc.TimeoutError):
        app.add_exception_handler(unavailable, database_unavailable_handler)
    app.add_exception_handler(sqlalchemy.exc.DataError, database_data_error_handler)
    for unavailable in (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        app.add_exception_handler(unavailable, redis_unavailable_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
