"""Structured-output benchmark: ``python -m bench.structured [--reps 5]``.

What a JSON schema costs and what forced-span drafting gives back, on the
default model, SmolLM2-135M-Instruct (float32 on the CPU), greedy:

- ``free``: unconstrained plain decoding (the reference speed);
- ``schema``: constrained plain decoding, forced-span drafting off;
- ``schema+forced``: constrained, with the tokens the grammar forces drafted;
- ``schema+lookup``: constrained, forced spans plus prompt lookup.

Systems run interleaved with a rotating order (``bench.measure.measure``), ratios
are paired per round (``bench.stats``). The constrained systems must produce
the same tokens; the script checks it. Writes ``<out>/structured.md``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import logging  # noqa: E402

from . import systems as S  # noqa: E402
from .measure import Plan, measure  # noqa: E402
from .stats import bench_args, format_paired, median, paired_ratio, write_report  # noqa: E402
from .workloads import Workload  # noqa: E402

BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "author": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        "genre": {"enum": ["fiction", "science", "history", "poetry", "children"]},
        "available": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["title", "author", "year", "genre", "available", "tags"],
    "additionalProperties": False,
}
QUESTION = "Describe a well-known book as a JSON object with its title, author, year, genre, availability and tags."
TOY_PROMPT = "import json\n\nBOOK = "


def systems() -> list[S.System]:
    schema = {"json_schema": BOOK}
    return [
        S.System("free", "engine", {"speculative_decoding_toggle": False}, "plain, unconstrained"),
        S.System("schema", "engine", {**schema, "structured_drafting": False}, "plain, JSON schema"),
        S.System("schema+forced", "engine", schema, "JSON schema, forced spans drafted"),
        S.System(
            "schema+lookup", "engine", {**schema, "prompt_lookup_num_tokens": 8}, "JSON schema, forced spans + lookup"
        ),
    ]


def bench_model(name: str, kit: me.ModelKit, reps: int, max_tokens: int) -> list[str]:
    if getattr(kit.tokenizer, "chat_template", None):
        prompt = me.apply_chat_template(kit, [{"role": "user", "content": QUESTION}])
    else:
        prompt = me.tokenize(kit, TOY_PROMPT)
    work = [Workload(f"{name}-book", "json", "schema", prompt)]
    sys_ = systems()
    plan = Plan(lengths=(), multi_turn_lengths=(), max_tokens=max_tokens, reps=reps, warmup=1)
    runs, measured = measure(S.Models(kit, None, kit.eos_token_ids), sys_, work, plan)
    by = runs[work[0].name]
    ref = by["schema"][0].tokens
    lines = []
    for s in sys_:
        tps = [r.gen_tps for r in by[s.name]]
        vs_free = paired_ratio(tps, [r.gen_tps for r in by["free"]])
        vs_schema = paired_ratio(tps, [r.gen_tps for r in by["schema"]])
        stats = by[s.name][0].engine_stats or {}
        same = "" if s.name == "free" else ("same" if by[s.name][0].tokens == ref else "DIFFERS")
        forced = f"{stats.get('grammar_accepted_tokens', 0)}/{stats.get('grammar_drafted_tokens', 0)}"
        lines.append(
            f"| {name} | {s.name} | {len(by[s.name][0].tokens)} | {median(tps):.1f} | {_ratio(vs_free)} | "
            f"{_ratio(vs_schema)} | {forced} | {same} |"
        )
    text = kit.tokenizer.decode(ref)
    logging.getLogger("bench").info("%s constrained output: %s", name, text)
    return lines


def _ratio(pr) -> str:
    return format_paired(pr.ratio, pr.low, pr.high)


def main(argv: list[str] | None = None) -> int:
    args = bench_args("python -m bench.structured", __doc__.split("\n\n")[0], 5, 120, argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lines = [
        f"Greedy, up to {args.max_tokens} new tokens, {args.reps} measured rounds, ratios paired per round "
        "(95% bootstrap interval); forced = grammar-forced drafts accepted/drafted.",
        "",
        "| model | system | new tokens | gen tok/s | vs free | vs schema | forced | output vs schema |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, path in (("smollm2-135m", me.DEFAULT_MODEL),):
        kit = me.load_model(path)
        lines += bench_model(name, kit, args.reps, args.max_tokens)
        me.unload(kit)
    return write_report(lines, args.out, "structured.md")


if __name__ == "__main__":
    raise SystemExit(main())
