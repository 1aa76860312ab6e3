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


def report_row(
    scenario: str, submitted: int, finished: int, duplicates: int, lost: int, recovery_s: float | None, recovery: str
) -> None:
    recovery_text = "n/a" if recovery_s is None else f"{recovery_s:.1f}"
    print(f"\nRELIABILITY|{scenario}|{submitted}|{finished}|{duplicates}|{lost}|{recovery_text}|{recovery}", flush=True)


def batch_output_duplicates(sessions, batch_id, timeout_s: float = 60.0) -> int:
    """Repeated custom_ids among the finalized batch's output and error lines (0 = none)."""
    import json
    import time

    from tokenloom.store.files.file_chunks import read_chunks
    from tokenloom.store.models import Batch, BatchStatus

    deadline = time.monotonic() + timeout_s
    while True:
        with sessions() as session:
            batch = session.get(Batch, batch_id)
            if batch.status not in (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING) or time.monotonic() > deadline:
                ids = []
                for file_id in (batch.output_file_id, batch.error_file_id):
                    if file_id is not None:
                        ids += [
                            json.loads(x)["custom_id"] for x in b"".join(read_chunks(sessions, file_id)).splitlines()
                        ]
                return duplicates_of(ids)
        time.sleep(0.1)
