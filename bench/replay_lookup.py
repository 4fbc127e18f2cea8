"""Replay prompt lookup and the router on recorded outputs: ``python -m bench.replay --lookup``
and ``--draft-mix`` (see ``bench.replay``'s docstring)."""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from mlx_engine.drafters.router import AutoRouter  # noqa: E402
from mlx_engine.pricing import costs  # noqa: E402

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

from . import workloads as W  # noqa: E402
from .replay_core import ReplayedDraft, greedy, parse_line, replay_drafter  # noqa: E402


def record_traces(path: Path, tokens: int, chat: bool, toy_model: str | Path) -> dict:
    """Greedy outputs of the bench workloads (``toy_model``'s ``bench.run``
    workloads, the default model unless told, and with ``chat`` SmolLM2's ``bench.chat`` ones; ``tokens`` long,
    replayed as far as each benchmark generates: 128 and 200), saved as JSON:
    ``name -> {"prompt": [...], "output": [...]}``. Greedy output does not
    depend on the decoding mode, so prompt lookup makes them faster."""
    traces: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}

    def add(kit: me.ModelKit, name: str, prompt: list[int]) -> None:
        if name in traces:
            return
        out = [
            t.id
            for r in me.create_generator(kit, prompt, max_tokens=tokens, temp=0.0, prompt_lookup_num_tokens=8)
            for t in r.tokens
        ]
        traces[name] = {"prompt": prompt, "output": out}
        path.write_text(json.dumps(traces))

    kit = me.load_model(toy_model)
    tokenize = lambda s: kit.tokenizer.encode(s)  # noqa: E731
    for w in W.build_workloads(
        tokenize, lambda p, n: greedy(kit, p, n), lengths=(128, 512, 1024), multi_turn_lengths=(512,)
    ):
        add(kit, f"toy/{w.name}", w.prompt)
    if chat:
        from . import chat as C

        kit = me.load_model(me.DEFAULT_MODEL)
        for w in C.build(kit):
            add(kit, f"chat/{w.name}", w.prompt)
    return traces


def lookup_main(args: argparse.Namespace) -> None:
    """Price fixed-length prompt lookup and the router (no draft model) on traces."""
    traces = record_traces(args.traces, 200, args.chat, args.toy_model)
    lines = dict(parse_line(item) for item in args.cost_lines.split(",")) if args.cost_lines else {}
    priors = dict(parse_line(item) for item in args.prior_lines.split(",")) if args.prior_lines else lines
    ks = (4, 8, 16, costs.MAX_DRAFT)
    names = [f"lookup k={k}" for k in ks] + ["auto"]
    print("| workload | " + " | ".join(names) + " | best | auto / best |")
    print("|---|" + "---:|" * (len(names) + 2))
    logs: dict[str, list[float]] = {n: [] for n in [*names, "best", "auto / best"]}
    for name, tr in traces.items():
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        jump, slope = lines.get("chat" if name.startswith("chat/") else "toy", (0.2, 0.1))
        line = (1.0,) + tuple(1.0 + jump + slope * k for k in range(1, costs.MAX_DRAFT + 1))
        jump, slope = priors.get("chat" if name.startswith("chat/") else "toy", (jump, slope))
        cm = costs.CostModel((1.0,) + tuple(1.0 + jump + slope * k for k in range(1, costs.MAX_DRAFT + 1)))
        prompt, output = tr["prompt"], tr["output"][: 200 if name.startswith("chat/") else args.tokens]
        row = {}
        for k in ks:
            row[f"lookup k={k}"] = replay_drafter(prompt, output, PromptLookupDrafter(k), list(line))[0]
        router = AutoRouter(prompt, cm, PromptLookupDrafter(args.auto_max))
        row["auto"], _ = replay_drafter(prompt, output, router, list(line))
        row["best"] = max([1.0] + [row[f"lookup k={k}"] for k in ks])
        row["auto / best"] = row["auto"] / row["best"]
        for n, v in row.items():
            logs[n].append(math.log(v))
        print(
            f"| {name} | "
            + " | ".join(f"{v:.2f}" for v in row.values())
            + f" | <!-- {router.decoding_mode} {len(router.mode_switches)} -->"
        )
    print("| geomean | " + " | ".join(f"{math.exp(sum(v) / len(v)):.3f}" for v in logs.values()) + " |")


def simulated_lengths(output: list[int], rate: float) -> list[int]:
    """The accept lengths of a draft right at each output position with
    probability ``rate`` (a fixed pseudo-random draw per position, so every
    replay sees the same draft): at t, how many positions from t on it is right."""
    import random

    draw = random.Random(f"{rate}:{len(output)}")
    right = [draw.random() < rate for _ in output]
    lengths, run = [0] * len(output), 0
    for t in reversed(range(len(output))):
        run = run + 1 if right[t] else 0
        lengths[t] = run
    return lengths


def draft_mix_main(args: argparse.Namespace) -> None:
    """Replay the router with a simulated draft model of each ``--draft-mix``
    acceptance beside prompt lookup alone and the draft alone, on every trace in
    ``--traces`` (``--lookup --chat`` records them)."""
    traces = json.loads(args.traces.read_text())
    jump, slope = parse_line(f"chat={args.chat_line}")[1]
    line = [1.0] + [1.0 + jump + slope * k for k in range(1, costs.MAX_DRAFT + 1)]
    cm = costs.CostModel(tuple(line))
    print("| workload | draft rate | lookup k=32 | auto, no draft | draft | auto | best | auto / best | final mode |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    ratios = []
    for rate in (float(r) for r in args.draft_mix.split(",")):
        for name, tr in traces.items():
            prompt, output = tr["prompt"], tr["output"][:200]

            def run(make_router: bool, prompt=prompt, output=output, rate=rate) -> tuple[float, str]:
                lengths = simulated_lengths(output, rate)
                sim = ReplayedDraft(
                    output, lengths, len(prompt), costs.RoundCosts(cm, args.draft_step), rate, args.draft_step
                )
                drafter = AutoRouter(prompt, cm, PromptLookupDrafter(costs.MAX_DRAFT), sim) if make_router else sim
                cost = lambda k: line[k] + sim.extra_cost()  # noqa: E731
                speed = replay_drafter(prompt, output, drafter, cost)[0]
                return speed, drafter.decoding_mode if make_router else ""

            lookup = replay_drafter(prompt, output, PromptLookupDrafter(costs.MAX_DRAFT), line)[0]
            alone = AutoRouter(prompt, cm, PromptLookupDrafter(costs.MAX_DRAFT))
            no_draft = replay_drafter(prompt, output, alone, line)[0]
            draft, _ = run(False)
            auto, mode = run(True)
            best = max(1.0, lookup, draft)
            ratios.append(auto / best)
            print(
                f"| {name} | {rate:.2f} | {lookup:.2f} | {no_draft:.2f} | {draft:.2f} | {auto:.2f} | {best:.2f} | {auto / best:.2f} | {mode} |"
            )
    print(
        f"| geomean auto / best | | | | | | | {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} | "
        f"worst {min(ratios):.2f} |"
    )
