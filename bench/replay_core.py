"""What the replays share: greedy outputs, a draft's accept lengths, a drafter
run over a recorded output, and a draft model replayed from its accept lengths.

``bench.replay`` (draft-length policies), ``bench.replay_lookup`` (prompt lookup,
the router, a simulated draft) and ``bench.replay_real`` (a real draft's
recorded proposals) build on these.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.drafters.policy import DraftLengthPolicy  # noqa: E402
from mlx_engine.pricing import costs  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402


def greedy(kit: me.ModelKit, prompt: list[int], n: int) -> list[int]:
    return [
        t.id
        for r in me.create_generator(kit, prompt, max_tokens=n, temp=0.0, speculative_decoding_toggle=False)
        for t in r.tokens
    ]


def accept_lengths(
    draft: mx.array, sequence: list[int], start: int, count: int, max_k: int = costs.MAX_MODEL_DRAFT
) -> list[int]:
    """For each position t in [start, start + count): how many of the draft's
    greedy tokens from ``sequence[:t]`` equal ``sequence[t:]`` (up to max_k)."""
    cache = make_prompt_cache(draft)
    mx.eval(draft(mx.array(sequence[: start - 1])[None], cache=cache))
    out = []
    for t in range(start, start + count):
        y, matched, fed = mx.array([sequence[t - 1]]), 0, 0
        while matched < max_k:
            y = mx.argmax(draft(y[None], cache=cache)[0, -1:], axis=-1)
            fed += 1
            if t + matched < len(sequence) and y.item() == sequence[t + matched]:
                matched += 1
            else:
                break
        for c in cache:
            c.trim(fed)
        mx.eval(draft(mx.array([sequence[t - 1]])[None], cache=cache))
        out.append(matched)
    return out


def parse_line(item: str) -> tuple[int | str, tuple[float, float]]:
    """'128=0.55+0.12k' -> (128, (0.55, 0.12)); with --lookup the key is 'toy' or 'chat'."""
    try:
        ctx, rest = item.split("=")
        jump, slope = rest.rstrip("k").split("+")
        return (int(ctx) if ctx.isdigit() else ctx), (float(jump), float(slope))
    except ValueError:
        raise SystemExit(f"--cost-lines: cannot read {item!r}; expected CTX=JUMP+SLOPEk, e.g. 128=0.55+0.12k")


def replay_drafter(prompt: list[int], output: list[int], drafter, round_cost: list[float]) -> tuple[float, int]:
    """Run ``drafter`` (a PromptLookupDrafter or an AutoRouter without a draft
    model) over a greedy output: each round it proposes, the drafts matching the
    output are accepted, and the round costs ``round_cost[k]`` undrafted rounds.
    Each round's time is reported to the drafter, as the engine's loop does,
    so the router learns the round costs from a prior that may differ. Returns
    tokens per undrafted-round time (1.0: plain decoding) after the first round,
    as ``bench`` measures generation speed (the first round rides on the prompt's
    pass, in the time to first token), and rounds."""
    history, t, spent, rounds, first = list(prompt), 0, 0.0, 0, 0
    count = len(output)
    while t < count:
        limit = count - t - 1
        drafts = list(drafter.propose(history, limit))[:limit] if limit > 0 else []
        n = 0
        while n < len(drafts) and drafts[n] == output[t + n]:
            n += 1
        # Timed in undrafted-round units; the first round is not (the loop reads
        # it right after the prompt's pass).
        seconds = round_cost(len(drafts)) if callable(round_cost) else round_cost[len(drafts)]
        drafter.observe(len(drafts), n, seconds if rounds else None)
        spent += seconds if rounds else 0.0
        history.extend(output[t : t + n + 1])
        t += n + 1
        first = first or t  # tokens of the first round
        rounds += 1
    return (t - first) / spent if spent else 1.0, rounds


class ReplayedDraft:
    """A draft model replayed from its accept lengths: at output position t it
    drafts ``lengths[t]`` right tokens then wrong ones (-1), its length chosen by
    the engine's own ``DraftLengthPolicy`` from the ``prior`` acceptance; each of
    its rounds also costs ``draft_step`` undrafted rounds per draft token plus
    one for catching up. As the engine's drafter, it scores the draft model on
    the positions it catches up on (a scoring round's pass costs
    ``SCORING_STEPS`` draft steps): its prediction at output position p was
    right when ``lengths[p] > 0``. Implements what the router reads of a
    ``DraftModelDrafter`` (``--draft-mix`` simulates the lengths, replay_real.py
    records a real draft's)."""

    #: A scoring pass (a few tokens through the draft model), in draft steps.
    SCORING_STEPS = 1.5

    def __init__(
        self,
        output: list[int],
        lengths: list[int],
        start: int,
        rounds: costs.RoundCosts,
        prior: float,
        draft_step: float,
        scores: bool = True,
    ):
        self.output, self.lengths, self.start, self.draft_step = output, lengths, start, draft_step
        self.policy = DraftLengthPolicy(None, rounds, prior_acceptance=prior, scores=scores)
        self.drafted_last = 0  # drafts of the last round this drafter made (0 if it made none)
        self.scored_last = False  # the last round was a scoring one
        self.fed = (
            start - 1
        )  # the draft model holds the true history up to here (a prefill stops before the last token)
        self._round: tuple[int, int] | None = None  # (history length, drafts) of the drafted round in flight
        self._predicted: list[bool] = []  # scored positions not yet observed
        self._proposed = False

    acceptance = property(lambda self: self.policy.acceptance)
    round_costs = property(lambda self: self.policy.round_costs)

    def time_undrafted(self, seconds: float | None) -> None:
        self.policy.time_undrafted(seconds)

    def plain_ahead(self, history: list[int]) -> bool:
        return False

    def propose(self, history: list[int], limit: int) -> list[int]:
        self._proposed = True
        t = len(history) - self.start
        k = self.policy.num_tokens(min(limit, len(self.output) - t))
        self.drafted_last = k
        if k == 0:
            if self.policy.score_now and len(history) - 1 - self.fed >= 2:
                self._score(len(history))
                self.fed, self.scored_last = len(history) - 1, True
            return []
        if len(history) - self.fed > self.policy.steady_catch_up:
            self._score(len(history))
        self._round = (len(history), k)
        right = min(k, self.lengths[t] if t < len(self.lengths) else 0)
        return self.output[t : t + right] + [-1] * (k - right)

    def _score(self, end: int) -> None:
        """The draft model's predictions at positions fed+1 .. end-1 (absolute)."""
        if self.policy.scores:
            self._predicted = [self.lengths[p - self.start] > 0 for p in range(self.fed + 1, end)]

    def observe(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        if not self._proposed:
            self.policy.skip()
        self._proposed = False
        if self._predicted:
            self.policy.observe_scored(self._predicted)
            self._predicted = []
        if self._round is not None:
            # Its cache keeps the accepted drafts it fed (all but its last draft).
            self.fed = self._round[0] + min(accepted, self._round[1] - 1)
            self._round = None
        self.policy.observe(drafted, accepted, seconds)

    def extra_cost(self) -> float:
        """The draft model's work in the round just made (0 when it made none)."""
        k, self.drafted_last = self.drafted_last, 0
        scored, self.scored_last = self.scored_last, False
        return (k + 1) * self.draft_step if k else self.SCORING_STEPS * self.draft_step if scored else 0.0
