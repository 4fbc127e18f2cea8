"""The default model's EAGLE-3 head on chat: ``python -m bench.heads_chat [--reps 2]``.

Workloads: held-out free-chat prompts (``training/smollm2_prompts.py``'s
``chat_prompts()`` with ``i % 25 == 0``, which neither the head's nor the small
draft's training data holds) and ``bench.chat``'s workloads. Systems, in one
run on one kit of SmolLM2-135M-Instruct (float32, CPU, greedy): mlx-lm's
``stream_generate`` (the baseline), the engine plain, the engine with the head
(``--head``, default ``smollm2-135m-eagle3``) as its drafter, auto with the head
loaded, and the engine with the small draft model (``--draft``, default
``smollm2-135m-draft``). After a short warm-up run of each system, each round runs every workload with the head loaded
(systems in a rotating order), then swaps in the small draft for its mode and a
second plain run; ratios are per workload, medians over rounds, and geomeans
per group. Reports the head's acceptance by draft position (the engine's
``acceptance_by_position``) and whether every output equals plain decoding's.
Writes ``<out>/heads_chat.md`` and ``<out>/heads_chat.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402

from . import systems as S  # noqa: E402
from .chat import build  # noqa: E402
from .stats import bench_args, geomean, write_report  # noqa: E402
from .workloads import Workload  # noqa: E402

logger = logging.getLogger("bench")
HEAD_SYSTEMS = (
    S.System("mlx-lm", "mlx-lm", {}, "mlx_lm.stream_generate, greedy"),
    S.System("engine-plain", "engine", {"speculative_decoding_toggle": False}, "engine, plain"),
    S.System("engine-head", "engine", {"speculative_decoding_toggle": True}, "engine, EAGLE-3 head drafting"),
    S.System("engine-auto-head", "engine", {"auto_speculative": True}, "engine, auto with the head loaded"),
)
DRAFT_SYSTEMS = (
    S.System("engine-plain-2", "engine", {"speculative_decoding_toggle": False}, "engine, plain (small-draft block)"),
    S.System("engine-small-draft", "engine", {"speculative_decoding_toggle": True}, "engine, small draft model"),
)


def held_out_chat(kit: me.ModelKit, n: int) -> list[Workload]:
    """The first ``n`` held-out free-chat prompts as workloads."""
    from training.smollm2_prompts import HELDOUT_EVERY, chat_prompts

    texts = [t for i, t in enumerate(chat_prompts()) if i % HELDOUT_EVERY == 0][:n]
    return [
        Workload(
            f"held-out-{i}", "chat", "held-out chat", me.apply_chat_template(kit, [{"role": "user", "content": t}])
        )
        for i, t in enumerate(texts)
    ]


def _block(models, systems, workloads, max_tokens, rnd, runs) -> None:
    for w in workloads:
        order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
        for s in order:
            runs[w.name][s.name].append(S.run(models, s, w.prompt, max_tokens))


def measure(kit, head: str, draft: str, workloads, reps: int, max_tokens: int) -> tuple[dict, dict]:
    """``runs[workload][system]`` (a warm-up round dropped, then ``reps`` rounds)
    and each drafter's chained step in target steps, as the engine measures it."""
    from mlx_engine.request.drafters import draft_step_cost

    names = [s.name for s in HEAD_SYSTEMS + DRAFT_SYSTEMS]
    runs = {w.name: {n: [] for n in names} for w in workloads}
    costs = {}
    for rnd in range(reps + 1):
        warm = rnd == 0  # one-off costs (cost measurements, compilation), not timed: one short run each
        todo, tokens = (workloads[:1], 8) if warm else (workloads, max_tokens)
        me.load_draft_model(kit, head)
        costs["head"] = draft_step_cost(kit)
        _block(S.Models(kit, None, kit.eos_token_ids), list(HEAD_SYSTEMS), todo, tokens, rnd, runs)
        me.unload_draft_model(kit)
        me.load_draft_model(kit, draft)
        costs["small draft"] = draft_step_cost(kit)
        _block(S.Models(kit, None, kit.eos_token_ids), list(DRAFT_SYSTEMS), todo, tokens, rnd, runs)
        me.unload_draft_model(kit)
        if warm:
            runs = {w.name: {n: [] for n in names} for w in workloads}
        logger.info("round %d of %d done", rnd, reps)
    return runs, costs


def analyse(runs: dict, workloads) -> list[dict]:
    rows = []
    for w in workloads:
        r = runs[w.name]
        tps = {n: statistics.median(x.gen_tps for x in rs) for n, rs in r.items()}
        plain = r["engine-plain"][0].tokens
        head_stats = r["engine-head"][0].engine_stats or {}
        rows.append(
            {
                "workload": w.name,
                "group": w.source,
                "new_tokens": len(plain),
                "gen_tps": tps,
                "head_vs_plain": tps["engine-head"] / tps["engine-plain"],
                "head_vs_small_draft": tps["engine-head"] / tps["engine-small-draft"],
                "small_draft_vs_plain": tps["engine-small-draft"] / tps["engine-plain-2"],
                "auto_vs_plain": tps["engine-auto-head"] / tps["engine-plain"],
                "auto_vs_best_single": tps["engine-auto-head"]
                / max(tps["engine-plain"], tps["engine-head"], tps["engine-small-draft"]),
                "plain_vs_mlx_lm": tps["engine-plain"] / tps["mlx-lm"],
                "head_acceptance_by_position": head_stats.get("acceptance_by_position"),
                "head_accepted_per_round": head_stats.get("mean_accepted_per_round"),
                "identical_to_plain": all(x.tokens == plain for n, rs in r.items() if n != "mlx-lm" for x in rs),
            }
        )
    return rows


def render(rows: list[dict], costs: dict, reps: int, max_tokens: int) -> list[str]:
    lines = [
        "Chained step in target steps (the engine's measure): " + ", ".join(f"{k} {v:.3f}" for k, v in costs.items()),
        "",
        f"SmolLM2-135M-Instruct, float32 on the CPU, greedy, up to {max_tokens} new tokens, {reps} measured rounds "
        "(medians of generation tok/s; ratios of medians).",
        "",
        "| workload | plain tok/s | head / plain | small draft / plain | head / small draft | auto (head) / plain "
        "| auto / best single | head acceptance by position | same as plain |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        acc = ", ".join(f"{a:.2f}" for a in (r["head_acceptance_by_position"] or [])[:5])
        lines.append(
            f"| {r['workload']} | {r['gen_tps']['engine-plain']:.1f} | {r['head_vs_plain']:.2f} | "
            f"{r['small_draft_vs_plain']:.2f} | {r['head_vs_small_draft']:.2f} | {r['auto_vs_plain']:.2f} | "
            f"{r['auto_vs_best_single']:.2f} | {acc} | {'yes' if r['identical_to_plain'] else 'NO'} |"
        )
    lines += ["", "| group | head / plain | small draft / plain | head / small draft | auto (head) / plain |"]
    lines.append("|---|---:|---:|---:|---:|")
    for name, pick in (("held-out free chat", "held-out chat"), ("bench.chat workloads", "chat prompt")):
        g = [r for r in rows if r["group"] == pick]
        if g:
            lines.append(
                f"| {name} (geomean of {len(g)}) | {geomean([r['head_vs_plain'] for r in g]):.2f} | "
                f"{geomean([r['small_draft_vs_plain'] for r in g]):.2f} | "
                f"{geomean([r['head_vs_small_draft'] for r in g]):.2f} | {geomean([r['auto_vs_plain'] for r in g]):.2f} |"
            )
    return lines


def _extra_args(p) -> None:
    p.add_argument("--head", default="smollm2-135m-eagle3", help="the EAGLE-3 head (catalog name or folder)")
    p.add_argument("--draft", default="smollm2-135m-draft", help="the small draft model compared with it")
    p.add_argument("--prompts", type=int, default=6, help="held-out free-chat prompts")
    p.add_argument("--workloads", default=None, help="comma-separated subset of bench.chat's workloads ('' for none)")


def main(argv: list[str] | None = None) -> int:
    args = bench_args("python -m bench.heads_chat", __doc__.split("\n\n")[0], 2, 128, argv, _extra_args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # no suffix memory: every system answers the same prompts, and auto would draft the earlier answers
    kit = me.load_model(me.DEFAULT_MODEL, suffix_memory_tokens=0)
    chat = build(kit)
    if args.workloads is not None:
        chat = [w for w in chat if w.name in args.workloads.split(",")]
    workloads = held_out_chat(kit, args.prompts) + chat
    runs, costs = measure(kit, args.head, args.draft, workloads, args.reps, args.max_tokens)
    rows = analyse(runs, workloads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heads_chat.json").write_text(json.dumps({"step_costs": costs, "rows": rows}, indent=1) + "\n")
    return write_report(render(rows, costs, args.reps, args.max_tokens), args.out, "heads_chat.md")


if __name__ == "__main__":
    raise SystemExit(main())
