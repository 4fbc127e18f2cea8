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

MiMo keeps the same head as ``model.mtp_layers.K.*`` (``token_layernorm``,
``hidden_layernorm``, ``input_proj``, ``final_layernorm`` beside the decoder
layer's tensors) and feeds ``input_proj`` the hidden state first:
``input_proj([hidden_layernorm(h), token_layernorm(e)])`` (HF's
``MiMoMTPLayers``). ``mtp_tensor`` reads both layouts into the layer-N names,
and ``fusion_order`` puts MiMo's ``input_proj`` columns in the layer-N order.
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
#: A MiMo MTP tensor: ``model.mtp_layers.K.<rest>``.
MIMO_TENSOR = re.compile(r"^(?:model\.)?mtp_layers\.(\d+)\.(.+)$")
#: MiMo's names of the fusion's tensors, onto the layer-N ones.
MIMO_NAMES = {
    "token_layernorm": "enorm",
    "hidden_layernorm": "hnorm",
    "input_proj": "eh_proj",
    "final_layernorm": "shared_head.norm",
}
FUSION = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")
LAYER_N, MIMO = "layer-n", "mimo"


def mtp_tensor(name: str) -> tuple[str, int, str] | None:
    """A head tensor's layout, layer index and name within the layer-N head
    (MiMo's fusion names translated), or None for any other tensor."""
    if m := LAYER_TENSOR.match(name):
        return LAYER_N, int(m.group(1)), m.group(2)
    if m := MIMO_TENSOR.match(name):
        first, _, rest = m.group(2).partition(".")
        return MIMO, int(m.group(1)), f"{MIMO_NAMES.get(first, first)}.{rest}"
    return None


def file_name(layout: str, index: int, name: str) -> str:
    """A head tensor's name as its file names it (for errors)."""
    if layout == LAYER_N:
        return f"layers.{index}.{name}"
    back = {v: k for k, v in MIMO_NAMES.items()}
    for ours, theirs in back.items():
        if name.startswith(ours + "."):
            name = theirs + name[len(ours) :]
            break
    return f"mtp_layers.{index}.{name}"


def mtp_layer_index(names: list[str]) -> tuple[str, int] | None:
    """The layout and layer index of an MTP head (its ``eh_proj``, or MiMo's
    first ``input_proj``), or None."""
    found = [t for t in map(mtp_tensor, names) if t is not None and t[2] == "eh_proj.weight"]
    return min(found, key=lambda t: (t[0] != LAYER_N, t[1]))[:2] if found else None


def fusion_order(layout: str, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """MiMo's ``input_proj`` (and its quantization's scales and biases, whose
    groups never straddle the halves) with its two input halves swapped into
    the layer-N order (embedding first); other layouts as they are."""
    if layout != MIMO:
        return tensors
    out = dict(tensors)
    for key in ("eh_proj.weight", "eh_proj.scales", "eh_proj.biases"):
        if key in out:
            half = out[key].shape[-1] // 2
            out[key] = mx.concatenate([out[key][..., half:], out[key][..., :half]], axis=-1)
    return out


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
