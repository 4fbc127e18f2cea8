"""Concurrency benchmark: ``python -m bench.concurrency [--reps 2] [--streams 1 2 4 8]``.

SmolLM2-135M-Instruct (float32 on the CPU, greedy) serving 1, 2, 4 and 8
requests at once on one kit, each consumed by its own thread, in three modes:
plain, prompt lookup and auto. Two prompt sets from ``bench.chat``: "mixed"
(all chat workloads, cycled) and "copy" (the edit and quote workloads, where
lookup pays). Reported per streams x mode: aggregate throughput (all tokens of
all requests over the wall time from the first request to the last result),
its paired ratio to one stream serving the same requests one after another
(plain decoding) and to plain at the same concurrency, and whether each
request's output equals its solo plain output. A second part
measures the time to first token of a request admitted while three others
decode, against the same request alone. Writes ``<out>/concurrency.md`` and
``<out>/concurrency.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from .chat import chat_prompts  # noqa: E402
from .machine import machine_info  # noqa: E402
from .stats import bench_args, format_paired, median, paired_ratio, write_report  # noqa: E402

STREAMS = (1, 2, 4, 8)
MODES = {"plain": {}, "lookup": {"prompt_lookup_num_tokens": 8}, "auto": {"auto_speculative": True}}
COPY = ("edit-rename", "edit-param", "quote-doc", "continue-list")


def prompt_sets(kit: me.ModelKit) -> dict[str, list[list[int]]]:
    texts = {name: text for name, (_, text) in chat_prompts().items()}
    ids = {n: me.apply_chat_template(kit, [{"role": "user", "content": t}]) for n, t in texts.items()}
    return {"mixed": list(ids.values()), "copy": [ids[n] for n in COPY]}


def run_streams(
    kit, prompts: list[list[int]], max_tokens: int, mode: dict, one_stream: bool = False
) -> tuple[float, list[list[int]]]:
    """All ``prompts`` at once (or one after another with ``one_stream``);
    returns (aggregate tok/s, each request's ids)."""
    outs: list = [None] * len(prompts)

    def one(i: int) -> None:
        ids = []
        for r in me.create_generator(kit, prompts[i], max_tokens=max_tokens, **mode):
            ids += [t.id for t in r.tokens]
        outs[i] = ids

    kit.prompt_cache.clear()  # every run starts cold
    start = time.perf_counter()
    if one_stream:
        for i in range(len(prompts)):
            one(i)
    else:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    seconds = time.perf_counter() - start
    return sum(len(o) for o in outs) / seconds, outs


def first_token_seconds(kit, prompt: list[int], max_tokens: int, others: list[list[int]]) -> float:
    """Seconds from creating a request to its first token, with ``others``
    already decoding (each past its fifth token)."""
    kit.prompt_cache.clear()
    running = [me.create_generator(kit, p, max_tokens=max_tokens) for p in others]
    for g in running:
        n = 0
        while n < 5:
            n += len(next(g).tokens)
    start = time.perf_counter()
    gen = me.create_generator(kit, prompt, max_tokens=4)
    while not next(gen).tokens:
        pass
    seconds = time.perf_counter() - start
    gen.close()
    for g in running:
        g.close()
    return seconds


def measure(kit, sets, reps: int, max_tokens: int, streams: tuple[int, ...] = STREAMS) -> tuple[dict, dict]:
    """Interleaved rounds (after a short warm-up): per (set, streams), the same
    requests served by one stream in turn, then at once in every mode."""
    run_streams(kit, sets["mixed"][:2], 8, {})
    rates: dict = {}
    outputs: dict = {}
    for _ in range(reps):
        for set_name, prompts in sets.items():
            for n in streams:
                chosen = [prompts[i % len(prompts)] for i in range(n)]
                rate, _ = run_streams(kit, chosen, max_tokens, {}, one_stream=True)
                rates.setdefault((set_name, n, "one stream"), []).append(rate)
                for mode_name, mode in MODES.items():
                    rate, outs = run_streams(kit, chosen, max_tokens, mode)
                    rates.setdefault((set_name, n, mode_name), []).append(rate)
                    outputs.setdefault((set_name, n, mode_name), outs)
    return rates, outputs


def exactness(kit, sets, outputs, max_tokens: int) -> dict:
    """For each run: how many requests equal their prompt's solo plain output."""
    solo: dict = {}
    for prompts in sets.values():
        for p in prompts:
            key = tuple(p)
            if key not in solo:
                solo[key] = [t.id for r in me.create_generator(kit, p, max_tokens=max_tokens) for t in r.tokens]
    same = {}
    for (set_name, n, mode_name), outs in outputs.items():
        chosen = [sets[set_name][i % len(sets[set_name])] for i in range(n)]
        same[(set_name, n, mode_name)] = sum(o == solo[tuple(p)] for o, p in zip(outs, chosen))
    return same


def render(rates, same, ttft, reps: int, max_tokens: int) -> list[str]:
    lines = [
        f"SmolLM2-135M-Instruct, float32 on the CPU, greedy, up to {max_tokens} new tokens per request, "
        f"{reps} interleaved rounds; ratios paired per round (95% bootstrap interval).",
        "",
        "| prompts | streams | mode | aggregate tok/s | vs one stream in turn | vs plain, same streams | equal to solo |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for (set_name, n, mode_name), rs in rates.items():
        if mode_name == "one stream":
            lines.append(f"| {set_name} | {n} | one stream, plain, in turn | {median(rs):.1f} | 1.00 | | |")
            continue
        one = paired_ratio(rs, rates[(set_name, n, "one stream")])
        plain = paired_ratio(rs, rates[(set_name, n, "plain")])
        lines.append(
            f"| {set_name} | {n} | {mode_name} | {median(rs):.1f} | {format_paired(one.ratio, one.low, one.high)} | "
            f"{format_paired(plain.ratio, plain.low, plain.high)} | {same[(set_name, n, mode_name)]}/{n} |"
        )
    alone, admitted = ttft
    lines += [
        "",
        "| time to first token | median s |",
        "|---|---:|",
        f"| alone | {median(alone):.3f} |",
        f"| admitted while 3 others decode | {median(admitted):.3f} |",
        f"| ratio | {median(admitted) / median(alone):.2f} |",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--streams", type=int, nargs="+", default=list(STREAMS), help="concurrency levels")
    # Off by default: every round repeats the same prompts, which the suffix
    # memory would draft from earlier rounds (bench.agentic measures that).
    pre.add_argument("--suffix-memory-tokens", type=int, default=0, help="the kit's suffix memory (0: off)")
    known, rest = pre.parse_known_args(argv)
    args = bench_args("python -m bench.concurrency", __doc__.split("\n\n")[0], 2, 96, rest)
    streams = tuple(sorted(set(known.streams) | {1}))
    kit = me.load_model(
        me.DEFAULT_MODEL, max_parallel=max(max(streams), 4), suffix_memory_tokens=known.suffix_memory_tokens
    )
    sets = prompt_sets(kit)
    rates, outputs = measure(kit, sets, args.reps, args.max_tokens, streams)
    same = exactness(kit, sets, outputs, args.max_tokens)
    mixed = sets["mixed"]
    alone = [first_token_seconds(kit, mixed[0], args.max_tokens, []) for _ in range(args.reps + 1)][1:]
    admitted = [first_token_seconds(kit, mixed[0], args.max_tokens, mixed[1:4]) for _ in range(args.reps + 1)][1:]
    lines = render(rates, same, (alone, admitted), args.reps, args.max_tokens)
    lines += ["", f"Machine: {machine_info()}"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "concurrency.json").write_text(
        json.dumps(
            {
                "rates": {f"{k[0]}/{k[1]}/{k[2]}": v for k, v in rates.items()},
                "equal_to_solo": {f"{k[0]}/{k[1]}/{k[2]}": v for k, v in same.items()},
                "ttft_alone": alone,
                "ttft_admitted": admitted,
            },
            indent=1,
        )
    )
    return write_report(lines, args.out, "concurrency.md")


if __name__ == "__main__":
    raise SystemExit(main())
