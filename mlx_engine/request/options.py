"""``create_generator``'s options, declared once, in groups: sampling
(``SamplingParams``, decode/sampling.py), decoding, constraints, output and
handling. Each field carries its default, doc and check (declare.py); the
function's signature, ``RequestOptions.from_kwargs``, validation (validate.py),
the plan (plan.py), the server's mapping and docs/api.md all read them here.

Decoding is an explicit choice, ``decoding=`` one of ``DECODING_CHOICES``; the
keyword arguments LM Studio's mlx-engine uses (``auto_speculative``,
``prompt_lookup_num_tokens`` alone, ``speculative_decoding_toggle``) stay as
documented aliases, mapped by ``DecodingOptions.choice`` (docs/decoding.md).
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Callable, Literal, get_args

from ..declare import boolean, count, keyword_parameters, one_of, option, strict_int
from ..decode.sampling import MAX_TOP_LOGPROBS, SamplingParams
from ..errors import InvalidArgument, argument
from ..pricing import costs
from ..results import GenerationStats
from .stop_strings import StopStringMatcher

DEFAULT_MAX_TOKENS = 256
DEFAULT_PROMPT_LOOKUP_TOKENS = 8  # decoding="prompt_lookup" without a length
MAX_DRAFT_TOKENS = costs.MAX_MODEL_DRAFT
MAX_LOOKUP_TOKENS = costs.MAX_DRAFT  # also auto's default lookup ceiling

Decoding = Literal["plain", "draft", "prompt_lookup", "auto"]
DECODING_CHOICES: tuple[str, ...] = get_args(Decoding)

ProgressCallback = Callable[[float], "bool | None"]
StatsCallback = Callable[[GenerationStats], None]


def _callable(name: str, value, **_):
    if value is not None and not callable(value):
        raise InvalidArgument("{param} must be callable or None", name)
    return value


def _max_tokens(name: str, value, **_) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument("{param} must be a positive integer, got {got}", name, got=repr(value))
    return value


def _stop_strings(name: str, value, **_) -> list[str]:
    with argument(name):
        return StopStringMatcher.validate(value)


def _top_logprobs(name: str, value, **_) -> int | None:
    return count(name, value, 0, MAX_TOP_LOGPROBS, f"between 0 and {MAX_TOP_LOGPROBS}") or None


def _request_id(name: str, value, **_) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidArgument("{param} must be a string or None, got {got}", name, got=repr(value))
    return value


def _admission_timeout(name: str, value, **_) -> float | None:
    """None, or seconds (a finite number >= 0) to wait for a free slot."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < float("inf"):
        raise InvalidArgument(
            "{param} must be None or a finite number of seconds >= 0, got {got}", name, got=repr(value)
        )
    return float(value)


@dataclass(frozen=True, kw_only=True)
class DecodingOptions:
    """How the request decodes (docs/decoding.md). ``decoding`` picks the mode;
    the lengths are only lengths; the last two fields are aliases."""

    decoding: Decoding | None = option(
        None,
        "'plain', 'draft', 'prompt_lookup' or 'auto'; None: from the aliases, else the loaded draft model, else plain",
        one_of(None, *DECODING_CHOICES, message=f"one of {', '.join(map(repr, DECODING_CHOICES))} or None"),
    )
    num_draft_tokens: int | None = option(
        None,
        f"the draft model's draft length, 1-{MAX_DRAFT_TOKENS} (None: adaptive)",
        strict_int(1, MAX_DRAFT_TOKENS, optional=True),
    )
    prompt_lookup_num_tokens: int | None = option(
        None,
        f"prompt lookup's longest draft, 1-{MAX_LOOKUP_TOKENS} (None: {DEFAULT_PROMPT_LOOKUP_TOKENS}, "
        f"or {MAX_LOOKUP_TOKENS} under auto); alias: alone it picks decoding='prompt_lookup'",
        strict_int(1, MAX_LOOKUP_TOKENS, optional=True),
    )
    prompt_lookup_min_ngram: int = option(1, "shortest suffix prompt lookup matches", strict_int(1))
    prompt_lookup_max_ngram: int = option(3, "longest suffix prompt lookup matches", strict_int(1))
    prompt_lookup_num_candidates: int = option(4, "continuations prompt lookup compares", strict_int(1))
    speculative_decoding_toggle: bool | None = option(
        None,
        "alias: True is decoding='draft'; False never uses the draft model",
        one_of(None, True, False, message="True, False or None"),
    )
    auto_speculative: bool = option(False, "alias: True is decoding='auto'", boolean("a bool"))

    def choice(self) -> str | None:
        """The decoding asked for, aliases mapped (None: the kit's default, the
        draft model when one is loaded and not refused, else plain).
        ``ValueError`` naming the argument that contradicts ``decoding``."""
        mode, toggle = self.decoding, self.speculative_decoding_toggle
        if self.prompt_lookup_min_ngram > self.prompt_lookup_max_ngram:
            raise InvalidArgument(
                "{param} ({low}) must not exceed {prompt_lookup_max_ngram} ({high})",
                "prompt_lookup_min_ngram",
                low=self.prompt_lookup_min_ngram,
                high=self.prompt_lookup_max_ngram,
            )
        if mode is None:
            if self.auto_speculative:
                return "auto"
            if self.prompt_lookup_num_tokens is not None:
                return "prompt_lookup"
            return "draft" if toggle is True or self.num_draft_tokens is not None else None
        contradictions = (
            ("auto_speculative", self.auto_speculative and mode != "auto"),
            ("speculative_decoding_toggle", toggle is True and mode in ("plain", "prompt_lookup")),
            ("speculative_decoding_toggle", toggle is False and mode == "draft"),
            ("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens is not None and mode in ("plain", "draft")),
            ("num_draft_tokens", self.num_draft_tokens is not None and mode in ("plain", "prompt_lookup")),
        )
        for name, contradicts in contradictions:
            if contradicts:
                raise InvalidArgument(
                    "{param}={got} contradicts {decoding}={mode}", name, got=repr(getattr(self, name)), mode=repr(mode)
                )
        return mode


@dataclass(frozen=True, kw_only=True)
class ConstraintOptions:
    """What the output must match (docs/api.md, "Structured output", "Tool calls");
    checked against the kit by ``structured`` and ``tools``."""

    json_schema: dict | str | None = option(None, "a JSON schema the output follows")
    regex: str | None = option(None, "a regular expression the output matches")
    grammar: str | None = option(None, "a Lark grammar (llguidance's dialect) the output follows")
    structured_drafting: bool = option(True, "draft the tokens the grammar forces", boolean())
    tools: list[dict] | None = option(None, "OpenAI tool definitions; calls come back as tool_calls")
    tool_choice: str | dict | None = option(None, "'auto' (None), 'none', 'required' or {'name': ...}")
    parallel_tool_calls: bool = option(True, "allow several calls in one answer")


@dataclass(frozen=True, kw_only=True)
class OutputOptions:
    """How much is generated and what comes back."""

    max_tokens: int = option(DEFAULT_MAX_TOKENS, "most tokens generated", _max_tokens)
    stop_strings: list[str] | None = option(None, "non-empty strings that end the text (never emitted)", _stop_strings)
    top_logprobs: int | None = option(None, f"alternatives per token, 0-{MAX_TOP_LOGPROBS} (0: none)", _top_logprobs)
    stats_callback: StatsCallback | None = option(None, "called once at the end with the stats", _callable)


@dataclass(frozen=True, kw_only=True)
class HandlingOptions:
    """How the request is taken in: its id, its images, prompt progress and the
    wait for a free slot."""

    request_id: str | None = option(None, "the id stop_generation takes (default: a random one)", _request_id)
    images_b64: list[str] | None = option(None, "vision kits: base64 images, one per image placeholder")
    prompt_progress_callback: ProgressCallback | None = option(
        None, "called with the percent of the prompt processed; False cancels", _callable
    )
    # Seconds to wait for a free slot while max_parallel generations are open
    # (None: GenerationInProgressError at once). Waited for on the caller's thread.
    admission_timeout: float | None = option(
        None, "seconds to wait for a free slot (None: refuse at once)", _admission_timeout
    )


@dataclass(frozen=True)
class RequestOptions:
    """``create_generator``'s options, as given, by group."""

    output: OutputOptions = field(default_factory=OutputOptions)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    decoding: DecodingOptions = field(default_factory=DecodingOptions)
    constraints: ConstraintOptions = field(default_factory=ConstraintOptions)
    handling: HandlingOptions = field(default_factory=HandlingOptions)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> RequestOptions:
        """The options named in ``kwargs``, each in its group; an unknown name
        is a ``ValueError`` naming it (with the nearest known name)."""
        names = [p.name for p in keyword_parameters(*GROUPS.values())]
        for name in kwargs:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise InvalidArgument(
                    "create_generator got an unknown argument {name}{hint}; it takes: {names}",
                    name,
                    name=repr(name),
                    hint=hint,
                    names=", ".join(names),
                )
        return cls(**{g: group(**_picked(group, kwargs)) for g, group in GROUPS.items()})

    def kwargs(self) -> dict[str, Any]:
        """The options as ``create_generator``'s keyword arguments (all of them)."""
        return {f.name: getattr(group, f.name) for group in self.groups() for f in fields(group)}

    def groups(self) -> tuple:
        return tuple(getattr(self, g) for g in GROUPS)


def _picked(group: type, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {f.name: kwargs[f.name] for f in fields(group) if f.name in kwargs}


GROUPS: dict[str, type] = {f.name: f.default_factory for f in fields(RequestOptions)}

# The keyword arguments flat, generated from the groups (nothing re-listed): the
# same fields as create_generator's signature, with the defaults as class
# attributes (GenerationOptions.max_tokens).
GenerationOptions = make_dataclass(
    "GenerationOptions",
    [(f.name, f.type, field(default=f.default, metadata=f.metadata)) for g in GROUPS.values() for f in fields(g)],
    frozen=True,
    kw_only=True,
    namespace={"__doc__": "create_generator's keyword arguments, flat (generated from the option groups)."},
)
GenerationOptions.__module__ = __name__
