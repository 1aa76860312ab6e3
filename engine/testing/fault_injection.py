"""A test hook: make the engine step fail, or stall, for requests whose prompt contains a marker.

Used by the fault tests to prove that an exception inside an engine step fails only the requests
it hits, and that the engine (and the worker around it) keeps serving everything else; and by
the tests that must act on a job while it is still running (cancel it, SIGTERM or SIGKILL its
worker, drop its client) however fast the machine is.

Two faults, each keyed on its own marker:
- fail: the forward pass raises InjectedFault for the marked request;
- stall: every engine step that holds the marked request first sleeps STALL_STEP_S, so the
  request makes at most one token per STALL_STEP_S: a job with `max_tokens` N cannot end by
  itself in less than N * STALL_STEP_S seconds, on any CPU. (Aborts still land between steps.)

Off unless armed. Two ways to arm it:
- in-process: `engine.faults.arm("<marker>")`, `engine.faults.arm(None, stall="<marker>")`
  (EngineHost and engine unit tests);
- for a worker or `tokenloom run` process: the environment variable TOKENLOOM_FAULT_INJECT_PROMPT,
  which the settings read (settings/fault_injection_env.py; the engine reads no environment) and
  hand to the Engine they build. A loud warning is logged; never set it in production.

The markers are matched against the decoded prompt when a request is added (once per request, and
only while armed), so unarmed engines pay one empty-set check per step.
"""

from __future__ import annotations

import time

STALL_STEP_S = 0.05  # a stalled request's floor per engine step (so per generated token)


class InjectedFault(RuntimeError):
    """The exception the armed hook raises in place of a forward pass."""


class FaultInjector:
    def __init__(self, marker: str | None = None, stall: str | None = None):
        self.fail_marker = marker or None
        self.stall_marker = stall or None
        self._poisoned: set[str] = set()  # request ids whose prompt holds the fail marker
        self._stalled: set[str] = set()  # request ids whose prompt holds the stall marker

    @property
    def marker(self) -> str | None:
        """None when unarmed: the engine's one check before it decodes a prompt for note_request."""
        return self.fail_marker or self.stall_marker

    def arm(self, marker: str | None, *, stall: str | None = None) -> None:
        self.fail_marker = marker or None
        self.stall_marker = stall or None

    def note_request(self, request_id: str, prompt_text: str) -> None:
        if self.fail_marker is not None and self.fail_marker in prompt_text:
            self._poisoned.add(request_id)
        if self.stall_marker is not None and self.stall_marker in prompt_text:
            self._stalled.add(request_id)

    def forget(self, request_id: str) -> None:
        self._poisoned.discard(request_id)
        self._stalled.discard(request_id)

    def check(self, request_ids) -> None:
        """Before a step of `request_ids`: sleep if one is stalled, raise InjectedFault if one is poisoned."""
        if not self._poisoned and not self._stalled:
            return
        request_ids = set(request_ids)
        if self._stalled.intersection(request_ids):
            time.sleep(STALL_STEP_S)
        hit = sorted(self._poisoned.intersection(request_ids))
        if hit:
            raise InjectedFault(f"injected fault: prompt contains {self.fail_marker!r} (request {', '.join(hit)})")
