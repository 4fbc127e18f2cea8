"""Unit tests of the pipeline's parts on their own: the sequence cache, the
verify loop, stop-string matching, decoding plans and request bookkeeping."""

import mlx_engine as me
from mlx_engine.caches.sequence import UNKNOWN, CacheOptions, SequenceCache, common_prefix_length
from mlx_engine.decode.loop import decode
from mlx_engine.decode.sampling import SamplingParams, build_sampler
from mlx_engine.request.options import DecodingOptions
from mlx_engine.request.plan import DecodingPlan, choose_plan
from mlx_engine.request.stop_strings import StopStringMatcher

import gc

import mlx.core as mx
import pytest
from helpers import generate_ids, loop_stats, run_alone

from fixtures.tiny_models import MarkovLM, successor_table

VOCAB = 50


# -- SequenceCache ----------------------------------------------------------------------
def markov(vocab: int = VOCAB) -> MarkovLM:
    return MarkovLM(successor_table(vocab, sharpness=12.0), num_layers=2)


def test_cache_records_tokens_and_rewinds():
    cache = SequenceCache(markov())
    cache.prefill(list(range(10)), chunk_size=4)
    assert cache.tokens == list(range(10)) and cache.layers[0].offset == 10
    assert cache.rewind_to(6) and cache.tokens == list(range(6)) and cache.layers[0].offset == 6
    assert cache.sync_to([0, 1, 2, 9, 9]) == 3 and cache.layers[1].offset == 3


def test_prefill_reports_chunks_and_records_keys():
    cache = SequenceCache(markov())
    seen = []
    cache.prefill([1, 2, 3, 4, 5], seen.append, chunk_size=2, keys=[-5, -4, -3, -2, -1])
    assert seen == [2, 2, 1]
    assert cache.tokens == [-5, -4, -3, -2, -1]


def test_prefill_interrupted_between_chunks_leaves_a_consistent_cache():
    cache = SequenceCache(markov())

    def stop_after_first(n):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.prefill(list(range(8)), stop_after_first, chunk_size=3)
    assert cache.tokens == [0, 1, 2] and cache.layers[0].offset == 3


def test_lazy_feed_records_unknown_until_resolved():
    cache = SequenceCache(markov())
    _, start = cache.feed_lazy([3], mx.array([4, 5]))
    assert cache.tokens == [3, UNKNOWN, UNKNOWN] and start == 1
    assert cache.sync_to([3, 4, 5]) == 1  # an unresolved position never matches
    _, start = cache.feed_lazy([], mx.array([7]))
    cache.resolve(start, [7])
    assert cache.tokens == [3, 7]


def test_rotating_cache_reports_why_it_cannot_rewind():
    cache = SequenceCache(markov(), CacheOptions.validate(max_kv_size=8))
    cache.prefill(list(range(6)))
    assert cache.rewind_limit_reason(1) is None
    assert "rotating KV cache" in cache.rewind_limit_reason(4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_kv_size": 4}, "max_kv_size"),
        ({"kv_bits": 5}, "kv_bits"),
        ({"kv_group_size": 48}, "kv_group_size"),
        ({"quantized_kv_start": -1}, "quantized_kv_start"),
        ({"kv_bits": 4, "max_kv_size": 64}, "cannot be combined"),
    ],
)
def test_cache_options_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheOptions.validate(**kwargs)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([], [1]) == 0


# -- the loop ------------------------------------------------------------------------------
class ScriptedDrafter:
    """Drafts from a fixed continuation, recording the feedback it gets."""

    name = "scripted"

    def __init__(self, continuation, wrong_every=0):
        self.continuation, self.wrong_every, self.feedback = continuation, wrong_every, []

    def propose(self, history, limit):
        start = len(history)
        drafts = list(self.continuation[start : start + limit])
        if self.wrong_every and drafts and len(self.feedback) % self.wrong_every == 0:
            drafts[-1] = (drafts[-1] + 1) % VOCAB  # a wrong last draft: rejected
        return drafts

    def observe(self, drafted, accepted, seconds):
        self.feedback.append((drafted, accepted))


def run_loop(drafter, n=30, prompt=(3,)):
    cache = SequenceCache(markov())
    steps = list(run_alone(decode(cache, list(prompt), n, build_sampler(SamplingParams()), [], 20, drafter)))
    stats = loop_stats(steps)
    return [s.token for s in steps], [s.from_draft for s in steps], stats, cache


def test_loop_plain_greedy_follows_the_model():
    tokens, flags, stats, cache = run_loop(None, 12)
    assert tokens == [(3 + i) % VOCAB for i in range(1, 13)]
    assert not any(flags) and stats.verify_rounds == 0
    assert len(cache.tokens) == 12  # every token but the last is cached


def test_loop_accepts_right_drafts_and_rewinds_wrong_ones():
    continuation = [(3 + i) % VOCAB for i in range(0, 80)]
    plain, _, _, _ = run_loop(None)
    tokens, flags, stats, cache = run_loop(ScriptedDrafter(continuation, wrong_every=2))
    assert tokens == plain
    assert any(flags) and stats.rejected_tokens > 0
    assert stats.accepted_tokens + stats.rejected_tokens == stats.drafted_tokens
    assert cache.tokens == ([3] + plain)[: len(cache.tokens)]  # nothing rejected stays cached


class FlippingDrafter(ScriptedDrafter):
    """Sets plain_ahead after a drafting round and clears it again, as a batch-priced
    drafter does when the batch it runs in grows or shrinks between two rounds."""

    proposals = 0

    def propose(self, history, limit):
        self.proposals += 1  # the batch changes while this round's drafts are verified
        return super().propose(history, limit)

    def plain_ahead(self, history):
        return self.proposals % 2 == 1


def test_plain_ahead_set_after_a_drafting_round_does_not_corrupt_the_row():
    """Regression: the loop queued a plain round behind a round with drafts
    still to accept, so accepting them rewound the queued position instead."""
    continuation = [(3 + i) % VOCAB for i in range(0, 80)]
    plain, _, _, _ = run_loop(None)
    tokens, flags, stats, cache = run_loop(FlippingDrafter(continuation, wrong_every=2))
    assert tokens == plain
    assert any(flags) and stats.rejected_tokens > 0
    assert cache.tokens == ([3] + plain)[: len(cache.tokens)]


# -- stop strings --------------------------------------------------------------------------
def test_stop_string_split_across_pieces_is_held_back_and_cut():
    m = StopStringMatcher(["END"])
    assert m.feed("hello E") == ("hello ", None)
    assert m.feed("N") == ("", None)
    assert m.feed("D tail") == ("", "END")


def test_earliest_and_longest_stop_string_wins():
    m = StopStringMatcher(["ab", "abc", "x"])
    assert m.feed("..abc..x") == ("..", "abc")
    assert StopStringMatcher(["b", "ab"]).feed("zab") == ("z", "ab")


def test_held_text_is_released_when_it_cannot_start_a_stop_string():
    m = StopStringMatcher(["<stop>"])
    assert m.feed("a <st") == ("a ", None)
    assert m.feed("ay") == ("<stay", None)
    assert m.flush() == ""


# -- plans and request bookkeeping -------------------------------------------------------------
def test_plans_are_typed_and_checked(kit, draft_path):
    plan = choose_plan(kit, DecodingOptions(prompt_lookup_num_tokens=5))
    assert plan == DecodingPlan(
        "prompt_lookup", lookup_k=5, ngrams=(1, 3, 4), reason="requested: prompt_lookup_num_tokens=5"
    )
    with pytest.raises(ValueError, match="prompt_lookup_min_ngram"):
        choose_plan(kit, DecodingOptions(prompt_lookup_num_tokens=5, prompt_lookup_min_ngram=4))
    me.load_draft_model(kit, draft_path)
    plan = choose_plan(kit, DecodingOptions(num_draft_tokens=3, auto_speculative=True))
    assert plan.kind == "auto" and plan.use_draft and plan.draft_k == 3


def test_fallback_is_planned_before_draft_work(llama_path, draft_path):
    """A full rotating cache: the plan falls back before the draft model's prompt is prefilled."""
    kit = me.load_model(llama_path, max_kv_size=16)
    me.load_draft_model(kit, draft_path)
    prompt = me.tokenize(kit, "def add(a, b):\n    return a + b\n\nclass Point:\n")
    assert len(prompt) > 16
    _, last = generate_ids(kit, prompt, max_tokens=4, temp=0.0, auto_speculative=True)
    assert last.stats.decoding_mode == "auto:plain" and "fell back" in last.stats.mode_reason
    assert kit.draft.first_cache.tokens == []  # no draft prefill was wasted


def test_unstarted_generator_does_not_leak_its_request_id(kit):
    prompt = me.tokenize(kit, "hello")
    gen = me.create_generator(kit, prompt, max_tokens=2, request_id="r1")
    assert me.stop_generation(kit, "r1")  # known from creation
    del gen
    gc.collect()
    assert not me.stop_generation(kit, "r1")
    assert "r1" not in kit.activity.known
    gen = me.create_generator(kit, prompt, max_tokens=2, request_id="r1")  # the id is free again
    gen.close()
    assert "r1" not in kit.activity.known
    assert len(generate_ids(kit, prompt, max_tokens=2, request_id="r1")[0]) == 2


def test_create_generator_options_are_declared_once_and_unknown_names_are_refused():
    """The keyword arguments come from GenerationOptions (signature included);
    an unknown one is a ValueError naming it, raised before anything runs."""
    import mlx_engine as me
    from mlx_engine.request.options import GenerationOptions

    import dataclasses
    import inspect

    params = inspect.signature(me.create_generator).parameters
    options = {f.name: f.default for f in dataclasses.fields(GenerationOptions)}
    assert list(params)[2:] == list(options)
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY and params[n].default == d for n, d in options.items())
    with pytest.raises(ValueError, match="unknown argument 'tmep' \\(did you mean 'temp'\\?\\)"):
        me.create_generator(None, [1, 2], tmep=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerationOptions(temp=0.5).temp = 1.0


def test_stop_condition_tokens_default_is_not_shared():
    from mlx_engine.results import GenerationStopCondition

    a, b = GenerationStopCondition("eos_token"), GenerationStopCondition("token_limit")
    a.stop_tokens.append(7)
    assert b.stop_tokens == [] and a == ("eos_token", None, [7])
    assert GenerationStopCondition("stop_string", "x", [1, 2]).stop_tokens == [1, 2]
    assert repr(b) == "GenerationStopCondition(stop_reason='token_limit', stop_string=None, stop_tokens=[])"


def test_context_budget_caps_the_answer_by_the_room_the_prompt_leaves():
    from types import SimpleNamespace

    kit = SimpleNamespace(context_length=64)
    assert me.context_budget(kit, 60) == 4
    assert me.context_budget(kit, 10, 100) == 54
    assert me.context_budget(kit, 10, 20) == 20
    with pytest.raises(me.InvalidArgument, match="prompt_tokens: 64 tokens leave no room") as err:
        me.context_budget(kit, 64)
    assert err.value.param == "prompt_tokens"
    assert me.context_budget(SimpleNamespace(context_length=None), 10_000) == me.GenerationOptions.max_tokens


def test_shadow_lookup_scores_positions_as_they_are_decided():
    """The worked example of drafters/shadow.py: a shadow counts its accepted
    positions as the output decides them, then its miss; a weak one is returned
    for its owner's weak record, which it teaches alone."""
    from mlx_engine.drafters.shadow import ShadowLookup, teach
    from mlx_engine.pricing.speedup import AcceptanceModel

    shadows, weak = ShadowLookup(), AcceptanceModel(prior=0.5)
    shadows.add(3, [53, 54, 55], weak=False)
    assert shadows.score([0, 1, 2, 53, 54]) == []
    assert (shadows.positions, shadows.scored, len(shadows.open)) == (2, 1, 1)
    assert shadows.score([0, 1, 2, 53, 54, 9]) == []
    assert (shadows.positions, shadows.scored, shadows.open) == (3, 1, [])
    assert (shadows.record.drafted, shadows.record.accepted) == (3, 2)
    shadows.add(6, [7, 8], weak=True)
    for scored in shadows.score([0, 1, 2, 53, 54, 9, 7, 8]):
        teach(weak, scored)
    assert shadows.positions == 3 and (weak.drafted, weak.accepted) == (2, 2)
    assert (shadows.record.drafted, shadows.record.accepted) == (3, 2)
