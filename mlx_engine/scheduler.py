"""Continuous batching: a kit's open generations advance together, one step at a time.

Each generation is the pipeline's generator (pipeline.run). It yields results,
``TURN`` between prompt chunks, and a ``Launch`` when its loop needs a forward
pass. A step resumes every running generation until it yields one of the
latter two, delivering its results to its stream, then runs all the launches
of the step as one batched forward pass (rows of the kit's ``RaggedBatch``) or,
for caches that cannot join a batch, one pass each. A newly admitted request
therefore prefills one chunk per step while the others keep decoding, and
requests finish, fail or are cancelled without disturbing the rest.

The scheduler runs on the kit's engine thread (worker.py): the worker runs a
step whenever a generation is running, and the host's calls (new requests,
close, stop) in between. Results reach each request's ``RequestStream`` through
a queue, so streams may be consumed from any thread. A stream whose consumer
falls ``MAX_BACKLOG`` results behind is paused (skipped by the steps) until it
catches up, so an abandoned stream cannot grow without bound.
"""

from __future__ import annotations

import logging
import queue
import sys
import weakref
from typing import Iterator

from . import worker
from .batch_cache import RaggedBatch, can_batch
from .results import GenerationResult
from .speculative.loop import TURN, Launch, forward_alone, resolve_pending

logger = logging.getLogger(__name__)

MAX_BACKLOG = 64  # undelivered results after which a request is paused
_END = object()


class _Live:
    """A running generation: its pipeline generator and its stream's queue."""

    __slots__ = ("gen", "out", "request_id", "cache", "paused")

    def __init__(self, gen: Iterator, request_id: str):
        self.gen = gen
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.request_id = request_id
        self.cache = None  # the cache of its last launch (a row of the batch, once decoding)
        self.paused = False  # skipped for its backlog; the consumer wakes the worker when it catches up


class Scheduler:
    """The kit's running generations and the batch their rows decode in."""

    def __init__(self, kit):
        # Weak: the worker holds its scheduler, and a kit must stay collectable
        # (its worker then returns to the pool).
        self._kit = weakref.ref(kit)
        self.live: list[_Live] = []

    @property
    def kit(self):
        return self._kit()

    @property
    def busy(self) -> bool:
        return any(not r.paused for r in self.live)

    def admit(self, gen: Iterator, request_id: str) -> _Live:
        live = _Live(gen, request_id)
        self.live.append(live)
        return live

    def close(self, live: _Live) -> None:
        """End a generation now (its stream was closed): the pipeline's cleanup runs."""
        if live in self.live:
            self.live.remove(live)
            try:
                live.gen.close()
            except Exception as exc:  # reported to the stream; the others go on
                live.out.put(exc)
            live.out.put(_END)

    def step(self) -> None:
        """Advance every running generation to its next launch, then run the launches."""
        launches: list[tuple[_Live, Launch]] = []
        for live in list(self.live):
            if live.paused:
                continue
            launch = self._advance(live)
            if launch is not None:
                live.cache = launch.cache
                launches.append((live, launch))
        if launches:
            self._forward(launches)

    def _advance(self, live: _Live) -> Launch | None:
        """Resume ``live`` until it asks for a forward pass (returned), yields its
        turn, or ends (its stream gets the end, or its exception)."""
        while True:
            try:
                item = next(live.gen)
            except StopIteration:
                self._finish(live, _END)
                return None
            except BaseException as exc:  # the request's own failure: the others go on
                self._finish(live, exc)
                return None
            if isinstance(item, Launch):
                return item
            if item is TURN:
                return None
            live.out.put(item)
            if live.out.qsize() >= MAX_BACKLOG:
                live.paused = True  # until its consumer catches up (RequestStream.__next__ wakes us)
                return None

    def _finish(self, live: _Live, last) -> None:
        self.live.remove(live)
        if last is not _END:
            live.out.put(last)
        live.out.put(_END)

    def _forward(self, launches: list[tuple[_Live, Launch]]) -> None:
        """One forward pass for the batch's rows (joining rows that can), one
        pass for each cache that cannot join; then every round is queued."""
        batch: RaggedBatch | None = self.kit.batch
        together, alone = [], []
        for live, launch in launches:
            if batch is not None and (launch.cache in batch or can_batch(launch.cache)):
                together.append((live, launch))
            else:
                alone.append((live, launch))
        try:
            resolve_pending([launch for _, launch in launches])  # draft passes, batched too
            if together:
                for _, launch in together:
                    if launch.cache not in batch:
                        batch.join(launch.cache)
                out = batch.feed([(l.cache, l.known, l.lazy) for _, l in together])
                for (_, launch), (logits, start) in zip(together, out):
                    launch.round = launch.finish(logits, start)
            for _, launch in alone:
                forward_alone(launch)
        except Exception as exc:
            logger.exception("a batched forward pass failed")
            self._fail_batch(exc, [live for live, _ in launches])

    def _fail_batch(self, exc: Exception, lives: list[_Live]) -> None:
        """A forward pass failed: every request in it, and every row of the batch
        (whose keys and values lived in it), gets the error where it waits, so
        its own cleanup runs; their caches restart empty."""
        batch = self.kit.batch
        rows = {id(c) for c in batch.rows} if batch is not None else set()
        if batch is not None:
            for cache in batch.rows:
                cache.reset()
            self.kit.batch = None  # rebuilt empty for the next request
        draft = self.kit.draft
        if draft is not None and draft.batch is not None:
            for cache in draft.batch.rows:
                cache.reset()
            draft.batch = None
        for live in list(self.live):
            if live in lives or id(live.cache) in rows:
                self.live.remove(live)
                try:
                    live.gen.throw(exc)
                except BaseException as err:  # the request's error, after its cleanup
                    live.out.put(err)
                else:  # pragma: no cover - a request never swallows a failed pass
                    live.gen.close()
                    live.out.put(exc)
                live.out.put(_END)


def _wake() -> None:
    """A no-op call: the worker re-checks whether its scheduler has work."""


class RequestStream(Iterator[GenerationResult]):
    """What ``create_generator`` returns: one request's results, produced by the
    kit's scheduler. The request is admitted on the first ``next()``; any thread
    may consume it. ``close()`` (also on garbage collection) cancels it."""

    def __init__(self, thread: worker.MLXWorker, scheduler: Scheduler, generation, request_id: str):
        self._thread, self._scheduler = thread, scheduler
        self._generation = generation
        self._request_id = request_id
        self._live: _Live | None = None
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
        if self._live is None:
            self._live = self._thread.call(self._scheduler.admit, self._generation, self._request_id)
        item = self._live.out.get()
        if self._live.paused and self._live.out.qsize() < MAX_BACKLOG // 2:
            self._live.paused = False
            self._thread.submit(_wake)  # the worker may be parked, waiting for work
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            self._live.out.get()  # the end marker that follows
            raise item
        return item

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        live, self._live = self._live, None
        if live is None:
            self._thread.call(self._generation.close)
        else:
            self._thread.call(self._scheduler.close, live)

    def __del__(self) -> None:
        """Close on the engine thread without waiting: a finalizer may run on
        any thread, holding any lock."""
        if self._done or sys.is_finalizing() or worker.shutting_down.is_set():
            return
        self._done = True
        try:
            if self._live is None:
                self._thread.submit(self._generation.close)
            else:
                self._thread.submit(self._scheduler.close, self._live)
        except Exception:  # pragma: no cover - best effort from a finalizer
            logger.exception("closing an abandoned generation failed")
