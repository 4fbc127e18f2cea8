"""Shadow lookup drafts: what prompt lookup would have drafted while another
mode runs, scored against the tokens that followed. Free evidence: the router
(routing.decide) moves to lookup when this record promises clearly more than the
running mode.

Worked example: at position 3 lookup would draft ``[53, 54, 55]``; the output
then continues ``53, 54, 9``. Once position 4 is decided the shadow has two
accepted positions (scored as soon as they are decided, not when the whole
shadow is), and once position 5 is decided it has its miss: 3 positions
decided, 2 accepted, one shadow scored. Invariant: only one shadow is open at a
time, so a phrase copied from the prompt is counted once, not once per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..pricing.speedup import AcceptanceModel


class Scored(NamedTuple):
    """What one shadow draft's newly decided positions showed: positions
    ``first .. first+hits-1`` accepted and, if ``missed``, the next one rejected;
    ``finished``: the draft is decided (missed or accepted to its end), its
    tokens then count. ``weak``: it came from a weak match."""

    first: int
    hits: int
    missed: bool
    finished: bool
    drafted: int
    weak: bool


def teach(record: AcceptanceModel, scored: Scored) -> None:
    """Apply a shadow's outcome to ``record`` through its own methods."""
    if scored.hits or scored.missed:
        record.observe_positions(scored.first, scored.hits, scored.missed, new=scored.first == 0)
    if scored.finished:
        record.count(scored.drafted, scored.first + scored.hits)


@dataclass
class ShadowLookup:
    """The shadow drafts of one request in one mode, and their record."""

    record: AcceptanceModel = field(default_factory=lambda: AcceptanceModel(prior=0.5))
    scored: int = 0  # shadow drafts with a decided first token
    positions: int = 0  # shadow draft positions decided
    open: list[tuple[int, list[int], int, bool]] = field(default_factory=list)  # (position, drafts, scored, weak)

    def score(self, history: list[int]) -> list[Scored]:
        """Score the open shadows position by position as ``history`` decides
        them, into this record; a weak match's shadow is returned instead
        (lookup would not draft it the way it drafts the rest: its owner keeps
        a record of its own). Returns every weak shadow's outcome, in order."""
        still_open, weak = [], []
        for pos, drafts, done, is_weak in self.open:
            actual = history[pos : pos + len(drafts)]
            n = done
            while n < len(actual) and actual[n] == drafts[n]:
                n += 1
            missed = n < len(actual)
            finished = missed or n == len(drafts)
            outcome = Scored(done, n - done, missed, finished, len(drafts), is_weak)
            if is_weak:
                weak.append(outcome)
            else:
                teach(self.record, outcome)
                if n > done or missed:
                    self.scored += done == 0
                    self.positions += n - done + missed
            if not finished:
                still_open.append((pos, drafts, n, is_weak))
        self.open = still_open
        return weak

    def add(self, position: int, drafts: list[int], weak: bool) -> None:
        """What lookup would draft at ``position`` now, to be scored as the output goes on."""
        self.open.append((position, drafts, 0, weak))
