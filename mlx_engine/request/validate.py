"""Validating a request: every ``create_generator`` argument is checked here,
before the generator is returned, and becomes one frozen ``Request``.

The options are declared once, by group, in options.py (names, defaults, docs
and per-field checks); ``validate_request`` runs those checks, the ones that
need the kit (images, constraints, the context) and plans the decoding. A bad
argument raises ``ValueError`` naming it. Nothing here runs the model or touches
its KV caches; the one kit state it writes is a vision kit's processed-image cache
(``decode_images`` runs the image processor on each image, so a refused image
fails here, and keeps the result for the request to reuse).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Set
from dataclasses import dataclass

import mlx.core as mx

from ..declare import checked
from ..decode.sampling import SamplingParams
from ..embeddings.kit import EmbeddingKit
from ..errors import InvalidArgument, argument
from ..kits.text import ModelKit
from ..structured import check_grammar, compile_constraint
from ..tools import ToolSpec, tool_constraint
from .options import DEFAULT_MAX_TOKENS, ProgressCallback, RequestOptions, StatsCallback
from .plan import DecodingPlan, choose_plan


@dataclass(frozen=True)
class Request:
    """A checked request, ready for the pipeline (pipeline.py)."""

    request_id: str
    prompt: list[int]
    images: list
    max_tokens: int
    params: SamplingParams
    stop_strings: list[str]
    progress_cb: ProgressCallback | None
    stats_cb: StatsCallback | None
    plan: DecodingPlan
    grammar: str | None  # llguidance grammar of a structured-output constraint (or of the tools)
    grammar_source: str | None  # the argument it came from: json_schema, regex, grammar or tools
    structured_drafting: bool
    tools: ToolSpec | None = None  # tools whose calls are parsed out of the text
    top_logprobs: int | None = None  # alternatives per generated token (None: none)


def validate_request(kit: ModelKit, prompt_tokens, o: RequestOptions, request_id: str) -> Request:
    """Check every option (``o``: create_generator's keyword arguments, by
    group) against the kit; ``ValueError`` naming the first bad one."""
    prompt = validate_prompt(kit, prompt_tokens)
    handling = checked(o.handling)
    with argument("images_b64"):
        images = kit.decode_images(prompt, handling.images_b64)
    output = checked(o.output)
    params = o.sampling.validated(kit.vocab_size)
    c = checked(o.constraints)
    constraint = compile_constraint(c.json_schema, c.regex, c.grammar)
    tools, constraint = tool_constraint(kit, c.tools, c.tool_choice, c.parallel_tool_calls, constraint)
    if constraint is not None:
        check_grammar(kit, *constraint)
    plan = choose_plan(kit, o.decoding)
    max_tokens = _fit_to_context(kit, prompt, output.max_tokens)
    return Request(
        request_id,
        prompt,
        images,
        max_tokens,
        params,
        output.stop_strings,
        handling.prompt_progress_callback,
        output.stats_callback,
        plan,
        None if constraint is None else constraint[1],
        None if constraint is None else constraint[0],
        c.structured_drafting,
        tools,
        output.top_logprobs,
    )


def context_budget(kit: ModelKit, prompt_len: int, max_tokens: int | None = None) -> int:
    """The tokens an answer to a prompt of ``prompt_len`` tokens may take in the
    kit's context: ``max_tokens`` capped by the room the prompt leaves (the whole
    room when None). ``InvalidArgument`` naming ``prompt_tokens`` when the prompt
    leaves no room. A kit with no known context: ``max_tokens``, or the default.

    ``create_generator`` holds a kit to this when its context is fitted to
    memory (``max_kv_size="auto"``); the server holds every request to it."""
    context = kit.context_length
    if context is None:
        return max_tokens or DEFAULT_MAX_TOKENS
    room = context - prompt_len
    if room <= 0:
        raise InvalidArgument(
            "{param}: {length} tokens leave no room in this kit's context of {context} tokens; shorten the prompt",
            "prompt_tokens",
            length=prompt_len,
            context=context,
        )
    return min(max_tokens, room) if max_tokens else room


def _fit_to_context(kit: ModelKit, prompt: list[int], max_tokens: int) -> int:
    """With a context fitted to memory (``max_kv_size="auto"``), a prompt must
    fit it, and generation stops at its end (``token_limit``)."""
    if not kit.cache_options.auto_context:
        return max_tokens
    return context_budget(kit, len(prompt), max_tokens)


def require_model(kit: ModelKit) -> None:
    """``ValueError`` unless ``kit`` is a loaded kit that can generate."""
    if isinstance(kit, EmbeddingKit):
        raise ValueError("kit is an embedding model (an EmbeddingKit): it cannot generate; use embed()")
    if not isinstance(kit, ModelKit):
        raise ValueError(f"kit must be a ModelKit from load_model, got {type(kit).__name__}")
    if kit.vocab_only:
        raise ValueError("this kit was loaded with vocab_only=True and cannot generate; load it without vocab_only")
    if kit.model is None:
        raise ValueError("this kit has been unloaded")


def validate_prompt(kit: ModelKit, prompt_tokens) -> list[int]:
    """The prompt as a list of Python ints. Any sequence of integers is accepted
    (ints, numpy or MLX integer scalars, a 1-D integer array); text, mappings and
    sets are refused (``InvalidArgument`` naming ``prompt_tokens``)."""
    with argument("prompt_tokens"):
        return _prompt_ids(kit, prompt_tokens)


def _prompt_ids(kit: ModelKit, prompt_tokens) -> list[int]:
    if isinstance(prompt_tokens, (str, bytes)):
        raise _bad_prompt("{param} must be a list of token ids; use tokenize(kit, text) for text")
    if isinstance(prompt_tokens, (Mapping, Set)):
        raise _bad_prompt("{param} must be a sequence of token ids, got a {kind}", kind=type(prompt_tokens).__name__)
    if getattr(prompt_tokens, "ndim", 1) != 1:
        raise _bad_prompt("{param} must be one-dimensional, got shape {shape}", shape=tuple(prompt_tokens.shape))
    if isinstance(prompt_tokens, mx.array):
        prompt_tokens = prompt_tokens.tolist()
    try:
        prompt = list(prompt_tokens)
    except TypeError:
        raise _bad_prompt(
            "{param} must be a list of token ids, got {kind}", kind=type(prompt_tokens).__name__
        ) from None
    if not prompt:
        raise _bad_prompt("{param} must not be empty")
    vocab = kit.vocab_size
    ids = []
    for i, t in enumerate(prompt):
        t = _token_id(t)
        if t is None:
            raise _bad_prompt("{param} must be integers; item {i} is {got}", i=i, got=repr(prompt[i]))
        if not 0 <= t < vocab:
            raise _bad_prompt("{param}[{i}] = {t} is outside the vocabulary [0, {vocab})", i=i, t=t, vocab=vocab)
        ids.append(t)
    return ids


def _bad_prompt(template: str, **values: object) -> InvalidArgument:
    return InvalidArgument(template, "prompt_tokens", **values)


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
