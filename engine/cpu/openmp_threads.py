"""Run torch work off the caller's thread, so that it leaves no OpenMP team behind.

libgomp gives every thread that starts a parallel region its own team of worker threads, kept
until that thread exits. A process whose main thread ran one parallel torch op and whose engine
then runs on its own thread (EngineHost: the worker, an embedding application, bench/serving.py)
holds two teams, more OpenMP threads than cores, and libgomp then stops spin-waiting between
parallel regions: every one of a step's ~300 regions wakes its workers from sleep, which makes
each decode step markedly slower.
Work that tokenloom itself does before its engine thread starts (the dtype probe, building the
benchmark checkpoint) goes through `in_passing_thread`, whose team ends with its thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def in_passing_thread(work: Callable[[], T]) -> T:
    """work()'s result (or its exception), computed on a thread that exits before this returns."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-passing") as pool:
        return pool.submit(work).result()
