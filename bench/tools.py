"""Tool-call benchmark: ``python -m bench.tools [--count 50] [--max-tokens 64]``.

On SmolLM2-135M-Instruct (greedy, float32 on the CPU), ``--count`` tool-call
prompts over five tools with nested argument schemas, rendered with the
default tool prompt (apply_chat_template(tools=...)). Per prompt, interleaved
in a rotating order:

- ``free``: ``tool_choice="none"``: no grammar; the text is parsed afterwards
  (parse_tool_calls) and a call counts as valid when it names a declared tool
  and its arguments validate with jsonschema;
- ``required``: ``tool_choice="required"``, forced-span drafting off (the
  grammar's own cost);
- ``required+forced``: the same with the tokens the grammar forces drafted.

Reports the share of valid calls without and with the grammar, the
generation rate (tokens/s, time to first token excluded) of constrained calls
against free text, and the speed-up of forced-span drafting, as medians of the
per-prompt paired ratios. Writes ``<out>/tools.md``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.tools import DEFAULT, parse_tool_calls  # noqa: E402

import argparse  # noqa: E402
import itertools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jsonschema  # noqa: E402

S = {"type": "string", "maxLength": 24}
DATE = {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    params = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS = [
    _tool(
        "get_weather",
        "Current weather in a city.",
        {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}},
        ["city", "unit"],
    ),
    _tool("calculator", "Evaluate an arithmetic expression.", {"expression": S}, ["expression"]),
    _tool(
        "search_flights",
        "Find flights between two cities.",
        {
            "origin": S,
            "destination": S,
            "date": DATE,
            "passengers": {
                "type": "object",
                "properties": {
                    "adults": {"type": "integer", "minimum": 1, "maximum": 9},
                    "children": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["adults", "children"],
                "additionalProperties": False,
            },
        },
        ["origin", "destination", "date", "passengers"],
    ),
    _tool(
        "create_event",
        "Add an event to the calendar.",
        {
            "title": S,
            "start": {
                "type": "object",
                "properties": {"date": DATE, "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                "required": ["date", "hour"],
                "additionalProperties": False,
            },
            "attendees": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"name": S},
                    "required": ["name"],
                    "additionalProperties": False,
                },
            },
        },
        ["title", "start", "attendees"],
    ),
    _tool(
        "send_email",
        "Send an email.",
        {"to": S, "subject": S, "urgent": {"type": "boolean"}},
        ["to", "subject", "urgent"],
    ),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Rome", "Austin", "Seoul", "Lagos", "Quito"]
QUESTIONS = [
    lambda i: f"What is the weather in {CITIES[i]}?",
    lambda i: f"What is {12 + i} times {7 + 2 * i}?",
    lambda i: f"Find me a flight from {CITIES[i]} to {CITIES[(i + 3) % 10]} on 2027-0{1 + i % 9}-1{i} for two adults.",
    lambda i: f"Put a meeting with {CITIES[(i + 5) % 10]} team on 2027-03-{10 + i} at {9 + i}:00 in my calendar.",
    lambda i: f"Email sam@example.com that the report for {CITIES[i]} is late.",
]


def prompts(count: int) -> list[str]:
    return [QUESTIONS[i % 5](i // 5 % 10) for i in range(count)]


def valid_calls(calls) -> bool:
    """At least one call, and every call's arguments validate against its tool's schema."""
    if not calls:
        return False
    try:
        for call in calls:
            jsonschema.validate(call.arguments, SCHEMAS[call.name])
    except jsonschema.ValidationError:
        return False
    return True


SYSTEMS = {
    "free": dict(tool_choice="none"),
    "required": dict(tool_choice="required", structured_drafting=False),
    "required+forced": dict(tool_choice="required"),
}


def run_one(kit, prompt: list[int], system: str, max_tokens: int) -> dict:
    results = list(
        me.create_generator(
            kit, prompt, max_tokens=max_tokens, temp=0.0, tools=TOOLS, parallel_tool_calls=False, **SYSTEMS[system]
        )
    )
    stats = results[-1].stats
    if system == "free":
        text = kit.tokenizer.decode([t.id for r in results for t in r.tokens])
        calls = parse_tool_calls(DEFAULT, text, set(SCHEMAS))[1]
    else:
        calls = [c for r in results for c in r.tool_calls]
    return {
        "tps": stats.generation_tps,
        "tokens": stats.generated_tokens,
        "valid": valid_calls(calls),
        "forced": (stats.grammar_accepted_tokens, stats.grammar_drafted_tokens),
        "ids": [t.id for r in results for t in r.tokens],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    kit = me.load_model(me.DEFAULT_MODEL)
    questions = prompts(args.count)
    rendered = [me.apply_chat_template(kit, [{"role": "user", "content": q}], tools=TOOLS) for q in questions]
    run_one(kit, rendered[0], "required", 8)  # warm-up: the grammar tokenizer, kernels
    runs = {name: [] for name in SYSTEMS}
    order = itertools.cycle(
        [list(SYSTEMS), list(SYSTEMS)[1:] + list(SYSTEMS)[:1], list(SYSTEMS)[2:] + list(SYSTEMS)[:2]]
    )
    t0 = time.perf_counter()
    for i, (prompt, systems) in enumerate(zip(rendered, order)):
        for name in systems:
            runs[name].append(run_one(kit, prompt, name, args.max_tokens))
        line = ", ".join(f"{k} {v[-1]['tps']:.1f} tok/s{' valid' if v[-1]['valid'] else ''}" for k, v in runs.items())
        print(f"[{i + 1}/{len(rendered)}] {line}", flush=True)
    report = summarize(runs, questions, args, time.perf_counter() - t0)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tools.md").write_text(report)
    print(report)


def summarize(runs: dict, questions: list[str], args, seconds: float) -> str:
    n = len(questions)
    share = {k: sum(r["valid"] for r in v) / n for k, v in runs.items()}
    ratio = lambda a, b: statistics.median(x["tps"] / y["tps"] for x, y in zip(runs[a], runs[b]) if y["tps"] > 0)  # noqa: E731
    same = sum(a["ids"] == b["ids"] for a, b in zip(runs["required"], runs["required+forced"]))
    acc, drafted = (sum(r["forced"][i] for r in runs["required+forced"]) for i in (0, 1))
    rows = [
        f"| {k} | {share[k]:.0%} | {statistics.median(r['tps'] for r in v):.1f} | "
        f"{statistics.mean(r['tokens'] for r in v):.1f} |"
        for k, v in runs.items()
    ]
    return "\n".join(
        [
            f"# Tool calls: SmolLM2-135M-Instruct, {n} prompts, 5 tools, greedy, max_tokens={args.max_tokens}",
            "",
            f"`python -m bench.tools --count {args.count} --max-tokens {args.max_tokens}` ({seconds:.0f} s)",
            "",
            "| system | valid calls | median tok/s | mean tokens |",
            "|---|---|---|---|",
            *rows,
            "",
            f"- valid calls without the grammar: {share['free']:.0%}; with it: {share['required']:.0%} "
            f"(forced drafting: {share['required+forced']:.0%})",
            f"- constrained calls vs free text, tok/s, median of per-prompt ratios: {ratio('required', 'free'):.2f}x",
            f"- forced-span drafting on calls, tok/s: {ratio('required+forced', 'required'):.2f}x "
            f"(grammar-forced tokens accepted/drafted {acc}/{drafted}); identical tokens on {same}/{n} prompts",
            "",
        ]
    )


if __name__ == "__main__":
    main()
