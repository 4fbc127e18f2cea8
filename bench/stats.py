"""Paired comparisons of two systems measured in the same interleaved rounds.

Within a round the systems run back to back on the same workload, so load on
the machine hits them alike; the ratio of their tok/s in one round is therefore
far less noisy than a ratio of medians taken over rounds. The comparison is the
geometric mean of those per-round ratios, with a bootstrap confidence interval
over rounds, and a verdict that only says "ahead" or "behind" when the whole
interval is on one side of 1.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import NamedTuple

#: Fewer paired rounds than this give no interval (the bootstrap of 1-2 values is meaningless).
MIN_ROUNDS = 3


class PairedRatio(NamedTuple):
    ratio: float  # geometric mean of the per-round ratios a / b
    low: float | None  # 95% bootstrap interval, None with fewer than MIN_ROUNDS rounds
    high: float | None
    rounds: int

    @property
    def verdict(self) -> str:
        """'ahead' / 'behind' when the interval excludes 1, else 'level' ('?' without one)."""
        if self.low is None or self.high is None:
            return "?"
        if self.low > 1.0:
            return "ahead"
        if self.high < 1.0:
            return "behind"
        return "level"


def paired_ratio(a: list[float], b: list[float], resamples: int = 4000, seed: int = 0) -> PairedRatio:
    """Compare rates ``a[i]`` and ``b[i]`` measured in the same round ``i``."""
    if len(a) != len(b):
        raise ValueError(f"paired_ratio needs one value per round from each system, got {len(a)} and {len(b)}")
    logs = [math.log(x / y) for x, y in zip(a, b) if x > 0 and y > 0]
    if not logs:
        return PairedRatio(float("nan"), None, None, 0)
    mean = sum(logs) / len(logs)
    if len(logs) < MIN_ROUNDS:
        return PairedRatio(math.exp(mean), None, None, len(logs))
    rng = random.Random(seed)  # seeded: the same runs always give the same report
    n = len(logs)
    means = sorted(sum(rng.choice(logs) for _ in range(n)) / n for _ in range(resamples))
    low, high = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return PairedRatio(math.exp(mean), math.exp(low), math.exp(high), n)


def median(xs: list[float]) -> float:
    """The median of the values that are not NaN (NaN when none are)."""
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def geomean(xs: list[float]) -> float:
    """The geometric mean of the positive values (NaN when none are)."""
    xs = [x for x in xs if x > 0 and not math.isnan(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def format_paired(ratio: float, low: float | None, high: float | None) -> str:
    """``1.23 (1.10-1.35)``, or just the ratio without an interval."""
    return f"{ratio:.2f}" + (f" ({low:.2f}-{high:.2f})" if low is not None and high is not None else "")


def bench_args(prog: str, description: str, reps: int, max_tokens: int, argv: list[str] | None, extra=None):
    """The options every focused benchmark script takes (``extra(parser)`` adds a script's own)."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--reps", type=int, default=reps, help="measured rounds")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    if extra is not None:
        extra(p)
    return p.parse_args(argv)


def write_report(lines: list[str], out_dir, name: str) -> int:
    """Write a focused benchmark's markdown to ``out_dir/name``, print it, return 0."""
    text = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / name).write_text(text)
    print(text)
    return 0
