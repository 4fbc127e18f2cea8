"""A model's KV cache together with the exact tokens it holds.

Keeping the token list beside the cache makes prefix reuse, draft rewinds and
cancellation one mechanism: whatever happened, the cache is brought in step with
a token sequence by trimming to the longest common prefix and feeding the rest.

Recurrent layers (mlx-lm's ``ArraysCache``: a convolution window plus an SSM or
delta-rule state) cannot be trimmed, so the cache keeps their state at chosen
positions instead: a *rewind point* before each forward pass (the last few) and
*checkpoints* at the end of a prompt, of an answer and every
``CHECKPOINT_INTERVAL`` tokens of a prefill (at most ``MAX_CHECKPOINTS``).
Rewinding restores the latest state at or before the target, trims the
attention layers to the same position, and reports where it landed; the caller
feeds the rest. A state is a tuple of references to MLX arrays, which the
models replace and never write into, so keeping one copies nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ..loading.memory import PREFILL_CHUNK

logger = logging.getLogger(__name__)

#: Recorded for a token fed to the model before its id is known (a lazily
#: computed draft or sampled token). It matches no real id, so a cache left
#: holding one (a round abandoned mid-flight) is trimmed there at the next sync.
UNKNOWN = -1
#: Recurrent-state checkpoints kept per sequence (the oldest is dropped past it).
MAX_CHECKPOINTS = 8
#: A long prefill leaves a checkpoint every this many tokens.
CHECKPOINT_INTERVAL = 2048
#: How far back ``checkpoint`` looks for ids not read yet.
MAX_UNKNOWN_TAIL = 64
#: Rewind points (the state before each of the last passes) a cache keeps by default.
DEFAULT_REWIND_POINTS = 2

#: A recurrent-state snapshot: per recurrent layer, its arrays (conv window, state).
State = tuple[tuple, ...]


def flat_layers(layers: list) -> list:
    """The cache layers with mlx-lm's ``CacheList`` (several caches of one
    block, e.g. Falcon-H1's Mamba and attention) opened up."""
    out = []
    for c in layers:
        out.extend(flat_layers(list(c.caches)) if isinstance(c, CacheList) else [c])
    return out


def layer_rewind_reason(layer) -> str | None:
    """Why this cache layer could not be brought back to an earlier position,
    or None: attention layers are trimmed, recurrent (``ArraysCache``) layers
    restored from a kept state; any other kind that cannot trim itself is not
    supported."""
    if isinstance(layer, CacheList):
        return next((r for c in layer.caches if (r := layer_rewind_reason(c))), None)
    if isinstance(layer, (KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache)) or layer.is_trimmable():
        return None
    return f"{type(layer).__name__} layers cannot be rewound"


def _is_recurrent(layer) -> bool:
    return isinstance(layer, ArraysCache)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class CacheOptions:
    """How a kit builds its KV caches: ``load_model``'s cache arguments, checked
    once (``validate``) and shared by the kit, its draft model and every cache."""

    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    auto_context: bool = False  # max_kv_size="auto": the context is fitted to memory (loading/memory.py)

    @classmethod
    def validate(cls, max_kv_size=None, kv_bits=None, kv_group_size=None, quantized_kv_start=None) -> CacheOptions:
        """``ValueError`` naming the argument for anything not allowed."""
        if max_kv_size == "auto":
            return replace(cls.validate(None, kv_bits, kv_group_size, quantized_kv_start), auto_context=True)
        if max_kv_size is not None and (not _is_int(max_kv_size) or max_kv_size < 8):
            raise ValueError(f"max_kv_size must be an integer >= 8, 'auto' or None, got {max_kv_size!r}")
        if kv_bits is not None and kv_bits not in (2, 3, 4, 6, 8):
            raise ValueError(f"kv_bits must be one of 2, 3, 4, 6, 8 or None, got {kv_bits!r}")
        if kv_group_size is not None and kv_group_size not in (32, 64, 128):
            raise ValueError(f"kv_group_size must be 32, 64 or 128, got {kv_group_size!r}")
        if quantized_kv_start is not None and (not _is_int(quantized_kv_start) or quantized_kv_start < 0):
            raise ValueError(f"quantized_kv_start must be a non-negative integer, got {quantized_kv_start!r}")
        if kv_bits is not None and max_kv_size is not None:
            raise ValueError("kv_bits cannot be combined with max_kv_size: mlx-lm cannot quantize a rotating KV cache")
        return cls(max_kv_size, kv_bits, kv_group_size or 64, quantized_kv_start or 0)


class KVLayout(NamedTuple):
    """What one plain KV layer holds for a model: keys of shape
    (1, heads, tokens, key_dim) and values (1, heads, tokens, value_dim), in ``dtype``."""

    heads: int
    key_dim: int
    value_dim: int
    dtype: mx.Dtype


class StateLayout(NamedTuple):
    """What one recurrent layer holds for a model: its arrays' shapes and
    dtypes (the same at any length)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[mx.Dtype, ...]


class SequenceCache:
    """KV cache layers of one model plus the tokens whose keys/values they hold."""

    def __init__(self, model: nn.Module, options: CacheOptions = CacheOptions()):
        self.model = model
        self.options = options
        self.max_kv_size = options.max_kv_size
        self.layers: list = []
        self.tokens: list[int] = []
        self.rewind_points = DEFAULT_REWIND_POINTS
        self.points: list[tuple[int, State]] = []  # rewind points, by position
        self.checkpoints: list[tuple[int, State]] = []  # durable checkpoints, by position
        self.position_shift = 0  # see shift_positions
        self.reset()

    def reset(self) -> None:
        layers = make_prompt_cache(self.model, max_kv_size=self.max_kv_size)
        if self.max_kv_size is not None:
            # Models with their own make_cache ignore max_kv_size; bound their
            # full-attention layers here (sliding-window and recurrent layers
            # are already bounded).
            layers = [RotatingKVCache(max_size=self.max_kv_size, keep=4) if type(c) is KVCache else c for c in layers]
        self.layers = layers
        self.tokens = []
        self.points = []
        self.checkpoints = []
        self.position_shift = 0

    def shift_positions(self, shift: int) -> None:
        """From now on this sequence's model positions run ``shift`` ahead of its
        cache offset (M-RoPE: an image takes fewer positions than tokens). The
        shift is passed to the model as ``position_shift`` on every pass."""
        self.position_shift = shift

    def __len__(self) -> int:
        return len(self.tokens)

    def kv_layout(self) -> list[KVLayout | StateLayout | None]:
        """Per layer (``CacheList`` opened up, as ``flat_layers``), the layout of
        its keys and values for this model, or of its recurrent state (None for
        other kinds of layer), from one token run through a fresh cache without
        evaluating it: shapes and dtypes only, nothing is computed."""
        layers = make_prompt_cache(self.model)
        self.model(mx.array([[0]], dtype=mx.uint32), cache=layers)
        out: list[KVLayout | StateLayout | None] = []
        for c in flat_layers(layers):
            if type(c) is KVCache and c.keys is not None:
                out.append(KVLayout(c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype))
            elif _is_recurrent(c) and all(a is not None for a in c.cache):
                out.append(StateLayout(tuple(tuple(a.shape) for a in c.cache), tuple(a.dtype for a in c.cache)))
            else:
                out.append(None)
        return out

    @property
    def recurrent(self) -> list:
        """The recurrent layers (whose state is restored, not trimmed)."""
        return [c for c in flat_layers(self.layers) if _is_recurrent(c)]

    def rewind_limit_reason(self, extra: int = 0) -> str | None:
        """Why the cache could not be rewound after feeding ``extra`` more tokens,
        or None if it can. Rewinding is what speculation and prefix reuse need."""
        for c in flat_layers(self.layers):
            if isinstance(c, RotatingKVCache):
                if c.offset + extra >= c.max_size:
                    return (
                        f"a rotating KV cache (window of {c.max_size} tokens: max_kv_size or the model's "
                        "sliding window) is full and cannot be rewound"
                    )
            elif reason := layer_rewind_reason(c):
                return reason
            elif _is_recurrent(c) and not self.rewind_points:
                return f"{type(c).__name__} layers (recurrent state) keep no earlier state on this kit"
        return None

    def keep_rewind_points(self, n: int) -> None:
        """Keep the recurrent state before each of the last ``n`` forward passes
        (a draft model's cache keeps one per chained draft step); 0 keeps no
        state at all, so recurrent layers cannot be rewound (a sharded kit,
        whose followers can only trim)."""
        self.rewind_points = max(0, n)
        if not n:
            self.points, self.checkpoints = [], []

    def add_point(self, state: State) -> None:
        """Keep ``state`` (the recurrent state at the current length, before a
        pass; a batch gives its row's) as a rewind point, keeping the last few."""
        if not self.rewind_points:
            return
        n = len(self.tokens)
        keep = [(p, s) for p, s in self.points if p < n]
        self.points = (keep[-(self.rewind_points - 1) :] if self.rewind_points > 1 else []) + [(n, state)]

    def snapshot(self) -> State:
        """The recurrent layers' current state (references, nothing is copied)."""
        return tuple(tuple(c.cache) for c in self.recurrent)

    def restore(self, state: State) -> None:
        for c, arrays in zip(self.recurrent, state):
            c.cache = list(arrays)

    def checkpoint(self) -> None:
        """Keep the recurrent state at the current length, for a later request
        branching here (the end of a prompt or an answer). A no-op without
        recurrent layers. A round abandoned mid-flight (ids not read yet at the
        end) is rewound first, so the checkpoint holds known tokens only."""
        if not self.recurrent or not self.rewind_points:
            return
        known = len(self.tokens)
        while known and self.tokens[known - 1] == UNKNOWN:
            known -= 1
        n = self.rewind_to(known)
        if not n or UNKNOWN in self.tokens[-MAX_UNKNOWN_TAIL:]:
            return
        self.checkpoints = [(p, s) for p, s in self.checkpoints if p != n] + [(n, self.snapshot())]
        self.checkpoints.sort(key=lambda ps: ps[0])
        if len(self.checkpoints) > MAX_CHECKPOINTS:
            del self.checkpoints[0]

    def adopt_checkpoints(self, checkpoints: list[tuple[int, State]]) -> None:
        """Keep these (position, state) checkpoints (read back from the disk
        tier), the latest ``MAX_CHECKPOINTS``."""
        if self.recurrent and self.rewind_points:
            self.checkpoints = sorted(checkpoints, key=lambda ps: ps[0])[-MAX_CHECKPOINTS:]

    def restorable(self, length: int) -> int:
        """The longest length not above ``length`` this cache can rewind to."""
        if length >= len(self.tokens):
            return len(self.tokens)
        if not self.recurrent:
            return length if self.rewind_limit_reason() is None else 0
        return max((p for p, _ in self.points + self.checkpoints if p <= length), default=0)

    def resume_points(self) -> list[int]:
        """Where a later request can resume this sequence exactly: its
        checkpoints and its end (any position, for attention-only caches)."""
        return [p for p, _ in self.checkpoints] + [len(self.tokens)]

    def state_at(self, length: int) -> State | None:
        """The kept recurrent state at exactly ``length`` (None if none is kept)."""
        return next((s for p, s in reversed(self.points + self.checkpoints) if p == length), None)

    def rewind_to(self, length: int) -> int:
        """Drop cached tokens beyond ``length``; returns the length the cache now
        holds: ``length`` itself for attention layers, the latest kept state at
        or before it for recurrent ones (0, a fresh cache, when there is none).
        The caller feeds the tokens between."""
        if length >= len(self.tokens):
            return len(self.tokens)
        target = self.restorable(length)
        state = self.state_at(target) if self.recurrent else ()
        if target == 0 or state is None:
            self.reset()
            return 0
        n = len(self.tokens) - target
        for c in flat_layers(self.layers):
            if not _is_recurrent(c):
                c.trim(n)
        self.restore(state)
        del self.tokens[target:]
        self.points = [(p, s) for p, s in self.points if p <= target]
        self.checkpoints = [(p, s) for p, s in self.checkpoints if p <= target]
        return target

    def sync_to(self, tokens: list[int]) -> int:
        """Rewind to the longest common prefix with ``tokens`` (or the latest
        kept state before it). Returns how many cached tokens are kept."""
        keep = common_prefix_length(self.tokens, tokens)
        kept = self.rewind_to(keep)
        if kept < keep:
            logger.info("cache rewound to %d of the %d tokens it shares; the rest is recomputed", kept, keep)
        return kept

    def state_bytes(self) -> int:
        """Bytes of recurrent state this cache holds: the current state, its
        rewind points and checkpoints (an array shared by several counts once)."""
        seen: dict[int, int] = {}
        for state in [self.snapshot()] + [s for _, s in self.points + self.checkpoints]:
            for arrays in state:
                for a in arrays:
                    if a is not None:
                        seen[id(a)] = a.nbytes
        return sum(seen.values())

    def feed(self, tokens: list[int]) -> mx.array:
        """Run the model on ``tokens`` after the cached ones; returns lazy logits
        of shape (len(tokens), vocab) and records the tokens as cached."""
        logits = self._forward(mx.array(tokens, dtype=mx.uint32)[None])
        self.tokens.extend(tokens)
        return logits[0]

    def feed_lazy(self, known: list[int], lazy: mx.array) -> tuple[mx.array, int]:
        """Like ``feed`` for ``known`` followed by the not-yet-evaluated ids ``lazy``,
        so the pass can be built before they are computed. The lazy ids are
        recorded as UNKNOWN from the returned position until ``resolve``."""
        inputs = lazy.reshape(-1).astype(mx.uint32)
        if known:
            inputs = mx.concatenate([mx.array(known, dtype=mx.uint32), inputs])
        logits = self._forward(inputs[None])
        self.tokens.extend(known)
        start = len(self.tokens)
        self.tokens.extend([UNKNOWN] * lazy.size)
        return logits[0], start

    def resolve(self, start: int, ids: list[int]) -> None:
        """Name the ids that ``feed_lazy`` recorded as UNKNOWN from ``start``
        (those still held: a cache reset meanwhile holds none of them)."""
        ids = ids[: max(0, len(self.tokens) - start)]
        self.tokens[start : start + len(ids)] = ids

    def _forward(self, inputs: mx.array, **model_inputs) -> mx.array:
        if self.recurrent:
            # The state before this pass: a rejected draft or a pass abandoned
            # mid-flight rewinds here (rewind_to), then feeds the accepted tokens.
            self.add_point(self.snapshot())
        if self.position_shift:
            model_inputs.setdefault("position_shift", self.position_shift)
        logits = self.model(inputs, cache=self.layers, **model_inputs)
        o = self.options
        if o.kv_bits is not None:
            maybe_quantize_kv_cache(self.layers, o.quantized_kv_start, o.kv_group_size, o.kv_bits)
        return logits

    def prefill(
        self,
        tokens: list[int],
        on_chunk: Callable[[int], None] | None = None,
        chunk_size: int = PREFILL_CHUNK,
        *,
        keys: list[int] | None = None,
        model_inputs: Callable[[int, int], dict] | None = None,
    ) -> None:
        """Process ``tokens`` in chunks, evaluating the cache after each so an
        interruption between chunks leaves a consistent, reusable cache.
        ``on_chunk(n)`` is called after each chunk of n tokens and may raise to stop.
        The one prefill path for text and vision kits: ``keys`` (default
        ``tokens``) are what the cache records (a vision kit records image-hash
        keys at image positions), and ``model_inputs(i, j)`` gives extra model
        inputs for ``tokens[i:j]`` (a vision kit's embeddings and positions)."""
        keys = tokens if keys is None else keys
        for start in range(0, len(tokens), chunk_size):
            end = min(start + chunk_size, len(tokens))
            extra = model_inputs(start, end) if model_inputs is not None else {}
            self._forward(mx.array(tokens[start:end], dtype=mx.uint32)[None], **extra)
            self.tokens.extend(keys[start:end])
            mx.eval([c.state for c in self.layers])
            if len(self.tokens) // CHECKPOINT_INTERVAL > (len(self.tokens) - (end - start)) // CHECKPOINT_INTERVAL:
                self.checkpoint()
            if on_chunk is not None:
                on_chunk(end - start)
