"""Connection limits for uvicorn: stalled sockets cannot lock clients out.

uvicorn closes a connection that idles between requests (``timeout_keep_alive``)
but never one that is still sending its first request, and has no cap on open
connections: a few thousand sockets that connect and send nothing (or half a
request) exhaust the open-file limit, and every client, ``/health`` included,
is locked out. ``GuardedH11Protocol`` adds the two missing bounds:

- a request's headers must arrive within ``idle_timeout`` seconds of the
  connection opening or of the previous response, and its body may pause at
  most ``idle_timeout`` seconds between bytes;
- at most ``max_connections`` are open: one more closes the connection that has
  waited longest for its client to send a request (never one whose request runs),
  or, when every connection has a request running, the new one.
"""

from __future__ import annotations

import logging
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT_S = 10.0


def _default_max_connections() -> int:
    """Half the process's open-file limit (the model, its caches and logs need
    the rest), at most 512."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(512, soft // 2)) if soft != resource.RLIM_INFINITY else 512


DEFAULT_MAX_CONNECTIONS = _default_max_connections()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request deadline and a connection cap
    (class attributes, set by ``connection_limits``)."""

    max_connections = DEFAULT_MAX_CONNECTIONS
    idle_timeout = DEFAULT_IDLE_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._waiting_since = self._last_data = self.loop.time()
        self._deadline = None
        self._arm(self.idle_timeout)
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._last_data = self.loop.time()
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._waiting_since = self.loop.time()
        self._arm(self.idle_timeout)

    def stalled_since(self) -> float | None:
        """Since when this connection has waited on its client: for a request
        (headers not in full, none running) since it opened or the last response
        ended; for the rest of a request's body, since the last bytes came. None
        while a request runs."""
        if self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            return self._waiting_since
        if self.conn.their_state is h11.SEND_BODY:
            return self._last_data
        return None

    def _arm(self, delay: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, self._check_deadline)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _check_deadline(self) -> None:
        self._deadline = None
        since = self.stalled_since()
        if since is None or self.transport.is_closing():
            return  # a request runs: on_response_complete arms the next deadline
        left = since + self.idle_timeout - self.loop.time()
        if left <= 0:
            self.transport.close()  # stalled or half-open: nothing came in time
        else:
            self._arm(left)

    def _make_room(self) -> None:
        waiting = [(c.stalled_since(), c) for c in self.connections if isinstance(c, GuardedH11Protocol)]
        waiting = [(since, c) for since, c in waiting if since is not None]
        victim = min(waiting, key=lambda w: w[0])[1] if waiting else self
        logger.debug("connection cap (%d) reached: closing the longest-waiting connection", self.max_connections)
        victim.transport.close()


def connection_limits(max_connections: int = DEFAULT_MAX_CONNECTIONS, idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S):
    """``uvicorn.Config`` keyword arguments: the guarded protocol with these
    limits, and the same idle timeout between requests."""
    if max_connections < 2 or idle_timeout <= 0:
        raise ValueError(f"max_connections must be >= 2 and idle_timeout > 0, got {max_connections}, {idle_timeout}")
    protocol = type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"max_connections": max_connections, "idle_timeout": idle_timeout},
    )
    return {"http": protocol, "timeout_keep_alive": idle_timeout}
