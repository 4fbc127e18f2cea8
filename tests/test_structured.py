"""Structured output: schema-valid JSON, regular expressions and Lark grammars,
the same constrained output in every decoding mode, forbidden drafts cut, bad
constraints refused before any model work."""

import mlx_engine as me
from mlx_engine.decode.loop import decode as _decode

import json

import jsonschema
import mlx.core as mx
import pytest
from helpers import generate_ids, loop_stats, requires_default_model, run_alone

from fixtures.tiny_vlm import image_b64, make_qwen2_vl


def decode(*args, **kwargs):
    return run_alone(_decode(*args, **kwargs))


from mlx_engine.decode.sampling import SamplingParams, build_sampler
from mlx_engine.structured import GrammarConstraint, compile_constraint

SMALL_SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["color", "ok", "n"],
    "additionalProperties": False,
}


def text_of(kit, prompt, **kw):
    results = list(me.create_generator(kit, prompt, **kw))
    return "".join(r.text for r in results), results[-1]


# -- the tiny model: equality across modes --------------------------------------------
@pytest.fixture
def tiny(kit, draft_path):
    me.load_draft_model(kit, draft_path)
    return kit


@pytest.mark.parametrize(
    "constraint",
    [
        {"json_schema": SMALL_SCHEMA},
        {"regex": r"(yes|no), [a-z]{2,6}\.[0-9]{3}"},
        {"grammar": 'start: "answer: " WORD ";"\nWORD: /[a-z]+/'},
    ],
)
def test_constrained_greedy_output_is_the_same_in_every_mode(tiny, constraint):
    prompt = me.tokenize(tiny, "class Point:\n    def __init__(self, x, y):\n")
    common = dict(max_tokens=40, temp=0.0, **constraint)
    reference, last = generate_ids(tiny, prompt, structured_drafting=False, speculative_decoding_toggle=False, **common)
    for mode in (
        dict(speculative_decoding_toggle=False),
        dict(prompt_lookup_num_tokens=4),
        dict(num_draft_tokens=3),
        dict(auto_speculative=True),
    ):
        ids, other = generate_ids(tiny, prompt, **mode, **common)
        assert ids == reference, mode
        assert other.stop_condition.stop_reason == last.stop_condition.stop_reason
    if last.stop_condition.stop_reason == "grammar_complete":
        text = tiny.tokenizer.decode(reference)
        if "json_schema" in constraint:
            jsonschema.validate(json.loads(text), SMALL_SCHEMA)


def test_forced_spans_are_drafted_for_free(kit):
    prompt = me.tokenize(kit, "hello")
    ids, last = generate_ids(kit, prompt, max_tokens=40, temp=0.0, json_schema=SMALL_SCHEMA)
    plain, _ = generate_ids(kit, prompt, max_tokens=40, temp=0.0, json_schema=SMALL_SCHEMA, structured_drafting=False)
    assert ids == plain
    assert last.stats.grammar_drafted_tokens >= 3  # '{"color": "' at least
    assert last.stats.grammar_accepted_tokens > 0
    assert last.stats.drafted_tokens == 0  # no drafter was used


def test_sampled_constrained_output_follows_the_grammar(kit):
    prompt = me.tokenize(kit, "x")
    for seed in range(4):
        text, last = text_of(kit, prompt, max_tokens=60, temp=1.0, seed=seed, regex=r"[0-9]{1,3}(,[0-9]{1,3}){2}")
        assert last.stop_condition.stop_reason in ("grammar_complete", "eos_token")
        parts = text.split(",")
        assert len(parts) == 3 and all(p.isdigit() and len(p) <= 3 for p in parts), text


class ForbiddenDrafter:
    """Always proposes tokens the grammar forbids (and one it allows last)."""

    name = "forbidden"

    def __init__(self, tokens):
        self.tokens = tokens
        self.observed = []

    def propose(self, history, limit):
        return self.tokens[:limit]

    def observe(self, drafted, accepted, seconds):
        self.observed.append((drafted, accepted))


def test_forbidden_drafts_are_cut_before_the_verify_pass(kit):
    """The grammar ('[0-9]+') forbids the drafter's first token, so no draft is
    ever verified and the output equals plain constrained decoding."""
    letters = me.tokenize(kit, "abc")
    grammar = compile_constraint(regex="[0-9]{12}")[1]
    prompt = me.tokenize(kit, "count: ")
    outputs = []
    for drafter in (None, ForbiddenDrafter(letters)):
        kit.cache.reset()
        kit.cache.sync_to(prompt[:-1])
        kit.cache.prefill(prompt[:-1])
        constraint = GrammarConstraint(kit, grammar, draft_forced=False)
        steps = list(
            decode(kit.cache, list(prompt), 12, build_sampler(SamplingParams()), [], 20, drafter, constraint=constraint)
        )
        outputs.append([s.token for s in steps])
        assert loop_stats(steps).drafted_tokens == 0
    assert outputs[0] == outputs[1]
    assert kit.tokenizer.decode(outputs[0]).isdigit()


def test_cancel_mid_object_then_generate_normally(kit, llama_path):
    prompt = me.tokenize(kit, "def add(a, b):\n")
    gen = me.create_generator(kit, prompt, max_tokens=30, temp=0.0, json_schema=SMALL_SCHEMA)
    for _ in range(3):
        next(gen)
    gen.close()
    ids, _ = generate_ids(kit, prompt, max_tokens=30, temp=0.0, json_schema=SMALL_SCHEMA)
    fresh = me.load_model(llama_path)
    assert ids == generate_ids(fresh, prompt, max_tokens=30, temp=0.0, json_schema=SMALL_SCHEMA)[0]
    assert (
        generate_ids(kit, prompt, max_tokens=8, temp=0.0)[0] == generate_ids(fresh, prompt, max_tokens=8, temp=0.0)[0]
    )


def test_stop_string_inside_constrained_output(kit):
    text, last = text_of(
        kit, me.tokenize(kit, "x"), max_tokens=40, temp=0.0, json_schema=SMALL_SCHEMA, stop_strings=['"ok"']
    )
    assert last.stop_condition.stop_reason == "stop_string"
    assert text.startswith('{"color": ')


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"json_schema": {"type": "foo"}}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": [1, 2]}, "json_schema"),
        ({"json_schema": {"type": "string", "format": "no-such-format-x"}, "regex": "a"}, "json_schema and regex"),
        ({"regex": "(unclosed"}, "regex"),
        ({"regex": ""}, "regex"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        # Constraints llguidance builds but cannot run: they used to fail mid-generation.
        ({"regex": "a{1000000}"}, "regex cannot be used.*too complex"),
        (
            {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}},
            "json_schema cannot be used.*too complex",
        ),
        pytest.param(
            {"grammar": "start: " + " ".join(f'"t{i}"' for i in range(70000))},
            "grammar cannot be used.*too large",
            marks=pytest.mark.slow,
        ),
        ({"structured_drafting": "yes", "regex": "a"}, "structured_drafting"),
    ],
)
def test_bad_constraints_are_refused_before_model_work(shared_kit, kwargs, argument):
    prompt = me.tokenize(shared_kit, "hello")
    before = list(shared_kit.cache.tokens)
    with pytest.raises(ValueError, match=argument):
        me.create_generator(shared_kit, prompt, max_tokens=5, **kwargs)
    assert list(shared_kit.cache.tokens) == before
    assert len(generate_ids(shared_kit, prompt, max_tokens=3)[0]) == 3  # still usable


@requires_default_model
@pytest.mark.parametrize("kwargs, argument", [({"regex": "(x|y)a{1000000}"}, "regex")])
def test_a_limit_past_the_first_position_is_the_arguments_error(smollm, kwargs, argument):
    """A grammar whose huge part follows a choice passes the up-front probe (it
    looks at the first position); the limit llguidance reaches later is still the
    argument's error (InvalidArgument naming it), not an engine failure, and the
    kit stays usable."""
    prompt = me.apply_chat_template(smollm, [{"role": "user", "content": "Say x."}])
    with pytest.raises(me.InvalidArgument, match=f"{argument} cannot be used") as err:
        for _ in me.create_generator(smollm, prompt, max_tokens=20, temp=0.0, **kwargs):
            pass
    assert err.value.param == argument
    assert len(generate_ids(smollm, prompt, max_tokens=3)[0]) == 3  # still usable


def test_vision_kit_takes_constraints(tmp_path):
    kit = me.load_model(make_qwen2_vl(tmp_path / "qwen2_vl"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color?"}]}]
    prompt = list(kit.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    text, last = text_of(
        kit, prompt, images_b64=[image_b64((255, 0, 0))], max_tokens=20, temp=0.0, regex="(red|green|blue)"
    )
    assert text in ("red", "green", "blue")
    assert last.stop_condition.stop_reason == "grammar_complete"


# -- the real model: schema-valid JSON ------------------------------------------------


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "height_m": {"type": "number"},
        "city": {"enum": ["Paris", "Rome", "Berlin", "Madrid"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "height_m", "city", "hobbies", "address"],
    "additionalProperties": False,
}


@pytest.mark.slow
@requires_default_model
@pytest.mark.parametrize("mode", [{}, {"prompt_lookup_num_tokens": 8}])
def test_smollm2_writes_schema_valid_json(smollm, mode):
    question = "Describe a person who lives in Paris as JSON: name, age, height in metres, city, hobbies, address."
    prompt = me.apply_chat_template(smollm, [{"role": "user", "content": question}])
    text, last = text_of(smollm, prompt, max_tokens=200, temp=0.0, json_schema=json.dumps(PERSON), **mode)
    assert last.stop_condition.stop_reason == "grammar_complete", text
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.slow
@requires_default_model
def test_smollm2_regex(smollm):
    prompt = me.apply_chat_template(smollm, [{"role": "user", "content": "Give me a US phone number."}])
    text, last = text_of(smollm, prompt, max_tokens=30, temp=0.0, regex=r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}")
    assert last.stop_condition.stop_reason == "grammar_complete"
    assert len(text) == 14 and text[0] == "(" and text[5:7] == " " + text[6], text


def test_mask_covers_padded_vocabulary(draft_path, llama_path):
    """The draft fixture has 16 padded embedding rows: the mask must cover them and never allow them."""
    kit = me.load_model(draft_path)
    c = GrammarConstraint(kit, compile_constraint(regex="[a-z]+")[1])
    masks = c.masks([])
    assert masks.shape == (1, kit.vocab_size)
    assert not mx.any(masks[0, len(kit.tokenizer.get_vocab()) :]).item()


@pytest.mark.parametrize("kwargs", [{"regex": "(yes|no)"}, {"json_schema": {"type": "boolean"}}])
def test_logprobs_under_a_constraint_are_finite(shared_kit, kwargs):
    """Masked alternatives are not reported (they used to come back as -inf)."""
    import math

    prompt = me.tokenize(shared_kit, "hello")
    results = list(me.create_generator(shared_kit, prompt, max_tokens=8, top_logprobs=5, **kwargs))
    tokens = [t for r in results for t in r.tokens]
    tops = [top for r in results for top in (r.top_logprobs or [])]
    assert tokens and len(tops) == len(tokens)
    assert all(math.isfinite(t.logprob) for t in tokens)
    assert all(math.isfinite(x.logprob) for top in tops for x in top)
    assert any(len(top) < 5 for top in tops)  # fewer alternatives than asked: the rest were masked
