"""The automatic speculative router: per request, and again during a long
generation, it picks plain decoding, prompt lookup or the draft model, whichever
is expected to give the most tokens per second on this machine.

Without a draft model, a probe of up to 16 tokens with prompt lookup that stops
after 4 consecutive misses, its draft growing 4x each time it is accepted whole;
commit to prompt lookup above 30% acceptance (with a draft model, also when
lookup's record expects more than the draft model's). With a draft model loaded, the
drafter is chosen per round: the probe's rounds and lookup's that lookup would
not draft are the draft model's, and while the draft model runs, a round drafts
from lookup when lookup's record on this request (its shadow drafts, below)
expects more from it. Beyond it:
acceptance is turned into expected speed with the kit's measured verify costs
(and the draft model's step cost), the draft length is the one with the best
expected speed, and acceptance keeps being watched so the mode switches when it no
longer pays. While another mode runs, what lookup would have drafted is scored
against the actual output (shadow drafts), so the router moves to lookup when the
text starts repeating itself. Probe tokens are real output; nothing is recomputed.

docs/decoding.md ("The auto router") gives each rule and the measurements that
chose it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from ..decode.loop import Drafts
from ..pricing import costs
from ..pricing.batch_pricing import COPYING, BatchPricing, LookupPricing, strength_acceptance
from ..pricing.speedup import AcceptanceModel, best_draft_length
from .draft_model import DraftModelDrafter
from .policy import rejection_cap
from .prompt_lookup import Match, PromptLookupDrafter, density_score
from .shadow import ShadowLookup, teach

logger = logging.getLogger(__name__)


class Mode(StrEnum):
    """The router's modes. ``PROBE`` is prompt lookup on trial (short drafts,
    growing while accepted whole); the others draft as their names say."""

    PROBE = "probe"
    PROMPT_LOOKUP = "prompt_lookup"
    DRAFT_MODEL = "draft_model"
    PLAIN = "plain"


#: Every switch the router makes, with the rule that makes it (docs/decoding.md,
#: "The auto router"). ``_enter`` refuses any other.
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
    # floor): a lookup draft costs little per token, and a bound of 4 split a
    # quote's copied spans of 5-8 tokens between deviations into two rounds.
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


class AutoRouter:
    """A drafter that delegates each round to the chosen mode."""

    name = "auto"

    def __init__(
        self,
        prompt: list[int],
        verify_costs: costs.CostModel,
        lookup: PromptLookupDrafter,
        draft_drafter: DraftModelDrafter | None = None,
        settings: RouterSettings = RouterSettings(),
        batch: BatchPricing | None = None,
        on_round: Callable[[int, float | None], None] | None = None,
    ):
        self.lookup_costs = costs.RoundCosts(verify_costs)  # a lookup draft costs nothing to make
        # Told each timed round without draft-model steps: (tokens verified, seconds),
        # so the kit's forward costs follow what rounds cost (cost_book.py).
        self.on_round = on_round
        self.verify_costs = verify_costs
        # The batch this request decodes in: its rows now, and the board of what
        # its lookup rows can draft (None: alone).
        self.batch = batch
        # The router's report, for the request's stats: the mode it is in, why it
        # entered the first one, and every switch since ("previous -> mode: why").
        self.decoding_mode = "auto"
        self.mode_reason = ""
        self.mode_switches: list[str] = []
        self.lookup = lookup
        self.draft_drafter = draft_drafter
        self.s = settings
        self.density = density_score(prompt, settings.min_prompt_tokens)
        self.lookup_allowed = len(prompt) >= settings.min_prompt_tokens and self.density >= settings.min_density
        self.max_lookup = lookup.num_tokens
        self.lookup_k = self._probe_start()
        # Shadow drafts are scored where the draft model's rounds start, not
        # where lookup's own would: they can promise more than lookup then gets.
        # So a switch from the draft model is checked against what it replaced,
        # and one that does not deliver is not made again in this request.
        self._replaced_draft_speedup: float | None = None
        self._lookup_retired = False
        self._rejected_at: int | None = None
        self._history: list[int] | None = None  # the loop's history (the list it extends)
        self._proposed = False  # propose ran for the round being observed
        # With a draft model loaded, which drafter made the round being observed
        # when it is not the mode's own: "lookup" (a lookup round inside the draft
        # model's mode) or "draft_model" (a draft round inside lookup's).
        self._round_by: str | None = None
        self._lookup_exits = 0  # times lookup was left because no length paid
        # Weak lookup matches' acceptance (RouterSettings.weak_match), from
        # their rounds and shadows in every mode of this request.
        self.weak = AcceptanceModel(prior=settings.weak_match_prior)
        self._round_weak = False  # the round being observed drafted from a weak match
        self._copying = False  # this round's strongest possible match is a copy's (_post)
        self._reset_evidence()
        self._enter_first_mode(
            f"prompt {len(prompt)} tokens, density {self.density:.2f}, costs {verify_costs.summary()}"
        )

    def _enter_first_mode(self, facts: str) -> None:
        """The request's first mode, from the prompt's facts and whether a draft model is loaded."""
        draft_drafter = self.draft_drafter
        if self.lookup_allowed:
            # With a draft model, the probe's rounds that lookup has nothing to
            # draft for are the draft model's, so the probe costs a verify pass only
            # where lookup's own draft misses, and finds copying at once
            # (docs/decoding.md, "Auto with a draft loaded").
            also = "; the draft model drafts the rounds lookup has nothing for" if draft_drafter is not None else ""
            self._enter(Mode.PROBE, f"{facts}: probing prompt lookup{also}")
        elif draft_drafter is not None:
            self._enter(Mode.DRAFT_MODEL, f"{facts}: prompt too short or sparse for lookup; draft model loaded")
        else:
            self._enter(Mode.PLAIN, f"{facts}: prompt too short or sparse for lookup")

    # -- bookkeeping -------------------------------------------------------
    def _reset_evidence(self) -> None:
        self.rounds = self.drafted = self.accepted = self.produced = self.misses = 0
        self.idle_run = 0  # lookup-mode rounds in a row that drafted nothing
        self.lookup_acceptance = AcceptanceModel(prior=0.5)
        # Lookup's own rounds only (lookup_acceptance may start from the shadow's).
        self.lookup_own = AcceptanceModel(prior=0.5)
        self.shadows = ShadowLookup()  # what lookup would have drafted meanwhile (shadow.py)

    def _enter(self, mode: Mode, why: str) -> None:
        previous = getattr(self, "mode", None)
        if (previous, mode) not in TRANSITIONS:
            raise AssertionError(f"router: no transition {previous} -> {mode}")
        self.mode = mode
        self._reset_evidence()
        label = Mode.PROMPT_LOOKUP if mode == Mode.PROBE else mode
        self.decoding_mode = f"auto:{label}"
        if previous is None:
            self.mode_reason = why
        else:
            self.mode_switches.append(f"{previous} -> {mode}: {why}")
        logger.debug("router: %s (%s)", mode, why)

    # -- drafter interface -------------------------------------------------
    @property
    def hidden_spec(self):
        """The hidden states the draft (a head) reads, recorded by every launch (loop.py)."""
        return getattr(self.draft_drafter, "hidden_spec", None)

    def take_hidden(self, at: int, rows) -> None:
        """A read round's hidden states, for a head drafter."""
        self.draft_drafter.take_hidden(at, rows)

    def plain_ahead(self, history: list[int]) -> bool:
        """True in plain decoding: the loop may then queue each round before the
        previous one is read, as plain decoding does without a router (it skips
        ``propose``; ``observe`` makes the round's shadow draft instead). Without
        this, plain rounds under the router cost a few percent more than plain
        decoding's."""
        self._post(history)
        if self.mode in (Mode.PROBE, Mode.PROMPT_LOOKUP) and self._lookup_pays_nothing():
            # A round lookup does not draft may be the draft model's (_draft_turn).
            return self.draft_drafter is None or self.draft_drafter.plain_ahead(history)
        if self.mode == Mode.DRAFT_MODEL:
            # Not while lookup has earned rounds of its own here: they are chosen in propose.
            return self.draft_drafter.plain_ahead(history) and not self._lookup_earns()
        return self.mode == Mode.PLAIN

    def _lookup_pays_nothing(self) -> bool:
        """Whether, in the batch as it is now, no lookup round of any length pays
        (strong or weak match): such a round drafts nothing, so it is queued
        ahead like a plain round instead of built after the previous one is read
        (which would hold up every row of the batch's next step)."""
        if self._lookup_pricing().rows <= 1:
            return False
        max_k = self.lookup_k if self.mode == Mode.PROBE else self.max_lookup
        return self._best_lookup(self.lookup_acceptance, max_k)[0] == 0 and self._best_lookup(self.weak, max_k)[0] == 0

    def _post(self, history: list[int]) -> None:
        """Tell the batch's other rows what this row's next lookup round can
        reach (batch_pricing.DraftingRows): in a batch and in lookup's modes, where the strongest match it
        can find is a copy's, that match's acceptance, at most what lookup's
        record here expects; otherwise nothing."""
        b = self.batch
        if b is None or b.board is None:
            return
        copying_possible = self.mode in (Mode.PROBE, Mode.PROMPT_LOOKUP) and b.rows() > 1  # alone: no bound per token
        bound = self.lookup.next_strength_bound(history) if copying_possible else 0
        self._copying = bound >= COPYING
        if not self._copying:
            b.withdraw()
            return
        b.post_acceptance(min(strength_acceptance(bound), self.lookup_acceptance.conditional()[0]))

    def propose(self, history: list[int], limit: int) -> Drafts:
        self._history, self._proposed, self._round_by = history, True, None
        if self.mode == Mode.PROMPT_LOOKUP:
            drafts = self._lookup_round(history, limit)
            return self._draft_turn(history, limit) if not drafts and self.draft_drafter is not None else drafts
        if self.mode == Mode.PROBE:
            m = self.lookup.propose_match(history, limit)
            drafts = m.drafts[: self._probe_length(len(m.drafts), m.strength)]
            self._round_weak = self._is_weak(Match(drafts, m.strength))
            if self._round_weak:
                # As in lookup's own rounds, a weak match that does not pay drafts nothing.
                drafts = drafts[: self._weak_probe_length(len(drafts))]
                self._round_weak = bool(drafts)
            return self._draft_turn(history, limit) if not drafts and self.draft_drafter is not None else drafts
        self._shadow_lookup(history)
        if self.mode == Mode.DRAFT_MODEL:
            if drafts := self._lookup_instead(history, limit):
                self._round_by = "lookup"
                return drafts
            return self.draft_drafter.propose(history, limit)
        return []

    def _probe_length(self, available: int, strength: int) -> int:
        """A probe round's length: ``lookup_k`` (growing while drafts are
        accepted whole), or longer where the match is so strong that its expected
        acceptance (strength_acceptance) pays for a longer draft: a copy is then
        drafted at full length from its first round. In a batch, at most what
        pays for the batch."""
        if not available:
            return 0
        strong = best_draft_length(strength_acceptance(strength), self.lookup_costs, available)[0]
        k = min(available, max(self.lookup_k, strong))
        if self._lookup_pricing().rows > 1:
            # In a batch the probe's drafts widen every row's pass: only what pays for the batch.
            k = min(k, self._best_lookup(self.lookup_acceptance, k)[0])
        return k

    def _weak_probe_length(self, available: int) -> int:
        """A probe round's length from a weak match: none where weak matches do
        not pay; the probe's whole length until a weak match has missed in this
        request (a copy often starts from one, and a long first draft reaches it
        at once); after that, what weak matches' record pays for, so fresh text
        whose one-token matches keep missing is not verified 32 drafts at a time."""
        k = self._weak_length(available)
        if k and self.weak.accepted == self.weak.drafted:
            return available  # no weak match has missed yet
        return k

    def _probe_start(self) -> int:
        """The probe's first lookup draft length (RouterSettings)."""
        start = self.s.probe_draft_tokens if self.draft_drafter is None else self.s.probe_draft_tokens_with_draft
        return min(start, self.max_lookup)

    def _draft_turn(self, history: list[int], limit: int) -> Drafts:
        """A probe or lookup round that lookup does not draft (no match, or one
        that does not pay): the draft model's, at the length its own record
        chooses, if some length pays; else a plain round. No exploration drafts
        here: they belong to the draft model's own mode (docs/decoding.md,
        "Tuning history")."""
        d = self.draft_drafter
        if d.round_costs is not None and best_draft_length(d.acceptance, d.round_costs, costs.MAX_MODEL_DRAFT)[0] == 0:
            return []
        self._round_by = "draft_model"
        return d.propose(history, limit)

    def _lookup_instead(self, history: list[int], limit: int) -> list[int]:
        """While the draft model runs, this round's lookup draft when lookup's
        record on this request (its shadow drafts, which also score the rounds
        this returns) expects more from it than the draft model's record from a
        round of its own; else nothing. Per round, so a good draft still gives way
        to lookup on the copied lines of an answer and keeps the rest."""
        if not self._lookup_earns():
            return []
        max_k = rejection_cap(self._rejected_at, self.max_lookup, self.s.lookup_rejection_floor)
        self.lookup.record(history)
        m = self.lookup.match(history, min(max_k, limit))
        if not m.drafts or self._is_weak(m):
            return []
        drafts = m.drafts
        k, speedup = best_draft_length(self.shadows.record, self._lookup_rounds_beside_draft(), len(drafts))
        evidence = 1 + self.s.thin_evidence / self.shadows.positions
        return drafts[:k] if k and speedup > evidence * max(1.0, self._draft_speedup()) else []

    def _lookup_earns(self) -> bool:
        """Whether lookup's record on this request (enough decided shadow
        positions) makes some lookup length pay beside the draft model."""
        if self.shadows.positions < self.s.shadow_rounds or self._lookup_retired:
            return False
        return best_draft_length(self.shadows.record, self._lookup_rounds_beside_draft(), self.max_lookup)[0] > 0

    def _draft_speedup(self) -> float:
        """The draft model's expected speed-up from its record on this request."""
        return best_draft_length(self.draft_drafter.acceptance, self.draft_drafter.round_costs, costs.MAX_MODEL_DRAFT)[
            1
        ]

    def _lookup_rounds_beside_draft(self) -> list[float]:
        """Lookup rounds' times while the draft model runs: lookup's own line
        comes from the short-context measurement or a few probe rounds; the draft's
        rounds, timed here and now, less the draft model's work, keep it from being
        priced under what its rounds cost at long contexts (docs/decoding.md)."""
        return [max(a, b) for a, b in zip(self.lookup_costs.table(), self.draft_drafter.round_costs.without_drafting())]

    def _lookup_round(self, history: list[int], limit: int) -> list[int]:
        """Each round the length with the best expected speed-up, within the
        rejection bound: from lookup's acceptance in this request (at least one
        token: leaving lookup is _watch_lookup's decision) or, for a weak match,
        from weak matches' acceptance (none when they do not pay)."""
        max_k = rejection_cap(self._rejected_at, self.max_lookup, self.s.lookup_rejection_floor)
        self.lookup.record(history)
        m = self.lookup.match(history, min(max_k, limit))
        drafts = m.drafts
        self._round_weak = self._is_weak(m)
        if self._round_weak:
            k = self._weak_length(max_k)
        else:
            # Alone at least one token (leaving lookup is _watch_lookup's call); in a
            # batch a round that does not pay drafts nothing.
            k = self._best_lookup(self.lookup_acceptance, max_k, min_k=int(self._lookup_pricing().rows == 1))[0]
        self.lookup_k = k
        return drafts[:k]

    def _best_lookup(self, acceptance: AcceptanceModel, max_k: int, min_k: int = 0) -> tuple[int, float]:
        """The lookup length that pays best at this acceptance, and its speed-up,
        priced for the batch this request is in (with its rows drafting beside it)."""
        p = self._lookup_pricing()
        return best_draft_length(acceptance, p.rounds, max_k, min_k, rows=p.rows, beside=p.beside)

    def _lookup_pricing(self) -> LookupPricing:
        """Lookup rounds' times, the batch's rows and what the others can draft:
        alone, the learned round costs; in a batch of several rows, a k-draft
        round widens every row's pass (costs.batch_round_table, scaled to the
        timed undrafted steps), and its gain adds to the other rows' (each
        gaining one token a step, or what its own drafts in the same pass
        bring, for the rows drafting beside it)."""
        b = self.batch
        rows = b.rows() if b is not None else 1
        if rows <= 1:
            return LookupPricing(self.lookup_costs, 1, [])
        table = costs.batch_round_table(self.verify_costs, rows, self.lookup_costs.undrafted())
        # Only a row that is copying counts the rows copying beside it (BatchPricing.draft_length).
        return LookupPricing(table, rows, b.beside(rows) if self._copying else [])

    def _is_weak(self, m: Match) -> bool:
        """Whether lookup's drafts ``m`` come from a weak match (RouterSettings.weak_match)."""
        return bool(m.drafts) and m.strength <= self.s.weak_match

    def _weak_length(self, max_k: int) -> int:
        """The draft length a weak match pays for (0: none), from weak matches' record."""
        return self._best_lookup(self.weak, max_k)[0]

    def observe(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        if self.mode in (Mode.PLAIN, Mode.DRAFT_MODEL) and not self._proposed and self._history is not None:
            # A round the loop queued ahead: the history it continued is the
            # loop's list as it stands now (this round's token not appended yet).
            self._shadow_lookup(self._history)
        self._proposed = False
        by, self._round_by = self._round_by, None
        if self.mode == Mode.PROMPT_LOOKUP:
            self.idle_run = 0 if drafted else self.idle_run + 1
        if by == "draft_model":
            self._observe_draft_round(drafted, accepted, seconds)
            return
        lookups = by == "lookup" or self.mode in (Mode.PROBE, Mode.PROMPT_LOOKUP)
        # Round times teach the cost of the drafter that ran; an undrafted round
        # costs the same whichever would have drafted.
        if lookups or drafted == 0:
            self.lookup_costs.observe(drafted, seconds)
            self._report_round(drafted + 1, seconds)
        if self.draft_drafter is not None and self.mode != Mode.DRAFT_MODEL and drafted == 0:
            self.draft_drafter.time_undrafted(seconds)
        if drafted and lookups:
            # As for the draft model: the next draft is capped (policy.rejection_cap).
            self._rejected_at = accepted + 1 if accepted < drafted else None
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.produced += accepted + 1
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self._round_weak and self.mode in (Mode.PROBE, Mode.PROMPT_LOOKUP):
            self.weak.observe(drafted, accepted)
        self._round_weak = False
        if self.mode == Mode.PROBE:
            self.lookup_acceptance.observe(drafted, accepted)
            if drafted and accepted == drafted:
                # Copying from the first drafts on: a fixed 32 drafts 33 tokens a
                # round from there, so reach it at once, not after the probe.
                self.lookup_k = min(self.max_lookup, self.lookup_k * self.s.probe_growth)
            elif drafted:
                # A copy that ended: back to the rejection bound (as lookup's own rounds).
                self.lookup_k = max(
                    rejection_cap(accepted + 1, self.lookup_k, self.s.lookup_rejection_floor), self._probe_start()
                )
            self._after_probe_round()
        elif self.mode == Mode.PROMPT_LOOKUP:
            self.lookup_acceptance.observe(drafted, accepted)
            self.lookup_own.observe(drafted, accepted)
            self._watch_lookup()
        elif self.mode == Mode.DRAFT_MODEL and by is None:
            # Not left for plain decoding when it stops paying: the drafter then
            # pauses drafting by itself and keeps scoring the draft model, so it resumes when
            # the text turns predictable (plain decoding could only leave for
            # prompt lookup, so a pessimistic start would forfeit the draft). A
            # lookup round (by == "lookup") is scored by its shadow draft, not here.
            self.draft_drafter.observe(drafted, accepted, seconds)
        if self.mode in (Mode.PLAIN, Mode.DRAFT_MODEL):
            self._consider_lookup()

    def _report_round(self, width: int, seconds: float | None) -> None:
        if self.on_round is not None and seconds is not None:
            self.on_round(width, seconds)

    def _observe_draft_round(self, drafted: int, accepted: int, seconds: float | None) -> None:
        """A draft-model round inside the probe or lookup: it teaches the draft
        model alone (an undrafted one also lookup's undrafted time); the probe
        counts its tokens, so a probe that finds nothing to copy still ends."""
        self.draft_drafter.observe(drafted, accepted, seconds)
        if drafted == 0:
            self.lookup_costs.observe(0, seconds)
            self._report_round(1, seconds)
        self._round_weak = False
        if self.mode == Mode.PROBE:
            self.produced += accepted + 1
            self._after_probe_round()
        elif self.mode == Mode.PROMPT_LOOKUP:
            self._leave_idle_lookup()

    def _shadow_lookup(self, history: list[int]) -> None:
        """Score earlier shadow drafts (shadow.py), then make one for this
        round (an index lookup: microseconds)."""
        for weak in self.shadows.score(history):
            teach(self.weak, weak)
        # What lookup would draft now, lookup memory included (the kit's other
        # conversations), so a short prompt whose answer was cached elsewhere
        # can still move the router to lookup. Not while an open shadow still
        # matches: lookup's own round would have drafted this position in that
        # shadow's round.
        if self.shadows.open:
            return
        self.lookup.record(history)
        if (m := self.lookup.match(history, self.max_lookup)).drafts:
            self.shadows.add(len(history), m.drafts, self._is_weak(m))

    def _consider_lookup(self) -> None:
        """Switch to prompt lookup when its shadow record promises clearly more
        than the running mode."""
        # From plain decoding a switch gains more than from the draft model, and
        # the draft model's switches were tuned with watch_rounds: keep them so.
        needed = (
            self.s.watch_rounds if self.mode == Mode.DRAFT_MODEL else self.s.shadow_rounds << min(self._lookup_exits, 5)
        )
        # Evidence is counted in decided positions: one shadow matching three
        # tokens in a row says as much as three matching their first.
        if self.shadows.positions < needed or (self.mode == Mode.DRAFT_MODEL and self._lookup_retired):
            return
        current = 1.0
        if self.mode == Mode.DRAFT_MODEL:
            current = self._draft_speedup()
            k, speedup = best_draft_length(self.shadows.record, self._lookup_rounds_beside_draft(), self.max_lookup)
        else:
            k, speedup = self._best_lookup(self.shadows.record, self.max_lookup)
        margin = self.s.switch_margin * (1 + self.s.thin_evidence / self.shadows.positions)
        if k and speedup > margin * current:
            shadow = self.shadows.record
            self._replaced_draft_speedup = current if self.mode == Mode.DRAFT_MODEL else None
            self._enter(
                Mode.PROMPT_LOOKUP,
                f"{self.shadows.scored} shadow drafts ({self.shadows.positions} positions) scored, lookup would have had "
                f"{shadow.conditional()[0]:.0%} of "
                f"their first tokens accepted: expected speed-up x{speedup:.2f} at k={k} against x{current:.2f}",
            )
            self.lookup_k = k
            self.lookup_acceptance = shadow

    def _lookup_speedup(self) -> tuple[int, float, float]:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        k, speedup = self._best_lookup(self.lookup_acceptance, self.max_lookup)
        return k, speedup, rate

    def _fallback_mode(self) -> str:
        return Mode.DRAFT_MODEL if self.draft_drafter is not None else Mode.PLAIN

    def _after_probe_round(self) -> None:
        done = self.produced >= self.s.probe_tokens or self.misses >= self.s.probe_max_misses
        if not done:
            return
        k, speedup, rate = self._lookup_speedup()
        facts = f"probe acceptance {rate:.0%} over {self.drafted} drafted, expected speed-up x{speedup:.2f} at k={k}"
        if k > 0 and (rate > self.s.commit_acceptance or self._probe_beats_draft(speedup)):
            probed = self.lookup_acceptance
            self._enter(Mode.PROMPT_LOOKUP, facts)
            # The probe's rounds are lookup's first evidence (docs/decoding.md, "Tuning history").
            self.lookup_k, self.lookup_acceptance = k, probed
        else:
            self._leave_lookup(facts, self.lookup_acceptance)

    def _probe_beats_draft(self, lookup_speedup: float) -> bool:
        """With a draft model loaded, whether the probe's record (per draft
        position) expects clearly more from lookup than the draft model's record
        on this request expects from it: a copy whose one long draft ran past
        its end has a low token rate, yet its rounds' first tokens pay
        (docs/decoding.md, "Tuning history")."""
        if self.draft_drafter is None or not self.drafted:
            return False  # on the prior alone (a probe that drafted nothing) lookup has no record
        return lookup_speedup > self.s.switch_margin * max(1.0, self._draft_speedup())

    def _leave_lookup(self, why: str, own: AcceptanceModel) -> None:
        """Back to the fallback mode. Lookup's own rounds stay the shadow record's
        first evidence, so a switch back needs what lookup failed to deliver to
        change (docs/decoding.md, "Tuning history")."""
        self._enter(self._fallback_mode(), why)
        self.shadows = ShadowLookup(own)

    def _leave_idle_lookup(self) -> bool:
        """Leave lookup's mode after ``idle_lookup_rounds`` rounds in a row drafted
        nothing (RouterSettings); its shadow drafts bring it back when the text
        copies again. Not counted as lookup not paying (``_lookup_exits``)."""
        if self.idle_run < self.s.idle_lookup_rounds:
            return False
        self._leave_lookup(f"nothing drafted in {self.idle_run} rounds", self.lookup_own)
        return True

    def _watch_lookup(self) -> None:
        if self._leave_idle_lookup():
            return
        if self.rounds < self.s.watch_rounds or self.drafted == 0:
            return
        k, speedup, rate = self._lookup_speedup()
        if k == 0:
            # Each time lookup did not pay, a switch back needs twice the shadow
            # evidence: on text that copies in snatches (a summary) shadows keep
            # promising a little, and every round trip costs watch_rounds rounds.
            self._lookup_exits += 1
            self._leave_lookup(f"lookup acceptance fell to {rate:.0%}; no draft length pays", self.lookup_own)
            return
        if (replaced := self._replaced_draft_speedup) is not None:
            # Only a switch from the draft model is checked: against what it replaced.
            delivered = self._best_lookup(self.lookup_own, self.max_lookup)[1]
            if delivered * self.s.switch_margin < replaced:
                self._lookup_retired = True
                self._replaced_draft_speedup = None
                self._enter(
                    Mode.DRAFT_MODEL,
                    f"lookup delivers x{delivered:.2f} ({rate:.0%} accepted) against the draft model's "
                    f"x{replaced:.2f}; no more switches to lookup in this request",
                )
                return
        self.lookup_k = k
        if self.rounds >= 4 * self.s.watch_rounds:
            # Keep the evidence recent so a change in the text is noticed.
            self.rounds //= 2
            self.drafted //= 2
            self.accepted //= 2
