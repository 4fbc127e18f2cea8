"""Reading GGUF files: header checks, typed metadata and tensors.

The header is walked here first, with bounds on every count and size, so every
structural problem or unsupported tensor type becomes a ``ModelLoadError``
naming the file (and the tensor) before any weights are read. Tensors then come
either as MLX stores them (files of MLX-native types only, re-packed here as
``mx.load`` would make them, transcode.py) or one at a time through
llama.cpp's ``gguf`` package decoders. Families and tokenizers: families.py
and tokenizer.py; the whole rule: docs/gguf.md.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ...errors import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
MAX_COUNT = 1 << 24  # tensors, metadata keys: far above any real model
# Bounds on what the header declares, checked before anything is read: the
# largest real vocabularies and merge lists hold a few hundred thousand entries
# and their whole metadata a few tens of MB, so a crafted file declaring more is
# refused in milliseconds instead of being decoded for minutes.
MAX_ARRAY_ITEMS = 1 << 22
MAX_HEADER_BYTES = 64 * 2**20  # metadata and tensor table together
MAX_DIM = 2**31 - 1  # MLX indexes with 32-bit integers

# GGML tensor types the loader reads, by name; ids, block sizes and decoders
# come from llama.cpp's own ``gguf`` package. The first group is what MLX holds
# natively: a file made only of these loads as ``mx.load`` reads it, Q4_0/Q4_1/
# Q8_0 kept as MLX quantized triples (group size 32; ``read_native``). A file holding any other
# type is read tensor by tensor and decoded by ``gguf.quants.dequantize``
# (docs/gguf.md gives the whole rule).
MLX_NATIVE_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
DEQUANTIZED_TYPES = ("BF16", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")
SUPPORTED_TYPES = MLX_NATIVE_TYPES + DEQUANTIZED_TYPES

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    type_name: str
    offset: int = 0  # of the tensor's data, from the start of the file
    n_bytes: int = 0


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file declares, checked against its size."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Reader:
    """Bounds-checked little-endian reads over a memory-mapped file; the header
    may use at most ``limit`` bytes of it."""

    _U64 = struct.Struct("<Q")

    def __init__(self, buf, path: Path, limit: int = MAX_HEADER_BYTES):
        self.buf, self.pos, self.path, self.limit = buf, 0, path, limit
        self.end = min(len(buf), limit)

    def corrupt(self, what: str) -> ModelLoadError:
        if self.end < len(self.buf):
            return ModelLoadError(
                f"GGUF file {str(self.path)!r}: {what} runs past the end of the file or past {self.limit} "
                "bytes of header (the most this loader reads)"
            )
        return ModelLoadError(
            f"GGUF file {str(self.path)!r} is truncated or corrupt: {what} runs past the end of the file"
        )

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise self.corrupt(what)
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, item_bytes: int = 1) -> int:
        n = self.scalar("<Q", what)
        # Every element takes at least ``item_bytes``, so a count beyond the bytes left is corrupt.
        if n * item_bytes > self.end - self.pos:
            raise self.corrupt(f"{what} (declaring {n} entries)")
        return n

    def string(self, what: str) -> str:
        return str(self.take(self.count(what), what), "utf-8", "replace")

    def value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], f"metadata {key!r}")
        if vtype == _STRING:
            return self.string(f"metadata {key!r}")
        if vtype == _ARRAY:
            return self.array(key)
        raise ModelLoadError(
            f"GGUF file {str(self.path)!r} is corrupt: metadata {key!r} has unknown value type {vtype}"
        )

    def array(self, key: str):
        """Numbers and bools as one numpy array (read in bulk), strings as a list
        of str; ``MAX_ARRAY_ITEMS`` bounds the declared count before any is read."""
        what = f"metadata {key!r}"
        item_type = self.scalar("<I", what)
        if item_type not in _SCALARS and item_type != _STRING:
            raise ModelLoadError(
                f"GGUF file {str(self.path)!r} is corrupt: {what} is an array of value type {item_type}"
            )
        item_bytes = struct.calcsize(_SCALARS[item_type]) if item_type in _SCALARS else 8  # a string's length field
        n = self.count(what, item_bytes)
        if n > MAX_ARRAY_ITEMS:
            raise ModelLoadError(
                f"GGUF file {str(self.path)!r}: {what} declares {n} entries; this loader reads at most {MAX_ARRAY_ITEMS}"
            )
        if item_type in _SCALARS:
            raw = self.take(n * item_bytes, what)
            values = np.frombuffer(raw, dtype=np.dtype(_SCALARS[item_type].replace("?", "u1")))
            return values.astype(np.bool_) if item_type == 7 else values.copy()
        return self._strings(n, what)

    def _strings(self, n: int, what: str) -> list[str]:
        """``n`` length-prefixed strings: one tight loop over the mapped bytes
        (about 10x faster than reading them one call at a time)."""
        buf, pos, end, unpack = self.buf, self.pos, self.end, self._U64.unpack_from
        out = []
        for _ in range(n):
            if pos + 8 > end:
                raise self.corrupt(what)
            (size,) = unpack(buf, pos)
            pos += 8
            if size > end - pos:
                raise self.corrupt(what)
            out.append(str(buf[pos : pos + size], "utf-8", "replace"))
            pos += size
        self.pos = pos
        return out


def read_header(path: Path, max_header_bytes: int = MAX_HEADER_BYTES) -> GGUFHeader:
    """Walk a GGUF file's header (metadata and tensor table) without reading
    weights; raises ``ModelLoadError`` for anything malformed, or for a header
    longer than ``max_header_bytes``."""
    stat = path.stat()
    return _read_header_cached(str(path), stat.st_size, stat.st_mtime_ns, max_header_bytes)


@functools.lru_cache(maxsize=2)
def _read_header_cached(name: str, size: int, mtime_ns: int, max_header_bytes: int) -> GGUFHeader:
    path = Path(name)
    if size < 24:
        raise ModelLoadError(f"GGUF file {name!r} is too small ({size} bytes) to be a GGUF model")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _Reader(buf, path, max_header_bytes)
        if r.take(4, "magic") != GGUF_MAGIC:
            raise ModelLoadError(f"{name!r} is not a GGUF file (its first bytes are not 'GGUF')")
        version = r.scalar("<I", "version")
        if version not in (2, 3):
            raise ModelLoadError(f"GGUF file {name!r} has version {version}; supported: 2 and 3")
        n_tensors, n_kv = r.scalar("<Q", "tensor count"), r.scalar("<Q", "metadata count")
        if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
            raise ModelLoadError(
                f"GGUF file {name!r} is corrupt: it declares {n_tensors} tensors and {n_kv} metadata keys"
            )
        metadata = {}
        for _ in range(n_kv):
            key = r.string("metadata key")
            metadata[key] = r.value(r.scalar("<I", f"metadata {key!r}"), key)
        infos = [_tensor_info(r) for _ in range(n_tensors)]
        header = GGUFHeader(path, version, metadata, {})
        alignment = meta_int(header, "general.alignment", 32)
        if alignment & (alignment - 1):  # MLX's reader divides by it: 0 would crash the process
            raise bad_field(header, "general.alignment", alignment, "a power of two")
        data_start = -(-r.pos // alignment) * alignment
    tensors = {}
    for info, offset in infos:
        n_bytes = _tensor_bytes(info, path)
        end = data_start + offset + n_bytes
        if end > size:
            raise ModelLoadError(
                f"GGUF file {name!r} is truncated: tensor {info.name!r} ends at byte {end} of a {size}-byte file "
                "(an incomplete download?)"
            )
        tensors[info.name] = TensorInfo(info.name, info.shape, info.type_name, data_start + offset, n_bytes)
    return GGUFHeader(path, version, metadata, tensors)


def _tensor_info(r: _Reader) -> tuple[TensorInfo, int]:
    name = r.string("tensor name")
    n_dims = r.scalar("<I", f"tensor {name!r}")
    if not 1 <= n_dims <= 4:
        raise ModelLoadError(f"GGUF file {str(r.path)!r} is corrupt: tensor {name!r} has {n_dims} dimensions")
    shape = tuple(r.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims))
    if not all(1 <= d <= MAX_DIM for d in shape):
        raise ModelLoadError(f"GGUF file {str(r.path)!r} is corrupt: tensor {name!r} has shape {list(shape)}")
    type_id = r.scalar("<I", f"tensor {name!r}")
    offset = r.scalar("<Q", f"tensor {name!r}")
    type_name = _type_name(type_id)
    if type_name not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"GGUF file {str(r.path)!r}: tensor {name!r} has type {type_name}, which the GGUF loader cannot read "
            f"(supported: {', '.join(SUPPORTED_TYPES)}); use a file of the model in one of those (Q4_K_M, Q8_0 or F16)"
        )
    return TensorInfo(name, shape, type_name), offset


def _type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown type {type_id}"


def _tensor_bytes(info: TensorInfo, path: Path) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[info.type_name]]
    n = int(np.prod(info.shape, dtype=object))
    if info.shape[0] % block:
        raise ModelLoadError(
            f"GGUF file {str(path)!r} is corrupt: tensor {info.name!r} rows are not whole {info.type_name} blocks"
        )
    return n // block * block_bytes


# -- typed metadata -----------------------------------------------------------
# Every field the engine reads goes through one of these, so a field of the
# wrong type or out of range is a ModelLoadError naming the file and the field.
_MISSING = object()


def bad_field(h: GGUFHeader, key: str, value, wanted: str) -> ModelLoadError:
    shown = f"an array of {len(value)}" if isinstance(value, (list, np.ndarray)) else repr(value)[:80]
    return ModelLoadError(f"GGUF file {str(h.path)!r}: metadata {key!r} must be {wanted}, got {shown}")


def meta_int(h: GGUFHeader, key: str, default=_MISSING, *, lo: int = 1, hi: int = MAX_DIM) -> int:
    """An integer scalar field in [lo, hi] (``default`` when absent; required
    without one)."""
    value = h.metadata.get(key, default)
    if value is _MISSING:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} lacks the metadata field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad_field(h, key, value, f"an integer from {lo} to {hi}")
    return value


def meta_float(h: GGUFHeader, key: str, default: float) -> float:
    """A finite, positive number (integer or float scalar)."""
    value = h.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise bad_field(h, key, value, "a finite positive number")
    return float(value)


def meta_str(h: GGUFHeader, key: str, default: str | None = None) -> str | None:
    value = h.metadata.get(key, default)
    if value is not None and not isinstance(value, str):
        raise bad_field(h, key, value, "a string")
    return value


def meta_flag(h: GGUFHeader, key: str) -> bool:
    value = h.metadata.get(key, False)
    if not isinstance(value, (bool, int)):
        raise bad_field(h, key, value, "a bool")
    return bool(value)


# -- tensors ------------------------------------------------------------------
def all_mlx_native(h: GGUFHeader) -> bool:
    """Whether every tensor has a type MLX's own reader keeps as it is stored."""
    return all(t.type_name in MLX_NATIVE_TYPES for t in h.tensors.values())


def read_native(h: GGUFHeader) -> Iterator[tuple[str, Any]]:
    """The tensors of a file ``all_mlx_native`` accepts, as ``(name, MLX
    array)`` pairs with the names and bytes ``mx.load`` gives (Q4_0/Q4_1/Q8_0
    as the quantized triple ``.weight``/``.scales``/``.biases``), read one
    tensor at a time from the memory-mapped file (``transcode_native``).
    ``mx.load`` holds Python's GIL while it reads the whole file (100-250 ms
    for SmolLM2), a stall for every other thread's stream; numpy lets go of it."""
    import mlx.core as mx

    from .transcode import NATIVE_BLOCKS, transcode_native

    data = np.memmap(h.path, dtype=np.uint8, mode="r")
    try:
        for info in h.tensors.values():
            raw = data[info.offset : info.offset + info.n_bytes]
            if info.type_name in ("F32", "F16"):
                yield info.name, mx.array(_decode(h, info, raw))
                continue
            if info.type_name not in NATIVE_BLOCKS:
                raise ModelLoadError(
                    f"GGUF file {str(h.path)!r}: tensor {info.name!r} ({info.type_name}) is not of a type MLX holds"
                )
            try:
                parts = transcode_native(info.type_name, raw, info.shape[::-1])
            except ValueError as exc:  # a shape the header walk let through that blocks cannot fill
                raise ModelLoadError(
                    f"GGUF file {str(h.path)!r}: could not read tensor {info.name!r} ({info.type_name}): {exc}"
                ) from exc
            stem = info.name.rpartition(".")[0] or info.name
            for part, array in parts.items():
                yield f"{stem}.{part}", mx.array(array)
    finally:
        del data


def read_decoded(
    h: GGUFHeader, dtype: str = "float32", keep: Callable[[TensorInfo], bool] | None = None
) -> Iterator[tuple[str, Any]]:
    """Each tensor as an MLX array, decoded one at a time by llama.cpp's
    ``gguf.quants.dequantize`` from the memory-mapped file, so that reading
    holds at most the weights made so far plus one tensor. F32 and F16 stay as
    stored; every other type becomes ``dtype`` (float32 on the CPU). A tensor
    ``keep`` accepts comes undecoded, as MLX's quantized arrays (a dict:
    ``transcode.transcode``)."""
    import mlx.core as mx

    from .transcode import transcode

    data = np.memmap(h.path, dtype=np.uint8, mode="r")
    try:
        for info in h.tensors.values():
            raw = data[info.offset : info.offset + info.n_bytes]
            if keep is not None and keep(info):
                yield info.name, {k: mx.array(v) for k, v in transcode(info.type_name, raw, info.shape[::-1]).items()}
                continue
            array = _decode(h, info, raw)
            if info.type_name not in ("F32", "F16"):
                array = array.astype(dtype, copy=False)
            yield info.name, mx.array(array)
            del array
    finally:
        del data


def _decode(h: GGUFHeader, info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    shape = info.shape[::-1]  # numpy order: the fastest-varying dimension last
    if info.type_name == "F32":
        return raw.view(np.float32).reshape(shape)
    if info.type_name == "F16":
        return raw.view(np.float16).reshape(shape)
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    try:
        return quants.dequantize(raw.reshape(rows, info.n_bytes // rows), GGMLQuantizationType[info.type_name]).reshape(
            shape
        )
    except Exception as exc:  # noqa: BLE001 - any decoder failure names the tensor
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r}: could not decode tensor {info.name!r} ({info.type_name}): {exc}"
        ) from exc


def find_gguf(directory: Path) -> Path | None:
    """The single .gguf model file in ``directory`` (multimodal projector files,
    ``mmproj*``, are not models); ``ModelLoadError`` when there are several."""
    found = sorted(p for p in directory.glob("*.gguf") if not p.name.lower().startswith("mmproj"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelLoadError(f"{str(directory)!r} holds several GGUF files ({names}); pass the path of the one to load")
    return found[0] if found else None


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"
