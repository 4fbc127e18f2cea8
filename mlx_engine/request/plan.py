"""Planning a request's decoding: which drafter, with which limits, and why.

``choose_plan`` turns the decoding options (options.py: the explicit
``decoding`` choice, its aliases mapped by ``DecodingOptions.choice``) into a
frozen ``DecodingPlan`` (the rules are in docs/decoding.md); ``DecodingPlan.for_cache`` falls back to
plain decoding when the kit's cache cannot be rewound, before any draft work
(a draft model's prompt would otherwise be prefilled for nothing). A pure
decision: nothing here builds a drafter or touches a cache (``drafters.py`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from ..declare import checked
from ..errors import InvalidArgument
from ..kits.text import ModelKit
from .options import DECODING_CHOICES, DEFAULT_PROMPT_LOOKUP_TOKENS, MAX_LOOKUP_TOKENS, DecodingOptions

if TYPE_CHECKING:
    from ..caches.sequence import SequenceCache

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


def choose_plan(kit: ModelKit, options: DecodingOptions) -> DecodingPlan:
    """The request's plan from its decoding options (rules in docs/decoding.md);
    ``ValueError`` naming the argument for any bad or conflicting one."""
    d = checked(options)
    choice = d.choice()
    has_draft = kit.draft is not None
    _check_draft(d, choice, has_draft)
    if choice is None:
        choice = "draft" if has_draft and d.speculative_decoding_toggle is not False else "plain"
    return PLANNERS[choice](d, has_draft)


def _check_draft(d: DecodingOptions, choice: str | None, has_draft: bool) -> None:
    """The draft model's arguments against the kit and the choice."""
    toggle, k = d.speculative_decoding_toggle, d.num_draft_tokens
    if toggle is True and not has_draft:
        raise InvalidArgument(
            "{param}=True requires a draft model; call load_draft_model first",
            "speculative_decoding_toggle",
        )
    if d.decoding == "draft" and not has_draft:
        raise InvalidArgument("{param}='draft' needs a draft model; call load_draft_model first", "decoding")
    if k is not None and (not has_draft or toggle is False):
        raise InvalidArgument("{param} needs a loaded draft model that this request uses", "num_draft_tokens")
    # Only by the alias: an explicit decoding="prompt_lookup" refuses these in choice().
    if choice == "prompt_lookup" and (toggle is True or k is not None):
        raise InvalidArgument(
            "{param} and the draft model ({speculative_decoding_toggle}=True or {num_draft_tokens}) "
            "are both requested; pick one, or pass {auto_speculative}=True to let the engine choose",
            "prompt_lookup_num_tokens",
        )


def _ngrams(d: DecodingOptions) -> tuple[int, int, int]:
    return (d.prompt_lookup_min_ngram, d.prompt_lookup_max_ngram, d.prompt_lookup_num_candidates)


def _plain(d: DecodingOptions, has_draft: bool) -> DecodingPlan:
    return DecodingPlan("plain")


def _draft(d: DecodingOptions, has_draft: bool) -> DecodingPlan:
    k = d.num_draft_tokens
    length = "draft length adapts to acceptance and round times" if k is None else f"num_draft_tokens={k}"
    return DecodingPlan("draft_model", True, k, reason=f"draft model loaded; {length}")


def _prompt_lookup(d: DecodingOptions, has_draft: bool) -> DecodingPlan:
    k = d.prompt_lookup_num_tokens
    reason = (
        f"requested: prompt_lookup_num_tokens={k}"
        if k is not None
        else f"requested: decoding='prompt_lookup' (up to {DEFAULT_PROMPT_LOOKUP_TOKENS} tokens)"
    )
    return DecodingPlan("prompt_lookup", lookup_k=k or DEFAULT_PROMPT_LOOKUP_TOKENS, ngrams=_ngrams(d), reason=reason)


def _auto(d: DecodingOptions, has_draft: bool) -> DecodingPlan:
    # The router's lookup length adapts each round, up to the longest draft.
    use_draft = has_draft and d.speculative_decoding_toggle is not False
    lookup_k = d.prompt_lookup_num_tokens or MAX_LOOKUP_TOKENS
    return DecodingPlan("auto", use_draft, d.num_draft_tokens, lookup_k, _ngrams(d))


# One planner per decoding choice (options.DECODING_CHOICES): a new drafter kind
# is a choice there, a planner here and its drafter in drafters.py.
PLANNERS: dict[str, Callable[[DecodingOptions, bool], DecodingPlan]] = {
    "plain": _plain,
    "draft": _draft,
    "prompt_lookup": _prompt_lookup,
    "auto": _auto,
}
assert tuple(sorted(PLANNERS)) == tuple(sorted(DECODING_CHOICES)), "a decoding choice without a planner"
