"""Planning a request's decoding: which drafter, with which limits, and why.

``choose_plan`` turns the decoding arguments into a frozen ``DecodingPlan``
(the rules are in docs/decoding.md); ``DecodingPlan.for_cache`` falls back to
plain decoding when the kit's cache cannot be rewound, before any draft work
(a draft model's prompt would otherwise be prefilled for nothing). A pure
decision: nothing here builds a drafter or touches a cache (``drafters.py`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..errors import InvalidArgument
from ..kits.text import ModelKit

if TYPE_CHECKING:
    from ..caches.sequence import SequenceCache
from ..pricing import costs

DEFAULT_PROMPT_LOOKUP_TOKENS = 8
MAX_DRAFT_TOKENS = costs.MAX_MODEL_DRAFT
MAX_LOOKUP_TOKENS = costs.MAX_DRAFT

Kind = Literal["plain", "draft_model", "prompt_lookup", "auto"]


@dataclass(frozen=True)
class DecodingPlan:
    """How one request decodes. ``use_draft``: the draft model takes part
    (draft_model, or auto with a draft loaded); ``draft_k``: its fixed draft
    length (None: adaptive); ``lookup_k`` and ``ngrams`` (min n, max n,
    candidates): prompt lookup's limits; ``reason``: why, for the stats;
    ``requested``: the mode asked for when this plan is a fallback."""

    kind: Kind
    use_draft: bool = False
    draft_k: int | None = None
    lookup_k: int = DEFAULT_PROMPT_LOOKUP_TOKENS
    ngrams: tuple[int, int, int] = (1, 3, 4)
    reason: str = ""
    requested: Kind | None = None

    @property
    def mode_name(self) -> str:
        """The stats' ``decoding_mode`` before any router decision: an auto
        request that fell back reports ``auto:plain`` (docs/decoding.md)."""
        return "auto:plain" if self.requested == "auto" else self.kind

    def for_cache(self, cache: SequenceCache, pending: int) -> DecodingPlan:
        """Plain decoding, with the reason, when ``cache`` could not be rewound
        once the ``pending`` prompt tokens are fed (checked before any draft work)."""
        why = cache.rewind_limit_reason(pending + 2) if self.kind != "plain" else None
        if why is None:
            return self
        return DecodingPlan("plain", reason=f"fell back to plain decoding: {why}", requested=self.kind)


def _check_lengths(num_draft_tokens, lookup_tokens, ngrams) -> None:
    for name, value, most in (
        ("num_draft_tokens", num_draft_tokens, MAX_DRAFT_TOKENS),
        ("prompt_lookup_num_tokens", lookup_tokens, MAX_LOOKUP_TOKENS),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most):
            raise InvalidArgument(
                "{param} must be an integer from 1 to {most} or None, got {got}", name, most=most, got=repr(value)
            )
    names = ("prompt_lookup_min_ngram", "prompt_lookup_max_ngram", "prompt_lookup_num_candidates")
    for name, value in zip(names, ngrams):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument("{param} must be a positive integer, got {got}", name, got=repr(value))
    if ngrams[0] > ngrams[1]:
        raise InvalidArgument(
            "{param} ({low}) must not exceed {prompt_lookup_max_ngram} ({high})",
            "prompt_lookup_min_ngram",
            low=ngrams[0],
            high=ngrams[1],
        )


def choose_plan(kit: ModelKit, *, num_draft_tokens, toggle, lookup_tokens, ngrams, auto) -> DecodingPlan:
    """The request's plan from its decoding arguments (rules in docs/decoding.md);
    ``ValueError`` naming the argument for any bad or conflicting one."""
    if toggle not in (None, True, False):
        raise InvalidArgument(
            "{param} must be True, False or None, got {got}", "speculative_decoding_toggle", got=repr(toggle)
        )
    if not isinstance(auto, bool):
        raise InvalidArgument("{param} must be a bool, got {got}", "auto_speculative", got=repr(auto))
    _check_lengths(num_draft_tokens, lookup_tokens, ngrams)
    has_draft = kit.draft is not None
    if toggle is True and not has_draft:
        raise InvalidArgument(
            "{param}=True requires a draft model; call load_draft_model first",
            "speculative_decoding_toggle",
        )
    if num_draft_tokens is not None and (not has_draft or toggle is False):
        raise InvalidArgument("{param} needs a loaded draft model that this request uses", "num_draft_tokens")
    use_draft = has_draft and toggle is not False
    if auto:
        # The router's lookup length adapts each round, up to the longest draft.
        return DecodingPlan("auto", use_draft, num_draft_tokens, lookup_tokens or MAX_LOOKUP_TOKENS, ngrams)
    if lookup_tokens is not None:
        if toggle is True or num_draft_tokens is not None:
            raise InvalidArgument(
                "{param} and the draft model ({speculative_decoding_toggle}=True or {num_draft_tokens}) "
                "are both requested; pick one, or pass {auto_speculative}=True to let the engine choose",
                "prompt_lookup_num_tokens",
            )
        return DecodingPlan(
            "prompt_lookup",
            lookup_k=lookup_tokens,
            ngrams=ngrams,
            reason=f"requested: prompt_lookup_num_tokens={lookup_tokens}",
        )
    if use_draft:
        length = (
            "draft length adapts to acceptance and round times"
            if num_draft_tokens is None
            else f"num_draft_tokens={num_draft_tokens}"
        )
        return DecodingPlan("draft_model", True, num_draft_tokens, reason=f"draft model loaded; {length}")
    return DecodingPlan("plain")
