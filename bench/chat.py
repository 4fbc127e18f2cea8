"""Chat benchmark on the real default model: ``python -m bench.chat [--reps 5]``.

SmolLM2-135M-Instruct (GGUF, float32 on the CPU) under its chat template, on
what a chat user asks: edit a given function and return it whole, answer a
question about a document by quoting it, summarise a passage, continue a list,
and free chat. Systems: mlx-lm's ``stream_generate`` on the kit's own module
(same weights, dtype and BLAS; the baseline), and the engine plain, with prompt
lookup, and with the automatic router without a draft model (plain or lookup);
with the draft trained for the model (``--draft``, default ``smollm2-135m-draft``;
``''`` for none) also mlx-lm's speculative decoding, the engine's draft-model
mode and auto with the draft loaded. ``--systems`` and ``--workloads`` pick subsets.
Systems run interleaved with a rotating order (``bench.measure.measure``); ratios
are paired per round (``bench.stats``). Greedy outputs are compared with
mlx-lm's; a divergence is reported with the top-2 logit gap where it happens.
Writes ``<out>/chat.md`` and ``<out>/chat.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
import textwrap  # noqa: E402

from . import systems as S  # noqa: E402
from .machine import machine_info  # noqa: E402
from .measure import Plan, logit_gap, measure  # noqa: E402
from .stats import bench_args, format_paired, geomean, median, paired_ratio  # noqa: E402
from .workloads import Workload  # noqa: E402

logger = logging.getLogger("bench")

SYSTEM_NAMES = ("mlx-lm", "engine-plain", "engine-lookup", "engine-lookup-32", "engine-auto-nodraft")
DRAFT_SYSTEM_NAMES = ("mlx-lm-spec", "engine-draft", "engine-auto")
DEFAULT_DRAFT = "smollm2-135m-draft"
AUTO_NO_DRAFT = S.System(
    "engine-auto-nodraft",
    "engine",
    {"auto_speculative": True, "speculative_decoding_toggle": False},
    "engine, auto_speculative=True (no draft model: plain or lookup)",
)
LOOKUP_32 = S.System(
    "engine-lookup-32",
    "engine",
    {"prompt_lookup_num_tokens": 32, "speculative_decoding_toggle": False},
    "engine, prompt lookup (32 tokens)",
)
EXTRA_SYSTEMS = (LOOKUP_32, AUTO_NO_DRAFT)

DOCUMENT = (
    "The Python Software Foundation (PSF) is a non-profit organisation devoted to the Python programming "
    "language. It was founded on 6 March 2001. The foundation manages the open source licensing for Python "
    "version 2.1 and later, and owns and protects the trademarks associated with Python. It also runs the "
    "North American PyCon conference each year. The PSF supports the community through grants for sprints, "
    "conferences and meetups, and it funds the development of the Python Package Index, where developers "
    "publish the packages that others install with pip. Anyone who shares the goals of the foundation may "
    "become a member; fellows are members nominated for their contributions to the language."
)
PASSAGE = (
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light energy into "
    "chemical energy. In the leaves, chlorophyll absorbs sunlight, which drives the splitting of water into "
    "oxygen, protons and electrons. The oxygen is released into the air. The energy captured is stored in "
    "two carrier molecules, ATP and NADPH, which power the Calvin cycle. In that cycle the plant fixes carbon "
    "dioxide from the air into sugars, which it uses for growth and stores as starch. Nearly all the oxygen in "
    "the atmosphere and most of the food that animals eat come, directly or indirectly, from photosynthesis."
)
LIST_START = "1. Mercury\n2. Venus\n3. Earth\n4. Mars"


def chat_prompts() -> dict[str, tuple[str, str]]:
    """``name -> (kind, user message)`` for each workload."""
    indent_src = textwrap.dedent(inspect.getsource(textwrap.indent))
    dedent_src = textwrap.dedent(inspect.getsource(textwrap.dedent))
    quote_src = textwrap.dedent(inspect.getsource(shlex.quote))
    return {
        "echo-code": ("echo", f"Repeat this function exactly as it is.\n\n```python\n{dedent_src}```"),
        "edit-rename": (
            "edit",
            "Rename the function `indent` to `indent_lines` and return the whole function, "
            f"unchanged otherwise.\n\n```python\n{indent_src}```",
        ),
        "edit-param": (
            "edit",
            "Add a parameter `safe_chars=''` to this function: characters in it are also "
            f"considered safe. Return the whole function.\n\n```python\n{quote_src}```",
        ),
        "quote-doc": (
            "quote",
            f"Document:\n{DOCUMENT}\n\nQuote the sentence of the document that says when "
            "the foundation was founded, then the sentence about its conference.",
        ),
        "summarise": ("summarise", f"Summarise this passage in three sentences.\n\n{PASSAGE}"),
        "continue-list": (
            "list",
            "Here are the first planets of the solar system, in order from the Sun:\n"
            f"{LIST_START}\n\nWrite the whole numbered list of all eight planets.",
        ),
        "free-chat": ("chat", "Write a short story about a robot who learns to paint."),
    }


def build(kit: me.ModelKit) -> list[Workload]:
    out = []
    for name, (kind, text) in chat_prompts().items():
        prompt = me.apply_chat_template(kit, [{"role": "user", "content": text}])
        out.append(Workload(name, kind, "chat prompt", prompt, notes=text.split("\n")[0][:80]))
    return out


def exactness(kit: me.ModelKit, prompt: list[int], ref: list[int], other: list[int]) -> str:
    """'same', or where ``other`` first differs from ``ref`` and the top-2 logit gap there."""
    n = min(len(ref), len(other))
    pos = next((i for i in range(n) if ref[i] != other[i]), None)
    if pos is None:
        return "same" if len(ref) == len(other) else f"same for {n} tokens, lengths {len(ref)} vs {len(other)}"
    gap, _, _ = logit_gap(kit.model, prompt + ref[:pos])
    return f"differs at token {pos} (top-2 gap {gap:.2e})"


def analyse(kit, systems, workloads, runs) -> tuple[list[dict], dict]:
    rows = []
    names = [s.name for s in systems]
    peers = [p for p in ("mlx-lm", "engine-plain") if p in names]
    for w in workloads:
        ref = runs[w.name][peers[0]][0].tokens
        for s in systems:
            rs = runs[w.name][s.name]
            tps = [r.gen_tps for r in rs]
            row = {
                "workload": w.name,
                "system": s.name,
                "prompt_tokens": len(w.prompt),
                "new_tokens": len(rs[0].tokens),
                "gen_tps": median(tps),
                "ttft": median([r.ttft for r in rs]),
                "total_s": median([r.total_time for r in rs]),
                "exact": exactness(kit, w.prompt, ref, rs[0].tokens),
            }
            for peer in peers:
                pr = paired_ratio(tps, [r.gen_tps for r in runs[w.name][peer]])
                row[f"vs_{peer}"] = {"ratio": pr.ratio, "low": pr.low, "high": pr.high, "verdict": pr.verdict}
            stats = rs[0].engine_stats or {}
            row["mode"] = stats.get("decoding_mode")
            row["accepted_per_round"] = stats.get("mean_accepted_per_round")
            rows.append(row)
    summary = {
        s.name: {peer: geomean([r[f"vs_{peer}"]["ratio"] for r in rows if r["system"] == s.name]) for peer in peers}
        for s in systems
    }
    return rows, summary


def render(rows: list[dict], summary: dict, reps: int, max_tokens: int, ref: str = "mlx-lm") -> str:
    def ratio(d):
        return format_paired(d["ratio"], d["low"], d["high"]) if d else "–"

    lines = [
        f"SmolLM2-135M-Instruct, float32 on the CPU, greedy, up to {max_tokens} new tokens, {reps} measured rounds; "
        "ratios are paired per round (95% bootstrap interval).",
        "",
        f"| workload | system | prompt | new | gen tok/s | vs mlx-lm | vs engine-plain | mode | acc/round | output vs {ref} |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        acc = f"{r['accepted_per_round']:.2f}" if r.get("accepted_per_round") else ""
        lines.append(
            f"| {r['workload']} | {r['system']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['gen_tps']:.1f} | "
            f"{ratio(r.get('vs_mlx-lm'))} | {ratio(r.get('vs_engine-plain'))} | {r['mode'] or ''} | {acc} | {r['exact']} |"
        )
    lines += ["", "| system | geomean vs mlx-lm | geomean vs engine-plain |", "|---|---:|---:|"]
    lines += [
        f"| {name} | {v.get('mlx-lm', float('nan')):.2f} | {v.get('engine-plain', float('nan')):.2f} |"
        for name, v in summary.items()
    ]
    return "\n".join(lines + versus_best(rows)) + "\n"


SINGLE_MODES = ("engine-plain", "engine-lookup", "engine-lookup-32", "engine-draft")


def versus_best(rows: list[dict]) -> list[str]:
    """Each auto system against the hindsight-best single mode per workload, by
    generation rate (after the first token) and by total time (prefill and
    first round included: a mode whose first round drafts long pays for it
    before the first token, which the generation rate leaves out)."""
    autos = sorted({r["system"] for r in rows if r["system"].startswith("engine-auto")})
    if not autos:
        return []
    lines = [
        "",
        "| workload | auto system | best single mode (gen tok/s) | auto / it | best single mode (total s) | auto / it |",
    ]
    lines.append("|---|---|---|---:|---|---:|")
    for w in dict.fromkeys(r["workload"] for r in rows):
        mine = {r["system"]: r for r in rows if r["workload"] == w}
        singles = [mine[s] for s in SINGLE_MODES if s in mine]
        by_rate = max(singles, key=lambda r: r["gen_tps"])
        by_time = min(singles, key=lambda r: r["total_s"])
        for a in autos:
            r = mine[a]
            lines.append(
                f"| {w} | {a} | {by_rate['system']} | {r['gen_tps'] / by_rate['gen_tps']:.2f} | "
                f"{by_time['system']} | {by_time['total_s'] / r['total_s']:.2f} |"
            )
    return lines


def _extra_args(p) -> None:
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for the draft systems ('' for none)")
    p.add_argument("--systems", help="comma-separated subset of the systems (mlx-lm and engine-plain always run)")
    p.add_argument("--workloads", help=f"comma-separated subset of: {', '.join(chat_prompts())}")
    p.add_argument(
        "--suffix-memory",
        type=int,
        default=None,
        help="the kit's suffix_memory_tokens (default: the kit's default; 0: off). With the memory on, "
        "every round after the first drafts the same prompt's earlier answer",
    )


def load_models(draft: str, suffix_memory: int | None = None) -> S.Models:
    """The default model, with ``draft`` loaded into the kit; mlx-lm gets the kit's
    own modules (two loads of the same weights measured up to 5% apart)."""
    kit = me.load_model(me.DEFAULT_MODEL, suffix_memory_tokens=suffix_memory)
    draft_module = None
    if draft:
        me.load_draft_model(kit, draft)
        draft_module = kit.draft.model
    return S.Models(kit, draft_module, kit.eos_token_ids)


def main(argv: list[str] | None = None) -> int:
    args = bench_args("python -m bench.chat", __doc__.split("\n\n")[0], 5, 200, argv, _extra_args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    models = load_models(args.draft, args.suffix_memory)
    kit = models.kit
    names = SYSTEM_NAMES + (DRAFT_SYSTEM_NAMES if args.draft else ())
    if args.systems:
        names = tuple(n for n in names if n in args.systems.split(",") or n in ("mlx-lm", "engine-plain"))
    systems = [s for s in S.SYSTEMS if s.name in names] + [s for s in EXTRA_SYSTEMS if s.name in names]
    workloads = [w for w in build(kit) if not args.workloads or w.name in args.workloads.split(",")]
    plan = Plan(lengths=(), multi_turn_lengths=(), max_tokens=args.max_tokens, reps=args.reps, warmup=1)
    runs, measured = measure(models, systems, workloads, plan)
    rows, summary = analyse(kit, systems, workloads, runs)
    text = render(
        rows, summary, measured, args.max_tokens, "mlx-lm" if "mlx-lm" in runs[workloads[0].name] else "engine-plain"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chat.md").write_text(text)
    (args.out / "chat.json").write_text(
        json.dumps({"machine": machine_info(), "rows": rows, "summary": summary}, indent=1)
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
