"""Admission: a bounded first-in-first-out queue in front of the kit's rows.

The kit serves ``max_parallel`` generations at once and refuses one more
(``GenerationInProgressError``); the engine leaves queueing to its host. Here a
request takes as many rows as it has choices (``n``), waits its turn when they
are taken, and is refused at once (429) when ``limit`` requests already wait.
Rows are given back when the generations have ended on the engine thread,
not when a client leaves, so the count stays equal to the kit's open rows.
Everything here runs on the event loop; ``release`` from another thread goes
through ``loop.call_soon_threadsafe``. The queue is the one owner of what is
admitted: the rows taken, the requests waiting, and the requests whose
generations are open (``admitted``: what a stopping server cancels).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


class QueueFullError(Exception):
    """``limit`` requests already wait."""


class ShuttingDownError(Exception):
    """The server is stopping and admits nothing more."""


@dataclass
class _Waiter:
    rows: int
    future: asyncio.Future


class AdmissionQueue:
    """``rows`` slots, FIFO waiters, at most ``limit`` of them."""

    def __init__(self, rows: int, limit: int):
        if rows < 1 or limit < 0:
            raise ValueError(f"rows must be >= 1 and limit >= 0, got {rows}, {limit}")
        self.rows, self.limit = rows, limit
        self.free = rows
        self.closed = False
        self._waiters: deque[_Waiter] = deque()
        self.admitted: set = set()  # requests (runs.RequestRun) with generations still open

    def enter(self, run) -> None:
        """``run`` holds rows and its generations have started."""
        self.admitted.add(run)

    def leave(self, run) -> None:
        """``run``'s last generation has ended (its rows are given back one by one)."""
        self.admitted.discard(run)

    @property
    def busy(self) -> bool:
        """Rows are taken, requests wait, or generations are open."""
        return bool(self.running or self.waiting or self.admitted)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def running(self) -> int:
        return self.rows - self.free

    async def acquire(self, rows: int) -> None:
        """Take ``rows`` slots, waiting in line; ``QueueFullError`` when the line
        is full, ``ShuttingDownError`` once closed. Cancelling the wait leaves the line."""
        if not 1 <= rows <= self.rows:
            raise ValueError(f"rows must be from 1 to {self.rows}, got {rows}")
        if self.closed:
            raise ShuttingDownError()
        if not self._waiters and self.free >= rows:
            self.free -= rows
            return
        if len(self._waiters) >= self.limit:
            raise QueueFullError()
        waiter = _Waiter(rows, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await waiter.future
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(rows)  # granted just as the wait was cancelled: hand the rows on
            raise

    def release(self, rows: int) -> None:
        """Give ``rows`` back and admit waiters in order while their rows are free."""
        self.free = min(self.rows, self.free + rows)
        self._wake()

    def close(self) -> None:
        """Admit nothing more; every waiter gets ``ShuttingDownError``."""
        self.closed = True
        while self._waiters:
            w = self._waiters.popleft()
            if not w.future.done():
                w.future.set_exception(ShuttingDownError())

    def _wake(self) -> None:
        # Strict FIFO: the head waits for its rows even if a later, smaller request would fit.
        while self._waiters and self._waiters[0].rows <= self.free:
            w = self._waiters.popleft()
            if w.future.done():
                continue
            self.free -= w.rows
            w.future.set_result(None)
