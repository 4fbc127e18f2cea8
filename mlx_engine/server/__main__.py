"""``python -m mlx_engine.server [--model NAME|PATH] [--models-dir DIR]``:
serve the catalog's models and those of ``--models-dir`` by name, loading them
on demand (hosting/host.py); ``--model`` is loaded at start.

Start-up mistakes (an option out of range, a port in use, a model that is not
there) are checked before the model loads where they can be, and each is one
line on stderr with exit status 2.

SIGTERM or SIGINT: stop accepting, let running generations finish for
``--shutdown-grace`` seconds, cut the rest (each stream still gets its final
chunk, an error event saying it was cut, and ``[DONE]``), unload the models
(writing the prompt caches' disk tier, if any) and exit 0.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import asyncio  # noqa: E402
import errno  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402

import uvicorn  # noqa: E402

from .app import DEFAULT_MAX_BODY_BYTES, DEFAULT_QUEUE, create_app  # noqa: E402
from .core.overflow import POLICIES  # noqa: E402
from .hosting.host import ModelHost  # noqa: E402
from .hosting.options import DEFAULT_LOAD_WAIT_S, DEFAULT_TTL_S, HostLimits, LoadOptions  # noqa: E402
from .hosting.templates import give_template, read_template  # noqa: E402
from .web.connections import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, connection_limits  # noqa: E402
from .web.host_check import LOOPBACK_NAMES  # noqa: E402

logger = logging.getLogger("mlx_engine.server")
API_KEY_ENV = "MLX_ENGINE_API_KEY"
PROG = "python -m mlx_engine.server"
# uvicorn cancels what still runs this long after our own grace period has cut
# every generation: time for the final chunks to reach the clients.
_CLOSE_MARGIN_S = 5.0


class StartupError(Exception):
    """A start-up mistake: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (``PROG: error: ...``), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _bounded(kind, lo, hi=None):
    """An argparse type: ``kind`` from ``lo`` to ``hi``."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < lo or (hi is not None and value > hi):
            allowed = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    return convert


def _context(text: str):
    if text == "auto":
        return text
    return _bounded(int, 1)(text)


def build_parser() -> argparse.ArgumentParser:
    """The command line; every option says its default."""
    p = _Parser(PROG, description="OpenAI-compatible server for mlx-engine (docs/server.md)")
    for add in (
        _model_options,
        _serving_options,
        _host_options,
        _security_options,
        _decoding_options,
        _runtime_options,
    ):
        add(p)
    return p


def _model_options(p: argparse.ArgumentParser) -> None:
    """What is loaded at start."""
    p.add_argument(
        "--model",
        help="model loaded at start: catalog name, model directory or .gguf file (default: none; "
        "models load when a request names them)",
    )
    p.add_argument(
        "--model-id", help="the name clients pass as `model` (default: the catalog name, else the file or folder name)"
    )
    p.add_argument("--draft", help="draft model loaded at start: catalog name or path (default: none)")
    p.add_argument(
        "--chat-template",
        help="a Jinja chat template file for --model, replacing its own (default: the model's; ChatML, with a "
        "warning, for a model whose files carry none)",
    )


def _serving_options(p: argparse.ArgumentParser) -> None:
    """Where it listens and how many requests run and wait."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, this machine only)")
    p.add_argument("--port", type=_bounded(int, 1, 65535), default=8080, help="TCP port (default: %(default)s)")
    p.add_argument(
        "--max-parallel",
        type=_bounded(int, 1),
        default=4,
        help="generations decoded together, the rows of the batch (default: %(default)s)",
    )
    p.add_argument(
        "--queue",
        type=_bounded(int, 0),
        default=DEFAULT_QUEUE,
        help="requests that may wait for a row; one more gets 429 (default: %(default)s)",
    )


def _host_options(p: argparse.ArgumentParser) -> None:
    """Several models by name: finding, loading and unloading them (hosting/host.py)."""
    p.add_argument(
        "--models-dir",
        help="folder of models served by name; the only folder draft models may be loaded from by path (default: none)",
    )
    p.add_argument(
        "--ttl",
        type=_bounded(float, 0),
        help=f"idle seconds before a model is unloaded; 0: never (default: {DEFAULT_TTL_S:g} for models loaded "
        "on demand, never for --model)",
    )
    p.add_argument(
        "--memory-budget", type=_bounded(int, 1), help="bytes loaded models may hold (default: half of physical memory)"
    )
    p.add_argument("--max-loaded", type=_bounded(int, 1), help="models loaded at once (default: no limit)")
    p.add_argument(
        "--load-wait",
        type=_bounded(float, 0.1),
        default=DEFAULT_LOAD_WAIT_S,
        help="seconds a request waits for its model to load before a 503 (default: %(default)s)",
    )
    p.add_argument(
        "--no-catalog",
        action="store_true",
        help="serve only --model and --models-dir, not the catalog (default: the catalog too)",
    )
    p.add_argument("--no-metrics", action="store_true", help="no GET /metrics (default: served)")
    p.add_argument("--no-ui", action="store_true", help="no chat page at GET / (default: served)")


def _security_options(p: argparse.ArgumentParser) -> None:
    """Who may call it and with what."""
    p.add_argument("--api-key", help=f"require this bearer token (default: ${API_KEY_ENV}, else no key)")
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="allowed browser origin; repeatable (default: none, CORS off)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="a Host name requests may carry, besides localhost, 127.0.0.1 and [::1] on a loopback address; "
        "repeatable; '*' accepts any (default: loopback names only on loopback, any otherwise)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_bounded(int, 1),
        default=DEFAULT_MAX_BODY_BYTES,
        help="request body limit; larger gets 413 (default: %(default)s)",
    )


def _decoding_options(p: argparse.ArgumentParser) -> None:
    """How requests decode, and the models' load options."""
    p.add_argument(
        "--decoding",
        default="auto",
        choices=me.DECODING_CHOICES,
        help="decoding mode when a request names none (default: %(default)s; draft needs --draft)",
    )
    p.add_argument(
        "--context",
        type=_context,
        help="max_kv_size: an integer (a rotating window of that many tokens) or 'auto' (fit the context to "
        "memory) (default: the model's context)",
    )
    p.add_argument("--prompt-cache-dir", help="the prompt cache's disk tier (default: none, memory only)")
    p.add_argument(
        "--compute-dtype",
        default="auto",
        choices=["auto", "native", "float32", "float16", "bfloat16"],
        help="dtype of the activations, as load_model's compute_dtype (default: %(default)s)",
    )


def _runtime_options(p: argparse.ArgumentParser) -> None:
    """Shutdown, connections, agent-prompt handling and logging."""
    p.add_argument(
        "--shutdown-grace",
        type=_bounded(float, 0),
        default=10.0,
        help="seconds running generations may finish after SIGTERM/SIGINT before they are cut (default: %(default)s)",
    )
    p.add_argument(
        "--max-connections",
        type=_bounded(int, 2),
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections at most; one more closes the one that has waited longest for its client "
        "(default: %(default)s: half the open-file limit, at most 512)",
    )
    p.add_argument(
        "--idle-timeout",
        type=_bounded(float, 0.1),
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds a connection may take to send a request's headers, pause inside its body, or idle "
        "between requests before it is closed (default: %(default)s)",
    )
    p.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="keep Claude Code's volatile 'x-anthropic-billing-header:' system line in Messages API prompts "
        "(default: dropped, so the prompt cache reuses agent turns)",
    )
    p.add_argument(
        "--context-overflow",
        default="error",
        choices=list(POLICIES),
        help="a prompt over the context: 'error' refuses it with each API's own error; 'truncate-middle' keeps "
        "the system prompt and the latest turn and drops the oldest turns between (default: %(default)s)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: %(default)s)",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, with everything checkable before loading a model checked."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.draft and not args.model:
        parser.error("--draft needs --model (other models get a draft over HTTP: POST /v1/mlx_engine/models/load)")
    if args.decoding == "draft" and not args.draft:
        parser.error("--decoding draft needs a draft model: pass --draft NAME|PATH")
    if args.models_dir is not None and not os.path.isdir(os.path.expanduser(args.models_dir)):
        parser.error(f"--models-dir: {args.models_dir!r} is not a folder")
    if args.chat_template is not None:
        if not args.model:
            parser.error("--chat-template needs --model")
        try:
            args.chat_template = read_template(args.chat_template)
        except ValueError as exc:
            parser.error(str(exc))
    for flag, path in (("--model", args.model), ("--draft", args.draft)):
        if path and path.lower() not in me.CATALOG and not os.path.exists(os.path.expanduser(path)):
            parser.error(f"{flag}: {path!r} was not found: not a catalog name ({', '.join(me.CATALOG)}) nor a path")
    return args


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any model loads so that a port in use
    is reported at once (``StartupError``)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise StartupError(f"--host {host!r}: cannot resolve it ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = " (another server is running there?)" if exc.errno == errno.EADDRINUSE else ""
        raise StartupError(f"--port {port} on {host}: {exc.strerror or exc}{hint}") from None
    sock.set_inheritable(True)
    return sock


def allowed_hosts(host: str, extra: list[str]) -> list[str] | None:
    """The Host names to accept: loopback names (plus ``extra``) when bound to a
    loopback address, ``extra`` otherwise; None (any) when none are given
    off loopback or ``*`` is among them."""
    if "*" in extra:
        return None
    if host in ("localhost", "::1") or host.startswith("127."):
        return [*LOOPBACK_NAMES, *extra]
    return list(extra) or None


class GracefulServer(uvicorn.Server):
    """uvicorn's server that stops admitting at once when asked to stop, lets
    running requests go on for the grace period, then cuts them (each ends with
    its final chunk) before uvicorn's own, later, deadline."""

    def __init__(self, config: uvicorn.Config, service, grace_s: float):
        super().__init__(config)
        self.service, self.grace_s = service, grace_s  # a Service or a ModelHost: drain() and cut_after()

    async def shutdown(self, sockets=None) -> None:
        self.service.drain()
        cutter = asyncio.ensure_future(self.service.cut_after(self.grace_s))
        try:
            await super().shutdown(sockets)
        finally:
            cutter.cancel()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = bind(args.host, args.port)
        kit = _load(args) if args.model else None
    except StartupError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(args, kit, sock)
    finally:
        sock.close()


def _load(args: argparse.Namespace) -> me.ModelKit:
    """The kit (and draft) the command line names; ``StartupError`` for a model
    or option the engine refuses."""
    try:
        kit = me.load_model(
            args.model,
            max_kv_size=args.context,
            prompt_cache_dir=args.prompt_cache_dir,
            compute_dtype=args.compute_dtype,
            max_parallel=args.max_parallel,
        )
    except ValueError as exc:  # ModelLoadError included
        raise StartupError(" ".join(str(exc).split())) from None
    give_template(kit, args.model_id or _default_id(args.model), args.chat_template)
    if args.draft:
        try:
            me.load_draft_model(kit, args.draft)
        except ValueError as exc:
            me.unload(kit)
            raise StartupError("--draft: " + " ".join(str(exc).split())) from None
    return kit


def _host(args: argparse.Namespace) -> ModelHost:
    """The model host: the catalog's and --models-dir's models, and the start model."""
    defaults = LoadOptions(args.context, args.max_parallel, args.compute_dtype, prompt_cache_dir=args.prompt_cache_dir)
    ttl = DEFAULT_TTL_S if args.ttl is None else (args.ttl or None)
    limits = HostLimits(ttl, args.memory_budget, args.max_loaded, args.load_wait)
    dirs = [args.models_dir] if args.models_dir else []
    return ModelHost(models_dirs=dirs, catalog=not args.no_catalog, defaults=defaults, limits=limits)


def _serve(args: argparse.Namespace, kit: me.ModelKit | None, sock: socket.socket) -> int:
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("serving on %s without an API key: anyone who can reach it can use the model", args.host)
    host = _host(args)
    app = create_app(
        host,
        api_key=args.api_key,
        queue_size=args.queue,
        models_dir=args.models_dir,
        cors_origins=args.cors_origin,
        max_body_bytes=args.max_body_bytes,
        decoding=args.decoding,
        keep_billing_header=args.keep_billing_header,
        context_overflow=args.context_overflow,
        allowed_hosts=allowed_hosts(args.host, args.allowed_host),
        metrics=not args.no_metrics,
        ui=not args.no_ui,
    )
    if kit is not None:
        # Loaded on purpose: no idle TTL (as LM Studio's explicit loads) unless --ttl names one.
        options = replace(host.defaults, draft=args.draft, ttl=args.ttl or math.inf)
        host.add_kit(args.model_id or _default_id(args.model), kit, managed=True, options=options)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_grace + _CLOSE_MARGIN_S,
        **connection_limits(args.max_connections, args.idle_timeout),
    )
    server = GracefulServer(config, host, args.shutdown_grace)
    address = f"[{args.host}]" if ":" in args.host else args.host
    logger.info("serving %d known models on http://%s:%d", len(host.entries), address, sock.getsockname()[1])
    # uvicorn re-raises the signal it caught once it has stopped; these handlers
    # make that a no-op, so a requested stop exits 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:  # a caller running main() in-process gets its handlers back
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("stopped")  # the app's lifespan has unloaded the models (ModelHost.stop)
    return 0


def _default_id(model: str) -> str:
    return model if model.lower() in me.CATALOG else os.path.basename(os.path.normpath(model))


if __name__ == "__main__":
    sys.exit(main())
