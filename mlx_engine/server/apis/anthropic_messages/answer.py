"""The results as Anthropic's message: stop reasons, usage, content blocks, whole or as the
Messages event stream (``BlockWriter``)."""

from __future__ import annotations

import mlx_engine as me

from typing import AsyncIterator

from ...core.chat_objects import Choice, engine_stats
from ...core.turns import (
    counts,
    sse,
    with_heartbeat,
    with_truncated,
)
from ...hosting.runs import RequestRun
from ...web.errors import AnthropicError, from_failure


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


async def message_events(run: RequestRun, mid: str, model: str, prompt_len: int, truncated: int) -> AsyncIterator[str]:
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
