"""Hidden-state head benchmark: ``python -m bench.heads [--model NAME] [--tokens N]``.

On the default model (or ``--model``), with a random EAGLE-3 head built for it
on the fly (speculators layout; a 32,000-id draft vocabulary as published
heads have, or the whole vocabulary with ``--full-vocab``):

- **step costs**: a chained head step per format (the EAGLE-3 head, and a
  random layer-N MTP head with its own output layer: DeepSeek/GLM's and MiMo's
  layouts load as the same network), and the small draft model's chained step
  (``smollm2-135m-draft`` when installed), in single target steps, as the
  engine measures them for its router and draft length;
- **overhead of a loaded head whose drafts are all rejected**: plain decoding
  with no head, then with the random head loaded in the draft mode and in auto
  (the head's drafts are priced and it rests once they fail), same prompts,
  interleaved, greedy, the suffix memory off (it would draft the repeated
  answers); tokens/s and the ratio to plain.

Writes ``<out>/heads.md``. A random head: costs and overheads, not acceptance.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from fixtures.tiny_heads import make_eagle3_head, make_layer_mtp_head  # noqa: E402

from .stats import bench_args, write_report  # noqa: E402

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about a lighthouse.",
    "What are three tips for learning a new language?",
    "Describe how a bicycle works.",
]


def _tokens_per_second(kit, prompt: list[int], tokens: int, **kw) -> tuple[float, float, object]:
    """Tokens per wall second and per CPU second of this process (all its
    threads: what the work costs, steadier than wall time on a shared machine)."""
    t0, c0 = time.perf_counter(), time.process_time()
    n, last = 0, None
    for r in me.create_generator(kit, prompt, max_tokens=tokens, **kw):
        n += len(r.tokens)
        last = r
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0), last.stats


def _step_costs(kit, head: Path, config: dict) -> list[str]:
    from mlx_engine.request.drafters import draft_step_cost

    rows = []
    mtp = make_layer_mtp_head(Path(tempfile.mkdtemp()) / "mtp", config, seed=1)
    for name, path in (("EAGLE-3 head", head), ("layer-N MTP head", mtp)):
        me.load_draft_model(kit, path)
        rows.append(f"| {name} ({kit.draft.description}) | {draft_step_cost(kit):.3f} |")
        me.unload_draft_model(kit)
    try:
        me.load_draft_model(kit, "smollm2-135m-draft")
        rows.append(f"| small draft model (smollm2-135m-draft) | {draft_step_cost(kit):.3f} |")
        me.unload_draft_model(kit)
    except Exception as exc:  # not installed: reported, not fatal
        rows.append(f"| small draft model | not measured: {exc} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    def extra(p) -> None:
        p.add_argument("--model", default="smollm2-135m-instruct")
        p.add_argument("--full-vocab", action="store_true")

    args = bench_args("bench.heads", __doc__.splitlines()[0], reps=2, max_tokens=96, argv=argv, extra=extra)
    # No suffix memory: a regenerated answer would be drafted from it, which measures lookup, not the head.
    kit = me.load_model(args.model, suffix_memory_tokens=0)
    config = dict(kit.config.get("text_config", kit.config))
    head = make_eagle3_head(
        Path(tempfile.mkdtemp()) / "head", config, draft_vocab=None if args.full_vocab else 32000, seed=1
    )
    lines = ["# Hidden-state heads", "", f"Model {args.model}, a random EAGLE-3 head.", ""]
    lines += ["| drafter | chained step / target step |", "|---|---|", *_step_costs(kit, head, config), ""]
    prompts = [me.apply_chat_template(kit, [{"role": "user", "content": p}]) for p in PROMPTS]
    for p in prompts:  # warm the prompt cache and the cost measurements
        _tokens_per_second(kit, p, 8)
    runs: dict[str, list[tuple[float, float]]] = {"plain": [], "head (draft mode)": [], "head (auto)": []}
    drafted: dict[str, list[int]] = {name: [0, 0] for name in runs}
    modes = {"plain": {}, "head (draft mode)": {}, "head (auto)": {"auto_speculative": True}}
    for rep in range(args.reps):
        for i, p in enumerate(prompts):
            names = list(modes)
            shift = (rep * len(prompts) + i) % len(names)  # each mode runs first, second and last in turn
            for name in names[shift:] + names[:shift]:
                if name != "plain":
                    me.load_draft_model(kit, head)
                wall, cpu, stats = _tokens_per_second(kit, p, args.max_tokens, **modes[name])
                runs[name].append((wall, cpu))
                drafted[name][0] += stats.drafted_tokens
                drafted[name][1] += stats.accepted_tokens
                me.unload_draft_model(kit)
    wall0 = statistics.median(w for w, _ in runs["plain"])
    cpu0 = statistics.median(c for _, c in runs["plain"])
    lines += [
        "| decoding | tokens/s (median) | / plain | tokens per CPU second | / plain | drafted, accepted |",
        "|---|---|---|---|---|---|",
    ]
    for name, values in runs.items():
        wall, cpu = statistics.median(w for w, _ in values), statistics.median(c for _, c in values)
        d, a = drafted[name]
        lines.append(f"| {name} | {wall:.1f} | {wall / wall0:.3f} | {cpu:.1f} | {cpu / cpu0:.3f} | {d}, {a} |")
    return write_report(lines, args.out, "heads.md")


if __name__ == "__main__":
    raise SystemExit(main())
