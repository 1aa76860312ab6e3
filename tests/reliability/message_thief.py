"""A stand-in for a worker that dies between receiving a job's message and claiming its row.

Run as a subprocess: takes ONE message from the model's queue through Celery's own broker
connection, without acking it (Redis moves it to its unacked set, as for any worker), prints
"took", then waits to be SIGKILLed. Redis would hand the message out again only after the
10-minute visibility timeout; the reconciler's stranded-job sweep must not wait that long.

    python -m tests.reliability.message_thief BROKER_URL MODEL
"""

from __future__ import annotations

import sys
import time

from tokenloom.store.celery_app import make_celery, queue_name


def main(broker_url: str, model: str) -> None:
    app = make_celery(broker_url)
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue(queue_name(model))
        queue.get(block=True, timeout=30)  # not acked
        print("took", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:3])
