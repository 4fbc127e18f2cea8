"""The server as a host of several models (docs/server.md, "Several models").

``ModelHost`` knows a set of models by name (catalog.py's, and the folders and
``.gguf`` files of ``--models-dir``), loads one when a request names it,
unloads idle ones (an idle TTL, a memory budget, a count limit: least recently
used first, never one with running or queued generations) and hands each
request its model's ``Service`` (kit, rows, queue) through one function,
``kit_for``. Loads and unloads run on threads, so other models keep serving.
Everything else runs on the event loop: states change between awaits only.
"""

from __future__ import annotations

import mlx_engine as me
from mlx_engine import catalog, find_gguf, is_embedding_model, is_gguf, physical_memory

import asyncio
import errno
import gc
import logging
import math
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import AsyncIterator, Callable

import anyio
import mlx.core as mx

from .errors import APIError
from .metrics import label_request
from .model_state import LOADED, LOADING, NOT_LOADED, UNLOADING, ModelState, check_transition
from .templates import give_template, template_note

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 3600.0  # an idle model is unloaded after an hour, as LM Studio's just-in-time loads
DEFAULT_MEMORY_SHARE = 0.5  # of physical memory, for the weights of loaded models
DEFAULT_LOAD_WAIT_S = 60.0
RESCAN_INTERVAL_S = 1.0  # an unknown model name rescans the folders at most this often
PAIRED = "paired"  # LoadOptions.draft: the catalog's draft for the model, when it has one
_COMPUTE_DTYPES = ("auto", "native", "float32", "float16", "bfloat16")


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


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded: ``load_model``'s ``max_kv_size`` (``context``),
    ``max_parallel``, ``compute_dtype`` and ``prompt_cache_dir``; ``draft``: a
    catalog name, a path or another known model's id, ``PAIRED`` (the catalog's
    pairing) or None; ``ttl``: idle seconds before an unload (None: the host's)."""

    context: int | str | None = None
    max_parallel: int = 4
    compute_dtype: str = "auto"
    draft: str | None = PAIRED
    ttl: float | None = None
    prompt_cache_dir: str | None = None

    def __post_init__(self) -> None:
        c = self.context
        if not (c is None or c == "auto" or (isinstance(c, int) and not isinstance(c, bool) and c >= 8)):
            raise ValueError(f"context must be an integer >= 8, 'auto' or None, got {c!r}")
        p = self.max_parallel
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 64:
            raise ValueError(f"max_parallel must be an integer from 1 to 64, got {p!r}")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(_COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        check_ttl(self.ttl)


def check_ttl(ttl) -> None:
    """``ValueError`` unless ``ttl`` is None or a positive number of seconds."""
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
        raise ValueError(f"ttl must be a positive number of seconds or None, got {ttl!r}")


# -- discovery -----------------------------------------------------------------------------
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


def model_too_large(model_id: str, size: int, budget: int) -> APIError:
    """A model that cannot fit the whole memory budget even with nothing else
    loaded: a client error (4xx, which SDKs do not retry), naming both sizes."""
    return APIError(
        400,
        f"model {model_id!r} needs about {size / 2**30:.2f} GiB ({size} bytes of weights), more than the "
        f"server's whole memory budget of {budget / 2**30:.2f} GiB ({budget} bytes); it cannot be loaded "
        "here unless the server is started with a larger --memory-budget",
        param="model",
        code="model_too_large",
    )


def _scrubbed(message: str, model: KnownModel) -> str:
    """``message`` with the model's path on this machine said as its id: load
    errors go to clients, the server's folders do not."""
    for path in (model.source, str(Path(model.source).parent)):
        if len(path) > 1 and model.kind != "catalog":
            message = message.replace(path, model.id)
    return message


def bad_draft(draft: str, model_id: str, reasons: list[str], source: str) -> APIError:
    """A 400 naming ``draft``: the draft cannot serve the model; said with the
    name the client gave (the server's own paths left out)."""
    why = "; ".join(r.replace(source, draft) for r in reasons)
    return APIError(
        400,
        f"draft: {draft!r} cannot serve model {model_id!r}: {why}",
        param="draft",
        code="incompatible_draft_model",
    )


def free_kit(kit: me.ModelKit) -> None:
    """``unload`` (which writes the prompt cache's disk tier), then collect the
    reference cycles that ended generations leave (frames, tracebacks): they can
    hold the model's arrays until Python's next full collection, and the memory
    should be back when the unload returns."""
    me.unload(kit)
    gc.collect()
    mx.clear_cache()


# -- the host ------------------------------------------------------------------------------
@dataclass
class ModelEntry:
    """One known model and where it stands."""

    model: KnownModel
    options: LoadOptions
    managed: bool = True  # False: a kit the embedding host holds; never loaded or unloaded here
    state: ModelState = NOT_LOADED
    service: object | None = None  # the app's Service while loaded
    task: asyncio.Future | None = None  # the load or unload under way
    active: int = 0  # requests between lookup and admission (inside kit_for)
    last_used: float = field(default_factory=time.monotonic)
    ttl: float | None = None  # None: the options' or the host's
    memory_bytes: int = 0
    last_error: str | None = None

    def __setattr__(self, name: str, value) -> None:
        # Every state change goes through the transitions table (model_state.py).
        if name == "state" and "state" in self.__dict__:
            value = check_transition(self.state, value)
        super().__setattr__(name, value)

    @property
    def busy(self) -> bool:
        """A request is in ``kit_for``, or generations run or wait for rows."""
        queue = getattr(self.service, "queue", None)
        runs = getattr(self.service, "runs", None)
        return self.active > 0 or bool(queue and (queue.running or queue.waiting)) or bool(runs)


@dataclass(frozen=True)
class HostLimits:
    """When models are unloaded: ``ttl`` idle seconds (None: never),
    ``memory_bytes`` for loaded models (None: ``DEFAULT_MEMORY_SHARE`` of
    physical memory), ``max_loaded`` (None: no count limit); ``load_wait_s``:
    how long a request waits for a loading model before a 503;
    ``rescan_interval_s``: how often an unknown name may rescan the folders."""

    ttl: float | None = DEFAULT_TTL_S
    memory_bytes: int | None = None
    max_loaded: int | None = None
    load_wait_s: float = DEFAULT_LOAD_WAIT_S
    rescan_interval_s: float = RESCAN_INTERVAL_S

    def __post_init__(self) -> None:
        check_ttl(self.ttl)
        for name in ("memory_bytes", "max_loaded"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if not self.load_wait_s > 0:
            raise ValueError(f"load_wait_s must be positive, got {self.load_wait_s!r}")

    @property
    def budget(self) -> int:
        return self.memory_bytes if self.memory_bytes is not None else int(DEFAULT_MEMORY_SHARE * physical_memory())


Loader = Callable[[KnownModel, LoadOptions], me.ModelKit]


class ModelHost:
    """Models by name, loaded on demand and unloaded when idle (module docstring).

    ``models_dirs`` are scanned at start and again when a request names an
    unknown model; ``catalog``: serve the catalog's installed models;
    ``defaults``: how on-demand loads load; ``loader`` (tests, hosts): builds a
    kit from a known model and options, on a thread."""

    def __init__(
        self,
        *,
        models_dirs: list[str | Path] = (),
        catalog: bool = True,
        defaults: LoadOptions = LoadOptions(),
        limits: HostLimits = HostLimits(),
        loader: Loader | None = None,
    ):
        self.models_dirs = [Path(d).expanduser() for d in models_dirs]
        self.use_catalog = catalog
        self.defaults, self.limits = defaults, limits
        self.loader = loader or self.load_kit
        self.entries: dict[str, ModelEntry] = {}
        self.primary: str | None = None  # the model named at start: /health's and the draft endpoints'
        self.closed = False
        self.outcomes: Counter = Counter()  # generations completed / cancelled / failed, all models
        # Set by create_app: (kit, model id, draft name) -> the app's Service for one model.
        self.make_service: Callable[[me.ModelKit, str, str | None], object] | None = None
        self.events: Callable[..., None] = lambda *a, **k: None  # metrics hook: (event, model_id, **values)
        self._reaper: asyncio.Task | None = None
        self._warned: set[str] = set()  # --models-dir entries already logged as unreadable
        self._last_scan = -math.inf
        self.rescan()

    def attach(self, make_service: Callable, events: Callable[..., None] | None = None) -> None:
        """Called by ``create_app``: how a loaded kit becomes the app's
        ``Service`` (kit, model id, draft name), and where load and unload events go."""
        self.make_service = make_service
        if events is not None:
            self.events = events

    # -- registry --------------------------------------------------------------------------
    def rescan(self) -> None:
        """Add the models found in the catalog and ``models_dirs`` since the last scan
        (a name already taken, or a source already served, keeps its first entry)."""
        self._last_scan = time.monotonic()
        found = (catalog_models() if self.use_catalog else []) + [
            m for d in self.models_dirs for m in scan_models_dir(d, self._warned)
        ]
        paths = {e.model.path for e in self.entries.values()}
        for model in found:
            if model.id in self.entries or model.path in paths:
                continue
            self.entries[model.id] = ModelEntry(model, self.defaults)
            paths.add(model.path)

    def add_kit(
        self,
        model_id: str,
        kit: me.ModelKit,
        *,
        managed: bool = False,
        options: LoadOptions | None = None,
        draft: str | None = None,
    ):
        """Serve ``kit`` as ``model_id``, loaded; returns its ``Service``.
        ``managed=False`` (a host's own kit): never unloaded here.
        ``managed=True``: the host's to unload, as if it had loaded it with
        ``options``. ``draft``: the name of the draft model the kit holds."""
        if self.make_service is None:
            raise RuntimeError("add_kit needs the app: call create_app with this host first")
        source = str(Path(kit.model_path).resolve())
        for other in [e for e in self.entries.values() if e.model.path == source and e.state == NOT_LOADED]:
            del self.entries[other.model.id]  # the same model found by a scan: one entry, this id
        entry = ModelEntry(KnownModel(model_id, source, "kit"), options or self.defaults, managed=managed)
        entry.service, entry.state = self.make_service(kit, model_id, draft), LOADED
        entry.memory_bytes = me.memory_in_use(kit)
        # Models given by the host (the command line's --model) are listed first, in the order
        # given: clients that take the first listed model talk to the one the user named.
        given = {k: e for k, e in self.entries.items() if e.model.kind == "kit" and k != model_id}
        found = {k: e for k, e in self.entries.items() if e.model.kind != "kit" and k != model_id}
        self.entries = {**given, model_id: entry, **found}
        self.primary = self.primary or model_id
        return entry.service

    def lookup(self, model: str) -> ModelEntry:
        """The entry named ``model``, rescanning once before a 404 (at most once
        per ``limits.rescan_interval_s``: a client naming unknown models in a loop
        cannot make the server walk its folders for each)."""
        entry = self.entries.get(model)
        now = time.monotonic()
        if (
            entry is None
            and (self.models_dirs or self.use_catalog)
            and now - self._last_scan >= self.limits.rescan_interval_s
        ):
            self.rescan()
            entry = self.entries.get(model)
        if entry is None:
            raise APIError(
                404,
                f"model {model!r} is not known here; GET /v1/models lists the models this server can serve",
                param="model",
                type="not_found_error",
                code="model_not_found",
            )
        return entry

    def ttl_of(self, entry: ModelEntry) -> float | None:
        return entry.ttl or entry.options.ttl or self.limits.ttl

    def describe(self, entry: ModelEntry) -> dict:
        """One model as ``GET /v1/models`` and ``/v1/mlx_engine/models`` show it."""
        queue = getattr(entry.service, "queue", None)
        if entry.state == LOADED and entry.service is not None:
            entry.memory_bytes = me.memory_in_use(entry.service.kit)
        ttl = self.ttl_of(entry)
        return {
            "id": entry.model.id,
            "object": "model",
            "created": 0,
            "owned_by": "mlx-engine",
            "state": entry.state.value,
            "mlx_engine": {
                "type": "embeddings" if self.embeds(entry) else "llm",  # as LM Studio's model list says it
                "source": entry.model.kind,
                "managed": entry.managed,
                "memory_bytes": entry.memory_bytes if entry.state == LOADED else 0,
                "disk_bytes": entry.model.size_bytes,
                "ttl": ttl if entry.managed and ttl != math.inf else None,
                "idle_s": round(time.monotonic() - entry.last_used, 3) if entry.state == LOADED else None,
                "running": queue.running if queue else 0,
                "waiting": queue.waiting if queue else 0,
                "max_parallel": queue.rows if queue else entry.options.max_parallel,
                "draft": getattr(entry.service, "draft_name", None),
                "chat_template": template_note(getattr(entry.service, "kit", None)),
                "last_error": entry.last_error,
            },
        }

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.state == LOADED]

    def embeds(self, entry: ModelEntry) -> bool:
        """Whether ``entry`` is an embedding model: its kit's kind once loaded, its files' before."""
        if entry.state == LOADED and entry.service is not None:
            return isinstance(entry.service.kit, me.EmbeddingKit)
        return entry.model.embeds

    def check_kind(self, entry: ModelEntry, embedding: bool) -> None:
        """A 400 naming ``model`` when an embedding model is asked to generate or a
        generating model to embed."""
        if self.embeds(entry) == embedding:
            return
        if embedding:
            message = f"model {entry.model.id!r} generates text; it cannot embed: name an embedding model"
        else:
            message = f"model {entry.model.id!r} is an embedding model: it serves /v1/embeddings, not generation"
        raise APIError(400, message, param="model", code="wrong_model_type")

    # -- serving ---------------------------------------------------------------------------
    @asynccontextmanager
    async def kit_for(self, model: str, *, ttl: float | None = None, embedding: bool = False) -> AsyncIterator:
        """The ``Service`` of ``model``, loaded first when it is not: the one
        way a route reaches a kit. The model counts as busy (never unloaded)
        until the block ends, and while its generations hold or wait for rows.
        ``embedding``: the route embeds (an ``EmbeddingKit``) rather than generates;
        a model of the other kind is a 400 naming ``model``, before any load."""
        entry = self.lookup(model)
        label_request(entry.model.id)  # the request's model, for the requests counter
        self.check_kind(entry, embedding)
        if ttl is not None:
            check_ttl(ttl)
            entry.ttl = ttl  # LM Studio's request ttl: this model's idle time from now on
        entry.active += 1
        try:
            service = await self._ready(entry)
            self.check_kind(entry, embedding)  # the kit that loaded decides
            entry.last_used = time.monotonic()
            yield service
        finally:
            entry.active -= 1
            entry.last_used = time.monotonic()

    async def _ready(self, entry: ModelEntry):
        """Wait until ``entry`` is loaded, starting its load when nobody has."""
        deadline = time.monotonic() + self.limits.load_wait_s
        while True:
            self._check_open()
            if entry.state == LOADED:
                return entry.service
            if entry.state == NOT_LOADED:
                if not entry.managed:
                    raise APIError(503, f"model {entry.model.id!r} was unloaded by its host", type="server_error")
                self._start_load(entry, entry.options)
            await self._wait(entry, deadline - time.monotonic())

    async def _wait(self, entry: ModelEntry, timeout: float | None) -> None:
        """Wait (bounded: then 503) for ``entry``'s load or unload; a failed load
        is the loader's error, given to every request that waited on it."""
        try:
            await asyncio.wait_for(asyncio.shield(entry.task), timeout=None if timeout is None else max(timeout, 0.001))
        except asyncio.TimeoutError:
            raise APIError(
                503,
                f"model {entry.model.id!r} is still loading; retry shortly",
                type="server_error",
                code="model_loading",
                headers={"Retry-After": "5"},
            ) from None
        except APIError:
            raise
        except Exception as exc:
            raise APIError(
                500,
                f"model {entry.model.id!r} failed to load: {_scrubbed(str(exc), entry.model)}",
                param="model",
                type="server_error",
                code="model_load_failed",
            ) from exc

    def _check_open(self) -> None:
        if self.closed:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")

    # -- loading and unloading -------------------------------------------------------------
    async def load(self, model: str, options: LoadOptions | None = None) -> ModelEntry:
        """Load ``model`` with ``options`` (its current ones when None); a model
        loaded with other options is reloaded when idle (409 when busy)."""
        self._check_open()
        entry = self.lookup(model)
        if not entry.managed:
            raise APIError(409, f"model {model!r} is managed by the embedding host", param="model", code="not_managed")
        if entry.state in (LOADING, UNLOADING):
            await self._wait(entry, None)
        if (
            entry.state == LOADED
            and options is not None
            and replace(options, ttl=None) != replace(entry.options, ttl=None)
        ):
            # A draft that cannot serve the model is the request's mistake: found before the unload.
            await anyio.to_thread.run_sync(self.check_draft, entry.service.kit, entry.model, options)
            await self.unload(model, reason="reload")
        elif entry.state == LOADED and options is not None:  # only the TTL changes: no reload
            entry.options, entry.ttl = options, None
        if entry.state == NOT_LOADED:
            self._start_load(entry, options or entry.options)
            await self._wait(entry, None)
        return entry

    def _start_load(self, entry: ModelEntry, options: LoadOptions) -> None:
        # The state changes before anything awaits: a request arriving next waits on this load.
        entry.state, entry.options = LOADING, options
        entry.task = asyncio.ensure_future(self._load(entry, options))

    async def _load(self, entry: ModelEntry, options: LoadOptions) -> None:
        """Make room, load on a thread, and publish the kit (or the loader's error)."""
        started = time.monotonic()
        try:
            await self._make_room(entry, entry.model.size_bytes)
            kit = await anyio.to_thread.run_sync(self.loader, entry.model, options)
        except BaseException as exc:
            entry.state, entry.last_error = NOT_LOADED, _scrubbed(f"{type(exc).__name__}: {exc}", entry.model)
            self.events("load", entry.model.id, ok=False)
            logger.warning("loading %s failed: %s", entry.model.id, exc)
            raise
        draft = self.draft_of(entry.model, options) if kit.draft is not None else None
        entry.service = self.make_service(kit, entry.model.id, draft)
        entry.state, entry.last_error, entry.last_used = LOADED, None, time.monotonic()
        entry.memory_bytes = me.memory_in_use(kit)
        seconds = time.monotonic() - started
        self.events("load", entry.model.id, ok=True, seconds=seconds)
        logger.info("loaded %s in %.2f s (%.1f MiB)", entry.model.id, seconds, entry.memory_bytes / 2**20)
        try:  # the estimate was the file's size: the measured bytes decide
            await self._make_room(entry, 0)
        except APIError as exc:  # this model is in and serving; the others are unloaded when they can be
            logger.warning("after loading %s: %s", entry.model.id, exc.message)

    async def _make_room(self, entry: ModelEntry, incoming: int) -> None:
        """Unload least recently used idle models until ``entry`` (``incoming``
        more bytes) fits the budget and the count; 503 when only busy ones are left."""
        budget = self.limits.budget
        alone = entry.memory_bytes + incoming
        if entry.state != LOADED and alone > budget:
            raise model_too_large(entry.model.id, alone, budget)
        while True:
            others = [e for e in self.entries.values() if e is not entry and e.state in (LOADED, LOADING)]
            used = sum(e.memory_bytes or e.model.size_bytes for e in others) + entry.memory_bytes + incoming
            count_over = self.limits.max_loaded is not None and len(others) + 1 > self.limits.max_loaded
            if used <= budget and not count_over:
                return
            idle = sorted(
                (e for e in others if e.state == LOADED and e.managed and not e.busy), key=lambda e: e.last_used
            )
            if not idle:
                if entry.state == LOADED:  # already in: over budget until the busy ones go idle
                    logger.warning("loaded models use %d bytes, over the %d-byte budget", used, budget)
                    return
                raise APIError(
                    503,
                    f"no room for model {entry.model.id!r}: the models holding the memory "
                    f"({', '.join(e.model.id for e in others)}) are busy; retry when they are idle",
                    type="server_error",
                    code="no_room",
                    headers={"Retry-After": "5"},
                )
            await self.unload(idle[0].model.id, reason="evicted")

    async def unload(self, model: str, *, reason: str = "request") -> ModelEntry:
        """Unload an idle model (409 when busy): stop admitting to it, then free
        the kit on a thread (``unload`` writes the prompt cache's disk tier)."""
        entry = self.lookup(model)
        if entry.state in (LOADING, UNLOADING):
            await asyncio.gather(asyncio.shield(entry.task), return_exceptions=True)
        if entry.state != LOADED:
            return entry
        if not entry.managed:
            raise APIError(409, f"model {model!r} is managed by the embedding host", param="model", code="not_managed")
        if entry.busy:
            raise APIError(
                409,
                f"model {model!r} has running or queued generations; retry when it is idle",
                param="model",
                code="busy",
                headers={"Retry-After": "1"},
            )
        service, entry.state = entry.service, UNLOADING  # before any await: no request gets this service now
        entry.task = asyncio.ensure_future(self._unload(entry, service, reason))
        await asyncio.shield(entry.task)
        return entry

    async def _unload(self, entry: ModelEntry, service, reason: str) -> None:
        try:
            service.drain()
            await anyio.to_thread.run_sync(free_kit, service.kit)
        except me.GenerationInProgressError:  # a generation still ending: keep the kit, with open admission
            entry.service, entry.state = self.make_service(service.kit, entry.model.id, service.draft_name), LOADED
            raise APIError(409, f"model {entry.model.id!r} is generating", code="busy") from None
        entry.service, entry.state, entry.memory_bytes = None, NOT_LOADED, 0
        self.events("unload", entry.model.id, reason=reason)
        logger.info("unloaded %s (%s)", entry.model.id, reason)

    def load_kit(self, model: KnownModel, options: LoadOptions) -> me.ModelKit:
        """The default loader (on a thread): ``load_model`` and the draft."""
        kit = me.load_model(
            model.source,
            max_kv_size=options.context,
            compute_dtype=options.compute_dtype,
            max_parallel=options.max_parallel,
            prompt_cache_dir=options.prompt_cache_dir,
        )
        if isinstance(kit, me.EmbeddingKit):  # (load_model gives one for sentence-transformers' layout) no draft
            return kit
        give_template(kit, model.id)  # ChatML for a model without a template of its own
        draft = self.draft_of(model, options)
        try:
            if draft is not None:
                me.load_draft_model(kit, self.draft_source(draft))
        except Exception as exc:
            if options.draft == PAIRED:  # the pairing is a bonus: serve without it
                logger.warning("model %s: its paired draft %s did not load", model.id, draft, exc_info=True)
            else:
                me.unload(kit)
                if isinstance(exc, ValueError):  # IncompatibleDraftModelError, ModelLoadError: the request's draft
                    raise bad_draft(draft, model.id, [str(exc)], self.draft_source(draft)) from None
                raise
        return kit

    def draft_source(self, draft: str) -> str:
        """Where ``draft`` (a known model's id, a catalog name or a path) is loaded from."""
        other = self.entries.get(draft)
        return other.model.source if other is not None else draft

    def check_draft(self, kit: me.ModelKit, model: KnownModel, options: LoadOptions) -> None:
        """400 naming ``draft`` when the draft ``options`` name explicitly cannot
        serve ``kit`` (its config and tokenizer read, no weights): on a thread."""
        if options.draft in (None, PAIRED):
            return
        source = self.draft_source(options.draft)
        report = me.check_draft_model(kit, source)
        if not report.compatible:
            raise bad_draft(options.draft, model.id, report.reasons, source)

    def draft_of(self, model: KnownModel, options: LoadOptions) -> str | None:
        """The draft ``options`` name for ``model`` (the catalog's pairing for ``PAIRED``)."""
        return catalog.draft_for(model.source) if options.draft == PAIRED else options.draft

    # -- idle unloads and shutdown ---------------------------------------------------------
    def start(self) -> None:
        """Start unloading idle models past their TTL (the app's lifespan calls it)."""
        if self._reaper is None:
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        while True:
            try:
                await self._reap_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never leave the models without their TTL
                logger.exception("idle unloads failed; retrying")
                await asyncio.sleep(1.0)

    async def _reap_once(self) -> None:
        """Sleep a quarter of the shortest TTL (at most 0.5 s), then unload the idle expired models."""
        ttls = [self.ttl_of(e) for e in self.entries.values() if e.managed and e.state == LOADED]
        ttls = [t for t in ttls if t]
        await asyncio.sleep(min([0.5] + [t / 4 for t in ttls]))
        now = time.monotonic()
        for entry in list(self.entries.values()):
            if entry.state != LOADED or not entry.managed:
                continue
            if entry.busy:
                entry.last_used = now  # idle time counts from the last generation's end
                continue
            ttl = self.ttl_of(entry)
            if ttl and now - entry.last_used >= ttl:
                try:
                    await self.unload(entry.model.id, reason="ttl")
                except APIError:  # became busy meanwhile
                    pass

    def drain(self) -> None:
        """Admit nothing more: new and queued requests get 503; running ones go on."""
        self.closed = True
        for entry in self.loaded():
            entry.service.drain()

    async def cut_after(self, grace_s: float) -> None:
        """Let running requests of every model finish for ``grace_s`` seconds, then cut the rest."""
        await asyncio.gather(*(e.service.cut_after(grace_s) for e in self.loaded()))

    async def stop(self, wait_s: float = 10.0) -> None:
        """Drain, cancel what runs (bounded wait), and unload the models the host loaded."""
        self.drain()
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(e.service.stop(wait_s) for e in self.loaded()))
        for entry in self.entries.values():
            if entry.task is not None and not entry.task.done():
                await asyncio.gather(entry.task, return_exceptions=True)
        for entry in [e for e in self.loaded() if e.managed]:
            try:
                await anyio.to_thread.run_sync(free_kit, entry.service.kit)
                self.events("unload", entry.model.id, reason="shutdown")
            except me.GenerationInProgressError:
                logger.warning("a generation of %s was still ending at exit; not unloaded", entry.model.id)
            entry.service, entry.state = None, NOT_LOADED


def replace_options(options: LoadOptions, **changes) -> LoadOptions:
    """``options`` with ``changes`` (checked: ``ValueError`` naming the field)."""
    return replace(options, **changes)
