"""Checks of a model directory that run before anything is built or allocated.

A hostile or broken ``config.json`` must fail with a ``ModelLoadError`` naming the
file and the field, not with whatever the architecture code happens to raise,
and never after building a model far bigger than the weights on disk (a config
declaring a million layers would otherwise allocate gigabytes before failing).
The weight files are checked from their safetensors headers only: a few KiB
read per file, no tensor data."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import ModelLoadError

_MODEL_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
# Size fields read by the architecture code: a positive integer each (a list of
# them where some architectures vary it per layer).
_SIZE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
_PER_LAYER_OK = ("intermediate_size", "num_attention_heads", "num_key_value_heads")
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors JSON header larger than this is refused
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
# Indices of repeated blocks in weight names ("model.layers.3.mlp...", "transformer.h.3...").
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_NOT_TEXT_LAYERS = re.compile(r"vision|visual|audio|image|mm_|multi_modal|projector|mtp", re.IGNORECASE)


MAX_JSON_BYTES = 512 * 2**20  # config, tokenizer and processor files larger than this are refused


def check_model_files(path: Path) -> None:
    """Every file the loaders may open must be a regular file (symlinks are
    followed): a name pointing at a device, FIFO or directory (e.g. a
    ``tokenizer.json`` linked to /dev/zero) would block or grow memory forever
    when read. Text files larger than MAX_JSON_BYTES are refused."""
    for entry in sorted(path.iterdir()):
        name = entry.name
        if not (
            name.endswith((".json", ".safetensors", ".jinja", ".txt", ".model", ".tiktoken")) or name == "merges.txt"
        ):
            continue
        try:
            ok = entry.is_file()  # follows symlinks
            size = entry.stat().st_size if ok else 0
        except OSError as exc:  # a symlink loop, permissions
            raise ModelLoadError(f"{str(entry)!r} cannot be read: {exc}") from exc
        if not ok and os.path.lexists(entry):
            if entry.is_dir():
                continue  # a folder named like a file is never opened as one
            raise ModelLoadError(
                f"{str(entry)!r} is not a regular file (a device, FIFO, dangling link or symlink loop?)"
            )
        if ok and not name.endswith(".safetensors") and size > MAX_JSON_BYTES:
            raise ModelLoadError(f"{str(entry)!r} is {size} bytes; files of this kind are at most {MAX_JSON_BYTES}")


def check_config_fields(config: dict, path: Path) -> None:
    """``model_type`` and the size fields (top level and ``text_config``) have
    the types the architecture code assumes."""
    where = f"config.json in {str(path)!r}"
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not _MODEL_TYPE.match(model_type):
        raise ModelLoadError(f"{where}: 'model_type' must be an architecture name (a short string), got {model_type!r}")
    sections = [("", config)]
    if "text_config" in config:
        if not isinstance(config["text_config"], dict):
            raise ModelLoadError(
                f"{where}: 'text_config' must be a JSON object, got {type(config['text_config']).__name__}"
            )
        sections.append(("text_config.", config["text_config"]))
    for prefix, cfg in sections:
        for name in _SIZE_FIELDS:
            value = cfg.get(name)
            if value is None or _positive_int(value):
                continue
            if name in _PER_LAYER_OK and isinstance(value, list) and value and all(_positive_int(v) for v in value):
                continue
            raise ModelLoadError(f"{where}: '{prefix}{name}' must be a positive integer, got {value!r}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(
    file: Path, opened: BinaryIO | None = None, kind: str = "weight file"
) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, checked against the file's size
    (so a truncated file is found here); reads only the header. ``opened``: the
    file already open (a caller that checked what it opened, e.g. that it is a
    regular file); ``kind`` names the file in errors."""
    try:
        if opened is not None:
            return _parse_header(opened, file, kind)
        with open(file, "rb") as f:
            return _parse_header(f, file, kind)
    except ModelLoadError:
        raise
    except (OSError, ValueError) as exc:  # unreadable, symlink loop, bad JSON / UTF-8
        raise ModelLoadError(f"{kind} {str(file)!r} is not a readable safetensors file: {exc}") from exc


def _parse_header(f: BinaryIO, file: Path, kind: str) -> dict[str, TensorInfo]:
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    raw_len = f.read(8)
    if len(raw_len) < 8:
        raise ModelLoadError(f"{kind} {str(file)!r} is too short to be safetensors ({size} bytes)")
    (n,) = struct.unpack("<Q", raw_len)
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise ModelLoadError(f"{kind} {str(file)!r} declares a {n}-byte header; the file has {size} bytes")
    header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ModelLoadError(f"{kind} {str(file)!r} has a malformed safetensors header")
    data_size = size - 8 - n
    return {
        name: _tensor_info(f"{kind} {str(file)!r}", file.name, name, entry, data_size)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _tensor_info(where: str, file_name: str, name: str, entry, data_size: int) -> TensorInfo:
    bad = f"{where}: tensor {name!r}"
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise ModelLoadError(f"{bad} has a malformed header entry") from None
    if not (isinstance(shape, list) and all(_positive_int(d) or d == 0 for d in shape)):
        raise ModelLoadError(f"{bad} has an invalid shape {shape!r}")
    if dtype not in _DTYPE_BYTES:
        raise ModelLoadError(f"{bad} has an unsupported dtype {dtype!r}")
    if (
        not (_positive_int(end) or end == 0)
        or not (_positive_int(begin) or begin == 0)
        or not begin <= end <= data_size
    ):
        raise ModelLoadError(
            f"{bad} lies outside the file (offsets {begin}..{end}, {data_size} data bytes): truncated?"
        )
    if end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
        raise ModelLoadError(f"{bad} has {end - begin} bytes for shape {shape} of {dtype}")
    return TensorInfo(file_name, dtype, tuple(shape))


def check_weights_match_config(config: dict, path: Path, files: list[Path]) -> None:
    """Compare the config's layer count and embedding size with the tensors the
    weight files declare, before the model is built."""
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        tensors.update(read_safetensors_header(file))
    if not tensors:
        raise ModelLoadError(f"the weight files in {str(path)!r} hold no tensors")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    declared = text.get("num_hidden_layers")
    found = {
        int(m.group(1))
        for name in tensors
        if not _NOT_TEXT_LAYERS.search(name)
        for m in [_LAYER_INDEX.search(name)]
        if m
    }
    if isinstance(declared, int) and found and declared > max(found) + 1:
        raise ModelLoadError(
            f"config.json in {str(path)!r} declares num_hidden_layers={declared} but the weight files hold "
            f"{max(found) + 1} layers"
        )
    if config.get("quantization") or text.get("quantization"):
        return  # packed widths; mlx-lm checks quantized shapes when it loads them
    for name, info in tensors.items():
        if not name.endswith(("embed_tokens.weight", "wte.weight", "tok_embeddings.weight")) or _NOT_TEXT_LAYERS.search(
            name
        ):
            continue
        for field, size in zip(("vocab_size", "hidden_size"), info.shape):
            want = text.get(field)
            if isinstance(want, int) and want != size:
                raise ModelLoadError(
                    f"config.json in {str(path)!r} declares {field}={want} but {name!r} in {info.file!r} has shape {list(info.shape)}"
                )
