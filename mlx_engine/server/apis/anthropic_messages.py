"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
as a wire format of the core.

``system`` and ``messages`` (text, base64 images, ``tool_use``, ``tool_result``)
become chat messages, ``tools`` (``input_schema``) and ``tool_choice`` the chat
request's tools, ``stop_sequences`` its stop strings; the core renders, admits
and generates (core/turns.py); the answer comes back as a Messages object or
Anthropic's event stream, errors as ``{"type": "error", "error": {...}}`` with
Anthropic's status codes. Keys come as ``x-api-key`` or a bearer token.

Claude Code starts its system prompt with a line ``x-anthropic-billing-header:
...`` that changes between requests; kept, it would make every prompt differ
from its first token and the prompt cache would reuse nothing. It is dropped
unless the operator keeps it (``keep_billing_header``).
"""

from __future__ import annotations

import mlx_engine as me

import hmac
import json
import logging
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..core.chat_objects import Choice, engine_stats
from ..core.schemas import EngineOptions
from ..core.turns import (
    admit,
    collect,
    count_prompt,
    counts,
    internal_request,
    prepare,
    sse,
    with_heartbeat,
    with_truncated,
)
from ..hosting.runs import RequestRun
from ..web.errors import AnthropicError, APIError, bad_request, clipped, from_failure, from_validation, tool_renamed

logger = logging.getLogger(__name__)

BILLING_HEADER = "x-anthropic-billing-header:"
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class CountTokensRequest(_Body):
    """The fields this server reads; ``metadata``, ``thinking``,
    ``context_management``, ``service_tier`` and others are ignored."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    mlx_engine: EngineOptions = EngineOptions()


# -- the request, translated --------------------------------------------------------------------------
def system_messages(system: str | list[dict] | None, keep_billing_header: bool = False) -> list[dict]:
    """``system`` (a string or text blocks, joined by blank lines) as a leading
    system message, Claude Code's billing line dropped unless kept."""
    if system is None:
        return []
    texts = [system] if isinstance(system, str) else [_text_block(b, f"system.{i}") for i, b in enumerate(system)]
    if texts and not keep_billing_header and texts[0].startswith(BILLING_HEADER):
        texts[0] = texts[0].partition("\n")[2]
    text = "\n\n".join(t for t in texts if t)
    return [{"role": "system", "content": text}] if text else []


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise bad_request(f"{where}: a text block {{'type': 'text', 'text': ...}} is required", where)
    return block["text"]


def chat_messages(messages: list[dict]) -> list[dict]:
    """``messages`` as chat messages: an assistant's ``tool_use`` blocks become
    its ``tool_calls``, a user's ``tool_result`` blocks ``tool`` messages (in
    their place among its text), thinking blocks are dropped. ``system``
    messages (Claude Code sends some) stay where they are."""
    out: list[dict] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{where}.role: must be 'user' or 'assistant', got {role!r}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad_request(f"{where}.content: a string or a list of content blocks is required", f"{where}.content")
        elif role == "assistant":
            out.append(_assistant(content, where, names))
        else:
            out.extend(_user(content, role, where, names))
    return out


def _assistant(blocks: list, where: str, names: dict[str, str]) -> dict:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        kind = _kind(b, f"{where}.content.{j}")
        if kind == "text":
            texts.append(_text_block(b, f"{where}.content.{j}"))
        elif kind == "tool_use":
            call_id, name, args = b.get("id"), b.get("name"), b.get("input", {})
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, dict)):
                raise bad_request(
                    f"{where}.content.{j}: tool_use needs a string id and name and an object input", where
                )
            names[call_id] = name
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind not in _SKIPPED_BLOCKS:
            logger.info("%s.content.%d: %s blocks are not served here; skipped", where, j, clipped(kind))
    msg: dict = {"role": "assistant", "content": "\n".join(texts) or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list, role: str, where: str, names: dict[str, str]) -> list[dict]:
    out: list[dict] = []
    parts: list[dict] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _kind(b, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(b, at)})
        elif kind == "image":
            parts.append(_image(b, at))
        elif kind == "tool_result":
            out += _flush(role, parts)
            parts = []
            out.append(_tool_result(b, at, names))
        elif kind not in _SKIPPED_BLOCKS:
            logger.info("%s: %s blocks are not served here; skipped", at, clipped(kind))
    return out + _flush(role, parts)


def _flush(role: str, parts: list[dict]) -> list[dict]:
    if not parts:
        return []
    if all(p["type"] == "text" for p in parts):
        return [{"role": role, "content": "\n".join(p["text"] for p in parts)}]
    return [{"role": role, "content": parts}]


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{where}: a content block with a 'type' is required", where)
    return block["type"]


def _image(block: dict, where: str) -> dict:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise bad_request(f"{where}.source: only base64 images are accepted (the server fetches nothing)", where)
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not isinstance(data, str):
        raise bad_request(f"{where}.source: media_type and data strings are required", where)
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _tool_result(block: dict, where: str, names: dict[str, str]) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}.tool_use_id: a string is required", f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, b in enumerate(content):
            if _kind(b, f"{where}.content.{k}") == "text":
                texts.append(_text_block(b, f"{where}.content.{k}"))
            else:
                logger.info(
                    "%s.content.%d: %s blocks in a tool result are not served here; skipped",
                    where,
                    k,
                    clipped(b["type"]),
                )
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content: a string or a list of blocks is required", f"{where}.content")
    if block.get("is_error") is True:
        content = f"Error: {content}"
    msg = {"role": "tool", "tool_call_id": call_id, "content": content}
    if call_id in names:
        msg["name"] = names[call_id]
    return msg


def chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, list[int]]:
    """Client tools (``name``, ``description``, ``input_schema``) as chat tools,
    and each one's index in the request; server tools (a ``type`` such as
    ``web_search_20250305``) are skipped with a log line."""
    out, sources = [], []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            logger.info("tools.%d: %s tools are not served here; skipped", i, clipped(kind))
            continue
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools.{i}.input_schema: a JSON schema object is required", f"tools.{i}.input_schema")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
        sources.append(i)
    return out or None, sources


def chat_tool_choice(choice: dict | None) -> tuple[str | dict | None, bool | None]:
    """``tool_choice`` as the chat request's ``tool_choice`` and ``parallel_tool_calls``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad_request(f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {kind!r}", "tool_choice.type")


def response_format(body: CountTokensRequest) -> dict | None:
    """Structured output (``output_format``, or ``output_config.format``) as a
    chat ``response_format``."""
    fmt = body.output_format or (body.output_config or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_format.schema: a JSON schema object is required", "output_format.schema")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


def internal(body: CountTokensRequest, keep_billing_header: bool) -> tuple[dict, list[int]]:
    """The chat request's fields for ``body``, and the tools' request indices."""
    tools, sources = chat_tools(body.tools)
    choice, parallel = chat_tool_choice(body.tool_choice)
    fields = {
        "model": body.model,
        "messages": system_messages(body.system, keep_billing_header) + chat_messages(body.messages),
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "response_format": response_format(body),
    }
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences or None,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            mlx_engine=body.mlx_engine.model_dump(),
        )
    return fields, sources


def _edge(err: APIError, sources: list[int]) -> AnthropicError:
    """An error of the internal request, its tool indices and fields as this request named them."""
    if err.status != 400:
        return AnthropicError.of(err)
    return AnthropicError(400, tool_renamed(err, sources, {"parameters": "input_schema"}).message)


def _too_long(prompt_len: int, context: int) -> APIError:
    return APIError(400, f"prompt is too long: {prompt_len} tokens > {context - 1} maximum")


# -- the answer, built ---------------------------------------------------------------------------------
def tool_use_id(call_id: str) -> str:
    """The engine's ``call_…`` ids in Anthropic's ``toolu_…`` form."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(choice: Choice) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    reason = choice.finish.stop_reason if choice.finish else "eos_token"
    if reason == "token_limit":
        return "max_tokens", None
    if reason == "stop_string":
        return "stop_sequence", choice.finish.stop_string
    return ("tool_use" if choice.tool_calls else "end_turn"), None


def usage(choice: Choice, prompt_len: int, truncated: int = 0) -> dict:
    """``input_tokens`` counts the prompt tokens the cache did not hold, as
    Anthropic counts them; ``cache_read_input_tokens`` the ones it did;
    ``mlx_engine`` the engine's statistics, as in the OpenAI APIs (with
    ``truncated_tokens`` when the overflow policy cut the prompt)."""
    c = counts(choice, prompt_len)
    return {
        "input_tokens": c.prompt - c.cached,
        "output_tokens": c.output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": c.cached,
        "mlx_engine": with_truncated(engine_stats(choice.stats), truncated),
    }


def whole_message(mid: str, model: str, choice: Choice, prompt_len: int, truncated: int = 0) -> dict:
    text = "".join(choice.text)
    content = [{"type": "text", "text": text}] if text else []
    content += [
        {"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": c.arguments} for c in choice.tool_calls
    ]
    reason, sequence = stop_reason(choice)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(choice, prompt_len, truncated),
    }


class BlockWriter:
    """Anthropic's content-block events of one generation: a text block or a
    ``tool_use`` block opened as its first piece arrives, closed at the next."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def feed(self, r: me.GenerationResult) -> list[str]:
        out: list[str] = []
        if r.text:
            if self.open != "text":
                out += self._start({"type": "text", "text": ""}, "text")
            out.append(self._delta({"type": "text_delta", "text": r.text}))
        for d in r.tool_call_deltas:
            if d.id is not None:
                out += self._start({"type": "tool_use", "id": tool_use_id(d.id), "name": d.name, "input": {}}, "tool")
            if d.arguments and self.open == "tool":
                out.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
        return out

    def _start(self, block: dict, kind: str) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [
            sse({"type": "content_block_start", "index": self.index, "content_block": block}, "content_block_start")
        ]

    def _delta(self, delta: dict) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]


PING = sse({"type": "ping"}, "ping")


async def _events(run: RequestRun, mid: str, model: str, prompt_len: int, truncated: int) -> AsyncIterator[str]:
    """The stream as Anthropic sends it: ``message_start``, ``ping``, each
    block's start, deltas and stop, ``message_delta`` (stop reason, usage),
    ``message_stop``. While nothing comes (a long prefill) ``ping`` events keep
    the connection alive; an engine failure is an ``error`` event."""
    writer, choice = BlockWriter(), Choice(0)
    start = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_len, "output_tokens": 0},
    }
    try:
        yield sse({"type": "message_start", "message": start}, "message_start")
        yield PING
        async for item in with_heartbeat(run.items()):
            if item is None:
                yield PING
                continue
            if item.error is not None:
                yield sse(AnthropicError.of(from_failure(item.error)).body(), "error")
                return
            choice.add(item.result, False)
            for e in writer.feed(item.result):
                yield e
        for e in writer.close():
            yield e
        if run.cut_by_shutdown:
            yield sse(AnthropicError(529, "the server is shutting down: the generation was cut short").body(), "error")
            return
        reason, sequence = stop_reason(choice)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield sse(
            {"type": "message_delta", "delta": delta, "usage": usage(choice, prompt_len, truncated)}, "message_delta"
        )
        yield sse({"type": "message_stop"}, "message_stop")
    finally:
        run.cancel()


# -- the endpoints -----------------------------------------------------------------------------------
async def _parse(request: Request, model: type[_Body]):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the request nests too deeply to be processed") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(list(exc.errors())) from None


def _check_key(expected: str | None, request: Request) -> None:
    """``x-api-key: KEY`` or ``Authorization: Bearer KEY`` (Claude Code's
    ``ANTHROPIC_API_KEY`` and ``ANTHROPIC_AUTH_TOKEN``)."""
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = request.headers.get("x-api-key") or (token.strip() if scheme.lower() == "bearer" else "")
    if not hmac.compare_digest(key.encode(), expected.encode()):
        raise AnthropicError(401, "invalid x-api-key: send 'x-api-key: KEY' or 'Authorization: Bearer KEY'")


def messages_router(host, api_key: str | None, *, keep_billing_header: bool = False) -> APIRouter:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``; the model's
    service comes from the host (hosting/host.py: loaded when needed)."""
    router = APIRouter()

    async def translated(request: Request, model: type[_Body]):
        _check_key(api_key, request)
        body = await _parse(request, model)
        try:
            host.lookup(body.model)
        except APIError as err:
            raise AnthropicError(
                404, f"model: {body.model!r} is not served here; GET /v1/models lists the models served"
            ) from err
        fields, sources = internal(body, keep_billing_header)
        return body, internal_request(fields), sources

    @router.post("/v1/messages")
    async def create(request: Request):
        sources: list[int] = []
        mid = f"msg_{uuid.uuid4().hex}"
        try:
            body, chat, sources = await translated(request, MessagesRequest)
            async with host.kit_for(body.model) as service:
                turn = await prepare(service, chat, _too_long, mid)
                run = await admit(service, request, turn.prompt, turn.kwargs, prompt_field="messages")
                prompt_len = len(turn.prompt.tokens)
                if body.stream:
                    events = _events(run, mid, service.model_id, prompt_len, turn.truncated)
                    return StreamingResponse(
                        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                    )
                choice = (await collect(run, request, 1, False))[0]
        except APIError as err:
            return _edge(err, sources).response()
        except AnthropicError as err:
            return err.response()
        return JSONResponse(whole_message(mid, service.model_id, choice, prompt_len, turn.truncated))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        sources: list[int] = []
        try:
            body, chat, sources = await translated(request, CountTokensRequest)
            async with host.kit_for(body.model) as service:
                prompt = await count_prompt(service, request, chat, _too_long)
        except APIError as err:
            return _edge(err, sources).response()
        except AnthropicError as err:
            return err.response()
        return {"input_tokens": len(prompt.tokens)}

    return router
