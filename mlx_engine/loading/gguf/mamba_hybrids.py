"""GGUF families of Mamba-2 layers beside attention, mapped onto mlx-lm's
``nemotron_h`` and ``falcon_h1`` classes. What llama.cpp's converter does and
what the mapping does about it:

- ``nemotron_h`` (Nemotron-H, dense): one mixer per layer, Mamba-2, attention
  or a squared-ReLU MLP; the kinds are per-layer arrays, ``head_count_kv`` 0
  and ``feed_forward_length`` 0 for Mamba-2, a width for an MLP (mlx-lm's
  ``hybrid_override_pattern``: ``M``, ``*``, ``-``). The Mamba-2 tensors as
  for ``mamba2`` (``-exp(A_log)``, squeezed kernel, per-group norm), here with
  any number of groups (mlx-lm's and llama.cpp's gated norms are both per
  group). The q/k rows are permuted for interleaved RoPE (GraniteHybridModel's
  ``undo_permute``), but Nemotron-H has no RoPE, and one permutation of both q
  and k leaves every q.k product as it was. A file without ``output.weight``
  uses the embedding as its output, as llama.cpp does.
- ``falcon-h1`` (Falcon-H1): every layer attention and Mamba-2 in parallel,
  then a SwiGLU MLP. The converter folds Falcon-H1's muP multipliers into the
  matrices (embedding, q/k/v, key, attention and SSM outputs, MLP gate and
  down, and ``ssm_multipliers`` per row block of ``ssm_in``), so the file's
  matrices are what mlx-lm's class holds once its own sanitize has folded
  them: every multiplier is set to 1. The pre-FFN norm is ``blk.N.ffn_norm``
  with no ``.weight`` suffix (the converter's FFN_PRE_NORM mapping); a tied
  output is the stored (scaled) embedding, as llama.cpp reads it.
"""

from __future__ import annotations

import numpy as np

from ...errors import ModelLoadError
from .family import ATTENTION, Family, kv_heads_per_layer, require_tensors
from .reader import GGUFHeader, bad_field, meta_float, meta_int
from .recurrent import SSM_TENSORS, check_ssm_shapes, mamba2_reshape, ssm_sizes

_NEMOTRON_GLOBAL = {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"}
_SSM_BLOCK = {
    "ssm_in": "in_proj",
    "ssm_conv1d": "conv1d",
    "ssm_dt": "dt_bias",  # only a bias: see families.mlx_name
    "ssm_norm": "norm",
    "ssm_out": "out_proj",
}
_SSM_BARE = {"ssm_a": "A_log", "ssm_d": "D"}
_NEMOTRON_BLOCK = {
    "attn_norm": "norm",
    **{k: f"mixer.{v}" for k, v in _SSM_BLOCK.items()},
    **{k: v.replace("self_attn.", "mixer.") for k, v in ATTENTION.items()},
    "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj",
}
_ATTENTION_TENSORS = [f"{t}.weight" for t in ATTENTION]
_NEMOTRON_KINDS = {"M": SSM_TENSORS, "*": _ATTENTION_TENSORS, "-": ["ffn_up.weight", "ffn_down.weight"]}


def _per_layer(h: GGUFHeader, key: str, n_layers: int) -> list[int]:
    """A field llama.cpp reads as a scalar or one non-negative entry per layer."""
    value = h.metadata.get(key)
    if not isinstance(value, np.ndarray):
        return [meta_int(h, key, lo=0)] * n_layers
    if value.ndim != 1 or len(value) != n_layers or value.dtype.kind not in "iu" or (value < 0).any():
        raise bad_field(h, key, value, f"an integer or {n_layers} non-negative integers (one per layer)")
    return [int(v) for v in value]


def _one(h: GGUFHeader, key: str, per_layer: list[int], what: str) -> int:
    """The one nonzero value of a per-layer field (mlx-lm's class takes one)."""
    values = sorted({v for v in per_layer if v})
    if len(values) > 1:
        raise bad_field(h, key, per_layer, f"one {what} for every layer that has one (mlx-lm's class takes one)")
    return values[0] if values else 0


def _nemotron_pattern(h: GGUFHeader, n_layers: int) -> tuple[list[str], list[int], list[int]]:
    """mlx-lm's ``hybrid_override_pattern`` from the per-layer KV heads and
    feed-forward widths (llama.cpp: both 0 is Mamba-2, a width is an MLP)."""
    arch, path = "nemotron_h", str(h.path)
    kv = kv_heads_per_layer(h, n_layers)
    ff = _per_layer(h, f"{arch}.feed_forward_length", n_layers)
    if any(k and f for k, f in zip(kv, ff)):
        raise bad_field(h, f"{arch}.attention.head_count_kv", kv, "0 on every feed-forward layer")
    if "nemotron_h.expert_count" in h.metadata or any(n.endswith("ffn_gate_inp.weight") for n in h.tensors):
        raise ModelLoadError(f"GGUF file {path!r}: nemotron_h with experts (Nemotron-H MoE) is not mapped")
    pattern = ["-" if f else "*" if k else "M" for k, f in zip(kv, ff)]
    if "M" not in pattern or "*" not in pattern:  # mlx-lm's class indexes a cache of each kind
        raise ModelLoadError(
            f"GGUF file {path!r}: nemotron_h needs both Mamba-2 and attention layers (mlx-lm's class indexes one of "
            f"each), but 'nemotron_h.attention.head_count_kv' and 'nemotron_h.feed_forward_length' give {pattern}"
        )
    return pattern, kv, ff


def _nemotron_config(h: GGUFHeader) -> dict:
    """Nemotron-H's config: the layer pattern, attention and Mamba-2 sizes."""
    arch = "nemotron_h"
    hidden, n_layers = meta_int(h, f"{arch}.embedding_length"), meta_int(h, f"{arch}.block_count")
    pattern, kv, ff = _nemotron_pattern(h, n_layers)
    heads = meta_int(h, f"{arch}.attention.head_count")
    head_dim = meta_int(h, f"{arch}.attention.key_length", hidden // heads)
    _one_head_size(h, head_dim)
    ssm = ssm_sizes(h, grouped_norm=True)
    eps_key = f"{arch}.attention.layer_norm_rms_epsilon"  # llama.cpp: else the layer_norm_epsilon field
    if eps_key not in h.metadata:
        eps_key = f"{arch}.attention.layer_norm_epsilon"
    return dict(
        model_type="nemotron_h", hidden_size=hidden, num_hidden_layers=n_layers, hybrid_override_pattern=pattern,
        intermediate_size=_one(h, f"{arch}.feed_forward_length", ff, "width") or hidden,
        num_attention_heads=heads, num_key_value_heads=_one(h, f"{arch}.attention.head_count_kv", kv, "count"),
        head_dim=head_dim, attention_bias=_has(h, "attn_q.bias"), mlp_bias=_has(h, "ffn_up.bias"),
        mamba_num_heads=ssm["heads"], mamba_head_dim=ssm["d_inner"] // ssm["heads"], mamba_proj_bias=False,
        ssm_state_size=ssm["state"], conv_kernel=ssm["conv"], n_groups=ssm["groups"], use_bias=False,
        use_conv_bias=_has(h, "ssm_conv1d.bias"), layer_norm_epsilon=meta_float(h, eps_key, 1e-5),
        time_step_limit=(0.0, float("inf")),  # llama.cpp's scan clamps no time step
        max_position_embeddings=meta_int(h, f"{arch}.context_length", 4096), tie_word_embeddings=False,
    )  # fmt: skip


def _has(h: GGUFHeader, suffix: str) -> bool:
    return any(name.startswith("blk.") and name.endswith(f".{suffix}") for name in h.tensors)


def _one_head_size(h: GGUFHeader, head_dim: int) -> None:
    """mlx-lm's classes have one head size for keys and values, and scale
    attention by 1/sqrt(head_dim); llama.cpp by ``attention.scale`` when the
    file has one."""
    key = f"{h.architecture}.attention.value_length"
    if meta_int(h, key, head_dim) != head_dim:
        raise bad_field(h, key, h.metadata[key], f"the key length ({head_dim}); mlx-lm's class has one head size")
    key = f"{h.architecture}.attention.scale"
    if key in h.metadata and not np.isclose(meta_float(h, key, 1.0), head_dim**-0.5, rtol=1e-5):
        raise bad_field(h, key, h.metadata[key], f"1/sqrt(head_dim) ({head_dim**-0.5:g}); mlx-lm's class has no other")


def _nemotron_h(h: GGUFHeader, config: dict) -> None:
    """Every layer's tensors for its kind; the Mamba-2, attention and MLP widths."""
    require_tensors(h, ["output_norm.weight"], "the final norm")
    pattern = config["hybrid_override_pattern"]
    kinds = {"M": "Mamba-2", "*": "attention", "-": "MLP"}
    for i, kind in enumerate(pattern):
        names = [f"blk.{i}.{t}" for t in ["attn_norm.weight", *_NEMOTRON_KINDS[kind]]]
        require_tensors(h, names, f"layer {i}, {kinds[kind]} by the per-layer KV heads and feed-forward widths")
    ssm = dict(d_inner=config["mamba_num_heads"] * config["mamba_head_dim"], heads=config["mamba_num_heads"],
               state=config["ssm_state_size"], groups=config["n_groups"], conv=config["conv_kernel"])  # fmt: skip
    check_ssm_shapes(h, pattern.index("M"), config["hidden_size"], ssm)
    attn, hidden, head_dim = pattern.index("*"), config["hidden_size"], config["head_dim"]
    expected = {
        f"blk.{attn}.attn_q.weight": (hidden, config["num_attention_heads"] * head_dim),
        f"blk.{attn}.attn_k.weight": (hidden, config["num_key_value_heads"] * head_dim),
    }
    if "-" in pattern:
        expected[f"blk.{pattern.index('-')}.ffn_up.weight"] = (hidden, config["intermediate_size"])
    _check_shapes(h, expected)


def _check_shapes(h: GGUFHeader, expected: dict[str, tuple[int, ...]]) -> None:
    for name, shape in expected.items():
        if h.tensors[name].shape != shape:
            raise ModelLoadError(
                f"GGUF file {str(h.path)!r}: tensor {name!r} of shape {list(h.tensors[name].shape)} does not match "
                f"the '{h.architecture}.*' sizes, which give {list(shape)}"
            )


def _tied_output(h: GGUFHeader, weights: dict) -> dict:
    """mlx-lm's nemotron_h always has ``lm_head``; without ``output.weight``
    llama.cpp uses the embedding (with its quantization, if kept)."""
    if "output.weight" in h.tensors:
        return weights
    embed = "backbone.embeddings."
    return {**weights, **{f"lm_head.{k[len(embed) :]}": v for k, v in weights.items() if k.startswith(embed)}}


_FALCON_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "pre_ff_layernorm",  # a file with the suffix, should a converter write one
    **ATTENTION,
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
    **{k: f"mamba.{v}" for k, v in _SSM_BLOCK.items()},
}
_FALCON_BARE = {**{k: f"mamba.{v}" for k, v in _SSM_BARE.items()}, "ffn_norm": "pre_ff_layernorm.weight"}
_FALCON_TENSORS = ["attn_norm.weight", *_ATTENTION_TENSORS, *(f"ffn_{t}.weight" for t in ("gate", "up", "down"))]
# Falcon-H1's muP multipliers, folded into the file's matrices by the converter.
_FALCON_UNIT = dict(
    embedding_multiplier=1.0, lm_head_multiplier=1.0, attention_in_multiplier=1.0, attention_out_multiplier=1.0,
    key_multiplier=1.0, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, mlp_multipliers=[1.0, 1.0],
    ssm_multipliers=[1.0] * 5,
)  # fmt: skip


def _falcon_h1(h: GGUFHeader, config: dict) -> None:
    """Falcon-H1: the Mamba-2 sizes, the multipliers at 1 (folded in the file),
    the SSM norm present in every layer or in none."""
    path, hidden, n = str(h.path), config["hidden_size"], config["num_hidden_layers"]
    config.setdefault("head_dim", hidden // config["num_attention_heads"])
    _one_head_size(h, config["head_dim"])
    normed = [f"blk.{i}.ssm_norm.weight" in h.tensors for i in range(n)]
    if any(normed) and not all(normed):
        raise ModelLoadError(
            f"GGUF file {path!r}: falcon-h1 with 'ssm_norm' in some layers only is not supported (mlx-lm's "
            f"mamba_rms_norm is one switch); layers with it: {[i for i in range(n) if normed[i]]}"
        )
    ssm = ssm_sizes(h, grouped_norm=not any(normed))  # mlx-lm's falcon_h1 norm is over all groups at once
    config.update(
        mamba_d_ssm=ssm["d_inner"], mamba_n_heads=ssm["heads"], mamba_d_head=ssm["d_inner"] // ssm["heads"],
        mamba_d_state=ssm["state"], mamba_d_conv=ssm["conv"], mamba_n_groups=ssm["groups"],
        mamba_conv_bias=_has(h, "ssm_conv1d.bias"), mamba_proj_bias=False, projectors_bias=False,
        mamba_rms_norm=all(normed), mamba_norm_before_gate=False,  # llama.cpp: y * silu(z), then the norm
        attention_bias=_has(h, "attn_q.bias"), mlp_bias=_has(h, "ffn_up.bias"), **_FALCON_UNIT,
    )  # fmt: skip
    require_tensors(h, ["output_norm.weight"], "the final norm")
    ssm_tensors = [t for t in SSM_TENSORS if normed[0] or t != "ssm_norm.weight"]
    for i in range(n):
        require_tensors(h, [f"blk.{i}.{t}" for t in [*_FALCON_TENSORS, *ssm_tensors]], f"layer {i}")
        if f"blk.{i}.ffn_norm.weight" not in h.tensors:  # the converter writes it without the suffix
            require_tensors(h, [f"blk.{i}.ffn_norm"], f"layer {i}'s pre-FFN norm")
    check_ssm_shapes(h, 0, hidden, ssm)


#: The Mamba-2 hybrids by ``general.architecture``.
MAMBA_HYBRID_FAMILIES = {
    "nemotron_h": Family(
        "nemotron_h",
        _NEMOTRON_BLOCK,
        _nemotron_h,
        global_names=_NEMOTRON_GLOBAL,
        recurrent_layers=True,
        reshape=mamba2_reshape,
        layer_prefix="backbone.layers",
        bare_names={k: f"mixer.{v}" for k, v in _SSM_BARE.items()},
        own_config=_nemotron_config,
        combine=_tied_output,
    ),
    "falcon-h1": Family(
        "falcon_h1",
        _FALCON_BLOCK,
        _falcon_h1,
        global_names={"token_embd": "model.embed_tokens", "output_norm": "model.final_layernorm", "output": "lm_head"},
        recurrent_layers=True,
        reshape=mamba2_reshape,
        bare_names=_FALCON_BARE,
    ),
}
