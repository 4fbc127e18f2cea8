"""The public API: load models, stream generations, manage draft models."""

from __future__ import annotations

import inspect
import logging
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from . import tools as tools_module
from .caches.prompt import PromptCacheOptions
from .caches.sequence import CacheOptions
from .declare import checked, keyword_parameters
from .decode.sampling import validate_seed
from .embeddings import EmbeddingKit, is_embedding_model, load_embedding_kit
from .errors import ChatTemplateLimitError, GenerationInProgressError
from .kits.drafts import check_draft_model, load_draft, unload_draft
from .kits.images import validate_max_image_pixels
from .kits.text import KitOptions, ModelKit, validate_max_parallel, validate_suffix_memory
from .kits.vision import VisionModelKit
from .loading import model as loading
from .loading.chat_template import check_render
from .loading.memory import return_freed_memory
from .request.options import GROUPS, RequestOptions
from .request.pipeline import Generation
from .request.validate import require_model, validate_request
from .results import GenerationResult
from .runtime import worker
from .runtime.idle import WhenIdle
from .runtime.streams import RequestStream

logger = logging.getLogger(__name__)


# -- models -------------------------------------------------------------------
def load_model(
    model_path: str | Path,
    *,
    max_kv_size: int | str | None = None,
    vocab_only: bool = False,
    trust_remote_code: bool = False,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
    seed: int | None = None,
    compute_dtype: str | None = "auto",
    max_image_pixels: int | None = None,
    prompt_cache_bytes: int | None = None,
    prompt_cache_dir: str | Path | None = None,
    prompt_cache_disk_bytes: int | None = None,
    max_parallel: int | None = None,
    suffix_memory_tokens: int | None = None,
) -> ModelKit:
    """Load a local model (a Hugging Face-layout directory, a .gguf file or a
    catalog name) into a kit.

    ``compute_dtype="auto"`` computes half-precision and quantized weights in
    float32 on the CPU, where that is several times faster; ``"native"`` keeps
    the stored dtype. A directory whose config.json has ``vision_config`` gives a
    ``VisionModelKit`` (docs/vision.md); ``max_image_pixels`` bounds its images.
    ``prompt_cache_bytes`` bounds the KV bytes of the cached sequences kept
    between requests; ``prompt_cache_dir`` adds a disk tier (docs/api.md,
    "Prompt cache"). ``max_parallel`` (default 4) is how
    many generations the kit serves at once, decoded together in one batch
    (docs/api.md, "Parallel requests"). ``suffix_memory_tokens`` (default
    65536; 0: off) bounds the tokens of earlier requests that prompt lookup and
    auto draft from (docs/decoding.md, "Suffix drafting"). The kit's MLX work runs on its own
    engine thread (docs/reliability.md). A directory in sentence-transformers' layout
    (``modules.json`` with a Pooling module) gives an ``EmbeddingKit`` for ``embed``
    (docs/api.md, "Embeddings"; the generation options do not apply to it)."""
    cache_options = CacheOptions.validate(max_kv_size, kv_bits, kv_group_size, quantized_kv_start)
    prompt_cache = PromptCacheOptions.validate(prompt_cache_bytes, prompt_cache_dir, prompt_cache_disk_bytes)
    kit_options = KitOptions(
        cache_options,
        vocab_only,
        trust_remote_code,
        compute_dtype,
        prompt_cache,
        validate_max_parallel(max_parallel),
        validate_suffix_memory(suffix_memory_tokens),
    )
    thread = worker.acquire()
    try:
        kit = thread.call(_load_model, model_path, kit_options, seed, max_image_pixels, thread)
    except BaseException:
        worker.release(thread)
        raise
    worker.release_with(kit, thread)  # the thread serves another kit once this one is gone
    return kit


def _load_model(model_path, kit_options: KitOptions, seed, max_image_pixels, thread: worker.MLXWorker) -> ModelKit:
    """The kit for ``model_path``, built on ``thread``, the engine thread it is given."""
    path = loading.resolve_model_path(model_path)
    config = loading.read_config(path)
    if max_image_pixels is not None:
        validate_max_image_pixels(max_image_pixels)
    if (seed := validate_seed(seed)) is not None:
        mx.random.seed(seed)
    if is_embedding_model(path):
        return load_embedding_kit(
            path,
            compute_dtype=kit_options.compute_dtype,
            trust_remote_code=kit_options.trust_remote_code,
            worker=thread,
        )
    if loading.is_vision_config(config):
        kit = VisionModelKit(path, kit_options, max_image_pixels, thread)
    else:
        kit = ModelKit(path, kit_options, thread)
    return_freed_memory()  # the load's transient buffers (decoded blocks) back to the OS
    return kit


def tokenize(kit: ModelKit, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids for ``prompt`` with the kit's tokenizer. Special tokens written
    in the text (``<|im_start|>``) always encode whole; ``add_special_tokens``
    adds the ones the tokenizer puts around a text (BOS): pass False for text
    already rendered by a chat template, which holds its own BOS."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    if not isinstance(add_special_tokens, bool):
        raise ValueError(f"add_special_tokens must be True or False, got {add_special_tokens!r}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates ("\ud800") have no UTF-8 form to tokenize
        raise ValueError(
            f"prompt is not valid Unicode text: {exc.reason} at index {exc.start} ({prompt[exc.start : exc.end]!r})"
        ) from None
    return list(kit.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))


def apply_chat_template(
    kit: ModelKit, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of a conversation (``[{"role": ..., "content": ...}, ...]``)
    rendered with the model's chat template, ready for ``create_generator``.

    ``tools`` (OpenAI tool definitions) go to the template when it renders
    tools in a known family's syntax; otherwise the default tool prompt is
    added to the system message (docs/api.md, "Tool calls"). Messages may hold
    assistant ``tool_calls`` and ``tool`` results."""
    if not getattr(kit.tokenizer, "chat_template", None):
        raise ValueError("messages: this model's tokenizer has no chat template; tokenize plain text with tokenize()")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a list of dicts with 'role' and 'content'")
    if not isinstance(add_generation_prompt, bool):
        raise ValueError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r}")
    checked = None if tools is None else tools_module.validate_tools(tools)
    messages, extra = tools_module.render_arguments(tools_module.tool_format(kit), checked, messages)
    tok = kit.tokenizer
    try:
        # The template is code from the model files: it runs first in a bounded
        # sandbox (chat_template.py), and only one that finishes there is
        # rendered by transformers, whose output the prompt is.
        template = tok.get_chat_template() if hasattr(tok, "get_chat_template") else tok.chat_template
        check_render(
            template,
            {
                **getattr(tok, "special_tokens_map", {}),
                "messages": messages,
                "tools": extra.get("tools"),
                "documents": None,
                "add_generation_prompt": add_generation_prompt,
            },
        )
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **extra)
    except ChatTemplateLimitError as exc:
        raise ChatTemplateLimitError(f"messages: {exc}") from None
    except Exception as exc:  # jinja errors raised by the template itself
        raise ValueError(f"messages: the chat template could not render them: {exc}") from exc
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def unload(kit: ModelKit) -> None:
    """Free the model, draft model and caches. The kit cannot generate afterwards.
    Refused with ``GenerationInProgressError`` while a generation is open: stop
    or close it first. An ``EmbeddingKit`` drops its weights."""
    if isinstance(kit, EmbeddingKit):
        kit.worker.call(kit.unload)
        return
    if not isinstance(kit, ModelKit):
        raise ValueError(f"kit must be a ModelKit from load_model, got {type(kit).__name__}")
    # No return_freed_memory() here: after a sharded job failed, MLX calls from this
    # thread can wait on the engine thread, blocked on the failed rank (distributed/kit.py).
    kit.worker.call(WhenIdle(kit, kit.unload))


def load_draft_model(kit: ModelKit, path: str | Path, name: str | None = None) -> None:
    """Load a draft model for speculative decoding; raises
    ``IncompatibleDraftModelError`` with every reason when it cannot serve the kit.
    All or nothing: when loading fails, the previous draft model stays loaded.
    ``name``: what ``draft_name`` says of it (``path`` as given by default)."""
    require_model(kit)
    kit.worker.call(WhenIdle(kit, load_draft, kit, path, name))


def draft_name(kit: ModelKit) -> str | None:
    """The loaded draft's name (``load_draft_model``'s ``name``, or the path or
    catalog name it was given); None when the kit has no draft."""
    return getattr(kit, "draft_name", None) if getattr(kit, "draft", None) is not None else None


def is_draft_model_compatible(kit: ModelKit, path: str | Path) -> bool:
    """Whether ``path`` could be loaded as this kit's draft model."""
    return check_draft_model(kit, path).compatible


def unload_draft_model(kit: ModelKit) -> None:
    """Release the draft model (no-op when none is loaded); the main cache stays."""
    kit.worker.call(WhenIdle(kit, unload_draft, kit))


def memory_in_use(kit: ModelKit) -> int:
    """Bytes a loaded kit holds: its weights, its draft model's and its prompt
    cache's KV. Callable from any thread (a server's event loop): it reads the
    arrays' sizes, never their data, so it does not wait for the engine thread."""
    from mlx.utils import tree_flatten

    total = 0
    for model in (kit.model, kit.draft.model if kit.draft is not None else None):
        if model is not None:
            total += sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if kit.prompt_cache is not None:
        try:
            total += kit.prompt_cache.memory_bytes()
        except RuntimeError:  # the engine thread changed the entries while they were summed; skip them
            pass
    return total


def stop_generation(kit: ModelKit, request_id: str) -> bool:
    """Ask the generation with ``request_id`` to stop; safe from any thread.
    It ends with ``user_cancelled``. Returns False when no such request exists."""
    return kit.activity.cancel(request_id)


# -- generation ---------------------------------------------------------------
def check_tools(kit: ModelKit, tools, tool_choice=None, parallel_tool_calls: bool = True) -> None:
    """Check ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as
    ``create_generator`` will, without generating, so a host can refuse a bad
    request before queueing it; ``InvalidArgument`` naming the bad one."""
    tools_module.validate_tool_request(tools, tool_choice, parallel_tool_calls, tools_module.tool_format(kit))


def create_generator(kit: ModelKit, prompt_tokens: list[int], **options) -> Iterator[GenerationResult]:
    """Stream the continuation of ``prompt_tokens``.

    Arguments are checked before anything runs; a bad one raises ``ValueError``
    naming it. The returned iterator yields one result per token (text may be
    empty while a possible stop string is held back) and always ends with one
    result carrying ``stop_condition`` and ``stats``. Closing it, or
    ``stop_generation(kit, request_id)``, cancels. A kit serves up to its
    ``max_parallel`` generations at once, decoded together; creating one more
    while that many are open raises ``GenerationInProgressError``, or, with
    ``admission_timeout`` (seconds), waits for one to end first. Decoding modes are described in docs/decoding.md.
    ``images_b64`` (vision kits, docs/vision.md): base64 images, one per image
    placeholder token in ``prompt_tokens``, decoded and checked here.
    ``json_schema`` / ``regex`` / ``grammar`` (Lark) constrain the output
    (docs/api.md, "Structured output"); ``structured_drafting`` drafts the tokens
    the grammar forces.
    ``tools`` / ``tool_choice`` (``"auto"`` by default, ``"none"``,
    ``"required"`` or ``{"name": ...}``) / ``parallel_tool_calls``: the model's
    calls come back as ``GenerationResult.tool_calls``, their arguments held to
    each tool's schema by a grammar (docs/api.md, "Tool calls").
    ``logit_bias`` ({token id: number}) is added to the logits;
    ``presence_penalty`` / ``frequency_penalty`` subtract (once / per occurrence)
    for tokens among the last ``repetition_context_size`` of the sequence.
    ``decoding`` (``"plain"``, ``"draft"``, ``"prompt_lookup"`` or ``"auto"``)
    picks the decoding mode; ``auto_speculative``, ``prompt_lookup_num_tokens``
    alone and ``speculative_decoding_toggle`` are its documented aliases.
    The generation runs on the kit's engine thread; callbacks are called there.
    The keyword arguments are the fields of the option groups (request/options.py:
    sampling, decoding, constraints, output, handling), the one place their
    names, defaults and checks are declared; an unknown one raises
    ``ValueError`` naming it.
    """
    opts = RequestOptions.from_kwargs(options)
    require_model(kit)
    if isinstance(prompt_tokens, mx.array):
        prompt_tokens = prompt_tokens.tolist()  # evaluated here: the host's array, the host's thread
    opts = replace(opts, handling=checked(opts.handling))  # request_id and admission_timeout, before any wait
    thread = kit.worker
    generation = _admitted(kit, thread, prompt_tokens, opts)
    # One path for every kit: with max_parallel=1 the scheduler steps one row.
    return RequestStream(thread, kit.scheduler, generation, generation.request_id)


# The keyword arguments, introspectable (help(), IDEs) though declared once, in the option groups.
create_generator.__signature__ = inspect.signature(create_generator).replace(
    parameters=[
        *list(inspect.signature(create_generator).parameters.values())[:2],
        *keyword_parameters(*GROUPS.values()),
    ]
)


def _admitted(kit: ModelKit, thread: worker.MLXWorker, prompt_tokens, opts: RequestOptions) -> Generation:
    """The validated generation, waiting up to ``admission_timeout`` for a free
    slot on the kit's own registry (woken when a request ends, not polled)."""
    wait = opts.handling.admission_timeout
    deadline = time.monotonic() + (wait or 0.0)
    while True:
        try:
            return thread.call(_start, kit, prompt_tokens, opts)
        except GenerationInProgressError:
            left = deadline - time.monotonic()
            if wait is None or left <= 0 or not kit.activity.wait_for_room(kit.max_parallel, left):
                raise


def _start(kit: ModelKit, prompt_tokens, options: RequestOptions) -> Generation:
    """Validate (on the kit's engine thread) and create the generation."""
    request = validate_request(kit, prompt_tokens, options, options.handling.request_id or uuid.uuid4().hex)
    return Generation(kit, request)
