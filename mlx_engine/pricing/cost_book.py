"""A kit's forward costs kept honest by the rounds its requests time.

A measurement (costs.Measurement) is taken once, at a short context, on a
machine whose load changes; a record stored while the machine was busy would
otherwise price every request after it. So every timed round that verified
lookup drafts or none (a draft model's rounds also pay for its steps) is
evidence about what a pass of its width costs here, and ``CostBook`` keeps the
last ``window`` of them:

- **The fit**: undrafted rounds' time is their median; drafted rounds' time is a
  robust (Theil-Sen) line ``a + b·width``, so one stall neither moves the level
  nor tilts the line. The book's model is the record blended with the fit, in
  logarithms, by ``rounds / (rounds + prior_rounds)`` (the record counts as
  ``prior_rounds`` rounds); widths beyond those observed keep the record's shape
  at the ratio the fit gives at the nearest observed width. With fewer than
  ``min_rounds`` rounds the record stands.
- **The check**: the record disagrees with the rounds when its single step is
  more than ``margin`` times the undrafted rounds' median (rounds cannot be much
  faster than the passes they contain: the record was timed on a busy machine),
  or when its price of a drafted width relative to a single step differs from the
  rounds' by more than ``margin`` either way. A disagreeing record is measured
  again (``remeasure``), at once the first time and then at most once per
  ``remeasure_every_s``; so is a record whose own samples were not credible
  (fit.credible) once it is older than that; rounds slower than the record alone (a long context,
  other work now) are no reason, as the fit already follows them.
- **The record** is saved (``save``) from the book's model when it moved by more
  than ``save_change`` since the record was read or last saved, so the next
  process starts from what the rounds said. Only a measured record is refined
  and saved this way; an estimate waits for its measurement.

The book takes its clock and its actions as values, so tests drive it with
injected timings. docs/decoding.md, "Costs that stay true".
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .costs import COST_MODEL_VERSION, MAX_DRAFT, CostModel, pass_seconds
from .fit import isotonic, median, theil_sen_slope

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BookSettings:
    """How much the rounds move a kit's costs, and when they call for a new measurement."""

    window: int = 160  # the most recent timed rounds kept
    min_rounds: int = 16  # rounds (of which min_undrafted undrafted) before the fit counts
    min_undrafted: int = 4
    min_drafted: int = 6  # drafted rounds (of two widths or more) before the drafted line counts
    prior_rounds: float = 8.0  # the record's weight, in rounds, in the blend
    margin: float = 1.4  # disagreement beyond which the record is measured again
    remeasure_every_s: float = 3600.0
    save_change: float = 0.05  # relative change of any width's price that is saved


class CostBook:
    """The costs a kit prices drafts with: ``base`` (a stored record, a
    measurement or an estimate, as ``source`` says) refined by ``observe``d
    rounds. ``current()`` is the model for the next request; it may call
    ``save(value)`` with a record to store and ``remeasure()`` to ask for a new
    measurement (the kit's background one), which ends in ``replace``."""

    def __init__(
        self,
        base: CostModel,
        source: str,
        record: dict | None = None,
        save: Callable[[dict], None] = lambda value: None,
        remeasure: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
        settings: BookSettings = BookSettings(),
    ):
        self.s, self.clock = settings, clock
        self._save, self._remeasure = save, remeasure
        self._lock = threading.RLock()  # remeasure may finish at once (replace)
        self.rounds: deque[tuple[int, float]] = deque(maxlen=settings.window)  # (width, seconds)
        self.remeasures = 0  # re-measurements asked for
        self._last_remeasure: float | None = None
        self._remeasuring = False
        self._set_base(base, source, record)

    def _set_base(self, base: CostModel, source: str, record: dict | None) -> None:
        self.base, self.source = base, source
        self.record = dict(record or {})  # what is stored beside the seconds (when and how measured)
        self.model = base
        self._saved = base.seconds
        self._fitted_at = -1  # len of rounds when last fitted (plus rounds seen), to refit only on news
        self._seen = 0

    def observe(self, width: int, seconds: float | None) -> None:
        """A round that verified ``width`` tokens (lookup drafts and the target's
        own, or 1) took ``seconds``, from one round's result to the next."""
        if seconds is None or not math.isfinite(seconds) or seconds <= 0 or not 1 <= width <= MAX_DRAFT + 1:
            return
        with self._lock:
            self.rounds.append((width, seconds))
            self._seen += 1

    def replace(self, measured: CostModel, record: dict) -> None:
        """A new measurement (``record``: when and how) replaces the base; the
        rounds already seen stay evidence against it."""
        with self._lock:
            self._remeasuring = False
            self._set_base(measured, "measured", record)
            self._saved = measured.seconds  # the caller stores the measurement itself

    def current(self) -> CostModel:
        """The costs to price the next request with (refit when rounds came in)."""
        with self._lock:
            if self._seen != self._fitted_at:
                self._fitted_at = self._seen
                self._refit()
            return self.model

    # -- the fit -----------------------------------------------------------
    def fit(self) -> dict[str, float] | None:
        """What the kept rounds say: ``undrafted`` seconds and, with enough
        drafted rounds, the drafted line ``a``, ``b`` over widths ``lo``..``hi``;
        None below ``min_rounds``."""
        rounds = list(self.rounds)
        single = [s for w, s in rounds if w == 1]
        drafted = [(float(w), s) for w, s in rounds if w > 1]
        if len(rounds) < self.s.min_rounds or len(single) < self.s.min_undrafted:
            return None
        out = {"undrafted": median(single), "rounds": float(len(rounds))}
        widths = {w for w, _ in drafted}
        if len(drafted) >= self.s.min_drafted and len(widths) >= 2:
            b = max(0.0, theil_sen_slope(_thinned(drafted)))
            a = median([s - b * w for w, s in drafted])
            out |= {"a": a, "b": b, "lo": min(widths), "hi": max(widths)}
        elif drafted:  # one width: its median alone
            out |= {"a": median([s for _, s in drafted]), "b": 0.0, "lo": min(widths), "hi": max(widths)}
        return out

    def _observed(self, fit: dict[str, float], n: int) -> float:
        """The fit's seconds for width ``n``; beyond the drafted widths seen, the
        base's shape at the fit's ratio to it at the nearest one."""
        if n == 1 or "a" not in fit:
            ratio = fit["undrafted"] / self.base.seconds[0]
            return self.base.seconds[n - 1] * ratio
        nearest = min(max(n, int(fit["lo"])), int(fit["hi"]))
        at = max(fit["a"] + fit["b"] * nearest, 1e-9)
        return self.base.seconds[n - 1] * at / pass_seconds(self.base, nearest)

    def _refit(self) -> None:
        fit = self.fit()
        if fit is None:
            self.model = self.base
            return
        w = fit["rounds"] / (fit["rounds"] + self.s.prior_rounds)
        blended = [
            math.exp(w * math.log(self._observed(fit, n)) + (1 - w) * math.log(self.base.seconds[n - 1]))
            for n in range(1, MAX_DRAFT + 2)
        ]
        self.model = CostModel(tuple(isotonic(blended)))
        if self.source != "estimate" and _moved(self._saved, self.model.seconds) > self.s.save_change:
            self._saved = self.model.seconds
            value = self.record_value(refined_rounds=int(fit["rounds"]))
            logger.info("forward costs refined from %d timed rounds: %s", int(fit["rounds"]), self.model.summary())
            self._save(value)
        self._check(fit)

    def disagreement(self, fit: dict[str, float]) -> float:
        """How far the base is from the rounds, as a factor (1.0: agrees): its
        step against the undrafted rounds' (only where the base is slower), and
        its drafted widths' prices in single steps against the rounds'."""
        worst = max(1.0, self.base.seconds[0] / fit["undrafted"])
        if "a" in fit:
            for n in range(int(fit["lo"]), int(fit["hi"]) + 1):
                seen = (fit["a"] + fit["b"] * n) / fit["undrafted"]
                priced = self.base.relative(n)
                worst = max(worst, seen / priced, priced / seen)
        return worst

    def _check(self, fit: dict[str, float]) -> None:
        if self.source == "estimate" or self._remeasuring:
            return  # an estimate is being measured already
        off = self.disagreement(fit)
        now = self.clock()
        recent = self._last_remeasure is not None and now - self._last_remeasure < self.s.remeasure_every_s
        if (off > self.s.margin or self._doubtful(now)) and not recent:
            logger.info(
                "forward costs: the record is %.2fx off what %d rounds timed%s; measuring again",
                off,
                len(self.rounds),
                " (and was not credible)" if self._doubtful(now) else "",
            )
            self._last_remeasure, self._remeasuring = now, True
            self.remeasures += 1
            self._remeasure()

    def _doubtful(self, now: float) -> bool:
        """Whether the record is a measurement its own samples did not find
        credible (fit.credible), taken over ``remeasure_every_s`` ago: the
        machine may be quieter now, so it is measured again once."""
        how, at = self.record.get("how"), self.record.get("measured_at")
        if not isinstance(how, dict) or how.get("credible") is not False or not isinstance(at, (int, float)):
            return False
        return now - at >= self.s.remeasure_every_s

    def record_value(self, refined_rounds: int = 0) -> dict:
        """The stored form of the book's model: its seconds, the cost-model
        version, and when and how it was measured (and refined)."""
        value = {**self.record, "seconds": list(self.model.seconds), "version": COST_MODEL_VERSION}
        if refined_rounds:
            value["refined"] = {"rounds": refined_rounds, "at": self.clock()}
        return value


def _moved(before: tuple[float, ...], after: tuple[float, ...]) -> float:
    return max(abs(a / b - 1.0) for a, b in zip(after, before))


def _thinned(points: list[tuple[float, float]], most: int = 64) -> list[tuple[float, float]]:
    """At most ``most`` of ``points``, evenly spaced (Theil-Sen is quadratic in them)."""
    step = max(1, math.ceil(len(points) / most))
    return points[::step]
