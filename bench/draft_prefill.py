"""Draft prefill benchmark: ``python -m bench.draft_prefill [--reps 3] [--prompt-tokens 1500]``.

SmolLM2-135M-Instruct (float32 on the CPU, greedy, ``max_parallel=4``) with
``smollm2-135m-draft`` loaded: three plain requests decode, each consumed by
its own thread that stamps every token; once each is past its eighth token, a
draft-model request with a long prompt (about ``--prompt-tokens``) is admitted.
Reported per scenario: the admitted request's time to first token, and the
plain rows' gaps between tokens while it prefills (from its creation to its
first token): the longest and the median, against their median gap before it
was admitted. Scenarios: "cold" (neither model holds the prompt) and "draft
only" (the main model's prompt cache holds it, the draft model's caches do
not, so only the draft model prefills). The plain rows' end token is banned
(``logit_bias``) so they decode throughout. Writes
``<out>/draft_prefill.md`` and ``<out>/draft_prefill.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import inspect  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from .chat import chat_prompts  # noqa: E402
from .stats import bench_args, write_report  # noqa: E402

DRAFT = "smollm2-135m-draft"
PLAIN_ROWS = 3
WARM_TOKENS = 8  # tokens each plain row decodes before the long request is admitted


def long_prompt(kit, tokens: int, tag: int) -> list[int]:
    """A chat prompt of at most ``tokens`` tokens (the start of the standard
    library's ``statistics`` module, a text that does not change with this
    repository, as a document to summarise), opened by ``tag`` so that no
    round reuses another's prefix."""
    lines = inspect.getsource(statistics).splitlines()

    def build(n: int) -> list[int]:
        text = f"Document {tag}.\n" + "\n".join(lines[:n]) + "\nSummarise it."
        return me.apply_chat_template(kit, [{"role": "user", "content": text}])

    lo, hi = 1, len(lines)
    while lo < hi:  # the most lines that fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(build(mid)) <= tokens else (lo, mid - 1)
    return build(lo)


class _Row(threading.Thread):
    """A plain request consumed on its own thread, stamping each token."""

    def __init__(self, kit, prompt: list[int], stop: threading.Event):
        super().__init__(daemon=True)
        ban = {i: -1e9 for i in kit.eos_token_ids}
        self.gen = me.create_generator(kit, prompt, max_tokens=4000, speculative_decoding_toggle=False, logit_bias=ban)
        self.stop, self.stamps = stop, []

    def run(self) -> None:
        for r in self.gen:
            if r.tokens:
                self.stamps.append(time.perf_counter())
            if self.stop.is_set():
                break
        self.gen.close()


def one_round(kit, rows: list[list[int]], prompt: list[int], main_cached: bool, max_tokens: int) -> dict:
    """Admit the long draft-model request while the plain rows decode; its TTFT and the rows' gaps."""
    kit.prompt_cache.clear()
    if main_cached:  # the main model's prompt cache holds the prompt; the draft's caches do not
        for _ in me.create_generator(kit, prompt, max_tokens=1, speculative_decoding_toggle=False):
            pass
    stop = threading.Event()
    threads = [_Row(kit, p, stop) for p in rows]
    for t in threads:
        t.start()
    while min(len(t.stamps) for t in threads) < WARM_TOKENS:
        time.sleep(0.01)
    admitted = time.perf_counter()
    gen = me.create_generator(kit, prompt, max_tokens=max_tokens, speculative_decoding_toggle=True)
    ids = []
    for r in gen:
        if r.tokens and not ids:
            first = time.perf_counter()
        ids += [t.id for t in r.tokens]
    stop.set()
    for t in threads:
        t.join()
    before, during = [], []
    for t in threads:
        for a, b in zip(t.stamps, t.stamps[1:]):
            if b <= admitted:
                before.append(b - a)
            elif b <= first or a < first:  # a gap ending, or one still open, while the request prefilled
                during.append(b - a)
    return {
        "ttft": first - admitted,
        "max_gap": max(during),
        "median_gap": statistics.median(during),
        "median_gap_before": statistics.median(before[1:] or before),
        "ids": ids,
        "prompt_tokens": len(prompt),
    }


def measure(kit, reps: int, prompt_tokens: int, max_tokens: int) -> dict[str, list[dict]]:
    """Interleaved rounds of both scenarios, after a warm-up round."""
    texts = [text for _, text in chat_prompts().values()][:PLAIN_ROWS]
    rows = [me.apply_chat_template(kit, [{"role": "user", "content": t}]) for t in texts]
    one_round(kit, rows, long_prompt(kit, prompt_tokens // 4, 0), False, max_tokens)  # costs measured, caches laid out
    out: dict[str, list[dict]] = {"cold": [], "draft only": []}
    for rep in range(reps):
        for i, (name, cached) in enumerate((("cold", False), ("draft only", True))):
            out[name].append(one_round(kit, rows, long_prompt(kit, prompt_tokens, 1 + 2 * rep + i), cached, max_tokens))
    return out


def render(results: dict[str, list[dict]], label: str) -> list[str]:
    lines = [
        f"Draft prefill while {PLAIN_ROWS} plain rows decode ({label}); medians over rounds, seconds.",
        "",
        (
            "| scenario | prompt tokens | TTFT | rows' longest gap | rows' median gap while it prefills | "
            "rows' median gap before |"
        ),
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, rounds in results.items():
        med = {
            k: statistics.median(r[k] for r in rounds)
            for k in ("ttft", "max_gap", "median_gap", "median_gap_before", "prompt_tokens")
        }
        lines.append(
            f"| {name} | {med['prompt_tokens']:.0f} | {med['ttft']:.2f} | {med['max_gap']:.2f} | "
            f"{med['median_gap']:.2f} | {med['median_gap_before']:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    def extra(p):
        p.add_argument("--prompt-tokens", type=int, default=1500, help="the admitted request's prompt length")
        p.add_argument("--label", default="", help="a name for this run in the report (e.g. the commit)")

    args = bench_args("python -m bench.draft_prefill", __doc__.split("\n\n")[0], 3, 8, argv, extra)
    kit = me.load_model(me.DEFAULT_MODEL, max_parallel=PLAIN_ROWS + 1)
    me.load_draft_model(kit, DRAFT)
    results = measure(kit, args.reps, args.prompt_tokens, args.max_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"draft_prefill{'-' + args.label if args.label else ''}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
    return write_report(render(results, args.label or "this tree"), args.out, f"{name}.md")


if __name__ == "__main__":
    raise SystemExit(main())
