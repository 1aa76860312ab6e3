"""A stand-in for a worker that dies between receiving a job's message and claiming its row.

Run as a subprocess: takes COUNT messages (default 1) from the model's queue, or from its
interactive queue, through Celery's own broker connection, without acking them (Redis moves them
to its unacked set, as for any worker), prints "took", then waits to be SIGKILLed. Redis would
hand the messages out again only after the 10-minute visibility timeout; the reconciler's
stranded-job sweep must not wait that long.

    python -m tests.reliability.message_thief BROKER_URL MODEL [jobs|interactive [COUNT]]
"""

from __future__ import annotations

import sys
import time

from tokenloom.store.celery_app import interactive_queue_name, make_celery, queue_name


def main(broker_url: str, model: str, queue_kind: str = "jobs", count: str = "1") -> None:
    app = make_celery(broker_url)
    name = interactive_queue_name(model) if queue_kind == "interactive" else queue_name(model)
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue(name)
        for _ in range(int(count)):
            queue.get(block=True, timeout=30)  # not acked
        print("took", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:5])
