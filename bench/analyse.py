"""From measured runs to report rows: medians, ratios to mlx-lm, exactness."""

from __future__ import annotations

from typing import Any

from . import systems as S
from .measure import Plan, Runs, logit_gap
from .stats import geomean, median, paired_ratio
from .workloads import Workload

OVERHEAD_GOAL = 0.97


def _timings(w: Workload, rs: list[S.Run]) -> dict[str, Any]:
    return {
        "prompt_tokens": len(w.prompt),
        "generated_tokens": len(rs[0].tokens),
        "gen_tps": median([r.gen_tps for r in rs]),
        "ttft_s": median([r.ttft for r in rs]),
        "prompt_tps": median([len(w.prompt) / r.ttft for r in rs if r.ttft > 0]),
        "total_s": median([r.total_time for r in rs]),
        "reps": len(rs),
    }


def _drafting(s: S.System, rs: list[S.Run], plan: Plan) -> dict[str, Any]:
    """Acceptance and the modes taken: the engine's stats, or mlx-lm's drafts counted."""
    stats = [r.engine_stats for r in rs if r.engine_stats]
    if stats:
        drafted = sum(st["drafted_tokens"] for st in stats)
        return {
            "acceptance": sum(st["accepted_tokens"] for st in stats) / drafted if drafted else None,
            "drafted_per_run": drafted / len(stats),
            "mode": sorted({st["decoding_mode"] for st in stats}),
            "mode_reason": stats[0]["mode_reason"],
            "mode_switches": stats[0]["mode_switches"],
            "cached_tokens": stats[0]["cached_tokens"],
        }
    if s.needs_draft and s.backend == "mlx-lm":
        k = s.kwargs.get("num_draft_tokens", S.MLX_LM_DRAFT_TOKENS)
        drafted = sum(S.mlx_lm_drafted(r.from_draft, plan.max_tokens, k) for r in rs)
        return {
            "acceptance": sum(sum(r.from_draft) for r in rs) / drafted if drafted else None,
            "drafted_per_run": drafted / len(rs),
        }
    return {"acceptance": None}


def _divergence(models: S.Models, w: Workload, rs: list[S.Run], base: list[int]) -> dict[str, Any]:
    """Where a system's tokens first leave the baseline's, and how close the baseline's top-2 were there."""
    toks = next(r.tokens for r in rs if r.tokens != base)
    pos = next((i for i, (a, b) in enumerate(zip(toks, base)) if a != b), min(len(toks), len(base)))
    gap, top1, top2 = logit_gap(models.kit.model, w.prompt + base[:pos])
    return {
        "position": pos,
        "baseline_token": base[pos] if pos < len(base) else None,
        "system_token": toks[pos] if pos < len(toks) else None,
        "top2_logit_gap": gap,
        "top2_ids": [top1, top2],
    }


def _row(models: S.Models, w: Workload, s: S.System, per: dict[str, list[S.Run]], plan: Plan) -> dict[str, Any]:
    """One workload x system row."""
    base_runs = per[S.BASELINE]
    base = base_runs[0].tokens
    base_gen = median([r.gen_tps for r in base_runs])
    base_total = median([r.total_time for r in base_runs])
    rs = per[s.name]
    row: dict[str, Any] = {"workload": w.name, "kind": w.kind, "system": s.name, **_timings(w, rs)}
    row["gen_ratio"] = row["gen_tps"] / base_gen if base_gen > 0 else float("nan")
    row["e2e_speedup"] = base_total / row["total_s"] if row["total_s"] > 0 else float("nan")
    row["reported_gen_tps"] = median([r.reported.get("generation_tps") or float("nan") for r in rs])
    row.update(_drafting(s, rs, plan))
    if s.peer is not None and s.peer in per:
        # Same rounds, back to back: the per-round ratio cancels the machine's drift.
        pr = paired_ratio([r.gen_tps for r in rs], [r.gen_tps for r in per[s.peer]])
        row["vs_peer"] = {"peer": s.peer, **pr._asdict(), "verdict": pr.verdict}
    row["exact"] = all(r.tokens == base for r in rs)
    row["deterministic"] = all(r.tokens == rs[0].tokens for r in rs)
    if s.name == S.BASELINE:
        row["deterministic"] = all(r.tokens == base for r in base_runs)
    if not row["exact"]:
        row["divergence"] = _divergence(models, w, rs, base)
    return row


def _summary(systems: list[S.System], rows: list[dict]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for s in systems:
        mine = [r for r in rows if r["system"] == s.name]
        summary[s.name] = {
            "description": s.description,
            "geomean_gen_ratio": geomean([r["gen_ratio"] for r in mine]),
            "geomean_e2e_speedup": geomean([r["e2e_speedup"] for r in mine]),
            "exact_workloads": sum(r["exact"] for r in mine),
            "workloads": len(mine),
        }
    plain = [r for r in rows if r["system"] == "engine-plain"]
    if plain:
        worst = min(plain, key=lambda r: r["gen_ratio"])
        summary["_overhead"] = {
            "geomean": geomean([r["gen_ratio"] for r in plain]),
            "min": worst["gen_ratio"],
            "min_workload": worst["workload"],
            "goal": OVERHEAD_GOAL,
        }
    return summary


def analyse(
    models: S.Models, systems: list[S.System], workloads: list[Workload], runs: Runs, plan: Plan
) -> tuple[list[dict], dict]:
    """Per workload x system rows, and the per-system summary."""
    rows = [_row(models, w, s, runs[w.name], plan) for w in workloads for s in systems]
    return rows, _summary(systems, rows)
