"""The framework-free half of the default model's EAGLE-3 recipe, shared by the
MLX scripts (``train_smollm2_eagle3``, ``eval_smollm2_eagle3``,
``extract_smollm2_hidden``) and the PyTorch path (``torch_eagle3``): the data
and its held-out split, the reduced draft vocabulary and its maps, the head's
config, a batch's layout (which entries are scored against which tokens), the
learning-rate schedule and acceptance-by-position counting. numpy only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# ../shared beside the main checkout; a worktree under wt/ finds it one level further up
DATA = (
    next((p for p in (REPO.parent / "shared", REPO.parent.parent / "shared") if p.is_dir()), REPO.parent / "shared")
    / "data"
    / "smollm2-answers"
    / "answers.npz"
)
AUX_LAYER_IDS = (2, 15, 27)  # EAGLE-3's default [2, n // 2, n - 3] for n = 30
HOLDOUT_EVERY = 10  # sequence i with i % 10 == 0 is held out for evaluation


# -- data and split -------------------------------------------------------------
def load_sequences(path: Path) -> tuple[list[np.ndarray], np.ndarray]:
    """Every sequence's token ids (prompt then answer) and the (n, 2) prompt/answer lengths."""
    if not Path(path).is_file():
        raise ValueError(f"data: {path} is not a file (expected answers.npz of ../shared/data/smollm2-answers)")
    d = np.load(path)
    ids, lens = d["ids"].astype(np.int32), d["lens"].astype(np.int64)
    off = np.concatenate([[0], np.cumsum(lens.sum(1))])
    return [ids[off[i] : off[i + 1]] for i in range(len(lens))], lens


def is_held_out(i: int) -> bool:
    """Whether sequence ``i`` belongs to the held-out set (never trained on)."""
    return i % HOLDOUT_EVERY == 0


def training_indices(n: int) -> list[int]:
    """The training split of ``n`` sequences, in order."""
    return [i for i in range(n) if not is_held_out(i)]


def held_out_indices(n: int, count: int | None = None) -> list[int]:
    """The first ``count`` held-out sequences of ``n`` (all when None)."""
    return [i for i in range(n) if is_held_out(i)][:count]


# -- draft vocabulary -----------------------------------------------------------
def _answer_counts(seqs: list[np.ndarray], lens: np.ndarray, vocab: int) -> np.ndarray:
    answers = [seqs[i][lens[i, 0] :] for i in training_indices(len(seqs))]
    return np.bincount(np.concatenate(answers).astype(np.int64), minlength=vocab)


def draft_vocabulary(seqs: list[np.ndarray], lens: np.ndarray, n: int, vocab: int) -> np.ndarray:
    """The ``n`` most frequent answer tokens of the training sequences (never the
    held-out ones), ascending: draft id ``i`` is target id ``ids[i]``."""
    counts = _answer_counts(seqs, lens, vocab)
    return np.sort(np.argsort(-counts, kind="stable")[:n])


def target_to_draft(draft_ids: np.ndarray, vocab: int) -> np.ndarray:
    """(vocab,) int64: each target id's draft id, -1 outside the draft vocabulary."""
    t2d = np.full(vocab, -1, dtype=np.int64)
    t2d[draft_ids] = np.arange(len(draft_ids))
    return t2d


def d2t_offsets(draft_ids: np.ndarray) -> np.ndarray:
    """The stored ``d2t``: target id = draft id + d2t[draft id] (int64)."""
    return (np.asarray(draft_ids) - np.arange(len(draft_ids))).astype(np.int64)


def frequent_drafts(seqs: list[np.ndarray], lens: np.ndarray, draft_ids: np.ndarray, vocab: int, n: int) -> np.ndarray:
    """Draft ids of the ``n`` most frequent training answer tokens, ascending
    (the output rows every training step scores)."""
    counts = _answer_counts(seqs, lens, vocab)
    return np.sort(np.argsort(-counts[draft_ids], kind="stable")[:n])


# -- the head's config ----------------------------------------------------------
def head_config(draft_vocab: int, args: dict, aux_ids: tuple[int, ...] = AUX_LAYER_IDS) -> dict:
    """The speculators-form config of a head for a llama target with ``args``
    (mlx-lm's ModelArgs as a dict): one decoder layer of the target's shape."""
    return {
        "architectures": ["Eagle3Speculator"],
        "model_type": "eagle3",
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {
            "model_type": "llama",
            "hidden_size": args["hidden_size"],
            "intermediate_size": args["intermediate_size"],
            "num_hidden_layers": 1,
            "num_attention_heads": args["num_attention_heads"],
            "num_key_value_heads": args["num_key_value_heads"],
            "head_dim": args["hidden_size"] // args["num_attention_heads"],
            "rms_norm_eps": args["rms_norm_eps"],
            "vocab_size": args["vocab_size"],
            "max_position_embeddings": args["max_position_embeddings"],
            "rope_theta": args["rope_theta"],
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
        },
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": args["hidden_size"],
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(aux_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
            "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"]},
        },
    }


# -- batch layout ---------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Which entries of a padded batch are scored, against what.

    ``tokens`` (B, L) int32 (each row the last ``lengths[i]`` ids of its
    sequence, from ``starts[i]``, then zeros); ``idx`` flat indices into the
    (B, L - 1) entries; ``cand`` candidate draft ids; ``target`` each scored
    entry's place in ``cand``; ``mask`` (depths, len(idx)) float32."""

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    idx: np.ndarray
    cand: np.ndarray
    target: np.ndarray
    mask: np.ndarray


def batch_layout(
    seqs: list[np.ndarray], prompts: list[int], t2d: np.ndarray, frequent: np.ndarray, max_len: int, depths: int
) -> Layout:
    """The layout of a batch of ``seqs`` (with their prompt lengths): entry ``q``
    predicts token ``q + 2``, scored when that is an answer token in the draft
    vocabulary; a sequence longer than ``max_len`` keeps its end (the answer).
    Depth ``k`` needs its chain origin ``q - k`` inside the row."""
    length = min(max_len, max(len(s) for s in seqs))
    b = len(seqs)
    tok = np.zeros((b, length), dtype=np.int32)
    tgt = np.zeros((b, length - 1), dtype=np.int64)
    ok = np.zeros((b, length - 1), dtype=bool)
    starts, lengths = np.zeros(b, dtype=np.int64), np.zeros(b, dtype=np.int64)
    for i, (ids, prompt) in enumerate(zip(seqs, prompts)):
        start = max(0, len(ids) - length)
        ids, n = ids[start:], len(ids) - start
        tok[i, :n], starts[i], lengths[i] = ids, start, n
        pos = np.arange(2, n)  # predicted token positions, entries 0 .. n - 3
        d = t2d[ids[pos]]
        tgt[i, : n - 2] = d
        ok[i, : n - 2] = (d >= 0) & (pos + start >= prompt)
    idx = np.nonzero(ok.reshape(-1))[0]
    y = tgt.reshape(-1)[idx]
    cand = np.unique(np.concatenate([frequent, y]))
    q = idx % (length - 1)
    mask = np.stack([(q >= k) for k in range(depths)]).astype(np.float32)
    return Layout(tok, starts, lengths, idx, cand, np.searchsorted(cand, y), mask)


def lr_at(lr: float, warmup: int, step: int, done: float) -> float:
    """Warm-up over ``warmup`` steps, then a cosine to 10% of ``lr`` as ``done`` goes 0 -> 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


# -- acceptance by draft position -----------------------------------------------
def accepted_chains(predicted: list[np.ndarray], ids: np.ndarray, prompt_len: int) -> np.ndarray:
    """(origins, depth) booleans from the training-time-test predictions:
    ``predicted[k][q]`` is the target id the head drafts at depth ``k`` from
    entry ``q``; the chain from origin ``c`` drafts ``predicted[j][c + j]`` for
    the token at ``c + j + 2``. Position ``j`` counts when drafts ``0..j`` all
    equal the target's tokens (what greedy speculation keeps); origins start where
    the first draft is an answer token and keep only whole chains."""
    depth, n = len(predicted), len(ids) - 1
    right = [np.asarray(p)[: n - 1] == ids[2:] for p in predicted]
    origins = np.arange(max(prompt_len - 2, 0), n - 1)
    table = np.zeros((len(origins), depth), dtype=bool)
    for j in range(depth):
        q = origins + j
        ok = q < n - 1
        table[ok, j] = right[j][q[ok]]
    keep = origins + depth + 1 < len(ids)  # the whole chain has targets to compare with
    return np.cumprod(table[keep], axis=1).astype(bool)


def agreement_summary(tables: list[np.ndarray]) -> dict:
    """Accepted-by-position rates, conditional rates and the mean accepted chain
    length over the chains of every table."""
    table = np.concatenate(tables)
    acc = table.mean(axis=0)
    return {
        "chain_origins": int(len(table)),
        "accepted_by_position": [round(float(a), 4) for a in acc],
        "conditional_by_position": [round(float(acc[0]), 4)]
        + [round(float(acc[j] / max(acc[j - 1], 1e-9)), 4) for j in range(1, len(acc))],
        "mean_accepted_of_depth": round(float(table.sum(axis=1).mean()), 3),
    }


def add_training_flags(p) -> None:
    """The training flags both trainers (MLX and PyTorch) take, with the same defaults."""
    p.add_argument("--draft-vocab", type=int, default=16384)
    p.add_argument("--candidates", type=int, default=4096, help="most frequent draft tokens scored every step")
    p.add_argument("--depths", type=int, default=3, help="training-time test depths (chain steps trained)")
    p.add_argument("--depth-decay", type=float, default=0.8)
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--save-minutes", type=float, default=5.0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
