"""Prompt-cache benchmark: ``python -m bench.prompt_cache``.

On SmolLM2-135M-Instruct (float32 on the CPU), time to first token of:

- **switch**: the next turn of chat A after a turn of chat B (two ~2,000-token chats);
- **regenerate**: the same prompt again (a branch of the cached answer);
- **disk**: the next turn of chat A in a new kit (a restart) with the disk tier;

each against the same prompt from an empty cache (cold). Then 200 requests over 20
conversations under a small memory budget (the largest ``memory_bytes`` seen), and
prompt lookup with and without lookup memory on a second chat quoting the first.
Writes ``<out>/prompt_cache.md``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import inspect  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402

from .stats import bench_args, write_report  # noqa: E402

QUESTION = "\n\nWhat does the function above do? Answer in one sentence."


def document(seed: int, n_chars: int = 7000) -> str:
    """A long code document from the standard library (different per seed)."""
    import difflib
    import json.decoder
    import shlex

    text = "".join(inspect.getsource(m) for m in (textwrap, shlex, difflib, json.decoder))
    start = (seed * 9973) % (len(text) - n_chars)
    return text[start : start + n_chars]


def ttft(kit, prompt: list[int], **kw) -> tuple[float, list[int], me.GenerationStats]:
    t0, first, ids, last = time.perf_counter(), None, [], None
    for r in me.create_generator(kit, prompt, max_tokens=kw.pop("max_tokens", 16), temp=0.0, **kw):
        first = first or time.perf_counter()
        ids += [t.id for t in r.tokens]
        last = r
    return first - t0, ids, last.stats


def cold(kit, prompt: list[int]) -> float:
    kit.prompt_cache.clear()
    return ttft(kit, prompt)[0]


def chat(kit, text: str) -> list[int]:
    return me.apply_chat_template(kit, [{"role": "user", "content": text}])


def next_turn(kit, prompt: list[int], answer: list[int]) -> list[int]:
    return (
        prompt
        + answer
        + me.tokenize(
            kit,
            "<|im_end|>\n<|im_start|>user\nAnd in fewer words?<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
    )


def switching(kit, reps: int) -> list[str]:
    rows = []
    for r in range(reps):
        kit.prompt_cache.clear()
        a, b = chat(kit, document(2 * r) + QUESTION), chat(kit, document(2 * r + 1) + QUESTION)
        _, a_ans, _ = ttft(kit, a)
        ttft(kit, b)
        a2 = next_turn(kit, a, a_ans)
        t_switch, _, s = ttft(kit, a2)
        t_regen, _, s2 = ttft(kit, a2)
        rows.append((len(a2), t_switch, s.cache_source, t_regen, s2.cache_source, cold(kit, a2)))
    return [
        f"| {n} | {ts:.2f} ({src}) | {tr:.2f} ({src2}) | {tc:.2f} | {ts / tc:.1%} | {tr / tc:.1%} |"
        for n, ts, src, tr, src2, tc in rows
    ]


def disk(reps: int) -> list[str]:
    rows = []
    for r in range(reps):
        with tempfile.TemporaryDirectory() as d:
            kit = me.load_model(me.DEFAULT_MODEL, prompt_cache_dir=d)
            a = chat(kit, document(10 + r) + QUESTION)
            _, a_ans, _ = ttft(kit, a)
            me.unload(kit)
            kit = me.load_model(me.DEFAULT_MODEL, prompt_cache_dir=d)
            a2 = next_turn(kit, a, a_ans)
            t_disk, _, s = ttft(kit, a2)
            kit.prompt_cache.disk = None  # cold: neither memory nor disk
            t_cold = cold(kit, a2)
            rows.append(f"| {len(a2)} | {t_disk:.2f} ({s.cache_source}) | {t_cold:.2f} | {t_disk / t_cold:.1%} |")
            me.unload(kit)
    return rows


def soak(n_requests: int = 200, n_chats: int = 20, budget: int = 64 * 2**20) -> str:
    kit = me.load_model(me.DEFAULT_MODEL, prompt_cache_bytes=budget)
    rng = random.Random(0)
    first = {c: chat(kit, document(100 + c, 600) + QUESTION) for c in range(n_chats)}
    chats = dict(first)
    peak, hits = 0, 0
    for _ in range(n_requests):
        c = rng.randrange(n_chats)
        _, ans, s = ttft(kit, chats[c], max_tokens=8)
        nxt = next_turn(kit, chats[c], ans)
        chats[c] = nxt if len(nxt) < 1500 else first[c]  # a chat that grew long starts over
        hits += s.cached_tokens > 0
        peak = max(peak, kit.prompt_cache.memory_bytes())
    return (
        f"{n_requests} requests over {n_chats} chats, budget {budget / 2**20:.0f} MiB: largest cache "
        f"{peak / 2**20:.1f} MiB, {len(kit.prompt_cache.entries)} entries at the end, {hits} requests reused a prefix"
    )


def lookup_memory(kit, reps: int) -> str:
    """The same question in a new chat (another system prompt, so no shared
    prefix): prompt lookup can draft the answer from the first chat."""
    question = "Write a Python function that checks whether a string is a palindrome, with a docstring."
    first = me.apply_chat_template(
        kit, [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}]
    )
    second = me.apply_chat_template(
        kit, [{"role": "system", "content": "You are a Python expert."}, {"role": "user", "content": question}]
    )
    ratios = []
    for _ in range(reps):
        kit.prompt_cache.clear()
        ttft(kit, first, max_tokens=160)
        _, ids_mem, s_mem = ttft(kit, second, max_tokens=160, prompt_lookup_num_tokens=8)
        kit.prompt_cache.entries = [kit.prompt_cache.entries[-1]]  # the same request without the first chat
        kit.prompt_cache.active.reset()
        _, ids_own, s_own = ttft(kit, second, max_tokens=160, prompt_lookup_num_tokens=8)
        assert ids_mem == ids_own, "lookup memory changed greedy output"
        if s_mem.generation_tps and s_own.generation_tps:  # None: no token after the first round
            ratios.append(s_mem.generation_tps / s_own.generation_tps)
    return (
        f"the same question in a second chat, prompt lookup: {statistics.median(ratios):.2f}x generation tok/s "
        f"with lookup memory (median of {reps}; accepted {s_mem.accepted_tokens}/{s_mem.drafted_tokens} drafts "
        f"against {s_own.accepted_tokens}/{s_own.drafted_tokens} without; same output)"
    )


def main(argv: list[str] | None = None) -> int:
    args = bench_args("python -m bench.prompt_cache", __doc__.split("\n\n")[0], 3, 16, argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    kit = me.load_model(me.DEFAULT_MODEL)
    lines = [
        "| prompt tokens | switch back (s) | regenerate (s) | cold (s) | switch / cold | regenerate / cold |",
        "|---:|---:|---:|---:|---:|---:|",
        *switching(kit, args.reps),
        "",
        "| prompt tokens | after restart, disk tier (s) | cold (s) | disk / cold |",
        "|---:|---:|---:|---:|",
        *disk(args.reps),
        "",
        "- " + soak(),
        "- " + lookup_memory(kit, args.reps),
    ]
    return write_report(lines, args.out, "prompt_cache.md")


if __name__ == "__main__":
    raise SystemExit(main())
