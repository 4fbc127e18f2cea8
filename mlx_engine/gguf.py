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
    """Bounds-checked little-endian reads over a memory-mapped file."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelLoadError(f"GGUF file {str(self.path)!r} is truncated or corrupt: {what} runs past the end of the file")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str) -> int:
        n = self.scalar("<Q", what)
        # Every element takes at least one byte, so a count beyond the bytes left is corrupt.
        if n > len(self.buf) - self.pos:
            raise ModelLoadError(f"GGUF file {str(self.path)!r} is corrupt: {what} declares {n} entries")
        return n

    def string(self, what: str) -> str:
        raw = self.take(self.count(what), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], f"metadata {key!r}")
        if vtype == _STRING:
            return self.string(f"metadata {key!r}")
        if vtype == _ARRAY and depth == 0:
            return self.array(key)
        raise ModelLoadError(f"GGUF file {str(self.path)!r} is corrupt: metadata {key!r} has unknown value type {vtype}")

    def array(self, key: str):
        item_type = self.scalar("<I", f"metadata {key!r}")
        n = self.count(f"metadata {key!r}")
        if item_type in _SCALARS and item_type != 7:
            fmt = _SCALARS[item_type]
            raw = self.take(n * struct.calcsize(fmt), f"metadata {key!r}")
            return np.frombuffer(raw, dtype=np.dtype(fmt)).copy()
        return [self.value(item_type, key, depth=1) for _ in range(n)]


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
        alignment = int(metadata.get("general.alignment", 32)) or 32
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
    arch = h.architecture
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} has architecture {arch or None!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    md = h.metadata

    def need(key: str) -> int:
        value = md.get(f"{arch}.{key}")
        if value is None or int(value) <= 0:
            raise ModelLoadError(f"GGUF file {str(h.path)!r} lacks a positive '{arch}.{key}'")
        return int(value)

    heads = need("attention.head_count")
    config = dict(
        ARCHITECTURES[arch],
        hidden_size=need("embedding_length"),
        num_hidden_layers=need("block_count"),
        intermediate_size=need("feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=int(md.get(f"{arch}.attention.head_count_kv", heads)),
        rms_norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(md.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in h.tensors,
    )
    if f"{arch}.attention.key_length" in md:
        config["head_dim"] = int(md[f"{arch}.attention.key_length"])
    embed = h.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} has no 'token_embd.weight' tensor")
    config["vocab_size"] = int(embed.shape[-1])
    _check_rope(h, config)
    _check_blocks(h, config["num_hidden_layers"])
    return config


def _check_rope(h: GGUFHeader, config: dict) -> None:
    arch, md = h.architecture, h.metadata
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in h.tensors or scaling not in ("none", "linear"):
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} uses RoPE scaling ({scaling}, rope_freqs: {'rope_freqs.weight' in h.tensors}), "
            "which the GGUF loader does not map yet"
        )
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(md[f"{arch}.rope.scaling.factor"])}


def _check_blocks(h: GGUFHeader, n_layers: int) -> None:
    blocks = {int(m.group(1)) for name in h.tensors if (m := re.match(r"blk\.(\d+)\.", name))}
    if blocks != set(range(n_layers)):
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


def _token_list(h: GGUFHeader, key: str) -> list:
    value = h.metadata.get(key)
    if not isinstance(value, list) or not value:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} has no tokenizer: metadata {key!r} is missing or empty")
    return value


def _special_token(h: GGUFHeader, tokens: list[str], name: str) -> str | None:
    token_id = h.metadata.get(f"tokenizer.ggml.{name}_token_id")
    if token_id is None:
        return None
    if not 0 <= int(token_id) < len(tokens):
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: {name}_token_id {int(token_id)} is outside the vocabulary")
    return tokens[int(token_id)]


def load_tokenizer(h: GGUFHeader):
    """The file's byte-level BPE tokenizer (``tokenizer.ggml.model == 'gpt2'``)
    as an mlx-lm ``TokenizerWrapper``: control tokens (type 3) are special and
    user-defined ones (type 4) are added tokens, so both encode whole."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    md = h.metadata
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} has tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)"
        )
    tokens = _token_list(h, "tokenizer.ggml.tokens")
    merges = _token_list(h, "tokenizer.ggml.merges")
    types = list(md.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens) or len(set(tokens)) != len(tokens):
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: the tokenizer's tokens and token types do not match")
    try:
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
    except Exception as exc:
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: could not build its BPE tokenizer: {exc}") from exc
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(md.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    special = {name: _special_token(h, tokens, key) for name, key in
               (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))}  # fmt: skip
    if bool(md.get("tokenizer.ggml.add_bos_token", False)) and special["bos_token"] is not None:
        bos = special["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=md.get("tokenizer.chat_template"),
        model_max_length=int(md.get(f"{h.architecture}.context_length", 4096)),
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
