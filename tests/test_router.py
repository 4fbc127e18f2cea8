"""The automatic router (drafters/router.py; its rules are routing.decide, called directly below): which drafter runs each round, and when it switches."""

import mlx_engine as me
from mlx_engine.drafters.prompt_lookup import PromptLookupDrafter
from mlx_engine.drafters.router import AutoRouter, Decision, Mode, RouterSettings
from mlx_engine.drafters.routing import Evidence, Ledger, decide, lookup_length
from mlx_engine.pricing.costs import CostModel, RoundCosts
from mlx_engine.pricing.speedup import AcceptanceModel

import pytest
from helpers import flat_costs, generate_ids, markov_kit


def test_router_sends_long_echo_prompt_to_prompt_lookup(llama_path):
    kit = markov_kit(llama_path)
    kit.model.delay = 0.003  # a pass costs 3 ms whatever its length, as verify passes nearly do
    prompt = list(range(100, 380)) + list(range(100, 200))
    plain, _ = generate_ids(kit, prompt, max_tokens=60)
    ids, final = generate_ids(kit, prompt, max_tokens=60, auto_speculative=True)
    assert ids == plain
    assert final.stats.decoding_mode == "auto:prompt_lookup", final.stats
    assert "probe acceptance" in final.stats.mode_switches[0]
    assert "density" in final.stats.mode_reason


def test_router_probe_of_a_short_fresh_prompt_drafts_nothing_and_ends_plain(llama_path):
    kit = markov_kit(llama_path)
    prompt = list(range(100, 140))
    ids, final = generate_ids(kit, prompt, max_tokens=20, auto_speculative=True)
    assert ids == generate_ids(kit, prompt, max_tokens=20)[0]
    assert final.stats.decoding_mode == "auto:plain"
    assert "probing" in final.stats.mode_reason
    assert "probe acceptance 0% of 0 positions tried (0 of 0 drafted)" in final.stats.mode_switches[0]
    assert final.stats.drafted_tokens == 0


def test_router_prefilter_keeps_short_prompts_plain_when_set():
    settings = RouterSettings(min_prompt_tokens=256, min_density=0.02)
    router = AutoRouter(list(range(40)) * 2, flat_costs(1.5), PromptLookupDrafter(8), settings=settings)
    assert router.mode == "plain" and "too short" in router.mode_reason
    assert AutoRouter(list(range(40)) * 2, flat_costs(1.5), PromptLookupDrafter(8)).mode == "probe"


def test_router_probe_draft_grows_while_accepted_whole():
    copied = list(range(50))
    # A copy whose context differs from the original's: a 3-token match, 60% on the traces.
    history = list(range(100, 150)) + [7] + copied + [8] + copied[:3]
    router = AutoRouter(history, flat_costs(1.5), PromptLookupDrafter(32))
    lengths, at = [], 3
    while router.mode == "probe":
        drafts = router.propose(history, 64)
        lengths.append(len(drafts))
        assert drafts == copied[at : at + len(drafts)]
        router.observe(len(drafts), len(drafts))
        history += copied[at : at + len(drafts) + 1]
        at += len(drafts) + 1
    # A short first draft (what a 60% match pays for), then the longest at once.
    assert len(lengths) == 2 and lengths[0] < 8 and lengths[1] == 32
    assert router.mode == "prompt_lookup"
    # The probe's evidence carries over: the first committed draft is long too.
    assert len(router.propose(history, 64)) == 32


def test_router_probe_drafts_a_strong_match_long_at_once():
    """A match agreeing 16 tokens or more (96% accepted on the traces) is drafted
    at the length that pays for it from the first probe round."""
    router = AutoRouter(list(range(50)) * 8, flat_costs(1.5), PromptLookupDrafter(32))
    history = list(range(50)) * 8
    drafts = router.propose(history, 64)
    assert len(drafts) > RouterSettings().probe_draft_tokens
    assert drafts == list(range(len(drafts)))


def test_router_leaves_lookup_when_it_stops_paying():
    prompt = list(range(50)) * 8
    router = AutoRouter(prompt, flat_costs(2.0), PromptLookupDrafter(8))
    assert router.mode == "probe"
    for _ in range(4):
        router.observe(4, 0)  # four consecutive misses end the probe
    assert router.mode == "plain"
    assert "probe acceptance 0%" in router.mode_switches[-1]


def test_router_switches_to_lookup_when_output_starts_repeating(llama_path):
    import mlx.core as mx

    vocab = me.load_model(llama_path, vocab_only=True).vocab_size
    nxt = [(t + 1) % vocab for t in range(vocab)]
    # Fresh tokens 100..135 (the probe finds nothing to copy and ends in plain
    # decoding), then 136..140 loop, as a degenerate model's output does.
    nxt[140] = 136
    table = mx.array([[12.0 if j == nxt[i] else 0.0 for j in range(vocab)] for i in range(vocab)])
    kit = markov_kit(llama_path, table)
    prompt = list(range(60, 100))
    # Auto first: run second it would draft the plain run's answer from the suffix memory.
    ids, final = generate_ids(kit, prompt, max_tokens=120, auto_speculative=True)
    plain, _ = generate_ids(kit, prompt, max_tokens=120)
    assert ids == plain
    s = final.stats
    assert s.mode_switches[0].startswith("probe -> plain")
    assert any(m.startswith("plain -> prompt_lookup") and "shadow drafts" in m for m in s.mode_switches)
    assert s.decoding_mode == "auto:prompt_lookup" and s.acceptance_rate > 0.8


NO_PROBE = RouterSettings(min_prompt_tokens=10**6)  # every prompt too short: no probe


class _StubDraft:
    """Stands in for a DraftModelDrafter whose drafts are always rejected."""

    def __init__(self):
        self.acceptance = AcceptanceModel()
        self.round_costs = RoundCosts(flat_costs(1.5), draft_step=0.1)

    def propose(self, history, limit):
        return [0]

    def observe(self, drafted, accepted, seconds=None):
        self.acceptance.observe(drafted, accepted)

    def time_undrafted(self, seconds):
        self.round_costs.observe(0, seconds)


@pytest.mark.parametrize("repeating", [True, False])
def test_router_shadow_drafts_move_draft_mode_to_lookup_only_when_text_repeats(repeating):
    history = list(range(1000, 1100))
    # The pre-filter skips the probe: the router starts in the draft model's mode.
    router = AutoRouter(history, flat_costs(1.5), PromptLookupDrafter(8), _StubDraft(), settings=NO_PROBE)
    assert router.mode == "draft_model"
    for i in range(60):
        router.propose(history, 8)
        router.observe(1, 0)
        history.append(2000 + i % 7 if repeating else 3000 + i)
    if repeating:
        assert router.mode == "prompt_lookup"
        assert "shadow drafts" in router.mode_switches[-1]
    else:
        # Rejected drafts do not send it to plain decoding, from which only prompt
        # lookup could be reached: the drafter pauses and explores by itself.
        assert router.mode == "draft_model" and not router.mode_switches


def test_router_with_a_draft_model_probes_lookup_and_gives_the_draft_the_rounds_lookup_cannot_draft():
    prompt = list(range(50)) * 8
    draft = _StubDraft()
    router = AutoRouter(prompt, flat_costs(1.5), PromptLookupDrafter(8), draft)
    assert router.mode == "probe" and "the draft model drafts the rounds lookup has nothing for" in router.mode_reason
    history = prompt + [700, 701]  # fresh tokens: lookup has nothing to draft
    assert router.propose(history, 8) == [0]  # the draft model's round
    router.observe(1, 0)
    assert draft.acceptance.drafted == 1 and router.ledger.lookup_acceptance.drafted == 0  # its record, not lookup's
    history += [702] + list(range(20))  # the text copies the prompt again: lookup drafts
    drafts = router.propose(history, 8)
    assert drafts == list(range(20, 28)) and router.mode == "probe"  # a strong match: long at once
    router.observe(8, 8)
    assert router.ledger.lookup_acceptance.drafted == 8 and draft.acceptance.drafted == 1


def test_router_returns_to_the_draft_model_when_lookup_delivers_less_than_shadows_promised():
    history = list(range(1000, 1100))
    router = AutoRouter(history, flat_costs(1.5), PromptLookupDrafter(8), _StubDraft(), settings=NO_PROBE)

    def run(rounds: int, drafted_accepted) -> None:
        for _ in range(rounds):
            drafts = router.propose(history, 8)
            drafted, accepted = drafted_accepted(len(drafts))
            router.observe(drafted, accepted)
            for _ in range(accepted + 1):  # the output repeats a 7-token cycle
                history.append(2000 + len(history) % 7)
            if router.mode != start_mode:
                return

    start_mode = "draft_model"
    run(60, lambda n: (2, 2))  # the draft model pays, and shadow lookup would pay more
    assert router.mode == "prompt_lookup" and "shadow drafts" in router.mode_switches[-1]
    start_mode = "prompt_lookup"
    run(60, lambda n: (n, 2))  # but lookup's own rounds stop at the third draft
    assert router.mode == "draft_model"
    assert "no more switches to lookup" in router.mode_switches[-1]
    run(60, lambda n: (2, 2))  # the shadow keeps promising, but is not followed again
    assert router.mode == "draft_model"


def test_router_shadow_drafts_use_lookup_memory():
    """In plain decoding (here: a short prompt under a pre-filter) the router's
    shadow drafts come from lookup memory too, so a conversation cached elsewhere
    can move it to lookup."""
    memory = [[50, 51, 52, 53, 54, 55, 56, 57, 58]]
    router = AutoRouter(
        [50, 51],
        flat_costs(1.5),
        PromptLookupDrafter(8, memory=memory),
        settings=RouterSettings(min_prompt_tokens=256),
    )
    assert router.mode == "plain"
    assert router.propose([50, 51, 52], 8) == []  # plain rounds draft nothing themselves
    assert router.ledger.shadows.open == [(3, [53, 54, 55, 56, 57, 58], 0, False)]  # (position, drafts, scored, weak)


def test_router_probe_drafts_from_lookup_memory():
    """A short prompt is probed, and the probe drafts from lookup memory when the
    request's own history has nothing to copy."""
    memory = [[50, 51, 52, 53, 54, 55, 56, 57, 58]]
    router = AutoRouter([50, 51], flat_costs(1.5), PromptLookupDrafter(8, memory=memory))
    assert router.mode == "probe"
    drafts = router.propose([50, 51, 52], 8)  # the probe's first draft: 4 tokens, or what the match pays for
    assert len(drafts) >= 4 and drafts == list(range(53, 53 + len(drafts)))


def test_router_without_a_draft_switches_to_lookup_within_a_few_rounds_of_copying():
    """Shadow drafts count from their first decided token: a copy that starts in
    the answer moves plain decoding to lookup after shadow_rounds rounds, not after
    the shadows' full length."""
    passage = list(range(500, 540))
    history = list(range(1000, 1100)) + passage  # a short prompt, plain under a pre-filter
    router = AutoRouter(
        history, flat_costs(1.5), PromptLookupDrafter(32), settings=RouterSettings(min_prompt_tokens=256)
    )
    assert router.mode == "plain"
    history += passage[:3]  # the answer starts copying the passage
    rounds = 0
    while router.mode == "plain":
        assert router.propose(history, 32) == []
        router.observe(0, 0)
        history.append(passage[len(history) - 140])
        rounds += 1
    assert rounds <= router.s.shadow_rounds + 1 and router.mode == "prompt_lookup"
    # Lookup then drafts beyond the old cap of 8 tokens, copying the passage.
    drafts = router.propose(history, 32)
    assert len(drafts) > 8 and drafts == passage[len(history) - 140 :][: len(drafts)]


def _copying_router(history: list[int]) -> AutoRouter:
    """A router in prompt lookup whose drafts on ``history`` grew by being accepted whole."""
    router = AutoRouter(history, flat_costs(1.2), PromptLookupDrafter(32))
    router.apply(Decision(Mode.PROMPT_LOOKUP, "test"))
    for _ in range(3):
        router.propose(history, 32)
        router.observe(router.ledger.lookup_k, router.ledger.lookup_k)  # all accepted: drafts grow
    assert router.ledger.lookup_k > 8
    return router


def test_router_lookup_length_shrinks_after_a_rejection():
    history = list(range(50)) * 8
    router = _copying_router(history)
    router.observe(router.ledger.lookup_k, 1)  # one accepted, then a rejection
    router.propose(history, 32)
    assert router.ledger.lookup_k <= max(router.s.lookup_rejection_floor, 2 * 2 + 2) < 32


def test_router_lookup_drafts_at_least_the_floor_after_a_rejection_at_the_first_draft():
    # A quote deviates from its source every 5-8 tokens: a draft of 4 after a
    # miss (2·1+2) split each copied span into two rounds.
    history = list(range(50)) * 8
    router = _copying_router(history)
    router.observe(router.ledger.lookup_k, 0)  # the first draft rejected
    assert len(router.propose(history, 32)) == router.s.lookup_rejection_floor == 8


def _lookup_router_after_a_miss(history: list[int]) -> AutoRouter:
    """A router in prompt lookup, at CPU-like verify costs, whose four drafts of
    4 were accepted whole and whose fifth was rejected at its first token."""
    router = AutoRouter(history, flat_costs(3.0), PromptLookupDrafter(32))
    router.apply(Decision(Mode.PROMPT_LOOKUP, "test"))
    for accepted in (4, 4, 4, 4, 0):
        router.propose(history, 32)
        router.observe(4, accepted)
    return router


def test_router_lookup_caps_a_short_match_at_the_rejection_bound_after_a_rejection():
    # The floor of 8 is for strong matches (a quote resuming after a deviation):
    # a 2-token match (60% accepted on the traces) after a miss drafts at most
    # 2·1+2 where verifying costs as on a CPU, however well lookup did before.
    history = list(range(50)) * 8
    router = _lookup_router_after_a_miss(history)
    short = history + [1000, 1001, 1002] + list(range(2000, 2040)) + [1003, 1001, 1002]
    drafts = router.propose(short, 32)
    assert drafts == list(range(2000, 2000 + len(drafts)))
    assert 0 < len(drafts) <= 2 * 1 + 2 < router.s.lookup_rejection_floor
    # A strong match after the same miss still drafts the floor.
    strong = _lookup_router_after_a_miss(history)
    assert len(strong.propose(history, 32)) == strong.s.lookup_rejection_floor


def test_router_lookup_draft_after_one_accepted_whole_is_at_most_twice_as_long_plus_two():
    # As the draft model's policy: positions twice as deep as any accepted are
    # untried (a resumed copy's 4 accepted drafts had been followed by 24, all rejected).
    history = list(range(50)) * 8
    router = AutoRouter(history, flat_costs(1.2), PromptLookupDrafter(32))
    router.apply(Decision(Mode.PROMPT_LOOKUP, "test"))
    router.propose(history, 32)
    router.observe(3, 3)
    assert 3 < len(router.propose(history, 32)) <= 2 * 3 + 2
    router.observe(8, 8)
    assert len(router.propose(history, 32)) == 2 * 8 + 2


def test_router_plain_rounds_are_queued_ahead_and_still_make_shadow_drafts():
    """In plain decoding the loop queues rounds ahead without calling propose
    (plain_ahead); observe then makes the shadow drafts, so the switch to lookup
    comes as it would with a propose per round."""
    passage = list(range(500, 540))
    history = list(range(1000, 1100)) + passage + passage[:3]
    router = AutoRouter(
        history,
        flat_costs(1.5),
        PromptLookupDrafter(32),
        settings=RouterSettings(min_prompt_tokens=256),
    )
    assert router.plain_ahead(history)
    assert router.propose(history, 32) == []  # the first round is launched normally
    rounds = 0
    while router.mode == "plain":
        router.observe(0, 0)  # a round queued ahead: no propose before it
        history.append(passage[len(history) - 140])
        rounds += 1
    assert rounds <= router.s.shadow_rounds + 2
    assert router.mode == "prompt_lookup" and not router.plain_ahead(history)


def test_router_probe_that_misses_ends_in_the_draft_model():
    prompt = list(range(50)) * 8
    router = AutoRouter(prompt, flat_costs(1.5), PromptLookupDrafter(8), _StubDraft())
    assert router.mode == "probe"
    for _ in range(4):
        router.propose(prompt, 8)
        router.observe(4, 0)  # lookup's drafts miss: the probe ends in the draft model
    assert router.mode == "draft_model"


def cpu_costs() -> CostModel:
    """Verify costs shaped like this CPU's: a jump from one token to two, then a slope."""
    return CostModel(tuple(0.01 * (1.0 if n == 1 else 1.27 + 0.07 * (n - 1)) for n in range(1, 18)))


def test_router_skips_weak_lookup_matches_where_they_do_not_pay_and_drafts_strong_ones():
    # A 50-token cycle that lookup copies; then a token seen once before, alone.
    cycle = list(range(50))
    history = cycle * 4 + [300, 7]
    router = AutoRouter(cycle * 4, cpu_costs(), PromptLookupDrafter(32))
    good = AcceptanceModel(prior=0.5)  # good evidence: strong matches draft long
    for _ in range(3):
        good.observe(16, 16)
    router.apply(Decision(Mode.PROMPT_LOOKUP, "test", record=good))
    assert router.propose(history, 32) == []  # [7] matched alone: weak, at 25% it does not pay here
    router.observe(0, 0)
    assert len(router.propose(cycle * 5, 32)) > 8  # a copied passage: strong
    # Where verifying more tokens costs almost nothing, the same weak match drafts.
    cheap = AutoRouter(cycle * 4, flat_costs(1.01), PromptLookupDrafter(32))
    cheap.apply(Decision(Mode.PROMPT_LOOKUP, "test"))
    assert cheap.propose(history, 32)[:1] == [8]
    cheap.observe(cheap.ledger.lookup_k, 0)
    assert cheap.ledger.weak.drafted == cheap.ledger.lookup_k > 0  # and the weak-match record learns from it


def test_router_scores_weak_shadow_drafts_in_the_weak_record():
    cycle = list(range(40))
    router = AutoRouter([], cpu_costs(), PromptLookupDrafter(16))
    router.apply(Decision(Mode.PLAIN, "test"))
    history = cycle + [300, 7]  # [7] matches alone: a weak shadow
    router.propose(history, 16)
    history.append(99)  # it missed
    router.propose(history, 16)
    assert router.ledger.weak.drafted > 0 and router.ledger.weak.accepted == 0
    assert router.ledger.shadows.positions == 0  # the shadow record did not count it


def test_router_probe_skips_a_weak_match_that_does_not_pay():
    cycle = list(range(50))
    history = cycle * 4 + [300, 7]  # [7] matched alone
    router = AutoRouter(cycle * 4, cpu_costs(), PromptLookupDrafter(32))
    assert router.mode == "probe"
    assert router.propose(history, 32) == []
    strong = AutoRouter(cycle * 4, cpu_costs(), PromptLookupDrafter(32))
    drafts = strong.propose(cycle * 5, 32)  # a copied passage: drafted long at once
    assert len(drafts) > 4 and drafts == cycle[: len(drafts)]
    cheap = AutoRouter(cycle * 4, flat_costs(1.01), PromptLookupDrafter(32))
    assert cheap.propose(history, 32)[:4] == [8, 9, 10, 11]  # verifying is nearly free: the weak match is probed


def test_router_probe_drafts_a_weak_match_whole_until_one_misses_then_what_weak_matches_pay_for():
    # A copy often starts from a one-token match, so the probe drafts the first
    # weak match at its whole length; once one has missed in this request, a weak
    # match drafts only what the weak record pays for (fresh text's one-token
    # matches keep missing).
    cycle = list(range(50))
    history = cycle * 4 + [300, 7]  # [7] matched alone
    router = AutoRouter(cycle * 4, flat_costs(1.3), PromptLookupDrafter(32))
    alone = Evidence.alone(router.lookup_costs)
    first = router.propose(history, 32)
    assert first == [8, 9, 10, 11] and lookup_length(router.ledger.weak, 32, alone)[0] < len(first)
    router.observe(len(first), 0)
    assert router.mode == "probe"
    second = router.propose(history + [301, 9], 32)  # [9] matched alone again
    assert second == [10, 11][: lookup_length(router.ledger.weak, 32, alone)[0]] and 0 < len(second) < len(first)


# -- the decision function (routing.decide): pure, over a ledger and a round's evidence

ALONE = Evidence.alone(RoundCosts(flat_costs(1.5)))


def _ledger_in(mode: Mode, max_lookup: int = 32, **carried) -> Ledger:
    """A ledger that has just entered ``mode`` (through the table)."""
    ledger = Ledger(max_lookup=max_lookup, lookup_k=4)
    ledger.enter(Decision(Mode.PROBE if mode == Mode.PROMPT_LOOKUP else mode, "test"))
    if mode == Mode.PROMPT_LOOKUP:
        ledger.enter(Decision(mode, "test", **carried))
    return ledger


def test_decide_chooses_the_first_mode_from_the_prompt_and_whether_a_draft_model_is_loaded():
    fresh = Ledger(max_lookup=8, lookup_k=4, facts="prompt 80 tokens")
    assert decide(fresh, ALONE) == Decision(Mode.PROBE, "prompt 80 tokens: probing prompt lookup")
    short = Ledger(max_lookup=8, lookup_k=4, lookup_allowed=False, facts="prompt 3 tokens")
    assert decide(short, ALONE).mode == Mode.PLAIN
    with_draft = decide(short, ALONE._replace(draft=_StubDraft()))
    assert with_draft.mode == Mode.DRAFT_MODEL and "draft model loaded" in with_draft.why
    assert fresh.mode is None and short.mode is None  # decide changes nothing


def test_decide_ends_a_probe_after_four_misses_in_the_fallback_mode_with_the_probe_as_shadow_evidence():
    ledger = _ledger_in(Mode.PROBE)
    missed = ALONE._replace(drafted=4, accepted=0)
    for _ in range(3):
        ledger.count(None, 4, 0, weak=False)
        assert decide(ledger, missed).mode == Mode.PROBE and not decide(ledger, missed).why
    ledger.count(None, 4, 0, weak=False)
    d = decide(ledger, missed)
    assert d.mode == Mode.PLAIN and d.why.startswith("probe acceptance 0% of 4 positions tried (0 of 16 drafted)")
    assert d.record is ledger.lookup_acceptance  # the probe's rounds: the shadow record's first evidence
    assert decide(ledger, missed._replace(draft=_StubDraft())).mode == Mode.DRAFT_MODEL
    assert ledger.mode == Mode.PROBE and ledger.misses == 4  # decide changed nothing
    ledger.take(d)
    assert ledger.mode == Mode.PLAIN and ledger.shadows.record is d.record and ledger.misses == 0


def test_the_probe_commits_on_its_rate_per_position_tried_whatever_its_draft_lengths():
    """The same accepted prefixes drafted 4 or 12 long: the positions past each
    round's first rejection were never tried, so the commit does not depend on
    how long the costs made the drafts (at 12 the token rate, 14%, would have
    kept the probe from lookup)."""
    decisions = []
    for length in (4, 12):
        ledger = _ledger_in(Mode.PROBE)
        for accepted in (3, 0, 3, 0, 3, 0, 3):  # 19 tokens produced: the probe's last round
            ledger.count(None, length, accepted, weak=False)
        assert (ledger.tried, ledger.accepted, ledger.drafted) == (19, 12, 7 * length)  # 4 + 1 + 4 + ... tried
        d = decide(ledger, ALONE._replace(drafted=length, accepted=3))
        decisions.append((d.mode, d.why.split(" (")[0]))
    assert decisions[0] == decisions[1] == (Mode.PROMPT_LOOKUP, "probe acceptance 63% of 19 positions tried")
    assert 12 / (7 * 12) < RouterSettings().commit_acceptance  # the token rate at 12


def test_a_probe_with_one_draft_accepted_on_new_text_does_not_commit_on_thin_evidence():
    """One draft accepted of two tried (a 5-token draft from a short match in
    new text, then rounds with nothing to draft) passes the 30% rate, but a
    switch from plain on shadows that thin would not be made: the probe falls
    back to plain decoding, its rounds the shadow record's first evidence."""
    ledger = _ledger_in(Mode.PROBE)
    ledger.count(None, 5, 1, weak=False)
    for _ in range(RouterSettings().probe_max_misses):
        ledger.count(None, 0, 0, weak=False)
    assert (ledger.tried, ledger.accepted) == (2, 1)
    d = decide(ledger, ALONE)
    assert d.mode == Mode.PLAIN and d.why.startswith("probe acceptance 50% of 2 positions tried")
    assert d.record is ledger.lookup_acceptance
    # The same rate on enough positions commits (the rule is evidence, not the rate).
    copied = _ledger_in(Mode.PROBE)
    for accepted in (1, 1, 1, 1, 1, 1, 1, 1):  # 16 tokens produced: the probe's last round
        copied.count(None, 5, accepted, weak=False)
    assert copied.tried == 16 and decide(copied, ALONE).mode == Mode.PROMPT_LOOKUP


def test_decide_commits_a_probe_accepted_whole_to_lookup_and_grows_its_drafts_meanwhile():
    ledger = _ledger_in(Mode.PROBE)
    whole = ALONE._replace(drafted=4, accepted=4)
    ledger.count(None, 4, 4, weak=False)
    assert decide(ledger, whole) == Decision(Mode.PROBE, lookup_k=32)  # x8, at most the lookup maximum
    for _ in range(3):
        ledger.count(None, 4, 4, weak=False)
    d = decide(ledger, whole)
    assert d.mode == Mode.PROMPT_LOOKUP and d.why.startswith(
        "probe acceptance 100% of 16 positions tried (16 of 16 drafted)"
    )
    assert d.lookup_k > 0 and d.record is ledger.lookup_acceptance  # the probe's rounds are lookup's first evidence


def test_decide_leaves_lookup_after_idle_rounds_and_when_no_length_pays():
    idle = _ledger_in(Mode.PROMPT_LOOKUP)
    for _ in range(RouterSettings().idle_lookup_rounds):
        idle.count(None, 0, 0, weak=False)
    d = decide(idle, ALONE)
    assert d == Decision(Mode.PLAIN, "nothing drafted in 8 rounds", record=idle.lookup_own)
    failing = _ledger_in(Mode.PROMPT_LOOKUP)
    for _ in range(RouterSettings().watch_rounds):
        failing.count(None, 8, 0, weak=False)
    cpu = Evidence.alone(RoundCosts(cpu_costs()))  # a verify of two tokens costs 27% more than one
    assert decide(failing, ALONE) == Decision(
        Mode.PROMPT_LOOKUP, lookup_k=1
    )  # where verifying is cheap, one still pays
    d = decide(failing, cpu)
    assert d.mode == Mode.PLAIN and "no draft length pays" in d.why and d.exit_counted
    failing.take(d)
    assert failing.lookup_exits == 1 and failing.mode == Mode.PLAIN


def test_decide_returns_to_the_draft_model_when_lookup_delivers_less_than_it_replaced():
    ev = ALONE._replace(draft=_StubDraft(), drafted=8, accepted=1)
    for replaced, retires in ((2.0, False), (3.0, True)):  # lookup's own rounds deliver x1.95 here
        ledger = _ledger_in(Mode.PROMPT_LOOKUP, replaced=replaced)
        for _ in range(RouterSettings().watch_rounds):
            ledger.count(None, 8, 1, weak=False)
        d = decide(ledger, ev)
        assert (d.mode == Mode.DRAFT_MODEL) == retires, d
    assert d.mode == Mode.DRAFT_MODEL and d.retire and "no more switches to lookup" in d.why
    ledger.take(d)
    assert ledger.lookup_retired and ledger.replaced_draft_speedup is None
    # Retired: shadows that promise more no longer move it.
    for i in range(20):
        ledger.shadows.add(i * 4, [1, 2, 3, 4], weak=False)
    ledger.shadows.score([1, 2, 3, 4] * 20)
    assert decide(ledger, ev) == Decision(Mode.DRAFT_MODEL)


def test_decide_moves_plain_decoding_to_lookup_on_shadow_evidence_only_with_enough_of_it():
    ledger = _ledger_in(Mode.PLAIN)
    ledger.shadows.add(0, [1, 2], weak=False)
    ledger.shadows.score([1, 2])
    assert ledger.shadows.positions == 2 and decide(ledger, ALONE) == Decision(Mode.PLAIN)  # fewer than 3 positions
    for i in range(1, 6):
        ledger.shadows.add(i * 8, list(range(8)), weak=False)
    ledger.shadows.score([1, 2] + [0] * 6 + list(range(8)) * 5)
    d = decide(ledger, ALONE)
    assert d.mode == Mode.PROMPT_LOOKUP and "shadow drafts" in d.why and d.record is ledger.shadows.record
    assert d.lookup_k > 0 and d.replaced is None


def test_decide_refuses_a_switch_outside_its_table():
    ledger = _ledger_in(Mode.PROBE)
    for _ in range(4):
        ledger.count(None, 4, 0, weak=False)
    with pytest.raises(AssertionError, match="no transition probe -> plain"):
        decide(ledger, ALONE, table={})
    with pytest.raises(AssertionError, match="no transition plain -> draft_model"):
        _ledger_in(Mode.PLAIN).enter(Decision(Mode.DRAFT_MODEL, "test"))
