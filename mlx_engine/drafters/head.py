"""Drafting with a head: ``HeadDrafter``, one request's drafter over the kit's
loaded head (heads/model.HeadDraft).

Each read round hands the drafter the hidden states its launch recorded
(``take_hidden``). When it drafts, it first feeds the head the verified
positions it has not seen (their hidden states with the next token's
embedding), then chains steps on the head's own output: beyond the head's
depth, as mlx-vlm and vLLM do. Those chained entries are dropped before the
next round feeds the verified ones. The draft length is the draft model's
policy (policy.DraftLengthPolicy): adaptive, confident, resting, and scored
while it rests (the head's predictions on the positions decoded meanwhile)."""

from __future__ import annotations

from typing import Callable, Iterator

import mlx.core as mx

from ..decode.capture import HiddenSpec
from ..heads.model import HeadDraft, HeadState, HiddenTrail
from ..pricing import costs
from .draft_model import greedy_picks
from .policy import DraftLengthPolicy
from .policy_drafter import PolicyDrafter


class HeadDrafter(PolicyDrafter):
    """Drafts greedily with a head reading the target's hidden states."""

    name = "draft_model"

    def __init__(
        self,
        draft: HeadDraft,
        num_draft_tokens: int | None,
        round_costs: costs.RoundCosts | None = None,
        prior_acceptance: float = 0.6,
    ):
        self.draft, self.head = draft, draft.head
        self.cache = HeadState(self.head)  # this request's head state
        self.trail = HiddenTrail()
        adaptive = num_draft_tokens is None
        super().__init__(
            DraftLengthPolicy(
                num_draft_tokens,
                round_costs,
                draft.acceptance_prior(prior_acceptance),
                scores=adaptive,
                confident=adaptive,
            )
        )
        self._last_drafted = False
        self._decoded_from: int | None = None  # the first generated position (the prompt is not scored)

    @property
    def hidden_spec(self) -> HiddenSpec:
        return self.head.spec

    def take_hidden(self, at: int, rows: mx.array) -> None:
        """Hidden states recorded at target positions from ``at`` (a read round's, or a prompt chunk's)."""
        self.trail.add(at, rows)

    def prefill_todo(self, prompt: list[int]) -> int:
        """Prompt tokens this drafter prefills itself: none (the head reads the
        hidden states the target's prefill records)."""
        return 0

    def prefill_prompt(self, prompt: list[int], on_chunk: Callable | None = None, chunk_size: int = 0) -> Iterator:
        return iter(())

    def plain_ahead(self, history: list[int]) -> bool:
        """True while the head rests (as the draft model's ``plain_ahead``);
        a resting head due to be scored catches up on the positions decoded
        meanwhile, its predictions there kept to score it."""
        if self.policy.score_due() and self._catch_up_on(history, score=True) is not None:
            self.policy.scoring()
        return not self._last_drafted and self.policy.idle_next()

    def propose(self, history: list[int], limit: int) -> mx.array | list[int]:
        k = self.num_tokens(limit)
        self._last_drafted = False
        if k <= 0:
            return []
        h = self._catch_up_on(history, score=len(history) - 1 - (self.cache.next or 0) > self.policy.steady_catch_up)
        if h is None:  # no hidden state at the last verified position yet (the first round)
            return []
        self._last_drafted = True
        return (
            self._confident_chain(h, k, len(history) - 1)
            if self.policy.confident
            else self._chain(h, k, len(history) - 1)
        )

    def _catch_up_on(self, history: list[int], score: bool) -> mx.array | None:
        """Feed the head the verified positions it lacks (up to the last one,
        ``len(history) - 2``, whose next token is the pending one); returns its
        output there, or None when that position's hidden state is missing."""
        state, last = self.cache, len(history) - 2
        if self._decoded_from is None:
            self._decoded_from = len(history)
        state.drop_chained()
        if state.next is not None and state.next > last:
            return state.last_out
        first = self.trail.first()
        if first is None or not self.trail.covers(last):
            return None
        lo = first if state.next is None else max(state.next, first)  # a gap: positions never recorded
        rows = self.trail.take(lo, last + 1)
        if rows is None:
            return None
        tokens = mx.array(history[lo + 1 : last + 2], dtype=mx.uint32)[None]
        out = self.head.forward(state.kv, tokens, rows[None], lo)
        self.catch_up = last + 1 - lo
        state.fed(last + 1, out[:, -1:])
        self.trail.drop_before(last + 1)
        # Entry p predicts the token at p + 2. Only generated tokens are scored
        # (as the draft model is), the last MAX_SCORED at most: each scored
        # position costs the head's output layer.
        first = max(lo, self._decoded_from - 2, len(history) - 2 - self.policy.MAX_SCORED)
        actual = history[first + 2 :]
        if score and actual and self.policy.scores:
            rows = out[0, first - lo : first - lo + len(actual)]
            self.keep_predictions(self.head.to_target(mx.argmax(self.head.logits(rows), axis=-1)), actual)
        return state.last_out

    def _step(self, token: mx.array, h: mx.array, position: int) -> mx.array:
        """One chained head step: the draft ``token`` at target ``position`` with the head's previous output."""
        self.cache.chain()
        return self.head.forward(self.cache.kv, token.reshape(1, 1), self.head.chained(h), position)

    def _chain(self, h: mx.array, k: int, pending: int) -> mx.array:
        """k drafts chained lazily (one evaluation with the verify pass)."""
        ys = []
        for j in range(k):
            if j:
                h = self._step(ys[-1], h, pending + j - 1)
            y = self.head.to_target(mx.argmax(self.head.logits(h[0, -1])))
            mx.async_eval(y)
            ys.append(y)
        return mx.stack(ys)

    def _confident_chain(self, h: mx.array, k: int, pending: int) -> mx.array:
        """Drafts read one by one while the policy finds the next worth computing."""
        ids: list[int] = []
        confidences: list[float] = []
        while True:
            ((draft_id, confidence),) = greedy_picks([self.head.logits(h[0, -1])], None)
            token = self.head.to_target(mx.array(draft_id)).item()
            ids.append(token)
            confidences.append(confidence)
            if len(ids) >= k or not self.policy.keep_drafting(confidences):
                self.policy.note_drafts(confidences)
                return mx.array(ids, dtype=mx.uint32)
            h = self._step(mx.array(token, dtype=mx.uint32), h, pending + len(ids) - 1)
