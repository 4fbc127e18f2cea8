"""Replayed agent sessions against the server: ``python -m bench.agent_sessions [--turns 10]``.

Two sessions shaped like the coding-agent harnesses' requests, each turn
re-sending the whole history (docs/server.md, "Coding agents"; the bodies are built in bench/agent_requests.py):

- ``claude-code`` (``POST /v1/messages``, streamed): a system prompt whose
  first line is Claude Code's ``x-anthropic-billing-header: ...; cch=<changes>;``,
  tools with ``input_schema``, each turn a ``tool_result`` holding a file
  re-emitted with an edit, a new instruction, and a system message after it
  that changes every turn (Claude Code's reminders);
- ``codex`` (``POST /v1/responses``, streamed, ``store: false``): a long
  ``developer`` base prompt, function, ``namespace`` and ``web_search`` tools,
  the earlier output items and ``function_call_output`` items re-sent.

Each session runs on a fresh server and a fresh kit (empty prompt cache and
suffix memory): as served (the billing line dropped) once per engine decoding
mode (``--decoding plain,auto``; auto drafts from the suffix memory and the
prompt), and with its first system line changing every turn (``cold``: for
Claude Code the operator's ``--keep-billing-header``, for Codex a nonce line),
so nothing is reused and each turn is a cold prefill. ``--mlx-lm`` replays the
plain session's turns on ``mlx_lm.server`` (same weights, bench.server's export;
the engine's rendered prompt sent as text to its completions route, since
SmolLM2's chat template renders no tools). ``--base-lines`` sizes the stable
prefix: real harness requests are mostly stable instructions and tool
definitions (captured: Codex CLI 0.171 with short instructions 5.2k tokens,
Claude Code 2.1 with four tools 3.3k) with small per-turn additions. Per turn:
prompt tokens, the prefix it shares with the previous turn's prompt (what a
cache could reuse), the prompt tokens the server reports as reused
(``cache_read_input_tokens`` / ``cached_tokens``), time to the first streamed
token, its ratio to the cold session's same turn, and decode tokens/s. Writes
``<out>/agent_sessions.md`` and ``.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.server import create_app  # noqa: E402
from mlx_engine.server.apis.anthropic_messages import MessagesRequest, internal  # noqa: E402
from mlx_engine.server.apis.openai_responses import chat_tools, input_messages  # noqa: E402
from mlx_engine.server.core import params  # noqa: E402
from mlx_engine.server.core.turns import internal_request  # noqa: E402

import json  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from .agent_requests import (  # noqa: E402
    BASE_LINES,
    MODEL,
    base_prompt,
    claude_history,
    claude_turn,
    codex_history,
    codex_turn,
)
from .machine import machine_info  # noqa: E402
from .stats import bench_args, write_report  # noqa: E402


# -- running them ---------------------------------------------------------------------------------------
def prompt_tokens(kit: me.ModelKit, api: str, body: dict, keep_header: bool) -> list[int]:
    """The prompt the server renders for ``body`` (its own translation and rendering, in process)."""
    if api == "messages":
        fields, _ = internal(MessagesRequest.model_validate(body), keep_header)
    else:
        fields = {"model": MODEL, "messages": input_messages(body["input"]), "tools": chat_tools(body["tools"])[0]}
    return params.chat_prompt(kit, internal_request(fields)).tokens


def stream(http: httpx.Client, url: str, path: str, body: dict) -> tuple[float, float, list[dict]]:
    """POST a streamed request; the seconds to its first text or call piece and
    to its end, and its events."""
    start, first, events = time.perf_counter(), None, []
    with http.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            if first is None and _is_first_piece(event):
                first = time.perf_counter() - start
    total = time.perf_counter() - start
    return (first if first is not None else total), total, events


def _is_first_piece(event: dict) -> bool:
    if "choices" in event:  # mlx_lm.server's completion stream
        return bool(event["choices"] and event["choices"][0].get("text"))
    return event.get("type") in (
        "content_block_delta",
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "content_block_start",
    )


def anthropic_answer(events: list[dict]) -> tuple[list[dict], int, int, float, int]:
    """The streamed content blocks, prompt tokens, reused prompt tokens, the
    engine's time to first token and the answer's tokens."""
    blocks, args = [], {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
            blocks[e["index"]]["text"] += e["delta"]["text"]
        elif e["type"] == "content_block_delta":
            args[e["index"]] = args.get(e["index"], "") + e["delta"]["partial_json"]
    for i, text in args.items():
        blocks[i]["input"] = json.loads(text) if text else {}
    usage = next(e for e in events if e["type"] == "message_delta")["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    ttft = usage["mlx_engine"]["time_to_first_token"]
    return blocks, prompt, usage["cache_read_input_tokens"], ttft, usage["output_tokens"]


def responses_answer(events: list[dict]) -> tuple[list[dict], int, int, float, int]:
    final = events[-1]["response"]
    usage = final["usage"]
    cached = usage["input_tokens_details"]["cached_tokens"]
    return (
        final["output"],
        usage["input_tokens"],
        cached,
        usage["mlx_engine"]["time_to_first_token"],
        usage["output_tokens"],
    )


def chat_answer(events: list[dict]) -> tuple[int, int, int]:
    """mlx_lm.server's stream: prompt tokens, cached prompt tokens, answer tokens."""
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return usage["prompt_tokens"], cached, usage["completion_tokens"]


def decode_rate(tokens: int, first_token: float, total: float) -> float:
    """Answer tokens after the first per second after the first was generated
    (the engine's time to first token: a tool call's first streamed piece comes
    only once its name is decoded, so the client's would hide decoding)."""
    return (tokens - 1) / (total - first_token) if tokens > 1 and total > first_token else 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_session(api: str, turns: int, cold: bool, opts: dict) -> tuple[list[dict], list[dict]]:
    """One session on a fresh server and a fresh kit (an empty prompt cache and
    suffix memory): a row per turn, and the bodies sent (``opts``: max_tokens,
    base, decoding)."""
    kit = me.load_model(me.DEFAULT_MODEL)
    try:
        return _turns(kit, api, turns, cold, opts)
    finally:
        me.unload(kit)


def _turns(kit: me.ModelKit, api: str, turns: int, cold: bool, opts: dict) -> tuple[list[dict], list[dict]]:
    keep = cold and api == "messages"
    make, extend = (claude_turn, claude_history) if api == "messages" else (codex_turn, codex_history)
    path = "/v1/messages" if api == "messages" else "/v1/responses"
    read = anthropic_answer if api == "messages" else responses_answer
    rows, bodies, history, previous = [], [], [], None
    with serve(create_app(kit, model_id=MODEL, keep_billing_header=keep)) as url, httpx.Client(timeout=3600) as http:
        for turn in range(1, turns + 1):
            body = make(turn, history, cold, opts["max_tokens"], opts["base"], opts["decoding"])
            tokens = prompt_tokens(kit, api, body, keep)
            ttft, total, events = stream(http, url, path, body)
            answer, prompt_len, reused, engine_ttft, answer_len = read(events)
            shared = common_prefix(previous, tokens) if previous is not None else 0
            rows.append(
                {
                    "turn": turn,
                    "prompt": prompt_len,
                    "rendered": len(tokens),
                    "shared": shared,
                    "reused": reused,
                    "ttft": ttft,
                    "engine_ttft": engine_ttft,
                    "decode_tps": decode_rate(answer_len, min(engine_ttft, ttft), total),
                    "answer": answer_len,
                    "total": total,
                }
            )
            bodies.append(body)
            history, previous = extend(body, answer, turn), tokens
    return rows, bodies


def completion_body(kit: me.ModelKit, api: str, body: dict) -> dict:
    """A replayed turn as mlx_lm.server gets it: the prompt the engine renders
    (tools included: SmolLM2's chat template has no tools, so mlx-lm's chat
    route would drop them), as text on ``/v1/completions``, so both prefill
    the same tokens."""
    tokens = prompt_tokens(kit, api, body, False)
    text = kit.tokenizer.decode(tokens)
    limit = body.get("max_tokens") or body.get("max_output_tokens")
    return {
        "prompt": text,
        "stream": True,
        "temperature": 0,
        "max_tokens": limit,
        "stream_options": {"include_usage": True},
    }


def run_mlx_lm(kit: me.ModelKit, url: str, api: str, bodies: list[dict]) -> list[dict]:
    """The same turns (the engine's session's bodies) on mlx_lm.server."""
    rows = []
    with httpx.Client(timeout=3600) as http:
        for turn, body in enumerate(bodies, 1):
            request = completion_body(kit, api, body) | {"model": url.rsplit("#", 1)[1]}
            ttft, total, events = stream(http, url.rsplit("#", 1)[0], "/v1/completions", request)
            prompt_len, cached, answer_len = chat_answer(events)
            rows.append(
                {
                    "turn": turn,
                    "prompt": prompt_len,
                    "rendered": prompt_len,
                    "shared": 0,
                    "reused": cached,
                    "ttft": ttft,
                    "engine_ttft": ttft,
                    "decode_tps": decode_rate(answer_len, ttft, total),
                    "answer": answer_len,
                    "total": total,
                }
            )
    return rows


@contextmanager
def mlx_lm_server(kit: me.ModelKit):
    """``mlx_lm.server`` on the kit's weights (bench.server's export), in a
    subprocess; yields ``URL#MODEL``."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from .server import export_for_mlx_lm

    folder = export_for_mlx_lm(kit, Path(tempfile.mkdtemp(prefix="agent-sessions-mlx-lm-")))
    port = free_port()
    code = "import runpy, mlx_engine; runpy.run_module('mlx_lm.server', run_name='__main__', alter_sys=True)"
    argv = [sys.executable, "-c", code, "--model", str(folder), "--port", str(port), "--log-level", "WARNING"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield f"{url}#{folder}"
    finally:
        proc.terminate()
        proc.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(app):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def report(results: dict, args) -> list[str]:
    """The markdown: a table per session; ``ttft / cold``: the client's time to
    first token over the same turn's in the cold session of the same harness."""
    lines = [
        "# Replayed agent sessions (bench/agent_sessions.py)",
        "",
        f"Up to {args.turns} turns per session, {me.DEFAULT_MODEL}, greedy, streamed, answers of at most",
        f"{args.max_tokens} tokens, a stable prefix of {args.base_lines} instruction lines. `shared`: prompt tokens",
        "shared with the previous turn's prompt (what a prefix cache can reuse); `reused`: prompt tokens the",
        "server reported as reused (the cache also holds the previous answer's tokens, so this can pass",
        "`shared`); `engine ttft`: the engine's time to first token (usage.mlx_engine); `client ttft`: seconds",
        "to the first streamed piece; `ttft / cold`: client ttft over the same turn's in the `cold` session,",
        "whose first system line changes every turn (Claude Code with `--keep-billing-header`; Codex with a",
        "nonce line), so its every turn is a cold prefill of a prompt as long; `decode tok/s`: answer tokens",
        "after the first over the seconds after the engine's first token. `mlx-lm`: the plain session's requests,",
        "rendered by the engine (tools included) and sent as text to `mlx_lm.server`'s completions, same weights.",
        "",
    ]
    for name, rows in results.items():
        cold = results.get(name.split(" ")[0] + " cold") if not name.endswith("cold") else None
        lines += _table(name, rows, cold)
    return lines


def _table(name: str, rows: list[dict], cold: list[dict] | None) -> list[str]:
    head = "| turn | prompt | shared | reused | reused / shared | engine ttft s | client ttft s | ttft / cold | decode tok/s |"
    lines = [f"## {name}", "", head, "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        ratio = f"{r['reused'] / r['shared']:.3f}" if r["shared"] else "-"
        vs_cold = f"{r['ttft'] / cold[i]['ttft']:.2f}" if cold and i < len(cold) and i > 0 else "-"
        cells = [r["turn"], r["prompt"], r["shared"], r["reused"], ratio, f"{r['engine_ttft']:.2f}", f"{r['ttft']:.2f}"]
        lines.append("| " + " | ".join(str(c) for c in [*cells, vs_cold, f"{r['decode_tps']:.1f}"]) + " |")
    later = rows[1:]
    if later and any(r["shared"] for r in later):
        shared, reused = sum(r["shared"] for r in later), sum(r["reused"] for r in later)
        lines += ["", f"turns 2-{len(rows)}: {reused} of {shared} shared tokens reused ({reused / max(shared, 1):.1%})"]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    args = bench_args(
        "python -m bench.agent_sessions",
        __doc__.splitlines()[0],
        reps=1,
        max_tokens=24,
        argv=argv,
        extra=lambda p: (
            p.add_argument("--turns", type=int, default=10),
            p.add_argument("--cold-turns", type=int, default=None, help="turns of the cold sessions (default --turns)"),
            p.add_argument("--base-lines", type=int, default=BASE_LINES, help="instruction lines of the stable prefix"),
            p.add_argument("--decoding", default="plain", help="comma-separated engine modes (plain, auto)"),
            p.add_argument("--harnesses", default="claude-code,codex"),
            p.add_argument("--mlx-lm", action="store_true", help="replay the plain sessions on mlx_lm.server"),
        ),
    )
    results, replay = {}, {}
    base = base_prompt(args.base_lines)
    for api, label in (("messages", "claude-code"), ("responses", "codex")):
        if label not in args.harnesses.split(","):
            continue
        for decoding in args.decoding.split(","):
            opts = {"max_tokens": args.max_tokens, "base": base, "decoding": decoding}
            results[f"{label} {decoding}"], bodies = run_session(api, args.turns, False, opts)
            replay.setdefault(label, bodies)
        opts = {"max_tokens": args.max_tokens, "base": base, "decoding": "plain"}
        results[f"{label} cold"] = run_session(api, args.cold_turns or args.turns, True, opts)[0]
    if args.mlx_lm:
        kit = me.load_model(me.DEFAULT_MODEL)  # for the export and the rendered prompts
        with mlx_lm_server(kit) as url:
            for api, label in (("messages", "claude-code"), ("responses", "codex")):
                if label in replay:
                    results[f"{label} mlx-lm"] = run_mlx_lm(kit, url, api, replay[label])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agent_sessions.json").write_text(
        json.dumps({"machine": machine_info(), "sessions": results}, indent=1)
    )
    return write_report(report(results, args), args.out, "agent_sessions.md")


if __name__ == "__main__":
    raise SystemExit(main())
