"""Prompt-lookup decoding: drafts copied from earlier in the context.

The index maps every n-gram (min_ngram..max_ngram) of the history to the
positions that followed it. It grows by appending as tokens arrive, so a lookup
costs a few dictionary probes whatever the history length.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, NamedTuple

from ..pricing.batch_pricing import BatchPricing


class Match(NamedTuple):
    """A lookup's drafts and the strength of the match they come from (the
    matched n-gram's length plus how many tokens before it also agree;
    0: none). The strength predicts acceptance (routing.RouterSettings.weak_match)."""

    drafts: list[int]
    strength: int


class NGramIndex:
    """Incremental n-gram -> continuation-position index over a token history."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._table: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; ``tokens`` may also be the whole history so far, of
        which only the part not yet indexed is added."""
        for tok in tokens[len(self.tokens) :]:
            self.tokens.append(tok)
            end = len(self.tokens)  # the position that follows this n-gram
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._table[tuple(self.tokens[end - n : end])].append(end)

    def lookup(self, num_tokens: int, num_candidates: int = 4, suffix: list[int] | None = None) -> Match:
        """Draft up to ``num_tokens`` tokens continuing the indexed history (with
        the match's strength; a query: the index is left as it was): the
        continuation of the longest suffix n-gram that occurred before. Among the
        ``num_candidates`` most recent matches, the one whose preceding context
        agrees longest with the history's suffix wins, then the longest
        continuation (compared ``RANK_SPAN`` tokens ahead), then the most recent.
        With ``suffix``, continue that sequence's suffix from this index's tokens
        instead (another text: lookup memory).

        Example, with bigrams at most::

            idx = NGramIndex(min_ngram=1, max_ngram=2)
            idx.extend([10, 1, 2, 3, 4, 20, 1, 2, 5, 6, 20, 1, 2])
            idx.lookup(2)   # Match(drafts=[5, 6], strength=3)
            idx.lookup(8)   # Match(drafts=[5, 6, 20, 1, 2], strength=3)

        The history ends with the bigram ``1 2``, seen twice before: followed by
        ``3 4`` (after ``10``) and by ``5 6`` (after ``20``). The token before the
        suffix, ``20``, agrees with the second, so it wins; the strength is the
        bigram plus that one agreeing token. A draft never runs past the history's
        end, so ``lookup(8)`` copies the 5 tokens there are. With
        ``suffix=[7, 4, 1]`` the bigram ``4 1`` never occurred, so the unigram
        ``1`` matches (strength 1); no context agrees, and the longest
        continuation wins: ``idx.lookup(3, suffix=[7, 4, 1])`` is ``Match([2, 3, 4], 1)``."""
        toks = self.tokens
        end = len(toks)
        query = toks if suffix is None else suffix
        if num_tokens <= 0 or end == 0 or not query:
            return Match([], 0)
        for n in range(min(self.max_ngram, len(query)), self.min_ngram - 1, -1):
            positions = self._table.get(tuple(query[len(query) - n :]))
            if not positions:
                continue
            best: list[int] = []
            best_key = (-1, -1)
            seen = 0
            for pos in reversed(positions):
                if pos >= end:
                    continue  # the suffix itself
                cont = _until_separator(toks[pos : pos + max(num_tokens, RANK_SPAN)])
                key = (_context_match(toks, pos - n, query, len(query) - n), len(cont))
                if cont and key > best_key:
                    best, best_key = cont, key
                seen += 1
                if seen >= num_candidates:
                    break
            if best:
                return Match(best[:num_tokens], n + best_key[0])
        return Match([], 0)

    def next_strength_bound(self, scan: int = 256) -> int:
        """The most strength a lookup can have once one more token, whichever
        it is, is appended: one more than the longest suffix of the history that
        also occurred earlier followed by a token (a match after the new token
        is that token plus an earlier repeat of what precedes it). Costs what a
        lookup does, so a batch can tell before a token is read that no draft
        after it would pay (``scan``: more earlier occurrences than this give
        the largest strength rather than being compared).

        Example: after ``[1, 2, 3, 9, 1, 2]`` the suffix ``1 2`` occurred before
        (followed by 3), so the strongest match after one more token is ``1 2 3``:
        the bound is 3. After ``[1, 2, 3, 9]`` it is ``min_ngram`` (9 is new)."""
        toks, end = self.tokens, len(self.tokens)
        most = self.max_ngram + CONTEXT_WINDOW
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            earlier = [p for p in self._table.get(tuple(toks[end - n :]), ()) if p < end]
            if not earlier:
                continue
            if len(earlier) > scan:
                return most
            longest = max(n + _context_match(toks, p - n, toks, end - n) for p in earlier)
            return min(1 + longest, most)
        return self.min_ngram


#: How far back candidates' contexts are compared (tokens beyond the n-gram).
CONTEXT_WINDOW = 32
#: How far ahead candidates' continuations are compared, whatever the draft
#: length: a short lookup must pick the same candidate as a long one. (A code
#: fence matches its opening, followed by the code, and its closing, followed by
#: the end of the prompt; ranked only 4 tokens ahead both are as long and the
#: most recent, the closing one, won.)
RANK_SPAN = 32


def _context_match(toks: list[int], i: int, query: list[int], j: int) -> int:
    """How many tokens before ``toks[i]`` equal those before ``query[j]``
    (up to ``CONTEXT_WINDOW``): the same passage seen again matches far back."""
    n = 0
    while n < CONTEXT_WINDOW and i - n > 0 and j - n > 0 and toks[i - n - 1] == query[j - n - 1]:
        n += 1
    return n


SEPARATOR = -2  # between the sequences of a lookup memory; never a token id


def _until_separator(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(SEPARATOR)] if SEPARATOR in tokens else tokens


def density_score(tokens: list[int], min_length: int = 256, ngram: int = 3, full_length: int = 768) -> float:
    """How much prompt lookup is likely to find, from 0 to 1: the share of
    positions whose preceding n-gram occurred earlier, times a ramp on the prompt
    length that is 0 below ``min_length`` and 1 from ``full_length`` on."""
    n_tok = len(tokens)
    if n_tok < max(min_length, ngram + 1):
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(ngram, n_tok + 1):
        key = tuple(tokens[i - ngram : i])
        if key in seen:
            repeats += 1
        else:
            seen.add(key)
    share = repeats / (n_tok - ngram + 1)
    ramp = min(1.0, (n_tok - min_length + 1) / max(1, full_length - min_length))
    return share * ramp


class PromptLookupDrafter:
    """A drafter that copies continuations of the current suffix from the
    history, and, when the history has none, from ``memory``: other token
    sequences the kit holds (its other cached conversations), at most
    ``MEMORY_TOKENS`` of the most recent ones."""

    name = "prompt_lookup"
    MEMORY_TOKENS = 16384
    # A match in another conversation needs more context than one in the
    # request's own history: a one- or two-token match there drafts noise.
    MEMORY_MIN_NGRAM = 3

    def __init__(
        self,
        num_tokens: int,
        min_ngram: int = 1,
        max_ngram: int = 3,
        num_candidates: int = 4,
        memory: list[list[int]] | None = None,
        batch_pricing: BatchPricing | None = None,
        on_round: Callable[[int, float | None], None] | None = None,
    ):
        self.num_tokens = num_tokens
        # A fixed-length request's timed rounds (tokens verified, seconds) for the
        # kit's forward costs (the router reports its own lookup rounds).
        self.on_round = on_round
        self.num_candidates = num_candidates
        # Given for a fixed-length request on a batching kit: drafts are cut to
        # what pays for the batch (the router prices its own lengths).
        self.batch_pricing = batch_pricing
        self.index = NGramIndex(min_ngram, max_ngram)
        self.memory = None
        if memory:
            self.memory = NGramIndex(max(min_ngram, self.MEMORY_MIN_NGRAM), max(max_ngram, self.MEMORY_MIN_NGRAM))
            kept, total = [], 0
            for seq in reversed(memory):  # most recent first, within the budget
                seq = [t for t in seq if t >= 0][-self.MEMORY_TOKENS :]
                if seq and total + len(seq) <= self.MEMORY_TOKENS:
                    kept.append(seq)
                    total += len(seq)
            for seq in reversed(kept):
                self.memory.extend(self.memory.tokens + seq + [SEPARATOR])

    def plain_ahead(self, history: list[int]) -> bool:
        """True while, in the batch as it is, no match the round after
        ``history`` and one more token can find would pay for its drafts
        (``next_strength_bound``): the loop then queues that round ahead, as
        plain decoding does (undrafted rounds built only after the previous one
        is read cost a batch more than plain decoding's)."""
        p = self.batch_pricing
        if p is None:
            return False
        if p.rows() <= 1:  # alone: nothing to post, and every round drafts (no bound to compute per token)
            p.post(0)
            return False
        bound = self.next_strength_bound(history)
        p.post(bound)
        return p.draft_length(bound, self.num_tokens) == 0

    def next_strength_bound(self, history: list[int]) -> int:
        """The most ``strength`` the round after ``history`` and one more token
        can have (NGramIndex.next_strength_bound); a match in the lookup memory,
        continuing only the history's last n-gram, is never stronger than it."""
        self.index.extend(history)
        bound = self.index.next_strength_bound()
        return max(bound, self.index.max_ngram) if self.memory is not None else bound

    def propose(self, history: list[int], limit: int) -> list[int]:
        return self.propose_match(history, limit).drafts

    def record(self, history: list[int]) -> None:
        """The explicit observe step before a round's queries: index ``history``
        (what is not indexed yet). A subclass may keep it elsewhere too (suffix.py)."""
        self.index.extend(history)

    def propose_match(self, history: list[int], limit: int) -> Match:
        """This round's drafts (``history`` recorded first), cut to what the match may
        propose (``match_length_cap``) and, in a batch, to what pays; with the match's strength."""
        self.record(history)
        m = self.match(history, min(self.num_tokens, limit))
        drafts = m.drafts[: self.match_length_cap(m.strength)]
        if self.batch_pricing is not None:
            drafts = drafts[: self.batch_pricing.draft_length(m.strength, len(drafts))]
        return Match(drafts, m.strength)

    def match_length_cap(self, strength: int) -> int | None:
        """The most drafts a match of ``strength`` may propose (None: all N)."""
        return None

    def match(self, history: list[int], n: int) -> Match:
        """Up to ``n`` tokens lookup would draft after ``history``, and the
        strength of the match they come from (the router's shadow drafts and
        weak-match rule use it with their own lengths). A query: it records
        nothing (``record`` does); the request's own index is brought up to
        ``history`` as a cache, which changes no answer."""
        self.index.extend(history)
        own = self.index.lookup(n, self.num_candidates)
        if own.drafts or self.memory is None:
            return own
        return self.memory.lookup(n, self.num_candidates, suffix=history[-self.index.max_ngram :])

    def observe(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """A fixed length (the router adapts lookup lengths): the round only
        reports its time, as evidence of what a pass of that width costs."""
        if self.on_round is not None and seconds is not None:
            self.on_round(drafted + 1, seconds)
