"""The kit's draft model: its weights and a pool of draft caches, one lent to
each request that drafts, with the acceptance this draft has delivered so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.nn as nn

from ..caches.ragged import RaggedBatch, can_batch, release_row
from ..caches.sequence import SequenceCache, common_prefix_length
from ..pricing import cost_store, costs


class AcceptanceRecord:
    """The drafts a loaded drafter proposed and had accepted on this kit so far
    (decaying counts, ``drafted_seen`` and ``accepted_seen``): a request's
    adaptive draft length starts from what this drafter has delivered."""

    drafted_seen: float
    accepted_seen: float

    def record(self, drafted: int, accepted: int) -> None:
        """One drafted round's outcome, from any request."""
        self.drafted_seen = self.drafted_seen * DRAFT_HISTORY_DECAY + drafted
        self.accepted_seen = self.accepted_seen * DRAFT_HISTORY_DECAY + accepted

    def acceptance_prior(self, default: float) -> float:
        """Share of this draft's tokens accepted so far; ``default`` until enough are seen."""
        if self.drafted_seen < DRAFT_HISTORY_MIN_TOKENS:
            return default
        return self.accepted_seen / self.drafted_seen


@dataclass
class DraftModel(AcceptanceRecord):
    """A loaded draft model and its pool of draft caches: ``first_cache``, made
    at load, and the ``spare`` ones made for parallel requests; either kind is
    lent to one request at a time (``lend``, ``give_back``)."""

    path: Path
    model: nn.Module
    first_cache: SequenceCache  # the pool's first cache; a drafter given no cache drafts with it
    num_params: int
    step_ratio: float | None = None  # a chained draft step in main-model steps, measured when first needed
    spare: list[SequenceCache] = field(default_factory=list)  # more caches, for parallel requests
    lent: list[SequenceCache] = field(default_factory=list)  # caches running requests draft with
    batch: RaggedBatch | None = None  # rows of the lent caches while parallel requests draft
    # Draft tokens proposed and accepted on this kit so far (decaying counts): a
    # request's adaptive draft length starts from what this draft has delivered,
    # not from a generic prior (a weak draft then costs nothing from round one).
    drafted_seen: float = 0.0
    accepted_seen: float = 0.0

    def chained_step_ratio(self, main: nn.Module, vocab_size: int, key: dict | None = None) -> float:
        """A draft step, as a drafter chains them, in single steps of the main
        model ``main``; found once per loaded draft: the record stored under
        ``key`` (cost_store.py), else measured and stored there."""
        if self.step_ratio is None:
            # Short (16 draft steps, 4 main ones): it is paid in a request's
            # time to first token, and timed rounds correct what it misses.
            self.step_ratio = cost_store.stored_ratio(
                key, lambda: costs.measure_draft_step_ratio(main, self.model, vocab_size)
            )
        return self.step_ratio

    def lend(self, prompt: list[int], make) -> SequenceCache:
        """An idle draft cache for a request (the one sharing the longest prefix
        with ``prompt``; a new one from ``make()`` when all are lent)."""
        idle = [c for c in [self.first_cache, *self.spare] if not any(c is x for x in self.lent)]
        cache = max(idle, key=lambda c: common_prefix_length(c.tokens, prompt)) if idle else make()
        self.lent.append(cache)
        return cache

    def batch_for_drafting(self) -> RaggedBatch | None:
        """The batch the draft passes of parallel requests share (None when the
        draft model's caches cannot be batched)."""
        if self.batch is None and can_batch(self.first_cache):
            self.batch = RaggedBatch(self.model, self.first_cache.layers)
        return self.batch

    def discard_batch(self) -> None:
        """Drop a broken draft batch: its rows' caches restart empty."""
        if self.batch is not None:
            for cache in self.batch.rows:
                cache.reset()
        self.batch = None

    def give_back(self, cache: SequenceCache) -> None:
        release_row(self.batch, cache)
        self.lent = [c for c in self.lent if c is not cache]
        if cache is not self.first_cache and not any(c is cache for c in self.spare):
            self.spare = (self.spare + [cache])[-MAX_SPARE_DRAFT_CACHES:]


MAX_SPARE_DRAFT_CACHES = 7
DRAFT_HISTORY_DECAY = 0.995  # per drafted round: the last few hundred rounds count
DRAFT_HISTORY_MIN_TOKENS = 32
