"""The dense attention GGUF families (no recurrent layers, no experts) mapped
onto mlx-lm's classes. What llama.cpp's converter does and what the mapping
does about it:

- ``llama`` (Llama 1-3, Mistral 7B, SmolLM): q/k rows permuted for interleaved
  RoPE; mlx-lm's llama computes interleaved RoPE with ``rope_traditional=True``,
  so the rows are used as stored. Llama 3.x RoPE scaling is a ``rope_freqs``
  tensor of per-frequency divisors, applied through ``mx.fast.rope(freqs=...)``
  (families.py's ``FactoredRoPE``).
- ``qwen2``, ``qwen3``, ``phi3``: stored unpermuted (NeoX RoPE).
- ``gemma2``, ``gemma3``: every ``*norm.weight`` stored as ``1 + w``; mlx-lm's
  Gemma RMSNorm adds the 1 itself, so 1 is subtracted back.
"""

from __future__ import annotations

import logging

from ...errors import ModelLoadError
from .family import ATTENTION, MLP, Family, no_head_dim
from .reader import GGUFHeader, bad_field, meta_float, meta_int

logger = logging.getLogger(__name__)

_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **ATTENTION, **MLP}
_GEMMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **ATTENTION,
    **MLP,
}
_PHI3_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # gate and up fused, as in Phi-3's own checkpoint
    "ffn_down": "mlp.down_proj",
}


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


def _phi3(h: GGUFHeader, config: dict) -> None:
    if "rope_factors_long.weight" in h.tensors or "rope_factors_short.weight" in h.tensors:
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: phi3 LongRoPE (rope_factors_long/short) is not mapped yet")
    no_head_dim(h, config)


DENSE_FAMILIES = {
    "llama": Family("llama", _LLAMA_BLOCK, rope_freqs=True, config={"rope_traditional": True}),
    "qwen2": Family("qwen2", _LLAMA_BLOCK, config={"rope_traditional": False}),
    "qwen3": Family("qwen3", {**_LLAMA_BLOCK, **_QK_NORM}, _head_dim),
    "gemma2": Family("gemma2", _GEMMA_BLOCK, _gemma2, norm_shift=1.0),
    "gemma3": Family("gemma3_text", {**_GEMMA_BLOCK, **_QK_NORM}, _gemma3, norm_shift=1.0),
    "phi3": Family("phi3", _PHI3_BLOCK, _phi3),
}
