"""Idle unloads: a model past its TTL with nothing running or queued is unloaded
(the host's ``start`` begins them, its ``stop`` ends them)."""

from __future__ import annotations

import asyncio
import logging
import time

from ..web.errors import APIError
from .model_state import LOADED

logger = logging.getLogger(__name__)


class IdleUnloads:
    """Unloads ``host``'s idle managed models past their TTL, on the event loop."""

    def __init__(self, host):
        self.host = host
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            try:
                await self._once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never leave the models without their TTL
                logger.exception("idle unloads failed; retrying")
                await asyncio.sleep(1.0)

    async def _once(self) -> None:
        """Sleep a quarter of the shortest TTL (at most 0.5 s), then unload the idle expired models."""
        ttls = [self.host.ttl_of(e) for e in self.host.entries.values() if e.managed and e.state == LOADED]
        ttls = [t for t in ttls if t]
        await asyncio.sleep(min([0.5] + [t / 4 for t in ttls]))
        now = time.monotonic()
        for entry in list(self.host.entries.values()):
            if entry.state != LOADED or not entry.managed:
                continue
            if entry.busy:
                entry.last_used = now  # idle time counts from the last generation's end
                continue
            ttl = self.host.ttl_of(entry)
            if ttl and now - entry.last_used >= ttl:
                try:
                    await self.host.unload(entry.model.id, reason="ttl")
                except APIError:  # became busy meanwhile
                    pass
