"""The benchmark's reports: ``latest.md``, ``latest.json``, the chart and the docs page."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

from . import systems as S
from .report_docs import render_docs, splice_docs

logger = logging.getLogger("bench")


def _f(x: float | None, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x * scale)


def _mode_path(switches: list[str]) -> str:
    """``["a -> b: why", "b -> c: why"]`` -> ``"a → b → c"``."""
    steps = [m.groups() for sw in switches if (m := re.match(r"(\S+) -> ([^:\s]+)", sw))]
    if not steps:
        return f"{len(switches)} switches"
    return " → ".join([steps[0][0]] + [dst for _, dst in steps])


def _reps(rows: list[dict]) -> str:
    lo, hi = min(r["reps"] for r in rows), max(r["reps"] for r in rows)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _render_peers(rows: list[dict], names: list[str], workloads: list[str]) -> list[str]:
    """Engine systems against the mlx-lm system doing the same job, round by round."""
    by = {(r["workload"], r["system"]): r.get("vs_peer") for r in rows}
    pairs = [n for n in names if any(by.get((w, n)) for w in workloads)]
    if not pairs:
        return []
    peer_of = {n: next(by[(w, n)]["peer"] for w in workloads if by.get((w, n))) for n in pairs}
    out = [
        "\n#### Against mlx-lm doing the same job (paired rounds)\n",
        "Geometric mean over measured rounds of (engine tok/s ÷ peer tok/s in the same round), with a 95% "
        "bootstrap interval over rounds: **ahead** or **behind** only when the whole interval is on that side "
        "of 1, else level. Pairing within a round cancels most of the machine's drift, so these are tighter "
        "than ratios of medians.\n",
        "| workload | " + " | ".join(f"{n} ÷ {peer_of[n]}" for n in pairs) + " |",
        "|---|" + "---:|" * len(pairs),
    ]
    tally = {n: {"ahead": 0, "level": 0, "behind": 0, "?": 0} for n in pairs}
    for wn in workloads:
        cells = []
        for n in pairs:
            v = by.get((wn, n))
            if not v:
                cells.append("–")
                continue
            tally[n][v["verdict"]] += 1
            ci = f" ({v['low']:.2f}-{v['high']:.2f})" if v["low"] is not None else ""
            mark = {"ahead": " **ahead**", "behind": " **behind**"}.get(v["verdict"], "")
            cells.append(f"{v['ratio']:.2f}{ci}{mark}")
        out.append(f"| {wn} | " + " | ".join(cells) + " |")
    out.append(
        "| ahead / level / behind | "
        + " | ".join(f"{t['ahead']} / {t['level']} / {t['behind']}" for t in tally.values())
        + " |"
    )
    return out


def _summary_lines(report: dict, names: list[str]) -> list[str]:
    rows, summary, cfg = report["rows"], report["summary"], report["config"]
    out = [
        f"Run: `{cfg['command']}` — {cfg['max_tokens']} new tokens, greedy, {cfg['warmup']} warm-up + "
        f"{_reps(rows)} measured rounds per workload (systems interleaved, order rotating each round), medians; "
        f"{report['machine']['date']}, {report['elapsed_s']:.0f} s.\n",
        "#### Summary (geometric means over workloads)\n",
        "| system | what | gen tok/s vs mlx-lm | end-to-end speedup | exact |",
        "|---|---|---:|---:|---:|",
    ]
    for n in names:
        sm = summary[n]
        out.append(
            f"| {n} | {sm['description']} | {_f(sm['geomean_gen_ratio'], '{:.2f}x')} | "
            f"{_f(sm['geomean_e2e_speedup'], '{:.2f}x')} | {sm['exact_workloads']}/{sm['workloads']} |"
        )
    if "_overhead" in summary:
        o = summary["_overhead"]
        verdict = "meets" if o["geomean"] >= o["goal"] else "misses"
        out.append(
            f"\nEngine overhead (engine-plain ÷ mlx-lm generation tok/s): geomean **{o['geomean']:.3f}x**, "
            f"lowest {o['min']:.3f}x on {o['min_workload']} — {verdict} the >= {o['goal']:.2f}x goal.\n"
        )
    return out


def _ratio_lines(by: dict, names: list[str], workloads: list[str]) -> list[str]:
    out = [
        "#### Generation tok/s relative to mlx-lm\n",
        "Cells are ratios of median generation tok/s; `*` marks output that differs from mlx-lm's greedy tokens.\n",
        "| workload | prompt tok | mlx-lm tok/s | " + " | ".join(n for n in names if n != S.BASELINE) + " |",
        "|---|---:|---:|" + "---:|" * (len(names) - 1),
    ]
    for wn in workloads:
        base = by[(wn, S.BASELINE)]
        cells = [
            f"{_f(by[(wn, n)]['gen_ratio'], '{:.2f}x')}{'' if by[(wn, n)]['exact'] else '*'}"
            for n in names
            if n != S.BASELINE
        ]
        out.append(f"| {wn} | {base['prompt_tokens']} | {_f(base['gen_tps'])} | " + " | ".join(cells) + " |")
    return out


def _detail_line(wn: str, n: str, r: dict) -> str:
    mode = "/".join(r.get("mode", [])) or (
        "speculative" if r["system"] != S.BASELINE and r.get("acceptance") is not None else "plain"
    )
    if r.get("mode_switches"):
        mode += f" (via {_mode_path(r['mode_switches'])})"
    exact = "yes" if r["exact"] else f"no @{r['divergence']['position']}"
    if not r["deterministic"]:
        exact += " (varies)"
    return (
        f"| {wn} | {n} | {_f(r['gen_tps'])} | {_f(r['gen_ratio'], '{:.2f}x')} | {_f(r['prompt_tps'], '{:.0f}')} | "
        f"{_f(r['ttft_s'], '{:.0f}', 1000)} | {_f(r['e2e_speedup'], '{:.2f}x')} | "
        f"{_f(r['acceptance'], '{:.0%}')} | {mode} | {exact} |"
    )


def _divergence_lines(rows: list[dict]) -> list[str]:
    div = [r for r in rows if not r["exact"]]
    if not div:
        return ["\nEvery system reproduced mlx-lm's greedy tokens exactly on every workload."]
    out = [
        "\n#### Divergences from mlx-lm's greedy output\n",
        "The baseline's top-2 logit gap at the first differing token (fresh-cache forward pass of "
        "prompt + baseline tokens up to there); a gap near 0 is a float near-tie, a large one a bug.\n",
        "| workload | system | position | baseline token | system token | top-2 logit gap |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in div:
        d = r["divergence"]
        out.append(
            f"| {r['workload']} | {r['system']} | {d['position']} | {d['baseline_token']} | "
            f"{d['system_token']} | {d['top2_logit_gap']:.4f} |"
        )
    return out


def render_markdown(report: dict) -> str:
    """The results section: summary, ratio matrix, details, divergences."""
    rows = report["rows"]
    names = [s["name"] for s in report["systems"]]
    workloads = [w["name"] for w in report["workloads"]]
    by = {(r["workload"], r["system"]): r for r in rows}
    out = _summary_lines(report, names) + _ratio_lines(by, names, workloads)
    out.extend(_render_peers(rows, names, workloads))
    out += [
        "\n#### Details\n",
        "Prompt tok/s = prompt tokens ÷ TTFT (cached prefix tokens count, so cache reuse shows up here); "
        "e2e = mlx-lm's total time ÷ this system's; acceptance = accepted ÷ drafted tokens.\n",
        "| workload | system | gen tok/s | vs mlx-lm | prompt tok/s | TTFT ms | e2e | acceptance | mode | exact |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    out += [_detail_line(wn, n, by[(wn, n)]) for wn in workloads for n in names]
    out += _divergence_lines(rows)
    return "\n".join(out) + "\n"


def render_chart(report: dict, path: Path) -> None:
    """Grouped bars of generation tok/s and end-to-end speedup vs mlx-lm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["name"] for s in report["systems"] if s["name"] != S.BASELINE]
    workloads = [w["name"] for w in report["workloads"]]
    by = {(r["workload"], r["system"]): r for r in report["rows"]}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(workloads) + 3), 8), sharex=True)
    width = 0.8 / max(1, len(names))
    for ax, key, label in (
        (axes[0], "gen_ratio", "generation tok/s ÷ mlx-lm"),
        (axes[1], "e2e_speedup", "end-to-end speedup vs mlx-lm"),
    ):
        for i, n in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(workloads))]
            ys = [by[(w, n)][key] for w in workloads]
            ax.bar(xs, [0.0 if y is None or math.isnan(y) else y for y in ys], width, label=n)
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=min(3, len(names)), fontsize=8)
    axes[0].set_title(
        f"mlx-engine vs mlx-lm — {report['models']['target']['path']} ({report['config']['max_tokens']} new tokens)"
    )
    axes[1].set_xticks(range(len(workloads)))
    axes[1].set_xticklabels(workloads, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(report: dict, out_dir: Path, docs_path: Path | None) -> str:
    """``latest.json`` is the compact summary that is committed (rows, summary,
    machine, configuration); every run's tokens and timings go to
    ``raw/latest-raw.json``, which git ignores (megabytes per run)."""
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    summary = {k: v for k, v in report.items() if k != "raw"}
    (out_dir / "latest.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out_dir / "raw" / "latest-raw.json").write_text(json.dumps(report, default=str) + "\n")
    md = render_markdown(report)
    (out_dir / "latest.md").write_text("# mlx-engine benchmark: latest results\n\n" + md)
    try:
        render_chart(report, out_dir / "ratios.png")
    except ImportError:
        logger.warning("matplotlib is not installed (pip install matplotlib); no chart written")
    if docs_path is not None:
        docs_path.parent.mkdir(parents=True, exist_ok=True)
        existing = docs_path.read_text() if docs_path.exists() else ""
        docs_path.write_text(splice_docs(existing, render_docs(report, md, out_dir, docs_path)))
        logger.info("wrote %s", docs_path)
    return md


def nan_to_none(o: Any) -> Any:
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {k: nan_to_none(v) for k, v in o.items()}
    if isinstance(o, list):
        return [nan_to_none(v) for v in o]
    return o
