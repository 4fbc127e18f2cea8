"""A served model's ``Service``: its kit, admission queue and running requests,
what every route of that model shares; ``ServiceFactory`` makes one per loaded
model with the app's options."""

from __future__ import annotations

import mlx_engine as me

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from ..web.metrics import Metrics
from .admission import AdmissionQueue

logger = logging.getLogger(__name__)


@dataclass
class Service:
    """What the handlers share: the kit and its admission queue (rows taken, requests waiting and running)."""

    kit: me.ModelKit
    model_id: str
    queue: AdmissionQueue
    api_key: str | None = None
    models_dir: Path | None = None
    decoding: str = "auto"
    context_overflow: str = "error"  # or "truncate-middle" (core/overflow.py)
    outcomes: Counter = field(default_factory=Counter)  # generations completed / cancelled / failed
    metrics: Metrics | None = None  # counts each generation's results (GET /metrics)

    def drain(self) -> None:
        """Stop admitting: queued and new requests get 503; running ones go on."""
        self.queue.close()

    async def stop(self, wait_s: float = 10.0) -> None:
        """Drain, cancel what still runs and wait (bounded) for its rows."""
        self.drain()
        self.cut_running()
        with anyio.move_on_after(wait_s):
            while self.queue.admitted:
                await asyncio.sleep(0.02)

    def cut_running(self) -> None:
        """Cancel every running request because the server stops: each ends with
        its final chunk (and an error event saying it was cut), not a dropped connection."""
        for run in list(self.queue.admitted):
            run.cancel(shutting_down=True)

    async def cut_after(self, grace_s: float) -> None:
        """Let running requests finish for ``grace_s`` seconds, then cut the rest."""
        await asyncio.sleep(grace_s)
        if self.queue.admitted:
            count = len(self.queue.admitted)
            logger.warning("shutdown grace period over: cancelling %d running request(s)", count)
        self.cut_running()


@dataclass(frozen=True)
class ServiceFactory:
    """Makes each model's ``Service`` (its queue and rows) with the app's options."""

    max_parallel: int | None
    queue_size: int
    api_key: str | None
    models_dir: Path | None
    decoding: str
    context_overflow: str
    outcomes: Counter
    metrics: Metrics | None

    def __call__(self, k: me.ModelKit, mid: str) -> Service:
        rows = k.max_parallel if self.max_parallel is None else min(self.max_parallel, k.max_parallel)
        return Service(
            k,
            mid,
            AdmissionQueue(rows, self.queue_size),
            self.api_key,
            self.models_dir,
            self.decoding,
            context_overflow=self.context_overflow,
            outcomes=self.outcomes,
            metrics=self.metrics,
        )
