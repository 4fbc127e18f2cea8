"""The prompt cache's disk tier: evicted entries as safetensors files.

A hybrid model's entry holds its attention KV, its recurrent state after its
tokens and the state at each of its checkpoints, read back as the entry's
checkpoints: it serves a prompt that shares a prefix reaching one of them (the
next turn, a regenerated answer, an edited message) as the entry did in memory.

Each entry is ``<dir>/<identity>/<name>.safetensors`` (the KV layers, written
with mlx-lm's ``save_prompt_cache``) plus ``<name>.json``, its record (its
tokens, size and SHA-256; ``name`` is a hash of the tokens). ``identity``
hashes the model files, the compute dtype and the cache options, so a different
model, dtype or cache layout never reads another's entries.

The folder is treated as untrusted input, like a model folder (loading/checks.py):
only regular files are opened (without blocking, so a FIFO is never waited on),
records are read up to a size bound, an entry's safetensors header is checked
against the file's size and against the model (layer count, heads, head sizes,
dtype, exactly as many positions as recorded tokens) before any tensor is read,
and its checksum must match (disk_entry.py: one entry's record, tensors and
checks). An entry that fails any check is ignored with a warning and deleted;
it is never loaded. The tier is an optimization: a write that fails (full disk,
read-only or removed folder) is logged and skipped and leaves no temporary
file, and a folder that cannot be read is a cache miss; neither ever fails a
request or ``unload``. The tier keeps itself under a byte budget by deleting the
least recently used entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache, save_prompt_cache

from . import disk_entry
from .sequence import KVLayout, SequenceCache, StateLayout, common_prefix_length

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAX_RECORD_BYTES = 64 * 2**20  # a record of a million tokens takes about 8 MB
STALE_TEMPORARY_SECONDS = 600  # a temporary file this old belongs to a write that died


def prepare_root(directory: str | os.PathLike) -> Path:
    """``prompt_cache_dir`` made ready before a model is loaded: created when
    missing; ``ValueError`` naming the option when it is not a directory or
    cannot be created. A folder the engine may not write to is accepted with a
    warning (its entries are read; writes are skipped)."""
    path = Path(directory).expanduser()
    try:
        if path.exists() and not path.is_dir():
            raise ValueError(f"prompt_cache_dir {str(path)!r} exists and is not a directory")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, permissions, a read-only file system
        raise ValueError(f"prompt_cache_dir {str(path)!r} cannot be created: {exc.strerror or exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        logger.warning("prompt_cache_dir %s is not writable: its entries are read, none are written", path)
    return path


def model_identity(model_path: Path, compute_dtype, cache_options) -> str:
    """A short hash of what decides whether a cached KV state is valid: the
    model files (name, size, modification time), dtype and cache options."""
    files = (
        [model_path]
        if model_path.is_file()
        else sorted(p for p in model_path.iterdir() if p.suffix in (".json", ".safetensors", ".gguf"))
    )
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{compute_dtype}|{cache_options}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


class DiskCache:
    """Entries of one model identity in ``root/identity``, under ``budget_bytes``."""

    def __init__(self, root: str | os.PathLike, identity: str, budget_bytes: int):
        self.dir = Path(root).expanduser() / identity
        self.budget_bytes = budget_bytes
        self._layout: list[KVLayout | StateLayout | None] | None = None  # the model's, found at the first read
        self._undeletable: set[str] = set()  # entries to ignore quietly (already warned about)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temporaries()
        except OSError as exc:
            logger.warning(
                "prompt cache: cannot prepare %s (%s); entries are written once it can be created", self.dir, exc
            )

    # -- listing --------------------------------------------------------------
    def _files(self, suffix: str) -> list[Path]:
        """Entry files ending in ``suffix`` (temporary files start with a dot)."""
        try:
            with os.scandir(self.dir) as it:
                return [Path(e.path) for e in it if e.name.endswith(suffix) and not e.name.startswith(".")]
        except FileNotFoundError:  # removed while running: nothing stored
            return []

    def _items(self) -> list[disk_entry.Item]:
        items = []
        for record in self._files(".json"):
            name = record.name[: -len(".json")]
            if name in self._undeletable:
                continue
            try:
                with disk_entry.open_regular(record, MAX_RECORD_BYTES) as f:
                    items.append(disk_entry.parse_record(name, f.read(MAX_RECORD_BYTES + 1)))
            except FileNotFoundError:  # deleted meanwhile (another process sharing the folder), a dangling link
                self._delete(name)
            except (OSError, ValueError) as exc:
                self._drop(name, f"its record {record.name} is unreadable: {exc}")
        return items

    # -- writing --------------------------------------------------------------
    def save(self, cache: SequenceCache) -> None:
        """Write ``cache`` (plain KV layers only; others are not written). Never
        raises: a write that fails is logged and skipped, with no temporary
        file left behind."""
        if not disk_entry.savable(cache):
            return
        try:
            self._write(cache)
        except Exception as exc:  # a cache write must never fail the request or unload that caused it
            logger.warning(
                "prompt cache: could not write a %d-token entry to %s (%s: %s); skipped",
                len(cache.tokens),
                self.dir,
                type(exc).__name__,
                exc,
            )

    def _write(self, cache: SequenceCache) -> None:
        name = disk_entry.entry_name(cache.tokens)
        target, record = self.dir / f"{name}.safetensors", self.dir / f"{name}.json"
        if disk_entry.is_regular(target) and disk_entry.is_regular(record):
            os.utime(target)
            return
        self.dir.mkdir(parents=True, exist_ok=True)  # again: the folder may have been removed meanwhile
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp_data, tmp_record = self.dir / f"{tmp}.safetensors", self.dir / f"{tmp}.json"
        try:
            if cache.recurrent:
                disk_entry.save_hybrid(tmp_data, cache)
            else:
                save_prompt_cache(str(tmp_data), [disk_entry.compact(c) for c in cache.layers])
            with open(tmp_data, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest = disk_entry.sha256(f, size)
            tmp_record.write_text(json.dumps({"tokens": cache.tokens, "sha256": digest, "bytes": size}))
            os.replace(tmp_data, target)
            os.replace(tmp_record, record)  # last: an entry exists once its record does
        finally:
            for p in (tmp_data, tmp_record):
                p.unlink(missing_ok=True)
        self._enforce_budget()

    # -- reading --------------------------------------------------------------
    def load_longest(
        self, keys: list[int], better_than: int, make: Callable[[], SequenceCache]
    ) -> SequenceCache | None:
        """The stored entry sharing the longest prefix with ``keys``, if longer
        than ``better_than``, checked before it is used (module docstring); one
        that fails a check is deleted and the next longest tried. Never raises:
        a folder that cannot be read is a miss."""
        try:
            candidates = [(common_prefix_length(i.tokens, keys), i) for i in self._items()]
            candidates = sorted((c for c in candidates if c[0] > better_than), key=lambda c: -c[0])
            if not candidates or self._model_layout(make) is None:
                return None
            for shared, item in candidates:
                layers = self._read_checked(item)
                if layers is None:
                    continue
                cache = make()
                if isinstance(layers, dict):
                    disk_entry.fill_hybrid(cache, layers, item.tokens)
                    if cache.restorable(shared) <= better_than:
                        continue  # no checkpoint of it within the shared prefix: no better than memory
                else:
                    cache.layers, cache.tokens = layers, list(item.tokens)
                _touch(self.dir / f"{item.name}.safetensors")
                return cache
        except Exception as exc:  # the disk tier only ever saves work: failing to read it is a miss
            logger.warning(
                "prompt cache: could not read %s (%s: %s); continuing without it", self.dir, type(exc).__name__, exc
            )
        return None

    def _model_layout(self, make: Callable[[], SequenceCache]) -> list[KVLayout | StateLayout | None] | None:
        """What this model's KV layers hold (found once); None when it cannot be
        found, so that no entry is read (and none is deleted for it)."""
        if self._layout is None:
            try:
                self._layout = make().kv_layout()
            except Exception as exc:
                logger.warning("prompt cache: cannot find this model's KV layout (%s); the disk tier is not read", exc)
                self._layout = []
        return self._layout or None

    def _read_checked(self, item: disk_entry.Item) -> list[KVCache] | dict[str, mx.array] | None:
        path = self.dir / f"{item.name}.safetensors"
        try:
            with disk_entry.open_regular(path, item.bytes) as f:
                return disk_entry.read_entry(f, path, item, self._layout)
        except FileNotFoundError:  # deleted meanwhile (another process keeping its budget), a dangling link
            self._delete(item.name)
            return None
        except Exception as exc:  # any entry that is unreadable or does not fit is dropped, never used
            self._drop(item.name, f"{path.name}: {exc}")
            return None

    # -- deleting -------------------------------------------------------------
    def _drop(self, name: str, why: str) -> None:
        logger.warning(
            "prompt cache: ignoring and deleting a corrupt or mismatched entry %s in %s: %s", name, self.dir, why
        )
        self._delete(name)

    def _delete(self, name: str) -> None:
        for suffix in (".safetensors", ".json"):
            try:
                (self.dir / f"{name}{suffix}").unlink(missing_ok=True)
            except OSError as exc:  # read-only folder, a folder under the name: ignore it from now on
                if name not in self._undeletable:
                    logger.warning("prompt cache: cannot delete %s%s (%s); ignoring it", name, suffix, exc)
                self._undeletable.add(name)

    def _stats(self) -> list[tuple[float, int, Path]]:
        """(modification time, size, path) of each entry's data file."""
        out = []
        for p in self._files(".safetensors"):
            try:
                st = p.stat()
            except OSError:  # deleted meanwhile (another process), a dangling link
                continue
            out.append((st.st_mtime, st.st_size, p))
        return out

    def _enforce_budget(self) -> None:
        files = sorted(self._stats())
        total = sum(size for _, size, _ in files)
        for _, size, p in files:
            if total <= self.budget_bytes:
                break
            self._delete(p.name[: -len(".safetensors")])
            total -= size

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of writes that died with their process (killed mid-write)."""
        cutoff = time.time() - STALE_TEMPORARY_SECONDS
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.startswith(".") and ".tmp." in e.name and e.stat(follow_symlinks=False).st_mtime < cutoff:
                    Path(e.path).unlink(missing_ok=True)

    def size_bytes(self) -> int:
        return sum(size for _, size, _ in self._stats())


def _touch(path: Path) -> None:
    """Mark ``path`` recently used (for the budget); a read-only folder keeps its times."""
    try:
        os.utime(path)
    except OSError:
        pass
