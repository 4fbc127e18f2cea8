"""Draft-model speculative decoding: the drafter (``DraftModelDrafter``) and its
batched draft jobs. Checking and loading a draft model is loading.py."""

from __future__ import annotations

import logging
from typing import Callable, Iterator

import mlx.core as mx

from ..caches.ragged import release_row
from ..caches.sequence import SequenceCache, common_prefix_length
from ..decode.protocol import DrafterUnavailable, PendingDrafts
from ..draft.model import DraftModel
from ..loading.memory import PREFILL_CHUNK
from ..pricing import costs
from .policy import DraftLengthPolicy
from .policy_drafter import PolicyDrafter

logger = logging.getLogger(__name__)


class DraftModelDrafter(PolicyDrafter):
    """Drafts greedily with a small model whose cache follows the main history.

    The draft cache is synchronised to the history by longest common prefix each
    round, which rewinds rejected drafts and reuses prefixes across requests with
    the same mechanism. With a fixed length the draft steps are chained lazily
    and handed to the loop unevaluated; the adaptive length reads each step, as
    its confidence decides whether to draft the next. How many tokens to draft is ``policy``'s decision
    (policy.DraftLengthPolicy); this class only tells it how far the draft model
    had to catch up before drafting, so such rounds are not timed."""

    name = "draft_model"

    def __init__(
        self,
        draft: DraftModel,
        num_draft_tokens: int | None,
        round_costs: costs.RoundCosts | None = None,
        prior_acceptance: float = 0.6,
        vocab_size: int | None = None,
        cache: SequenceCache | None = None,
        batched: bool = False,
    ):
        self.draft = draft
        self.batched = batched  # drafts with the other requests' (DraftJob) on a kit serving several
        self.cache = cache if cache is not None or draft is None else draft.first_cache  # this request's draft cache
        if self.cache is not None:
            # A recurrent draft rewinds to the state after any accepted draft step.
            self.cache.keep_rewind_points(costs.MAX_MODEL_DRAFT + 2)
        self.vocab_size = vocab_size  # the main model's: padded draft rows are never proposed
        if draft is not None:
            prior_acceptance = draft.acceptance_prior(prior_acceptance)
        # The adaptive length drafts as far as the draft model is confident
        # (DraftLengthPolicy.keep_drafting). Its catch-ups after undrafted
        # rounds, and its scoring passes while it rests (score_due), are scored
        # into the acceptance by position (observe_scored), which the router
        # weighs the draft model by and which ends a rest early.
        adaptive = draft is not None and num_draft_tokens is None
        super().__init__(
            DraftLengthPolicy(num_draft_tokens, round_costs, prior_acceptance, scores=adaptive, confident=adaptive)
        )
        self._unresolved: tuple[int, mx.array] | None = None
        self._last_drafted = False  # the last round launched had drafts

    def plain_ahead(self, history: list[int]) -> bool:
        """True while the adaptive length drafts nothing: the loop then queues
        each round before the previous one is read, as plain decoding does (so
        an idle draft model's rounds cost what plain ones do). Never right after a
        drafted round: the next one starts where its accepted drafts end."""
        if self.policy.score_due():
            self._score_resting(history)
        return not self._last_drafted and self.policy.idle_next()

    def _score_resting(self, history: list[int]) -> None:
        """Catch the resting draft model up on ``history`` in one pass, its
        predictions there kept to score it when the round is observed
        (``DraftLengthPolicy.score_due``). Queued, not waited for: the next
        round is queued behind it."""
        self._resolve()
        cache = self.cache
        release_row(self.draft.batch, cache)
        feed = history[cache.rewind_to(min(common_prefix_length(cache.tokens, history), len(history) - 1)) :]
        if len(feed) > 1:  # else there is nothing new to score it on
            self.policy.scoring()
            self._keep_greedy(cache.feed(feed), feed[1:])

    def prefill_todo(self, prompt: list[int]) -> int:
        """Prompt tokens ``prefill_prompt`` will feed the draft model (what its cache lacks)."""
        return len(prompt) - 1 - common_prefix_length(self.cache.tokens, prompt[:-1])

    def prefill_prompt(
        self, prompt: list[int], on_chunk: Callable[[int], None] | None = None, chunk_size: int = PREFILL_CHUNK
    ) -> Iterator[None]:
        """Bring the draft cache to ``prompt[:-1]`` (keeping the prefix it shares),
        yielding after each chunk of ``chunk_size`` tokens, as the main model's
        prefill does (``ModelKit.prefill_prompt``): the scheduler lets the other
        requests take a step there. Each chunk is evaluated before the yield, so
        a request ended between chunks leaves the cache holding a consistent
        prefix of the prompt, which the next request to borrow it extends."""
        cache = self.cache
        todo = prompt[cache.sync_to(prompt[:-1]) : -1]
        for i in range(0, len(todo), chunk_size):
            cache.prefill(todo[i : i + chunk_size], on_chunk, chunk_size)
            yield
        cache.checkpoint()  # a hybrid draft: a regenerated answer resumes here

    def propose(self, history: list[int], limit: int) -> mx.array | list[int]:
        self._resolve()
        k = self.num_tokens(limit)
        self._last_drafted = k > 0
        if k <= 0:
            return []
        cache = self.cache
        # Back to the accepted history (a recurrent draft to the state after
        # its last accepted step: one is kept per step), then feed the rest.
        keep = cache.rewind_to(min(common_prefix_length(cache.tokens, history), len(history) - 1))
        self.catch_up = len(history) - keep
        if reason := cache.rewind_limit_reason(len(history) - keep + k):
            raise DrafterUnavailable(f"draft model: {reason}")
        if self.batched:
            return DraftJob(self, history[keep:], k)
        return self.chain(history[keep:], k)

    def chain(self, feed: list[int], k: int) -> mx.array:
        """Feed ``feed`` and chain k-1 more draft steps on this request's own cache.

        The steps are chained lazily, each queued as soon as it is built, and
        handed over unevaluated: the main model's verify pass is built on them
        and one evaluation runs both (no sync per token or per model). In
        confident mode each step is read instead: its confidence decides
        whether the next is computed (``confident_chain``)."""
        if self.policy.confident:
            return self.confident_chain(feed, k)
        cache = self.cache
        release_row(self.draft.batch, cache)
        logits = cache.feed(feed)
        self.note_catch_up(logits, feed)
        y = mx.argmax(logits[-1][: self.vocab_size])
        mx.async_eval(y)
        ys = [y]
        start = len(cache)
        for _ in range(k - 1):
            logits, _ = cache.feed_lazy([], y)
            y = mx.argmax(logits[-1][: self.vocab_size])
            mx.async_eval(y)
            ys.append(y)
        drafts = mx.stack(ys)
        self.fed_lazily(start, drafts)
        return drafts

    def confident_chain(self, feed: list[int], k: int) -> mx.array:
        """Feed ``feed``, then draft up to k tokens while the policy finds the
        next one worth computing (``keep_drafting``); returns the drafts."""
        cache = self.cache
        release_row(self.draft.batch, cache)
        logits = cache.feed(feed)
        self.note_catch_up(logits, feed)
        ids: list[int] = []
        confidences: list[float] = []
        while True:
            ((token, confidence),) = greedy_picks([logits[-1]], self.vocab_size)
            ids.append(token)
            confidences.append(confidence)
            if not self.drafts_on(confidences, k):
                self.policy.note_drafts(confidences)
                return mx.array(ids, dtype=mx.uint32)
            logits = cache.feed([token])

    def drafts_on(self, confidences: list[float], k: int) -> bool:
        """Whether a round with drafts of these ``confidences`` drafts one more:
        up to ``k``, in confident mode only while ``keep_drafting`` says so."""
        return len(confidences) < k and (not self.policy.confident or self.policy.keep_drafting(confidences))

    def fed_lazily(self, start: int, drafts: mx.array) -> None:
        """All but the last of ``drafts`` were fed from ``start`` unevaluated;
        their ids are named in the cache when the next round is proposed."""
        self._unresolved = (start, drafts)

    def note_catch_up(self, logits: mx.array, feed: list[int]) -> None:
        """Keep the predictions of a drafting pass that first caught the draft
        model up on ``feed`` (tokens decoded without it, more than a drafted
        round's steady catch-up), to score them."""
        if len(feed) > self.policy.steady_catch_up:
            self._keep_greedy(logits, feed[1:])

    def _keep_greedy(self, logits: mx.array, actual: list[int]) -> None:
        """Keep the greedy predictions of ``logits``' first rows, which
        ``actual`` follow, to compare them when the round is observed."""
        if self.policy.scores and actual:
            self.keep_predictions(mx.argmax(logits[: len(actual), : self.vocab_size], axis=-1), actual)

    def _resolve(self) -> None:
        """Name the draft ids fed lazily last round (evaluated by now)."""
        if self._unresolved is not None:
            start, drafts = self._unresolved
            self.cache.resolve(start, drafts.tolist()[:-1])
            self._unresolved = None


class DraftJob(PendingDrafts):
    """One request's draft steps of a scheduler step: ``feed`` (the ids its draft
    cache lacks) then k-1 chained steps, run with the other requests' as rows
    of the draft model's batch (``run_together``)."""

    def __init__(self, drafter: DraftModelDrafter, feed: list[int], k: int):
        self.drafter, self.feed, self.k = drafter, feed, k
        self.drafts: mx.array | None = None

    def materialize(self) -> mx.array:
        if self.drafts is None:
            self.drafts = self.drafter.chain(self.feed, self.k)
        return self.drafts

    @staticmethod
    def run_together(jobs: list[DraftJob]) -> None:
        """Every job's steps as batched draft passes: one pass for the feeds,
        then one per further draft position (rows that need no more ride along)."""
        draft = jobs[0].drafter.draft
        batch = draft.batch_for_drafting()
        if batch is None:
            for job in jobs:
                job.materialize()
            return
        vocab = jobs[0].drafter.vocab_size
        for job in jobs:
            if job.drafter.cache not in batch:
                batch.join(job.drafter.cache)
        out = batch.feed([(j.drafter.cache, j.feed, None) for j in jobs])
        for job, (logits, _) in zip(jobs, out):
            job.drafter.note_catch_up(logits, job.feed)
        if any(j.drafter.policy.confident for j in jobs):
            DraftJob._draft_step_by_step(jobs, batch, [logits for logits, _ in out])
            return
        chains = [[mx.argmax(logits[-1][:vocab])] for logits, _ in out]
        mx.async_eval([c[-1] for c in chains])
        starts = [len(j.drafter.cache) for j in jobs]
        for step in range(1, max(j.k for j in jobs)):
            active = [i for i, j in enumerate(jobs) if j.k > step]
            out = batch.feed([(jobs[i].drafter.cache, [], chains[i][-1]) for i in active])
            for i, (logits, _) in zip(active, out):
                chains[i].append(mx.argmax(logits[-1][:vocab]))
            mx.async_eval([chains[i][-1] for i in active])
        for job, chain, start in zip(jobs, chains, starts):
            job.drafts = mx.stack(chain)
            job.drafter.fed_lazily(start, job.drafts)

    @staticmethod
    def _draft_step_by_step(jobs: list[DraftJob], batch, logits: list[mx.array]) -> None:
        """``run_together`` when a job drafts in confident mode: every step is
        read, and a confident job's row stops when its policy finds the next
        draft not worth computing (the others run to their k)."""
        vocab = jobs[0].drafter.vocab_size
        ids: list[list[int]] = [[] for _ in jobs]
        confidences: list[list[float]] = [[] for _ in jobs]
        active = list(range(len(jobs)))
        while active:
            going = []
            for i, (token, confidence) in zip(active, greedy_picks([row[-1] for row in logits], vocab)):
                ids[i].append(token)
                confidences[i].append(confidence)
                if jobs[i].drafter.drafts_on(confidences[i], jobs[i].k):
                    going.append(i)
            if going:
                logits = [r for r, _ in batch.feed([(jobs[i].drafter.cache, [ids[i][-1]], None) for i in going])]
            active = going
        for job, row_ids, row_confidences in zip(jobs, ids, confidences):
            if job.drafter.policy.confident:
                job.drafter.policy.note_drafts(row_confidences)
            job.drafts = mx.array(row_ids, dtype=mx.uint32)


def greedy_picks(rows: list[mx.array], vocab_size: int | None) -> list[tuple[int, float]]:
    """The greedy token of each row of logits (its first ``vocab_size``
    entries) and that token's probability, evaluated together."""
    rows = [row[:vocab_size] for row in rows]
    tokens = [mx.argmax(row) for row in rows]
    confidences = [mx.exp(row[t] - mx.logsumexp(row)) for row, t in zip(rows, tokens)]
    mx.eval(tokens, confidences)
    return [(t.item(), c.item()) for t, c in zip(tokens, confidences)]
