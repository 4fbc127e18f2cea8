"""A Messages request's body (pydantic) as the core's chat request: the system prompt,
content blocks as chat messages, tools and ``tool_choice``, and the core's errors said
with this request's tool indices and fields."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ...core.schemas import EngineOptions
from ...web.errors import AnthropicError, APIError, bad_request, clipped, tool_renamed

logger = logging.getLogger(__name__)


BILLING_HEADER = "x-anthropic-billing-header:"
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class CountTokensRequest(Body):
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


def named_as_request(err: APIError, sources: list[int]) -> AnthropicError:
    """An error of the internal request, its tool indices and fields as this request named them."""
    if err.status != 400:
        return AnthropicError.of(err)
    return AnthropicError(400, tool_renamed(err, sources, {"parameters": "input_schema"}).message)


def too_long(prompt_len: int, context: int) -> APIError:
    return APIError(400, f"prompt is too long: {prompt_len} tokens > {context - 1} maximum")
