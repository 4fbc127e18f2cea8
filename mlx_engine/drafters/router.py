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

The rules are in routing.py (``decide``, pure, over the ``Ledger`` this router
keeps), the drafting of each mode in proposers.py; this module is the drafter
the loop drives, which records each round and applies each decision.
docs/decoding.md ("The auto router") gives each rule and the measurements that
chose it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..decode.protocol import Drafts
from ..pricing import costs
from ..pricing.batch_pricing import COPYING, BatchPricing, LookupPricing, strength_acceptance
from ..pricing.speedup import AcceptanceModel
from .draft_model import DraftModelDrafter
from .prompt_lookup import PromptLookupDrafter, density_score
from .proposers import PROPOSERS, Round
from .routing import (
    TRANSITIONS,
    Decision,
    Evidence,
    Ledger,
    Mode,
    RouterSettings,
    decide,
    is_weak,
    lookup_earns,
    lookup_length,
    probe_start,
)
from .shadow import teach

__all__ = ["TRANSITIONS", "AutoRouter", "Decision", "Evidence", "Ledger", "Mode", "RouterSettings", "decide"]

logger = logging.getLogger(__name__)


class AutoRouter:
    """A drafter that delegates each round to the chosen mode's proposer,
    records the round in its ledger and applies ``decide``'s decision."""

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
        density = density_score(prompt, settings.min_prompt_tokens)
        self.ledger = Ledger(
            max_lookup=lookup.num_tokens,
            lookup_k=probe_start(lookup.num_tokens, draft_drafter is not None, settings),
            lookup_allowed=len(prompt) >= settings.min_prompt_tokens and density >= settings.min_density,
            facts=f"prompt {len(prompt)} tokens, density {density:.2f}, costs {verify_costs.summary()}",
            weak=AcceptanceModel(prior=settings.weak_match_prior),
        )
        self._history: list[int] | None = None  # the loop's history (the list it extends)
        self._proposed = False  # propose ran for the round being observed
        # With a draft model loaded, which drafter made the round being observed
        # when it is not the mode's own: "lookup" (a lookup round inside the draft
        # model's mode) or "draft_model" (a draft round inside lookup's).
        self.round_by: str | None = None
        self._round_weak = False  # the round being observed drafted from a weak match
        self._copying = False  # this round's strongest possible match is a copy's (_post)
        self.apply(decide(self.ledger, self._evidence(), settings))

    @property
    def mode(self) -> Mode:
        """The mode the router is in."""
        return self.ledger.mode

    def apply(self, d: Decision) -> None:
        """Take a decision of ``decide`` (a switch is reported in the request's stats)."""
        previous = self.ledger.mode
        self.ledger.take(d)
        if not d.why:
            return
        label = Mode.PROMPT_LOOKUP if d.mode == Mode.PROBE else d.mode
        self.decoding_mode = f"auto:{label}"
        if previous is None:
            self.mode_reason = d.why
        else:
            self.mode_switches.append(f"{previous} -> {d.mode}: {d.why}")
        logger.debug("router: %s (%s)", d.mode, d.why)

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
        decoding's. In lookup's modes, also where in the batch as it is now no
        lookup round of any length pays (strong or weak match): such a round
        drafts nothing, so it is queued ahead like a plain round instead of built
        after the previous one is read (which would hold up every row of the
        batch's next step)."""
        self._post(history)
        led, ev, d = self.ledger, self._evidence(), self.draft_drafter
        if led.mode in (Mode.PROBE, Mode.PROMPT_LOOKUP) and ev.lookup.rows > 1:
            max_k = led.lookup_k if led.mode == Mode.PROBE else led.max_lookup
            if lookup_length(led.lookup_acceptance, max_k, ev)[0] == 0 and lookup_length(led.weak, max_k, ev)[0] == 0:
                # A round lookup does not draft may be the draft model's (proposers.draft_turn).
                return d is None or d.plain_ahead(history)
        if led.mode == Mode.DRAFT_MODEL:
            # Not while lookup has earned rounds of its own here: they are chosen in propose.
            return d.plain_ahead(history) and not lookup_earns(led, ev, self.s)
        return led.mode == Mode.PLAIN

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
        b.post_acceptance(min(strength_acceptance(bound), self.ledger.lookup_acceptance.conditional()[0]))

    def propose(self, history: list[int], limit: int) -> Drafts:
        self._history, self._proposed = history, True
        if self.mode in (Mode.PLAIN, Mode.DRAFT_MODEL):
            self._shadow(history)
        r = Round(self.ledger, self._evidence(), self.s, self.lookup, self.draft_drafter)
        p = PROPOSERS[self.mode](r, history, limit)
        self.round_by, self._round_weak = p.by, p.weak
        if p.lookup_k is not None:
            self.ledger.use_length(p.lookup_k)
        return p.drafts

    def _evidence(self, by: str | None = None, drafted: int = 0, accepted: int = 0) -> Evidence:
        """The evidence now: lookup rounds' times, the batch's rows and what the
        others can draft: alone, the learned round costs; in a batch of several
        rows, a k-draft round widens every row's pass (costs.batch_round_table,
        scaled to the timed undrafted steps), and its gain adds to the other
        rows' (each gaining one token a step, or what its own drafts in the same
        pass bring, for the rows drafting beside it); and the round observed."""
        b = self.batch
        rows = b.rows() if b is not None else 1
        pricing = LookupPricing(self.lookup_costs, 1, [])
        if rows > 1:
            table = costs.batch_round_table(self.verify_costs, rows, self.lookup_costs.undrafted())
            # Only a row that is copying counts the rows copying beside it (BatchPricing.draft_length).
            pricing = LookupPricing(table, rows, b.beside(rows) if self._copying else [])
        return Evidence(pricing, self.lookup_costs, self.draft_drafter, by, drafted, accepted)

    def observe(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        if self.mode in (Mode.PLAIN, Mode.DRAFT_MODEL) and not self._proposed and self._history is not None:
            # A round the loop queued ahead: the history it continued is the
            # loop's list as it stands now (this round's token not appended yet).
            self._shadow(self._history)
        self._proposed = False
        by, self.round_by = self.round_by, None
        weak, self._round_weak = self._round_weak, False
        self._time_round(by, drafted, accepted, seconds)
        self.ledger.count(by, drafted, accepted, weak)
        self.apply(decide(self.ledger, self._evidence(by, drafted, accepted), self.s))

    def _time_round(self, by: str | None, drafted: int, accepted: int, seconds: float | None) -> None:
        """Round times teach the cost of the drafter that ran; an undrafted round
        costs the same whichever would have drafted. The draft model learns from
        its own rounds (not left for plain decoding when it stops paying: it then
        pauses drafting by itself and keeps scoring the draft model, so it resumes
        when the text turns predictable; a lookup round inside its mode is scored
        by its shadow draft, not here)."""
        d, mode = self.draft_drafter, self.mode
        if by == "draft_model":
            d.observe(drafted, accepted, seconds)
            if drafted == 0:
                self._time_lookup(0, seconds)
            return
        if by == "lookup" or mode in (Mode.PROBE, Mode.PROMPT_LOOKUP) or drafted == 0:
            self._time_lookup(drafted, seconds)
        if drafted == 0 and d is not None and mode != Mode.DRAFT_MODEL:
            d.time_undrafted(seconds)
        if by is None and mode == Mode.DRAFT_MODEL:
            d.observe(drafted, accepted, seconds)

    def _time_lookup(self, drafted: int, seconds: float | None) -> None:
        """A lookup (or undrafted) round's time: lookup's round costs learn it,
        and the kit's forward costs (``on_round``: tokens verified, seconds)."""
        self.lookup_costs.observe(drafted, seconds)
        if self.on_round is not None and seconds is not None:
            self.on_round(drafted + 1, seconds)

    def _shadow(self, history: list[int]) -> None:
        """Score earlier shadow drafts (shadow.py; the weak ones into the ledger's
        weak-match record), then make one for this round (an index lookup:
        microseconds)."""
        led = self.ledger
        for scored in led.shadows.score(history):
            teach(led.weak, scored)
        # What lookup would draft now, lookup memory included (the kit's other
        # conversations), so a short prompt whose answer was cached elsewhere
        # can still move the router to lookup. Not while an open shadow still
        # matches: lookup's own round would have drafted this position in that
        # shadow's round.
        if led.shadows.open:
            return
        self.lookup.record(history)
        if (m := self.lookup.match(history, led.max_lookup)).drafts:
            led.shadows.add(len(history), m.drafts, is_weak(m, self.s))
