"""The chat page at ``/`` in a real browser: Playwright driving Debian's headless
Chromium against ``python -m mlx_engine.server`` on the default model (with its
draft) and a tiny vision model in ``--models-dir``. One server and one browser
for the module; each test gets a fresh browser context (empty storage).

Answers are kept short (``max_tokens`` set through the settings panel) so the
module stays within a couple of minutes on the CPU."""

from __future__ import annotations

import mlx_engine as me
from mlx_engine.server import create_app
from mlx_engine.server.__main__ import parse_args
from mlx_engine.server.web.ui import CONTENT_SECURITY_POLICY

import base64
import json
import re

import httpx
import pytest
from helpers import requires_default_model, wait_until
from page_helpers import ask, fill_setting, start_browser

from bench.browser import server
from fixtures.tiny_vlm import image_b64, make_qwen2_vl

pytestmark = [requires_default_model, pytest.mark.slow]

TIMEOUT_MS = 180_000  # a bound for a broken page, not a speed claim: CI's CPU may be busy
VLM = "tiny-vlm"
ATTACK = '<img src=x onerror="window.__pwned=1"> and <script>window.__pwned=2</script> and ![t](http://127.0.0.1:9/t.png) and [go](javascript:window.__pwned=3)'


@pytest.fixture(scope="module")
def browser():
    pw, b = start_browser()
    yield b
    b.close()
    pw.stop()


@pytest.fixture(scope="module")
def url(browser, tmp_path_factory):
    folder = tmp_path_factory.mktemp("page-models")
    make_qwen2_vl(folder / VLM)
    with server("--model", me.DEFAULT_MODEL, "--draft", "smollm2-135m-draft", "--models-dir", str(folder)) as u:
        yield u


@pytest.fixture
def page(browser, url):
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    p = context.new_page()
    p.set_default_timeout(TIMEOUT_MS)
    errors, requests = [], []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.on("request", lambda r: requests.append(r.url))
    p.goto(url)
    p.wait_for_selector("body[data-ready=true]")
    yield p
    context.close()
    assert not errors, errors
    # Nothing but this server is ever asked for anything (no CDN, no image, no font).
    assert all(r.startswith(url) or r.startswith(("data:", "blob:")) for r in requests), requests


def expect(locator):
    from playwright.sync_api import expect as pw_expect

    pw_expect.set_options(timeout=TIMEOUT_MS)
    return pw_expect(locator)


def answered(page, count: int = 1):
    """Wait for the ``count``-th answer to end with the engine's statistics."""
    stats = page.locator(".msg.assistant .stats")
    expect(stats).to_have_count(count, timeout=TIMEOUT_MS)
    expect(stats.nth(count - 1)).to_contain_text("prompt tokens cached", timeout=TIMEOUT_MS)
    expect(page.locator("#send")).to_be_visible()
    return stats.nth(count - 1).inner_text()


def stored(page) -> dict:
    return page.evaluate("() => JSON.parse(localStorage.getItem('mlx-engine.chat.v1'))")


# -- served as it should be (no browser needed) -------------------------------------------------


def test_page_files_are_served_with_a_strict_policy(url):
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'self'" in CONTENT_SECURITY_POLICY and "'unsafe-inline'" not in CONTENT_SECURITY_POLICY
    assert r.headers["x-content-type-options"] == "nosniff"
    for name, kind in [("app.js", "text/javascript"), ("markdown.js", "text/javascript"), ("style.css", "text/css")]:
        asset = httpx.get(f"{url}/ui/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind), name
    linked = re.findall(r'(?:src|href)="([^"]*)"', r.text)
    assert linked and all(link.startswith(("/ui/", "data:")) for link in linked), linked  # nothing from elsewhere
    for bad in ("/ui/nope.js", "/ui/..%2fui.py", "/ui/%2e%2e%2f__init__.py"):
        assert httpx.get(url + bad).status_code == 404, bad


def test_no_ui_leaves_no_page(llama_path):
    assert parse_args(["--no-ui"]).no_ui and not parse_args([]).no_ui
    kit = me.load_model(llama_path)
    try:
        from helpers import serve

        with serve(create_app(kit, ui=False)) as off, serve(create_app(kit)) as on:
            assert httpx.get(off + "/").status_code == 404
            assert httpx.get(off + "/ui/app.js").status_code == 404
            assert httpx.get(on + "/").status_code == 200
    finally:
        me.unload(kit)


# -- asking, stopping, regenerating, editing ------------------------------------------------------


def test_answer_streams_in_with_the_engines_statistics(page):
    fill_setting(page, "max_tokens", 12)
    # Greedy: a sampled answer can be a single word that arrives in one update ("none" once in CI).
    fill_setting(page, "temperature", 0)
    # Record what the answer shows each time the page changes while the stop button is up.
    page.evaluate(
        """() => { window.__seen = [];
        new MutationObserver(() => {
          const body = document.querySelector('.msg.assistant .body');
          if (body && !document.getElementById('stop').hidden) window.__seen.push(body.textContent);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }"""
    )
    ask(page, "Name three colours.")
    line = answered(page)
    seen = [t for t in page.evaluate("() => window.__seen") if t]
    assert len(set(seen)) >= 2, seen  # the answer grew on the page while it streamed
    assert re.search(r"\d+\.\d tok/s", line), line
    assert re.search(r"first token \d+\.\d\d s \(page \d+\.\d\d s\)", line), line
    assert re.search(r"\d+/\d+ prompt tokens cached", line), line
    assert re.search(r"auto:(plain|prompt_lookup|draft_model)", line), line
    assert re.search(r"\b\d+ tokens\b", line), line
    message = stored(page)["conversations"][0]["messages"][1]
    assert message["role"] == "assistant" and message["content"]
    assert message["stats"]["mlx_engine"]["generated_tokens"] == message["stats"]["completion_tokens"] <= 12
    assert page.locator("#title").input_value() == "Name three colours."  # the first message names the chat


def test_the_decoding_picker_reaches_the_engine_and_drafting_shows(page):
    fill_setting(page, "max_tokens", 24)
    assert "smollm2-135m-draft" in page.locator("#decoding option[value=draft]").inner_text()
    page.select_option("#decoding", "draft")
    ask(page, "Count from one to ten.")
    line = answered(page)
    assert "draft_model" in line and "auto" not in line, line
    assert re.search(r"\d+/\d+ drafted accepted \(\d+%\)", line), line
    page.select_option("#decoding", "plain")
    page.locator(".msg.assistant .actions button", has_text="Regenerate").click()
    line = answered(page)
    assert " plain " in f" {line} " and "drafted" not in line, line
    assert stored(page)["conversations"][0]["settings"]["decoding"] == "plain"


def test_stop_mid_answer_keeps_the_text_and_cancels_the_generation(page, url):
    cancelled = httpx.get(url + "/health").json()["cancelled"]
    fill_setting(page, "max_tokens", 400)
    page.select_option("#decoding", "plain")
    ask(page, "Tell me a long story about a dragon.")
    expect(page.locator(".msg.assistant .stats")).to_contain_text("streaming", timeout=TIMEOUT_MS)
    page.click("#stop")
    expect(page.locator(".msg.assistant .stats")).to_have_text("stopped")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    wait_until(lambda: httpx.get(url + "/health").json()["cancelled"] > cancelled, timeout=60)
    message = stored(page)["conversations"][0]["messages"][1]
    assert message["stopped"] and message["content"]


def test_regenerate_and_edit_reuse_the_prompt_cache(page):
    fill_setting(page, "max_tokens", 6)
    page.select_option("#decoding", "plain")
    ask(page, "What is the capital of France?")
    answered(page)
    page.locator(".msg.assistant .actions button", has_text="Regenerate").click()
    line = answered(page)
    expect(page.locator(".msg")).to_have_count(2)  # the answer was replaced, not added
    cached, prompt = map(int, re.search(r"(\d+)/(\d+) prompt tokens cached", line).groups())
    assert 0 < cached <= prompt, line  # the same prompt again: read from the cache

    page.locator(".msg.user .actions button", has_text="Edit").click()
    page.fill("textarea.edit", "What is the capital of Italy?")
    page.click("text=Save and send")
    line = answered(page)
    expect(page.locator(".msg")).to_have_count(2)
    expect(page.locator(".msg.user .user-text")).to_have_text("What is the capital of Italy?")
    cached = int(re.search(r"(\d+)/\d+ prompt tokens cached", line).group(1))
    assert cached > 0, line  # the template's head and the words before the edit are reused
    assert stored(page)["conversations"][0]["messages"][0]["content"] == "What is the capital of Italy?"


# -- conversations ------------------------------------------------------------------------------


def test_conversations_survive_a_reload_and_export_and_import(page, tmp_path):
    fill_setting(page, "max_tokens", 4)
    ask(page, "Hello there")
    answered(page)
    page.fill("#title", "First chat")
    page.press("#title", "Tab")
    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    ask(page, "Second question")
    answered(page)
    page.fill("#title", "Second chat")
    page.press("#title", "Tab")

    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    titles = page.locator("#conversations .conversation")
    expect(titles).to_have_text(["Second chat", "First chat"])
    page.locator("#conversations .conversation", has_text="First chat").click()
    expect(page.locator(".msg.user .user-text")).to_have_text("Hello there")
    assert page.locator("#max_tokens").input_value() == "4"  # settings are the conversation's

    with page.expect_download() as download:
        page.click("#export")
    exported = json.loads(open(download.value.path()).read())
    assert exported["format"] == "mlx-engine-chat"
    assert [c["title"] for c in exported["conversations"]] == ["Second chat", "First chat"]

    page.once("dialog", lambda d: d.accept())
    page.click("#delete-chat")
    expect(titles).to_have_text(["Second chat"])

    path = tmp_path / "chats.json"
    path.write_text(json.dumps(exported))
    page.set_input_files("#import-file", str(path))
    expect(titles).to_have_count(3)
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    expect(titles).to_have_count(3)

    path.write_text('{"conversations": [{"title": "no messages"}]}')
    page.set_input_files("#import-file", str(path))
    expect(page.locator("#notice")).to_contain_text("conversations[0] is not a conversation")


# -- models -------------------------------------------------------------------------------------


def test_model_picker_shows_states_and_loads_and_unloads(page, url):
    options = page.locator("#model option")
    expect(options).to_have_text(
        [
            "all-minilm-l6-v2 (not loaded)",
            "smollm2-135m-eagle3 (not loaded)",
            "smollm2-135m-instruct (loaded)",
            f"{VLM} (not loaded)",
        ]
    )  # by name
    page.select_option("#model", VLM)
    expect(page.locator("#model-action")).to_have_text("Load")
    page.click("#model-action")
    expect(page.locator("#model option[value='tiny-vlm']")).to_have_text(f"{VLM} (loaded)")
    expect(page.locator("#model-state")).to_contain_text("MiB")
    assert httpx.get(f"{url}/v1/models/{VLM}").json()["state"] == "loaded"
    expect(page.locator("#model-action")).to_have_text("Unload")
    page.click("#model-action")
    expect(page.locator("#model option[value='tiny-vlm']")).to_have_text(f"{VLM} (not loaded)")
    assert httpx.get(f"{url}/v1/models/{VLM}").json()["state"] == "not_loaded"
    assert stored(page)["conversations"][0]["model"] == VLM  # the conversation keeps its model


def test_an_image_goes_to_a_vision_model(page, tmp_path):
    png = tmp_path / "red.png"
    png.write_bytes(base64.b64decode(image_b64()))
    page.select_option("#model", VLM)
    fill_setting(page, "max_tokens", 3)
    page.set_input_files("#attach", str(png))
    expect(page.locator("#attachments img")).to_have_count(1)
    with page.expect_request("**/v1/chat/completions") as sent:
        ask(page, "What colour is this?")
    body = json.loads(sent.value.post_data)
    assert body["model"] == VLM
    assert [m["role"] for m in body["messages"]] == ["user"]  # the answer to come is not sent
    parts = body["messages"][0]["content"]
    assert parts[0] == {"type": "text", "text": "What colour is this?"}
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    answered(page)
    expect(page.locator(".msg.user img.thumb")).to_have_count(1)
    expect(page.locator("#attachments img")).to_have_count(0)

    # A text-only model refuses images: the page says why.
    page.click("#new-chat")
    page.select_option("#model", me.DEFAULT_MODEL)
    page.set_input_files("#attach", str(png))
    ask(page, "And this?")
    expect(page.locator(".msg.assistant .error")).to_contain_text("takes text only")


# -- model output is text -------------------------------------------------------------------------


def _assert_inert(page):
    body = page.locator(".msg.assistant .body").last
    expect(body).to_contain_text('<img src=x onerror="window.__pwned=1">')
    expect(body).to_contain_text("<script>window.__pwned=2</script>")
    expect(body).to_contain_text("![t](http://127.0.0.1:9/t.png)")
    assert page.locator("#messages img, #messages script, #messages iframe").count() == 0
    assert page.locator("#messages a").count() == 0  # a javascript: link stays text
    assert page.evaluate("() => window.__pwned") is None


def test_html_in_a_streamed_answer_shows_as_text_and_runs_nothing(page):
    """The page's own stream parser and renderer, fed an answer full of markup
    (the server's route is answered by the test, in the server's SSE format)."""
    chunks = [ATTACK[:30], ATTACK[30:70], ATTACK[70:]]
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]} for c in chunks]
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
    events.append({"choices": [], "usage": {**usage, "mlx_engine": {"decoding_mode": "plain"}}})
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(body=sse, content_type="text/event-stream"))
    ask(page, "Repeat after me: " + ATTACK)
    answered(page)
    _assert_inert(page)
    expect(page.locator(".msg.user .user-text")).to_have_text("Repeat after me: " + ATTACK)
    page.reload()  # and again from storage
    page.wait_for_selector("body[data-ready=true]")
    _assert_inert(page)


def test_markup_stored_in_a_conversation_renders_inert(page):
    """A conversation put in storage (or imported) holding markup, code and links."""
    answer = (
        ATTACK
        + "\n\n```html\n<script>window.__pwned=4</script>\n```\n\n**bold** and [site](https://example.org)"
        + "\n\n## Steps\n- one `x`\n- two\n\n3. three\n4. four\n\n> quoted\n\n```\nstill streaming"
    )
    conversation = {
        "id": "x1",
        "title": "stored",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}],
    }
    page.evaluate(
        "(c) => localStorage.setItem('mlx-engine.chat.v1', JSON.stringify({conversations: [c], current: c.id}))",
        conversation,
    )
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    expect(page.locator(".msg.assistant strong")).to_have_text("bold")
    expect(page.locator(".code-block code").first).to_have_text("<script>window.__pwned=4</script>")
    link = page.locator(".msg.assistant a")
    expect(link).to_have_attribute("href", "https://example.org")
    expect(link).to_have_attribute("rel", "noopener noreferrer nofollow")
    expect(page.locator(".msg.assistant h4")).to_have_text("Steps")
    expect(page.locator(".msg.assistant ul li")).to_have_text(["one x", "two"])
    expect(page.locator(".msg.assistant ol li")).to_have_text(["three", "four"])
    expect(page.locator(".msg.assistant ol")).to_have_attribute("start", "3")
    expect(page.locator(".msg.assistant blockquote")).to_have_text("quoted")
    expect(page.locator(".code-block code").last).to_have_text("still streaming")  # an open fence: code to the end
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("#messages img, #messages script").count() == 0
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.locator(".code-block button", has_text="Copy").first.click()
    assert page.evaluate("() => navigator.clipboard.readText()") == "<script>window.__pwned=4</script>"


# -- keys, phone width, colour scheme, labels -------------------------------------------------------


def test_keys_phone_width_scheme_and_labels(page):
    page.fill("#input", "line one")
    page.press("#input", "Shift+Enter")
    page.locator("#input").press_sequentially("line two")
    assert page.locator("#input").input_value() == "line one\nline two"
    expect(page.locator(".msg")).to_have_count(0)  # Shift+Enter did not send

    unlabelled = page.evaluate(
        """() => [...document.querySelectorAll('button, input, select, textarea')].filter(e => {
            const name = e.getAttribute('aria-label') || (e.labels && e.labels.length && e.labels[0].textContent.trim())
                || e.textContent.trim();
            return !name; }).map(e => e.outerHTML)"""
    )
    assert unlabelled == []

    light = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    page.emulate_media(color_scheme="dark")
    dark = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    assert light != dark

    page.set_viewport_size({"width": 390, "height": 800})
    sidebar = page.locator("#sidebar")
    expect(sidebar).not_to_be_in_viewport()  # slid away
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390  # nothing wider than the phone
    page.click("#toggle-sidebar")
    expect(page.locator("#toggle-sidebar")).to_have_attribute("aria-expanded", "true")
    expect(sidebar).to_be_in_viewport(ratio=1)
    page.click("#new-chat")  # picking a chat closes the list again
    expect(page.locator("#toggle-sidebar")).to_have_attribute("aria-expanded", "false")
