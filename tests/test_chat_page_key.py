"""The chat page of a server started with ``--api-key``: the page itself opens
without the key, asks for it, refuses a wrong one, and sends the right one with
every request (its own server, hence its own module)."""

from __future__ import annotations

import mlx_engine as me

import httpx
import pytest
from helpers import requires_default_model
from page_helpers import ask, fill_setting, start_browser

from bench.browser import server

pytestmark = [requires_default_model, pytest.mark.slow]

KEY = "page-test-key"
TIMEOUT_MS = 180_000


@pytest.fixture(scope="module")
def browser():
    pw, b = start_browser()
    yield b
    b.close()
    pw.stop()


@pytest.fixture(scope="module")
def url(browser):
    with server("--model", me.DEFAULT_MODEL, "--api-key", KEY) as u:
        yield u


def test_the_page_asks_for_the_key_and_sends_it(browser, url):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    assert httpx.get(url + "/").status_code == 200  # the page needs no key; the API does
    assert httpx.get(url + "/v1/models").status_code == 401
    context = browser.new_context()
    page = context.new_page()
    sent = []
    page.on("request", lambda r: sent.append(r.headers.get("authorization")) if "/v1/chat" in r.url else None)
    page.goto(url)
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible()
    page.fill("#key-input", "wrong")
    page.click("#key-submit")
    expect(page.locator("#key-error")).to_have_text("The server refused that key.")
    page.fill("#key-input", KEY)
    page.click("#key-submit")
    expect(dialog).to_be_hidden()
    page.wait_for_selector("body[data-ready=true]")
    expect(page.locator("#model option")).to_have_text(
        ["all-minilm-l6-v2 (not loaded)", "smollm2-135m-eagle3 (not loaded)", f"{me.DEFAULT_MODEL} (loaded)"]
    )

    fill_setting(page, "max_tokens", 4)
    ask(page, "Hi")
    expect(page.locator(".msg.assistant .stats")).to_contain_text("prompt tokens cached")
    assert sent == [f"Bearer {KEY}"]
    # The key stays with this tab (sessionStorage), never with the saved conversations.
    assert page.evaluate("() => sessionStorage.getItem('mlx-engine.api-key')") == KEY
    assert KEY not in page.evaluate("() => localStorage.getItem('mlx-engine.chat.v1')")
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    expect(dialog).to_be_hidden()
    context.close()
