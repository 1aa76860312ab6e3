"""The warning a client gets for request fields tokenloom does not define (vLLM's behaviour: accept,
ignore, say so): an `X-Tokenloom-Ignored-Fields` response header and one log line per request.
Under `[server] strict_fields = true` such a request never gets here: it is refused with a 400."""

from __future__ import annotations

import logging

from pydantic import BaseModel

from tokenloom.engine.batch_input import SAMPLING_FIELDS
from tokenloom.engine.request_fields import check_fields

log = logging.getLogger("tokenloom.api")

IGNORED_FIELDS_HEADER = "X-Tokenloom-Ignored-Fields"


def ignored_field_headers(body: BaseModel, route: str) -> dict[str, str]:
    """{header: "a, b"} for the unknown fields `body` carried (and a warning log), else {}."""
    extra = body.model_extra or {}
    unknown = check_fields(extra, SAMPLING_FIELDS, strict=False).unknown if extra else ()
    if not unknown:
        return {}
    log.warning("%s: ignored request field(s) tokenloom does not define: %s", route, ", ".join(unknown))
    return {IGNORED_FIELDS_HEADER: ", ".join(unknown)}
