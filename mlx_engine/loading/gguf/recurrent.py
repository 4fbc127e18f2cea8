"""GGUF families with recurrent layers, mapped onto mlx-lm's hybrid classes (the
engine's hybrid machinery, caches/sequence.py, then applies unchanged). What
llama.cpp's converter does and what the mapping does about it:

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

import mlx.core as mx

from ...errors import ModelLoadError
from .family import ATTENTION, GLOBAL_NAMES, MLP, Family, flag_or_true, kv_heads_per_layer, no_head_dim, require_tensors
from .moe import expert_sizes
from .reader import GGUFHeader, bad_field, meta_float, meta_int

logger = logging.getLogger(__name__)

_LFM2_GLOBAL = {**GLOBAL_NAMES, "token_embd_norm": "model.embedding_norm"}
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


def _lfm2(h: GGUFHeader, config: dict) -> None:
    """LFM2: layer kinds from the per-layer KV head counts (0: convolution);
    what mlx-lm's class cannot express (an untied output, a sliding window,
    bidirectional attention, partial or scaled RoPE) is refused."""
    path, hidden = str(h.path), config["hidden_size"]
    kinds = ["full_attention" if n else "conv" for n in kv_heads_per_layer(h, config["num_hidden_layers"])]
    if len(set(kinds)) < 2:
        raise ModelLoadError(
            f"GGUF file {path!r}: lfm2 needs both convolution and attention layers (mlx-lm's class indexes "
            f"one of each), but 'lfm2.attention.head_count_kv' makes every layer {kinds[0]!r}"
        )
    unsupported = {
        "an untied output matrix ('output.weight')": "output.weight" in h.tensors,
        "sliding-window attention": meta_int(h, "lfm2.attention.sliding_window", 0, lo=0) > 0,
        "bidirectional attention ('lfm2.attention.causal' false)": not flag_or_true(h, "lfm2.attention.causal"),
        "RoPE scaling": "rope_scaling" in config,
        "partial RoPE": meta_int(h, "lfm2.rope.dimension_count", hidden // config["num_attention_heads"])
        != hidden // config["num_attention_heads"],
    }
    for what, present in unsupported.items():
        if present:
            raise ModelLoadError(f"GGUF file {path!r}: lfm2 with {what} is not supported (mlx-lm's lfm2 has none)")
    no_head_dim(h, config)
    l_cache = meta_int(h, "lfm2.shortconv.l_cache", lo=2, hi=64)
    config.update(
        layer_types=kinds, norm_eps=config["rms_norm_eps"], conv_bias=False, conv_L_cache=l_cache,
        block_dim=hidden, block_ff_dim=config["intermediate_size"], block_auto_adjust_ff_dim=False,
        block_multiple_of=1, block_ffn_dim_multiplier=1.0, tie_word_embeddings=True,
    )  # fmt: skip
    require_tensors(h, ["token_embd_norm.weight"], "lfm2's final norm")
    for i, kind in enumerate(kinds):
        names = [f"blk.{i}.{t}.weight" for t in [*_LFM2_SHARED, *_LFM2_KINDS[kind]]]
        require_tensors(h, names, f"layer {i}, a {kind} layer by 'lfm2.attention.head_count_kv'")
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


def ssm_sizes(h: GGUFHeader, grouped_norm: bool = False) -> dict:
    """A Mamba-2 mixer's sizes from ``<arch>.ssm.*``: inner size, heads (llama.cpp's
    ``time_step_rank``), state, groups and conv kernel length. Groups: only 1,
    unless the class's gated norm is per group as llama.cpp's (``grouped_norm``)."""
    arch = h.architecture
    d_inner, heads = meta_int(h, f"{arch}.ssm.inner_size"), meta_int(h, f"{arch}.ssm.time_step_rank")
    groups = meta_int(h, f"{arch}.ssm.group_count")
    if d_inner % heads:
        raise bad_field(h, f"{arch}.ssm.time_step_rank", heads, f"a divisor of '{arch}.ssm.inner_size' ({d_inner})")
    if d_inner % groups:
        raise bad_field(h, f"{arch}.ssm.group_count", groups, f"a divisor of '{arch}.ssm.inner_size' ({d_inner})")
    if groups != 1 and not grouped_norm:  # mlx-lm's gated RMSNorm normalizes all of d_inner at once, not per group
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
    ssm = ssm_sizes(h)
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


SSM_TENSORS = [*(f"{t}.weight" for t in ("ssm_in", "ssm_conv1d", "ssm_norm", "ssm_out")), "ssm_dt.bias", *_MAMBA2_BARE]


def _mamba2(h: GGUFHeader, config: dict) -> None:
    """Every block's tensors present, with the widths the SSM sizes give."""
    require_tensors(h, ["output_norm.weight"], "the final norm")
    for i in range(config["num_hidden_layers"]):
        names = [f"blk.{i}.{t}" for t in ["attn_norm.weight", "ssm_conv1d.bias", *SSM_TENSORS]]
        require_tensors(h, names, f"Mamba-2 block {i}")
    check_ssm_shapes(h, 0, config["hidden_size"], ssm_sizes(h))


def check_ssm_shapes(h: GGUFHeader, block: int, hidden: int, ssm: dict) -> None:
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


# Granite 4.0-H Tiny/Small: experts and a shared expert, whose gate and up halves the
# converter split from shared_mlp.input_linear (re-fused by _fuse_shared_input).
_GRANITE_MOE = {
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
    "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
    "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj",
    "ffn_gate_shexp": "shared_mlp.gate_half",
    "ffn_up_shexp": "shared_mlp.up_half",
    "ffn_down_shexp": "shared_mlp.output_linear",
}


_GRANITE_HYBRID_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    **ATTENTION,
    **MLP,
    **{k: v.replace("mixer.", "mamba.") for k, v in _MAMBA2_BLOCK.items() if k != "attn_norm"},
    **_GRANITE_MOE,
}
_GRANITE_HYBRID_BARE = {k: v.replace("mixer.", "mamba.") for k, v in _MAMBA2_BARE.items()}


def _fuse_shared_input(h: GGUFHeader, weights: dict) -> dict:
    """The shared expert's gate and up halves back into ``input_linear`` (gate
    first, as mlx-lm splits it); quantized triples row-wise alike."""
    halves = ("shared_mlp.gate_half.", "shared_mlp.up_half.")
    out = {k: v for k, v in weights.items() if not any(half in k for half in halves)}
    for key in weights:
        if halves[0] in key:
            up = key.replace(halves[0], halves[1])
            if up not in weights:
                raise ModelLoadError(f"GGUF file {str(h.path)!r}: the shared expert of {key!r} lacks its up half")
            out[key.replace(halves[0], "shared_mlp.input_linear.")] = mx.concatenate([weights[key], weights[up]])
    return out


def _granitehybrid(h: GGUFHeader, config: dict) -> None:
    """Granite 4.0-H without RoPE, dense (Micro) or with experts and a shared
    expert (Tiny, Small): layer kinds from the per-layer KV head counts (0:
    Mamba-2), Granite's multipliers, the Mamba-2 sizes."""
    arch, path, hidden = "granitehybrid", str(h.path), config["hidden_size"]
    kinds = ["attention" if n else "mamba" for n in kv_heads_per_layer(h, config["num_hidden_layers"])]
    moe = any(name.endswith("ffn_gate_inp.weight") for name in h.tensors)
    if flag_or_true(h, f"{arch}.rope.scaling.finetuned"):  # llama.cpp's switch for RoPE, on when absent
        raise ModelLoadError(
            f"GGUF file {path!r}: granitehybrid with RoPE (Bamba) is not mapped; Granite 4.0-H has none"
        )
    no_head_dim(h, config)
    ssm = ssm_sizes(h)
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
    require_tensors(h, ["output_norm.weight"], "the final norm")
    shared = ["attn_norm", "ffn_norm", *(_GRANITE_MOE if moe else MLP)]
    if moe:  # experts of width feed_forward_length, a shared expert of expert_shared_feed_forward_length
        n_expert, n_used, width = expert_sizes(h, hidden, width_key="feed_forward_length")
        config.update(
            num_local_experts=n_expert, num_experts_per_tok=n_used, intermediate_size=width,
            shared_intermediate_size=meta_int(h, f"{arch}.expert_shared_feed_forward_length"),
        )  # fmt: skip
    for i, kind in enumerate(kinds):
        own = [f"{t}.weight" for t in ATTENTION] if kind == "attention" else SSM_TENSORS
        require_tensors(h, [f"blk.{i}.{t}" for t in [*(f"{s}.weight" for s in shared), *own]], f"layer {i}, {kind}")
    if "mamba" in kinds:
        check_ssm_shapes(h, kinds.index("mamba"), hidden, ssm)


def mamba2_reshape(h: GGUFHeader, key: str, value):
    """``A = -exp(A_log)`` back to ``A_log``; ``[1, heads]`` vectors and the
    per-group norm flat; the conv kernel to ``(channels, K, 1)``."""
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


#: The recurrent families by ``general.architecture``.
RECURRENT_FAMILIES = {
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
        reshape=mamba2_reshape,
        layer_prefix="backbone.layers",
        bare_names=_MAMBA2_BARE,
        own_config=_mamba2_config,
    ),
    "granitehybrid": Family(
        "granitemoehybrid",
        _GRANITE_HYBRID_BLOCK,
        _granitehybrid,
        recurrent_layers=True,
        reshape=mamba2_reshape,
        bare_names=_GRANITE_HYBRID_BARE,
        combine=_fuse_shared_input,
    ),
}
