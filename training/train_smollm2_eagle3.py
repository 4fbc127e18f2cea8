"""Train an EAGLE-3 head for SmolLM2-135M-Instruct on its own greedy answers:
``python -m training.train_smollm2_eagle3``.

Reads the aux hidden states ``training/extract_smollm2_hidden.py`` wrote (the
outputs of the target's layers 1, 14 and 26, float16) and trains the head alone,
on this CPU, in MLX. The head is mlx-vlm's ``Eagle3DraftModel`` (the
speculators/SGLang layout the engine loads): ``fc`` (3 x 576 -> 576), one llama
decoder layer whose attention reads the normed token embedding beside the normed
hidden state, ``norm``, and a reduced output layer ``lm_head`` over the
``--draft-vocab`` most frequent answer tokens, with ``d2t`` (target id = draft
id + d2t[draft id]). The token embedding is the target's (frozen, not saved).

**Training-time test** (EAGLE-3): the head's entry for position ``q`` reads the
target's features at ``q`` and the token at ``q + 1`` and predicts the token at
``q + 2``. At depth ``k`` its hidden input is instead the head's own output one
position earlier at depth ``k - 1`` (what a chained draft feeds it), and its
attention sees the target-fed entries up to ``q - k`` plus its own chain
``q - k + 1 .. q`` (one entry per depth): exactly the keys the head's cache
holds when it drafts its ``k + 1``-th token. Loss: cross-entropy against the
target's greedy token (the answers are greedy) at every depth, weighted
``--depth-decay ** k``, on answer positions whose token is in the draft
vocabulary.

Output (``--out``): ``config.json`` (speculators form, ``model_type`` eagle3),
``model.safetensors`` (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``), float32 or mlx-quantized (``--bits``), and ``training.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_vlm.speculative.drafters.eagle3 import Eagle3DraftModel, ModelConfig  # noqa: E402

from .eagle3_recipe import (  # noqa: E402
    AUX_LAYER_IDS,
    DATA,
    add_training_flags,
    batch_layout,
    d2t_offsets,
    draft_vocabulary,
    frequent_drafts,
    head_config,
    load_sequences,
    lr_at,
    target_to_draft,
)

logger = logging.getLogger("train_smollm2_eagle3")
TARGET = "smollm2-135m-instruct"


# -- the head -------------------------------------------------------------------
def new_head(
    kit: me.ModelKit, draft_ids: np.ndarray, seed: int, aux_ids: tuple[int, ...] = AUX_LAYER_IDS
) -> Eagle3DraftModel:
    """A head started from the target: its embedding and its output rows of the
    draft vocabulary (both frozen) and its final norm; ``fc`` and the layer are
    random (passing the top aux layer through ``fc`` instead starts the head
    confidently predicting the *current* next token, loss 14, and its large
    residual drowns the layer's updates)."""
    mx.random.seed(seed)
    cfg = head_config(len(draft_ids), vars(kit.model.args), aux_ids)
    head = Eagle3DraftModel(ModelConfig.from_dict(cfg))
    inner = kit.model.model
    emb = inner.embed_tokens.weight.astype(mx.float32)
    head.embed_tokens.weight = emb
    head.lm_head.weight = emb[mx.array(draft_ids)]
    head.norm.weight = inner.norm.weight.astype(mx.float32)
    head.d2t = mx.array(d2t_offsets(draft_ids), dtype=mx.int32)
    freeze_target_parts(head)
    mx.eval(head.parameters())
    return head


def freeze_target_parts(head: Eagle3DraftModel) -> None:
    """The embedding and the output rows are the target's and ``d2t`` a map:
    none is trained (EAGLE's frozen output layer; the head learns to reach the
    target's last hidden space, with few parameters to fit on little data)."""
    head.embed_tokens.freeze()
    head.lm_head.freeze()
    head.freeze(keys=["d2t"], recurse=False)


# -- the training-time test -----------------------------------------------------
def _heads(x: mx.array, n: int) -> mx.array:
    b, t, _ = x.shape
    return x.reshape(b, t, n, -1).transpose(0, 2, 1, 3)


def _shift(x: mx.array, k: int) -> mx.array:
    """``x`` moved ``k`` places later along axis 2 (zeros in front)."""
    if k == 0:
        return x
    pad = mx.zeros((*x.shape[:2], k, *x.shape[3:]), dtype=x.dtype)
    return mx.concatenate([pad, x[:, :, : x.shape[2] - k]], axis=2)


def ttt_forward(head: Eagle3DraftModel, aux: mx.array, tokens: mx.array, depths: int) -> list[mx.array]:
    """The head's output (before ``norm``) at every entry for depths 0..depths-1.

    ``aux`` (B, L, 3 * hidden) target features, ``tokens`` (B, L). Entry ``q``
    (0 <= q < L - 1) reads the token at ``q + 1`` and sits at rotary position
    ``q + 1``, as in ``Eagle3DraftModel.prefill_from_target_hidden``."""
    layer = head.layers[0]
    attn = layer.self_attn
    n = tokens.shape[1] - 1
    emb = layer.input_layernorm(head.embed_tokens(tokens[:, 1:]))
    hidden = head.fc(aux[:, :n])
    causal = mx.arange(n)[:, None] - mx.arange(n)[None, :]  # q - r
    keys, values, outs = [], [], []
    for k in range(depths):
        x = mx.concatenate([emb, layer.hidden_norm(hidden)], axis=-1)
        q = attn.rope(_heads(attn.q_proj(x), attn.n_heads), offset=1)
        kk = attn.rope(_heads(attn.k_proj(x), attn.n_kv_heads), offset=1)
        v = _heads(attn.v_proj(x), attn.n_kv_heads)
        rep = attn.n_heads // attn.n_kv_heads
        keys.append(mx.repeat(kk, rep, axis=1))
        values.append(mx.repeat(v, rep, axis=1))
        s0 = (q * attn.scale) @ keys[0].transpose(0, 1, 3, 2)
        s0 = mx.where(causal >= k, s0, -1e9)
        # depth-j key for query q is the chain entry q - k + j (its own at j = k)
        diag = [((q * attn.scale) * _shift(keys[j], k - j)).sum(-1, keepdims=True) for j in range(1, k + 1)]
        p = mx.softmax(mx.concatenate([s0, *diag], axis=-1), axis=-1)
        o = p[..., :n] @ values[0]
        for j in range(1, k + 1):
            o = o + p[..., n + j - 1 : n + j] * _shift(values[j], k - j)
        o = attn.o_proj(o.transpose(0, 2, 1, 3).reshape(*hidden.shape[:2], -1))
        h = hidden + o
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(h)
        hidden = mx.concatenate([mx.zeros_like(h[:, :1]), h[:, :-1]], axis=1)  # own output, one place later
    return outs


def loss_fn(head, aux, tokens, idx, cand, target, mask, depths: int, decay: float):
    """Weighted cross-entropy of every depth against the target's greedy token.

    Scored entries are the flat positions ``idx`` (answer tokens in the draft
    vocabulary); ``mask`` (depths, len(idx)) drops those a depth cannot reach.
    The softmax runs over the candidate output rows ``cand`` (the most frequent
    draft tokens and the batch's targets; ``target`` indexes into it): the
    output layer is the target's own rows, frozen, and scoring all of it would
    cost more than the rest of the head."""
    w = head.lm_head.weight[cand]
    total, weight = mx.array(0.0), 0.0
    for k, h in enumerate(ttt_forward(head, aux, tokens, depths)):
        h = head.norm(h.reshape(-1, h.shape[-1])[idx])
        ce = nn.losses.cross_entropy(h @ w.T, target, reduction="none")
        m = mask[k]
        total = total + decay**k * (ce * m).sum() / mx.maximum(m.sum(), 1)
        weight += decay**k
    return total / weight


# -- data -----------------------------------------------------------------------
class Shards:
    """The extracted sequences in memory: features (float16), ids, prompt lengths."""

    def __init__(self, folder: Path):
        files = sorted(Path(folder).glob("shard-*.npz"))
        if not files:
            raise ValueError(f"hidden: no shard-*.npz in {folder} (run training.extract_smollm2_hidden first)")
        self.hidden, self.ids, self.prompt = [], [], []
        for f in files:
            d = np.load(f)
            off = np.concatenate([[0], np.cumsum(d["lens"].sum(1))])
            for j in range(len(d["lens"])):
                self.hidden.append(d["hidden"][off[j] : off[j + 1]].reshape(off[j + 1] - off[j], -1))
                self.ids.append(d["ids"][off[j] : off[j + 1]])
                self.prompt.append(int(d["lens"][j, 0]))
        self.tokens = sum(len(x) for x in self.ids)

    def __len__(self) -> int:
        return len(self.ids)


def make_batch(data: Shards, rows: list[int], t2d: np.ndarray, frequent: np.ndarray, args: argparse.Namespace):
    """Padded features and tokens, the flat indices of scored entries, candidate
    output rows, the targets' places among them and the per-depth mask
    (``eagle3_recipe.batch_layout``), as MLX arrays."""
    lay = batch_layout(
        [data.ids[r] for r in rows], [data.prompt[r] for r in rows], t2d, frequent, args.max_len, args.depths
    )
    aux = np.zeros((*lay.tokens.shape, data.hidden[rows[0]].shape[1]), dtype=np.float16)
    for i, r in enumerate(rows):
        aux[i, : lay.lengths[i]] = data.hidden[r][lay.starts[i] : lay.starts[i] + lay.lengths[i]]
    return (
        mx.array(aux).astype(mx.float32),
        mx.array(lay.tokens),
        mx.array(lay.idx.astype(np.int32)),
        mx.array(lay.cand.astype(np.int32)),
        mx.array(lay.target.astype(np.int32)),
        mx.array(lay.mask),
    )


# -- train ----------------------------------------------------------------------
def save_head(head: Eagle3DraftModel, draft_ids: np.ndarray, out: Path, meta: dict, bits: int = 0) -> None:
    """Write the head in the speculators/SGLang layout (``midlayer.*``), without
    the embedding (the target's is used); mlx-quantized when ``bits``."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = head_config(
        len(draft_ids), head.config.transformer_layer_config.__dict__, tuple(head.config.target_layer_ids)
    )
    if bits:
        head = _quantized_copy(head, bits)
        cfg["quantization"] = {"group_size": 64, "bits": bits}
    weights = {}
    for k, v in tree_flatten(head.parameters()):
        if k.startswith("embed_tokens") or k == "d2t":
            continue
        weights[k.replace("layers.0.", "midlayer.", 1)] = v
    weights["d2t"] = mx.array(d2t_offsets(draft_ids))
    t2d = np.zeros(head.target_vocab_size, dtype=bool)
    t2d[draft_ids] = True
    weights["t2d"] = mx.array(t2d)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")


def _quantized_copy(head: Eagle3DraftModel, bits: int) -> Eagle3DraftModel:
    copy = Eagle3DraftModel(head.config)
    copy.update(head.parameters())
    nn.quantize(copy, group_size=64, bits=bits, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    mx.eval(copy.parameters())
    return copy


def load_head(path: Path, kit: me.ModelKit) -> tuple[Eagle3DraftModel, np.ndarray]:
    """A saved head (float or quantized) bound to ``kit``'s embedding, and its draft ids."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    head = Eagle3DraftModel(ModelConfig.from_dict(cfg))
    if "quantization" in cfg:
        q = cfg["quantization"]
        nn.quantize(
            head, group_size=q["group_size"], bits=q["bits"], class_predicate=lambda p, m: isinstance(m, nn.Linear)
        )
    w = mx.load(str(Path(path) / "model.safetensors"))
    w = {k.replace("midlayer.", "layers.0.", 1): v for k, v in w.items()}
    head.load_weights(list(head.sanitize(w).items()), strict=False)
    head.bind(kit.model)
    d2t = np.array(w["d2t"]).astype(np.int64)
    return head, d2t + np.arange(len(d2t))


def train(args: argparse.Namespace) -> None:
    """Train until ``--minutes`` elapse or ``--steps``, saving every ``--save-minutes``."""
    kit = me.load_model(TARGET)
    seqs, lens = load_sequences(args.data)
    draft_ids = draft_vocabulary(seqs, lens, args.draft_vocab, kit.vocab_size)
    t2d = target_to_draft(draft_ids, kit.vocab_size)
    head = new_head(kit, draft_ids, args.seed)
    if args.resume and (args.out / "model.safetensors").exists():
        head, _ = load_head(args.out, kit)
        freeze_target_parts(head)
    data, loaded_at = Shards(args.hidden), time.time()
    frequent = frequent_drafts(seqs, lens, draft_ids, kit.vocab_size, args.candidates)
    logger.info(
        "head: %.2fM trainable parameters; %d sequences, %d tokens",
        sum(v.size for _, v in tree_flatten(head.trainable_parameters())) / 1e6,
        len(data),
        data.tokens,
    )
    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.0)
    step_fn = nn.value_and_grad(head, loss_fn)
    rng = np.random.default_rng(args.seed)
    start, last_save, seen, ema, step, order = time.time(), time.time(), 0, None, 0, []
    while time.time() - start < args.minutes * 60 and step < args.steps:
        if time.time() - loaded_at > 180:  # the extraction may still be writing shards
            data, loaded_at, order = Shards(args.hidden), time.time(), []
        if len(order) < args.batch:
            order = list(rng.permutation(len(data)))
        rows, order = order[: args.batch], order[args.batch :]
        batch = make_batch(data, rows, t2d, frequent, args)
        opt.learning_rate = lr_at(args.lr, args.warmup, step, (time.time() - start) / (args.minutes * 60))
        loss, grads = step_fn(head, *batch, args.depths, args.depth_decay)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        step, seen = step + 1, seen + batch[2].size
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if step % 5 == 0:
            el = time.time() - start
            logger.info(
                "step %d loss %.3f (ema %.3f) | %d answer tokens, %.0f tok/s, %.1f min",
                step,
                loss.item(),
                ema,
                seen,
                seen / el,
                el / 60,
            )
        if time.time() - last_save > args.save_minutes * 60:
            save_head(head, draft_ids, args.out, _meta(args, step, seen, start, ema, data))
            last_save = time.time()
    save_head(head, draft_ids, args.out, _meta(args, step, seen, start, ema, data))
    logger.info("saved %s after %d steps, %.1f min", args.out, step, (time.time() - start) / 60)


def _meta(args, step, seen, start, ema, data) -> dict:
    return {
        **{k: v for k, v in vars(args).items() if isinstance(v, (int, float))},
        "steps": step,
        "answer_tokens_seen": seen,
        "minutes": round((time.time() - start) / 60, 1),
        "loss_ema": ema,
        "sequences": len(data),
        "tokens": data.tokens,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.train_smollm2_eagle3", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DATA, help="answers.npz (for the draft vocabulary)")
    p.add_argument("--hidden", type=Path, default=Path(".cache/smollm2-eagle3/hidden"), help="extracted shards")
    p.add_argument("--out", type=Path, default=Path(".cache/smollm2-eagle3/head"))
    add_training_flags(p)
    p.add_argument("--ship", type=Path, default=None, help="instead of training: write --out's head here, quantized")
    p.add_argument("--bits", type=int, default=4, help="quantization of --ship")
    return p.parse_args(argv)


def ship(args: argparse.Namespace) -> None:
    """Write the trained head in ``--out`` to ``--ship``, mlx-quantized to ``--bits``."""
    kit = me.load_model(TARGET)
    head, draft_ids = load_head(args.out, kit)
    meta = json.loads((args.out / "training.json").read_text())
    save_head(head, draft_ids, args.ship, {**meta, "shipped_bits": args.bits}, bits=args.bits)
    logger.info("shipped %s (%d-bit)", args.ship, args.bits)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse(argv)
    ship(args) if args.ship else train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
