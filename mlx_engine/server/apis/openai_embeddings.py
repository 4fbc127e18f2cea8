"""``POST /v1/embeddings`` in OpenAI's shape (docs/server.md, "Embeddings").

``input`` is a string, a list of strings, a list of token ids or a list of
such lists; ``encoding_format`` is ``float`` or ``base64`` (little-endian
float32, as OpenAI's clients decode it); ``dimensions`` shortens the vectors
of a model trained for it (Matryoshka) and is a 400 on another. The model is
the host's, loaded on demand like a chat model (hosting/host.py, ``kit_for(...,
embedding=True)``); a request waits for the model's one row in its admission
queue (hosting/admission.py) and embeds on the kit's engine thread.
"""

from __future__ import annotations

import mlx_engine as me

import base64
import time
from typing import Any, Literal

import anyio
import numpy as np
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from ..core.turns import take_rows
from ..web.errors import APIError, bad_request, engine_error

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
# ``embed``'s argument names, as the request says them.
_EMBED_FIELDS = {"texts": "input", "truncate=True": '"mlx_engine": {"truncate": true}'}


class _Body(BaseModel):
    model_config = ConfigDict(
        strict=True, extra="ignore"
    )  # as core/schemas.py's bodies: strict types, unknown fields ignored


class EmbeddingOptions(_Body):
    """The engine's extension: ``truncate`` embeds the first tokens of an input
    over the model's length instead of refusing it."""

    truncate: bool = False


class EmbeddingRequest(_Body):
    model: str = Field(min_length=1)
    input: Any  # its shapes are checked by inputs_of, with messages naming the item
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    ttl: float | None = Field(None, gt=0)  # LM Studio's: idle seconds before this model is unloaded
    mlx_engine: EmbeddingOptions | None = None


def inputs_of(value: Any) -> tuple[list, bool]:
    """``input`` as ``embed``'s list (strings and token-id lists) and whether it
    was a single item; a 400 naming ``input`` (or ``input.i``) otherwise."""
    shape = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        return [value], True
    if not isinstance(value, list):
        raise bad_request(f"input must be {shape}, got {type(value).__name__}", "input")
    if not value:
        raise bad_request("input must not be an empty list", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input holds {len(value)} items; at most {MAX_INPUTS} per request", "input")
    if all(_is_id(v) for v in value):
        return [value], True
    for i, item in enumerate(value):
        if not (isinstance(item, str) or (isinstance(item, list) and item and all(_is_id(t) for t in item))):
            raise bad_request(
                f"input.{i} must be a string or a non-empty list of token ids (non-negative integers) "
                f"in {shape}, got {_json_type(item)}",
                f"input.{i}",
            )
    if len({type(v) for v in value}) > 1:
        raise bad_request("input must not mix strings and token-id lists", "input")
    return value, False


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _json_type(v: Any) -> str:
    if isinstance(v, list) and not v:
        return "an empty list"
    return {str: "a string", int: "a number", float: "a number", bool: "a boolean", dict: "an object"}.get(
        type(v), "a list holding other than token ids" if isinstance(v, list) else "null"
    )


def from_embed_error(exc: ValueError, single: bool) -> APIError:
    """``embed``'s ``InvalidArgument`` as a 400 naming the request field
    (``texts[3]`` -> ``input.3``, or ``input`` for a single input)."""
    if not isinstance(exc, me.InvalidArgument):
        return bad_request(str(exc), "input")
    return engine_error(exc, _EMBED_FIELDS, items=not single)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def embeddings_router(host, auth) -> APIRouter:
    router = APIRouter(dependencies=[Depends(auth)])

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        items, single = inputs_of(body.input)
        truncate = bool(body.mlx_engine and body.mlx_engine.truncate)
        async with host.kit_for(body.model, ttl=body.ttl, embedding=True) as service:
            result, seconds = await _embed(service, request, items, single, truncate, body.dimensions)
        if service.metrics is not None:
            service.metrics.embedded(service.model_id, len(items), result.total_tokens, seconds)
        data = [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, body.encoding_format)}
            for i, v in enumerate(result.vectors)
        ]
        usage = {"prompt_tokens": result.total_tokens, "total_tokens": result.total_tokens}
        return {"object": "list", "data": data, "model": service.model_id, "usage": usage}

    return router


async def _embed(service, request: Request, items: list, single: bool, truncate: bool, dimensions):
    """Wait for the model's row (429 when the line is full, 503 when stopping), then embed."""
    await take_rows(service, request, 1)
    started = time.perf_counter()
    try:
        result = await anyio.to_thread.run_sync(
            lambda: me.embed(service.kit, items, truncate=truncate, dimensions=dimensions)
        )
    except ValueError as exc:
        raise from_embed_error(exc, single) from None
    finally:
        service.queue.release(1)
    return result, time.perf_counter() - started
