"""The compose test's cost, phase by phase: each phase's wall time is written to pytest's terminal
as it ends (through the terminal reporter, so it shows without `-s`), and the whole list again at
the end of the session. A cold run (no cached base, no image layers) and a warm one differ by
minutes, and CI's budget is counted in minutes, so the numbers are part of the test's output."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _pytest.capture import CaptureManager  # pytest's own; not exported under pytest.*


@dataclass
class PhaseClock:
    reporter: pytest.TerminalReporter | None
    capture: CaptureManager | None  # suspended while writing: a test's output is captured
    timings: list[tuple[str, float]] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            elapsed = time.monotonic() - started
            self.timings.append((name, elapsed))
            self.write(f"[compose phase] {name}: {elapsed:.1f} s")

    def write(self, line: str) -> None:
        if self.reporter is None:
            return
        suspended = self.capture.global_and_fixture_disabled() if self.capture is not None else nullcontext()
        with suspended:
            self.reporter.ensure_newline()
            self.reporter.write_line(line)

    def summary(self) -> None:
        if not self.timings:
            return
        self.write(
            "[compose phases] "
            + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.timings)
            + f"; total {sum(seconds for _, seconds in self.timings):.0f} s"
        )
