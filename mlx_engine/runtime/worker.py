"""The threads that run the engine's MLX work.

Every MLX operation of a kit (loading, generating, draft loading, unloading) runs
on one engine-owned worker thread; the host calls in from any thread and waits.
Two MLX properties make this necessary (docs/reliability.md):

- MLX streams are per thread: an array left unevaluated on one thread cannot be
  evaluated on another ("There is no Stream(cpu, 0) in current thread").
- MLX keeps a per-thread compile cache whose destructor, run when the thread
  exits, takes the GIL. If a host thread that ran MLX work exits while the
  interpreter is finalizing, that destructor aborts the process ("terminate
  called without an active exception", exit 134).

Workers therefore never exit: a worker whose kit is gone returns to an idle pool
and is reused by the next kit. Idle workers are daemon threads parked on a queue,
so process exit never runs their thread-exit destructors. At exit, running
generations are asked to stop and the engine waits (boundedly) for its workers to
park before the interpreter finalizes.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
EXIT_WAIT_SECONDS = 30.0  # how long process exit waits for a busy worker to park

# Reentrant: a kit collected while the pool is being changed releases its worker
# from inside the garbage collector, on the same thread.
_pool_lock = threading.RLock()
_idle: list["MLXWorker"] = []
_all: list["MLXWorker"] = []
shutting_down = threading.Event()  # set at process exit: running generations stop


class ProcessExiting(RuntimeError):
    """Raised by ``submit`` once the process is exiting: workers take no more work."""


WAIT_POLL_SECONDS = 0.5  # how often a waiter re-checks a done flag whose wake-up went to another waiter


class DoneFlag:
    """A flag set once work is done, like ``threading.Event``, but safe to wait
    on in a thread that may get ``KeyboardInterrupt``. ``Event.wait`` runs
    Python code while it holds the event's lock; an interrupt landing there
    (Ctrl-C while the host waits) can leave that lock held, and the worker
    then blocks for good in ``set()``. Here a waiter blocks only inside C
    (``SimpleQueue.get``) and holds nothing."""

    __slots__ = ("_set", "_wake")

    def __init__(self) -> None:
        self._set = False
        self._wake: queue.SimpleQueue = queue.SimpleQueue()

    def set(self) -> None:
        self._set = True
        self._wake.put(None)

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set (True) or ``timeout`` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = WAIT_POLL_SECONDS if deadline is None else min(WAIT_POLL_SECONDS, deadline - time.monotonic())
            if left <= 0:
                return False
            try:
                self._wake.get(timeout=left)
            except queue.Empty:
                continue
            self._wake.put(None)  # for any other waiter
        return True


class Task:
    """One call handed to a worker, and its outcome.

    Not a ``concurrent.futures.Future``: a Future is waited on and read under
    a ``threading.Condition`` (the lock hazard ``DoneFlag`` avoids) and keeps
    its exception, whose traceback then holds the task and the call's
    arguments in a cycle; here ``done`` is a ``DoneFlag`` and the outcome is
    read as plain attributes (``streams.RequestStream`` hands a result over with no
    call in between) and cleared when handed over."""

    __slots__ = ("fn", "args", "kwargs", "done", "result", "error")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = DoneFlag()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # handed to the caller, StopIteration included
            self.error = exc
        finally:
            self.fn = self.args = self.kwargs = None
            self.done.set()

    def outcome(self) -> Any:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.result


class CloseGeneration:
    """A call that closes a generation on the engine thread. A value, so a worker
    can tell a close from other work (a sharded kit's worker runs closes inline
    once a rank has failed: they touch no other rank)."""

    __slots__ = ("close",)

    def __init__(self, close: Callable[[], None]):
        self.close = close

    def __call__(self) -> None:
        self.close()


class MLXWorker:
    """A daemon thread that runs the calls handed to it, one at a time."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Task] = queue.SimpleQueue()
        # The kit's scheduler (scheduler.py): stepped whenever it is busy, with
        # the calls handed to the worker run between its steps.
        self.job = None  # set through serve()
        self._thread = threading.Thread(target=self._loop, name="mlx-engine-worker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self.job
            # No steps once the process is exiting: the worker must park, idle,
            # before the interpreter finalizes (see _park_workers_at_exit).
            if job is None or not job.busy or shutting_down.is_set():
                # Not held while parked: a worker released to the pool would keep
                # its last kit's scheduler (and the arrays it holds) until reused.
                job = None
                self._tasks.get().run()
                continue
            while True:  # the calls handed over meanwhile, without waiting
                try:
                    self._tasks.get_nowait().run()
                except queue.Empty:
                    break
            try:
                job.step()
            except BaseException:  # pragma: no cover - a step reports to its requests itself
                logger.exception("a scheduler step failed")

    def failure_of(self, exc: BaseException) -> BaseException:
        """The error a request that failed with ``exc`` on this thread reports
        (a sharded kit's worker turns a lost rank into ``ShardedKitError``)."""
        return exc

    def serve(self, job) -> None:
        """Step ``job`` (a kit's scheduler: ``busy``, ``step()``) whenever it is
        busy, between the calls handed over; None: only calls."""
        self.job = job

    @property
    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> Task:
        if shutting_down.is_set():
            raise ProcessExiting("the process is exiting; mlx-engine accepts no more work")
        task = Task(fn, args, kwargs)
        self._tasks.put(task)
        return task

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run ``fn`` on this worker and return its result (or raise its
        exception) in the calling thread; inline when called from the worker."""
        if self.is_current:
            return fn(*args, **kwargs)
        task = self.submit(fn, *args, **kwargs)
        task.done.wait()
        return task.outcome()


def acquire() -> MLXWorker:
    """An idle worker from the pool, or a new one."""
    with _pool_lock:
        if _idle:
            return _idle.pop()
        worker = MLXWorker()
        _all.append(worker)
        return worker


def release_with(owner: object, worker: MLXWorker) -> MLXWorker:
    """Return ``worker`` to the pool once ``owner`` (the kit it serves) is gone."""
    weakref.finalize(owner, release, worker)
    return worker


def release(worker: MLXWorker) -> None:
    """Return a worker whose kit is gone to the pool (never ends its thread)."""
    with _pool_lock:
        worker.serve(None)
        if worker not in _idle:
            _idle.append(worker)


def _park_workers_at_exit() -> None:
    """Stop running generations and wait for every worker to park, so that no
    worker touches the interpreter while it finalizes."""
    shutting_down.set()
    for worker in list(_all):
        done = threading.Event()
        worker._tasks.put(Task(done.set, (), {}))  # queued behind any running work
        if not done.wait(EXIT_WAIT_SECONDS):
            logger.warning("an mlx-engine worker was still busy at exit")


atexit.register(_park_workers_at_exit)
