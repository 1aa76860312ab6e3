"""TOKENLOOM_FAULT_INJECT_PROMPT: the environment's way to arm the engine's fault-injection test hook.

The worker and `tokenloom run` build their Engine with what this returns, so a test can make a
real worker process fail or stall the requests whose prompt holds a marker. The value is
`<marker>` (fail), `stall:<marker>`, or both joined by ";" (`<marker>;stall:<marker>`). The engine
reads no environment itself; unset, the hook is inert.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from tokenloom.engine import STALL_STEP_S, FaultInjector

log = logging.getLogger("tokenloom.settings")

FAULT_INJECT_ENV_VAR = "TOKENLOOM_FAULT_INJECT_PROMPT"
_STALL_PREFIX = "stall:"
_SEPARATOR = ";"


def fault_injector_from_env(environ: Mapping[str, str] = os.environ) -> FaultInjector:
    """The hook armed as the environment says (inert when the variable is unset), with a loud warning."""
    marker = stall = None
    for entry in (environ.get(FAULT_INJECT_ENV_VAR) or "").split(_SEPARATOR):
        if entry.startswith(_STALL_PREFIX):
            stall = entry[len(_STALL_PREFIX) :] or None
        elif entry:
            marker = entry
    if marker:
        log.warning(
            "%s is set: requests whose prompt contains %r will fail inside the engine step "
            "(a test hook; unset it outside tests)",
            FAULT_INJECT_ENV_VAR,
            marker,
        )
    if stall:
        log.warning(
            "%s is set: requests whose prompt contains %r will stall %.2f s in every engine step "
            "(a test hook; unset it outside tests)",
            FAULT_INJECT_ENV_VAR,
            stall,
            STALL_STEP_S,
        )
    return FaultInjector(marker, stall)
