"""Distil a draft model for SmolLM2-135M-Instruct: ``python -m training.train_smollm2_draft``.

Three subcommands, each resumable and usable on a partial run:

- ``generate``: the target answers chat prompts (``training/smollm2_prompts.py``)
  greedily in batches (mlx-lm ``batch_generate``); each batch is appended to
  ``<work>/data/shard-*.json`` as prompt and answer token ids. Greedy answers are
  exactly what a draft must predict: each answer token is the target's argmax.
- ``train``: trains a small llama on those sequences (loss on answer tokens, plus
  a share of *copy windows*: an answer followed by itself, to encourage copying),
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

from .smollm2_prompts import chat_prompts  # noqa: E402

logger = logging.getLogger("train_smollm2_draft")
TARGET = "smollm2-135m-instruct"
HELDOUT_EVERY = 25  # prompt i with i % 25 == 0 is held out for evaluation
DRAFT_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 192, "num_hidden_layers": 4,
    "intermediate_size": 768, "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 64,
    "rms_norm_eps": 1e-5, "vocab_size": 49152, "rope_theta": 100000.0, "rope_traditional": False,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
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


def generate(args: argparse.Namespace) -> None:
    """Append the target's greedy answers to shards until every prompt is answered or time is up."""
    from mlx_lm.generate import batch_generate

    data = args.work / "data"
    data.mkdir(parents=True, exist_ok=True)
    done = {ex["index"] for f in sorted(data.glob("shard-*.json")) for ex in json.loads(f.read_text())}
    kit = me.load_model(TARGET)
    todo = [(i, p) for i, p in prompt_ids(kit, args.max_prompt) if i not in done]
    logger.info("generate: %d prompts to answer (%d done)", len(todo), len(done))
    start, tokens = time.time(), 0
    per_call = args.batch * 3  # continuous batching refills finished rows from the same call
    for b in range(0, len(todo), per_call):
        if time.time() - start > args.minutes * 60:
            break
        chunk = todo[b:b + per_call]
        res = batch_generate(kit.model, kit.tokenizer, [p for _, p in chunk], max_tokens=args.max_new,
                             return_token_ids=True, completion_batch_size=args.batch, prefill_batch_size=8)
        shard = [{"index": i, "prompt": p, "answer": list(map(int, a))} for (i, p), a in zip(chunk, res.token_ids)]
        (data / f"shard-{len(done) + b:06d}.json").write_text(json.dumps(shard))
        tokens += sum(len(s["answer"]) for s in shard)
        el = time.time() - start
        logger.info("generate: %d/%d prompts, %d answer tokens, %.0f tok/s", b + len(chunk), len(todo), tokens, tokens / el)


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
    counts = np.bincount(np.concatenate([np.asarray(ex["answer"], dtype=np.int64) for ex in examples]),
                         minlength=DRAFT_CONFIG["vocab_size"])
    return np.argsort(-counts)[:n]


def make_batch(examples: list[dict], rng: random.Random, args: argparse.Namespace, frequent: np.ndarray):
    """Inputs, the flat indices of scored positions, the candidate output rows and
    the targets' places among them. Rows are answers (the prompt as context) or
    copy windows (an answer, then the same answer again; scored on the repeat)."""
    rows, masks, seq = [], [], args.seq
    for _ in range(args.batch):
        ex = rng.choice(examples)
        if rng.random() < args.copy_frac and len(ex["answer"]) >= 16:
            a = ex["answer"][: seq // 2]
            toks, mask = a + a, [0] * len(a) + [1] * len(a)
        else:
            toks = ex["prompt"] + ex["answer"]
            mask = [0] * len(ex["prompt"]) + [1] * len(ex["answer"])
        toks, mask = toks[-(seq + 1):], mask[-(seq + 1):]
        rows.append(toks + [0] * (seq + 1 - len(toks)))
        masks.append(mask[1:] + [0] * (seq + 1 - len(mask)))
    arr, m = np.array(rows, dtype=np.int32), np.array(masks, dtype=bool).reshape(-1)
    idx = np.nonzero(m)[0].astype(np.int32)
    y = arr[:, 1:].reshape(-1)[idx]
    noise = np.array([rng.randrange(DRAFT_CONFIG["vocab_size"]) for _ in range(args.negatives)], dtype=np.int64)
    cand = np.unique(np.concatenate([frequent, y, noise]))
    return mx.array(arr[:, :-1]), mx.array(idx), mx.array(cand.astype(np.int32)), mx.array(np.searchsorted(cand, y).astype(np.int32))


def loss_fn(model, x, idx, cand, y):
    """Cross-entropy on the scored positions over candidate output rows (the
    frequent tokens, the batch's targets and random negatives): the 49152-row
    output layer and its softmax dominate a small draft's training step."""
    h = model.model(x)
    h = h.reshape(-1, h.shape[-1])[idx]
    logits = h @ model.model.embed_tokens.weight[cand].T
    return nn.losses.cross_entropy(logits, y, reduction="mean")


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
    sched = optim.join_schedules([optim.linear_schedule(1e-5, args.lr, args.warmup),
                                  optim.cosine_decay(args.lr, args.total_steps, args.lr * 0.1)], [args.warmup])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.01)
    step_fn = nn.value_and_grad(model, loss_fn)
    rng, start, last_save, seen, ema = random.Random(args.seed), time.time(), time.time(), 0, None
    examples, loaded_at = load_examples(args.work), time.time()
    frequent = frequent_tokens(examples, args.frequent)
    while time.time() - start < args.minutes * 60 and step < args.total_steps:
        if time.time() - loaded_at > 300:
            examples, loaded_at = load_examples(args.work), time.time()
            frequent = frequent_tokens(examples, args.frequent)
        x, idx, cand, y = make_batch(examples, rng, args, frequent)
        loss, grads = step_fn(model, x, idx, cand, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        step, seen = step + 1, seen + y.size
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0:
            el = time.time() - start
            logger.info("step %d loss %.3f (ema %.3f) lr %.2e | %d loss tokens, %.0f tok/s, %d examples, %.1f min",
                        step, loss.item(), ema, opt.learning_rate.item(), seen, seen / el, len(examples), el / 60)
        if time.time() - last_save > args.save_minutes * 60:
            save_draft(model, kit, args.out, _meta(args, step, seen, start, ema, len(examples)))
            last_save = time.time()
    save_draft(model, kit, args.out, _meta(args, step, seen, start, ema, len(examples)))
    logger.info("saved %s after %d steps", args.out, step)


def _meta(args, step, seen, start, ema, n_examples) -> dict:
    return {"steps": step, "loss_tokens_this_run": seen, "minutes_this_run": round((time.time() - start) / 60, 1),
            "loss_ema": ema, "examples": n_examples, "batch": args.batch, "seq": args.seq, "lr": args.lr,
            "copy_frac": args.copy_frac, "frequent": args.frequent, "negatives": args.negatives, "total_steps": args.total_steps}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.train_smollm2_draft", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("generate", "train", "eval"))
    p.add_argument("--work", type=Path, default=Path("models/logs/smollm2-draft"), help="generated data and logs")
    p.add_argument("--out", type=Path, default=Path("models/smollm2-135m-draft"))
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=384)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--total-steps", type=int, default=3000)
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
        from .eval_smollm2_draft import evaluate
        evaluate(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
