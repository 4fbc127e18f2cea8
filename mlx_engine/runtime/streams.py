"""The host-side streams ``create_generator`` returns; each hands over one
request's results, computed on the kit's engine thread (worker.py), to
whichever thread consumes it. ``RequestStream``: a request among the scheduler's
(scheduler.py); ``WorkerIterator``: any iterator whose steps run on a worker
(a request that runs alone, such as a vision kit's). Both close their request on
``close()`` or garbage collection, and neither loses a result to a
``KeyboardInterrupt``."""

from __future__ import annotations

import logging
import sys
from typing import Iterator, TypeVar

from ..results import GenerationResult
from .scheduler import END, LiveRequest, Scheduler
from .worker import CloseGenerator, MLXWorker, ProcessExiting, Task, shutting_down

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _wake() -> None:
    """A no-op call: the worker re-checks whether its scheduler has work."""


class RequestStream(Iterator[GenerationResult]):
    """What ``create_generator`` returns: one request's results, produced by the
    kit's scheduler. The request is admitted on the first ``next()``; any thread
    may consume it. ``close()`` (also on garbage collection) cancels it.

    A ``KeyboardInterrupt`` while ``next()`` waits loses nothing: a result is
    removed from the queue only where no signal handler can run before it is
    returned, and an interrupted admission is resumed, not repeated."""

    def __init__(self, thread: MLXWorker, scheduler: Scheduler, generation, request_id: str):
        self._thread, self._scheduler = thread, scheduler
        self._generation = generation
        self._request_id = request_id
        self._admission = None  # the admitting call's task (MLXWorker.submit), once made
        self._live: LiveRequest | None = None
        self._done = False

    @property
    def request_id(self) -> str:
        return self._request_id

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> GenerationResult:
        if self._done:
            raise StopIteration
        if self._thread.is_current:
            raise RuntimeError("a generation cannot be consumed from the engine thread (inside a callback)")
        live = self._live or self._admit()
        item = live.wait()
        if live.catch_up():
            self._nudge_worker()
        end, failed = item is END, isinstance(item, BaseException)
        # From here to the hand-over, no call or loop: Python runs signal
        # handlers (KeyboardInterrupt) only at those, so a result taken is
        # always returned, and one not yet taken is read again next time.
        del live.out[0]
        if end or failed:
            self._done = True
        if end:
            raise StopIteration
        if failed:
            raise item
        return item

    def _nudge_worker(self) -> None:
        """The worker may be parked, waiting for work: give it a call (none once
        the process is exiting: the worker then takes no more steps)."""
        try:
            self._thread.submit(_wake)
        except ProcessExiting:
            pass

    def _admit(self) -> LiveRequest:
        """Admit the request (once, even if waiting for it is interrupted). At
        process exit a request not admitted yet just ends."""
        if self._admission is None:
            try:
                self._admission = self._thread.submit(self._scheduler.admit, self._generation, self._request_id)
            except ProcessExiting:
                self._done = True
                raise StopIteration from None
        self._admission.done.wait()
        self._live = self._admission.outcome()
        return self._live

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        if self._live is None and self._admission is not None:
            self._admission.done.wait()
            self._live = self._admission.result
        live, self._live = self._live, None
        if live is None:
            self._thread.call(self._generation.close)
        else:
            self._thread.call(self._scheduler.close, live)

    def __del__(self) -> None:
        """Close on the engine thread without waiting: a finalizer may run on
        any thread, holding any lock."""
        if self._done or sys.is_finalizing() or shutting_down.is_set():
            return
        self._done = True
        try:
            self._thread.submit(_close_stream, self._scheduler, self._generation, self._live, self._admission)
        except Exception:  # pragma: no cover - best effort from a finalizer
            logger.exception("closing an abandoned generation failed")


def _close_stream(scheduler: Scheduler, generation, live: LiveRequest | None, admission) -> None:
    """Close an abandoned stream (on the engine thread, after any admission
    queued before it has run)."""
    if live is None and admission is not None:
        live = admission.result
    if live is None:
        generation.close()
    else:
        scheduler.close(live)


class WorkerIterator(Iterator[T]):
    """An iterator whose steps run on a worker. ``close()`` (also on garbage
    collection) closes the underlying generator on the worker. A step
    interrupted in the caller (e.g. KeyboardInterrupt while waiting) is not
    lost: the next ``next()`` returns its result."""

    def __init__(self, worker: MLXWorker, gen: Iterator[T]):
        self._worker = worker
        self._gen: Iterator[T] | None = gen
        self._pending: Task | None = None

    def __iter__(self) -> "WorkerIterator[T]":
        return self

    def __next__(self) -> T:
        if self._gen is None:
            raise StopIteration
        if self._worker.is_current:
            return next(self._gen)
        if self._pending is None:
            try:
                self._pending = self._worker.submit(next, self._gen)
            except ProcessExiting:
                # Generations stop at process exit; a thread still iterating
                # (a daemon) simply sees the end, not an error.
                raise StopIteration from None
        task = self._pending
        task.done.wait()
        # No call from here to the hand-over: Python runs signal handlers
        # (KeyboardInterrupt) only at calls and loops, so a step taken is
        # always returned, and one not yet taken is returned by the next call.
        error, result = task.error, task.result
        task.error = self._pending = None  # no cycle through the raised error's traceback
        if error is not None:
            raise error
        return result

    def close(self) -> None:
        gen, self._gen = self._gen, None
        if gen is None:
            return
        if self._pending is not None:
            self._pending.done.wait()
            self._pending = None
        self._worker.call(CloseGenerator(gen))

    def __del__(self) -> None:
        """Close on the worker without waiting: a finalizer may run on any thread,
        holding any lock. The worker runs calls in order, so the next call to the
        kit finds the generation closed."""
        gen, self._gen = self._gen, None
        if gen is None or sys.is_finalizing() or shutting_down.is_set():
            return
        try:
            if self._worker.is_current:
                gen.close()
            else:
                self._worker.submit(CloseGenerator(gen))
        except Exception:  # pragma: no cover - best effort from a finalizer
            logger.exception("closing an abandoned generation failed")
