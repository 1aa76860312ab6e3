"""Resumable offline runs: offline/offline_run.py with store/offline_ledger.py on a real SQLite file.

The engine runs in process on a tiny random Llama; the ledger is the real SQLAlchemy one. "Reused"
is checked against the engine's own step counter, so a line generated again cannot pass as reused.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.pool import NullPool

from tests.conftest import engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.offline.offline_run import run_file
from tokenloom.offline.run_ledger import LineKey, hash_line, run_key
from tokenloom.openai_protocol.batch_output import RunSummary
from tokenloom.store.database import normalize_url
from tokenloom.store.models import Batch, Job
from tokenloom.store.offline_ledger import open_ledger, prepare_database

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

MAX_NUM_SEQS = 2  # in-flight cap 8, window 32: the files below need several window fills
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def engine(llama_checkpoint):
    config = engine_config(
        llama_checkpoint,
        model=dict(max_model_len=128),
        scheduler=dict(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=128),
    )
    return Engine(config)


@pytest.fixture
def db_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    prepare_database(url)
    return url


def lines_of(n: int = 20) -> list:
    """Good greedy lines plus lines that fail (bad JSON, bad value), with and without custom_ids."""
    lines = [{"custom_id": f"q{i}", "prompt": f"Story number {i}", "max_tokens": 2 + i % 5, **GREEDY} for i in range(n)]
    lines[3] = '{"custom_id": "broken", "prompt": '  # not JSON: custom_id unknown, key "line-4"
    lines[6] = {"custom_id": "hot", "prompt": "Hi", "temperature": -1}
    lines[9] = {"prompt": "No id here", "max_tokens": 3, **GREEDY}  # default custom_id "line-10"
    return lines


def write_jsonl(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def records(path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()]


def run(engine, src, dst, url, fresh=False, wrap=None) -> tuple[RunSummary, int]:
    """One attempt with a freshly opened ledger (as a new process would); also returns the
    number of engine steps it took."""
    ledger = open_ledger(url, engine.model_name, dst, fresh=fresh)
    steps = engine.counters.num_steps
    try:
        summary = run_file(engine, src, dst, progress=False, ledger=wrap(ledger) if wrap else ledger)
    finally:
        ledger.close()
    return summary, engine.counters.num_steps - steps


def job_rows(url, dst, model) -> list[Job]:
    sql = create_engine(normalize_url(url), poolclass=NullPool)
    try:
        with sql.connect() as conn:
            batch_id = conn.execute(select(Batch.id).where(Batch.run_key == run_key(model, dst))).scalar_one()
            return list(conn.execute(select(Job).where(Job.batch_id == batch_id).order_by(Job.line_number)))
    finally:
        sql.dispose()


class Interrupting:
    """The real ledger, but Ctrl-C arrives during its `at`-th commit, before the data is stored."""

    def __init__(self, ledger, at: int):
        self.ledger, self.at, self.calls, self.max_lookup = ledger, at, 0, 0

    def lookup(self, keys):
        self.max_lookup = max(self.max_lookup, len(keys))
        return self.ledger.lookup(keys)

    def record(self, entries):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        self.ledger.record(entries)


def test_second_run_reuses_every_line_and_writes_the_same_bytes(engine, db_url, tmp_path):
    src, dst = write_jsonl(tmp_path / "in.jsonl", lines_of()), tmp_path / "out.jsonl"
    first, first_steps = run(engine, src, dst, db_url)
    written = dst.read_bytes()
    assert (first.requests_total, first.requests_failed, first.requests_reused) == (20, 2, 0)
    assert first_steps > 0 and first.resumed_line() == ""

    second, second_steps = run(engine, src, dst, db_url)
    assert second_steps == 0  # nothing reached the engine
    assert (second.requests_total, second.requests_failed) == (20, 2)  # failed lines are reused too
    assert (second.requests_reused, second.requests_generated) == (20, 0)
    assert second.output_tokens == 0  # throughput figures count only what this attempt generated
    assert dst.read_bytes() == written
    assert second.resumed_line() == "resumed: 20 lines reused from an earlier run, 0 generated"
    assert "| resumed" in second.format() and "20 lines reused" in second.format()

    rows = job_rows(db_url, dst, engine.model_name)
    assert [r.custom_id for r in rows][:5] == ["q0", "q1", "q2", "line-4", "q4"]
    assert [r.result_record for r in rows] == records(dst)
    assert {r.status.value for r in rows} == {"succeeded", "failed"}
    raw = src.read_bytes().splitlines(keepends=True)
    assert [r.input_hash for r in rows] == [hash_line(b) for b in raw]


def test_edited_line_is_generated_again_and_replaces_its_row(engine, db_url, tmp_path):
    lines = lines_of()
    src, dst = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run(engine, src, dst, db_url)
    before = records(dst)
    lines[5] = {**lines[5], "max_tokens": 9, "ignore_eos": True}  # same custom_id "q5", new bytes
    write_jsonl(src, lines)

    summary, steps = run(engine, src, dst, db_url)
    after = records(dst)
    assert (summary.requests_reused, summary.requests_generated) == (19, 1) and steps > 0
    assert len(after[5]["token_ids"]) == 9 != len(before[5]["token_ids"])
    assert after[:5] + after[6:] == before[:5] + before[6:]
    rows = job_rows(db_url, dst, engine.model_name)
    assert len(rows) == 20 and [r.custom_id for r in rows].count("q5") == 1

    again, steps = run(engine, src, dst, db_url)  # the replacement row is what a rerun finds
    assert (again.requests_reused, steps) == (20, 0) and records(dst) == after


def test_fresh_forgets_the_earlier_results(engine, db_url, tmp_path):
    src, dst = write_jsonl(tmp_path / "in.jsonl", lines_of()), tmp_path / "out.jsonl"
    first, _ = run(engine, src, dst, db_url)
    fresh, steps = run(engine, src, dst, db_url, fresh=True)
    assert (fresh.requests_reused, fresh.requests_generated) == (0, 20) and steps > 0
    assert fresh.output_tokens == first.output_tokens
    assert len(job_rows(db_url, dst, engine.model_name)) == 20


def test_an_interrupted_run_resumes_without_regenerating_written_lines(engine, db_url, tmp_path):
    src, dst = write_jsonl(tmp_path / "in.jsonl", lines_of(40)), tmp_path / "out.jsonl"
    clean = tmp_path / "clean.jsonl"
    run_file(engine, src, clean, progress=False)  # no ledger: the reference, as before this feature

    spy = None

    def interrupt(ledger):
        nonlocal spy
        spy = Interrupting(ledger, at=6)
        return spy

    with pytest.raises(KeyboardInterrupt):
        run(engine, src, dst, db_url, wrap=interrupt)
    assert not engine.has_unfinished_requests  # the in-flight requests were aborted
    assert spy.max_lookup <= 4 * MAX_NUM_SEQS  # lookups are per window fill, never the whole file
    partial = records(dst)
    assert 0 < len(partial) < 40
    # Commit-before-write: every line that reached the file is in the ledger, verbatim.
    stored = {r.custom_id: r.result_record for r in job_rows(db_url, dst, engine.model_name)}
    assert all(stored[r["custom_id"] or f"line-{r['line']}"] == r for r in partial)

    resumed, _ = run(engine, src, dst, db_url)
    assert resumed.requests_reused >= len(partial)
    assert resumed.requests_generated == 40 - resumed.requests_reused
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rs]  # timings differ
    assert strip(records(dst)) == strip(records(clean))
    assert records(dst)[: len(partial)] == partial  # the reused lines are byte-for-byte what was written


def test_moved_lines_are_reused_with_their_new_line_number(engine, db_url, tmp_path):
    lines = lines_of()
    src, dst = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run(engine, src, dst, db_url)
    before = records(dst)
    write_jsonl(src, [{"custom_id": "new", "prompt": "A new first line", "max_tokens": 2, **GREEDY}, "", *lines])

    summary, _ = run(engine, src, dst, db_url)
    after = records(dst)
    # Keys are (bytes, custom_id): "broken" (no custom_id -> "line-4") and "line-10" now have other
    # default ids, so they run again with "new"; every other line is reused, two lines further down.
    assert (summary.requests_reused, summary.requests_generated) == (18, 3)
    assert [r["line"] for r in after] == [1, *range(3, 23)]
    regenerated = {3, 9}  # indexes of "broken" and the id-less line
    for i, (new, old) in enumerate(zip(after[1:], before)):
        if i not in regenerated:
            assert new == {**old, "line": old["line"] + 2}
    assert after[1 + 9]["custom_id"] == "line-12" and after[1 + 3]["status"] == "failed"


def test_a_repeated_custom_id_does_not_break_the_ledger(engine, db_url, tmp_path):
    lines = [
        {"custom_id": "dup", "prompt": "First", "max_tokens": 3, **GREEDY},
        {"custom_id": "dup", "prompt": "Second", "max_tokens": 4, **GREEDY},
    ]
    src, dst = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run(engine, src, dst, db_url)
    first = records(dst)
    summary, _ = run(engine, src, dst, db_url)
    # One row per custom_id: one of the two is reused, the other generated again (same greedy text).
    assert (summary.requests_reused, summary.requests_generated) == (1, 1)
    assert records(dst)[0]["token_ids"] == first[0]["token_ids"]
    assert records(dst)[1]["token_ids"] == first[1]["token_ids"]


def test_lookup_matches_both_hash_and_custom_id(engine, db_url, tmp_path):
    src, dst = write_jsonl(tmp_path / "in.jsonl", lines_of()), tmp_path / "out.jsonl"
    run(engine, src, dst, db_url)
    row = job_rows(db_url, dst, engine.model_name)[0]
    ledger = open_ledger(db_url, engine.model_name, dst)
    try:
        hit = LineKey(row.input_hash, "q0")
        assert ledger.lookup([hit, LineKey(row.input_hash, "q1"), LineKey("0" * 64, "q0")]) == {hit: row.result_record}
    finally:
        ledger.close()
    other = open_ledger(db_url, engine.model_name, tmp_path / "other.jsonl")  # another output: another run
    try:
        assert other.lookup([hit]) == {}
    finally:
        other.close()
    sql = create_engine(normalize_url(db_url), poolclass=NullPool)
    with sql.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Batch)).scalar_one() == 2
    sql.dispose()
