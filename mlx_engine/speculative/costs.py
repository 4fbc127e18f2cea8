"""Measured costs of forward passes, used to pick draft lengths and modes.

Speculation pays when (expected tokens per round) / (cost of a round) beats one
token per single-token step. Both sides depend on the machine, the model and the
dtype (on MLX's CPU backend a 9-token verify can cost several single steps), so
they are measured once per model and cached on the kit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

logger = logging.getLogger(__name__)

MAX_DRAFT = 16
_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 17)


@dataclass(frozen=True)
class CostModel:
    """Seconds per forward pass of n tokens (n = 1..MAX_DRAFT+1) at short context."""

    seconds: tuple[float, ...]  # index n-1

    def step(self) -> float:
        return self.seconds[0]

    def relative(self, n: int) -> float:
        """Cost of an n-token pass in single-step units."""
        n = max(1, min(n, len(self.seconds)))
        return self.seconds[n - 1] / self.seconds[0]

    def summary(self) -> str:
        return ", ".join(f"v{n}={self.relative(n):.2f}" for n in (2, 4, 8, 16))


def measure(model: nn.Module, vocab_size: int, context: int = 128, repeats: int = 5) -> CostModel:
    """Time forward passes of several widths on a scratch cache."""
    cache = make_prompt_cache(model)
    rng = mx.random.randint(0, vocab_size, (context + 32,), key=mx.random.key(0))
    mx.eval(model(rng[:context][None], cache=cache))
    timings: dict[int, float] = {}
    for n in _SIZES:
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model(rng[context : context + n][None], cache=cache)
            mx.eval(out[:, -1])
            samples.append(time.perf_counter() - t0)
            for c in cache:
                c.trim(n)
        samples.sort()
        timings[n] = samples[len(samples) // 2]
    # Interpolate the sizes not measured.
    known = sorted(timings)
    seconds = []
    for n in range(1, MAX_DRAFT + 2):
        lo = max(k for k in known if k <= n)
        hi = min(k for k in known if k >= n)
        if lo == hi:
            seconds.append(timings[lo])
        else:
            w = (n - lo) / (hi - lo)
            seconds.append(timings[lo] * (1 - w) + timings[hi] * w)
    # Cost is non-decreasing in width; timing noise should not say otherwise.
    for i in range(1, len(seconds)):
        seconds[i] = max(seconds[i], seconds[i - 1])
    cm = CostModel(tuple(seconds))
    logger.info("measured forward costs: step=%.2f ms, %s", cm.step() * 1e3, cm.summary())
    return cm


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per verify round with k drafts accepted independently with
    probability alpha (accepted prefix plus the target's own token)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def best_draft_length(alpha: float, verify: CostModel, draft_step: float = 0.0, max_k: int = MAX_DRAFT) -> tuple[int, float]:
    """The draft length with the best expected speed-up over plain decoding, and
    that speed-up. ``draft_step`` is a draft token's cost in main-model steps."""
    best_k, best = 0, 1.0
    for k in range(1, max_k + 1):
        speedup = expected_tokens(alpha, k) / (verify.relative(k + 1) + k * draft_step)
        if speedup > best:
            best_k, best = k, speedup
    return best_k, best
