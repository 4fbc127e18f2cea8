"""The verify / accept / rewind loop shared by all decoding modes.

Each round the drafter proposes up to k tokens; the main model scores the pending
token plus the k drafts in one forward pass; the target's own choice is sampled at
every position (sample-and-match), drafts are accepted while they equal it, and
the cache is trimmed back to the accepted prefix. Sampling from the target at each
position keeps the output distribution exactly the target's, whatever the drafter
proposes. With no drafter, or a round with no draft, this is plain decoding.

On a hybrid model the recurrent layers cannot be trimmed: a partly accepted
round restores their state from before the verify pass (caches/sequence.py keeps it) and
the next round's pass feeds the accepted tokens again before its own
(docs/decoding.md, *Hybrid models*).

What the loop exchanges with its caller (launches, rounds, steps) and its
drafter (the ``Drafter`` interface) is declared in protocol.py.
"""

from __future__ import annotations

import time
from typing import Generator

import mlx.core as mx

from ..caches.sequence import SequenceCache
from ..pricing.costs import MAX_DRAFT
from ..structured import GrammarConstraint, apply_mask
from .capture import HiddenSpec
from .protocol import (
    Decoding,
    Drafter,
    DrafterUnavailable,
    Drafts,
    Launch,
    PendingDrafts,
    Round,
    RoundOutcome,
    Step,
)
from .sampling import LogitsProcessor, Sampler


def sample_rows(
    logits: mx.array,
    context: list[int],
    drafts: list[int],
    sampler: Sampler,
    processors: list[LogitsProcessor],
    context_window: int,
    masks: mx.array | None = None,
    *,
    position: int,
) -> tuple[mx.array, mx.array]:
    """Sample the target's token at each of the k+1 positions. Logits processors
    see the exact context of each position (history plus the drafts before it);
    ``masks`` (k+1, vocab) then removes the tokens a grammar forbids there.
    ``position`` is the absolute sequence position (prompt included) of row 0's
    token; row i samples position + i with that position's own randomness."""
    if processors:
        rows = []
        for i in range(logits.shape[0]):
            ctx = (context + drafts[:i])[-context_window:]
            row = logits[i : i + 1]
            for proc in processors:
                row = proc(mx.array(ctx), row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    if masks is not None:
        logits = apply_mask(logits, masks)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs, range(position, position + logprobs.shape[0])), logprobs


def _queue(drafts: Drafts, start: int, tokens: mx.array, logprobs: mx.array, forced: bool = False) -> Round:
    """Start evaluating a round; the chosen tokens' log-probabilities are
    computed with them so reading them later never waits on a queued round."""
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    mx.async_eval(tokens, chosen, logprobs)
    return Round(drafts, start, tokens, chosen, logprobs, forced)


def decode(
    cache: SequenceCache,
    history: list[int],
    max_new: int,
    sampler: Sampler,
    processors: list[LogitsProcessor],
    context_window: int,
    drafter: Drafter | None,
    constraint: GrammarConstraint | None = None,
) -> Decoding:
    """Yield up to ``max_new`` tokens following ``history`` (whose last token the
    cache does not hold yet). With ``drafter=None`` this is plain decoding; with a
    ``constraint`` every position is sampled under the grammar's mask.

    Between tokens it yields a ``Launch`` for each verify round: the caller (the
    scheduler) runs the forward passes of every request's launches together and
    resumes it with ``send(round)``, the launch's queued ``Round``. One request
    is a batch of one; nothing else differs.

    Each round is launched before the previous round's tokens are handed out,
    so the caller's work (detokenizing, stop strings, other rows) overlaps the
    model, as in mlx-lm's ``generate_step``. ``cache.tokens`` always has one entry
    per cached position: the id, or UNKNOWN for an id of a queued round that is
    not read yet. The caller may therefore stop at any point: the next request's
    prefix match stops at the first UNKNOWN and recomputes from there."""
    loop = _Loop(cache, history, max_new, sampler, processors, context_window, drafter, constraint)
    return loop.run()


class _Loop:
    """One decode's state: the history, the drafter (dropped for good when it
    becomes unavailable), the tokens produced and the last round's read time."""

    def __init__(self, cache, history, max_new, sampler, processors, context_window, drafter, constraint):
        self.cache, self.history, self.max_new = cache, history, max_new
        self.sampler, self.processors, self.context_window = sampler, processors, context_window
        self.drafter, self.constraint = drafter, constraint
        self.fallback: str | None = None  # why the drafter was dropped, until a step reports it
        self.produced = 0
        self.last_read: float | None = None

    def run(self) -> Decoding:
        cache = self.cache
        rnd = yield from self.launch()
        while True:
            # A drafter whose plain_ahead says so (the router in plain decoding) drafts nothing next round.
            plain = self.drafter is None or _plain_ahead(self.drafter, self.history)
            ahead = plain and not self.processors and self.constraint is None
            # Only behind a round without drafts: with drafts still to accept, the row's
            # next position is not known until they are (a batch-priced drafter's
            # plain_ahead can turn on between its drafting round and this read).
            ahead = ahead and self.produced + 1 < self.max_new and _draft_count(rnd.drafts) == 0
            if ahead:
                pending = yield from self.launch_plain_from(rnd.tokens)
            sampled = rnd.tokens.tolist()
            sampled_lp = rnd.chosen.tolist()
            now = time.perf_counter()
            seconds = None if self.last_read is None else now - self.last_read
            self.last_read = now
            if ahead:
                cache.resolve(pending.start, sampled[:1])
            self.give_hidden(rnd)
            n, outcome = _accept(cache, rnd, sampled, self.drafter, seconds)
            emitted, complete = self.grammar_cut(sampled[: n + 1], n)
            self.history.extend(emitted)
            self.produced += len(emitted)
            if self.produced < self.max_new and not ahead and not complete:
                pending = yield from self.launch()
            for i, tok in enumerate(emitted):
                first = i == 0
                fallback, self.fallback = (self.fallback, None) if first else (None, self.fallback)
                final = i == len(emitted) - 1
                at_limit = final and self.produced >= self.max_new
                outcome_here = outcome if first else None
                yield Step(
                    tok, sampled_lp[i], rnd.logprobs[i], i < n, complete and final, at_limit, outcome_here, fallback
                )
            if self.produced >= self.max_new or complete:
                return
            rnd = pending

    @property
    def hidden_spec(self) -> HiddenSpec | None:
        """The hidden states the drafter reads (recorded by every launch while it drafts)."""
        return None if self.drafter is None else getattr(self.drafter, "hidden_spec", None)

    def give_hidden(self, rnd: Round) -> None:
        """Hand a read round's hidden states to the drafter that asked for them."""
        if rnd.hidden is not None and self.drafter is not None:
            self.drafter.take_hidden(rnd.hidden_at, rnd.hidden)

    def grammar_cut(self, emitted: list[int], accepted: int) -> tuple[list[int], bool]:
        """Advance the grammar; nothing follows a complete grammar (not even an
        end token drafted or sampled after it), so every mode ends on the same
        token. Returns the tokens to emit and whether the grammar is complete."""
        if self.constraint is None:
            return emitted, False
        kept = emitted[: self.constraint.advance(emitted)]
        if len(kept) < accepted + 1:
            self.cache.rewind_to(len(self.cache.tokens) - (accepted + 1 - len(kept)))
        return kept, self.constraint.complete

    def propose(self, limit: int) -> Drafts:
        if self.drafter is None or limit <= 0:
            return []
        try:
            # Checked before drafting: a lazily drafted round cannot be undone.
            if reason := self.cache.rewind_limit_reason(min(limit, MAX_DRAFT) + 1):
                raise DrafterUnavailable(reason)
            drafts = self.drafter.propose(self.history, limit)
            return drafts if isinstance(drafts, PendingDrafts) else drafts[:limit]
        except DrafterUnavailable as exc:
            self.drafter = None
            self.fallback = str(exc)
            return []

    def launch(self) -> Generator[Launch, Round, Round]:
        """Yield this round's launch; the caller sends back its queued round."""
        history, limit = self.history, self.max_new - self.produced - 1
        if self.constraint is not None:
            launch = _launch_constrained(
                self.cache,
                history,
                limit,
                self.propose,
                self.constraint,
                self.sampler,
                self.processors,
                self.context_window,
            )._replace(hidden=self.hidden_spec)
        else:
            launch = self._launch_free(history, limit)
        return (yield launch)

    def _launch_free(self, history: list[int], limit: int) -> Launch:
        drafts = self.propose(limit)
        sample, position = self.sampler, len(history)  # row 0 samples the token after history
        feed = _unfed(self.cache, history)
        skip = len(feed) - 1  # logits rows of re-fed accepted tokens, not sampled again
        if isinstance(drafts, PendingDrafts) and self.processors:
            drafts = drafts.materialize()
        if isinstance(drafts, (mx.array, PendingDrafts)):
            if drafts.size and not self.processors:
                # The launch's lazy ids are the drafts (pending ones are computed first).
                return Launch(
                    self.cache,
                    feed,
                    drafts,
                    lambda logits, start, ids: _queue(
                        ids, start, *sample_rows(_after(logits, skip), [], [], sample, [], 0, position=position)
                    ),
                    self.hidden_spec,
                )
            drafts = drafts.tolist()  # processors need each position's exact context

        def finish(logits: mx.array, start: int, ids: None) -> Round:
            rows = sample_rows(
                _after(logits, skip), history, drafts, sample, self.processors, self.context_window, position=position
            )
            return _queue(drafts, start, *rows)

        return Launch(self.cache, feed + drafts, None, finish, self.hidden_spec)

    def launch_plain_from(self, token: mx.array) -> Generator[Launch, Round, Round]:
        # Plain decoding without logits processors: build the next step from the
        # token before it is known (as mlx-lm's generate_step does), so graph
        # construction overlaps the running step.
        # ``token`` sits at len(history) (not appended yet); this step samples the next position.
        sample, position = self.sampler, len(self.history) + 1
        return (
            yield Launch(
                self.cache,
                [],
                token,
                lambda logits, start, ids: _queue(
                    [], start, *sample_rows(logits, [], [], sample, [], 0, position=position)
                ),
                self.hidden_spec,
            )
        )


def _plain_ahead(drafter: Drafter, history: list[int]) -> bool:
    """Whether ``drafter`` drafts nothing in the round after ``history`` and one
    more token (whichever it is); drafters without ``plain_ahead`` may draft."""
    ahead = getattr(drafter, "plain_ahead", None)
    return ahead is not None and ahead(history)


def _draft_count(drafts: Drafts) -> int:
    return len(drafts) if isinstance(drafts, list) else drafts.size


def _accept(cache: SequenceCache, rnd: Round, sampled: list[int], drafter, seconds) -> tuple[int, RoundOutcome | None]:
    """Accept the drafts that match the target's choices, rewind the cache past
    the rest and tell the drafter; returns the number accepted and the round's
    outcome (None for a round without drafts)."""
    drafts = rnd.drafts
    if isinstance(drafts, mx.array):
        drafts = drafts.tolist()  # already evaluated: the verify pass used them
        cache.resolve(rnd.start, drafts)
    k = len(drafts)
    n = 0
    while n < k and sampled[n] == drafts[n]:
        n += 1
    if k:
        # Attention layers are trimmed to the accepted prefix; recurrent ones
        # return to the state before the pass, and the next round re-feeds
        # the accepted tokens (_unfed).
        cache.rewind_to(len(cache.tokens) - (k - n))
    if rnd.forced:
        return n, RoundOutcome(
            k, n, forced=True
        ) if k else None  # the grammar's drafts, not the drafter's: no feedback to it
    if drafter is not None:
        drafter.observe(k, n, seconds)
    return n, RoundOutcome(k, n) if k else None


def _launch_constrained(cache, history, limit, propose, constraint, sampler, processors, context_window) -> Launch:
    """A verify round under a grammar: the tokens it forces are drafted for free
    (when the cache can rewind them), otherwise the drafter's drafts are cut at
    the first token the grammar forbids; every position gets its grammar mask."""
    forced: list[int] = []
    if limit > 0 and not cache.rewind_limit_reason(min(limit, MAX_DRAFT) + 1):
        forced = constraint.forced(min(limit, MAX_DRAFT))
    drafts = forced or propose(limit)
    if isinstance(drafts, PendingDrafts):
        drafts = drafts.materialize()
    if isinstance(drafts, mx.array):
        drafts = drafts.tolist()
    drafts = constraint.allowed_prefix(list(drafts))
    position = len(history)
    feed = _unfed(cache, history)
    skip = len(feed) - 1

    def finish(logits: mx.array, start: int, ids: None) -> Round:
        logits = _after(logits, skip)
        mx.async_eval(logits)  # the forward pass runs while the grammar computes the masks
        masks = constraint.masks(drafts)
        rows = sample_rows(logits, history, drafts, sampler, processors, context_window, masks, position=position)
        return _queue(drafts, start, *rows, forced=bool(forced))

    return Launch(cache, feed + drafts, None, finish)


def _after(logits: mx.array, skip: int) -> mx.array:
    """The logits rows past the ``skip`` re-fed tokens (no slice when there are none)."""
    return logits[skip:] if skip else logits


def _unfed(cache: SequenceCache, history: list[int]) -> list[int]:
    """The history's ids the cache lacks: its last one, and after a rewind of
    recurrent layers (which return to the state before the verify pass) the
    accepted ones before it, fed again in front of the next round's."""
    return history[min(len(cache.tokens), len(history) - 1) :]
