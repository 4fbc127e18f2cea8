import mlx_engine as me
from mlx_engine.caches.sequence import UNKNOWN, SequenceCache
from mlx_engine.decode.loop import decode as _decode
from mlx_engine.decode.sampling import SamplingParams, build_sampler
from mlx_engine.draft.model import DraftModel
from mlx_engine.drafters.draft_model import DraftModelDrafter

import gc
import json
import shutil

import mlx.core as mx
import pytest
from helpers import assert_same_or_near_tie, generate_ids, loop_stats, run_alone

from fixtures.tiny_models import MarkovLM, make_model, successor_table


def decode(*args, **kwargs):
    return run_alone(_decode(*args, **kwargs))


def untimed_costs(verify, draft_step: float = 0.0):
    """Round costs that stay at ``verify``'s: the tiny models' timed rounds
    would otherwise re-price drafting by this machine's scheduling noise."""
    from mlx_engine.pricing.costs import RoundCosts

    class Untimed(RoundCosts):
        def observe(self, k: int, seconds: float | None) -> None:
            pass

    return Untimed(verify, draft_step=draft_step)


TEXT = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"


def test_same_model_draft_accepts_everything(llama_path):
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, TEXT)
    plain, _ = generate_ids(kit, prompt, max_tokens=24)
    me.load_draft_model(kit, llama_path)
    results = list(me.create_generator(kit, prompt, max_tokens=24, num_draft_tokens=4))
    ids = [t.id for r in results for t in r.tokens]
    s = results[-1].stats
    assert s.decoding_mode == "draft_model"
    assert_same_or_near_tie(kit, prompt, plain, ids)
    if ids == plain:
        assert s.acceptance_rate == 1.0
        assert s.rejected_tokens == 0
    assert s.drafted_tokens > 0 and s.verify_rounds > 0
    assert sum(t.from_draft for r in results for t in r.tokens) == s.accepted_tokens


@pytest.mark.parametrize("k", [None, 1, 3, 8])
def test_draft_greedy_output_equals_plain(llama_path, draft_path, k, cheap_draft):
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, TEXT)
    plain, _ = generate_ids(kit, prompt, max_tokens=30, speculative_decoding_toggle=None)
    me.load_draft_model(kit, draft_path)
    ids, final = generate_ids(kit, prompt, max_tokens=30, num_draft_tokens=k)
    assert final.stats.decoding_mode == "draft_model"
    assert final.stats.drafted_tokens == final.stats.accepted_tokens + final.stats.rejected_tokens
    assert len(final.stats.acceptance_by_position) >= 1
    assert_same_or_near_tie(kit, prompt, plain, ids)
    # Follow-up requests reuse the prefix in both caches and stay exact.
    follow = prompt + ids + me.tokenize(kit, "\n    def norm(self):")
    ids2, f2 = generate_ids(kit, follow, max_tokens=20, num_draft_tokens=k)
    assert f2.stats.cached_tokens >= len(prompt)
    fresh = me.load_model(llama_path)
    assert_same_or_near_tie(fresh, follow, generate_ids(fresh, follow, max_tokens=20)[0], ids2)


def test_toggle_false_skips_draft_and_true_requires_one(llama_path, draft_path):
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, TEXT)
    with pytest.raises(ValueError, match="requires a draft model"):
        me.create_generator(kit, prompt, speculative_decoding_toggle=True)
    me.load_draft_model(kit, draft_path)
    _, final = generate_ids(kit, prompt, max_tokens=5, speculative_decoding_toggle=False)
    assert final.stats.decoding_mode == "plain" and final.stats.drafted_tokens == 0
    for bad in (0, 17, "3", True):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            me.create_generator(kit, prompt, num_draft_tokens=bad)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        me.create_generator(kit, prompt, num_draft_tokens=2, speculative_decoding_toggle=False)


def test_compatibility_report(llama_path, draft_path, foreign_tokenizer_path, tmp_path):
    vocab_kit = me.load_model(llama_path, vocab_only=True)
    assert me.check_draft_model(vocab_kit, draft_path).compatible  # padded embeddings are fine
    assert me.is_draft_model_compatible(vocab_kit, draft_path)
    report = me.check_draft_model(vocab_kit, foreign_tokenizer_path)
    assert not report and any("tokenizers differ" in r for r in report.reasons)
    assert not me.is_draft_model_compatible(vocab_kit, tmp_path / "missing")
    assert "does not exist" in me.check_draft_model(vocab_kit, tmp_path / "missing").reasons[0]
    kit = me.load_model(llama_path)
    with pytest.raises(me.IncompatibleDraftModelError, match="tokenizers differ") as err:
        me.load_draft_model(kit, foreign_tokenizer_path)
    assert err.value.reasons
    assert kit.draft is None
    # A path that is not there is not found (ModelLoadError), not "not compatible".
    with pytest.raises(me.ModelLoadError, match="does not exist") as missing:
        me.load_draft_model(kit, tmp_path / "missing")
    assert not isinstance(missing.value, me.IncompatibleDraftModelError)


def test_drafts_differing_only_in_details_that_speculation_ignores_are_accepted(llama_path, draft_path, tmp_path):
    """Same token ids, but no pad token, another set of special ids and a larger
    embedding: notes in the report, not reasons; the output is the plain one."""
    d = tmp_path / "other-tool-draft"
    shutil.copytree(draft_path, d)
    tok_config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tok_config, "pad_token": None, "unk_token": "<|im_end|>"}))
    kit = me.load_model(llama_path)
    report = me.check_draft_model(kit, d)
    assert report.compatible, report.reasons
    assert any("pad_token_id differs" in n for n in report.notes)
    assert any("special" in n for n in report.notes)
    assert any("embedding rows differ" in n for n in report.notes)  # the draft fixture pads 16 rows
    assert not me.check_draft_model(kit, draft_path).reasons
    prompt = me.tokenize(kit, "for i in range(10):")
    plain = generate_ids(kit, prompt, max_tokens=12)[0]
    me.load_draft_model(kit, d)
    assert_same_or_near_tie(kit, prompt, plain, generate_ids(kit, prompt, max_tokens=12, num_draft_tokens=3)[0])


def test_load_unload_any_time_keeps_main_cache(llama_path, draft_path):
    kit = me.load_model(llama_path)
    me.unload_draft_model(kit)  # none loaded: no-op
    prompt = me.tokenize(kit, TEXT)
    generate_ids(kit, prompt, max_tokens=5)
    me.load_draft_model(kit, draft_path)
    me.load_draft_model(kit, draft_path)  # twice replaces
    ids, final = generate_ids(kit, prompt, max_tokens=5)
    assert final.stats.cached_tokens == len(prompt) - 1
    me.unload_draft_model(kit)
    me.unload_draft_model(kit)
    assert kit.draft is None
    ids2, final2 = generate_ids(kit, prompt, max_tokens=5)
    assert final2.stats.cached_tokens == len(prompt) - 1
    assert final2.stats.decoding_mode == "plain"
    gen = me.create_generator(kit, prompt, max_tokens=5)
    next(gen)
    with pytest.raises(me.GenerationInProgressError):
        me.load_draft_model(kit, draft_path)
    gen.close()


def test_unload_releases_draft_memory(llama_path, models_dir):
    big_draft = make_model(models_dir / "big_draft", "llama", hidden=384, layers=4, seed=9, tokenizer_from=llama_path)
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, TEXT)
    generate_ids(kit, prompt, max_tokens=4)
    import gc

    gc.collect()  # active memory is process-wide: free earlier tests' garbage first (unloading collects too)
    mx.clear_cache()
    before = mx.get_active_memory()
    me.load_draft_model(kit, big_draft)
    generate_ids(kit, prompt, max_tokens=8, num_draft_tokens=3)
    loaded = mx.get_active_memory()
    assert loaded - before > 4_000_000
    me.unload_draft_model(kit)
    after = mx.get_active_memory()
    # Nothing of the draft stays (the main cache may have been re-laid out by the
    # prompt cache in between, so it is not required to match byte for byte).
    assert after <= 1.02 * before


@pytest.mark.parametrize("when", ["close", "stop"])
def test_cancel_mid_round_then_generation_is_correct(llama_path, draft_path, when):
    kit = me.load_model(llama_path)
    kit.eos_token_ids = set()  # the random model must not end early
    me.load_draft_model(kit, draft_path)
    prompt = me.tokenize(kit, TEXT)
    gen = me.create_generator(kit, prompt, max_tokens=40, num_draft_tokens=4, request_id="r")
    for i, r in enumerate(gen):
        if i == 5:
            if when == "close":
                gen.close()
                break
            me.stop_generation(kit, "r")
    else:
        assert r.stop_condition.stop_reason == "user_cancelled"
    for cache in (kit.cache, kit.draft.first_cache):
        # One entry per cached position; ids of an abandoned queued round are
        # UNKNOWN, and only at the end, where the next prefix match stops.
        assert len(cache.tokens) == cache.layers[0].offset
        if UNKNOWN in cache.tokens:
            assert set(cache.tokens[cache.tokens.index(UNKNOWN) :]) == {UNKNOWN}
    if when == "close":  # closed while the next round's lazy drafts were queued
        assert UNKNOWN in kit.cache.tokens
    follow = prompt + me.tokenize(kit, " def area")
    ids, _ = generate_ids(kit, follow, max_tokens=20, num_draft_tokens=4)
    fresh = me.load_model(llama_path)
    fresh.eos_token_ids = set()
    assert_same_or_near_tie(fresh, follow, generate_ids(fresh, follow, max_tokens=20)[0], ids)


@pytest.mark.slow
def test_progress_covers_draft_prefill_and_cancel_there(llama_path, draft_path):
    kit = me.load_model(llama_path)
    me.load_draft_model(kit, llama_path)  # same size: draft prefill is half the work
    prompt = me.tokenize(kit, "for i in range(10):\n    print(i)\n" * 70)
    seen = []
    results = list(
        me.create_generator(kit, prompt, max_tokens=3, prompt_progress_callback=lambda p: seen.append(p) or True)
    )
    assert seen == sorted(seen) and seen[-1] == 100.0 and any(55 < p < 100 for p in seen)
    kit2 = me.load_model(llama_path)
    me.load_draft_model(kit2, llama_path)
    # Cancel past half way: the main model's first chunk and the draft's (in the same step) are in.
    results = list(me.create_generator(kit2, prompt, max_tokens=3, prompt_progress_callback=lambda p: p <= 55))
    assert results[-1].stop_condition.stop_reason == "user_cancelled"
    ids, final = generate_ids(kit2, prompt, max_tokens=6)
    assert ids == generate_ids(kit, prompt, max_tokens=6)[0]


def test_full_rotating_cache_falls_back_to_plain(llama_path, draft_path):
    kit = me.load_model(llama_path, max_kv_size=64)
    me.load_draft_model(kit, draft_path)
    prompt = me.tokenize(kit, "for i in range(10):\n    print(i)\n" * 10)
    ids, final = generate_ids(kit, prompt, max_tokens=10)
    assert len(ids) == 10
    assert final.stats.decoding_mode == "plain"
    assert "cannot be rewound" in final.stats.mode_reason


@pytest.mark.slow
def test_sampling_distribution_is_exact_with_a_poor_draft():
    """Sample-and-match keeps the target's distribution, even when the draft
    disagrees with it: compare the joint law of two sampled tokens with the
    exact one by a chi-square test on a 4-token vocabulary."""
    vocab = 4
    target_logits = mx.array(
        [[1.0, 0.2, -0.5, 0.0], [0.0, 1.5, 0.3, -1.0], [0.4, 0.4, 0.4, 0.0], [-1.0, 0.0, 0.0, 2.0]]
    )
    draft_logits = mx.array([[0.0, 0.0, 3.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0], [0.0, 3.0, 0.0, 0.0]])
    p = mx.softmax(target_logits, axis=-1)
    exact = {(a, b): p[0, a].item() * p[a, b].item() for a in range(vocab) for b in range(vocab)}
    target, draft_model = MarkovLM(target_logits), MarkovLM(draft_logits)
    counts = dict.fromkeys(exact, 0)
    runs = 2000
    for run in range(runs):
        sampler = build_sampler(SamplingParams(temp=1.0, seed=run))  # a sampler carries its own seed
        cache = SequenceCache(target)
        drafter = DraftModelDrafter(DraftModel(None, draft_model, SequenceCache(draft_model), 0), 2)
        steps = decode(cache, [0], 2, sampler, [], 20, drafter)
        a, b = (s.token for s in steps)
        counts[(a, b)] += 1
    chi2 = sum((counts[c] - runs * q) ** 2 / (runs * q) for c, q in exact.items())
    assert chi2 < 37.7  # chi-square, 15 degrees of freedom, p = 0.001


def test_markov_target_and_draft_greedy_exact():
    table = successor_table(50)
    target, draft_model = MarkovLM(table), MarkovLM(successor_table(50, seed=5))
    sampler = build_sampler(SamplingParams())
    plain = [s.token for s in decode(SequenceCache(target), [3], 40, sampler, [], 20, None)]
    drafter = DraftModelDrafter(DraftModel(None, draft_model, SequenceCache(draft_model), 0), 5)
    steps = list(decode(SequenceCache(target), [3], 40, sampler, [], 20, drafter))
    stats = loop_stats(steps)
    spec = [s.token for s in steps]
    assert spec == plain
    assert stats.accepted_tokens > 0


def test_decode_reports_round_times_to_the_drafter():
    table = successor_table(50)
    target = MarkovLM(table)
    seen = []

    class Recorder(DraftModelDrafter):
        def observe(self, drafted, accepted, seconds=None):
            seen.append((drafted, seconds))

    drafter = Recorder(DraftModel(None, MarkovLM(table), SequenceCache(MarkovLM(table)), 0), 3)
    sampler = build_sampler(SamplingParams())
    list(decode(SequenceCache(target), [3], 30, sampler, [], 20, drafter))
    assert seen[0][1] is None  # the first round has no previous result to time from
    assert len(seen) > 3 and all(s > 0 for _, s in seen[1:])


def test_adaptive_length_rests_a_confident_draft_model_that_is_always_wrong():
    from mlx_engine.pricing.costs import CostModel

    table = successor_table(50)
    target, draft_model = MarkovLM(table), MarkovLM(mx.roll(table, 1, axis=1))  # every draft is wrong
    verify = CostModel(tuple(0.01 * (1 + 0.3 * (n - 1)) for n in range(1, 18)))  # each drafted token costs 0.3 steps
    sampler = build_sampler(SamplingParams())
    plain = [s.token for s in decode(SequenceCache(target), [3], 120, sampler, [], 20, None)]
    draft = DraftModel(None, draft_model, SequenceCache(draft_model), 0)
    drafter = DraftModelDrafter(draft, None, untimed_costs(verify, draft_step=0.2), vocab_size=50)
    steps = list(decode(SequenceCache(target), [3], 120, sampler, [], 20, drafter))
    assert [s.token for s in steps] == plain
    drafted = [(i, s.outcome.drafted) for i, s in enumerate(steps) if s.outcome is not None and s.outcome.drafted]
    # The draft is ~98% sure of each wrong draft: the first round drafts far on
    # that, then the rejections scale its confidence down, so the next drafts
    # are shorter, until score_every rounds in a row accepted nothing.
    first = [k for _, k in drafted[: drafter.policy.score_every]]
    assert first[0] > 2 and first[1:] == sorted(first[1:], reverse=True) and first[-1] == 1, drafted
    # Then it rests, and its scoring, at the end of each rest and within the
    # long ones, never finds it right: it never drafts again.
    assert len(drafted) == drafter.policy.score_every, drafted


def test_adaptive_length_resumes_when_the_draft_model_turns_right():
    from mlx_engine.pricing.costs import CostModel

    table = successor_table(96)
    # The draft is wrong after tokens below 25 (it skips one) and right after the rest.
    draft_table = mx.where(mx.arange(96)[:, None] < 25, mx.roll(table, 1, axis=1), table)
    target, draft_model = MarkovLM(table), MarkovLM(draft_table)
    verify = CostModel(tuple(0.01 * (1 + 0.3 * (n - 1)) for n in range(1, 18)))
    sampler = build_sampler(SamplingParams())
    plain = [s.token for s in decode(SequenceCache(target), [3], 70, sampler, [], 20, None)]
    draft = DraftModel(None, draft_model, SequenceCache(draft_model), 0)
    drafter = DraftModelDrafter(draft, None, untimed_costs(verify, draft_step=0.2), vocab_size=96)
    steps = list(decode(SequenceCache(target), [3], 70, sampler, [], 20, drafter))
    assert [s.token for s in steps] == plain  # 4, 5, ...: drafts are right from output position 22 on
    rounds = [(i, s.outcome) for i, s in enumerate(steps) if s.outcome is not None and s.outcome.drafted]
    # In the wrong stretch: the first rounds only (scoring kept it resting).
    assert len([i for i, _ in rounds if i < 22]) == drafter.policy.score_every, rounds
    # Drafting resumed at the first scoring of the resting draft model that found
    # it right (they are rest_score_every rounds apart at most; the rest it was in
    # when it turned right had 10 rounds to go). The drafts grew as they kept
    # being accepted.
    resumed = [(i, o) for i, o in rounds if i >= 22]
    assert resumed and resumed[0][0] <= 22 + drafter.policy.rest_score_every + 4, rounds
    assert all(o.accepted == o.drafted for _, o in resumed) and max(o.drafted for _, o in resumed) > 3, rounds
    assert sum(o.accepted for _, o in resumed) >= 20, rounds


def test_the_next_draft_is_worth_computing_while_its_best_chance_pays_for_it():
    from mlx_engine.drafters.policy import DraftLengthPolicy
    from mlx_engine.pricing.costs import CostModel, RoundCosts

    # Rounds of k drafts cost 1.34 + 0.19·k undrafted steps (the example in keep_drafting).
    verify = CostModel((0.01,) + tuple(0.01 * (1.34 + 0.19 * k) for k in range(1, 17)))
    policy = DraftLengthPolicy(None, RoundCosts(verify), confident=True)
    assert policy.keep_drafting([0.9, 0.6 / 0.9])  # survivals 0.9, 0.6: a third may add 0.6 tokens
    assert not policy.keep_drafting([0.9, 0.2 / 0.9])
    assert policy.keep_drafting([0.3])  # one draft this sure does not pay, but with a second it may
    assert not policy.keep_drafting([0.1])
    # Rounds fitted to cost the same whatever they draft (slope 0): draft on.
    flat = DraftLengthPolicy(None, RoundCosts(CostModel((0.01,) + (0.02,) * 16)), confident=True)
    assert flat.keep_drafting([0.5, 0.2, 0.1])
    # Drafts accepted less often than the draft was sure of them scale its
    # confidence down; drafts accepted more often never scale it up.
    policy.note_drafts([0.95, 0.95, 0.95])
    policy.observe(3, 0)
    assert policy.survival([0.95])[0] == pytest.approx(0.95 * 2 / (2 + 0.95))  # weight 2 at 1.0, one miss at 0.95
    sure = DraftLengthPolicy(None, RoundCosts(verify), confident=True)
    sure.note_drafts([0.5, 0.5])
    sure.observe(2, 2)
    assert sure.survival([0.5, 0.5]) == [0.5, 0.25]


def _cpu_verify_costs():
    """Verify costs shaped like this CPU's: a jump from one token to two, then a slope."""
    from mlx_engine.pricing.costs import CostModel

    return CostModel((0.01,) + tuple(0.01 * (1.34 + 0.19 * k) for k in range(1, 17)))


def _rest_round(policy, matches: list[bool]) -> bool:
    """One queued-ahead round of a rest, as the drafter runs it: the resting
    draft model scored (``matches``) when due. Whether it was."""
    due = policy.score_due()
    if due:
        policy.scoring()
    policy.skip()
    if due:
        policy.observe_scored(matches)
    policy.observe(0, 0)
    return due


def test_a_resting_draft_model_is_scored_and_wakes_only_where_it_is_right_now():
    from mlx_engine.drafters.policy import DraftLengthPolicy
    from mlx_engine.pricing.costs import RoundCosts

    verify = _cpu_verify_costs()
    rest_round = _rest_round

    def resting() -> DraftLengthPolicy:
        policy = DraftLengthPolicy(None, RoundCosts(verify), scores=True, confident=True)
        for _ in range(policy.score_every):  # sure drafts, all rejected: a rest
            policy.note_drafts([0.9])
            policy.observe(1, 0)
        # Scored wrong at the end of each rest (4, 8, 16 rounds), and every
        # rest_score_every rounds of the longest: it rests on, never drafting.
        scored = []
        for i in range(60):
            assert policy.idle_next(), i
            if rest_round(policy, [False] * 8):
                scored.append(i)
        assert scored == [3, 11, 20, 27, 36, 43, 52, 59]
        return policy

    def next_scoring(policy: DraftLengthPolicy, matches: list[bool]) -> None:
        while not rest_round(policy, matches):
            pass

    # Right over the last positions decoded: drafting pays again, the rest ends.
    woken = resting()
    next_scoring(woken, [False] + [True] * 7)
    assert not woken.idle_next() and woken.num_tokens(64) > 0
    # As often right, but wrong at the last position: it rests on.
    wrong_now = resting()
    next_scoring(wrong_now, [True] * 7 + [False])
    assert wrong_now.idle_next() and wrong_now.num_tokens(64) == 0
    # Right at the last position only, on a record of misses: it rests on.
    lucky = resting()
    next_scoring(lucky, [False] * 7 + [True])
    assert lucky.idle_next()


def test_one_right_guess_among_misses_does_not_wake_a_resting_draft_model_but_brings_its_next_scoring_sooner():
    from mlx_engine.drafters.policy import DraftLengthPolicy
    from mlx_engine.pricing.costs import CostModel, RoundCosts

    def rested_after_a_good_run() -> DraftLengthPolicy:
        """A draft model whose record pays (verifying drafts costs little, as on
        a GPU), resting after 4 rounds all rejected."""
        cheap = CostModel((0.01,) + tuple(0.01 * (1.05 + 0.02 * k) for k in range(1, 17)))
        policy = DraftLengthPolicy(None, RoundCosts(cheap), scores=True, confident=True)
        for _ in range(8):
            policy.note_drafts([0.9, 0.9, 0.9])
            policy.observe(3, 3)
        for _ in range(policy.score_every):
            policy.note_drafts([0.9])
            policy.observe(1, 0)
        assert policy.idle_next()
        return policy

    lucky = rested_after_a_good_run()
    scored = [i for i in range(4) if _rest_round(lucky, [False, True, False, False, True, False, True])]
    assert scored == [3] and lucky._drafting_pays()  # its record pays: only the scoring keeps it resting
    assert lucky.idle_next()
    # The next rest (8 rounds) is scored after 4 of them, not only at its end.
    assert [i for i in range(8) if _rest_round(lucky, [False] * 4)] == [4, 7]
    for matches in ([True, True, False, True], [False, True, True]):  # right now, and mostly or twice in a row
        woken = rested_after_a_good_run()
        while not _rest_round(woken, matches):
            pass
        assert not woken.idle_next() and woken.num_tokens(64) > 0


def test_scored_positions_count_as_the_rounds_drafting_through_them_would_make():
    from mlx_engine.drafters.policy import DraftLengthPolicy

    scored, drafted = DraftLengthPolicy(None, scores=True), DraftLengthPolicy(None)
    scored.observe_scored([True, True, False, False, True])
    # A round drafting from each position: 2 accepted, 1, none, none, and 1
    # cut off by the end (the next position is not decoded yet).
    for k, a in ((3, 2), (2, 1), (1, 0), (1, 0), (1, 1)):
        drafted.acceptance.observe(k, a)
    assert scored.acceptance.tries == drafted.acceptance.tries
    assert scored.acceptance.hits == drafted.acceptance.hits
    assert scored.acceptance.conditional()[:3] == drafted.acceptance.conditional()[:3]


def test_adaptive_length_backs_off_exploring_and_times_undrafted_rounds():
    from mlx_engine.pricing.costs import CostModel, RoundCosts

    verify = CostModel(tuple(0.01 * (1 + 0.5 * (n - 1)) for n in range(1, 18)))
    drafter = DraftModelDrafter(None, None, RoundCosts(verify, draft_step=0.2))
    explored = []
    for i in range(200):
        k = drafter.num_tokens(16)
        if k:
            explored.append(i)
        drafter.observe(k, 0, None)  # every draft is rejected; rounds are not timed
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    # No length pays from the start: the first exploration draft comes after one
    # undrafted round, and the gap doubles while exploring keeps failing.
    assert explored[0] == 1 and gaps == [4, 8, 16, 32, 64, 64], explored
    # Once rounds are timed, an undrafted round is timed whenever none is recent:
    # right after a rejected draft, or after max_timing_wait rounds of accepts.
    rounds = RoundCosts(verify, draft_step=0.2)
    timed = DraftModelDrafter(None, None, rounds)
    for _ in range(5):
        timed.observe(3, 3, 0.02)  # drafting pays: every draft accepted, rounds cheap
    assert rounds.needs_undrafted_timing()
    lengths = []
    while not lengths or lengths[-1]:
        lengths.append(timed.num_tokens(16))
        timed.observe(lengths[-1], lengths[-1], 0.01 if lengths[-1] == 0 else 0.02)
    assert len(lengths) == timed.policy.max_timing_wait + 1 and min(lengths[:-1]) > 0
    assert not rounds.needs_undrafted_timing() and timed.num_tokens(16) > 0
    rejected = DraftModelDrafter(None, None, RoundCosts(verify, draft_step=0.2))
    rejected.observe(3, 3, 0.02)
    rejected.observe(4, 2, 0.02)
    assert rejected.num_tokens(16) == 0


def test_exploration_drafts_the_most_promising_length():
    from mlx_engine.pricing.costs import CostModel, RoundCosts

    # Going from a 1-token pass to a 2-token one doubles the cost; each further
    # token adds 5% of a step (MLX's CPU kernels at a long context look like
    # this). At 50% acceptance no length pays, but a one-token exploration draft
    # would be the least informative and the dearest per token.
    verify = CostModel((0.01,) + tuple(0.02 + 0.0005 * (n - 2) for n in range(2, 18)))
    drafter = DraftModelDrafter(None, None, RoundCosts(verify), prior_acceptance=0.5)
    lengths = [drafter.num_tokens(16) for _ in range(drafter.policy.explore_every)]
    assert lengths[:-1] == [0] * (drafter.policy.explore_every - 1)
    assert lengths[-1] > 2, lengths


def test_rounds_after_the_draft_model_caught_up_are_not_timed():
    from mlx_engine.pricing.costs import CostModel, RoundCosts

    table = successor_table(50)
    timed = []

    class Recording(RoundCosts):
        def observe(self, k, seconds):
            timed.append((k, seconds))

    draft = DraftModel(None, MarkovLM(table), SequenceCache(MarkovLM(table)), 0)
    drafter = DraftModelDrafter(draft, 3, Recording(CostModel((0.01,) * 17)), vocab_size=50)
    history = list(range(10))
    drafter.propose(history, 16)  # the draft model processes all 10 tokens first
    drafter.observe(3, 3, 0.05)
    history += [10, 11, 12, 13]  # three drafts accepted plus the target's token
    drafter.propose(history, 16)  # catches up on two tokens: a steady round
    drafter.observe(3, 1, 0.02)
    drafter.observe(0, 0, 0.01)  # undrafted rounds are always timed
    assert timed == [(3, None), (3, 0.02), (0, 0.01)]


def test_the_next_draft_is_at_most_twice_as_far_as_the_last_got_plus_two():
    from mlx_engine.pricing.costs import CostModel, RoundCosts

    # Drafts are nearly free and acceptance has been perfect: the longest pays.
    drafter = DraftModelDrafter(None, None, RoundCosts(CostModel((0.01,) * 17)), prior_acceptance=0.95)
    for _ in range(5):
        drafter.observe(16, 16)
    assert drafter.num_tokens(16) == 16
    drafter.observe(16, 1)  # the burst ends at the second draft
    assert drafter.num_tokens(16) == 2 * (1 + 1) + 2
    for _ in range(5):
        drafter.observe(3, 3)  # short rounds, every draft accepted
    assert drafter.num_tokens(16) == 2 * 3 + 2  # not straight to 16: positions past 3 are untested
    drafter.observe(8, 8)  # a fully accepted longer round lifts the bound
    assert drafter.num_tokens(16) == 16


def test_failed_draft_load_keeps_the_previous_draft(llama_path, draft_path, tmp_path):
    """load_draft_model is all or nothing: truncated weights raise ModelLoadError
    and the draft that was loaded keeps serving."""
    import shutil

    kit = me.load_model(llama_path)
    me.load_draft_model(kit, draft_path)
    before = kit.draft
    broken = shutil.copytree(draft_path, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(me.ModelLoadError, match="truncated"):
        me.load_draft_model(kit, broken)
    assert kit.draft is before
    prompt = me.tokenize(kit, "for i in range(10):\n")
    ids, final = generate_ids(kit, prompt, max_tokens=8, num_draft_tokens=2)
    assert final.stats.drafted_tokens > 0


@pytest.mark.parametrize(
    "mode", [dict(), dict(num_draft_tokens=3), dict(prompt_lookup_num_tokens=4, speculative_decoding_toggle=False)]
)
def test_seeded_sampling_is_reproducible_with_a_fixed_draft_length(llama_path, draft_path, mode):
    """docs/decoding.md#seeds: a seed reproduces the text (tests/test_seeded_sampling.py
    checks that it is the same text in every mode)."""
    kit = me.load_model(llama_path)
    me.load_draft_model(kit, draft_path)
    prompt = me.tokenize(kit, "for i in range(10):\n    print(i)\n" * 3)
    if "num_draft_tokens" not in mode:
        mode = dict(mode, speculative_decoding_toggle=False)
    runs = [generate_ids(kit, prompt, max_tokens=24, temp=0.8, seed=3, **mode)[0] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_a_draft_model_remembers_its_acceptance_across_requests():
    table = successor_table(50)
    target = MarkovLM(table)
    wrong = mx.array([[8.0 if t % 3 == 0 and j == (t + 2) % 50 else 0.0 for j in range(50)] for t in range(50)])
    draft_lm = MarkovLM(table + wrong * 2)  # after every third token it guesses t+2, not t+1
    draft = DraftModel(None, draft_lm, SequenceCache(draft_lm), 0)
    assert draft.acceptance_prior(0.6) == 0.6  # nothing seen yet
    sampler = build_sampler(SamplingParams())
    stats = loop_stats(list(decode(SequenceCache(target), [3], 60, sampler, [], 20, DraftModelDrafter(draft, 4))))
    assert draft.drafted_seen >= 32
    seen = draft.accepted_seen / draft.drafted_seen
    assert seen == pytest.approx(stats.accepted_tokens / stats.drafted_tokens, rel=0.05)  # decaying counts
    assert 0 < seen < 1
    # The next request's adaptive length starts from that record, not the generic prior.
    nxt = DraftModelDrafter(draft, None)
    assert nxt.acceptance.prior == pytest.approx(seen)
    assert draft.acceptance_prior(0.6) == pytest.approx(seen)


def test_a_resting_draft_model_lets_the_loop_queue_rounds_ahead():
    from mlx_engine.pricing.costs import CostModel

    table = successor_table(50)
    target, draft_model = MarkovLM(table), MarkovLM(mx.roll(table, 1, axis=1))  # every draft is wrong
    verify = CostModel(tuple(0.01 * (1 + 0.3 * (n - 1)) for n in range(1, 18)))
    sampler = build_sampler(SamplingParams())
    plain = [s.token for s in decode(SequenceCache(target), [3], 120, sampler, [], 20, None)]
    drafter = DraftModelDrafter(
        DraftModel(None, draft_model, SequenceCache(draft_model), 0),
        None,
        untimed_costs(verify, draft_step=0.2),
        vocab_size=50,
    )
    skipped, proposed = [], []
    skip, propose = drafter.policy.skip, drafter.propose
    drafter.policy.skip = lambda: (skipped.append(1), skip())[1]
    drafter.propose = lambda history, limit: (proposed.append(len(history)), propose(history, limit))[1]
    steps = list(decode(SequenceCache(target), [3], 120, sampler, [], 20, drafter))
    assert [s.token for s in steps] == plain
    assert len(skipped) > 80  # most rounds of a rest were queued ahead, without propose
    assert loop_stats(steps).verify_rounds <= 12 and len(proposed) + len(skipped) >= 119


@pytest.mark.slow
def test_unloading_a_draft_gives_back_all_of_its_memory(llama_path, draft_path):
    """Issue 56: a draft loaded, used (fixed-length drafting) and unloaded leaves
    the kit's active memory exactly where the same kit stands after plain
    generations alone. The kit's own caches grow once while it warms up (a KV
    step of the main model), with or without a draft: measured after that."""
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, "def add(a, b):\n")

    def plain() -> int:
        for _ in range(3):
            generate_ids(kit, prompt, max_tokens=16, speculative_decoding_toggle=False)
        gc.collect()
        mx.clear_cache()
        return mx.get_active_memory()

    try:
        for _ in range(2):  # warm-up: first allocations of both paths
            me.load_draft_model(kit, draft_path)
            generate_ids(kit, prompt, max_tokens=16, num_draft_tokens=3)
            me.unload_draft_model(kit)
            plain()
        before = plain()
        me.load_draft_model(kit, draft_path)
        generate_ids(kit, prompt, max_tokens=16, num_draft_tokens=3)
        assert kit.draft is not None
        me.unload_draft_model(kit)
        assert abs(plain() - before) <= 2**20  # allocator noise under 1 MiB; a leaked draft was 3.7 MB
    finally:
        me.unload(kit)


def test_the_loaded_draft_has_a_name(llama_path, draft_path):
    """``draft_name``: what ``load_draft_model`` was given (its ``name``, else the
    path as given), None without a draft; a host reads it instead of keeping its own."""
    kit = me.load_model(llama_path)
    assert me.draft_name(kit) is None
    me.load_draft_model(kit, draft_path)
    assert me.draft_name(kit) == str(draft_path)
    me.load_draft_model(kit, draft_path, name="drafty")
    assert me.draft_name(kit) == "drafty"
    me.unload_draft_model(kit)
    assert me.draft_name(kit) is None
