"""Sampling parameters: validation, the position-keyed sampler and mlx-lm's logits processors.

The sampler is *position-keyed*: the randomness that picks the token at sequence
position i comes from a key derived from the request's seed and i alone, never
from a shared random stream. Sample-and-match in the verify loop therefore draws
exactly the token plain decoding would draw at every position, whatever was drafted
and however the rounds were cut (docs/decoding.md#seeds).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

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


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens_to_keep: int | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    seed: int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, added logit) pairs

    @property
    def greedy(self) -> bool:
        return self.temp == 0.0


def _invalid(name: str, part: str, template: str, **values: object) -> InvalidArgument:
    """``template`` about the argument ``name``, or ``part`` of it (``logit_bias``'s
    `` key``, ``[5]``), said right after the argument."""
    return InvalidArgument("{param}{part}" + template, name, part=part, **values)


def _number(name: str, value, *, integer: bool = False, part: str = ""):
    """``value`` as a Python int or float; ``ValueError`` naming ``name`` (and
    ``part``) unless it is a (finite) real number. numpy scalars are accepted; bools are not."""
    ok_types = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, ok_types):
        kind = "an integer" if integer else "a number"
        raise _invalid(name, part, " must be {kind}, got {got}", kind=kind, got=repr(value))
    if integer:
        return int(value)
    value = float(value) if not isinstance(value, numbers.Integral) else int(value)
    if not math.isfinite(value):
        raise _invalid(name, part, " must be a finite number, got {got}", got=repr(value))
    return value


def validate_seed(seed, name: str = "seed") -> int | None:
    """A seed MLX accepts: None or an integer in [0, 2**64 - 1]."""
    if seed is None:
        return None
    seed = _number(name, seed, integer=True)
    if not 0 <= seed <= MAX_SEED:
        raise _invalid(name, "", " must be an integer from 0 to 2**64 - 1, got {got}", got=seed)
    return seed


def _optional_number(name: str, value) -> float | None:
    """A finite number, or None for None and 0 (off)."""
    return None if value is None else (_number(name, value) or None)


def _checked(name: str, value, ok: Callable[[float], bool], allowed: str, integer: bool = False):
    """``value`` as a finite number (None stays None); ``ValueError`` saying
    "``name`` must be ``allowed``" unless ``ok`` holds for it."""
    if value is None:
        return None
    if not ok(number := _number(name, value, integer=integer)):
        raise _invalid(name, "", " must be {allowed}, got {got}", allowed=allowed, got=number)
    return number


def _count(name: str, value, lo: int, hi: int, allowed: str) -> int | None:
    """``value`` as an integer in [lo, hi] (None stays None), else ``ValueError``."""
    return _checked(name, value, lambda x: lo <= x <= hi, allowed, integer=True)


def validate_sampling(
    *,
    temp: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    min_tokens_to_keep: int | None,
    repetition_penalty: float | None,
    repetition_context_size: int,
    seed: int | None,
    top_logprobs: int | None,
    vocab_size: int,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: dict | None = None,
) -> SamplingParams:
    """Check every sampling argument and return them normalised (NaN and
    infinities are refused for every float). ``vocab_size`` bounds ``top_k`` and
    ``min_tokens_to_keep``."""
    temp = _checked("temp", temp, lambda x: x >= 0, ">= 0 (0 or None is greedy)")
    top_p = _checked("top_p", top_p, lambda x: 0 < x <= 1, "in (0, 1]")
    top_k = _count("top_k", top_k, 0, vocab_size - 1, f"from 0 (off) to {vocab_size - 1} (below the vocabulary size)")
    min_p = _checked("min_p", min_p, lambda x: 0 <= x <= 1, "in [0, 1]")
    min_tokens_to_keep = _count(
        "min_tokens_to_keep", min_tokens_to_keep, 1, vocab_size, f"from 1 to {vocab_size} (the vocabulary size)"
    )
    repetition_penalty = _checked("repetition_penalty", repetition_penalty, lambda x: x > 0, "> 0")
    context = _number("repetition_context_size", repetition_context_size, integer=True)  # required
    context = _count("repetition_context_size", context, 1, MAX_REPETITION_CONTEXT, "from 1 to 2**31 - 1 (tokens)")
    seed = validate_seed(seed)
    top_logprobs = _count("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS, f"between 0 and {MAX_TOP_LOGPROBS}")
    return SamplingParams(
        temp=float(temp or 0.0),
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        min_tokens_to_keep=min_tokens_to_keep,
        repetition_penalty=repetition_penalty,
        repetition_context_size=context,
        seed=seed,
        top_logprobs=top_logprobs or None,
        presence_penalty=_optional_number("presence_penalty", presence_penalty),
        frequency_penalty=_optional_number("frequency_penalty", frequency_penalty),
        logit_bias=validate_logit_bias(logit_bias, vocab_size),
    )


def validate_logit_bias(logit_bias, vocab_size: int) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias`` ({token id: value added to its logit}) as sorted pairs;
    ``ValueError`` naming the bad key or value."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, Mapping):
        raise InvalidArgument(
            "{param} must be a dict of token id -> number, got {kind}", "logit_bias", kind=type(logit_bias).__name__
        )
    pairs = []
    for key, value in logit_bias.items():
        tid = _number("logit_bias", key, integer=True, part=" key")
        if not 0 <= tid < vocab_size:
            raise InvalidArgument(
                "{param} key {tid} is outside the vocabulary [0, {vocab})", "logit_bias", tid=tid, vocab=vocab_size
            )
        pairs.append((tid, float(_number("logit_bias", value, part=f"[{tid}]"))))
    return tuple(sorted(pairs)) or None


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
