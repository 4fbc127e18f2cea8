"""EAGLE-3 heads (speculators / SGLang checkpoints): the network is mlx-vlm's
``Eagle3DraftModel`` (its modules and weight names), run here with a cache and
positions per request instead of mlx-vlm's one session state, so each row of a
batch keeps its own head state (docs/decoding.md, *Hidden-state drafters*)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.base import create_attention_mask
from mlx_vlm.models.cache import KVCache
from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config
from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

from ..decode.capture import HiddenSpec

#: llama fields of SGLang's flat EAGLE-3 config, moved under ``transformer_layer_config``.
_LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "vocab_size",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
    "num_hidden_layers",
)


def is_eagle3_config(config: dict) -> bool:
    """Whether ``config`` (a config.json) describes an EAGLE-3 head."""
    kinds = {config.get("model_type"), config.get("speculators_model_type")}
    archs = " ".join(config.get("architectures") or [])
    return "eagle3" in kinds or "Eagle3" in archs or "eagle_aux_hidden_state_layer_ids" in config


def eagle3_config(config: dict) -> Eagle3Config:
    """mlx-vlm's config from either form: speculators' (the layer's fields under
    ``transformer_layer_config``) or SGLang's flat one (aux ids under ``eagle_config``)."""
    flat = dict(config)
    if "transformer_layer_config" not in flat:
        flat["transformer_layer_config"] = {k: flat[k] for k in _LAYER_FIELDS if k in flat}
        flat["transformer_layer_config"].setdefault("num_hidden_layers", 1)
    aux = (flat.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is not None:
        flat.setdefault("eagle_aux_hidden_state_layer_ids", aux)
    flat.setdefault("draft_vocab_size", flat["transformer_layer_config"].get("vocab_size", 32000))
    return Eagle3Config.from_dict(flat)


def rename_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Speculators/SGLang names (``midlayer.*``, a ``model.`` prefix) onto mlx-vlm's (``layers.0.*``)."""
    out = {}
    for key, value in weights.items():
        key = key.removeprefix("model.")
        if key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer.") :]
        out[key] = value
    return out


class Eagle3Head:
    """An EAGLE-3 head bound to its target: what the drafter runs.

    Entry for target position ``p``: the hidden states recorded at ``p`` (the
    aux layers, through ``fc``) with the embedding of the token at ``p + 1``,
    at rotary position ``p + 1``; its output predicts the token at ``p + 2``.
    A chained step reads the head's own output (before ``norm``) instead."""

    kind = "eagle3"

    def __init__(self, net: Eagle3DraftModel, config: Eagle3Config, embed: nn.Module):
        self.net, self.config, self.embed = net, config, embed
        # aux id i is the output of decoder layer i-1 (Hugging Face's hidden_states[i]), as mlx-vlm reads it.
        self.spec = HiddenSpec(tuple(config.capture_layer_ids))
        self.draft_vocab = net.draft_vocab_size
        self.target_vocab = net.target_vocab_size

    def new_cache(self) -> list:
        return [KVCache() for _ in self.net.layers]

    def forward(self, cache: list, tokens: mx.array, hidden: mx.array, position: int) -> mx.array:
        """Push entries for ``tokens`` (1, L) with ``hidden`` (1, L, width) at
        target positions from ``position``; returns the head's outputs (1, L, hidden)."""
        net = self.net
        if hidden.shape[-1] != net.hidden_size:  # the target's aux states (a chained step reads its own)
            if net.input_norm is not None:
                hidden = net.input_norm(hidden)
            hidden = net.fc(hidden)
        embeds = self.embed(tokens)
        h = hidden.astype(embeds.dtype) if hidden.dtype != embeds.dtype else hidden
        for i, layer in enumerate(net.layers):
            mask = create_attention_mask(h, cache[i])
            h = layer(embeds, h, mask, cache[i], position + 1) if i == 0 else layer(h, mask, cache[i], position + 1)
        return h

    def logits(self, h: mx.array) -> mx.array:
        """Draft-vocabulary logits of head outputs."""
        h = self.net.norm(h)
        return self.embed.as_linear(h) if self.net.lm_head is None else self.net.lm_head(h)

    def to_target(self, ids: mx.array) -> mx.array:
        """Draft-vocabulary ids as target ids (``d2t`` offsets)."""
        ids = ids.astype(mx.int32)
        if self.net.d2t is not None:
            ids = ids + self.net.d2t[ids]
        return ids.astype(mx.uint32)

    def chained(self, h: mx.array) -> mx.array:
        """What the next chained step reads as its hidden state."""
        return h
