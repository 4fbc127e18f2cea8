"""Typed values that generation streams back to the caller."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

StopReason = Literal["eos_token", "stop_string", "token_limit", "user_cancelled", "grammar_complete", "tool_calls"]


class Token(NamedTuple):
    """One generated token. ``from_draft`` is true when a drafter proposed it and
    the main model accepted it (draft model or prompt lookup)."""

    id: int
    text: str
    logprob: float
    from_draft: bool = False


class TopLogprob(NamedTuple):
    """An alternative the model considered at one position."""

    id: int
    text: str
    logprob: float


class ToolCall(NamedTuple):
    """A tool call the model made (docs/api.md, "Tool calls"): the declared
    tool's ``name``, its ``arguments`` (a dict that validates against the tool's
    JSON schema when the grammar held the call), a unique ``id`` and its
    ``index`` among the generation's calls (OpenAI's ``tool_calls[i].index``)."""

    index: int
    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        """The arguments as JSON text (OpenAI's ``function.arguments``)."""
        return json.dumps(self.arguments, ensure_ascii=False)


class ToolCallDelta(NamedTuple):
    """A piece of a tool call as it streams (OpenAI's ``delta.tool_calls[i]``):
    the first piece of call ``index`` carries its ``id`` and ``name``, the
    next ones fragments of its arguments' JSON text. The fragments of one
    index, joined, are the JSON of that call's ``arguments``."""

    index: int
    id: str | None
    name: str | None
    arguments: str


class _StopConditionFields(NamedTuple):
    stop_reason: StopReason
    stop_string: str | None = None
    stop_tokens: list[int] | None = None


class GenerationStopCondition(_StopConditionFields):
    """Why generation ended. ``stop_string`` is set for ``stop_string``; ``stop_tokens``
    holds the token ids that triggered the stop (the EOS id, or the tokens whose
    text completed the stop string; a new empty list by default, never one
    shared between conditions)."""

    __slots__ = ()

    def __new__(cls, stop_reason: StopReason, stop_string: str | None = None, stop_tokens: list[int] | None = None):
        return super().__new__(cls, stop_reason, stop_string, [] if stop_tokens is None else stop_tokens)


@dataclass(frozen=True)
class GenerationStats:
    """Statistics of one generation, given to ``stats_callback`` and attached to the
    final result; built once when the generation ends (frozen). Times are seconds,
    rates tokens per second, memory bytes."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the kit's cache
    cache_source: str = "none"  # where they came from: none | memory | branch | disk (docs/api.md)
    cache_entries: int = 0  # cached sequences the kit holds in memory, this one included
    time_to_first_token: float = 0.0
    prompt_tps: float | None = None  # over the prompt tokens processed (setup_time excluded); None: all cached
    setup_time: float = 0.0  # finding forward costs for draft/auto decoding, within time_to_first_token
    generated_tokens: int = 0
    generation_tps: float | None = None  # tokens after the first round, from the first token on; None: no such tokens
    total_time: float = 0.0
    peak_memory: int = 0
    # Speculative decoding.
    decoding_mode: str = "plain"  # plain | draft_model | prompt_lookup | auto:<mode>
    mode_reason: str = ""
    mode_switches: list[str] = field(default_factory=list)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rejected_tokens: int = 0
    verify_rounds: int = 0
    acceptance_by_position: list[float] = field(default_factory=list)
    # Structured output: tokens the grammar forced, drafted without a drafter.
    grammar_drafted_tokens: int = 0
    grammar_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        return self.accepted_tokens / self.verify_rounds if self.verify_rounds else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_per_round"] = self.mean_accepted_per_round
        return d


@dataclass
class GenerationResult:
    """A chunk of streamed output. ``text`` is safe to display (whole characters,
    never part of a stop string). Exactly one result per generation, the last,
    has ``stop_condition`` and ``stats`` set. ``tool_calls`` holds the calls
    completed in this chunk (with ``tools``); their markup is never in ``text``.
    ``tool_call_deltas`` streams the calls piece by piece (docs/api.md, "Tool calls")."""

    text: str
    tokens: list[Token]
    top_logprobs: list[list[TopLogprob]] | None = None
    stop_condition: GenerationStopCondition | None = None
    stats: GenerationStats | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_deltas: list[ToolCallDelta] = field(default_factory=list)
