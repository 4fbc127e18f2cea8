"""A model's KV cache together with the exact tokens it holds.

Keeping the token list beside the cache makes prefix reuse, draft rewinds and
cancellation one mechanism: whatever happened, the cache is brought in step with
a token sequence by trimming to the longest common prefix and feeding the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from ..loading.memory import PREFILL_CHUNK

logger = logging.getLogger(__name__)

#: Recorded for a token fed to the model before its id is known (a lazily
#: computed draft or sampled token). It matches no real id, so a cache left
#: holding one (a round abandoned mid-flight) is trimmed there at the next sync.
UNKNOWN = -1


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
    auto_context: bool = False  # max_kv_size="auto": the context is fitted to memory (context.py)

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


class SequenceCache:
    """KV cache layers of one model plus the tokens whose keys/values they hold."""

    def __init__(self, model: nn.Module, options: CacheOptions = CacheOptions()):
        self.model = model
        self.options = options
        self.max_kv_size = options.max_kv_size
        self.layers: list = []
        self.tokens: list[int] = []
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

    def __len__(self) -> int:
        return len(self.tokens)

    def kv_layout(self) -> list[KVLayout | None]:
        """Per layer, the layout of its keys and values for this model (None for
        layers that are not plain KV caches), from one token run through a
        fresh cache without evaluating it: shapes and dtypes only, nothing is
        computed."""
        layers = make_prompt_cache(self.model)
        self.model(mx.array([[0]], dtype=mx.uint32), cache=layers)
        return [
            KVLayout(c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype)
            if type(c) is KVCache and c.keys is not None
            else None
            for c in layers
        ]

    def rewind_limit_reason(self, extra: int = 0) -> str | None:
        """Why the cache could not be rewound after feeding ``extra`` more tokens,
        or None if it can. Rewinding is what speculation and prefix reuse need."""
        for c in self.layers:
            if isinstance(c, (KVCache, QuantizedKVCache)):
                continue
            if isinstance(c, RotatingKVCache):
                if c.offset + extra >= c.max_size:
                    return (
                        f"a rotating KV cache (window of {c.max_size} tokens: max_kv_size or the model's "
                        "sliding window) is full and cannot be rewound"
                    )
                continue
            if not c.is_trimmable():
                return f"{type(c).__name__} layers (e.g. recurrent state) cannot be rewound"
        return None

    def rewind_to(self, length: int) -> bool:
        """Drop cached tokens beyond ``length``. Returns False (cache untouched) when
        the cache cannot be trimmed."""
        n = len(self.tokens) - length
        if n <= 0:
            return True
        if any(not c.is_trimmable() for c in self.layers):
            return False
        for c in self.layers:
            c.trim(n)
        del self.tokens[length:]
        return True

    def sync_to(self, tokens: list[int]) -> int:
        """Rewind to the longest common prefix with ``tokens`` (resetting when the
        cache cannot be trimmed). Returns how many cached tokens are kept."""
        keep = common_prefix_length(self.tokens, tokens)
        if not self.rewind_to(keep):
            logger.info("cache cannot be trimmed to %d tokens; recomputing from scratch", keep)
            self.reset()
            keep = 0
        return keep

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
            if on_chunk is not None:
                on_chunk(end - start)
