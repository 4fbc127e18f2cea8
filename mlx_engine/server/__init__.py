"""An OpenAI-compatible HTTP server over a kit (docs/server.md).

``create_app(kit, ...)`` builds the ASGI app for a kit a host already holds;
``python -m mlx_engine.server --model NAME|PATH`` loads one and serves it.
Needs FastAPI and uvicorn (the ``server`` extra).
"""

from .app import create_app

__all__ = ["create_app"]
