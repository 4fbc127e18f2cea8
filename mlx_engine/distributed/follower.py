"""A rank other than 0 (``Follower``): it mirrors rank 0's forward passes
(protocol.FollowerLoop) on its engine thread until rank 0 unloads the kit."""

from __future__ import annotations

import logging
import time

from ..errors import ShardedKitError
from .control import ControlClient
from .health import ShardWorker, on_failure
from .kit import ShardInfo
from .protocol import FollowerExit, FollowerLoop

logger = logging.getLogger(__name__)


class Follower:
    """A rank other than 0: ``serve()`` mirrors rank 0's passes until it unloads
    the kit (``FollowerExit("stopped")``) or the job fails (``"failed"``)."""

    def __init__(self, loop: FollowerLoop, info: ShardInfo, thread: ShardWorker, control: ControlClient):
        self._loop = loop
        self.shard = info
        self._thread = thread
        self._control = control
        self._stopped = False

    def serve(self) -> FollowerExit:
        try:
            result = self._thread.call(self._loop.run)
        except (RuntimeError, ShardedKitError) as exc:
            result = FollowerExit("failed", self._loop.passes, str(exc), len(self._loop.caches))
        self._stopped = True
        self._control.close()
        logger.info(
            "follower rank %d: %s after %d passes %s", self.shard.rank, result.reason, result.passes, result.detail
        )
        return result

    def lost_rank0(self) -> None:
        """The control channel to rank 0 closed: unless this follower was stopped, the job failed."""
        time.sleep(0.5)  # rank 0 closes the channel right after its stop message: let serve() see that first
        if not (self._stopped or self._loop.stopped):
            on_failure(self._thread.health, self._thread, "rank 0 closed the control connection", None)
