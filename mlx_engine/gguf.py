"""Reading GGUF files: header checks, config, tokenizer and weights.

MLX reads GGUF tensors natively (``mx.load``), but it silently drops tensors of
unknown types and reports unsupported ones without naming them, so the header
is walked here first: every structural problem, unsupported tensor type or
unsupported architecture becomes a ``ModelLoadError`` naming the file, before
any weights are read. The tokenizer is rebuilt from the metadata with
``tokenizers`` (no Hugging Face files needed), and the weights are renamed onto
mlx-lm's model classes.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelLoadError

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

# GGML tensor types by id. Only the first group loads: F32/F16 as arrays and
# Q4_0/Q4_1/Q8_0 as MLX quantized triples (group size 32). MLX's reader turns a
# few K-quants into float16 with unverified rounding and fails on the rest.
LOADABLE_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}
OTHER_TYPES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    type_name: str


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
    may use at most ``MAX_HEADER_BYTES`` of it."""

    _U64 = struct.Struct("<Q")

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path
        self.end = min(len(buf), MAX_HEADER_BYTES)

    def corrupt(self, what: str) -> ModelLoadError:
        if self.end < len(self.buf):
            return ModelLoadError(
                f"GGUF file {str(self.path)!r}: {what} runs past the end of the file or past {MAX_HEADER_BYTES} "
                "bytes of header (the most this loader reads)"
            )
        return ModelLoadError(f"GGUF file {str(self.path)!r} is truncated or corrupt: {what} runs past the end of the file")

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
        raise ModelLoadError(f"GGUF file {str(self.path)!r} is corrupt: metadata {key!r} has unknown value type {vtype}")

    def array(self, key: str):
        """Numbers and bools as one numpy array (read in bulk), strings as a list
        of str; ``MAX_ARRAY_ITEMS`` bounds the declared count before any is read."""
        what = f"metadata {key!r}"
        item_type = self.scalar("<I", what)
        if item_type not in _SCALARS and item_type != _STRING:
            raise ModelLoadError(f"GGUF file {str(self.path)!r} is corrupt: {what} is an array of value type {item_type}")
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


def read_header(path: Path) -> GGUFHeader:
    """Walk a GGUF file's header (metadata and tensor table) without reading
    weights; raises ``ModelLoadError`` for anything malformed."""
    stat = path.stat()
    return _read_header_cached(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_header_cached(name: str, size: int, mtime_ns: int) -> GGUFHeader:
    path = Path(name)
    if size < 24:
        raise ModelLoadError(f"GGUF file {name!r} is too small ({size} bytes) to be a GGUF model")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _Reader(buf, path)
        if r.take(4, "magic") != GGUF_MAGIC:
            raise ModelLoadError(f"{name!r} is not a GGUF file (its first bytes are not 'GGUF')")
        version = r.scalar("<I", "version")
        if version not in (2, 3):
            raise ModelLoadError(f"GGUF file {name!r} has version {version}; supported: 2 and 3")
        n_tensors, n_kv = r.scalar("<Q", "tensor count"), r.scalar("<Q", "metadata count")
        if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
            raise ModelLoadError(f"GGUF file {name!r} is corrupt: it declares {n_tensors} tensors and {n_kv} metadata keys")
        metadata = {}
        for _ in range(n_kv):
            key = r.string("metadata key")
            metadata[key] = r.value(r.scalar("<I", f"metadata {key!r}"), key)
        infos = [_tensor_info(r) for _ in range(n_tensors)]
        header = GGUFHeader(path, version, metadata, {})
        alignment = _int(header, "general.alignment", 32)
        if alignment & (alignment - 1):  # MLX's reader divides by it: 0 would crash the process
            raise _bad_field(header, "general.alignment", alignment, "a power of two")
        data_start = -(-r.pos // alignment) * alignment
    tensors = {}
    for info, offset in infos:
        end = data_start + offset + _tensor_bytes(info, path)
        if end > size:
            raise ModelLoadError(
                f"GGUF file {name!r} is truncated: tensor {info.name!r} ends at byte {end} of a {size}-byte file "
                "(an incomplete download?)"
            )
        tensors[info.name] = info
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
    if type_id not in LOADABLE_TYPES:
        type_name = OTHER_TYPES.get(type_id, f"unknown type {type_id}")
        supported = ", ".join(t[0] for t in LOADABLE_TYPES.values())
        raise ModelLoadError(
            f"GGUF file {str(r.path)!r}: tensor {name!r} has type {type_name}, which MLX cannot load "
            f"(supported: {supported}); use a Q4_0, Q4_1, Q8_0 or F16 file of the model"
        )
    return TensorInfo(name, shape, LOADABLE_TYPES[type_id][0]), offset


def _tensor_bytes(info: TensorInfo, path: Path) -> int:
    _, block, block_bytes = next(t for t in LOADABLE_TYPES.values() if t[0] == info.type_name)
    n = int(np.prod(info.shape, dtype=object))
    if info.shape[0] % block:
        raise ModelLoadError(f"GGUF file {str(path)!r} is corrupt: tensor {info.name!r} rows are not whole {info.type_name} blocks")
    return n // block * block_bytes


# -- typed metadata -----------------------------------------------------------
# Every field the engine reads goes through one of these, so a field of the
# wrong type or out of range is a ModelLoadError naming the file and the field.
_MISSING = object()


def _bad_field(h: GGUFHeader, key: str, value, wanted: str) -> ModelLoadError:
    shown = f"an array of {len(value)}" if isinstance(value, (list, np.ndarray)) else repr(value)[:80]
    return ModelLoadError(f"GGUF file {str(h.path)!r}: metadata {key!r} must be {wanted}, got {shown}")


def _int(h: GGUFHeader, key: str, default=_MISSING, *, lo: int = 1, hi: int = MAX_DIM) -> int:
    """An integer scalar field in [lo, hi] (``default`` when absent; required
    without one)."""
    value = h.metadata.get(key, default)
    if value is _MISSING:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} lacks the metadata field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad_field(h, key, value, f"an integer from {lo} to {hi}")
    return value


def _float(h: GGUFHeader, key: str, default: float) -> float:
    """A finite, positive number (integer or float scalar)."""
    value = h.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise _bad_field(h, key, value, "a finite positive number")
    return float(value)


def _str(h: GGUFHeader, key: str, default: str | None = None) -> str | None:
    value = h.metadata.get(key, default)
    if value is not None and not isinstance(value, str):
        raise _bad_field(h, key, value, "a string")
    return value


def _flag(h: GGUFHeader, key: str) -> bool:
    value = h.metadata.get(key, False)
    if not isinstance(value, (bool, int)):
        raise _bad_field(h, key, value, "a bool")
    return bool(value)


# -- config -------------------------------------------------------------------
# Architectures whose GGUF tensors map onto an mlx-lm model with the names below.
# llama.cpp stores llama's q/k rows permuted for interleaved RoPE, which mlx-lm's
# llama computes with rope_traditional=True; qwen2 is stored unpermuted.
ARCHITECTURES = {
    "llama": {"model_type": "llama", "rope_traditional": True},
    "qwen2": {"model_type": "qwen2", "rope_traditional": False},
}


def config_from_header(h: GGUFHeader) -> dict:
    """An mlx-lm (Hugging Face style) config from the ``<arch>.*`` metadata,
    checked against the tensor table so no absurd model is ever allocated."""
    arch = _str(h, "general.architecture", "")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} has architecture {arch or None!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    heads = _int(h, f"{arch}.attention.head_count")
    config = dict(
        ARCHITECTURES[arch],
        hidden_size=_int(h, f"{arch}.embedding_length"),
        num_hidden_layers=_int(h, f"{arch}.block_count"),
        intermediate_size=_int(h, f"{arch}.feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=_int(h, f"{arch}.attention.head_count_kv", heads),
        rms_norm_eps=_float(h, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=_float(h, f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=_int(h, f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in h.tensors,
    )
    if f"{arch}.attention.key_length" in h.metadata:
        config["head_dim"] = _int(h, f"{arch}.attention.key_length")
    embed = h.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} has no two-dimensional 'token_embd.weight' tensor")
    config["vocab_size"] = int(embed.shape[-1])
    _check_rope(h, config)
    _check_blocks(h, config["num_hidden_layers"])
    _check_dims(h, config)
    return config


def _check_dims(h: GGUFHeader, config: dict) -> None:
    """The declared sizes against the first block's tensors (GGUF lists the
    input dimension first), so the model built from them matches the file."""
    arch, hidden = h.architecture, config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise _bad_field(h, f"{arch}.attention.head_count_kv", kv_heads, f"a divisor of head_count ({heads})")
    head_dim = config.get("head_dim") or hidden // heads
    expected = {
        "token_embd.weight": (0, hidden, "embedding_length"),
        "blk.0.ffn_up.weight": (1, config["intermediate_size"], "feed_forward_length"),
        "blk.0.attn_q.weight": (1, heads * head_dim, "attention.head_count"),
        "blk.0.attn_k.weight": (1, kv_heads * head_dim, "attention.head_count_kv"),
    }
    for name, (axis, size, field) in expected.items():
        info = h.tensors.get(name)
        if info is not None and (len(info.shape) <= axis or info.shape[axis] != size):
            raise ModelLoadError(
                f"GGUF file {str(h.path)!r}: metadata '{arch}.{field}' (and the sizes derived from it, {size}) "
                f"does not match tensor {name!r} of shape {list(info.shape)}"
            )


def _check_rope(h: GGUFHeader, config: dict) -> None:
    arch = h.architecture
    scaling = _str(h, f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in h.tensors or scaling not in ("none", "linear"):
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} uses RoPE scaling ({scaling}, rope_freqs: {'rope_freqs.weight' in h.tensors}), "
            "which the GGUF loader does not map yet"
        )
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": _float(h, f"{arch}.rope.scaling.factor", None)}


def _check_blocks(h: GGUFHeader, n_layers: int) -> None:
    blocks = {int(m.group(1)) for name in h.tensors if (m := re.match(r"blk\.(\d+)\.", name))}
    if len(blocks) != n_layers or (blocks and max(blocks) != n_layers - 1):  # never builds range(n_layers)
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} declares {n_layers} layers but holds tensors for "
            f"{len(blocks)} (blocks {min(blocks, default=None)}..{max(blocks, default=None)})"
        )


# -- weights ------------------------------------------------------------------
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def mlx_name(name: str, path: Path) -> str:
    """The mlx-lm parameter name of a GGUF tensor (``.scales``/``.biases`` are
    the quantization triple MLX's reader adds)."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{suffix}"
    raise ModelLoadError(f"GGUF file {str(path)!r} has a tensor {name!r} the loader does not know how to map")


def load_model(h: GGUFHeader, config: dict):
    """Build the mlx-lm model for ``config`` and load the file's tensors into it,
    keeping quantized tensors quantized (``compute_dtype`` decides later)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    try:
        raw = mx.load(str(h.path))
    except Exception as exc:  # MLX's reader found what the header walk could not
        raise ModelLoadError(f"could not read GGUF tensors from {str(h.path)!r}: {exc}") from exc
    weights = {mlx_name(k, h.path): v for k, v in raw.items()}
    bits = {
        k[: -len(".scales")]: weights[k[: -len(".scales")] + ".weight"].shape[-1] * 32 // (v.shape[-1] * 32)
        for k, v in weights.items()
        if k.endswith(".scales")
    }
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if bits:
        nn.quantize(model, class_predicate=lambda p, m: {"group_size": 32, "bits": bits[p]} if p in bits else False)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} does not match its declared shapes: {exc}") from exc
    mx.eval(model.parameters())
    model.eval()
    return model


# -- tokenizer ----------------------------------------------------------------
# How each ``tokenizer.ggml.pre`` splits text before byte-level BPE, written as
# the Hugging Face tokenizer of the same model does it.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact"):  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"qwen2": _QWEN2_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}.get(pre)
    if split is None:
        logger.warning("GGUF pre-tokenizer %r is not known; splitting text as GPT-2 does", pre)
        return byte_level
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _token_list(h: GGUFHeader, key: str) -> list[str]:
    value = h.metadata.get(key)
    if value is None or (isinstance(value, list) and not value):
        raise ModelLoadError(f"GGUF file {str(h.path)!r} has no tokenizer: metadata {key!r} is missing or empty")
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise _bad_field(h, key, value, "an array of strings")
    return value


def _token_types(h: GGUFHeader, n_tokens: int) -> list[int]:
    key = "tokenizer.ggml.token_type"
    value = h.metadata.get(key)
    if value is None:
        return [1] * n_tokens
    if not (isinstance(value, np.ndarray) and value.dtype.kind in "iu" and len(value) == n_tokens):
        raise _bad_field(h, key, value, f"an array of {n_tokens} integers (one per token)")
    return value.tolist()


def _special_token(h: GGUFHeader, tokens: list[str], name: str) -> str | None:
    key = f"tokenizer.ggml.{name}_token_id"
    if key not in h.metadata:
        return None
    return tokens[_int(h, key, lo=0, hi=len(tokens) - 1)]


def load_tokenizer(h: GGUFHeader):
    """The file's byte-level BPE tokenizer (``tokenizer.ggml.model == 'gpt2'``)
    as an mlx-lm ``TokenizerWrapper``: control tokens (type 3) are special and
    user-defined ones (type 4) are added tokens, so both encode whole."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = _str(h, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} has tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)"
        )
    tokens = _token_list(h, "tokenizer.ggml.tokens")
    merges = _token_list(h, "tokenizer.ggml.merges")
    types = _token_types(h, len(tokens))
    if len(set(tokens)) != len(tokens):
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: metadata 'tokenizer.ggml.tokens' holds a token twice")
    try:
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
    except Exception as exc:
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: could not build its BPE tokenizer: {exc}") from exc
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(_str(h, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    special = {name: _special_token(h, tokens, key) for name, key in
               (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))}  # fmt: skip
    if _flag(h, "tokenizer.ggml.add_bos_token") and special["bos_token"] is not None:
        bos = special["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=_str(h, "tokenizer.chat_template"),
        model_max_length=_int(h, f"{h.architecture}.context_length", 4096),
        **{k: v for k, v in special.items() if v is not None},
    )
    eos = [tokens.index(special["eos_token"])] if special["eos_token"] is not None else []
    return TokenizerWrapper(fast, BPEStreamingDetokenizer, eos_token_ids=eos)


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
