import mlx_engine as me
from mlx_engine import ModelLoadError

import json
import shutil

import pytest
from helpers import generate_ids


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        me.load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="never downloads"):
        me.load_model("some-org/some-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        me.load_model(tmp_path)


def test_malformed_config(tmp_path, llama_path):
    d = copy_model(llama_path, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        me.load_model(d)


def test_unsupported_model_type(tmp_path, llama_path):
    d = copy_model(llama_path, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "no_such_arch"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported model type 'no_such_arch'"):
        me.load_model(d)


def test_missing_and_truncated_weights(tmp_path, llama_path):
    d = copy_model(llama_path, tmp_path / "m")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    with pytest.raises(ModelLoadError, match="no model.*safetensors"):
        me.load_model(d)
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors'.*truncated"):
        me.load_model(d)


def test_vision_config_goes_to_mlx_vlm_with_clear_errors(tmp_path, llama_path):
    """A config with vision_config is loaded as a vision model (tests/test_vision.py);
    what mlx-vlm cannot load is refused with a ModelLoadError saying why."""
    d = copy_model(llama_path, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vision_config"] = {"hidden_size": 8}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="vision"):
        me.load_model(d)  # a text llama's tokenizer has no image placeholder
    cfg["model_type"] = "no_such_vlm"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported vision model type 'no_such_vlm'"):
        me.load_model(d)


def test_bad_load_options(llama_path):
    with pytest.raises(ValueError, match="max_kv_size"):
        me.load_model(llama_path, max_kv_size=0)
    with pytest.raises(ValueError, match="kv_bits"):
        me.load_model(llama_path, kv_bits=5)
    with pytest.raises(ValueError, match="seed"):
        me.load_model(llama_path, seed=-1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temp=-0.1), "temp"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=-1), "top_logprobs"),
        (dict(stop_strings=[""]), "stop_strings"),
        (dict(stop_strings="x"), "stop_strings"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(seed="a"), "seed"),
        (dict(prompt_progress_callback=3), "prompt_progress_callback"),
        (dict(num_draft_tokens=3), "num_draft_tokens"),
        (dict(speculative_decoding_toggle=True), "speculative_decoding_toggle"),
        (dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens"),
        (dict(prompt_lookup_min_ngram=4, prompt_lookup_max_ngram=2), "prompt_lookup_min_ngram"),
        (dict(seed=2**64), "seed"),
        (dict(top_k=10**6), "top_k"),
        (dict(repetition_context_size=2.0), "repetition_context_size"),
        # Bounds that used to fail only mid-generation, inside MLX, naming nothing.
        (dict(min_tokens_to_keep=10**9, temp=1.0, min_p=0.1), "min_tokens_to_keep"),
        (dict(repetition_context_size=10**12, repetition_penalty=1.1), "repetition_context_size"),
    ]
    + [
        (dict([(name, value)]), name)
        for name in ("temp", "top_p", "min_p", "repetition_penalty")
        for value in (float("nan"), float("inf"), float("-inf"))
    ],
)
def test_bad_generation_arguments(shared_kit, kwargs, match):
    prompt = me.tokenize(shared_kit, "hello")
    with pytest.raises(ValueError, match=match) as err:
        me.create_generator(shared_kit, prompt, **kwargs)
    # The argument is named as a value too, so a host (the server) maps it without reading the message.
    assert isinstance(err.value, me.InvalidArgument) and err.value.param == match
    assert generate_ids(shared_kit, prompt, max_tokens=2)[1].stop_condition.stop_reason == "token_limit"


def test_largest_bounds_generate(shared_kit):
    prompt = me.tokenize(shared_kit, "hello")
    ids, last = generate_ids(
        shared_kit,
        prompt,
        max_tokens=3,
        temp=1.0,
        min_p=0.5,
        seed=1,
        min_tokens_to_keep=shared_kit.vocab_size,
        repetition_penalty=1.1,
        repetition_context_size=2**31 - 1,
    )
    assert len(ids) == 3


def test_tokenize_refuses_lone_surrogates(shared_kit):
    with pytest.raises(ValueError, match=r"prompt is not valid Unicode.*index 1"):
        me.tokenize(shared_kit, "a\ud800b")
    assert me.tokenize(shared_kit, "ab") == me.tokenize(shared_kit, "ab")


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], "must not be empty"),
        ([1, "a"], "integers"),
        ([1, 10**6], "outside the vocabulary"),
        ([-1], "outside"),
        ("text", "tokenize"),
        ([1.5], "integers"),
    ],
)
def test_bad_prompts(shared_kit, prompt, match):
    with pytest.raises(ValueError, match=match) as err:
        me.create_generator(shared_kit, prompt)
    assert isinstance(err.value, me.InvalidArgument) and err.value.param == "prompt_tokens"
    assert generate_ids(shared_kit, [1, 2, 3], max_tokens=2)[1].stop_condition.stop_reason == "token_limit"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(tools=[TOOL, {"type": "function", "function": {"name": "bad name"}}]), "tools[1].function.name"),
        (dict(tools=[TOOL], tool_choice="sometimes"), "tool_choice"),
        (dict(tools=[TOOL], tool_choice={"name": ["f"]}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[TOOL], parallel_tool_calls="yes"), "parallel_tool_calls"),
        (dict(tools=[TOOL], regex="a+"), "tools"),
        (dict(json_schema={"type": "nonsense"}), "json_schema"),
        (dict(json_schema=3), "json_schema"),
        (dict(regex="("), "regex"),
        (dict(grammar="start: nope"), "grammar"),
        (dict(regex="a", grammar="start: 'a'"), "regex"),
        (dict(images_b64=["AA"]), "images_b64"),
        (dict(logit_bias={10**6: 1.0}), "logit_bias"),
        (dict(logit_bias={1: float("nan")}), "logit_bias"),
        (dict(structured_drafting="yes"), "structured_drafting"),
        (dict(auto_speculative="yes"), "auto_speculative"),
    ],
)
def test_invalid_arguments_carry_their_name(shared_kit, kwargs, param):
    with pytest.raises(me.InvalidArgument) as err:
        me.create_generator(shared_kit, me.tokenize(shared_kit, "hello"), **kwargs)
    assert err.value.param == param and isinstance(err.value, ValueError)


def test_raising_callbacks_leave_kit_usable(kit):
    prompt = me.tokenize(kit, "for i in range(10):\n" * 80)

    def boom(p):
        if p > 0:
            raise RuntimeError("host bug")
        return True

    with pytest.raises(me.CallbackError, match="prompt_progress_callback raised RuntimeError"):
        list(me.create_generator(kit, prompt, max_tokens=3, prompt_progress_callback=boom))
    with pytest.raises(me.CallbackError, match="stats_callback"):
        list(me.create_generator(kit, prompt, max_tokens=3, stats_callback=lambda s: 1 / 0))
    ids, final = generate_ids(kit, prompt, max_tokens=3)
    assert ids == generate_ids(me.load_model(kit.model_path), prompt, max_tokens=3)[0]


def test_vocab_only_kit_tokenizes_but_cannot_generate(llama_path):
    kit = me.load_model(llama_path, vocab_only=True)
    assert kit.model is None
    prompt = me.tokenize(kit, "hello")
    assert prompt
    with pytest.raises(ValueError, match="vocab_only"):
        me.create_generator(kit, prompt)


def test_unloaded_kit_refuses(llama_path):
    kit = me.load_model(llama_path)
    me.unload(kit)
    with pytest.raises(ValueError, match="unloaded"):
        me.create_generator(kit, [1, 2])


def test_top_k_must_be_below_the_vocabulary(shared_kit):
    prompt = me.tokenize(shared_kit, "hello")
    with pytest.raises(ValueError, match=f"top_k must be from 0 .* to {shared_kit.vocab_size - 1}"):
        me.create_generator(shared_kit, prompt, top_k=shared_kit.vocab_size)
    ids, final = generate_ids(shared_kit, prompt, max_tokens=3, top_k=shared_kit.vocab_size - 1, temp=0.5, seed=1)
    assert final.stop_condition.stop_reason == "token_limit"


def test_seed_beyond_64_bits_is_a_value_error(llama_path):
    with pytest.raises(ValueError, match="seed must be an integer from 0 to 2\\*\\*64 - 1"):
        me.load_model(llama_path, seed=2**64)
    me.load_model(llama_path, seed=2**64 - 1, vocab_only=True)


def test_numpy_and_mlx_integer_ids_are_accepted(kit):
    import mlx.core as mx
    import numpy as np

    prompt = me.tokenize(kit, "def add(a, b):")
    want = generate_ids(kit, prompt, max_tokens=4)[0]
    for variant in (
        np.array(prompt),
        [np.int32(t) for t in prompt],
        mx.array(prompt),
        [mx.array(t) for t in prompt],
        tuple(prompt),
    ):
        assert generate_ids(kit, variant, max_tokens=4)[0] == want
    with pytest.raises(ValueError, match="integers"):
        me.create_generator(kit, np.array(prompt, dtype=np.float32))
    with pytest.raises(ValueError, match="one-dimensional"):
        me.create_generator(kit, np.array([prompt]))


@pytest.mark.parametrize("prompt", [{1: 2, 3: 4}, {1, 2, 3}, [True, False]])
def test_mappings_sets_and_bools_are_not_prompts(shared_kit, prompt):
    with pytest.raises(ValueError, match="prompt_tokens"):
        me.create_generator(shared_kit, prompt)


@pytest.mark.parametrize("path", ["", "   "])
def test_empty_model_path_is_refused(path):
    with pytest.raises(ValueError, match="model_path must not be empty"):
        me.load_model(path)


def write_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(model_type="cache"), "unsupported model type 'cache'"),
        (dict(model_type=["llama"]), "'model_type' must be an architecture name"),
        (dict(model_type=None), "'model_type' must be an architecture name"),
        (dict(model_type="../../etc"), "'model_type' must be an architecture name"),
        (dict(hidden_size="64"), "'hidden_size' must be a positive integer, got '64'"),
        (dict(hidden_size=64.0), "'hidden_size' must be a positive integer"),
        (dict(num_hidden_layers=True), "'num_hidden_layers' must be a positive integer"),
        (dict(vocab_size=-1), "'vocab_size' must be a positive integer"),
        (dict(text_config=[1]), "'text_config' must be a JSON object"),
        (dict(rope_theta="fast"), "cannot run with its config.json: TypeError"),
        (dict(rope_theta=None), "cannot run with its config.json"),
    ],
)
def test_config_fields_of_the_wrong_type_name_the_field(tmp_path, llama_path, changes, match):
    d = copy_model(llama_path, tmp_path / "m")
    write_config(d, **changes)
    with pytest.raises(ModelLoadError, match=match):
        me.load_model(d)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_hidden_layers=1_000_000), "declares num_hidden_layers=1000000 but the weight files hold 2 layers"),
        (dict(hidden_size=128), "declares hidden_size=128 but 'model.embed_tokens.weight'"),
        (dict(vocab_size=10**7), "declares vocab_size=10000000"),
    ],
)
def test_config_is_checked_against_the_weights_before_building(tmp_path, llama_path, changes, match):
    """A config far bigger than its weights fails from the safetensors headers,
    before mlx-lm builds the model (a million layers would take gigabytes)."""
    d = copy_model(llama_path, tmp_path / "m")
    write_config(d, **changes)
    with pytest.raises(ModelLoadError, match=match):
        me.load_model(d)


def test_safetensors_header_lies_are_caught(tmp_path, llama_path):
    import struct

    d = copy_model(llama_path, tmp_path / "m")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 2**60) + data[8:])
    with pytest.raises(ModelLoadError, match="header"):
        me.load_model(d)
    weights.write_bytes(data[:4])
    with pytest.raises(ModelLoadError, match="too short"):
        me.load_model(d)
    weights.unlink()
    weights.symlink_to(weights)  # a symlink loop
    with pytest.raises(ModelLoadError, match="symlink loop"):
        me.load_model(d)


def test_a_failure_before_model_work_keeps_the_cache(kit, monkeypatch):
    prompt = me.tokenize(kit, "class Point:\n    def __init__(self, x, y):")
    generate_ids(kit, prompt, max_tokens=4)
    cached = list(kit.cache.tokens)
    assert cached

    def broken(*args, **kwargs):
        raise RuntimeError("planning failed")

    monkeypatch.setattr(kit, "expand_prompt", broken)
    with pytest.raises(RuntimeError, match="planning failed"):
        list(me.create_generator(kit, prompt, max_tokens=4))
    assert kit.cache.tokens == cached


def test_nan_weights_are_refused_at_load(tmp_path, llama_path, draft_path):
    import mlx.core as mx

    d = copy_model(llama_path, tmp_path / "m")
    weights = dict(mx.load(str(d / "model.safetensors")))
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = mx.full(weights[name].shape, float("nan"))
    mx.save_safetensors(str(d / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError, match="NaN or infinite logits"):
        me.load_model(d)


def test_invalid_arguments_carry_their_parts(kit):
    """The argument, its item and the keys inside, and a message template a host
    says in its own names (the server's wire fields) without reading the text."""
    bad = {"type": "function", "function": {"name": "bad name"}}
    with pytest.raises(me.InvalidArgument) as err:
        me.create_generator(kit, me.tokenize(kit, "hello"), tools=[TOOL, bad])
    exc = err.value
    assert (exc.field, exc.index, exc.keys) == ("tools", 1, ("function", "name"))
    assert str(exc) == exc.render() and str(exc).startswith("tools[1].function.name must be")
    assert exc.render(param="tools.1.name").startswith("tools.1.name must be")
    with pytest.raises(me.InvalidArgument) as err:
        me.create_generator(kit, me.tokenize(kit, "hello"), tools=[TOOL], regex="a+")
    said = err.value.render({"regex": "mlx_engine.regex", "tool_choice": "toolChoice"})
    assert said.startswith("tools and mlx_engine.regex were both given") and "(or toolChoice='none')" in said
    # The caller's data is a value, never part of the template: its braces stay text.
    assert str(me.InvalidArgument("{param} got {got}", "x", got="{param}")) == "x got {param}"
