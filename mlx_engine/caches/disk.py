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
and its checksum must match. An entry that fails any check is ignored with a
warning and deleted; it is never loaded. The tier is an optimization: a write
that fails (full disk, read-only or removed folder) is logged and skipped and
leaves no temporary file, and a folder that cannot be read is a cache miss;
neither ever fails a request or ``unload``. The tier keeps itself under a byte
budget by deleting the least recently used entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, load_prompt_cache, save_prompt_cache

from ..loading.checks import read_safetensors_header
from .sequence import KVLayout, SequenceCache, StateLayout, common_prefix_length, flat_layers

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAX_RECORD_BYTES = 64 * 2**20  # a record of a million tokens takes about 8 MB
STALE_TEMPORARY_SECONDS = 600  # a temporary file this old belongs to a write that died
_SAFETENSORS_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16"}


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


def _entry_name(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:32]


def _nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))


def _open_regular(path: Path, max_bytes: int) -> BinaryIO:
    """``path`` open for reading if it is a regular file (symlinks followed) of
    at most ``max_bytes``. Opened without blocking and checked on the open
    file, so a FIFO or device under the name is never read from: a FIFO would
    block forever and ``/dev/zero`` never ends."""
    f = open(path, "rb", opener=_nonblocking)
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
        f.close()
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file (a FIFO, device or folder)")
        raise ValueError(f"{st.st_size} bytes, more than the {max_bytes} allowed")
    return f


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _sha256(f: BinaryIO, size: int) -> str:
    """Hash of the first ``size`` bytes of ``f``, from its start."""
    h = hashlib.sha256()
    f.seek(0)
    while size > 0 and (block := f.read(min(size, 1 << 20))):
        h.update(block)
        size -= len(block)
    return h.hexdigest()


@dataclass
class _Item:
    name: str
    tokens: list[int]
    sha256: str
    bytes: int


def _parse_record(name: str, raw: bytes) -> _Item:
    """An entry's record, checked: ``ValueError`` for anything malformed."""
    try:
        d = json.loads(raw)
        tokens, sha, size = d["tokens"], d["sha256"], d["bytes"]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed record: {exc!r}") from None
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise ValueError("malformed record: 'tokens' must be a list of token ids")
    if type(size) is not int or size < 0 or not isinstance(sha, str):
        raise ValueError("malformed record: 'bytes' or 'sha256'")
    if _entry_name(tokens) != name:
        raise ValueError("its tokens do not match its name")
    return _Item(name, tokens, sha, size)


def _savable(cache: SequenceCache) -> bool:
    """Plain KV layers holding exactly the cache's (known) tokens, beside
    recurrent layers holding their state after them (a hybrid model)."""
    n = len(cache.tokens)
    return (
        bool(cache.tokens)
        and min(cache.tokens) >= 0
        and all(
            (type(c) is KVCache and c.offset == n)
            or (bool(cache.recurrent) and isinstance(c, ArraysCache) and all(a is not None for a in c.cache))
            for c in flat_layers(cache.layers)
        )
    )


def _save_hybrid(path: Path, cache: SequenceCache) -> None:
    """A hybrid cache's layers (``CacheList`` opened up): KV layer i as
    ``i.0``/``i.1``, a recurrent layer's arrays as ``i.s0``, ``i.s1``, ... (the
    state after the entry's tokens) and, per checkpoint at position p before
    the end, ``i.cP.s0``, ``i.cP.s1``, ... (in the header, so the checksum
    covers the positions too)."""
    tensors = {}
    flat = flat_layers(cache.layers)
    recurrent = [i for i, c in enumerate(flat) if isinstance(c, ArraysCache)]
    for i, c in enumerate(flat):
        if isinstance(c, ArraysCache):
            tensors.update({f"{i}.s{j}": a for j, a in enumerate(c.cache)})
        else:
            tensors[f"{i}.0"], tensors[f"{i}.1"] = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    for p, state in cache.checkpoints:
        if 0 < p < len(cache.tokens) and all(a is not None for arrays in state for a in arrays):
            for i, arrays in zip(recurrent, state):
                tensors.update({f"{i}.c{p}.s{j}": a for j, a in enumerate(arrays)})
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx-engine-hybrid"})


def _fill_hybrid(cache: SequenceCache, tensors: dict[str, mx.array], tokens: list[int]) -> None:
    """Set a fresh hybrid cache from an entry's checked tensors: its layers, and
    its checkpoints (those stored, and its end)."""
    flat = flat_layers(cache.layers)
    for i, c in enumerate(flat):
        if isinstance(c, ArraysCache):
            c.cache = [tensors[f"{i}.s{j}"] for j in range(len(c.cache))]
        else:
            c.state = (tensors[f"{i}.0"], tensors[f"{i}.1"], len(tokens))
    cache.tokens = list(tokens)
    recurrent = [(i, len(c.cache)) for i, c in enumerate(flat) if isinstance(c, ArraysCache)]
    stored = [
        (p, tuple(tuple(tensors[f"{i}.c{p}.s{j}"] for j in range(n)) for i, n in recurrent))
        for p in _checkpoint_positions(tensors, len(tokens))
    ]
    cache.adopt_checkpoints(stored)
    cache.checkpoint()  # the end: a branch or a rewind may land here


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

    def _items(self) -> list[_Item]:
        items = []
        for record in self._files(".json"):
            name = record.name[: -len(".json")]
            if name in self._undeletable:
                continue
            try:
                with _open_regular(record, MAX_RECORD_BYTES) as f:
                    items.append(_parse_record(name, f.read(MAX_RECORD_BYTES + 1)))
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
        if not _savable(cache):
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
        name = _entry_name(cache.tokens)
        target, record = self.dir / f"{name}.safetensors", self.dir / f"{name}.json"
        if _is_regular(target) and _is_regular(record):
            os.utime(target)
            return
        self.dir.mkdir(parents=True, exist_ok=True)  # again: the folder may have been removed meanwhile
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp_data, tmp_record = self.dir / f"{tmp}.safetensors", self.dir / f"{tmp}.json"
        try:
            if cache.recurrent:
                _save_hybrid(tmp_data, cache)
            else:
                save_prompt_cache(str(tmp_data), [_compact(c) for c in cache.layers])
            with open(tmp_data, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest = _sha256(f, size)
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
                    _fill_hybrid(cache, layers, item.tokens)
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

    def _read_checked(self, item: _Item) -> list[KVCache] | dict[str, mx.array] | None:
        path = self.dir / f"{item.name}.safetensors"
        try:
            with _open_regular(path, item.bytes) as f:
                return _read_entry(f, path, item, self._layout)
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


def _read_entry(
    f: BinaryIO, path: Path, item: _Item, layout: list[KVLayout | StateLayout | None]
) -> list[KVCache] | dict[str, mx.array]:
    """The layers of the entry open as ``f`` (a hybrid model's: its tensors by
    name): its size, header (against the model's ``layout`` and the recorded
    tokens) and checksum are checked before any tensor is read; ``ValueError``
    says what does not match."""
    size = os.fstat(f.fileno()).st_size
    if size != item.bytes:
        raise ValueError(f"{size} bytes where its record says {item.bytes} (a truncated file?)")
    _check_header(read_safetensors_header(path, f, "prompt cache entry"), layout, len(item.tokens))
    if _sha256(f, size) != item.sha256:
        raise ValueError("checksum mismatch (a corrupt file)")
    f.seek(0)
    if any(isinstance(lay, StateLayout) for lay in layout):
        tensors = mx.load(f)
        mx.eval(list(tensors.values()))  # read now, while the file is open
        return tensors
    layers = load_prompt_cache(f)
    if any(type(c) is not KVCache or c.offset != len(item.tokens) for c in layers):
        raise ValueError(f"its layers are not plain KV caches holding its {len(item.tokens)} tokens")
    mx.eval([(c.keys, c.values) for c in layers])  # read now, while the file is open
    return layers


def _check_header(tensors: dict, layout: list[KVLayout | StateLayout | None], n: int) -> None:
    """The tensors an entry declares are exactly this model's layers for ``n``
    tokens: per KV layer keys ``i.0``, values ``i.1`` and an optional offset
    scalar ``i.2``; per recurrent layer (a hybrid model) its arrays ``i.s0``,
    ``i.s1``, ... of the model's own shapes."""
    if any(lay is None for lay in layout):
        raise ValueError("this model's cache has layers that are neither plain KV caches nor recurrent state")
    held = {name.split(".")[0] for name in tensors}
    if len(held) != len(layout):
        raise ValueError(f"{len(held)} layers; this model has {len(layout)}")
    allowed = set()
    positions = _checkpoint_positions(tensors, n)
    for i, lay in enumerate(layout):
        if isinstance(lay, StateLayout):
            parts = [
                (f"{i}.{at}s{j}", shape, dtype)
                for at in ["", *(f"c{p}." for p in positions)]
                for j, (shape, dtype) in enumerate(zip(lay.shapes, lay.dtypes))
            ]
        else:
            parts = [
                (f"{i}.{j}", (1, lay.heads, n, dim), lay.dtype) for j, dim in enumerate((lay.key_dim, lay.value_dim))
            ]
            allowed.add(f"{i}.2")
            offset = tensors.get(f"{i}.2")
            if offset is not None and offset.shape != ():
                raise ValueError(f"tensor {i}.2 (the layer's offset) has shape {list(offset.shape)}")
        for part, want, dtype in parts:
            allowed.add(part)
            info, name = tensors.get(part), _SAFETENSORS_DTYPES.get(dtype)
            if info is None or tuple(info.shape) != tuple(want) or (name is not None and info.dtype != name):
                got = "missing" if info is None else f"{info.dtype} {list(info.shape)}"
                raise ValueError(f"tensor {part} is {got}; this model's for {n} tokens is {name} {list(want)}")
    extra = set(tensors) - allowed
    if extra:
        raise ValueError(f"unexpected tensors {sorted(extra)[:3]}")


def _checkpoint_positions(tensors: dict, n: int) -> list[int]:
    """The checkpoint positions named in an entry's header (``i.cP.sJ``), each
    a position inside its ``n`` tokens; ``ValueError`` for any other."""
    positions = set()
    for name in tensors:
        part = name.split(".")[1] if name.count(".") == 2 else ""
        if part.startswith("c"):
            if not part[1:].isdigit() or not 0 < int(part[1:]) < n:
                raise ValueError(f"tensor {name} names no checkpoint inside its {n} tokens")
            positions.add(int(part[1:]))
    return sorted(positions)


def _touch(path: Path) -> None:
    """Mark ``path`` recently used (for the budget); a read-only folder keeps its times."""
    try:
        os.utime(path)
    except OSError:
        pass


def _compact(layer: KVCache) -> KVCache:
    """The layer with exactly its tokens' keys and values (no spare buffer).
    Needed: mlx-lm's ``KVCache.state`` (what ``save_prompt_cache`` writes) is
    the whole step-allocated buffer, not the first ``offset`` positions."""
    out = KVCache()
    if layer.keys is not None:
        o = layer.offset
        out.state = (layer.keys[..., :o, :], layer.values[..., :o, :], o)
    return out
