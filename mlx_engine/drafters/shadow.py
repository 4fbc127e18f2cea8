"""Shadow lookup drafts: what prompt lookup would have drafted while another
mode runs, scored against the tokens that followed. Free evidence: the router
(router.py) moves to lookup when this record promises clearly more than the
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

from ..pricing.speedup import AcceptanceModel


@dataclass
class ShadowLookup:
    """The shadow drafts of one request in one mode, and their record."""

    record: AcceptanceModel = field(default_factory=lambda: AcceptanceModel(prior=0.5))
    scored: int = 0  # shadow drafts with a decided first token
    positions: int = 0  # shadow draft positions decided
    open: list[tuple[int, list[int], int, bool]] = field(default_factory=list)  # (position, drafts, scored, weak)

    def score(self, history: list[int], weak: AcceptanceModel) -> None:
        """Score the open shadows position by position as ``history`` decides
        them; a weak match's shadow teaches ``weak`` instead of this record
        (lookup would not draft it the way it drafts the rest)."""
        still_open = []
        for pos, drafts, done, is_weak in self.open:
            actual = history[pos : pos + len(drafts)]
            n = done
            while n < len(actual) and actual[n] == drafts[n]:
                n += 1
            missed = n < len(actual)
            record = weak if is_weak else self.record
            if n > done or missed:
                record.observe_positions(done, n - done, missed, new=done == 0)
                if not is_weak:
                    self.scored += done == 0
                    self.positions += n - done + missed
            if missed or n == len(drafts):
                record.drafted += len(drafts)
                record.accepted += n
            else:
                still_open.append((pos, drafts, n, is_weak))
        self.open = still_open

    def add(self, position: int, drafts: list[int], weak: bool) -> None:
        """What lookup would draft at ``position`` now, to be scored as the output goes on."""
        self.open.append((position, drafts, 0, weak))
