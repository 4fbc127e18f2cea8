"""Run SmolLM2-135M-Instruct over its own answers once and keep the hidden states
an EAGLE-3 head reads: ``python -m training.extract_smollm2_hidden``.

Input: ``../shared/data/smollm2-answers/answers.npz`` (the target's greedy
answers to 5,318 prompts; see its README). The target is the engine's
(``load_model("smollm2-135m-instruct")``, float32 on this CPU); each sequence
(prompt then answer) goes through its decoder layers once, teacher-forced, and
the outputs of the layers named by the head's aux ids are kept in float16:
aux id ``i`` is the output of decoder layer ``i-1`` (Hugging Face's
``hidden_states[i]``, mlx-vlm's ``capture_layer_ids``), the default ``[2, 15, 27]``
of the target's 30 layers. Layers above the highest aux id and the output layer
are not run (their result is not needed: the answers *are* the target's greedy
tokens).

Sequences go in a fixed shuffled order, so a run cut short by ``--minutes`` is a
random sample; every ``--shard`` sequences are written as
``<out>/shard-NNNNN.npz`` (``hidden`` (T, 3, hidden) float16, ``ids`` (T,),
``lens`` (n, 2) prompt/answer lengths, ``index`` (n,) sequence numbers). A rerun
skips the sequences already written. Sequence ``i`` with ``i % HOLDOUT_EVERY == 0`` (training/eagle3_recipe.py)
is never extracted: it is the held-out set of ``training/eval_smollm2_eagle3.py``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.base import create_attention_mask  # noqa: E402

from .eagle3_recipe import AUX_LAYER_IDS, DATA, is_held_out, load_sequences  # noqa: E402

logger = logging.getLogger("extract_smollm2_hidden")
TARGET = "smollm2-135m-instruct"


def aux_hidden(model, tokens: mx.array, aux_ids: tuple[int, ...] = AUX_LAYER_IDS) -> mx.array:
    """The outputs of decoder layers ``aux - 1`` for a (B, L) batch, concatenated
    on the last axis in ``aux_ids`` order: (B, L, len(aux_ids) * hidden)."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    mask = create_attention_mask(h, None)
    capture, out = {i - 1 for i in aux_ids}, {}
    for i, layer in enumerate(inner.layers[: max(aux_ids)]):
        h = layer(h, mask, None)
        if i in capture:
            out[i] = h
    return mx.concatenate([out[i - 1] for i in aux_ids], axis=-1)


def extract(args: argparse.Namespace) -> None:
    """Write shards of aux hidden states until every training sequence is done or time is up."""
    args.out.mkdir(parents=True, exist_ok=True)
    seqs, lens = load_sequences(args.data)
    done = {int(i) for f in args.out.glob("shard-*.npz") for i in np.load(f)["index"]}
    order = np.random.default_rng(args.seed).permutation(len(seqs))
    todo = [int(i) for i in order if not is_held_out(int(i)) and int(i) not in done]
    kit = me.load_model(TARGET)
    logger.info("extract: %d sequences to run (%d done)", len(todo), len(done))
    start, tokens, shard = time.time(), 0, []
    n_shard = len(list(args.out.glob("shard-*.npz")))
    for i in todo:
        if time.time() - start > args.minutes * 60:
            break
        h = aux_hidden(kit.model, mx.array(seqs[i])[None])[0].astype(mx.float16)
        mx.eval(h)
        shard.append((i, np.array(h)))
        tokens += len(seqs[i])
        if len(shard) == args.shard:
            _write(args.out / f"shard-{n_shard:05d}.npz", shard, seqs, lens)
            n_shard, shard = n_shard + 1, []
            el = time.time() - start
            logger.info("extract: %d shards, %d tokens this run, %.0f tok/s", n_shard, tokens, tokens / el)
    if shard:
        _write(args.out / f"shard-{n_shard:05d}.npz", shard, seqs, lens)
    logger.info("extract: done, %d tokens in %.1f min", tokens, (time.time() - start) / 60)


def _write(path: Path, shard: list, seqs: list[np.ndarray], lens: np.ndarray) -> None:
    idx = np.array([i for i, _ in shard], dtype=np.int64)
    np.savez(
        path,
        hidden=np.concatenate([h for _, h in shard]),
        ids=np.concatenate([seqs[i] for i in idx]),
        lens=lens[idx],
        index=idx,
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.extract_smollm2_hidden", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DATA, help="answers.npz")
    p.add_argument("--out", type=Path, default=Path(".cache/smollm2-eagle3/hidden"))
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--shard", type=int, default=16, help="sequences per shard file")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    extract(parse(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
