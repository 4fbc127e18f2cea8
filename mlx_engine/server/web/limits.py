"""A request-body size limit, enforced before the body is parsed.

A declared ``Content-Length`` over the limit is refused at once; a body sent
without one (chunked) is counted as it arrives and refused when it passes the
limit. Either way the answer is a 413 error object in the shape of the route's
API (OpenAI's, or Anthropic's ``request_too_large`` on ``/v1/messages``).
"""

from __future__ import annotations

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, response_for


class _TooLarge(HTTPException):
    """Raised while FastAPI reads the body; an ``HTTPException`` so FastAPI
    passes it through instead of calling it a parse error (400)."""


class BodySizeLimit:
    """ASGI middleware: at most ``max_bytes`` of request body."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than the server's limit of {self.max_bytes} bytes",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await response_for(self._error(), scope["path"])(scope, receive, send)
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(413, self._error().message)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked_send)
        except _TooLarge:
            if not started:
                await response_for(self._error(), scope["path"])(scope, receive, send)
