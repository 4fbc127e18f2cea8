"""Evaluate an EAGLE-3 head for SmolLM2-135M-Instruct:
``python -m training.eval_smollm2_eagle3 --head models/smollm2-135m-eagle3``.

- **Agreement by draft position** on held-out sequences of
  ``../shared/data/smollm2-answers`` (sequence ``i % 10 == 0``, never
  extracted for training): from every answer position, the head drafts a chain
  of ``--depth`` tokens from the target's hidden states there, feeding itself its
  own outputs; position ``j`` counts as accepted when drafts ``1..j`` all equal
  the target's greedy tokens (what greedy speculation keeps). Computed with the
  training-time-test forward, which is the chain exactly while it is right.
- **Equality with mlx-vlm**: the saved head loaded as mlx-vlm's
  ``Eagle3DraftModel`` (its cache, ``prefill_from_target_hidden`` and
  ``draft_block``) proposes the same tokens as this repository's training code
  running the chain free (its own drafts as inputs), from several origins.
- **Step cost**: one head step (mlx-vlm's ``draft_block``) against one target
  decode step, float32 on this CPU, medians of interleaved runs.

Writes ``eval.json`` beside the head (or ``--out``)."""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from .eagle3_recipe import DATA, accepted_chains, agreement_summary, held_out_indices, load_sequences  # noqa: E402
from .extract_smollm2_hidden import aux_hidden  # noqa: E402
from .train_smollm2_eagle3 import load_head, ttt_forward  # noqa: E402

logger = logging.getLogger("eval_smollm2_eagle3")
TARGET = "smollm2-135m-instruct"


def draft_ids_at(head, draft_ids: np.ndarray, h: mx.array) -> np.ndarray:
    """Target ids of the head's greedy choice for outputs ``h`` (before ``norm``)."""
    return draft_ids[np.array(mx.argmax(head.lm_head(head.norm(h)), axis=-1))]


def chain_agreement(head, draft_ids, aux: mx.array, ids: np.ndarray, prompt_len: int, depth: int) -> np.ndarray:
    """(origins, depth) booleans: draft ``j`` of the chain from each answer origin
    equals the target's token, drafts before it all right (teacher-forced chain)."""
    outs = ttt_forward(head, aux[None], mx.array(ids)[None], depth)
    return accepted_chains([draft_ids_at(head, draft_ids, h[0]) for h in outs], ids, prompt_len)


def free_chain(head, draft_ids, aux: mx.array, ids: np.ndarray, origin: int, depth: int) -> list[int]:
    """The training code's chain from entry ``origin`` run free: each draft is
    fed back as the next token, as a drafter does."""
    toks, out = [int(t) for t in ids[: origin + 2]], []
    for k in range(depth):
        a = mx.concatenate([aux[: len(toks)], mx.zeros((max(0, len(toks) - aux.shape[0]), aux.shape[1]))])
        h = ttt_forward(head, a[None], mx.array(toks)[None], k + 1)[k][0, origin + k]
        out.append(int(draft_ids_at(head, draft_ids, h[None])[0]))
        toks.append(out[-1])
    return out


def mlx_vlm_chain(head, kit, aux: mx.array, ids: np.ndarray, origin: int, depth: int) -> list[int]:
    """mlx-vlm's drafter on the same head: prefill on positions 0..origin, then one block."""
    head.reset(kit.model)
    prefix = mx.array(ids[: origin + 1])[None]
    head.prefill_from_target_hidden(prefix, aux[None, : origin + 1], int(ids[origin + 1]), None, mx.int32, True)
    block = head.draft_block(
        int(ids[origin + 1]), aux[None, origin : origin + 1], None, depth + 1, None, mx.int32, True
    )
    return [int(t) for t in np.array(block)[0]]


def step_costs(kit, head, aux: mx.array, ids: np.ndarray, rounds: int = 5, n: int = 20) -> dict:
    """Median ms of a target decode step and of a head step after a 128-token context."""
    ctx = 128
    t_ms, h_ms = [], []
    for _ in range(rounds):
        cache = make_prompt_cache(kit.model)
        mx.eval(kit.model(mx.array(ids[:ctx])[None], cache=cache))
        tok = mx.array([[int(ids[ctx])]])
        for _ in range(n):
            t = time.perf_counter()
            tok = mx.argmax(kit.model(tok, cache=cache)[:, -1], axis=-1)[None]
            mx.eval(tok)
            t_ms.append((time.perf_counter() - t) * 1000)
        for _ in range(n // 4):
            head.reset(kit.model)
            head.prefill_from_target_hidden(
                mx.array(ids[:ctx])[None], aux[None, :ctx], int(ids[ctx]), None, mx.int32, True
            )
            mx.eval(head.draft_block(int(ids[ctx]), aux[None, ctx - 1 : ctx], None, 2, None, mx.int32, True))
            t = time.perf_counter()
            mx.eval(head.draft_block(int(ids[ctx]), aux[None, ctx - 1 : ctx], None, 5, None, mx.int32, True))
            h_ms.append((time.perf_counter() - t) * 1000 / 4)  # the seed went to the first block: 4 steps
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"target_step_ms": med(t_ms), "head_step_ms": med(h_ms), "head_over_target": med(h_ms) / med(t_ms)}


def evaluate(args: argparse.Namespace) -> dict:
    """Agreement by position, equality with mlx-vlm and step cost; writes eval.json."""
    kit = me.load_model(TARGET)
    head, draft_ids = load_head(args.head, kit)
    seqs, lens = load_sequences(args.data)
    held = held_out_indices(len(seqs), args.sequences)
    tables, same, tried, first = [], 0, 0, None
    for n, i in enumerate(held):
        ids = seqs[i]
        aux = aux_hidden(kit.model, mx.array(ids)[None])[0].astype(mx.float16).astype(mx.float32)
        mx.eval(aux)
        first = first or (aux, ids)
        tables.append(chain_agreement(head, draft_ids, aux, ids, int(lens[i, 0]), args.depth))
        checks = args.checks if n < args.check_sequences else 0
        for origin in range(int(lens[i, 0]), len(ids) - args.depth - 2, 97)[:checks]:
            tried += 1
            same += free_chain(head, draft_ids, aux, ids, origin, args.depth) == mlx_vlm_chain(
                head, kit, aux, ids, origin, args.depth
            )
    out = {
        "head": str(args.head),
        "held_out_sequences": len(held),
        **agreement_summary(tables),
        "mlx_vlm_equal_chains": f"{same}/{tried}",
        "step_cost": step_costs(kit, head, *first),
    }
    logger.info("eval: %s", json.dumps(out))
    dest = Path(args.out or args.head) / "eval.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.eval_smollm2_eagle3", description=__doc__.split("\n\n")[0])
    p.add_argument("--head", type=Path, default=Path("models/smollm2-135m-eagle3"))
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--out", type=Path, default=None, help="folder for eval.json (default: the head's)")
    p.add_argument("--sequences", type=int, default=16, help="held-out sequences scored")
    p.add_argument("--depth", type=int, default=5, help="chain length scored")
    p.add_argument("--checks", type=int, default=2, help="origins per sequence compared with mlx-vlm")
    p.add_argument("--check-sequences", type=int, default=6, help="sequences whose chains are compared with mlx-vlm")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    evaluate(parse(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
