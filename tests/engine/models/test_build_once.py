"""build_once: processes starting together (the API and workers of `docker compose up`, all pid 1 in
their containers) build a shared cache's checkpoint once, and none reads or deletes another's files."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from tokenloom.engine.models.build_once import build_once, is_built

NEEDS_SERVICES = False


def _slow_build(out: Path) -> None:
    # One marker per build in the shared folder: the test counts how many builds ran.
    (out.parent / "builds").mkdir(exist_ok=True)
    (out.parent / "builds" / f"{os.getpid()}-{time.monotonic_ns()}").touch()
    (out / "model.safetensors").write_bytes(b"w" * 1024)
    time.sleep(0.5)  # hold the build open so the other processes arrive while it runs
    (out / "config.json").write_text("{}")


def _build_in_child(target: str, ready, go) -> None:
    ready.wait()
    go.wait()
    build_once(Path(target), _slow_build, "a test checkpoint")
    assert is_built(Path(target))


def test_processes_starting_together_build_once_and_all_see_it_complete(tmp_path):
    target = tmp_path / "checkpoint"
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Barrier(4), ctx.Event()
    children = [ctx.Process(target=_build_in_child, args=(str(target), ready, go)) for _ in range(3)]
    for child in children:
        child.start()
    ready.wait()
    go.set()
    for child in children:
        child.join(timeout=120)
    assert [child.exitcode for child in children] == [0, 0, 0]
    assert len(list((tmp_path / "builds").iterdir())) == 1
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".checkpoint.staging-*"))


def test_a_complete_checkpoint_is_reused_without_building(tmp_path):
    target = tmp_path / "checkpoint"
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert build_once(target, lambda out: pytest.fail("built again"), "a test checkpoint") == target


def test_a_killed_builds_leftovers_are_replaced(tmp_path):
    target = tmp_path / "checkpoint"
    target.mkdir()
    (target / "half-written.safetensors").write_bytes(b"x")  # no config.json: incomplete
    stale = tmp_path / ".checkpoint.staging-dead"
    stale.mkdir()
    build_once(target, _slow_build, "a test checkpoint")
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert not stale.exists()


def test_a_failed_build_leaves_nothing_and_raises(tmp_path):
    target = tmp_path / "checkpoint"

    def failing(out: Path) -> None:
        (out / "part").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(target, failing, "a test checkpoint")
    assert not target.exists()
    assert not list(tmp_path.glob(".checkpoint.staging-*"))
