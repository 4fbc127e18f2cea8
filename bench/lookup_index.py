"""Measure the prompt-lookup index: build time and per-round cost at a given
history length (default 32k tokens of Python source from the stdlib).

    .venv/bin/python -m bench.lookup_index [--tokens 32768]
"""

from __future__ import annotations

from mlx_engine.drafters.prompt_lookup import PromptLookupDrafter

import argparse
import random
import sysconfig
import time
from pathlib import Path


def stdlib_tokens(n: int) -> list[int]:
    """A stand-in token stream: whitespace-split words of stdlib source mapped to ids."""
    vocab: dict[str, int] = {}
    out: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for word in path.read_text(errors="ignore").split():
            out.append(vocab.setdefault(word, len(vocab)))
            if len(out) >= n:
                return out
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    history = stdlib_tokens(args.tokens)
    drafter = PromptLookupDrafter(num_tokens=8)
    t0 = time.perf_counter()
    drafter.propose(history, 8)
    build = time.perf_counter() - t0
    rng = random.Random(0)
    t0 = time.perf_counter()
    hits = 0
    for _ in range(args.rounds):
        history.append(rng.choice(history[-200:]))  # one new token per round, as in decoding
        hits += bool(drafter.propose(history, 8))
    per_round = (time.perf_counter() - t0) / args.rounds
    print(
        f"history {len(history)} tokens: index build {build * 1e3:.1f} ms, "
        f"per round (append 1 token + lookup) {per_round * 1e6:.1f} us, drafts found in {hits / args.rounds:.0%} of rounds"
    )


if __name__ == "__main__":
    main()
