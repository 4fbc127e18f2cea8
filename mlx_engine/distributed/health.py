"""The job's health as one rank sees it: the first failure (``Health``), the
engine thread that turns it into ``ShardedKitError`` for every call
(``ShardWorker``), and ``on_failure``, which releases the host from calls blocked
on a failed rank."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..errors import ShardedKitError
from ..runtime import worker
from ..runtime.idle import WhenIdle
from .control import break_ring_sockets

logger = logging.getLogger(__name__)

ABORT_GRACE = 5.0  # seconds a failed rank's blocked call gets to end before the host is released anyway


class Health:
    """Whether the job is usable; the first failure wins."""

    def __init__(self) -> None:
        self.failure: str | None = None
        self._lock = threading.Lock()

    def fail(self, reason: str) -> bool:
        with self._lock:
            if self.failure is not None:
                return False
            self.failure = reason
            return True

    def error(self) -> ShardedKitError:
        return ShardedKitError(
            f"the sharded kit is unusable: {self.failure}. Relaunch the job (every rank) and load the model again"
        )


class ShardWorker(worker.MLXWorker):
    """The engine thread of one rank. A failure of the job (a rank died or hung,
    noticed by MLX or by the control channel) turns into ``ShardedKitError`` for
    the call that was running and every later one."""

    def __init__(self, health: Health):
        super().__init__()
        self.health = health
        self.on_ring_error: Callable[[str], None] = health.fail
        self.release: Callable | None = None  # runs inline once failed (unloading a dead kit)
        self.on_abort: Callable[[], None] | None = None  # after abort_inflight released a blocked call
        self._inflight: list[worker.Task] = []

    def watch_ring(self, on_error: Callable[[str], None]) -> None:
        """From now on an MLX error in a call reports to ``on_error`` (rank 0: fail the whole job)."""
        self.on_ring_error = on_error

    def serve_kit(self, release: Callable, on_abort: Callable[[], None]) -> None:
        """The kit this thread serves: ``release`` is its unload (run inline once
        the job failed), ``on_abort`` runs after a blocked call was released."""
        self.release = release
        self.on_abort = on_abort

    def submit(self, fn: Callable, *args, **kwargs) -> worker.Task:
        if self.health.failure is not None:
            # unload() runs the kit's release either directly or through the
            # API's idle check (a WhenIdle carrying it).
            releasing = self.release is not None and (
                fn == self.release or (isinstance(fn, WhenIdle) and fn.action == self.release)
            )
            closing = isinstance(fn, worker.CloseGeneration)
            if releasing or closing:
                # Unloading a dead kit or closing its generators touches no rank: run it here.
                task = worker.Task(fn, args, kwargs)
                task.run()
                if task.error is not None and closing:
                    task.error = None  # a generator still running on a blocked thread stays as it is
                return task
            raise self.health.error()
        task = super().submit(self._guarded, fn, args, kwargs)
        self._inflight = [t for t in self._inflight if not t.done.is_set()] + [task]
        return task

    def _guarded(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            failure = self.failure_of(exc)
            if failure is exc:
                raise
            raise failure from exc

    def failure_of(self, exc: BaseException) -> BaseException:
        """A ring error (MLX's message: there is no typed one) or any error once
        the job failed is the job's failure, reported once to ``on_ring_error``;
        other errors are the call's own."""
        if not isinstance(exc, RuntimeError) or isinstance(exc, ShardedKitError):
            return exc
        if self.health.failure is None and "[ring]" not in str(exc):
            return exc
        self.on_ring_error(f"MLX reported: {exc}")
        return self.health.error()

    def abort_inflight(self) -> None:
        """Release the host from calls still blocked after a failure (their thread
        stays blocked inside MLX; the kit is not used again)."""
        aborted = False
        for task in self._inflight:
            if not task.done.is_set():
                task.error = self.health.error()
                task.done.set()
                aborted = True
        if self.job is not None and self.job.abandon(self.health.error()):
            aborted = True  # streams waiting on the scheduler's steps
        if aborted and self.on_abort is not None:
            self.on_abort()

    def run_at_exit(self, fn: Callable, timeout: float) -> None:
        task = worker.Task(fn, (), {})
        self._tasks.put(task)  # submit() refuses work once the process is exiting
        task.done.wait(timeout)


def on_failure(health: Health, thread: ShardWorker, reason: str, control) -> None:
    """A rank failed: record it, release collectives blocked on it, and give the
    host its error within ABORT_GRACE seconds whatever MLX does."""
    if not health.fail(reason):
        return
    broken = break_ring_sockets()
    logger.error("sharded kit failed: %s (%d ring sockets shut down)", reason, broken)
    if control is not None:
        control.close()
    timer = threading.Timer(ABORT_GRACE, thread.abort_inflight)
    timer.daemon = True
    timer.start()
