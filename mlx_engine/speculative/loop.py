"""The verify / accept / rewind loop shared by all decoding modes.

Each round the drafter proposes up to k tokens; the main model scores the pending
token plus the k drafts in one forward pass; the target's own choice is sampled at
every position (sample-and-match), drafts are accepted while they equal it, and
the cache is trimmed back to the accepted prefix. Sampling from the target at each
position keeps the output distribution exactly the target's, whatever the drafter
proposes. With no drafter, or a round with no draft, this is plain decoding.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Protocol

import mlx.core as mx

from ..cache import SequenceCache
from ..results import GenerationStats
from ..sampling import LogitsProcessor, Sampler


class Step(NamedTuple):
    token: int
    logprobs: mx.array  # (vocab,) log-probabilities the token was sampled from
    from_draft: bool


class DrafterUnavailable(Exception):
    """Raised by a drafter that can no longer draft for this request (for example
    its cache cannot be rewound); the loop continues with plain decoding."""


class Drafter(Protocol):
    name: str

    def propose(self, history: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that may follow ``history`` (whose last token the
        main model has not processed yet)."""

    def observe(self, drafted: int, accepted: int) -> None:
        """Feedback after each verify round."""


def sample_rows(
    logits: mx.array,
    context: list[int],
    drafts: list[int],
    sampler: Sampler,
    processors: list[LogitsProcessor],
    context_window: int,
) -> tuple[mx.array, mx.array]:
    """Sample the target's token at each of the k+1 positions. Logits processors
    see the exact context of each position (history plus the drafts before it)."""
    if processors:
        rows = []
        for i in range(logits.shape[0]):
            ctx = (context + drafts[:i])[-context_window:]
            row = logits[i : i + 1]
            for proc in processors:
                row = proc(mx.array(ctx), row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs), logprobs


def decode(
    cache: SequenceCache,
    history: list[int],
    max_new: int,
    sampler: Sampler,
    processors: list[LogitsProcessor],
    context_window: int,
    drafter: Drafter | None,
    stats: GenerationStats,
    on_fallback: Callable[[str], None] | None = None,
) -> Iterator[Step]:
    """Yield up to ``max_new`` tokens following ``history``. The cache must hold
    ``history[:-1]``; it is always consistent with ``cache.tokens`` at every yield,
    so the caller may stop at any point."""
    position_tries: list[int] = []
    position_hits: list[int] = []
    produced = 0
    while produced < max_new:
        limit = max_new - produced - 1
        drafts: list[int] = []
        if drafter is not None and limit > 0:
            try:
                drafts = drafter.propose(history, limit)[:limit]
                if drafts and (reason := cache.rewind_limit_reason(len(drafts) + 1)):
                    raise DrafterUnavailable(reason)
            except DrafterUnavailable as exc:
                drafter, drafts = None, []
                if on_fallback is not None:
                    on_fallback(str(exc))
        k = len(drafts)
        logits = cache.feed([history[-1]] + drafts)
        tokens, logprobs = sample_rows(logits, history, drafts, sampler, processors, context_window)
        mx.eval(tokens, logprobs)
        sampled = tokens.tolist()
        n = 0
        while n < k and sampled[n] == drafts[n]:
            n += 1
        if k:
            cache.rewind_to(len(cache.tokens) - (k - n))
            drafter.observe(k, n)
            stats.verify_rounds += 1
            stats.drafted_tokens += k
            stats.accepted_tokens += n
            stats.rejected_tokens += k - n
            while len(position_tries) < k:
                position_tries.append(0)
                position_hits.append(0)
            for i in range(k):
                position_tries[i] += 1
                position_hits[i] += i < n
            stats.acceptance_by_position = [h / t for h, t in zip(position_hits, position_tries)]
        elif drafter is not None:
            drafter.observe(0, 0)
        emitted = sampled[: n + 1]
        history.extend(emitted)
        produced += len(emitted)
        for i, tok in enumerate(emitted):
            yield Step(tok, logprobs[i], i < n)


def plain_decode(
    cache: SequenceCache,
    history: list[int],
    max_new: int,
    sampler: Sampler,
    processors: list[LogitsProcessor],
    context_window: int,
) -> Iterator[Step]:
    """Plain decoding with the next step computed while the current token is
    handed out (as mlx-lm's ``generate_step`` does). Used when no drafter is
    involved; the cache holds every yielded token except the last."""

    def step(token: mx.array) -> tuple[mx.array, mx.array]:
        logits = cache.forward(token.reshape(1, 1))[0]
        if processors:
            ctx = mx.array(history[-context_window:])
            for proc in processors:
                logits = proc(ctx, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs)[0], logprobs[0]

    if max_new <= 0:
        return
    y, lp = step(mx.array(history[-1], dtype=mx.uint32))
    cache.tokens.append(history[-1])
    mx.async_eval(y, lp)
    produced = 0
    while True:
        tok = y.item()
        history.append(tok)
        produced += 1
        if produced < max_new:
            # Queue the next step before handing this token out.
            next_y, next_lp = step(y)
            mx.async_eval(next_y, next_lp)
            cache.tokens.append(tok)
        yield Step(tok, lp, False)
        if produced >= max_new:
            return
        y, lp = next_y, next_lp
