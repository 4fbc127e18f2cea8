"""The measurement loop: systems interleaved on every workload, rounds rotating."""

from __future__ import annotations

import mlx_engine as me  # noqa: F401  first: loads OpenBLAS before mlx.core

import logging  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from tqdm import tqdm  # noqa: E402
from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: E402

from . import systems as S  # noqa: E402
from .workloads import Workload  # noqa: E402

logger = logging.getLogger("bench")

WARMUP_TOKENS = 16  # warm-up runs process the full prompt but generate only this many tokens


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    lengths: tuple[int, ...]
    multi_turn_lengths: tuple[int, ...]
    max_tokens: int
    reps: int
    warmup: int = 1  # warm-up rounds per workload (a global warm-up always runs first)

    budget_s: float | None = None  # for the measurement loop; later rounds are dropped past it


QUICK = Plan(lengths=(256,), multi_turn_lengths=(256,), max_tokens=64, reps=2, warmup=0, budget_s=140)
FULL = Plan(lengths=(128, 512, 1024), multi_turn_lengths=(512,), max_tokens=128, reps=3, warmup=1, budget_s=780)

Runs = dict[str, dict[str, list[S.Run]]]


def _round(models: S.Models, systems: list[S.System], w: Workload, rnd: int, max_tokens: int, bar) -> list[S.Run]:
    """One workload's turn in round ``rnd``: every system once, the order rotated by ``rnd``."""
    out: dict[str, S.Run] = {}
    shift = rnd % len(systems)
    for s in systems[shift:] + systems[:shift]:
        out[s.name] = S.run(models, s, w.prompt, max_tokens, setup=w.setup, setup_tokens=w.setup_tokens)
        bar.update()
    return [out[s.name] for s in systems]


def measure(
    models: S.Models, systems: list[S.System], workloads: list[Workload], plan: Plan, budget_s: float | None = None
) -> tuple[Runs, int]:
    """All runs, ``runs[workload][system]`` with warm-up rounds dropped, and the
    number of complete measured rounds.

    A global warm-up (every system once on the shortest prompt) comes first, so
    one-off costs such as the engine's forward-cost measurement are never timed.
    Then rounds sweep every workload, systems interleaved within each, in an order
    that rotates by one each round (A B C, B C A, ...): running right after a
    given system or first in a round can cost a few percent (a fixed A-then-B
    order measured B 3% slower on identical work), and rotation spreads that over
    every system. Warm-up rounds generate only ``WARMUP_TOKENS`` tokens. Once
    ``budget_s`` (seconds for this whole function) is spent, the rest of a
    warm-up round is skipped and measuring stops after the first measured round,
    so every workload x system is measured at least once."""
    runs: Runs = {w.name: {s.name: [] for s in systems} for w in workloads}
    total = len(workloads) * len(systems) * (plan.warmup + plan.reps) + len(systems)
    shortest = min(workloads, key=lambda w: len(w.prompt))
    t0 = time.perf_counter()
    measured = 0
    over = lambda: budget_s is not None and time.perf_counter() - t0 > budget_s  # noqa: E731
    with logging_redirect_tqdm(), tqdm(total=total, desc="runs", unit="run", dynamic_ncols=True, mininterval=2) as bar:
        bar.set_postfix_str("warm-up")
        for s in systems:
            S.run(models, s, shortest.prompt, min(32, plan.max_tokens))
            bar.update()
        for rnd in range(plan.warmup + plan.reps):
            warm = rnd < plan.warmup
            tokens = min(WARMUP_TOKENS, plan.max_tokens) if warm else plan.max_tokens
            for w in workloads:
                if over() and (warm or measured >= 1):
                    break
                bar.set_postfix_str(f"{'warm-up' if warm else f'round {measured + 1}'}: {w.name}")
                done = _round(models, systems, w, rnd, tokens, bar)
                if not warm:
                    for s, r in zip(systems, done):
                        runs[w.name][s.name].append(r)
            else:
                measured += not warm
                continue
            if warm:
                logger.warning("time budget (%.0f s) spent: skipping the rest of the warm-up round", budget_s)
            else:
                logger.warning(
                    "time budget (%.0f s) spent: %d complete measured round(s) of %d", budget_s, measured, plan.reps
                )
                break
    return runs, measured


def logit_gap(model, prefix: list[int]) -> tuple[float, int, int]:
    """Top-2 logit difference after ``prefix`` (fresh cache), and the top-2 ids."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prefix, dtype=mx.uint32)[None], cache=cache)[0, -1].astype(mx.float32)
    order = mx.argsort(-logits)[:2]
    top = logits[order]
    mx.eval(top, order)
    a, b = order.tolist()
    return float(top[0].item() - top[1].item()), a, b
