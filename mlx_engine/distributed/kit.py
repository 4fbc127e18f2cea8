"""Rank 0's kit over a model sharded across the job (``ShardedModelKit``) and
where this process stands in the job (``ShardInfo``)."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

from ..caches.sequence import SequenceCache
from ..kits.text import KitOptions, ModelKit
from ..runtime import worker
from .control import ControlServer
from .health import Health, ShardWorker
from .protocol import MirroredModel, PassCounter

logger = logging.getLogger(__name__)

EXIT_STOP_WAIT = 10.0


@dataclass(frozen=True)
class ShardInfo:
    """Where this process stands in the sharded job."""

    rank: int
    size: int
    parallelism: str  # "tensor" or "pipeline"
    counter: PassCounter  # forward passes (and their tokens) mirrored by rank 0


@dataclass(frozen=True)
class Shard:
    """What rank 0's load made of the job, for its kit."""

    model: MirroredModel
    info: ShardInfo
    num_params: int
    compute_dtype: object
    health: Health
    control: ControlServer


class ShardedModelKit(ModelKit):
    """Rank 0's kit over a model sharded across the job; use it like any ModelKit.
    ``usable`` is False (and every call raises ``ShardedKitError``) once a rank
    has failed; ``unload`` releases the followers."""

    shard: ShardInfo
    background_cost_measurement = False  # every rank takes part in each pass: measured at once

    def cost_key(self, kind: str, path=None) -> dict:
        """A stored cost record also depends on how the model is split."""
        return {**super().cost_key(kind, path), "ranks": self.shard.size, "parallelism": self.shard.parallelism}

    def __init__(self, model_path, options: KitOptions, shard: Shard, worker: ShardWorker):
        """A kit over this rank's shard: the files read as a vocabulary-only kit's,
        then the sharded model, the job's health and its control channel.
        ``worker``: the rank's engine thread, which built the kit and runs it."""
        super().__init__(model_path, options, worker)
        self.vocab_only = False
        self.model = shard.model
        self.num_params = shard.num_params  # of the whole model, as for a ModelKit
        self.compute_dtype = shard.compute_dtype
        self.prompt_cache = self._make_prompt_cache(self.new_cache(shard.model))
        # The followers mirror in-place trims of each cache, not branches of one
        # cache into another, so this kit keeps a single cached sequence.
        self.prompt_cache.keep_single_sequence()
        self.shard = shard.info
        self._health = shard.health
        self._control = shard.control

    def new_cache(self, model) -> SequenceCache:
        """A cache whose recurrent layers (a hybrid model's) keep no earlier
        state: the followers mirror trims only, so such a cache is never rewound
        (speculation falls back to plain decoding, prefixes are recomputed)."""
        cache = super().new_cache(model)
        cache.keep_rewind_points(0)
        return cache

    def forget_generation(self) -> None:
        """The generation that was running is blocked on a failed rank and will never
        finish on its own: stop counting it, so that ``unload`` is allowed."""
        self.activity.forget_all()

    @property
    def usable(self) -> bool:
        return self._health.failure is None and self.model is not None

    @property
    def failure(self) -> str | None:
        """Why the kit is unusable (None while it is usable)."""
        return self._health.failure

    def unload(self) -> None:
        """Release the followers and drop the model. After a failure this runs on the
        calling thread and only drops references: MLX calls such as ``clear_cache``
        can wait on the engine thread, which may be blocked on the failed rank."""
        model = self.model
        failed = self._health.failure is not None
        if isinstance(model, MirroredModel) and not failed:
            self._control.closing()
            try:
                model.stop_followers()
            except RuntimeError as exc:
                logger.warning("could not release the followers: %s", exc)
        self._control.close()
        if not failed:
            super().unload()
            return
        self.model = self.prompt_cache = self.draft = self.cost_model = None


def release_at_exit(ref: "weakref.ref[ShardedModelKit]") -> None:
    """At process exit, release the followers of a kit that is still loaded."""
    kit = ref()
    if kit is None or not kit.usable or kit.model is None:
        return
    worker.shutting_down.set()  # a running generation stops at its next token
    kit.worker.run_at_exit(kit.unload, EXIT_STOP_WAIT)
