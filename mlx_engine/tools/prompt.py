"""Tools in the prompt: the model's own chat template when it renders tools,
else the default tool prompt.

The default tool prompt (Hermes-like, the syntax most open models were tuned
on) lists the tools as JSON inside ``<tools></tools>`` in the system message
and asks for each call as ``{"name": ..., "arguments": {...}}`` inside
``<tool_call></tool_call>``. Earlier assistant calls are written back in that
syntax and tool results become a user turn inside ``<tool_response>`` tags, so a
template that knows nothing of tools renders the whole conversation.
"""

from __future__ import annotations

import json
from typing import Any

from .formats import ToolFormat
from .spec import MAX_JSON_DEPTH, Tool, json_depth

DEFAULT_TOOL_PROMPT = (
    "You can call functions to help answer. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with only a JSON object naming it and giving its arguments, inside tags:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>\n'
    "A function's result comes back inside <tool_response></tool_response> tags."
)


def default_tool_prompt(tools: tuple[Tool, ...]) -> str:
    """The system text that teaches the default tool syntax."""
    return DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools))


def _call_text(call: Any) -> str:
    """An OpenAI ``tool_calls`` item in the default syntax."""
    fn = call.get("function", call) if isinstance(call, dict) else {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # written back as the model wrote it
    payload = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


def default_messages(messages: list[dict], tools: tuple[Tool, ...] | None) -> list[dict]:
    """``messages`` for a template without tool support: the tool prompt in the
    system message, assistant calls as text, tool results as user turns
    (consecutive results in one turn)."""
    out: list[dict] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif m["role"] == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        else:
            out.append({**m, "content": content})
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools:
        prompt = default_tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _native_message(m: dict) -> dict:
    """Assistant calls with their arguments as a dict, as Hugging Face chat
    templates expect (OpenAI sends them as JSON text)."""
    if m.get("role") != "assistant" or not m.get("tool_calls"):
        return m
    calls = []
    for call in m["tool_calls"]:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except json.JSONDecodeError:
                pass  # left as the model wrote it
        calls.append(call)
    return {**m, "tool_calls": calls}


CALL_SHAPE = '[{"id": ..., "type": "function", "function": {"name": ..., "arguments": <JSON text or object>}}]'


def check_tool_history(messages: list[dict]) -> None:
    """``ValueError`` naming the first malformed ``tool_calls`` item of the
    messages (OpenAI's shape, ``CALL_SHAPE``); arguments that are text but not
    JSON are allowed (written back as the model wrote them)."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls must be a list {CALL_SHAPE}, got {type(calls).__name__}")
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(call, dict):
                raise ValueError(f"{where} must be an object like {CALL_SHAPE[1:-1]}")
            fn = call.get("function", call)
            if not isinstance(fn, dict):
                raise ValueError(f'{where}.function must be {{"name": ..., "arguments": ...}}')
            if not isinstance(fn.get("name"), str):
                raise ValueError(f"{where}.function.name must be a string, got {fn.get('name')!r}")
            args = fn.get("arguments", {})
            if not isinstance(args, (str, dict)):
                raise ValueError(f"{where}.function.arguments must be JSON text or an object")
            if json_depth(args) > MAX_JSON_DEPTH:
                raise ValueError(f"{where}.function.arguments is nested deeper than {MAX_JSON_DEPTH} levels")


def render_arguments(fmt: ToolFormat, tools: tuple[Tool, ...] | None, messages: list[dict]) -> tuple[list[dict], dict]:
    """The messages and keyword arguments for the tokenizer's ``apply_chat_template``
    (``ValueError`` for malformed ``tool_calls``)."""
    check_tool_history(messages)
    if fmt.native:
        return [_native_message(m) for m in messages], ({"tools": [t.as_openai() for t in tools]} if tools else {})
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return default_messages(messages, tools), {}
    return messages, {}
