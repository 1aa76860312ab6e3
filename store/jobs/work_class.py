"""Classes of work and their order: a client waiting on a connection goes before a polled job,
which goes before a batch line. Every stage orders by it: the queue message (store/celery_app.py),
the worker's claim (worker/job_runner.py, its room in worker/claim_budget.py) and the engine's
scheduler (through `engine_priority`).
docs/priority.md is the user's view of it.
"""

from __future__ import annotations

import enum
from typing import Literal

# OpenAI's `service_tier` values; tokenloom maps them onto a class (see `WorkClass.for_request`).
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]

# A request's own `priority` lies in [-PRIORITY_LIMIT, PRIORITY_LIMIT] (vLLM's field: lower runs
# first). The engine sees one integer per request: the class's rank times a stride wider than that
# range, plus the request's priority, so any interactive request outranks any batch line whatever
# priorities they carry, and priorities order requests within a class.
PRIORITY_LIMIT = 1000
CLASS_STRIDE = 10 * PRIORITY_LIMIT
# The most important `priority` a key may set unless an admin grants it a lower floor
# (api_keys.min_priority; docs/priority.md). 0 is every request's default, and the engine preempts
# only strictly better priorities, so a key held to this floor can order its own work (higher
# values run later) but never preempt another project's request of the same class.
DEFAULT_MIN_PRIORITY = 0


class WorkClass(str, enum.Enum):
    INTERACTIVE = "interactive"  # /v1/chat/completions and /v1/completions (streamed or not)
    JOBS = "jobs"  # /v1/jobs: asynchronous, polled
    BATCH = "batch"  # Batch API lines and `tokenloom submit`

    @property
    def rank(self) -> int:
        """0 runs first."""
        return _RANKS[self]

    def engine_priority(self, priority: int = 0) -> int:
        """The engine's priority (lower runs first, and is preempted last) for a request of this class.

        A request's `priority` reaches here only within its key's allowance: the API refuses a
        priority below the key's floor (DEFAULT_MIN_PRIORITY unless granted) and a class above the
        endpoint's without the grant (api/class_allowance.py), so a negative value here comes from
        an admin key or a key an admin allowed to preempt other projects' work.
        """
        return self.rank * CLASS_STRIDE + max(-PRIORITY_LIMIT, min(PRIORITY_LIMIT, priority))

    @classmethod
    def for_request(cls, endpoint_class: "WorkClass", service_tier: ServiceTier | None) -> "WorkClass":
        """The class of a request sent to an endpoint whose own class is `endpoint_class`.

        OpenAI's tiers, mapped: "priority" asks to go first (interactive); "flex" accepts to wait
        (batch: it runs when no interactive or job work is waiting); "auto", "default", "scale" and
        no tier keep the endpoint's class.
        """
        if service_tier == "priority":
            return cls.INTERACTIVE
        if service_tier == "flex":
            return cls.BATCH
        return endpoint_class


_RANKS = {WorkClass.INTERACTIVE: 0, WorkClass.JOBS: 1, WorkClass.BATCH: 2}
