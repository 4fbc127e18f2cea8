"""How many tokens a draft model drafts each round.

``DraftLengthPolicy`` is the adaptive draft length on its own, separate from the
drafter's cache work, so the drafter, the router (which reads its acceptance and
round costs) and ``bench/replay.py`` (which replays it offline) use the same
object. With a fixed ``num_draft_tokens`` it always answers that length.
"""

from __future__ import annotations

from ..pricing import costs, speedup


def rejection_cap(rejected_at: int | None, max_k: int, floor: int = 0) -> int:
    """The longest next draft after a round rejected at draft position
    ``rejected_at`` (a + 1 for a drafts accepted; k for a round that accepted
    all its k; None: no cap): 2·(a+1)+2, at least ``floor``. The burst that just ended says little past
    there; every drafter (the draft model's policy, lookup under the router)
    caps by it. The draft model's policy also caps a round after one that
    accepted all its k drafts, at 2·k+2: the acceptance learned from short
    rounds says little about positions twice as deep."""
    return max_k if rejected_at is None else min(max_k, max(floor, 2 * rejected_at + 2))


class DraftLengthPolicy:
    """Chooses each round's draft length from the observed acceptance and round
    times (``round_costs``). It is at most ``2·(a+1)+2`` after a round that
    accepted ``a`` drafts and rejected one, and ``2·k+2`` after one that
    accepted all its ``k``. When no length pays, rounds go
    undrafted, with an exploration draft after ``explore_every`` of them so a
    change in acceptance is noticed (the gap doubles, up to ``max_explore_gap``,
    while those drafts keep not paying). A drafter that can ``score`` the draft
    model on the tokens decoded without it (``observe_scored``) is asked to do
    that instead, every ``score_every`` undrafted rounds and further apart (up
    to ``max_score_gap``) while scoring finds nothing that pays: a pass of the draft
    model over those tokens costs a fraction of a verify pass carrying
    exploration drafts, and tells exactly what drafting there would have had
    accepted.

    In ``confident`` mode (a draft model's adaptive length) the drafter instead
    asks after each draft step whether the next is worth computing
    (``keep_drafting``): the draft model's own confidence in each draft, scaled
    down where this request's drafts were accepted less often (``calibrate``),
    tells which rounds a draft will get far in, which the acceptance by
    position cannot. ``num_tokens`` then only gives the ceiling, or 0 while the
    draft model rests after rounds that accepted nothing. A rest ends only where
    scoring finds the draft model right again (``score_due``): it is scored on
    the tokens decoded meanwhile every ``rest_score_every`` rounds of a rest and
    at its end, and a rest whose end finds it wrong is followed by a longer one.
    docs/decoding.md explains each rule and how it was chosen."""

    explore_every = 2
    max_explore_gap = 64
    max_timing_wait = 8
    # Between drafted rounds the draft model is one or two tokens behind: the
    # target's own token, after the last draft it had not been fed.
    steady_catch_up = 2
    score_every = 4
    max_score_gap = 16
    # A resting draft model is scored every this many rounds (score_due): a
    # scoring pass costs about a fifth of a target step on this CPU, so every 4
    # rounds cost free text about 4%.
    # A scoring that finds the draft model right at the last position but not
    # right enough to wake it (_right_now) brings the next one in half the
    # interval: the text may be turning predictable.
    rest_score_every = 8
    MAX_SCORED = 64
    # Confident mode: the draft's own confidence, scaled by how often drafts
    # were accepted where it was that confident (this request), counts like
    # this many positions before any is seen.
    calibration_weight = 2.0

    def __init__(
        self,
        fixed: int | None,
        round_costs: costs.RoundCosts | None = None,
        prior_acceptance: float = 0.6,
        decay: float = 0.8,
        scores: bool = False,
        confident: bool = False,
    ):
        self.fixed = fixed
        # Each round's length from the draft's confidence in its drafts
        # (keep_drafting) instead of the acceptance by position.
        self.confident = confident and fixed is None and round_costs is not None
        self.calibration = [0.0, 0.0]  # decaying sums over verified positions: confidence, accepted
        self._confidences: list[float] = []  # of the drafts the round observed next verifies
        self._fruitless = 0  # drafted rounds that accepted nothing, since one expected to pay accepted some
        self._promising = False  # the drafts noted last were expected to pay
        self._asleep = 0  # undrafted rounds left before the draft model is run again
        self._rested = 0  # rounds of the current rest since it began or was last scored
        self._score_interval = self.rest_score_every  # rounds of a rest between scorings
        self._rest_scored = False  # the scores observed next are a resting draft model's
        self.scores = scores  # undrafted rounds are scored (observe_scored) instead of explored
        self.score_now = False  # the round num_tokens just chose is a scoring one
        self.round_costs = round_costs
        # A draft model's acceptance changes quickly between copied and free
        # text, so its evidence turns over faster than the default.
        self.acceptance = speedup.AcceptanceModel(prior_acceptance, decay=decay)
        self.idle_rounds = 0  # consecutive undrafted rounds (adaptive length only)
        self.explore_gap = self.explore_every
        self.score_gap = self.score_every
        # How far the last drafted round got (accepted + 1) if it had a draft
        # rejected, else None; bounds the next draft (see observe).
        self._rejected_at: int | None = None
        self._last_drafted = 0  # drafts of the last drafted round
        self._timing_wait = 0  # rounds an undrafted timing has waited for a rejection

    def num_tokens(self, limit: int) -> int:
        """The next round's draft length (0: an undrafted round, a scoring one
        when ``score_now`` is then set)."""
        self.score_now = False
        if self.fixed is not None:
            return min(self.fixed, limit)
        if self.round_costs is None:
            return min(4, limit)
        if self._time_undrafted_now():
            return 0
        if self.confident:
            if self._asleep:
                self._rest_one_round()
                return 0
            return min(limit, costs.MAX_MODEL_DRAFT)  # the ceiling: keep_drafting stops before
        max_k = min(limit, costs.MAX_MODEL_DRAFT)
        # Not much further than the last drafted round got: it was rejected at
        # _rejected_at, or accepted all its _last_drafted drafts.
        max_k = rejection_cap(self._rejected_at or self._last_drafted or None, max_k)
        k, _ = speedup.best_draft_length(self.acceptance, self.round_costs, max_k)
        if k == 0:
            self.idle_rounds += 1
            if self.idle_rounds < self._gap():
                return 0
            if self.scores:
                # Further apart while scoring keeps finding nothing that pays.
                self.idle_rounds, self.score_now = 0, True
                self.score_gap = min(2 * self.score_gap, self.max_score_gap)
                return 0
            # Explore with the most promising drafted length, not one token: on
            # MLX's CPU backend the step from a 1- to a 2-token pass is the dear
            # part of a verify, and acceptance is bursty, so only a longer draft
            # shows whether drafting pays. Back off while exploring keeps not paying.
            self.idle_rounds = 0
            self.explore_gap = min(2 * self.explore_gap, self.max_explore_gap)
            return speedup.best_draft_length(self.acceptance, self.round_costs, max_k, min_k=1)[0]
        self.idle_rounds = 0
        self.explore_gap, self.score_gap = self.explore_every, self.score_every
        return k

    def idle_next(self) -> bool:
        """Whether the next round is undrafted whatever this one's outcome (no
        length pays and no exploration is due), so the loop may queue it ahead
        as plain decoding does; ``skip`` then counts it."""
        if self.confident:
            return self._asleep > 0
        if self.fixed is not None or self.round_costs is None or self.idle_rounds + 1 >= self._gap():
            return False
        return not self._drafting_pays()

    def _gap(self) -> int:
        """Undrafted rounds before the next exploration draft or scoring."""
        return self.score_gap if self.scores else self.explore_gap

    def skip(self) -> None:
        """An undrafted round the loop queued ahead (``idle_next`` was true)."""
        self.idle_rounds += 1
        if self._asleep:
            self._rest_one_round()

    def _rest_one_round(self) -> None:
        self._asleep -= 1
        self._rested += 1

    def score_due(self) -> bool:
        """Confident mode: whether the resting draft model is due to be scored
        on the tokens decoded since it last ran (``observe_scored``): in the
        last round of a rest, which decides whether it drafts again, and every
        ``rest_score_every`` rounds of a long one (half as many after a scoring
        that found it right at the last position), so a draft that turns right
        mid-rest is noticed within that many rounds, not at the rest's end. The
        drafter calls ``scoring`` when it does."""
        return self.confident and self._asleep > 0 and (self._asleep == 1 or self._rested >= self._score_interval)

    def scoring(self) -> None:
        """The drafter scores the resting draft model now (``score_due``)."""
        self._rested, self._rest_scored = 0, True

    def keep_drafting(self, confidences: list[float]) -> bool:
        """Confident mode, after each draft step (``confidences``: the draft
        model's probability of each draft so far): whether one more is worth
        computing. The next draft is accepted with at most the chance that all
        so far are (``survival``), so it is not worth computing once that
        chance, over what the draft adds to the round's time, is below the best
        rate (tokens per second) a round with these drafts already reaches.

        Example (CPU, rounds of k drafts at 1.34 + 0.19·k undrafted steps):
        survivals 0.9, 0.6 reach 2.5 tokens in 1.72 steps, 1.45 a step; a
        third draft can add at most 0.6 tokens for 0.19 steps, 3.2 a step:
        draft it. After survivals 0.9, 0.2 (1.24 a step with the first draft
        alone), a third could add at most 1.05 a step: stop."""
        survival = self.survival(confidences)
        table = self.round_costs.table()
        k = len(survival)
        if k >= len(table) - 1:
            return False
        # survival / added time > rate, multiplied out: a draft that adds no time
        # (the fitted slope can be 0) is worth computing whenever it may be accepted.
        return survival[-1] > (table[k + 1] - table[k]) * _best_rate(survival, table)[1]

    def note_drafts(self, confidences: list[float]) -> None:
        """Confident mode: the confidences of the drafts the next observed
        round verifies, compared with what it accepts (``calibrate``)."""
        self._confidences = confidences
        # Judged by the draft's own confidence: calibration lags a draft that has
        # just turned right, and a sure draft accepted is the sign of it.
        self._promising = _best_rate(self.survival(confidences, scaled=False), self.round_costs.table())[0] > 0

    def survival(self, confidences: list[float], scaled: bool = True) -> list[float]:
        """The chance that drafts 1..i are all accepted, for each i: the draft's
        confidences scaled by how often this request's drafts were accepted
        where it was as confident (``calibration``), when they were accepted
        less often than that (unless not ``scaled``)."""
        total, accepted = self.calibration
        w = self.calibration_weight
        # Only ever down: scaled up, a run of confident drafts would never stop.
        scale = min(1.0, (accepted + w) / (total + w)) if scaled else 1.0
        out, survive = [], 1.0
        for p in confidences:
            survive *= min(1.0, p * scale)
            out.append(survive)
        return out

    def _rest_if_fruitless(self, accepted: int) -> None:
        """After ``score_every`` drafted rounds in a row accepted nothing (a
        round whose drafts were not expected to pay that got lucky does not
        break the row), the draft model rests: the next ``score_gap`` rounds go undrafted without
        running it. If the first drafted round after a rest accepts nothing
        too, it rests again, twice as long (up to ``max_score_gap``); so does
        a rest whose scoring at its end finds the draft model wrong
        (``_wake_if_right``)."""
        if accepted:
            self._fruitless, self.score_gap = 0, self.score_every
            return
        self._fruitless += 1
        if self._fruitless >= self.score_every:
            self._fruitless, self._asleep, self._rested = self.score_every - 1, self.score_gap, 0
            self._score_interval = self.rest_score_every
            self.score_gap = min(2 * self.score_gap, self.max_score_gap)

    def calibrate(self, confidences: list[float], accepted: int) -> None:
        """Compare a round's drafts' confidences with how many were accepted:
        each position counts up to the first rejected one."""
        reached = confidences[: accepted + 1]
        if reached:
            total, hits = self.calibration
            self.calibration = [total * self.acceptance.decay + sum(reached), hits * self.acceptance.decay + accepted]

    def _time_undrafted_now(self) -> bool:
        """Drafting is judged against an undrafted round, so time one now and
        then: inferring its cost from drafted rounds flatters drafting. Time it
        where it costs least, right after a rejected draft, unless that takes more
        than max_timing_wait rounds (in a burst of accepts an undrafted round
        gives up a whole round's worth of tokens)."""
        if not self.round_costs.needs_undrafted_timing():
            return False
        self._timing_wait += 1
        if self._rejected_at is not None or self._timing_wait > self.max_timing_wait:
            self._timing_wait = 0
            return True
        return False

    def observe(self, drafted: int, accepted: int, seconds: float | None = None, catch_up: int = 0) -> None:
        """A round's outcome; ``catch_up``: tokens the draft model processed
        before drafting (a round after undrafted ones starts by catching up)."""
        self.acceptance.observe(drafted, accepted)
        if self.confident and drafted:
            if self._promising or not accepted:  # a lucky accept of drafts not expected to pay: neither
                self._rest_if_fruitless(accepted)
            self.calibrate(self._confidences[:drafted], accepted)
            self._confidences = []
        if drafted:
            # After a rejection, draft at most twice as far as that round got, plus
            # two: the next round starts right after a token the draft missed, and
            # acceptance learned deep inside the burst that just ended is stale there.
            self._rejected_at = accepted + 1 if accepted < drafted else None
            self._last_drafted = drafted
            if catch_up > self.steady_catch_up:
                # The draft model first caught up on tokens decoded without it: a
                # one-off cost of resuming drafting, not what a round of this length
                # costs (counted, it could keep drafting off for good).
                seconds = None
        if self.round_costs is not None:
            self.round_costs.observe(drafted, seconds)

    def time_undrafted(self, seconds: float | None) -> None:
        """An undrafted round's time, from a round this policy did not choose."""
        if self.round_costs is not None:
            self.round_costs.observe(0, seconds)

    def observe_scored(self, matches: list[bool]) -> None:
        """Acceptance evidence without a verify pass: whether the draft model's
        greedy prediction at each of a run of decoded positions was the token
        decoded there (teacher forcing). For greedy drafts, n matches in a row
        from a position are exactly what a round drafting from there would have
        had accepted, so each position counts as such a round: ``[T, T, F]`` as
        rounds accepting 2 then rejecting, rejecting the second draft, and
        rejecting the first. A run reaching the end is cut there (what follows
        is not decoded yet): ``[F, T]`` ends with a round accepting 1. Only
        the last ``MAX_SCORED`` positions count (older evidence has decayed)."""
        matches = matches[-self.MAX_SCORED :]
        runs, run = [], 0  # runs[j]: matches in a row from position j
        for hit in reversed(matches):
            run = run + 1 if hit else 0
            runs.append(run)
        for j, run in enumerate(reversed(runs)):
            cut = j + run == len(matches)
            if run or not cut:
                self.acceptance.observe(run + (not cut), run)
        if self._rest_scored:
            self._rest_scored = False
            self._wake_if_right(matches)

    def _wake_if_right(self, matches: list[bool]) -> None:
        """After scoring a resting draft model: end the rest if it is right now
        (``_right_now``) and its record makes drafting pay; else, at the rest's
        end, rest again, twice as long (up to ``max_score_gap``), scored next
        after half the usual interval if it was right at the last position."""
        if _right_now(matches) and self._drafting_pays():
            self._asleep, self._score_interval = 0, self.rest_score_every
            return
        self._score_interval = self.rest_score_every // 2 if matches and matches[-1] else self.rest_score_every
        if self._asleep == 0:
            self._asleep, self._rested = self.score_gap, 0
            self.score_gap = min(2 * self.score_gap, self.max_score_gap)

    def _drafting_pays(self) -> bool:
        """Whether some draft length pays at the acceptance by position."""
        return speedup.best_draft_length(self.acceptance, self.round_costs, costs.MAX_MODEL_DRAFT)[0] > 0


def _best_rate(survival: list[float], table: list[float]) -> tuple[int, float]:
    """The number of drafts (a prefix of those with these ``survival`` chances)
    whose round makes the most expected tokens per second by ``table`` (a
    round's seconds by drafts), and that rate; 0 drafts: an undrafted round."""
    best, rate, expected = 0, 1.0 / table[0], 1.0
    for k, s in enumerate(survival[: len(table) - 1], start=1):
        expected += s
        if expected / table[k] > rate:
            best, rate = k, expected / table[k]
    return best, rate


def _right_now(matches: list[bool]) -> bool:
    """Whether a resting draft model scored on ``matches`` (its greedy
    prediction at each position decoded since it last ran, right or wrong) is
    right now: at the last position, and at the one before it or at most of
    them. One right guess among misses is chance on free text: woken on
    0100101, it drafted 7 tokens, all rejected; 1101 and 011 wake it."""
    if not matches or not matches[-1]:
        return False
    return (len(matches) > 1 and matches[-2]) or 2 * sum(matches) > len(matches)
