"""The contract between the offline runner and whatever remembers finished lines (a "ledger").

`offline/offline_run.py` uses a ledger to make `tokenloom run` resumable without knowing how it
is stored: `store/offline_ledger.py` implements it on the job-queue database (SQLAlchemy), and
engine/ stays free of SQL. A line is identified by a `LineKey`: the sha256 of its raw bytes plus
its custom_id, so an edited line (new hash) or a line whose id changed is run again.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True, slots=True)
class LineKey:
    input_hash: str  # sha256 hex of the line's bytes, without its line terminator
    custom_id: str  # the line's custom_id, or "line-<n>" when it has none (see `ledger_custom_id`)


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One finished line: `record` is exactly the result line written to the output file."""

    key: LineKey
    line_number: int
    record: dict


class LedgerError(RuntimeError):
    """The ledger's storage failed or cannot be used; the message says what to check."""


class RunLedger(Protocol):
    def lookup(self, keys: Sequence[LineKey]) -> dict[LineKey, dict]:
        """The stored result records of those keys that finished in an earlier attempt of this run.

        Called once per window fill with at most a few hundred keys, so a ledger never has to
        hold a whole run's records in memory."""
        ...

    def record(self, entries: Sequence[LedgerEntry]) -> None:
        """Store finished lines durably, all or none (one transaction); returns once committed.

        An entry replaces any stored line of the run with the same custom_id (an edited line).
        Storage failures raise LedgerError."""
        ...


def hash_line(raw: bytes) -> str:
    # The terminator is left out so that appending lines to a file whose last line had no
    # newline does not change that line's hash (and force it to run again).
    return hashlib.sha256(raw.rstrip(b"\r\n")).hexdigest()


def ledger_custom_id(custom_id: str | None, line_number: int) -> str:
    """A line's id in the ledger: its own, else the same "line-<n>" default parse_line gives."""
    return custom_id if custom_id is not None else f"line-{line_number}"


def run_key(model: str, output_path: str | os.PathLike) -> str:
    """What identifies a run across attempts: the model and where its results go."""
    absolute = str(Path(output_path).resolve())
    return hashlib.sha256(f"{model}\0{absolute}".encode("utf-8", "surrogatepass")).hexdigest()
