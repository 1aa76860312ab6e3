"""The interactive lane: a worker's own consumer of its model's interactive queue.

Celery's claim threads can all be waiting for room with batch messages in hand (a batch saturates
the worker by design), and Celery takes no new message while they do: an interactive message sent
then would wait for a batch to drain. So interactive messages never go through them. This thread
consumes the model's interactive queue with Kombu (the library under Celery; the messages are
Celery task messages, sent by store/celery_app.py), claims each message's jobs at once (they have a
budget of their own: worker/claim_budget.py) and acks it, so a chat request is in the engine within a
database round trip of being sent, whatever the worker is busy with.

Delivery is as reliable as the Celery path: a message is acked only after its jobs are claimed; a
worker that stops (or is killed) before that leaves it to Redis, which delivers it again.
"""

from __future__ import annotations

import logging
import threading

from celery import Celery
from kombu import Connection, Exchange, Message, Queue
from kombu.mixins import ConsumerMixin

from tokenloom.store.celery_app import interactive_queue_name
from tokenloom.store.db_retry import is_outage
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.worker.job_runner import JobRunner, NotAdmitting

log = logging.getLogger("tokenloom.worker")

# Messages taken ahead of their claim: a few, so a burst of chat requests is claimed back to back,
# and other workers of the model get the rest.
PREFETCH = 4


class InteractiveLane(ConsumerMixin):
    def __init__(self, app: Celery, model: str, runner: JobRunner):
        self.connection: Connection = app.connection_for_read()
        name = interactive_queue_name(model)
        # The queue as Celery declares it when it sends to an undeclared queue name.
        self.queue = Queue(name, Exchange(name), routing_key=name)
        self.runner = runner
        self._thread: threading.Thread | None = None

    def start(self) -> "InteractiveLane":
        self._thread = threading.Thread(target=self.run, name="tokenloom-interactive-lane", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self.should_stop = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.connection.release()

    def get_consumers(self, consumer_type, channel):
        return [
            consumer_type(queues=[self.queue], callbacks=[self.on_message], accept=["json"], prefetch_count=PREFETCH)
        ]

    def on_message(self, body, message: Message) -> None:
        try:
            args = body[0]  # Celery's message body: [args, kwargs, embed]
            self.runner.run(args[0], WorkClass.INTERACTIVE)
        except NotAdmitting:
            message.requeue()  # the worker is stopping: another worker (or the next one) claims it
            return
        except Exception as exc:
            if is_outage(exc):  # the database stayed down past [database] retry_s: deliver it again
                log.warning("interactive message put back, the database is unavailable: %s", exc)
                message.requeue()
                return
            # A message that cannot be read or claimed is dropped, not redelivered forever; its
            # jobs stay queued and the reconciler sends them again.
            log.error("interactive message dropped (%s): %r", exc, body)
        message.ack()
