"""The public API: load models, stream generations, manage draft models."""

from __future__ import annotations

import logging
import numbers
import time
import uuid
import weakref
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx

from . import loading, worker
from .errors import CallbackError, GenerationInProgressError
from .images import validate_max_image_pixels
from .model_kit import ModelKit
from .vision_model_kit import VisionModelKit
from .results import (
    GenerationResult,
    GenerationStats,
    GenerationStopCondition,
    StopReason,
    Token,
    TopLogprob,
)
from .sampling import SamplingParams, build_logits_processors, build_sampler, validate_sampling, validate_seed
from .speculative import costs
from .speculative.draft_model import (
    DraftModelDrafter,
    check_draft_model,
    load_draft,
    unload_draft,
)
from .speculative.loop import Drafter, decode
from .speculative.prompt_lookup import PromptLookupDrafter
from .speculative.router import AutoRouter
from .stop_strings import StopStringMatcher, TextStream
from .structured import GrammarConstraint, check_grammar, compile_constraint

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
DEFAULT_PROMPT_LOOKUP_TOKENS = 8
MAX_DRAFT_TOKENS = costs.MAX_DRAFT

ProgressCallback = Callable[[float], bool | None]
StatsCallback = Callable[[GenerationStats], None]


# -- models -------------------------------------------------------------------
def load_model(
    model_path: str | Path,
    *,
    max_kv_size: int | None = None,
    vocab_only: bool = False,
    trust_remote_code: bool = False,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
    seed: int | None = None,
    compute_dtype: str | None = "auto",
    max_image_pixels: int | None = None,
) -> ModelKit:
    """Load a local model directory (Hugging Face layout) into a kit.

    ``compute_dtype="auto"`` computes unquantized half-precision weights in
    float32 on the CPU, where that is several times faster; ``"native"`` keeps
    the stored dtype. A directory whose config.json has ``vision_config`` gives a
    ``VisionModelKit`` (docs/vision.md); ``max_image_pixels`` bounds its images.
    The kit's MLX work runs on its own engine thread (docs/reliability.md)."""
    options = dict(max_kv_size=max_kv_size, vocab_only=vocab_only, trust_remote_code=trust_remote_code,
                   kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                   seed=seed, compute_dtype=compute_dtype, max_image_pixels=max_image_pixels)
    thread = worker.acquire()
    try:
        kit = thread.call(_load_model, model_path, **options)
    except BaseException:
        worker.release(thread)
        raise
    _attach_worker(kit, thread)
    return kit


def _attach_worker(kit: ModelKit, thread: worker.MLXWorker) -> worker.MLXWorker:
    kit._worker = thread
    weakref.finalize(kit, worker.release, thread)  # the thread serves another kit once this one is gone
    return thread


def _worker_of(kit: ModelKit) -> worker.MLXWorker:
    return kit._worker or _attach_worker(kit, worker.acquire())


def _load_model(
    model_path: str | Path,
    *,
    max_kv_size: int | None,
    vocab_only: bool,
    trust_remote_code: bool,
    kv_bits: int | None,
    kv_group_size: int | None,
    quantized_kv_start: int | None,
    seed: int | None,
    compute_dtype: str | None,
    max_image_pixels: int | None,
) -> ModelKit:
    path = loading.resolve_model_path(model_path)
    config = loading.read_config(path)
    if max_image_pixels is not None:
        validate_max_image_pixels(max_image_pixels)
    if (seed := validate_seed(seed)) is not None:
        mx.random.seed(seed)
    if loading.is_vision_config(config):
        kit_class, extra = VisionModelKit, {"max_image_pixels": max_image_pixels}
    else:
        kit_class, extra = ModelKit, {}
    return kit_class(
        path,
        max_kv_size=max_kv_size,
        vocab_only=vocab_only,
        trust_remote_code=trust_remote_code,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        compute_dtype=compute_dtype,
        **extra,
    )


def tokenize(kit: ModelKit, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids for ``prompt`` with the kit's tokenizer. Special tokens written
    in the text (``<|im_start|>``) always encode whole; ``add_special_tokens``
    adds the ones the tokenizer puts around a text (BOS): pass False for text
    already rendered by a chat template, which holds its own BOS."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    if not isinstance(add_special_tokens, bool):
        raise ValueError(f"add_special_tokens must be True or False, got {add_special_tokens!r}")
    return list(kit.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))


def apply_chat_template(kit: ModelKit, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation (``[{"role": ..., "content": ...}, ...]``)
    rendered with the model's chat template, ready for ``create_generator``."""
    if not getattr(kit.tokenizer, "chat_template", None):
        raise ValueError("messages: this model's tokenizer has no chat template; tokenize plain text with tokenize()")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a list of dicts with 'role' and 'content'")
    try:
        ids = kit.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as exc:  # jinja errors raised by the template itself
        raise ValueError(f"messages: the chat template could not render them: {exc}") from exc
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def unload(kit: ModelKit) -> None:
    """Free the model, draft model and caches. The kit cannot generate afterwards.
    Refused with ``GenerationInProgressError`` while a generation is open: stop
    or close it first."""
    if not isinstance(kit, ModelKit):
        raise ValueError(f"kit must be a ModelKit from load_model, got {type(kit).__name__}")
    _require_idle(kit)
    _worker_of(kit).call(kit.unload)


def load_draft_model(kit: ModelKit, path: str | Path) -> None:
    """Load a draft model for speculative decoding; raises
    ``IncompatibleDraftModelError`` with every reason when it cannot serve the kit.
    All or nothing: when loading fails, the previous draft model stays loaded."""
    _require_model(kit)
    _require_idle(kit)
    _worker_of(kit).call(load_draft, kit, path)


def is_draft_model_compatible(kit: ModelKit, path: str | Path) -> bool:
    """Whether ``path`` could be loaded as this kit's draft model."""
    return check_draft_model(kit, path).compatible


def unload_draft_model(kit: ModelKit) -> None:
    """Release the draft model (no-op when none is loaded); the main cache stays."""
    _require_idle(kit)
    _worker_of(kit).call(unload_draft, kit)


def stop_generation(kit: ModelKit, request_id: str) -> bool:
    """Ask the generation with ``request_id`` to stop; safe from any thread.
    It ends with ``user_cancelled``. Returns False when no such request exists."""
    act = kit._activity
    with act.lock:
        if request_id not in act.known:
            return False
        act.cancelled.add(request_id)
        return True


# -- generation ---------------------------------------------------------------
def create_generator(
    kit: ModelKit,
    prompt_tokens: list[int],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temp: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    min_tokens_to_keep: int | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    seed: int | None = None,
    stop_strings: list[str] | None = None,
    top_logprobs: int | None = None,
    prompt_progress_callback: ProgressCallback | None = None,
    stats_callback: StatsCallback | None = None,
    request_id: str | None = None,
    num_draft_tokens: int | None = None,
    speculative_decoding_toggle: bool | None = None,
    prompt_lookup_num_tokens: int | None = None,
    prompt_lookup_min_ngram: int = 1,
    prompt_lookup_max_ngram: int = 3,
    prompt_lookup_num_candidates: int = 4,
    auto_speculative: bool = False,
    images_b64: list[str] | None = None,
    json_schema: dict | str | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    structured_drafting: bool = True,
) -> Iterator[GenerationResult]:
    """Stream the continuation of ``prompt_tokens``.

    Arguments are checked before anything runs; a bad one raises ``ValueError``
    naming it. The returned iterator yields one result per token (text may be
    empty while a possible stop string is held back) and always ends with one
    result carrying ``stop_condition`` and ``stats``. Closing it, or
    ``stop_generation(kit, request_id)``, cancels. A kit runs one generation at a
    time: starting a second while one is active raises
    ``GenerationInProgressError``. Decoding modes are described in docs/decoding.md.
    ``images_b64`` (vision kits, docs/vision.md): base64 images, one per image
    placeholder token in ``prompt_tokens``, decoded and checked here.
    ``json_schema`` / ``regex`` / ``grammar`` (Lark) constrain the output
    (docs/api.md, "Structured output"); ``structured_drafting`` drafts the tokens
    the grammar forces.
    The generation runs on the kit's engine thread; callbacks are called there.
    """
    _require_model(kit)
    if isinstance(prompt_tokens, mx.array):
        prompt_tokens = prompt_tokens.tolist()  # evaluated here: the host's array, the host's thread
    args = {k: v for k, v in locals().items() if k not in ("kit", "prompt_tokens")}
    thread = _worker_of(kit)
    return worker.WorkerIterator(thread, thread.call(_create_generator, kit, prompt_tokens, **args))


def _create_generator(
    kit: ModelKit,
    prompt_tokens: list[int],
    *,
    max_tokens: int,
    temp: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    min_tokens_to_keep: int | None,
    repetition_penalty: float | None,
    repetition_context_size: int,
    seed: int | None,
    stop_strings: list[str] | None,
    top_logprobs: int | None,
    prompt_progress_callback: ProgressCallback | None,
    stats_callback: StatsCallback | None,
    request_id: str | None,
    num_draft_tokens: int | None,
    speculative_decoding_toggle: bool | None,
    prompt_lookup_num_tokens: int | None,
    prompt_lookup_min_ngram: int,
    prompt_lookup_max_ngram: int,
    prompt_lookup_num_candidates: int,
    auto_speculative: bool,
    images_b64: list[str] | None,
    json_schema: dict | str | None,
    regex: str | None,
    grammar: str | None,
    structured_drafting: bool,
) -> Iterator[GenerationResult]:
    """create_generator's checks and the generator, on the kit's engine thread."""
    prompt = _validate_prompt(kit, prompt_tokens)
    images = kit.decode_images(prompt, images_b64)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    params = validate_sampling(
        temp=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        min_tokens_to_keep=min_tokens_to_keep,
        repetition_penalty=repetition_penalty,
        repetition_context_size=repetition_context_size,
        seed=seed,
        top_logprobs=top_logprobs,
        vocab_size=kit.vocab_size,
    )
    stops = StopStringMatcher.validate(stop_strings)
    for name, cb in (("prompt_progress_callback", prompt_progress_callback), ("stats_callback", stats_callback)):
        if cb is not None and not callable(cb):
            raise ValueError(f"{name} must be callable or None")
    if request_id is not None and not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string or None, got {request_id!r}")
    constraint = compile_constraint(json_schema, regex, grammar)
    if constraint is not None:
        check_grammar(kit, *constraint)
    if not isinstance(structured_drafting, bool):
        raise ValueError(f"structured_drafting must be True or False, got {structured_drafting!r}")
    mode = _choose_mode(
        kit,
        num_draft_tokens=num_draft_tokens,
        toggle=speculative_decoding_toggle,
        lookup_tokens=prompt_lookup_num_tokens,
        lookup_ngrams=(prompt_lookup_min_ngram, prompt_lookup_max_ngram, prompt_lookup_num_candidates),
        auto=auto_speculative,
    )
    _require_idle(kit)
    request_id = request_id or uuid.uuid4().hex
    with kit._activity.lock:
        if request_id in kit._activity.known:
            raise ValueError(f"request_id {request_id!r} is already in use on this kit")
        kit._activity.known.add(request_id)
    structured = None if constraint is None else (constraint[1], structured_drafting)
    return _generate(
        kit, prompt, max_tokens, params, stops, prompt_progress_callback, stats_callback, request_id, mode, images,
        structured,
    )


def _require_model(kit: ModelKit) -> None:
    if not isinstance(kit, ModelKit):
        raise ValueError(f"kit must be a ModelKit from load_model, got {type(kit).__name__}")
    if kit.vocab_only:
        raise ValueError("this kit was loaded with vocab_only=True and cannot generate; load it without vocab_only")
    if kit.model is None:
        raise ValueError("this kit has been unloaded")


def _require_idle(kit: ModelKit) -> None:
    if kit._activity.active is not None:
        raise GenerationInProgressError(
            f"generation {kit._activity.active!r} is still running on this kit; finish or close it first "
            "(a kit runs one generation at a time)"
        )


def _validate_prompt(kit: ModelKit, prompt_tokens) -> list[int]:
    """The prompt as a list of Python ints. Any sequence of integers is accepted
    (ints, numpy or MLX integer scalars, a 1-D integer array); text, mappings and
    sets are refused."""
    if isinstance(prompt_tokens, (str, bytes)):
        raise ValueError("prompt_tokens must be a list of token ids; use tokenize(kit, text) for text")
    if isinstance(prompt_tokens, (Mapping, Set)):
        raise ValueError(f"prompt_tokens must be a sequence of token ids, got a {type(prompt_tokens).__name__}")
    if getattr(prompt_tokens, "ndim", 1) != 1:
        raise ValueError(f"prompt_tokens must be one-dimensional, got shape {tuple(prompt_tokens.shape)}")
    if isinstance(prompt_tokens, mx.array):
        prompt_tokens = prompt_tokens.tolist()
    try:
        prompt = list(prompt_tokens)
    except TypeError:
        raise ValueError(f"prompt_tokens must be a list of token ids, got {type(prompt_tokens).__name__}") from None
    if not prompt:
        raise ValueError("prompt_tokens must not be empty")
    vocab = kit.vocab_size
    ids = []
    for i, t in enumerate(prompt):
        t = _token_id(t)
        if t is None:
            raise ValueError(f"prompt_tokens must be integers; item {i} is {prompt[i]!r}")
        if not 0 <= t < vocab:
            raise ValueError(f"prompt_tokens[{i}] = {t} is outside the vocabulary [0, {vocab})")
        ids.append(t)
    return ids


def _token_id(t) -> int | None:
    """``t`` as an int if it is an integer (Python, numpy or a 0-d integer array)."""
    if isinstance(t, bool):
        return None
    if isinstance(t, numbers.Integral):
        return int(t)
    dtype = getattr(t, "dtype", None)
    if getattr(t, "ndim", None) == 0 and dtype is not None and "int" in str(dtype) and "bool" not in str(dtype):
        return int(t.item())
    return None


def _choose_mode(kit: ModelKit, *, num_draft_tokens, toggle, lookup_tokens, lookup_ngrams, auto) -> dict:
    """Resolve the decoding mode from the arguments (rules in docs/decoding.md)."""
    if toggle not in (None, True, False):
        raise ValueError(f"speculative_decoding_toggle must be True, False or None, got {toggle!r}")
    if not isinstance(auto, bool):
        raise ValueError(f"auto_speculative must be a bool, got {auto!r}")
    for name, value, lo in (("num_draft_tokens", num_draft_tokens, 1), ("prompt_lookup_num_tokens", lookup_tokens, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= MAX_DRAFT_TOKENS):
            raise ValueError(f"{name} must be an integer from {lo} to {MAX_DRAFT_TOKENS} or None, got {value!r}")
    min_n, max_n, cands = lookup_ngrams
    for name, value in (("prompt_lookup_min_ngram", min_n), ("prompt_lookup_max_ngram", max_n), ("prompt_lookup_num_candidates", cands)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if min_n > max_n:
        raise ValueError(f"prompt_lookup_min_ngram ({min_n}) must not exceed prompt_lookup_max_ngram ({max_n})")
    has_draft = kit.draft is not None
    if toggle is True and not has_draft:
        raise ValueError("speculative_decoding_toggle=True requires a draft model; call load_draft_model first")
    if num_draft_tokens is not None and (not has_draft or toggle is False):
        raise ValueError("num_draft_tokens needs a loaded draft model that this request uses")
    use_draft = has_draft and toggle is not False
    if auto:
        return {"kind": "auto", "draft": use_draft, "draft_k": num_draft_tokens,
                "lookup_k": lookup_tokens or DEFAULT_PROMPT_LOOKUP_TOKENS, "ngrams": lookup_ngrams}
    if lookup_tokens is not None:
        if toggle is True or num_draft_tokens is not None:
            raise ValueError(
                "prompt_lookup_num_tokens and the draft model (speculative_decoding_toggle=True or num_draft_tokens) "
                "are both requested; pick one, or pass auto_speculative=True to let the engine choose"
            )
        return {"kind": "prompt_lookup", "lookup_k": lookup_tokens, "ngrams": lookup_ngrams}
    if use_draft:
        return {"kind": "draft_model", "draft_k": num_draft_tokens}
    return {"kind": "plain"}


def _kit_costs(kit: ModelKit) -> costs.CostModel:
    if kit.cost_model is None:
        kit.cost_model = costs.measure(kit.model, kit.vocab_size)
    return kit.cost_model


def _draft_step_cost(kit: ModelKit) -> float:
    """A draft-model step, as the drafter chains them, in main-model steps
    (measured once per loaded draft)."""
    draft = kit.draft
    if draft.step_cost is None:
        draft.step_cost = costs.measure_chained_step(draft.model, kit.vocab_size)
    return draft.step_cost / _kit_costs(kit).step()


def _top_logprobs(kit: ModelKit, logprobs: mx.array, n: int) -> list[TopLogprob]:
    idx = mx.argpartition(-logprobs, kth=n - 1)[:n]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    ids, lps = idx[order].tolist(), vals[order].tolist()
    return [TopLogprob(i, kit.tokenizer.decode([i]), lp) for i, lp in zip(ids, lps)]


class _Cancelled(Exception):
    pass


def _process_prompt(
    kit: ModelKit,
    prompt: list[int],
    main_todo: list[int],
    draft_drafter: DraftModelDrafter | None,
    progress_cb: ProgressCallback | None,
    cancelled: Callable[[], bool],
) -> None:
    """Prefill the main (and draft) caches with the prompt's uncached part,
    reporting progress from 0 to 100 over both models' work (the draft's weighted
    by its size). Raises _Cancelled between chunks when asked to stop."""
    draft_todo, draft_weight = 0, 0.0
    if draft_drafter is not None:
        draft_todo = len(prompt) - 1 - min(len(draft_drafter.draft.cache.tokens), len(prompt) - 1)
        draft_weight = kit.draft.num_params / kit.num_params
    total = len(main_todo) + draft_weight * draft_todo
    done = 0.0

    def report(percent: float) -> None:
        if progress_cb is None:
            return
        try:
            keep_going = progress_cb(percent)
        except Exception as exc:
            raise CallbackError(f"prompt_progress_callback raised {type(exc).__name__}: {exc}") from exc
        if keep_going is False:
            raise _Cancelled()

    def chunk_done(weight: float) -> Callable[[int], None]:
        def on_chunk(n: int) -> None:
            nonlocal done
            done += n * weight
            if cancelled():
                raise _Cancelled()
            if done < total:
                report(100.0 * done / total)

        return on_chunk

    report(0.0)
    kit.prefill_prompt(main_todo, chunk_done(1.0))
    if draft_drafter is not None:
        draft_drafter.prefill(prompt, chunk_done(draft_weight))
    report(100.0)


def _generate(
    kit: ModelKit,
    prompt: list[int],
    max_tokens: int,
    params: SamplingParams,
    stop_strings: list[str],
    progress_cb: ProgressCallback | None,
    stats_cb: StatsCallback | None,
    request_id: str,
    mode: dict,
    images: list | None = None,
    structured: tuple[str, bool] | None = None,
) -> Iterator[GenerationResult]:
    act = kit._activity
    with act.lock:
        if act.active is not None:
            act.known.discard(request_id)
            raise GenerationInProgressError(f"generation {act.active!r} is still running on this kit")
        act.active = request_id
    steps = None
    model_work = False  # whether the caches may hold a half-recorded forward pass
    try:
        stats = GenerationStats(prompt_tokens=len(prompt))
        t_start = time.perf_counter()
        mx.reset_peak_memory()
        if params.seed is not None:
            mx.random.seed(params.seed)
        plan = kit.plan_prompt(prompt, images)  # a vision kit expands its images here
        prompt = plan.ids
        stats.prompt_tokens = len(prompt)
        cache = kit.cache
        stats.cached_tokens = cache.sync_to(plan.keys[:-1])
        # Build the drafter first: the draft model's prompt is prefilled too.
        t_setup = time.perf_counter()
        drafter, draft_drafter = _make_drafter(kit, prompt, mode, stats)  # may measure costs once per kit
        stats.setup_time = time.perf_counter() - t_setup
        main_todo = prompt[stats.cached_tokens : -1]
        model_work = True
        try:
            _process_prompt(kit, prompt, main_todo, draft_drafter, progress_cb, lambda: _stop_requested(act, request_id))
        except _Cancelled:
            stats.total_time = time.perf_counter() - t_start
            yield _final(GenerationResult("", []), "user_cancelled", stats, stats_cb)
            return

        sampler = build_sampler(params)
        processors = build_logits_processors(params)
        history = list(prompt)
        fallback_note = cache.rewind_limit_reason(2) if drafter is not None else None
        if fallback_note:
            stats.mode_reason = f"fell back to plain decoding: {fallback_note}"
            stats.decoding_mode = "plain"
            drafter = None

        def on_fallback(reason: str) -> None:
            stats.mode_switches.append(f"{stats.decoding_mode} -> plain: {reason}")
            stats.decoding_mode = "plain"

        constraint = None if structured is None else GrammarConstraint(kit, structured[0], draft_forced=structured[1])
        steps = decode(cache, history, max_tokens, sampler, processors, params.repetition_context_size,
                       drafter, stats, on_fallback, constraint)

        stream = TextStream(kit.tokenizer.detokenizer, stop_strings)
        t_first = None

        def finish(text: str, tokens: list[Token], tops, stop) -> GenerationResult:
            stats.generated_tokens = n_generated
            return _finish(GenerationResult(text, tokens, tops), stop, stats, stats_cb, t_start, t_first, len(main_todo))

        n_generated = 0
        for step in steps:
            if t_first is None:
                t_first = time.perf_counter()
            if _stop_requested(act, request_id):
                yield finish(stream.finish().text, [], None, "user_cancelled")
                return
            n_generated += 1
            tok = step.token
            if tok in kit.eos_token_ids:
                tail = stream.finish()
                stop = (
                    GenerationStopCondition("stop_string", tail.stop_string, [tok])
                    if tail.stop_string
                    else GenerationStopCondition("eos_token", None, [tok])
                )
                yield finish(tail.text, [], None, stop)
                return
            token = Token(tok, kit.tokenizer.decode([tok]), step.logprob, step.from_draft)
            tops = [_top_logprobs(kit, step.logprobs, params.top_logprobs)] if params.top_logprobs else None
            last = n_generated >= max_tokens
            event = stream.push(tok, final=last or step.completes_grammar)
            if event.stop_string is not None:
                stop = GenerationStopCondition("stop_string", event.stop_string, event.stop_tokens)
                yield finish(event.text, [token], tops, stop)
                return
            if step.completes_grammar:
                yield finish(event.text, [token], tops, "grammar_complete")
                return
            if last:
                yield finish(event.text, [token], tops, "token_limit")
                return
            yield GenerationResult(event.text, [token], tops)
    except CallbackError:
        raise  # raised between prompt chunks or at the end: caches are consistent
    except Exception:
        # An unexpected failure during model work may have left a forward pass
        # half-recorded; start the next request from clean caches rather than
        # risk reusing a bad one. A failure before it leaves the caches as they were.
        if model_work:
            _reset_caches(kit)
        raise
    finally:
        if steps is not None:
            steps.close()
        with act.lock:
            act.active = None
            act.known.discard(request_id)
            act.cancelled.discard(request_id)


def _stop_requested(act, request_id: str) -> bool:
    """Cancelled by stop_generation, or the process is exiting."""
    return request_id in act.cancelled or worker.shutting_down.is_set()


def _reset_caches(kit: ModelKit) -> None:
    if kit.cache is not None:
        kit.cache.reset()
    if kit.draft is not None:
        kit.draft.cache.reset()


def _make_drafter(kit: ModelKit, prompt: list[int], mode: dict, stats: GenerationStats) -> tuple[Drafter | None, DraftModelDrafter | None]:
    """The drafter for this request, and the draft-model drafter inside it (whose
    prompt must be prefilled) if any."""
    kind = mode["kind"]
    if kind == "plain":
        return None, None
    if kind == "prompt_lookup" or kind == "auto":
        min_n, max_n, cands = mode["ngrams"]
        lookup = PromptLookupDrafter(mode["lookup_k"], min_n, max_n, cands)
    if kind == "prompt_lookup":
        stats.decoding_mode = "prompt_lookup"
        stats.mode_reason = f"requested: prompt_lookup_num_tokens={mode['lookup_k']}"
        return lookup, None
    draft = None
    if kind == "draft_model" or mode.get("draft"):
        # Round costs drive the adaptive length, and the router's choice of mode.
        needs_costs = mode["draft_k"] is None or kind == "auto"
        draft = DraftModelDrafter(
            kit.draft,
            mode["draft_k"],
            costs.RoundCosts(_kit_costs(kit), _draft_step_cost(kit)) if needs_costs else None,
            vocab_size=kit.vocab_size,
        )
    if kind == "draft_model":
        stats.decoding_mode = "draft_model"
        stats.mode_reason = "draft model loaded; " + (
            "draft length adapts to acceptance and round times" if mode["draft_k"] is None else f"num_draft_tokens={mode['draft_k']}"
        )
        return draft, draft
    return AutoRouter(prompt, _kit_costs(kit), stats, lookup, draft), draft


def _finish(result, stop, stats, stats_cb, t_start, t_first, processed_prompt) -> GenerationResult:
    now = time.perf_counter()
    t_first = t_first or now
    stats.time_to_first_token = t_first - t_start
    prompt_time = stats.time_to_first_token - stats.setup_time
    stats.prompt_tps = processed_prompt / prompt_time if prompt_time > 0 else 0.0
    if stats.generated_tokens > 1 and now > t_first:
        stats.generation_tps = (stats.generated_tokens - 1) / (now - t_first)
    stats.total_time = now - t_start
    return _final(result, stop, stats, stats_cb)


def _final(result: GenerationResult, stop: StopReason | GenerationStopCondition, stats, stats_cb) -> GenerationResult:
    stats.peak_memory = int(mx.get_peak_memory())
    result.stop_condition = stop if isinstance(stop, GenerationStopCondition) else GenerationStopCondition(stop)
    result.stats = stats
    if stats_cb is not None:
        try:
            stats_cb(stats)
        except Exception as exc:
            raise CallbackError(f"stats_callback raised {type(exc).__name__}: {exc}") from exc
    return result
