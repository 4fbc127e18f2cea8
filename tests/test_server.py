"""The OpenAI-compatible server (mlx_engine/server, docs/server.md), talked to
as clients do: the official ``openai`` client and raw HTTP, over a real socket
on 127.0.0.1 (uvicorn in a thread; one test runs ``python -m mlx_engine.server``
in a subprocess to stop it with SIGTERM under load)."""

import mlx_engine as me
from mlx_engine.server import create_app
from mlx_engine.server.__main__ import GracefulServer, build_parser
from mlx_engine.server.__main__ import main as server_main
from mlx_engine.server.hosting.admission import AdmissionQueue, QueueFullError, ShuttingDownError
from mlx_engine.server.web.connections import connection_limits
from mlx_engine.server.web.host_check import LOOPBACK_NAMES

import asyncio
import base64
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import jsonschema
import openai
import pytest
import uvicorn
from helpers import free_port, requires_default_model, serve, slowed_kit, wait_until

KEY = "test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def tkit(llama_path):
    kit = me.load_model(llama_path, max_parallel=4)
    yield kit
    me.unload(kit)


@pytest.fixture(scope="module")
def server(tkit, models_dir):
    app = create_app(tkit, model_id=MODEL, api_key=KEY, queue_size=16, models_dir=models_dir)
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def slow_kit(llama_path):
    """The tiny model with every forward pass slowed to about 5 ms, so that a
    long generation is surely still running while a test acts on it."""
    with slowed_kit(llama_path, 0.005, max_parallel=2) as kit:
        yield kit


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def no_eos(kit) -> dict:
    """A logit_bias that keeps a generation going to its max_tokens."""
    return {str(t): -100 for t in kit.eos_token_ids}


def sdk_text(kit, prompt, **kw) -> str:
    return "".join(r.text for r in me.create_generator(kit, prompt, **kw))


def chat_prompt(kit, text):
    return me.apply_chat_template(kit, [{"role": "user", "content": text}])


# -- the official client -------------------------------------------------------------------
def test_chat_whole_and_streamed_equal_the_sdk(client, tkit):
    messages = [{"role": "user", "content": "Tell me about the quick brown fox."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    want = sdk_text(tkit, chat_prompt(tkit, messages[0]["content"]), max_tokens=16, speculative_decoding_toggle=False)
    assert whole.choices[0].message.content == want
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 16 or whole.choices[0].finish_reason == "stop"

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == whole.usage.prompt_tokens
    # The same conversation again: its prompt comes from the kit's cache.
    assert usage.prompt_tokens_details.cached_tokens > 0
    ext = usage.model_extra["mlx_engine"]
    assert {
        "decoding_mode",
        "mode_reason",
        "drafted_tokens",
        "accepted_tokens",
        "time_to_first_token",
        "generation_tps",
    } <= set(ext)


def test_next_turn_reuses_the_cache_across_requests(client):
    turn1 = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "A question"}]
    first = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=6, temperature=0)
    turn2 = turn1 + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And another"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_completions_whole_and_streamed(client, tkit):
    prompt = "Once upon a time"
    want = sdk_text(tkit, me.tokenize(tkit, prompt), max_tokens=10, speculative_decoding_toggle=False)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert whole.choices[0].text == want and whole.object == "text_completion"
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    ids = client.completions.create(model=MODEL, prompt=me.tokenize(tkit, prompt), max_tokens=10, temperature=0)
    assert ids.choices[0].text == want


def test_json_schema_answers_validate(client):
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "level": {"enum": ["low", "high"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["ok", "level", "n"],
        "additionalProperties": False,
    }
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Answer as JSON."}],
            max_tokens=40,
            temperature=0.8,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    obj = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
        extra_body={"mlx_engine": {"decoding": "plain"}},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # a random model may write a long string; what it wrote is still the start of an object
        assert obj.choices[0].message.content.startswith("{")


def test_seeded_sampling_repeats_and_n_choices(client, tkit):
    ask = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=12,
        temperature=0.9,
        logit_bias=no_eos(tkit),
    )
    a = client.chat.completions.create(seed=7, **ask).choices[0].message.content
    b = client.chat.completions.create(seed=7, **ask).choices[0].message.content
    other = client.chat.completions.create(seed=8, **ask).choices[0].message.content
    assert a == b and a != other
    two = client.chat.completions.create(seed=7, n=2, **ask)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == a and two.choices[1].message.content == other  # choice i: seed + i
    assert two.usage.completion_tokens == 24
    assert len(two.usage.model_extra["mlx_engine"]["choices"]) == 2


# -- tool calls ----------------------------------------------------------------------------
# Bounded strings: the random-weight model would otherwise write one until max_tokens.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "maxLength": 8}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def streamed_calls(chunks) -> dict:
    """``delta.tool_calls`` reassembled as the openai client's users do: index -> (id, name, arguments)."""
    parts: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # id, type and name come once, on a call's first delta
                    assert d.index not in parts and d.type == "function" and d.function.name
                    parts[d.index] = [d.id, d.function.name, ""]
                else:
                    assert d.type is None and d.function.name is None
                parts[d.index][2] += d.function.arguments
    return {i: (cid, name, json.loads(args)) for i, (cid, name, args) in parts.items()}


def test_tool_calls_whole_streamed_and_per_choice(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    common = dict(
        model=MODEL,
        messages=messages,
        max_tokens=120,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    whole = client.chat.completions.create(**common, n=2)
    for choice in whole.choices:  # n > 1: each choice makes its own call
        msg = choice.message
        assert choice.finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    first, second = (c.message.tool_calls[0] for c in whole.choices)
    assert first.id != second.id and (first.function.name, first.function.arguments) == (
        second.function.name,
        second.function.arguments,
    )  # greedy: the same call

    chunks = list(client.chat.completions.create(**common, stream=True))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    calls = streamed_calls(chunks)
    assert list(calls) == [0] and calls[0][0].startswith("call_")
    assert calls[0][1:] == (first.function.name, json.loads(first.function.arguments))


@pytest.mark.slow
@requires_default_model
def test_tool_call_round_trip_on_the_default_model(smollm):
    """A required call validates, a named one calls that tool, and the next request
    with the assistant's call and the tool's result renders and answers as the SDK does."""
    with serve(create_app(smollm, model_id=MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            answer = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=48,
                temperature=0,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
            )
            assert answer.choices[0].finish_reason == "tool_calls"
            call = answer.choices[0].message.tool_calls[0]
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.function.name == "get_weather"

        history = messages + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'},
        ]
        follow = client.chat.completions.create(
            model=MODEL, messages=history, max_tokens=24, temperature=0, tools=TOOLS, tool_choice="none"
        )
        prompt = me.apply_chat_template(smollm, history, tools=TOOLS)
        assert follow.usage.prompt_tokens == len(prompt)
        want = sdk_text(
            smollm, prompt, max_tokens=24, tools=TOOLS, tool_choice="none", speculative_decoding_toggle=False
        )
        assert follow.choices[0].message.content == want and want.strip()
        assert follow.choices[0].message.tool_calls is None


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy: the best
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace")
    c = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_sixteen_clients_on_four_rows_equal_the_sdk_alone(server, tkit):
    prompts = [f"Question number {i}: what comes next?" for i in range(16)]
    extra = {"mlx_engine": {"decoding": "plain"}}

    async def ask_all():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0) as c:

            async def one(text):
                stream = await c.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": text}],
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    extra_body=extra,
                )
                return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

            return await asyncio.gather(*(one(t) for t in prompts))

    got = asyncio.run(ask_all())
    want = [sdk_text(tkit, chat_prompt(tkit, t), max_tokens=12, speculative_decoding_toggle=False) for t in prompts]
    assert got == want
    assert tkit.open_generations == 0


# -- raw HTTP ----------------------------------------------------------------------------
def post(url, body=None, *, key=KEY, content=None, path="/v1/chat/completions", **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
    return httpx.post(url + path, json=body, content=content, headers=headers, timeout=30, **kw)


def hello(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (hello(temperature="hot"), 400, "temperature"),
        (hello(max_tokens="5"), 400, "max_tokens"),
        (hello(n=2.0), 400, "n"),
        (hello(stream=1), 400, "stream"),
        ({"model": MODEL, "messages": "hello"}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
        (hello(top_k=10**6), 400, "top_k"),  # checked by the engine, mapped to the field
        (hello(seed=-1), 400, "seed"),
        (hello(stop=[""]), 400, "stop"),
        (hello(logit_bias={"abc": 1}), 400, "logit_bias"),
        (hello(n=5), 400, "n"),
        (hello(tools="get_weather"), 400, "tools"),
        (hello(tools=[{"type": "function"}]), 400, "tools.0"),
        (hello(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "tools.0.function.name"),
        (hello(tools=TOOLS + TOOLS[:1]), 400, "tools.2.function.name"),
        (
            hello(
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
            400,
            "tools.0.function.parameters",
        ),  # by the engine
        (hello(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), 400, "tool_choice"),
        (hello(tools=TOOLS, tool_choice="sometimes"), 400, "tool_choice"),
        (hello(tool_choice="required"), 400, "tool_choice"),
        (hello(tools=TOOLS, parallel_tool_calls="yes"), 400, "parallel_tool_calls"),
        (hello(tools=TOOLS, response_format={"type": "json_object"}), 400, "tools"),
        (
            hello(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}]),
            400,
            "messages.0.tool_calls.0.function",
        ),
        (
            hello(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}),
            400,
            "response_format",
        ),
        (
            hello(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}],
                    }
                ]
            ),
            400,
            "messages.0.content.0.image_url",
        ),
        (hello(model="gpt-4o"), 404, "model"),
    ],
)
def test_bad_requests_are_openai_errors(server, body, status, param):
    r = post(server, content=body) if isinstance(body, bytes) else post(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"] == param


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_object(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize(
    "body, path, param, absent",
    [
        # The engine's own checks, said in the request's terms (not create_generator's).
        (hello(mlx_engine={"decoding": "draft"}), None, "mlx_engine.decoding", "load_draft_model"),
        (hello(stop=[""]), None, "stop", "stop_strings"),
        (hello(mlx_engine={"num_draft_tokens": 3}), None, "mlx_engine.num_draft_tokens", "create_generator"),
        (hello(mlx_engine={"regex": "("}), None, "mlx_engine.regex", "create_generator"),
        ({"model": MODEL, "prompt": [1, 10**6], "max_tokens": 2}, "/v1/completions", "prompt", "prompt_tokens"),
        # Break-it probe: 500s for bad input.
        (
            hello(tools=TOOLS, tool_choice={"type": "function", "function": {"name": ["get_weather"]}}),
            None,
            "tool_choice",
            None,
        ),
        (
            hello(tools=TOOLS, tool_choice={"type": "function", "function": {"name": {"a": 1}}}),
            None,
            "tool_choice",
            None,
        ),
        ({"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2}, "/v1/completions", "prompt", None),
        (hello(stop=["x"] * 17), None, "stop", None),
        (hello(stop="y" * 5000), None, "stop", None),
        (
            hello(tools=[{"type": "function", "function": {"name": "f", "parameters": nested(100_000)}}]),
            None,
            "tools.0.function.parameters",
            None,
        ),
        (
            hello(tools=[{"type": "function", "function": {"name": "f", "parameters": json.loads(nested(500))}}]),
            None,
            "tools.0.function.parameters",
            None,
        ),
        (
            hello(response_format={"type": "json_schema", "json_schema": {"schema": json.loads(nested_object(900))}}),
            None,
            "response_format",
            None,
        ),
        (
            hello(
                messages=[
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": nested(100_000)}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "1"},
                ]
            ),
            None,
            "messages.1.tool_calls.0.function.arguments",
            None,
        ),
    ],
)
def test_errors_speak_the_requests_terms_and_bad_input_is_never_a_500(server, body, path, param, absent):
    # As JSON text with escapes: a lone surrogate is JSON that Python's encoder must not see raw.
    r = post(server, content=json.dumps(body).encode(), path=path or "/v1/chat/completions")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if absent:
        assert absent not in error["message"], error
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_a_model_by_id(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    got = httpx.get(f"{server}/v1/models/{MODEL}", headers=auth)
    body = got.json()
    assert got.status_code == 200 and {k: body[k] for k in ("id", "object", "created", "owned_by")} == {
        "id": MODEL,
        "object": "model",
        "created": 0,
        "owned_by": "mlx-engine",
    }
    assert body["state"] == "loaded"  # and the host's extension fields (docs/server.md, "Several models")
    missing = httpx.get(f"{server}/v1/models/gpt-4o", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server}/v1/models/{MODEL}").status_code == 401


def test_draft_names_and_paths_get_clear_errors(tkit, tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")

    def check(url, name):
        return httpx.post(f"{url}/v1/mlx_engine/draft/check", json={"model": name}, timeout=30)

    with serve(create_app(tkit, model_id=MODEL, models_dir=tmp_path)) as url:
        for name, status in (
            ("no-such-draft", 404),
            ("sub/no-such-draft", 404),
            ("bad\x00name", 400),
            ("x" * 5000, 400),
            ("/".join(["d"] * 3000), 400),
            ("loop", 400),
            ("a", 400),
            ("loop/inner", 400),
        ):
            for r in (check(url, name), httpx.post(f"{url}/v1/mlx_engine/draft", json={"model": name}, timeout=30)):
                assert r.status_code == status, (name, r.text)
                assert r.json()["error"]["param"] == "model"
        missing = check(url, "no-such-draft").json()["error"]
        assert "not found" in missing["message"] and missing["code"] == "model_not_found"
    with serve(create_app(tkit, model_id=MODEL)) as url:
        r = check(url, "no-such-draft")  # a name, not a path: unknown, not forbidden
        assert r.status_code == 404 and "catalog" in r.json()["error"]["message"]
        assert check(url, "/tmp").status_code == 403


def test_empty_tools_are_no_tools(server, tkit):
    """Some clients always send ``tools``; an empty list renders and answers as none."""
    r = post(server, hello(tools=[], tool_choice="auto", temperature=0, max_tokens=6))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message
    assert message["content"] == sdk_text(
        tkit, chat_prompt(tkit, "hello"), max_tokens=6, speculative_decoding_toggle=False
    )


def test_unknown_fields_are_ignored_and_models_listed(server):
    assert post(server, hello(some_future_field={"x": 1}, metadata={"a": "b"})).status_code == 200
    listed = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in listed["data"]] == [MODEL]


def test_api_key_required_and_compared(server):
    assert post(server, hello(), key=None).status_code == 401
    assert post(server, hello(), key="wrong").status_code == 401
    assert httpx.get(f"{server}/v1/models").status_code == 401
    assert post(server, hello()).status_code == 200
    assert httpx.get(f"{server}/health").json()["status"] == "ok"  # health needs no key


def test_oversized_body_is_413(tkit):
    with serve(create_app(tkit, model_id=MODEL, max_body_bytes=1000)) as url:
        big = hello(messages=[{"role": "user", "content": "x" * 2000}])
        r = post(url, big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: counted as it arrives
            yield json.dumps(big).encode()

        r = post(url, content=chunked())
        assert r.status_code == 413
        assert post(url, hello()).status_code == 200


def test_cors_is_off_unless_origins_are_given(server, tkit):
    origin = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in httpx.options(f"{server}/v1/chat/completions", headers=origin).headers
    with serve(create_app(tkit, model_id=MODEL, cors_origins=["http://app.example"])) as url:
        r = httpx.options(f"{url}/v1/chat/completions", headers=origin)
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.options(f"{url}/v1/chat/completions", headers={**origin, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_a_full_queue_is_429_and_the_waiter_gets_the_row(slow_kit):
    app = create_app(slow_kit, model_id=MODEL, max_parallel=1, queue_size=1)
    long_body = hello(max_tokens=4000, stream=True, logit_bias=no_eos(slow_kit), mlx_engine={"decoding": "plain"})
    with serve(app) as url, httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", json=long_body) as first:
            lines = first.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # running
            waiter = {}
            t = threading.Thread(target=lambda: waiter.update(r=post(url, hello(max_tokens=3))))
            t.start()
            wait_until(lambda: http.get(f"{url}/health").json()["waiting"] == 1)
            refused = post(url, hello())
            assert refused.status_code == 429 and refused.headers["Retry-After"]
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert "r" not in waiter
        t.join(60)  # the first stream's client left: its row went to the waiter
        assert waiter["r"].status_code == 200
    wait_until(lambda: slow_kit.open_generations == 0)


def test_admission_queue_is_fifo_bounded_and_closable():
    async def main():
        q = AdmissionQueue(rows=2, limit=2)
        await q.acquire(2)
        order = []

        async def wait_for(name, rows):
            await q.acquire(rows)
            order.append(name)

        tasks = [asyncio.create_task(wait_for("a", 2)), asyncio.create_task(wait_for("b", 1))]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError):
            await q.acquire(1)
        q.release(1)  # one row free: the head needs two, and "b" may not pass it
        await asyncio.sleep(0.01)
        assert order == []
        q.release(1)
        await asyncio.sleep(0.01)
        assert order == ["a"]
        q.release(2)
        await asyncio.gather(*tasks)
        assert order == ["a", "b"] and q.free == 1
        waiting = asyncio.create_task(q.acquire(2))
        await asyncio.sleep(0.01)
        waiting.cancel()  # a client that left the line
        await asyncio.gather(waiting, return_exceptions=True)
        assert q.waiting == 0 and q.free == 1
        late = asyncio.create_task(q.acquire(2))
        await asyncio.sleep(0.01)
        q.close()
        with pytest.raises(ShuttingDownError):
            await late
        with pytest.raises(ShuttingDownError):
            await q.acquire(1)

    asyncio.run(main())


def test_rows_a_host_holds_make_requests_wait_not_fail(server, tkit):
    held = [me.create_generator(tkit, chat_prompt(tkit, "host"), max_tokens=2) for _ in range(tkit.max_parallel)]
    answer = {}
    t = threading.Thread(target=lambda: answer.update(r=post(server, hello(max_tokens=3))))
    t.start()
    wait_until(lambda: httpx.get(f"{server}/health").json()["running"] == 1)
    assert "r" not in answer  # admitted by the server, waiting for the kit
    for g in held:
        g.close()
    t.join(60)
    assert answer["r"].status_code == 200
    wait_until(lambda: tkit.open_generations == 0)


def test_a_client_leaving_mid_stream_frees_its_row(slow_kit, caplog):
    caplog.set_level(logging.INFO, logger="mlx_engine.server.hosting.runs")
    body = hello(max_tokens=4000, stream=True, logit_bias=no_eos(slow_kit), mlx_engine={"decoding": "plain"})
    with serve(create_app(slow_kit, model_id=MODEL)) as url, httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
            assert slow_kit.open_generations == 1
        wait_until(lambda: slow_kit.open_generations == 0)
        health = http.get(f"{url}/health").json()
        assert health["running"] == 0 and health["cancelled"] == 1
    # One line says so (a host's log shows why a request ended early), no traceback.
    lines = [r for r in caplog.records if r.name == "mlx_engine.server.hosting.runs"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "cancelled" in lines[0].getMessage()
    assert lines[0].exc_info is None


# -- vision --------------------------------------------------------------------------------
def test_an_image_part_on_a_vision_kit(tmp_path_factory):
    from fixtures.tiny_vlm import image_b64, make_qwen2_vl

    path = make_qwen2_vl(tmp_path_factory.mktemp("vlm") / "qwen2_vl")
    kit = me.load_model(path)
    red = image_b64((255, 0, 0))
    prompt = list(
        kit.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
            add_generation_prompt=True,
        )
    )
    want = sdk_text(kit, prompt, images_b64=[red], max_tokens=6, speculative_decoding_toggle=False)
    with serve(create_app(kit, model_id=MODEL)) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        parts = [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{red}"}},
            {"type": "text", "text": "What colour?"},
        ]
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": parts}],
            max_tokens=6,
            temperature=0,
            extra_body={"mlx_engine": {"decoding": "plain"}},
        )
        assert r.choices[0].message.content == want
        bad = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, parts[1]]
        with pytest.raises(openai.BadRequestError, match="data: URIs"):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": bad}], max_tokens=2)
        broken = [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no").decode()}},
            parts[1],
        ]
        with pytest.raises(openai.BadRequestError, match="image 1 of the request") as err:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": broken}], max_tokens=2)
        assert err.value.body["param"] == "messages" and "images_b64" not in err.value.body["message"]
    me.unload(kit)


# -- draft models over HTTP ----------------------------------------------------------------
def test_draft_management(server, tkit, models_dir, draft_path, foreign_tokenizer_path):
    def call(method, path, body=None):
        return httpx.request(
            method,
            f"{server}/v1/mlx_engine/draft{path}",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )

    assert call("GET", "").json() == {"loaded": False, "model": None}
    ok = call("POST", "/check", {"model": "draft"}).json()
    assert ok["compatible"] is True and ok["reasons"] == [], ok
    foreign = call("POST", "/check", {"model": str(foreign_tokenizer_path)}).json()
    assert foreign["compatible"] is False and any("tokenizers differ" in r for r in foreign["reasons"])
    for outside in ("../../etc", "/etc/passwd", str(models_dir.parent)):
        r = call("POST", "", {"model": outside})
        assert r.status_code == 403 and r.json()["error"]["param"] == "model"
    assert call("POST", "", {"model": "foreign"}).json()["error"]["code"] == "incompatible_draft_model"
    assert call("POST", "", {"model": "draft"}).json() == {"loaded": True, "model": "draft"}
    r = post(server, hello(max_tokens=8, temperature=0, mlx_engine={"decoding": "draft"}))
    assert r.json()["usage"]["mlx_engine"]["decoding_mode"] == "draft_model"
    assert call("DELETE", "").json() == {"loaded": False, "model": None}
    assert tkit.draft is None
    r = post(server, hello(mlx_engine={"decoding": "draft"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "mlx_engine.decoding"


def test_paths_are_refused_without_models_dir(tkit):
    with serve(create_app(tkit, model_id=MODEL)) as url:
        r = httpx.post(f"{url}/v1/mlx_engine/draft", json={"model": "/tmp"})
        assert r.status_code == 403


# -- connections and hosts -------------------------------------------------------------------
@pytest.mark.slow
def test_stalled_sockets_cannot_lock_clients_out(tkit):
    """Sockets that connect and send half a request (or nothing) are closed when
    a cap of 8 is passed (the longest-waiting first) or when their deadline
    ends; /health and requests still get through."""
    with serve(create_app(tkit, model_id=MODEL), **connection_limits(max_connections=8, idle_timeout=1.0)) as url:
        port = int(url.rsplit(":", 1)[1])
        stalled = []
        try:
            for i in range(64):
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" if i % 2 else b"")
                stalled.append(sock)
            for _ in range(3):
                assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
            assert post(url, hello(), key=None).status_code == 200
            last = stalled[-1]  # spared by the cap, closed by its deadline
            last.settimeout(30)
            assert last.recv(1) == b""
            body = socket.create_connection(("127.0.0.1", port))  # a body that stops coming
            stalled.append(body)
            body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
            body.settimeout(30)
            assert body.recv(65536).startswith(b"HTTP/1.1 400") or body.recv(1) == b""
        finally:
            for sock in stalled:
                sock.close()


def test_host_header_is_checked_against_dns_rebinding(tkit):
    with serve(create_app(tkit, model_id=MODEL, allowed_hosts=list(LOOPBACK_NAMES))) as url:
        port = url.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]:80", "LOCALHOST"):
            assert httpx.get(f"{url}/health", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", ""):
            r = httpx.post(f"{url}/v1/chat/completions", json=hello(), headers={"Host": host})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
    with serve(create_app(tkit, model_id=MODEL, allowed_hosts=[*LOOPBACK_NAMES, "box.lan"])) as url:
        assert httpx.get(f"{url}/health", headers={"Host": "box.lan:8080"}).status_code == 200


# -- start-up ----------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "mlx_engine.server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "MLX_ENGINE_API_KEY": ""},
    )


def test_server_help_says_every_default():
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.dest
            assert "default" in action.help or action.required, action.dest
    text = parser.format_help()
    for default in ("(default: 8080)", "(default: 4)", "(default: 64)"):
        assert default in text


@pytest.mark.parametrize(
    "args, says",
    [
        (["--model", "nope"], "--model: 'nope' was not found"),
        (["--model", "nope", "--port", "99999"], "--port: must be from 1 to 65535, got 99999"),
        (["--model", "nope", "--max-parallel", "0"], "--max-parallel: must be at least 1"),
        (["--model", "nope", "--shutdown-grace", "nan"], "--shutdown-grace"),
        (["--model", "nope", "--shutdown-grace", "inf"], "--shutdown-grace: must be a finite number, got inf"),
        (["--model", "nope", "--context", "lots"], "--context"),
        (["--model", "nope", "--decoding", "draft"], "--decoding draft needs a draft model"),
        (["--model", "nope", "--models-dir", "/no/such/dir"], "--models-dir"),
        (["--draft", "smollm2-135m-draft"], "--draft needs --model"),  # --model itself is optional (a model host)
        (["--ttl", "-1"], "--ttl: must be at least 0"),
        (["--max-loaded", "0"], "--max-loaded: must be at least 1"),
    ],
)
def test_server_start_up_mistakes_are_one_line_and_exit_2(args, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        server_main(args)  # before any model loads: "nope" is never loaded
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m mlx_engine.server: error: "), lines
    assert says in lines[0]


@pytest.mark.slow
def test_server_port_in_use_and_bad_models_are_found_before_loading(tmp_path, llama_path):
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The port is checked first: a model that would fail to load is never reached.
        out = start_server("--model", str(not_a_model), "--port", str(port))
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert f"--port {port}" in out.stderr and "in use" in out.stderr
    out = start_server("--model", str(not_a_model), "--port", str(free_port()))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "no config.json" in out.stderr and "Traceback" not in out.stderr
    out = start_server("--model", str(llama_path), "--draft", str(tmp_path / "no-draft"), "--port", str(free_port()))
    assert out.returncode == 2 and "--draft" in out.stderr and "not found" in out.stderr, out.stderr


# -- stopping --------------------------------------------------------------------------------
def test_stopping_cuts_running_answers_with_a_final_chunk_after_the_grace(slow_kit):
    """In process, as the command line stops: past the grace period a stream
    ends with its finish chunk, an error event saying it was cut, and [DONE];
    a whole answer is a 200."""
    app = create_app(slow_kit, model_id=MODEL)
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", timeout_graceful_shutdown=30)
    server = GracefulServer(config, app.state.service, grace_s=0.5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    url = f"http://127.0.0.1:{config.port}"
    body = hello(max_tokens=4000, logit_bias=no_eos(slow_kit), mlx_engine={"decoding": "plain"})
    got = {}

    def whole():
        got["whole"] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)

    waiter = threading.Thread(target=whole)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        waiter.start()
        wait_until(lambda: slow_kit.open_generations == 2)
        server.should_exit = True
        lines = [ln for ln in r.iter_lines() if ln]
    waiter.join(60)
    thread.join(60)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]] == ["stop"]
    assert events[-1]["error"]["code"] == "shutting_down"
    answer = got["whole"]
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "stop"
    assert slow_kit.open_generations == 0


@pytest.mark.slow
@requires_default_model
def test_sigterm_under_load_ends_every_answer_cleanly_and_exits_0():
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_engine.server",
            "--model",
            me.DEFAULT_MODEL,
            "--port",
            str(port),
            "--model-id",
            MODEL,
            "--max-parallel",
            "2",
            "--queue",
            "4",
            "--shutdown-grace",
            "1",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env={**os.environ, "MLX_ENGINE_API_KEY": ""},
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(url) or proc.poll() is not None, timeout=120)
        assert proc.poll() is None
        outcomes = {}

        # The default model answers "hello" in about 10 tokens: without its end tokens
        # (<|endoftext|> 0, <|im_end|> 2) both answers surely run into the shutdown.
        endless = {"logit_bias": {"0": -100, "2": -100}, "mlx_engine": {"decoding": "plain"}}

        def streamed(name, max_tokens):
            body = hello(max_tokens=max_tokens, stream=True, **endless)
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                outcomes[name] = (r.status_code, [ln for ln in r.iter_lines() if ln])

        def whole(name, max_tokens):
            body = hello(max_tokens=max_tokens, **endless)
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            outcomes[name] = (r.status_code, r.json())

        threads = [
            threading.Thread(target=streamed, args=("a", 4000)),
            threading.Thread(target=whole, args=("b", 4000)),
        ]
        for t in threads:
            t.start()
        wait_until(lambda: _health(url)["running"] == 2)
        threads.append(threading.Thread(target=whole, args=("queued", 3)))
        threads[-1].start()
        wait_until(lambda: _health(url)["waiting"] == 1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert outcomes["queued"][0] == 503  # admitted nothing more
        # 4000 tokens take far longer than the 1 s grace: cut, and each answer still ends properly.
        status, lines = outcomes["a"]
        events = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
        assert status == 200 and lines[-1] == "data: [DONE]"
        finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
        assert finishes == ["stop"]
        assert events[-1]["error"]["code"] == "shutting_down"
        status, answer = outcomes["b"]
        assert status == 200 and answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] < 4000
        assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()


def _health(url) -> dict:
    return httpx.get(f"{url}/health").json()


def _up(url) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_generation_failing_on_its_argument_is_a_400_naming_the_field():
    """A grammar that reaches one of llguidance's limits mid-generation is the
    request's fault (tests/test_structured.py): a 400 naming the request's field,
    while any other failure of a running generation stays a 500."""
    from mlx_engine.server.web.errors import from_failure

    err = from_failure(me.InvalidArgument("{param} cannot be used: {detail}", "regex", detail="too many expressions"))
    assert (err.status, err.param, err.type) == (400, "mlx_engine.regex", "invalid_request_error")
    assert "mlx_engine.regex cannot be used" in err.message
    assert from_failure(RuntimeError("boom")).status == 500


def test_grammar_limits_up_front_and_late_over_http(tkit):
    """A limit met on the probe's path (a huge repetition right after a choice)
    is a 400 before any model work; one met further along ends the generation
    with the same 400 (an error event in a stream), and /health counts it as
    ``rejected``, not ``failed``: it is the client's argument."""
    with serve(create_app(tkit, model_id=MODEL)) as url:
        early = httpx.post(f"{url}/v1/chat/completions", json=hello(mlx_engine={"regex": "[xy]c{100000}"}))
        assert early.status_code == 400 and early.json()["error"]["param"] == "mlx_engine.regex"
        late = hello(max_tokens=40, temperature=0, mlx_engine={"regex": "[xy]{12}z{100000}", "decoding": "plain"})
        whole = httpx.post(f"{url}/v1/chat/completions", json=late, timeout=60)
        assert whole.status_code == 400 and whole.json()["error"]["param"] == "mlx_engine.regex"
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**late, "stream": True}, timeout=60) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert r.status_code == 200 and '"param": "mlx_engine.regex"' in lines[-2] and lines[-1] == "data: [DONE]"
        health = httpx.get(f"{url}/health").json()
        assert health["rejected"] == 2 and health["failed"] == 0
