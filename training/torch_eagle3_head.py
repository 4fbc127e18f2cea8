"""The default model's EAGLE-3 head in PyTorch: the network of mlx-vlm's
``Eagle3DraftModel`` (what the engine runs, mlx_engine/heads/eagle3.py) with the
same module and weight names and shapes, its training-time-test forward and loss
(as ``training/train_smollm2_eagle3.py`` computes them in MLX), and its
checkpoint in the layout the engine loads: ``config.json`` (speculators form),
``model.safetensors`` (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``, float32, no embedding), ``training.json``. Quantizing it for shipping
is the MLX trainer's ``--ship``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .eagle3_recipe import d2t_offsets, head_config


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 (mlx's ``fast.rms_norm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    """The first layer's attention: reads 2 x hidden (the normed embedding beside the normed hidden state)."""

    def __init__(self, cfg: dict):
        super().__init__()
        hidden, self.head_dim = cfg["hidden_size"], cfg["head_dim"]
        self.n_heads, self.n_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(2 * hidden, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=False)
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.register_buffer("inv_freq", cfg["rope_theta"] ** -half, persistent=False)

    def rope(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        """Rotary embedding of (B, heads, L, head_dim) at positions ``offset ..``
        (non-traditional: the two halves rotate together, as mlx's ``RoPE``)."""
        pos = torch.arange(offset, offset + x.shape[2], device=x.device, dtype=torch.float32)
        ang = pos[:, None] * self.inv_freq[None, :]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        a, b = x[..., : self.head_dim // 2], x[..., self.head_dim // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.gate_proj = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FirstLayer(nn.Module):
    """mlx-vlm's ``Eagle3FirstLayer`` (``norm_before_residual`` false): its modules, not its cache."""

    def __init__(self, cfg: dict):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.hidden_norm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = MLP(cfg)


class Eagle3Head(nn.Module):
    """The head: ``fc`` over the concatenated aux hidden states, one layer,
    ``norm``, ``lm_head`` over the draft vocabulary; ``embed_tokens`` is the
    target's (frozen, never saved), ``d2t`` a buffer."""

    def __init__(self, config: dict):
        super().__init__()
        cfg = config["transformer_layer_config"]
        self.config = config
        hidden, draft = cfg["hidden_size"], config["draft_vocab_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], hidden)
        self.fc = nn.Linear(3 * config["target_hidden_size"], hidden, bias=False)
        self.layers = nn.ModuleList([FirstLayer(cfg)])
        self.norm = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(hidden, draft, bias=False)
        self.register_buffer("d2t", torch.zeros(draft, dtype=torch.int64))

    def freeze_target_parts(self) -> None:
        """The embedding and the output rows are the target's: not trained (as in MLX)."""
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)


def new_head(
    args: dict, embed: torch.Tensor, norm: torch.Tensor, draft_ids: np.ndarray, seed: int, aux_ids
) -> Eagle3Head:
    """A head for a llama target with config ``args`` (a dict), started as the
    MLX trainer's ``new_head``: the target's embedding, its output rows of the
    draft vocabulary (tied: the embedding's) and final norm; ``fc`` and the layer
    random."""
    torch.manual_seed(seed)
    head = Eagle3Head(head_config(len(draft_ids), args, tuple(aux_ids)))
    with torch.no_grad():
        head.embed_tokens.weight.copy_(embed.float())
        head.lm_head.weight.copy_(embed.float()[torch.as_tensor(draft_ids, device=embed.device)])
        head.norm.weight.copy_(norm.float())
        head.d2t.copy_(torch.as_tensor(d2t_offsets(draft_ids)))
    head.freeze_target_parts()
    return head


# -- the training-time test -----------------------------------------------------
def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.reshape(b, t, n, -1).transpose(1, 2)


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` moved ``k`` places later along axis 2 (zeros in front)."""
    return x if k == 0 else F.pad(x, (0, 0, k, 0))[:, :, : x.shape[2]]


def ttt_forward(head: Eagle3Head, aux: torch.Tensor, tokens: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """The head's output (before ``norm``) at every entry for depths 0..depths-1,
    as ``train_smollm2_eagle3.ttt_forward``: entry ``q`` reads the features at
    ``q`` and the token at ``q + 1`` (rotary position ``q + 1``); at depth ``k``
    its hidden input is its own depth ``k - 1`` output one place earlier and it
    attends to the target-fed entries up to ``q - k`` plus its chain."""
    layer = head.layers[0]
    attn = layer.self_attn
    n = tokens.shape[1] - 1
    emb = layer.input_layernorm(head.embed_tokens(tokens[:, 1:].long()))
    hidden = head.fc(aux[:, :n])
    pos = torch.arange(n, device=tokens.device)
    causal = pos[:, None] - pos[None, :]  # q - r
    rep = attn.n_heads // attn.n_kv_heads
    keys, values, outs = [], [], []
    for k in range(depths):
        x = torch.cat([emb, layer.hidden_norm(hidden)], dim=-1).to(hidden.dtype)
        q = attn.rope(_heads(attn.q_proj(x), attn.n_heads), 1) * attn.scale
        keys.append(attn.rope(_heads(attn.k_proj(x), attn.n_kv_heads), 1).repeat_interleave(rep, dim=1))
        values.append(_heads(attn.v_proj(x), attn.n_kv_heads).repeat_interleave(rep, dim=1))
        s0 = (q @ keys[0].transpose(-1, -2)).masked_fill(causal < k, -1e9)
        # depth-j key for query q is the chain entry q - k + j (its own at j = k)
        diag = [(q * _shift(keys[j], k - j)).sum(-1, keepdim=True) for j in range(1, k + 1)]
        p = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
        o = p[..., :n] @ values[0]
        for j in range(1, k + 1):
            o = o + p[..., n + j - 1 : n + j] * _shift(values[j], k - j)
        o = attn.o_proj(o.transpose(1, 2).reshape(*hidden.shape[:2], -1))
        h = hidden + o
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(h)
        hidden = F.pad(h, (0, 0, 1, 0))[:, :-1]  # own output, one place later
    return outs


def loss_fn(head, aux, tokens, idx, cand, target, mask, depths: int, decay: float) -> torch.Tensor:
    """Weighted cross-entropy of every depth against the target's greedy token
    over the candidate output rows ``cand`` (the MLX trainer's ``loss_fn``)."""
    idx, cand, target = idx.long(), cand.long(), target.long()
    w = head.lm_head.weight[cand]
    total, weight = aux.new_zeros((), dtype=torch.float32), 0.0
    for k, h in enumerate(ttt_forward(head, aux, tokens, depths)):
        h = head.norm(h.reshape(-1, h.shape[-1])[idx])
        ce = F.cross_entropy((h @ w.T).float(), target, reduction="none")
        m = mask[k]
        total = total + decay**k * (ce * m).sum() / m.sum().clamp(min=1)
        weight += decay**k
    return total / weight


# -- checkpoint -----------------------------------------------------------------
def save_head(head: Eagle3Head, draft_ids: np.ndarray, out: Path, meta: dict) -> None:
    """Write the head as the MLX trainer does (float32, speculators names: ``midlayer.*``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {
        k.replace("layers.0.", "midlayer.", 1): v.detach().float().cpu().contiguous()
        for k, v in head.state_dict().items()
        if not k.startswith("embed_tokens") and k != "d2t"
    }
    weights["d2t"] = torch.as_tensor(d2t_offsets(draft_ids))
    t2d = torch.zeros(head.embed_tokens.num_embeddings, dtype=torch.bool)
    t2d[torch.as_tensor(draft_ids)] = True
    weights["t2d"] = t2d
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(head.config, indent=1) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")


def load_head(path: Path, embed: torch.Tensor) -> tuple[Eagle3Head, np.ndarray]:
    """A saved float head (this module's or the MLX trainer's ``--out``) with the
    target's embedding ``embed``, and its draft ids."""
    config = json.loads((Path(path) / "config.json").read_text())
    if "quantization" in config:
        raise ValueError(f"{path}: a quantized (shipped) head; load the float one it was shipped from")
    head = Eagle3Head(config)
    w = {k.replace("midlayer.", "layers.0.", 1): v for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
    d2t = w.pop("d2t").to(torch.int64)
    w.pop("t2d", None)
    head.load_state_dict({**w, "d2t": d2t, "embed_tokens.weight": embed.float().cpu()})
    head.freeze_target_parts()
    return head, d2t.numpy() + np.arange(len(d2t))
