#!/usr/bin/env python
"""Evaluate the bundled ``pystd`` demo models and write their model cards.

For each of ``<out>/pystd-target`` and ``<out>/pystd-draft`` this loads the
model with ``mlx_lm.load`` and measures

* held-out loss: mean cross-entropy (nats/token) on 32 evenly spaced windows of
  512 tokens of the held-out stdlib files (``training/corpus.py``),
* copy accuracy: next-token accuracy on the second half of 64 repeated random
  token sequences (2 x 48 tokens); chance is ~1/4096,
* echo: prompt = held-out passage (96 tokens) + "\\n\\n" + first 8 tokens of the
  passage again; how many of the next 32 greedy tokens match the passage,
* no-loop: fraction of distinct 4-grams in 128 greedy tokens for ordinary prompts,
* decode-step cost (ms) for float32 and float16 compute, 100 single-token steps
  with a KV cache,

and writes ``eval.json`` and ``README.md`` into each model directory.

    .venv/bin/python -m training.eval_demo_models --out models
"""

from __future__ import annotations

import ctypes
import os

_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
if os.path.exists(_OPENBLAS):
    ctypes.CDLL(_OPENBLAS, mode=ctypes.RTLD_GLOBAL)

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from training import corpus  # noqa: E402

EOS = "<|endoftext|>"
NOLOOP_PROMPTS = [
    "import os\nimport sys\n\n\ndef main():\n",
    "class Config:\n    \"\"\"",
    "def parse_args(argv=None):\n",
    "# Utility functions for working with paths\n\n",
    "    def __repr__(self):\n",
    "try:\n    import threading\nexcept ImportError:\n",
]
# wall-clock budgets of the run that produced the bundled models
TRAIN_MINUTES = {"target": 85, "draft": 11}
SAMPLE_PROMPT = "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n"


def encode(tokenizer, text):
    return list(tokenizer.encode(text, add_special_tokens=False))


def greedy(model, prompt_ids, n):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt_ids)[None], cache=cache)
    out = []
    for _ in range(n):
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        t = int(tok.item())
        out.append(t)
        logits = model(tok[None], cache=cache)
    return out


def decode_cost_ms(model, steps=100, warmup=10, prompt_len=16):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array(np.arange(1, prompt_len + 1, dtype=np.int32))[None]
    logits = model(x, cache=cache)
    mx.eval(logits)
    tok = mx.argmax(logits[:, -1, :], axis=-1)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(tok[None], cache=cache)
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(tok)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    return {"median_ms": round(float(np.median(times)), 3), "mean_ms": round(float(np.mean(times)), 3),
            "steps": steps}


def evaluate(path: Path, seq_len=512, n_windows=32) -> dict:
    import mlx.core as mx
    import mlx_lm
    from train_demo_models import copy_accuracy, heldout_windows, mean_ce

    model, tokenizer = mlx_lm.load(str(path))
    cfg = json.loads((path / "config.json").read_text())
    V = cfg["vocab_size"]
    eos_id = cfg["eos_token_id"]
    res = {"model": path.name}

    # decode cost: fp16 as stored, then fp32
    res["decode_ms_float16"] = decode_cost_ms(model)
    model.set_dtype(mx.float32)
    res["decode_ms_float32"] = decode_cost_ms(model)

    texts = corpus.read_heldout_texts()
    parts = []
    for t in texts.values():
        parts += encode(tokenizer, t) + [eos_id]
    held = np.asarray(parts, dtype=np.int32)
    win = heldout_windows(held, seq_len, n_windows)
    res["heldout_loss"] = round(mean_ce(model, win), 4)
    res["heldout_ppl"] = round(float(np.exp(res["heldout_loss"])), 2)
    res["heldout_eval_tokens"] = int(win.shape[0] * seq_len)
    res["copy_acc"] = round(copy_accuracy(model, V, n=64, half=48, seed=1234), 4)

    # echo check
    sep = encode(tokenizer, "\n\n")
    matches, prefixes = [], []
    for rel, text in texts.items():
        ids = encode(tokenizer, text)
        for frac in (1 / 3, 2 / 3):
            s = int(len(ids) * frac)
            passage = ids[s:s + 96]
            if len(passage) < 96:
                continue
            prompt = passage + sep + passage[:8]
            gen = greedy(model, prompt, 32)
            ref = passage[8:40]
            m = [int(a == b) for a, b in zip(gen, ref)]
            matches.append(sum(m))
            prefixes.append(next((i for i, v in enumerate(m) if not v), len(m)))
    res["echo"] = {"prompts": len(matches), "passage_tokens": 96, "separator": "\\n\\n",
                   "given_tokens": 8, "generated_tokens": 32,
                   "mean_matching_tokens": round(float(np.mean(matches)), 2),
                   "mean_exact_prefix": round(float(np.mean(prefixes)), 2),
                   "full_match_fraction": round(float(np.mean([p == 32 for p in prefixes])), 3)}

    # no-loop check
    fracs = []
    for p in NOLOOP_PROMPTS:
        gen = greedy(model, encode(tokenizer, p), 128)
        grams = [tuple(gen[i:i + 4]) for i in range(len(gen) - 3)]
        fracs.append(len(set(grams)) / len(grams))
    res["noloop"] = {"prompts": len(fracs), "generated_tokens": 128,
                     "mean_distinct_4gram_frac": round(float(np.mean(fracs)), 3),
                     "min_distinct_4gram_frac": round(float(np.min(fracs)), 3)}

    # sample through the public mlx_lm API (fp16 weights as loaded by users)
    model16, tok16 = mlx_lm.load(str(path))
    res["sample_prompt"] = SAMPLE_PROMPT
    res["sample"] = mlx_lm.generate(model16, tok16, SAMPLE_PROMPT, max_tokens=80, verbose=False)
    return res


def target_agreement(draft_path: Path, target_path: Path, seq_len=512, n_windows=32) -> dict:
    """How often the draft's greedy choice equals the target's: on held-out text
    and on the target's own greedy output (what greedy speculative decoding
    verifies), both teacher-forced. The share of drafts a greedy verify accepts
    grows with it."""
    import mlx.core as mx
    import mlx_lm
    from train_demo_models import heldout_windows

    draft, tokenizer = mlx_lm.load(str(draft_path))
    target, _ = mlx_lm.load(str(target_path))
    draft.set_dtype(mx.float32)
    target.set_dtype(mx.float32)
    eos_id = json.loads((target_path / "config.json").read_text())["eos_token_id"]

    def agree(seqs) -> float:
        same = total = 0
        for ids in seqs:
            x = mx.array(ids)[None]
            same += int((draft(x).argmax(-1) == target(x).argmax(-1)).sum().item())
            total += len(ids)
        return same / total

    parts = []
    for t in corpus.read_heldout_texts().values():
        parts += encode(tokenizer, t) + [eos_id]
    held = heldout_windows(np.asarray(parts, dtype=np.int32), seq_len, n_windows)
    generated = []
    for prompt in NOLOOP_PROMPTS + [SAMPLE_PROMPT]:
        ids = encode(tokenizer, prompt)
        generated.append(ids + greedy(target, ids, 128))
    return {"heldout_top1": round(agree(list(held)), 4), "target_greedy_top1": round(agree(generated), 4),
            "heldout_tokens": int(held.size), "target_greedy_prompts": len(generated), "target_greedy_tokens": 128}


def corpus_info(path: Path) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tr = corpus.training_files()
    n_tok = sum(len(e.ids) + 1 for e in tok.encode_batch([corpus.read_text(p) for p in tr]))
    return {"python_version": platform.python_version(), "stdlib_root": corpus.stdlib_root(),
            "training_files": len(tr), "training_bytes": int(sum(os.path.getsize(p) for p in tr)),
            "training_tokens": int(n_tok), "heldout_files": list(corpus.HELDOUT_FILES)}


# Both bundled models were made in phases; train_info.json only describes the
# last one, so the earlier phases are recorded here. The target was restarted
# from checkpoints with a stronger copy mix because copying had not emerged; the
# draft was trained once like the target and then distilled from it.
PRIOR_PHASES = {
    "target": [
        {"phase": 1, "steps": 123, "tokens": 123 * 2048, "wall_s": 30.3 * 60, "lr": 1.5e-3,
         "warmup": 50, "copy_frac": 0.5, "random_copy_frac": 0.25,
         "recipe": "one passage pair per copy window (earlier version of the script)",
         "end_eval": {"step": 100, "copy_acc": 0.0, "heldout_loss": 6.011}},
        {"phase": 2, "steps": 283, "tokens": 283 * 2048, "wall_s": 30.1 * 60, "lr": 1.5e-3,
         "warmup": 20, "copy_frac": 0.5, "random_copy_frac": 0.25,
         "recipe": "copy windows densely filled with passage pairs (current script)",
         "end_eval": {"step": 200, "copy_acc": 0.0, "heldout_loss": 5.362}},
    ],
    "draft": [
        {"phase": 1, "steps": 681, "tokens": 1394688, "wall_s": 660.4, "lr": 3e-3, "seed": 0,
         "warmup": 10, "copy_frac": 0.75, "random_copy_frac": 0.5,
         "recipe": "next-token cross-entropy on the corpus, like the target (seed 0, 11-minute budget)",
         "end_eval": {"step": 681, "copy_acc": 0.0, "heldout_loss": 4.6642,
                      "target_agreement": {"heldout_top1": 0.539, "target_greedy_top1": 0.6824}}},
        {"phase": 2, "steps": 1021, "tokens": 2091008, "wall_s": 2400.1, "lr": 2e-3, "seed": 1,
         "warmup": 20, "copy_frac": 0.75, "random_copy_frac": 0.0,
         "recipe": "distilled from `pystd-target` on 512-token windows",
         "command": ".venv/bin/python -m training.train_demo_models --out models --only draft "
                    "--init-draft models/pystd-draft --prior-steps 681 --distill-from models/pystd-target "
                    "--draft-minutes 40 --draft-lr 2e-3 --warmup 20 --random-copy-frac 0 --seed 1",
         "end_eval": {"step": 1021, "heldout_loss": 4.7201,
                      "target_agreement": {"heldout_top1": 0.7762, "target_greedy_top1": 0.7357}}},
    ],
}


def role_of(path: Path) -> str:
    return "target" if "target" in path.name else "draft"


def total_steps(info):
    return info["steps"] + (info.get("prior_steps") or 0)


def total_tokens(info):
    return info["tokens_seen"] + (info.get("prior_tokens") or 0)


def total_wall(info, role):
    prior = sum(p["wall_s"] for p in PRIOR_PHASES[role]) if info.get("prior_steps") else 0
    return info["train_wall_s"] + prior


def phase_notes(info, role):
    if not info.get("prior_steps"):
        return ""
    phases = PRIOR_PHASES[role]
    rows = "\n".join(
        f"| {p['phase']} | {p['steps']} | {p['tokens']:,} | {p['wall_s'] / 60:.0f} | {p['lr']} / {p['warmup']} | "
        f"{p['copy_frac']:.0%} / {p['random_copy_frac']:.0%} | {p['recipe']} |" for p in phases)
    n = len(phases) + 1
    last = (f"distilled from `{Path(info['distilled_from']).name}` on {info['seq_len']}-token windows"
            if info.get("distilled_from") else "dense copy windows, heavier copy mix (current script)")
    rows += (f"\n| {n} | {info['steps']} | {info['tokens_seen']:,} | {info['train_wall_s'] / 60:.0f} | "
             f"{info['lr']} / {info['warmup']} | {info['copy_frac']:.0%} / {info['random_copy_frac']:.0%} | "
             f"{last} |")
    if role == "target":
        intro = """The CPU was heavily shared with other jobs, so the run was slower than planned and copying
had not emerged; training was therefore restarted twice from the latest checkpoint (weights
only, fresh AdamW state and lr warmup) with a stronger copy mix:"""
    else:
        intro = """The draft was first trained on the corpus like the target, then **distilled from the
target**: trained, from those weights with a fresh AdamW state each phase, on the target's
next-token distributions (teacher-forced on the same data mix, without random-token
passages), first on 512-token windows, then on 1024-token windows so that it also follows
the target past the 512 positions both were first trained on. A draft is only as good as
its agreement with the target's choices, and distillation trains exactly that (see
*Agreement with the target* below):"""
    return f"""
{intro}

| phase | steps | tokens | minutes | peak lr / warmup | copy windows / random passages | data |
|---:|---:|---:|---:|---|---|---|
{rows}

The step-by-step table below covers the last phase only (`train_info.json`; the full log is in
`models/logs/`, which is not committed).
"""


def write_card(path: Path, res: dict, info: dict, cinfo: dict, other: dict | None):
    cfg = json.loads((path / "config.json").read_text())
    size_mb = (path / "model.safetensors").stat().st_size / 1e6
    role = role_of(path)
    hist = info.get("history", [])
    distilled = bool(info.get("distilled_from"))
    hist_head = "| step | minutes | train loss | held-out loss | copy acc |" + (" target top-1 agreement |" if distilled else "")
    hist_head += "\n|---:|---:|---:|---:|---:|" + ("---:|" if distilled else "")
    hist_rows = "\n".join(
        f"| {h['step']} | {h['elapsed_min']:.1f} | {h['train_loss']:.3f} | {h['heldout_loss']:.3f} | {h['copy_acc']:.3f} |"
        + (f" {h['teacher_agreement']:.3f} |" if distilled else "")
        for h in hist if h.get("train_loss") is not None)
    ratio = ""
    if other is not None:
        r32 = res["decode_ms_float32"]["median_ms"] / other["decode_ms_float32"]["median_ms"]
        r16 = res["decode_ms_float16"]["median_ms"] / other["decode_ms_float16"]["median_ms"]
        if role == "draft":
            r32, r16 = 1 / r32, 1 / r16
        ratio = (f"\nTarget/draft decode-step cost ratio: **{r32:.1f}x** (float32), "
                 f"**{r16:.1f}x** (float16).\n")
    first_seed = PRIOR_PHASES[role][0].get("seed", info["seed"]) if info.get("prior_steps") else info["seed"]
    retrain = info.get("retrain_command") or (
        "nohup .venv/bin/python -m training.train_demo_models --out models "
        f"--target-minutes {TRAIN_MINUTES['target']:g} --draft-minutes {TRAIN_MINUTES['draft']:g} --seed {first_seed} "
        "> models/logs/nohup.out 2>&1 &")
    if distilled:
        phases = PRIOR_PHASES[role]
        lines = ["# phase 1: the whole family (tokenizer, target, draft, evaluation)", retrain]
        for ph in phases[1:]:
            lines += [f"# phase {ph['phase']}: {ph['recipe']}", ph["command"]]
        lines += [f"# phase {len(phases) + 1}: distil the draft from the target on {info['seq_len']}-token windows, "
                  "then re-run -m training.eval_demo_models",
                  ".venv/bin/python -m training.train_demo_models --out models --only draft "
                  f"--init-draft models/pystd-draft --prior-steps {info['prior_steps']} "
                  f"--distill-from models/pystd-target --draft-minutes {info['train_wall_s'] / 60:.0f} "
                  f"--draft-lr {info['lr']:g} --warmup {info['warmup']} --random-copy-frac {info['random_copy_frac']:g} "
                  f"--seq-len {info['seq_len']} --batch-size {info['batch_size']} --seed {info['seed']}"]
        retrain = "\n".join(lines)
    agreement = ""
    if res.get("target_agreement"):
        ta = res["target_agreement"]
        earlier = [(ph["phase"], ph["end_eval"]["target_agreement"]) for ph in PRIOR_PHASES["draft"]
                   if distilled and "target_agreement" in ph.get("end_eval", {})]

        def was(key: str) -> str:
            if not earlier:
                return ""
            return " (" + ", ".join(f"after phase {n}: {a[key]:.1%}" for n, a in earlier) + ")"
        agreement = f"""
## Agreement with the target

How often this draft's greedy choice equals `pystd-target`'s, teacher-forced (both models in
float32). Greedy speculative decoding accepts a draft token exactly when they agree, so this
is the per-token acceptance to expect, before burstiness.

| text | agreement |
|---|---:|
| held-out files ({ta['heldout_tokens']:,} tokens, 32 x 512 windows) | {ta['heldout_top1']:.1%}{was('heldout_top1')} |
| the target's own greedy output ({ta['target_greedy_prompts']} prompts x {ta['target_greedy_tokens']} tokens, with the prompts) | {ta['target_greedy_top1']:.1%}{was('target_greedy_top1')} |
"""
    card = f"""# pystd-{role}

A tiny **base** (non-chat) causal language model of Python source code, trained from
scratch with MLX on a CPU as the bundled demo model of `mlx-engine`
({'the large model of the family; pair it with `pystd-draft` for speculative decoding' if role == 'target' else 'the draft model of the family, for speculative decoding of `pystd-target`'}).
It is a toy: it writes Python-looking code and knows nothing else.
{'It copies from its context (copy accuracy ' + format(res['copy_acc'], '.2f') + ').' if res['copy_acc'] >= 0.5 else '**Copying from context (induction) did not emerge in this short CPU run** (copy accuracy ' + format(res['copy_acc'], '.3f') + '), so prompt-lookup drafts will rarely be accepted and echo-style prompts are not reproduced; undertrained (about ' + format(total_tokens(info) / 1e6, '.1f') + 'M tokens), it also falls into repetition loops on some prompts.'}
There is no chat template.

## Architecture

| | |
|---|---|
| architecture | `llama` (`LlamaForCausalLM`), tied input/output embeddings |
| parameters | {info['parameters']:,} ({info['parameters'] / 1e6:.2f}M) |
| hidden size / layers / heads / kv heads | {cfg['hidden_size']} / {cfg['num_hidden_layers']} / {cfg['num_attention_heads']} / {cfg['num_key_value_heads']} |
| FFN (SwiGLU) | {cfg['intermediate_size']} |
| vocab | {cfg['vocab_size']} (byte-level BPE, `<|endoftext|>` = id {cfg['eos_token_id']} is EOS and BOS) |
| RoPE theta / max positions | {cfg['rope_theta']} / {cfg['max_position_embeddings']} (trained on {info['seq_len']}-token windows) |
| weights | float16 `model.safetensors`, {size_mb:.1f} MB |

## Training data

Python {cinfo['python_version']} standard library sources: {cinfo['training_files']} `.py` files
({cinfo['training_bytes'] / 1e6:.1f} MB, {cinfo['training_tokens']:,} tokens), excluding
`site-packages`, `test`/`tests`, `idlelib`, `lib2to3`, files > 200 kB and these held-out
files: {', '.join('`' + f + '`' for f in cinfo['heldout_files'])} (see `training/corpus.py`).
Documents are joined with `<|endoftext|>`. {info['copy_frac']:.0%} of the training windows are
*copy windows*, filled with blocks of: up to 64 tokens of natural context, a 16-128 token
passage, a short separator (e.g. `\\n`, `\\n\\n`, `\\n# again:\\n`, nothing), the passage again,
up to 32 tokens of the text that follows the passage. {info['edit_frac']:.0%} of the natural-text
second copies carry 1-3 small edits (substitution/insertion/deletion), and
{info['random_copy_frac']:.0%} of the passages are random tokens (the loss on their first copy is
masked), so that copying from context (induction) emerges early.

## Training

AdamW (betas 0.9/0.95, weight decay {info['weight_decay']}), peak lr {info['lr']}, {info['warmup']} warmup steps,
cosine decay to 10%, grad clip {info['grad_clip']}, batch {info['batch_size']} x {info['seq_len']} tokens,
float32, seed {info['seed']}, on {info.get('machine', 'a 2-core x86_64 CPU (MLX CPU backend + OpenBLAS)')}.
**{total_steps(info)} steps, {total_tokens(info):,} tokens seen, {total_wall(info, role) / 60:.1f} min wall time.**
{phase_notes(info, role)}
Reproduce (the whole family: tokenizer, target, draft, evaluation) with the command below.
The learning-rate schedule is sized from the wall-clock budget, so the number of steps
(and hence the exact weights) depends on machine speed and load; the CPU was shared
with other jobs during the original run. Add `--max-steps N` with large budgets for a
fixed-length run.

```
{retrain}
```

{hist_head}
{hist_rows}

## Evaluation

| metric | value |
|---|---|
| held-out loss (mean CE over {res['heldout_eval_tokens']:,} held-out tokens, 32 x 512 windows) | {res['heldout_loss']:.4f} nats/token (ppl {res['heldout_ppl']}) |
| copy accuracy (2nd half of 64 repeated random 48-token sequences) | {res['copy_acc']:.3f} (chance ~ 0.0002) |
| echo: held-out 96-token passage + `\\n\\n` + its first 8 tokens; greedy next 32 | {res['echo']['mean_matching_tokens']:.1f}/32 tokens match on average, mean exact prefix {res['echo']['mean_exact_prefix']:.1f}, {res['echo']['full_match_fraction']:.0%} fully correct ({res['echo']['prompts']} prompts) |
| no-loop: distinct 4-grams in 128 greedy tokens ({res['noloop']['prompts']} prompts) | mean {res['noloop']['mean_distinct_4gram_frac']:.2f}, min {res['noloop']['min_distinct_4gram_frac']:.2f} |
| decode step, float32 compute (KV cache, median of 100) | {res['decode_ms_float32']['median_ms']:.2f} ms |
| decode step, float16 compute (KV cache, median of 100) | {res['decode_ms_float16']['median_ms']:.2f} ms |
{ratio}
Decode timings are single-stream, batch 1, on the 2-core CPU above; float16 matmuls on the
MLX CPU backend do not use BLAS, so float32 compute is usually faster there.
{agreement}
Greedy sample (`mlx_lm.generate`, float16 weights) for the prompt
`{SAMPLE_PROMPT.encode('unicode_escape').decode()}`:

```python
{SAMPLE_PROMPT}{res['sample']}
```

## Usage

```python
import mlx_lm
model, tokenizer = mlx_lm.load("models/pystd-{role}")
print(mlx_lm.generate(model, tokenizer, "def fib(n):\\n", max_tokens=64))
```
"""
    (path / "README.md").write_text(card)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models")
    p.add_argument("--only", choices=["target", "draft"], default=None)
    args = p.parse_args(argv)
    out = Path(args.out)
    names = [args.only] if args.only else ["target", "draft"]
    results = {}
    for name in names:
        path = out / f"pystd-{name}"
        if not (path / "model.safetensors").exists():
            print(f"skip {path}: no model", flush=True)
            continue
        t0 = time.time()
        results[name] = evaluate(path)
        print(f"[{name}] eval in {time.time() - t0:.0f}s: " + json.dumps(
            {k: v for k, v in results[name].items() if k not in ("sample", "sample_prompt")}), flush=True)
    # merge with already-written results of the other model for the ratio
    for name in ("target", "draft"):
        f = out / f"pystd-{name}" / "eval.json"
        if name not in results and f.exists():
            results[name] = json.loads(f.read_text())
    cinfo = None
    for name in names:
        if name not in results:
            continue
        path = out / f"pystd-{name}"
        cinfo = cinfo or corpus_info(path)
        info_f = path / "train_info.json"
        info = json.loads(info_f.read_text()) if info_f.exists() else {}
        other = results.get("draft" if name == "target" else "target")
        res = dict(results[name])
        if other is not None:
            a, b = (res, other) if name == "target" else (other, res)
            res["target_draft_cost_ratio"] = {
                "float32": round(a["decode_ms_float32"]["median_ms"] / b["decode_ms_float32"]["median_ms"], 2),
                "float16": round(a["decode_ms_float16"]["median_ms"] / b["decode_ms_float16"]["median_ms"], 2)}
        res["parameters"] = info.get("parameters")
        res["steps"] = total_steps(info) if info else None
        res["tokens_seen"] = total_tokens(info) if info else None
        res["train_wall_s"] = total_wall(info, name) if info else None
        if name == "draft" and (out / "pystd-target" / "model.safetensors").exists():
            res["target_agreement"] = target_agreement(path, out / "pystd-target")
        if info.get("prior_steps"):
            res["training_phases"] = PRIOR_PHASES[name]
            res["final_phase"] = {"steps": info["steps"], "tokens": info["tokens_seen"],
                                  "wall_s": info["train_wall_s"], "copy_frac": info["copy_frac"],
                                  "random_copy_frac": info["random_copy_frac"]}
        res["seed"] = info.get("seed")
        res["corpus"] = cinfo
        (path / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
        if info:
            write_card(path, res, info, cinfo, other)
        print(f"wrote {path / 'eval.json'} and README.md", flush=True)


if __name__ == "__main__":
    main()
