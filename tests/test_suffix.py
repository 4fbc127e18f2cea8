"""Suffix drafting: the kit's memory of earlier requests (drafters/suffix.py)."""

import mlx_engine as me
from mlx_engine.drafters.suffix import SuffixDrafter, SuffixMemory

import pytest
from helpers import generate_ids, markov_kit


def test_longest_match_wins_over_a_shorter_one():
    memory = SuffixMemory(key=2)
    memory.record("a", [5, 6, 7, 8])
    memory.record("b", [1, 6, 7, 9])
    match = memory.query([5, 6, 7], 4)
    assert match.drafts == [8] and match.match_length == 3 and match.occurrences == 1
    # Both match two tokens: one occurrence each, the most recent breaks the tie.
    tie = memory.query([0, 6, 7], 4)
    assert tie.drafts == [9] and tie.match_length == 2 and tie.occurrences == 2 and tie.score == 0.5


def test_the_most_frequent_continuation_is_drafted_and_rare_ones_stop_the_draft():
    memory = SuffixMemory(key=2, min_probability=0.3)
    for i, tail in enumerate([[3, 4, 5], [3, 4, 5], [3, 9, 9], [7, 7, 7]]):
        memory.record(i, [1, 2] + tail)
    match = memory.query([1, 2], 8)
    assert match.occurrences == 4
    # 3 follows 3 of 4 times (p 0.75), then 4 follows 2 of those 3 (p 0.5), then 5 (p 0.5).
    assert match.drafts == [3, 4]  # length factor 1.0: at most 2 tokens for a 2-token match
    assert match.score == pytest.approx(0.75 + 0.5)
    memory.length_factor = 4.0
    assert memory.query([1, 2], 8).drafts == [3, 4, 5]
    memory.min_probability = 0.6
    assert memory.query([1, 2], 8).drafts == [3]  # 0.75 then 0.5: stops below 0.6


def test_no_draft_without_a_match_or_past_a_sequence_end():
    memory = SuffixMemory(key=2)
    memory.record("a", [1, 2, 3])
    assert memory.query([9, 9], 4).drafts == []
    assert memory.query([2, 3], 4).drafts == []  # "2 3" ends the sequence: nothing follows it
    assert memory.query([1, 2], 0).drafts == []


def test_record_is_incremental_and_replaces_a_sequence_that_changed():
    memory = SuffixMemory(key=2)
    memory.record("r", [1, 2, 3])
    memory.record("r", [1, 2, 3, 4, 5])  # the request ran on: only the tail is indexed
    assert memory.sequence("r") == [1, 2, 3, 4, 5] and memory.total_tokens == 5
    assert memory.query([0, 3, 4], 4).drafts == [5]
    memory.record("r", [1, 2, 3])  # a lagging copy (the cache misses the last token) changes nothing
    assert memory.sequence("r") == [1, 2, 3, 4, 5]
    memory.record("r", [1, 2, 7, 8])  # a different sequence under the same name replaces it
    assert memory.sequence("r") == [1, 2, 7, 8] and memory.total_tokens == 4
    assert memory.query([0, 3, 4], 4).drafts == []
    assert memory._index.keys() == {(1, 2), (2, 7), (7, 8)}  # nothing of the old one is left


def test_the_next_turn_of_a_conversation_replaces_the_earlier_turn():
    memory = SuffixMemory(key=2)
    memory.record("turn1", [1, 2, 3, 4])
    memory.record("turn2", [1, 2, 3, 4, 5, 6])
    assert "turn1" not in memory and memory.total_tokens == 6


def test_eviction_keeps_the_bound_and_drops_least_recently_used_whole_sequences():
    memory = SuffixMemory(max_tokens=10, key=2)
    memory.record("a", [1, 2, 3, 4])
    memory.record("b", [5, 6, 7, 8])
    memory.record("a", [1, 2, 3, 4, 10])  # a is used again: b is now the oldest
    memory.record("c", [11, 12, 13, 14])
    assert "b" not in memory and "a" in memory and "c" in memory
    assert memory.total_tokens == 9 <= memory.max_tokens
    assert memory.query([0, 6, 7], 4).drafts == []
    big = SuffixMemory(max_tokens=6, key=2)
    big.record("long", list(range(100, 120)))
    assert big.total_tokens == 6 and big.sequence("long") == list(range(100, 106))
    off = SuffixMemory(max_tokens=0)
    off.record("x", [1, 2, 3])
    assert len(off) == 0


def test_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixMemory(max_tokens=-1)


def test_drafter_prefers_the_longer_of_its_own_and_the_memory_match():
    memory = SuffixMemory(key=2)
    memory.record("earlier", [40, 41, 42, 43, 44, 45, 46, 47])
    drafter = SuffixDrafter(8, memory, "now")
    assert drafter.propose_match([40, 41, 42, 43], 8) == ([44, 45, 46, 47], 4)
    # The request's own history repeats "42 43" with a longer agreeing context.
    own = SuffixDrafter(8, memory, "own")
    assert own.propose([9, 42, 43, 1, 2, 9, 42, 43], 8)[:3] == [1, 2, 9]
    assert memory.sequence("own") == [9, 42, 43, 1, 2, 9, 42, 43]  # recorded as it runs


def test_known_answer_is_drafted_from_the_earlier_answer(llama_path):
    """The same question in a new chat: the second answer is drafted from the
    first (recorded by a plain request), and is the same output. Without the
    suffix memory lookup finds nothing to copy."""
    prompt = [300, 37, 212, 64, 3, 77, 120, 88]  # the Markov model continues t -> t+1: nothing repeats
    for memory_tokens, expect_accepted in ((None, True), (0, False)):
        kit = markov_kit(llama_path)
        if memory_tokens == 0:
            kit.suffix_memory = None
        plain, _ = generate_ids(kit, prompt, max_tokens=24)
        ids, final = generate_ids(kit, prompt, max_tokens=24, prompt_lookup_num_tokens=8)
        assert ids == plain
        assert (final.stats.accepted_tokens > 0) == expect_accepted, final.stats
        if expect_accepted:
            assert final.stats.verify_rounds <= 6  # 24 tokens in 9-token rounds


def test_known_answer_with_auto_and_outputs_identical_in_every_mode(llama_path):
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, "def add(a, b):\n")
    runs = {}
    for name, kw in (("plain", {}), ("lookup", {"prompt_lookup_num_tokens": 8}), ("auto", {"auto_speculative": True})):
        runs[name] = generate_ids(kit, prompt, max_tokens=24, temp=0.0, **kw)
    assert runs["lookup"][0] == runs["plain"][0] == runs["auto"][0]
    assert runs["lookup"][1].stats.accepted_tokens > 0
    assert runs["auto"][1].stats.accepted_tokens > 0
    seeded = [
        generate_ids(kit, prompt, max_tokens=24, temp=0.9, seed=7, **kw)[0]
        for kw in ({}, {"prompt_lookup_num_tokens": 8}, {"auto_speculative": True})
    ]
    assert seeded[0] == seeded[1] == seeded[2]


def test_load_model_option(llama_path):
    assert me.load_model(llama_path, suffix_memory_tokens=0).suffix_memory is None
    assert me.load_model(llama_path, suffix_memory_tokens=128).suffix_memory.max_tokens == 128
    with pytest.raises(ValueError, match="suffix_memory_tokens"):
        me.load_model(llama_path, suffix_memory_tokens=-3)


def test_drafts_are_at_most_one_token_per_matched_token():
    """SuffixDecoding's adaptive length for the request's own matches too: a
    one-token match drafts one token, a long match the full N; fixed-length
    lookup (memory off) drafts N whatever the match."""
    from mlx_engine.drafters.prompt_lookup import PromptLookupDrafter

    weak = [7, 8, 9, 7, 1, 2, 3, 4, 5, 6, 9]  # "9" was followed by "7" once: a one-token match
    assert SuffixDrafter(8, SuffixMemory(key=2), "a").propose(weak, 8) == [7]
    assert PromptLookupDrafter(8).propose(weak, 8) == [7, 1, 2, 3, 4, 5, 6, 9]
    copy = list(range(100, 130)) + list(range(100, 120))  # a 20-token match of the first 30
    assert SuffixDrafter(8, SuffixMemory(key=2), "b").propose(copy, 8) == list(range(120, 128))
