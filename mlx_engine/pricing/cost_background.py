"""A kit's forward-cost measurement run between its requests, one pass at a time.

The first speculative request of a kit with no stored measurement starts from
an estimate (costs.estimate) and this measures the real widths afterwards on the
kit's engine thread: each task runs one forward pass and queues the next, so a
request arriving meanwhile waits for at most one pass; while the process is not
idle (``idle``: no generation of any kit open, and none for a moment, so
back-to-back requests are not interleaved with passes) it waits (re-checked every
``RETRY_SECONDS``) so that it neither slows a request nor times passes
disturbed by one.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from .costs import CostModel, Measurement

logger = logging.getLogger(__name__)

RETRY_SECONDS = 0.5


class BackgroundMeasurement:
    """Drives ``measurement`` through ``submit`` (a worker's submit) while
    ``idle()``; calls ``finish`` with the measurement and its result on the
    worker thread.
    ``alive()`` false (the kit unloaded, the process exiting) stops it."""

    def __init__(
        self,
        measurement: Measurement,
        submit: Callable[[Callable[[], None]], object],
        idle: Callable[[], bool],
        alive: Callable[[], bool],
        finish: Callable[[Measurement, CostModel], None],
    ):
        self.measurement = measurement
        self._submit, self._idle, self._alive, self._finish = submit, idle, alive, finish
        self.finished = threading.Event()
        self._timer: threading.Timer | None = None

    def start(self) -> None:
        self._queue()

    def stop(self) -> None:
        """Stop now and let go of the model and the scratch cache (the kit
        unloads): a retry timer still pending would hold them for up to
        ``RETRY_SECONDS``, and an unload must free its memory when it returns."""
        if self._timer is not None:
            self._timer.cancel()
        self.measurement = None

    def _queue(self) -> None:
        if self.measurement is None or not self._alive():
            return
        try:
            self._submit(self._pass)
        except RuntimeError as exc:  # the process is exiting (worker.ProcessExiting)
            logger.debug("cost measurement stopped: %s", exc)

    def _pass(self) -> None:
        measurement = self.measurement
        if measurement is None or not self._alive():
            return
        if not self._idle():
            self._timer = threading.Timer(RETRY_SECONDS, self._queue)
            self._timer.daemon = True
            self._timer.start()
            return
        try:
            done = measurement.step()
        except Exception:  # noqa: BLE001 - the estimate stays in use; nothing else depends on this
            logger.warning("forward-cost measurement failed; the estimate stays in use", exc_info=True)
            return
        if done:
            self._finish(measurement, measurement.result())
            self.finished.set()
        else:
            self._queue()
