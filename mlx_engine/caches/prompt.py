"""A kit's prompt cache: several cached sequences, branches, a memory budget
and an optional disk tier.

Each entry is a ``SequenceCache`` (KV layers plus the exact tokens they hold).
A request uses the entry sharing the longest prefix with its prompt:

- when the prompt extends the entry (the next turn of that chat), the entry is
  used in place;
- when it diverges inside the entry (regenerate, an edited message, another
  chat with the same system prompt), a **branch** is made: a new entry holding
  the shared prefix, whose KV arrays are slices of the original's (MLX arrays
  are immutable, so the two share storage until one grows), and the original
  stays intact: every earlier point of a conversation is a checkpoint;
- recurrent layers (hybrid models) cannot be cut back: a branch starts from
  the latest recurrent-state checkpoint at or before the shared prefix (the
  end of an earlier prompt or answer, see sequence.py), its attention KV sliced
  to the same position, and the request prefills the rest;
- caches that cannot be sliced (rotating windows that have wrapped, quantized
  layers) are trimmed in place, as a single-sequence cache would.

Entries are evicted least recently used first once their KV bytes pass the
budget; with a disk directory, evicted entries are written there (disk.py)
and read back on a prefix hit.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from .disk import DiskCache, prepare_root
from .sequence import UNKNOWN, SequenceCache, common_prefix_length, flat_layers

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 16
DEFAULT_DISK_BYTES = 8 * 2**30


@dataclass(frozen=True)
class PromptCacheOptions:
    """``load_model``'s prompt-cache arguments, checked: ``memory_bytes`` bounds
    the KV bytes of all cached sequences (None: ``default_memory_budget()``);
    ``directory`` turns on the disk tier, ``disk_bytes`` bounds it."""

    memory_bytes: int | None = None
    directory: str | None = None
    disk_bytes: int = DEFAULT_DISK_BYTES

    @classmethod
    def validate(cls, memory_bytes=None, directory=None, disk_bytes=None) -> PromptCacheOptions:
        for name, value in (("prompt_cache_bytes", memory_bytes), ("prompt_cache_disk_bytes", disk_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer (bytes) or None, got {value!r}")
        if directory is not None and (not isinstance(directory, (str, os.PathLike)) or not str(directory).strip()):
            raise ValueError(f"prompt_cache_dir must be a directory path or None, got {directory!r}")
        if directory is not None:
            prepare_root(directory)  # before any weights are read: a bad folder fails the load at once
        return cls(
            memory_bytes,
            None if directory is None else str(directory),
            DEFAULT_DISK_BYTES if disk_bytes is None else disk_bytes,
        )


class CacheHit(NamedTuple):
    """Where a request's cached prefix came from, for the stats."""

    tokens: int  # prompt tokens reused
    source: str  # "none", "memory", "branch" or "disk"


def cache_bytes(cache: SequenceCache) -> int:
    """KV bytes held by ``cache``: a plain KV layer counts its tokens' share of
    its buffers (shared storage counts for each holder), recurrent layers their
    state with its rewind points and checkpoints, other layers their state."""
    total = cache.state_bytes()
    for layer in flat_layers(cache.layers):
        if isinstance(layer, KVCache):
            if layer.keys is not None:
                total += (layer.keys.nbytes + layer.values.nbytes) * layer.offset // layer.keys.shape[2]
        elif not isinstance(layer, ArraysCache):
            total += sum(a.nbytes for a in _arrays(layer.state))
    return total


def _arrays(state) -> list[mx.array]:
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _arrays(s)]
    return []


def can_branch(cache: SequenceCache) -> bool:
    """Whether a prefix of ``cache`` can be copied out by slicing (plain KV
    layers) and restoring a kept state (recurrent layers)."""
    layers = flat_layers(cache.layers)
    return bool(layers) and all(type(c) is KVCache or isinstance(c, ArraysCache) for c in layers)


def branch(cache: SequenceCache, n: int, make: Callable[[], SequenceCache]) -> SequenceCache:
    """A new entry holding the first ``n`` tokens of ``cache`` (for recurrent
    layers: of the latest kept state at or before ``n``, so it may hold fewer);
    the KV arrays are slices of the original's and the states the original's
    own, so nothing is copied until either one grows."""
    out = make()
    n = cache.restorable(n)
    state = cache.state_at(n) if cache.recurrent else ()
    if n == 0 or state is None:
        return out
    for src, dst in zip(flat_layers(cache.layers), flat_layers(out.layers)):
        if type(src) is KVCache and src.keys is not None:
            dst.state = (src.keys[..., :n, :], src.values[..., :n, :], n)
    out.restore(state)
    out.tokens = list(cache.tokens[:n])
    out.checkpoints = [(p, s) for p, s in cache.checkpoints if p <= n]
    return out


def _known_length(tokens: list[int]) -> int:
    """Length without trailing UNKNOWN positions (a round abandoned mid-flight)."""
    n = len(tokens)
    while n and tokens[n - 1] == UNKNOWN:
        n -= 1
    return n


def _covers(longer: SequenceCache, known: list[int], entry: SequenceCache) -> bool:
    """Whether ``longer`` (whose known tokens are ``known``) makes ``entry``
    redundant: its tokens are a prefix of ``known``, and (a hybrid's recurrent
    state) ``longer`` can resume at every position ``entry`` can."""
    if not _is_prefix(entry.tokens, known):
        return False
    return not entry.recurrent or all(longer.restorable(p) == p for p in entry.resume_points())


def _is_prefix(tokens: list[int], of: list[int]) -> bool:
    n = _known_length(tokens)
    return n <= len(of) and tokens[:n] == of[:n]


class PromptCache:
    """The kit's cached sequences (one of them ``active``: the kit's ``cache``)."""

    def __init__(
        self,
        make: Callable[[], SequenceCache],
        budget_bytes: int,
        disk: DiskCache | None = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ):
        self.make = make
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.disk = disk
        self.entries: list[SequenceCache] = [make()]  # least recently used first
        self.busy: list[SequenceCache] = []  # entries a running request decodes into
        # One sequence, trimmed in place: for kits whose caches are mirrored on
        # other processes (a sharded kit's followers know only in-place trims).
        self.single_sequence = False

    @property
    def active(self) -> SequenceCache:
        return self.entries[-1]

    def idle_sequences(self, other_than_prefix_of: list[int]) -> list[list[int]]:
        """The token sequences of entries no running request holds, except those
        holding all of ``other_than_prefix_of`` but its last token (earlier
        answers to that very prompt), least recently used first."""
        n = len(other_than_prefix_of) - 1
        return [
            e.tokens
            for e in self.entries
            if not self.is_busy(e) and common_prefix_length(e.tokens, other_than_prefix_of) < n
        ]

    def is_busy(self, entry: SequenceCache) -> bool:
        """Whether a running request holds ``entry``."""
        return any(e is entry for e in self.busy)

    def select(self, keys: list[int]) -> tuple[SequenceCache, CacheHit]:
        """The entry for a prompt whose cache keys (all but the last position)
        are ``keys``, made the most recently used and busy until ``release``;
        evicts past the budget. Entries busy with other requests are not
        shared (their keys and values may be rows of the running batch)."""
        idle = [e for e in self.entries if not self.is_busy(e)] or [self.make()]
        best = max(reversed(idle), key=lambda e: common_prefix_length(e.tokens, keys))
        shared = common_prefix_length(best.tokens, keys)
        entry, source = self._entry_for(best, shared, keys)
        self.entries = [e for e in self.entries if e is not entry] + [entry]
        self.busy.append(entry)
        self._evict()
        return entry, CacheHit(
            common_prefix_length(entry.tokens, keys), source if shared or source == "disk" else "none"
        )

    def _entry_for(self, best: SequenceCache, shared: int, keys: list[int]) -> tuple[SequenceCache, str]:
        if self.single_sequence:
            return best, "memory"
        if self.disk is not None:
            loaded = self.disk.load_longest(keys, shared, self.make)
            if loaded is not None:
                return loaded, "disk"
        if shared == _known_length(best.tokens):
            return best, "memory"  # the prompt extends this entry
        if shared and can_branch(best):
            if not best.restorable(shared):
                return self.make(), "none"  # no recurrent state kept that early: keep the entry whole
            return branch(best, shared, self.make), "branch"
        if not shared and best.tokens:
            return self.make(), "none"  # a new sequence: keep the others
        return best, "memory"  # trimmed in place (sync_to) where slicing is not possible

    def release(self, entry: SequenceCache) -> None:
        """After a request: ``entry`` is idle again; drop the idle entries it now
        covers (their tokens are a prefix of its own, e.g. the answer it
        replaced was regenerated identically), then keep to the budget."""
        self.busy = [e for e in self.busy if e is not entry]
        known = entry.tokens[: _known_length(entry.tokens)]
        self.entries = [e for e in self.entries if e is entry or self.is_busy(e) or not _covers(entry, known, e)]
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used entries past the entry count or the byte
        budget (never the active one), writing them to disk when there is one."""
        while len(self.entries) > 1 and (
            len(self.entries) > self.max_entries or self.memory_bytes() > self.budget_bytes
        ):
            idle = [e for e in self.entries[:-1] if not self.is_busy(e)]
            if not idle:
                return
            old = idle[0]
            self.entries = [e for e in self.entries if e is not old]
            if self.disk is not None and old.tokens:
                self.disk.save(old)
            logger.debug("prompt cache: evicted a %d-token entry", len(old.tokens))

    def memory_bytes(self) -> int:
        return sum(cache_bytes(e) for e in self.entries)

    def keep_single_sequence(self) -> None:
        """From now on keep one sequence, trimmed in place, never branched (a
        sharded kit: its followers mirror in-place trims only)."""
        self.single_sequence = True

    def replace_all(self, cache: SequenceCache) -> None:
        """Make ``cache`` the only entry (a kit whose model or cache was swapped)."""
        self.entries = [cache]
        self.busy = []

    def clear(self) -> None:
        """Forget every idle cached sequence (the disk tier is kept)."""
        self.entries = [e for e in self.entries if self.is_busy(e)] or [self.make()]

    def flush(self) -> None:
        """Write every entry to the disk tier (at unload, for persistence)."""
        if self.disk is not None:
            for e in self.entries:
                if e.tokens:
                    self.disk.save(e)
