"""Qwen3.5 / Qwen3.6 MTP heads: mlx-vlm's split drafter folder (``model_type``
``qwen3_5_mtp``: ``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
``layers.N.*``, ``norm``) or the ``mtp.*`` tensors of the target's own Hugging
Face checkpoint. The network is mlx-vlm's ``Qwen3_5MTPDraftModel`` (its modules,
its ``sanitize``: the zero-centred norms of the HF layout), run here with a cache
and positions per request, as mlx-vlm's session methods run it.

Entry for target position ``p``: ``fc([norm(embed(t[p+1])), norm(h[p])])``
through the head's full-attention layer(s) at position ``p``, then ``norm``;
``h[p]`` is the target's final normed hidden state. Its output, through the
target's output layer, predicts the token at ``p + 2``; a chained step reads
that output (after ``norm``), as mlx-vlm chains it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.base import create_attention_mask
from mlx_vlm.models.cache import KVCache
from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig
from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel

from ..decode import capture
from ..decode.capture import FINAL, HiddenSpec

MODEL_TYPES = ("qwen3_5_mtp",)
#: Target families whose own checkpoint may hold ``mtp.*`` tensors of this layout.
TARGET_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def is_split_config(config: dict) -> bool:
    return config.get("model_type") in MODEL_TYPES


def head_config(config: dict) -> Qwen3_5MTPConfig:
    """mlx-vlm's config from a split folder's config.json or from the target's
    own (flat or with ``text_config``)."""
    text = dict(config.get("text_config") or config)
    text.setdefault("mtp_num_hidden_layers", config.get("mtp_num_hidden_layers", 1))
    text["rope_parameters"] = _rope(text)
    return Qwen3_5MTPConfig.from_dict({**config, "model_type": "qwen3_5_mtp", "text_config": text})


def _rope(text: dict) -> dict:
    """mlx-vlm's rope fields from a text-only config (mlx-lm's has no
    ``mrope_section``: text positions are the same in every section, so any
    split of the rotary frequencies gives plain rotary embeddings)."""
    rope = dict(text.get("rope_parameters") or {})
    rope.setdefault("rope_theta", text.get("rope_theta", 10000.0))
    rope.setdefault("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    rope.setdefault("type", rope.get("rope_type", "default"))
    if "mrope_section" not in rope:
        head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
        half = int(head_dim * rope["partial_rotary_factor"]) // 2
        rope["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    return rope


def build_net(config: dict) -> Qwen3_5MTPDraftModel:
    return Qwen3_5MTPDraftModel(head_config(config))


class Qwen35MTPHead:
    """A Qwen3.5 MTP head bound to its target (heads/model.Head)."""

    kind = "qwen3_5_mtp"

    def __init__(self, net: Qwen3_5MTPDraftModel, model: nn.Module, vocab: int):
        self.net = net
        inner = capture.text_model(model)
        self.embed = inner.embed_tokens
        self.embed_scale = float(getattr(inner, "embed_scale", 1.0))
        self.spec = HiddenSpec((FINAL,))
        self.draft_vocab = vocab
        lm = getattr(model, "language_model", model)
        self._out = getattr(model, "lm_head", None) or getattr(lm, "lm_head", None) or self.embed.as_linear

    def new_cache(self) -> list:
        return [KVCache() for _ in self.net.layers]

    def forward(self, cache: list, tokens: mx.array, hidden: mx.array, position: int) -> mx.array:
        net = self.net
        e = self.embed(tokens) * self.embed_scale
        h = mx.concatenate([net.pre_fc_norm_embedding(e), net.pre_fc_norm_hidden(hidden.astype(e.dtype))], axis=-1)
        h = net.fc(h)
        positions = (mx.arange(tokens.shape[1], dtype=mx.int32) + position)[None]
        for layer, c in zip(net.layers, cache):
            h = layer(h, mask=create_attention_mask(h, c), cache=c, position_ids=positions)
        return net.norm(h)

    def logits(self, h: mx.array) -> mx.array:
        return self._out(h)

    def to_target(self, ids: mx.array) -> mx.array:
        return ids.astype(mx.uint32)

    def chained(self, h: mx.array) -> mx.array:
        return h
