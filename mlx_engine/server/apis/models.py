"""The models a server knows, over HTTP: OpenAI's ``GET /v1/models`` (every
known model, with its state) and ``GET /v1/models/{id}``, and the host's
management endpoints under ``/v1/mlx_engine/models`` (load with options,
unload, memory per model). All behind the API key when one is set."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from ..hosting.drafts import resolve_draft
from ..hosting.host import ModelHost
from ..hosting.options import PAIRED, replace_options
from ..web.errors import APIError, from_engine


class LoadRequest(BaseModel):
    """``POST /v1/mlx_engine/models/load``: a known model and how to load it
    (absent fields: the server's defaults; ``draft``: absent is the catalog's
    pairing, null none)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = Field(min_length=1)
    context: int | Literal["auto"] | None = None
    max_parallel: int | None = Field(None, ge=1, le=64)
    compute_dtype: Literal["auto", "native", "float32", "float16", "bfloat16"] | None = None
    draft: str | None = Field(None, min_length=1)
    ttl: float | None = Field(None, gt=0)


class UnloadRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = Field(min_length=1)


def models_router(host: ModelHost, models_dir: Path | None, auth) -> APIRouter:
    """``/v1/models`` and ``/v1/mlx_engine/models`` over ``host``; a draft
    named by path must lie inside ``models_dir`` (as drafts.py's endpoints)."""
    router = APIRouter(dependencies=[Depends(auth)])

    @router.get("/v1/models")
    async def list_models():
        host.rescan()  # folders are read again: a model copied in since start is listed
        return {"object": "list", "data": [host.describe(e) for e in list(host.entries.values())]}

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        return host.describe(host.lookup(model_id))

    @router.get("/v1/mlx_engine/models")
    async def loaded_models():
        loaded = [host.describe(e) for e in host.loaded()]
        return {
            "object": "list",
            "data": loaded,
            "memory_bytes": sum(m["mlx_engine"]["memory_bytes"] for m in loaded),
            "memory_budget_bytes": host.limits.budget,
            "max_loaded": host.limits.max_loaded,
        }

    @router.post("/v1/mlx_engine/models/load")
    async def load(body: LoadRequest):
        entry = host.lookup(body.model)
        changes = body.model_dump(exclude={"model", "draft", "ttl"}, exclude_none=True)
        draft = body.draft if "draft" in body.model_fields_set else PAIRED
        if draft not in (None, PAIRED) and draft not in host.entries:
            draft = _draft_source(draft, models_dir)
        ttl = body.ttl or math.inf  # loaded on purpose: no idle TTL unless asked, as LM Studio's explicit loads
        try:
            options = replace_options(host.defaults, **changes, draft=draft, ttl=ttl)
        except ValueError as exc:
            raise from_engine(exc) from exc
        try:
            await host.load(entry.model.id, options)
        except APIError as exc:  # said with the client's name for the draft, not the server's path
            if exc.param == "draft" and isinstance(draft, str) and isinstance(body.draft, str):
                exc.message = exc.message.replace(draft, body.draft)
            raise
        return host.describe(entry)

    @router.post("/v1/mlx_engine/models/unload")
    async def unload(body: UnloadRequest):
        entry = await host.unload(body.model)
        return host.describe(entry)

    return router


def _draft_source(draft: str, models_dir: Path | None) -> str:
    """A catalog name, or a path inside ``models_dir`` (403 otherwise), for the ``draft`` field."""
    try:
        return resolve_draft(draft, models_dir)
    except APIError as exc:
        message = exc.message.removeprefix("model: ")
        raise APIError(exc.status, f"draft: {message}", param="draft", type=exc.type) from None
