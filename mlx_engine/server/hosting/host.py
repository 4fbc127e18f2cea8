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

import asyncio
import logging
import math
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator, Callable

import anyio

from ..web.errors import APIError
from ..web.metrics import label_request
from .discovery import KnownModel, catalog_models, scan_models_dir
from .kit_loading import check_draft, free_kit, load_kit, model_too_large, scrubbed
from .model_state import LOADED, LOADING, NOT_LOADED, UNLOADING, ModelEntry
from .options import HostLimits, LoadOptions, check_ttl
from .reaper import IdleUnloads
from .templates import template_note

logger = logging.getLogger(__name__)


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
        # Set by create_app: (kit, model id) -> the app's Service for one model.
        self.make_service: Callable[[me.ModelKit, str], object] | None = None
        self.events: Callable[..., None] = lambda *a, **k: None  # metrics hook: (event, model_id, **values)
        self._reaper = IdleUnloads(self)
        self._warned: set[str] = set()  # --models-dir entries already logged as unreadable
        self._last_scan = -math.inf
        self.rescan()

    def attach(self, make_service: Callable, events: Callable[..., None] | None = None) -> None:
        """Called by ``create_app``: how a loaded kit becomes the app's
        ``Service`` (kit, model id), and where load and unload events go."""
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
    ):
        """Serve ``kit`` as ``model_id``, loaded; returns its ``Service``.
        ``managed=False`` (a host's own kit): never unloaded here.
        ``managed=True``: the host's to unload, as if it had loaded it with
        ``options``. Its draft, if any, is named as the kit says (``draft_name``)."""
        if self.make_service is None:
            raise RuntimeError("add_kit needs the app: call create_app with this host first")
        source = str(Path(kit.model_path).resolve())
        for other in [e for e in self.entries.values() if e.model.path == source and e.state == NOT_LOADED]:
            del self.entries[other.model.id]  # the same model found by a scan: one entry, this id
        entry = ModelEntry(KnownModel(model_id, source, "kit"), options or self.defaults, managed=managed)
        entry.service, entry.state = self.make_service(kit, model_id), LOADED
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
        loaded = entry.state == LOADED and entry.service is not None
        memory = me.memory_in_use(entry.service.kit) if loaded else 0  # measured now; nothing written
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
                "memory_bytes": memory,
                "disk_bytes": entry.model.size_bytes,
                "ttl": ttl if entry.managed and ttl != math.inf else None,
                "idle_s": round(time.monotonic() - entry.last_used, 3) if entry.state == LOADED else None,
                "running": queue.running if queue else 0,
                "waiting": queue.waiting if queue else 0,
                "max_parallel": queue.rows if queue else entry.options.max_parallel,
                "draft": me.draft_name(entry.service.kit) if loaded else None,
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
                f"model {entry.model.id!r} failed to load: {scrubbed(str(exc), entry.model)}",
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
            entry.state, entry.last_error = NOT_LOADED, scrubbed(f"{type(exc).__name__}: {exc}", entry.model)
            self.events("load", entry.model.id, ok=False)
            logger.warning("loading %s failed: %s", entry.model.id, exc)
            raise
        entry.service = self.make_service(kit, entry.model.id)
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
        for other in self.loaded():  # what each holds now (its prompt cache grows with use)
            other.memory_bytes = me.memory_in_use(other.service.kit)
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
            entry.service, entry.state = self.make_service(service.kit, entry.model.id), LOADED
            raise APIError(409, f"model {entry.model.id!r} is generating", code="busy") from None
        entry.service, entry.state, entry.memory_bytes = None, NOT_LOADED, 0
        self.events("unload", entry.model.id, reason=reason)
        logger.info("unloaded %s (%s)", entry.model.id, reason)

    def load_kit(self, model: KnownModel, options: LoadOptions) -> me.ModelKit:
        """The default loader (on a thread): ``load_model`` and the draft (kit_loading.py)."""
        return load_kit(model, options, self.draft_source)

    def draft_source(self, draft: str) -> str:
        """Where ``draft`` (a known model's id, a catalog name or a path) is loaded from."""
        other = self.entries.get(draft)
        return other.model.source if other is not None else draft

    def check_draft(self, kit: me.ModelKit, model: KnownModel, options: LoadOptions) -> None:
        """400 naming ``draft`` when the draft ``options`` name explicitly cannot
        serve ``kit`` (its config and tokenizer read, no weights): on a thread."""
        check_draft(kit, model, options, self.draft_source)

    # -- idle unloads and shutdown ---------------------------------------------------------
    def start(self) -> None:
        """Start unloading idle models past their TTL (the app's lifespan calls it)."""
        self._reaper.start()

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
        self._reaper.stop()
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
