"""GGUF model families mapped onto mlx-lm's model classes: the config built from
a file's ``<arch>.*`` metadata, the tensor names, and the few transforms
llama.cpp's converter (``convert_hf_to_gguf.py``) applied that must be undone.

The families are mapped, each with what the converter does to it, in dense.py
(``llama``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``, ``phi3``), recurrent.py
(``lfm2``, ``mamba2``, ``granitehybrid``), mamba_hybrids.py (``nemotron_h``,
``falcon-h1``), moe.py (``qwen3moe``, ``gpt-oss``) and qwen35.py (Qwen3.5,
Qwen3-Next); what every family shares (``Family``) is in family.py. This module
joins them in one table (``FAMILIES``), builds and checks the config, names
the tensors and loads the weights.
"""

from __future__ import annotations

import logging
import re

from ...errors import ModelLoadError
from ..evaluation import eval_piecewise
from .dense import DENSE_FAMILIES
from .family import Family, kv_heads_per_layer
from .mamba_hybrids import MAMBA_HYBRID_FAMILIES
from .moe import MOE_FAMILIES, is_expert_tensor
from .qwen35 import QWEN35_FAMILIES, MTPHead, mtp_name
from .reader import (
    GGUFHeader,
    all_mlx_native,
    bad_field,
    meta_float,
    meta_int,
    meta_str,
    read_decoded,
    read_native,
)
from .recurrent import RECURRENT_FAMILIES
from .transcode import TRANSCODED

logger = logging.getLogger(__name__)

FAMILIES = {
    **DENSE_FAMILIES,
    **RECURRENT_FAMILIES,
    **MAMBA_HYBRID_FAMILIES,
    **MOE_FAMILIES,
    **QWEN35_FAMILIES,
}


def config_from_header(h: GGUFHeader) -> dict:
    """An mlx-lm (Hugging Face style) config from the ``<arch>.*`` metadata,
    checked against the tensor table so no absurd model is ever allocated."""
    arch = meta_str(h, "general.architecture", "")
    if arch not in FAMILIES:
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} has architecture {arch or None!r}; supported: {', '.join(FAMILIES)}"
        )
    family = FAMILIES[arch]
    if family.own_config is not None:
        return _checked(h, family, family.own_config(h))
    heads, n_layers = meta_int(h, f"{arch}.attention.head_count"), meta_int(h, f"{arch}.block_count")
    config = dict(
        family.config,
        model_type=family.model_type,
        hidden_size=meta_int(h, f"{arch}.embedding_length"),
        num_hidden_layers=n_layers,
        intermediate_size=meta_int(h, f"{arch}.feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=_kv_heads(h, family, n_layers),
        rms_norm_eps=meta_float(h, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta_float(h, f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=meta_int(h, f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in h.tensors,
    )
    if f"{arch}.attention.key_length" in h.metadata:
        config["head_dim"] = meta_int(h, f"{arch}.attention.key_length")
    _check_rope(h, config, family)
    config = _checked(h, family, config)
    _check_dims(h, config)
    return config


def _checked(h: GGUFHeader, family: Family, config: dict) -> dict:
    """``config`` with the vocabulary size, after the checks every family shares
    and the family's own (``extra_config``)."""
    embed = h.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} has no two-dimensional 'token_embd.weight' tensor")
    config["vocab_size"] = int(embed.shape[-1])
    _check_vocabulary(h, config["vocab_size"])
    family.extra_config(h, config)
    # MTP blocks (qwen35's ``nextn``) follow the layers and are counted in block_count
    _check_blocks(h, config["num_hidden_layers"] + meta_int(h, f"{h.architecture}.nextn_predict_layers", 0, lo=0))
    return config


def _kv_heads(h: GGUFHeader, family: Family, n_layers: int) -> int:
    """The one KV head count of the attention layers (mlx-lm's classes take one);
    a per-layer 0 (no attention) only in families with recurrent layers."""
    per_layer = kv_heads_per_layer(h, n_layers)
    attention = sorted({n for n in per_layer if n})
    if len(attention) != 1 or (0 in per_layer and not family.recurrent_layers):
        wanted = "the same count for every attention layer" + (
            ", 0 for a recurrent one" if family.recurrent_layers else ""
        )
        raise bad_field(h, f"{h.architecture}.attention.head_count_kv", per_layer, wanted)
    return attention[0]


def _check_vocabulary(h: GGUFHeader, rows: int) -> None:
    """One embedding row per token of a SentencePiece vocabulary, as llama.cpp
    requires: with fewer tokens than rows the model can generate ids the
    tokenizer cannot decode (IndexError in the middle of a generation), with
    more the tokenizer makes ids the model has no row for. (A byte-level BPE
    tokenizer decodes an id past its vocabulary as nothing, so a file padded
    only in its embedding still loads.)"""
    tokens = h.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(h.metadata.get("tokenizer.ggml.model"), str) or h.metadata["tokenizer.ggml.model"] != "llama":
        return  # not SentencePiece, or not a name at all (the tokenizer's own checks say so)
    if isinstance(tokens, (list, tuple)) and len(tokens) != rows:
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r}: its tokenizer has {len(tokens)} tokens but 'token_embd.weight' has "
            f"{rows} rows; they must be equal (llama.cpp refuses such a file too)"
        )


def _check_dims(h: GGUFHeader, config: dict) -> None:
    """The declared sizes against the first block's tensors (GGUF lists the
    input dimension first), so the model built from them matches the file."""
    arch, hidden = h.architecture, config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise bad_field(h, f"{arch}.attention.head_count_kv", kv_heads, f"a divisor of head_count ({heads})")
    head_dim, inter = config.get("head_dim") or hidden // heads, config["intermediate_size"]
    fused = arch == "phi3"
    gated = 2 if arch in ("qwen35", "qwen35moe", "qwen3next") else 1  # attn_q holds the queries and their output gate
    attn = next((i for i in range(config["num_hidden_layers"]) if f"blk.{i}.attn_k.weight" in h.tensors), 0)
    expected = {
        "token_embd.weight": (0, hidden, "embedding_length"),
        "blk.0.ffn_up.weight": (1, 2 * inter if fused else inter, "feed_forward_length"),
        f"blk.{attn}.attn_q.weight": (1, gated * heads * head_dim, "attention.head_count"),
        f"blk.{attn}.attn_k.weight": (1, kv_heads * head_dim, "attention.head_count_kv"),
    }
    if arch == "phi3":  # elsewhere (qwen35) attn_qkv is a linear-attention projection
        expected["blk.0.attn_qkv.weight"] = (1, (heads + 2 * kv_heads) * head_dim, "attention.head_count")
    for name, (axis, size, field_name) in expected.items():
        info = h.tensors.get(name)
        if info is not None and (len(info.shape) <= axis or info.shape[axis] != size):
            raise ModelLoadError(
                f"GGUF file {str(h.path)!r}: metadata '{arch}.{field_name}' (and the sizes derived from it, {size}) "
                f"does not match tensor {name!r} of shape {list(info.shape)}"
            )


def _check_rope(h: GGUFHeader, config: dict, family: Family) -> None:
    arch = h.architecture
    scaling = meta_str(h, f"{arch}.rope.scaling.type", "none")
    freqs = h.tensors.get("rope_freqs.weight")
    if scaling == "yarn" and family.yarn:
        return  # the family's extra_config reads it
    if scaling not in ("none", "linear") or (freqs is not None and not family.rope_freqs):
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} uses RoPE scaling ({scaling}, rope_freqs: {freqs is not None}), "
            f"which the GGUF loader does not map for {arch}"
        )
    if freqs is not None:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        if freqs.shape != (head_dim // 2,) or freqs.type_name != "F32":
            raise ModelLoadError(
                f"GGUF file {str(h.path)!r}: tensor 'rope_freqs.weight' must be F32 of shape [{head_dim // 2}], "
                f"got {freqs.type_name} {list(freqs.shape)}"
            )
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": meta_float(h, f"{arch}.rope.scaling.factor", None)}


def _check_blocks(h: GGUFHeader, n_layers: int) -> None:
    blocks = {int(m.group(1)) for name in h.tensors if (m := re.match(r"blk\.(\d+)\.", name))}
    if len(blocks) != n_layers or (blocks and max(blocks) != n_layers - 1):  # never builds range(n_layers)
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} declares {n_layers} layers but holds tensors for "
            f"{len(blocks)} (blocks {min(blocks, default=None)}..{max(blocks, default=None)})"
        )


def mlx_name(name: str, h: GGUFHeader) -> str:
    """The mlx-lm parameter name of a GGUF tensor (``.scales``/``.biases`` are
    the quantization triple MLX's reader adds)."""
    stem, _, suffix = name.rpartition(".")
    family = FAMILIES[h.architecture]
    if stem in family.global_names:
        return f"{family.global_names[stem]}.{suffix}"
    bare = re.fullmatch(r"blk\.(\d+)\.(\w+)", name)
    if bare and bare.group(2) in family.bare_names:
        return f"{family.layer_prefix}.{bare.group(1)}.{family.bare_names[bare.group(2)]}"
    m = re.fullmatch(r"blk\.(\d+)\.([\w.]+)", stem)
    if m and m.group(2) in family.block_names:
        target = family.block_names[m.group(2)]
        if not target.endswith(("dt_bias", "sinks")):
            return f"{family.layer_prefix}.{m.group(1)}.{target}.{suffix}"
        if suffix == ("bias" if target.endswith("dt_bias") else "weight"):  # parameters of their own in mlx-lm
            return f"{family.layer_prefix}.{m.group(1)}.{target}"
    raise ModelLoadError(f"GGUF file {str(h.path)!r} has a tensor {name!r} the loader does not know how to map")


# MLX affine bits for a decoded type whose weights stay quantized (Metal):
# two bits more than the source's own weight bits (MLX has no 7-bit format, so
# 5-bit types take 8), in groups of 32. An affine grid only reproduces a GGUF
# block's levels where the block uses its extreme codes, so the same bit width
# loses as much again as the file's own rounding; two more bits keep the added
# error small (docs/gguf.md gives the measured logit differences).
# F32, F16 and BF16 stay float16.
REQUANT_BITS = {
    "Q2_K": 4,
    "Q3_K": 5,
    "Q4_0": 6,
    "Q4_1": 6,
    "Q4_K": 6,
    "IQ4_NL": 6,
    "IQ4_XS": 6,
    "Q5_0": 8,
    "Q5_1": 8,
    "Q5_K": 8,
    "Q6_K": 8,
    "Q8_0": 8,
}
REQUANT_GROUP = 32
# Stacked MoE experts, the bulk of an MoE file, re-quantized at the source's
# own width where it has no exact MLX equivalent (transcode.py): Q6_K's 16-value
# sub-blocks at 6 bits in groups of 32 take 7 bits a weight against the file's
# 6.56 (at 8 bits 9, 1.37x), for 0.9-1.0% relative RMS logit difference from
# the decoded model on the llama.cpp Q4_K_M fixtures (docs/gguf.md).
EXPERT_REQUANT_BITS = {**REQUANT_BITS, "Q6_K": 6}


def load_model(h: GGUFHeader, config: dict, *, keep_quantized: bool | None = None):
    """Build the mlx-lm model for ``config`` and load the file's tensors into it.
    A file of MLX-native types only keeps Q4_0/Q4_1/Q8_0 quantized (as MLX's
    reader gives them; ``compute_dtype`` decides later). Any other file is
    decoded tensor by tensor: to float32 on the CPU (the fast path there);
    elsewhere (``keep_quantized``, by default off the CPU) to float16, with the
    matrices of quantized types re-quantized to MLX's affine format by
    ``REQUANT_BITS``. Stacked MoE expert tensors stay quantized everywhere:
    re-packed where MLX has their format (transcode.py), else re-quantized by
    ``EXPERT_REQUANT_BITS``. A family's MTP blocks become ``model.mtp``."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if keep_quantized is None:
        keep_quantized = mx.default_device() != mx.cpu
    native = all_mlx_native(h) and not FAMILIES[h.architecture].decoded
    weights, source_types, rope_freqs, modes, mtp = _read_weights(h, native, "float16" if keep_quantized else "float32")
    if FAMILIES[h.architecture].combine is not None:
        weights = FAMILIES[h.architecture].combine(h, weights)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
        # qwen3_5's sanitize moves the text model under its multimodal wrapper's prefix
        source_types.update({f"language_model.{k}": t for k, t in source_types.items()})
    if not native:
        weights = requantize(model, weights, source_types, h, dense=keep_quantized)
    quantized = {
        k[: -len(".scales")]: {
            "group_size": 32,
            "bits": weights[k[: -len(".scales")] + ".weight"].shape[-1] * 32 // (v.shape[-1] * 32),
            "mode": modes.get(k[: -len(".scales")], "affine"),
        }
        for k, v in weights.items()
        if k.endswith(".scales")
    }
    if quantized:
        nn.quantize(model, class_predicate=lambda p, m: quantized.get(p, False))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} does not match its declared shapes: {exc}") from exc
    if rope_freqs is not None:
        _use_rope_freqs(model, config, rope_freqs)
    if mtp:
        model.mtp = MTPHead(mtp)  # not a parameter of the model: a value for a hidden-state drafter
        eval_piecewise(list(mtp.values()))
    eval_piecewise(model.parameters())
    model.eval()
    return model


def _read_weights(h: GGUFHeader, native: bool, dtype: str):
    """``(weights, source types, rope_freqs, MLX modes, MTP head)`` under
    mlx-lm's names, the family's transforms undone; expert tensors of a
    ``TRANSCODED`` type come as MLX quantized triples (transcode.py)."""
    import mlx.core as mx

    family = FAMILIES[h.architecture]
    tensors = read_native(h) if native else read_decoded(h, dtype, keep=is_expert_tensor)
    weights, source_types, rope_freqs, modes, kept, mtp = {}, {}, None, {}, {}, {}
    for name, value in tensors:
        if name == "rope_freqs.weight":
            rope_freqs = value
            continue
        if (hf_name := mtp_name(name, h)) is not None:  # kept aside: mlx-lm's class has no MTP head
            bits = EXPERT_REQUANT_BITS.get(h.tensors[name].type_name) if name in h.tensors else None
            if not isinstance(value, dict) and value.ndim == 3 and bits and value.shape[-1] % REQUANT_GROUP == 0:
                q = mx.quantize(value, group_size=REQUANT_GROUP, bits=bits)  # its experts stay quantized too
                value = {"weight": q[0], "scales": q[1], "biases": q[2]}
            parts = value if isinstance(value, dict) else {hf_name.rsplit(".", 1)[1]: value}
            mtp.update({f"{hf_name.rsplit('.', 1)[0]}.{part}": array for part, array in parts.items()})
            continue
        key = mlx_name(name, h)
        if isinstance(value, dict):  # an expert tensor kept quantized: weight, scales[, biases]
            stem = key[: -len(".weight")]
            weights.update({f"{stem}.{part}": array for part, array in value.items()})
            modes[stem] = "mxfp4" if h.tensors[name].type_name == "MXFP4" else "affine"
            kept[h.tensors[name].type_name] = TRANSCODED[h.tensors[name].type_name]
            continue
        value = family.reshape(h, key, value)
        weights[key] = value - family.norm_shift if family.norm_shift and key.endswith("norm.weight") else value
        if name in h.tensors:
            source_types[key] = h.tensors[name].type_name
    if kept:
        logger.info(
            "GGUF %s: expert tensors kept quantized as stored, groups of 32 (%s)",
            h.path.name,
            ", ".join(f"{t} -> {'mxfp4' if t == 'MXFP4' else f'{b}-bit affine'}" for t, b in sorted(kept.items())),
        )
    return weights, source_types, rope_freqs, modes, mtp


def requantize(model, weights: dict, source_types: dict[str, str], h: GGUFHeader, dense: bool = True) -> dict:
    """``weights`` with each Linear/Embedding matrix (when ``dense``) and each
    stacked expert tensor of a type in ``REQUANT_BITS`` replaced by MLX's
    quantized triple (``.weight``, ``.scales``, ``.biases``); the choice per
    type is logged."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchLinear

    modules = dict(model.named_modules())
    out, chosen = dict(weights), {}
    for key, value in weights.items():
        stem = key[: -len(".weight")]
        module = modules.get(stem)
        n_bits = (EXPERT_REQUANT_BITS if isinstance(module, SwitchLinear) else REQUANT_BITS).get(
            source_types.get(key, "")
        )
        if not (n_bits and key.endswith(".weight")) or value.shape[-1] % REQUANT_GROUP:
            continue
        dense_matrix = dense and isinstance(module, (nn.Linear, nn.Embedding)) and value.ndim == 2
        if not (dense_matrix or (isinstance(module, SwitchLinear) and value.ndim == 3)):
            continue
        out[key], out[f"{stem}.scales"], out[f"{stem}.biases"] = mx.quantize(
            value, group_size=REQUANT_GROUP, bits=n_bits
        )
        chosen[source_types[key]] = n_bits
    if chosen:
        logger.info(
            "GGUF %s: re-quantized in MLX's affine format, groups of %d (%s)%s",
            h.path.name,
            REQUANT_GROUP,
            ", ".join(f"{t} -> {b}-bit" for t, b in sorted(chosen.items())),
            "; other tensors float16" if dense else " (experts only)",
        )
    return out


class FactoredRoPE:
    """Interleaved RoPE whose per-frequency periods are multiplied by llama.cpp's
    ``rope_freqs`` factors (how Llama 3.x files store their RoPE scaling):
    llama.cpp divides each frequency ``base**(-2i/d)`` by ``factor[i]``."""

    def __init__(self, dims: int, base: float, factors, traditional: bool):
        import mlx.core as mx

        self.dims, self.traditional = dims, traditional
        self.periods = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)

    def __call__(self, x, offset: int = 0):
        import mlx.core as mx

        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset, freqs=self.periods
        )


def _use_rope_freqs(model, config: dict, factors) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = FactoredRoPE(head_dim, config["rope_theta"], factors, config.get("rope_traditional", False))
    for layer in model.layers:
        layer.self_attn.rope = rope
