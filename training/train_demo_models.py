#!/usr/bin/env python
"""Train the bundled ``pystd`` demo model family with MLX on the CPU.

Produces, under ``--out`` (default ``models``):

* ``pystd-target/``  a ~15.7M-parameter llama-architecture causal LM
* ``pystd-draft/``   a ~0.95M-parameter llama-architecture causal LM
* ``logs/``          tokenizer/token caches and ``train.log`` (git-ignored)

Both models share one byte-level BPE tokenizer (vocab 4096) trained on the
Python standard library sources (see ``training/corpus.py``), and are saved in
Hugging Face layout (float16 ``model.safetensors`` + config + tokenizer files)
so that ``mlx_lm.load(path)`` loads them.

Training data are windows of the tokenized training files (documents joined by
``<|endoftext|>``) mixed with *copy sequences* -- a passage, a short separator
and the same passage again (sometimes with a small edit, sometimes a passage of
random tokens) -- so that copying from context (induction) emerges early; the
demo relies on it for prompt-lookup decoding and the echo benchmark.

Typical use (runs for about 90 minutes on 2 CPU cores)::

    nohup .venv/bin/python -m training.train_demo_models --out models \
        --target-minutes 85 --draft-minutes 11 > models/logs/nohup.out 2>&1 &

Given ``--max-steps N`` (and budgets large enough not to stop early) the run is
deterministic up to floating point reordering; the learning-rate schedule is
otherwise sized from the wall-clock budget.
"""

from __future__ import annotations

# --- fast BLAS: must be loaded before mlx.core is imported anywhere ----------
import ctypes
import os

_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
if os.path.exists(_OPENBLAS):
    ctypes.CDLL(_OPENBLAS, mode=ctypes.RTLD_GLOBAL)
# -----------------------------------------------------------------------------

import argparse
import json
import logging
import math
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

from training import corpus  # noqa: E402

EOS = "<|endoftext|>"
log = logging.getLogger("train_demo")

MODEL_SPECS = {
    "target": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6,
                   num_key_value_heads=6, intermediate_size=1024),
    "draft": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=384),
}

SEPARATORS = ["\n", "\n\n", "\n# again:\n", "\n\n# copy:\n", "\n# ---\n",
              "\n\n\n", "", " ", "\n# same as above\n"]


# ----------------------------------------------------------------- tokenizer
def train_tokenizer(files, vocab_size: int, path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def load_or_train_tokenizer(args, work: Path):
    from tokenizers import Tokenizer

    path = work / f"tokenizer-{args.vocab_size}.json"
    if path.exists() and not args.retrain_tokenizer:
        log.info("loading cached tokenizer %s", path)
        return Tokenizer.from_file(str(path)), path
    # Continuing from (or distilling from) a saved model must keep its exact vocabulary.
    for start in (args.init_target, args.init_draft, args.distill_from):
        if start and (Path(start) / "tokenizer.json").exists() and not args.retrain_tokenizer:
            import shutil

            shutil.copyfile(Path(start) / "tokenizer.json", path)
            log.info("using the tokenizer of %s", start)
            return Tokenizer.from_file(str(path)), path
    t0 = time.time()
    files = corpus.training_files()
    log.info("training byte-level BPE (vocab %d) on %d files", args.vocab_size, len(files))
    tok = train_tokenizer(files, args.vocab_size, path)
    log.info("tokenizer trained in %.1fs -> %s", time.time() - t0, path)
    return tok, path


def encode_files(tok, paths, eos_id: int) -> np.ndarray:
    texts = [corpus.read_text(p) for p in paths]
    encs = tok.encode_batch(texts)
    parts = []
    for e in encs:
        parts.append(np.asarray(e.ids, dtype=np.int32))
        parts.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(parts)


def load_token_streams(args, tok, work: Path):
    eos_id = tok.token_to_id(EOS)
    cache = work / f"tokens-{args.vocab_size}.npz"
    if cache.exists() and not args.retrain_tokenizer:
        d = np.load(cache)
        return d["train"], d["heldout"]
    t0 = time.time()
    train = encode_files(tok, corpus.training_files(), eos_id)
    held = encode_files(tok, corpus.heldout_files(), eos_id)
    np.savez(cache, train=train, heldout=held)
    log.info("tokenized corpus in %.1fs: train %d tokens, held-out %d tokens",
             time.time() - t0, len(train), len(held))
    return train, held


# ---------------------------------------------------------------------- data
class Batcher:
    """Deterministic sampler of plain windows and copy sequences."""

    def __init__(self, stream, seps, vocab_size, eos_id, seq_len, batch_size,
                 copy_frac, random_frac, edit_frac, seed):
        self.stream = stream
        self.seps = seps
        self.V = vocab_size
        self.eos = eos_id
        self.T = seq_len + 1
        self.B = batch_size
        self.copy_frac = copy_frac
        self.random_frac = random_frac
        self.edit_frac = edit_frac
        self.rng = np.random.default_rng(seed)
        self.max_plen = min(128, (self.T - 8) // 2 - 4)
        self.min_plen = min(16, self.max_plen)

    def _window(self, n):
        s = int(self.rng.integers(0, len(self.stream) - n))
        return self.stream[s:s + n]

    def _edit(self, p):
        p = list(p)
        for _ in range(int(self.rng.integers(1, 4))):
            i = int(self.rng.integers(1, max(2, len(p) - 1)))
            r = self.rng.random()
            tokn = int(self.stream[int(self.rng.integers(0, len(self.stream)))])
            if r < 0.5:
                p[i] = tokn
            elif r < 0.75 and len(p) > 4:
                del p[i]
            else:
                p.insert(i, tokn)
        return np.asarray(p, dtype=np.int32)

    def _pair(self):
        """One block: natural lead-in, passage, separator, (edited) passage, continuation."""
        rng = self.rng
        plen = int(rng.integers(self.min_plen, self.max_plen + 1))
        sep = self.seps[int(rng.integers(len(self.seps)))]
        lead = int(rng.integers(0, 65))
        cont = int(rng.integers(0, 33))
        if rng.random() < self.random_frac:
            passage = rng.integers(1, self.V, plen).astype(np.int32)
            parts = [self._window(lead), passage, sep, passage, self._window(cont)]
            ws = [np.ones(lead), np.zeros(plen), np.ones(len(sep) + plen + cont)]
        else:
            s = int(rng.integers(lead + 1, len(self.stream) - plen - cont - 1))
            passage = self.stream[s:s + plen]
            second = self._edit(passage) if rng.random() < self.edit_frac else passage
            parts = [self.stream[s - lead:s], passage, sep, second, self.stream[s + plen:s + plen + cont]]
            ws = [np.ones(lead + plen + len(sep) + len(second) + cont)]
        return np.concatenate(parts), np.concatenate(ws).astype(np.float32)

    def copy_seq(self):
        """A window filled with repeated-passage blocks (dense copy signal)."""
        seqs, ws, n = [], [], 0
        while n < self.T:
            seq, w = self._pair()
            seqs.append(seq)
            ws.append(w)
            n += len(seq)
        return (np.concatenate(seqs)[:self.T].astype(np.int32),
                np.concatenate(ws)[:self.T].astype(np.float32))

    def next(self):
        xs, ws = [], []
        for _ in range(self.B):
            if self.rng.random() < self.copy_frac:
                seq, w = self.copy_seq()
            else:
                seq, w = self._window(self.T), np.ones(self.T, dtype=np.float32)
            xs.append(seq)
            ws.append(w)
        x = np.stack(xs).astype(np.int32)
        w = np.stack(ws)
        return x[:, :-1], x[:, 1:], w[:, 1:]


# --------------------------------------------------------------------- model
def model_config(name: str, vocab_size: int, eos_id: int, max_pos: int = 2048) -> dict:
    spec = MODEL_SPECS[name]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "head_dim": spec["hidden_size"] // spec["num_attention_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "vocab_size": vocab_size,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float16",
    }


def build_model(cfg: dict):
    from mlx_lm.models import llama

    fields = llama.ModelArgs.__dataclass_fields__
    args = llama.ModelArgs(**{k: v for k, v in cfg.items() if k in fields})
    return llama.Model(args)


def count_params(model) -> int:
    from mlx.utils import tree_flatten

    return int(sum(v.size for _, v in tree_flatten(model.parameters())))


def write_tokenizer_files(out: Path, tok_path: Path, max_len: int):
    import shutil

    shutil.copyfile(tok_path, out / "tokenizer.json")
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "unk_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    smap = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")


def save_hf(model, cfg: dict, out: Path, tok_path: Path, train_info: dict | None = None):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    tmp = out / "model.safetensors.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
           "pad_token_id": cfg["pad_token_id"], "do_sample": False,
           "max_length": cfg["max_position_embeddings"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer_files(out, tok_path, cfg["max_position_embeddings"])
    if train_info is not None:
        (out / "train_info.json").write_text(json.dumps(train_info, indent=2) + "\n")


# ---------------------------------------------------------------- evaluation
def copy_batch(vocab_size: int, n: int = 32, half: int = 48, seed: int = 1234):
    rng = np.random.default_rng(seed)
    a = rng.integers(1, vocab_size, (n, half)).astype(np.int32)
    return np.concatenate([a, a], axis=1)


def copy_accuracy(model, vocab_size, n=32, half=48, seed=1234) -> float:
    """Next-token accuracy on the 2nd half of repeated random token sequences."""
    import mlx.core as mx

    x = mx.array(copy_batch(vocab_size, n, half, seed))
    logits = model(x[:, :-1])
    pred = mx.argmax(logits[:, half:, :], axis=-1)  # predicts tokens half+1 .. 2*half-1
    acc = mx.mean((pred == x[:, half + 1:]).astype(mx.float32))
    return float(acc.item())


def heldout_windows(held: np.ndarray, seq_len: int, n: int) -> np.ndarray:
    n = max(1, min(n, (len(held) - 1) // (seq_len + 1)))
    starts = np.linspace(0, len(held) - seq_len - 1, n).astype(np.int64)
    return np.stack([held[s:s + seq_len + 1] for s in starts])


def mean_ce(model, windows: np.ndarray, batch: int = 4) -> float:
    import mlx.core as mx
    import mlx.nn as nn

    tot, cnt = 0.0, 0
    for i in range(0, len(windows), batch):
        w = mx.array(windows[i:i + batch])
        ce = nn.losses.cross_entropy(model(w[:, :-1]), w[:, 1:], reduction="sum")
        tot += float(ce.item())
        cnt += int(w[:, 1:].size)
    return tot / cnt


def load_teacher(path: str):
    """The frozen float32 model a draft is distilled from (an HF dir made by this script)."""
    import mlx.core as mx

    cfg = json.loads((Path(path) / "config.json").read_text())
    teacher = build_model(cfg)
    teacher.load_weights(str(Path(path) / "model.safetensors"))
    teacher.set_dtype(mx.float32)
    teacher.freeze()
    mx.eval(teacher.parameters())
    log.info("distilling from %s", path)
    return teacher


def top1_agreement(model, teacher, windows: np.ndarray, batch: int = 4) -> float:
    """How often the model's argmax equals the teacher's: a draft's greedy acceptance proxy."""
    import mlx.core as mx

    same, cnt = 0, 0
    for i in range(0, len(windows), batch):
        x = mx.array(windows[i:i + batch, :-1])
        same += int((model(x).argmax(-1) == teacher(x).argmax(-1)).sum().item())
        cnt += int(x.size)
    return same / cnt


# ------------------------------------------------------------------ training
def train_model(name, args, tok_path, train, held, eos_id, minutes, lr, out: Path):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    mx.random.seed(args.seed)
    cfg = model_config(name, args.vocab_size, eos_id)
    model = build_model(cfg)
    init_from = getattr(args, f"init_{name}")
    if init_from:
        model.load_weights(str(Path(init_from) / "model.safetensors"))
        log.info("[%s] initialised from %s", name, init_from)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    n_params = count_params(model)
    log.info("[%s] %d parameters (%.2fM), budget %.1f min, lr %.2e, batch %dx%d",
             name, n_params, n_params / 1e6, minutes, lr, args.batch_size, args.seq_len)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    seps = [np.asarray(tok.encode(s).ids, dtype=np.int32) for s in SEPARATORS]
    batcher = Batcher(train, seps, args.vocab_size, eos_id, args.seq_len, args.batch_size,
                      args.copy_frac, args.random_copy_frac, args.edit_frac, args.seed)
    hw = heldout_windows(held, args.seq_len, 8)

    opt = optim.AdamW(learning_rate=lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)

    teacher = load_teacher(args.distill_from) if name == "draft" and args.distill_from else None

    def loss_fn(m, x, y, w, soft):
        logits = m(x)
        if soft is None:
            ce = nn.losses.cross_entropy(logits, y)
        else:
            # Distillation: cross-entropy against the teacher's next-token distribution,
            # which is what raises the draft's agreement with the target (its acceptance).
            ce = -(soft * nn.log_softmax(logits, axis=-1)).sum(axis=-1)
        return (ce * w).sum() / w.sum()

    vg = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step(x, y, w):
        soft = None if teacher is None else mx.softmax(teacher(x), axis=-1)
        loss, grads = vg(model, x, y, w, soft)
        grads, gnorm = optim.clip_grad_norm(grads, args.grad_clip)
        opt.update(model, grads)
        return loss, gnorm

    if not args.no_compile:
        step = partial(mx.compile, inputs=state, outputs=state)(step)

    budget_s = minutes * 60.0
    max_steps = args.max_steps
    planned = max_steps  # schedule length; re-estimated from the budget while running
    warmup = args.warmup
    final_frac = 0.1

    def lr_at(it):
        if it < warmup:
            return lr * (it + 1) / warmup
        prog = min(1.0, (it - warmup) / max(1, planned - warmup))
        return lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

    t_start = time.time()
    tokens_per_step = args.batch_size * args.seq_len
    tokens_seen = 0
    losses = []
    history = []
    last_save = time.time()
    it = 0
    t_after_first = None
    stop_reason = "max_steps"
    while it < max_steps:
        elapsed = time.time() - t_start
        if elapsed >= budget_s:
            stop_reason = "time_budget"
            break
        x, y, w = batcher.next()
        opt.learning_rate = lr_at(it)
        loss, gnorm = step(mx.array(x), mx.array(y), mx.array(w))
        mx.eval(state, loss, gnorm)
        losses.append(float(loss.item()))
        tokens_seen += tokens_per_step
        it += 1
        if it == 1:
            t_after_first = time.time()
        # size the schedule from the budget (frozen once 80% through it)
        if t_after_first is not None and it >= 10 and it % 10 == 0:
            el = time.time() - t_start
            if el < 0.8 * budget_s:
                per = (time.time() - t_after_first) / (it - 1)
                est = it + int((budget_s - el) / per)
                planned = max(warmup + 1, min(max_steps, est))
        if it % args.log_every == 0 or it == 1:
            el = time.time() - t_start
            per = (time.time() - t_after_first) / max(1, it - 1) if it > 1 else el
            rem = min(max(0, planned - it) * per, max(0, budget_s - el))
            recent = float(np.mean(losses[-args.log_every:]))
            log.info("[%s] step %d/%d loss %.4f lr %.2e gnorm %.2f tok/s %.0f "
                     "elapsed %.1fm ETA %.1fm", name, it, planned, recent, lr_at(it - 1),
                     float(gnorm.item()), tokens_per_step / per if it > 1 else 0,
                     el / 60, rem / 60)
        if it % args.eval_every == 0:
            ca = copy_accuracy(model, args.vocab_size)
            hl = mean_ce(model, hw)
            entry = {"step": it, "train_loss": float(np.mean(losses[-args.eval_every:])),
                     "heldout_loss": hl, "copy_acc": ca,
                     "elapsed_min": (time.time() - t_start) / 60}
            if teacher is not None:
                entry["teacher_agreement"] = top1_agreement(model, teacher, hw)
            history.append(entry)
            log.info("[%s] eval step %d: copy_acc %.3f heldout_loss %.4f%s", name, it, ca, hl,
                     f" teacher top-1 agreement {entry['teacher_agreement']:.3f}"
                     if teacher is not None else "")
        if time.time() - last_save > args.save_every_min * 60:
            save_hf(model, cfg, out, tok_path)
            last_save = time.time()
            log.info("[%s] checkpoint saved to %s", name, out)
    wall = time.time() - t_start
    ca = copy_accuracy(model, args.vocab_size)
    hl = mean_ce(model, hw)
    history.append({"step": it, "train_loss": float(np.mean(losses[-args.eval_every:])) if losses else None,
                    "heldout_loss": hl, "copy_acc": ca, "elapsed_min": wall / 60})
    if teacher is not None:
        history[-1]["teacher_agreement"] = top1_agreement(model, teacher, hw)
        log.info("[%s] teacher top-1 agreement on held-out text %.3f", name,
                 history[-1]["teacher_agreement"])
    info = {
        "model": name, "parameters": n_params, "steps": it, "planned_steps": planned,
        "stop_reason": stop_reason, "tokens_seen": tokens_seen, "train_wall_s": round(wall, 1),
        "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": lr, "warmup": warmup,
        "weight_decay": args.weight_decay, "grad_clip": args.grad_clip, "seed": args.seed,
        "copy_frac": args.copy_frac, "random_copy_frac": args.random_copy_frac,
        "edit_frac": args.edit_frac, "compiled": not args.no_compile,
        "final_train_loss": float(np.mean(losses[-args.log_every:])) if losses else None,
        "history": history,
        "init_from": init_from, "prior_steps": args.prior_steps if init_from else 0,
        "distilled_from": args.distill_from if teacher is not None else None,
        "prior_tokens": args.prior_steps * tokens_per_step if init_from else 0,
    }
    save_hf(model, cfg, out, tok_path, info)
    log.info("[%s] done: %d steps, %d tokens, %.1f min, copy_acc %.3f, heldout %.4f -> %s",
             name, it, tokens_seen, wall / 60, ca, hl, out)
    return info


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models")
    p.add_argument("--only", choices=["target", "draft", "tokenizer", "all"], default="all")
    p.add_argument("--target-minutes", type=float, default=85.0)
    p.add_argument("--draft-minutes", type=float, default=11.0)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--target-lr", type=float, default=1.5e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--copy-frac", type=float, default=0.75,
                   help="fraction of training windows filled with repeated passages")
    p.add_argument("--random-copy-frac", type=float, default=0.5,
                   help="fraction of copy sequences whose passage is random tokens")
    p.add_argument("--edit-frac", type=float, default=0.3,
                   help="fraction of (natural) copy sequences whose second copy is edited")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every-min", type=float, default=10.0)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--init-target", default=None, help="start the target from this HF model dir")
    p.add_argument("--init-draft", default=None, help="start the draft from this HF model dir")
    p.add_argument("--distill-from", default=None,
                   help="train the draft on this model's next-token distributions (distillation)")
    p.add_argument("--prior-steps", type=int, default=0,
                   help="steps already trained by the --init-* checkpoint (recorded only)")
    p.add_argument("--retrain-tokenizer", action="store_true")
    p.add_argument("--no-eval", action="store_true", help="skip the final evaluation/model cards")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    work = out / "logs"
    work.mkdir(parents=True, exist_ok=True)
    gi = out / ".gitignore"
    if not gi.exists():
        gi.write_text("logs/\n")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout), logging.FileHandler(work / "train.log")],
    )
    log.info("args: %s", vars(args))
    np.random.seed(args.seed)
    tok, tok_path = load_or_train_tokenizer(args, work)
    train, held = load_token_streams(args, tok, work)
    eos_id = tok.token_to_id(EOS)
    log.info("train tokens %d, held-out tokens %d, eos id %d", len(train), len(held), eos_id)
    if args.only == "tokenizer":
        return
    infos = {}
    todo = ["target", "draft"] if args.only == "all" else [args.only]
    for name in todo:
        minutes = args.target_minutes if name == "target" else args.draft_minutes
        lr = args.target_lr if name == "target" else args.draft_lr
        infos[name] = train_model(name, args, tok_path, train, held, eos_id, minutes, lr,
                                  out / f"pystd-{name}")
    if not args.no_eval:
        import eval_demo_models

        eval_demo_models.main(["--out", str(out)] + (["--only", args.only] if args.only != "all" else []))


if __name__ == "__main__":
    main()
