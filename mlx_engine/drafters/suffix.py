"""Suffix drafting: drafts from everything the kit has seen, across requests.

``SuffixMemory`` keeps the token sequences of the kit's requests (prompt and
output, one sequence per request) and answers, for the end of a running
history, the continuation that most often followed its longest earlier match.
It is the cross-request memory of SuffixDecoding (arXiv 2411.04975): asking the
same question again in a new chat, a retried agent step or code re-emitted with
small edits drafts what was produced before. Drafts are only proposals that the
target verifies, so outputs never change, only their speed.

The structure is a suffix index rather than a pointer-built suffix tree: every
``key``-gram maps to the positions that followed it, per sequence, and a query
extends each occurrence of the history's last ``key`` tokens backwards (up to
``max_depth``). The occurrences with the longest match are exactly the leaves
under the deepest suffix-tree node the history reaches, and counting their next
tokens gives that node's child frequencies, so the draft is the suffix tree's
greedy most-frequent path, with the same per-token probabilities
(``count(child) / count(node)``). Unlike a pointer-built tree it costs one index
entry per token (not one node per token and depth) and drops a whole sequence in
time proportional to its length, which is what least-recently-used eviction
needs.

Worked example (``key=2``): after ``record("a", [5, 6, 7, 8])`` and
``record("b", [1, 6, 7, 9])`` the index holds (5,6)->a@2, (6,7)->a@3 and b@3,
(7,8)->a@4, (1,6)->b@2, (7,9)->b@4. Querying the history ``[0, 6, 7]`` finds
(6,7) in both sequences; each matches 2 tokens (the token before, 0, equals
neither 5 nor 1), so the deepest node has count 2 and children 8 (a) and 9 (b),
one each: the draft is ``[9]`` (ties go to the most recent sequence) with
probability 1/2, and the walk stops there (``b`` ends). Querying
``[5, 6, 7]`` matches 3 tokens in ``a`` alone: the draft is ``[8]`` with
probability 1.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Callable, NamedTuple

from ..pricing.batch_pricing import BatchPricing
from .prompt_lookup import Match, PromptLookupDrafter

#: Default bound on the tokens a kit's suffix memory holds: about 185 bytes of
#: Python objects a token on text (12 MB), up to about 430 where almost no pair
#: of tokens repeats (random ids; each pair then holds its own index entry).
DEFAULT_SUFFIX_MEMORY_TOKENS = 65536


class SuffixMatch(NamedTuple):
    """A query's answer: the drafts, how many tokens of the history matched
    (the suffix-tree depth reached), how many earlier occurrences had that match
    (the node's count) and the drafts' expected accepted tokens (the sum of the
    path's cumulative probabilities, SuffixDecoding's score)."""

    drafts: list[int]
    match_length: int
    occurrences: int
    score: float


NO_MATCH = SuffixMatch([], 0, 0, 0.0)


class SuffixMemory:
    """Token sequences (least recently used evicted first, whole) indexed for
    longest-suffix-match drafting; at most ``max_tokens`` tokens in all (a single
    sequence longer than that is kept to its first ``max_tokens``).

    Not thread-safe: a kit's memory is used on its engine thread only."""

    def __init__(
        self,
        max_tokens: int = DEFAULT_SUFFIX_MEMORY_TOKENS,
        key: int = 2,
        max_depth: int = 64,
        max_candidates: int = 64,
        min_probability: float = 0.1,
        length_factor: float = 1.0,
    ):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
        if key < 1 or max_depth < key:
            raise ValueError(f"need 1 <= key <= max_depth, got key={key}, max_depth={max_depth}")
        self.max_tokens = max_tokens
        self.key = key
        self.max_depth = max_depth
        self.max_candidates = max_candidates  # most recent occurrences examined per query
        self.min_probability = min_probability  # the draft stops below this path probability
        self.length_factor = length_factor  # drafts at most this many tokens per matched token
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self._ids: dict[Hashable, int] = {}
        self._names: dict[int, Hashable] = {}
        self._index: dict[tuple[int, ...], dict[int, list[int]]] = {}
        self._next_id = 0
        self.total_tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, name: Hashable) -> bool:
        return name in self._ids

    def sequence(self, name: Hashable) -> list[int]:
        """A copy of the tokens stored under ``name``."""
        return list(self._seqs[self._ids[name]])

    # -- updates -------------------------------------------------------------
    def record(self, name: Hashable, tokens: list[int]) -> None:
        """Store ``tokens`` (negative ids are dropped: not real tokens) under
        ``name`` and mark it most recently used. When the stored sequence is a
        prefix of ``tokens`` only the new tail is indexed (a running request
        calls this every round); when ``tokens`` is a prefix of the stored
        sequence nothing changes; otherwise the sequence is replaced. A new
        sequence that extends another one (the next turn of a conversation)
        replaces it."""
        tokens = [t for t in tokens if t >= 0][: self.max_tokens]
        if not tokens:
            return
        sid = self._ids.get(name)
        if sid is not None:
            old = self._seqs[sid]
            if len(tokens) >= len(old) and tokens[: len(old)] == old:
                self._append(sid, tokens[len(old) :])
                self._seqs.move_to_end(sid)
                self._evict(keep=sid)
                return
            if old[: len(tokens)] == tokens:
                self._seqs.move_to_end(sid)  # nothing new (a request's cache lags its last token)
                return
            self._remove(sid)
        for other in [
            s
            for s, seq in self._seqs.items()
            if seq and len(seq) < len(tokens) and seq[0] == tokens[0] and tokens[: len(seq)] == seq
        ]:
            self._remove(other)  # the earlier turn of this conversation
        sid = self._next_id
        self._next_id += 1
        self._ids[name], self._names[sid] = sid, name
        self._seqs[sid] = []
        self._append(sid, tokens)
        self._evict(keep=sid)

    def forget(self, name: Hashable) -> None:
        """Drop the sequence stored under ``name`` (nothing if there is none)."""
        sid = self._ids.get(name)
        if sid is not None:
            self._remove(sid)

    def _append(self, sid: int, tail: list[int]) -> None:
        seq = self._seqs[sid]
        for tok in tail:
            seq.append(tok)
            end = len(seq)  # the position that follows this key
            if end >= self.key:
                self._index.setdefault(tuple(seq[end - self.key : end]), {}).setdefault(sid, []).append(end)
        self.total_tokens += len(tail)

    def _remove(self, sid: int) -> None:
        seq = self._seqs.pop(sid)
        del self._ids[self._names.pop(sid)]
        for end in range(self.key, len(seq) + 1):
            gram = tuple(seq[end - self.key : end])
            entry = self._index.get(gram)
            if entry is not None and entry.pop(sid, None) is not None and not entry:
                del self._index[gram]
        self.total_tokens -= len(seq)

    def _evict(self, keep: int) -> None:
        while self.total_tokens > self.max_tokens:
            oldest = next(iter(self._seqs))
            if oldest == keep:
                oldest = next((s for s in self._seqs if s != keep), None)
                if oldest is None:
                    return
            self._remove(oldest)

    # -- queries -------------------------------------------------------------
    def query(self, history: list[int], max_tokens: int) -> SuffixMatch:
        """The draft after ``history``: the most frequent continuation of its
        longest earlier match (at least ``key`` tokens), token by token while the
        path probability stays at least ``min_probability``, and at most
        ``length_factor`` tokens per matched token."""
        k = self.key
        if max_tokens <= 0 or len(history) < k:
            return NO_MATCH
        entry = self._index.get(tuple(history[-k:]))
        if not entry:
            return NO_MATCH
        best, best_len = [], 0
        seen = 0
        for sid in reversed(entry):  # the sequences that last took this key first
            seq = self._seqs[sid]
            for pos in reversed(entry[sid]):
                if pos >= len(seq):
                    continue  # the history's own end: nothing follows yet
                m = k + _agreement(seq, pos - k, history, len(history) - k, self.max_depth - k)
                if m > best_len:
                    best, best_len = [(seq, pos)], m
                elif m == best_len:
                    best.append((seq, pos))
                seen += 1
                if seen >= self.max_candidates:
                    break
            if seen >= self.max_candidates:
                break
        if not best:
            return NO_MATCH
        limit = min(max_tokens, max(1, int(self.length_factor * best_len)))
        drafts, score, prob = _walk(best, limit, self.min_probability)
        return SuffixMatch(drafts, best_len, len(best), score)

    def next_match_bound(self, history: list[int], scan: int = 256) -> int:
        """The longest ``match_length`` a query can find once one more token,
        whichever it is, is appended to ``history``: one more than the longest
        earlier occurrence, followed by a token, of the history's end (at least
        ``key``; ``max_depth`` past ``scan`` occurrences). As
        ``NGramIndex.next_strength_bound``, for the memory."""
        k = self.key
        if len(history) < k:
            return min(k, len(history) + 1)
        longest = 0
        entry = self._index.get(tuple(history[-k:]), {})
        if sum(len(positions) for positions in entry.values()) > scan:
            return self.max_depth
        for sid, positions in entry.items():
            seq = self._seqs[sid]
            for pos in positions:
                if pos < len(seq):
                    m = k + _agreement(seq, pos - k, history, len(history) - k, self.max_depth - k)
                    longest = max(longest, m)
        return min(max(k, 1 + longest), self.max_depth)


def _agreement(seq: list[int], i: int, history: list[int], j: int, most: int) -> int:
    """How many tokens before ``seq[i]`` equal those before ``history[j]`` (up to ``most``)."""
    n = 0
    while n < most and i - n > 0 and j - n > 0 and seq[i - n - 1] == history[j - n - 1]:
        n += 1
    return n


def _walk(
    occurrences: list[tuple[list[int], int]], limit: int, min_probability: float
) -> tuple[list[int], float, float]:
    """The greedy most-frequent path below a suffix-tree node given by its
    occurrences (sequence, position of the next token), most recent first."""
    drafts: list[int] = []
    score, prob = 0.0, 1.0
    alive = occurrences
    for i in range(limit):
        counts: dict[int, int] = {}
        for seq, pos in alive:
            if pos + i < len(seq):
                tok = seq[pos + i]
                counts[tok] = counts.get(tok, 0) + 1
        if not counts:
            break
        tok = max(counts, key=counts.get)  # ties: the first counted, the most recent occurrence
        p = prob * counts[tok] / len(alive)
        if p < min_probability:
            break
        prob = p
        drafts.append(tok)
        score += prob
        alive = [(seq, pos) for seq, pos in alive if pos + i < len(seq) and seq[pos + i] == tok]
    return drafts, score, prob


class SuffixDrafter(PromptLookupDrafter):
    """Prompt lookup whose cross-request source is the kit's ``SuffixMemory``:
    the request's own history first (as prompt lookup), the memory's match
    instead when it is longer (an earlier answer to this very prompt matches the
    whole prompt and answer so far). The running history is recorded into the
    memory under ``name`` as it grows (``record``, before a round's queries), so concurrent and later requests draft
    from it. A match's ``strength`` is the match length of the source used (the
    router's weak-match rule uses it)."""

    name = "suffix"

    def __init__(
        self,
        num_tokens: int,
        memory: SuffixMemory,
        request_name: Hashable,
        min_ngram: int = 1,
        max_ngram: int = 3,
        num_candidates: int = 4,
        batch_pricing: BatchPricing | None = None,
        on_round: Callable[[int, float | None], None] | None = None,
    ):
        super().__init__(
            num_tokens, min_ngram, max_ngram, num_candidates, batch_pricing=batch_pricing, on_round=on_round
        )
        self.suffix_memory = memory
        self.request_name = request_name

    def match_length_cap(self, strength: int) -> int:
        """SuffixDecoding's adaptive length for every match: at most one draft
        token per matched token (a one-token match, right about a quarter of the
        time, drafts one token, not N; a long copy drafts up to N). The memory's
        own query already keeps to it."""
        return max(1, strength)

    def next_strength_bound(self, history: list[int]) -> int:
        """As prompt lookup's, the suffix memory's matches included."""
        return max(super().next_strength_bound(history), self.suffix_memory.next_match_bound(history))

    def record(self, history: list[int]) -> None:
        """Index ``history`` and record it into the kit's suffix memory under this
        request's name (the explicit observe step: ``match`` only queries)."""
        super().record(history)
        self.suffix_memory.record(self.request_name, history)

    def match(self, history: list[int], n: int) -> Match:
        """The longer of the request's own lookup match and the suffix memory's
        (``record(history)`` first, for the memory to hold this request's tokens)."""
        own = super().match(history, n)
        found = self.suffix_memory.query(history, n) if n > 0 else NO_MATCH
        if found.drafts and (not own.drafts or found.match_length > own.strength):
            return Match(found.drafts, found.match_length)
        return own
