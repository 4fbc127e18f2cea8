"""Sampling parameters: validation and the mlx-lm sampler / logits processors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

MAX_TOP_LOGPROBS = 20

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
    ok_types = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


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
) -> SamplingParams:
    """Check every sampling argument and return them normalised."""
    if temp is not None and _number("temp", temp) < 0:
        raise ValueError(f"temp must be >= 0 (0 or None is greedy), got {temp}")
    if top_p is not None and not (0 < _number("top_p", top_p) <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and _number("top_k", top_k, integer=True) < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if min_p is not None and not (0 <= _number("min_p", min_p) <= 1):
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if min_tokens_to_keep is not None and _number("min_tokens_to_keep", min_tokens_to_keep, integer=True) < 1:
        raise ValueError(f"min_tokens_to_keep must be >= 1, got {min_tokens_to_keep}")
    if repetition_penalty is not None and _number("repetition_penalty", repetition_penalty) <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if _number("repetition_context_size", repetition_context_size, integer=True) < 1:
        raise ValueError(f"repetition_context_size must be >= 1, got {repetition_context_size}")
    if seed is not None and _number("seed", seed, integer=True) < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    if top_logprobs is not None and not (
        0 <= _number("top_logprobs", top_logprobs, integer=True) <= MAX_TOP_LOGPROBS
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
