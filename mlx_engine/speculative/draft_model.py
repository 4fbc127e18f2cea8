"""Draft-model speculative decoding: compatibility, loading, and the drafter."""

from __future__ import annotations

import gc
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx

from .. import loading
from ..errors import IncompatibleDraftModelError, ModelLoadError
from ..batch_cache import release_row
from ..cache import PREFILL_CHUNK, SequenceCache
from ..draft_pool import DraftModel
from ..model_kit import ModelKit, param_count, prepare_weights, smoke_test
from . import costs
from .loop import DrafterUnavailable, PendingDrafts
from .policy import DraftLengthPolicy

logger = logging.getLogger(__name__)


@dataclass
class DraftCompatibility:
    """Whether a draft model can serve a kit: ``reasons`` lists everything that
    breaks speculation (the draft is refused), ``notes`` the differences that do
    not (the main model verifies every drafted token), such as special-token
    settings or embedding rows padded past the vocabulary."""

    compatible: bool
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.compatible


def _special_ids(tok) -> dict[str, int | None]:
    return {
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "pad_token_id": getattr(tok, "pad_token_id", None),
    }


def _uses_recurrent_cache(config: dict) -> bool:
    """True when the architecture keeps state that cannot be trimmed (SSM/linear
    attention layers); read from its mlx-lm module, not by building the model."""
    from mlx_lm.utils import _get_classes

    model_class, _ = _get_classes(config)
    source = inspect.getsource(importlib.import_module(model_class.__module__))
    return any(name in source for name in ("ArraysCache", "MambaCache"))


def _compare_vocabularies(main_tok, draft_tok, main_rows: int) -> tuple[list[str], list[str]]:
    """(reasons, notes) from the two token lists. A draft proposes ids below the
    main model's row count; one whose token at such an id is another token for
    the main model breaks speculation, anything else only lowers acceptance."""
    main_vocab, draft_vocab = main_tok.get_vocab(), draft_tok.get_vocab()
    if main_vocab == draft_vocab:
        return [], []
    main_by_id = {i: t for t, i in main_vocab.items()}
    mismatched = sum(1 for t, i in draft_vocab.items() if i < main_rows and main_by_id.get(i, t) != t)
    reasons, notes = [], []
    if mismatched:
        reasons.append(
            f"tokenizers differ: {mismatched} of the draft's {len(draft_vocab)} tokens map to a different token "
            f"of the main model's {len(main_vocab)}"
        )
    unknown = sum(1 for t, i in draft_vocab.items() if i < main_rows and i not in main_by_id)
    missing = sum(1 for t, i in main_vocab.items() if draft_vocab.get(t) != i)
    if unknown:
        notes.append(f"the draft has {unknown} tokens at ids the main tokenizer does not use (never accepted)")
    if missing and not mismatched:
        notes.append(f"{missing} of the main model's tokens are not in the draft's tokenizer (never drafted)")
    return reasons, notes


def _special_notes(main_tok, draft_tok, main_rows: int, draft_rows) -> list[str]:
    """Differences the verify loop makes harmless: stopping and padding follow
    the main tokenizer, and drafts are cut to the main model's rows."""
    notes = []
    main_special, draft_special = _special_ids(main_tok), _special_ids(draft_tok)
    for name, value in main_special.items():
        if value != draft_special[name]:
            notes.append(f"{name} differs: main {value}, draft {draft_special[name]} (the main tokenizer's is used)")
    if set(main_tok.all_special_ids) != set(draft_tok.all_special_ids):
        notes.append("the tokenizers mark different sets of ids as special (the main tokenizer's are used)")
    if isinstance(draft_rows, int) and draft_rows != main_rows:
        notes.append(f"embedding rows differ: main {main_rows}, draft {draft_rows} (rows past the vocabulary "
                     "are never drafted)")
    return notes


def check_draft_model(kit: ModelKit, path: str | Path) -> DraftCompatibility:
    """Check a draft model against a kit reading only the draft's config and
    tokenizer (no weights), so hosts can list compatible drafts cheaply."""
    reasons: list[str] = []
    try:
        draft_path = loading.resolve_model_path(path, "draft model path")
        config = loading.read_config(draft_path)
        if loading.is_vision_config(config):
            reasons.append("the draft is a vision model; a draft must be a text-only model")
        loading.check_architecture(config, draft_path)
        draft_tok = loading.load_tokenizer(draft_path)
    except (ModelLoadError, ValueError) as exc:
        return DraftCompatibility(False, [str(exc)])
    main_rows = kit.vocab_size
    vocab_reasons, notes = _compare_vocabularies(kit.tokenizer, draft_tok, main_rows)
    reasons += vocab_reasons
    notes += _special_notes(kit.tokenizer, draft_tok, main_rows, config.get("vocab_size"))
    try:
        if _uses_recurrent_cache(config):
            reasons.append(f"the draft architecture {config['model_type']!r} has recurrent layers whose cache cannot be rewound")
    except Exception as exc:  # pragma: no cover - module introspection failure
        reasons.append(f"could not inspect the draft architecture: {exc}")
    return DraftCompatibility(not reasons, reasons, notes)


def load_draft(kit: ModelKit, path: str | Path) -> None:
    """Load a draft model into the kit, replacing any loaded one only once the
    new one has loaded: a failure leaves the previous draft in place."""
    report = check_draft_model(kit, path)
    if not report:
        raise IncompatibleDraftModelError(
            f"draft model {str(path)!r} is not compatible: " + "; ".join(report.reasons), report.reasons
        )
    for note in report.notes:
        logger.info("draft model %s: %s", path, note)
    draft_path = loading.resolve_model_path(path, "draft model path")
    model, _ = loading.load_weights(draft_path, trust_remote_code=False)
    prepare_weights(model, "auto")
    smoke_test(model, draft_path)
    new = DraftModel(draft_path, model, kit.new_cache(model), param_count(model))
    unload_draft(kit)
    kit.draft = new
    logger.info("loaded draft model %s (%.1fM parameters)", draft_path, kit.draft.num_params / 1e6)


def unload_draft(kit: ModelKit) -> None:
    """Drop the draft model and its cache; the main cache is kept."""
    if kit.draft is None:
        return
    kit.draft = None
    gc.collect()
    mx.clear_cache()
    logger.info("draft model unloaded")


class DraftModelDrafter:
    """Drafts greedily with a small model whose cache follows the main history.

    The draft cache is synchronised to the history by longest common prefix each
    round, which rewinds rejected drafts and reuses prefixes across requests with
    the same mechanism. The draft steps are chained lazily and handed to the loop
    unevaluated. How many tokens to draft is ``policy``'s decision
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
        self.cache = cache if cache is not None or draft is None else draft.cache  # this request's draft cache
        self.vocab_size = vocab_size  # the main model's: padded draft rows are never proposed
        if draft is not None:
            prior_acceptance = draft.acceptance_prior(prior_acceptance)
        self.policy = DraftLengthPolicy(num_draft_tokens, round_costs, prior_acceptance)
        self._unresolved: tuple[int, mx.array] | None = None
        self._catch_up = 0  # tokens the draft model processed before this round's drafts
        self._proposed = False  # the length of the round observed next was decided (num_tokens ran)
        self._last_drafted = False  # the last round launched had drafts

    @property
    def acceptance(self) -> costs.AcceptanceModel:
        return self.policy.acceptance

    @property
    def round_costs(self) -> costs.RoundCosts | None:
        return self.policy.round_costs

    def num_tokens(self, limit: int) -> int:
        """The next round's draft length (0: undrafted), decided by the policy."""
        self._proposed = True
        return self.policy.num_tokens(limit)

    @property
    def plain_ahead(self) -> bool:
        """True while the adaptive length drafts nothing: the loop then queues
        each round before the previous one is read, as plain decoding does (an
        idle draft model's rounds cost 2-3% more otherwise). Never right after a
        drafted round: the next one starts where its accepted drafts end."""
        return not self._last_drafted and self.policy.idle_next()

    def prefill_prompt(self, prompt: list[int], on_chunk: Callable[[int], None] | None = None,
                       chunk_size: int = PREFILL_CHUNK) -> Iterator[None]:
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

    def propose(self, history: list[int], limit: int) -> mx.array | list[int]:
        self._resolve()
        k = self.num_tokens(limit)
        self._last_drafted = k > 0
        if k <= 0:
            return []
        cache = self.cache
        keep = min(cache.sync_to(history), len(history) - 1)
        self._catch_up = len(history) - keep
        if not cache.rewind_to(keep):
            raise DrafterUnavailable("the draft model's cache cannot be rewound")
        if reason := cache.rewind_limit_reason(len(history) - keep + k):
            raise DrafterUnavailable(f"draft model: {reason}")
        if self.batched:
            return DraftJob(self, history[keep:], k)
        return self.chain(history[keep:], k)

    def chain(self, feed: list[int], k: int) -> mx.array:
        """Feed ``feed`` and chain k-1 more draft steps on this request's own cache.

        The steps are chained lazily, each queued as soon as it is built, and
        handed over unevaluated: the main model's verify pass is built on them
        and one evaluation runs both (no sync per token or per model)."""
        cache = self.cache
        release_row(self.draft.batch, cache)
        y = mx.argmax(cache.feed(feed)[-1][: self.vocab_size])
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

    def fed_lazily(self, start: int, drafts: mx.array) -> None:
        """All but the last of ``drafts`` were fed from ``start`` unevaluated;
        their ids are named in the cache when the next round is proposed."""
        self._unresolved = (start, drafts)

    def _resolve(self) -> None:
        """Name the draft ids fed lazily last round (evaluated by now)."""
        if self._unresolved is not None:
            start, drafts = self._unresolved
            self.cache.resolve(start, drafts.tolist()[:-1])
            self._unresolved = None

    def observe(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        if not self._proposed:  # a round the loop queued ahead (plain_ahead)
            self.policy.skip()
        self._proposed = False
        if drafted and self.draft is not None:
            self.draft.record(drafted, accepted)
        self.policy.observe(drafted, accepted, seconds, catch_up=self._catch_up)


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
