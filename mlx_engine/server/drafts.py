"""Runtime draft management over HTTP: the SDK's ``load_draft_model``,
``check_draft_model`` and ``unload_draft_model`` as endpoints.

A draft is named by catalog name, or by a path that must lie inside the
operator's ``--models-dir`` (symlinks resolved first), so no request can make
the server read anything else.
"""

from __future__ import annotations

import mlx_engine as me

from pathlib import Path

import anyio
from fastapi import APIRouter, Depends

from .errors import APIError, bad_request
from .schemas import DraftRequest


def resolve_draft(value: str, models_dir: Path | None) -> str:
    """A catalog name as is, or the real path of ``value`` inside ``models_dir``."""
    if value.lower() in me.CATALOG:
        return value
    if models_dir is None:
        raise APIError(
            403,
            "model: only catalog names are accepted; the server was started without --models-dir",
            param="model",
            type="permission_error",
        )
    root = models_dir.resolve()
    path = Path(value)
    path = (path if path.is_absolute() else root / path).resolve()
    if path != root and root not in path.parents:
        raise APIError(
            403, "model: the path is outside the server's --models-dir", param="model", type="permission_error"
        )
    return str(path)


def draft_router(service, auth) -> APIRouter:
    """``/v1/mlx_engine/draft``: GET state, POST load, DELETE unload;
    ``/v1/mlx_engine/draft/check``: POST compatibility report."""
    router = APIRouter(prefix="/v1/mlx_engine/draft", dependencies=[Depends(auth)])
    kit = service.kit

    def state() -> dict:
        return {"loaded": kit.draft is not None, "model": service.draft_name if kit.draft is not None else None}

    @router.get("")
    async def get_draft():
        return state()

    @router.post("/check")
    async def check_draft(body: DraftRequest):
        target = resolve_draft(body.model, service.models_dir)
        report = await anyio.to_thread.run_sync(me.check_draft_model, kit, target)
        return {"model": body.model, "compatible": report.compatible, "reasons": list(report.reasons)}

    @router.post("")
    async def load_draft(body: DraftRequest):
        target = resolve_draft(body.model, service.models_dir)
        try:
            await anyio.to_thread.run_sync(me.load_draft_model, kit, target)
        except me.IncompatibleDraftModelError as exc:
            raise APIError(400, f"model: {exc}", param="model", code="incompatible_draft_model") from exc
        except me.GenerationInProgressError as exc:
            raise _busy(exc) from exc
        except ValueError as exc:  # ModelLoadError included
            raise bad_request(f"model: {exc}", "model") from exc
        service.draft_name = body.model
        return state()

    @router.delete("")
    async def unload_draft():
        try:
            await anyio.to_thread.run_sync(me.unload_draft_model, kit)
        except me.GenerationInProgressError as exc:
            raise _busy(exc) from exc
        service.draft_name = None
        return state()

    return router


def _busy(exc: Exception) -> APIError:
    return APIError(
        409,
        f"generations are running; retry when the server is idle ({exc})",
        code="busy",
        headers={"Retry-After": "1"},
    )
