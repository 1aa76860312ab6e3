"""Logging for every CLI command: one --log-level, and text or JSON lines (--log-format,
TOKENLOOM_LOG_FORMAT) on stderr.

JSON logs are one object per line with the fields log shippers index (time, level, logger,
message, and the traceback as `exc_info` when there is one). uvicorn and Celery log through the
same root handler when JSON is chosen (cli/api_commands.py and cli/worker_commands.py hand
their logging over to it), so a JSON stream has no text lines in it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime, timezone

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
LOG_FORMAT_ENV = "TOKENLOOM_LOG_FORMAT"


class JsonLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def default_log_format() -> str:
    chosen = os.environ.get(LOG_FORMAT_ENV, "text").strip().lower()
    return chosen if chosen in LOG_FORMATS else "text"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (a caller may swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging(level: str, log_format: str) -> None:
    """The root logger's level and one stderr handler of this module (replacing an earlier one;
    handlers others installed stay)."""
    handler = StderrHandler()
    handler.setFormatter(JsonLineFormatter() if log_format == "json" else logging.Formatter("%(message)s"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, StderrHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in QUIET_LOGGERS:  # their INFO lines are set-up chatter, not progress
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))


QUIET_LOGGERS = ("alembic.runtime.plugins",)
