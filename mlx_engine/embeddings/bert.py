"""BERT (and the encoders sharing its layout: MiniLM, BGE, E5, GTE) in MLX.

Module and parameter names follow Hugging Face's ``BertModel``, so its
safetensors load as they are. Written here rather than taken from
``mlx-embeddings`` (docs/api.md, "Embeddings", says why)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import ModelLoadError
from .fastmath import gelu_erf, softmax

# Keys of a BERT checkpoint that the encoder does not use: the pooler (sentence
# embeddings pool the hidden states themselves), pre-training heads, buffers.
_UNUSED = ("pooler.", "cls.", "embeddings.position_ids")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_dict(cls, config: dict) -> "BertConfig":
        names = cls.__dataclass_fields__
        args = {k: v for k, v in config.items() if k in names}
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"BERT position_embedding_type {config['position_embedding_type']!r} is not supported")
        if args.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise ModelLoadError(f"BERT hidden_act {args['hidden_act']!r} is not one of {', '.join(_ACTIVATIONS)}")
        try:
            made = cls(**args)
        except TypeError as exc:
            raise ModelLoadError(f"the BERT config.json lacks a field: {exc}") from exc
        if made.hidden_size % made.num_attention_heads:
            raise ModelLoadError("BERT hidden_size must be a multiple of num_attention_heads")
        return made


_ACTIVATIONS = {"gelu": gelu_erf, "gelu_new": nn.gelu_approx, "gelu_pytorch_tanh": nn.gelu_approx, "relu": nn.relu}


class _Dense(nn.Module):
    """A linear layer and, with ``norm``, the residual LayerNorm after it (BERT's ``*.output``)."""

    def __init__(self, d_in: int, d_out: int, eps: float | None = None):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        if eps is not None:
            self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        y = self.dense(x)
        return y if residual is None else self.LayerNorm(y + residual)


class _SelfAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.heads = c.num_attention_heads
        self.query, self.key, self.value = (nn.Linear(c.hidden_size, c.hidden_size) for _ in range(3))

    def __call__(self, x: mx.array, key_mask: mx.array) -> mx.array:
        B, L, D = x.shape

        def split(t: mx.array) -> mx.array:
            return t.reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scale = (D // self.heads) ** -0.5
        # Written out rather than mx.fast.scaled_dot_product_attention: on the CPU that
        # runs MLX's softmax, whose exp takes one value at a time (fastmath.py).
        scores = (q * scale) @ k.transpose(0, 1, 3, 2)
        weights = softmax(scores.astype(mx.float32) + key_mask).astype(v.dtype)
        return (weights @ v).transpose(0, 2, 1, 3).reshape(B, L, D)


class _Attention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.self = _SelfAttention(c)
        self.output = _Dense(c.hidden_size, c.hidden_size, c.layer_norm_eps)

    def __call__(self, x: mx.array, key_mask: mx.array) -> mx.array:
        return self.output(self.self(x, key_mask), x)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = _Dense(c.hidden_size, c.intermediate_size)
        self.output = _Dense(c.intermediate_size, c.hidden_size, c.layer_norm_eps)
        self.act = _ACTIVATIONS[c.hidden_act]

    def __call__(self, x: mx.array, key_mask: mx.array) -> mx.array:
        """``key_mask``: (batch, 1, 1, keys), 0 for a real token and -inf for padding,
        added to every query's scores, so a padded row's real tokens see only real keys."""
        h = self.attention(x, key_mask)
        return self.output(self.act(self.intermediate(h)), h)


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, ids: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])
        # Every input is one segment: token type 0, as sentence-transformers encodes a text.
        h = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(h)


class _Encoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.layer = [_Layer(c) for _ in range(c.num_hidden_layers)]


class BertModel(nn.Module):
    """The encoder: token ids and a 0/1 attention mask in, hidden states out."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def __call__(self, ids: mx.array, attention_mask: mx.array) -> mx.array:
        h = self.embeddings(ids)
        # Additive mask over the keys only: padding gets -inf in every query's row (and
        # padded queries, which pooling ignores, still see the real keys: no NaN rows).
        key_mask = mx.where(attention_mask[:, None, None, :] > 0, 0.0, -mx.inf).astype(mx.float32)
        for layer in self.encoder.layer:
            h = layer(h, key_mask)
        return h

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A checkpoint's weights under this module's names: ``bert.`` prefixes
        (``BertForMaskedLM``) dropped, unused heads and buffers left out."""
        out = {}
        for key, value in weights.items():
            key = key.removeprefix("bert.")
            if not key.startswith(_UNUSED):
                out[key] = value
        return out
