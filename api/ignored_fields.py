"""The warning a client gets for request fields tokenloom does not define (vLLM's behaviour: accept,
ignore, say so): an `X-Tokenloom-Ignored-Fields` response header and one log line per request.
Under `[server] strict_fields = true` such a request never gets here: it is refused with a 400."""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel

from tokenloom.openai_protocol.batch_input import SAMPLING_FIELDS
from tokenloom.openai_protocol.request_fields import check_fields

log = logging.getLogger("tokenloom.api")

IGNORED_FIELDS_HEADER = "X-Tokenloom-Ignored-Fields"


def ignored_field_headers(body: BaseModel, route: str) -> dict[str, str]:
    """{header: "a, b"} for the unknown fields `body` carried (and a warning log), else {}."""
    extra = body.model_extra or {}
    unknown = check_fields(extra, SAMPLING_FIELDS, strict=False).unknown if extra else ()
    if not unknown:
        return {}
    log.warning("%s: ignored request field(s) tokenloom does not define: %s", route, ", ".join(unknown))
    return {IGNORED_FIELDS_HEADER: ", ".join(_header_safe(name) for name in unknown)}


def _header_safe(name: str) -> str:
    """A field name as HTTP header text: ASCII only, no control characters (a client may send any
    JSON key: a CR/LF would split the header, a non-Latin-1 character cannot be sent at all)."""
    return json.dumps(name, ensure_ascii=True)[1:-1]
