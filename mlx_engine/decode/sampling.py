"""Sampling parameters: validation, the position-keyed sampler and mlx-lm's logits processors.

The sampler is *position-keyed*: the randomness that picks the token at sequence
position i comes from a key derived from the request's seed and i alone, never
from a shared random stream. Sample-and-match in the verify loop therefore draws
exactly the token plain decoding would draw at every position, whatever was drafted
and however the rounds were cut (docs/decoding.md#seeds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from ..declare import checked, count, in_range, invalid, number, option
from ..errors import InvalidArgument

MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1  # MLX seeds with an unsigned 64-bit integer
# MLX slices the token history with 32-bit indices; any size at least the
# sequence length already penalises the whole sequence.
MAX_REPETITION_CONTEXT = 2**31 - 1

Sampler = Callable[[mx.array, Sequence[int]], mx.array]
"""``sampler(logprobs, positions)``: ``logprobs`` (n, vocab), ``positions`` the n
absolute sequence positions the rows are sampled for; returns (n,) token ids."""
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def validate_seed(seed, name: str = "seed") -> int | None:
    """A seed MLX accepts: None or an integer in [0, 2**64 - 1]."""
    if seed is None:
        return None
    seed = number(name, seed, integer=True)
    if not 0 <= seed <= MAX_SEED:
        raise invalid(name, " must be an integer from 0 to 2**64 - 1, got {got}", got=seed)
    return seed


def validate_logit_bias(logit_bias, vocab_size: int) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias`` ({token id: value added to its logit}) as sorted pairs;
    ``ValueError`` naming the bad key or value."""
    if logit_bias is None:
        return None
    if isinstance(logit_bias, tuple):  # already checked pairs
        logit_bias = dict(logit_bias)
    if not isinstance(logit_bias, Mapping):
        raise InvalidArgument(
            "{param} must be a dict of token id -> number, got {kind}", "logit_bias", kind=type(logit_bias).__name__
        )
    pairs = []
    for key, value in logit_bias.items():
        tid = number("logit_bias key", key, integer=True)
        if not 0 <= tid < vocab_size:
            raise InvalidArgument(
                "{param} key {key} is outside the vocabulary [0, {vocab})", "logit_bias", key=tid, vocab=vocab_size
            )
        pairs.append((tid, float(number(f"logit_bias[{tid}]", value))))
    return tuple(sorted(pairs)) or None


def _temp(name, value, **_) -> float:
    return float(in_range(name, value, lambda x: x >= 0, ">= 0 (0 or None is greedy)") or 0.0)


def _top_k(name, value, *, vocab_size: int, **_):
    return count(name, value, 0, vocab_size - 1, f"from 0 (off) to {vocab_size - 1} (below the vocabulary size)")


def _keep(name, value, *, vocab_size: int, **_):
    return count(name, value, 1, vocab_size, f"from 1 to {vocab_size} (the vocabulary size)")


def _context_size(name, value, **_) -> int:
    value = number(name, value, integer=True)  # required
    return count(name, value, 1, MAX_REPETITION_CONTEXT, "from 1 to 2**31 - 1 (tokens)")


def _penalty(name, value, **_) -> float | None:
    """A finite number, or None for None and 0 (off)."""
    return None if value is None else (number(name, value) or None)


def _bias(name, value, *, vocab_size: int, **_):
    return validate_logit_bias(value, vocab_size)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """The sampling options: ``create_generator``'s sampling group, declared once
    (docs/api.md, "Generating"). ``validated(vocab_size)`` checks and normalises
    them (NaN and infinities are refused for every float)."""

    temp: float | None = option(None, "temperature; 0 or None is greedy", _temp)
    top_p: float | None = option(
        None, "nucleus sampling, in (0, 1]", lambda n, v, **_: in_range(n, v, lambda x: 0 < x <= 1, "in (0, 1]")
    )
    top_k: int | None = option(None, "keep the k most likely tokens, 0 (off) to the vocabulary size - 1", _top_k)
    min_p: float | None = option(
        None, "min-p sampling, in [0, 1]", lambda n, v, **_: in_range(n, v, lambda x: 0 <= x <= 1, "in [0, 1]")
    )
    min_tokens_to_keep: int | None = option(None, "min-p keeps at least this many tokens", _keep)
    repetition_penalty: float | None = option(
        None,
        "> 0; over the last repetition_context_size tokens",
        lambda n, v, **_: in_range(n, v, lambda x: x > 0, "> 0"),
    )
    repetition_context_size: int = option(20, "tokens the penalties look back over, 1 to 2**31 - 1", _context_size)
    seed: int | None = option(
        None, "0 to 2**64 - 1: the same text in every decoding mode", lambda n, v, **_: validate_seed(v, n)
    )
    presence_penalty: float | None = option(None, "subtracted once from each recent token's logit", _penalty)
    frequency_penalty: float | None = option(None, "subtracted per occurrence of each recent token", _penalty)
    # Given as {token id: number}; validated, as sorted (token id, added logit) pairs.
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = option(
        None, "{token id: number} added to the logits", _bias
    )

    @property
    def greedy(self) -> bool:
        return not self.temp

    def validated(self, vocab_size: int) -> SamplingParams:
        """Every field checked (``ValueError`` naming the first bad one) and
        normalised; ``vocab_size`` bounds ``top_k`` and ``min_tokens_to_keep``."""
        return checked(self, vocab_size=vocab_size)


_MASK64 = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that spreads every
    input bit over the whole output."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def position_keys(seed: int, positions: Sequence[int]) -> mx.array:
    """MLX random keys, (n, 2) uint32, one per position. The key of position p is
    output p of a SplitMix64 stream started at ``mix(seed)`` (counter-based), so it
    depends on ``seed`` and ``p`` only; MLX's threefry then expands it to noise."""
    base = _mix64(seed & _MASK64)
    keys = []
    for p in positions:
        k = _mix64((base + (int(p) + 1) * _GOLDEN) & _MASK64)
        keys.append((k >> 32, k & 0xFFFFFFFF))  # mx.random.key's layout: high word first
    return mx.array(keys, dtype=mx.uint32).reshape(len(keys), 2)


def gumbel_noise(seed: int, positions: Sequence[int], vocab: int) -> mx.array:
    """Standard Gumbel noise, (n, vocab) float32: row i drawn from the key of
    ``positions[i]``, so a row is the same whether drawn alone or in a batch."""
    keys = position_keys(seed, positions)
    return mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))(keys)


def draw_seed() -> int:
    """A 64-bit seed from MLX's global random stream, for a request without one:
    ``mx.random.seed`` (or ``load_model(seed=)``) still makes a run reproducible."""
    parts = mx.random.randint(0, 1 << 16, (4,)).tolist()  # 16-bit draws are exact
    return parts[0] << 48 | parts[1] << 32 | parts[2] << 16 | parts[3]


Filter = Callable[[mx.array], mx.array]


def sampling_filters(params: SamplingParams) -> list[Filter]:
    """mlx-lm's filters, under the conditions and in the order ``make_sampler``
    applies them (top-p, min-p, top-k), so the set of tokens that can be sampled
    is mlx-lm's."""
    top_p, min_p, top_k = params.top_p or 0.0, params.min_p or 0.0, params.top_k or 0
    keep = params.min_tokens_to_keep or 1
    filters: list[Filter] = []
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p, keep))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    return filters


class PositionalSampler:
    """Samples row i of ``logprobs`` for sequence position ``positions[i]`` by
    Gumbel-max: ``argmax(filtered / temp + g)`` with ``g`` Gumbel noise keyed by
    (seed, position) is an exact sample of ``softmax(filtered / temp)``. The
    sampler carries its own seed; it never touches MLX's global random state."""

    def __init__(self, temp: float, filters: Sequence[Filter], seed: int):
        if temp <= 0:
            raise ValueError(f"temp must be > 0 for sampling, got {temp}")
        self.temp, self.filters, self.seed = temp, tuple(filters), seed

    def __call__(self, logprobs: mx.array, positions: Sequence[int]) -> mx.array:
        if logprobs.ndim != 2 or logprobs.shape[0] != len(positions):
            raise ValueError(f"logprobs {logprobs.shape} need one row per position ({len(positions)} positions)")
        for f in self.filters:
            logprobs = f(logprobs)
        noise = gumbel_noise(self.seed, positions, logprobs.shape[-1])
        return mx.argmax(logprobs.astype(mx.float32) * (1.0 / self.temp) + noise, axis=-1)


def greedy_sampler(logprobs: mx.array, positions: Sequence[int] = ()) -> mx.array:
    """Temperature 0: the most likely token at each row (positions are not needed)."""
    return mx.argmax(logprobs, axis=-1)


def build_sampler(params: SamplingParams, seed: int | None = None) -> Sampler:
    """The request's sampler over log-probabilities (n, vocab), one row per
    position. Greedy for ``temp`` 0; otherwise position-keyed by ``seed``, else
    ``params.seed``, else a seed drawn with ``draw_seed``."""
    if params.greedy:
        return greedy_sampler
    if seed is None:
        seed = params.seed if params.seed is not None else draw_seed()
    return PositionalSampler(params.temp, sampling_filters(params), seed)


def build_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """mlx-lm's processors for the request: logit bias, then the repetition,
    presence and frequency penalties, each over the last
    ``repetition_context_size`` tokens of the sequence (prompt included)."""
    repetition = params.repetition_penalty if params.repetition_penalty != 1.0 else None
    size = params.repetition_context_size
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) if params.logit_bias else None,
        repetition_penalty=repetition,
        repetition_context_size=size,
        presence_penalty=params.presence_penalty,
        presence_context_size=size,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=size,
    )
