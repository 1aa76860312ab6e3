"""A request body size limit ([server] max_body_mb) as pure ASGI middleware -> 413 in OpenAI's shape.

File uploads (POST /v1/files) get their own, larger limit ([server] max_file_mb): a batch input
file is legitimately much bigger than any single request.

Checked twice: a declared Content-Length over the limit is refused before reading anything, and
a chunked body is counted as it arrives, so neither kind can make the server buffer more.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException

from tokenloom.api.errors import error_body


def too_large_message(max_bytes: int, upload: bool = False) -> str:
    if upload:
        return (
            f"file is larger than {max_bytes / 2**20:g} MiB: split it into several batch files, or raise "
            "[server] max_file_mb"
        )
    return (
        f"request body is larger than {max_bytes / 2**20:g} MiB: send less per request (split a long "
        "POST /v1/jobs list), or raise [server] max_body_mb"
    )


class BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body parsing re-raises it (any other error there becomes a 400)
    and the app's handler renders it in OpenAI's shape."""

    def __init__(self, max_bytes: int, upload: bool = False):
        super().__init__(413, too_large_message(max_bytes, upload))


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, upload_paths: frozenset[str] = frozenset(), max_upload_bytes: int = 0):
        self.app = app
        self.default_max_bytes = max_bytes
        self.upload_paths = upload_paths
        self.max_upload_bytes = max_upload_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope.get("path") in self.upload_paths
        max_bytes = self.max_upload_bytes if upload else self.default_max_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._refuse(send, max_bytes, upload)
            return
        received = 0
        response_started = False

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise BodyTooLarge(max_bytes, upload)
            return message

        async def tracking_send(message):
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not response_started:
                await self._refuse(send, max_bytes, upload)

    async def _refuse(self, send, max_bytes: int, upload: bool) -> None:
        body = json.dumps(error_body(413, too_large_message(max_bytes, upload))).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
