"""Who may use which class of work: a key's allowance for `service_tier` and `priority`.

The interactive class is for the synchronous endpoints, and a request's `priority` orders its
project's own work; neither may be used to jump other tenants' work unless an admin allows it
(docs/priority.md):

- `service_tier: "priority"` lifting a request above its endpoint's class (a /v1/jobs job into the
  interactive class) needs the key's `allow_priority_tier`; on the synchronous endpoints it asks
  for their own class, so any key may send it. Asking for a lower class (`"flex"`) is always allowed.
- `priority` below the key's `min_priority` (0 unless granted: the default every request has, and
  the engine preempts only strictly better priorities) is refused, so a key held to the default
  can never preempt another project's request of its class.
- Admin keys (the admin env key, `--admin` keys, an open API) may use anything.

A request outside its allowance gets a 403 `class_not_allowed` naming the field, the allowance and
how to get more; it is never clamped, so a client sees at once what it did not get. A Batch API
line outside it fails as that line's error (api/batches/batch_jobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.api.errors import ApiError
from tokenloom.store.jobs.work_class import DEFAULT_MIN_PRIORITY, PRIORITY_LIMIT, ServiceTier, WorkClass

CLASS_NOT_ALLOWED = "class_not_allowed"


@dataclass(frozen=True, slots=True)
class ClassAllowance:
    """What a key may ask for; the defaults are any new key's (the api_keys columns' server defaults)."""

    priority_tier: bool = False  # may `service_tier: "priority"` lift a request above its endpoint's class
    min_priority: int = DEFAULT_MIN_PRIORITY  # the most important `priority` it may set
    key_prefix: str | None = None  # names the key in the refusal's hint

    def work_class(
        self, endpoint_class: WorkClass, service_tier: ServiceTier | None, priority: int | None, *, where: str = ""
    ) -> WorkClass:
        """The class a request to an endpoint of `endpoint_class` gets, or ApiError(403) when its
        `service_tier` or `priority` asks for more than this allowance. `where` prefixes the message."""
        refusal = self.refusal(endpoint_class, service_tier, priority)
        if refusal is not None:
            param, message = refusal
            raise ApiError(403, f"{where}{message}", param=param, code=CLASS_NOT_ALLOWED)
        return WorkClass.for_request(endpoint_class, service_tier)

    def refusal(self, endpoint_class: WorkClass, service_tier: object, priority: object) -> tuple[str, str] | None:
        """(the field, what to do) when the request asks for more than allowed, else None. Values of
        the wrong type are not this check's business (the schema or the line's parser refuses them)."""
        if service_tier == "priority" and not self.priority_tier:
            lifted = WorkClass.for_request(endpoint_class, "priority")
            if lifted.rank < endpoint_class.rank:
                return "service_tier", (
                    f'service_tier "priority" would move this request from the {endpoint_class.value} class to the '
                    f"{lifted.value} class, which this key may not use: the interactive class is for "
                    "/v1/chat/completions and /v1/completions (send the request there), or ask an admin to "
                    f"grant it: `tokenloom keys grant {self._key()} --allow-priority-tier`"
                )
        if isinstance(priority, int) and not isinstance(priority, bool) and priority < self.min_priority:
            return "priority", (
                f"priority {priority} is below this key's allowance (priority >= {self.min_priority}): a lower "
                "priority would preempt other projects' requests of the same class. Use "
                f"{self.min_priority}..{PRIORITY_LIMIT} to order your own work (higher runs later), or ask an "
                f"admin to lower the floor: `tokenloom keys grant {self._key()} --min-priority {priority}`"
            )
        return None

    def _key(self) -> str:
        return self.key_prefix or "<key id or prefix>"


UNLIMITED = ClassAllowance(priority_tier=True, min_priority=-PRIORITY_LIMIT)  # admin keys
