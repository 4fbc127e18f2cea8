"""The one core the three wire formats share.

Chat completions, the Responses API (apis/openai_responses/) and the Messages API
(apis/anthropic_messages/) all become the same internal request, a
``ChatCompletionRequest``: messages as the chat template takes them, tools,
constraints, sampling and decoding. From there the prompt, ``create_generator``'s
arguments (core/params.py), admission (hosting/admission.py) and the generations (hosting/runs.py) are
the same code for all three; each wire format only translates its body in and
its events out, with its own error and stop-reason vocabulary at the edge.
"""

from __future__ import annotations

import mlx_engine as me

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import Request
from pydantic import ValidationError

from ..hosting.admission import QueueFullError, ShuttingDownError
from ..hosting.runs import RequestRun
from ..web.errors import APIError, from_engine, from_failure, from_validation
from . import overflow, params
from .chat_objects import Choice
from .schemas import ChatCompletionRequest, Message

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2
# A stream with nothing to send for this long (a long prompt prefilling) gets a
# keep-alive event, so clients and proxies with idle timeouts keep waiting.
HEARTBEAT_S = 5.0
# Prompts at least this long log their prefill progress (every quarter).
PROGRESS_LOG_TOKENS = 2048


class ClientGone(Exception):
    """The client disconnected while its request waited."""


@dataclass
class Turn:
    """One request in the internal form: the chat request a wire format was
    translated into (cut to fit under a context-overflow policy), its rendered
    prompt, ``create_generator``'s arguments and the prompt tokens the cut dropped."""

    body: ChatCompletionRequest
    prompt: params.Prompt
    kwargs: list[dict]
    truncated: int = 0


def internal_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The internal request from a wire format's translation; a value the chat
    request refuses is a 400 naming the internal field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise from_validation(list(exc.errors())) from None


async def prepare(
    service, body: ChatCompletionRequest, too_long: Callable[[int, int], APIError], label: str = ""
) -> Turn:
    """Render the prompt off the loop, fit one over the context to it under the
    service's overflow policy or refuse it with ``too_long(prompt_tokens,
    context)`` (each API's own error), and build the generation arguments."""
    fitted = await anyio.to_thread.run_sync(fit_context, service, body, None, too_long)
    body, prompt = fitted.body, fitted.prompt
    context = service.kit.context_length
    if context is not None and len(prompt.tokens) >= context:
        raise too_long(len(prompt.tokens), context)
    kwargs = params.generator_kwargs(service.kit, body, prompt, service.decoding)
    if len(prompt.tokens) >= PROGRESS_LOG_TOKENS:
        kwargs = [{**kw, "prompt_progress_callback": _progress_logger(label, len(prompt.tokens))} for kw in kwargs]
    return Turn(body, prompt, kwargs, fitted.dropped)


def fit_context(
    service,
    body: ChatCompletionRequest,
    renderer: overflow.Render | None = None,
    too_long: Callable[[int, int], APIError] | None = None,
) -> overflow.Fitted:
    """``body`` rendered and, when its prompt is over the context and the
    operator chose ``truncate-middle``, cut to fit (core/overflow.py); unchanged
    otherwise (a prompt still over is the caller's to refuse). ``renderer``:
    the prompt of a body (default ``render_now``).

    Text that cannot fit whatever its tokens (more characters than the context
    holds tokens times the longest token's length) is never tokenized whole:
    under ``error`` it is ``too_long(at least so many tokens, context)`` at once
    (default: the chat API's 400), under ``truncate-middle`` the oldest turns and
    the longest texts are cut down to that bound first."""
    kit = service.kit
    renderer = renderer or (lambda b: render_now(kit, b))
    context = kit.context_length
    pre_cut = 0
    if context is not None:
        floor = params.prompt_floor(kit, params.counted_chars(body))
        if floor >= context and service.context_overflow == "error":
            raise (too_long or params.over_context)(floor, context)
        if floor >= context:
            body, pre_cut = overflow.pretrim(body, context * (params.longest_token_chars(kit) or 1))
    prompt = renderer(body)
    fitted = overflow.Fitted(body, prompt, 0)
    if service.context_overflow != "error" and context is not None and len(prompt.tokens) >= context:
        fitted = overflow.fit(kit, body, prompt, renderer) or fitted
    if pre_cut:  # the characters cut before the first render, as tokens at this prompt's rate
        rate = max(1.0, params.counted_chars(body) / max(1, len(prompt.tokens)))
        fitted = overflow.Fitted(fitted.body, fitted.prompt, fitted.dropped + int(pre_cut / rate))
    return fitted


async def render(kit: me.ModelKit, body: ChatCompletionRequest) -> params.Prompt:
    """``render_now`` off the event loop."""
    return await anyio.to_thread.run_sync(render_now, kit, body)


def render_now(kit: me.ModelKit, body: ChatCompletionRequest) -> params.Prompt:
    """The prompt of ``body``. System messages stay where the client put them
    (agents add one per turn after the history; moving it to the top would
    change the prefix every turn and defeat the prompt cache); a template that
    refuses them there gets them merged into the first system message."""
    try:
        return params.chat_prompt(kit, body)
    except APIError:
        hoisted = _hoist_system(body)
        if hoisted is None:
            raise
        logger.info("the chat template refused system messages after the first turn; merged them at the top")
        return params.chat_prompt(kit, hoisted)


def _hoist_system(body: ChatCompletionRequest) -> ChatCompletionRequest | None:
    """``body`` with every system message after the first position merged into
    a leading one; None when there is none to move."""
    msgs = body.messages
    late = [i for i, m in enumerate(msgs) if i > 0 and m.role in ("system", "developer")]
    if not late:
        return None
    system = [m for i, m in enumerate(msgs) if m.role in ("system", "developer") and (i == 0 or i in late)]
    text = "\n\n".join(_text_of(m.content) for m in system)
    rest = [m for i, m in enumerate(msgs) if not (m.role in ("system", "developer") and (i == 0 or i in late))]
    merged = Message(role="system", content=text)
    return body.model_copy(update={"messages": [merged, *rest]})


def _text_of(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(getattr(p, "text", "") for p in content)


def _progress_logger(label: str, prompt_len: int) -> Callable[[float], None]:
    """A ``prompt_progress_callback`` that logs each quarter of a long prefill."""
    logged = [0]

    def report(percent: float) -> None:
        quarter = int(percent // 25)
        if quarter > logged[0]:
            logged[0] = quarter
            logger.info("%s: prefill %d%% of %d prompt tokens", label or "request", min(100, quarter * 25), prompt_len)

    return report


async def admit(
    service, request: Request, prompt: params.Prompt, kwargs: list[dict], *, prompt_field: str
) -> RequestRun:
    """Wait for rows (429 when the line is full, 503 when stopping), then start."""
    await take_rows(service, request, len(kwargs))
    observer = service.metrics.observer(service.model_id) if service.metrics is not None else None
    run = RequestRun(service.kit, service.queue, service.outcomes, observer)
    try:
        await run.start(prompt.tokens, kwargs)
    except ValueError as exc:
        raise from_engine(exc, prompt_field) from exc
    return run


async def count_prompt(
    service, request: Request, body: ChatCompletionRequest, too_long: Callable[[int, int], APIError]
) -> params.Prompt:
    """The prompt of ``body`` for counting its tokens, admitted as a request is:
    text that cannot fit the context is ``too_long`` before its token list is
    built, and the render takes a row (waiting in line, 429 when the line is
    full, 503 when stopping) so counts cannot crowd out the generations."""
    kit = service.kit
    context = kit.context_length
    floor = params.prompt_floor(kit, params.counted_chars(body))
    if context is not None and floor >= context:
        raise too_long(floor, context)
    await take_rows(service, request, 1)
    try:
        return await render(kit, body)
    finally:
        service.queue.release(1)


async def take_rows(service, request: Request, rows: int) -> None:
    """``rows`` of the service's queue, waited for in line; the queue's refusals as API errors."""
    try:
        await unless_disconnected(request, service.queue.acquire(rows))
    except QueueFullError:
        raise APIError(
            429,
            f"the server is busy: {service.queue.waiting} requests are waiting; retry later",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from None
    except ShuttingDownError:
        raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down") from None


async def unless_disconnected(request: Request, awaitable) -> None:
    """Await ``awaitable`` unless the client leaves first (then it is cancelled)."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()


async def collect(run: RequestRun, request: Request, n: int, with_logprobs: bool) -> list[Choice]:
    """All results of a non-streamed request; a client that leaves cancels it."""
    choices = [Choice(i) for i in range(n)]

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        run.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        async for item in run.items():
            if item.error is not None:
                raise from_failure(item.error)
            choices[item.index].add(item.result, with_logprobs)
    finally:
        watcher.cancel()
        run.cancel()
    return choices


async def with_heartbeat(items: AsyncIterator, interval: float | None = None) -> AsyncIterator:
    """``items``, with a ``None`` whenever ``interval`` seconds (default
    ``HEARTBEAT_S``) pass without one: the stream's cue to send a keep-alive."""
    interval = HEARTBEAT_S if interval is None else interval
    it = items.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()


@dataclass
class Counts:
    """A finished generation's token counts, as every API reports them."""

    prompt: int
    cached: int
    output: int


def counts(choice: Choice, prompt_len: int) -> Counts:
    stats = choice.stats
    if stats is None:
        return Counts(prompt_len, 0, 0)
    return Counts(stats.prompt_tokens or prompt_len, stats.cached_tokens, stats.generated_tokens)


def with_truncated(ext: dict, truncated: int) -> dict:
    """The ``mlx_engine`` usage extension, with ``truncated_tokens`` when the
    overflow policy cut the prompt (absent otherwise, as before the policy)."""
    return {**ext, "truncated_tokens": truncated} if truncated else ext


def sse(obj: Any, event: str | None = None) -> str:
    """One server-sent event (with an ``event:`` line when named)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"
