"""Hybrid-model benchmark: ``python -m bench.hybrid``.

Random-weight models of the same width and depth, built on the fly: an
attention model (llama), a Gated DeltaNet hybrid (qwen3_next: three of four
layers recurrent) and a Mamba-2 hybrid (granitemoehybrid). On each:

- **known answer**: a prompt answered once with plain decoding, then again
  with prompt lookup drafting that answer from the suffix memory (every draft
  is accepted, so the rewind machinery is measured, not the model): generation
  tokens/s against plain decoding, and mlx-lm's own plain ``generate_step``;
- **next turn**: time to first token of a conversation's next turn (the
  prefix resumed from the end-of-answer checkpoint) against the same prompt
  prefilled cold;
- **4 streams**: aggregate tokens/s of 4 parallel plain requests against one;
- **verify costs**: the kit's measured pass costs (a rejected round on a
  hybrid re-feeds its accepted tokens in the next pass: the cost of a wider pass).

Writes ``<out>/hybrid.md``. Random weights: speeds, not quality.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from fixtures.tiny_models import make_model  # noqa: E402

from .stats import bench_args, write_report  # noqa: E402

HIDDEN, LAYERS = 512, 8
SIZES = {
    "llama": dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=2 * HIDDEN, num_attention_heads=8,
                  num_key_value_heads=2),
    "qwen3_next": dict(num_hidden_layers=LAYERS, intermediate_size=2 * HIDDEN, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
                       linear_value_head_dim=64, num_experts=0, full_attention_interval=4),
    "granitemoehybrid": dict(num_hidden_layers=LAYERS, intermediate_size=2 * HIDDEN, num_attention_heads=8,
                             num_key_value_heads=2, mamba_n_heads=16, mamba_d_head=64, shared_intermediate_size=2 * HIDDEN,
                             layer_types=["mamba", "mamba", "mamba", "attention"] * (LAYERS // 4), attention_multiplier=0.125),
}  # fmt: skip
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


def gen_tps(kit, prompt: list[int], **kw) -> tuple[float, me.GenerationStats]:
    last = None
    for r in me.create_generator(kit, prompt, temp=0.0, **kw):
        last = r
    return last.stats.generation_tps, last.stats


def mlx_lm_tps(model, prompt: list[int], n: int) -> float:
    t0, count = None, 0
    for _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        t0 = t0 or time.perf_counter()
        count += 1
    return (count - 1) / (time.perf_counter() - t0)


def known_answer(kit, n: int, reps: int) -> tuple[float, float, float, float]:
    """Plain and known-answer tokens/s (best of ``reps``), the share of drafts
    accepted, and mlx-lm's plain tokens/s."""
    prompt = me.tokenize(kit, TEXT * 4)
    plain = max(gen_tps(kit, prompt, max_tokens=n)[0] for _ in range(reps))
    lookup, accepted, drafted = [], 0, 0
    for _ in range(reps):
        tps, stats = gen_tps(kit, prompt, max_tokens=n, prompt_lookup_num_tokens=32)
        lookup.append(tps)
        accepted, drafted = accepted + stats.accepted_tokens, drafted + stats.drafted_tokens
    return plain, max(lookup), accepted / max(drafted, 1), mlx_lm_tps(kit.model, prompt, n)


def next_turn(kit, reps: int) -> tuple[float, float, int]:
    """Next-turn and cold time to first token on a ~2,000-token conversation."""
    first = me.tokenize(kit, (TEXT * 40)[:7000])
    answer = []
    for r in me.create_generator(kit, first, max_tokens=16, temp=0.0):
        answer += [t.id for t in r.tokens]
    turn = first + answer + me.tokenize(kit, "\nNow rename Point to Vector.")
    warm, cold = [], []
    for _ in range(reps):
        _, stats = gen_tps(kit, turn, max_tokens=1)
        warm.append(stats.time_to_first_token)
        kit.prompt_cache.clear()
        cold.append(gen_tps(kit, turn, max_tokens=1)[1].time_to_first_token)
        kit.prompt_cache.clear()
        gen_tps(kit, first + answer, max_tokens=1)  # the conversation so far, cached again
    return min(warm), min(cold), len(turn)


def streams(kit, n: int) -> tuple[float, float]:
    prompts = [me.tokenize(kit, f"{i}: " + TEXT) for i in range(4)]
    one = gen_tps(kit, prompts[0], max_tokens=n)[0]
    done = []

    def run(p):
        done.append(sum(len(r.tokens) for r in me.create_generator(kit, p, max_tokens=n, temp=0.0)))

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return one, sum(done) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    args = bench_args("bench.hybrid", __doc__.splitlines()[0], reps=2, max_tokens=96, argv=argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tok = make_model(Path(tmp) / "tok", "llama")
        for arch, overrides in SIZES.items():
            path = make_model(Path(tmp) / arch, arch, hidden=HIDDEN, tokenizer_from=tok, overrides=overrides)
            kit = me.load_model(path)
            params = sum(v.size for _, v in __import__("mlx.utils").utils.tree_flatten(kit.model.parameters()))
            plain, lookup, acc, mlx_lm = known_answer(kit, args.max_tokens, args.reps)
            warm, cold, n_turn = next_turn(kit, args.reps)
            one, four = streams(kit, args.max_tokens // 2)
            costs = kit.forward_costs().summary()
            rows.append((arch, params, plain, lookup, acc, mlx_lm, warm, cold, n_turn, one, four, costs))
            me.unload(kit)
    base = rows[0][3] / rows[0][2]
    lines = [
        "# Hybrid models (random weights, float32, CPU)",
        "",
        f"Width {HIDDEN}, {LAYERS} layers; {args.max_tokens} generated tokens; best of {args.reps}.",
        "",
        "| model | params | plain tok/s | known answer tok/s (accepted) | speed-up | vs llama's | mlx-lm plain | next-turn TTFT | cold TTFT (tokens) | ratio | 1 stream | 4 streams | verify costs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for arch, params, plain, lookup, acc, mlx_lm, warm, cold, n_turn, one, four, costs in rows:
        up = lookup / plain
        lines.append(
            f"| {arch} | {params / 1e6:.1f}M | {plain:.1f} | {lookup:.1f} ({acc:.0%}) | {up:.2f}x | {up / base:.2f} | {mlx_lm:.1f} "
            f"| {warm * 1e3:.0f} ms | {cold * 1e3:.0f} ms ({n_turn}) | {warm / cold:.3f} | {one:.1f} | {four:.1f} | {costs} |"
        )
    return write_report(lines, args.out, "hybrid.md")


if __name__ == "__main__":
    raise SystemExit(main())
