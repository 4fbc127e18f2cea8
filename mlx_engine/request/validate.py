"""Validating a request: every ``create_generator`` argument is checked here,
before the generator is returned, and becomes one frozen ``Request``.

``GenerationOptions`` declares ``create_generator``'s keyword arguments once
(names, types, defaults; the function's signature is built from it), and
``validate_request`` checks them against the kit and plans the decoding. A bad
argument raises ``ValueError`` naming it. Nothing here runs the model or touches
its KV caches; the one kit state it writes is a vision kit's processed-image cache
(``decode_images`` runs the image processor on each image, so a refused image
fails here, and keeps the result for the request to reuse).
"""

from __future__ import annotations

import difflib
import inspect
import numbers
from collections.abc import Mapping, Set
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable

import mlx.core as mx

from ..decode.sampling import SamplingParams, validate_sampling
from ..embeddings.kit import EmbeddingKit
from ..errors import InvalidArgument, argument
from ..kits.text import ModelKit
from ..results import GenerationStats
from ..structured import check_grammar, compile_constraint
from ..tools import ToolSpec, tool_constraint
from .plan import DecodingPlan, choose_plan
from .stop_strings import StopStringMatcher

DEFAULT_MAX_TOKENS = 256

ProgressCallback = Callable[[float], "bool | None"]
StatsCallback = Callable[[GenerationStats], None]


@dataclass(frozen=True, kw_only=True)
class GenerationOptions:
    """``create_generator``'s keyword arguments as given, before validation
    (docs/api.md, "Generating"; the decoding ones in docs/decoding.md)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temp: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens_to_keep: int | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop_strings: list[str] | None = None
    top_logprobs: int | None = None
    prompt_progress_callback: ProgressCallback | None = None
    stats_callback: StatsCallback | None = None
    request_id: str | None = None
    num_draft_tokens: int | None = None
    speculative_decoding_toggle: bool | None = None
    prompt_lookup_num_tokens: int | None = None
    prompt_lookup_min_ngram: int = 1
    prompt_lookup_max_ngram: int = 3
    prompt_lookup_num_candidates: int = 4
    auto_speculative: bool = False
    images_b64: list[str] | None = None
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    structured_drafting: bool = True
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # Seconds to wait for a free slot while max_parallel generations are open
    # (None: GenerationInProgressError at once). Waited for on the caller's thread.
    admission_timeout: float | None = None

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> GenerationOptions:
        """The options named in ``kwargs``; an unknown name is a ``ValueError`` naming it."""
        names = [f.name for f in fields(cls)]
        for name in kwargs:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise InvalidArgument(
                    "create_generator got an unknown argument {name}{hint}; it takes: {names}",
                    name,
                    name=repr(name),
                    hint=hint,
                    names=", ".join(names),
                )
        return cls(**kwargs)

    @classmethod
    def keyword_parameters(cls) -> list[inspect.Parameter]:
        """The options as keyword-only parameters, for ``create_generator``'s signature."""
        return [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=f.type,
                default=f.default if f.default is not MISSING else inspect.Parameter.empty,
            )
            for f in fields(cls)
        ]


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


def validate_request(kit: ModelKit, prompt_tokens, o: GenerationOptions, request_id: str) -> Request:
    """Check every argument (``o``: create_generator's keyword arguments) against
    the kit; ``ValueError`` naming the first bad one."""
    prompt = validate_prompt(kit, prompt_tokens)
    with argument("images_b64"):
        images = kit.decode_images(prompt, o.images_b64)
    if isinstance(o.max_tokens, bool) or not isinstance(o.max_tokens, int) or o.max_tokens <= 0:
        raise InvalidArgument("{param} must be a positive integer, got {got}", "max_tokens", got=repr(o.max_tokens))
    params = validate_sampling(
        temp=o.temp,
        top_p=o.top_p,
        top_k=o.top_k,
        min_p=o.min_p,
        min_tokens_to_keep=o.min_tokens_to_keep,
        repetition_penalty=o.repetition_penalty,
        repetition_context_size=o.repetition_context_size,
        seed=o.seed,
        top_logprobs=o.top_logprobs,
        vocab_size=kit.vocab_size,
        presence_penalty=o.presence_penalty,
        frequency_penalty=o.frequency_penalty,
        logit_bias=o.logit_bias,
    )
    with argument("stop_strings"):
        stops = StopStringMatcher.validate(o.stop_strings)
    for name, cb in (("prompt_progress_callback", o.prompt_progress_callback), ("stats_callback", o.stats_callback)):
        if cb is not None and not callable(cb):
            raise InvalidArgument("{param} must be callable or None", name)
    constraint = compile_constraint(o.json_schema, o.regex, o.grammar)
    tools, constraint = tool_constraint(kit, o.tools, o.tool_choice, o.parallel_tool_calls, constraint)
    if constraint is not None:
        check_grammar(kit, *constraint)
    if not isinstance(o.structured_drafting, bool):
        raise InvalidArgument(
            "{param} must be True or False, got {got}", "structured_drafting", got=repr(o.structured_drafting)
        )
    plan = choose_plan(
        kit,
        num_draft_tokens=o.num_draft_tokens,
        toggle=o.speculative_decoding_toggle,
        lookup_tokens=o.prompt_lookup_num_tokens,
        ngrams=(o.prompt_lookup_min_ngram, o.prompt_lookup_max_ngram, o.prompt_lookup_num_candidates),
        auto=o.auto_speculative,
    )
    max_tokens = _fit_to_context(kit, prompt, o.max_tokens)
    return Request(
        request_id,
        prompt,
        images,
        max_tokens,
        params,
        stops,
        o.prompt_progress_callback,
        o.stats_callback,
        plan,
        None if constraint is None else constraint[1],
        None if constraint is None else constraint[0],
        o.structured_drafting,
        tools,
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
        return max_tokens or GenerationOptions.max_tokens
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


def validate_request_id(request_id) -> None:
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidArgument("{param} must be a string or None, got {got}", "request_id", got=repr(request_id))


def validate_admission_timeout(timeout) -> float | None:
    """``admission_timeout``: None, or seconds (a finite number >= 0) to wait for a free slot."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 <= timeout < float("inf"):
        raise InvalidArgument(
            "{param} must be None or a finite number of seconds >= 0, got {got}", "admission_timeout", got=repr(timeout)
        )
    return float(timeout)


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
