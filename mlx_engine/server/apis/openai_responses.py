"""OpenAI's Responses API (``POST /v1/responses``) as a wire format of the core.

A request's ``instructions``, stored history (``previous_response_id``) and
``input`` items become chat messages, its function tools and ``text.format``
the chat request's ``tools`` and ``response_format``; the core renders,
admits and generates (core/turns.py), and the results come back as Responses
output items: whole, or as the Responses event stream. Tool types other than
``function`` (``web_search``, ``namespace``, ...) are skipped with a log line:
this server runs no hosted tools.
"""

from __future__ import annotations

import mlx_engine as me

import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..core.chat_objects import Choice, engine_stats
from ..core.schemas import EngineOptions
from ..core.turns import Counts, admit, collect, counts, internal_request, prepare, sse, with_heartbeat, with_truncated
from ..hosting.runs import RequestRun
from ..web.errors import APIError, bad_request, clipped, from_failure, tool_renamed

logger = logging.getLogger(__name__)

DEFAULT_STORE_SIZE = 256  # stored responses kept for previous_response_id; the oldest is dropped first
DEFAULT_STORE_BYTES = 64 * 1024 * 1024  # and at most this much of them (their JSON), the oldest dropped first
# What a response echoes but no prompt holds (so no context check bounds it),
# bounded as OpenAI bounds it: metadata pairs and their lengths, format names.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_FORMAT_NAME, MAX_FORMAT_DESCRIPTION = 64, 4096
MAX_TOOLS = 128
MAX_HOSTED_TOOL_BYTES = 16 * 1024  # a tool this server skips (web_search, mcp, custom ...): its JSON
_TEXT_PARTS = ("input_text", "output_text", "text")
_IGNORED_ITEMS = ("reasoning", "item_reference")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    """The fields this server reads; others (``reasoning``, ``include``,
    ``prompt_cache_key``, ``truncation``, ``service_tier``, ``user``) are ignored."""

    model: str
    input: Any  # a string or a list of items, checked by input_messages (pydantic would name the union's member)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    mlx_engine: EngineOptions = EngineOptions()


@dataclass
class Stored:
    response: dict
    conversation: list[dict]  # chat messages: the input history and this response's output
    size: int = 0  # bytes of both as JSON: what the store counts against its byte bound


class ResponseStore:
    """Stored responses by id, at most ``capacity`` of them and ``max_bytes``
    of their JSON (response and conversation), the oldest dropped first. A
    conversation continued from a stored one shares its messages, so the bytes
    counted are an upper bound of what is held."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE, max_bytes: int = DEFAULT_STORE_BYTES):
        self.capacity, self.max_bytes = capacity, max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, response: dict, conversation: list[dict]) -> bool:
        """Keep a response; False (logged) when it alone is over ``max_bytes``."""
        size = len(json.dumps(response, default=str)) + len(json.dumps(conversation, default=str))
        if size > self.max_bytes:
            logger.warning(
                "response %s (%d bytes) is larger than the store's %d bytes; not stored", rid, size, self.max_bytes
            )
            return False
        self.delete(rid)
        self._items[rid] = Stored(response, conversation, size)
        self.bytes += size
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self.bytes -= dropped.size
        return True

    def get(self, rid: str) -> Stored | None:
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        stored = self._items.pop(rid, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None


# -- what is echoed, checked ------------------------------------------------------------------
def check_echoed(body: ResponsesRequest) -> None:
    """A 400 naming the field for what a response echoes but no prompt bounds:
    ``metadata`` past OpenAI's bounds, a format name or description too long,
    too many tools or a skipped (hosted) tool's body too large, and a non-finite
    number (``Infinity``, ``NaN``: not JSON, which the answer must be) anywhere
    in ``tools``, ``tool_choice`` or ``text.format.schema``."""
    meta = body.metadata or {}
    if len(meta) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata: at most {MAX_METADATA_PAIRS} key-value pairs, got {len(meta)}", "metadata")
    for key, value in meta.items():
        if len(key) > MAX_METADATA_KEY:
            raise bad_request(f"metadata: keys are at most {MAX_METADATA_KEY} characters, got {len(key)}", "metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise bad_request(
                f"metadata.{key[:64]}: values are at most {MAX_METADATA_VALUE} characters, got {len(value)}",
                f"metadata.{key[:64]}",
            )
    fmt = body.text.format if body.text else None
    for name, bound in (("name", MAX_FORMAT_NAME), ("description", MAX_FORMAT_DESCRIPTION)):
        value = getattr(fmt, name, None)
        if value is not None and len(value) > bound:
            raise bad_request(
                f"text.format.{name}: at most {bound} characters, got {len(value)}", f"text.format.{name}"
            )
    _check_tools(body.tools or [])
    for value, where in (
        (body.tools, "tools"),
        (body.tool_choice, "tool_choice"),
        (fmt and fmt.schema_, "text.format.schema"),
    ):
        bad = non_finite(value)
        if bad is not None:
            path = where + "".join(f".{p}" for p in bad)
            raise bad_request(f"{path}: numbers must be finite (Infinity and NaN are not JSON)", path)


def _check_tools(tools: list[dict]) -> None:
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    for i, tool in enumerate(tools):
        if tool.get("type") in ("function", "namespace"):
            continue  # declared in the prompt: the context bounds them
        size = len(json.dumps(tool, default=str))
        if size > MAX_HOSTED_TOOL_BYTES:
            raise bad_request(
                f"tools.{i}: a {tool.get('type')!r} tool (not served here) is at most {MAX_HOSTED_TOOL_BYTES} "
                f"bytes as JSON, got {size}",
                f"tools.{i}",
            )


def non_finite(value: Any) -> list | None:
    """The path (keys and indices) to the first non-finite float in ``value``
    (nested dicts and lists, walked without recursion); None when there is none."""
    stack: list[tuple[Any, list]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path
        if isinstance(item, dict):
            stack.extend((v, [*path, k]) for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((v, [*path, i]) for i, v in reversed(list(enumerate(item))))
    return None


# -- the request, translated ------------------------------------------------------------------
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


def _edge(err: APIError, tool_sources: list[int]) -> APIError:
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


def _too_long(prompt_len: int, context: int) -> APIError:
    return APIError(
        400,
        f"Your input exceeds the context window of this model: the prompt has {prompt_len} tokens "
        f"and the model's context is {context} tokens.",
        param="input",
        code="context_length_exceeded",
    )


# -- the response, built --------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Head:
    """What every Responses object of one request shares: the request's
    settings echoed back, as OpenAI's response object carries them."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.id, self.created, self.body, self.model = _new_id("resp"), int(time.time()), body, model

    def obj(self, status: str, output: list[dict], usage: dict | None = None, **extra) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": b.store,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [],
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": b.metadata or {},
            "user": None,
            **extra,
        }

    def final(self, choice: Choice, prompt_len: int, output: list[dict], truncated: int = 0) -> dict:
        """The finished response: ``incomplete`` when the token budget cut it."""
        cut = choice.finish is not None and choice.finish.stop_reason == "token_limit"
        extra = {"incomplete_details": {"reason": "max_output_tokens"}} if cut else {}
        return self.obj(
            "incomplete" if cut else "completed", output, usage(counts(choice, prompt_len), choice, truncated), **extra
        )


def usage(c: Counts, choice: Choice, truncated: int = 0) -> dict:
    return {
        "input_tokens": c.prompt,
        "input_tokens_details": {"cached_tokens": c.cached},
        "output_tokens": c.output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": c.prompt + c.output,
        "mlx_engine": with_truncated(engine_stats(choice.stats), truncated),
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed") -> dict:
    return {
        "id": _new_id("msg"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)],
    }


def call_item(call_id: str, name: str, arguments: str, spaces: set[str], status: str = "completed") -> dict:
    """A ``function_call`` item; a call of ``namespace.fn`` has ``namespace`` and ``name: fn``."""
    item = {"id": _new_id("fc"), "type": "function_call", "status": status, "call_id": call_id}
    space, dot, short = name.partition(".")
    if dot and space in spaces:
        item["namespace"], name = space, short
    return {**item, "name": name, "arguments": arguments}


def whole_output(choice: Choice, spaces: set[str]) -> list[dict]:
    """A finished choice as output items: its text (when any, or when it made no
    calls), then its completed calls."""
    text = "".join(choice.text)
    items = [message_item(text)] if text or not choice.tool_calls else []
    return items + [call_item(c.id, c.name, c.arguments_json, spaces) for c in choice.tool_calls]


def output_messages(output: list[dict]) -> list[dict]:
    """Output items as the chat messages a next turn's history holds."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": _full_name(i), "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call"
    ]
    msg: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def _full_name(item: dict) -> str:
    return f"{item['namespace']}.{item['name']}" if item.get("namespace") else item["name"]


class EventWriter:
    """The Responses event stream of one generation: output items opened and
    closed as text and tool-call pieces arrive, numbered events."""

    def __init__(self, spaces: set[str]) -> None:
        self.spaces = spaces
        self.seq = 0
        self.items: list[dict] = []  # every item opened, in output order
        self.open: dict | None = None
        self.done_calls: set[str] = set()

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    def feed(self, r: me.GenerationResult) -> list[str]:
        out = self._text(r.text) if r.text else []
        for d in r.tool_call_deltas:
            out += self._call_piece(d)
        for c in r.tool_calls:
            self.done_calls.add(c.id)
        return out

    def _start(self, item: dict) -> list[str]:
        out = self.close()
        self.open = item
        self.items.append(item)
        return out + [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _text(self, text: str) -> list[str]:
        out = self._open_message() if self.open is None or self.open["type"] != "message" else []
        self.open["content"][0]["text"] += text
        return out + [
            self.event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])
        ]

    def _open_message(self) -> list[str]:
        item = message_item("", status="in_progress")
        item["content"] = []
        out = self._start(item)
        part = _text_part("")
        out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=dict(part)))
        item["content"].append(part)
        return out

    def _call_piece(self, d: me.ToolCallDelta) -> list[str]:
        out = self._start(call_item(d.id, d.name, "", self.spaces, status="in_progress")) if d.id is not None else []
        if d.arguments and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += d.arguments
            out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=d.arguments))
        return out

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def close(self) -> list[str]:
        """Close the open item (its ``.done`` events)."""
        item, out = self.open, []
        if item is None:
            return out
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self.event(
                    "response.output_text.done", **self._where(), content_index=0, text=part["text"], logprobs=[]
                )
            )
            out.append(self.event("response.content_part.done", **self._where(), content_index=0, part=dict(part)))
            item["status"] = "completed"
        else:
            item["status"] = "completed" if item["call_id"] in self.done_calls else "incomplete"
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **self._where(),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=dict(item)))
        self.open = None
        return out

    def finish(self) -> tuple[list[str], list[dict]]:
        """Close what is open (an answer with no text and no call still gets its
        empty message); the events and the final output (cut calls left out,
        as in a whole response)."""
        out = (self._open_message() if not self.items else []) + self.close()
        return out, [i for i in self.items if i["status"] == "completed"]


# -- the endpoints -----------------------------------------------------------------------------------
def responses_router(host, auth, store_size: int = DEFAULT_STORE_SIZE) -> APIRouter:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``; the
    model's service comes from the host (hosting/host.py: loaded when needed)."""
    router = APIRouter(dependencies=[Depends(auth)])
    store = ResponseStore(store_size)

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        check_echoed(body)
        async with host.kit_for(body.model) as service:
            return await _respond(service, store, body, request)

    @router.get("/v1/responses/{rid}")
    async def retrieve(rid: str):
        stored = store.get(rid)
        if stored is None:
            raise APIError(404, f"Response with id {rid!r} not found.", param="response_id", type="not_found_error")
        return stored.response

    @router.delete("/v1/responses/{rid}")
    async def delete(rid: str):
        if not store.delete(rid):
            raise APIError(404, f"Response with id {rid!r} not found.", param="response_id", type="not_found_error")
        return {"id": rid, "object": "response", "deleted": True}

    return router


def _history(store: ResponseStore, body: ResponsesRequest) -> list[dict]:
    """The stored conversation ``previous_response_id`` continues (none without one)."""
    if body.previous_response_id is None:
        return []
    stored = store.get(body.previous_response_id)
    if stored is None:
        raise APIError(
            404,
            f"Previous response with id {body.previous_response_id!r} not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored.conversation


def _chat_fields(body: ResponsesRequest, messages: list[dict], tools: list[dict] | None) -> dict:
    """The internal (chat) request's fields for ``body`` over ``messages``."""
    return {
        "model": body.model,
        "messages": messages,
        "tools": tools,
        "tool_choice": chat_tool_choice(body.tool_choice, tools is not None),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "mlx_engine": body.mlx_engine.model_dump(),
    }


async def _respond(service, store: ResponseStore, body: ResponsesRequest, request: Request):
    """One Responses request on ``service``: translated to the core's request,
    run, and answered whole or as a stream; kept in ``store`` when asked."""
    history = _history(store, body)
    new = input_messages(body.input)
    tools, sources = chat_tools(body.tools)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    head = Head(body, service.model_id)
    try:
        chat = internal_request(_chat_fields(body, system + history + new, tools))
        turn = await prepare(service, chat, _too_long, head.id)
        run = await admit(service, request, turn.prompt, turn.kwargs, prompt_field="input")
    except APIError as err:
        raise _edge(err, sources) from None
    prompt_len = len(turn.prompt.tokens)

    def keep(response: dict, output: list[dict]) -> None:
        if body.store:
            store.put(head.id, response, history + new + output_messages(output))

    if body.stream:
        events = _events(run, head, (prompt_len, turn.truncated), keep, namespaces(body.tools))
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    choice = (await collect(run, request, 1, False))[0]
    output = whole_output(choice, namespaces(body.tools))
    response = head.final(choice, prompt_len, output, turn.truncated)
    keep(response, output)
    return response


async def _events(run: RequestRun, head: Head, prompt: tuple[int, int], keep, spaces: set[str]) -> AsyncIterator[str]:
    """The stream as OpenAI sends it: ``response.created`` and ``.in_progress``,
    each output item's events, then ``response.completed`` (or ``.incomplete``
    when the budget cut it, ``.failed`` on an engine error) with usage. While
    nothing comes (a long prefill) ``response.in_progress`` is sent again to
    keep the connection alive.
    ``prompt``: its length and the tokens the overflow policy cut from it."""
    writer, choice = EventWriter(spaces), Choice(0)
    try:
        yield writer.event("response.created", response=head.obj("in_progress", []))
        yield writer.event("response.in_progress", response=head.obj("in_progress", []))
        async for item in with_heartbeat(run.items()):
            if item is None:
                # An event, not an SSE comment: clients' idle timers (Codex CLI's
                # stream_idle_timeout_ms) count events and skip comments.
                yield writer.event("response.in_progress", response=head.obj("in_progress", []))
                continue
            if item.error is not None:
                err = from_failure(item.error)
                failed = head.obj("failed", [], error={"code": err.code or err.type, "message": err.message})
                yield writer.event("response.failed", response=failed)
                return
            choice.add(item.result, False)
            for e in writer.feed(item.result):
                yield e
        closing, output = writer.finish()
        for e in closing:
            yield e
        if run.cut_by_shutdown:  # a partial answer is not kept
            error = {"code": "shutting_down", "message": "the server is shutting down: the generation was cut short"}
            yield writer.event("response.failed", response=head.obj("failed", output, error=error))
            return
        final = head.final(choice, prompt[0], output, prompt[1])
        keep(final, output)
        yield writer.event(f"response.{final['status']}", response=final)
    finally:
        run.cancel()
