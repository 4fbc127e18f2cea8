"""An early-exit draft for SmolLM2-135M-Instruct with a trimmed output vocabulary:
``python -m training.train_smollm2_early_draft``.

The draft is the target's own embedding and first ``--layers`` transformer
layers (the first ``--frozen`` of them kept as they are), the target's final
norm, and an output layer over only the ``--vocab`` tokens most frequent in the
target's chat answers (FR-Spec, arXiv 2502.14856: the 49152-row output layer
dominates a small draft's step). It starts as the target cut short (its head rows
are the target's tied embedding rows) and is distilled on the target's greedy
answers written by ``python -m training.train_smollm2_draft generate`` (same
shards, same held-out prompts), with the loss of that script restricted to the
subset. A draft proposing only ids in the subset keeps speculation exact: the
target verifies every drafted token.

Subcommands: ``generate`` (the target's answers to a spread of the training
prompts, in small shards), ``train`` (until ``--minutes`` or ``--total-steps``; writes
``--out/early_draft.safetensors``, the trained weights and the subset, and
``training.json``) and ``eval`` (agreement on the held-out chat prompts and the
decode-step cost, as ``training/eval_smollm2_draft.py`` measures the shipped draft,
plus the subset's coverage and the engine's costs with the speed-up they predict).
Results: docs/demo-models.md.
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

from .eval_smollm2_draft import argmax_all, step_costs  # noqa: E402
from .smollm2_prompts import HELDOUT_EVERY, chat_prompts  # noqa: E402
from .train_smollm2_draft import answer_batch  # noqa: E402

logger = logging.getLogger("train_smollm2_early_draft")
TARGET = "smollm2-135m-instruct"


class EarlyExitDraft(nn.Module):
    """The target's embedding and first layers, a final norm, and an output
    layer over ``token_ids`` only. ``__call__`` gives full-vocabulary logits
    (-inf outside the subset) so it drafts like any model of the target's
    vocabulary; ``subset_logits`` is what training scores."""

    def __init__(self, target_args: dict, n_layers: int, token_ids: np.ndarray):
        super().__init__()
        cfg = {**target_args, "num_hidden_layers": n_layers, "layer_types": None}
        self.args = llama.ModelArgs.from_dict(cfg)
        self.model = llama.LlamaModel(self.args)
        self.head = nn.Linear(self.args.hidden_size, len(token_ids), bias=False)
        self.token_ids = mx.array(np.asarray(token_ids, dtype=np.int32))
        self.freeze(recurse=False, keys=["token_ids"])  # a map, not a weight
        self.vocab_size = self.args.vocab_size

    @property
    def layers(self):
        return self.model.layers

    def subset_logits(self, inputs: mx.array, cache=None) -> mx.array:
        return self.head(self.model(inputs, cache))

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        sub = self.subset_logits(inputs, cache)
        full = mx.full((*sub.shape[:-1], self.vocab_size), -mx.inf, dtype=sub.dtype)
        idx = mx.broadcast_to(self.token_ids, sub.shape)
        return mx.put_along_axis(full, idx, sub, axis=-1)


def target_args(kit: me.ModelKit) -> dict:
    return {k: v for k, v in vars(kit.model.args).items() if k != "layer_types"}


def frequent_ids(examples: list[dict], n: int, vocab: int, always: list[int]) -> tuple[np.ndarray, float]:
    """The ``n`` tokens the target chooses most (``always`` included), sorted,
    and the share of answer tokens they cover. Ranked by answer counts plus the
    target's top-k probability mass at every answer position: a few thousand
    answers leave most of a 4096-token subset with a count of 0 or 1, and the
    target's runners-up rank those tokens by what it would also say."""
    counts = np.bincount(np.concatenate([np.asarray(ex["answer"]) for ex in examples]), minlength=vocab)
    top = np.concatenate([np.asarray(ex["top_ids"]).reshape(-1) for ex in examples])
    lp = np.concatenate([np.asarray(ex["top_lp"], dtype=np.float64).reshape(-1) for ex in examples])
    score = counts + np.bincount(top, weights=np.exp(lp), minlength=vocab)
    ids = [int(t) for t in always] + [int(t) for t in np.argsort(-score, kind="stable") if t not in always]
    ids = np.sort(np.array(ids[:n], dtype=np.int64))
    return ids, float(counts[ids].sum() / max(counts.sum(), 1))


def new_draft(kit: me.ModelKit, n_layers: int, token_ids: np.ndarray, frozen: int) -> EarlyExitDraft:
    """The target cut after ``n_layers`` layers: its weights copied in, the
    head from its tied embedding's rows of ``token_ids``; the embedding and the
    first ``frozen`` layers do not train."""
    draft = EarlyExitDraft(target_args(kit), n_layers, token_ids)
    src = dict(tree_flatten(kit.model.parameters()))
    weights = [
        (k, v)
        for k, v in src.items()
        if k.startswith("model.") and (not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers)
    ]
    head = src.get("lm_head.weight", src["model.embed_tokens.weight"])  # tied when there is no lm_head
    draft.load_weights(weights + [("head.weight", head[mx.array(token_ids)])], strict=False)
    draft.model.embed_tokens.freeze()
    for layer in draft.model.layers[:frozen]:
        layer.freeze()
    mx.eval(draft.parameters())
    return draft


def generate(args: argparse.Namespace) -> None:
    """The target's greedy answers to every ``--every``-th training prompt (the
    held-out ones skipped), in small shards, in the format of
    ``train_smollm2_draft generate`` (which answers every prompt, in large calls)."""

    data = args.work / "data"
    data.mkdir(parents=True, exist_ok=True)
    done = {ex["index"] for ex in load_examples(args.work)}
    kit = me.load_model(args.target)
    todo = [i for i, _ in enumerate(chat_prompts()) if i % HELDOUT_EVERY and i % args.every == 0 and i not in done]
    texts, start = chat_prompts(), time.time()
    for b in range(0, len(todo), args.batch):
        if time.time() - start > args.minutes * 60:
            break
        chunk = [
            (i, me.apply_chat_template(kit, [{"role": "user", "content": texts[i]}])) for i in todo[b : b + args.batch]
        ]
        chunk = [(i, p) for i, p in chunk if len(p) <= 256]
        answers = answer_batch(kit, [p for _, p in chunk], args)
        shard = [{"index": i, "prompt": p, **a} for (i, p), a in zip(chunk, answers)]
        (data / f"shard-{todo[b]:06d}.json").write_text(json.dumps(shard))
        logger.info("generate: %d/%d prompts, %.1f min", b + len(chunk), len(todo), (time.time() - start) / 60)


def load_examples(work: Path) -> list[dict]:
    return [ex for f in sorted((work / "data").glob("shard-*.json")) for ex in json.loads(f.read_text())]


def make_batch(examples: list[dict], rng: random.Random, args: argparse.Namespace, sub_of: np.ndarray):
    """Inputs, flat indices of scored positions, their hard targets' places in
    the subset, and the target's top-k distribution restricted to the subset
    (places and renormalised probabilities; weight 0 where none of it is in the
    subset). Answer tokens outside the subset are not scored (never drafted)."""
    seq, k, rows, masks, tops = args.seq, args.top_k, [], [], []
    for _ in range(args.batch):
        ex = rng.choice(examples)
        full, n_prompt = ex["prompt"] + ex["answer"], len(ex["prompt"])
        start = rng.randrange(max(1, len(full) - seq))  # a random window of a long answer
        toks = full[start : start + seq + 1]
        mask = [int(start + j >= n_prompt) for j in range(1, len(toks))]  # predicts an answer token
        rows.append(toks + [0] * (seq + 1 - len(toks)))
        masks.append(mask + [0] * (seq + 1 - len(toks)))
        tops += [
            (ex["top_ids"][start + j - n_prompt], ex["top_lp"][start + j - n_prompt])
            for j in range(1, len(toks))
            if start + j >= n_prompt
        ]
    arr = np.array(rows, dtype=np.int64)
    y_all = sub_of[arr[:, 1:].reshape(-1)]
    scored = np.array(masks, dtype=bool).reshape(-1)
    keep = scored & (y_all >= 0)
    idx = np.nonzero(keep)[0]
    top_ids = np.array([t[0][:k] for t in tops], dtype=np.int64)[keep[scored]]
    top_lp = np.array([t[1][:k] for t in tops], dtype=np.float32)[keep[scored]]
    places = sub_of[top_ids]
    p = np.exp(top_lp - top_lp.max(axis=1, keepdims=True)) * (places >= 0)
    w = (p.sum(axis=1) > 0).astype(np.float32) * args.soft
    p /= np.maximum(p.sum(axis=1, keepdims=True), 1e-9)
    return (
        mx.array(arr[:, :-1].astype(np.int32)),
        mx.array(idx.astype(np.int32)),
        mx.array(y_all[idx].astype(np.int32)),
        mx.array(np.maximum(places, 0).astype(np.int32)),
        mx.array(p),
        mx.array(w),
    )


def loss_fn(model: EarlyExitDraft, x, idx, y, soft_idx, soft_p, soft_w):
    """Per scored position: (1-w) x cross-entropy on the greedy token + w x
    cross-entropy against the target's top-k distribution, over the subset."""
    logits = model.subset_logits(x)
    logq = nn.log_softmax(logits.reshape(-1, logits.shape[-1])[idx], axis=-1)
    hard = -mx.take_along_axis(logq, y[:, None], axis=-1)[:, 0]
    soft = -(soft_p * mx.take_along_axis(logq, soft_idx, axis=-1)).sum(axis=-1)
    return ((1 - soft_w) * hard + soft_w * soft).mean()


def lr_at(args: argparse.Namespace, step: int, done: float) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


def save(draft: EarlyExitDraft, out: Path, meta: dict) -> None:
    """Trainable weights and the subset (float16; the embedding is the target's)."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(draft.trainable_parameters())}
    weights["token_ids"] = draft.token_ids
    mx.save_safetensors(str(out / "early_draft.safetensors"), weights)
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")


def load(kit: me.ModelKit, out: Path) -> EarlyExitDraft:
    meta = json.loads((out / "training.json").read_text())
    w = mx.load(str(out / "early_draft.safetensors"))
    draft = new_draft(kit, meta["layers"], np.array(w.pop("token_ids")), meta["frozen"])
    draft.load_weights([(k, v.astype(mx.float32)) for k, v in w.items()], strict=False)
    mx.eval(draft.parameters())
    return draft


def train(args: argparse.Namespace) -> dict:
    kit = me.load_model(args.target)
    examples = load_examples(args.work)
    token_ids, coverage = frequent_ids(examples, args.vocab, kit.vocab_size, sorted(kit.eos_token_ids))
    sub_of = np.full(kit.vocab_size, -1, dtype=np.int64)
    sub_of[token_ids] = np.arange(len(token_ids))
    draft = new_draft(kit, args.layers, token_ids, args.frozen)
    n_train = sum(v.size for _, v in tree_flatten(draft.trainable_parameters()))
    logger.info(
        "%d examples, %d answer tokens; subset of %d covers %.3f; %.2fM trainable",
        len(examples),
        sum(len(e["answer"]) for e in examples),
        len(token_ids),
        coverage,
        n_train / 1e6,
    )
    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.0)
    step_fn = nn.value_and_grad(draft, loss_fn)
    rng, start, step, seen, ema = random.Random(args.seed), time.time(), 0, 0, None
    loaded_at = start
    while time.time() - start < args.minutes * 60 and step < args.total_steps:
        if time.time() - loaded_at > 180:  # pick up shards a running ``generate`` has added
            examples, loaded_at = load_examples(args.work), time.time()
        opt.learning_rate = lr_at(args, step, (time.time() - start) / (args.minutes * 60))
        batch = make_batch(examples, rng, args, sub_of)
        loss, grads = step_fn(draft, *batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(draft, grads)
        mx.eval(draft.trainable_parameters(), opt.state, loss)
        step, seen = step + 1, seen + batch[1].size
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0:
            logger.info(
                "step %d loss %.3f (ema %.3f) lr %.2e | %d tokens, %.1f min",
                step,
                loss.item(),
                ema,
                opt.learning_rate.item(),
                seen,
                (time.time() - start) / 60,
            )
    meta = {
        "layers": args.layers,
        "frozen": args.frozen,
        "vocab": len(token_ids),
        "coverage": coverage,
        "steps": step,
        "scored_tokens": seen,
        "minutes": round((time.time() - start) / 60, 1),
        "loss_ema": ema,
        "examples": len(examples),
        "answer_tokens": sum(len(e["answer"]) for e in examples),
        "batch": args.batch,
        "seq": args.seq,
        "lr": args.lr,
        "soft": args.soft,
        "trainable_m": n_train / 1e6,
    }
    save(draft, args.out, meta)
    logger.info("saved %s: %s", args.out, meta)
    return meta


def engine_costs(kit: me.ModelKit, draft: nn.Module, agreement: float) -> dict:
    """The draft's chained step and the target's verify passes as the engine
    measures them (mlx_engine.pricing.costs), and the speed-up over plain
    decoding they predict at the best draft length if each draft token is
    accepted independently with probability ``agreement`` (acceptance is
    burstier than that in practice, which favours longer drafts)."""
    from mlx_engine.pricing import costs, speedup

    target = costs.measure(kit.model, kit.vocab_size)
    draft_step = costs.measure_chained_step(draft, kit.vocab_size)
    gain = {
        k: speedup.expected_tokens(agreement, k) * target.step() / (k * draft_step + target.seconds[k])
        for k in range(1, 9)
    }
    best = max(gain, key=gain.get)
    return {
        "target_step_ms": target.step() * 1e3,
        "draft_chained_step_ms": draft_step * 1e3,
        "ratio": target.step() / draft_step,
        "verify": target.summary(),
        "predicted_speedup": round(gain[best], 3),
        "at_draft_length": best,
    }


def heldout_answers(kit: me.ModelKit, args: argparse.Namespace) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy answer) for the held-out chat prompts, as
    ``eval_smollm2_draft.chat_agreement`` makes them; kept in ``--work`` so
    several drafts are measured on one generation."""
    from mlx_lm.generate import batch_generate

    path = args.work / f"heldout-{args.eval_prompts}-{args.max_new}.json"
    if path.exists():
        return [tuple(x) for x in json.loads(path.read_text())]
    prompts = [
        me.apply_chat_template(kit, [{"role": "user", "content": t}])
        for i, t in enumerate(chat_prompts())
        if i % HELDOUT_EVERY == 0
    ]
    prompts = [p for p in prompts if len(p) <= 256][: args.eval_prompts]
    res = batch_generate(
        kit.model,
        kit.tokenizer,
        prompts,
        max_tokens=args.max_new,
        return_token_ids=True,
        completion_batch_size=len(prompts),
    )
    pairs = [(p, list(map(int, a))) for p, a in zip(prompts, res.token_ids)]
    path.write_text(json.dumps(pairs))
    return pairs


def agreement(draft: nn.Module, pairs: list[tuple[list[int], list[int]]]) -> dict:
    """Share of answer tokens where the draft's argmax is the target's greedy
    token, and the share inside the draft's output subset (its ceiling)."""

    hits = inside = total = 0
    ids = set(np.array(draft.token_ids).tolist()) if hasattr(draft, "token_ids") else None
    for p, a in pairs:
        pred = argmax_all(draft, p + a)[len(p) - 1 : len(p) + len(a) - 1]
        hits += sum(int(x == y) for x, y in zip(pred, a))
        inside += len(a) if ids is None else sum(int(t in ids) for t in a)
        total += len(a)
    return {
        "prompts": len(pairs),
        "answer_tokens": total,
        "agreement": hits / max(total, 1),
        "answer_tokens_in_subset": inside / max(total, 1),
    }


def evaluate(args: argparse.Namespace) -> dict:
    """Agreement on held-out chat answers and step cost, as the shipped draft's
    eval, plus the costs the engine measures and the speed-up they predict."""

    kit = me.load_model(args.target)
    draft = load(kit, args.out)
    out = {"agreement_heldout_chat": agreement(draft, heldout_answers(kit, args)), "step_cost": step_costs(kit, draft)}
    out["engine_costs"] = engine_costs(kit, draft, out["agreement_heldout_chat"]["agreement"])
    logger.info("eval: %s", json.dumps(out))
    (args.out / "eval.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m training.train_smollm2_early_draft", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("command", choices=("generate", "train", "eval"))
    p.add_argument("--target", default=TARGET, help="the model the draft serves (its answers are in --work)")
    p.add_argument("--work", type=Path, default=Path("models/logs/smollm2-draft"), help="generated answers (shards)")
    p.add_argument("--out", type=Path, default=Path("models/logs/smollm2-early-draft"))
    p.add_argument("--layers", type=int, default=3, help="target layers the draft keeps")
    p.add_argument("--frozen", type=int, default=1, help="of them, the first ones kept as the target's")
    p.add_argument("--vocab", type=int, default=4096, help="output tokens (the most frequent in the answers)")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--total-steps", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=320)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--soft", type=float, default=0.7, help="weight of the soft (top-k) loss against the hard one")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--every", type=int, default=8, help="generate: answer every n-th training prompt")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    {"generate": generate, "train": train, "eval": evaluate}[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
