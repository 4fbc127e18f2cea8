"""The auto router's proposers, one per mode (routing.Mode): each drafts a
round from the ledger and the evidence as they stand, and returns what it drafted
and how (a ``Proposal``); the router (router.py) keeps the record. Lookup is
asked through its query (``match``) after its explicit ``record`` step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from ..decode.protocol import Drafts
from ..pricing import costs
from ..pricing.batch_pricing import strength_acceptance
from ..pricing.speedup import best_draft_length
from .prompt_lookup import Match, PromptLookupDrafter
from .routing import (
    DraftRecord,
    Evidence,
    Ledger,
    Mode,
    RouterSettings,
    draft_speedup,
    is_weak,
    lookup_beside_draft,
    lookup_earns,
    lookup_length,
    rejection_bound,
)


class DraftDrafter(DraftRecord, Protocol):
    """The draft-model (or head) drafter as the proposers use it."""

    def propose(self, history: list[int], limit: int) -> Drafts: ...


class Proposal(NamedTuple):
    """A round's drafts; ``by``: the drafter that made them when not the
    mode's own ("lookup" or "draft_model"); ``weak``: drafted from a weak
    match; ``lookup_k``: lookup's draft length from here (None: as it was)."""

    drafts: Drafts
    by: str | None = None
    weak: bool = False
    lookup_k: int | None = None


class Round(NamedTuple):
    """What a proposer works with: the request's ledger, the evidence now, the
    settings, and the drafters (``draft`` None: no draft model loaded)."""

    ledger: Ledger
    ev: Evidence
    s: RouterSettings
    lookup: PromptLookupDrafter
    draft: DraftDrafter | None


def propose_probe(r: Round, history: list[int], limit: int) -> Proposal:
    """Lookup on trial: its match at the probe's length (longer for a strong
    match); a weak match only where weak matches pay; a round lookup does not
    draft is the draft model's (``draft_turn``)."""
    m = r.lookup.propose_match(history, limit)
    drafts = m.drafts[: probe_length(r, len(m.drafts), m.strength)]
    weak = is_weak(Match(drafts, m.strength), r.s)
    if weak:
        # As in lookup's own rounds, a weak match that does not pay drafts nothing.
        drafts = drafts[: weak_probe_length(r, len(drafts))]
        weak = bool(drafts)
    if not drafts and r.draft is not None:
        return draft_turn(r, history, limit, weak)
    return Proposal(drafts, weak=weak)


def propose_lookup(r: Round, history: list[int], limit: int) -> Proposal:
    """Each round the length with the best expected speed-up, within the
    rejection bound: from lookup's acceptance in this request (alone at least
    one token: leaving lookup is ``decide``'s call; in a batch a round that does
    not pay drafts nothing) or, for a weak match, from weak matches' acceptance
    (none when they do not pay). A round lookup does not draft is the draft
    model's (``draft_turn``)."""
    r.lookup.record(history)
    max_k = rejection_bound(r.ledger, r.s)
    m = r.lookup.match(history, min(max_k, limit))
    if max_k > rejection_bound(r.ledger, r.s, floor=0):  # the floor raised the bound: a strong match keeps it
        max_k = rejection_bound(r.ledger, r.s, rejection_floor(r, m))
    weak = is_weak(m, r.s)
    if weak:
        k = lookup_length(r.ledger.weak, max_k, r.ev)[0]
    else:
        k = lookup_length(r.ledger.lookup_acceptance, max_k, r.ev, min_k=int(r.ev.lookup.rows == 1))[0]
    drafts = m.drafts[:k]
    if not drafts and r.draft is not None:
        return draft_turn(r, history, limit, weak)._replace(lookup_k=k)
    return Proposal(drafts, weak=weak, lookup_k=k)


def propose_draft_model(r: Round, history: list[int], limit: int) -> Proposal:
    """The draft model's round, or lookup's where lookup's record on this
    request expects more from it (``lookup_instead``)."""
    if drafts := lookup_instead(r, history, limit):
        return Proposal(drafts, by="lookup")
    return Proposal(r.draft.propose(history, limit))


def propose_plain(r: Round, history: list[int], limit: int) -> Proposal:
    """Plain decoding drafts nothing (the router still makes its shadow draft)."""
    return Proposal([])


#: The proposer of each mode.
PROPOSERS: dict[Mode, Callable[[Round, list[int], int], Proposal]] = {
    Mode.PROBE: propose_probe,
    Mode.PROMPT_LOOKUP: propose_lookup,
    Mode.DRAFT_MODEL: propose_draft_model,
    Mode.PLAIN: propose_plain,
}


def probe_length(r: Round, available: int, strength: int) -> int:
    """A probe round's length: ``lookup_k`` (growing while drafts are
    accepted whole), or longer where the match is so strong that its expected
    acceptance (strength_acceptance) pays for a longer draft: a copy is then
    drafted at full length from its first round. In a batch, at most what
    pays for the batch."""
    if not available:
        return 0
    strong = best_draft_length(strength_acceptance(strength), r.ev.lookup_costs, available)[0]
    k = min(available, max(r.ledger.lookup_k, strong))
    if r.ev.lookup.rows > 1:
        # In a batch the probe's drafts widen every row's pass: only what pays for the batch.
        k = min(k, lookup_length(r.ledger.lookup_acceptance, k, r.ev)[0])
    return k


def rejection_floor(r: Round, m: Match) -> int:
    """The rejection bound's floor for the match ``m``: the length, up to
    ``lookup_rejection_floor``, that its expected acceptance (strength_acceptance)
    pays for. The whole floor for a strong match (a quote resuming after a
    deviation); less, or none, for a short one (JSON keys, a repeated phrase),
    which the rejection bound alone then caps (docs/decoding.md, "Tuning history")."""
    most = min(r.s.lookup_rejection_floor, len(m.drafts))
    return best_draft_length(strength_acceptance(m.strength), r.ev.lookup_costs, most)[0]


def weak_probe_length(r: Round, available: int) -> int:
    """A probe round's length from a weak match: none where weak matches do
    not pay; the probe's whole length until a weak match has missed in this
    request (a copy often starts from one, and a long first draft reaches it
    at once); after that, what weak matches' record pays for, so fresh text
    whose one-token matches keep missing is not verified 32 drafts at a time."""
    weak = r.ledger.weak
    k = lookup_length(weak, available, r.ev)[0]
    if k and weak.accepted == weak.drafted:
        return available  # no weak match has missed yet
    return k


def draft_turn(r: Round, history: list[int], limit: int, weak: bool) -> Proposal:
    """A probe or lookup round that lookup does not draft (no match, or one
    that does not pay): the draft model's, at the length its own record
    chooses, if some length pays; else a plain round. No exploration drafts
    here: they belong to the draft model's own mode (docs/decoding.md,
    "Tuning history")."""
    d = r.draft
    if d.round_costs is not None and best_draft_length(d.acceptance, d.round_costs, costs.MAX_MODEL_DRAFT)[0] == 0:
        return Proposal([], weak=weak)
    return Proposal(d.propose(history, limit), by="draft_model", weak=weak)


def lookup_instead(r: Round, history: list[int], limit: int) -> list[int]:
    """While the draft model runs, this round's lookup draft when lookup's
    record on this request (its shadow drafts, which also score the rounds
    this returns) expects more from it than the draft model's record from a
    round of its own; else nothing. Per round, so a good draft still gives way
    to lookup on the copied lines of an answer and keeps the rest."""
    if not lookup_earns(r.ledger, r.ev, r.s):
        return []
    r.lookup.record(history)
    m = r.lookup.match(history, min(rejection_bound(r.ledger, r.s), limit))
    if not m.drafts or is_weak(m, r.s):
        return []
    shadows = r.ledger.shadows
    k, speedup = best_draft_length(shadows.record, lookup_beside_draft(r.ev), len(m.drafts))
    evidence = r.s.thin(shadows.positions)
    return m.drafts[:k] if k and speedup > evidence * max(1.0, draft_speedup(r.ev)) else []
