"""Several sequences' KV caches in one batch, each row with its own length.

Rows are right-ragged: row ``b`` holds its cached positions at ``[0, n_b)`` of
a shared buffer, where ``n_b`` is the length of that row's ``SequenceCache``
token list. A forward pass writes each row's inputs from its own ``n_b`` on,
gives every row its own RoPE offset and masks, per row, what that row must not
see. Rewinding a row after speculation is therefore just shortening its token
list: positions past it are masked now and overwritten later.

mlx-lm's ``BatchKVCache`` does not fit speculation: it left-pads rows and
advances them with one shared write index, so rows that accept different
numbers of drafts could only be realigned by rolling the whole buffer every
round. Rows join (after their prompt is prefilled in their own cache) and leave
(their keys and values handed back to their cache, for the prompt cache) between
steps; the first row to join and the last to leave hand their arrays over
without a copy, so a lone request costs what it did without batching.

Hybrid models' recurrent layers (``ArraysCache``) join too, for the families
whose layers honour mlx-lm's per-row ``lengths`` (``BATCHED_RECURRENT``): each
pass sets every row's number of real inputs, so a row's padding (and a row
riding along with none) never enters its convolution window or its SSM or
delta-rule state. Before each pass a row's state is kept as its rewind point
(a lazy slice of the batch's arrays: nothing is copied unless it is used); a
row rewound by its request (``SequenceCache.rewind_to`` restores the state
into the row's own, otherwise empty, layers) is written back into its row of
the batch before the next pass.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

from .sequence import UNKNOWN, SequenceCache, flat_layers

STEP = 256  # buffer growth, in positions (as mlx-lm's KVCache)

#: Hybrid families (mlx-lm module names) whose recurrent layers keep padded
#: rows' state exact given per-row ``lengths``: checked row by row against each
#: row alone in tests/test_hybrid.py. Not nemotron_h (its Mamba layer does not
#: pass ``lengths`` to ``ssm_update``, so right padding enters the state) nor
#: jamba (its Mamba-1 layer ignores the mask): their rows run alone.
#: qwen3_5_moe is qwen3_5's model with MoE feed-forwards (tests/test_gguf_qwen35.py).
BATCHED_RECURRENT = frozenset(
    {"qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "mamba2", "granitemoehybrid", "falcon_h1"}
)


def can_batch(cache: SequenceCache) -> bool:
    """Whether ``cache``'s layers can join a batch: plain, unquantized KV
    layers, and recurrent ones of the families in ``BATCHED_RECURRENT``."""
    o = cache.options
    layers = flat_layers(cache.layers)
    if not layers or o.kv_bits is not None:
        return False
    if cache.recurrent and type(cache.model).__module__.rsplit(".", 1)[-1] not in BATCHED_RECURRENT:
        return False
    return all(type(c) is KVCache or type(c) is ArraysCache for c in layers)


class _StateLayer(ArraysCache):
    """One recurrent layer's state for every row (row b at index b), with the
    rows' real input counts of the current pass as mlx-lm's ``lengths``."""


def _batch_layers(batch: RaggedBatch, template: list) -> list:
    """The batch's layers, shaped as a cache of this model (``template``)."""
    out = []
    for c in template:
        if isinstance(c, CacheList):
            out.append(CacheList(*_batch_layers(batch, list(c.caches))))
        elif isinstance(c, ArraysCache):
            out.append(_StateLayer(len(c.cache)))
        else:
            out.append(_Layer(batch))
    return out


class _Layer:
    """One attention layer's keys and values for every row, as the model sees it."""

    def __init__(self, batch: RaggedBatch):
        self.batch = batch
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def offset(self):
        return self.batch.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        starts, end, n = self.batch.starts, self.batch.end, keys.shape[2]
        self._reserve(end, keys, values)
        if len(starts) == 1:
            s = starts[0]
            self.keys[..., s : s + n, :] = keys
            self.values[..., s : s + n, :] = values
        else:
            for b, s in enumerate(starts):
                self.keys[b : b + 1, :, s : s + n, :] = keys[b : b + 1]
                self.values[b : b + 1, :, s : s + n, :] = values[b : b + 1]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _reserve(self, end: int, keys: mx.array, values: mx.array) -> None:
        if self.keys is not None and end <= self.keys.shape[2]:
            return
        have = 0 if self.keys is None else self.keys.shape[2]
        grow = (end - have + STEP - 1) // STEP * STEP
        b, h, _, dk = keys.shape
        new_k = mx.zeros((b, h, grow, dk), keys.dtype)
        new_v = mx.zeros((b, h, grow, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return self.batch.mask(n, return_array)


class RaggedBatch:
    """The rows decoding together on one model: one forward pass per step."""

    def __init__(self, model: nn.Module, template: list | int):
        """``template``: a cache of this model (its layers' kinds and nesting),
        or the number of its layers when they are all plain KV layers."""
        self.model = model
        self.layers = _batch_layers(
            self, [KVCache() for _ in range(template)] if isinstance(template, int) else template
        )
        self.flat = flat_layers(self.layers)
        self.states = [l for l in self.flat if isinstance(l, _StateLayer)]  # recurrent layers (a hybrid model's)
        self.rows: list[SequenceCache] = []
        self.starts: list[int] = []
        self.end = 0
        self.offset: int | mx.array = 0

    def __contains__(self, cache: SequenceCache) -> bool:
        return any(r is cache for r in self.rows)

    def join(self, cache: SequenceCache) -> None:
        """Move ``cache``'s keys, values and recurrent state into a new last
        row (its layers are left empty until ``leave``). All or nothing: every
        layer's stacked buffers are built before any is replaced, so a join
        that fails leaves the batch and ``cache`` as they were."""
        n = len(cache.tokens)
        pairs = list(zip(self.flat, flat_layers(cache.layers)))
        stacked = [
            _stack_state(layer, len(self.rows), own.cache)
            if isinstance(layer, _StateLayer)
            else _stack_row(layer, self.rows, own.keys, own.values, n)
            for layer, own in pairs
        ]
        for (layer, own), new in zip(pairs, stacked):
            if isinstance(layer, _StateLayer):
                layer.cache, own.cache = new, [None] * len(own.cache)
            else:
                (layer.keys, layer.values), own.state = new, (None, None, 0)
        self.rows.append(cache)

    def leave(self, cache: SequenceCache) -> None:
        """Hand row ``cache``'s keys, values and state back to its layers and drop the row."""
        self._write_restored()
        b = next(i for i, r in enumerate(self.rows) if r is cache)
        n = len(cache.tokens)
        alone = len(self.rows) == 1
        keep = mx.array([i for i in range(len(self.rows)) if i != b])
        for layer, own in zip(self.flat, flat_layers(cache.layers)):
            if isinstance(layer, _StateLayer):
                own.cache = [a if a is None or alone else mx.take(a, mx.array([b]), axis=0) for a in layer.cache]
                layer.cache = [None if a is None or alone else mx.take(a, keep, axis=0) for a in layer.cache]
                continue
            if layer.keys is None or n == 0:
                own.state = (None, None, 0)
            else:
                # ``take`` copies, so the row's arrays do not keep the batch's alive.
                k = layer.keys if alone else mx.take(layer.keys, mx.array([b]), axis=0)
                v = layer.values if alone else mx.take(layer.values, mx.array([b]), axis=0)
                own.state = (k, v, n)
            if alone:
                layer.keys = layer.values = None
            elif layer.keys is not None:
                layer.keys = mx.take(layer.keys, keep, axis=0)
                layer.values = mx.take(layer.values, keep, axis=0)
        del self.rows[b]
        mx.eval([_arrays_of(l) for l in flat_layers(cache.layers)] + [_arrays_of(l) for l in self.flat])

    def _write_restored(self) -> None:
        """Rows whose request restored a kept state into their own layers (a
        rewind) get it written into their row of the batch."""
        for b, row in enumerate(self.rows):
            for layer, own in zip(self.flat, flat_layers(row.layers)):
                if isinstance(layer, _StateLayer) and any(a is not None for a in own.cache):
                    layer.cache = [_put_row(a, b, r, len(self.rows)) for a, r in zip(layer.cache, own.cache)]
                    own.cache = [None] * len(own.cache)

    def _prepare_states(self, fed: list[SequenceCache], lengths: list[int], width: int) -> None:
        """Before a pass: each fed row keeps its state as a rewind point, and
        the recurrent layers learn every row's real input count."""
        states = self.states
        if not states:
            return
        self._write_restored()
        index = {id(c): b for b, c in enumerate(self.rows)}
        for cache in fed:
            b = index[id(cache)]
            cache.add_point(tuple(tuple(None if a is None else a[b : b + 1] for a in l.cache) for l in states))
        padded = any(n != width for n in lengths)
        for l in states:
            l.left_padding, l.lengths = None, mx.array(lengths) if padded else None

    def feed(self, inputs: list[tuple[SequenceCache, list[int], mx.array | None]]) -> list[tuple[mx.array, int]]:
        """One forward pass for the rows in ``inputs``: each row's ``known`` ids
        then its lazily computed ids (recorded as UNKNOWN until resolved, as in
        ``SequenceCache.feed_lazy``). Rows of the batch not in ``inputs`` ride
        along on one padding token written past their end (never read, later
        overwritten). Returns, per input, the lazy logits of its own length and
        the position of its first lazy id."""
        given = {id(c): (known, lazy) for c, known, lazy in inputs}
        if len(given) != len(inputs):
            raise RuntimeError("each row may appear once in a batched forward pass")
        if not all(any(r is c for r in self.rows) for c, _, _ in inputs):
            raise RuntimeError("a batched forward pass can only feed rows of the batch")
        lengths = [_length(*given.get(id(c), ([], None))) for c in self.rows]
        width = max(max(lengths), 1)
        rows = [_padded(*given.get(id(c), ([], None)), width) for c in self.rows]
        self.starts = [len(c.tokens) for c in self.rows]
        self.end = max(self.starts) + width
        self.offset = self.starts[0] if len(self.rows) == 1 else mx.array(self.starts)
        self._prepare_states([c for c, _, _ in inputs], lengths, width)
        shifts = [c.position_shift for c in self.rows]
        extra = {"position_shift": mx.array(shifts)[:, None]} if any(shifts) else {}
        logits = self.model(mx.stack(rows), cache=self.layers, **extra)
        for l in self.states:
            l.lengths = None
        index = {id(c): b for b, c in enumerate(self.rows)}
        out = []
        for cache, known, lazy in inputs:
            b = index[id(cache)]
            cache.tokens.extend(known)
            start = len(cache.tokens)
            if lazy is not None:
                cache.tokens.extend([UNKNOWN] * lazy.size)
            out.append((logits[b, : lengths[b]], start))
        return out

    def mask(self, n: int, return_array: bool = False):
        """Row b's query i sees keys up to its own position ``start_b + i``. A
        lone row takes mlx-lm's own masks (None or "causal"), so its pass is the
        same as without batching."""
        if len(self.starts) == 1 and not return_array:
            return None if n == 1 else "causal"
        starts = mx.array(self.starts)[:, None, None, None]
        query = mx.arange(n)[None, None, :, None]
        return mx.arange(self.end)[None, None, None, :] <= starts + query


def release_row(batch: RaggedBatch | None, cache: SequenceCache) -> None:
    """Take ``cache`` out of ``batch`` if it is one of its rows (its keys and
    values return to its layers)."""
    if batch is not None and cache in batch:
        batch.leave(cache)


def _length(known: list[int], lazy: mx.array | None) -> int:
    return len(known) + (0 if lazy is None else lazy.size)


def _padded(known: list[int], lazy: mx.array | None, width: int) -> mx.array:
    """A row's input ids padded to ``width`` (padding outputs are never read)."""
    parts = [mx.array(known, dtype=mx.uint32)] if known else []
    if lazy is not None:
        parts.append(lazy.reshape(-1).astype(mx.uint32))
    n = _length(known, lazy)
    if n < width:
        parts.append(mx.zeros((width - n,), mx.uint32))
    return mx.concatenate(parts) if len(parts) > 1 else parts[0]


def _stack_row(layer: _Layer, rows: list[SequenceCache], k: mx.array | None, v: mx.array | None, n: int):
    """The layer's buffers with a row holding ``k``/``v`` (its first ``n``
    positions) appended; the first row's arrays are adopted as they are.

    Buffers differ in width (a branched cache holds a slice of its source's
    buffer, then grows by a step), so the joining row keeps only its ``n``
    positions and whichever side is narrower is padded: positions past a row's
    length are never read."""
    if not rows:
        return k, v
    if layer.keys is None and k is None:
        return None, None
    ref_k = layer.keys if layer.keys is not None else k
    ref_v = layer.values if layer.values is not None else v
    have = 0 if layer.keys is None else layer.keys.shape[2]
    width = max(have, (n + STEP - 1) // STEP * STEP)
    keys = mx.concatenate([_fit(layer.keys, len(rows), ref_k, width), _fit(_head(k, n), 1, ref_k, width)], axis=0)
    values = mx.concatenate([_fit(layer.values, len(rows), ref_v, width), _fit(_head(v, n), 1, ref_v, width)], axis=0)
    return keys, values


def _head(a: mx.array | None, n: int) -> mx.array | None:
    """A row's first ``n`` positions (None when it holds none)."""
    return None if a is None or n == 0 else a[..., :n, :]


def _fit(a: mx.array | None, batch: int, like: mx.array, width: int) -> mx.array:
    """``a`` (``batch`` rows shaped as ``like``; zeros when None) padded to ``width`` positions."""
    if a is None:
        return mx.zeros((batch, like.shape[1], width, like.shape[3]), like.dtype)
    if a.shape[2] < width:
        pad = mx.zeros((a.shape[0], a.shape[1], width - a.shape[2], a.shape[3]), a.dtype)
        a = mx.concatenate([a, pad], axis=2)
    return a


def _arrays_of(layer) -> list:
    """A layer's arrays, to evaluate: keys and values, or recurrent state."""
    if isinstance(layer, ArraysCache):
        return [a for a in layer.cache if a is not None]
    return [a for a in (layer.keys, layer.values) if a is not None]


def _stack_state(layer: _StateLayer, rows: int, own: list) -> list:
    """The layer's state arrays with a row holding ``own`` appended; a row
    without a state yet (no tokens) holds zeros, which is what the model starts
    from; the first row's arrays are adopted as they are."""
    if not rows:
        return list(own)
    out = []
    for a, r in zip(layer.cache, own):
        if a is None and r is None:
            out.append(None)
            continue
        like = a if a is not None else r
        a = mx.zeros((rows,) + like.shape[1:], like.dtype) if a is None else a
        r = mx.zeros((1,) + like.shape[1:], like.dtype) if r is None else r
        out.append(mx.concatenate([a, r], axis=0))
    return out


def _put_row(a: mx.array | None, b: int, row: mx.array | None, rows: int) -> mx.array | None:
    """``a`` (``rows`` rows; None: all zeros) with row ``b`` replaced by
    ``row`` (a new array: kept states that are slices of the old one stay as
    they were)."""
    if row is None:
        return a
    if rows == 1:
        return row
    if a is None:
        a = mx.zeros((rows,) + row.shape[1:], row.dtype)
    return mx.concatenate([a[:b], row, a[b + 1 :]], axis=0)
