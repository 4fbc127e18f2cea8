"""ModelKit: a loaded text model, its tokenizer and the caches kept between
requests, plus an optional draft model (draft/model.py) and its request
registry (registry.Activity)."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from ..caches.disk import DiskCache, model_identity
from ..caches.prompt import PromptCache, PromptCacheOptions
from ..caches.ragged import RaggedBatch, can_batch
from ..caches.sequence import CacheOptions, SequenceCache
from ..draft.model import DraftModel
from ..drafters.suffix import DEFAULT_SUFFIX_MEMORY_TOKENS, SuffixMemory
from ..errors import InvalidArgument
from ..loading import model as loading
from ..loading.memory import PREFILL_CHUNK, default_memory_budget, fit_context
from ..pricing import cost_store, costs
from ..pricing.batch_pricing import DraftingRows
from ..pricing.cost_background import BackgroundMeasurement
from ..pricing.cost_book import CostBook
from ..runtime import worker as workers
from ..runtime.scheduler import Scheduler
from ..runtime.worker import MLXWorker, shutting_down
from .registry import Activity, process_idle_seconds

logger = logging.getLogger(__name__)


@dataclass
class ExpandedPrompt:
    """A request's prompt as the kit and its cache see it: ``ids`` are the real
    token ids (images expanded by a vision kit), ``keys`` what the cache records
    for them (equal to ``ids`` except at image positions, which hold image-hash keys)."""

    ids: list[int]
    keys: list[int]


@dataclass(frozen=True)
class KitOptions:
    """A kit's load options, as ``load_model`` checked them."""

    cache: CacheOptions = CacheOptions()
    vocab_only: bool = False
    trust_remote_code: bool = False
    compute_dtype: str | None = "auto"
    prompt_cache: PromptCacheOptions = PromptCacheOptions()
    max_parallel: int | None = None  # None: DEFAULT_MAX_PARALLEL
    suffix_memory_tokens: int = DEFAULT_SUFFIX_MEMORY_TOKENS  # 0: no suffix drafting memory


DEFAULT_MAX_PARALLEL = 4


def validate_suffix_memory(value) -> int:
    """The suffix memory's token bound: ``value``, or the default for None;
    ``ValueError`` unless it is None or a non-negative integer."""
    if value is None:
        return DEFAULT_SUFFIX_MEMORY_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"suffix_memory_tokens must be a non-negative integer (0: off) or None, got {value!r}")
    return value


def validate_max_parallel(value) -> int | None:
    """``ValueError`` unless ``value`` is None or an integer from 1 to 64."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise ValueError(
            f"max_parallel must be an integer from 1 to 64 (concurrent generations) or None, got {value!r}"
        )
    return value


class ModelKit:
    """A text model ready to generate. Create it with ``mlx_engine.load_model``."""

    # Whether forward costs are measured between requests (after an estimate) rather
    # than at once; a sharded kit measures at once, every rank taking part.
    background_cost_measurement = True

    def __init__(self, model_path: str | Path, options: KitOptions = KitOptions(), worker: MLXWorker | None = None):
        """Load the kit whole: files, weights, caches and the engine thread that runs
        it (``worker``: the one ``load_model`` built it on; see ``_init_runtime``).
        The steps are methods a subclass extends (VisionModelKit)."""
        files = self._model_files(model_path)
        self._init_files(files, options)
        if not options.vocab_only:
            self._load_weights(files, options)
        self._init_runtime(worker)

    def _model_files(self, model_path: str | Path) -> loading.HFFiles | loading.GGUFFiles:
        """The model's files, their format chosen once (``loading.model_files``)."""
        return loading.model_files(loading.resolve_model_path(model_path))

    def _load_weights(self, files: loading.HFFiles | loading.GGUFFiles, options: KitOptions) -> None:
        """The model, readied and checked, and the caches and limits that depend on it."""
        self.model, self.config = files.weights(options.trust_remote_code)
        self.compute_dtype = loading.prepare_weights(self.model, options.compute_dtype)
        self.num_params = loading.float_param_count(self.model)
        loading.smoke_test(self.model, self.model_path)
        kv = options.cache
        if kv.kv_bits is not None:
            head_dim = loading.attention_head_dim(self.config)
            if head_dim is not None and head_dim % kv.kv_group_size:
                raise ValueError(
                    f"kv_group_size must divide the model's attention head size ({head_dim}); got {kv.kv_group_size}"
                )
        self.prompt_cache = self._make_prompt_cache(self.new_cache(self.model))
        self._fit_context()
        self._init_batching(options.max_parallel)
        logger.info(
            "loaded %s (%s, compute dtype %s)",
            self.model_path,
            self.config.get("model_type"),
            self.compute_dtype or "native",
        )

    def _init_runtime(self, thread: MLXWorker | None) -> None:
        """The kit's engine thread and its requests' scheduler, made last (a kit that
        failed to load holds neither). The scheduler is made here, not with the first
        generation: it starts no thread (a list, a weak reference to the kit) and the
        engine thread steps it only while it has live requests, so an unused kit costs
        nothing more. A kit built directly takes a pool thread, returned once it is gone."""
        if thread is None:
            thread = workers.release_with(self, workers.acquire())
        self._worker = thread
        self._scheduler = Scheduler(self, thread.failure_of)
        thread.serve(self._scheduler)

    def _fit_context(self) -> None:
        """``context_length``: with ``max_kv_size="auto"`` the longest context that
        fits memory (loading/memory.py), else the one the model was trained for."""
        trained = self.config.get("text_config", self.config).get("max_position_embeddings")
        trained = int(trained) if isinstance(trained, int) and trained > 0 else None
        self.context_length = fit_context(self.model, trained) if self.cache_options.auto_context else trained

    def _init_batching(self, max_parallel: int | None) -> None:
        """``max_parallel`` concurrent generations (see ``batch``)."""
        self.max_parallel = DEFAULT_MAX_PARALLEL if max_parallel is None else max_parallel

    @property
    def activity(self) -> Activity:
        """The request registry: open, running and cancelled requests."""
        return self._activity

    @property
    def worker(self) -> MLXWorker:
        """The engine thread that runs this kit's MLX work (runtime/worker.py)."""
        return self._worker

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of its requests (runtime/scheduler.py), stepped by ``worker``."""
        return self._scheduler

    @property
    def open_generations(self) -> int:
        """How many generators on this kit are open (created and not yet ended,
        closed or cancelled); at most ``max_parallel``. Safe from any thread."""
        with self._activity.lock:
            return len(self._activity.known)

    @property
    def batch(self) -> RaggedBatch | None:
        """The rows of the running generations, decoded in one forward pass per
        step; None when the kit serves one generation at a time or its caches
        cannot be batched (caches/ragged.py). Rebuilt, between requests, for a
        model that was swapped."""
        current = self._batch
        if current is not None and (current.model is self.model or current.rows):
            return current
        cache = self.cache
        batchable = self.max_parallel > 1 and self.model is not None and cache is not None and can_batch(cache)
        self._batch = RaggedBatch(self.model, cache.layers) if batchable else None
        return self._batch

    def discard_batch(self) -> None:
        """Drop a broken batch: its rows' caches restart empty, and the next
        ``batch`` is a new, empty one (the scheduler's recovery)."""
        if self._batch is not None:
            for cache in self._batch.rows:
                cache.reset()
        self._batch = None

    def set_draft(self, draft: DraftModel | None, name: str | None = None) -> None:
        """Install a loaded draft model (or none) under ``name``, what its loader
        called it; draft/loading.py checks and loads it."""
        self.draft = draft
        self.draft_name = name if draft is not None else None

    def _init_files(self, files: loading.HFFiles | loading.GGUFFiles, options: KitOptions) -> None:
        """What every kit starts from: config, tokenizer and empty slots (the
        format was chosen once, ``files``)."""
        self.model_path = files.path
        self.config = files.config()
        self.check_architecture()
        self.cache_options = options.cache
        self.tokenizer = files.tokenizer(options.trust_remote_code)
        self.eos_token_ids = loading.eos_token_ids(self.tokenizer)
        self.vocab_only = options.vocab_only
        self.model: nn.Module | None = None
        self.prompt_cache: PromptCache | None = None
        self.context_length: int | None = None  # tokens a request may hold (see _fit_context)
        self._prompt_cache_options = options.prompt_cache
        self.draft: DraftModel | None = None
        self.draft_name: str | None = None  # what load_draft_model was given for it (api.draft_name)
        self.compute_dtype: mx.Dtype | None = None
        self.cost_model: costs.CostModel | None = None  # see forward_costs
        self.cost_source: str | None = None  # where cost_model came from: stored, estimate, measured
        self._cost_measurement: BackgroundMeasurement | None = None
        self.cost_book: CostBook | None = None  # the costs refined by timed rounds (cost_book.py)
        # What earlier requests produced, for suffix drafting (drafters/suffix.py).
        self.suffix_memory = SuffixMemory(options.suffix_memory_tokens) if options.suffix_memory_tokens else None
        # What the batch's lookup rows can draft, so each prices its drafts with the others'.
        self.drafting_rows = DraftingRows()
        self.num_params = 0
        self._activity = Activity()
        self.max_parallel = 1  # concurrent generations (see _init_batching)
        self._batch: RaggedBatch | None = None  # see ``batch``

    def forward_costs(self) -> costs.CostModel:
        """The model's forward-pass costs by width, set up once per kit when
        speculation first needs them: a record an earlier process stored for
        this model and machine (cost_store.py); else an estimate from one timed
        step, measured properly between this kit's requests (cost_background.py)
        and then stored. Refined since by the rounds requests timed
        (``observe_round``, cost_book.py). docs/decoding.md, "Round costs"."""
        if self.cost_model is None or self.cost_book is None:
            self.cost_book = self._open_cost_book()
        self.cost_model, self.cost_source = self.cost_book.current(), self.cost_book.source
        return self.cost_model

    def observe_round(self, width: int, seconds: float | None) -> None:
        """A speculative round of this kit verified ``width`` tokens (no draft
        model's steps in it) in ``seconds``: evidence for its forward costs.
        Only while the round ran alone: in a batch the pass was wider."""
        if self.cost_book is not None and self.open_generations <= 1:
            self.cost_book.observe(width, seconds)

    def cost_key(self, kind: str, path: Path | None = None) -> dict:
        """What a stored cost record of this kit (``path``: its draft's) depends on."""
        model = model_identity(path or self.model_path, self.compute_dtype, self.cache_options)
        return {"kind": kind, "kit": type(self).__name__, "model": model, **cost_store.machine_identity()}

    def _open_cost_book(self) -> CostBook:
        """The kit's cost book, from the stored record, a measurement taken now
        (a kit that cannot measure between requests) or an estimate."""
        ref, root, key = weakref.ref(self), cost_store.store_dir(), self.cost_key("forward")

        def save(value: dict) -> None:
            cost_store.save(key, value, root)

        def remeasure() -> None:
            kit = ref()
            if kit is not None and kit.background_cost_measurement:
                kit._measure_costs_in_background()

        record = cost_store.load(key)
        stored = costs_from_record(record)
        if stored is not None:
            return CostBook(stored, "stored", record, save, remeasure)
        if not self.background_cost_measurement:
            m = costs.Measurement(self.model, self.vocab_size)
            while not m.step():
                pass
            measured = m.result()
            value = measured_record(m, measured)
            cost_store.save(key, value, root)
            return CostBook(measured, "measured", value, save, remeasure)
        step = costs.measure_step(self.model, self.vocab_size)
        logger.info("forward costs estimated from a %.2f ms step; measuring them between requests", step * 1e3)
        book = CostBook(costs.estimate(step), "estimate", None, save, remeasure)
        self.cost_book = book
        self._measure_costs_in_background()
        return book

    def _measure_costs_in_background(self) -> None:
        """Measure the widths between requests (cost_background.py). The tasks
        hold the kit weakly, so a kit dropped without ``unload`` is not kept
        alive by them, and the record goes where the store was when it started."""
        # Weakly, the model too: a measurement stopped by ``unload`` holds nothing of it.
        model, ref, root, book = weakref.ref(self.model), weakref.ref(self), cost_store.store_dir(), self.cost_book

        def finish(measurement: costs.Measurement, measured: costs.CostModel) -> None:
            kit = ref()
            if kit is not None and kit.cost_book is book:  # stored first: a reader that sees "measured" finds it
                value = measured_record(measurement, measured)
                cost_store.save(kit.cost_key("forward"), value, root)
                book.replace(measured, value)
                kit.cost_model, kit.cost_source = book.current(), book.source

        self._cost_measurement = BackgroundMeasurement(
            costs.Measurement(self.model, self.vocab_size),
            self.worker.submit,
            # Idle for a moment, not just between two back-to-back requests (an agent's
            # loop, a benchmark): a pass started then would delay the next one. And no
            # other model's request either (a server hosting several): the passes would
            # be timed beside its stream, and slow it.
            idle=lambda: ref() is not None and process_idle_seconds() >= IDLE_GRACE_S,
            alive=lambda: (
                (kit := ref()) is not None and kit.model is not None and kit.model is model() and not worker_exiting()
            ),
            finish=finish,
        )
        self._cost_measurement.start()

    def check_architecture(self) -> None:
        """Refuse an architecture mlx-lm cannot build (VisionModelKit: mlx-vlm)."""
        loading.check_architecture(self.config, self.model_path)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model accepts (its embedding rows)."""
        if self.model is not None:
            embed = loading.embedding_rows(self.model)
            if embed is not None:
                return int(embed)
        return int(self.config.get("vocab_size") or len(self.tokenizer))

    def new_cache(self, model: nn.Module) -> SequenceCache:
        return SequenceCache(model, self.cache_options)

    @property
    def cache(self) -> SequenceCache | None:
        """The cached sequence the current (or last) request uses; the others
        are in ``prompt_cache`` (prompt_cache.py)."""
        return self.prompt_cache.active if self.prompt_cache is not None else None

    def replace_prompt_cache(self, first: SequenceCache) -> None:
        """Start the prompt cache over with ``first`` as its only cached sequence,
        dropping every other one (docs/api.md, "Prompt cache"); the kit made its
        prompt cache at load (``_make_prompt_cache``)."""
        if self.prompt_cache is None:
            self.prompt_cache = self._make_prompt_cache(first)
        else:
            self.prompt_cache.replace_all(first)

    def _make_prompt_cache(self, first: SequenceCache) -> PromptCache:
        o = self._prompt_cache_options
        disk = None
        if o.directory is not None:
            identity = model_identity(self.model_path, self.compute_dtype, self.cache_options)
            disk = DiskCache(o.directory, identity, o.disk_bytes)
        budget = default_memory_budget() if o.memory_bytes is None else o.memory_bytes
        cache = PromptCache(lambda: self.new_cache(self.model), budget, disk)
        cache.replace_all(first)
        return cache

    # Prompt handling; VisionModelKit overrides these to add images.
    def decode_images(self, prompt: list[int], images_b64) -> list:
        if images_b64 is None or (isinstance(images_b64, (list, tuple)) and not images_b64):
            return []
        raise InvalidArgument(
            "{param}: this is a text-only model and cannot take images; load a vision model (its config.json has "
            "vision_config)",
            "images_b64",
        )

    def remember_sequence(self, name, tokens: list[int]) -> None:
        """Record a request's tokens (prompt and output) in the suffix memory,
        from which later requests draft (nothing when it is off)."""
        if self.suffix_memory is not None:
            self.suffix_memory.record(name, tokens)

    def expand_prompt(self, prompt: list[int], images: list | None = None) -> ExpandedPrompt:
        """The request's prompt as the cache sees it (see ExpandedPrompt)."""
        return ExpandedPrompt(prompt, prompt)

    def prefill_prompt(
        self,
        expanded: ExpandedPrompt,
        cache: SequenceCache,
        todo: list[int],
        on_chunk=None,
        chunk_size: int = PREFILL_CHUNK,
    ) -> Iterator[None]:
        """Feed ``todo``, the part of the ``expanded`` prompt (all but its last token)
        that ``cache`` lacks, yielding after each chunk (the scheduler lets the
        other requests take a step there)."""
        for i in range(0, len(todo), chunk_size):
            cache.prefill(todo[i : i + chunk_size], on_chunk, chunk_size)
            yield

    def unload(self) -> None:
        try:
            if self.prompt_cache is not None:
                self.prompt_cache.flush()  # to the disk tier, when there is one (its writes never raise)
        finally:  # whatever the disk does, the model is released
            if self._cost_measurement is not None:
                self._cost_measurement.stop()  # its scratch cache and model go now, not at its next retry
            self.model = None
            self.prompt_cache = None
            self._batch = None
            self.draft = None
            self.cost_model = self.cost_book = None
            self.suffix_memory = None  # earlier requests' tokens: nothing to draft for any more
            mx.clear_cache()


def costs_from_record(record: dict | None) -> costs.CostModel | None:
    """A stored forward-cost record as a CostModel, or None if it is not a valid
    one (a record of another cost-model version is not: measured again)."""
    if (record or {}).get("version") != costs.COST_MODEL_VERSION:
        if record is not None:
            logger.info("forward costs: ignoring a record of cost-model version %r", record.get("version"))
        return None
    seconds = cost_store.positive_floats((record or {}).get("seconds"), costs.MAX_DRAFT + 1)
    if seconds is None or seconds != sorted(seconds):
        return None
    return costs.CostModel(tuple(seconds))


#: How long a kit must have been without a request before a background cost
#: measurement runs a pass: a request arriving meanwhile waits for that pass.
IDLE_GRACE_S = 1.0


def measured_record(m: costs.Measurement, measured: costs.CostModel | None = None) -> dict:
    """The stored record of a finished measurement (``measured``: its result):
    its seconds, the cost-model version, and when and how it was measured."""
    return {
        "seconds": list((measured or m.result()).seconds),
        "version": costs.COST_MODEL_VERSION,
        "measured_at": time.time(),
        "how": m.description(),
    }


def worker_exiting() -> bool:
    return shutting_down.is_set()
