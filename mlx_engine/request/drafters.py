"""The drafter for one request, built from its plan and what the kit holds:
prompt lookup (from the suffix memory or the kit's other cached conversations),
the draft model (with a cache lent by the kit's pool), or the auto router over
both. May measure the kit's forward costs once (``kit.forward_costs()``).
"""

from __future__ import annotations

from ..decode.protocol import Drafter
from ..drafters.draft_model import DraftModelDrafter
from ..drafters.head import HeadDrafter
from ..drafters.prompt_lookup import PromptLookupDrafter
from ..drafters.router import AutoRouter
from ..drafters.suffix import SuffixDrafter
from ..heads.model import HeadDraft
from ..kits.text import ModelKit
from ..pricing import costs
from ..pricing.batch_pricing import BatchPricing
from .plan import DecodingPlan


def draft_step_cost(kit: ModelKit) -> float:
    """A draft-model (or head) step, as the drafter chains them, in main-model steps."""
    return kit.draft.chained_step_ratio(kit.model, kit.vocab_size, kit.cost_key("draft_step_ratio", kit.draft.path))


def lookup_memory(kit: ModelKit, prompt: list[int]) -> list[list[int]]:
    """The kit's other cached conversations, which prompt lookup drafts from
    when the request's own history has no match. Sequences that hold this whole
    prompt (earlier answers to it) are left out, so regenerating with a seed
    samples the same tokens again."""
    return [] if kit.prompt_cache is None else kit.prompt_cache.idle_sequences(other_than_prefix_of=prompt)


def build_drafter(
    kit: ModelKit, plan: DecodingPlan, prompt: list[int], request_id: str | None = None
) -> tuple[Drafter | None, DraftModelDrafter | HeadDrafter | None]:
    """The drafter the plan names, and the draft-model drafter inside it (whose
    prompt must be prefilled) if any. May measure the kit's costs once. With the
    kit's suffix memory on, prompt lookup drafts from it (recording the request
    under ``request_id``) instead of from the other cached conversations."""
    if plan.kind == "plain":
        return None, None
    name = request_id if request_id is not None else object()
    batch = None
    if kit.max_parallel > 1:
        batch = BatchPricing(kit, kit.drafting_rows, name)
    # A fixed-length lookup request cuts its drafts to what pays in the batch and
    # times its rounds for the kit's forward costs; the router does both itself.
    fixed = plan.kind == "prompt_lookup"
    own = dict(batch_pricing=batch if fixed else None, on_round=kit.observe_round if fixed else None)
    if kit.suffix_memory is not None:
        lookup = SuffixDrafter(plan.lookup_k, kit.suffix_memory, name, *plan.ngrams, **own)
    else:
        lookup = PromptLookupDrafter(plan.lookup_k, *plan.ngrams, memory=lookup_memory(kit, prompt), **own)
    if plan.kind == "prompt_lookup":
        return lookup, None
    draft_drafter = None
    if plan.use_draft:
        # Round costs drive the adaptive length, and the router's choice of mode.
        needs_costs = plan.draft_k is None or plan.kind == "auto"
        round_costs = costs.RoundCosts(kit.forward_costs(), draft_step_cost(kit)) if needs_costs else None
        if isinstance(kit.draft, HeadDraft):  # a head: its state is this request's own
            draft_drafter = HeadDrafter(kit.draft, plan.draft_k, round_costs)
        else:
            cache = kit.draft.lend(prompt, lambda: kit.new_cache(kit.draft.model))
            draft_drafter = DraftModelDrafter(
                kit.draft,
                plan.draft_k,
                round_costs,
                vocab_size=kit.vocab_size,
                cache=cache,
                batched=kit.max_parallel > 1,
            )
    if plan.kind == "draft_model":
        return draft_drafter, draft_drafter
    router = AutoRouter(prompt, kit.forward_costs(), lookup, draft_drafter, batch=batch, on_round=kit.observe_round)
    return router, draft_drafter
