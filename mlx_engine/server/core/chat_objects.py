"""OpenAI response objects from the engine's results: whole answers, stream
chunks, logprobs and usage (with the ``mlx_engine`` statistics extension)."""

from __future__ import annotations

import mlx_engine as me

import time
import uuid
from dataclasses import dataclass, field

FINISH_REASONS = {
    "eos_token": "stop",
    "stop_string": "stop",
    "grammar_complete": "stop",
    "tool_calls": "tool_calls",
    "token_limit": "length",
    "user_cancelled": "stop",
}
_STATS = (
    "decoding_mode",
    "mode_reason",
    "drafted_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "time_to_first_token",
    "prompt_tps",
    "generation_tps",
    "cache_source",
    "generated_tokens",
)


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # chat-style entries, one per token
    finish: me.GenerationStopCondition | None = None
    stats: me.GenerationStats | None = None
    tool_calls: list[me.ToolCall] = field(default_factory=list)

    def add(self, r: me.GenerationResult, with_logprobs: bool) -> list[dict]:
        """Record a result; returns its logprob entries (empty unless asked)."""
        self.text.append(r.text)
        self.tool_calls.extend(r.tool_calls)
        entries = token_logprobs(r) if with_logprobs else []
        self.logprobs.extend(entries)
        if r.stop_condition is not None:
            self.finish, self.stats = r.stop_condition, r.stats
        return entries

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's reason; ``tool_calls`` when an answer that ended normally made calls."""
        if self.finish is None:
            return None
        reason = FINISH_REASONS[self.finish.stop_reason]
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    def message(self) -> dict:
        """The whole answer's ``message``: content null when there are only calls."""
        text = "".join(self.text)
        if not self.tool_calls:
            return {"role": "assistant", "content": text}
        return {
            "role": "assistant",
            "content": text or None,
            "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                for c in self.tool_calls
            ],
        }


def delta_tool_calls(deltas: list[me.ToolCallDelta]) -> list[dict]:
    """Streamed call pieces as OpenAI's ``delta.tool_calls``: ``id``, ``type`` and
    the name only on a call's first piece, argument fragments on every one."""
    out = []
    for d in deltas:
        if d.id is not None:
            out.append(
                {
                    "index": d.index,
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments},
                }
            )
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def token_logprobs(r: me.GenerationResult) -> list[dict]:
    """Chat logprob entries (``{"token", "logprob", "bytes", "top_logprobs"}``) of a result's tokens."""
    tops = r.top_logprobs or [[] for _ in r.tokens]
    return [
        {**_entry(t.text, t.logprob), "top_logprobs": [_entry(a.text, a.logprob) for a in alts]}
        for t, alts in zip(r.tokens, tops)
    ]


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """The legacy completions shape of the same entries."""
    offsets, pos = [], offset
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def engine_stats(stats: me.GenerationStats | None) -> dict:
    if stats is None:
        return {}
    d = stats.as_dict()
    return {k: d[k] for k in _STATS}


def usage(prompt_len: int, choices: list[Choice], truncated: int = 0) -> dict:
    """OpenAI usage (the prompt counted once for all choices) plus ``mlx_engine``:
    the first choice's statistics, and every choice's when there are several;
    ``truncated_tokens`` when the overflow policy cut the prompt."""
    first = choices[0].stats
    prompt_tokens = first.prompt_tokens if first else prompt_len
    completion = sum(c.stats.generated_tokens for c in choices if c.stats)
    ext = {**engine_stats(first), "stop_reason": choices[0].finish.stop_reason if choices[0].finish else None}
    if truncated:
        ext["truncated_tokens"] = truncated
    if len(choices) > 1:
        ext["choices"] = [{**engine_stats(c.stats), "index": c.index} for c in choices]
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens if first else 0},
        "mlx_engine": ext,
    }


class Envelope:
    """id, created and model shared by every object of one response."""

    def __init__(self, model: str, chat: bool, truncated: int = 0):
        self.chat, self.model, self.truncated = chat, model, truncated
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "mlx-engine",
        }

    def whole(self, choices: list[Choice], prompt_len: int, with_logprobs: bool) -> dict:
        """The non-streamed answer."""
        out = []
        for c in choices:
            lp = None
            if with_logprobs:
                lp = {"content": c.logprobs} if self.chat else completion_logprobs(c.logprobs)
            body = {"message": c.message()} if self.chat else {"text": "".join(c.text)}
            out.append({"index": c.index, **body, "logprobs": lp, "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": out, "usage": usage(prompt_len, choices, self.truncated)}

    def chunk(
        self,
        index: int,
        *,
        text: str | None = None,
        role: bool = False,
        entries: list[dict] | None = None,
        offset: int = 0,
        finish: str | None = None,
        with_usage: bool = False,
        tool_deltas: list[me.ToolCallDelta] | None = None,
    ) -> dict:
        """One stream chunk for choice ``index``."""
        lp = None
        if entries is not None:
            lp = {"content": entries} if self.chat else completion_logprobs(entries, offset)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if tool_deltas:
                delta["tool_calls"] = delta_tool_calls(tool_deltas)
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            head = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
            head = self._head("text_completion")
        return {**head, "choices": [choice], **({"usage": None} if with_usage else {})}

    def usage_chunk(self, choices: list[Choice], prompt_len: int) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": usage(prompt_len, choices, self.truncated)}
