"""The offline run ledger (store/offline_ledger.py) on Postgres, and `tokenloom run`'s schema check there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import engine_config
from tests.services import REPO_ROOT
from tokenloom.engine.loop.engine import Engine
from tokenloom.offline.offline_run import run_file
from tokenloom.offline.run_ledger import LedgerError
from tokenloom.store import migrate
from tokenloom.store.offline_ledger import open_ledger, prepare_database

GREEDY = {"temperature": 0}
# Ids Postgres text cannot hold as they are (NUL, a lone surrogate) or that overflow String(512).
ODD_IDS = ["nul\u0000id", "\udc00lone", "x" * 600]


@pytest.fixture(scope="module")
def engine(llama_checkpoint):
    return Engine(
        engine_config(
            llama_checkpoint, model=dict(max_model_len=128), scheduler=dict(max_num_seqs=2, max_num_batched_tokens=128)
        )
    )


def write_lines(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))


def attempt(engine, src, dst, url):
    ledger = open_ledger(url, engine.model_name, dst)
    steps = engine.counters.num_steps
    try:
        return run_file(engine, src, dst, progress=False, ledger=ledger), engine.counters.num_steps - steps
    finally:
        ledger.close()


def test_resume_on_postgres(engine, pg_url, tmp_path):
    prepare_database(pg_url)  # at head: accepted as is
    lines = [{"custom_id": f"p{i}", "prompt": f"Postgres line {i}", "max_tokens": 3, **GREEDY} for i in range(12)]
    lines += [{"custom_id": cid, "prompt": "Odd id", "max_tokens": 2, **GREEDY} for cid in ODD_IDS]
    lines += ['{"not json', {"custom_id": "bad", "prompt": "Hi", "top_p": 7}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, lines)

    first, _ = attempt(engine, src, dst, pg_url)
    written = dst.read_bytes()
    assert (first.requests_total, first.requests_failed) == (17, 2)

    second, steps = attempt(engine, src, dst, pg_url)
    assert (second.requests_reused, second.requests_generated, steps) == (17, 0, 0)
    assert dst.read_bytes() == written  # NUL / surrogate ids and texts survive Postgres verbatim

    lines[2] = {**lines[2], "max_tokens": 5}  # edited: its row (same custom_id) is replaced
    write_lines(src, lines)
    third, _ = attempt(engine, src, dst, pg_url)
    assert (third.requests_reused, third.requests_generated) == (16, 1)
    fourth, steps = attempt(engine, src, dst, pg_url)
    assert (fourth.requests_reused, steps) == (17, 0)


def test_a_postgres_schema_behind_head_is_refused(pg_empty_url, tmp_path):
    migrate.upgrade(pg_empty_url, "0001")
    with pytest.raises(LedgerError, match="tokenloom db upgrade"):
        prepare_database(pg_empty_url)
    assert migrate.current(pg_empty_url) == "0001"  # never upgraded behind the operator's back

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Hi"}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_")}
    env.update(PYTHONPATH=str(REPO_ROOT), TOKENLOOM_DATABASE_URL=pg_empty_url)
    proc = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "run", str(src), "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "0001" in proc.stderr and "`tokenloom db upgrade`" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "in.results.jsonl").exists()


def test_an_unreachable_postgres_is_a_ledger_error():
    with pytest.raises(LedgerError, match="TOKENLOOM_DATABASE_URL"):
        prepare_database("postgresql://tokenloom@127.0.0.1:1/tokenloom")
