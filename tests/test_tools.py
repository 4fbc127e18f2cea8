"""Tool calls: tools in the prompt, per-family parsers on recorded outputs,
calls held valid by the grammar in every decoding mode and in the batch,
streamed deltas, malformed or unfinished calls reported as text, bad tool
arguments refused."""

import mlx_engine as me
from mlx_engine.tools import FORMATS, ToolCallStream, detect_format, parse_tool_calls
from mlx_engine.tools.formats import template_supports_tools

import json
import shutil

import jsonschema
import pytest
from helpers import generate_ids, requires_default_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 24}, "precision": {"type": "integer"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CALC]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMES = set(SCHEMAS)

# -- small chat templates in each family's format ----------------------------------
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    'Call a function with <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>.<|im_end|>\n{% endif %}'
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    '{% for c in m.tool_calls %}\n<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if tools and loop.last %}Given the following functions, respond with a JSON for a function call "
    'as {"name": function name, "parameters": dictionary of arguments}.\n{% for t in tools %}{{ t | tojson }}\n'
    '{% endfor %}{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", '
    '"parameters": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>'
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% else %}{{ m.content }}</s>"
    "{% endif %}{% endfor %}"
)
MISTRAL_V11_TEMPLATE = MISTRAL_TEMPLATE.replace(
    "[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}",
    "{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}",
)
PLAIN_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
FAMILY_TEMPLATES = {
    "hermes": HERMES_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "mistral": MISTRAL_TEMPLATE,
    "mistral_v11": MISTRAL_V11_TEMPLATE,
    "default": PLAIN_TEMPLATE,
}

# -- recorded outputs of each family --------------------------------------------------
RECORDED = {
    "hermes": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    ),
    "llama3": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "calculator", "parameters": {"expression": "2*3"}}'
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "calculator", "arguments": {"expression": "2*3"}}]'
    ),
    "mistral_v11": (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]calculator[ARGS]{"expression": "2*3"}'
    ),
    "default": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    ),
}
RECORDED_TEXT = {"hermes": "Let me look.\n", "default": "Let me look.\n"}
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("calculator", {"expression": "2*3"})]


@pytest.mark.parametrize("family", FAMILY_TEMPLATES)
def test_the_format_is_chosen_from_the_chat_template(family):
    assert detect_format(FAMILY_TEMPLATES[family]).name == family
    assert template_supports_tools(FAMILY_TEMPLATES[family]) == (family != "default")


@pytest.mark.parametrize("family", RECORDED)
def test_each_family_parser_reads_its_recorded_output(family):
    text, calls = parse_tool_calls(FORMATS[family], RECORDED[family], NAMES)
    assert text == RECORDED_TEXT.get(family, "")
    assert [(c.name, c.arguments) for c in calls] == EXPECTED_CALLS
    assert [c.index for c in calls] == [0, 1] and len({c.id for c in calls}) == 2


def test_llama3_python_tag_and_plain_answers():
    fmt = FORMATS["llama3"]
    _, calls = parse_tool_calls(fmt, '<|python_tag|>{"name": "calculator", "parameters": {"expression": "1"}}', NAMES)
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "1"})]
    answer = "The set {1, 2} has two elements."
    assert parse_tool_calls(fmt, answer, NAMES) == (answer, [])


@pytest.mark.parametrize(
    "family, raw",
    [
        (
            "hermes",
            'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call> done',
        ),  # bad JSON
        ("hermes", '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'),  # undeclared tool
        ("hermes", 'Checking <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+'),  # cut short
        ("default", '<tool_call>\n{"name": "calculator", "arguments": "not an object"}\n</tool_call>'),
        ("llama3", '{"name": "calculator", "parameters": {"expression": "1"}'),  # unbalanced
        ("mistral", '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": 1}}, {"nam'),
        ("mistral_v11", '[TOOL_CALLS]calculator[ARGS]{"expression": '),
    ],
)
def test_a_malformed_call_is_text_never_a_broken_call(family, raw):
    assert parse_tool_calls(FORMATS[family], raw, NAMES) == (raw, [])
    stream = ToolCallStream(FORMATS[family], NAMES)
    pieces = [stream.feed(raw[i : i + 3]) for i in range(0, len(raw), 3)] + [stream.finish()]
    assert "".join(p.text for p in pieces) == raw
    assert not any(p.calls or p.deltas for p in pieces)


@pytest.mark.parametrize("family", RECORDED)
def test_streamed_text_never_holds_markup_and_deltas_rebuild_the_calls(family):
    raw = RECORDED[family]
    for streamed in (False, True):
        stream = ToolCallStream(FORMATS[family], NAMES, streamed=streamed)
        pieces = [stream.feed(raw[i : i + 2]) for i in range(0, len(raw), 2)] + [stream.finish()]
        assert "".join(p.text for p in pieces) == RECORDED_TEXT.get(family, "")
        calls = [c for p in pieces for c in p.calls]
        assert [(c.name, c.arguments) for c in calls] == EXPECTED_CALLS
        assert rebuild(pieces) == {c.index: (c.id, c.name, c.arguments) for c in calls}
        if streamed:
            assert sum(len(p.deltas) for p in pieces) > 4  # argument fragments, not one delta per call


def rebuild(results) -> dict:
    """Calls reassembled from streamed deltas: index -> (id, name, arguments)."""
    parts: dict[int, list] = {}
    for r in results:
        for d in getattr(r, "tool_call_deltas", None) or getattr(r, "deltas", []):
            if d.id is not None:
                assert d.index not in parts  # id and name come once, first
                parts[d.index] = [d.id, d.name, ""]
            parts[d.index][2] += d.arguments
    return {i: (cid, name, json.loads(args)) for i, (cid, name, args) in parts.items()}


# -- tools in the prompt ---------------------------------------------------------------
@pytest.fixture(scope="module")
def family_kits(llama_path, tmp_path_factory):
    """A vocab-only kit per family: the llama fixture's tokenizer with that family's template."""
    kits = {}
    for family, template in FAMILY_TEMPLATES.items():
        out = tmp_path_factory.mktemp(f"tools-{family}")
        for f in llama_path.iterdir():
            shutil.copy(f, out / f.name)
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        kits[family] = out
    return kits


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


@pytest.mark.parametrize("family", FAMILY_TEMPLATES)
def test_tools_and_tool_history_reach_every_template(family_kits, family):
    kit = me.load_model(family_kits[family], vocab_only=True)
    text = kit.tokenizer.decode(me.apply_chat_template(kit, HISTORY, tools=TOOLS))
    assert '"get_weather"' in text and '"calculator"' in text  # the tool definitions
    assert "Paris" in text and '"temperature": 21' in text  # the earlier call and its result
    if family == "default":
        assert "<tool_call>" in text and "<tool_response>" in text and "You can call functions" in text


def test_apply_chat_template_refuses_bad_tools(family_kits):
    kit = me.load_model(family_kits["default"], vocab_only=True)
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        me.apply_chat_template(kit, HISTORY, tools=[{"type": "function", "function": {"name": "bad name!"}}])


# -- generation: the tiny fixture in each family's syntax --------------------------------
# Bounded arguments: the random-weight model would write an unbounded string forever.
TINY_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "maxLength": 6}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
]
TINY_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TINY_TOOLS}


@pytest.mark.parametrize("family", FAMILY_TEMPLATES)
def test_required_calls_follow_each_family_syntax(family_kits, family):
    kit = me.load_model(family_kits[family])
    try:
        prompt = me.apply_chat_template(kit, [{"role": "user", "content": "hello"}], tools=TINY_TOOLS)
        results = list(
            me.create_generator(
                kit,
                prompt,
                max_tokens=120,
                temp=0.0,
                tools=TINY_TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
            )
        )
        ids = [t.id for r in results for t in r.tokens]
        calls = [c for r in results for c in r.tool_calls]
        assert results[-1].stop_condition.stop_reason == "tool_calls"
        assert len(calls) == 1 and "".join(r.text for r in results) == ""
        jsonschema.validate(calls[0].arguments, TINY_SCHEMAS[calls[0].name])
        # The raw output is the family's own syntax: its parser reads the same call.
        _, parsed = parse_tool_calls(FORMATS[family], kit.tokenizer.decode(ids), NAMES)
        assert [(c.name, c.arguments) for c in parsed] == [(calls[0].name, calls[0].arguments)]
    finally:
        me.unload(kit)


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tools=[{"type": "function"}]), r"tools\[0\] must be"),
        (dict(tools=[WEATHER, WEATHER]), "declared twice"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice must be one of"),
        (dict(tools=TOOLS, tool_choice={"name": "nope"}), "not one of the declared tools"),
        (dict(tools=TOOLS, tool_choice={"name": ["a", "list"]}), "must name a tool with a string"),
        (dict(tool_choice="required"), "tool_choice was given without tools"),
        (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls must be True or False"),
        (dict(tools=TOOLS, json_schema={"type": "object"}), "tools and json_schema were both given"),
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "string", "pattern": "(unclosed"}},
                            },
                        },
                    }
                ]
            ),
            r"tools\[0\]\.function\.parameters \(f\)",
        ),
    ],
)
def test_bad_tool_arguments_are_refused_before_any_work(kit, kwargs, match):
    prompt = me.tokenize(kit, "hi")
    with pytest.raises(ValueError, match=match):
        me.create_generator(kit, prompt, max_tokens=4, **kwargs)
    assert generate_ids(kit, prompt, max_tokens=3, temp=0.0)[1].stats.generated_tokens == 3  # still usable


# -- generation: the default model ---------------------------------------------------------
MODES = {
    "plain": dict(speculative_decoding_toggle=False),
    "prompt_lookup": dict(prompt_lookup_num_tokens=4),
    "draft_model": dict(num_draft_tokens=3),
    "auto": dict(auto_speculative=True),
}


def weather_prompt(kit, question="What is the weather in Paris?"):
    return me.apply_chat_template(kit, [{"role": "user", "content": question}], tools=TOOLS)


@pytest.mark.slow
@requires_default_model
@pytest.mark.parametrize(
    "choice, question",
    [
        ("required", "Compute 23 * 19."),
        ({"type": "function", "function": {"name": "get_weather"}}, "What is the weather in Paris?"),
    ],
)
def test_calls_are_valid_and_the_same_in_every_mode(smollm, choice, question):
    prompt = weather_prompt(smollm, question)
    common = dict(max_tokens=48, temp=0.0, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    me.load_draft_model(smollm, "smollm2-135m-draft")
    try:
        runs = {mode: list(me.create_generator(smollm, prompt, **kw, **common)) for mode, kw in MODES.items()}
    finally:
        me.unload_draft_model(smollm)
    reference = None
    for mode, results in runs.items():
        ids = [t.id for r in results for t in r.tokens]
        calls = [c for r in results for c in r.tool_calls]
        assert results[-1].stop_condition.stop_reason == "tool_calls", mode
        assert len(calls) == 1 and "".join(r.text for r in results) == "", mode
        if isinstance(choice, dict):
            assert calls[0].name == "get_weather"
        jsonschema.validate(calls[0].arguments, SCHEMAS[calls[0].name])
        assert rebuild(results) == {0: (calls[0].id, calls[0].name, calls[0].arguments)}, mode
        reference = reference or ids
        assert ids == reference, mode
    assert runs["plain"][-1].stats.grammar_accepted_tokens > 5  # markup and keys drafted for free


@pytest.mark.slow
@requires_default_model
def test_auto_lets_a_plain_answer_through_untouched(smollm):
    prompt = weather_prompt(smollm, "Compute 23 * 19.")
    plain, _ = generate_ids(smollm, prompt, max_tokens=24, temp=0.0)
    results = list(me.create_generator(smollm, prompt, max_tokens=24, temp=0.0, tools=TOOLS))
    assert [t.id for r in results for t in r.tokens] == plain
    assert "".join(r.text for r in results) == smollm.tokenizer.decode(plain)
    assert not any(r.tool_calls or r.tool_call_deltas for r in results)


@requires_default_model
def test_without_the_grammar_a_malformed_call_is_text(smollm):
    # A grammar stands in for a model that writes a broken call; with
    # tool_choice="none" nothing holds it to the tools, and it stays text.
    broken = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": 3}'
    prompt = weather_prompt(smollm)
    results = list(
        me.create_generator(
            smollm,
            prompt,
            max_tokens=60,
            temp=0.0,
            tools=TOOLS,
            tool_choice="none",
            grammar=f"start: {json.dumps(broken)}",
        )
    )
    assert "".join(r.text for r in results) == broken
    assert not any(r.tool_calls or r.tool_call_deltas for r in results)


@pytest.mark.slow
@requires_default_model
def test_cancelling_in_the_middle_of_a_call(smollm):
    prompt = weather_prompt(smollm, "Compute 23 * 19.")
    gen = me.create_generator(
        smollm, prompt, max_tokens=60, temp=0.0, tools=TOOLS, tool_choice="required", request_id="tool-cancel"
    )
    results = []
    for r in gen:
        results.append(r)
        if r.tool_call_deltas and r.tool_call_deltas[0].id is not None:
            me.stop_generation(smollm, "tool-cancel")  # the name is out, the arguments are not
    last = results[-1]
    assert last.stop_condition.stop_reason == "user_cancelled"
    assert not any(r.tool_calls for r in results)  # an unfinished call is never a call
    assert "".join(r.text for r in results) == ""  # nor text: its deltas were streamed
    again = list(
        me.create_generator(
            smollm, prompt, max_tokens=56, temp=0.0, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
        )
    )
    assert len([c for r in again for c in r.tool_calls]) == 1  # the kit goes on


@pytest.mark.slow
@requires_default_model
def test_tool_calls_inside_the_batch(smollm):
    tool_prompt, text_prompt = weather_prompt(smollm, "Compute 23 * 19."), me.tokenize(smollm, "Once upon a time")
    tool_kw = dict(max_tokens=56, temp=0.0, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    alone_tool, _ = generate_ids(smollm, tool_prompt, **tool_kw)
    alone_text, _ = generate_ids(smollm, text_prompt, max_tokens=30, temp=0.0)
    gens = [
        me.create_generator(smollm, tool_prompt, **tool_kw),
        me.create_generator(smollm, text_prompt, max_tokens=30, temp=0.0),
    ]
    outs: list[list] = [[], []]
    live = [0, 1]
    while live:  # consume in turns: both decode in one batch
        for i in list(live):
            r = next(gens[i], None)
            if r is None:
                live.remove(i)
            else:
                outs[i].append(r)
    assert [t.id for r in outs[0] for t in r.tokens] == alone_tool
    assert [t.id for r in outs[1] for t in r.tokens] == alone_text
    assert len([c for r in outs[0] for c in r.tool_calls]) == 1


# -- markers that are special tokens (Mistral's [TOOL_CALLS], some Hermes vocabularies) ----
def marker_model(out, special: bool):
    """The hermes template over a tokenizer holding <tool_call> and </tool_call>
    as single tokens, special (as some vocabularies do) or not (as Qwen's)."""
    from tokenizers import AddedToken, Tokenizer

    from fixtures.tiny_models import make_model

    path = make_model(out / "m", "llama", hidden=64, layers=2, scale=3.0, seed=5, vocab_pad=16)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken("<tool_call>", special=special), AddedToken("</tool_call>", special=special)])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def special_marker_kit(tmp_path_factory):
    kit = me.load_model(marker_model(tmp_path_factory.mktemp("special"), special=True))
    yield kit
    me.unload(kit)


def test_a_marker_held_as_a_special_token_is_written_as_that_token(special_marker_kit):
    kit = special_marker_kit
    open_id, close_id = (kit.tokenizer.encode(m, add_special_tokens=False) for m in ("<tool_call>", "</tool_call>"))
    assert len(open_id) == len(close_id) == 1
    prompt = me.apply_chat_template(kit, [{"role": "user", "content": "hello"}], tools=TINY_TOOLS)
    results = list(
        me.create_generator(
            kit, prompt, max_tokens=120, temp=0.0, tools=TINY_TOOLS, tool_choice="required", parallel_tool_calls=False
        )
    )
    ids = [t.id for r in results for t in r.tokens]
    assert ids[0] == open_id[0] and ids[-1] == close_id[0]  # the model's own tokens, not the text spelled out
    calls = [c for r in results for c in r.tool_calls]
    assert len(calls) == 1 and "".join(r.text for r in results) == ""
    jsonschema.validate(calls[0].arguments, TINY_SCHEMAS[calls[0].name])


def test_auto_opens_a_call_with_the_special_token_and_then_holds_it(special_marker_kit):
    from mlx_engine.structured import tokenizer_for
    from mlx_engine.tools import build_grammar, special_markers, tool_format, validate_tool_request

    import llguidance

    kit = special_marker_kit
    spec = validate_tool_request(TINY_TOOLS, "auto", False, tool_format(kit))
    matcher = llguidance.LLMatcher(tokenizer_for(kit), build_grammar(spec, special_markers(kit, spec.format)))
    free = kit.tokenizer.encode("hello there", add_special_tokens=False)
    open_id = kit.tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert matcher.validate_tokens(free) == len(free)  # free text first
    for t in free + open_id:
        assert matcher.consume_token(t)
    forced = kit.tokenizer.decode(matcher.compute_ff_tokens())
    assert forced.startswith('\n{"name": "')  # from the opening on, the grammar holds
    assert matcher.validate_tokens(kit.tokenizer.encode("hello", add_special_tokens=False)) == 0


def test_auto_opens_a_call_mid_answer_in_every_mode(tmp_path):
    """A Markov model that writes "ok <tool_call>" (one text token, as in Qwen's
    vocabulary) and then follows its table: the text before the opening is
    released, and from the opening on the grammar holds, identically in every
    decoding mode."""
    import mlx.core as mx
    from helpers import markov_kit

    from fixtures.tiny_models import make_model, successor_table

    path = marker_model(tmp_path, special=False)
    draft = make_model(tmp_path / "draft", "llama", hidden=32, layers=1, seed=6, vocab_pad=16, tokenizer_from=path)
    probe = me.load_model(path, vocab_only=True)
    prompt = me.tokenize(probe, "hello")
    chain = [prompt[-1]] + probe.tokenizer.encode("ok <tool_call>", add_special_tokens=False)
    assert len(set(chain)) == len(chain) and probe.tokenizer.decode(chain[-1:]) == "<tool_call>"
    table = successor_table(probe.vocab_size, sharpness=12.0)
    for a, b in zip(chain, chain[1:]):
        table[a] = mx.where(mx.arange(probe.vocab_size) == b, 30.0, table[a])
    kit = markov_kit(path, table)
    me.load_draft_model(kit, draft)
    try:
        runs = {
            mode: list(
                me.create_generator(
                    kit, prompt, max_tokens=80, temp=0.0, tools=TINY_TOOLS, parallel_tool_calls=False, **kw
                )
            )
            for mode, kw in MODES.items()
        }
    finally:
        me.unload(kit)
    reference = [t.id for r in runs["plain"] for t in r.tokens]
    assert reference[: len(chain) - 1] == chain[1:]  # the free text, then the opening
    for mode, results in runs.items():
        assert [t.id for r in results for t in r.tokens] == reference, mode
        assert "".join(r.text for r in results) == "ok ", mode
        calls = [c for r in results for c in r.tool_calls]
        assert len(calls) == 1 and results[-1].stop_condition.stop_reason == "tool_calls", mode
        jsonschema.validate(calls[0].arguments, TINY_SCHEMAS[calls[0].name])
        assert rebuild(results) == {0: (calls[0].id, calls[0].name, calls[0].arguments)}


# -- tool calls that end (issue 39) ---------------------------------------------------
def test_a_repeated_call_ends_the_answer_and_is_not_streamed():
    stream = ToolCallStream(FORMATS["hermes"], NAMES, streamed=True)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "23 * 19"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
    outs = [stream.feed(piece) for piece in (call, "\n", other, "\n", call[:30], call[30:])]
    made = [c for o in outs for c in o.calls]
    assert [c.arguments["expression"] for c in made] == ["23 * 19", "1 + 1"]
    assert [o.repeated for o in outs] == [False] * 5 + [True]
    sent = {d.index for o in outs for d in o.deltas}
    assert sent == {0, 1}  # the repeat's name and arguments were never sent
    assert "".join(o.text for o in outs) == ""


@requires_default_model
@pytest.mark.parametrize(
    "choice",
    ["required", "auto", {"type": "function", "function": {"name": "calculator"}}, {"name": "get_weather"}],
)
@pytest.mark.slow
def test_forced_and_parallel_calls_end_with_tool_calls(smollm, choice):
    """The default model repeats a call until max_tokens unless the engine ends the answer."""
    prompt = weather_prompt(smollm, "Compute 23 * 19.")
    results = list(me.create_generator(smollm, prompt, max_tokens=300, temp=0.0, tools=TOOLS, tool_choice=choice))
    calls = [c for r in results for c in r.tool_calls]
    if choice == "auto" and not calls:
        pytest.skip("the model answered in text")
    assert results[-1].stop_condition.stop_reason == "tool_calls"
    keys = [(c.name, c.arguments_json) for c in calls]
    assert len(keys) == len(set(keys)) >= 1  # no identical repeat
    if isinstance(choice, dict):
        assert len(calls) == 1  # a named choice is one call
    assert rebuild(results) == {c.index: (c.id, c.name, c.arguments) for c in calls}
    assert "".join(r.text for r in results) == ""


DEEP = "[" * 100_000 + "]" * 100_000


def deep_list(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tools=[{"type": "function", "function": {"name": "get_weather\n"}}]), r"tools\[0\]\.function\.name"),
        (dict(tools=TOOLS, tool_choice={"name": ["get_weather"]}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": {"a": 1}}}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": "get_weather"}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": DEEP}}]), r"tools\[0\]"),
        (dict(tools=[{"name": "get_weather", "parameters": {"type": "object"}}]), r"tools\[0\] must be"),
        (dict(tools=[{"type": "function", "function": {"name": "f"}, "extra": DEEP}]), None),
        (dict(tools="get_weather"), "tools must be"),
        (dict(tools={"get_weather": WEATHER}), "tools must be"),
    ],
)
def test_malformed_tools_and_choices_are_value_errors(kit, kwargs, match):
    prompt = me.tokenize(kit, "hi")
    if match is None:  # accepted: an unknown key is ignored
        me.create_generator(kit, prompt, max_tokens=1, **kwargs).close()
        return
    with pytest.raises(ValueError, match=match):
        me.create_generator(kit, prompt, max_tokens=4, **kwargs)


@pytest.mark.parametrize(
    "tool_calls, match",
    [
        ("get_weather", r"messages\[1\]\.tool_calls must be a list"),
        ({"function": {"name": "get_weather"}}, r"messages\[1\]\.tool_calls must be a list"),
        (["get_weather"], r"messages\[1\]\.tool_calls\[0\]"),
        ([{"function": "get_weather"}], r"messages\[1\]\.tool_calls\[0\]\.function"),
        ([{"function": {"name": 3, "arguments": "{}"}}], r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
        ([{"function": {"name": "f", "arguments": 3}}], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
        ([{"function": {"name": "f", "arguments": DEEP}}], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
        ([{"function": {"name": "f", "arguments": {"b": deep_list(5000)}}}], r"tool_calls\[0\]\.function\.arguments"),
    ],
)
@pytest.mark.parametrize("family", ["default", "hermes"])
def test_malformed_tool_history_is_a_value_error(family_kits, family, tool_calls, match):
    kit = me.load_model(family_kits[family], vocab_only=True)
    messages = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": tool_calls}]
    with pytest.raises(ValueError, match=match):
        me.apply_chat_template(kit, messages, tools=TOOLS)


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'


@pytest.mark.parametrize("cut", ["<", "<tool", "<tool_call", "\n<tool_c", "\n<"])
@pytest.mark.parametrize("streamed", [False, True])
def test_a_call_cut_inside_its_opening_marker_is_not_text(cut, streamed):
    newline = cut[: len(cut) - len(cut.lstrip("\n"))]  # text before the marker stays text
    for before, text in (("", newline), (CALL, ""), ("Sure. ", "Sure. " + newline)):
        stream = ToolCallStream(FORMATS["hermes"], NAMES, streamed=streamed)
        pieces = [stream.feed(before), stream.feed(cut), stream.finish()]
        assert "".join(p.text for p in pieces) == text
        assert len([c for p in pieces for c in p.calls]) == (1 if before == CALL else 0)
