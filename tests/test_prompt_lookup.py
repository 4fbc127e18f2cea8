import mlx_engine as me
from mlx_engine.drafters.prompt_lookup import NGramIndex, PromptLookupDrafter, density_score
from mlx_engine.pricing.costs import CostModel, RoundCosts
from mlx_engine.pricing.speedup import AcceptanceModel, best_draft_length, expected_tokens

import pytest
from helpers import assert_same_or_near_tie, flat_costs, generate_ids, markov_kit
from hypothesis import given, settings
from hypothesis import strategies as st


def lookup(tokens, k=4, min_n=1, max_n=3, cands=4):
    idx = NGramIndex(min_n, max_n)
    idx.extend(tokens)
    return idx.lookup(k, cands).drafts


def test_finder_prefers_longest_suffix_match():
    # Suffix [1, 2, 3]: the 3-gram occurred once, followed by 9 8; the 1-gram [3]
    # also occurred followed by 7, which must lose to the longer match.
    assert lookup([3, 7, 0, 1, 2, 3, 9, 8, 5, 1, 2, 3], k=2) == [9, 8]
    assert lookup([1, 2, 3, 4, 5, 1, 2], k=3) == [3, 4, 5]


def test_finder_returns_nothing_without_match_or_continuation():
    assert lookup([]) == []
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([5], k=3) == []
    assert lookup([1, 2, 1], k=0) == []
    # A match whose continuation is the suffix itself is truncated, not empty.
    assert lookup([4, 4], k=3) == [4]


def test_lookup_docstring_example_holds():
    """NGramIndex.lookup's worked example: context agreement picks the match,
    the strength counts it, drafts stop at the history's end, and a suffix from
    another text falls back to the unigram and the longest continuation."""
    idx = NGramIndex(min_ngram=1, max_ngram=2)
    idx.extend([10, 1, 2, 3, 4, 20, 1, 2, 5, 6, 20, 1, 2])
    assert idx.lookup(2) == ([5, 6], 3)
    assert idx.lookup(8) == ([5, 6, 20, 1, 2], 3)
    assert idx.lookup(3, suffix=[7, 4, 1]) == ([2, 3, 4], 1)


def test_finder_is_incremental():
    idx = NGramIndex(1, 3)
    seq = [1, 2, 3, 4, 1, 2]
    for i in range(len(seq)):
        idx.extend(seq[: i + 1])
    assert idx.lookup(2).drafts == [3, 4]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 6), max_size=60),
    k=st.integers(0, 8),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    cands=st.integers(1, 5),
)
def test_every_draft_is_a_real_continuation(tokens, k, min_n, extra, cands):
    max_n = min_n + extra
    draft = lookup(tokens, k, min_n, max_n, cands)
    assert len(draft) <= k
    if not draft:
        return
    # Some earlier occurrence of a suffix n-gram is followed by exactly the draft.
    found = False
    for n in range(min_n, max_n + 1):
        if n > len(tokens):
            break
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix and tokens[start + n : start + n + len(draft)] == draft:
                found = True
    assert found


def test_density_score():
    assert density_score(list(range(200))) == 0.0  # below the length threshold
    assert density_score([1, 2, 3] * 60) == 0.0
    assert density_score(list(range(600))) == 0.0  # nothing repeats
    short = density_score(list(range(100)) * 3)
    long = density_score(list(range(100)) * 12)
    assert 0 < short < long <= 1.0
    assert long > 0.85


def flat_rounds(rel: float = 1.1) -> RoundCosts:
    return RoundCosts(flat_costs(rel))


def test_best_draft_length_uses_costs():
    assert best_draft_length(0.0, flat_rounds())[0] == 0
    k, speed = best_draft_length(0.9, flat_rounds())
    assert k >= 8 and speed > 3
    expensive = RoundCosts(CostModel(tuple(0.01 * n for n in range(1, 18))))  # verify costs scale with width
    assert best_draft_length(0.9, expensive)[0] == 0


def test_round_costs_learn_from_round_times():
    wide = RoundCosts(flat_costs(3.0))  # the measurement says a 17-token verify costs 3 steps
    assert wide.seconds(0) == pytest.approx(0.01) and wide.seconds(16) == pytest.approx(0.03)
    k_before = best_draft_length(0.6, wide)[0]
    # A uniformly slower machine (other work, a longer context) changes no decision.
    slower = RoundCosts(flat_costs(3.0))
    for k in (0, 2, 4, 0, 2, 4) * 5:
        slower.observe(k, 2 * slower.prior[k])
    assert slower.seconds(9) == pytest.approx(2 * slower.prior[9], rel=0.05)
    assert best_draft_length(0.6, slower)[0] == k_before
    # Rounds that actually cost no more than an undrafted one make longer drafts pay.
    cheap = RoundCosts(flat_costs(3.0))
    for _ in range(10):
        for k in (0, 4, 8, 12, 16):
            cheap.observe(k, 0.01)
    assert best_draft_length(0.6, cheap)[0] > k_before
    # One stall does not undo that.
    cheap.observe(16, 5.0)
    assert cheap.seconds(16) < 0.02


def test_round_costs_price_every_length_from_any_drafted_round():
    # The measurement says drafting is nearly free (a 17-token verify costs 1.1
    # steps); the rounds say any drafted round costs about 1.8 undrafted ones,
    # plus 0.05 per draft, and only k=3 has been run.
    rounds = RoundCosts(flat_costs(1.1))
    for _ in range(10):
        rounds.observe(0, 0.01)
        rounds.observe(3, 0.01 * (1.8 + 0.05 * 3))
    table = [t / rounds.seconds(0) for t in rounds.table()]
    assert table[3] == pytest.approx(1.95, rel=0.03)
    # Shorter drafts share the fixed part of that cost instead of being priced
    # near an undrafted round, so a modest acceptance does not pick them.
    assert table[1] > 1.7 and table[2] > 1.75
    assert all(a <= b for a, b in zip(table, table[1:]))
    assert best_draft_length(0.4, rounds)[0] == 0


def test_round_costs_reread_drafted_rounds_when_the_undrafted_round_is_timed():
    rounds = RoundCosts(flat_costs(1.1))  # the measurement says a step takes 10 ms
    for _ in range(5):
        rounds.observe(3, 0.039)  # drafted rounds come first (no undrafted one timed yet)
    rounds.observe(0, 0.02)  # the machine is twice as slow as measured
    assert rounds.seconds(3) / rounds.seconds(0) == pytest.approx(1.95, rel=0.02)


def test_acceptance_model_sees_bursts_that_a_single_rate_misses():
    bursty = AcceptanceModel(decay=1.0)
    for _ in range(20):
        bursty.observe(4, 4)  # a run of matches...
        bursty.observe(4, 0)  # ...or a miss at the first position
    assert bursty.rate == 0.5
    p = bursty.conditional()
    assert abs(p[0] - 0.5) < 0.05 and min(p[1:4]) > 0.9
    assert p[8] == p[3]  # untried positions lean on the last tried one
    assert bursty.expected_tokens(4) > expected_tokens(0.5, 4) + 0.8
    costs = flat_rounds(1.6)
    assert best_draft_length(bursty, costs)[0] > best_draft_length(bursty.rate, costs)[0]


def test_acceptance_model_follows_a_change_in_the_text():
    model = AcceptanceModel()
    for _ in range(30):
        model.observe(4, 4)
    assert model.expected_tokens(4) > 4.5
    k_high = best_draft_length(model, flat_rounds(3.0))[0]
    for _ in range(30):
        model.observe(4, 0)
    assert model.conditional()[0] < 0.2
    assert model.expected_tokens(4) < 1.3
    assert best_draft_length(model, flat_rounds(3.0))[0] <= 1 < k_high


def test_prompt_lookup_exact_and_fast_on_repetitive_text(llama_path):
    kit = markov_kit(llama_path)
    prompt = list(range(100, 300)) + list(range(100, 150))
    plain, _ = generate_ids(kit, prompt, max_tokens=40)
    ids, final = generate_ids(kit, prompt, max_tokens=40, prompt_lookup_num_tokens=8)
    assert ids == plain
    s = final.stats
    assert s.decoding_mode == "prompt_lookup"
    assert s.acceptance_rate > 0.9 and s.verify_rounds <= 8


@pytest.mark.parametrize("path_fixture", ["llama_path", "qwen_path"])
def test_prompt_lookup_exact_on_real_architectures(request, path_fixture):
    kit = me.load_model(request.getfixturevalue(path_fixture))
    text = "for i in range(10):\n    print(i, i * i)\n"
    prompt = me.tokenize(kit, text * 8)
    plain, _ = generate_ids(kit, prompt, max_tokens=30)
    for k in (1, 4):
        ids, final = generate_ids(kit, prompt, max_tokens=30, prompt_lookup_num_tokens=k)
        assert_same_or_near_tie(kit, prompt, plain, ids)
        assert final.stats.decoding_mode == "prompt_lookup"


def test_auto_with_a_draft_model_is_exact(llama_path, draft_path):
    kit = me.load_model(llama_path)
    me.load_draft_model(kit, draft_path)
    prompt = me.tokenize(kit, "def add(a, b):\n    return a + b\n")
    plain, _ = generate_ids(kit, prompt, max_tokens=30, speculative_decoding_toggle=False)
    ids, final = generate_ids(kit, prompt, max_tokens=30, auto_speculative=True)
    assert_same_or_near_tie(kit, prompt, plain, ids)
    assert final.stats.decoding_mode.startswith("auto:")


def test_conflicting_requests_are_refused(llama_path, draft_path):
    kit = me.load_model(llama_path)
    me.load_draft_model(kit, draft_path)
    prompt = me.tokenize(kit, "hello")
    with pytest.raises(ValueError, match="pick one"):
        me.create_generator(kit, prompt, prompt_lookup_num_tokens=4, speculative_decoding_toggle=True)
    with pytest.raises(ValueError, match="pick one"):
        me.create_generator(kit, prompt, prompt_lookup_num_tokens=4, num_draft_tokens=3)
    # Explicit prompt lookup with a draft loaded (toggle unset) uses prompt lookup.
    _, final = generate_ids(kit, prompt, max_tokens=3, prompt_lookup_num_tokens=4)
    assert final.stats.decoding_mode == "prompt_lookup"


def test_prompt_lookup_falls_back_when_cache_cannot_rewind(llama_path):
    kit = me.load_model(llama_path, max_kv_size=64)
    prompt = me.tokenize(kit, "for i in range(10):\n    print(i)\n" * 10)
    ids, final = generate_ids(kit, prompt, max_tokens=10, prompt_lookup_num_tokens=4)
    assert len(ids) == 10
    assert final.stats.decoding_mode == "plain" and "cannot be rewound" in final.stats.mode_reason


def test_sampling_modes_work_with_prompt_lookup(kit):
    prompt = me.tokenize(kit, "for i in range(10):\n    print(i, i * i)\n" * 6)
    options = dict(max_tokens=25, temp=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, seed=11)
    a, final = generate_ids(kit, prompt, prompt_lookup_num_tokens=4, **options)
    b, _ = generate_ids(kit, prompt, prompt_lookup_num_tokens=4, **options)
    assert a == b and len(a) == 25
    assert all(0 <= t < kit.vocab_size for t in a)
    assert final.stats.decoding_mode == "prompt_lookup"


def wait_until(condition, timeout=120.0):
    """Poll ``condition``; the bound only turns a hang into a failure."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.mark.slow
def test_cost_model_is_estimated_then_measured_between_requests_and_stored(llama_path, tmp_path, monkeypatch):
    from mlx_engine.pricing import cost_store, costs

    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    # The first request must not measure every width before its first token.
    monkeypatch.setattr(costs, "measure", lambda *a, **k: pytest.fail("measured all widths inside a request"))
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, "for i in range(10):\n    print(i, i * i)\n" * 8)
    generate_ids(kit, prompt, max_tokens=4, auto_speculative=True)
    assert kit.cost_source in ("estimate", "measured")  # measured if idle passes already ran
    wait_until(lambda: kit.cost_source == "measured")
    cm = kit.cost_model
    rel = [cm.relative(n) for n in range(1, 18)]
    assert rel[0] == 1.0 and rel == sorted(rel)
    generate_ids(kit, prompt, max_tokens=4, auto_speculative=True)
    assert kit.cost_model is cm
    record = cost_store.load(kit.cost_key("forward"))
    assert record["seconds"] == list(cm.seconds) and record["version"] == costs.COST_MODEL_VERSION
    assert record["measured_at"] > 0 and record["how"]["samples"] >= 5 * 11  # when and how it was measured
    me.unload(kit)

    # A new kit of the same model on the same machine reads it: nothing is timed.
    monkeypatch.setattr(costs, "measure_step", lambda *a, **k: pytest.fail("timed a step despite a stored record"))
    again = me.load_model(llama_path)
    generate_ids(again, prompt, max_tokens=4, auto_speculative=True)
    assert again.cost_source == "stored" and again.cost_model == cm
    me.unload(again)


@pytest.mark.parametrize(
    "content",
    [b"not json", b'{"key": "other", "value": {"seconds": [1]}}', b"\xff\xfe", b"[]", b"{}", b"x" * 100_000],
)
@pytest.mark.slow
def test_a_bad_cost_record_is_measured_again_and_replaced(llama_path, tmp_path, monkeypatch, content):
    from mlx_engine.pricing import cost_store

    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    kit = me.load_model(llama_path)
    key = kit.cost_key("forward")
    cost_store.save(key, {"seconds": [1.0]})
    [path] = tmp_path.glob("*.json")
    path.write_bytes(content)
    assert cost_store.load(key) is None
    prompt = me.tokenize(kit, "a b c a b c a b c")
    generate_ids(kit, prompt, max_tokens=3, auto_speculative=True)
    assert kit.cost_source in ("estimate", "measured")
    wait_until(lambda: kit.cost_source == "measured")
    assert cost_store.load(key)["seconds"] == list(kit.cost_model.seconds)
    me.unload(kit)


def test_cost_records_of_invalid_values_or_other_keys_are_misses(tmp_path, monkeypatch):
    from mlx_engine.kits.text import costs_from_record
    from mlx_engine.pricing import cost_store, costs

    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    n = costs.MAX_DRAFT + 1
    good = [0.01 * (1 + i / 10) for i in range(n)]
    version = costs.COST_MODEL_VERSION
    assert costs_from_record({"seconds": good, "version": version}) == costs.CostModel(tuple(good))
    for bad in ([float("nan")] * n, [-1.0] * n, good[:-1], list(reversed(good)), ["1"] * n, [True] * n, None):
        assert costs_from_record({"seconds": bad, "version": version}) is None
    # A record of another cost-model version (or none: before versions) is stale: a miss.
    for stale in ({"seconds": good}, {"seconds": good, "version": version - 1}, {"seconds": good, "version": "2"}):
        assert costs_from_record(stale) is None
    cost_store.save({"kind": "a"}, {"seconds": good})
    assert cost_store.load({"kind": "a"}) == {"seconds": good}
    assert cost_store.load({"kind": "b"}) is None
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file, renamed
    monkeypatch.setenv("MLX_ENGINE_COST_DIR", "")  # the store off
    cost_store.save({"kind": "c"}, {"seconds": good})
    assert cost_store.load({"kind": "a"}) is None and len(list(tmp_path.glob("*.json"))) == 1


def test_draft_step_cost_is_stored(llama_path, draft_path, tmp_path, monkeypatch):
    from mlx_engine.pricing import cost_store, costs

    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    kit = me.load_model(llama_path)
    me.load_draft_model(kit, draft_path)
    prompt = me.tokenize(kit, "a b c a b c a b c")
    generate_ids(kit, prompt, max_tokens=3)
    step = kit.draft.step_ratio
    assert cost_store.load(kit.cost_key("draft_step_ratio", kit.draft.path)) == {"ratio": step}
    me.unload(kit)
    monkeypatch.setattr(costs, "measure_draft_step_ratio", lambda *a, **k: pytest.fail("measured a stored draft step"))
    again = me.load_model(llama_path)
    me.load_draft_model(again, draft_path)
    generate_ids(again, prompt, max_tokens=3)
    assert again.draft.step_ratio == step
    me.unload(again)


def test_lookup_memory_drafts_from_other_sequences():
    memory = [[9, 9, 9], [1, 2, 3, 4, 5, 6, 7]]
    drafter = PromptLookupDrafter(4, memory=memory)
    assert drafter.propose([20, 1, 2, 3], 4) == [4, 5, 6, 7]  # continues "1 2 3" from the other conversation
    assert PromptLookupDrafter(4, memory=memory).propose([20, 21, 3], 4) == []  # one shared token is not enough
    assert PromptLookupDrafter(4, memory=memory).propose([5, 6, 7], 4) == []  # never across the end of a sequence
    assert PromptLookupDrafter(4).propose([20, 1, 2, 3], 4) == []
    own = PromptLookupDrafter(4, memory=memory)
    assert own.propose([1, 2, 3, 8, 8, 1, 2, 3], 4) == [8, 8, 1, 2]  # the request's own history comes first


def test_lookup_memory_keeps_output_exact(kit):
    """A second conversation quoting the first: lookup drafts from the cached
    first conversation and the output stays plain greedy output."""
    import mlx_engine as me

    from helpers import generate_ids

    question = me.tokenize(kit, "def add(a, b):\n")
    plain, _ = generate_ids(
        me.load_model(kit.model_path), me.tokenize(kit, "# two\n") + question, max_tokens=24, temp=0.0
    )
    generate_ids(kit, me.tokenize(kit, "# one\n") + question, max_tokens=24, temp=0.0)  # the first chat
    ids, last = generate_ids(
        kit, me.tokenize(kit, "# two\n") + question, max_tokens=24, temp=0.0, prompt_lookup_num_tokens=8
    )
    assert ids == plain
    assert last.stats.cache_entries == 2 and last.stats.accepted_tokens > 0


def test_finder_prefers_the_candidate_whose_context_matches_longest():
    # The suffix 3-gram [8, 5, 1] occurs twice before: after [6, 6] (continued by
    # 2) and, more recently, after [7, 7] (continued by 3). The history ends
    # [6, 6, 8, 5, 1]: the earlier occurrence shares more context and wins.
    tokens = [6, 6, 8, 5, 1, 2, 0, 7, 7, 8, 5, 1, 3, 0, 6, 6, 8, 5, 1]
    assert lookup(tokens, k=1) == [2]
    # Without a longer context match the most recent candidate wins...
    filler = list(range(200, 240))
    assert lookup([8, 5, 1, 2, *filler, 6, 5, 1, 3, *filler, 4, 5, 1], k=1) == [3]
    # ...unless its continuation runs into the end of the text sooner (compared
    # RANK_SPAN tokens ahead whatever k is): a closing code fence loses to the
    # opening one, which the code follows.
    assert lookup([8, 5, 1, 2, 0, 6, 5, 1, 3, 0, 4, 5, 1], k=1) == [2]
    assert lookup([8, 5, 1, 2, 0, 6, 5, 1, 3, 0, 4, 5, 1], k=8) == [2, 0, 6, 5, 1, 3, 0, 4]
    # With one candidate allowed, only the most recent is looked at.
    assert lookup(tokens, k=1, cands=1) == [3]


def test_acceptance_model_takes_evidence_position_by_position():
    whole, pieces = AcceptanceModel(decay=0.9), AcceptanceModel(decay=0.9)
    whole.observe(8, 3)  # three accepted, the fourth rejected
    pieces.observe_positions(0, 2, False, new=True)  # two decided so far, both accepted
    pieces.observe_positions(2, 1, True)  # then one more accepted and one rejected
    assert pieces.tries == pytest.approx(whole.tries) and pieces.hits == pytest.approx(whole.hits)


def test_longer_lookup_drafts_stay_exact(llama_path):
    kit = me.load_model(llama_path)
    prompt = list(range(10, 60)) * 6
    plain, _ = generate_ids(kit, prompt, max_tokens=80)
    for kwargs in ({"prompt_lookup_num_tokens": 32}, {"auto_speculative": True}):
        ids, final = generate_ids(kit, prompt, max_tokens=80, **kwargs)
        assert_same_or_near_tie(kit, prompt, plain, ids)


def test_lookup_accepts_up_to_32_tokens_and_the_draft_model_16(llama_path, draft_path):
    kit = me.load_model(llama_path)
    me.create_generator(kit, [1, 2, 3], max_tokens=1, prompt_lookup_num_tokens=32)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        me.create_generator(kit, [1, 2, 3], max_tokens=1, prompt_lookup_num_tokens=33)
    me.load_draft_model(kit, draft_path)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        me.create_generator(kit, [1, 2, 3], max_tokens=1, num_draft_tokens=17)


def test_auto_with_plain_rounds_queued_ahead_is_exact(kit):
    prompt = me.tokenize(kit, "The quick brown fox jumps over the lazy dog. " * 3)
    plain, _ = generate_ids(kit, prompt, max_tokens=40)
    ids, final = generate_ids(kit, prompt, max_tokens=40, auto_speculative=True)
    assert_same_or_near_tie(kit, prompt, plain, ids)


def test_finder_reports_the_strength_of_its_match():
    index = NGramIndex(1, 3)
    index.extend([6, 6, 8, 5, 1, 2, 0, 9, 9, 9, 4, 1])
    assert index.lookup(2) == ([2, 0], 1)  # only the token 1 matches, nothing before it
    index.extend(index.tokens + [2, 0, 7, 6, 6, 8, 5, 1])
    assert index.lookup(2) == ([2, 0], 3 + 2)  # the 3-gram [8, 5, 1] and the [6, 6] before it
    index.extend(index.tokens + [77])
    assert index.lookup(2) == ([], 0)
