"""Run the benchmark: ``python -m bench.run [--quick] [--out bench/results]``.

For every workload the systems run interleaved, the order rotating each round
(A B C, B C A, C A B, ...) so no system always runs in the same place: one warm-up
round, then ``reps`` measured rounds; medians are reported. Outputs:
``<out>/latest.json`` (a compact summary; every run in ``<out>/raw/``, not
committed), ``<out>/latest.md``, ``<out>/ratios.png`` and
``docs/benchmarks.md``.

This module is the command line; the work is in ``machine`` (environment),
``measure`` (the loop), ``analyse`` (rows), ``report`` and ``report_docs``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from . import systems as S  # noqa: E402
from . import workloads as W  # noqa: E402
from .analyse import analyse  # noqa: E402
from .machine import ROOT, machine_info, make_tiny_models, model_info  # noqa: E402
from .measure import FULL, QUICK, Plan, Runs, measure  # noqa: E402
from .report import nan_to_none, write_reports  # noqa: E402
from .workloads import Workload, build_workloads  # noqa: E402

logger = logging.getLogger("bench")

DEFAULT_MODEL = me.DEFAULT_MODEL  # SmolLM2-135M-Instruct (catalog.py)
DEFAULT_DRAFT = "smollm2-135m-draft"  # its draft, trained by training/train_smollm2_draft.py
DEFAULT_DOCS = "docs/benchmarks.md"


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


def _plan(args: argparse.Namespace) -> Plan:
    """The quick or full plan, with the command line's overrides."""
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
    return plan


def _load(model_path: Path, draft_path: Path | None) -> S.Models:
    """The kit (with its draft) and the modules mlx-lm runs."""
    logger.info("loading %s%s", model_path, f" with draft {draft_path}" if draft_path else "")
    kit = me.load_model(model_path)
    draft_module = None
    if draft_path is not None:
        me.load_draft_model(kit, draft_path)
        # The engine's own draft module for mlx-lm too, as for the target: two loads
        # of the same weights measured up to 5% apart in one process.
        draft_module = kit.draft.model
    return S.Models(kit, draft_module, set(kit.eos_token_ids))


def _workloads(models: S.Models, systems: list[S.System], plan: Plan, kinds: str | None) -> list[Workload]:
    """The workloads, multi-turn ones continued with mlx-lm's greedy reply."""
    baseline = next(s for s in systems if s.name == S.BASELINE)

    def continue_fn(prompt: list[int], n: int) -> list[int]:
        return S.run_mlx_lm(models, baseline, prompt, n).tokens

    chosen = tuple(kinds.split(",")) if kinds else None
    return build_workloads(
        lambda t: me.tokenize(models.kit, t),
        continue_fn,
        lengths=plan.lengths,
        multi_turn_lengths=plan.multi_turn_lengths,
        setup_tokens=plan.max_tokens,
        **({"kinds": chosen} if chosen else {}),
    )


def _raw(runs: Runs) -> dict[str, Any]:
    """Every run's tokens and timings (``raw/latest-raw.json``)."""
    return {
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
    }


def _config(args: argparse.Namespace, argv: list[str] | None, kit, plan: Plan, measured: int) -> dict[str, Any]:
    command = "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
    return {
        "command": command.strip(),
        "quick": args.quick,
        "compute_dtype": str(kit.compute_dtype or "native"),
        **asdict(plan),
        "measured_reps": measured,
        "texts": W.text_source,
    }


def _workload_info(w: Workload) -> dict[str, Any]:
    return {
        "name": w.name,
        "kind": w.kind,
        "source": w.source,
        "prompt_tokens": len(w.prompt),
        "notes": w.notes,
        **w.meta,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    t_start = time.perf_counter()
    plan = _plan(args)
    if args.budget == 0:
        args.budget = float("inf")
    model_path, draft_path = _resolve(args)
    if model_path is None:
        return 2
    machine = machine_info()
    logger.info("BLAS: %s (%s)", machine["blas"]["backend"], machine["blas"]["path"] or machine["blas"]["reason"])
    models = _load(model_path, draft_path)
    systems = S.select(args.systems.split(",") if args.systems else None, draft_path is not None)
    workloads = _workloads(models, systems, plan, args.kinds)
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
    kit = models.kit
    report = {
        "machine": machine,
        "config": _config(args, argv, kit, plan, measured),
        "models": {
            "target": model_info(model_path, kit.model, kit.config),
            "draft": model_info(draft_path, models.draft_module) if draft_path else None,
        },
        "systems": [
            {"name": s.name, "backend": s.backend, "kwargs": s.kwargs, "description": s.description} for s in systems
        ],
        "workloads": [_workload_info(w) for w in workloads],
        "rows": rows,
        "summary": summary,
        "raw": _raw(runs),
    }
    report["elapsed_s"] = time.perf_counter() - t_start
    report = nan_to_none(report)
    docs = None if args.no_docs else (args.docs if args.docs.is_absolute() else ROOT / args.docs)
    md = write_reports(report, args.out, docs)
    logger.info("wrote %s/latest.{json,md} and ratios.png in %.0f s total", args.out, time.perf_counter() - t_start)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
