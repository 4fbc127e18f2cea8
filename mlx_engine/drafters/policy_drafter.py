"""What the drafters with a model of their own (the draft model's,
draft_model.py, and a head's, head.py) share around their draft-length policy
(policy.DraftLengthPolicy): each round's length asked of it, each round's
outcome told to it and to the draft's acceptance record, and the greedy
predictions kept at positions decoded without drafting, scored into its
acceptance when the next round is observed."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from ..pricing import costs, speedup
from .policy import DraftLengthPolicy


class RoundRecord(Protocol):
    """A loaded draft's acceptance over every request (``DraftModel``, ``HeadDraft``)."""

    def record(self, drafted: int, accepted: int) -> None: ...


class PolicyDrafter:
    """A drafter whose draft length ``policy`` decides. Its subclass sets
    ``draft`` (told each drafted round's outcome; None: no draft loaded), drafts,
    and notes ``catch_up``, the tokens its model processed before this round's
    drafts (a round that first caught up on tokens decoded without it is not
    timed: ``DraftLengthPolicy.observe``)."""

    draft: RoundRecord | None

    def __init__(self, policy: DraftLengthPolicy):
        self.policy = policy
        self.catch_up = 0
        self.proposed = False  # the length of the round observed next was decided (num_tokens ran)
        self.kept: tuple[mx.array, list[int]] | None = None  # predictions to score, the tokens decoded there

    @property
    def acceptance(self) -> speedup.AcceptanceModel:
        return self.policy.acceptance

    @property
    def round_costs(self) -> costs.RoundCosts | None:
        return self.policy.round_costs

    def time_undrafted(self, seconds: float | None) -> None:
        """An undrafted round another drafter (the router's lookup) ran: its time
        teaches this drafter's round costs what an undrafted round costs."""
        self.policy.time_undrafted(seconds)

    def num_tokens(self, limit: int) -> int:
        """The next round's draft length (0: undrafted), decided by the policy."""
        self.proposed = True
        return self.policy.num_tokens(limit)

    def keep_predictions(self, predicted: mx.array, actual: list[int]) -> None:
        """Keep the model's greedy ``predicted`` tokens (queued, not read) at
        positions where ``actual`` were decoded, to score them when the round is
        observed."""
        mx.async_eval(predicted)
        self.kept = (predicted, actual)

    def observe(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """A verify round's outcome (the loop's ``Drafter.observe``)."""
        if not self.proposed:  # a round the loop queued ahead (plain_ahead)
            self.policy.skip()
        self.proposed = False
        if self.kept is not None:  # positions before this round's
            predicted, actual = self.kept
            self.kept = None
            self.policy.observe_scored([p == a for p, a in zip(predicted.tolist(), actual)])
        if drafted and self.draft is not None:
            self.draft.record(drafted, accepted)
        self.policy.observe(drafted, accepted, seconds, catch_up=self.catch_up)
        self.catch_up = 0
