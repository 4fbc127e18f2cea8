"""The chat page at ``/`` (docs/server.md#the-chat-page): static files shipped
inside the package (``ui/``), served as they are. Nothing is built at install
and nothing is fetched at run time; the page talks to the same ``/v1`` routes
as any client (with the API key the person types in when the server has one).

Every file is sent with a strict Content-Security-Policy: scripts, styles and
connections only from this server, images only from the person's own
attachments (``data:``/``blob:``), no plugins, frames or form posts. The page
renders model output with DOM nodes and ``textContent`` (``ui/markdown.js``);
the policy is the second wall should that ever fail.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from .errors import APIError

# The page's files, by URL name: only these are served (no path is ever read from a request).
_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "store.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data: blob:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated each time: a new version of the package shows at once
}


def read_asset(name: str) -> bytes:
    """One of the page's files, from the installed package."""
    return resources.files("mlx_engine.server.web").joinpath("ui", name).read_bytes()


def ui_router() -> APIRouter:
    """``GET /`` (the page) and ``GET /ui/{name}`` (its scripts and style). Open
    without the API key: the page holds no secret, and it asks for the key."""
    router = APIRouter()
    cache: dict[str, bytes] = {}

    def asset(name: str) -> Response:
        if name not in _FILES:
            raise APIError(404, f"no such file: /ui/{name}", type="not_found_error")
        if name not in cache:
            cache[name] = read_asset(name)
        return Response(cache[name], media_type=_FILES[name], headers=SECURITY_HEADERS)

    @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page():
        return asset("index.html")

    @router.api_route("/ui/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def ui_file(name: str):
        return asset(name)

    return router
