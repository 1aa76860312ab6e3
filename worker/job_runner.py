"""Runs the jobs of queue messages through the shared engine: claimed in groups, recorded in groups.

Called from a Celery task thread with a message's job ids. The thread waits for room (a worker
holds at most `max_in_flight` claimed jobs, so unclaimed rows stay queued for other workers),
claims the rows in one conditional UPDATE (store/jobs/job_store.py), submits them to the shared
`EngineHost`, and returns: the message is acked once its jobs are claimed. From then on
Postgres owns them: a claimed row is `running` under a lease this worker's heartbeat renews, so
if the worker dies the lease expires and the reconciler of any worker sends the job again.
Celery only delivers; it never has to hold a message for a job's whole run.

Each request's done-callback hands its output to the ResultWriter, which records whatever
finished in the same round with one UPDATE (the row values come from worker/job_results.py),
then closes the jobs' streams and passes their batches to the BatchCloser. Deltas go from the
engine thread to one StreamPublisher (a Redis round trip per step); cancels and shutdown abort
requests from the CancelWatcher and `release_all`, and aborted jobs of a shutdown are handed back
to the queue. Every database call is retried through an outage (store/db_retry.py), so finished
results wait in memory for the database instead of being lost.

How many jobs of each class may be claimed is the ClaimBudget's arithmetic (worker/claim_budget.py);
this module waits for its room and does the claiming. One lock guards the budget, the fair-share
ranks, the cancel watcher's marks and admission, because a job that ends leaves all of them at once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from typing import TypeVar

from tokenloom.engine import EngineHost, InvalidRequestError, RequestOutput
from tokenloom.openai_protocol.scoring_limit import DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES, check_prompt_logprob_entries
from tokenloom.store.db_retry import with_db_retry
from tokenloom.store.jobs.job_store import Claim, ClaimOutcome, JobResult, JobStore
from tokenloom.store.jobs.stream_events import EndEvent, RestartEvent, StreamEvent
from tokenloom.store.jobs.streams import JobStreams
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobErrorCode, JobStatus, utcnow
from tokenloom.worker.batch_closer import BatchCloser
from tokenloom.worker.cancel_watcher import CancelWatcher
from tokenloom.worker.claim_budget import ClaimBudget
from tokenloom.worker.fair_share import FairShareRanks
from tokenloom.worker.job_results import ResultMapper
from tokenloom.worker.result_writer import FinishedJob, ResultWriter
from tokenloom.worker.stream_publisher import StreamPublisher

log = logging.getLogger("tokenloom.worker")

T = TypeVar("T")

Requeue = Callable[[str, list[uuid.UUID], WorkClass], None]  # (model, job ids, class) -> messages on its queue


class NotAdmitting(Exception):
    """The worker is shutting down: the job's message must go back to the queue untouched."""


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        host: EngineHost,
        streams: JobStreams | None,
        worker_id: str,
        lease_s: float,
        max_attempts: int,
        requeue: Requeue | None = None,
        db_retry_s: float = 300.0,
        max_in_flight: int = 256,
        min_claim_share: float = 0.0,
        max_prompt_logprob_entries: int = DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES,
    ):
        self.store = store
        self.host = host
        self.worker_id = worker_id
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.requeue = requeue  # needed by release_all
        self.db_retry_s = db_retry_s
        self.max_in_flight = max_in_flight
        self.max_prompt_logprob_entries = max_prompt_logprob_entries
        self._budget = ClaimBudget(
            max_in_flight, min_claim_share
        )  # the jobs held here (claimed, not yet recorded), room per class
        self._share_ranks = FairShareRanks()  # the engine's order of the batch lines held here
        # Batch lines the engine admitted (their first output), appended on the engine thread without the
        # lock (a deque's append is atomic) and handed to the ranks under it: the fair-share clock.
        self._admitted: deque[uuid.UUID] = deque()
        self._last_stamp = utcnow()  # the last claim stamp given (_claim_stamp)
        # One lock for the budget, the ranks, the cancel marks and admission: a job that ends leaves them all at once.
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # signalled when jobs end or admission stops
        self._admitting = True
        self._release = threading.Event()
        assert host.engine is not None  # the host is started, and start() returns once its engine is built
        self._engine = host.engine
        speller = self._engine.token_speller
        self._publisher = StreamPublisher(streams, speller) if streams is not None else None
        self._writer = ResultWriter(store, worker_id, db_retry_s, self._settle)
        self._closer = BatchCloser(store.sessions)
        # Polls the database for cancels of the held jobs and aborts them in the engine.
        self._cancels = CancelWatcher(store, self._budget, self._lock, host.abort)
        self._results = ResultMapper(speller, self._cancels.is_cancelled, self._release.is_set)
        self._cancels.start()

    def close(self) -> None:
        """Stop polling for cancels: the worker is stopping (called after `wait_idle`)."""
        self._cancels.stop()

    def stop_admitting(self) -> None:
        """From now on `run` raises NotAdmitting instead of claiming (the worker is draining)."""
        with self._lock:
            self._admitting = False
            self._room.notify_all()

    def release_all(self) -> None:
        """Abort every running job in the engine and hand it back to the queue, unfinished."""
        self.stop_admitting()
        self._release.set()  # before the aborts: a job submitted after this aborts itself
        for job_id in self.active_job_ids:
            self.host.abort(str(job_id))

    @property
    def active_job_ids(self) -> list[uuid.UUID]:
        with self._lock:
            return self._budget.held_ids()

    def run(self, job_ids: list[str] | str, work_class: WorkClass = WorkClass.JOBS) -> dict[str, int]:
        """Claim and start one message's jobs; returns how many ended each way (ClaimOutcome values).

        Returns once every job is claimed (or found done or owned elsewhere), not when they finish.
        Interactive jobs are claimed at once, whatever the worker holds of the other classes; jobs
        and batch lines wait for room, a waiting job before any waiting batch line. A batch
        message's ids only say how many lines to take: the lines claimed are the model's queued
        ones, round-robin across projects (JobStore.claim_fair), so a tenant's batch is not held
        behind another's.
        """
        remaining = list(dict.fromkeys(uuid.UUID(j) for j in ([job_ids] if isinstance(job_ids, str) else job_ids)))
        counts: Counter[ClaimOutcome] = Counter()
        while remaining:
            room = self._wait_for_room(work_class, len(remaining))
            if work_class is WorkClass.BATCH:
                hint, remaining = remaining[:room], remaining[room:]
                for outcome, n in self._claim_fair_and_start(hint).items():
                    counts[outcome] += n
                continue
            fresh, considered = self._take(remaining, room, work_class)
            remaining = remaining[considered:]
            counts[ClaimOutcome.OWNED_ELSEWHERE] += considered - len(fresh)  # running here already
            for outcome, n in self._claim_and_start(fresh).items():
                counts[outcome] += n
        return {outcome.value: n for outcome, n in counts.items() if n}

    def _wait_for_room(self, work_class: WorkClass, wanted: int) -> int:
        """Wait until this class may claim, then reserve and return how many (1..wanted) it may take."""
        with self._lock:
            self._budget.wait_begins(work_class)
            try:
                while True:
                    if not self._admitting:
                        raise NotAdmitting(work_class.value)
                    taken = self._budget.reserve(work_class, wanted)
                    if taken:
                        return taken
                    self._room.wait()
            finally:
                self._budget.wait_ends(work_class)

    def _take(self, ids: list[uuid.UUID], room: int, work_class: WorkClass) -> tuple[list[uuid.UUID], int]:
        """Of the reserved `room`, take the ids not already held: (taken ids, how many of `ids` were looked at)."""
        with self._lock:
            fresh, considered = self._budget.first_unheld(ids, room)
            self._budget.hold(work_class, room, fresh)
            self._room.notify_all()
            return fresh, considered

    def _claim_fair_and_start(self, hint: list[uuid.UUID]) -> Counter[ClaimOutcome]:
        """A batch message's lines: as many as its ids, the model's queued lines chosen fairly."""
        return self._claim_batch_lines_and_start(
            len(hint),
            lambda stamp, adopt: self.store.claim_fair(
                hint,
                self.worker_id,
                self.lease_s,
                self.max_attempts,
                skip=set(self.active_job_ids),
                claimed_at=stamp,
                adopt=adopt,
            ),
        )

    def owes_batch_lines(self) -> bool:
        """This worker holds fewer batch lines than its guaranteed share, and no batch message is being claimed."""
        with self._lock:
            return (
                self._admitting
                and not self._budget.is_waiting(WorkClass.BATCH)
                and self._budget.owed(WorkClass.BATCH) > 0
            )

    def claim_owed_batch_lines(self, model: str) -> int:
        """Claim, without a message, the batch lines this worker is owed below its guaranteed share
        ([queue] min_claim_share); returns how many it claimed. For worker/owed_batch_claims.py: batch
        messages wait at Redis behind every job message, so under a steady stream of /v1/jobs work
        they would never reach a claim thread. Nothing when a batch message is being claimed here; blocks,
        like a message's claim, until the owed room frees."""
        with self._lock:
            if not self._admitting or self._budget.is_waiting(WorkClass.BATCH):
                return 0
            owed = self._budget.owed(WorkClass.BATCH)
        if not owed:
            return 0
        try:
            # Waits as a batch message's claim would: its waiting keeps jobs off the room owed to batch lines.
            reserved = self._wait_for_room(WorkClass.BATCH, owed)
        except NotAdmitting:
            return 0
        counts = self._claim_batch_lines_and_start(
            reserved,
            lambda stamp, adopt: self.store.claim_fair_count(
                model, reserved, self.worker_id, self.lease_s, self.max_attempts, claimed_at=stamp, adopt=adopt
            ),
        )
        return counts[ClaimOutcome.CLAIMED]

    def _claim_batch_lines_and_start(
        self, reserved: int, claim: Callable[[datetime, bool], dict[uuid.UUID, Claim]]
    ) -> Counter[ClaimOutcome]:
        """Run `claim(stamp, adopt)` for `reserved` batch lines (room already reserved) and start what it took."""
        counts: Counter[ClaimOutcome] = Counter()
        claims: dict[uuid.UUID, Claim] = {}
        stamp = self._claim_stamp()
        tries = 0

        def claim_once() -> dict[uuid.UUID, Claim]:
            # A retry adopts the lines an earlier try committed under this stamp, its reply lost: the
            # retry's own pick would be other lines, and those would run here untracked until their
            # leases expired (store/jobs/job_store.py, JobStore.claim_fair).
            nonlocal tries
            tries += 1
            return claim(stamp, tries > 1)

        try:
            claims = self._db(claim_once, "claiming batch lines")
        finally:
            claimed = [job_id for job_id, claim_ in claims.items() if claim_.outcome is ClaimOutcome.CLAIMED]
            with self._lock:  # the reservation becomes the claimed lines in one step: no room is counted twice
                self._budget.hold(WorkClass.BATCH, reserved, claimed)
                self._room.notify_all()
        for job_id, claim_ in claims.items():
            counts[claim_.outcome] += 1
            self._after_claim(job_id, claim_)
        return counts

    def _claim_stamp(self) -> datetime:
        """A claim's `admitted_at` stamp, unique among this worker's claims: its rows can be found again."""
        with self._lock:
            stamp = max(utcnow(), self._last_stamp + timedelta(microseconds=1))
            self._last_stamp = stamp
            return stamp

    def _claim_and_start(self, job_ids: list[uuid.UUID]) -> Counter[ClaimOutcome]:
        counts: Counter[ClaimOutcome] = Counter()
        if not job_ids:
            return counts
        try:
            claims = self._db(
                lambda: self.store.claim_many(job_ids, self.worker_id, self.lease_s, self.max_attempts), "claiming jobs"
            )
        except BaseException:
            for job_id in job_ids:
                self._forget(job_id)
            raise
        for job_id in job_ids:
            counts[claims[job_id].outcome] += 1
            self._after_claim(job_id, claims[job_id])
        return counts

    def _after_claim(self, job_id: uuid.UUID, claim: Claim) -> None:
        if claim.outcome is ClaimOutcome.CLAIMED:
            assert claim.job is not None  # a claimed row was read in the claim (only ALREADY_DONE may lack one)
            self._start(claim.job)
            return
        self._forget(job_id)
        log.info("job %s not run here: %s", job_id, claim.outcome.value)
        if claim.outcome is ClaimOutcome.TOO_MANY_ATTEMPTS:
            assert claim.job is not None  # the row whose attempts ran out (only ALREADY_DONE may lack one)
            self._publish(job_id, EndEvent(JobStatus.FAILED.value, None, "too many attempts"))
            self._closer.put(claim.job.batch_id)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no job is held and every result and batch is recorded; for shutdown and tests."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._budget.held_count:
                if not self._room.wait(max(0.0, deadline - time.monotonic())):
                    return False
        return self._closer.wait_idle(max(0.0, deadline - time.monotonic()))

    def _forget(self, job_id: uuid.UUID) -> None:
        with self._lock:
            self._note_admitted()  # before the release: the deque never keeps ids of lines that ended
            self._budget.release(job_id)
            self._share_ranks.release(job_id)
            self._cancels.forget(job_id)
            self._room.notify_all()

    def _start(self, job: Job) -> None:
        if job.attempts > 1:
            # An earlier attempt died mid-way and may have streamed tokens: readers start over.
            self._publish(job.id, RestartEvent())
        # The API stores the ids it tokenized (and checked against max_model_len): run those, so a
        # prompt is tokenized once. Rows queued without them (`tokenloom submit`) are encoded by the engine.
        prompt, messages = (
            (job.prompt_token_ids, None) if job.prompt_token_ids is not None else (job.prompt, job.messages)
        )
        try:
            # Not validated here: Engine.add_request does, once (a refusal then fails this job alone).
            params = self._engine.request_params(job.params or {})
            if params.prompt_logprobs is not None:
                # The API refuses larger requests; a row it did not check (`tokenloom submit`, one queued before
                # the limit) must not take the worker's memory either, on every attempt. Such a row is encoded
                # here, once, to be counted.
                if not isinstance(prompt, list) or messages is not None:
                    prompt, messages = self._engine.encode_prompt(prompt, messages), None
                check_prompt_logprob_entries(params, len(prompt), self.max_prompt_logprob_entries, echo=job.echo)
        except Exception as exc:  # noqa: BLE001 - a refusal, or a prompt that cannot be encoded (a chat template
            # rejecting these messages): this job fails alone and the worker keeps serving the rest.
            reason = str(exc) if isinstance(exc, InvalidRequestError) else f"the prompt could not be encoded: {exc}"
            refusal = JobResult.failed(JobErrorCode.INVALID_REQUEST, reason)
            self._writer.put(FinishedJob(job, lambda: refusal))
            return
        submitted_wall = utcnow()
        work_class = job.work_class  # claimed rows come from the table, where the column is NOT NULL
        on_output: Callable[[RequestOutput], None] | None = (
            None if self._publisher is None else partial(self._publisher.put_output, job.id)
        )
        if work_class is WorkClass.BATCH:
            on_output = self._noting_admission(job.id, on_output)
        future = self.host.submit(
            str(job.id),
            prompt,
            messages=messages,
            params=params,
            on_output=on_output,
            priority=work_class.engine_priority(job.priority or 0),
            share_rank=self._share_rank(job) if work_class is WorkClass.BATCH else 0,
            seat_class=work_class.rank,  # each class keeps its guaranteed seats ([scheduler] min_seat_share)
        )
        if self._release.is_set() or self._cancels.is_cancelled(job.id):
            self.host.abort(str(job.id))  # shutdown or cancel came while this job was being submitted
        # Runs on the engine thread when the request ends: only a queue append happens there.
        future.add_done_callback(
            lambda done: self._writer.put(FinishedJob(job, partial(self._results.outcome, job, done, submitted_wall)))
        )

    def _share_rank(self, job: Job) -> int:
        """The engine orders equal priorities by it, so a tenant whose batch came later is not queued
        behind every line another tenant had claimed first (worker/fair_share.py)."""
        with self._lock:
            self._note_admitted()
            return self._share_ranks.rank(job.id, job.project)

    def _noting_admission(
        self, job_id: uuid.UUID, on_output: Callable[[RequestOutput], None] | None
    ) -> Callable[[RequestOutput], None]:
        """Wrap a batch line's output callback: its first output says the engine admitted the line, so it
        no longer holds the fair-share clock back. Runs on the engine thread: one deque append, once."""
        first = True

        def on_delta(output: RequestOutput) -> None:
            nonlocal first
            if first:
                first = False
                self._admitted.append(job_id)
            if on_output is not None:
                on_output(output)

        return on_delta

    def _note_admitted(self) -> None:
        """Hand the lines admitted since the last call to the ranks. Call with the lock held."""
        while self._admitted:
            self._share_ranks.admitted(self._admitted.popleft())

    def _settle(
        self, finished: FinishedJob, result: JobResult | None, written: bool, error: BaseException | None = None
    ) -> None:
        """Called on the ResultWriter's thread once a job's outcome is recorded (or cannot be)."""
        job = finished.job
        try:
            if error is not None:
                # The database stayed down past [database] retry_s: the lease expires once this
                # worker stops renewing it, and any worker's reconciler sends the job again.
                log.error("job %s: its result could not be recorded (%s); it will run again", job.id, error)
            elif result is None:
                self._hand_back(job)
            elif written:
                self._publish(job.id, EndEvent(result.status.value, result.finish_reason, result.error))
                self._closer.put(job.batch_id)
            else:
                log.warning("job %s: result dropped, the row was finished by another attempt", job.id)
        finally:
            self._forget(job.id)

    def _db(self, call: Callable[[], T], what: str) -> T:
        return with_db_retry(call, what, self.db_retry_s)

    def _hand_back(self, job: Job) -> None:
        """Row back to queued (not counted as an attempt), then a new message; never lose it."""
        if not self._db(lambda: self.store.release_many([job.id], self.worker_id), "handing a job back"):
            return  # cancelled meanwhile, or no longer ours: its new owner records it
        try:
            if self.requeue is None:  # a runner built without a queue to send to: the reconciler re-sends it
                raise RuntimeError("this runner has no queue to send to")
            self.requeue(job.model, [job.id], job.work_class)
        except Exception as exc:  # Redis unreachable: let the reconciler of any worker re-send it
            log.warning("job %s: could not re-send (%s); it will be re-sent as an orphan", job.id, exc)
            self._db(lambda: self.store.mark_orphaned(job.id, self.worker_id), "marking a job orphaned")
        else:
            log.info("job %s handed back to the queue", job.id)
        self._publish(job.id, RestartEvent())  # stream readers drop what they saw: it starts over

    def _publish(self, job_id: uuid.UUID, event: StreamEvent) -> None:
        if self._publisher is not None:
            self._publisher.put_event(job_id, event)
