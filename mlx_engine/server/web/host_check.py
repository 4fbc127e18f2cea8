"""The ``Host`` header check against DNS rebinding.

A web page on another site can make a browser send requests to a server on
127.0.0.1 by pointing its own domain name at that address; the browser then
sends that domain in ``Host``. A server that only answers the names it is
known by (``localhost``, ``127.0.0.1``, ``[::1]`` when bound to loopback, or
the operator's ``--allowed-host`` names) refuses such requests.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, response_for

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def host_name(header: str) -> str:
    """The name part of a ``Host`` header value, lower-cased, port removed
    (``[::1]:8080`` -> ``[::1]``, ``example.com:80`` -> ``example.com``)."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class AllowedHosts:
    """ASGI middleware: requests whose ``Host`` is not one of ``names`` get a
    400 error object (OpenAI's with ``code: "invalid_host"``; Anthropic's on
    its routes)."""

    def __init__(self, app: ASGIApp, names: list[str]):
        self.app = app
        self.names = {host_name(n) for n in names}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            if host_name(header) not in self.names:
                error = APIError(
                    400,
                    f"Host {header!r} is not one this server answers to; start it with --allowed-host to add a name",
                    param=None,
                    code="invalid_host",
                )
                return await response_for(error, scope["path"])(scope, receive, send)
        await self.app(scope, receive, send)
