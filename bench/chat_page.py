"""The chat page's first token: ``python -m bench.chat_page [--trials 12] [--max-tokens 8]``.

Time from pressing Enter on the page (``/``) to the answer's first text on
screen, against the engine's own time to first token for the same request
(``usage.mlx_engine.time_to_first_token``), and against a plain HTTP client's
(httpx: request sent to first content chunk) on the same server. The page is
driven by Playwright in Debian's headless Chromium (bench/browser.py); the
times on the page are the page's own clock (``performance.now()``): a capturing
``keydown`` listener on the composer and a ``MutationObserver`` on the answer.

Each trial asks a new question in a new conversation (its own first line,
so no prompt is a prefix of another's) and the page and the client alternate,
both with plain decoding and the same sampling, the client on one kept-alive connection
as the browser's.
Writes ``<out>/chat_page.md`` and ``<out>/chat_page.json``; the goal (issue 54)
is the page within 0.2 s of the engine's own time to first token.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402

from bench.browser import launch, server  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
]

# Runs in the page: stamps Enter on the composer and the first text of the next answer.
_PROBE = """() => {
  window.__t0 = null; window.__t1 = null;
  const answers = () => document.querySelectorAll('.msg.assistant').length;
  const before = answers();
  document.getElementById('input').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey) window.__t0 = performance.now();
  }, {capture: true, once: true});
  const obs = new MutationObserver(() => {
    const all = document.querySelectorAll('.msg.assistant .body');
    if (answers() > before && all[all.length - 1].textContent && window.__t1 === null) {
      window.__t1 = performance.now();
      obs.disconnect();
    }
  });
  obs.observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


def page_trial(page, question: str) -> dict:
    """One question on the page: the page's first token and the engine's."""
    page.click("#new-chat")
    page.evaluate(_PROBE)
    page.fill("#input", question)
    page.press("#input", "Enter")
    page.locator(".msg.assistant .stats").filter(has_text="prompt tokens cached").wait_for(timeout=120_000)
    t0, t1 = page.evaluate("() => [window.__t0, window.__t1]")
    conv = page.evaluate("() => JSON.parse(localStorage.getItem('mlx-engine.chat.v1'))")
    current = next(c for c in conv["conversations"] if c["id"] == conv["current"])
    stats = current["messages"][-1]["stats"]
    return {"seen_s": (t1 - t0) / 1000, "engine_s": stats["mlx_engine"]["time_to_first_token"]}


def client_trial(client: httpx.Client, url: str, question: str, max_tokens: int) -> dict:
    """The same request from httpx: sent to first content chunk, and the engine's."""
    body = {
        "model": me.DEFAULT_MODEL,
        "messages": [{"role": "user", "content": question}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "top_p": 1,
        "mlx_engine": {"decoding": "plain"},
    }
    first, engine = None, None
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                engine = chunk["usage"]["mlx_engine"]["time_to_first_token"]
    return {"seen_s": first, "engine_s": engine}


def summary(rows: list[dict]) -> dict:
    gaps = [r["seen_s"] - r["engine_s"] for r in rows]
    return {
        "trials": len(rows),
        "seen_median_s": statistics.median(r["seen_s"] for r in rows),
        "engine_median_s": statistics.median(r["engine_s"] for r in rows),
        "gap_median_s": statistics.median(gaps),
        "gap_max_s": max(gaps),
    }


def run(trials: int, max_tokens: int) -> dict:
    from playwright.sync_api import sync_playwright

    rows = {"page": [], "client": []}
    with server("--model", me.DEFAULT_MODEL) as url, sync_playwright() as pw, httpx.Client() as client:
        browser = launch(pw)
        page = browser.new_page()
        page.goto(url)
        page.wait_for_selector("body[data-ready=true]")
        page.click("#toggle-settings")
        page.fill("#max_tokens", str(max_tokens))
        page.press("#max_tokens", "Tab")
        page.select_option("#decoding", "plain")  # both paths decode alike (new chats keep the settings)
        for i in range(trials + 1):  # the first of each is a warm-up
            question = f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"
            p = page_trial(page, question)
            c = client_trial(client, url, f"Client question {i}: {QUESTIONS[i % len(QUESTIONS)]}", max_tokens)
            if i:
                rows["page"].append(p)
                rows["client"].append(c)
        browser.close()
    return {"rows": rows, "page": summary(rows["page"]), "client": summary(rows["client"])}


def report(result: dict) -> str:
    lines = [
        "| path | trials | first token seen (median) | engine's time to first token (median) | gap (median) | gap (max) |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in (("page", "chat page: Enter to text on screen"), ("client", "httpx: request to first chunk")):
        s = result[name]
        lines.append(
            f"| {label} | {s['trials']} | {s['seen_median_s']:.3f} s | {s['engine_median_s']:.3f} s "
            f"| {s['gap_median_s']:.3f} s | {s['gap_max_s']:.3f} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    result = run(args.trials, args.max_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chat_page.json").write_text(json.dumps(result, indent=2))
    (out / "chat_page.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
