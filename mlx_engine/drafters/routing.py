"""The auto router's rules: its modes, the switches it may make
(``TRANSITIONS``), its thresholds (``RouterSettings``), the evidence it keeps
(``Ledger``: what each drafter proposed and what was accepted, per mode and per
request) and ``decide``, the one pure function that chooses the mode after each
round from the ledger and that round's ``Evidence``. The router (router.py)
applies the ``Decision``; the proposers (proposers.py) draft in each mode.

docs/decoding.md ("The auto router") gives each rule and the measurements that
chose it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

from ..pricing import costs
from ..pricing.batch_pricing import LookupPricing
from ..pricing.speedup import AcceptanceModel, best_draft_length
from .policy import rejection_cap
from .prompt_lookup import Match
from .shadow import ShadowLookup


class Mode(StrEnum):
    """The router's modes. ``PROBE`` is prompt lookup on trial (short drafts,
    growing while accepted whole); the others draft as their names say."""

    PROBE = "probe"
    PROMPT_LOOKUP = "prompt_lookup"
    DRAFT_MODEL = "draft_model"
    PLAIN = "plain"


#: Every switch the router makes, with the rule that makes it (docs/decoding.md,
#: "The auto router"). ``decide`` and ``Ledger.enter`` refuse any other.
TRANSITIONS: dict[tuple[Mode | None, Mode], str] = {
    (None, Mode.PROBE): "the prompt passes the pre-filter: lookup is probed",
    (None, Mode.DRAFT_MODEL): "too short or sparse for lookup, a draft model loaded",
    (None, Mode.PLAIN): "too short or sparse for lookup, no draft model",
    (Mode.PROBE, Mode.PROMPT_LOOKUP): "the probe's acceptance passes commit_acceptance and a length pays",
    (Mode.PROBE, Mode.DRAFT_MODEL): "the probe ends without that, a draft model loaded",
    (Mode.PROBE, Mode.PLAIN): "the probe ends without that, no draft model",
    (Mode.PROMPT_LOOKUP, Mode.DRAFT_MODEL): "no lookup length pays any more, nothing was drafted in "
    "idle_lookup_rounds rounds, or lookup delivers less than the draft model it replaced",
    (Mode.PROMPT_LOOKUP, Mode.PLAIN): "no lookup length pays any more, or nothing was drafted in idle_lookup_rounds "
    "rounds; no draft model",
    (Mode.PLAIN, Mode.PROMPT_LOOKUP): "shadow lookup drafts promise clearly more than plain decoding",
    (Mode.DRAFT_MODEL, Mode.PROMPT_LOOKUP): "shadow lookup drafts promise clearly more than the draft model",
}


@dataclass(frozen=True)
class RouterSettings:
    """The router's thresholds (docs/decoding.md, "The auto router", says how
    each was chosen)."""

    # The pre-filter: below these, no probe (0: every prompt is probed; a probe
    # finding nothing to copy drafts nothing and costs nothing).
    min_prompt_tokens: int = 0
    min_density: float = 0.0
    probe_tokens: int = 16
    probe_max_misses: int = 4
    probe_draft_tokens: int = 4
    # Lookup's drafts after a rejection are at least this long (rejection_cap's
    # floor) where the match is strong enough to pay for it (proposers.rejection_floor):
    # a bound of 4 split a quote's copied spans of 5-8 tokens between deviations
    # into two rounds; on a short match (JSON keys) 8 drafts were mostly rejected.
    lookup_rejection_floor: int = 8
    # With a draft model loaded the probe drafts lookup's whole match from its
    # first round: a round lookup does not draft is the draft model's anyway,
    # and a 33-token verify costs little more than a 5-token one on these CPUs
    # (docs/decoding.md, "Tuning history").
    probe_draft_tokens_with_draft: int = 32
    commit_acceptance: float = 0.30
    watch_rounds: int = 6  # rounds of evidence before a mode may be dropped
    # Lookup's mode is left after this many rounds in a row that drafted nothing
    # (lookup found no match that pays, the draft model none either): alone, such a
    # round is built only after the previous one is read, where the fallback
    # mode's idle rounds are queued ahead as plain decoding queues them.
    idle_lookup_rounds: int = 8
    shadow_rounds: int = 3  # shadow draft positions decided before plain may switch to lookup
    switch_margin: float = 1.1  # how much better shadow lookup must look to switch to it
    # The switch margin grows on thin evidence, x(1 + thin_evidence / positions
    # decided): one shadow matching a short phrase must not look like copying.
    thin_evidence: float = 1.0
    probe_growth: int = 8  # a probe draft accepted whole makes the next one this many times longer
    # A lookup match this weak or weaker (prompt_lookup.Match.strength: one
    # matching token, no agreeing context before it) gets its own acceptance
    # record, starting from weak_match_prior, because such matches are accepted far
    # less often than the request's others: where verifying costs as on a CPU, lookup
    # then skips them (a plain round) instead of drafting what the others justify.
    weak_match: int = 1
    weak_match_prior: float = 0.25

    def thin(self, positions: int) -> float:
        """How much a threshold grows when ``positions`` decided draft
        positions are its evidence: x(1 + thin_evidence / positions)."""
        return 1 + self.thin_evidence / positions


class DraftRecord(Protocol):
    """What the rules read of the draft-model (or head) drafter: its record on
    this request and its rounds' times."""

    @property
    def acceptance(self) -> AcceptanceModel: ...

    @property
    def round_costs(self) -> costs.RoundCosts | None: ...


class Evidence(NamedTuple):
    """What the rules price with now, and the round just observed: lookup
    rounds priced for the batch as it is (``LookupPricing``), lookup rounds'
    learned times alone, the draft drafter's record (None: no draft model), and
    the round: which drafter made it when not the mode's own (``by``: "lookup"
    or "draft_model"), its drafts and accepted drafts."""

    lookup: LookupPricing
    lookup_costs: costs.RoundCosts
    draft: DraftRecord | None = None
    by: str | None = None
    drafted: int = 0
    accepted: int = 0

    @classmethod
    def alone(cls, lookup_costs: costs.RoundCosts, draft: DraftRecord | None = None, **round_) -> Evidence:
        """Evidence for a request decoding alone (no batch beside it)."""
        return cls(LookupPricing(lookup_costs, 1, []), lookup_costs, draft, **round_)


class Decision(NamedTuple):
    """``decide``'s answer: the mode from here and, for a switch, why (empty:
    no switch). ``lookup_k``: lookup's draft length from here (None: as it
    was). ``record``: entering lookup, its acceptance record (the probe's, or
    the shadows'); leaving it, the shadow record's first evidence (None: a
    fresh one). ``replaced``: entering lookup from the draft model, the draft
    model's expected speed-up. ``exit_counted``: lookup left because no length
    paid (``Ledger.lookup_exits``); ``retire``: no more switches to lookup;
    ``halve``: lookup's counts are halved to keep the evidence recent."""

    mode: Mode
    why: str = ""
    lookup_k: int | None = None
    record: AcceptanceModel | None = None
    replaced: float | None = None
    exit_counted: bool = False
    retire: bool = False
    halve: bool = False


@dataclass
class Ledger:
    """The router's evidence on one request: counts of the running mode's
    rounds (reset by each switch), lookup's records, the shadow drafts, and what
    holds for the whole request (the weak-match record, the rejection bound,
    lookup's exits). ``facts`` describe the prompt for the first mode's reason."""

    max_lookup: int
    lookup_k: int
    lookup_allowed: bool = True
    facts: str = ""
    mode: Mode | None = None
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tried: int = 0  # draft positions up to each round's first rejection: what acceptance is a rate of
    produced: int = 0
    misses: int = 0
    idle_run: int = 0  # lookup-mode rounds in a row that drafted nothing
    lookup_acceptance: AcceptanceModel = field(default_factory=lambda: AcceptanceModel(prior=0.5))
    # Lookup's own rounds only (lookup_acceptance may start from the shadow's).
    lookup_own: AcceptanceModel = field(default_factory=lambda: AcceptanceModel(prior=0.5))
    shadows: ShadowLookup = field(default_factory=ShadowLookup)  # what lookup would have drafted meanwhile
    # Weak lookup matches' acceptance (RouterSettings.weak_match), from their
    # rounds and shadows in every mode of this request.
    weak: AcceptanceModel = field(default_factory=lambda: AcceptanceModel(prior=RouterSettings.weak_match_prior))
    cap_at: int | None = None  # rejection_cap's argument: a + 1 after a rejection, k after k accepted
    # Shadow drafts are scored where the draft model's rounds start, not where
    # lookup's own would: they can promise more than lookup then gets. So a
    # switch from the draft model is checked against what it replaced, and one
    # that does not deliver is not made again in this request.
    replaced_draft_speedup: float | None = None
    lookup_retired: bool = False
    lookup_exits: int = 0  # times lookup was left because no length paid

    def enter(self, d: Decision) -> None:
        """Switch to ``d.mode``: the mode's counts start over, carrying what ``d`` says."""
        if (self.mode, d.mode) not in TRANSITIONS:
            raise AssertionError(f"router: no transition {self.mode} -> {d.mode}")
        if d.retire:
            self.lookup_retired, self.replaced_draft_speedup = True, None
        self.lookup_exits += d.exit_counted
        self.mode = d.mode
        self.rounds = self.drafted = self.accepted = self.tried = self.produced = self.misses = self.idle_run = 0
        self.lookup_acceptance, self.lookup_own = AcceptanceModel(prior=0.5), AcceptanceModel(prior=0.5)
        self.shadows = ShadowLookup()
        if d.mode == Mode.PROMPT_LOOKUP:
            self.lookup_acceptance = d.record if d.record is not None else self.lookup_acceptance
            self.replaced_draft_speedup = d.replaced
        elif d.record is not None:
            # Lookup's rounds stay the shadow record's first evidence, so a switch
            # back needs what lookup failed to deliver to change (docs/decoding.md).
            self.shadows = ShadowLookup(d.record)

    def count(self, by: str | None, drafted: int, accepted: int, weak: bool) -> None:
        """Count a verified round: ``by`` the drafter that made it when not the
        mode's own, ``weak`` whether it drafted from a weak match."""
        lookup_mode = self.mode in (Mode.PROBE, Mode.PROMPT_LOOKUP)
        if self.mode == Mode.PROMPT_LOOKUP:
            self.idle_run = 0 if drafted else self.idle_run + 1
        if by == "draft_model":
            # The probe counts a draft-model round's tokens, so a probe that finds nothing to copy still ends.
            self.produced += (accepted + 1) * (self.mode == Mode.PROBE)
            return
        if drafted and (by == "lookup" or lookup_mode):
            # As for the draft model, the next draft is capped (policy.rejection_cap):
            # after a rejection, and after a round that accepted all its k drafts
            # (positions twice as deep are untried; a resumed copy's short round
            # accepted whole had drafted 24 more, all rejected).
            self.cap_at = accepted + 1 if accepted < drafted else drafted
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.tried += min(drafted, accepted + 1)
        self.produced += accepted + 1
        self.misses = self.misses + 1 if accepted == 0 else 0
        if lookup_mode:
            if weak:
                self.weak.observe(drafted, accepted)
            self.lookup_acceptance.observe(drafted, accepted)
        if self.mode == Mode.PROMPT_LOOKUP:
            self.lookup_own.observe(drafted, accepted)

    def use_length(self, k: int) -> None:
        """Lookup's draft length from here, as its proposer chose it this round."""
        self.lookup_k = k

    def take(self, d: Decision) -> None:
        """Apply ``decide``'s decision (a switch through ``enter``)."""
        if d.why:
            self.enter(d)
        if d.lookup_k is not None:
            self.lookup_k = d.lookup_k
        if d.halve:
            self.rounds //= 2
            self.drafted //= 2
            self.accepted //= 2


# -- pricing, for the rules and the proposers -------------------------------
def lookup_length(acceptance: AcceptanceModel, max_k: int, ev: Evidence, min_k: int = 0) -> tuple[int, float]:
    """The lookup length that pays best at this acceptance, and its speed-up,
    priced for the batch the request is in (with its rows drafting beside it)."""
    p = ev.lookup
    return best_draft_length(acceptance, p.rounds, max_k, min_k, rows=p.rows, beside=p.beside)


def draft_speedup(ev: Evidence) -> float:
    """The draft model's expected speed-up from its record on this request."""
    return best_draft_length(ev.draft.acceptance, ev.draft.round_costs, costs.MAX_MODEL_DRAFT)[1]


def lookup_beside_draft(ev: Evidence) -> list[float]:
    """Lookup rounds' times while the draft model runs: lookup's own line
    comes from the short-context measurement or a few probe rounds; the draft's
    rounds, timed here and now, less the draft model's work, keep it from being
    priced under what its rounds cost at long contexts (docs/decoding.md)."""
    return [max(a, b) for a, b in zip(ev.lookup_costs.table(), ev.draft.round_costs.without_drafting())]


def lookup_earns(ledger: Ledger, ev: Evidence, s: RouterSettings) -> bool:
    """Whether lookup's record on this request (enough decided shadow
    positions) makes some lookup length pay beside the draft model."""
    if ledger.shadows.positions < s.shadow_rounds or ledger.lookup_retired:
        return False
    return best_draft_length(ledger.shadows.record, lookup_beside_draft(ev), ledger.max_lookup)[0] > 0


def is_weak(m: Match, s: RouterSettings) -> bool:
    """Whether lookup's drafts ``m`` come from a weak match (RouterSettings.weak_match)."""
    return bool(m.drafts) and m.strength <= s.weak_match


def probe_start(max_lookup: int, with_draft: bool, s: RouterSettings) -> int:
    """The probe's first lookup draft length (RouterSettings)."""
    return min(s.probe_draft_tokens_with_draft if with_draft else s.probe_draft_tokens, max_lookup)


def rejection_bound(ledger: Ledger, s: RouterSettings, floor: int | None = None) -> int:
    """The longest lookup draft after the last rejection (policy.rejection_cap),
    at least ``floor`` (None: ``lookup_rejection_floor``)."""
    return rejection_cap(ledger.cap_at, ledger.max_lookup, s.lookup_rejection_floor if floor is None else floor)


# -- the decision ------------------------------------------------------------
def decide(ledger: Ledger, ev: Evidence, s: RouterSettings = RouterSettings(), table: dict = TRANSITIONS) -> Decision:
    """The mode after the round ``ev`` describes (the ledger already counts it),
    or the request's first mode (a ledger with no mode yet). Pure: it reads the
    ledger and the evidence and changes neither; every switch is in ``table``."""
    if ledger.mode is None:
        d = _first_mode(ledger, ev)
    elif ledger.mode == Mode.PROBE:
        d = _after_probe_round(ledger, ev, s)
    elif ledger.mode == Mode.PROMPT_LOOKUP:
        d = _watch_lookup(ledger, ev, s)
    else:
        d = _consider_lookup(ledger, ev, s)
    if d.why and (ledger.mode, d.mode) not in table:
        raise AssertionError(f"router: no transition {ledger.mode} -> {d.mode}")
    return d


def _first_mode(ledger: Ledger, ev: Evidence) -> Decision:
    """The request's first mode, from the prompt's facts and whether a draft model is loaded."""
    facts = ledger.facts
    if ledger.lookup_allowed:
        # With a draft model, the probe's rounds that lookup has nothing to
        # draft for are the draft model's, so the probe costs a verify pass only
        # where lookup's own draft misses, and finds copying at once
        # (docs/decoding.md, "Auto with a draft loaded").
        also = "; the draft model drafts the rounds lookup has nothing for" if ev.draft is not None else ""
        return Decision(Mode.PROBE, f"{facts}: probing prompt lookup{also}")
    if ev.draft is not None:
        return Decision(Mode.DRAFT_MODEL, f"{facts}: prompt too short or sparse for lookup; draft model loaded")
    return Decision(Mode.PLAIN, f"{facts}: prompt too short or sparse for lookup")


def _fallback(ev: Evidence) -> Mode:
    return Mode.DRAFT_MODEL if ev.draft is not None else Mode.PLAIN


def _lookup_speedup(ledger: Ledger, ev: Evidence) -> tuple[int, float, float]:
    # Per position tried, not per token drafted: positions past a round's first
    # rejection were never tried, and how many there were depends on the draft
    # lengths the costs chose (docs/decoding.md, "Tuning history").
    rate = ledger.accepted / ledger.tried if ledger.tried else 0.0
    k, speedup = lookup_length(ledger.lookup_acceptance, ledger.max_lookup, ev)
    return k, speedup, rate


def _probe_k(ledger: Ledger, ev: Evidence, s: RouterSettings) -> int:
    """The probe's next draft length after a round of its own."""
    if ev.by == "draft_model" or not ev.drafted:
        return ledger.lookup_k
    if ev.accepted == ev.drafted:
        # Copying from the first drafts on: a fixed 32 drafts 33 tokens a
        # round from there, so reach it at once, not after the probe.
        return min(ledger.max_lookup, ledger.lookup_k * s.probe_growth)
    # A copy that ended: back to the rejection bound (as lookup's own rounds).
    start = probe_start(ledger.max_lookup, ev.draft is not None, s)
    return max(rejection_cap(ev.accepted + 1, ledger.lookup_k, s.lookup_rejection_floor), start)


def _after_probe_round(ledger: Ledger, ev: Evidence, s: RouterSettings) -> Decision:
    grown = _probe_k(ledger, ev, s)
    if ledger.produced < s.probe_tokens and ledger.misses < s.probe_max_misses:
        return Decision(Mode.PROBE, lookup_k=grown)
    k, speedup, rate = _lookup_speedup(ledger, ev)
    facts = (
        f"probe acceptance {rate:.0%} of {ledger.tried} positions tried ({ledger.accepted} of {ledger.drafted} "
        f"drafted), expected speed-up x{speedup:.2f} at k={k}"
    )
    if k > 0 and (_probe_rate_commits(ledger, rate, s) or _probe_beats_draft(ledger, ev, speedup, s)):
        # The probe's rounds are lookup's first evidence (docs/decoding.md, "Tuning history").
        return Decision(Mode.PROMPT_LOOKUP, facts, lookup_k=k, record=ledger.lookup_acceptance)
    return Decision(_fallback(ev), facts, lookup_k=grown, record=ledger.lookup_acceptance)


def _probe_rate_commits(ledger: Ledger, rate: float, s: RouterSettings) -> bool:
    """Whether the probe's acceptance commits it to lookup: above
    ``commit_acceptance`` grown on thin evidence as the switch margin is
    (x(1 + thin_evidence / positions tried)), on at least ``shadow_rounds``
    positions, as a switch from plain decoding on shadow drafts needs. One
    draft accepted of two or three tried is what a short match in new text
    gives: such probes committed and then decoded plainly through lookup's
    idle rounds (docs/decoding.md, "Tuning history")."""
    if ledger.tried < s.shadow_rounds:
        return False
    return rate > s.commit_acceptance * s.thin(ledger.tried)


def _probe_beats_draft(ledger: Ledger, ev: Evidence, lookup_speedup: float, s: RouterSettings) -> bool:
    """With a draft model loaded, whether the probe's record (per draft
    position) expects clearly more from lookup than the draft model's record
    on this request expects from it: a copy whose one long draft ran past
    its end has a low token rate, yet its rounds' first tokens pay
    (docs/decoding.md, "Tuning history")."""
    if ev.draft is None or not ledger.drafted:
        return False  # on the prior alone (a probe that drafted nothing) lookup has no record
    return lookup_speedup > s.switch_margin * max(1.0, draft_speedup(ev))


def _watch_lookup(ledger: Ledger, ev: Evidence, s: RouterSettings) -> Decision:
    """Lookup's mode is left after ``idle_lookup_rounds`` rounds in a row drafted
    nothing (not counted as lookup not paying), or when no length pays; a switch
    from the draft model is checked against what it replaced. Otherwise the
    length that pays best, the counts halved now and then to stay recent."""
    if ledger.idle_run >= s.idle_lookup_rounds:
        return Decision(_fallback(ev), f"nothing drafted in {ledger.idle_run} rounds", record=ledger.lookup_own)
    if ev.by == "draft_model" or ledger.rounds < s.watch_rounds or ledger.drafted == 0:
        return Decision(Mode.PROMPT_LOOKUP)
    k, speedup, rate = _lookup_speedup(ledger, ev)
    if k == 0:
        # Each time lookup did not pay, a switch back needs twice the shadow
        # evidence: on text that copies in snatches (a summary) shadows keep
        # promising a little, and every round trip costs watch_rounds rounds.
        why = f"lookup acceptance fell to {rate:.0%}; no draft length pays"
        return Decision(_fallback(ev), why, record=ledger.lookup_own, exit_counted=True)
    if (replaced := ledger.replaced_draft_speedup) is not None:
        # Only a switch from the draft model is checked: against what it replaced.
        delivered = lookup_length(ledger.lookup_own, ledger.max_lookup, ev)[1]
        if delivered * s.switch_margin < replaced:
            why = (
                f"lookup delivers x{delivered:.2f} ({rate:.0%} accepted) against the draft model's "
                f"x{replaced:.2f}; no more switches to lookup in this request"
            )
            return Decision(Mode.DRAFT_MODEL, why, retire=True)
    # Keep the evidence recent so a change in the text is noticed.
    return Decision(Mode.PROMPT_LOOKUP, lookup_k=k, halve=ledger.rounds >= 4 * s.watch_rounds)


def _consider_lookup(ledger: Ledger, ev: Evidence, s: RouterSettings) -> Decision:
    """Switch to prompt lookup when its shadow record promises clearly more
    than the running mode (plain decoding or the draft model)."""
    stay = Decision(ledger.mode)
    in_draft = ledger.mode == Mode.DRAFT_MODEL
    # From plain decoding a switch gains more than from the draft model, and
    # the draft model's switches were tuned with watch_rounds: keep them so.
    needed = s.watch_rounds if in_draft else s.shadow_rounds << min(ledger.lookup_exits, 5)
    shadows = ledger.shadows
    # Evidence is counted in decided positions: one shadow matching three
    # tokens in a row says as much as three matching their first.
    if shadows.positions < needed or (in_draft and ledger.lookup_retired):
        return stay
    current = 1.0
    if in_draft:
        current = draft_speedup(ev)
        k, speedup = best_draft_length(shadows.record, lookup_beside_draft(ev), ledger.max_lookup)
    else:
        k, speedup = lookup_length(shadows.record, ledger.max_lookup, ev)
    margin = s.switch_margin * s.thin(shadows.positions)
    if not (k and speedup > margin * current):
        return stay
    why = (
        f"{shadows.scored} shadow drafts ({shadows.positions} positions) scored, lookup would have had "
        f"{shadows.record.conditional()[0]:.0%} of "
        f"their first tokens accepted: expected speed-up x{speedup:.2f} at k={k} against x{current:.2f}"
    )
    return Decision(Mode.PROMPT_LOOKUP, why, lookup_k=k, record=shadows.record, replaced=current if in_draft else None)
