"""One engine on its own thread, fed by many client threads: the bridge to Celery tasks and HTTP.

Client threads call `submit()` and get a Future; the engine thread drains the inbox between
steps, so requests join the running batch at the next step (continuous batching) and the engine
never waits for a batch to fill. Streaming callbacks run on the engine thread and must be quick
(hand the delta to a queue, never do I/O there).

A request that the engine fails inside a step (engine.py: only the requests the failure hits)
resolves its future with EngineRequestError naming the reason; the thread keeps serving the rest.
Should `step()` itself raise (a failure the engine cannot pin on requests), every request in
flight fails and the thread still carries on with later ones.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.outputs.outputs import EngineRequestError, RequestOutput
from tokenloom.engine.sample.sampling_params import SamplingParams

log = logging.getLogger("tokenloom.engine_host")

DeltaCallback = Callable[[RequestOutput], None]


@dataclass(slots=True)
class _Submission:
    request_id: str
    prompt: str | list[int] | None
    messages: list | None
    params: SamplingParams | None
    priority: int
    share_rank: int
    seat_class: int
    on_output: DeltaCallback | None
    future: Future = field(default_factory=Future)


class EngineHost:
    def __init__(self, engine: Engine | Callable[[], Engine], idle_wait_s: float = 0.05):
        # Given a factory, the engine is built ON the engine thread: torch's intra-op (OpenMP) thread
        # pool then belongs to the one thread that runs every step. Loading the model on another
        # thread leaves a second OpenMP team behind, and with more OpenMP threads than cores the
        # runtime stops spin-waiting between parallel regions.
        self._factory: Callable[[], Engine] | None
        self.engine: Engine | None
        if isinstance(engine, Engine):
            self._factory, self.engine = None, engine
        else:
            self._factory, self.engine = engine, None
        self._built: Future = Future()
        self._idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[str, _Submission] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenloom-engine", daemon=True)

    def start(self) -> "EngineHost":
        """Start the engine thread; returns once the engine is built (re-raising a failed build)."""
        self._thread.start()
        self._built.result()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        self._stopping.set()
        self._inbox.put(None)  # wake the loop
        self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def _live(self) -> Engine:
        """The built engine; only used on the engine thread, after `_run` has built it."""
        if self.engine is None:
            raise RuntimeError("engine is not built yet")
        return self.engine

    def submit(
        self,
        request_id: str,
        prompt: str | list[int] | None = None,
        *,
        messages: list | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
        share_rank: int = 0,
        seat_class: int = 0,
        on_output: DeltaCallback | None = None,
    ) -> Future:
        """Queue a request; the future resolves to the final RequestOutput (or the refusal)."""
        submission = _Submission(request_id, prompt, messages, params, priority, share_rank, seat_class, on_output)
        if self._stopping.is_set():
            submission.future.set_exception(RuntimeError("engine is shutting down"))
        else:
            self._inbox.put(("add", submission))
        return submission.future

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except BaseException as exc:  # e.g. a model that cannot load: start() raises it
                self._built.set_exception(exc)
                return
        self._built.set_result(None)
        while not self._stopping.is_set():
            self._drain_inbox(block=not self._live.has_unfinished_requests)
            if not self._live.has_unfinished_requests:
                continue
            try:
                outputs = self._live.step()
            except Exception as exc:  # a broken step must not leave clients waiting forever
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            for output in outputs:
                self._deliver(output)
        self._fail_all(RuntimeError("engine stopped before the request finished"))

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self._idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            kind, payload = item
            if kind == "add":
                self._add(payload)
            else:
                output = self._live.abort(payload)
                if output is not None:
                    self._deliver(output)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, submission: _Submission) -> None:
        try:
            self._live.add_request(
                submission.request_id,
                submission.prompt,
                messages=submission.messages,
                params=submission.params,
                priority=submission.priority,
                share_rank=submission.share_rank,
                seat_class=submission.seat_class,
            )
        except Exception as exc:  # InvalidRequestError and anything else: this request only
            submission.future.set_exception(exc)
            return
        self._pending[submission.request_id] = submission

    def _deliver(self, output: RequestOutput) -> None:
        submission = self._pending.get(output.request_id)
        if submission is None:
            return
        if submission.on_output is not None:
            try:
                submission.on_output(output)
            except Exception:
                log.exception("output callback of %s failed", output.request_id)
        if output.finished:
            del self._pending[output.request_id]
            if output.error is not None:
                submission.future.set_exception(EngineRequestError(output.error))
            else:
                submission.future.set_result(output)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, submission in list(self._pending.items()):
            try:
                self._live.abort(request_id)
            except Exception:  # state already broken: still resolve every future
                log.exception("aborting %s after a failed step failed too", request_id)
            submission.future.set_exception(exc)
        self._pending.clear()
