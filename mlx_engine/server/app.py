"""The ASGI app: the wire formats (apis/: OpenAI's chat and completions,
Responses, embeddings, Anthropic's Messages, the model and draft endpoints) over
one kit or several, on the same core (core/turns.py), wired with the HTTP
concerns (web/) and the hosted models (hosting/).

``create_app(kit, ...)`` builds it from a kit the host already holds, from
several (``{id: kit}``), or from a ``ModelHost`` that loads and unloads models
by name itself (hosting/host.py; the command line, ``python -m mlx_engine.server``,
builds one). Each handler reads: get the model's service from the host
(``host.kit_for``, loading it when needed), build the prompt and arguments off
the loop (core/params.py), wait for rows (hosting/admission.py), start the
generations on threads (hosting/runs.py), then answer whole or as server-sent
events (core/chat_objects.py).
"""

from __future__ import annotations

import mlx_engine as me

import hmac
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Mapping

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .apis.anthropic_messages import messages_router
from .apis.drafts import draft_router
from .apis.models import models_router
from .apis.openai_chat import chat_router
from .apis.openai_embeddings import embeddings_router
from .apis.openai_responses import responses_router
from .core.overflow import check_policy
from .core.turns import ClientGone
from .hosting.host import ModelHost
from .hosting.service import Service, ServiceFactory
from .web.errors import APIError, bad_request, from_validation, response_for
from .web.host_check import AllowedHosts
from .web.limits import BodySizeLimit
from .web.metrics import CONTENT_TYPE_LATEST, Metrics, RequestCounter
from .web.ui import ui_router

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # room for a few data-URI images
DEFAULT_QUEUE = 64
_KITS = (me.ModelKit, me.EmbeddingKit)  # what create_app serves: generating and embedding models


def create_app(
    kit: me.ModelKit | Mapping[str, me.ModelKit] | ModelHost,
    *,
    model_id: str | None = None,
    api_key: str | None = None,
    max_parallel: int | None = None,
    queue_size: int = DEFAULT_QUEUE,
    models_dir: str | Path | None = None,
    cors_origins: list[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    decoding: str = "auto",
    metrics: bool = True,
    keep_billing_header: bool = False,
    allowed_hosts: list[str] | None = None,
    context_overflow: str = "error",
    ui: bool = True,
) -> FastAPI:
    """The OpenAI-compatible app (docs/server.md) serving ``kit``: one kit, a
    mapping of model ids to kits the embedding host manages (never unloaded
    here), or a ``ModelHost`` that loads and unloads models by name itself.

    ``model_id``: the name clients pass as ``model`` for a single kit (default:
    the model folder's or file's name). ``api_key``: required as a bearer token
    when set. ``max_parallel``: rows the server uses per kit (default and at
    most the kit's); ``queue_size``: requests that may wait for rows before
    429s, per model. ``models_dir``: where draft models may be loaded from by
    path. ``cors_origins``: allowed browser origins (none: CORS off).
    ``decoding``: the default mode (auto, plain, prompt_lookup, draft).
    ``metrics``: serve ``GET /metrics`` (Prometheus).
    ``keep_billing_header``: keep Claude Code's volatile first system line in
    Messages API prompts (default: dropped, so the prompt cache reuses turns).
    ``allowed_hosts``: the ``Host`` names requests must carry (None: any; see
    web/host_check.py on DNS rebinding). ``context_overflow``: ``error`` refuses a
    prompt over the context; ``truncate-middle`` cuts its middle (core/overflow.py).
    ``ui``: serve the chat page at ``/`` (web/ui.py)."""
    _check_arguments(kit, max_parallel, queue_size, decoding)
    check_policy(context_overflow)
    host = kit if isinstance(kit, ModelHost) else ModelHost(catalog=False)
    app_metrics = Metrics(host) if metrics else None

    folder = Path(models_dir) if models_dir else None
    make_service = ServiceFactory(
        max_parallel, queue_size, api_key or None, folder, decoding, context_overflow, host.outcomes, app_metrics
    )
    service = _attach(host, kit, model_id, make_service, app_metrics)

    app = FastAPI(title="mlx-engine", lifespan=_lifespan(host), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.host = host
    app.state.service = service  # a single kit's (None for several): what embedders of one kit used
    _install_errors(app)
    _install_middleware(app, max_body_bytes, allowed_hosts, app_metrics, cors_origins)
    auth = _auth_dependency(api_key or None)
    _add_routes(app, host, auth)
    _include_routers(app, host, auth, folder, api_key or None, keep_billing_header, app_metrics)
    if ui:
        app.include_router(ui_router())
    return app


def _lifespan(host: ModelHost):
    """The app's lifespan: the host's timers start with the app and its models unload when it stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        host.start()
        yield
        await host.stop()

    return lifespan


def _include_routers(
    app: FastAPI,
    host: ModelHost,
    auth,
    folder: Path | None,
    api_key: str | None,
    keep_billing_header: bool,
    app_metrics,
) -> None:
    """Drafts, models, the Responses and Messages APIs (the same core in two more
    wire formats, core/turns.py) and the Prometheus scrape."""
    app.include_router(chat_router(host, auth))
    app.include_router(draft_router(host, folder, auth))
    app.include_router(models_router(host, folder, auth))
    app.include_router(responses_router(host, auth))
    app.include_router(messages_router(host, api_key, keep_billing_header=keep_billing_header))
    app.include_router(embeddings_router(host, auth))
    if app_metrics is not None:

        @app.get("/metrics", dependencies=[Depends(auth)])
        async def scrape():
            return Response(app_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _attach(host: ModelHost, kit, model_id: str | None, make_service, app_metrics) -> Service | None:
    """The host serves the app's kit(s) (a single kit's service is returned)."""
    host.attach(make_service, app_metrics.event if app_metrics else None)
    if isinstance(kit, _KITS):
        return host.add_kit(model_id or Path(kit.model_path).name, kit)
    if not isinstance(kit, ModelHost):
        for mid, k in kit.items():
            host.add_kit(str(mid), k)
    return None


def _install_middleware(app: FastAPI, max_body_bytes: int, allowed_hosts, app_metrics, cors_origins) -> None:
    """The body limit, the Host check, the request counter and CORS, in that
    order (the last added is the outermost)."""
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if allowed_hosts is not None:
        app.add_middleware(AllowedHosts, names=list(allowed_hosts))
    if app_metrics is not None:
        app.add_middleware(RequestCounter, metrics=app_metrics)
    if cors_origins:  # added last, so outermost: its headers reach every answer, a 413 included
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
        )


def _check_arguments(kit, max_parallel, queue_size, decoding) -> None:
    """``ValueError`` naming the first bad argument of ``create_app``."""
    if isinstance(kit, _KITS):
        rows = kit.max_parallel if max_parallel is None else max_parallel
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= kit.max_parallel:
            raise ValueError(
                f"max_parallel must be an integer from 1 to the kit's max_parallel ({kit.max_parallel}), got {max_parallel!r}"
            )
    elif not isinstance(kit, ModelHost) and (
        not isinstance(kit, Mapping) or not kit or not all(isinstance(k, _KITS) for k in kit.values())
    ):
        raise ValueError(
            "kit must be a ModelKit or EmbeddingKit, a non-empty mapping of model ids to kits, or a ModelHost"
        )
    elif max_parallel is not None and (
        isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1
    ):
        raise ValueError(f"max_parallel must be a positive integer or None, got {max_parallel!r}")
    if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 0:
        raise ValueError(f"queue_size must be a non-negative integer, got {queue_size!r}")
    if decoding not in me.DECODING_CHOICES:
        raise ValueError(f"decoding must be one of {', '.join(me.DECODING_CHOICES)}, got {decoding!r}")


def _auth_dependency(api_key: str | None):
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(
                401,
                "a valid API key is required: send 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="invalid_api_key",
            )

    return check


def _install_errors(app: FastAPI) -> None:
    """Server-level errors in the shape of the API the path belongs to (web/errors.py)."""

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return response_for(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, exc: RequestValidationError):
        return response_for(from_validation(list(exc.errors())), request.url.path)

    @app.exception_handler(RecursionError)
    async def too_deep(request, exc: RecursionError):
        # Past the nesting limits core/params.py checks: still the client's input, never a 500.
        return response_for(bad_request("the request nests too deeply to be processed"), request.url.path)

    @app.exception_handler(ClientGone)
    async def client_gone(request, exc: ClientGone):
        return JSONResponse(
            {"error": {"message": "client closed the request", "type": "client_closed"}}, status_code=499
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
        return response_for(err, request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        # Starlette logs the traceback; the client gets its API's error object, not plain text.
        return response_for(APIError(500, f"internal server error: {exc}", type="server_error"), request.url.path)


def _add_routes(app: FastAPI, host: ModelHost, auth) -> None:
    @app.get("/health")
    async def health():
        queues = [e.service.queue for e in host.loaded()]
        return {
            "status": "stopping" if host.closed or any(q.closed for q in queues) else "ok",
            "model": host.primary,
            "running": sum(q.running for q in queues),
            "waiting": sum(q.waiting for q in queues),
            **{k: host.outcomes[k] for k in ("completed", "cancelled", "failed", "rejected")},
        }
