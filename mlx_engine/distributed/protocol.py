"""How the followers keep in step with rank 0: every forward pass of the sharded
model on rank 0 is announced to the other ranks inside the same MLX graph.

Rank 0 wraps its sharded model in ``MirroredModel``. Each call builds a fixed-size
int32 header (which cache, its length before the pass, the input shape, how to
build the cache if it is new, and up to ``INLINE`` input ids) and ``all_sum``s it
over the group, the followers contributing zeros; longer inputs follow in a
second ``all_sum``. The model then runs on the ids *as received*, so the header
collectives always run before the pass's own ones (they are queued first), and ids that are still lazy on
rank 0 (a draft, the token sampled one step ahead) travel without a host sync.

Followers (``serve``) wait on the header, trim their copy of that cache to the
announced length (that is how rewinds, trims and resets reach them: no separate
message), run the same pass and evaluate it. Every pass is evaluated in full on
every rank (``async_eval`` of the logits on rank 0), so each rank runs the same
collectives in the same order whatever the caller evaluates.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ..errors import ShardedKitError

logger = logging.getLogger(__name__)

OP_FORWARD, OP_DROP, OP_STOP = 1, 2, 3
FIELDS = 8  # op, cache id, cache length, batch, length, rotating size, rotating keep, sequence number
INLINE = 24  # input ids carried in the header itself (a verify pass is at most 17)
HEADER = FIELDS + INLINE


@dataclass
class PassCounter:
    """Forward passes mirrored so far (read by stats and the benchmark)."""

    passes: int = 0
    tokens: int = 0


class MirroredModel(nn.Module):
    """Rank 0's sharded model: calls it after announcing the pass to the followers.

    Attribute ``model`` is the sharded mlx-lm model (so code that looks for the
    embedding finds it); ``layers`` and ``make_cache`` are the local shard's."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.model = model
        self._group = group
        self._seq = 0
        self._next_id = 1
        self._mirrors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # first layer -> (id, rotating)
        self._dropped: deque[int] = deque()  # cache ids whose layers were freed (any thread)
        self._lock = threading.Lock()
        self.counter = PassCounter()
        self.stopped = False

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return make_prompt_cache(self.model)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        if kwargs:
            raise ShardedKitError(f"a sharded kit's model takes token ids only, not {sorted(kwargs)}")
        if self.stopped:
            raise ShardedKitError("the followers of this sharded kit were released (unloaded); load it again")
        self._flush_drops()
        if inputs.ndim == 1:
            inputs = inputs[None]
        batch, length = inputs.shape
        cache_id, offset, rot_size, rot_keep = self._describe(cache)
        ids = inputs.reshape(-1).astype(mx.int32)
        fields = [OP_FORWARD, cache_id, offset, batch, length, rot_size, rot_keep]
        received = self._announce(fields, ids)
        # Queued before the pass is built: a pipeline stage's recv does not depend
        # on the ids, and MLX could otherwise order it before the announcement.
        mx.async_eval(received)
        logits = self.model(received.reshape(batch, length).astype(mx.uint32), cache=cache)
        mx.async_eval(logits)  # the whole pass runs on every rank, whatever the caller evaluates
        self.counter.passes += 1
        self.counter.tokens += batch * length
        return logits

    def stop_followers(self) -> None:
        """Release the followers: their ``serve`` returns."""
        if not self.stopped:
            mx.eval(self._send_header([OP_STOP, 0, 0, 0, 0, 0, 0], None))
            self.stopped = True

    # -- messages ----------------------------------------------------------
    def _send_header(self, fields: list[int], inline: mx.array | None) -> mx.array:
        self._seq += 1
        parts = [mx.array(fields + [self._seq], dtype=mx.int32)]
        n = 0 if inline is None else inline.size
        if n:
            parts.append(inline)
        parts.append(mx.zeros((INLINE - n,), dtype=mx.int32))
        return mx.distributed.all_sum(mx.concatenate(parts), group=self._group)

    def _announce(self, fields: list[int], ids: mx.array) -> mx.array:
        """Send the header (and the ids); returns the ids as every rank received them."""
        if ids.size <= INLINE:
            header = self._send_header(fields, ids)
            return header[FIELDS : FIELDS + ids.size]
        header = self._send_header(fields, None)
        # The payload depends on the header, so the two collectives run in this order.
        return mx.distributed.all_sum(ids + 0 * header[0], group=self._group)

    def _flush_drops(self) -> None:
        while True:
            with self._lock:
                batch = [self._dropped.popleft() for _ in range(min(INLINE, len(self._dropped)))]
            if not batch:
                return
            mx.async_eval(self._send_header([OP_DROP, 0, 0, 0, 0, 0, 0], mx.array(batch, dtype=mx.int32)))

    def _describe(self, cache) -> tuple[int, int, int, int]:
        """(id, length, rotating size, rotating keep) of a cache layer list; a list
        seen for the first time gets an id, freed when its layers are."""
        if not cache:
            return 0, 0, 0, 0
        first = cache[0]
        known = self._mirrors.get(first)
        if known is None:
            # Kept beside mlx-lm's layer objects, not written onto them.
            known = self._mirrors[first] = (self._next_id, _rotating_replacement(self.model, cache))
            self._next_id += 1
            weakref.finalize(first, self._note_dropped, known[0])
        cache_id, (rot_size, rot_keep) = known
        return cache_id, int(first.offset), rot_size, rot_keep

    def _note_dropped(self, cache_id: int) -> None:
        with self._lock:
            self._dropped.append(cache_id)


def _rotating_replacement(model: nn.Module, cache: list) -> tuple[int, int]:
    """Whether ``cache`` replaced the model's plain KV layers with rotating ones
    (``max_kv_size``), and their size and keep: what a follower needs to build
    the same cache. Other layer types than mlx-lm's defaults are refused."""
    default = make_prompt_cache(model)
    if len(default) != len(cache):
        raise ShardedKitError(f"a cache of {len(cache)} layers was passed to a model shard of {len(default)} layers")
    for made, used in zip(default, cache):
        if type(made) is type(used):
            continue
        if type(made) is KVCache and type(used) is RotatingKVCache:
            return int(used.max_size), int(used.keep)
        raise ShardedKitError(f"a sharded kit cannot mirror a {type(used).__name__} cache layer")
    return 0, 0


def _build_cache(model: nn.Module, rot_size: int, rot_keep: int) -> list:
    layers = make_prompt_cache(model)
    if rot_size:
        layers = [RotatingKVCache(max_size=rot_size, keep=rot_keep) if type(c) is KVCache else c for c in layers]
    return layers


@dataclass(frozen=True)
class FollowerExit:
    """How a follower's ``serve`` ended: ``reason`` is ``"stopped"`` (rank 0
    released it) or ``"failed"``, with ``detail`` saying why; ``passes`` mirrored,
    and ``caches``: cache copies still held (those rank 0 had not freed)."""

    reason: str
    passes: int
    detail: str = ""
    caches: int = 0


class FollowerLoop:
    """A follower's side of the protocol: mirror every pass rank 0 announces."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group):
        self.model = model
        self.group = group
        self.caches: dict[int, list] = {}
        self.seq = 0
        self.passes = 0
        self.stopped = False  # rank 0 released this follower

    def run(self) -> FollowerExit:
        while True:
            header = mx.distributed.all_sum(mx.zeros((HEADER,), dtype=mx.int32), group=self.group)
            values = header.tolist()
            op, cache_id, offset, batch, length, rot_size, rot_keep, seq = values[:FIELDS]
            self.seq += 1
            if seq != self.seq:
                raise ShardedKitError(f"follower out of step: message {seq} arrived, {self.seq} expected")
            if op == OP_STOP:
                self.stopped = True
                return FollowerExit("stopped", self.passes, caches=len(self.caches))
            if op == OP_DROP:
                for dropped in values[FIELDS:]:
                    self.caches.pop(dropped, None)
                continue
            if op != OP_FORWARD:
                raise ShardedKitError(f"follower received an unknown message (op {op})")
            n = batch * length
            if n <= INLINE:
                ids = header[FIELDS : FIELDS + n]
            else:
                ids = mx.distributed.all_sum(mx.zeros((n,), dtype=mx.int32), group=self.group)
            cache = self._cache(cache_id, offset, rot_size, rot_keep)
            mx.eval(self.model(ids.reshape(batch, length).astype(mx.uint32), cache=cache))
            self.passes += 1

    def _cache(self, cache_id: int, offset: int, rot_size: int, rot_keep: int) -> list | None:
        """The follower's copy of cache ``cache_id``, trimmed to ``offset`` tokens."""
        if cache_id == 0:
            return None
        layers = self.caches.get(cache_id)
        if layers is None:
            layers = self.caches[cache_id] = _build_cache(self.model, rot_size, rot_keep)
        held = int(layers[0].offset)
        if held < offset:
            raise ShardedKitError(f"follower out of step: cache {cache_id} holds {held} tokens, rank 0's {offset}")
        if held > offset:
            if not all(c.is_trimmable() for c in layers):
                raise ShardedKitError(f"follower cannot trim cache {cache_id} from {held} to {offset} tokens")
            for c in layers:
                c.trim(held - offset)
        return layers
