"""The request contract: create_generator's options declared once, in groups
(request/options.py), the explicit ``decoding`` choice and its aliases, and the
server's mapping of its wire fields into the groups."""

from __future__ import annotations

import mlx_engine as me
from mlx_engine.declare import checked
from mlx_engine.request.options import (
    DEFAULT_PROMPT_LOOKUP_TOKENS,
    GROUPS,
    MAX_LOOKUP_TOKENS,
    DecodingOptions,
    RequestOptions,
)
from mlx_engine.request.plan import DecodingPlan, choose_plan

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from helpers import generate_ids

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_groups_are_the_signature_and_the_documented_table():
    """The signature is the groups' fields in order; docs/api.md's table lists
    each group's fields, and every field has a one-line doc."""
    names = [f.name for group in GROUPS.values() for f in dataclasses.fields(group)]
    assert list(inspect.signature(me.create_generator).parameters)[2:] == names
    assert [f.name for f in dataclasses.fields(me.GenerationOptions)] == names
    table = {}
    for line in (DOCS / "api.md").read_text().splitlines():
        row = re.match(r"\| (\w+) \| `(\w+)` \| (.*) \|$", line)
        if row:
            table[row[1]] = (row[2], re.findall(r"`(\w+)`", row[3]))
    for name, group in GROUPS.items():
        assert table[name] == (group.__name__, [f.name for f in dataclasses.fields(group)])
        assert all(f.metadata.get("doc") for f in dataclasses.fields(group)), name


def test_request_options_sort_keyword_arguments_into_groups_and_back():
    kw = {"max_tokens": 7, "temp": 0.5, "decoding": "auto", "regex": "a+", "request_id": "r"}
    opts = RequestOptions.from_kwargs(kw)
    assert opts.output.max_tokens == 7 and opts.sampling.temp == 0.5 and opts.decoding.decoding == "auto"
    assert opts.constraints.regex == "a+" and opts.handling.request_id == "r"
    assert {k: opts.kwargs()[k] for k in kw} == kw
    assert RequestOptions.from_kwargs(opts.kwargs()) == opts
    with pytest.raises(me.InvalidArgument, match="did you mean 'decoding'") as err:
        RequestOptions.from_kwargs({"decodng": "auto"})
    assert err.value.param == "decodng"


@pytest.mark.parametrize(
    "kw, choice",
    [
        ({}, None),
        ({"auto_speculative": True}, "auto"),
        ({"auto_speculative": True, "prompt_lookup_num_tokens": 4}, "auto"),
        ({"prompt_lookup_num_tokens": 4}, "prompt_lookup"),
        ({"speculative_decoding_toggle": True}, "draft"),
        ({"num_draft_tokens": 3}, "draft"),
        ({"speculative_decoding_toggle": False}, None),
        ({"decoding": "prompt_lookup", "prompt_lookup_num_tokens": 4}, "prompt_lookup"),
        ({"decoding": "auto", "auto_speculative": True}, "auto"),
    ],
)
def test_aliases_map_to_the_decoding_choice(kw, choice):
    assert DecodingOptions(**kw).choice() == choice


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"decoding": "fast"}, "decoding"),
        ({"decoding": "plain", "auto_speculative": True}, "auto_speculative"),
        ({"decoding": "draft", "prompt_lookup_num_tokens": 4}, "prompt_lookup_num_tokens"),
        ({"decoding": "plain", "prompt_lookup_num_tokens": 4}, "prompt_lookup_num_tokens"),
        ({"decoding": "plain", "speculative_decoding_toggle": True}, "speculative_decoding_toggle"),
        ({"decoding": "draft", "speculative_decoding_toggle": False}, "speculative_decoding_toggle"),
    ],
)
def test_an_alias_that_contradicts_decoding_is_named(kw, param):
    with pytest.raises(me.InvalidArgument) as err:
        checked(DecodingOptions(**kw)).choice()
    assert err.value.param == param


def test_the_plan_reads_the_explicit_choice(kit, draft_path):
    """A lookup length is only a length: the choice picks the mode, and the
    engine holds the lengths' defaults (no host needs its own)."""
    plain = choose_plan(kit, DecodingOptions(decoding="plain"))
    assert plain == DecodingPlan("plain")
    lookup = choose_plan(kit, DecodingOptions(decoding="prompt_lookup"))
    assert lookup.kind == "prompt_lookup" and lookup.lookup_k == DEFAULT_PROMPT_LOOKUP_TOKENS
    explicit = choose_plan(kit, DecodingOptions(decoding="prompt_lookup", prompt_lookup_num_tokens=5))
    assert explicit == choose_plan(kit, DecodingOptions(prompt_lookup_num_tokens=5))
    auto = choose_plan(kit, DecodingOptions(decoding="auto", prompt_lookup_num_tokens=5))
    assert (auto.kind, auto.use_draft, auto.lookup_k) == ("auto", False, 5)
    assert choose_plan(kit, DecodingOptions(decoding="auto")).lookup_k == MAX_LOOKUP_TOKENS
    with pytest.raises(me.InvalidArgument, match="decoding='draft' needs a draft model") as err:
        choose_plan(kit, DecodingOptions(decoding="draft"))
    assert err.value.param == "decoding"
    me.load_draft_model(kit, draft_path)
    try:
        assert choose_plan(kit, DecodingOptions()).kind == "draft_model"  # the kit's default with a draft
        assert choose_plan(kit, DecodingOptions(decoding="draft", num_draft_tokens=3)).draft_k == 3
        assert choose_plan(kit, DecodingOptions(decoding="plain")).kind == "plain"
        no_draft = choose_plan(kit, DecodingOptions(decoding="auto", speculative_decoding_toggle=False))
        assert no_draft.kind == "auto" and not no_draft.use_draft
        with pytest.raises(me.InvalidArgument) as err:
            choose_plan(kit, DecodingOptions(decoding="prompt_lookup", num_draft_tokens=3))
        assert err.value.param == "num_draft_tokens"
        with pytest.raises(me.InvalidArgument) as err:
            choose_plan(kit, DecodingOptions(decoding="plain", num_draft_tokens=3))
        assert err.value.param == "num_draft_tokens"
    finally:
        me.unload_draft_model(kit)


def test_decoding_generates_as_its_alias_does(kit):
    prompt = me.tokenize(kit, "def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
    ids, last = generate_ids(kit, prompt, max_tokens=8, temp=0.0, decoding="prompt_lookup", prompt_lookup_num_tokens=4)
    alias_ids, alias_last = generate_ids(kit, prompt, max_tokens=8, temp=0.0, prompt_lookup_num_tokens=4)
    assert ids == alias_ids and last.stats.decoding_mode == alias_last.stats.decoding_mode == "prompt_lookup"
    with pytest.raises(me.InvalidArgument, match="decoding must be one of") as err:
        me.create_generator(kit, prompt, decoding="fast")
    assert err.value.param == "decoding"


def test_the_server_maps_its_wire_fields_into_the_groups(kit):
    """The extension's mode is passed as chosen and each length only where that
    mode uses it; the server holds no lookup default of its own."""
    from mlx_engine.server.core import params
    from mlx_engine.server.core.schemas import CompletionRequest, EngineOptions
    from mlx_engine.server.web.errors import from_engine

    lookup = params.decoding_options(EngineOptions(decoding="prompt_lookup", num_draft_tokens=3), "auto")
    assert lookup == DecodingOptions(decoding="prompt_lookup")
    plain = params.decoding_options(EngineOptions(prompt_lookup_num_tokens=4, prompt_lookup_max_ngram=5), "plain")
    assert plain == DecodingOptions(decoding="plain")
    auto = params.decoding_options(EngineOptions(prompt_lookup_num_tokens=4), "auto")
    assert auto == DecodingOptions(decoding="auto", prompt_lookup_num_tokens=4)
    req = CompletionRequest(model="m", prompt="hi", n=2, seed=5, temperature=0.5, max_tokens=4)
    kwargs = params.generator_kwargs(kit, req, params.Prompt([1, 2], []), "prompt_lookup")
    assert [kw["seed"] for kw in kwargs] == [5, 6] and kwargs[0]["decoding"] == "prompt_lookup"
    assert RequestOptions.from_kwargs(kwargs[0]).sampling.temp == 0.5
    err = from_engine(me.InvalidArgument("{param}='draft' needs a draft model", "decoding"))
    assert err.param == "mlx_engine.decoding" and err.message.startswith("mlx_engine.decoding='draft'")
