"""The statistics a forward-cost fit is made of (costs.py fits its widths with
them; cost_book.py refits from timed rounds): medians, the samples' spread and
whether they are credible, a spike taken out, a monotone (isotonic) fit, a
robust slope, and linear interpolation between measured widths.
"""

from __future__ import annotations

import math

#: A measurement is credible when, over its widths, the middle half of the
#: samples spans at most this share of their median (``spread``) and the
#: monotone fit moved no width's median by more than ``MAX_SHAPE_FIX``; else its
#: widths are timed again (up to ``attempts`` rounds in all).
CREDIBLE_SPREAD = 0.15
MAX_SHAPE_FIX = 0.25


def median(xs: list[float]) -> float:
    """The median of ``xs`` (the mean of the middle two for an even count)."""
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def spread(samples: dict[int, list[float]]) -> float:
    """The typical relative spread of the widths' samples: over widths, the
    median of (upper quartile - lower quartile) / median. One stalled sample of
    five does not widen it; a machine whose load came and went does."""
    rel = []
    for xs in samples.values():
        if xs:
            xs, m = sorted(xs), median(xs)
            rel.append((xs[(3 * len(xs) - 1) // 4] - xs[len(xs) // 4]) / m if m > 0 else 0.0)
    return median(rel) if rel else 0.0


def credible(samples: dict[int, list[float]]) -> bool:
    """Whether the samples make a trustworthy measurement: a narrow spread and
    medians that need little fixing to be monotone in width."""
    medians = {n: median(xs) for n, xs in samples.items() if xs}
    if len(medians) < 2:
        return False
    fitted = isotonic([medians[n] for n in sorted(medians)])
    moved = max(abs(f - medians[n]) / medians[n] for f, n in zip(fitted, sorted(medians)))
    return spread(samples) <= CREDIBLE_SPREAD and moved <= MAX_SHAPE_FIX


#: A width's median this many times off the line through its neighbours is a
#: spike (the machine busy while it was timed), not the curve's shape: the
#: steepest real step measured here, 1 to 2 tokens on a CPU, is 1.28x.
SPIKE = 1.3


def despike(points: list[tuple[int, float]]) -> list[float]:
    """The values of ``points`` (width, seconds; widths ascending) with spikes
    replaced: the value furthest off the line through its two neighbours (the
    widest: through the two before it), if more than ``SPIKE`` times off, takes
    that line's value, then the next furthest, and so on (a third of the points
    at most). Furthest first, so a spike's neighbour is not taken for a dip."""
    xs, out = [x for x, _ in points], [y for _, y in points]

    def expected(i: int) -> float:
        j, k = (i - 1, i + 1) if i + 1 < len(xs) else (i - 2, i - 1)
        return out[j] + (out[k] - out[j]) * (xs[i] - xs[j]) / (xs[k] - xs[j])

    for _ in range(len(points) // 3):
        off = [
            (abs(math.log(out[i] / e)), i, e)
            for i in range(1, len(xs))
            if i >= 2 or i + 1 < len(xs)
            for e in [expected(i)]
            if e > 0 and out[i] > 0
        ]
        if not off:
            break
        worst, i, e = max(off)
        if worst <= math.log(SPIKE):
            break
        out[i] = e
    return out


def isotonic(values: list[float], weights: list[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in (weighted) least
    squares: pool-adjacent-violators. A spike is pooled with the values after
    it, so it lifts them only by its share of the pool."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights or [1.0] * len(values)):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return [m for m, _, c in blocks for _ in range(c)]


def theil_sen_slope(points: list[tuple[float, float]]) -> float:
    """The median of the slopes between pairs of points of different x (0.0 if none)."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1]
    return median(slopes) if slopes else 0.0


def interpolate(timings: dict[int, float], widest: int) -> list[float]:
    """Seconds for widths 1..widest from the measured ones: linear between them,
    and along the last two measured widths' line beyond the widest."""
    known = sorted(timings)
    seconds = []
    for n in range(1, widest + 1):
        lower = [k for k in known if k <= n]
        upper = [k for k in known if k >= n]
        lo = lower[-1]
        hi = upper[0] if upper else known[-1]
        if not upper:
            lo = known[-2] if len(known) > 1 else hi
        if lo == hi:
            seconds.append(timings[lo])
        else:
            w = (n - lo) / (hi - lo)
            seconds.append(timings[lo] * (1 - w) + timings[hi] * w)
    return seconds
