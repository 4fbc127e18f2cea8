"""A head's chained step, timed against the target's single step (what the
router and the adaptive length price a head's draft by)."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .capture import HiddenSpec
from .model import Head


def hidden_width(main: nn.Module, spec: HiddenSpec) -> int:
    """The width of the rows ``spec`` records on ``main`` (per point: the model's hidden size)."""
    from .capture import text_model

    return len(spec.points) * text_model(main).embed_tokens.weight.shape[-1]


def measure_head_step_ratio(main: nn.Module, head: Head, vocab_size: int, chain: int = 4, context: int = 32) -> float:
    """A chained head step (its greedy pick included, as the drafter chains
    them) in single steps of ``main``, the two timed in turn (the median of 3)."""
    key = mx.random.key(5)
    tokens = mx.random.randint(0, vocab_size, (context + 1,), key=key)
    width = hidden_width(main, head.spec)
    hidden = mx.random.normal((1, context, width), key=key) * 0.1
    cache = make_prompt_cache(main)
    mx.eval(main(tokens[:context][None], cache=cache))

    def main_step() -> float:
        t0 = time.perf_counter()
        mx.eval(main(tokens[context:][None], cache=cache)[:, -1])
        for layer in cache:
            if layer.is_trimmable():
                layer.trim(1)
        return time.perf_counter() - t0

    def head_steps() -> float:
        kv = head.new_cache()
        h = head.forward(kv, tokens[1 : context + 1][None], hidden, 0)
        mx.eval(h)
        t0 = time.perf_counter()
        for j in range(chain):
            y = head.to_target(mx.argmax(head.logits(h[:, -1:])[0, -1]))
            h = head.chained(head.forward(kv, y.reshape(1, 1), h[:, -1:], context + j))
            mx.eval(h)
        return (time.perf_counter() - t0) / chain

    pairs = [(head_steps(), main_step()) for _ in range(4)][1:]  # the first: warm-up
    ratios = sorted(d / m for d, m in pairs)
    return ratios[len(ratios) // 2]
