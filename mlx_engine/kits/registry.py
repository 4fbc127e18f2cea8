"""The kit's request registry (``ModelKit.activity``)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import GenerationInProgressError


@dataclass(eq=False)  # compared by identity: every kit's registry is its own
class Activity:
    """The kit's request bookkeeping, safe from any thread: the requests created
    and not yet ended (``known``, at most the kit's ``max_parallel``), those
    running (``active``), and those asked to stop. A request is registered when
    its generator is created and ended when the generator finishes, fails or is
    closed, started or not."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    freed: threading.Condition = field(init=False)  # notified whenever a request ends
    active: set[str] = field(default_factory=set)
    known: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)
    last_end: float = 0.0  # time.monotonic() when a request last ended (0: none yet)

    def __post_init__(self) -> None:
        self.freed = threading.Condition(self.lock)
        _REGISTRIES.add(self)

    def wait_for_room(self, capacity: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until fewer than ``capacity`` requests
        are open; whether there is room now (another caller may still take it)."""
        with self.freed:
            return self.freed.wait_for(lambda: len(self.known) < capacity, timeout)

    def register(self, request_id: str, capacity: int = 1) -> None:
        with self.lock:
            if request_id in self.known:
                raise ValueError(f"request_id {request_id!r} is already in use on this kit")
            if len(self.known) >= capacity:
                open_ = ", ".join(repr(r) for r in sorted(self.known))
                raise GenerationInProgressError(
                    f"this kit already has {len(self.known)} open generation(s) ({open_}), its max_parallel of "
                    f"{capacity}; finish or close one first"
                )
            self.known.add(request_id)

    def begin(self, request_id: str) -> None:
        with self.lock:
            self.active.add(request_id)

    def end(self, request_id: str) -> None:
        with self.lock:
            self.active.discard(request_id)
            self.known.discard(request_id)
            self.cancelled.discard(request_id)
            self.last_end = time.monotonic()
            self.freed.notify_all()

    def idle_seconds(self) -> float:
        """Seconds since the last request ended with none open (0.0 while one is)."""
        with self.lock:
            return 0.0 if self.known else time.monotonic() - self.last_end

    def cancel(self, request_id: str) -> bool:
        """Ask ``request_id`` to stop; False when no such request exists."""
        with self.lock:
            if request_id not in self.known:
                return False
            self.cancelled.add(request_id)
            return True

    def forget_all(self) -> None:
        """Stop counting every open request (their generations can never finish,
        e.g. blocked on a failed rank), so the kit may be unloaded."""
        with self.lock:
            self.active.clear()
            self.known.clear()
            self.cancelled.clear()
            self.freed.notify_all()

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self.cancelled


#: Every live kit's registry in this process (weakly: an unloaded kit's goes with it).
_REGISTRIES: weakref.WeakSet[Activity] = weakref.WeakSet()


def process_idle_seconds(registries: Iterable[Activity] | None = None) -> float:
    """Seconds since any kit in this process (``registries``: every live kit's)
    last had a request open (0.0 while one has): work that would slow or be
    slowed by a running stream, such as timing forward passes, waits for every
    model's requests, not only its own."""
    found = list(_REGISTRIES if registries is None else registries)
    return min((a.idle_seconds() for a in found), default=float("inf"))
