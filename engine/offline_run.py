"""Run a JSONL batch file through an `Engine` and write one result line per input line.

- The input is read lazily, line by line, as bytes (each line is decoded on its own, so a
  line that is not UTF-8 fails alone). Blank lines are skipped entirely: they get no result
  line. Line numbers (`line`, and the default custom_id "line-<n>") are physical 1-based line
  numbers in the file, blank lines included, so they point at the line in an editor.
- At most `4 * [scheduler] max_num_seqs` requests are in the engine at once, and at most four
  times that many lines are read but not yet written (results that finish out of order wait in
  memory for the earlier lines), so memory stays flat however long the file is.
- Results are written in input order as soon as every earlier line is written; the file is
  flushed about once a second. It is written directly to `output_path` (not resumable yet).
- A bad line (not JSON, unknown field, invalid sampling value, prompt too long for
  max_model_len, ...) becomes a "failed" result line; nothing else is affected.
- `queue_s` / `ttft_s` / `e2e_s` are measured from when a line is handed to the engine, not
  from when the run started.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import deque
from dataclasses import replace
from typing import IO, Iterator

from tqdm import tqdm

from engine.batch_input import BatchItem, BatchLineError, parse_line
from engine.batch_output import RunStats, RunSummary, failure_record, success_record
from engine.engine import Engine
from engine.sampling_params import InvalidRequestError

log = logging.getLogger("tokenloom.offline")

FLUSH_INTERVAL_S = 1.0
POSTFIX_INTERVAL_S = 0.5


def run_file(engine: Engine, input_path: str | os.PathLike, output_path: str | os.PathLike,
             progress: bool = True) -> RunSummary:
    """Run every non-blank line of `input_path`; write results to `output_path` in input order."""
    started = time.perf_counter()
    total = count_jobs(input_path)
    # backslashreplace: a lone surrogate (JSON "\ud800" in a custom_id) is written back as \ud800.
    with open(input_path, "rb") as src, \
            open(output_path, "w", encoding="utf-8", errors="backslashreplace") as dst, \
            tqdm(total=total, unit="req", desc="tokenloom", file=sys.stderr, disable=not progress,
                 dynamic_ncols=True) as bar:
        run = _Run(engine, _read_lines(src), dst, bar)
        try:
            run.loop()
        finally:
            run.abort_in_flight()
    return run.stats.summary(time.perf_counter() - started, engine.counters)


def count_jobs(path: str | os.PathLike) -> int:
    """Non-blank lines in the file (one result line each)."""
    with open(path, "rb") as fh:
        return sum(1 for raw in fh if raw.strip())


def _read_lines(src: IO[bytes]) -> Iterator[tuple[int, str | None, str | None]]:
    """(line_number, text, error) for each non-blank line; exactly one of text/error is set."""
    for number, raw in enumerate(src, 1):
        if not raw.strip():
            continue
        try:
            yield number, raw.decode("utf-8"), None
        except UnicodeDecodeError as err:
            yield number, None, f"line is not valid UTF-8 ({err.reason} at byte {err.start})"


class _Run:
    def __init__(self, engine: Engine, lines: Iterator, dst: IO[str], bar: tqdm):
        self.engine = engine
        self.model = engine.model_name
        self.lines = lines
        self.dst = dst
        self.bar = bar
        self.max_in_flight = 4 * engine.config.scheduler.max_num_seqs
        self.max_window = 4 * self.max_in_flight  # read but not yet written
        self.in_flight: dict[str, BatchItem] = {}  # engine request id -> item
        self.order: deque[int] = deque()  # line numbers read and not yet written, in input order
        self.done: dict[int, dict] = {}  # line number -> finished result record
        self.exhausted = False
        self.stats = RunStats(replace(engine.counters))
        self.started = time.perf_counter()
        self.last_flush = self.last_postfix = self.started

    def loop(self) -> None:
        while True:
            self._fill()
            self._write_ready()
            if not self.in_flight:
                if self.exhausted:
                    break
                continue  # the window was full of finished lines; they were just written
            steps_before = self.engine.counters.num_steps
            outputs = self.engine.step()
            if self.engine.counters.num_steps == steps_before:
                raise RuntimeError(
                    f"the engine scheduled nothing with {len(self.in_flight)} requests unfinished"
                )
            for output in outputs:
                item = self.in_flight.get(output.request_id) if output.finished else None
                if item is not None:
                    del self.in_flight[output.request_id]
                    self._complete(item.line_number,
                                   success_record(item.custom_id, item.line_number, self.model, output))
            self._update_postfix()
        self.dst.flush()

    def abort_in_flight(self) -> None:
        """Leave the engine clean if the run stops early (an exception or Ctrl-C)."""
        for request_id in list(self.in_flight):
            self.engine.abort(request_id)
        self.in_flight.clear()

    def _fill(self) -> None:
        while (not self.exhausted and len(self.in_flight) < self.max_in_flight
               and len(self.order) < self.max_window):
            entry = next(self.lines, None)
            if entry is None:
                self.exhausted = True
                return
            number, text, error = entry
            self.order.append(number)
            parsed = parse_line(text, number, self.engine.default_params) if error is None \
                else BatchLineError(number, None, error)
            if isinstance(parsed, BatchLineError):
                self._fail(number, parsed.custom_id, parsed.message)
            else:
                self._submit(parsed)

    def _submit(self, item: BatchItem) -> None:
        request_id = f"batch-line-{item.line_number}"
        try:
            self.engine.add_request(request_id, item.prompt, messages=item.messages, params=item.params)
        except InvalidRequestError as err:
            self._fail(item.line_number, item.custom_id, str(err))
        except Exception as err:  # e.g. a chat template that rejects these messages
            log.debug("line %d: add_request failed", item.line_number, exc_info=True)
            self._fail(item.line_number, item.custom_id, f"could not queue the request: {err}")
        else:
            self.in_flight[request_id] = item

    def _fail(self, number: int, custom_id: str | None, message: str) -> None:
        log.debug("line %d failed: %s", number, message)
        self._complete(number, failure_record(custom_id, number, self.model, message))

    def _complete(self, number: int, record: dict) -> None:
        self.done[number] = record
        self.stats.add(record)
        self.bar.update(1)

    def _write_ready(self) -> None:
        while self.order and self.order[0] in self.done:
            record = self.done.pop(self.order.popleft())
            self.dst.write(json.dumps(record, ensure_ascii=False) + "\n")
        now = time.perf_counter()
        if now - self.last_flush >= FLUSH_INTERVAL_S:
            self.dst.flush()
            self.last_flush = now

    def _update_postfix(self) -> None:
        now = time.perf_counter()
        if self.bar.disable or now - self.last_postfix < POSTFIX_INTERVAL_S:
            return
        self.last_postfix = now
        generated = self.engine.counters.num_generated_tokens - self.stats.counters_at_start.num_generated_tokens
        self.bar.set_postfix_str(f"{generated / (now - self.started):,.1f} out tok/s", refresh=False)
