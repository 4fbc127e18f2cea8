"""The results as Responses output: the response object, its output items and usage,
whole or as the Responses event stream (``EventWriter``)."""

from __future__ import annotations

import mlx_engine as me

import time
import uuid

from ...core.chat_objects import Choice, engine_stats
from ...core.turns import Counts, counts, sse, with_truncated
from .body import ResponsesRequest


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
