"""The systems under test: a registry of named configurations and the code
that runs one generation with each.

Adding a decoding mode is one line in ``SYSTEMS``. ``engine`` systems call
``mlx_engine.create_generator`` with ``kwargs``; ``mlx-lm`` systems call
``mlx_lm.stream_generate`` on the same ``nn.Module`` and tokenizer (same weights,
dtype and BLAS), greedy.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.nn as nn  # noqa: E402
from mlx_lm import stream_generate  # noqa: E402

#: mlx-lm's ``generate`` CLI default (``--num-draft-tokens 3``); the Python
#: function ``speculative_generate_step`` defaults to 2.
MLX_LM_DRAFT_TOKENS = 3


@dataclass(frozen=True)
class System:
    """A named way of generating: ``backend`` plus the keyword arguments it gets."""

    name: str
    backend: Literal["engine", "mlx-lm"]
    kwargs: dict[str, Any]
    description: str
    needs_draft: bool = False
    #: The mlx-lm system doing the same job, compared round by round in the report.
    peer: str | None = None


BASELINE = "mlx-lm"

SYSTEMS: list[System] = [
    System("mlx-lm", "mlx-lm", {}, "mlx_lm.stream_generate, greedy (baseline)"),
    System(
        "mlx-lm-spec",
        "mlx-lm",
        {"num_draft_tokens": MLX_LM_DRAFT_TOKENS},
        f"mlx_lm.stream_generate with draft_model, num_draft_tokens={MLX_LM_DRAFT_TOKENS}",
        needs_draft=True,
    ),
    System("engine-plain", "engine", {"speculative_decoding_toggle": False}, "engine, plain decoding", peer="mlx-lm"),
    System(
        "engine-draft",
        "engine",
        {"speculative_decoding_toggle": True},
        "engine, draft model, adaptive draft length",
        needs_draft=True,
        peer="mlx-lm-spec",
    ),
    System(
        "engine-draft-k3",
        "engine",
        {"speculative_decoding_toggle": True, "num_draft_tokens": 3},
        "engine, draft model, num_draft_tokens=3",
        needs_draft=True,
        peer="mlx-lm-spec",
    ),
    System(
        "engine-lookup",
        "engine",
        {"prompt_lookup_num_tokens": 8, "speculative_decoding_toggle": False},
        "engine, prompt lookup (8 tokens)",
    ),
    System(
        "engine-auto",
        "engine",
        {"auto_speculative": True},
        "engine, auto_speculative=True (draft loaded)",
        needs_draft=True,
    ),
]


def select(names: list[str] | None, have_draft: bool) -> list[System]:
    """Systems to run (baseline always first); drops draft systems without a draft."""
    chosen = [s for s in SYSTEMS if names is None or s.name in names or s.name == BASELINE]
    unknown = set(names or ()) - {s.name for s in SYSTEMS}
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; known: {[s.name for s in SYSTEMS]}")
    return [s for s in chosen if have_draft or not s.needs_draft]


@dataclass
class Models:
    """Everything the systems share: the engine kit (draft loaded into it when
    given) and the draft module mlx-lm is given (the kit's own: the same weights
    in the same memory as the engine's)."""

    kit: me.ModelKit
    draft_module: nn.Module | None
    eos_ids: set[int]  # the engine's stop tokens (EOS plus end-of-turn tokens)


@dataclass
class Run:
    """One timed generation."""

    tokens: list[int]
    from_draft: list[bool]
    ttft: float  # seconds from the call to the first token
    first_round: int  # tokens available at the first yield (1 for plain decoding)
    decode_time: float  # seconds from the first yield to the last token
    total_time: float
    reported: dict[str, float] = field(default_factory=dict)  # the system's own numbers
    engine_stats: dict[str, Any] | None = None

    @property
    def gen_tps(self) -> float:
        """Tokens after the first round per second after it: excludes TTFT, and
        does not credit speculative modes with the drafts accepted in round one."""
        n = len(self.tokens) - self.first_round
        return n / self.decode_time if n > 0 and self.decode_time > 0 else float("nan")


def _first_round(flags: list[bool]) -> int:
    """Tokens in the first verify round: accepted drafts up to the first token the
    main model produced itself."""
    for i, f in enumerate(flags):
        if not f:
            return i + 1
    return len(flags)


def run_engine(
    models: Models,
    system: System,
    prompt: list[int],
    max_tokens: int,
    setup: list[int] | None = None,
    setup_tokens: int = 0,
) -> Run:
    """One greedy generation with the engine, from empty caches. ``setup`` (a
    first turn) is run untimed before the measured one, leaving the kit's caches
    holding it and its reply, which the measured request may reuse."""
    kit = models.kit
    kit.prompt_cache.clear()  # every cached sequence: the run starts cold
    if getattr(kit.draft, "first_cache", None) is not None:  # a head (hidden-state drafter) has none
        kit.draft.first_cache.reset()
    if setup is not None:
        for _ in me.create_generator(kit, setup, max_tokens=setup_tokens, temp=0.0, **system.kwargs):
            pass
    tokens: list[int] = []
    flags: list[bool] = []
    stats = None
    t_first = None
    t0 = time.perf_counter()
    for r in me.create_generator(kit, prompt, max_tokens=max_tokens, temp=0.0, **system.kwargs):
        if r.tokens and t_first is None:
            t_first = time.perf_counter()
        for tok in r.tokens:
            tokens.append(tok.id)
            flags.append(tok.from_draft)
        if r.stats is not None:
            stats = r.stats
    t_end = time.perf_counter()
    t_first = t_first or t_end
    reported = {}
    if stats is not None:
        reported = {
            "generation_tps": stats.generation_tps,
            "prompt_tps": stats.prompt_tps,
            "time_to_first_token": stats.time_to_first_token,
        }
    return Run(
        tokens,
        flags,
        t_first - t0,
        _first_round(flags),
        t_end - t_first,
        t_end - t0,
        reported,
        stats.as_dict() if stats is not None else None,
    )


def run_mlx_lm(models: Models, system: System, prompt: list[int], max_tokens: int, **_: Any) -> Run:
    """One greedy generation with ``mlx_lm.stream_generate`` (fresh cache every call)."""
    kit = models.kit
    extra: dict[str, Any] = {}
    if system.needs_draft:
        extra = {"draft_model": models.draft_module, **system.kwargs}
    tokens: list[int] = []
    flags: list[bool] = []
    last = None
    t_first = None
    t0 = time.perf_counter()
    for r in stream_generate(kit.model, kit.tokenizer, prompt, max_tokens=max_tokens, sampler=None, **extra):
        if t_first is None:
            t_first = time.perf_counter()
        last = r
        if r.token in models.eos_ids:
            # Not output (the engine omits it too). The engine also stops on
            # end-of-turn tokens such as <|im_end|>, which mlx-lm does not: stop
            # at the same tokens so outputs and timings compare like for like.
            break
        tokens.append(int(r.token))
        flags.append(bool(r.from_draft))
    t_end = time.perf_counter()
    t_first = t_first or t_end
    reported = {}
    if last is not None:
        reported = {"generation_tps": last.generation_tps, "prompt_tps": last.prompt_tps}
    return Run(tokens, flags, t_first - t0, _first_round(flags), t_end - t_first, t_end - t0, reported)


def run(models: Models, system: System, prompt: list[int], max_tokens: int, **kw: Any) -> Run:
    fn = run_engine if system.backend == "engine" else run_mlx_lm
    return fn(models, system, prompt, max_tokens, **kw)


def mlx_lm_drafted(flags: list[bool], max_tokens: int, k: int) -> int:
    """Draft tokens mlx-lm's speculative loop proposed, reconstructed from the
    ``from_draft`` flags: each round drafts min(k, tokens left) and ends with one
    token of the main model's own."""
    drafted, i = 0, 0
    while i < len(flags):
        drafted += min(k, max_tokens - i)
        while i < len(flags) and flags[i]:
            i += 1
        i += 1
    return drafted
