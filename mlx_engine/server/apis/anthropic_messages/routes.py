"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's key header checked,
the body parsed and translated, run by the core, answered whole or streamed."""

from __future__ import annotations

import hmac
import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from ...core.turns import (
    admit,
    collect,
    count_prompt,
    internal_request,
    prepare,
)
from ...web.errors import AnthropicError, APIError, bad_request, from_validation
from .answer import message_events, whole_message
from .translate import Body, CountTokensRequest, MessagesRequest, internal, named_as_request, too_long


# -- the endpoints -----------------------------------------------------------------------------------
async def _parse(request: Request, model: type[Body]):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the request nests too deeply to be processed") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(list(exc.errors())) from None


def _check_key(expected: str | None, request: Request) -> None:
    """``x-api-key: KEY`` or ``Authorization: Bearer KEY`` (Claude Code's
    ``ANTHROPIC_API_KEY`` and ``ANTHROPIC_AUTH_TOKEN``)."""
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = request.headers.get("x-api-key") or (token.strip() if scheme.lower() == "bearer" else "")
    if not hmac.compare_digest(key.encode(), expected.encode()):
        raise AnthropicError(401, "invalid x-api-key: send 'x-api-key: KEY' or 'Authorization: Bearer KEY'")


def messages_router(host, api_key: str | None, *, keep_billing_header: bool = False) -> APIRouter:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``; the model's
    service comes from the host (hosting/host.py: loaded when needed)."""
    router = APIRouter()

    async def translated(request: Request, model: type[Body]):
        _check_key(api_key, request)
        body = await _parse(request, model)
        try:
            host.lookup(body.model)
        except APIError as err:
            raise AnthropicError(
                404, f"model: {body.model!r} is not served here; GET /v1/models lists the models served"
            ) from err
        fields, sources = internal(body, keep_billing_header)
        return body, internal_request(fields), sources

    @router.post("/v1/messages")
    async def create(request: Request):
        sources: list[int] = []
        mid = f"msg_{uuid.uuid4().hex}"
        try:
            body, chat, sources = await translated(request, MessagesRequest)
            async with host.kit_for(body.model) as service:
                turn = await prepare(service, chat, too_long, mid)
                run = await admit(service, request, turn.prompt, turn.kwargs, prompt_field="messages")
                prompt_len = len(turn.prompt.tokens)
                if body.stream:
                    events = message_events(run, mid, service.model_id, prompt_len, turn.truncated)
                    return StreamingResponse(
                        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                    )
                choice = (await collect(run, request, 1, False))[0]
        except APIError as err:
            return named_as_request(err, sources).response()
        except AnthropicError as err:
            return err.response()
        return JSONResponse(whole_message(mid, service.model_id, choice, prompt_len, turn.truncated))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        sources: list[int] = []
        try:
            body, chat, sources = await translated(request, CountTokensRequest)
            async with host.kit_for(body.model) as service:
                prompt = await count_prompt(service, request, chat, too_long)
        except APIError as err:
            return named_as_request(err, sources).response()
        except AnthropicError as err:
            return err.response()
        return {"input_tokens": len(prompt.tokens)}

    return router
