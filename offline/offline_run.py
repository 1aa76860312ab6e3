"""Run a JSONL batch file through an `Engine` and write one result line per input line.

- The input is read lazily, line by line, as bytes (each line is decoded on its own, so a
  line that is not UTF-8 fails alone). Blank lines are skipped entirely: they get no result
  line. Line numbers (`line`, and the default custom_id "line-<n>") are physical 1-based line
  numbers in the file, blank lines included, so they point at the line in an editor.
- At most `4 * [scheduler] max_num_seqs` requests are in the engine at once, and at most four
  times that many lines are read but not yet written (results that finish out of order wait in
  memory for the earlier lines), so memory stays flat however long the file is.
- Results are written in input order as soon as every earlier line is written; the file is
  flushed about once a second. It is written directly to `output_path`, from the start, on
  every attempt.
- Resumable with a `RunLedger` (offline/run_ledger.py; `tokenloom run` passes one backed by
  `[database] url`): the records each engine step finishes are handed to `ledger.record` (one
  committed transaction) BEFORE they are written, so every line in the output file is stored.
  A rerun looks each window fill's lines up in the ledger (by line hash + custom_id) and writes
  the stored record of a line that finished before instead of generating it again; only its
  "line" field is updated if the line moved. Without a ledger nothing is remembered.
- A bad line (not JSON, unknown field, invalid sampling value, prompt too long for
  max_model_len, more prompt logprobs than the limit, ...) becomes a "failed" result line;
  nothing else is affected.
- `queue_s` / `ttft_s` / `e2e_s` are measured from when a line is handed to the engine, not
  from when the run started.
- `output_format="openai"` writes each line as a line of an OpenAI Batch output file instead
  (engine/batch_output.openai_output_line: what /v1/batches writes). The ledger stores the
  tokenloom record either way, so a rerun may switch formats.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import IO, Iterator

from tqdm import tqdm

from tokenloom.engine import Engine, InvalidRequestError, speller_for
from tokenloom.offline.run_ledger import LedgerEntry, LineKey, RunLedger, hash_line, ledger_custom_id
from tokenloom.openai_protocol.batch_input import SAMPLING_FIELDS, BatchItem, BatchLineError, parse_line
from tokenloom.openai_protocol.batch_output import (
    RunStats,
    RunSummary,
    failure_record,
    openai_output_line,
    success_record,
)
from tokenloom.openai_protocol.request_fields import describe_unknown
from tokenloom.openai_protocol.scoring_limit import DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES, check_prompt_logprob_entries

log = logging.getLogger("tokenloom.offline")

FLUSH_INTERVAL_S = 1.0
POSTFIX_INTERVAL_S = 0.5
OUTPUT_FORMATS = ("tokenloom", "openai")
# Ids of OpenAI-format lines derive from the line (bytes, custom_id, number): a rerun writes the same ids.
_LINE_ID_NAMESPACE = uuid.UUID("5f0c2a4e-7d1b-4c8e-9a36-2b7e1f4d8c10")


def run_file(
    engine: Engine,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    progress: bool = True,
    ledger: RunLedger | None = None,
    output_format: str = "tokenloom",
    max_prompt_logprob_entries: int = DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
) -> RunSummary:
    """Run every non-blank line of `input_path`; write results to `output_path` in input order.

    With a `ledger`, lines it holds from an earlier attempt are reused, not generated again.
    `output_format`: "tokenloom" (openai_protocol/batch_output.py result lines) or "openai" (OpenAI Batch
    output lines). A line asking for more prompt logprobs than `max_prompt_logprob_entries` ([server]
    max_prompt_logprob_entries, openai_protocol/scoring_limit.py) fails as that line's error."""
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output format {output_format!r} is not one of {', '.join(OUTPUT_FORMATS)}")
    started = time.perf_counter()
    total = count_jobs(input_path)
    # backslashreplace: a lone surrogate (JSON "\ud800" in a custom_id) is written back as \ud800.
    with (
        open(input_path, "rb") as src,
        open(output_path, "w", encoding="utf-8", errors="backslashreplace") as dst,
        tqdm(
            total=total, unit="req", desc="tokenloom", file=sys.stderr, disable=not progress, dynamic_ncols=True
        ) as bar,
    ):
        run = _Run(engine, _read_lines(src), dst, bar, ledger, output_format, max_prompt_logprob_entries)
        try:
            run.loop()
        finally:
            run.abort_in_flight()
    return run.stats.summary(
        time.perf_counter() - started, engine.counters, throughput=engine.config.metrics.enable_throughput
    )


def count_jobs(path: str | os.PathLike) -> int:
    """Non-blank lines in the file (one result line each)."""
    with open(path, "rb") as fh:
        return sum(1 for raw in fh if raw.strip())


@dataclass(slots=True)
class _Line:
    number: int
    input_hash: str
    text: str | None  # exactly one of text / error is set
    error: str | None


def _read_lines(src: IO[bytes]) -> Iterator[_Line]:
    """Each non-blank line, decoded (or with the reason it cannot be)."""
    for number, raw in enumerate(src, 1):
        if not raw.strip():
            continue
        try:
            yield _Line(number, hash_line(raw), raw.decode("utf-8"), None)
        except UnicodeDecodeError as err:
            yield _Line(number, hash_line(raw), None, f"line is not valid UTF-8 ({err.reason} at byte {err.start})")


class _Run:
    def __init__(
        self,
        engine: Engine,
        lines: Iterator[_Line],
        dst: IO[str],
        bar: tqdm,
        ledger: RunLedger | None = None,
        output_format: str = "tokenloom",
        max_prompt_logprob_entries: int = DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
    ):
        self.engine = engine
        self.max_prompt_logprob_entries = max_prompt_logprob_entries
        self.speller = speller_for(engine.loaded.encoder.backend)
        # Line number -> (line id, chat?) while an OpenAI-format line waits to be written.
        self.openai_lines: dict[int, tuple[str, bool]] | None = {} if output_format == "openai" else None
        self.model = engine.model_name
        self.lines = lines
        self.dst = dst
        self.bar = bar
        self.ledger = ledger
        self.max_in_flight = 4 * engine.config.scheduler.max_num_seqs
        self.max_window = 4 * self.max_in_flight  # read but not yet written
        self.in_flight: dict[str, tuple[BatchItem, LineKey]] = {}  # engine request id -> item, key
        self.order: deque[int] = deque()  # line numbers read and not yet written, in input order
        self.done: dict[int, dict] = {}  # line number -> finished result record
        self.unrecorded: list[LedgerEntry] = []  # finished, not yet in the ledger (nor written)
        self.exhausted = False
        self.warned_fields: set[str] = set()  # unknown request fields already warned about
        self.stats = RunStats(replace(engine.counters))
        self.started = time.perf_counter()
        self.last_flush = self.last_postfix = self.started

    def loop(self) -> None:
        while True:
            self._fill()
            # The previous step's results (and lines that failed while filling) are committed in
            # one transaction before any of them is written: the file never holds a line the
            # ledger lacks, so a rerun after a kill reproduces the file without regenerating.
            self._record()
            self._write_ready()
            if not self.in_flight:
                if self.exhausted:
                    break
                continue  # the window was full of finished lines; they were just written
            steps_before = self.engine.counters.num_steps
            outputs = self.engine.step()
            if self.engine.counters.num_steps == steps_before:
                raise RuntimeError(f"the engine scheduled nothing with {len(self.in_flight)} requests unfinished")
            for output in outputs:
                entry = self.in_flight.get(output.request_id) if output.finished else None
                if entry is not None:
                    del self.in_flight[output.request_id]
                    item, key = entry
                    if output.error is not None:  # the engine failed this line; the run goes on
                        # Not stored in the ledger: an engine fault may be transient, so a rerun
                        # tries the line again instead of reusing the failure.
                        message = f"engine error: {output.error}"
                        log.debug("line %d failed: %s", item.line_number, message)
                        self._complete(
                            item.line_number,
                            key,
                            failure_record(item.custom_id, item.line_number, self.model, message, "server_error"),
                            remember=False,
                        )
                    else:
                        self._complete(
                            item.line_number,
                            key,
                            success_record(
                                item.custom_id,
                                item.line_number,
                                self.model,
                                output,
                                self.speller,
                                self._echo_text(item, output),
                            ),
                        )
            self._update_postfix()
        self.dst.flush()

    def abort_in_flight(self) -> None:
        """Leave the engine clean if the run stops early (an exception or Ctrl-C)."""
        for request_id in list(self.in_flight):
            self.engine.abort(request_id)
        self.in_flight.clear()

    def _fill(self) -> None:
        while not self.exhausted and len(self.in_flight) < self.max_in_flight and len(self.order) < self.max_window:
            # Read as many lines as could start now, then ask the ledger about all of them at
            # once: one lookup per fill, and never more stored records in memory than that.
            room = min(self.max_in_flight - len(self.in_flight), self.max_window - len(self.order))
            parsed = [self._parse(line) for line in self._read(room)]
            stored = self.ledger.lookup([key for key, _ in parsed]) if self.ledger and parsed else {}
            for key, item in parsed:
                self.order.append(item.line_number)
                if self.openai_lines is not None:
                    line_id = uuid.uuid5(_LINE_ID_NAMESPACE, f"{key.input_hash}/{key.custom_id}/{item.line_number}").hex
                    self.openai_lines[item.line_number] = (line_id, getattr(item, "messages", None) is not None)
                record = stored.get(key)
                if record is not None:
                    self._reuse(item.line_number, record)
                elif isinstance(item, BatchLineError):
                    self._fail(item.line_number, key, item.custom_id, item.message)
                else:
                    self._submit(item, key)

    def _read(self, count: int) -> list[_Line]:
        lines: list[_Line] = []
        while len(lines) < count:
            line = next(self.lines, None)
            if line is None:
                self.exhausted = True
                break
            lines.append(line)
        return lines

    def _parse(self, line: _Line) -> tuple[LineKey, BatchItem | BatchLineError]:
        parsed: BatchItem | BatchLineError
        if line.text is not None:
            parsed = parse_line(line.text, line.number, self.engine.default_params)
        else:
            assert line.error is not None  # _read_lines sets exactly one of text / error
            parsed = BatchLineError(line.number, None, line.error)
        unknown = [name for name in getattr(parsed, "unknown_fields", ()) if name not in self.warned_fields]
        if unknown:  # once per field name: a 50k-line file repeating a typo gets one warning, not 50k
            self.warned_fields.update(unknown)
            log.warning(
                "line %d: %s, ignored (tokenloom ignores request fields it does not define)",
                line.number,
                describe_unknown(unknown, SAMPLING_FIELDS),
            )
        return LineKey(line.input_hash, ledger_custom_id(parsed.custom_id, line.number)), parsed

    def _echo_text(self, item: BatchItem, output) -> str | None:
        """The prompt's text for a line that asked for `echo` (its token ids decoded when it gave ids)."""
        if not item.echo:
            return None
        return item.prompt if isinstance(item.prompt, str) else self.engine.decode(output.prompt_token_ids)

    def _submit(self, item: BatchItem, key: LineKey) -> None:
        request_id = f"batch-line-{item.line_number}"
        prompt, messages = item.prompt, item.messages
        try:
            if item.params.prompt_logprobs is not None:  # counted before it runs: tokenized here, once
                prompt, messages = self.engine.encode_prompt(prompt, messages), None
                check_prompt_logprob_entries(item.params, len(prompt), self.max_prompt_logprob_entries, echo=item.echo)
            self.engine.add_request(request_id, prompt, messages=messages, params=item.params)
        except InvalidRequestError as err:
            self._fail(item.line_number, key, item.custom_id, str(err))
        except Exception as err:  # e.g. a chat template that rejects these messages
            log.debug("line %d: add_request failed", item.line_number, exc_info=True)
            self._fail(item.line_number, key, item.custom_id, f"could not queue the request: {err}")
        else:
            self.in_flight[request_id] = (item, key)

    def _fail(self, number: int, key: LineKey, custom_id: str | None, message: str) -> None:
        log.debug("line %d failed: %s", number, message)
        self._complete(number, key, failure_record(custom_id, number, self.model, message))

    def _complete(self, number: int, key: LineKey, record: dict, remember: bool = True) -> None:
        self.done[number] = record
        if self.ledger is not None and remember:
            self.unrecorded.append(LedgerEntry(key, number, record))
        self.stats.add(record)
        self.bar.update(1)

    def _reuse(self, number: int, record: dict) -> None:
        # Same bytes and custom_id, so the same result; only its position may have changed.
        if record.get("line") != number:
            record = {**record, "line": number}
        self.done[number] = record
        self.stats.add(record, reused=True)
        self.bar.update(1)

    def _record(self) -> None:
        # Entries are only queued when there is a ledger (see _complete).
        if self.unrecorded and self.ledger is not None:
            self.ledger.record(self.unrecorded)
            self.unrecorded = []

    def _write_ready(self) -> None:
        while self.order and self.order[0] in self.done:
            number = self.order.popleft()
            record = self.done.pop(number)
            if self.openai_lines is not None:
                line_id, chat = self.openai_lines.pop(number)
                record = openai_output_line(record, chat, int(time.time()), line_id)
            self.dst.write(json.dumps(record, ensure_ascii=False) + "\n")
        now = time.perf_counter()
        if now - self.last_flush >= FLUSH_INTERVAL_S:
            self.dst.flush()
            self.last_flush = now

    def _update_postfix(self) -> None:
        now = time.perf_counter()
        if (
            self.bar.disable
            or not self.engine.config.metrics.enable_throughput
            or now - self.last_postfix < POSTFIX_INTERVAL_S
        ):
            return
        self.last_postfix = now
        generated = self.engine.counters.num_generated_tokens - self.stats.counters_at_start.num_generated_tokens
        self.bar.set_postfix_str(f"{generated / (now - self.started):,.1f} out tok/s", refresh=False)
