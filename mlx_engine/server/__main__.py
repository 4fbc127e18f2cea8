"""``python -m mlx_engine.server --model NAME|PATH``: load a kit and serve it.

SIGTERM or SIGINT: stop accepting, let running generations finish for
``--shutdown-grace`` seconds, cancel the rest, unload the kit (writing the
prompt cache's disk tier, if any) and exit 0.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import uvicorn  # noqa: E402

from .app import DEFAULT_MAX_BODY_BYTES, DEFAULT_QUEUE, create_app  # noqa: E402

logger = logging.getLogger("mlx_engine.server")
API_KEY_ENV = "MLX_ENGINE_API_KEY"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser("python -m mlx_engine.server", description="OpenAI-compatible server for mlx-engine")
    p.add_argument("--model", required=True, help="catalog name, model directory or .gguf file")
    p.add_argument("--model-id", help="the name clients pass as `model` (default: the model's file or folder name)")
    p.add_argument("--draft", help="draft model: catalog name or path")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--max-parallel", type=int, default=4, help="generations decoded together (rows of the batch)")
    p.add_argument("--queue", type=int, default=DEFAULT_QUEUE, help="requests that may wait for a row before 429s")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require this bearer token (default: ${API_KEY_ENV}; none: no key)",
    )
    p.add_argument("--models-dir", help="folder draft models may be loaded from by path over HTTP")
    p.add_argument(
        "--cors-origin", action="append", default=[], help="allowed browser origin (repeatable; default none)"
    )
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument(
        "--decoding",
        default="auto",
        choices=["auto", "plain", "prompt_lookup", "draft"],
        help="default decoding mode when a request names none",
    )
    p.add_argument("--context", help="max_kv_size: an integer (rotating window) or 'auto' (fit the context to memory)")
    p.add_argument("--prompt-cache-dir", help="disk tier of the prompt cache")
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "native", "float32", "float16", "bfloat16"])
    p.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds running generations may finish on stop")
    p.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="keep Claude Code's volatile 'x-anthropic-billing-header:' system line (default: dropped, for the prompt cache)",
    )
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


class _Server(uvicorn.Server):
    """uvicorn's server that stops admitting as soon as a signal arrives."""

    def __init__(self, config: uvicorn.Config, service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.drain()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("serving on %s without an API key: anyone who can reach it can use the model", args.host)
    context = args.context if args.context in (None, "auto") else int(args.context)
    kit = me.load_model(
        args.model,
        max_kv_size=context,
        prompt_cache_dir=args.prompt_cache_dir,
        compute_dtype=args.compute_dtype,
        max_parallel=args.max_parallel,
    )
    if args.draft:
        me.load_draft_model(kit, args.draft)
    app = create_app(
        kit,
        model_id=args.model_id or _default_id(args.model),
        api_key=args.api_key,
        queue_size=args.queue,
        models_dir=args.models_dir,
        cors_origins=args.cors_origin,
        max_body_bytes=args.max_body_bytes,
        decoding=args.decoding,
        keep_billing_header=args.keep_billing_header,
    )
    if args.draft:
        app.state.service.draft_name = args.draft
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_grace
    )
    server = _Server(config, app.state.service)
    # uvicorn re-raises the signal it caught once it has stopped; these handlers
    # make that a no-op, so a requested stop exits 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:  # a caller running main() in-process gets its handlers back
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        me.unload(kit)
    except me.GenerationInProgressError:  # a generation outlived the grace period and the wait for it
        logger.warning("a generation was still ending at exit; the kit was not unloaded")
    logger.info("stopped")
    return 0


def _default_id(model: str) -> str:
    return model if model.lower() in me.CATALOG else os.path.basename(os.path.normpath(model))


if __name__ == "__main__":
    sys.exit(main())
