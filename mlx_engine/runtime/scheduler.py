"""Continuous batching: a kit's open generations advance together, one step at a time.

Each generation is the pipeline's generator (pipeline.Generation). It yields
results, ``TURN`` between prompt chunks, and a ``Launch`` when its loop needs a
forward pass. A step resumes every running generation until it yields one of
the latter two, delivering its results to its stream, then runs all the
launches of the step as one batched forward pass (rows of the kit's
``RaggedBatch``) or, for caches that cannot join a batch, one pass each; the
next step resumes each generation with ``send(round)``, its launch's queued
round. A newly admitted request
therefore prefills one chunk per step while the others keep decoding, and
requests finish, fail or are cancelled without disturbing the rest.

The scheduler runs on the kit's engine thread (worker.py): the worker runs a
step whenever a generation is running, and the host's calls (new requests,
close, stop) in between. Results reach each request's ``RequestStream`` (streams.py) through
a queue, so streams may be consumed from any thread. A stream whose consumer
falls ``MAX_BACKLOG`` results behind is paused (skipped by the steps) until it
catches up, so an abandoned stream cannot grow without bound.
"""

from __future__ import annotations

import logging
import queue
import weakref
from collections import deque
from typing import Callable, Generator

import mlx.core as mx

from ..caches.ragged import RaggedBatch, can_batch
from ..decode import capture
from ..decode.protocol import TURN, Launch, Round, forward_alone, lazy_ids, resolve_pending, with_hidden

logger = logging.getLogger(__name__)

MAX_BACKLOG = 64  # undelivered results after which a request is paused
END = object()  # the last item of every request's results


class LiveRequest:
    """A running generation: its pipeline generator and its stream's results.

    The worker appends to ``out``; the stream reads ``out[0]`` and removes it
    only when it hands it over (see ``RequestStream.__next__``)."""

    __slots__ = ("gen", "out", "wake", "request_id", "cache", "paused", "round")

    def __init__(self, gen: Generator, request_id: str):
        self.gen = gen
        self.out: deque = deque()
        # One token per append: the stream blocks only inside C (SimpleQueue.get),
        # where a KeyboardInterrupt leaves no lock held (see worker.DoneFlag).
        self.wake: queue.SimpleQueue = queue.SimpleQueue()
        self.request_id = request_id
        self.cache = None  # the cache of its last launch (a row of the batch, once decoding)
        self.paused = False  # skipped for its backlog; the consumer wakes the worker when it catches up
        self.round: Round | None = None  # its last launch's round, sent to it when it resumes

    @property
    def backlog(self) -> int:
        """Results queued and not yet handed over."""
        return len(self.out)

    def catch_up(self) -> bool:
        """Unpause once the consumer has taken the backlog down to half the bound;
        True when it was paused (the worker must be woken to resume it)."""
        if self.paused and self.backlog <= MAX_BACKLOG // 2:
            self.paused = False
            return True
        return False

    def push(self, item) -> None:
        self.out.append(item)
        self.wake.put(None)

    def wait(self):
        """The next result, left in ``out`` (blocks until there is one). Tokens
        left from results taken without waiting only cost a loop turn."""
        while not self.out:
            self.wake.get()
        return self.out[0]


#: A launch of the step, its generation and its lazy ids (pending drafts computed).
_Resolved = tuple[LiveRequest, Launch, "mx.array | None"]


class Scheduler:
    """The kit's running generations and the batch their rows decode in.

    Failure model (docs/reliability.md): whatever can be attributed to one
    request (resuming its loop, joining its row, sampling its logits under its
    processors and grammar, its drafts, its pass alone) ends that request only;
    its own cleanup resets its caches. A failed shared pass is retried one row
    at a time, so a request fails only if its own pass fails; only a batch that
    cannot hand its rows back fails every request holding a row in it."""

    def __init__(self, kit, failure_of: Callable[[BaseException], BaseException] = lambda exc: exc):
        """``failure_of``: the error a request reports for the one it failed with
        (the engine thread's ``MLXWorker.failure_of``)."""
        # Weak: the worker holds its scheduler, and a kit must stay collectable
        # (its worker then returns to the pool).
        self._kit = weakref.ref(kit)
        self._failure_of = failure_of
        self.live: list[LiveRequest] = []

    @property
    def kit(self):
        return self._kit()

    @property
    def busy(self) -> bool:
        return any(not r.paused for r in self.live)

    def admit(self, gen: Generator, request_id: str) -> LiveRequest:
        live = LiveRequest(gen, request_id)
        self.live.append(live)
        return live

    def close(self, live: LiveRequest) -> None:
        """End a generation now (its stream was closed): the pipeline's cleanup runs."""
        if live in self.live:
            self.live.remove(live)
            try:
                live.gen.close()
            except Exception as exc:  # reported to the stream; the others go on
                live.push(exc)
            live.push(END)

    def step(self) -> None:
        """Advance every running generation to its next launch, then run the launches."""
        launches: list[tuple[LiveRequest, Launch]] = []
        for live in list(self.live):
            if live.paused:
                continue
            launch = self._advance(live)
            if launch is not None:
                live.cache = launch.cache
                launches.append((live, launch))
        if launches:
            self._forward(launches)

    def _advance(self, live: LiveRequest) -> Launch | None:
        """Resume ``live`` until it asks for a forward pass (returned), yields its
        turn, or ends (its stream gets the end, or its exception)."""
        while True:
            rnd, live.round = live.round, None
            try:
                item = live.gen.send(rnd)
            except StopIteration:
                self._finish(live, END)
                return None
            except BaseException as exc:  # the request's own failure: the others go on
                self._finish(live, exc)
                return None
            if isinstance(item, Launch):
                return item
            if item is TURN:
                return None
            # Paused before the result is visible: a consumer that drains the
            # queue meanwhile sees the flag, and wakes the worker.
            pause = live.backlog + 1 >= MAX_BACKLOG
            if pause:
                live.paused = True  # until its consumer catches up (RequestStream.__next__ wakes us)
            live.push(item)
            if pause:
                return None

    def _finish(self, live: LiveRequest, last) -> None:
        self.live.remove(live)
        if last is not END:
            live.push(self._failure_of(last))
        live.push(END)

    def abandon(self, exc: BaseException) -> bool:
        """The engine thread is stuck for good (a sharded job lost a rank): hand
        every running request's stream ``exc`` and its end, from any thread
        (their own clean-up cannot run). True when there was one."""
        abandoned, self.live = self.live, []
        for live in abandoned:
            live.push(exc)
            live.push(END)
        return bool(abandoned)

    def _forward(self, launches: list[tuple[LiveRequest, Launch]]) -> None:
        """One forward pass for the batch's rows (joining rows that can), one
        pass for each cache that cannot join; each row's round is kept for its
        generation's next resumption."""
        batch: RaggedBatch | None = self.kit.batch
        together, alone = [], []
        for live, launch, ids in self._draft(launches):
            if batch is None or not (launch.cache in batch or can_batch(launch.cache)):
                alone.append((live, launch, ids))
            elif launch.cache in batch or self._attempt(live, batch.join, launch.cache):
                together.append((live, launch, ids))
        if together:
            self._feed_together(batch, together)
        for live, launch, ids in alone:
            self._attempt(live, _run_alone, live, launch, ids)

    def _attempt(self, live: LiveRequest, fn: Callable, *args) -> bool:
        """Run one request's part of a step; if it raises, that request fails alone."""
        try:
            fn(*args)
            return True
        except Exception as exc:
            logger.info("request %r failed: %s: %s", live.request_id, type(exc).__name__, exc)
            self._fail(live, exc)
            return False

    def _draft(self, launches: list[tuple[LiveRequest, Launch]]) -> list[_Resolved]:
        """Compute the step's pending drafts together (batched draft passes).
        Drafts are proposals the main model verifies, so when the shared draft
        pass fails the draft caches are dropped (each drafter re-syncs its cache
        from its history) and each request drafts alone; the requests whose
        own drafting fails fail alone. Returns the launches still running, each
        with its lazy ids."""
        try:
            ids = resolve_pending([launch for _, launch in launches])
            return [(live, launch, i) for (live, launch), i in zip(launches, ids)]
        except Exception:
            logger.exception("a batched draft pass failed; drafting each request alone")
        if self.kit.draft is not None:
            self.kit.draft.discard_batch()
        resolved: list[_Resolved] = []
        for live, launch in launches:
            self._attempt(live, _draft_alone, live, launch, resolved)
        return resolved

    def _feed_together(self, batch: RaggedBatch, together: list[_Resolved]) -> None:
        """The rows' shared forward pass, then each row's own sampling."""
        # The rows of a kit share its head, so one spec covers every row that asks.
        spec = next((launch.hidden for _, launch, _ in together if launch.hidden is not None), None)
        try:
            with capture.collecting(spec) as sink:
                out = batch.feed([(launch.cache, launch.known, ids) for _, launch, ids in together])
        except Exception:
            # Not attributable to one row. A failed pass records nothing (a row's
            # tokens grow after the model ran; buffer positions past a row's
            # length are never read), so each row is retried on its own.
            logger.exception("a batched forward pass failed; running its rows one at a time")
            self._retry_alone(batch, together)
            return
        rows = {id(c): b for b, c in enumerate(batch.rows)}
        for (live, launch, ids), (logits, start) in zip(together, out):
            where = (sink, rows[id(launch.cache)])
            self._attempt(live, _finish_launch, live, launch, logits, start, ids, where)

    def _retry_alone(self, batch: RaggedBatch, together: list[_Resolved]) -> None:
        """Take the rows out of the batch and run each launch on its own cache
        (they rejoin at the next step)."""
        try:
            for _, launch, _ in together:
                batch.leave(launch.cache)
        except Exception as exc:
            logger.exception("the batch could not hand its rows back")
            self._fail_batch(exc)
            return
        for live, launch, ids in together:
            self._attempt(live, _run_alone, live, launch, ids)

    def _fail_batch(self, exc: Exception) -> None:
        """The batch itself is broken: every request holding a row of it gets
        the error where it waits, so its own cleanup runs; the batch's caches
        (the draft model's too) restart empty, and it is rebuilt empty."""
        batch = self.kit.batch
        rows = {id(c) for c in batch.rows} if batch is not None else set()
        self.kit.discard_batch()
        if self.kit.draft is not None:
            self.kit.draft.discard_batch()
        for live in list(self.live):
            if id(live.cache) in rows:
                self._fail(live, exc)

    def _fail(self, live: LiveRequest, exc: Exception) -> None:
        """End ``live`` with ``exc`` raised where it waits for its forward pass:
        its own cleanup runs (its caches are reset, its row leaves the batch)."""
        if live not in self.live:
            return
        self.live.remove(live)
        try:
            live.gen.throw(exc)
        except BaseException as err:  # the request's error, after its cleanup
            live.push(self._failure_of(err))
        else:  # pragma: no cover - a request never swallows a failed pass
            live.gen.close()
            live.push(exc)
        live.push(END)


def _draft_alone(live: LiveRequest, launch: Launch, resolved: list[_Resolved]) -> None:
    """Compute a launch's pending drafts on its own draft cache."""
    resolved.append((live, launch, lazy_ids(launch)))


def _run_alone(live: LiveRequest, launch: Launch, ids) -> None:
    """Run a launch on its own cache; its round waits for the row's resumption."""
    live.round = forward_alone(launch, ids)


def _finish_launch(live: LiveRequest, launch: Launch, logits, start: int, ids, where: tuple) -> None:
    """Sample a row of a shared pass; its round waits for the row's resumption.
    ``where``: the pass's recorded hidden states and the row's index in it."""
    sink, row = where
    live.round = with_hidden(launch.finish(logits, start, ids), launch, sink, row, logits.shape[0], start)
