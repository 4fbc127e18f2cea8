"""One entry of the prompt cache's disk tier (disk.py keeps the folder): its
record (tokens, size, SHA-256; named by a hash of its tokens), its tensors (a
plain model's KV layers, or a hybrid model's layers, recurrent state and
checkpoints) and the checks an entry passes before any of its tensors is read.

An entry's files are untrusted input (disk.py's docstring): only regular files
are opened, without blocking, and an entry is read only once its size, its
safetensors header (against the model's layout and the recorded tokens) and its
checksum match.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, load_prompt_cache

from ..loading.checks import read_safetensors_header
from .sequence import KVLayout, SequenceCache, StateLayout, flat_layers

_SAFETENSORS_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16"}


def entry_name(tokens: list[int]) -> str:
    """An entry's file name: a hash of its tokens."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:32]


def _nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))


def open_regular(path: Path, max_bytes: int) -> BinaryIO:
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


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file (symlinks followed); False when it cannot be read."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def sha256(f: BinaryIO, size: int) -> str:
    """Hash of the first ``size`` bytes of ``f``, from its start."""
    h = hashlib.sha256()
    f.seek(0)
    while size > 0 and (block := f.read(min(size, 1 << 20))):
        h.update(block)
        size -= len(block)
    return h.hexdigest()


@dataclass
class Item:
    """An entry as its record describes it."""

    name: str
    tokens: list[int]
    sha256: str
    bytes: int


def parse_record(name: str, raw: bytes) -> Item:
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
    if entry_name(tokens) != name:
        raise ValueError("its tokens do not match its name")
    return Item(name, tokens, sha, size)


def savable(cache: SequenceCache) -> bool:
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


def save_hybrid(path: Path, cache: SequenceCache) -> None:
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


def fill_hybrid(cache: SequenceCache, tensors: dict[str, mx.array], tokens: list[int]) -> None:
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


def read_entry(
    f: BinaryIO, path: Path, item: Item, layout: list[KVLayout | StateLayout | None]
) -> list[KVCache] | dict[str, mx.array]:
    """The layers of the entry open as ``f`` (a hybrid model's: its tensors by
    name): its size, header (against the model's ``layout`` and the recorded
    tokens) and checksum are checked before any tensor is read; ``ValueError``
    says what does not match."""
    size = os.fstat(f.fileno()).st_size
    if size != item.bytes:
        raise ValueError(f"{size} bytes where its record says {item.bytes} (a truncated file?)")
    _check_header(read_safetensors_header(path, f, "prompt cache entry"), layout, len(item.tokens))
    if sha256(f, size) != item.sha256:
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


def compact(layer: KVCache) -> KVCache:
    """The layer with exactly its tokens' keys and values (no spare buffer).
    Needed: mlx-lm's ``KVCache.state`` (what ``save_prompt_cache`` writes) is
    the whole step-allocated buffer, not the first ``offset`` positions."""
    out = KVCache()
    if layer.keys is not None:
        o = layer.offset
        out.state = (layer.keys[..., :o, :], layer.values[..., :o, :], o)
    return out
