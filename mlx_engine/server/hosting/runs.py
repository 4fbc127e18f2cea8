"""Generations bridged to the event loop.

``create_generator`` (which validates on the kit's engine thread) and every
``next()`` block, so they run on threads: one pump thread per generation
iterates it and hands each result to the loop through ``call_soon_threadsafe``.
The loop never waits on MLX work. Cancelling (``stop_generation``) makes the
generation end within one step with ``user_cancelled``; the pump then closes
the iterator and, once every choice of a request has ended, gives the rows
back to the admission queue.
"""

from __future__ import annotations

import mlx_engine as me

import asyncio
import logging
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import anyio

from .admission import AdmissionQueue

logger = logging.getLogger(__name__)

_END = object()
# While a host that embeds the server holds rows of the kit itself, the kit can
# refuse a generation the queue admitted: it then waits on the kit's own
# admission (woken when a generation ends), in slices of this many seconds so a
# request cancelled meanwhile stops waiting.
_ADMISSION_SLICE_S = 0.5


@dataclass
class Item:
    """A result of choice ``index``, or the exception that ended it."""

    index: int
    result: me.GenerationResult | None = None
    error: BaseException | None = None


class RequestRun:
    """The ``n`` generations of one HTTP request (its choices), from creation to
    the last row given back."""

    def __init__(
        self,
        kit: me.ModelKit,
        rows: AdmissionQueue,
        outcomes: Counter,
        observer: Callable[[int, me.GenerationResult], None] | None = None,
    ):
        self.kit, self.rows, self.outcomes = kit, rows, outcomes
        self.observer = observer  # sees every result on the pump thread (metrics.RunObserver)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Item | object] = asyncio.Queue()
        self.request_ids: list[str] = []
        self._live = 0
        self._lock = threading.Lock()
        self.cut_by_shutdown = False  # cancelled while running because the server stops
        self._own: Counter = Counter()  # this request's outcomes (for its one log line)

    async def start(self, prompt: list[int], kwargs_per_choice: list[dict]) -> None:
        """Create one generator per choice on threads (retrying while the kit is
        busy with a host's own generations) and start their pumps. The queue's
        rows must already be held; on failure they are given back."""
        gens = []
        try:
            for kw in kwargs_per_choice:
                rid = f"srv-{uuid.uuid4().hex}"
                gens.append((rid, await self._create(prompt, {**kw, "request_id": rid})))
        except BaseException:
            for _, gen in gens:
                await anyio.to_thread.run_sync(gen.close)
            self.rows.release(len(kwargs_per_choice))
            raise
        # From here each pump gives its own row back when its generation has ended.
        self._live = len(gens)
        self.rows.enter(self)
        for index, (rid, gen) in enumerate(gens):
            self.request_ids.append(rid)
            threading.Thread(
                target=self._pump, args=(index, gen), name=f"mlx-engine-server-{rid[-6:]}", daemon=True
            ).start()

    async def _create(self, prompt: list[int], kwargs: dict):
        kwargs = {**kwargs, "admission_timeout": _ADMISSION_SLICE_S}
        while True:
            try:
                return await anyio.to_thread.run_sync(lambda: me.create_generator(self.kit, prompt, **kwargs))
            except me.GenerationInProgressError:
                continue  # still full after a slice: the await above is where a cancellation lands

    def _pump(self, index: int, gen) -> None:
        """Thread: iterate one generator, hand results to the loop, close it."""
        outcome = "failed"
        try:
            for result in gen:
                if result.stop_condition is not None:
                    outcome = "cancelled" if result.stop_condition.stop_reason == "user_cancelled" else "completed"
                if self.observer is not None:
                    self.observer(index, result)
                self._put(Item(index, result))
        except BaseException as exc:  # noqa: BLE001 - reported to the client, not lost
            logger.debug("generation %s failed", self.request_ids[index], exc_info=True)
            self._put(Item(index, error=exc))
            if isinstance(exc, ValueError):  # the request's own argument (a grammar limit met late): a 400
                outcome = "rejected"
                self._call(logger.info, "request %s rejected: %s", self.request_ids[0], exc)
            else:
                self._call(self._failed, f"{type(exc).__name__}: {exc}")
        finally:
            gen.close()
            self._put(_END)
            self._call(self._ended, outcome)

    def _put(self, item) -> None:
        self._call(self.queue.put_nowait, item)

    def _call(self, fn: Callable, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed (process exit): nothing is listening
            pass

    def _failed(self, why: str) -> None:
        logger.warning("request %s failed: %s", self.request_ids[0], why)

    def _ended(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self._own[outcome] += 1
        self.rows.release(1)
        self._live -= 1
        if self._live == 0:
            self.rows.leave(self)
            if self._own["cancelled"]:
                cause = "the server is stopping" if self.cut_by_shutdown else "the client left or the host stopped it"
                logger.info(
                    "request %s cancelled (%s): %d of %d choices cut short",
                    self.request_ids[0],
                    cause,
                    self._own["cancelled"],
                    len(self.request_ids),
                )

    def cancel(self, shutting_down: bool = False) -> None:
        """Ask every choice to stop (within one step); safe to call repeatedly.
        ``shutting_down``: the server stops (the stream says it was cut)."""
        if shutting_down and self._live:
            self.cut_by_shutdown = True
        for rid in self.request_ids:
            me.stop_generation(self.kit, rid)

    async def items(self) -> AsyncIterator[Item]:
        """Results of all choices in arrival order, until each has ended."""
        ends = 0
        while ends < len(self.request_ids):
            item = await self.queue.get()
            if item is _END:
                ends += 1
                continue
            yield item
