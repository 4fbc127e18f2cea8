"""Anthropic's Messages API on the server (mlx_engine/server/apis/anthropic_messages/,
docs/server.md), talked to as clients do: the official ``anthropic`` client's
``messages.create`` / ``messages.stream`` / ``messages.count_tokens`` and raw
HTTP, over 127.0.0.1; and the same greedy request through all three APIs."""

import mlx_engine as me
from mlx_engine.server import create_app
from mlx_engine.server.apis.anthropic_messages import routes as anthropic_routes
from mlx_engine.server.core import turns as core

import asyncio
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from helpers import requires_default_model, serve, slowed_kit, wait_until
from test_server import sdk_text

MODEL = "tiny"
KEY = "test-key"
GREEDY = {"temperature": 0, "mlx_engine": {"decoding": "plain"}}  # this client has no temperature argument
BILLING = "x-anthropic-billing-header: cc_version=2.1.0.abc; cc_entrypoint=cli; cch={};"
# A bounded string: the random-weight model would otherwise write one until the budget.
WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def tkit(llama_path):
    kit = me.load_model(llama_path, max_parallel=4)
    yield kit
    me.unload(kit)


@pytest.fixture(scope="module")
def server(tkit):
    with serve(create_app(tkit, model_id=MODEL, api_key=KEY, queue_size=32)) as url:
        yield url


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def slow_kit(llama_path):
    """The tiny model with every forward pass slowed to about 50 ms."""
    with slowed_kit(llama_path, 0.05, max_parallel=1) as kit:
        yield kit


def test_text_whole_and_streamed_equal_the_chat_answer(client, tkit):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the fox."}]
    prompt = me.apply_chat_template(tkit, messages)
    want = sdk_text(tkit, prompt, max_tokens=12, speculative_decoding_toggle=False)
    ask = dict(model=MODEL, max_tokens=12, system="Be brief.", messages=messages[1:], extra_body=GREEDY)
    whole = client.messages.create(**ask)
    assert whole.content[0].type == "text" and whole.content[0].text == want
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == len(prompt)
    assert whole.usage.model_extra["mlx_engine"]["generated_tokens"] == whole.usage.output_tokens

    with client.messages.stream(**ask) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[:2] == ["message_start", "content_block_start"]  # the client does not surface pings
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == want and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The same prompt again: the kit's cache held it, and the usage says so.
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(prompt)


def test_count_tokens_is_the_rendered_prompt(client, tkit):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "Hello."}],
        },
        {"role": "user", "content": "What now?"},
    ]
    want = me.apply_chat_template(
        tkit,
        [
            {"role": "system", "content": "S1\n\nS2"},
            {"role": "user", "content": "hi\nthere"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "What now?"},
        ],
    )
    system = [{"type": "text", "text": "S1", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "S2"}]
    got = client.messages.count_tokens(model=MODEL, system=system, messages=messages)
    assert got.input_tokens == len(want)


def test_the_billing_header_is_kept_out_of_the_prompt_unless_the_operator_keeps_it(client, server, tkit):
    """Claude Code's first system line changes between requests; dropped, the
    next request reuses the whole cached prompt it shares with the last."""
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Hello there."}])
    plain = client.messages.count_tokens(system="You code.", **body).input_tokens
    for cch in ("aaaa1", "bbbb2"):
        system = [{"type": "text", "text": BILLING.format(cch)}, {"type": "text", "text": "You code."}]
        assert client.messages.count_tokens(system=system, **body).input_tokens == plain
        inline = BILLING.format(cch) + "\nYou code."
        assert client.messages.count_tokens(system=inline, **body).input_tokens == plain
    first = client.messages.create(max_tokens=2, system=BILLING.format("c1") + "\nYou code.", **body, extra_body=GREEDY)
    second = client.messages.create(
        max_tokens=2, system=BILLING.format("c2") + "\nYou code.", **body, extra_body=GREEDY
    )
    assert second.usage.cache_read_input_tokens >= plain - 1 and first.content == second.content
    with serve(create_app(tkit, model_id=MODEL, keep_billing_header=True)) as url:
        keeping = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        kept = keeping.messages.count_tokens(system=BILLING.format("x") + "\nYou code.", **body).input_tokens
        assert kept > plain


def test_system_messages_stay_in_place(client, tkit):
    messages = [
        {"role": "user", "content": "Fix the bug."},
        {"role": "system", "content": "Reminder: be careful."},
    ]
    want = me.apply_chat_template(tkit, [{"role": "system", "content": "You code."}, *messages])
    assert client.messages.count_tokens(model=MODEL, system="You code.", messages=messages).input_tokens == len(want)


def test_tool_use_whole_and_streamed(client):
    ask = dict(
        model=MODEL,
        max_tokens=120,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    whole = client.messages.create(**ask)  # the server tool is skipped, not refused
    assert whole.stop_reason == "tool_use"
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])

    with client.messages.stream(**ask) as stream:
        raw = list(stream)
        final = stream.get_final_message()
    pieces = "".join(
        e.delta.partial_json for e in raw if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(pieces) == use.input
    assert final.stop_reason == "tool_use" and final.content[-1].input == use.input


def test_stop_sequences(client):
    ask = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Count with me."}], extra_body=GREEDY)
    text = client.messages.create(**ask).content[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip()
    cut = client.messages.create(stop_sequences=[stop], **ask)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == text[: text.index(stop)]


def test_max_tokens_over_the_context_is_capped_not_refused(client, tkit):
    words = tkit.context_length - 40
    prompt = me.apply_chat_template(tkit, [{"role": "user", "content": "a " * words}])
    room = tkit.context_length - len(prompt)
    assert 0 < room < 80
    got = client.messages.create(
        model=MODEL,
        max_tokens=32000,
        messages=[{"role": "user", "content": "a " * words}],
        extra_body=GREEDY,
        timeout=120,
    )
    assert got.usage.output_tokens <= room


@pytest.mark.slow
@requires_default_model
def test_a_tool_loop_on_the_default_model(smollm):
    """``tool_use``, then its ``tool_result``: the answer is chat completions' for the same turns."""
    with serve(create_app(smollm, model_id=MODEL)) as url:
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        question = {"role": "user", "content": "What is the weather in Paris?"}
        first = client.messages.create(
            model=MODEL,
            max_tokens=48,
            messages=[question],
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            extra_body=GREEDY,
        )
        use = first.content[-1]
        assert first.stop_reason == "tool_use" and use.name == "get_weather"
        result = {
            "type": "tool_result",
            "tool_use_id": use.id,
            "content": [{"type": "text", "text": '{"sky": "sunny"}'}],
        }
        follow = client.messages.create(
            model=MODEL,
            max_tokens=24,
            messages=[question, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}],
            tools=[WEATHER],
            tool_choice={"type": "none"},
            extra_body=GREEDY,
        )
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).chat.completions.create(
            model=MODEL,
            messages=[
                question,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": use.id,
                            "type": "function",
                            "function": {"name": use.name, "arguments": json.dumps(use.input)},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": use.id, "content": '{"sky": "sunny"}'},
            ],
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": WEATHER["description"],
                        "parameters": WEATHER["input_schema"],
                    },
                }
            ],
            tool_choice="none",
            max_tokens=24,
            temperature=0,
            extra_body={"mlx_engine": {"decoding": "plain"}},
        )
        assert follow.content[0].text == chat.choices[0].message.content and follow.content[0].text.strip()
        assert follow.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
        usage = follow.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens


@pytest.mark.slow
def test_sixteen_clients_across_the_three_apis_equal_the_sdk_alone(server, tkit):
    prompts = [f"Question number {i}: what comes next?" for i in range(16)]
    plain = {"mlx_engine": {"decoding": "plain"}}

    async def chat(c, text):
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": text}],
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body=plain,
        )
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def responses(c, text):
        stream = await c.responses.create(
            model=MODEL, input=text, max_output_tokens=10, temperature=0, stream=True, extra_body=plain
        )
        return "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])

    async def messages(a, text):
        async with a.messages.stream(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": text}], extra_body=GREEDY
        ) as s:
            return "".join([t async for t in s.text_stream])

    async def ask_all():
        async with (
            openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0) as c,
            anthropic.AsyncAnthropic(base_url=server, api_key=KEY, max_retries=0) as a,
        ):
            calls = [(chat, c), (responses, c), (messages, a)]
            return await asyncio.gather(*(calls[i % 3][0](calls[i % 3][1], t) for i, t in enumerate(prompts)))

    got = asyncio.run(ask_all())
    want = [
        sdk_text(
            tkit,
            me.apply_chat_template(tkit, [{"role": "user", "content": t}]),
            max_tokens=10,
            speculative_decoding_toggle=False,
        )
        for t in prompts
    ]
    assert got == want
    assert tkit.open_generations == 0


# -- raw HTTP and error statuses ---------------------------------------------------------------------
def post(url, body=None, *, content=None, path="/v1/messages", key=KEY, headers=None, **kw):
    headers = {
        **({"x-api-key": key, "anthropic-version": "2023-06-01", "anthropic-beta": "x"} if key else {}),
        **(headers or {}),
    }
    if content is not None:
        headers["Content-Type"] = "application/json"
    return httpx.post(url + path, json=body, content=content, headers=headers, timeout=60, **kw)


def hello(**fields):
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}], **fields}


@pytest.mark.parametrize(
    "body, status, kind",
    [
        (b"{not json", 400, "invalid_request_error"),
        (b"[]", 400, "invalid_request_error"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            400,
            "invalid_request_error",
        ),  # no max_tokens
        (hello(max_tokens=0), 400, "invalid_request_error"),
        (hello(messages=[]), 400, "invalid_request_error"),
        (hello(messages=[{"role": "robot", "content": "x"}]), 400, "invalid_request_error"),
        (hello(messages=[{"role": "user", "content": 5}]), 400, "invalid_request_error"),
        (hello(messages=[{"role": "user", "content": [{"text": "no type"}]}]), 400, "invalid_request_error"),
        (
            hello(
                messages=[
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}
                ]
            ),
            400,
            "invalid_request_error",
        ),
        (hello(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]), 400, "invalid_request_error"),
        (
            hello(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": 1}]}]),
            400,
            "invalid_request_error",
        ),
        (hello(system=[{"type": "image"}]), 400, "invalid_request_error"),
        (hello(temperature=1.5), 400, "invalid_request_error"),
        (hello(top_k="5"), 400, "invalid_request_error"),
        (hello(stop_sequences="END"), 400, "invalid_request_error"),
        (hello(tools=[{"name": "f"}]), 400, "invalid_request_error"),
        (hello(tools=[{**WEATHER, "name": "bad name!"}]), 400, "invalid_request_error"),
        (hello(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), 400, "invalid_request_error"),
        (hello(tools=[WEATHER], tool_choice={"type": "tool", "name": ["a"]}), 400, "invalid_request_error"),
        (hello(tool_choice={"type": "sometimes"}), 400, "invalid_request_error"),
        (hello(model="claude-sonnet-4-5"), 404, "not_found_error"),
    ],
)
def test_bad_requests_are_anthropic_errors(server, body, status, kind):
    r = post(server, content=body) if isinstance(body, bytes) else post(server, body)
    assert r.status_code == status, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == kind and got["error"]["message"]


def test_error_messages_name_the_request_fields(server):
    r = post(server, hello(tools=[{"type": "bash_20250124", "name": "bash"}, {**WEATHER, "name": "bad name!"}]))
    assert "tools.1.name" in r.json()["error"]["message"]
    assert "max_tokens" in post(server, hello(max_tokens="9")).json()["error"]["message"]


def test_keys_are_x_api_key_or_bearer(server):
    assert post(server, hello(), key=None).status_code == 401
    wrong = post(server, hello(), key="nope")
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    bearer = httpx.post(f"{server}/v1/messages", json=hello(), headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="nope", max_retries=0).messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )


def _is_anthropic_error(r, status, kind):
    got = r.json()
    return (
        r.status_code == status and got["type"] == "error" and got["error"]["type"] == kind and got["error"]["message"]
    )


@pytest.fixture(scope="module")
def guarded(tkit):
    """A server with a small body limit, a key and a Host list."""
    app = create_app(tkit, model_id=MODEL, api_key=KEY, max_body_bytes=2000, allowed_hosts=["localhost", "127.0.0.1"])
    with serve(app) as url:
        yield url


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_server_level_errors_on_anthropic_routes_are_in_anthropic_shape(guarded, path):
    big = hello(messages=[{"role": "user", "content": "x" * 3000}])
    assert _is_anthropic_error(post(guarded, big, path=path), 413, "request_too_large")

    def chunked():  # no Content-Length: counted as it arrives
        yield json.dumps(big).encode()

    assert _is_anthropic_error(post(guarded, content=chunked(), path=path), 413, "request_too_large")
    assert _is_anthropic_error(post(guarded, hello(), path=path, key=None), 401, "authentication_error")
    evil = post(guarded, hello(), path=path, headers={"Host": "evil.example"})
    assert _is_anthropic_error(evil, 400, "invalid_request_error") and "Host" in evil.json()["error"]["message"]
    wrong_method = httpx.get(guarded + path, headers={"x-api-key": KEY}, timeout=60)
    assert _is_anthropic_error(wrong_method, 405, "invalid_request_error") and "POST" in wrong_method.headers["allow"]


def test_unknown_anthropic_paths_and_the_openai_routes_keep_their_shapes(guarded):
    assert _is_anthropic_error(post(guarded, hello(), path="/v1/messages/batches"), 404, "not_found_error")
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3000}]}
    r = httpx.post(f"{guarded}/v1/chat/completions", json=big, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large" and "type" not in r.json()
    assert "type" not in httpx.get(f"{guarded}/v1/nothing", timeout=60).json()


def test_an_unexpected_failure_is_a_500_in_each_apis_shape(guarded, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(anthropic_routes, "count_prompt", broken)
    assert _is_anthropic_error(post(guarded, hello(), path="/v1/messages/count_tokens"), 500, "api_error")


def test_a_prompt_over_the_context_is_prompt_too_long(client, tkit):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "word " * (tkit.context_length + 10)}]
        )
    err = caught.value.body["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith("prompt is too long")


def test_busy_and_stopping_servers_answer_429_and_529(slow_kit, tkit):
    # Greedy, this prompt runs on for 40 tokens at least (the slow kit's weights are the tiny model's).
    prompt = me.apply_chat_template(tkit, [{"role": "user", "content": "hello"}])
    assert len(list(me.create_generator(tkit, prompt, max_tokens=40, temp=0.0))) >= 40
    app = create_app(slow_kit, model_id=MODEL, queue_size=0)
    long_body = hello(max_tokens=2000, stream=True, **GREEDY)
    with serve(app) as url, httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/messages", json=long_body) as first:
            lines = first.iter_lines()
            next(lines)  # running: the only row is taken, and nothing may wait
            busy = post(url, hello(), key=None)
            assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
            assert busy.headers["Retry-After"]
            # Counting is admitted as a request is: it takes a row, and none is free.
            count = http.post(f"{url}/v1/messages/count_tokens", json={"model": MODEL, "messages": hello()["messages"]})
            assert count.status_code == 429 and count.json()["error"]["type"] == "rate_limit_error"
            app.state.service.drain()
            stopping = post(url, hello(), key=None)
            assert stopping.status_code == 529 and stopping.json()["error"]["type"] == "overloaded_error"
    wait_until(lambda: slow_kit.open_generations == 0)


def test_pings_keep_a_waiting_stream_alive_and_a_client_leaving_frees_its_row(slow_kit, tkit, monkeypatch):
    prompt = me.apply_chat_template(tkit, [{"role": "user", "content": "hello"}])
    assert len(list(me.create_generator(tkit, prompt, max_tokens=40, temp=0.0))) >= 40
    monkeypatch.setattr(core, "HEARTBEAT_S", 0.01)  # each forward pass (50 ms) outlasts it
    body = hello(max_tokens=2000, stream=True, **GREEDY)
    with serve(create_app(slow_kit, model_id=MODEL)) as url, httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/messages", json=body) as r:
            lines, seen = r.iter_lines(), []
            while not seen or not seen[-1].startswith("event: content_block_delta"):
                seen.append(next(lines))
            assert seen.count("event: ping") >= 2  # the one after message_start, and keep-alives
            assert slow_kit.open_generations == 1
        wait_until(lambda: slow_kit.open_generations == 0)
        health = http.get(f"{url}/health").json()
        assert health["running"] == 0 and health["cancelled"] == 1
