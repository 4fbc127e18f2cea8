import mlx_engine as me
from mlx_engine import GenerationInProgressError

import threading

import pytest
from helpers import generate_ids


def prompt_of(kit, text="def add(a, b):\n    return a + b\n"):
    return me.tokenize(kit, text)


@pytest.mark.parametrize("arch_fixture", ["llama_path", "qwen_path"])
def test_generates_and_ends_with_one_stop_condition(arch_fixture, request):
    kit = me.load_model(request.getfixturevalue(arch_fixture))
    results = list(me.create_generator(kit, prompt_of(kit), max_tokens=12))
    assert sum(r.stop_condition is not None for r in results) == 1
    final = results[-1]
    assert final.stop_condition.stop_reason == "token_limit"
    assert sum(len(r.tokens) for r in results) == 12
    assert final.stats.generated_tokens == 12
    assert final.stats.prompt_tokens == len(prompt_of(kit))
    assert final.stats.peak_memory > 0
    for r in results:
        for t in r.tokens:
            assert isinstance(t, me.Token) and t.logprob <= 0 and not t.from_draft


def test_eos_stops_generation(kit):
    prompt = prompt_of(kit)
    ids, _ = generate_ids(kit, prompt, max_tokens=6)
    kit.eos_token_ids = {ids[3]}
    ids2, final = generate_ids(kit, prompt, max_tokens=6)
    assert final.stop_condition.stop_reason == "eos_token"
    assert final.stop_condition.stop_tokens == [ids[3]]
    assert ids2 == ids[: ids.index(ids[3])]


def test_stop_string_across_tokens_is_never_emitted(kit):
    prompt = prompt_of(kit)
    results = list(me.create_generator(kit, prompt, max_tokens=40))
    full = "".join(r.text for r in results)
    assert len(full) > 12
    stop = full[6:11]  # likely spans several tokens
    results = list(me.create_generator(kit, prompt, max_tokens=40, stop_strings=["not-in-output", stop]))
    text = "".join(r.text for r in results)
    final = results[-1]
    assert final.stop_condition.stop_reason == "stop_string"
    assert final.stop_condition.stop_string == stop
    assert text == full[: full.index(stop)]
    assert stop not in text
    assert final.stop_condition.stop_tokens


def test_cache_reuse_equals_fresh_output(llama_path):
    kit = me.load_model(llama_path)
    base = prompt_of(kit, "class Point:\n    def __init__(self, x, y):\n")
    ids1, r1 = generate_ids(kit, base, max_tokens=8)
    follow = base + ids1 + prompt_of(kit, "\nfor i in range(10):")
    ids2, r2 = generate_ids(kit, follow, max_tokens=10)
    assert r2.stats.cached_tokens >= len(base)
    fresh = me.load_model(llama_path)
    ids3, r3 = generate_ids(fresh, follow, max_tokens=10)
    assert r3.stats.cached_tokens == 0
    assert ids2 == ids3
    # A shorter, diverging prompt trims the cache and still matches a fresh kit.
    other = base[:5] + prompt_of(kit, " Hello world")
    ids4, r4 = generate_ids(kit, other, max_tokens=10)
    assert r4.stats.cached_tokens == 5
    assert ids4 == generate_ids(me.load_model(llama_path), other, max_tokens=10)[0]


def test_progress_is_monotonic_and_cancel_keeps_processed_part(llama_path):
    kit = me.load_model(llama_path)
    prompt = prompt_of(kit, "for i in range(10):\n    print(i, i * i)\n" * 60)
    assert len(prompt) > 1030
    seen = []
    results = list(
        me.create_generator(kit, prompt, max_tokens=2, prompt_progress_callback=lambda p: seen.append(p) or True)
    )
    assert seen == sorted(seen) and seen[-1] == 100.0 and seen[0] == 0.0
    assert results[-1].stop_condition.stop_reason == "token_limit"

    kit2 = me.load_model(llama_path)
    calls = []

    def cancel_after_first_chunk(p):
        calls.append(p)
        return len(calls) < 2

    results = list(me.create_generator(kit2, prompt, max_tokens=4, prompt_progress_callback=cancel_after_first_chunk))
    assert len(results) == 1 and results[0].stop_condition.stop_reason == "user_cancelled"
    ids, final = generate_ids(kit2, prompt, max_tokens=4)
    assert final.stats.cached_tokens == 512  # one prefill chunk survived
    assert ids == generate_ids(kit, prompt, max_tokens=4)[0]


def test_close_and_stop_generation_cancel(kit):
    prompt = prompt_of(kit)
    gen = me.create_generator(kit, prompt, max_tokens=50)
    next(gen)
    gen.close()
    # The kit is usable again and output equals a fresh run.
    ids, final = generate_ids(kit, prompt, max_tokens=5)
    assert final.stop_condition.stop_reason == "token_limit"

    results = []
    gen = me.create_generator(kit, prompt, max_tokens=10_000, request_id="req-1")

    def consume():
        for r in gen:
            results.append(r)

    worker = threading.Thread(target=consume)
    worker.start()
    while not results:
        pass
    assert me.stop_generation(kit, "req-1")
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert results[-1].stop_condition.stop_reason == "user_cancelled"
    assert len(results) < 10_000
    assert not me.stop_generation(kit, "req-1")


def test_at_most_max_parallel_open_generations(kit, llama_path):
    prompt = prompt_of(kit)
    # Long enough that the first, running meanwhile, is still open below.
    gens = [me.create_generator(kit, prompt, max_tokens=10_000) for _ in range(kit.max_parallel)]
    next(gens[0])
    with pytest.raises(GenerationInProgressError, match="max_parallel of 4"):
        me.create_generator(kit, prompt, max_tokens=5)
    for g in gens:
        g.close()
    assert generate_ids(kit, prompt, max_tokens=3)[1].stop_condition.stop_reason == "token_limit"
    one = me.load_model(llama_path, max_parallel=1)
    gen = me.create_generator(one, prompt, max_tokens=5)
    next(gen)
    with pytest.raises(GenerationInProgressError):
        me.create_generator(one, prompt, max_tokens=5)
    gen.close()
    assert generate_ids(one, prompt, max_tokens=3)[1].stop_condition.stop_reason == "token_limit"


def test_seeded_sampling_is_reproducible(kit):
    prompt = prompt_of(kit)
    a = generate_ids(kit, prompt, max_tokens=20, temp=1.0, seed=7)[0]
    b = generate_ids(kit, prompt, max_tokens=20, temp=1.0, seed=7)[0]
    c = generate_ids(kit, prompt, max_tokens=20, temp=1.0, seed=8)[0]
    assert a == b and a != c
    d = generate_ids(
        kit, prompt, max_tokens=20, temp=0.8, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.3, seed=3
    )[0]
    assert len(d) == 20


def test_repetition_penalty_sees_cached_prompt(kit):
    prompt = prompt_of(kit)
    greedy = generate_ids(kit, prompt, max_tokens=30)[0]
    # Without a penalty the output repeats itself or the prompt ...
    assert set(greedy) & set(prompt) or len(set(greedy)) < len(greedy)
    # ... with a huge one, no token of the (now cached) prompt or earlier output repeats.
    penalised, final = generate_ids(kit, prompt, max_tokens=30, repetition_penalty=50.0, repetition_context_size=200)
    assert final.stats.cached_tokens == len(prompt) - 1
    assert not set(penalised) & set(prompt)
    assert len(set(penalised)) == len(penalised)


def test_logit_bias_moves_the_choice_in_every_mode(kit):
    prompt = prompt_of(kit)
    greedy = generate_ids(kit, prompt, max_tokens=8)[0]
    avoided = generate_ids(kit, prompt, max_tokens=8, logit_bias={greedy[0]: -100.0})[0]
    assert avoided[0] != greedy[0]
    forced = greedy[0] + 1
    for mode in ({}, {"prompt_lookup_num_tokens": 4}, {"auto_speculative": True}):
        assert generate_ids(kit, prompt, max_tokens=6, logit_bias={forced: 100.0}, **mode)[0] == [forced] * 6


def test_presence_and_frequency_penalties_see_the_window(kit):
    prompt = prompt_of(kit)
    for name in ("presence_penalty", "frequency_penalty"):
        ids = generate_ids(kit, prompt, max_tokens=30, repetition_context_size=200, **{name: 100.0})[0]
        assert not set(ids) & set(prompt) and len(set(ids)) == len(ids), name


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(logit_bias={"a": 1.0}), "logit_bias key"),
        (dict(logit_bias={10**6: 1.0}), "logit_bias key 1000000 is outside the vocabulary"),
        (dict(logit_bias={1: float("nan")}), r"logit_bias\[1\]"),
        (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(frequency_penalty="high"), "frequency_penalty"),
    ],
)
def test_bad_bias_and_penalties(shared_kit, kwargs, match):
    with pytest.raises(ValueError, match=match):
        me.create_generator(shared_kit, prompt_of(shared_kit), **kwargs)


def test_top_logprobs(kit):
    results = list(me.create_generator(kit, prompt_of(kit), max_tokens=5, top_logprobs=3))
    for r in results:
        for tok, tops in zip(r.tokens, r.top_logprobs):
            assert len(tops) == 3
            assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
            assert tops[0].id == tok.id  # greedy picks the top token
            assert abs(tops[0].logprob - tok.logprob) < 1e-5


def test_stats_callback_receives_final_stats(kit):
    got = []
    results = list(me.create_generator(kit, prompt_of(kit), max_tokens=4, stats_callback=got.append))
    assert got == [results[-1].stats]
    s = got[0]
    assert s.time_to_first_token > 0 and s.total_time >= s.time_to_first_token and s.generation_tps > 0


def test_generation_in_worker_thread(kit):
    out = {}

    def work():
        out["ids"] = generate_ids(kit, prompt_of(kit), max_tokens=6)[0]

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert out["ids"] == generate_ids(kit, prompt_of(kit), max_tokens=6)[0]


def test_rotating_cache_honours_max_kv_size(llama_path):
    kit = me.load_model(llama_path, max_kv_size=64)
    prompt = prompt_of(kit, "for i in range(10):\n    print(i)\n" * 10)
    assert len(prompt) > 64
    ids, final = generate_ids(kit, prompt, max_tokens=10)
    assert len(ids) == 10
    assert all(c.max_size == 64 for c in kit.cache.layers)
    # The wrapped cache cannot be trimmed; a diverging prompt recomputes.
    ids2, final2 = generate_ids(kit, prompt[:-3], max_tokens=5)
    assert final2.stats.cached_tokens == 0


def chain_table(vocab: int, sequence: list[int]):
    """Logits whose greedy continuation follows ``sequence`` token by token."""
    import mlx.core as mx

    rows = [[0.0] * vocab for _ in range(vocab)]
    for a, b in zip(sequence, sequence[1:]):
        rows[a][b] = 20.0
    return mx.array(rows)


def test_multibyte_text_is_never_split(llama_path):
    from helpers import markov_kit

    base = me.load_model(llama_path)
    text = "Grüße aus München. 日本語のテキスト。 emoji 🙂 ok"
    seq = me.tokenize(base, text)
    assert len(set(seq)) == len(seq), "fixture text must not repeat tokens"
    kit = markov_kit(llama_path, chain_table(base.vocab_size, seq))
    results = list(me.create_generator(kit, seq[:1], max_tokens=len(seq) - 1))
    pieces = [r.text for r in results]
    assert "".join(pieces) == base.tokenizer.decode(seq[1:])
    assert not any("\ufffd" in p for p in pieces)
    # A multi-byte stop string spanning several byte-level tokens.
    results = list(me.create_generator(kit, seq[:1], max_tokens=len(seq) - 1, stop_strings=["のテ"]))
    assert "".join(r.text for r in results) == base.tokenizer.decode(seq[1:]).split("のテ")[0]
    assert results[-1].stop_condition.stop_string == "のテ"


def test_quantized_kv_cache(llama_path, models_dir):
    from fixtures.tiny_models import make_model

    with pytest.raises(ValueError, match="kv_group_size"):
        me.load_model(llama_path, kv_bits=8, kv_group_size=32)  # head size 16
    path = make_model(models_dir / "wide_heads", "llama", hidden=128, heads=4, kv_heads=2, tokenizer_from=llama_path)
    kit = me.load_model(path, kv_bits=8, kv_group_size=32, quantized_kv_start=0)
    prompt = prompt_of(kit)
    ids, final = generate_ids(kit, prompt, max_tokens=8)
    assert len(ids) == 8
    ids2, final2 = generate_ids(kit, prompt + ids, max_tokens=4)
    assert final2.stats.cached_tokens == len(prompt) + len(ids) - 1


def test_rates_cover_work_done_or_are_none(kit):
    """A fully cached prompt has no prompt rate (not 0.0); an answer whose tokens all
    came in its first round has no generation rate (it used to be a huge number)."""
    prompt = prompt_of(kit)
    first = list(me.create_generator(kit, prompt, max_tokens=12, temp=0.0))[-1].stats
    assert first.prompt_tps is not None and first.prompt_tps > 0
    assert first.generation_tps is not None and first.generation_tps > 0
    again = list(me.create_generator(kit, prompt, max_tokens=12, temp=0.0))[-1].stats
    assert again.cached_tokens == len(prompt) - 1 and again.prompt_tps is None
    one = list(me.create_generator(kit, prompt, max_tokens=1, temp=0.0))[-1].stats
    assert one.generated_tokens == 1 and one.generation_tps is None
