"""Measured costs of forward passes and learned round times, used to pick
draft lengths and modes (speedup.py weighs them against acceptance).

Speculation pays when (expected tokens per round) / (cost of a round) beats one
token per single-token step. Both sides depend on the machine, the model and the
dtype (on MLX's CPU backend a 9-token verify can cost several single steps), so
they are measured once per model and machine (kept on disk by cost_store.py):
a kit that has no record starts from an estimate (one timed step and the
device's typical curve, ``estimate``) and measures the widths between its
requests (``Measurement``, one pass at a time). The statistics the widths are
fitted with are in fit.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from ..caches.sequence import flat_layers
from .fit import credible, despike, interpolate, isotonic, median, spread, theil_sen_slope

logger = logging.getLogger(__name__)

#: The longest draft any drafter proposes (prompt lookup, on near-perfect copies).
MAX_DRAFT = 32
#: The longest draft-model draft: each draft token costs a draft-model step.
MAX_MODEL_DRAFT = 16
_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 17, 25)  # wider ones extrapolated (they cost most to time)


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
        return ", ".join(f"v{n}={self.relative(n):.2f}" for n in (2, 4, 8, 16, 32))


#: The version of how costs are measured and fitted; a stored record of
#: another version is ignored (measured again), so an old fit never outlives a fix.
COST_MODEL_VERSION = 2


class Measurement:
    """Timing forward passes of several widths on a scratch cache, one pass per
    ``step()``, so it can run between a kit's requests without holding one up
    for more than a pass. Each width is timed ``repeats`` times after one
    untimed pass over every width (the first calls of a shape are slower), the
    widths interleaved so drift in machine load hits all alike. A measurement
    that is not credible (``credible``: samples spread wide, or medians far from
    monotone) times every width ``repeats`` more times, up to ``attempts``
    rounds; each width's cost is the median of all its samples."""

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        context: int = 128,
        repeats: int = 5,
        attempts: int = 3,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.model, self.vocab_size, self.context, self.repeats = model, vocab_size, context, repeats
        self.attempts, self.clock = attempts, clock
        self.cache = None
        self.tokens = None
        self.back = None  # takes the scratch cache back after a timed pass (_rewinder)
        self.samples: dict[int, list[float]] = {n: [] for n in _SIZES}
        self.passes = 0  # passes run so far, the context prefill excluded
        self.rounds = 1  # rounds of ``repeats`` timings planned so far
        self.target = (repeats + 1) * len(_SIZES)

    @property
    def done(self) -> bool:
        return self.passes >= self.target

    def step(self) -> bool:
        """Run the next pass (the first call prefills the context); True once done."""
        if self.cache is None:
            self.cache = make_prompt_cache(self.model)
            self.tokens = mx.random.randint(0, self.vocab_size, (self.context + max(_SIZES),), key=mx.random.key(0))
            mx.eval(self.model(self.tokens[: self.context][None], cache=self.cache))
            self.back = _rewinder(self.cache)
            return self.done
        if self.done:
            return True
        rep, n = divmod(self.passes, len(_SIZES))
        n = _SIZES[n]
        t0 = self.clock()
        out = self.model(self.tokens[self.context : self.context + n][None], cache=self.cache)
        mx.eval(out[:, -1])
        elapsed = self.clock() - t0
        if rep:  # the first round over the widths is the warm-up
            self.samples[n].append(elapsed)
        self.back(n)
        self.passes += 1
        if self.done and self.rounds < self.attempts and not credible(self.samples):
            self.rounds += 1
            self.target += self.repeats * len(_SIZES)
            logger.info("forward costs: samples spread wide (a busy machine?); timing every width again")
        if self.done:
            self.cache = self.tokens = self.back = None
        return self.done

    def result(self) -> CostModel:
        cm = fit_widths(self.samples)
        logger.info("measured forward costs: step=%.2f ms, %s", cm.step() * 1e3, cm.summary())
        return cm

    def description(self) -> dict:
        """How this measurement was taken, for its stored record."""
        return {
            "method": "interleaved passes, median per width, isotonic fit",
            "context": self.context,
            "samples": sum(len(xs) for xs in self.samples.values()),
            "rounds": self.rounds,
            "spread": round(spread(self.samples), 4),
            "credible": credible(self.samples),
            # Recorded, not a criterion: on a shared machine the load average stays
            # above the core count; the spread is what that load did to the timings.
            "load": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        }


def measure(model: nn.Module, vocab_size: int, context: int = 128, repeats: int = 5) -> CostModel:
    """Time forward passes of several widths on a scratch cache (all at once)."""
    m = Measurement(model, vocab_size, context, repeats)
    while not m.step():
        pass
    return m.result()


def fit_widths(samples: dict[int, list[float]]) -> CostModel:
    """A cost model from timed widths: each width's median, a lone spike (or
    dip) against its neighbours replaced by their line (``despike``), made
    monotone by isotonic regression (what is left of a slow width is averaged
    with its neighbours, not raised into every wider one), linear between widths
    and, beyond the widest, along a robust (Theil-Sen) line through the widths
    of 8 or more."""
    widths = sorted(n for n, xs in samples.items() if xs)
    fitted = dict(zip(widths, isotonic(despike([(n, median(samples[n])) for n in widths]))))
    seconds = interpolate(fitted, widths[-1])
    tail = [(n, fitted[n]) for n in widths if n >= 8] or [(n, fitted[n]) for n in widths]
    slope = max(0.0, theil_sen_slope(tail))
    seconds += [seconds[-1] + slope * i for i in range(1, MAX_DRAFT + 2 - len(seconds))]
    return CostModel(tuple(accumulate(seconds[: MAX_DRAFT + 1], max)))  # exact order despite rounding


def _non_decreasing(seconds: list[float]) -> tuple[float, ...]:
    """Cost is non-decreasing in width; timing noise should not say otherwise."""
    return tuple(isotonic(list(seconds)))


#: An n-token pass in single steps before this machine's widths are measured:
#: (width, relative cost) points, linear between. CPU: the median of the
#: measurements of the default model on the development machine (MLX's CPU
#: backend, OpenBLAS); GPU: a flatter curve (wide passes cost little more than
#: one token there). Only a start: timed rounds re-price drafts within a few
#: rounds, and the measurement replaces it once it has run between requests.
ESTIMATED_WIDTHS = {
    "cpu": {1: 1.0, 2: 1.28, 4: 1.40, 8: 1.51, 16: 1.75, 33: 2.54},
    "gpu": {1: 1.0, 2: 1.05, 4: 1.08, 8: 1.15, 16: 1.3, 33: 1.7},
}


def estimate(step_seconds: float, device_type: str | None = None) -> CostModel:
    """A cost model from one measured single step and the device's typical
    curve (``ESTIMATED_WIDTHS``): what a kit uses until its widths are measured."""
    if device_type is None:
        device_type = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    curve = ESTIMATED_WIDTHS["gpu" if device_type == "gpu" else "cpu"]
    return CostModel(_non_decreasing(interpolate({n: step_seconds * r for n, r in curve.items()}, MAX_DRAFT + 1)))


def measure_step(model: nn.Module, vocab_size: int, context: int = 4, repeats: int = 1) -> float:
    """Seconds of one single-token step at a short context (the fastest of
    ``repeats`` after an untimed one, the least disturbed by other work): the
    cheap part of a measurement."""
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, vocab_size, (context + 1,), key=mx.random.key(2))
    mx.eval(model(tokens[:context][None], cache=cache))
    back = _rewinder(cache)
    samples = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        mx.eval(model(tokens[context:][None], cache=cache)[:, -1])
        samples.append(time.perf_counter() - t0)
        back(1)
    return min(samples[1:])


def _rewinder(cache: list):
    """A function taking the scratch ``cache`` back by n tokens after a timed
    pass: attention layers are trimmed, recurrent ones (a hybrid's) get back
    the state they hold now."""
    layers = flat_layers(cache)
    start = {id(c): tuple(c.cache) for c in layers if isinstance(c, ArraysCache)}

    def back(n: int) -> None:
        for c in layers:
            if isinstance(c, ArraysCache):
                c.cache = list(start[id(c)])
            else:
                c.trim(n)

    return back


def measure_chained_step(
    model: nn.Module, vocab_size: int, chain: int = 4, context: int = 128, repeats: int = 5
) -> float:
    """Seconds per step when ``chain`` greedy steps are built lazily, each queued
    as soon as it is built, and evaluated once: how a drafter runs its model,
    cheaper than isolated steps because graph building overlaps computation."""
    timer = _chained_timer(model, vocab_size, chain, context)
    samples = sorted(timer() for _ in range(repeats + 1))[:-1]  # the slowest: the first calls of a shape
    return samples[len(samples) // 2]


def measure_draft_step_ratio(
    model: nn.Module, draft: nn.Module, vocab_size: int, chain: int = 4, context: int = 32, repeats: int = 3
) -> float:
    """A chained draft step (``measure_chained_step``) in single steps of
    ``model``, the two timed in turn so that other work on the machine slows
    both alike (two separate timings, each stored, can each catch a different
    load: docs/decoding.md, *Round costs*)."""
    draft_timer = _chained_timer(draft, vocab_size, chain, context)
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, vocab_size, (context + 1,), key=mx.random.key(2))
    mx.eval(model(tokens[:context][None], cache=cache))
    back = _rewinder(cache)

    def main_step() -> float:
        t0 = time.perf_counter()
        mx.eval(model(tokens[context:][None], cache=cache)[:, -1])
        back(1)
        return time.perf_counter() - t0

    pairs = [(draft_timer(), main_step()) for _ in range(repeats + 1)][1:]  # the first: warm-up
    ratios = sorted(d / m for d, m in pairs)
    return ratios[len(ratios) // 2]


def _chained_timer(model: nn.Module, vocab_size: int, chain: int, context: int) -> Callable[[], float]:
    """A function timing ``chain`` lazily chained greedy steps after a
    ``context``-token prompt (seconds per step), the cache taken back after each."""
    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, vocab_size, (context,), key=mx.random.key(1))
    mx.eval(model(prompt[None], cache=cache))
    back = _rewinder(cache)

    def timed() -> float:
        t0 = time.perf_counter()
        y = prompt[-1:]
        for _ in range(chain):
            y = mx.argmax(model(y.reshape(1, 1), cache=cache)[0, -1])
            mx.async_eval(y)
        mx.eval(y)
        back(chain)
        return (time.perf_counter() - t0) / chain

    return timed


class RoundCosts:
    """Seconds of a verify round with k drafts (k = 0..MAX_DRAFT), learned from the
    rounds as they run.

    Rounds are modelled as ``T(0)`` undrafted and ``T(0)·(1 + jump + slope·k)``
    with k drafts: a drafted round pays once for what any draft costs (the
    draft model catching up, a second graph, MLX's multi-token kernels, which on
    the CPU cost far more than one-token ones) and then a little per token.

    ``T(0)`` is a decaying average of timed undrafted rounds. ``jump`` and
    ``slope`` are a decaying least-squares fit to the drafted rounds' times in
    units of ``T(0)``, so any drafted length informs every other one. The
    once-per-kit measurement (a (k+1)-token verify pass plus k draft steps, at a
    short context) is the prior: its straight line until rounds are timed, then
    its slope, held until rounds of several lengths have been seen. Ratios to
    ``T(0)`` make a uniformly slower machine (other work, a longer context)
    change no decision. One line rather than a price per length, because rounds
    of one or two lengths must price every other length. docs/decoding.md
    ("Round costs") has the timed rounds this model was fitted to."""

    def __init__(
        self,
        verify: CostModel,
        draft_step: float = 0.0,
        weight: float = 2.0,
        decay: float = 0.9,
        age: float = 0.99,
    ):
        # draft_step: one draft token's cost in main-model steps (0 for lookup).
        self.prior = [verify.step() * (verify.relative(k + 1) + k * draft_step) for k in range(MAX_DRAFT + 1)]
        self.draft_seconds = verify.step() * draft_step  # one draft step, as measured
        self.weight = weight  # of the measurement, in rounds
        self.decay = decay  # per observation of the same kind: how fast evidence turns over
        self.age = age  # every round: the undrafted time must be re-timed now and then
        # The measurement's straight line, in units of the undrafted step (over
        # the draft model's lengths, which it was chosen for).
        ks = range(1, MAX_MODEL_DRAFT + 1)
        ys = [self.prior[k] / self.prior[0] - 1.0 for k in ks]
        k_mean, y_mean = sum(ks) / len(ks), sum(ys) / len(ys)
        self._prior_slope = sum((k - k_mean) * (y - y_mean) for k, y in zip(ks, ys)) / sum(
            (k - k_mean) ** 2 for k in ks
        )
        self._prior_jump = y_mean - self._prior_slope * k_mean
        self.t0_sum = self.t0_count = 0.0  # undrafted rounds: decaying sum of seconds, count
        # Drafted rounds: decaying sums of w, w·k, w·k², w·s, w·k·s (s in seconds),
        # read in units of T(0) when solving, so a later or better-timed T(0)
        # re-reads every drafted round instead of leaving them on the old one.
        self.fit = [0.0] * 5
        self.observed = 0
        self._coef = self._solve()

    def undrafted(self) -> float:
        """Seconds of an undrafted round (the measured step until one is timed)."""
        return self.t0_sum / self.t0_count if self.t0_count > 1e-9 else self.prior[0]

    def _solve(self) -> tuple[float, float]:
        """Jump and slope: the line through the rounds' mean (the measurement
        misses per-round overheads, so timed rounds set the level alone), with a
        slope to which the measurement's contributes like ``weight`` rounds a
        quarter of the length range either side: rounds of one length set the
        level and do not tilt the line."""
        w, wk, wkk, ws, wks = self.fit
        if w < 1e-9:
            return self._prior_jump, self._prior_slope
        t0 = self.undrafted()
        wy, wky = ws / t0 - w, wks / t0 - wk  # y = s / T(0) - 1
        k_mean, y_mean = wk / w, wy / w
        spread = self.weight * (MAX_MODEL_DRAFT / 4) ** 2
        slope = max(0.0, (wky - w * k_mean * y_mean + spread * self._prior_slope) / (wkk - w * k_mean**2 + spread))
        return max(0.0, y_mean - slope * k_mean), slope

    def observe(self, k: int, seconds: float | None) -> None:
        """Record the wall time of a round that verified k drafts."""
        if seconds is None or seconds <= 0 or not 0 <= k <= MAX_DRAFT:
            return
        # One stall (garbage collection, the host's own work) must not dominate
        # what earlier rounds of the same kind established.
        if (self.t0_count if k == 0 else self.fit[0]) >= 0.5:
            seconds = min(seconds, 2.0 * self.seconds(k))
        self.t0_sum *= self.age
        self.t0_count *= self.age
        if k == 0:
            self.t0_sum = self.t0_sum * self.decay + seconds
            self.t0_count = self.t0_count * self.decay + 1.0
        else:
            self.fit = [x * self.decay + v for x, v in zip(self.fit, (1.0, k, k * k, seconds, k * seconds))]
        self._coef = self._solve()
        self.observed += 1

    def needs_undrafted_timing(self) -> bool:
        """True when no recent undrafted round was timed (after the first timed
        round): the speed-up of drafting is relative to one."""
        return self.observed > 0 and self.t0_count < 0.5

    def table(self) -> list[float]:
        """Seconds of a round with k drafts, for k = 0..MAX_DRAFT."""
        t0 = self.undrafted()
        jump, slope = self._coef
        return [t0] + [t0 * (1.0 + jump + slope * k) for k in range(1, MAX_DRAFT + 1)]

    def seconds(self, k: int) -> float:
        return self.table()[k]

    def without_drafting(self) -> list[float]:
        """These rounds' times less the draft model's own work (its catch-up pass
        and k steps, as measured): what rounds of drafts that cost nothing to
        make, such as prompt lookup's, cost on this machine at this context."""
        table = self.table()
        return [table[0]] + [max(table[0], t - (k + 1) * self.draft_seconds) for k, t in enumerate(table[1:], start=1)]


def pass_seconds(verify: CostModel, width: int) -> float:
    """Seconds of a forward pass of ``width`` tokens in all: measured up to
    MAX_DRAFT+1, along the last two widths' line beyond."""
    s = verify.seconds
    if width <= len(s):
        return s[max(1, width) - 1]
    return s[-1] + (s[-1] - s[-2]) * (width - len(s))


def batch_round_table(verify: CostModel, rows: int, undrafted: float | None = None) -> list[float]:
    """Seconds of a batched step of ``rows`` rows in which one row drafts k
    tokens (k = 0..MAX_DRAFT). The batch pads every row to the widest, so the
    pass holds rows·(k+1) tokens; on a CPU a pass costs about what one row of as
    many tokens does, so widths come from the one-row measurement. With
    ``undrafted`` (a timed batched step) the table is scaled to it."""
    base = pass_seconds(verify, rows)
    scale = 1.0 if undrafted is None else undrafted / base
    return [scale * pass_seconds(verify, rows * (k + 1)) for k in range(MAX_DRAFT + 1)]
