"""Run the benchmark: ``python -m bench.run [--quick] [--out bench/results]``.

For every workload the systems run interleaved, the order rotating each round
(A B C, B C A, C A B, ...) so no system always runs in the same place: one warm-up
round, then ``reps`` measured rounds; medians are reported. Outputs:
``<out>/latest.json`` (a compact summary; every run in ``<out>/raw/``, not
committed), ``<out>/latest.md``, ``<out>/ratios.png`` and
``docs/benchmarks.md``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from tqdm import tqdm  # noqa: E402
from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: E402

from . import systems as S  # noqa: E402
from . import workloads as W  # noqa: E402
from .stats import paired_ratio  # noqa: E402
from .workloads import Workload, build_workloads  # noqa: E402

logger = logging.getLogger("bench")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = me.DEFAULT_MODEL  # SmolLM2-135M-Instruct (catalog.py)
DEFAULT_DRAFT = "smollm2-135m-draft"  # its draft, trained by training/train_smollm2_draft.py
DEFAULT_DOCS = "docs/benchmarks.md"
OVERHEAD_GOAL = 0.97
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


# -- environment ----------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """The machine and software the numbers come from."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    os_name = platform.platform()
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = f"{line.split('=', 1)[1].strip(chr(34))} ({platform.system()} {platform.release()})"
    except OSError:
        pass
    blas = me.blas_status()
    try:
        git = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        git = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "os": os_name,
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", "unknown"),
        "mlx_lm": importlib.metadata.version("mlx-lm"),
        "mlx_engine": importlib.metadata.version("mlx-engine") if _has_dist("mlx-engine") else "source",
        "blas": {"backend": blas.backend, "path": blas.path, "reason": blas.reason},
        "git_commit": git,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_start": list(os.getloadavg()),
    }


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def model_info(path: Path, model, cfg: dict | None = None) -> dict[str, Any]:
    cfg = cfg if cfg is not None else json.loads((path / "config.json").read_text())
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return {
        "path": str(path),
        "parameters": params,
        "model_type": cfg.get("model_type"),
        "hidden_size": cfg.get("hidden_size"),
        "layers": cfg.get("num_hidden_layers"),
        "vocab_size": cfg.get("vocab_size"),
        "stored_dtype": cfg.get("torch_dtype") or path.suffix.lstrip("."),
        "compute_dtype": str(next(v for _, v in tree_flatten(model.parameters())).dtype).replace("mlx.core.", ""),
    }


def make_tiny_models(where: Path) -> tuple[Path, Path]:
    """Random-weight stand-ins (fixtures/tiny_models.py) for trying the harness."""
    from fixtures.tiny_models import make_model

    target, draft = where / "target", where / "draft"
    if not (target / "model.safetensors").exists():
        make_model(target, "llama", hidden=256, layers=4, scale=3.0)
    if not (draft / "model.safetensors").exists():
        make_model(draft, "llama", hidden=64, layers=1, tokenizer_from=target)
    return target, draft


# -- measurement ----------------------------------------------------------------
def measure(
    models: S.Models, systems: list[S.System], workloads: list[Workload], plan: Plan, budget_s: float | None = None
) -> tuple[dict[str, dict[str, list[S.Run]]], int]:
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
    runs: dict[str, dict[str, list[S.Run]]] = {w.name: {s.name: [] for s in systems} for w in workloads}
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
            for w in workloads:
                if over() and (warm or measured >= 1):
                    break
                bar.set_postfix_str(f"{'warm-up' if warm else f'round {measured + 1}'}: {w.name}")
                shift = rnd % len(systems)
                for s in systems[shift:] + systems[:shift]:
                    r = S.run(
                        models,
                        s,
                        w.prompt,
                        min(WARMUP_TOKENS, plan.max_tokens) if warm else plan.max_tokens,
                        setup=w.setup,
                        setup_tokens=w.setup_tokens,
                    )
                    if not warm:
                        runs[w.name][s.name].append(r)
                    bar.update()
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


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and not math.isnan(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def analyse(
    models: S.Models,
    systems: list[S.System],
    workloads: list[Workload],
    runs: dict[str, dict[str, list[S.Run]]],
    plan: Plan,
) -> tuple[list[dict], dict]:
    """Per workload x system rows, and the per-system summary."""
    rows: list[dict] = []
    for w in workloads:
        base_runs = runs[w.name][S.BASELINE]
        base = base_runs[0].tokens
        base_gen = _median([r.gen_tps for r in base_runs])
        base_total = _median([r.total_time for r in base_runs])
        base_stable = all(r.tokens == base for r in base_runs)
        for s in systems:
            rs = runs[w.name][s.name]
            row: dict[str, Any] = {
                "workload": w.name,
                "kind": w.kind,
                "system": s.name,
                "prompt_tokens": len(w.prompt),
                "generated_tokens": len(rs[0].tokens),
                "gen_tps": _median([r.gen_tps for r in rs]),
                "ttft_s": _median([r.ttft for r in rs]),
                "prompt_tps": _median([len(w.prompt) / r.ttft for r in rs if r.ttft > 0]),
                "total_s": _median([r.total_time for r in rs]),
                "reps": len(rs),
            }
            row["gen_ratio"] = row["gen_tps"] / base_gen if base_gen > 0 else float("nan")
            row["e2e_speedup"] = base_total / row["total_s"] if row["total_s"] > 0 else float("nan")
            row["reported_gen_tps"] = _median([r.reported.get("generation_tps") or float("nan") for r in rs])
            stats = [r.engine_stats for r in rs if r.engine_stats]
            if stats:
                drafted = sum(st["drafted_tokens"] for st in stats)
                row["acceptance"] = sum(st["accepted_tokens"] for st in stats) / drafted if drafted else None
                row["drafted_per_run"] = drafted / len(stats)
                row["mode"] = sorted({st["decoding_mode"] for st in stats})
                row["mode_reason"] = stats[0]["mode_reason"]
                row["mode_switches"] = stats[0]["mode_switches"]
                row["cached_tokens"] = stats[0]["cached_tokens"]
            elif s.needs_draft and s.backend == "mlx-lm":
                k = s.kwargs.get("num_draft_tokens", S.MLX_LM_DRAFT_TOKENS)
                drafted = sum(S.mlx_lm_drafted(r.from_draft, plan.max_tokens, k) for r in rs)
                row["acceptance"] = sum(sum(r.from_draft) for r in rs) / drafted if drafted else None
                row["drafted_per_run"] = drafted / len(rs)
            else:
                row["acceptance"] = None
            if s.peer is not None and s.peer in runs[w.name]:
                # Same rounds, back to back: the per-round ratio cancels the machine's drift.
                pr = paired_ratio([r.gen_tps for r in rs], [r.gen_tps for r in runs[w.name][s.peer]])
                row["vs_peer"] = {"peer": s.peer, **pr._asdict(), "verdict": pr.verdict}
            row["exact"] = all(r.tokens == base for r in rs)
            row["deterministic"] = all(r.tokens == rs[0].tokens for r in rs)
            if s.name == S.BASELINE:
                row["deterministic"] = base_stable
            if not row["exact"]:
                toks = next(r.tokens for r in rs if r.tokens != base)
                pos = next((i for i, (a, b) in enumerate(zip(toks, base)) if a != b), min(len(toks), len(base)))
                gap, top1, top2 = logit_gap(models.kit.model, w.prompt + base[:pos])
                row["divergence"] = {
                    "position": pos,
                    "baseline_token": base[pos] if pos < len(base) else None,
                    "system_token": toks[pos] if pos < len(toks) else None,
                    "top2_logit_gap": gap,
                    "top2_ids": [top1, top2],
                }
            rows.append(row)
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
    return rows, summary


# -- reports ----------------------------------------------------------------------
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


def render_markdown(report: dict) -> str:
    """The results section: summary, ratio matrix, details, divergences."""
    rows, summary, systems = report["rows"], report["summary"], report["systems"]
    names = [s["name"] for s in systems]
    workloads = [w["name"] for w in report["workloads"]]
    by = {(r["workload"], r["system"]): r for r in rows}
    out: list[str] = []
    cfg = report["config"]
    out.append(
        f"Run: `{cfg['command']}` — {cfg['max_tokens']} new tokens, greedy, {cfg['warmup']} warm-up + "
        f"{_reps(rows)} measured rounds per workload (systems interleaved, order rotating each round), medians; "
        f"{report['machine']['date']}, {report['elapsed_s']:.0f} s.\n"
    )
    out.append("#### Summary (geometric means over workloads)\n")
    out.append("| system | what | gen tok/s vs mlx-lm | end-to-end speedup | exact |")
    out.append("|---|---|---:|---:|---:|")
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
    out.append("#### Generation tok/s relative to mlx-lm\n")
    out.append(
        "Cells are ratios of median generation tok/s; `*` marks output that differs from mlx-lm's greedy tokens.\n"
    )
    out.append("| workload | prompt tok | mlx-lm tok/s | " + " | ".join(n for n in names if n != S.BASELINE) + " |")
    out.append("|---|---:|---:|" + "---:|" * (len(names) - 1))
    for wn in workloads:
        base = by[(wn, S.BASELINE)]
        cells = [
            f"{_f(by[(wn, n)]['gen_ratio'], '{:.2f}x')}{'' if by[(wn, n)]['exact'] else '*'}"
            for n in names
            if n != S.BASELINE
        ]
        out.append(f"| {wn} | {base['prompt_tokens']} | {_f(base['gen_tps'])} | " + " | ".join(cells) + " |")
    out.extend(_render_peers(rows, names, workloads))
    out.append("\n#### Details\n")
    out.append(
        "Prompt tok/s = prompt tokens ÷ TTFT (cached prefix tokens count, so cache reuse shows up here); "
        "e2e = mlx-lm's total time ÷ this system's; acceptance = accepted ÷ drafted tokens.\n"
    )
    out.append(
        "| workload | system | gen tok/s | vs mlx-lm | prompt tok/s | TTFT ms | e2e | acceptance | mode | exact |"
    )
    out.append("|---|---|---:|---:|---:|---:|---:|---:|---|---|")
    for wn in workloads:
        for n in names:
            r = by[(wn, n)]
            mode = "/".join(r.get("mode", [])) or (
                "speculative" if r["system"] != S.BASELINE and r.get("acceptance") is not None else "plain"
            )
            if r.get("mode_switches"):
                mode += f" (via {_mode_path(r['mode_switches'])})"
            exact = "yes" if r["exact"] else f"no @{r['divergence']['position']}"
            if not r["deterministic"]:
                exact += " (varies)"
            out.append(
                f"| {wn} | {n} | {_f(r['gen_tps'])} | {_f(r['gen_ratio'], '{:.2f}x')} | {_f(r['prompt_tps'], '{:.0f}')} | "
                f"{_f(r['ttft_s'], '{:.0f}', 1000)} | {_f(r['e2e_speedup'], '{:.2f}x')} | "
                f"{_f(r['acceptance'], '{:.0%}')} | {mode} | {exact} |"
            )
    div = [r for r in rows if not r["exact"]]
    if div:
        out.append("\n#### Divergences from mlx-lm's greedy output\n")
        out.append(
            "The baseline's top-2 logit gap at the first differing token (fresh-cache forward pass of "
            "prompt + baseline tokens up to there); a gap near 0 is a float near-tie, a large one a bug.\n"
        )
        out.append("| workload | system | position | baseline token | system token | top-2 logit gap |")
        out.append("|---|---|---:|---:|---:|---:|")
        for r in div:
            d = r["divergence"]
            out.append(
                f"| {r['workload']} | {r['system']} | {d['position']} | {d['baseline_token']} | "
                f"{d['system_token']} | {d['top2_logit_gap']:.4f} |"
            )
    else:
        out.append("\nEvery system reproduced mlx-lm's greedy tokens exactly on every workload.")
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


def render_docs(report: dict, results_md: str, out_dir: Path, docs_path: Path) -> str:
    m, models = report["machine"], report["models"]
    blas = m["blas"]
    chart = os.path.relpath(out_dir / "ratios.png", docs_path.parent)
    lines = [
        "<!-- Generated by `python -m bench.run` between these markers; edits will be overwritten. -->",
        "",
        "mlx-engine's decoding modes against mlx-lm on the same weights, in the same process (so dtype and BLAS "
        f"are identical), on `{models['target']['path'].split('/')[-1]}`"
        + (f" with the draft `{models['draft']['path'].split('/')[-1]}`" if models.get("draft") else "")
        + ". Regenerate with:",
        "",
        "```",
        "python -m bench.run            # full run (SmolLM2-135M-Instruct and its draft; budgeted to ~13 min of measuring)",
        "python -m bench.run --quick    # a few minutes (measuring is budgeted to 140 s)",
        "python -m bench.run --tiny --quick --no-docs   # random tiny models, to try the harness",
        "```",
        "",
        "### Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {m['cpu']} ({m['cores']} cores, {m['cores_usable']} usable) |",
        f"| OS | {m['os']} |",
        f"| Python | {m['python']} |",
        f"| mlx / mlx-lm | {m['mlx']} / {m['mlx_lm']} |",
        f"| BLAS | {blas['backend']}{' (' + blas['path'] + ')' if blas['path'] else ''}: {blas['reason']} |",
        f"| load average (1/5/15 min) | start {', '.join(f'{x:.2f}' for x in m['loadavg_start'])}; "
        f"end {', '.join(f'{x:.2f}' for x in m['loadavg_end'])} |",
        f"| git commit | {m['git_commit'] or 'unknown'} |",
        f"| date | {m['date']} |",
        "",
        "### Models",
        "",
        "| role | path | parameters | layers × hidden | vocab | compute dtype |",
        "|---|---|---:|---|---:|---|",
    ]
    for role, info in models.items():
        if info:
            lines.append(
                f"| {role} | `{info['path']}` | {info['parameters'] / 1e6:.2f}M | {info['layers']} × "
                f"{info['hidden_size']} | {info['vocab_size']} | {info['compute_dtype']} |"
            )
    lines += [
        "",
        "### Method",
        "",
        f"- **Workloads** ({report['config']['texts']}):",
    ]
    for w in report["workloads"]:
        lines.append(f"  - `{w['name']}` ({w['prompt_tokens']} prompt tokens, `{w['source']}`): {w['notes']}")
    lines += [
        "- **Systems**: " + "; ".join(f"`{s['name']}` = {s['description']}" for s in report["systems"]) + ".",
        "- Each run starts from empty KV caches (engine caches are reset), except `multi-turn`: there the engine "
        "first runs turn 1 untimed on the same kit, and turn 2 (turn-1 prompt + mlx-lm's greedy reply + a new "
        "chunk) is measured, so the engine reuses its cache while `mlx_lm.stream_generate` recomputes the prompt.",
        "- **Generation tok/s** counts the tokens after the first decoding round over the time after the first token "
        "arrived, so it excludes TTFT and does not credit speculative modes with drafts accepted in round one. "
        "**TTFT** runs from the call to the first token. **End-to-end** is the whole call.",
        "- Output ends at the engine's stop tokens for every system (the engine also stops at end-of-turn tokens "
        "such as `<|im_end|>`, `mlx_engine/loading/model.py` `END_OF_TURN_TOKENS`, which `mlx_lm.stream_generate` does "
        "not), so outputs and timings compare like for like.",
        "- **Exact** means the greedy tokens equal mlx-lm's token for token; otherwise the first differing position "
        "and mlx-lm's top-2 logit gap there are listed (a near-zero gap is a float near-tie, not a bug).",
        "- The CPU is shared with other work (see the load average above), so numbers are noisy: treat differences "
        "of a few percent as noise, and compare ratios from the same run rather than absolute tok/s across runs.",
        "- **Against mlx-lm doing the same job** pairs each engine system with its mlx-lm counterpart "
        "(`engine-plain` with `mlx-lm`, the draft-model modes with `mlx-lm-spec`) round by round "
        "(`bench/stats.py`): the geometric mean of per-round ratios, with a 95% bootstrap interval over rounds.",
        "",
        "### Results",
        "",
        f"![generation tok/s and end-to-end speedup vs mlx-lm]({chart})",
        "",
        results_md,
    ]
    return "\n".join(lines)


DOCS_START, DOCS_END = "<!-- bench.run:start -->", "<!-- bench.run:end -->"


def splice_docs(existing: str, generated: str) -> str:
    """Put ``generated`` between the markers of the benchmarks page, keeping the
    hand-written sections around it (the real-model and structured-output results)."""
    if DOCS_START in existing and DOCS_END in existing:
        head = existing[: existing.index(DOCS_START) + len(DOCS_START)]
        return f"{head}\n{generated}\n{existing[existing.index(DOCS_END) :]}"
    return f"# Benchmarks\n\n{DOCS_START}\n{generated}\n{DOCS_END}\n"


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


def _nan_to_none(o: Any) -> Any:
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {k: _nan_to_none(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_nan_to_none(v) for v in o]
    return o


# -- CLI --------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="fewer workloads, 64 tokens, 2 reps (measuring budgeted to 140 s)"
    )
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results directory")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a model directory, .gguf file or catalog name")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (directory or catalog name); '' for none")
    p.add_argument("--tiny", action="store_true", help="use tiny random models (fixtures/tiny_models.py) instead")
    p.add_argument("--systems", help=f"comma-separated subset of: {', '.join(s.name for s in S.SYSTEMS)}")
    p.add_argument("--kinds", help="comma-separated subset of workload kinds")
    p.add_argument("--max-tokens", type=int, help="new tokens per run")
    p.add_argument("--reps", type=int, help="measured rounds per workload")
    p.add_argument("--lengths", help="comma-separated prompt lengths, e.g. 128,512,1024")
    p.add_argument(
        "--budget",
        type=float,
        help="seconds for the measurement loop (0: no limit); rounds after the "
        "first measured one are dropped past it (default 140 quick, 780 full)",
    )
    p.add_argument("--docs", type=Path, default=Path(DEFAULT_DOCS), help="benchmarks page to regenerate")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def _resolve(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """The model and draft paths (catalog names resolved); None for a missing model."""
    from mlx_engine.loading import model as loading

    if args.tiny:
        return make_tiny_models(Path(tempfile.gettempdir()) / "mlx-engine-bench-tiny")
    try:
        model_path = loading.resolve_model_path(args.model)
    except (me.ModelLoadError, ValueError) as exc:
        logger.error("no model %s (%s; pass --model or --tiny)", args.model, exc)
        return None, None
    draft_path = None
    if str(args.draft) not in ("", "."):
        try:
            draft_path = loading.resolve_model_path(args.draft, "draft model path")
        except (me.ModelLoadError, ValueError) as exc:
            logger.warning("no draft model %s (%s); draft-model systems are skipped", args.draft, exc)
    return model_path, draft_path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    t_start = time.perf_counter()
    plan = QUICK if args.quick else FULL
    if args.max_tokens or args.reps or args.lengths:
        lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else plan.lengths
        plan = Plan(
            lengths,
            plan.multi_turn_lengths if not args.lengths else lengths[-1:],
            args.max_tokens or plan.max_tokens,
            args.reps or plan.reps,
            plan.warmup,
            plan.budget_s,
        )
    if args.budget == 0:
        args.budget = float("inf")
    model_path, draft_path = _resolve(args)
    if model_path is None:
        return 2

    machine = machine_info()
    logger.info("BLAS: %s (%s)", machine["blas"]["backend"], machine["blas"]["path"] or machine["blas"]["reason"])
    logger.info("loading %s%s", model_path, f" with draft {draft_path}" if draft_path else "")
    kit = me.load_model(model_path)
    draft_module = None
    if draft_path is not None:
        me.load_draft_model(kit, draft_path)
        # The engine's own draft module for mlx-lm too, as for the target: two loads
        # of the same weights measured up to 5% apart in one process.
        draft_module = kit.draft.model
    models = S.Models(kit, draft_module, set(kit.eos_token_ids))
    systems = S.select(args.systems.split(",") if args.systems else None, draft_path is not None)

    baseline = next(s for s in systems if s.name == S.BASELINE)

    def continue_fn(prompt: list[int], n: int) -> list[int]:
        return S.run_mlx_lm(models, baseline, prompt, n).tokens

    kinds = tuple(args.kinds.split(",")) if args.kinds else None
    workloads = build_workloads(
        lambda t: me.tokenize(kit, t),
        continue_fn,
        lengths=plan.lengths,
        multi_turn_lengths=plan.multi_turn_lengths,
        setup_tokens=plan.max_tokens,
        **({"kinds": kinds} if kinds else {}),
    )
    logger.info(
        "%d workloads x %d systems x %d rounds (%d warm-up)",
        len(workloads),
        len(systems),
        plan.warmup + plan.reps,
        plan.warmup,
    )
    runs, measured = measure(
        models, systems, workloads, plan, args.budget if args.budget is not None else plan.budget_s
    )
    logger.info("measured in %.0f s; checking exactness", time.perf_counter() - t_start)
    rows, summary = analyse(models, systems, workloads, runs, plan)
    machine["loadavg_end"] = list(os.getloadavg())
    command = "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {
        "machine": machine,
        "config": {
            "command": command.strip(),
            "quick": args.quick,
            "compute_dtype": str(kit.compute_dtype or "native"),
            **asdict(plan),
            "measured_reps": measured,
            "texts": W.text_source,
        },
        "models": {
            "target": model_info(model_path, kit.model, kit.config),
            "draft": model_info(draft_path, draft_module) if draft_path else None,
        },
        "systems": [
            {"name": s.name, "backend": s.backend, "kwargs": s.kwargs, "description": s.description} for s in systems
        ],
        "workloads": [
            {
                "name": w.name,
                "kind": w.kind,
                "source": w.source,
                "prompt_tokens": len(w.prompt),
                "notes": w.notes,
                **w.meta,
            }
            for w in workloads
        ],
        "rows": rows,
        "summary": summary,
        "raw": {
            wn: {
                sn: [
                    {
                        "tokens": r.tokens,
                        "ttft": r.ttft,
                        "decode_time": r.decode_time,
                        "total_time": r.total_time,
                        "first_round": r.first_round,
                        "from_draft": sum(r.from_draft),
                        "reported": r.reported,
                        "engine_stats": r.engine_stats,
                    }
                    for r in rs
                ]
                for sn, rs in per.items()
            }
            for wn, per in runs.items()
        },
    }
    report["elapsed_s"] = time.perf_counter() - t_start
    report = _nan_to_none(report)
    docs = None if args.no_docs else (args.docs if args.docs.is_absolute() else ROOT / args.docs)
    md = write_reports(report, args.out, docs)
    logger.info("wrote %s/latest.{json,md} and ratios.png in %.0f s total", args.out, time.perf_counter() - t_start)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
