"""What every GGUF family mapping shares: ``Family`` (how one architecture maps
onto an mlx-lm model class), the common tensor-name maps, and the checks the
family modules use (dense.py: attention-only; recurrent.py, mamba_hybrids.py:
hybrids; moe.py, qwen35.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ...errors import ModelLoadError
from .reader import GGUFHeader, bad_field, meta_flag, meta_int

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture maps onto an mlx-lm model class."""

    model_type: str
    block_names: dict[str, str]
    extra_config: Callable[[GGUFHeader, dict], None] = lambda h, config: None
    norm_shift: float = 0.0  # subtracted from every *norm.weight (gemma stores 1 + w)
    rope_freqs: bool = False  # a rope_freqs tensor (Llama 3.x) is understood
    config: dict = field(default_factory=dict)
    global_names: dict[str, str] = field(default_factory=lambda: dict(GLOBAL_NAMES))
    recurrent_layers: bool = False  # head_count_kv may be 0 for a layer: a recurrent one
    reshape: Callable[[GGUFHeader, str, object], object] = lambda h, key, value: value  # a converter's transform undone
    layer_prefix: str = "model.layers"
    bare_names: dict[str, str] = field(default_factory=dict)  # block tensors named without .weight
    own_config: Callable[[GGUFHeader], dict] | None = None  # families without attention metadata
    yarn: bool = False  # YaRN RoPE scaling is mapped by extra_config
    decoded: bool = False  # reshape permutes within matrices: always read decoded, never through mx.load
    combine: Callable[[GGUFHeader, dict], dict] | None = None  # several GGUF tensors into one parameter


def no_head_dim(h: GGUFHeader, config: dict) -> None:
    """For classes whose head size is always hidden / heads."""
    if "head_dim" in config and config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        raise bad_field(
            h, f"{h.architecture}.attention.key_length", config["head_dim"], "embedding_length / head_count"
        )


def flag_or_true(h: GGUFHeader, key: str) -> bool:
    """A bool field that is true when absent."""
    return meta_flag(h, key) if key in h.metadata else True


def require_tensors(h: GGUFHeader, names: list[str], what: str) -> None:
    missing = [n for n in names if n not in h.tensors]
    if missing:
        raise ModelLoadError(f"GGUF file {str(h.path)!r} lacks {', '.join(map(repr, missing))} ({what})")


def kv_heads_per_layer(h: GGUFHeader, n_layers: int) -> list[int]:
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
