"""An OpenAI-compatible HTTP server over a kit (docs/server.md).

``create_app(kit, ...)`` builds the ASGI app for a kit a host already holds, or
for a ``ModelHost`` (models by name, loaded on demand within ``HostLimits``);
``python -m mlx_engine.server --model NAME|PATH`` loads one and serves it, its
connections held by ``connection_limits``. Needs FastAPI and uvicorn (the
``server`` extra). Folders by job: ``web`` (HTTP concerns), ``hosting`` (the
models and their generations), ``core`` (what the wire formats share), ``apis``
(the wire formats).
"""

from .app import create_app
from .hosting.host import ModelHost
from .hosting.options import HostLimits, LoadOptions
from .web.connections import connection_limits

__all__ = ["create_app", "HostLimits", "LoadOptions", "ModelHost", "connection_limits"]
