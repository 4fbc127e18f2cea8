"""DeepSeek/GLM-style MTP heads: the layer a checkpoint keeps at index
``num_hidden_layers`` (``eh_proj``, ``enorm``, ``hnorm``, ``shared_head``, and
a decoder layer of the target's own architecture).

Entry for target position ``p``: ``eh_proj([enorm(embed(t[p+1])), hnorm(h[p])])``
through the decoder layer, ``h[p]`` the target's final normed hidden state (what
its output layer reads, as vLLM's DeepSeek MTP reads it); its output, through
``shared_head.norm`` and ``shared_head.head`` (the target's output layer when
absent), predicts the token at ``p + 2``. A chained step reads the head's own
output (before ``shared_head.norm``). The decoder layer is a copy of one of
the target's attention layers (the last one), given the head's weights, so
any architecture mlx-lm implements works; its weights go through the target's
own ``sanitize`` under that layer's name.
"""

from __future__ import annotations

import copy
import re

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..decode import capture
from ..decode.capture import FINAL, HiddenSpec

#: A layer-N MTP tensor: ``model.layers.N.<rest>`` with ``eh_proj`` among them.
LAYER_TENSOR = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
FUSION = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")


def mtp_layer_index(names: list[str]) -> int | None:
    """The layer index holding an MTP head (its ``eh_proj``), or None."""
    for name in names:
        m = LAYER_TENSOR.match(name)
        if m and m.group(2) == "eh_proj.weight":
            return int(m.group(1))
    return None


class MTPNet(nn.Module):
    """The head's weights: the fusion, the decoder layer (``block``), the final norm."""

    def __init__(self, block: nn.Module, hidden: int, eps: float, own_head: int | None):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.shared_head = {"norm": nn.RMSNorm(hidden, eps=eps)}
        if own_head is not None:
            self.shared_head["head"] = nn.Linear(hidden, own_head, bias=False)


def attention_template(model: nn.Module) -> int:
    """The index of the target's last attention layer (a KV cache layer): the MTP block's architecture."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    for i in reversed(range(len(caches))):
        if isinstance(caches[i], KVCache) or type(caches[i]).__name__ in ("KVCache", "RotatingKVCache"):
            return i
    raise ValueError("the target has no attention layer to build an MTP block from")


def head_weights(model: nn.Module, tensors: dict[str, mx.array], template: int) -> dict[str, mx.array]:
    """A layer-N head's tensors (``rest`` names) onto ``MTPNet``'s names: the
    decoder layer's through the target's sanitize, as its layer ``template``."""
    fusion = {k: v for k, v in tensors.items() if k.split(".")[0] in ("eh_proj", "enorm", "hnorm", "shared_head")}
    layer = {k: v for k, v in tensors.items() if k not in fusion and not k.startswith("embed_tokens.")}
    prefix = f"model.layers.{template}."
    sanitize = getattr(model, "sanitize", None)
    named = {prefix + k: v for k, v in layer.items()}
    if sanitize is not None:
        named = sanitize(named)
    out = {k: v for k, v in fusion.items()}
    for k, v in named.items():
        m = LAYER_TENSOR.match(k.removeprefix("language_model."))
        out["block." + (m.group(2) if m else k)] = v
    return out


class LayerNMTPHead:
    """A layer-N MTP head bound to its target (heads/model.Head)."""

    kind = "mtp"

    def __init__(self, net: MTPNet, model: nn.Module, vocab: int):
        self.net, self.model = net, model
        self.embed = capture.text_model(model).embed_tokens
        self.spec = HiddenSpec((FINAL,))
        self.draft_vocab = vocab
        own = net.shared_head.get("head")
        lm_head = getattr(model, "lm_head", None) or getattr(getattr(model, "language_model", None), "lm_head", None)
        self._out = own if own is not None else (lm_head if lm_head is not None else self.embed.as_linear)

    def new_cache(self) -> list:
        return [KVCache()]

    def forward(self, cache: list, tokens: mx.array, hidden: mx.array, position: int) -> mx.array:
        net = self.net
        e = net.enorm(self.embed(tokens))
        h = net.hnorm(hidden.astype(e.dtype))
        x = net.eh_proj(mx.concatenate([e, h], axis=-1))
        return net.block(x, create_attention_mask(x, cache[0]), cache[0])

    def logits(self, h: mx.array) -> mx.array:
        return self._out(self.net.shared_head["norm"](h))

    def to_target(self, ids: mx.array) -> mx.array:
        return ids.astype(mx.uint32)

    def chained(self, h: mx.array) -> mx.array:
        return h


def build_block(model: nn.Module) -> tuple[nn.Module, int]:
    """A fresh copy of the target's last attention layer (weights replaced at load), and its index."""
    template = attention_template(model)
    block = copy.deepcopy(capture.text_model(model).layers[template])
    if capture.recording_point(block) is not None:  # copied from a recording layer
        block.__class__ = type(block).__mro__[1]
    return block, template
