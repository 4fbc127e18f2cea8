"""The prompt cache's disk tier: evicted entries as safetensors files.

Each entry is ``<dir>/<identity>/<name>.safetensors`` (the KV layers, written
with mlx-lm's ``save_prompt_cache``) plus ``<name>.json`` (its tokens, size and
SHA-256). ``identity`` hashes the model files, the compute dtype and the cache
options, so a different model, dtype or cache layout never reads another's
entries. An entry whose checksum does not match, or that cannot be parsed, is
ignored with a warning and deleted; it is never loaded. The tier keeps itself
under a byte budget by deleting the least recently used entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from .cache import SequenceCache, common_prefix_length

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def model_identity(model_path: Path, compute_dtype, cache_options) -> str:
    """A short hash of what decides whether a cached KV state is valid: the
    model files (name, size, modification time), dtype and cache options."""
    files = [model_path] if model_path.is_file() else sorted(
        p for p in model_path.iterdir() if p.suffix in (".json", ".safetensors", ".gguf")
    )
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{compute_dtype}|{cache_options}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class _Item:
    name: str
    tokens: list[int]
    sha256: str
    bytes: int


class DiskCache:
    """Entries of one model identity in ``root/identity``, under ``budget_bytes``."""

    def __init__(self, root: str | os.PathLike, identity: str, budget_bytes: int):
        self.dir = Path(root).expanduser() / identity
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes

    def _items(self) -> list[_Item]:
        items = []
        for meta in self.dir.glob("*.json"):
            try:
                d = json.loads(meta.read_text())
                items.append(_Item(meta.stem, [int(t) for t in d["tokens"]], str(d["sha256"]), int(d["bytes"])))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("prompt cache: ignoring unreadable entry %s (%s)", meta, exc)
                self._delete(meta.stem)
        return items

    def save(self, cache: SequenceCache) -> None:
        """Write ``cache`` (plain KV layers only; others are not written)."""
        if not cache.tokens or any(type(c) is not KVCache for c in cache.layers) or min(cache.tokens) < 0:
            return
        name = hashlib.sha256(json.dumps(cache.tokens).encode()).hexdigest()[:32]
        target = self.dir / f"{name}.safetensors"
        if target.exists():
            os.utime(target)
            return
        tmp = self.dir / f".{name}.tmp.safetensors"
        save_prompt_cache(str(tmp), [_compact(c) for c in cache.layers])
        item = {"tokens": cache.tokens, "sha256": _sha256(tmp), "bytes": tmp.stat().st_size}
        os.replace(tmp, target)
        (self.dir / f"{name}.json").write_text(json.dumps(item))
        self._enforce_budget()

    def load_longest(self, keys: list[int], better_than: int, make: Callable[[], SequenceCache]) -> SequenceCache | None:
        """The stored entry sharing the longest prefix with ``keys``, if longer
        than ``better_than``; checked against its checksum before it is read."""
        candidates = [(common_prefix_length(i.tokens, keys), i) for i in self._items()]
        candidates = [c for c in candidates if c[0] > better_than]
        if not candidates:
            return None
        shared, item = max(candidates, key=lambda c: c[0])
        path = self.dir / f"{item.name}.safetensors"
        try:
            if not path.exists() or path.stat().st_size != item.bytes or _sha256(path) != item.sha256:
                raise ValueError("checksum mismatch (a truncated or corrupt file)")
            layers = load_prompt_cache(str(path))
        except Exception as exc:  # any unreadable entry is dropped, never used
            logger.warning("prompt cache: ignoring corrupt entry %s: %s", path, exc)
            self._delete(item.name)
            return None
        cache = make()
        if len(layers) != len(cache.layers) or any(type(c) is not KVCache for c in layers):
            logger.warning("prompt cache: ignoring entry %s: its layers do not fit this model", path)
            self._delete(item.name)
            return None
        cache.layers, cache.tokens = layers, list(item.tokens)
        os.utime(path)
        return cache

    def _enforce_budget(self) -> None:
        files = sorted(self.dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        while files and total > self.budget_bytes:
            oldest = files.pop(0)
            total -= oldest.stat().st_size
            self._delete(oldest.stem)

    def _delete(self, name: str) -> None:
        for suffix in (".safetensors", ".json"):
            try:
                (self.dir / f"{name}{suffix}").unlink()
            except FileNotFoundError:
                pass

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob("*.safetensors"))


def _compact(layer: KVCache) -> KVCache:
    """The layer with exactly its tokens' keys and values (no spare buffer)."""
    out = KVCache()
    if layer.keys is not None:
        out.keys, out.values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
        out.offset = layer.offset
    return out
