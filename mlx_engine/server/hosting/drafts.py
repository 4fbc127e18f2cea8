"""Where a draft named over HTTP comes from (the draft endpoints, apis/drafts.py,
and a model's load, apis/models.py).

A draft is named by catalog name, or by a path that must lie inside the
operator's ``--models-dir`` (symlinks resolved first), so no request can make
the server read anything else.
"""

from __future__ import annotations

import mlx_engine as me

from pathlib import Path

from ..web.errors import APIError, bad_request


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
