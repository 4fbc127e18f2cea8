"""OpenAI's Responses API on the server (mlx_engine/server/apis/openai_responses/,
docs/server.md), talked to as clients do: the official ``openai`` client's
``responses.create`` / ``responses.stream`` and raw HTTP, over 127.0.0.1."""

import mlx_engine as me
from mlx_engine.server import create_app
from mlx_engine.server.apis.openai_responses import ResponseStore
from mlx_engine.server.core import turns as core

import json

import httpx
import jsonschema
import openai
import pytest
from helpers import requires_default_model, serve, slowed_kit, wait_until
from test_server import sdk_text

MODEL = "tiny"
PLAIN = {"mlx_engine": {"decoding": "plain"}}
# A bounded string: the random-weight model would otherwise write one until the budget.
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
}


@pytest.fixture(scope="module")
def tkit(llama_path):
    kit = me.load_model(llama_path, max_parallel=4)
    yield kit
    me.unload(kit)


@pytest.fixture(scope="module")
def server(tkit):
    with serve(create_app(tkit, model_id=MODEL)) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def slow_kit(llama_path):
    """The tiny model with every forward pass slowed to about 50 ms: a stream
    surely waits on it while a test acts."""
    with slowed_kit(llama_path, 0.05, max_parallel=2) as kit:
        yield kit


def events_of(stream) -> list:
    return [e for e in stream]


def test_text_whole_and_streamed_equal_the_chat_answer(client, tkit):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the fox."}]
    want = sdk_text(tkit, me.apply_chat_template(tkit, messages), max_tokens=12, speculative_decoding_toggle=False)
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=PLAIN
    )
    ask = dict(model=MODEL, instructions="Be brief.", max_output_tokens=12, temperature=0, extra_body=PLAIN)
    whole = client.responses.create(input="Tell me about the fox.", **ask)
    assert whole.output_text == want == chat.choices[0].message.content
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: from the kit's cache
    # The developer role, and input as items with input_text parts, render the same prompt.
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me about the fox."}]},
    ]
    dev = client.responses.create(input=items, **{**ask, "instructions": None})
    assert dev.output_text == want and dev.usage.input_tokens == chat.usage.prompt_tokens

    with client.responses.stream(input="Tell me about the fox.", **ask) as stream:
        events = events_of(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == want and final.usage.input_tokens == whole.usage.input_tokens
    assert events[-2].item.id == final.output[0].id == events[2].item.id


def test_stored_responses_continue_by_id(client):
    first = client.responses.create(
        model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0, extra_body=PLAIN
    )
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    follow = dict(model=MODEL, max_output_tokens=6, temperature=0, extra_body=PLAIN)
    by_id = client.responses.create(previous_response_id=first.id, input="And another?", **follow)
    history = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"},
    ]
    stateless = client.responses.create(input=history, store=False, **follow)
    assert by_id.output_text == stateless.output_text
    assert by_id.usage.input_tokens == stateless.usage.input_tokens
    assert by_id.usage.input_tokens_details.cached_tokens > 0
    assert by_id.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):  # store=False: not kept
        client.responses.retrieve(stateless.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(previous_response_id="resp_nope", input="hi", **follow)
    assert missing.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_the_store_is_bounded_oldest_first():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b", "c"):
        store.put(rid, {"id": rid}, [])
    assert store.get("a") is None and store.get("b").response == {"id": "b"} and store.get("c") is not None


def test_the_store_is_bounded_in_bytes_oldest_first():
    """Each response counted as its JSON: past ``max_bytes`` the oldest go; one
    larger than the whole bound is not kept (and pushes nothing out)."""
    store = ResponseStore(capacity=100, max_bytes=1000)
    for rid in ("a", "b", "c"):
        assert store.put(rid, {"id": rid, "pad": "x" * 300}, [{"role": "user", "content": "hi"}])
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    assert 0 < store.bytes <= 1000
    assert not store.put("huge", {"id": "huge", "pad": "x" * 2000}, [])
    assert store.get("huge") is None and store.get("b") is not None
    assert store.delete("b") and store.bytes == store.get("c").size


def test_metadata_within_bounds_is_echoed_and_kept(client):
    meta = {f"k{i}": "v" * 512 for i in range(16)}
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, metadata=meta, extra_body=PLAIN)
    assert r.metadata == meta and client.responses.retrieve(r.id).metadata == meta


def test_function_calls_whole_and_streamed(client, tkit):
    tools = [WEATHER, {"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["x"]}]
    ask = dict(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
        temperature=0,
        extra_body=PLAIN,
    )
    whole = client.responses.create(**ask)  # the hosted tools are skipped, not refused
    assert whole.status == "completed"
    calls = [o for o in whole.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ask["input"]}],
        tools=[CHAT_WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
        extra_body=PLAIN,
    )
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == json.loads(calls[0].arguments)

    with client.responses.stream(**ask) as stream:
        events = events_of(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == json.loads(calls[0].arguments) == json.loads(events[-3].arguments)
    assert final.output[0].type == "function_call" and final.output[0].status == "completed"


def test_namespace_functions_are_declared_and_called_by_namespace(client):
    tools = [{"type": "namespace", "name": "wx", "description": "weather", "tools": [WEATHER]}]
    r = client.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
        temperature=0,
        extra_body=PLAIN,
    )
    call = r.output[-1]
    assert call.type == "function_call" and call.namespace == "wx" and call.name == "get_weather"


def test_text_format_json_schema_validates(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
        "required": ["ok", "level"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    r = client.responses.create(
        model=MODEL, input="Answer as JSON.", text=fmt, max_output_tokens=40, temperature=0, extra_body=PLAIN
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.mark.slow
@requires_default_model
def test_a_tool_loop_on_the_default_model(smollm):
    """A call, then its output sent back as ``function_call_output`` (stateless
    and by ``previous_response_id``): both answer as chat completions does."""
    with serve(create_app(smollm, model_id=MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        common = dict(model=MODEL, tools=[WEATHER], temperature=0, extra_body=PLAIN)
        first = client.responses.create(
            input="What is the weather in Paris?",
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=48,
            **common,
        )
        call = first.output[-1]
        assert call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
        follow = dict(tool_choice="none", max_output_tokens=24, **common)
        by_id = client.responses.create(previous_response_id=first.id, input=[result], **follow)
        items = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            result,
        ]
        stateless = client.responses.create(input=items, **follow)
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "sunny"}'},
            ],
            tools=[CHAT_WEATHER],
            tool_choice="none",
            max_tokens=24,
            temperature=0,
            extra_body=PLAIN,
        )
        want = chat.choices[0].message.content
        assert want.strip() and by_id.output_text == stateless.output_text == want
        assert by_id.usage.input_tokens == stateless.usage.input_tokens == chat.usage.prompt_tokens
        assert by_id.usage.input_tokens_details.cached_tokens > 0


# -- raw HTTP ------------------------------------------------------------------------------------
def post(url, body=None, *, content=None, path="/v1/responses", **kw):
    headers = {"Content-Type": "application/json"} if content is not None else {}
    return httpx.post(url + path, json=body, content=content, headers=headers, timeout=60, **kw)


def ask(**fields):
    return {"model": MODEL, "input": "hello", "max_output_tokens": 2, **fields}


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"model": MODEL}, 400, "input"),
        (ask(input=5), 400, "input"),
        (ask(input=[{"role": "robot", "content": "x"}]), 400, "input.0.role"),
        (ask(input=[{"role": "user", "content": 5}]), 400, "input.0.content"),
        (ask(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), 400, "input.0.content.0"),
        (ask(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), 400, "input.0.call_id"),
        (ask(input=[{"type": "function_call_output", "call_id": "c", "output": 3}]), 400, "input.0.output"),
        (ask(input=[]), 400, "input"),
        (ask(max_output_tokens=0), 400, "max_output_tokens"),
        (ask(temperature="hot"), 400, "temperature"),
        (ask(text={"format": {"type": "json_schema", "name": "x"}}), 400, "text.format.schema"),
        (ask(text={"format": {"type": "xml"}}), 400, "text.format.type"),
        (ask(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}), 400, "tool_choice"),
        (ask(tools=[WEATHER], tool_choice={"type": "function", "name": ["a"]}), 400, "tool_choice"),
        (ask(tools=[{"type": "web_search"}, {**WEATHER, "name": "bad name!"}]), 400, "tools.1.name"),
        (ask(tools=[WEATHER, WEATHER]), 400, None),
        (ask(tool_choice="required"), 400, "tool_choice"),
        (ask(stream="yes"), 400, "stream"),
        (ask(model="other"), 404, "model"),
        # What a response echoes but no prompt bounds (issue 56): OpenAI's bounds, and finite numbers only.
        (ask(metadata={f"k{i}": "v" for i in range(17)}), 400, "metadata"),
        (ask(metadata={"k" * 65: "v"}), 400, "metadata"),
        (ask(metadata={"k": "v" * 513}), 400, "metadata.k"),
        (ask(text={"format": {"type": "json_schema", "name": "n" * 65, "schema": {}}}), 400, "text.format.name"),
        (
            ask(text={"format": {"type": "json_schema", "name": "x", "description": "d" * 4097, "schema": {}}}),
            400,
            "text.format.description",
        ),
        (ask(tools=[{"type": "web_search", "filters": "x" * 20000}]), 400, "tools.0"),
        (ask(tools=[{"type": "web_search"}] * 129), 400, "tools"),
        (b'{"model": "tiny", "input": "hi", "tools": [{"type": "web_search", "x": Infinity}]}', 400, "tools.0.x"),
        (
            b'{"model": "tiny", "input": "hi", "tool_choice": {"type": "file_search", "n": [1, NaN]}}',
            400,
            "tool_choice.n.1",
        ),
        (
            b'{"model": "tiny", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", '
            b'"schema": {"type": "number", "maximum": -Infinity}}}}',
            400,
            "text.format.schema.maximum",
        ),
    ],
)
def test_bad_requests_are_openai_errors(server, body, status, param):
    r = post(server, content=body) if isinstance(body, bytes) else post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err


def test_a_prompt_over_the_context_is_context_length_exceeded(server, tkit):
    long_input = "word " * (tkit.context_length + 10)
    r = post(server, ask(input=long_input))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input"
    assert str(tkit.context_length) in err["message"]


def test_no_max_output_tokens_is_bounded_by_the_context(server, tkit):
    """Without ``max_output_tokens`` the answer may run to the end of the context (a prompt
    just short of it leaves a few tokens), never past it and never refused."""
    words = tkit.context_length - 40
    prompt = me.apply_chat_template(tkit, [{"role": "user", "content": "a " * words}])
    room = tkit.context_length - len(prompt)
    assert 0 < room < 80
    body = {"model": MODEL, "input": "a " * words, "temperature": 0, **PLAIN}
    r = post(server, body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["input_tokens"] == len(prompt) and usage["output_tokens"] <= room


def test_streams_send_keep_alives_while_waiting_and_a_disconnect_frees_the_row(slow_kit, tkit, monkeypatch):
    # Greedy, this prompt runs on for 40 tokens at least (the same weights as slow_kit's).
    prompt = me.apply_chat_template(tkit, [{"role": "user", "content": "hello there"}])
    assert len(list(me.create_generator(tkit, prompt, max_tokens=40, temp=0.0))) >= 40
    monkeypatch.setattr(core, "HEARTBEAT_S", 0.01)  # each forward pass (50 ms) outlasts it
    body = {
        "model": MODEL,
        "input": "hello there",
        "max_output_tokens": 2000,
        "temperature": 0,
        "stream": True,
        **PLAIN,
    }
    with serve(create_app(slow_kit, model_id=MODEL)) as url, httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/responses", json=body) as r:
            lines = r.iter_lines()
            seen = []
            while not any(line.startswith("event: response.output_text.delta") for line in seen):
                seen.append(next(lines))
            assert seen.count("event: response.in_progress") >= 2  # the keep-alives are events
            assert slow_kit.open_generations == 1
        wait_until(lambda: slow_kit.open_generations == 0)
        health = http.get(f"{url}/health").json()
        assert health["running"] == 0 and health["cancelled"] == 1


def test_client_data_in_log_lines_is_clipped(server, caplog):
    """An unknown item or tool type is skipped with a log line that names it,
    cut short: a body cannot make a log line as long as itself."""
    kind = "k" * 10_000  # under the hosted-tool bound
    body = ask(input=[{"type": kind}, {"role": "user", "content": "hi"}], tools=[{"type": kind}], max_output_tokens=1)
    with caplog.at_level("INFO", logger="mlx_engine.server.apis.openai_responses"):
        assert post(server, body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "not served here" in r.getMessage()]
    assert len(lines) == 2 and all(len(line) < 200 for line in lines)
