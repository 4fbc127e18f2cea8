"""GGUF mixture-of-experts families mapped onto mlx-lm's classes. What
llama.cpp's converter does and what the mapping does about it:

- ``qwen3moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): every
  layer a sparse MoE block (llama.cpp has no dense layers for it, so mlx-lm's
  ``decoder_sparse_step`` is 1 and ``mlp_only_layers`` empty); the router is
  ``ffn_gate_inp``, the experts stacked ``ffn_{gate,up,down}_exps``
  (GGUF ``[hidden, ff, experts]``, MLX ``(experts, ff, hidden)``: the same
  bytes), the expert width ``expert_feed_forward_length``. llama.cpp always
  renormalizes the top-k router probabilities, so ``norm_topk_prob`` is true.

- ``gpt-oss`` (gpt-oss-20b/120b): attention with q/k/v/o biases and one
  learned sink per head (``attn_sinks``, a parameter of its own in mlx-lm);
  sliding-window layers alternating with global ones, the first sliding
  (llama.cpp's pattern 2, mlx-lm's default ``layer_types``), window
  ``attention.sliding_window``; YaRN RoPE from ``rope.scaling.*``; the router
  ``ffn_gate_inp`` with a bias, softmax over the top-k logits; experts with
  biases, gate and up split from the checkpoint's interleaved ``gate_up_proj``
  by the converter (mlx-lm's class holds them split too), clamped SwiGLU
  (alpha 1.702, limit 7, both fixed in llama.cpp and mlx-lm). The checkpoint's
  MXFP4 experts are written as GGUF MXFP4, MLX's ``mxfp4`` mode byte for byte.

How quantized expert tensors are held is the reader's ``expert_layout``
(docs/gguf.md): they stay quantized where MLX has an exact equivalent.
"""

from __future__ import annotations

from ...errors import ModelLoadError
from .family import ATTENTION, Family, require_tensors
from .reader import GGUFHeader, TensorInfo, bad_field, meta_float, meta_int, meta_str
from .transcode import TRANSCODED

EXPERTS = {
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_QWEN3MOE_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    **ATTENTION,
    **EXPERTS,
}


def is_expert_tensor(info: TensorInfo) -> bool:
    """A stacked expert matrix (``blk.N.ffn_*_exps.weight``, three dimensions)
    of a type MLX holds exactly (transcode.py): kept quantized as stored."""
    return info.name.endswith("_exps.weight") and len(info.shape) == 3 and info.type_name in TRANSCODED


def expert_sizes(h: GGUFHeader, hidden: int, width_key: str = "expert_feed_forward_length") -> tuple[int, int, int]:
    """``(experts, used per token, expert width)`` from ``<arch>.expert_*``
    (the width from ``width_key``), checked against every block's stacked
    expert tensors."""
    arch = h.architecture
    n_expert = meta_int(h, f"{arch}.expert_count", hi=4096)
    n_used = meta_int(h, f"{arch}.expert_used_count", hi=n_expert)
    width = meta_int(h, f"{arch}.{width_key}")
    n_layers = meta_int(h, f"{arch}.block_count")
    expected = {"ffn_gate_exps": (hidden, width, n_expert), "ffn_up_exps": (hidden, width, n_expert),
                "ffn_down_exps": (width, hidden, n_expert), "ffn_gate_inp": (hidden, n_expert)}  # fmt: skip
    for i in range(n_layers):
        names = [f"blk.{i}.{t}.weight" for t in expected]
        require_tensors(h, names, f"the experts of layer {i}")
        for t, shape in expected.items():
            info = h.tensors[f"blk.{i}.{t}.weight"]
            if info.shape != shape:
                raise ModelLoadError(
                    f"GGUF file {str(h.path)!r}: tensor {info.name!r} of shape {list(info.shape)} does not match "
                    f"'{arch}.embedding_length', '{arch}.{width_key}' and '{arch}.expert_count', "
                    f"which give {list(shape)}"
                )
    return n_expert, n_used, width


def _qwen3moe(h: GGUFHeader, config: dict) -> None:
    """Every layer sparse, top-k renormalized (as llama.cpp computes it)."""
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    if any(f"blk.{i}.ffn_gate_inp_shexp.weight" in h.tensors for i in range(config["num_hidden_layers"])):
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: qwen3moe with shared experts is not a Qwen3-MoE model")
    n_expert, n_used, width = expert_sizes(h, config["hidden_size"])
    if "qwen3moe.expert_shared_count" in h.metadata:
        raise bad_field(h, "qwen3moe.expert_shared_count", h.metadata["qwen3moe.expert_shared_count"], "absent")
    config.update(
        num_experts=n_expert, num_experts_per_tok=n_used, moe_intermediate_size=width, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True,
    )  # fmt: skip


_GPT_OSS_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",  # a parameter, not a module: see mlx_name
    "ffn_gate_inp": "mlp.router",
    **ATTENTION,
    **{k: v.replace("mlp.switch_mlp.", "mlp.experts.") for k, v in EXPERTS.items()},
}


def _gpt_oss(h: GGUFHeader, config: dict) -> None:
    """gpt-oss: alternating sliding-window layers, sinks, YaRN, biased experts."""
    arch, path = "gpt-oss", str(h.path)
    n_layers = config["num_hidden_layers"]
    if "gpt-oss.attention.sliding_window_pattern" in h.metadata:
        raise ModelLoadError(
            f"GGUF file {path!r}: an explicit gpt-oss sliding-window pattern is not supported "
            "(only alternating layers, the first sliding, as gpt-oss and llama.cpp's default)"
        )
    if n_layers % 2:
        raise bad_field(h, f"{arch}.block_count", n_layers, "even (sliding and global layers alternate)")
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    n_expert, n_used, width = expert_sizes(h, config["hidden_size"])
    biases = [f"blk.{i}.{t}.bias" for i in range(n_layers) for t in ("ffn_gate_inp", *EXPERTS, *ATTENTION)]
    require_tensors(h, biases + [f"blk.{i}.attn_sinks.weight" for i in range(n_layers)], "gpt-oss's biases and sinks")
    config.update(
        num_local_experts=n_expert, num_experts_per_tok=n_used, intermediate_size=width,
        sliding_window=meta_int(h, f"{arch}.attention.sliding_window"),
        layer_types=["sliding_attention", "full_attention"] * (n_layers // 2), rope_scaling=_yarn(h),
    )  # fmt: skip


def _yarn(h: GGUFHeader) -> dict | None:
    """mlx-lm's YaRN config from ``rope.scaling.*`` (None without scaling)."""
    arch = h.architecture
    kind = meta_str(h, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise bad_field(h, f"{arch}.rope.scaling.type", kind, "'yarn' or 'none'")
    for key in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier"):
        if f"{arch}.rope.scaling.{key}" in h.metadata:
            raise ModelLoadError(f"GGUF file {str(h.path)!r}: '{arch}.rope.scaling.{key}' is not mapped")
    return {
        "rope_type": "yarn",
        "factor": meta_float(h, f"{arch}.rope.scaling.factor", 1.0),
        "original_max_position_embeddings": meta_int(h, f"{arch}.rope.scaling.original_context_length"),
        "beta_fast": meta_float(h, f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": meta_float(h, f"{arch}.rope.scaling.yarn_beta_slow", 1.0),
    }


MOE_FAMILIES = {
    "qwen3moe": Family("qwen3_moe", _QWEN3MOE_BLOCK, _qwen3moe),
    "gpt-oss": Family("gpt_oss", _GPT_OSS_BLOCK, _gpt_oss, yarn=True),
}
