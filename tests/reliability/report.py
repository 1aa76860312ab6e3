"""One table row per fault test, printed as `RELIABILITY|...` so `pytest -s` output can be
collected into docs/reliability.md (see that file for the command).

Columns: scenario | jobs submitted | jobs finished (exactly one terminal row each) | duplicates
(extra terminal rows or batch output lines per job) | lost (submitted jobs with no terminal row)
| max recovery time (seconds; each test says what it measures, in `recovery`).
"""

from __future__ import annotations

import collections


def duplicates_of(keys) -> int:
    """How many entries repeat an earlier one (0 when every key is unique)."""
    return sum(count - 1 for count in collections.Counter(keys).values())


def report_row(scenario: str, submitted: int, finished: int, duplicates: int, lost: int,
               recovery_s: float | None, recovery: str) -> None:
    recovery_text = "n/a" if recovery_s is None else f"{recovery_s:.1f}"
    print(f"\nRELIABILITY|{scenario}|{submitted}|{finished}|{duplicates}|{lost}|{recovery_text}|{recovery}", flush=True)
