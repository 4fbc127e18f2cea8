"""The models a host can serve: the catalog's installed models, and the model
folders and ``.gguf`` files under ``--models-dir`` (``KnownModel``)."""

from __future__ import annotations

import mlx_engine as me
from mlx_engine import catalog, find_gguf, is_embedding_model, is_gguf

import errno
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnownModel:
    """A model the host can load: its ``id`` (what clients send as ``model``),
    ``source`` (a catalog name or a path) and ``kind`` (catalog, directory, gguf, kit)."""

    id: str
    source: str
    kind: str
    size_bytes: int = 0  # weights on disk: the memory estimate before a load

    @property
    def path(self) -> str:
        """The real path of the model's files: one model found twice is served once."""
        if self.kind == "catalog":
            try:
                return str(catalog.lookup(self.source).resolve())
            except (me.ModelLoadError, OSError, RuntimeError):  # uninstalled since the scan: its name stands
                return self.source
        return self.source

    @cached_property
    def embeds(self) -> bool:
        """Whether its files are an embedding model's (sentence-transformers' layout),
        known before it is loaded (read once: /v1/models and every metrics scrape ask)."""
        return self.kind != "gguf" and is_embedding_model(Path(self.path))


def catalog_models() -> list[KnownModel]:
    """The catalog's installed models, draft models excepted (they serve a target)."""
    drafts = {e.draft for e in catalog.CATALOG.values() if e.draft}
    found = []
    for name in catalog.CATALOG:
        if name in drafts:
            continue
        try:
            path = catalog.lookup(name)
            found.append(KnownModel(name, name, "catalog", _weights_bytes(path)))
        except me.ModelLoadError:  # not installed: nothing to serve
            continue
        except OSError as exc:  # a file removed or a link left dangling while it was read
            logger.warning("catalog model %s skipped: %s", name, exc.strerror or type(exc).__name__)
    return found


def scan_models_dir(root: str | Path, warned: set[str] | None = None) -> list[KnownModel]:
    """The models in ``root``: ``.gguf`` files (id: the file name without
    ``.gguf``), model folders (id: the folder name) and, one level down, the
    ``publisher/model`` folders of LM Studio's layout (id: ``publisher/model``).
    A model folder is one with ``config.json`` or exactly one model ``.gguf``.

    An entry that cannot be read (a dangling link, a file removed meanwhile, a
    folder without permission) is skipped with a log line, once per entry when
    ``warned`` (the names already reported) is given: the rest are listed."""
    root = Path(root).expanduser()
    found: list[KnownModel] = []
    for child in _entries(root, root, warned):
        try:
            if is_gguf(child) and not child.name.lower().startswith("mmproj"):
                found.append(KnownModel(child.stem, str(child.resolve(strict=True)), "gguf", child.stat().st_size))
            elif child.is_dir():
                found += _models_in(root, child, warned)
            elif child.is_symlink() and not child.exists():
                _skipped(root, child, OSError(errno.ENOENT, "a link to nothing (dangling symlink)"), warned)
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop in Python 3.11's resolve()
            _skipped(root, child, exc, warned)
    return found


def _entries(root: Path, folder: Path, warned: set[str] | None) -> list[Path]:
    """The visible entries of ``folder``, sorted; none (logged) when it cannot be listed."""
    try:
        return sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError as exc:
        _skipped(root, folder, exc, warned)
        return []


def _models_in(root: Path, child: Path, warned: set[str] | None) -> list[KnownModel]:
    """``child`` as a model folder, or the model folders one level inside it."""
    model = _model_folder(child, child.name)
    if model is not None:
        return [model]
    found = []
    for sub in _entries(root, child, warned):
        try:
            if sub.is_dir():
                model = _model_folder(sub, f"{child.name}/{sub.name}")
                found += [model] if model is not None else []
        except (OSError, RuntimeError) as exc:
            _skipped(root, sub, exc, warned)
    return found


def _skipped(root: Path, entry: Path, exc: Exception, warned: set[str] | None) -> None:
    """Log (once per entry when ``warned`` is kept) an entry the scan skips,
    named relative to the folder: the log says which, and why."""
    name = str(entry.relative_to(root)) if entry != root and root in entry.parents else entry.name
    why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    if warned is not None:
        if name in warned:
            return
        warned.add(name)
    logger.warning("--models-dir: %r skipped: %s", name, why)


def _model_folder(folder: Path, model_id: str) -> KnownModel | None:
    if (folder / "config.json").is_file():
        return KnownModel(model_id, str(folder.resolve(strict=True)), "directory", _weights_bytes(folder))
    try:
        file = find_gguf(folder)
    except me.ModelLoadError:  # several GGUF files: each is named by its own path, not served by folder
        return None
    return None if file is None else KnownModel(model_id, str(file.resolve(strict=True)), "gguf", file.stat().st_size)


def _weights_bytes(path: Path) -> int:
    """Bytes of the weights files at ``path`` (a file, or a folder's
    ``.safetensors`` and ``.gguf``); ``OSError`` when one cannot be read."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) + sum(
        p.stat().st_size for p in path.glob("*.gguf")
    )
