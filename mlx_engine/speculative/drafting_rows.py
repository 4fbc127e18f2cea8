"""What the rows of a kit's batch can draft next round.

In a batch every row's drafts share one forward pass, padded to the widest
row, so a draft length is one choice for the whole batch: eight rows copying
text each gain from four drafts in a pass of 8 x 5 tokens, where one row alone
would pay the same width for its own gain only (speedup.best_draft_length,
``beside``). Each lookup row posts, every round, the acceptance its next round
can reach (prompt_lookup.strength_acceptance of its ``next_strength_bound``),
and prices its drafts with the other rows' posts.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable


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
        least half of the batch's ``rows``; else none. Rows that draft cannot
        have their next step queued before this one is read, which the pass
        widths do not price: with 2-3 copying rows of 8 (86% of their drafts
        accepted) drafting together measured 0.89-0.99x plain batched decoding,
        with all 8 copying 1.18x."""
        with self._lock:
            others = [a for r, a in self._posted.items() if r != row]
        return others if 2 * (len(others) + 1) >= rows else []
