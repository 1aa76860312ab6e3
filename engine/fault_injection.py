"""A test hook: make the forward pass fail for requests whose prompt contains a marker.

Used by the fault tests to prove that an exception inside an engine step fails only the requests
it hits, and that the engine (and the worker around it) keeps serving everything else.

Off unless armed. Two ways to arm it:
- in-process: `engine.faults.arm("<marker>")` (EngineHost and engine unit tests);
- for a worker process: the environment variable TOKENLOOM_FAULT_INJECT_PROMPT=<marker>, read
  once when the Engine is built (a loud warning is logged; never set it in production).

The marker is matched against the decoded prompt when a request is added (once per request, and
only while armed), so unarmed engines pay one empty-set check per step.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("tokenloom.engine")

ENV_VAR = "TOKENLOOM_FAULT_INJECT_PROMPT"


class InjectedFault(RuntimeError):
    """The exception the armed hook raises in place of a forward pass."""


class FaultInjector:
    def __init__(self, marker: str | None = None):
        self.marker = marker or None
        self._poisoned: set[str] = set()  # request ids whose prompt holds the marker

    @classmethod
    def from_env(cls, environ=os.environ) -> "FaultInjector":
        marker = environ.get(ENV_VAR) or None
        if marker:
            log.warning("%s is set: requests whose prompt contains %r will fail inside the engine step "
                        "(a test hook; unset it outside tests)", ENV_VAR, marker)
        return cls(marker)

    def arm(self, marker: str | None) -> None:
        self.marker = marker or None

    def note_request(self, request_id: str, prompt_text: str) -> None:
        if self.marker is not None and self.marker in prompt_text:
            self._poisoned.add(request_id)

    def forget(self, request_id: str) -> None:
        self._poisoned.discard(request_id)

    def check(self, request_ids) -> None:
        """Raise InjectedFault if any of `request_ids` (a step about to run) is poisoned."""
        if not self._poisoned:
            return
        hit = sorted(self._poisoned.intersection(request_ids))
        if hit:
            raise InjectedFault(f"injected fault: prompt contains {self.marker!r} (request {', '.join(hit)})")
