"""GGUF ``qwen35`` (Qwen3.5/3.6 dense), ``qwen35moe`` (Qwen3.5/3.6 MoE:
experts and a gated shared expert, as qwen3moe's plus ``ffn_*_shexp``) and
``qwen3next`` (Qwen3-Next: qwen35moe's shape; the converter reorders no value
heads but splits the checkpoint's fused ``in_proj_qkvz``, per key head ``[q, k,
v, z]``, into ``attn_qkv`` and ``attn_gate``, re-fused here, and keeps
``in_proj_ba`` as ``ssm_ba``) mapped onto mlx-lm's ``qwen3_5``,
``qwen3_5_moe`` and ``qwen3_next``: gated
delta-net (linear attention) layers with a full-attention layer every
``full_attention_interval``. What llama.cpp's converter (``Qwen3_5TextModel``:
``Qwen3NextModel`` and ``_LinearAttentionVReorderBase``) did, and what the
mapping does about it:

- ``A_log`` stored as ``ssm_a = -exp(A_log)``: the log is taken back.
- ``dt_bias`` stored as ``ssm_dt.bias``; ``in_proj_b``/``in_proj_a`` as
  ``ssm_beta``/``ssm_alpha``; ``in_proj_qkv``/``in_proj_z`` as
  ``attn_qkv``/``attn_gate``; the gated norm as ``ssm_norm``.
- the depthwise conv kernel squeezed to ``[K, channels]``: its axis comes back.
- every ``*norm.weight`` but the linear-attention norm stored ``+ 1``: mlx-lm's
  ``qwen3_5`` holds them with the 1 added too (its ``sanitize`` adds it to a
  Hugging Face checkpoint), so they are used as stored.
- with fewer key than value heads, the value heads reordered from grouped by
  key head to tiled (``[G0v0, G1v0, ..., G0v1, G1v1, ...]``) in the V rows of
  ``attn_qkv``, the rows of ``attn_gate``, ``ssm_beta``, ``ssm_alpha``, the
  entries of ``ssm_a`` and ``ssm_dt``, the V channels of the conv kernel and
  the columns of ``ssm_out``: reordered back.
- partial RoPE (``rope.dimension_count``) and multimodal RoPE sections
  (``rope.dimension_sections``): with text, every section's position is the
  token's, so it is plain NeoX RoPE on those dimensions.
- the MTP head, written as ``nextn_predict_layers`` extra blocks
  ``blk.{n}.*`` (a full-attention block and ``nextn.{eh_proj,enorm,hnorm,
  shared_head_norm}``): not part of mlx-lm's class; kept, decoded, under the
  Hugging Face names (``mtp.layers.0.*``, ``mtp.fc.weight``, ...) as the
  model's ``mtp_weights`` for a hidden-state drafter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ...errors import ModelLoadError
from .family import MLP, Family, require_tensors
from .moe import EXPERTS, expert_sizes
from .reader import GGUFHeader, bad_field, meta_int

_ATTENTION = {
    "attn_q": "self_attn.q_proj",  # queries and their output gate, interleaved per head
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LINEAR = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt_bias",  # only a bias: see mlx_name
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_BLOCK = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm", **_ATTENTION,
          **_LINEAR, **MLP}  # fmt: skip
_BARE = {"ssm_a": "linear_attn.A_log"}
_MOE_FFN = {
    "ffn_gate_inp": "mlp.gate",
    **EXPERTS,
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_MOE_BLOCK = {**{k: v for k, v in _BLOCK.items() if k not in MLP}, **_MOE_FFN}
# qwen3next: the split halves of in_proj_qkvz (re-fused by _fuse_qkvz) and the fused in_proj_ba
_NEXT_LINEAR = {**{k: v for k, v in _LINEAR.items() if k not in ("ssm_beta", "ssm_alpha")},
                "ssm_ba": "linear_attn.in_proj_ba"}  # fmt: skip
_NEXT_BLOCK = {**{k: v for k, v in _MOE_BLOCK.items() if k not in ("ssm_beta", "ssm_alpha")}, **_NEXT_LINEAR}
# The converter's remap of the MTP head (``_QwenMtpMixin.filter_tensors``), reversed.
_MTP_NAMES = {"nextn.eh_proj": "fc", "nextn.enorm": "pre_fc_norm_embedding", "nextn.hnorm": "pre_fc_norm_hidden",
              "nextn.shared_head_norm": "norm"}  # fmt: skip


def _sizes(h: GGUFHeader) -> dict:
    """The gated delta-net sizes from ``qwen35.ssm.*`` (llama.cpp's reading:
    key heads ``group_count``, value heads ``time_step_rank``, both head sizes
    ``state_size``)."""
    arch = h.architecture
    k_heads, v_heads = meta_int(h, f"{arch}.ssm.group_count"), meta_int(h, f"{arch}.ssm.time_step_rank")
    head = meta_int(h, f"{arch}.ssm.state_size")
    if v_heads % k_heads:
        raise bad_field(h, f"{arch}.ssm.time_step_rank", v_heads, f"a multiple of '{arch}.ssm.group_count' ({k_heads})")
    inner = meta_int(h, f"{arch}.ssm.inner_size")
    if inner != head * v_heads:
        raise bad_field(h, f"{arch}.ssm.inner_size", inner, f"state_size * time_step_rank ({head * v_heads})")
    return dict(k_heads=k_heads, v_heads=v_heads, head=head, conv=meta_int(h, f"{arch}.ssm.conv_kernel", lo=2, hi=64))


def _qwen35(h: GGUFHeader, config: dict) -> None:
    """Layer kinds from ``full_attention_interval``, the delta-net sizes,
    partial RoPE; the MTP blocks counted out of the layers."""
    arch = h.architecture
    n_mtp = meta_int(h, f"{arch}.nextn_predict_layers", 0, lo=0, hi=8)
    n_layers = config["num_hidden_layers"] - n_mtp
    if n_layers < 1:
        raise bad_field(h, f"{arch}.nextn_predict_layers", n_mtp, f"below '{arch}.block_count'")
    interval = meta_int(h, f"{arch}.full_attention_interval", 4, hi=max(n_layers, 1))
    if f"{arch}.attention.recurrent_layers" in h.metadata:
        kinds = h.metadata[f"{arch}.attention.recurrent_layers"]
        expected = [(i + 1) % interval != 0 for i in range(n_layers)] + [False] * n_mtp
        if not isinstance(kinds, np.ndarray) or kinds.astype(bool).tolist() != expected:
            raise bad_field(h, f"{arch}.attention.recurrent_layers", kinds, f"every {interval}th layer attention")
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    rope_dims = meta_int(h, f"{arch}.rope.dimension_count", config["head_dim"], hi=config["head_dim"])
    ssm = _sizes(h)
    config.update(
        num_hidden_layers=n_layers, full_attention_interval=interval, linear_num_key_heads=ssm["k_heads"],
        linear_num_value_heads=ssm["v_heads"], linear_key_head_dim=ssm["head"], linear_value_head_dim=ssm["head"],
        linear_conv_kernel_dim=ssm["conv"], attention_bias=False, num_experts=0,
        rope_parameters={"type": "default", "rope_theta": config["rope_theta"],
                         "partial_rotary_factor": rope_dims / config["head_dim"]},
        partial_rotary_factor=rope_dims / config["head_dim"], mlp_only_layers=[], decoder_sparse_step=1,
    )  # fmt: skip
    ffn = list(MLP) if arch == "qwen35" else list(_MOE_FFN)
    linear = list(_NEXT_LINEAR) if arch == "qwen3next" else list(_LINEAR)
    if arch == "qwen3next" and any(name.endswith(".ssm_in.weight") for name in h.tensors):
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r}: qwen3next with a fused 'ssm_in' projection (an older converter's layout) "
            "is not mapped; files with attn_qkv and attn_gate are"
        )
    for i in range(n_layers):
        kind = "linear" if (i + 1) % interval else "attention"
        own = linear if kind == "linear" else list(_ATTENTION)
        names = [f"blk.{i}.{t}.{'bias' if t == 'ssm_dt' else 'weight'}" for t in ["attn_norm", *own, *ffn]]
        require_tensors(h, names + ([f"blk.{i}.ssm_a"] if kind == "linear" else []), f"layer {i}, {kind}")
    _check_linear_shapes(h, config, ssm)
    if n_mtp:
        require_tensors(h, [f"blk.{n_layers}.nextn.eh_proj.weight"], "the MTP block ('nextn_predict_layers')")


def _qwen35moe(h: GGUFHeader, config: dict) -> None:
    """qwen35 with every feed-forward a sparse MoE block and a sigmoid-gated
    shared expert (``ffn_*_shexp``, ``ffn_gate_inp_shexp``); top-k
    renormalized, as llama.cpp computes it."""
    arch = h.architecture
    if any(name.endswith("ffn_gate_up_exps.weight") for name in h.tensors):
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r}: fused 'ffn_gate_up_exps' expert tensors are not mapped; files with "
            "separate ffn_gate_exps and ffn_up_exps are"
        )
    _qwen35(h, config)
    n_expert, n_used, width = expert_sizes(h, config["hidden_size"])
    config.update(
        num_experts=n_expert, num_experts_per_tok=n_used, moe_intermediate_size=width, decoder_sparse_step=1,
        norm_topk_prob=True,
        shared_expert_intermediate_size=meta_int(h, f"{arch}.expert_shared_feed_forward_length",
                                                 config["intermediate_size"]),
    )  # fmt: skip


def _check_linear_shapes(h: GGUFHeader, config: dict, ssm: dict) -> None:
    """The first linear layer's projections against the ``ssm.*`` sizes."""
    hidden, key_dim, value_dim = config["hidden_size"], ssm["k_heads"] * ssm["head"], ssm["v_heads"] * ssm["head"]
    expected = {
        "attn_qkv.weight": (hidden, 2 * key_dim + value_dim), "attn_gate.weight": (hidden, value_dim),
        "ssm_conv1d.weight": (ssm["conv"], 2 * key_dim + value_dim), "ssm_beta.weight": (hidden, ssm["v_heads"]),
        "ssm_ba.weight": (hidden, 2 * ssm["v_heads"]), "ssm_out.weight": (value_dim, hidden),
        "ssm_a": (ssm["v_heads"],),
    }  # fmt: skip
    for name, shape in expected.items():
        info = h.tensors.get(f"blk.0.{name}")
        if info is None:  # ssm_beta in qwen35, ssm_ba in qwen3next
            continue
        if info.shape != shape:
            raise ModelLoadError(
                f"GGUF file {str(h.path)!r}: tensor {info.name!r} of shape {list(info.shape)} does not match the "
                f"'{h.architecture}.ssm.*' sizes, which give {list(shape)}"
            )


def _untile(value, axis: int, k_heads: int, v_per_k: int, head: int):
    """Value heads from the converter's tiled order back to grouped by key head
    along ``axis`` (the inverse of ``_reorder_v_heads``)."""
    import mlx.core as mx

    shape = list(value.shape)
    axis %= len(shape)
    split = shape[:axis] + [v_per_k, k_heads, head] + shape[axis + 1 :]
    return mx.swapaxes(value.reshape(split), axis, axis + 1).reshape(shape)


def _qwen35_reshape(h: GGUFHeader, key: str, value):
    """Undo the converter: log of -A, the conv kernel's axis, value heads back
    to grouped order."""
    import mlx.core as mx

    ssm = _sizes(h)
    k, r, d = ssm["k_heads"], ssm["v_heads"] // ssm["k_heads"], ssm["head"]
    if key.endswith("A_log"):
        a = value.astype(mx.float32).reshape(-1)
        if not (a < 0).all().item():
            raise ModelLoadError(
                f"GGUF file {str(h.path)!r}: {key!r} (ssm_a) holds A = -exp(A_log), so must be negative"
            )
        value = mx.log(-a)
    if key.endswith("conv1d.weight") and value.ndim == 2:
        value = value[..., None]
    if key.endswith("shared_expert_gate.weight"):  # GGUF [hidden] or [hidden, 1]: one output
        return value.reshape(1, -1)
    if r == 1 or ".linear_attn." not in key or h.architecture == "qwen3next":  # qwen3next: heads as in HF
        return value
    key_dim = k * d
    if key.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        qk, v = value[: 2 * key_dim], value[2 * key_dim :]
        return mx.concatenate([qk, _untile(v, 0, k, r, d)], axis=0)
    if key.endswith("in_proj_z.weight"):
        return _untile(value, 0, k, r, d)
    if key.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return _untile(value, 0, k, r, 1)
    if key.endswith("out_proj.weight"):
        return _untile(value, 1, k, r, d)
    return value


def _fuse_qkvz(h: GGUFHeader, weights: dict) -> dict:
    """qwen3next: the converter split ``in_proj_qkvz`` (per key head ``[q, k,
    v, z]``) into ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (z);
    mlx-lm's class takes it fused as in the checkpoint, so it is re-fused."""
    import mlx.core as mx

    ssm = _sizes(h)
    nk, d = ssm["k_heads"], ssm["head"]
    out = {}
    for key, value in weights.items():
        if not key.endswith("linear_attn.in_proj_qkv.weight"):
            if not key.endswith("linear_attn.in_proj_z.weight"):
                out[key] = value
            continue
        stem = key[: -len("in_proj_qkv.weight")]
        hidden = value.shape[-1]
        q, k, v = value[: nk * d], value[nk * d : 2 * nk * d], value[2 * nk * d :]
        parts = [t.reshape(nk, -1, hidden) for t in (q, k, v, weights[f"{stem}in_proj_z.weight"])]
        out[f"{stem}in_proj_qkvz.weight"] = mx.concatenate(parts, axis=1).reshape(-1, hidden)
    return out


def mtp_name(name: str, h: GGUFHeader) -> str | None:
    """The Hugging Face name of a tensor of the MTP blocks (None for any other)."""
    n_mtp = h.metadata.get(f"{h.architecture}.nextn_predict_layers", 0)
    first = int(h.metadata.get(f"{h.architecture}.block_count", 0)) - int(n_mtp or 0)
    m = re.fullmatch(r"blk\.(\d+)\.(.+)\.(weight|bias|scales|biases)", name)
    if not n_mtp or not m or int(m.group(1)) < first:
        return None
    stem, suffix = m.group(2), m.group(3)
    if stem in _MTP_NAMES:
        return f"mtp.{_MTP_NAMES[stem]}.{suffix}"
    layer = int(m.group(1)) - first
    return f"mtp.layers.{layer}.{_MOE_BLOCK.get(stem, _BLOCK.get(stem, stem))}.{suffix}"


@dataclass(frozen=True)
class MTPHead:
    """A file's multi-token-prediction head (Qwen3.5's ``nextn`` blocks), which
    mlx-lm's class does not compute: the arrays under their Hugging Face names
    (``mtp.fc.weight``, ``mtp.pre_fc_norm_embedding.weight``,
    ``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight``, ``mtp.layers.0.*``
    as a full-attention block; norms as stored, with the 1 added), for a
    hidden-state drafter. Set as ``model.mtp`` (not a parameter: a plain value,
    so it is not part of ``model.parameters()``)."""

    weights: dict


QWEN35_FAMILIES = {
    "qwen35": Family(
        "qwen3_5", _BLOCK, _qwen35, reshape=_qwen35_reshape, bare_names=_BARE, decoded=True
    ),  # decoded: the value heads are permuted back within rows and columns
    "qwen35moe": Family("qwen3_5_moe", _MOE_BLOCK, _qwen35moe, reshape=_qwen35_reshape, bare_names=_BARE, decoded=True),
    "qwen3next": Family(
        "qwen3_next",
        _NEXT_BLOCK,
        _qwen35moe,
        reshape=_qwen35_reshape,
        bare_names=_BARE,
        decoded=True,
        combine=_fuse_qkvz,
    ),  # fmt: skip
}
