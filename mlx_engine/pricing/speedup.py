"""The expected speed-up of drafting: how many drafts a round accepts
(``AcceptanceModel``, ``expected_tokens``) against what a round costs
(costs.py), and the draft length that pays best (``best_draft_length``)."""

from __future__ import annotations

from collections.abc import Sequence

from .costs import MAX_DRAFT, RoundCosts


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per verify round with k drafts accepted independently with
    probability alpha (accepted prefix plus the target's own token)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class AcceptanceModel:
    """Acceptance by draft position, each conditional on the drafts before it
    being accepted, from decaying counts of observed rounds.

    Acceptance is bursty: a draft that has matched so far usually keeps matching
    (an echoed passage, a loop), so one average rate undervalues long drafts
    exactly where they pay. A position with little evidence leans on the one
    before it, which lets the draft length grow when early positions do well."""

    def __init__(self, prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.9, size: int = MAX_DRAFT):
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.tries = [0.0] * size
        self.hits = [0.0] * size
        self.drafted = 0
        self.accepted = 0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.tries = [t * self.decay for t in self.tries]
        self.hits = [h * self.decay for h in self.hits]
        for i in range(min(drafted, accepted + 1, len(self.tries))):
            self.tries[i] += 1
            self.hits[i] += i < accepted

    def observe_positions(self, first: int, hits: int, missed: bool, new: bool = False) -> None:
        """Evidence decided a few positions at a time (a shadow draft scored as
        the output arrives): positions ``first .. first+hits-1`` accepted and, if
        ``missed``, the next one rejected. ``new``: the first evidence of a draft
        (older evidence decays once per draft, as in ``observe``)."""
        if new:
            self.tries = [t * self.decay for t in self.tries]
            self.hits = [h * self.decay for h in self.hits]
        for i in range(first, min(first + hits + missed, len(self.tries))):
            self.tries[i] += 1
            self.hits[i] += i < first + hits

    def count(self, drafted: int, accepted: int) -> None:
        """Count a decided draft's tokens in the totals (its positions observed
        a few at a time by ``observe_positions``)."""
        self.drafted += drafted
        self.accepted += accepted

    @property
    def rate(self) -> float:
        """Accepted / drafted over everything observed (the prior when nothing is)."""
        return self.accepted / self.drafted if self.drafted else self.prior

    def conditional(self) -> list[float]:
        """P(draft i accepted | drafts before it accepted), for each position."""
        out, previous = [], self.prior
        for tries, hits in zip(self.tries, self.hits):
            previous = (hits + self.prior_weight * previous) / (tries + self.prior_weight)
            out.append(previous)
        return out

    def expected_tokens(self, k: int) -> float:
        """Expected tokens from a round of k drafts (accepted prefix + one)."""
        total, survive = 1.0, 1.0
        for p in self.conditional()[:k]:
            survive *= p
            total += survive
        return total


def best_draft_length(
    acceptance: float | AcceptanceModel,
    rounds: RoundCosts | Sequence[float],
    max_k: int = MAX_DRAFT,
    min_k: int = 0,
    rows: int = 1,
    beside: Sequence[float] = (),
) -> tuple[int, float]:
    """The draft length in [min_k, max_k] with the best expected speed-up over
    undrafted rounds, and that speed-up (1.0 for k = 0). ``acceptance`` is a
    per-token rate (independent positions) or an AcceptanceModel; ``rounds``
    gives the time of a round with k drafts (a RoundCosts or its table). In a
    batch of ``rows`` rows (``rounds`` then priced for it, batch_round_table)
    the speed-up is the batch's: the other rows gain one token a step whatever
    this one drafts, so a draft must pay for the whole batch's wider pass;
    ``beside`` are the acceptances of other rows drafting in the same pass,
    which up to its width draft for free, so each gains its own expected
    tokens from k drafts too (the batch's width is one choice for every row).

    Worked example, 8 rows, a 2-token pass costing 1.27 single-row steps: one
    row drafting one token at 96% makes (7 + 1.96) / 8 = 1.12 tokens per row in
    1.27 steps, 0.88x; all eight drafting it make 1.96 / 1.27 = 1.54x."""
    # Per-position acceptance, computed once: E(k) = 1 + p1 + p1p2 + ... + p1..pk.
    if isinstance(acceptance, AcceptanceModel):
        ps = acceptance.conditional()
    else:
        ps = [float(acceptance)] * max_k
    seconds = rounds.table() if isinstance(rounds, RoundCosts) else rounds
    beside = list(beside)[: max(0, rows - 1)]
    speedups = [1.0]
    expected, survive = 1.0, 1.0
    for k, p in enumerate(ps[:max_k], start=1):
        survive *= p
        expected += survive
        others = (rows - 1 - len(beside)) + sum(expected_tokens(a, k) for a in beside)
        speedups.append((others + expected) / rows * seconds[0] / seconds[k])
    lengths = range(min(min_k, len(speedups) - 1), len(speedups))
    best_k = max(lengths, key=lambda k: (speedups[k], -k))
    return best_k, speedups[best_k]
