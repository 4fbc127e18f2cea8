"""The context-overflow policy (mlx_engine/server/core/overflow.py, docs/server.md):
a prompt over the context is each API's own error by default and, under
``truncate-middle``, cut in the middle (system prompt and latest turn kept) and
answered, in chat completions, the Responses API and the Messages API alike."""

import mlx_engine as me
from mlx_engine.server import create_app
from mlx_engine.server.__main__ import main as server_main
from mlx_engine.server.core import overflow, params
from mlx_engine.server.core.schemas import ChatCompletionRequest
from mlx_engine.server.core.turns import render_now

import logging

import httpx
import pytest
from helpers import serve

MODEL = "tiny"
SYSTEM = "SYSTEM-MARK you are terse"
LAST = "LAST-MARK what now"
PLAIN = {"decoding": "plain"}


@pytest.fixture(scope="module")
def tkit(llama_path):
    kit = me.load_model(llama_path, max_parallel=2)
    yield kit
    me.unload(kit)


@pytest.fixture(scope="module")
def servers(tkit):
    with serve(create_app(tkit, model_id=MODEL)) as plain:
        with serve(create_app(tkit, model_id=MODEL, context_overflow="truncate-middle")) as cut:
            yield {"error": plain, "truncate-middle": cut}


def history(context: int) -> list[dict]:
    """A system prompt, old turns (a tool call and its result among them) that
    together run past ``context`` (each message about a quarter of it), then a
    last user turn with a tool result."""
    old = "old words " * (context // 22)
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "first " + old},
        {"role": "assistant", "content": "ok " + old},
        {"role": "user", "content": "second " + old},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "files " + old},
        {"role": "assistant", "content": "seen " + old},
        {"role": "user", "content": LAST},
        {"role": "assistant", "content": None, "tool_calls": [{**call, "id": "c2"}]},
        {"role": "tool", "tool_call_id": "c2", "content": "RESULT-MARK a.py b.py"},
    ]


def chat_body(messages: list[dict], max_tokens: int | None = 4) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages, "max_tokens": max_tokens})


def fitted(kit, body: ChatCompletionRequest) -> overflow.Fitted:
    prompt = render_now(kit, body)
    assert len(prompt.tokens) >= kit.context_length
    result = overflow.fit(kit, body, prompt, lambda b: render_now(kit, b))
    assert result is not None
    return result


def test_oldest_turns_go_first_and_the_system_prompt_and_last_turn_stay_whole(tkit, caplog):
    body = chat_body(history(tkit.context_length))
    with caplog.at_level(logging.INFO, logger="mlx_engine.server.core.overflow"):
        result = fitted(tkit, body)
    kept = [m.model_dump(exclude_none=True) for m in result.body.messages]
    assert kept[0] == {"role": "system", "content": SYSTEM}
    assert kept[-3:] == [m.model_dump(exclude_none=True) for m in body.messages[-3:]]
    # The first turn went whole; the second (a tool call and its result) fits and stays.
    assert kept[1:-3] == [m.model_dump(exclude_none=True) for m in body.messages[3:7]]
    assert not any("characters cut" in str(m.get("content")) for m in kept)
    assert len(result.prompt.tokens) <= overflow.target(tkit.context_length, 4)
    assert result.dropped == len(render_now(tkit, body).tokens) - len(result.prompt.tokens) > 0
    lines = [r.getMessage() for r in caplog.records if "context overflow" in r.getMessage()]
    assert len(lines) == 1 and f"{result.dropped} tokens dropped" in lines[0]


def test_a_last_turn_too_long_alone_loses_the_middle_of_its_text(tkit):
    words = [f"w{i}" for i in range(tkit.context_length * 2)]
    body = chat_body([{"role": "system", "content": SYSTEM}, {"role": "user", "content": " ".join(words)}])
    result = fitted(tkit, body)
    system, user = result.body.messages
    assert system.content == SYSTEM
    assert user.content.startswith("w0 w1 w2 ") and user.content.endswith(" ".join(words[-3:]))
    assert "characters cut to fit the context" in user.content
    assert len(result.prompt.tokens) <= overflow.target(tkit.context_length, 4)


def test_room_is_left_for_the_answer():
    assert overflow.target(1000, None) == 750
    assert overflow.target(1000, 10) == 990
    assert overflow.target(1000, 5000) == 750


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, headers={"anthropic-version": "2023-06-01"})


def requests(context: int) -> dict[str, tuple[str, dict]]:
    """The same over-long conversation in the three wire formats."""
    msgs = history(context)
    chat = {"model": MODEL, "messages": msgs, "max_tokens": 4, "mlx_engine": PLAIN}
    old = msgs[1]["content"] * 3
    inp = [
        {"role": "user", "content": old},
        {"role": "assistant", "content": old},
        {"role": "user", "content": LAST},
    ]
    responses = {"model": MODEL, "instructions": SYSTEM, "input": inp, "max_output_tokens": 4, "mlx_engine": PLAIN}
    messages = {"model": MODEL, "system": SYSTEM, "messages": inp, "max_tokens": 4}
    return {
        "chat": ("/v1/chat/completions", chat),
        "responses": ("/v1/responses", responses),
        "messages": ("/v1/messages", messages),
    }


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_over_the_context_is_the_apis_error_by_default(servers, tkit, api):
    path, body = requests(tkit.context_length)[api]
    r = post(servers["error"], path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if api == "responses":
        assert err["code"] == "context_length_exceeded"
    elif api == "messages":
        assert err["type"] == "invalid_request_error" and err["message"].startswith("prompt is too long")
    else:
        assert err["param"] == "messages" and "no room" in err["message"]


def chat_of(api: str, body: dict) -> ChatCompletionRequest:
    """The internal request each wire format becomes (system first, as each API puts it)."""
    if api == "chat":
        return chat_body(body["messages"])
    system = body.get("instructions") or body.get("system")
    msgs = body.get("input") or body.get("messages")
    return chat_body([{"role": "system", "content": system}, *msgs])


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_truncate_middle_answers_with_the_cut_prompt(servers, tkit, api):
    path, body = requests(tkit.context_length)[api]
    r = post(servers["truncate-middle"], path, body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    expected = fitted(tkit, chat_of(api, body))
    assert usage["mlx_engine"]["truncated_tokens"] == expected.dropped > 0
    if api == "messages":
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(expected.prompt.tokens)
    else:
        key = "prompt_tokens" if api == "chat" else "input_tokens"
        assert usage[key] == len(expected.prompt.tokens)


def test_a_prompt_that_fits_is_not_touched(servers):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "mlx_engine": PLAIN}
    usage = post(servers["truncate-middle"], "/v1/chat/completions", body).json()["usage"]
    assert "truncated_tokens" not in usage["mlx_engine"]


def test_bad_policies_are_start_up_errors(tkit, capsys):
    with pytest.raises(ValueError, match="context_overflow must be one of error, truncate-middle, got 'drop'"):
        create_app(tkit, context_overflow="drop")
    with pytest.raises(SystemExit) as exit_:
        server_main(["--model", "nope", "--context-overflow", "drop"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--context-overflow" in err and "'drop'" in err


# -- text that cannot fit (issue 56) ------------------------------------------------------------
@pytest.fixture
def rendered(monkeypatch) -> list[int]:
    """The characters of every prompt the chat template or the tokenizer is given."""
    seen: list[int] = []
    template, tokenize = me.apply_chat_template, me.tokenize

    def spy_template(kit, messages, **kw):
        seen.append(sum(len(str(m.get("content") or "")) for m in messages))
        return template(kit, messages, **kw)

    def spy_tokenize(kit, text, **kw):
        seen.append(len(text))
        return tokenize(kit, text, **kw)

    monkeypatch.setattr(me, "apply_chat_template", spy_template)
    monkeypatch.setattr(me, "tokenize", spy_tokenize)
    return seen


def test_text_that_cannot_fit_is_refused_before_it_is_tokenized(servers, tkit, rendered):
    """More characters than the context holds tokens times the longest token:
    each API's context error at once, on every route and count_tokens too, the
    text never rendered or tokenized whole."""
    bound = tkit.context_length * params.longest_token_chars(tkit)
    huge = "many words " * (bound // 11 + 10)
    url, user = servers["error"], [{"role": "user", "content": huge}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": user}, timeout=60)
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    assert chat.json()["error"]["param"] == "messages"
    text = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": huge}, timeout=60)
    assert text.status_code == 400 and text.json()["error"]["param"] == "prompt"
    resp = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": huge}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 4, "messages": user}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt is too long"), path
    # A tool's parameters are rendered too: a huge schema is the same refusal.
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": huge}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert not any(n >= len(huge) for n in rendered) and len(rendered) == 0


def test_truncate_middle_cuts_text_that_cannot_fit_before_rendering_it(servers, tkit, rendered):
    bound = tkit.context_length * params.longest_token_chars(tkit)
    huge = "old words " * (bound // 10 + 10)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": huge},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": LAST},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "mlx_engine": PLAIN}
    r = httpx.post(f"{servers['truncate-middle']}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["mlx_engine"]["truncated_tokens"] >= tkit.context_length
    assert rendered and max(rendered) <= bound
