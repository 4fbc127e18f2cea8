"""Position-keyed sampling (docs/decoding.md#seeds): the same seed gives the same
text in every decoding mode, and the sampler is an exact categorical sample with
mlx-lm's filtering."""

import mlx_engine as me
from mlx_engine.draft.model import DraftModel
from mlx_engine.request.sampling import SamplingParams, build_sampler, draw_seed, position_keys, sampling_filters

import mlx.core as mx
import pytest
from helpers import generate_ids, markov_kit
from mlx_lm.sample_utils import make_sampler

from fixtures.tiny_models import MarkovLM, successor_table

FILTERED = dict(top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1)
CODE = "for i in range(10):\n    print(i, i * i)\n"


def _logprobs(logits) -> mx.array:
    x = mx.array(logits)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


# --- the sampler -------------------------------------------------------------------


def test_a_row_depends_only_on_the_seed_and_its_position():
    lp = _logprobs(mx.random.normal((6, 50), key=mx.random.key(0)))
    sampler = build_sampler(SamplingParams(temp=1.0, seed=7))
    batch = sampler(lp, range(100, 106)).tolist()
    alone = [sampler(lp[i : i + 1], [100 + i]).item() for i in range(6)]
    assert batch == alone  # a verify pass of k+1 rows samples what single steps would
    again = build_sampler(SamplingParams(temp=1.0), seed=7)  # an explicit seed, same key
    assert again(lp[::-1], range(105, 99, -1)).tolist() == batch[::-1]
    assert position_keys(7, [3]).tolist() == position_keys(7, [1, 2, 3]).tolist()[2:]
    flat = mx.zeros((400, 50))
    a = sampler(flat, range(400)).tolist()
    b = build_sampler(SamplingParams(temp=1.0, seed=8))(flat, range(400)).tolist()
    shifted = sampler(flat, range(1, 401)).tolist()
    assert sum(x == y for x, y in zip(a, b)) < 40 and sum(x == y for x, y in zip(a, shifted)) < 40


def test_greedy_is_argmax_and_needs_no_seed():
    lp = _logprobs(mx.random.normal((3, 20), key=mx.random.key(1)))
    sampler = build_sampler(SamplingParams(temp=0.0, seed=5))
    assert sampler(lp, range(3)).tolist() == mx.argmax(lp, axis=-1).tolist()


@pytest.mark.parametrize("params", [dict(temp=1.0), dict(temp=0.7), dict(temp=1.3, top_k=3), dict(temp=0.9, top_p=0.8)])
def test_frequencies_match_the_softmax(params):
    """Many positions of one seed, and one position of many seeds, on a 4-token
    vocabulary: the frequencies are those of softmax(filtered logprobs / temp)."""
    lp = _logprobs([[1.0, 0.2, -0.5, 0.0]])
    filtered = lp
    for f in sampling_filters(SamplingParams(**params)):
        filtered = f(filtered)
    expected = mx.softmax(filtered[0] / params["temp"]).tolist()
    n = 20000
    by_position = build_sampler(SamplingParams(**params, seed=11))(mx.repeat(lp, n, axis=0), range(n)).tolist()
    seeds = 2000
    by_seed = [build_sampler(SamplingParams(**params, seed=s))(lp, [42]).item() for s in range(seeds)]
    for draws, bound in ((by_position, 0.02), (by_seed, 0.05)):  # about 5 standard deviations
        freq = [draws.count(t) / len(draws) for t in range(4)]
        assert all(abs(f - e) < bound for f, e in zip(freq, expected)), (freq, expected)


@pytest.mark.parametrize(
    "params",
    [
        dict(top_p=0.6),
        dict(top_k=3),
        dict(min_p=0.2),
        dict(min_p=0.5, min_tokens_to_keep=4),
        dict(top_p=0.9, top_k=5, min_p=0.05),
        dict(top_p=0.3, min_p=0.9, min_tokens_to_keep=2),
        dict(),
    ],
)
def test_filtering_keeps_mlx_lm_support(params):
    """The tokens that can be sampled are those mlx-lm's make_sampler can sample:
    at a high temperature both samplers hit every token they allow."""
    lp = _logprobs(mx.random.normal((1, 12), key=mx.random.key(3)) * 2.0)
    temp, n = 50.0, 3000
    ours = build_sampler(SamplingParams(temp=temp, seed=1, **params))(mx.repeat(lp, n, axis=0), range(n))
    mlx_lm = make_sampler(
        temp=temp,
        top_p=params.get("top_p", 0.0),
        top_k=params.get("top_k", 0),
        min_p=params.get("min_p", 0.0),
        min_tokens_to_keep=params.get("min_tokens_to_keep", 1),
    )
    mx.random.seed(0)
    theirs = mlx_lm(mx.repeat(lp, n, axis=0))
    filtered = lp
    for f in sampling_filters(SamplingParams(temp=temp, **params)):
        filtered = f(filtered)
    support = {i for i, v in enumerate(filtered[0].tolist()) if v > float("-inf")}
    assert set(ours.tolist()) == set(theirs.tolist()) == support


def test_a_request_without_seed_draws_one_from_mlx_global_stream():
    mx.random.seed(123)
    a = [draw_seed() for _ in range(3)]
    mx.random.seed(123)
    assert [draw_seed() for _ in range(3)] == a and len(set(a)) == 3
    assert all(0 <= s < 2**64 for s in a)


# --- every mode gives the same text --------------------------------------------------


def _markov_with_draft(llama_path):
    """A Markov kit (verify and step logits bit-identical) whose draft is another
    Markov model that agrees with it most of the time."""
    kit = markov_kit(llama_path, successor_table(me.load_model(llama_path, vocab_only=True).vocab_size, 6.0))
    draft_model = MarkovLM(successor_table(kit.vocab_size, sharpness=12.0, seed=5))
    mx.eval(draft_model.parameters())
    kit.set_draft(DraftModel(None, draft_model, kit.new_cache(draft_model), 1))
    return kit


MODES = {
    "prompt_lookup": dict(prompt_lookup_num_tokens=4, speculative_decoding_toggle=False),
    "draft_fixed": dict(num_draft_tokens=3),
    "draft_adaptive": dict(),
    "auto": dict(auto_speculative=True),
    "auto_no_draft": dict(auto_speculative=True, speculative_decoding_toggle=False),
}


@pytest.mark.parametrize("sampling", [dict(temp=0.8), dict(temp=0.8, **FILTERED)])
def test_same_seed_same_text_in_every_mode_markov(llama_path, sampling):
    kit = _markov_with_draft(llama_path)
    prompt = list(range(100, 400)) + list(range(100, 160))  # long and echoing: lookup and the router engage
    kw = dict(max_tokens=60, seed=7, **sampling)
    plain, _ = generate_ids(kit, prompt, speculative_decoding_toggle=False, **kw)
    assert plain != [(prompt[-1] + 1 + i) % kit.vocab_size for i in range(60)]  # some non-greedy samples
    accepted, rejected = 0, 0
    for name, mode in MODES.items():
        ids, final = generate_ids(kit, prompt, **mode, **kw)
        assert ids == plain, (name, final.stats.decoding_mode)
        accepted += final.stats.accepted_tokens
        rejected += final.stats.rejected_tokens
    assert accepted > 20 and rejected > 0  # drafts were both taken and refused
    other, _ = generate_ids(kit, prompt, speculative_decoding_toggle=False, **dict(kw, seed=8))
    assert other != plain


@pytest.mark.parametrize("sampling", [dict(temp=0.8), dict(temp=0.8, **FILTERED)])
def test_same_seed_same_text_in_every_mode_transformer(llama_path, draft_path, sampling):
    """On a real architecture (verify kernels, KV caches) with a draft model that
    is the target itself, so drafts are accepted wherever the sample is the argmax."""
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, CODE * 6)
    kw = dict(max_tokens=40, seed=7, **sampling)
    plain, final = generate_ids(kit, prompt, **kw)
    assert final.stats.decoding_mode == "plain"
    accepted = 0
    for draft in (draft_path, llama_path):
        me.load_draft_model(kit, draft)
        for name, mode in MODES.items():
            ids, final = generate_ids(kit, prompt, **mode, **kw)
            assert ids == plain, (draft.name, name, final.stats.decoding_mode)
            accepted += final.stats.accepted_tokens
    assert accepted > 0
    assert generate_ids(kit, prompt, **dict(kw, seed=8), speculative_decoding_toggle=False)[0] != plain


def test_a_resumed_request_continues_the_same_sample(llama_path):
    """Position means the index in prompt + output: a request whose prompt already
    holds the first tokens of an answer (cached or not) samples the rest of it."""
    kit = markov_kit(llama_path, successor_table(me.load_model(llama_path, vocab_only=True).vocab_size, 4.0))
    prompt = list(range(100, 140))
    kw = dict(temp=0.9, top_k=20, repetition_penalty=1.2, seed=3)
    whole, _ = generate_ids(kit, prompt, max_tokens=30, **kw)
    rest, final = generate_ids(kit, prompt + whole[:12], max_tokens=18, **kw)
    assert final.stats.cached_tokens > 0 and rest == whole[12:]
    rest, _ = generate_ids(kit, prompt + whole[:12], max_tokens=18, prompt_lookup_num_tokens=4, **kw)
    assert rest == whole[12:]


def test_global_seed_makes_unseeded_requests_reproducible(llama_path):
    kit = me.load_model(llama_path, seed=5)
    prompt = me.tokenize(kit, CODE * 2)
    first = [generate_ids(kit, prompt, max_tokens=12, temp=1.0)[0] for _ in range(2)]
    assert first[0] != first[1]  # each request draws its own seed
    kit2 = me.load_model(llama_path, seed=5)
    assert [generate_ids(kit2, prompt, max_tokens=12, temp=1.0)[0] for _ in range(2)] == first
    # A seeded request leaves the global stream alone.
    kit3 = me.load_model(llama_path, seed=5)
    generate_ids(kit3, prompt, max_tokens=4, temp=1.0, seed=99)
    assert [generate_ids(kit3, prompt, max_tokens=12, temp=1.0)[0] for _ in range(2)] == first
