"""The verify / accept / rewind loop shared by all decoding modes.

Each round the drafter proposes up to k tokens; the main model scores the pending
token plus the k drafts in one forward pass; the target's own choice is sampled at
every position (sample-and-match), drafts are accepted while they equal it, and
the cache is trimmed back to the accepted prefix. Sampling from the target at each
position keeps the output distribution exactly the target's, whatever the drafter
proposes. With no drafter, or a round with no draft, this is plain decoding.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, NamedTuple, Protocol

import mlx.core as mx

from ..cache import SequenceCache
from ..results import GenerationStats
from ..sampling import LogitsProcessor, Sampler
from .costs import MAX_DRAFT


class Step(NamedTuple):
    token: int
    logprob: float  # log-probability of ``token`` under the distribution it was sampled from
    logprobs: mx.array  # (vocab,) that distribution, for top-logprobs
    from_draft: bool


class DrafterUnavailable(Exception):
    """Raised by a drafter that can no longer draft for this request (for example
    its cache cannot be rewound); the loop continues with plain decoding."""


Drafts = list[int] | mx.array


class Drafter(Protocol):
    name: str

    def propose(self, history: list[int], limit: int) -> Drafts:
        """Up to ``limit`` tokens that may follow ``history`` (whose last token the
        main model has not processed yet). A lazy ``mx.array`` of ids lets the loop
        build the verify pass before the drafts are computed and evaluate both at
        once, as mlx-lm's speculative loop does."""

    def observe(self, drafted: int, accepted: int, seconds: float | None) -> None:
        """Feedback after each verify round: drafts verified and accepted, and the
        round's wall time (from the previous round's result to this one's, so it
        includes drafting and the caller's overlapped work; None for the first)."""


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


class _Round(NamedTuple):
    drafts: Drafts
    start: int  # cache position of the ids fed lazily (UNKNOWN there until read)
    tokens: mx.array  # the target's choice at each position
    chosen: mx.array  # their log-probabilities
    logprobs: mx.array


def _queue(drafts: Drafts, start: int, tokens: mx.array, logprobs: mx.array) -> _Round:
    """Start evaluating a round; the chosen tokens' log-probabilities are
    computed with them so reading them later never waits on a queued round."""
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    mx.async_eval(tokens, chosen, logprobs)
    return _Round(drafts, start, tokens, chosen, logprobs)


class _AcceptanceTracker:
    """Fills the speculation fields of the stats as rounds complete."""

    def __init__(self, stats: GenerationStats):
        self.stats = stats
        self.tries: list[int] = []
        self.hits: list[int] = []

    def record(self, drafted: int, accepted: int) -> None:
        s = self.stats
        s.verify_rounds += 1
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        s.rejected_tokens += drafted - accepted
        while len(self.tries) < drafted:
            self.tries.append(0)
            self.hits.append(0)
        for i in range(drafted):
            self.tries[i] += 1
            self.hits[i] += i < accepted
        s.acceptance_by_position = [h / t for h, t in zip(self.hits, self.tries)]


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
    """Yield up to ``max_new`` tokens following ``history`` (whose last token the
    cache does not hold yet). With ``drafter=None`` this is plain decoding.

    Each round is queued on MLX before the previous round's tokens are handed
    out, so the caller's work (detokenizing, stop strings) overlaps the model, as
    in mlx-lm's ``generate_step``. ``cache.tokens`` always has one entry per cached
    position: the id, or UNKNOWN for an id of a queued round that is not read yet.
    The caller may therefore stop at any point: the next request's prefix match
    stops at the first UNKNOWN and recomputes from there."""
    tracker = _AcceptanceTracker(stats)
    produced = 0
    last_read: float | None = None

    def launch() -> _Round:
        nonlocal drafter
        limit = max_new - produced - 1
        drafts: Drafts = []
        if drafter is not None and limit > 0:
            try:
                # Checked before drafting: a lazily drafted round cannot be undone.
                if reason := cache.rewind_limit_reason(min(limit, MAX_DRAFT) + 1):
                    raise DrafterUnavailable(reason)
                drafts = drafter.propose(history, limit)[:limit]
            except DrafterUnavailable as exc:
                drafter, drafts = None, []
                if on_fallback is not None:
                    on_fallback(str(exc))
        if isinstance(drafts, mx.array):
            if drafts.size and not processors:
                logits, start = cache.feed_lazy([history[-1]], drafts)
                return _queue(drafts, start, *sample_rows(logits, [], [], sampler, [], context_window))
            drafts = drafts.tolist()  # processors need each position's exact context
        logits = cache.feed([history[-1]] + drafts)
        return _queue(drafts, len(cache), *sample_rows(logits, history, drafts, sampler, processors, context_window))

    def launch_plain_from(token: mx.array) -> _Round:
        # Plain decoding without logits processors: build the next step from the
        # token before it is known (as mlx-lm's generate_step does), so graph
        # construction overlaps the running step.
        logits, start = cache.feed_lazy([], token)
        return _queue([], start, *sample_rows(logits, [], [], sampler, [], context_window))

    pending = launch()
    while True:
        rnd = pending
        ahead = drafter is None and not processors and produced + 1 < max_new
        if ahead:
            pending = launch_plain_from(rnd.tokens)
        sampled = rnd.tokens.tolist()
        sampled_lp = rnd.chosen.tolist()
        now = time.perf_counter()
        seconds = None if last_read is None else now - last_read
        last_read = now
        if ahead:
            cache.resolve(pending.start, sampled[:1])
        drafts = rnd.drafts
        if isinstance(drafts, mx.array):
            drafts = drafts.tolist()  # already evaluated: the verify pass used them
            cache.resolve(rnd.start, drafts)
        k = len(drafts)
        n = 0
        while n < k and sampled[n] == drafts[n]:
            n += 1
        if k:
            cache.rewind_to(len(cache.tokens) - (k - n))
            drafter.observe(k, n, seconds)
            tracker.record(k, n)
        elif drafter is not None:
            drafter.observe(0, 0, seconds)
        emitted = sampled[: n + 1]
        history.extend(emitted)
        produced += len(emitted)
        if produced < max_new and not ahead:
            pending = launch()
        for i, tok in enumerate(emitted):
            yield Step(tok, sampled_lp[i], rnd.logprobs[i], i < n)
        if produced >= max_new:
            return
