"""Pricing drafts in a batch: what the rows of a kit's batch can draft next
round (``DraftingRows``, the kit's board), the acceptance a lookup match of a
given strength earns, and how a lookup round is priced beside the other rows
(``BatchPricing`` for a fixed-length lookup, ``LookupPricing`` for the router).

In a batch every row's drafts share one forward pass, padded to the widest
row, so a draft length is one choice for the whole batch: eight rows copying
text each gain from four drafts in a pass of 8 x 5 tokens, where one row alone
would pay the same width for its own gain only (speedup.best_draft_length,
``beside``). Each lookup row posts, every round, the acceptance its next round
can reach (strength_acceptance, below, of its ``next_strength_bound``),
and prices its drafts with the other rows' posts.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import NamedTuple, Protocol

from . import costs, speedup


class DraftingRows:
    """The kit's board of posted acceptances, one per running lookup request."""

    def __init__(self):
        self._lock = threading.Lock()
        self._posted: dict[Hashable, float] = {}

    def post(self, row: Hashable, acceptance: float) -> None:
        """``row``'s next round can be accepted at about ``acceptance`` per token."""
        with self._lock:
            self._posted[row] = acceptance

    def forget(self, row: Hashable) -> None:
        """``row`` drafts no more (its request ended, or left lookup)."""
        with self._lock:
            self._posted.pop(row, None)

    def beside(self, row: Hashable, rows: int) -> list[float]:
        """The other rows' posted acceptances, when they and ``row`` are at
        least half of the batch's ``rows``; else none: rows that draft cannot
        have their next step queued ahead, which the pass widths do not price
        (docs/decoding.md, "Tuning history")."""
        with self._lock:
            others = [a for r, a in self._posted.items() if r != row]
        return others if 2 * (len(others) + 1) >= rows else []


#: The share of first drafted tokens accepted after a lookup match of at least
#: this strength (prompt_lookup.Match.strength), over every position of the chat and toy
#: replay traces (docs/decoding.md, the auto router's weak-match rule).
STRENGTH_ACCEPTANCE = ((16, 0.96), (8, 0.88), (4, 0.81), (2, 0.6), (0, 0.25))


#: The match strength from which a row is copying (strength_acceptance above):
#: its acceptance is posted to the batch and it drafts with the rows copying
#: beside it (DraftingRows).
COPYING = 8


def strength_acceptance(strength: int) -> float:
    """The expected per-token acceptance of a draft from a match of ``strength``."""
    return next(p for least, p in STRENGTH_ACCEPTANCE if strength >= least)


class BatchSource(Protocol):
    """What batch pricing reads, each time it prices, from the kit a request
    decodes on (a ModelKit): its verify costs (measured when first needed) and
    how many generations are open on it (the batch's rows now)."""

    @property
    def open_generations(self) -> int: ...

    def forward_costs(self) -> costs.CostModel: ...


class BatchPricing(NamedTuple):
    """What a lookup needs to price its drafts in a batch: the kit it decodes
    on (``source``), and the board where the batch's lookup rows post what they
    can draft (this request's row on it: ``row``)."""

    source: BatchSource
    board: DraftingRows | None = None
    row: Hashable = None

    def rows(self) -> int:
        """The rows of the batch now."""
        return self.source.open_generations

    def verify_costs(self) -> costs.CostModel:
        """The kit's verify costs."""
        return self.source.forward_costs()

    def post_acceptance(self, acceptance: float) -> None:
        """Tell the batch's other rows this row's next round can be accepted at
        about ``acceptance`` per token (nothing without a board)."""
        if self.board is not None:
            self.board.post(self.row, acceptance)

    def withdraw(self) -> None:
        """This row's next round drafts nothing the other rows can draft beside."""
        if self.board is not None:
            self.board.forget(self.row)

    def post(self, strength: int) -> None:
        """Tell the batch's other rows what this row's next round can reach:
        the acceptance of a match of ``strength`` if it is a copy's (``COPYING``
        or stronger), else nothing: weaker matches are priced alone
        (docs/decoding.md, "Tuning history")."""
        if strength >= COPYING:
            self.post_acceptance(strength_acceptance(strength))
        else:
            self.withdraw()

    def beside(self, rows: int) -> list[float]:
        """What the batch's other copying rows posted (DraftingRows.beside)."""
        return self.board.beside(self.row, rows) if self.board is not None else []

    def draft_length(self, strength: int, available: int) -> int:
        """How many of ``available`` drafts from a match of ``strength`` pay
        for the batch's wider pass (all of them alone). A copy's match counts
        the rows copying beside it; a weaker one is priced alone, so a row that
        is not copying keeps plain decoding's rounds queued ahead instead of
        drafting weak matches under the copying rows' width (which cost a mixed
        batch more than they gained)."""
        rows = self.rows()
        if rows <= 1 or available == 0:
            return available
        table = costs.batch_round_table(self.verify_costs(), rows)
        beside = self.beside(rows) if strength >= COPYING else []
        return speedup.best_draft_length(strength_acceptance(strength), table, available, rows=rows, beside=beside)[0]


class LookupPricing(NamedTuple):
    """How a lookup round is priced: round times by draft length (a RoundCosts
    alone), the rows of the batch, and the acceptances of the rows drafting beside it."""

    rounds: costs.RoundCosts | list[float]
    rows: int
    beside: list[float]
