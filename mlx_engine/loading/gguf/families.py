"""GGUF model families mapped onto mlx-lm's model classes: the config built from
a file's ``<arch>.*`` metadata, the tensor names, and the few transforms
llama.cpp's converter (``convert_hf_to_gguf.py``) applied that must be undone.

Per family, what the converter does and what the mapping does about it:

- ``llama`` (Llama 1-3, Mistral 7B, SmolLM): q/k rows permuted for interleaved
  RoPE; mlx-lm's llama computes interleaved RoPE with ``rope_traditional=True``,
  so the rows are used as stored. Llama 3.x RoPE scaling is a ``rope_freqs``
  tensor of per-frequency divisors, applied through ``mx.fast.rope(freqs=...)``.
- ``qwen2``, ``qwen3``, ``phi3``: stored unpermuted (NeoX RoPE).
- ``gemma2``, ``gemma3``: every ``*norm.weight`` stored as ``1 + w``; mlx-lm's
  Gemma RMSNorm adds the 1 itself, so 1 is subtracted back.
- ``lfm2`` (hybrid: short-convolution and attention layers): the layer kinds
  are ``attention.head_count_kv``, one entry per layer, 0 for a convolution
  layer; the depthwise kernel, ``(hidden, 1, L)`` in the checkpoint, is stored
  squeezed as ``[L, hidden]`` and gets its axis back; the final norm is named
  ``token_embd_norm``; ``feed_forward_length`` is already the adjusted width.
- ``mamba2`` (recurrent only): no attention metadata (head count 0); the SSM
  sizes are ``ssm.*``; ``A_log`` is stored as ``A = -exp(A_log)`` (``ssm_a``,
  like ``ssm_d`` without a ``.weight`` suffix, shape ``[1, heads]``), so the
  log is taken back; the conv kernel is squeezed as for lfm2; the gated norm is
  stored per group.
- ``granitehybrid`` (Granite 4.0-H: Mamba-2 and attention layers): layer kinds
  from ``head_count_kv`` as for lfm2 (0: Mamba-2), the Mamba-2 tensors as for
  mamba2, Granite's multipliers from ``embedding_scale``, ``residual_scale``,
  ``attention.scale`` and ``logit_scale``. Its q/k rows are stored permuted for
  interleaved RoPE, but Granite 4.0-H uses no RoPE, and one permutation of both
  q and k leaves every q.k product as it was.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ...errors import ModelLoadError
from .reader import (
    GGUFHeader,
    all_mlx_native,
    bad_field,
    meta_flag,
    meta_float,
    meta_int,
    meta_str,
    read_decoded,
    read_native,
)

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **_ATTENTION, **_MLP}
_GEMMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **_ATTENTION,
    **_MLP,
}
_LFM2_GLOBAL = {**_GLOBAL_NAMES, "token_embd_norm": "model.embedding_norm"}
_LFM2_FFN = {"ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2"}
_LFM2_SHARED = {"attn_norm": "operator_norm", "ffn_norm": "ffn_norm", **_LFM2_FFN}
_LFM2_KINDS = {  # GGUF block tensors by layer kind (mlx-lm's layer_types)
    "conv": {"shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj"},
    "full_attention": {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.out_proj",
        "attn_q_norm": "self_attn.q_layernorm",
        "attn_k_norm": "self_attn.k_layernorm",
    },
}
_PHI3_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # gate and up fused, as in Phi-3's own checkpoint
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture maps onto an mlx-lm model class."""

    model_type: str
    block_names: dict[str, str]
    extra_config: Callable[[GGUFHeader, dict], None] = lambda h, config: None
    norm_shift: float = 0.0  # subtracted from every *norm.weight (gemma stores 1 + w)
    rope_freqs: bool = False  # a rope_freqs tensor (Llama 3.x) is understood
    config: dict = field(default_factory=dict)
    global_names: dict[str, str] = field(default_factory=lambda: dict(_GLOBAL_NAMES))
    recurrent_layers: bool = False  # head_count_kv may be 0 for a layer: a recurrent one
    reshape: Callable[[GGUFHeader, str, object], object] = lambda h, key, value: value  # a converter's transform undone
    layer_prefix: str = "model.layers"
    bare_names: dict[str, str] = field(default_factory=dict)  # block tensors named without .weight
    own_config: Callable[[GGUFHeader], dict] | None = None  # families without attention metadata


def _head_dim(h: GGUFHeader, config: dict) -> None:
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])


def _gemma_scale(h: GGUFHeader, config: dict, layers_27b: int) -> None:
    """llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B models
    (recognised by their layer count), which use 1/sqrt(hidden/heads)."""
    _head_dim(h, config)
    n_layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    config["query_pre_attn_scalar"] = hidden // heads if n_layers == layers_27b else config["head_dim"]


def _gemma2(h: GGUFHeader, config: dict) -> None:
    _gemma_scale(h, config, 46)
    config["attn_logit_softcapping"] = meta_float(h, "gemma2.attn_logit_softcapping", 50.0)
    config["final_logit_softcapping"] = meta_float(h, "gemma2.final_logit_softcapping", 30.0)
    window = meta_int(h, "gemma2.attention.sliding_window", 4096)
    logger.info(
        "gemma2 in mlx-lm attends globally on every layer; llama.cpp uses a %d-token window on alternate layers, "
        "so outputs past %d tokens differ from it",
        window,
        window,
    )


def _gemma3(h: GGUFHeader, config: dict) -> None:
    _gemma_scale(h, config, 62)
    if "gemma3.final_logit_softcapping" in h.metadata:
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: gemma3 with final logit softcapping is not supported")
    if "gemma3.attention.sliding_window_pattern" in h.metadata:
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r}: an explicit gemma3 sliding-window pattern is not supported (only every 6th layer global)"
        )
    config["sliding_window"] = meta_int(h, "gemma3.attention.sliding_window", config["max_position_embeddings"])
    config["sliding_window_pattern"] = 6  # llama.cpp's and mlx-lm's fixed pattern: every 6th layer is global
    if config["num_hidden_layers"] < 6:
        raise bad_field(h, "gemma3.block_count", config["num_hidden_layers"], "at least 6 (one global layer)")
    config["rope_local_base_freq"] = meta_float(h, "gemma3.rope.freq_base_swa", 10000.0)
    if "rope_scaling" in config:  # linear scaling applies to the global layers only, as in llama.cpp
        config["rope_scaling"] = {"rope_type": "linear", "factor": config["rope_scaling"]["factor"]}


def _no_head_dim(h: GGUFHeader, config: dict) -> None:
    """For classes whose head size is always hidden / heads."""
    if "head_dim" in config and config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        raise bad_field(
            h, f"{h.architecture}.attention.key_length", config["head_dim"], "embedding_length / head_count"
        )


def _phi3(h: GGUFHeader, config: dict) -> None:
    if "rope_factors_long.weight" in h.tensors or "rope_factors_short.weight" in h.tensors:
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: phi3 LongRoPE (rope_factors_long/short) is not mapped yet")
    _no_head_dim(h, config)


def _lfm2(h: GGUFHeader, config: dict) -> None:
    """LFM2: layer kinds from the per-layer KV head counts (0: convolution);
    what mlx-lm's class cannot express (an untied output, a sliding window,
    bidirectional attention, partial or scaled RoPE) is refused."""
    path, hidden = str(h.path), config["hidden_size"]
    kinds = ["full_attention" if n else "conv" for n in _kv_heads_per_layer(h, config["num_hidden_layers"])]
    if len(set(kinds)) < 2:
        raise ModelLoadError(
            f"GGUF file {path!r}: lfm2 needs both convolution and attention layers (mlx-lm's class indexes "
            f"one of each), but 'lfm2.attention.head_count_kv' makes every layer {kinds[0]!r}"
        )
    unsupported = {
        "an untied output matrix ('output.weight')": "output.weight" in h.tensors,
        "sliding-window attention": meta_int(h, "lfm2.attention.sliding_window", 0, lo=0) > 0,
        "bidirectional attention ('lfm2.attention.causal' false)": not _flag_or_true(h, "lfm2.attention.causal"),
        "RoPE scaling": "rope_scaling" in config,
        "partial RoPE": meta_int(h, "lfm2.rope.dimension_count", hidden // config["num_attention_heads"])
        != hidden // config["num_attention_heads"],
    }
    for what, present in unsupported.items():
        if present:
            raise ModelLoadError(f"GGUF file {path!r}: lfm2 with {what} is not supported (mlx-lm's lfm2 has none)")
    _no_head_dim(h, config)
    l_cache = meta_int(h, "lfm2.shortconv.l_cache", lo=2, hi=64)
    config.update(
        layer_types=kinds, norm_eps=config["rms_norm_eps"], conv_bias=False, conv_L_cache=l_cache,
        block_dim=hidden, block_ff_dim=config["intermediate_size"], block_auto_adjust_ff_dim=False,
        block_multiple_of=1, block_ffn_dim_multiplier=1.0, tie_word_embeddings=True,
    )  # fmt: skip
    _require_tensors(h, ["token_embd_norm.weight"], "lfm2's final norm")
    for i, kind in enumerate(kinds):
        names = [f"blk.{i}.{t}.weight" for t in [*_LFM2_SHARED, *_LFM2_KINDS[kind]]]
        _require_tensors(h, names, f"layer {i}, a {kind} layer by 'lfm2.attention.head_count_kv'")
    conv = h.tensors[f"blk.{kinds.index('conv')}.shortconv.conv.weight"]
    if conv.shape != (l_cache, hidden):
        raise ModelLoadError(
            f"GGUF file {path!r}: tensor {conv.name!r} of shape {list(conv.shape)} does not match "
            f"'lfm2.shortconv.l_cache' ({l_cache}) and 'lfm2.embedding_length' ({hidden})"
        )


def _lfm2_reshape(h: GGUFHeader, key: str, value):
    """The depthwise kernel back to MLX's Conv1d layout ``(hidden, L, 1)``."""
    return value[..., None] if key.endswith("conv.conv.weight") and value.ndim == 2 else value


_MAMBA2_GLOBAL = {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"}
_MAMBA2_BLOCK = {
    "attn_norm": "norm",
    "ssm_in": "mixer.in_proj",
    "ssm_conv1d": "mixer.conv1d",
    "ssm_dt": "mixer.dt_bias",  # only a bias: see mlx_name
    "ssm_norm": "mixer.norm",
    "ssm_out": "mixer.out_proj",
}
_MAMBA2_BARE = {"ssm_a": "mixer.A_log", "ssm_d": "mixer.D"}


def _ssm_sizes(h: GGUFHeader) -> dict:
    """A Mamba-2 mixer's sizes from ``<arch>.ssm.*``: inner size, heads (llama.cpp's
    ``time_step_rank``), state, groups (only 1) and conv kernel length."""
    arch = h.architecture
    d_inner, heads = meta_int(h, f"{arch}.ssm.inner_size"), meta_int(h, f"{arch}.ssm.time_step_rank")
    groups = meta_int(h, f"{arch}.ssm.group_count")
    if d_inner % heads:
        raise bad_field(h, f"{arch}.ssm.time_step_rank", heads, f"a divisor of '{arch}.ssm.inner_size' ({d_inner})")
    if groups != 1:  # mlx-lm's gated RMSNorm normalizes all of d_inner at once, not per group
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r}: {arch} with {groups} groups is not supported (mlx-lm normalizes "
            "the gated output over all groups at once; llama.cpp per group)"
        )
    return dict(
        d_inner=d_inner, heads=heads, state=meta_int(h, f"{arch}.ssm.state_size"), groups=groups,
        conv=meta_int(h, f"{arch}.ssm.conv_kernel", lo=2, hi=64),
    )  # fmt: skip


def _mamba2_config(h: GGUFHeader) -> dict:
    """Mamba-2 from its ``mamba2.ssm.*`` fields (llama.cpp writes no attention
    or feed-forward sizes for it)."""
    ssm = _ssm_sizes(h)
    eps = meta_float(h, "mamba2.attention.layer_norm_rms_epsilon", 1e-5)
    if eps != 1e-5:  # mlx-lm's ResidualBlock norm always uses 1e-5
        logger.info("GGUF %s: mamba2's layer norms use eps 1e-5 in mlx-lm, the file says %g", h.path.name, eps)
    return dict(
        model_type="mamba2", hidden_size=meta_int(h, "mamba2.embedding_length"),
        num_hidden_layers=meta_int(h, "mamba2.block_count"), num_heads=ssm["heads"],
        head_dim=ssm["d_inner"] // ssm["heads"], intermediate_size=ssm["d_inner"], state_size=ssm["state"],
        n_groups=ssm["groups"], layer_norm_epsilon=eps, conv_kernel=ssm["conv"], use_bias=False,
        use_conv_bias=True, time_step_limit=(0.0, float("inf")),  # llama.cpp's scan clamps no time step
        time_step_rank=ssm["heads"], max_position_embeddings=meta_int(h, "mamba2.context_length", 4096),
        tie_word_embeddings="output.weight" not in h.tensors,
    )  # fmt: skip


_SSM_TENSORS = [*(f"{t}.weight" for t in ("ssm_in", "ssm_conv1d", "ssm_norm", "ssm_out")), "ssm_dt.bias", *_MAMBA2_BARE]


def _mamba2(h: GGUFHeader, config: dict) -> None:
    """Every block's tensors present, with the widths the SSM sizes give."""
    _require_tensors(h, ["output_norm.weight"], "the final norm")
    for i in range(config["num_hidden_layers"]):
        names = [f"blk.{i}.{t}" for t in ["attn_norm.weight", "ssm_conv1d.bias", *_SSM_TENSORS]]
        _require_tensors(h, names, f"Mamba-2 block {i}")
    _check_ssm_shapes(h, 0, config["hidden_size"], _ssm_sizes(h))


def _check_ssm_shapes(h: GGUFHeader, block: int, hidden: int, ssm: dict) -> None:
    """The input projection's width (gate, x, B, C and one time step per head)
    and the conv kernel's shape, against the ``ssm.*`` sizes."""
    conv_dim = ssm["d_inner"] + 2 * ssm["groups"] * ssm["state"]
    expected = {
        f"blk.{block}.ssm_in.weight": (hidden, ssm["d_inner"] + conv_dim + ssm["heads"]),
        f"blk.{block}.ssm_conv1d.weight": (ssm["conv"], conv_dim),
    }
    for name, shape in expected.items():
        if h.tensors[name].shape != shape:
            raise ModelLoadError(
                f"GGUF file {str(h.path)!r}: tensor {name!r} of shape {list(h.tensors[name].shape)} does not match "
                f"the '{h.architecture}.ssm.*' sizes, which give {list(shape)}"
            )


_GRANITE_HYBRID_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    **_ATTENTION,
    **_MLP,
    **{k: v.replace("mixer.", "mamba.") for k, v in _MAMBA2_BLOCK.items() if k != "attn_norm"},
}
_GRANITE_HYBRID_BARE = {k: v.replace("mixer.", "mamba.") for k, v in _MAMBA2_BARE.items()}


def _granitehybrid(h: GGUFHeader, config: dict) -> None:
    """Granite 4.0-H, dense and without RoPE: layer kinds from the per-layer KV
    head counts (0: Mamba-2), Granite's multipliers, the Mamba-2 sizes."""
    arch, path, hidden = "granitehybrid", str(h.path), config["hidden_size"]
    kinds = ["attention" if n else "mamba" for n in _kv_heads_per_layer(h, config["num_hidden_layers"])]
    if any(name.endswith("ffn_gate_inp.weight") for name in h.tensors):
        raise ModelLoadError(f"GGUF file {path!r}: granitehybrid with experts (MoE) is not mapped yet; dense files are")
    if _flag_or_true(h, f"{arch}.rope.scaling.finetuned"):  # llama.cpp's switch for RoPE, on when absent
        raise ModelLoadError(
            f"GGUF file {path!r}: granitehybrid with RoPE (Bamba) is not mapped; Granite 4.0-H has none"
        )
    _no_head_dim(h, config)
    ssm = _ssm_sizes(h)
    config.update(
        layer_types=kinds, position_embedding_type="nope", attention_bias=False, mlp_bias=False,
        embedding_multiplier=meta_float(h, f"{arch}.embedding_scale", 1.0),
        residual_multiplier=meta_float(h, f"{arch}.residual_scale", 1.0),
        attention_multiplier=meta_float(h, f"{arch}.attention.scale", (hidden // config["num_attention_heads"]) ** -0.5),
        logits_scaling=meta_float(h, f"{arch}.logit_scale", 1.0),
        mamba_n_heads=ssm["heads"], mamba_d_head=ssm["d_inner"] // ssm["heads"], mamba_d_state=ssm["state"],
        mamba_d_conv=ssm["conv"], mamba_n_groups=ssm["groups"], mamba_proj_bias=False,
        mamba_conv_bias=any(name.endswith(".ssm_conv1d.bias") for name in h.tensors),
        time_step_limit=(0.0, float("inf")),
    )  # fmt: skip
    _require_tensors(h, ["output_norm.weight"], "the final norm")
    shared = ["attn_norm", "ffn_norm", *_MLP]
    for i, kind in enumerate(kinds):
        own = [f"{t}.weight" for t in _ATTENTION] if kind == "attention" else _SSM_TENSORS
        _require_tensors(h, [f"blk.{i}.{t}" for t in [*(f"{s}.weight" for s in shared), *own]], f"layer {i}, {kind}")
    if "mamba" in kinds:
        _check_ssm_shapes(h, kinds.index("mamba"), hidden, ssm)


def _mamba2_reshape(h: GGUFHeader, key: str, value):
    """``A = -exp(A_log)`` back to ``A_log``; ``[1, heads]`` vectors and the
    per-group norm flat; the conv kernel to ``(channels, K, 1)``."""
    import mlx.core as mx

    if key.endswith("A_log"):
        a = value.astype(mx.float32).reshape(-1)
        if not (a < 0).all().item():  # log(-A) would be NaN: every output would be
            raise ModelLoadError(
                f"GGUF file {str(h.path)!r}: {key!r} (ssm_a) holds A = -exp(A_log), so must be negative"
            )
        return mx.log(-a)
    if key.endswith((".D", "mixer.norm.weight", "mamba.norm.weight")):
        return value.reshape(-1)
    return value[..., None] if key.endswith("conv1d.weight") and value.ndim == 2 else value


def _flag_or_true(h: GGUFHeader, key: str) -> bool:
    """A bool field that is true when absent."""
    return meta_flag(h, key) if key in h.metadata else True


def _require_tensors(h: GGUFHeader, names: list[str], what: str) -> None:
    missing = [n for n in names if n not in h.tensors]
    if missing:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} lacks {', '.join(map(repr, missing))} ({what})")


def _kv_heads_per_layer(h: GGUFHeader, n_layers: int) -> list[int]:
    """``<arch>.attention.head_count_kv`` per layer: llama.cpp accepts a scalar
    (every layer) or one entry per layer (0 marks a layer without attention)."""
    key = f"{h.architecture}.attention.head_count_kv"
    value = h.metadata.get(key)
    if value is None:
        return [meta_int(h, f"{h.architecture}.attention.head_count")] * n_layers
    if not isinstance(value, np.ndarray):
        return [meta_int(h, key)] * n_layers
    if value.ndim != 1 or len(value) != n_layers or value.dtype.kind not in "iu" or (value < 0).any():
        raise bad_field(h, key, value, f"an integer or {n_layers} non-negative integers (one per layer)")
    return [int(v) for v in value]


FAMILIES = {
    "llama": Family("llama", _LLAMA_BLOCK, rope_freqs=True, config={"rope_traditional": True}),
    "qwen2": Family("qwen2", _LLAMA_BLOCK, config={"rope_traditional": False}),
    "qwen3": Family("qwen3", {**_LLAMA_BLOCK, **_QK_NORM}, _head_dim),
    "gemma2": Family("gemma2", _GEMMA_BLOCK, _gemma2, norm_shift=1.0),
    "gemma3": Family("gemma3_text", {**_GEMMA_BLOCK, **_QK_NORM}, _gemma3, norm_shift=1.0),
    "phi3": Family("phi3", _PHI3_BLOCK, _phi3),
    "lfm2": Family(
        "lfm2",
        {**_LFM2_SHARED, **_LFM2_KINDS["conv"], **_LFM2_KINDS["full_attention"]},
        _lfm2,
        global_names=_LFM2_GLOBAL,
        recurrent_layers=True,
        reshape=_lfm2_reshape,
    ),
    "mamba2": Family(
        "mamba2",
        _MAMBA2_BLOCK,
        _mamba2,
        global_names=_MAMBA2_GLOBAL,
        recurrent_layers=True,
        reshape=_mamba2_reshape,
        layer_prefix="backbone.layers",
        bare_names=_MAMBA2_BARE,
        own_config=_mamba2_config,
    ),
    "granitehybrid": Family(
        "granitemoehybrid",
        _GRANITE_HYBRID_BLOCK,
        _granitehybrid,
        recurrent_layers=True,
        reshape=_mamba2_reshape,
        bare_names=_GRANITE_HYBRID_BARE,
    ),
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
    _check_blocks(h, config["num_hidden_layers"])
    return config


def _kv_heads(h: GGUFHeader, family: Family, n_layers: int) -> int:
    """The one KV head count of the attention layers (mlx-lm's classes take one);
    a per-layer 0 (no attention) only in families with recurrent layers."""
    per_layer = _kv_heads_per_layer(h, n_layers)
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
    attn = next((i for i in range(config["num_hidden_layers"]) if f"blk.{i}.attn_k.weight" in h.tensors), 0)
    expected = {
        "token_embd.weight": (0, hidden, "embedding_length"),
        "blk.0.ffn_up.weight": (1, 2 * inter if fused else inter, "feed_forward_length"),
        f"blk.{attn}.attn_q.weight": (1, heads * head_dim, "attention.head_count"),
        f"blk.{attn}.attn_k.weight": (1, kv_heads * head_dim, "attention.head_count_kv"),
        "blk.0.attn_qkv.weight": (1, (heads + 2 * kv_heads) * head_dim, "attention.head_count"),
    }
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
        if not target.endswith("dt_bias"):
            return f"{family.layer_prefix}.{m.group(1)}.{target}.{suffix}"
        if suffix == "bias":  # a parameter of its own in mlx-lm, a bias in GGUF
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


def load_model(h: GGUFHeader, config: dict, *, keep_quantized: bool | None = None):
    """Build the mlx-lm model for ``config`` and load the file's tensors into it.
    A file of MLX-native types only keeps Q4_0/Q4_1/Q8_0 quantized (as MLX's
    reader gives them; ``compute_dtype`` decides later). Any other file is
    decoded tensor by tensor: to float32 on the CPU (the fast path there);
    elsewhere (``keep_quantized``, by default off the CPU) to float16, with the
    matrices of quantized types re-quantized to MLX's affine format by
    ``REQUANT_BITS``."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    family = FAMILIES[h.architecture]
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if keep_quantized is None:
        keep_quantized = mx.default_device() != mx.cpu
    if all_mlx_native(h):
        tensors = iter(read_native(h).items())
    else:
        tensors = read_decoded(h, "float16" if keep_quantized else "float32")
    weights, source_types, rope_freqs = {}, {}, None
    for name, value in tensors:
        if name == "rope_freqs.weight":
            rope_freqs = value
            continue
        key = mlx_name(name, h)
        value = family.reshape(h, key, value)
        weights[key] = value - family.norm_shift if family.norm_shift and key.endswith("norm.weight") else value
        if name in h.tensors:
            source_types[key] = h.tensors[name].type_name
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if keep_quantized and not all_mlx_native(h):
        weights = requantize(model, weights, source_types, h)
    bits = {
        k[: -len(".scales")]: weights[k[: -len(".scales")] + ".weight"].shape[-1] * 32 // (v.shape[-1] * 32)
        for k, v in weights.items()
        if k.endswith(".scales")
    }
    if bits:
        nn.quantize(model, class_predicate=lambda p, m: {"group_size": 32, "bits": bits[p]} if p in bits else False)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} does not match its declared shapes: {exc}") from exc
    if rope_freqs is not None:
        _use_rope_freqs(model, config, rope_freqs)
    mx.eval(model.parameters())
    model.eval()
    return model


def requantize(model, weights: dict, source_types: dict[str, str], h: GGUFHeader) -> dict:
    """``weights`` with each Linear/Embedding matrix of a type in
    ``REQUANT_BITS`` replaced by MLX's quantized triple (``.weight``,
    ``.scales``, ``.biases``); the choice per type is logged."""
    import mlx.core as mx
    import mlx.nn as nn

    modules = dict(model.named_modules())
    out, chosen = dict(weights), {}
    for key, value in weights.items():
        stem = key[: -len(".weight")]
        n_bits = REQUANT_BITS.get(source_types.get(key, ""))
        if not (n_bits and key.endswith(".weight") and isinstance(modules.get(stem), (nn.Linear, nn.Embedding))):
            continue
        if value.ndim != 2 or value.shape[-1] % REQUANT_GROUP:
            continue
        out[key], out[f"{stem}.scales"], out[f"{stem}.biases"] = mx.quantize(
            value, group_size=REQUANT_GROUP, bits=n_bits
        )
        chosen[source_types[key]] = n_bits
    if chosen:
        logger.info(
            "GGUF %s: kept quantized in MLX's affine format, groups of %d (%s); other tensors float16",
            h.path.name,
            REQUANT_GROUP,
            ", ".join(f"{t} -> {b}-bit" for t, b in sorted(chosen.items())),
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
