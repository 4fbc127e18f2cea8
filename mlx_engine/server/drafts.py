"""Runtime draft management over HTTP: the SDK's ``load_draft_model``,
``check_draft_model`` and ``unload_draft_model`` as endpoints, for the model
served at start (the host's ``primary``; other models take a draft when loaded,
``POST /v1/mlx_engine/models/load``).

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
    """A catalog name (or ``"mtp"``, the model's own MTP head) as is, or the real path of ``value`` inside ``models_dir``:
    404 for a name or path that is not there, 403 for a path outside (or any
    path without ``models_dir``), 400 for one that cannot be a path."""
    if value.lower() in me.CATALOG or value == me.OWN_MTP:  # a catalog name, or the model's own MTP head
        return value
    is_name = not any(c in value for c in "/\\") and not value.startswith(("~", "."))
    if models_dir is None:
        if is_name:
            raise _not_found(f"model: no catalog model is named {value!r} (the server takes no paths: no --models-dir)")
        raise APIError(
            403,
            "model: paths are not accepted; the server was started without --models-dir",
            param="model",
            type="permission_error",
        )
    if "\x00" in value:
        raise bad_request("model: a path cannot contain a NUL byte", "model")
    root = models_dir.resolve()
    path = Path(value)
    try:
        path = (path if path.is_absolute() else root / path).resolve()
        inside = path == root or root in path.parents
        exists = inside and path.exists()
    except RuntimeError as exc:  # Python 3.11's resolve(): "Symlink loop from ..."
        raise bad_request(f"model: the path cannot be resolved: {exc}", "model") from None
    except OSError as exc:  # a name too long, a loop met by stat
        raise bad_request(f"model: the path cannot be used: {exc.strerror or exc}", "model") from None
    if path == root:
        raise bad_request("model: names the --models-dir folder itself, not a model inside it", "model")
    if not inside:
        raise APIError(
            403, "model: the path is outside the server's --models-dir", param="model", type="permission_error"
        )
    if not exists:
        raise _not_found(f"model: {value!r} was not found in the catalog or under the server's --models-dir")
    return str(path)


def _not_found(message: str) -> APIError:
    return APIError(404, message, param="model", type="not_found_error", code="model_not_found")


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
        return {"loaded": loaded, "model": service.draft_name if loaded else None}

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
                await anyio.to_thread.run_sync(me.load_draft_model, service.kit, target)
            except me.IncompatibleDraftModelError as exc:
                raise APIError(400, f"model: {exc}", param="model", code="incompatible_draft_model") from exc
            except me.GenerationInProgressError as exc:
                raise _busy(exc) from exc
            except ValueError as exc:  # ModelLoadError included
                raise bad_request(f"model: {exc}", "model") from exc
            service.draft_name = body.model
            return state(service)

    @router.delete("")
    async def unload_draft():
        async with primary() as service:
            try:
                await anyio.to_thread.run_sync(me.unload_draft_model, service.kit)
            except me.GenerationInProgressError as exc:
                raise _busy(exc) from exc
            service.draft_name = None
            return state(service)

    return router


def _busy(exc: Exception) -> APIError:
    return APIError(
        409,
        f"generations are running; retry when the server is idle ({exc})",
        code="busy",
        headers={"Retry-After": "1"},
    )
