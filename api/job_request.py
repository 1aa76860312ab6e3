"""An API request body -> an unsaved, validated `Job` row (queued), or a 400/404 saying what to fix.

Validation is the engine's: the body goes through `engine.batch_input.parse_line` (the same
checks as a line of `tokenloom run` / `tokenloom submit`), then the served model's tokenizer and
context limit, and the prompt logprobs it may ask for (openai_protocol/scoring_limit.py). Only the
sampling fields the client set are stored; the worker fills the rest from its [sampling] defaults,
exactly as for submitted files.
"""

from __future__ import annotations

import json
import uuid

from tokenloom.api.auth import Principal
from tokenloom.api.errors import ApiError
from tokenloom.api.served_model import ServedModel
from tokenloom.engine import STRUCTURED_OUTPUT_FIELDS as STRUCTURED_FIELDS
from tokenloom.engine import InvalidRequestError, SamplingParams
from tokenloom.openai_protocol.batch_input import CHAT_URL, COMPLETIONS_URL, BatchItem, BatchLineError, parse_line
from tokenloom.openai_protocol.scoring_limit import check_prompt_logprob_entries
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus

# Body fields the route handles itself (the rest goes through openai_protocol/batch_input.py's field rule).
NON_SAMPLING_FIELDS = frozenset({"model", "stream", "stream_options", "custom_id", "priority", "service_tier"})
# (`echo` is not a sampling field either: parse_line reads it into BatchItem.echo, stored as jobs.echo)
# Request field -> the SamplingParams field it sets.
PARAM_OF_FIELD = {
    "max_completion_tokens": "max_tokens",
    "top_logprobs": "logprobs",
    **{name: "structured_outputs" for name in STRUCTURED_FIELDS},
}
PARAM_NAMES = SamplingParams.field_names()


def model_not_found(requested: str, served: ServedModel) -> ApiError:
    return ApiError(
        404,
        f"model {requested!r} is not served here: this API serves {served.public_name!r} (GET /v1/models lists it)",
        param="model",
        code="model_not_found",
    )


def check_model(requested: str | None, served: ServedModel) -> None:
    if not served.answers_to(requested):
        raise model_not_found(requested, served)


def refuse_nul(prompt, messages: list | None, custom_id: str | None) -> None:
    """Postgres text cannot hold U+0000 (and no tokenizer means anything by it): refuse it up front."""
    texts = [("prompt", prompt), ("custom_id", custom_id)]
    for i, message in enumerate(messages or []):
        content = message.get("content") if isinstance(message, dict) else None
        parts = content if isinstance(content, list) else [content]
        texts += [(f"messages[{i}].content", p.get("text") if isinstance(p, dict) else p) for p in parts]
    for where, text in texts:
        if isinstance(text, str) and "\x00" in text:
            raise InvalidRequestError(f"{where} contains a NUL character (U+0000): remove it")


def build_job(
    body: dict,
    served: ServedModel,
    caller: Principal,
    endpoint_class: WorkClass,
    *,
    custom_id: str | None = None,
    where: str = "",
) -> Job:
    """`body`: the request without None values, holding `prompt` or `messages`. `where` prefixes
    error messages (e.g. "requests[3]: ") when the body is one item of a list. Unknown fields are
    refused when the served model's API is strict ([server] strict_fields), else ignored. The
    job goes to `caller`'s project. Its class is the endpoint's, unless the body's `service_tier`
    maps it elsewhere; its `priority` orders it within the class; both within the caller's
    allowance, else ApiError(403) (api/class_allowance.py)."""
    check_model(body.get("model"), served)
    work_class = caller.allowance.work_class(
        endpoint_class, body.get("service_tier"), body.get("priority"), where=where
    )
    line = {k: v for k, v in body.items() if k not in NON_SAMPLING_FIELDS}
    return job_for_item(
        parse_line(json.dumps(line), 1, strict=served.strict_fields),
        line,
        served,
        caller.project,
        where=where,
        custom_id=custom_id,
        priority=body.get("priority", 0),
        work_class=work_class,
    )


def job_for_item(
    item: BatchItem | BatchLineError, fields, served: ServedModel, project: str, *, where: str = "", **row
) -> Job:
    """A parsed request (`fields`: the names it set) -> a queued row, or ApiError(400). `row`: extra
    Job columns (custom_id, priority, line_number, work_class)."""
    try:
        if isinstance(item, BatchLineError):
            raise ApiError(400, f"{where}{item.message}", param=item.param)
        refuse_nul(item.prompt, item.messages, row.get("custom_id"))
        prompt_ids = served.encode(item.prompt, item.messages)
        served.check_fits(item.params, len(prompt_ids))
        check_prompt_logprob_entries(item.params, len(prompt_ids), served.max_prompt_logprob_entries, echo=item.echo)
    except InvalidRequestError as exc:
        raise ApiError(400, f"{where}{exc}", param=getattr(exc, "param", None)) from None
    explicit = {PARAM_OF_FIELD.get(k, k) for k in fields} & PARAM_NAMES
    if item.params.prompt_logprobs is not None:  # set by echo + logprobs, or by the client
        explicit.add("prompt_logprobs")
    prompt = item.prompt if isinstance(item.prompt, str) else None
    if item.echo and prompt is None:  # the echoed text of a token-id prompt, decoded once here
        prompt = served.encoder.decode(prompt_ids)
    return Job(
        id=uuid.uuid4(),
        project=project,
        model=served.name,
        endpoint=CHAT_URL if item.messages is not None else COMPLETIONS_URL,
        prompt=prompt,
        echo=item.echo,
        # Tokenized here once (chat template applied): the worker runs these ids, it never re-encodes.
        prompt_token_ids=prompt_ids,
        messages=item.messages,
        status=JobStatus.QUEUED,
        params={name: getattr(item.params, name) for name in sorted(explicit)},
        **row,
    )
