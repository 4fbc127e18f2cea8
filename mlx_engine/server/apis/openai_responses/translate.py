"""A Responses request as the core's chat request: input items as chat messages,
function tools as chat tools, ``text.format`` as ``response_format``, and the
core's errors named as this request's fields."""

from __future__ import annotations

import logging
from typing import Any

from ...web.errors import APIError, bad_request, clipped, tool_renamed
from .body import TextConfig

logger = logging.getLogger(__name__)

_TEXT_PARTS = ("input_text", "output_text", "text")
_IGNORED_ITEMS = ("reasoning", "item_reference")


def input_messages(items: str | list[dict]) -> list[dict]:
    """``input`` as chat messages: message items by role, consecutive
    ``function_call`` items as one assistant message's ``tool_calls`` (after its
    text), ``function_call_output`` as ``tool`` messages; reasoning skipped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise bad_request("input: a string or a list of input items (objects) is required", "input")
    out: list[dict] = []
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call_id, name = _field(item, "call_id", where), _field(item, "name", where)
            if isinstance(item.get("namespace"), str):
                name = f"{item['namespace']}.{name}"
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _field(item, "arguments", where)},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", where)
            tool = {"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"), where)}
            if call_id in names:
                tool["name"] = names[call_id]
            out.append(tool)
        elif kind in _IGNORED_ITEMS:
            continue
        else:
            logger.info("%s: input items of type %s are not served here; skipped", where, clipped(kind))
    return out


def _field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise bad_request(f"{where}.{key}: a non-empty string is required", f"{where}.{key}")
    return value


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(
            f"{where}.role: must be 'user', 'assistant', 'system' or 'developer', got {role!r}", f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: a string or a list of content parts is required", f"{where}.content")
    parts = [_part(p, f"{where}.content.{j}") for j, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):  # a string: what a text-only template renders
        return {"role": role, "content": "\n".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _part(part: Any, where: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise bad_request(f"{where}.image_url: a data: URI is required (file ids are not served)", where)
        return {"type": "image_url", "image_url": {"url": url}}
    raise bad_request(
        f"{where}: parts of type {kind!r} are not supported (input_text, output_text, input_image are)", where
    )


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "\n".join(_part(p, f"{where}.output.{j}").get("text", "") for j, p in enumerate(output))
    raise bad_request(f"{where}.output: a string or a list of parts is required", f"{where}.output")


def chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, list[int]]:
    """Function tools as chat tools, and each one's index in the request. The
    functions of a ``namespace`` tool are declared as ``namespace.name`` (its
    calls come back split again); other tool types are skipped with a log line."""
    out, sources = [], []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            inner = [t for t in tool["tools"] if isinstance(t, dict) and t.get("type") == "function"]
            out += [_chat_tool(t, f"{tool.get('name')}.{t.get('name')}") for t in inner]
            sources += [i] * len(inner)
        elif kind == "function":
            out.append(_chat_tool(tool, tool.get("name")))
            sources.append(i)
        else:
            logger.info("tools.%d: %s tools are not served here; skipped", i, clipped(kind))
    return out or None, sources


def _chat_tool(tool: dict, name: Any) -> dict:
    fn = {"name": name, "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def namespaces(tools: list[dict] | None) -> set[str]:
    """The names of the request's ``namespace`` tools."""
    return {t["name"] for t in tools or [] if t.get("type") == "namespace" and isinstance(t.get("name"), str)}


def chat_tool_choice(choice: str | dict | None, have_tools: bool) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    logger.info("tool_choice of type %s names a tool not served here; taken as 'auto'", clipped(choice.get("type")))
    return "auto" if have_tools else None


def response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format.schema is required when type is 'json_schema'", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


def named_as_request(err: APIError, tool_sources: list[int]) -> APIError:
    """An error of the internal request, naming the Responses field."""
    err = tool_renamed(err, tool_sources)
    param = err.param or ""
    if param.startswith("messages"):
        err.param = "input"
    elif param.startswith("response_format"):
        err.param = "text.format"
    elif param == "max_tokens":
        err.param = "max_output_tokens"
    return err


def too_long(prompt_len: int, context: int) -> APIError:
    return APIError(
        400,
        f"Your input exceeds the context window of this model: the prompt has {prompt_len} tokens "
        f"and the model's context is {context} tokens.",
        param="input",
        code="context_length_exceeded",
    )
