"""OpenAI's chat completions and completions: the request's prompt (core/params.py),
admission and the generations (core/turns.py), answered whole or as server-sent
events (core/chat_objects.py)."""

from __future__ import annotations

import json
from typing import AsyncIterator

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..core import params
from ..core.chat_objects import Choice, Envelope
from ..core.schemas import ChatCompletionRequest, CompletionRequest
from ..core.turns import admit, collect, fit_context
from ..hosting.runs import RequestRun
from ..hosting.service import Service
from ..web.errors import APIError, bad_request, from_failure

SHUTDOWN_CUT = APIError(
    503, "the server is shutting down: the generation was cut short", type="server_error", code="shutting_down"
)


def chat_router(host, auth) -> APIRouter:
    """``POST /v1/chat/completions`` and ``POST /v1/completions``."""
    router = APIRouter(dependencies=[Depends(auth)])

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        async with host.kit_for(body.model, ttl=body.ttl) as service:
            fitted = await anyio.to_thread.run_sync(
                fit_context, service, body, lambda b: params.chat_prompt(service.kit, b)
            )
            return await _answer(service, request, fitted.body, fitted.prompt, chat=True, truncated=fitted.dropped)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.echo:
            raise bad_request("echo is not supported", "echo")
        async with host.kit_for(body.model, ttl=body.ttl) as service:
            prompt = await anyio.to_thread.run_sync(params.completion_prompt, service.kit, body)
            return await _answer(service, request, body, prompt, chat=False)

    return router


async def _answer(service: Service, request: Request, body, prompt: params.Prompt, *, chat: bool, truncated: int = 0):
    """Admit the request, start its choices, answer whole or streamed."""
    if body.n > service.queue.rows:
        raise bad_request(f"n must be at most {service.queue.rows} (the server's parallel rows)", "n")
    kwargs = params.generator_kwargs(service.kit, body, prompt, service.decoding)
    run = await admit(service, request, prompt, kwargs, prompt_field="messages" if chat else "prompt")
    env = Envelope(service.model_id, chat, truncated)
    with_logprobs = params.wants_logprobs(body)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(run, env, body.n, len(prompt.tokens), with_logprobs, usage)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    choices = await collect(run, request, body.n, with_logprobs)
    return JSONResponse(env.whole(choices, len(prompt.tokens), with_logprobs))


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(
    run: RequestRun, env: Envelope, n: int, prompt_len: int, with_logprobs: bool, include_usage: bool
) -> AsyncIterator[str]:
    """The stream as OpenAI sends it: a role chunk (chat), content and
    ``tool_calls`` delta chunks, a finish chunk per choice, a usage chunk when asked, ``[DONE]``. Leaving the
    stream (a client disconnect cancels it) stops the generations."""
    choices = [Choice(i) for i in range(n)]
    offsets = [0] * n
    try:
        if env.chat:
            for i in range(n):
                yield _sse(env.chunk(i, role=True, with_usage=include_usage))
        async for item in run.items():
            if item.error is not None:
                yield _sse(from_failure(item.error).body())
                continue
            c, r = choices[item.index], item.result
            entries = c.add(r, with_logprobs)
            if r.text or entries or r.tool_call_deltas or c.finish is not None:
                yield _sse(
                    env.chunk(
                        c.index,
                        text=r.text,
                        entries=entries if with_logprobs else None,
                        offset=offsets[c.index],
                        finish=c.finish_reason,
                        with_usage=include_usage,
                        tool_deltas=r.tool_call_deltas,
                    )
                )
                offsets[c.index] += len(r.text)
        if include_usage:
            yield _sse(env.usage_chunk(choices, prompt_len))
        if run.cut_by_shutdown:
            yield _sse(SHUTDOWN_CUT.body())
        yield "data: [DONE]\n\n"
    finally:
        run.cancel()
