"""From a request body to what the SDK takes: the prompt's token ids (and
images) and ``create_generator``'s keyword arguments, one set per choice, built
as the engine's option groups (so a misspelt field fails here, and the server
keeps no engine default of its own).

Runs off the event loop (chat templates and tokenizers are CPU work). Bad
input raises ``APIError`` (400) naming the request field; what only the engine
can check (a schema llguidance refuses, a top_k beyond the vocabulary) comes
back from ``create_generator`` as ``ValueError`` and is mapped the same way.
"""

from __future__ import annotations

import mlx_engine as me
from mlx_engine import MAX_JSON_DEPTH, json_depth

from dataclasses import dataclass, replace
from weakref import WeakKeyDictionary

from ..web.errors import bad_request, from_engine
from .schemas import ChatCompletionRequest, CompletionRequest, EngineOptions, Message

# JSON nesting in tool schemas and call arguments is limited by the engine's one
# MAX_JSON_DEPTH, so the server and the SDK refuse the same requests.

# The longest token of each tokenizer, in characters (of its vocabulary's
# strings: a byte-level BPE's strings are one character per byte, so none covers
# more characters of text than it has).
_TOKEN_CHARS: WeakKeyDictionary = WeakKeyDictionary()
# Roles whose text every chat template renders whole (assistant turns may be cut:
# templates drop the reasoning of earlier turns).
COUNTED_ROLES = ("system", "developer", "user", "tool")


@dataclass
class Prompt:
    tokens: list[int]
    images: list[str]  # data URIs, one per image placeholder (vision kits)


def chat_prompt(kit: me.ModelKit, req: ChatCompletionRequest) -> Prompt:
    """The conversation rendered with the model's chat template (with the
    request's tools, checked first so a bad one is a 400 before any wait)."""
    check_nesting(req)
    tools = tool_kwargs(req)
    try:
        me.check_tools(kit, tools["tools"], tools["tool_choice"], tools["parallel_tool_calls"])
    except ValueError as exc:
        raise from_engine(exc) from exc
    vision = isinstance(kit, me.VisionModelKit)
    images: list[str] = []
    messages = [_message(m, i, vision, images) for i, m in enumerate(req.messages)]
    try:
        tokens = me.apply_chat_template(kit, messages, tools=tools["tools"])
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    return Prompt(tokens, images)


def check_nesting(req: ChatCompletionRequest) -> None:
    """A 400 naming the field for JSON nested deeper than ``MAX_JSON_DEPTH`` in
    what the SDK parses or walks recursively (tool schemas, earlier calls'
    arguments), before it can exhaust Python's recursion limit."""
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and "parameters" in fn:
            _within_depth(fn["parameters"], f"tools.{i}.function.parameters")
    for i, m in enumerate(req.messages):
        for j, call in enumerate(m.tool_calls or []):
            _within_depth(call.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments")


def _within_depth(value, where: str) -> None:
    depth = json_depth(value)  # JSON text or a parsed value, walked without recursion
    if depth > MAX_JSON_DEPTH:
        raise bad_request(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep", where)


def _message(m: Message, i: int, vision: bool, images: list[str]) -> dict:
    """One message as the chat template takes it: image parts become
    ``{"type": "image"}`` (their data goes to ``images``), text parts are
    joined into a string on a text-only model."""
    out: dict = {"role": "system" if m.role == "developer" else m.role}
    content = m.content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
                continue
            where = f"messages.{i}.content.{j}.image_url"
            if not vision:
                raise bad_request(f"{where}: this model takes text only", where)
            if not part.image_url.url.startswith("data:"):
                raise bad_request(f"{where}: only data: URIs are accepted (the server fetches nothing)", where)
            images.append(part.image_url.url)
            parts.append({"type": "image"})
        content = parts if vision else "".join(p["text"] for p in parts)
    out["content"] = content if content is not None else ""
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    if m.tool_calls is not None:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    return out


def tool_kwargs(req: ChatCompletionRequest | CompletionRequest) -> dict:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as ``create_generator``
    takes them. An empty ``tools`` list is no tools (some clients always send one)."""
    if not isinstance(req, ChatCompletionRequest):
        return {}
    parallel = req.parallel_tool_calls
    if parallel is None:
        parallel = me.GenerationOptions.parallel_tool_calls
    return {"tools": req.tools or None, "tool_choice": req.tool_choice, "parallel_tool_calls": parallel}


def completion_prompt(kit: me.ModelKit, req: CompletionRequest) -> Prompt:
    """A completion prompt: text (one string) or token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise bad_request("prompt: give one prompt per request (a list of several is not supported)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        _refuse_over_context(kit, prompt_floor(kit, len(prompt)), "prompt")
        try:
            return Prompt(me.tokenize(kit, prompt), [])
        except ValueError as exc:  # text that is not valid Unicode (a lone surrogate)
            raise bad_request(str(exc), "prompt") from exc
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    _refuse_over_context(kit, len(prompt), "prompt")
    return Prompt(list(prompt), [])


def _refuse_over_context(kit: me.ModelKit, tokens: int, field: str) -> None:
    """A 400 naming ``field`` when a prompt of at least ``tokens`` tokens leaves
    no room in the context: before its token list is built."""
    context = kit.context_length
    if context is not None and tokens >= context:
        raise over_context(tokens, context, field)


def over_context(tokens: int, context: int, field: str = "messages"):
    """The chat and completions APIs' error for a prompt with no room left."""
    err = bad_request(
        f"{field}: the prompt has at least {tokens} tokens, which leaves no room in the model's context of "
        f"{context} tokens",
        field,
    )
    err.code = "context_length_exceeded"
    return err


def token_budget(kit: me.ModelKit, prompt_len: int, asked: int | None) -> int:
    """``max_tokens``: the engine's ``context_budget`` (what was asked, capped by
    the context left after the prompt; the whole remaining context when nothing
    was asked), its refusal as a 400 naming ``messages``."""
    try:
        return me.context_budget(kit, prompt_len, asked)
    except me.InvalidArgument:
        raise bad_request(
            f"messages: the prompt has {prompt_len} tokens, which leaves no room in the model's context of "
            f"{kit.context_length} tokens",
            "messages",
        ) from None


def decoding_options(opts: EngineOptions, default_mode: str) -> me.DecodingOptions:
    """The ``mlx_engine`` extension as the engine's decoding group: the mode as
    chosen, each length only where that mode uses it (the engine holds the
    defaults: prompt lookup's 8 tokens, auto's ceiling)."""
    mode = opts.decoding or default_mode
    lookup = mode in ("prompt_lookup", "auto")
    ngrams = {
        "prompt_lookup_min_ngram": opts.prompt_lookup_min_ngram,
        "prompt_lookup_max_ngram": opts.prompt_lookup_max_ngram,
    }
    return me.DecodingOptions(
        decoding=mode,
        num_draft_tokens=opts.num_draft_tokens if mode in ("draft", "auto") else None,
        prompt_lookup_num_tokens=opts.prompt_lookup_num_tokens if lookup else None,
        **(ngrams if lookup else {}),
    )


def constraint_options(req: ChatCompletionRequest | CompletionRequest) -> me.ConstraintOptions:
    """``response_format``, the extension's regex/grammar and the tools as the
    engine's constraint group."""
    return me.ConstraintOptions(**structured_kwargs(req), **tool_kwargs(req))


def structured_kwargs(req: ChatCompletionRequest | CompletionRequest) -> dict:
    """``response_format`` (and the extension's regex/grammar) as a constraint."""
    fmt, opts = req.response_format, req.mlx_engine
    out: dict = {"regex": opts.regex, "grammar": opts.grammar, "structured_drafting": opts.structured_drafting}
    if fmt is None or fmt.type == "text":
        return out
    if fmt.type == "json_object":
        return {**out, "json_schema": {"type": "object"}}
    if fmt.json_schema is None:
        raise bad_request(
            "response_format.json_schema is required when type is 'json_schema'", "response_format.json_schema"
        )
    # Always enforced by the grammar, whether or not ``strict`` is set.
    return {**out, "json_schema": fmt.json_schema.schema_}


def generator_kwargs(
    kit: me.ModelKit, req: ChatCompletionRequest | CompletionRequest, prompt: Prompt, default_mode: str
) -> list[dict]:
    """``create_generator``'s keyword arguments for each of the ``n`` choices:
    the request's fields mapped into the engine's option groups (mlx_engine's
    ``RequestOptions``), then flattened."""
    if (req.mlx_engine.decoding or default_mode) == "draft" and kit.draft is None:
        raise bad_request(
            "mlx_engine.decoding: 'draft' needs a draft model and none is loaded; load one with "
            "POST /v1/mlx_engine/draft (or start the server with --draft)",
            "mlx_engine.decoding",
        )
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    sampling = me.SamplingParams(
        temp=req.temperature if req.temperature is not None else 1.0,
        top_p=req.top_p,
        top_k=req.top_k or None,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        repetition_penalty=req.mlx_engine.repetition_penalty,
        repetition_context_size=req.mlx_engine.repetition_context_size,
    )
    base = me.RequestOptions(
        output=me.OutputOptions(
            max_tokens=token_budget(kit, len(prompt.tokens), asked),
            stop_strings=[req.stop] if isinstance(req.stop, str) else (req.stop or None),
            top_logprobs=_top_logprobs(req) or None,
        ),
        sampling=sampling,
        decoding=decoding_options(req.mlx_engine, default_mode),
        constraints=constraint_options(req),
        handling=me.HandlingOptions(images_b64=prompt.images or None),
    )
    # Choice i samples with seed + i, so seeded choices differ and repeat.
    seeds = [None if req.seed is None else (req.seed + i) % 2**64 for i in range(req.n)]
    return [replace(base, sampling=replace(sampling, seed=seed)).kwargs() for seed in seeds]


def _top_logprobs(req) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        return req.top_logprobs if req.logprobs else None
    return req.logprobs


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias: keys must be token ids, got {key!r}", "logit_bias") from None
    return out


def wants_logprobs(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(req.logprobs) if isinstance(req, ChatCompletionRequest) else req.logprobs is not None


def longest_token_chars(kit: me.ModelKit) -> int | None:
    """The most characters of text one token of ``kit`` covers (its longest
    vocabulary string); None when the tokenizer lists no vocabulary."""
    tok = kit.tokenizer
    try:
        return _TOKEN_CHARS[tok]
    except (KeyError, TypeError):
        pass
    get_vocab = getattr(tok, "get_vocab", None)
    longest = max((len(t) for t in get_vocab()), default=0) if callable(get_vocab) else 0
    value = longest or None
    try:
        _TOKEN_CHARS[tok] = value
    except TypeError:  # a tokenizer that takes no weak reference: measured again next time
        pass
    return value


def counted_chars(req: ChatCompletionRequest) -> int:
    """Characters of ``req`` that every chat template renders whole: the text of
    its system, user and tool messages and its tools' names and descriptions."""
    total = 0
    for m in req.messages:
        if m.role not in COUNTED_ROLES:
            continue
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(p.text) for p in m.content if p.type == "text")
    for tool in req.tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict):
            total += sum(len(fn[k]) for k in ("name", "description") if isinstance(fn.get(k), str))
            if isinstance(fn.get("parameters"), dict):  # anything else is refused by the tools' own checks
                total += _string_chars(fn["parameters"])
    return total


def _string_chars(value) -> int:
    """Characters of every string (keys included) in a JSON value, walked
    without recursion: a schema rendered in any layout holds them all."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def prompt_floor(kit: me.ModelKit, chars: int) -> int:
    """The fewest tokens ``chars`` characters of text can take with ``kit``'s
    tokenizer (none is longer than ``longest_token_chars``): a prompt whose
    floor is over the context cannot fit, known before its token list is built."""
    longest = longest_token_chars(kit)
    return 0 if not longest else -(-chars // longest)
