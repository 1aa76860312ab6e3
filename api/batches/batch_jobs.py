"""Batch input lines -> job rows, at POST /v1/batches.

Each line is checked exactly like an online request (openai_protocol/batch_input.py, then the served
model's tokenizer and context limit). A line that fails becomes a job row that is `failed` from
the start with the reason, so it appears in the batch's error file in OpenAI's format and the
rest of the batch still runs. Lines that name another model or another endpoint refuse the whole
batch (400 naming the line): that is a wrong file, not a bad request.

Every line runs in the batch class at priority 0 (the Batch API is the flex tier, whoever sends
it). A line whose `service_tier` or `priority` asks for more than the key's allowance
(api/class_allowance.py) fails as that line's error, like any request that cannot run, so the
error file says what it was not given instead of the line running as if it had been.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator

from tokenloom.api.batches.batch_file import BatchLine
from tokenloom.api.class_allowance import ClassAllowance
from tokenloom.api.errors import ApiError
from tokenloom.api.job_request import NON_SAMPLING_FIELDS, job_for_item
from tokenloom.api.served_model import ServedModel
from tokenloom.openai_protocol.batch_input import parse_line
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobErrorCode, JobStatus, utcnow


def check_line_fits_batch(line: BatchLine, endpoint: str, served: ServedModel) -> None:
    if line.url != endpoint:
        raise ApiError(
            400,
            f"line {line.number} of the batch file has url {line.url!r} but the batch's "
            f"endpoint is {endpoint!r}: create the batch with endpoint {line.url!r}",
            param="endpoint",
            code="endpoint_mismatch",
        )
    model = line.body.get("model")
    if not (model is None or isinstance(model, str) and served.answers_to(model)):
        raise ApiError(
            400,
            f"line {line.number} of the batch file asks for model {model!r} but this API "
            f"serves {served.public_name!r} (GET /v1/models): fix body.model in the file",
            param="model",
            code="model_not_found",
        )


def jobs_for_lines(
    lines: Iterable[BatchLine], endpoint: str, served: ServedModel, project: str, allowance: ClassAllowance
) -> Iterator[Job]:
    """One unsaved row per line, as the lines are read; an ApiError(400) at the first line that
    does not belong in this batch (the caller's transaction then stores nothing). `allowance`: the
    submitting key's (a line outside it becomes a failed row)."""
    for line in lines:
        check_line_fits_batch(line, endpoint, served)
        yield _job(line, served, project, allowance)


def _job(line: BatchLine, served: ServedModel, project: str, allowance: ClassAllowance) -> Job:
    fields = {k for k in line.body if k not in NON_SAMPLING_FIELDS}
    row = dict(custom_id=line.custom_id, line_number=line.number, work_class=WorkClass.BATCH)
    try:
        # The line keeps the batch class whatever it asks; asking beyond the key's allowance fails it.
        allowance.work_class(WorkClass.BATCH, line.body.get("service_tier"), line.body.get("priority"))
        return job_for_item(
            parse_line(line.text, line.number, strict=served.strict_fields), fields, served, project, **row
        )
    except ApiError as exc:
        return Job(
            id=uuid.uuid4(),
            project=project,
            model=served.name,
            endpoint=line.url,
            status=JobStatus.FAILED,
            error=exc.message,
            error_code=JobErrorCode.INVALID_REQUEST,
            finished_at=utcnow(),
            params={},
            **row,
        )
