"""Evaluate a SmolLM2 draft: ``python -m training.train_smollm2_draft eval --out DIR``.

Agreement with the target's greedy choice (the share of positions where the
draft's argmax equals the target's: what greedy speculation accepts), on the
target's own answers to held-out chat prompts and teacher-forced on held-out
stdlib text; copy accuracy on a repeated random token run; and the decode-step
cost of both models in float32 (the engine's CPU default), loaded through the
public API. Writes ``DIR/eval.json``."""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from .corpus import HELDOUT_FILES, stdlib_root  # noqa: E402
from .smollm2_prompts import HELDOUT_EVERY, chat_prompts  # noqa: E402

logger = logging.getLogger("eval_smollm2_draft")


def argmax_all(model, tokens: list[int]) -> list[int]:
    """The model's argmax after every prefix of ``tokens`` (one forward pass)."""
    return mx.argmax(model(mx.array(tokens)[None])[0], axis=-1).tolist()


def chat_agreement(kit: me.ModelKit, draft, n_prompts: int, max_new: int) -> dict:
    """Draft agreement on the target's greedy answers to held-out prompts."""
    from mlx_lm.generate import batch_generate

    prompts = [
        me.apply_chat_template(kit, [{"role": "user", "content": t}])
        for i, t in enumerate(chat_prompts())
        if i % HELDOUT_EVERY == 0
    ]
    prompts = [p for p in prompts if len(p) <= 256][:n_prompts]
    res = batch_generate(
        kit.model, kit.tokenizer, prompts, max_tokens=max_new, return_token_ids=True, completion_batch_size=len(prompts)
    )
    hits = total = 0
    for p, a in zip(prompts, res.token_ids):
        a = list(map(int, a))
        pred = argmax_all(draft, p + a)[len(p) - 1 : len(p) + len(a) - 1]
        hits += sum(int(x == y) for x, y in zip(pred, a))
        total += len(a)
    return {"prompts": len(prompts), "answer_tokens": total, "agreement": hits / max(total, 1)}


def text_agreement(kit: me.ModelKit, draft, length: int = 512) -> dict:
    """Teacher-forced agreement with the target's argmax on text the draft never
    saw: held-out stdlib files (code) and two of this repository's docs (English)."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    sources = {
        "code": [Path(stdlib_root()) / n for n in HELDOUT_FILES[:3]],
        "english": [docs / "architecture.md", docs / "performance.md"],
    }
    out = {}
    for kind, paths in sources.items():
        hits = total = 0
        for path in paths:
            toks = me.tokenize(kit, path.read_text(encoding="utf-8"))[:length]
            t, d = argmax_all(kit.model, toks), argmax_all(draft, toks)
            hits += sum(int(x == y) for x, y in zip(t, d))
            total += len(toks)
        out[kind] = {"files": [p.name for p in paths], "tokens": total, "agreement": hits / max(total, 1)}
    return out


def copy_accuracy(draft, vocab: int, n: int = 64, seed: int = 0) -> float:
    """Share of the second copy of a random token run that the draft predicts."""
    rng = random.Random(seed)
    run = [rng.randrange(1000, vocab) for _ in range(n)]
    pred = argmax_all(draft, run + run)[n : 2 * n - 1]
    return sum(int(p == t) for p, t in zip(pred, run[1:])) / (n - 1)


def step_ms(model, ctx: int = 128, n: int = 40) -> list[float]:
    """Times of single-token decode steps after a ``ctx``-token prompt."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * ctx]), cache=cache))
    tok, out = mx.array([[5]]), []
    for _ in range(n):
        t = time.perf_counter()
        y = mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)
        mx.eval(y)
        out.append((time.perf_counter() - t) * 1000)
        tok = y[None]
    return out


def step_costs(kit: me.ModelKit, draft, rounds: int = 5) -> dict:
    """Median decode-step times, target and draft interleaved over ``rounds``."""
    t, d = [], []
    for _ in range(rounds):
        t += step_ms(kit.model)
        d += step_ms(draft)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"target_ms": med(t), "draft_ms": med(d), "ratio": med(t) / med(d), "dtype": str(kit.compute_dtype)}


def evaluate(args: argparse.Namespace) -> dict:
    """Evaluate the draft in ``args.out`` and write ``eval.json`` there."""
    kit = me.load_model("smollm2-135m-instruct")
    report = me.check_draft_model(kit, args.out)
    me.load_draft_model(kit, args.out)
    draft = kit.draft.model
    out = {
        "compatible": report.compatible,
        "draft_params_m": kit.draft.num_params / 1e6,
        "step_cost": step_costs(kit, draft),
        "agreement_heldout_chat": chat_agreement(kit, draft, args.eval_prompts, args.max_new),
        "agreement_heldout_text": text_agreement(kit, draft),
        "copy_accuracy_random_run": copy_accuracy(draft, kit.vocab_size),
    }
    logger.info("eval: %s", json.dumps(out))
    (Path(args.out) / "eval.json").write_text(json.dumps(out, indent=1) + "\n")
    return out
