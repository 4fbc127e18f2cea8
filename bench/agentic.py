"""Agentic workloads: ``python -m bench.agentic [--reps 2] [--max-tokens 64]``.

SmolLM2-135M-Instruct (GGUF, float32 on the CPU), greedy, on conversations
that repeat themselves the way agent harnesses and chat apps do:

- ``known-answer``: a question, then the same question in a new chat (a
  regenerate, a retried agent step, a second user asking the same);
- ``code-edit``: one chat in which the model writes a function, then re-emits
  it whole with a rename, then with a docstring;
- ``code-rewrite``: one chat in which the model writes a class, code only, then
  is asked twice for the whole class again with an edit (an agent rewriting a
  file): most of each answer re-emits the class;
- ``tool-calls``: the same tool offered in three new chats with different
  arguments (``apply_chat_template(tools=...)``, ``create_generator(tools=...)``);
- ``json-shape``: three new chats asking for an answer in the same JSON shape;
- ``revisit``: one chat that returns to its first question after another topic;
- ``other-system``: the same question in two new chats under two other system
  prompts (an app's presets, an agent's roles): the answer can be copied, the
  prompt's head cannot be reused.

Each turn's prompt holds the model's own earlier answers. Systems: plain
decoding, prompt lookup (32 tokens) and auto, each with the kit's suffix
memory (``suffix_memory_tokens``, docs/decoding.md) and without it (lookup
then drafts from the kit's other cached conversations, as before suffix
drafting). Every system runs every scenario from an empty prompt cache and an
empty suffix memory, systems interleaved in a rotating order each round.
Reported per turn: the turn's speed-up over plain decoding (plain's wall time /
the system's, prefill included, paired per round, geometric mean over rounds),
accepted drafts, and whether the output equals plain's. On a shared machine
absolute rates drift; the paired ratios are what to read. Beside the timed
ratio, each turn's *priced* speed-up takes timing out: the rounds the system
ran (from its statistics: drafted rounds, drafts, accepted tokens) priced by one
fixed cost line, a round of k drafts costing ``1 + JUMP + SLOPE*k`` undrafted
rounds (``--price-line``, default the default model's chat line on this CPU,
0.27+0.07k), so two trees that made the same decisions read the same and a
worse decision shows without noise. With ``--fixed-costs JUMP+SLOPEk`` every
round is priced at that line and nothing is learned from timings
(``fix_costs``), so decisions depend on the text alone and two trees compare
turn by turn without noise (the priced column; the timed one still times). Writes
``<out>/agentic.md`` and ``<out>/agentic.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.drafters.suffix import SuffixMemory  # noqa: E402
from mlx_engine.pricing import costs  # noqa: E402

import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import NamedTuple  # noqa: E402

from .machine import machine_info  # noqa: E402
from .replay_core import parse_line  # noqa: E402
from .stats import bench_args, geomean  # noqa: E402

logger = logging.getLogger("bench")

#: The priced speed-up's cost line (--price-line): the default model's chat line on this CPU.
PRICE_LINE = "0.27+0.07k"


class System(NamedTuple):
    name: str
    kwargs: dict
    suffix_memory: bool


SYSTEMS = (
    System("plain", {"speculative_decoding_toggle": False}, True),
    System("lookup", {"prompt_lookup_num_tokens": 32}, False),
    System("suffix", {"prompt_lookup_num_tokens": 32}, True),
    System("auto", {"auto_speculative": True}, False),
    System("auto-suffix", {"auto_speculative": True}, True),
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}

QUESTION = "Explain what a Python decorator is, with a short example."
#: scenario -> turns of (chat id, user message); a new chat id starts a new conversation.
SCENARIOS: dict[str, list[tuple[str, str]]] = {
    "known-answer": [("a", QUESTION), ("b", QUESTION)],
    "code-edit": [
        ("a", "Write a Python function `word_count(text)` that returns a dict mapping each word to its count."),
        ("a", "Rename the function to `count_words` and return the whole function."),
        ("a", "Add a docstring to the function and return the whole function."),
    ],
    "code-rewrite": [
        ("a", "Write a Python class `Stack` with push, pop, peek and is_empty methods. Reply with the code only."),
        ("a", "Add a `size` method and reply with the whole class, code only."),
        ("a", "Rename the class to `LifoStack` and reply with the whole class, code only."),
    ],
    "tool-calls": [(c, f"What is the weather in {c} right now?") for c in ("Paris", "Tokyo", "Lima")],
    "json-shape": [
        (
            c,
            f"Give the capital, continent and official language of {c} as JSON with the keys "
            '"country", "capital", "continent" and "language".',
        )
        for c in ("France", "Japan", "Brazil")
    ],
    "revisit": [
        ("a", QUESTION),
        ("a", "What is a Python list comprehension?"),
        ("a", "Back to the first question: " + QUESTION),
    ],
    "other-system": [("tutor", QUESTION), ("reviewer", QUESTION)],
}
#: chat id -> the system prompt a new chat of that id starts with (others have none).
CHAT_SYSTEM_PROMPTS = {
    "tutor": "You are a patient programming tutor. Explain clearly and give examples.",
    "reviewer": "You are a senior Python developer who reviews code for a team.",
}


class Turn(NamedTuple):
    tokens: list[int]
    seconds: float
    decode_seconds: float  # after the first token (prefill excluded)
    accepted: int
    mode: str | None
    drafted: int = 0  # draft tokens verified
    rounds: int = 0  # rounds that verified drafts


def priced(turn: Turn, line: tuple[float, float]) -> float:
    """The turn's decoding after its first token in undrafted-round units: each
    round yields its accepted drafts and one token more, an undrafted round costs
    1, a round of k drafts ``1 + jump + slope*k`` (plain decoding: tokens - 1)."""
    jump, slope = line
    undrafted = max(len(turn.tokens) - 1 - turn.accepted - turn.rounds, 0)
    return undrafted + turn.rounds * (1 + jump) + slope * turn.drafted


def fix_costs(kit: me.ModelKit, line: tuple[float, float]) -> None:
    """``--fixed-costs``: every request of ``kit`` prices rounds at ``line`` (a
    pass of n tokens ``1 + JUMP + SLOPE*(n-1)`` single steps) and learns nothing
    from timed rounds, so the router's decisions depend on the text alone: two
    trees compare decision by decision, with no timing noise and no cost
    measurement in between. A measurement device, not a way to run the engine:
    it replaces this process's ``RoundCosts.observe`` and the kit's costs."""
    jump, slope = line
    fixed = costs.CostModel(
        tuple(0.1 * (1.0 if n == 1 else 1 + jump + slope * (n - 1)) for n in range(1, costs.MAX_DRAFT + 2))
    )
    kit.forward_costs = lambda: fixed
    costs.RoundCosts.observe = lambda self, k, seconds=None: None


def run_scenario(kit: me.ModelKit, system: System, turns: list[tuple[str, str]], max_tokens: int) -> list[Turn]:
    """One system through one scenario, from an empty prompt cache and suffix memory."""
    kit.prompt_cache.clear()
    kit.suffix_memory = SuffixMemory() if system.suffix_memory else None
    tools = [WEATHER_TOOL] if turns and "weather" in turns[0][1] else None
    chats: dict[str, list[dict]] = {}
    out = []
    for chat, text in turns:
        system_prompt = CHAT_SYSTEM_PROMPTS.get(chat)
        messages = chats.setdefault(chat, [{"role": "system", "content": system_prompt}] if system_prompt else [])
        messages.append({"role": "user", "content": text})
        prompt = me.apply_chat_template(kit, messages, tools=tools)
        tokens, final, pieces, first = [], None, [], None
        t0 = time.perf_counter()
        for r in me.create_generator(kit, prompt, max_tokens=max_tokens, temp=0.0, tools=tools, **system.kwargs):
            if first is None and r.tokens:
                first = time.perf_counter()
            tokens.extend(t.id for t in r.tokens)
            pieces.append(r.text)
            final = r
        end = time.perf_counter()
        seconds, decode = end - t0, end - (first if first is not None else t0)
        stats = final.stats if final is not None else None
        out.append(
            Turn(
                tokens,
                seconds,
                decode,
                stats.accepted_tokens,
                stats.decoding_mode,
                stats.drafted_tokens,
                stats.verify_rounds,
            )
            if stats is not None
            else Turn(tokens, seconds, decode, 0, None)
        )
        messages.append({"role": "assistant", "content": "".join(pieces)})
    return out


def measure(kit, systems, scenarios, reps: int, max_tokens: int) -> dict:
    """runs[scenario][system] = one list of turns per round, after a warm-up
    (each system's first turn of the first scenario: compiles, measures costs)."""
    runs = {s: {sys.name: [] for sys in systems} for s in scenarios}
    first = next(iter(scenarios.values()))[:1]
    for system in systems:
        run_scenario(kit, system, first, max_tokens)
    for rnd in range(1, reps + 1):
        order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
        for name, turns in scenarios.items():
            for system in order:
                result = run_scenario(kit, system, turns, max_tokens)
                runs[name][system.name].append(result)
        logger.info("round %d of %d done", rnd, reps)
    return runs


def analyse(runs: dict, systems, line: tuple[float, float]) -> tuple[list[dict], dict]:
    rows = []
    for scenario, by_system in runs.items():
        plain = by_system["plain"]
        for t in range(len(plain[0])):
            for system in systems:
                rounds = by_system[system.name]
                ratios = [p[t].seconds / r[t].seconds for p, r in zip(plain, rounds)]
                decode = [p[t].decode_seconds / max(r[t].decode_seconds, 1e-9) for p, r in zip(plain, rounds)]
                costs = [priced(r[t], line) for r in rounds]
                rows.append(
                    {
                        "scenario": scenario,
                        "turn": t + 1,
                        "system": system.name,
                        "new_tokens": len(rounds[0][t].tokens),
                        "speedup": geomean(ratios),
                        "decode_speedup": geomean(decode),
                        "ratios": ratios,
                        "priced": geomean([max(len(r[t].tokens) - 1, 1) / max(c, 1e-9) for r, c in zip(rounds, costs)]),
                        "priced_runs": [round(c, 2) for c in costs],
                        "seconds": [round(r[t].seconds, 4) for r in rounds],
                        "decode_seconds": [round(r[t].decode_seconds, 4) for r in rounds],
                        "accepted": rounds[0][t].accepted,
                        "mode": rounds[0][t].mode,
                        "same_as_plain": all(r[t].tokens == plain[0][t].tokens for r in rounds),
                    }
                )
    summary = {}
    for system in systems:
        mine = [r for r in rows if r["system"] == system.name]
        summary[system.name] = tuple(geomean([r[k] for r in mine]) for k in ("speedup", "decode_speedup", "priced"))
    return rows, summary


def render(rows: list[dict], summary: dict, reps: int, max_tokens: int) -> str:
    names = list(summary)
    lines = [
        f"SmolLM2-135M-Instruct, float32 on the CPU, greedy, up to {max_tokens} new tokens, {reps} measured "
        "rounds after a warm-up. Speed-up over plain decoding per turn: plain's wall time / the "
        "system's (prefill included), paired per round, geometric mean; in brackets the speed-up its "
        "rounds priced at the fixed cost line (no timing: decisions only). The machine is shared: read "
        "the ratios, not absolute rates.",
        "",
        "| scenario | turn | new | "
        + " | ".join(names)
        + " | accepted ("
        + ", ".join(names[1:])
        + ") | same as plain |",
        "|---|---:|---:|" + "---:|" * len(names) + "---|---|",
    ]
    keyed = {(r["scenario"], r["turn"], r["system"]): r for r in rows}
    for scenario, turn in dict.fromkeys((r["scenario"], r["turn"]) for r in rows):
        cells = [keyed[(scenario, turn, n)] for n in names]
        same = (
            "yes"
            if all(c["same_as_plain"] for c in cells)
            else "NO: " + ",".join(c["system"] for c in cells if not c["same_as_plain"])
        )
        lines.append(
            f"| {scenario} | {turn} | {cells[0]['new_tokens']} | "
            + " | ".join(
                f"{c['speedup']:.2f}" + ("" if c["system"] == "plain" else f" ({c['priced']:.2f})") for c in cells
            )
            + " | "
            + ", ".join(str(c["accepted"]) for c in cells[1:])
            + f" | {same} |"
        )
    lines += [
        "",
        "| system | geomean speed-up over plain, all turns (wall) | the same, after the first token | priced |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {n} | {w:.2f} | {d:.2f} | {c:.2f} |" for n, (w, d, c) in summary.items() if not math.isnan(w)]
    return "\n".join(lines) + "\n"


def _extra_args(p) -> None:
    p.add_argument("--scenarios", help=f"comma-separated subset of: {', '.join(SCENARIOS)}")
    p.add_argument("--systems", help=f"comma-separated subset of: {', '.join(s.name for s in SYSTEMS)} (plain always)")
    p.add_argument(
        "--fixed-costs",
        metavar="JUMP+SLOPEk",
        help="price every round at this line and learn nothing from timings (fix_costs): deterministic decisions",
    )
    p.add_argument(
        "--price-line",
        default=PRICE_LINE,
        help="JUMP+SLOPEk: a round of k drafts priced 1 + JUMP + SLOPE*k undrafted rounds (the priced speed-up)",
    )


def main(argv: list[str] | None = None) -> int:
    args = bench_args("python -m bench.agentic", __doc__.split("\n\n")[0], 2, 64, argv, _extra_args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kit = me.load_model(me.DEFAULT_MODEL)
    if args.fixed_costs:
        fix_costs(kit, parse_line("fixed=" + args.fixed_costs)[1])
    systems = [s for s in SYSTEMS if not args.systems or s.name in args.systems.split(",") or s.name == "plain"]
    scenarios = {k: v for k, v in SCENARIOS.items() if not args.scenarios or k in args.scenarios.split(",")}
    runs = measure(kit, systems, scenarios, args.reps, args.max_tokens)
    rows, summary = analyse(runs, systems, parse_line("price=" + args.price_line)[1])
    text = render(rows, summary, args.reps, args.max_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agentic.md").write_text(text)
    (args.out / "agentic.json").write_text(
        json.dumps({"machine": machine_info(), "rows": rows, "summary": summary}, indent=1)
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
