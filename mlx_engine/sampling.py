"""Sampling parameters: validation and the mlx-lm sampler / logits processors."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1  # MLX seeds with an unsigned 64-bit integer

Sampler = Callable[[mx.array], mx.array]
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

    @property
    def greedy(self) -> bool:
        return self.temp == 0.0


def _number(name: str, value, *, integer: bool = False):
    """``value`` as a Python int or float; ``ValueError`` naming ``name`` unless it
    is a (finite) real number. numpy scalars are accepted; bools are not."""
    ok_types = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, ok_types):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if integer:
        return int(value)
    value = float(value) if not isinstance(value, numbers.Integral) else int(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def validate_seed(seed, name: str = "seed") -> int | None:
    """A seed MLX accepts: None or an integer in [0, 2**64 - 1]."""
    if seed is None:
        return None
    seed = _number(name, seed, integer=True)
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be an integer from 0 to 2**64 - 1, got {seed}")
    return seed


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
) -> SamplingParams:
    """Check every sampling argument and return them normalised (NaN and
    infinities are refused for every float). ``vocab_size`` bounds ``top_k``."""
    if temp is not None and (temp := _number("temp", temp)) < 0:
        raise ValueError(f"temp must be >= 0 (0 or None is greedy), got {temp}")
    if top_p is not None and not (0 < (top_p := _number("top_p", top_p)) <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and not (0 <= (top_k := _number("top_k", top_k, integer=True)) < vocab_size):
        raise ValueError(f"top_k must be from 0 (off) to {vocab_size - 1} (below the vocabulary size), got {top_k}")
    if min_p is not None and not (0 <= (min_p := _number("min_p", min_p)) <= 1):
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if min_tokens_to_keep is not None and (min_tokens_to_keep := _number("min_tokens_to_keep", min_tokens_to_keep, integer=True)) < 1:
        raise ValueError(f"min_tokens_to_keep must be >= 1, got {min_tokens_to_keep}")
    if repetition_penalty is not None and (repetition_penalty := _number("repetition_penalty", repetition_penalty)) <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if (repetition_context_size := _number("repetition_context_size", repetition_context_size, integer=True)) < 1:
        raise ValueError(f"repetition_context_size must be >= 1, got {repetition_context_size}")
    seed = validate_seed(seed)
    if top_logprobs is not None and not (
        0 <= (top_logprobs := _number("top_logprobs", top_logprobs, integer=True)) <= MAX_TOP_LOGPROBS
    ):
        raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}")
    return SamplingParams(
        temp=float(temp or 0.0),
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        min_tokens_to_keep=min_tokens_to_keep,
        repetition_penalty=repetition_penalty,
        repetition_context_size=repetition_context_size,
        seed=seed,
        top_logprobs=top_logprobs or None,
    )


def build_sampler(params: SamplingParams) -> Sampler:
    """A sampler over log-probabilities of shape (..., vocab); works on a batch of
    positions at once, which the verify step relies on."""
    return make_sampler(
        temp=params.temp,
        top_p=params.top_p or 0.0,
        min_p=params.min_p or 0.0,
        min_tokens_to_keep=params.min_tokens_to_keep or 1,
        top_k=params.top_k or 0,
    )


def build_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    if params.repetition_penalty is None or params.repetition_penalty == 1.0:
        return []
    return make_logits_processors(
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
    )
