"""The kit's loaded head (``HeadDraft``, in the kit's draft slot) and what one
request keeps of it: its head cache (``HeadState``) and the hidden states
recorded for it and not yet fed to the head (``HiddenTrail``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..decode import capture
from ..decode.capture import HiddenSpec, Installed
from ..draft.model import AcceptanceRecord
from ..pricing import cost_store


class Head(Protocol):
    """A head bound to its target (eagle3.Eagle3Head, mtp.MTPHead)."""

    kind: str
    spec: HiddenSpec
    draft_vocab: int
    net: nn.Module

    def new_cache(self) -> list: ...
    def forward(self, cache: list, tokens: mx.array, hidden: mx.array, position: int) -> mx.array: ...
    def logits(self, h: mx.array) -> mx.array: ...
    def to_target(self, ids: mx.array) -> mx.array: ...
    def chained(self, h: mx.array) -> mx.array: ...


@dataclass
class HeadDraft(AcceptanceRecord):
    """A loaded head: what ``kit.draft`` holds when the draft is a head. It
    has no cache pool (each request's head state is its own ``HeadState``)
    and no draft batch (each row drafts with its own state)."""

    path: Path
    head: Head
    num_params: int
    description: str = ""
    installed: Installed | None = None  # the capture points on the target (attach; removed at close)
    step_ratio: float | None = None
    batch: None = None  # no draft batch: the scheduler's draft-batch hooks find none
    drafted_seen: float = 0.0
    accepted_seen: float = 0.0

    @property
    def model(self) -> nn.Module:
        """The head's network (its weights are what a host counts for the draft)."""
        return self.head.net

    def chained_step_ratio(self, main: nn.Module, vocab_size: int, key: dict | None = None) -> float:
        """A chained head step in single steps of the target; stored under ``key``."""
        if self.step_ratio is None:
            self.step_ratio = cost_store.stored_ratio(key, lambda: measure_head_step_ratio(main, self.head, vocab_size))
        return self.step_ratio

    def give_back(self, cache: HeadState) -> None:
        """A request's head state ends with it (nothing is pooled)."""

    def discard_batch(self) -> None:
        """No draft batch to drop."""

    def attach(self, model: nn.Module) -> None:
        """Make the target record what the head reads (once the previous draft is unloaded)."""
        self.installed = capture.install(model, self.head.spec)

    def close(self) -> None:
        """Give the target's recording modules their classes back (unload)."""
        if self.installed is not None:
            self.installed.remove()
            self.installed = None


class HeadState:
    """One request's head cache: entries for target positions up to ``next``
    (exclusive), plus ``chained`` speculative entries of the last drafted
    round, dropped before the next round feeds the verified positions."""

    def __init__(self, head: Head):
        self.head = head
        self.tokens: list[int] = []  # the pipeline's prefill bookkeeping: a head is never prefilled
        self.reset()

    def reset(self) -> None:
        self.kv = self.head.new_cache()
        self.next: int | None = None  # the target position the next entry is for (None: no entry yet)
        self.chained = 0
        self.last_out: mx.array | None = None  # the head's output at position next - 1

    def fed(self, next_position: int, last_out: mx.array) -> None:
        """Entries now reach ``next_position`` (exclusive); ``last_out`` is the
        head's output at the last of them."""
        self.next, self.last_out = next_position, last_out

    def chain(self) -> None:
        """Count one speculative entry (a chained draft step), dropped by ``drop_chained``."""
        self.chained += 1

    def drop_chained(self) -> None:
        if self.chained:
            for layer in self.kv:
                layer.trim(self.chained)
            self.chained = 0


class HiddenTrail:
    """Hidden states recorded at target positions, newest pass last; a
    position a later pass fed again (a rewound hybrid, a rejected draft's
    position) reads the later pass's row."""

    def __init__(self):
        self.parts: list[tuple[int, mx.array]] = []  # (first position, rows)

    def add(self, at: int, rows: mx.array) -> None:
        self.parts.append((at, rows))

    def first(self) -> int | None:
        return min((at for at, _ in self.parts), default=None)

    def covers(self, position: int) -> bool:
        return any(at <= position < at + rows.shape[0] for at, rows in self.parts)

    def take(self, lo: int, hi: int) -> mx.array | None:
        """Rows for positions lo..hi-1 (None if one is missing)."""
        pieces, p = [], lo
        while p < hi:
            i = next((i for i in reversed(range(len(self.parts))) if self._holds(i, p)), None)
            if i is None:
                return None
            at, rows = self.parts[i]
            # The run this part covers, up to where a newer part begins.
            end = min([hi, at + rows.shape[0], *[a for a, _ in self.parts[i + 1 :] if p < a]])
            pieces.append(rows[p - at : end - at])
            p = end
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)

    def _holds(self, i: int, position: int) -> bool:
        at, rows = self.parts[i]
        return at <= position < at + rows.shape[0]

    def drop_before(self, position: int) -> None:
        """Forget rows of positions before ``position`` (fed to the head)."""
        self.parts = [(at, rows) for at, rows in self.parts if at + rows.shape[0] > position]


def measure_head_step_ratio(main: nn.Module, head: Head, vocab_size: int, chain: int = 4, context: int = 32) -> float:
    """A chained head step (its greedy pick included, as the drafter chains
    them) in single steps of ``main``, the two timed in turn (the median of 3)."""
    key = mx.random.key(5)
    tokens = mx.random.randint(0, vocab_size, (context + 1,), key=key)
    width = capture.hidden_width(main, head.spec)
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
