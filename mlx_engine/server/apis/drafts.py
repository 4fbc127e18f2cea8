"""Runtime draft management over HTTP: the SDK's ``load_draft_model``,
``check_draft_model`` and ``unload_draft_model`` as endpoints, for the model
served at start (the host's ``primary``; other models take a draft when loaded,
``POST /v1/mlx_engine/models/load``). Drafts are named as ``resolve_draft``
(hosting/drafts.py) allows.
"""

from __future__ import annotations

import mlx_engine as me

from functools import partial
from pathlib import Path

import anyio
from fastapi import APIRouter, Depends

from ..core.schemas import DraftRequest
from ..hosting.drafts import resolve_draft
from ..web.errors import APIError, bad_request


def draft_router(host, models_dir: Path | None, auth) -> APIRouter:
    """``/v1/mlx_engine/draft``: GET state, POST load, DELETE unload;
    ``/v1/mlx_engine/draft/check``: POST compatibility report."""
    router = APIRouter(prefix="/v1/mlx_engine/draft", dependencies=[Depends(auth)])

    def primary():
        if host.primary is None:
            raise APIError(
                404,
                "no model was named at start; give a model its draft with POST /v1/mlx_engine/models/load",
                code="model_not_found",
            )
        return host.kit_for(host.primary)  # loaded again if it was unloaded, and busy meanwhile

    def state(service) -> dict:
        loaded = service.kit.draft is not None
        return {"loaded": loaded, "model": me.draft_name(service.kit)}

    @router.get("")
    async def get_draft():
        async with primary() as service:
            return state(service)

    @router.post("/check")
    async def check_draft(body: DraftRequest):
        target = resolve_draft(body.model, models_dir)
        async with primary() as service:
            report = await anyio.to_thread.run_sync(me.check_draft_model, service.kit, target)
        return {"model": body.model, "compatible": report.compatible, "reasons": list(report.reasons)}

    @router.post("")
    async def load_draft(body: DraftRequest):
        target = resolve_draft(body.model, models_dir)
        async with primary() as service:
            try:
                await anyio.to_thread.run_sync(partial(me.load_draft_model, service.kit, target, name=body.model))
            except me.IncompatibleDraftModelError as exc:
                raise APIError(400, f"model: {exc}", param="model", code="incompatible_draft_model") from exc
            except me.GenerationInProgressError as exc:
                raise _busy(exc) from exc
            except ValueError as exc:  # ModelLoadError included
                raise bad_request(f"model: {exc}", "model") from exc
            return state(service)

    @router.delete("")
    async def unload_draft():
        async with primary() as service:
            try:
                await anyio.to_thread.run_sync(me.unload_draft_model, service.kit)
            except me.GenerationInProgressError as exc:
                raise _busy(exc) from exc
            return state(service)

    return router


def _busy(exc: Exception) -> APIError:
    return APIError(
        409,
        f"generations are running; retry when the server is idle ({exc})",
        code="busy",
        headers={"Retry-After": "1"},
    )
