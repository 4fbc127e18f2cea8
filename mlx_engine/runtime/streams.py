"""The host-side streams ``create_generator`` returns; each hands over one
request's results, computed on the kit's engine thread (worker.py), to
whichever thread consumes it: ``RequestStream``, a request among the
scheduler's (scheduler.py; a kit serving one generation at a time has a
one-row scheduler). It closes its request on ``close()`` or garbage
collection, and loses no result to a ``KeyboardInterrupt``."""

from __future__ import annotations

import logging
import sys
from functools import partial
from typing import Iterator

from ..results import GenerationResult
from .scheduler import END, LiveRequest, Scheduler
from .worker import CloseGeneration, MLXWorker, ProcessExiting, shutting_down

logger = logging.getLogger(__name__)


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
        self._thread.call(CloseGeneration(partial(_close_stream, self._scheduler, self._generation, live, None)))

    def __del__(self) -> None:
        """Close on the engine thread without waiting: a finalizer may run on
        any thread, holding any lock."""
        if self._done or sys.is_finalizing() or shutting_down.is_set():
            return
        self._done = True
        try:
            close = partial(_close_stream, self._scheduler, self._generation, self._live, self._admission)
            self._thread.submit(CloseGeneration(close))
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
