"""Distil a draft model for SmolLM2-135M-Instruct: ``python -m training.train_smollm2_draft``.

Three subcommands, each resumable and usable on a partial run:

- ``generate``: the target answers chat prompts (``training/smollm2_prompts.py``)
  greedily in batches (mlx-lm ``BatchGenerator``); each batch is appended to
  ``<work>/data/shard-*.json`` as prompt and answer token ids, with the target's
  top-k log-probabilities at every answer token. Greedy answers are exactly what a
  draft must predict: each answer token is the target's argmax.
- ``train``: trains a small llama on those sequences (loss on answer tokens against
  the greedy token and the target's top-k distribution, plus a share of *copy
  windows*: an answer followed by itself, to encourage copying),
  re-reading the shards as they grow. The tied embedding starts as the target's
  embedding projected on its top principal directions, so the output layer
  starts from the target's geometry. Checkpoints (Hugging Face layout, float16,
  with the target's tokenizer) go to ``--out`` every few minutes.
- ``eval``: agreement with the target's greedy choice and step costs
  (``training/eval_smollm2_draft.py``).
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from .eval_smollm2_draft import evaluate  # noqa: E402
from .smollm2_prompts import HELDOUT_EVERY, chat_prompts  # noqa: E402

logger = logging.getLogger("train_smollm2_draft")
TARGET = "smollm2-135m-instruct"
DRAFT_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 192,
    "num_hidden_layers": 4,
    "intermediate_size": 768,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "rope_traditional": False,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float16",
}


# -- generate -------------------------------------------------------------------
def prompt_ids(kit: me.ModelKit, max_prompt: int) -> list[tuple[int, list[int]]]:
    """(index, chat-template token ids) of every training prompt not held out."""
    out = []
    for i, text in enumerate(chat_prompts()):
        ids = me.apply_chat_template(kit, [{"role": "user", "content": text}])
        if i % HELDOUT_EVERY and len(ids) <= max_prompt:
            out.append((i, ids))
    return out


def answer_batch(kit: me.ModelKit, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """Greedy answers (ending with the stop token when one came) with the
    target's top ``--top-k`` log-probabilities at every answer position."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        kit.model,
        stop_tokens=[[t] for t in kit.eos_token_ids],
        max_tokens=args.max_new,
        completion_batch_size=args.batch,
        prefill_batch_size=8,
    )
    uids = gen.insert(prompts, [args.max_new] * len(prompts))
    out = {u: {"answer": [], "top_ids": [], "top_lp": []} for u in uids}
    while responses := gen.next_generated():
        lp = mx.stack([r.logprobs for r in responses])
        ids = mx.argpartition(-lp, args.top_k - 1, axis=-1)[:, : args.top_k]
        vals = mx.take_along_axis(lp, ids, axis=-1)
        for r, i, v in zip(responses, ids.tolist(), vals.tolist()):
            o = out[r.uid]
            o["answer"].append(int(r.token))
            o["top_ids"].append(i)
            o["top_lp"].append([round(x, 3) for x in v])
    gen.close()
    return [out[u] for u in uids]


def generate(args: argparse.Namespace) -> None:
    """Append the target's greedy answers to shards until every prompt is answered or time is up."""
    data = args.work / "data"
    data.mkdir(parents=True, exist_ok=True)
    done = {ex["index"] for f in sorted(data.glob("shard-*.json")) for ex in json.loads(f.read_text())}
    kit = me.load_model(TARGET)
    todo = [(i, p) for i, p in prompt_ids(kit, args.max_prompt) if i not in done]
    logger.info("generate: %d prompts to answer (%d done)", len(todo), len(done))
    start, tokens = time.time(), 0
    per_call = args.batch * 2  # continuous batching refills finished rows from the same call
    for b in range(0, len(todo), per_call):
        if time.time() - start > args.minutes * 60:
            break
        chunk = todo[b : b + per_call]
        answers = answer_batch(kit, [p for _, p in chunk], args)
        shard = [{"index": i, "prompt": p, **a} for (i, p), a in zip(chunk, answers)]
        (data / f"shard-{len(done) + b:06d}.json").write_text(json.dumps(shard))
        tokens += sum(len(s["answer"]) for s in shard)
        el = time.time() - start
        logger.info(
            "generate: %d/%d prompts, %d answer tokens, %.0f tok/s", b + len(chunk), len(todo), tokens, tokens / el
        )


# -- the draft model ------------------------------------------------------------
def pca_embedding(target_embed: np.ndarray, dim: int) -> np.ndarray:
    """The target's embedding projected on its top ``dim`` principal directions,
    rescaled to rows of about unit norm (logits of about unit scale at the start)."""
    e = target_embed.astype(np.float64)
    _, vecs = np.linalg.eigh(e.T @ e)
    proj = e @ vecs[:, ::-1][:, :dim]
    return (proj / np.sqrt((proj**2).mean() * dim)).astype(np.float32)


def new_draft(kit: me.ModelKit | None, seed: int) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(DRAFT_CONFIG))
    if kit is not None:
        emb = np.array(kit.model.model.embed_tokens.weight.astype(mx.float32))
        model.model.embed_tokens.weight = mx.array(pca_embedding(emb, DRAFT_CONFIG["hidden_size"]))
    mx.eval(model.parameters())
    return model


def save_draft(model: llama.Model, kit: me.ModelKit, out: Path, meta: dict) -> None:
    """Write a Hugging Face-layout draft: config, float16 weights, the target's tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(DRAFT_CONFIG, indent=1) + "\n")
    kit.tokenizer._tokenizer.save_pretrained(str(out))
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")


# -- train ----------------------------------------------------------------------
def load_examples(work: Path) -> list[dict]:
    return [ex for f in sorted((work / "data").glob("shard-*.json")) for ex in json.loads(f.read_text())]


def frequent_tokens(examples: list[dict], n: int) -> np.ndarray:
    """The ``n`` most frequent answer tokens: with the batch's own targets they
    form the candidate rows of the output layer during training."""
    counts = np.bincount(
        np.concatenate([np.asarray(ex["answer"], dtype=np.int64) for ex in examples]),
        minlength=DRAFT_CONFIG["vocab_size"],
    )
    return np.argsort(-counts)[:n]


def _row(ex: dict, rng: random.Random, args: argparse.Namespace) -> tuple[list[int], list[int], list]:
    """Tokens, loss mask and soft targets (top ids, log-probabilities, or None)
    of one training row, each aligned with the token it predicts."""
    if rng.random() < args.copy_frac and len(ex["answer"]) >= 16:
        a = ex["answer"][: args.seq // 2]
        return a + a, [0] * len(a) + [1] * len(a), [None] * (2 * len(a))
    n = len(ex["answer"])
    soft = list(zip(ex["top_ids"], ex["top_lp"])) if "top_ids" in ex else [None] * n
    return ex["prompt"] + ex["answer"], [0] * len(ex["prompt"]) + [1] * n, [None] * len(ex["prompt"]) + soft


def make_batch(examples: list[dict], rng: random.Random, args: argparse.Namespace, frequent: np.ndarray):
    """Inputs, the flat indices of scored positions, the candidate output rows,
    the targets' places among them, and soft targets (places, probabilities and
    a weight per scored position: 0 where the row has none). Rows are answers
    (the prompt as context) or copy windows (an answer, then the same answer
    again; scored on the repeat, hard targets only)."""
    rows, masks, softs, seq, k = [], [], [], args.seq, args.top_k
    for _ in range(args.batch):
        toks, mask, soft = _row(rng.choice(examples), rng, args)
        toks, mask, soft = toks[-(seq + 1) :], mask[-(seq + 1) :], soft[-(seq + 1) :]
        rows.append(toks + [0] * (seq + 1 - len(toks)))
        masks.append(mask[1:] + [0] * (seq + 1 - len(mask)))
        softs += [sf for m, sf in zip(mask[1:], soft[1:]) if m]
    arr, m = np.array(rows, dtype=np.int32), np.array(masks, dtype=bool).reshape(-1)
    idx = np.nonzero(m)[0].astype(np.int32)
    y = arr[:, 1:].reshape(-1)[idx]
    soft_ids = np.array([sf[0][:k] if sf else [0] * k for sf in softs], dtype=np.int64).reshape(-1, k)
    soft_lp = np.array([sf[1][:k] if sf else [0.0] * k for sf in softs], dtype=np.float32).reshape(-1, k)
    soft_w = np.array([1.0 if sf else 0.0 for sf in softs], dtype=np.float32)
    noise = np.array([rng.randrange(DRAFT_CONFIG["vocab_size"]) for _ in range(args.negatives)], dtype=np.int64)
    cand = np.unique(np.concatenate([frequent, y, soft_ids.reshape(-1), noise]))
    p = np.exp(soft_lp - soft_lp.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return (
        mx.array(arr[:, :-1]),
        mx.array(idx),
        mx.array(cand.astype(np.int32)),
        mx.array(np.searchsorted(cand, y).astype(np.int32)),
        mx.array(np.searchsorted(cand, soft_ids).astype(np.int32)),
        mx.array(p),
        mx.array(soft_w * args.soft),
    )


def loss_fn(model, x, idx, cand, y, soft_idx, soft_p, soft_w):
    """Cross-entropy on the scored positions over candidate output rows (the
    frequent tokens, the targets, the target model's top tokens and random
    negatives: the 49152-row output layer and its softmax dominate a small
    draft's training step), mixed per position with the cross-entropy against
    the target model's top-k distribution where it is known."""
    h = model.model(x)
    h = h.reshape(-1, h.shape[-1])[idx]
    logq = nn.log_softmax(h @ model.model.embed_tokens.weight[cand].T, axis=-1)
    hard = -mx.take_along_axis(logq, y[:, None], axis=-1)[:, 0]
    soft = -(soft_p * mx.take_along_axis(logq, soft_idx, axis=-1)).sum(axis=-1)
    return ((1 - soft_w) * hard + soft_w * soft).mean()


def lr_at(args: argparse.Namespace, step: int, done: float) -> float:
    """Linear warm-up over steps, then a cosine decay to 10% over the wall-clock
    budget (the number of steps depends on the machine's load)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


def train(args: argparse.Namespace) -> None:
    """Train until ``--minutes`` elapse, checkpointing every ``--save-minutes``."""
    kit = me.load_model(TARGET)
    model = new_draft(kit, args.seed)
    step = 0
    if args.resume and (args.out / "model.safetensors").exists():
        model.load_weights(str(args.out / "model.safetensors"))
        model.set_dtype(mx.float32)
        step = json.loads((args.out / "training.json").read_text()).get("steps", 0)
    logger.info("draft: %.2fM parameters", sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6)
    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.01)
    step_fn = nn.value_and_grad(model, loss_fn)
    rng, start, last_save, seen, ema = random.Random(args.seed), time.time(), time.time(), 0, None
    examples, loaded_at = load_examples(args.work), time.time()
    frequent = frequent_tokens(examples, args.frequent)
    while time.time() - start < args.minutes * 60 and step < args.total_steps:
        if time.time() - loaded_at > 300:
            examples, loaded_at = load_examples(args.work), time.time()
            frequent = frequent_tokens(examples, args.frequent)
        opt.learning_rate = lr_at(args, step, (time.time() - start) / (args.minutes * 60))
        batch = make_batch(examples, rng, args, frequent)
        loss, grads = step_fn(model, *batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        step, seen = step + 1, seen + batch[3].size
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0:
            el = time.time() - start
            logger.info(
                "step %d loss %.3f (ema %.3f) lr %.2e | %d loss tokens, %.0f tok/s, %d examples, %.1f min",
                step,
                loss.item(),
                ema,
                opt.learning_rate.item(),
                seen,
                seen / el,
                len(examples),
                el / 60,
            )
        if time.time() - last_save > args.save_minutes * 60:
            save_draft(model, kit, args.out, _meta(args, step, seen, start, ema, len(examples)))
            last_save = time.time()
    save_draft(model, kit, args.out, _meta(args, step, seen, start, ema, len(examples)))
    logger.info("saved %s after %d steps", args.out, step)


def _meta(args, step, seen, start, ema, n_examples) -> dict:
    return {
        "steps": step,
        "loss_tokens_this_run": seen,
        "minutes_this_run": round((time.time() - start) / 60, 1),
        "loss_ema": ema,
        "examples": n_examples,
        "batch": args.batch,
        "seq": args.seq,
        "lr": args.lr,
        "copy_frac": args.copy_frac,
        "frequent": args.frequent,
        "negatives": args.negatives,
        "soft": args.soft,
        "top_k": args.top_k,
        "total_steps": args.total_steps,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.train_smollm2_draft", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("generate", "train", "eval"))
    p.add_argument("--work", type=Path, default=Path("models/logs/smollm2-draft"), help="generated data and logs")
    p.add_argument("--out", type=Path, default=Path("models/smollm2-135m-draft"))
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--batch", type=int, default=8, help="rows per training step; answers generated at once")
    p.add_argument("--seq", type=int, default=384)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8, help="target log-probabilities kept per answer token")
    p.add_argument("--soft", type=float, default=0.7, help="weight of the soft (top-k) loss against the hard one")
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--total-steps", type=int, default=100_000, help="stop after this many steps at most")
    p.add_argument("--copy-frac", type=float, default=0.1)
    p.add_argument("--frequent", type=int, default=4096, help="frequent answer tokens scored every step")
    p.add_argument("--negatives", type=int, default=1024, help="random output rows scored every step")
    p.add_argument("--save-minutes", type=float, default=5.0)
    p.add_argument("--eval-prompts", type=int, default=24, help="held-out chat prompts answered for eval")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.command == "generate":
        generate(args)
    elif args.command == "train":
        train(args)
    else:
        evaluate(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
