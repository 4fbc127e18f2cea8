"""First choices from the estimate against a measurement (issue 55, item 3):
``python -m bench.first_choices [--model NAME] [--measurements 3]``.

A kit with no stored cost record prices its first speculative requests from an
estimate: one timed single step and the device's typical curve
(``costs.estimate``), until the widths are measured between requests. This
times that step as the kit does (``costs.measure_step``), then takes full
measurements (``costs.Measurement``, the one the kit takes in the background,
credible or repeated), and compares the draft lengths each cost model picks
(``best_draft_length`` over a ``RoundCosts`` built from it, before any round is
timed) for per-token acceptances 0.20-0.98 and caps 4, 8, 16 and 32: 160 cases,
for prompt lookup (drafts cost nothing) and for a draft model whose step costs
``--draft-step`` main steps. A different choice matters by what it costs:
``speed_lost`` is the mean (``worst_speed_lost`` the largest) share of the
expected speed the estimate's choice gives up against the best length under
the measured curve; ``measured_lost`` the same for the measurement's own
choices (made from its fitted line). Run it on a quiet machine: a measurement
sees any other load (its record says how credible it was). Writes
``<out>/first_choices.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.pricing import costs  # noqa: E402
from mlx_engine.pricing.fit import credible, spread  # noqa: E402
from mlx_engine.pricing.speedup import best_draft_length, expected_tokens  # noqa: E402

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

logger = logging.getLogger("bench")

ACCEPTANCES = [round(0.20 + 0.02 * i, 2) for i in range(40)]
CAPS = (4, 8, 16, 32)


def picks(verify: costs.CostModel, draft_step: float) -> dict[tuple[float, int], int]:
    """The draft length chosen before any timed round, per (acceptance, cap)."""
    rounds = costs.RoundCosts(verify, draft_step=draft_step)
    return {(p, cap): best_draft_length(p, rounds, max_k=cap)[0] for p in ACCEPTANCES for cap in CAPS}


def compare(estimate: dict, measured: dict, table: list[float]) -> dict:
    """How often the estimate's choice equals the measurement's, how far off it
    is otherwise, and the expected speed each one's choices give up against the
    best length under the measured round times ``table`` (seconds of a round
    with k drafts): the measurement's choices come from its fitted line
    (``RoundCosts``), so they too may give up a little."""
    diffs = [estimate[c] - measured[c] for c in measured]
    off = [d for d in diffs if d]
    return {
        "cases": len(diffs),
        "same": len(diffs) - len(off),
        "shorter": sum(d < 0 for d in off),
        "longer": sum(d > 0 for d in off),
        "largest_difference": max((abs(d) for d in off), default=0),
        **_lost("speed_lost", estimate, table),
        **_lost("measured_lost", measured, table),
    }


def _lost(name: str, choices: dict, table: list[float]) -> dict:
    """Mean and worst share of the best expected speed-up that ``choices`` give up."""

    def rate(p: float, k: int) -> float:
        return expected_tokens(p, k) / table[k]

    lost = [1 - rate(p, k) / max(rate(p, j) for j in range(cap + 1)) for (p, cap), k in choices.items()]
    return {name: round(sum(lost) / len(lost), 4), f"worst_{name}": round(max(lost), 4)}


def measure_once(kit) -> tuple[costs.CostModel, dict]:
    m = costs.Measurement(kit.model, kit.vocab_size)
    while not m.step():
        pass
    return m.result(), {"spread": round(spread(m.samples), 4), "credible": credible(m.samples), "rounds": m.rounds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--measurements", type=int, default=3, help="full measurements, each compared")
    p.add_argument("--draft-step", type=float, default=0.25, help="a draft model's step, in main-model steps")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kit = me.load_model(args.model)
    step = costs.measure_step(kit.model, kit.vocab_size)
    estimate = costs.estimate(step)
    report = {"model": args.model, "load": os.getloadavg()[0], "step_ms": round(step * 1e3, 2)}
    report["estimate"] = [round(x / estimate.step(), 3) for x in estimate.seconds]
    report["measurements"] = []
    for _ in range(args.measurements):
        measured, how = measure_once(kit)
        row = {**how, "relative": [round(x / measured.step(), 3) for x in measured.seconds]}
        for name, draft_step in (("lookup", 0.0), ("draft", args.draft_step)):
            table = costs.RoundCosts(measured, draft_step=draft_step).prior  # the measured curve, not its line
            row[name] = compare(picks(estimate, draft_step), picks(measured, draft_step), table)
        report["measurements"].append(row)
        logger.info(
            "measured %s (spread %.2f, credible %s): lookup %s, draft %s",
            measured.summary(),
            how["spread"],
            how["credible"],
            row["lookup"],
            row["draft"],
        )
    me.unload(kit)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_choices.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
