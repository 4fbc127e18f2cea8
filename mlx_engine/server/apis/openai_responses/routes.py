"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: a request
translated, run by the core, answered whole or streamed, and kept when asked."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ...core.chat_objects import Choice
from ...core.turns import admit, collect, internal_request, prepare, with_heartbeat
from ...hosting.runs import RequestRun
from ...web.errors import APIError, from_failure
from .answer import EventWriter, Head, output_messages, whole_output
from .body import ResponsesRequest, check_echoed
from .store import DEFAULT_STORE_SIZE, ResponseStore
from .translate import (
    chat_tool_choice,
    chat_tools,
    input_messages,
    named_as_request,
    namespaces,
    response_format,
    too_long,
)


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
        turn = await prepare(service, chat, too_long, head.id)
        run = await admit(service, request, turn.prompt, turn.kwargs, prompt_field="input")
    except APIError as err:
        raise named_as_request(err, sources) from None
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
