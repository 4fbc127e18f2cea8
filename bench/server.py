"""Server benchmark: ``python -m bench.server [--max-tokens 48] [--concurrency 1,4,16]``.

The engine's OpenAI-compatible server (``python -m mlx_engine.server``) against
``mlx_lm.server`` on the same weights: the default model (SmolLM2-135M-Instruct)
is written in the layout mlx-lm loads (its float32 weights as the kit computes
them, as safetensors, with its config and tokenizer), so both serve identical
numbers, with the same BLAS. The servers run as subprocesses on 127.0.0.1, all
started at once (an idle server costs no CPU); each scenario runs the systems
back to back in a rotating order. Clients stream chat completions (greedy); for 1, 4 and 16
concurrent clients the report gives time to first token (p50/p95) and the
aggregate tokens per second (completion tokens of all requests / wall time).

Systems: ``engine-plain`` (``mlx_engine.decoding=plain``) and ``mlx-lm`` on
four chat workloads of bench.chat and on the copy-heavy ones; on the latter
also ``engine-spec`` (auto decoding, draft model loaded) and ``mlx-lm-spec``
(``--draft-model``, which turns mlx-lm's batching off). Each system has a
process (and the SDK a kit) of its own, so no system reuses a prompt another
one cached; within a scenario every system gets the same requests. ``sdk`` runs the same requests through the
SDK in this process, one at a time, for the 1-client comparison. Every request
gets its own system line so no prompt is a prefix of another's (no server
reuses a cached prompt). Writes ``<out>/server.md`` and ``<out>/server.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from .chat import DEFAULT_DRAFT, chat_prompts  # noqa: E402
from .machine import machine_info  # noqa: E402

logger = logging.getLogger("bench")

COPY_HEAVY = ("echo-code", "edit-rename", "quote-doc", "continue-list")
MLX_LM_DRAFT_TOKENS = 3  # mlx-lm's generate CLI default, as bench.systems uses


@dataclass
class Served:
    """A server subprocess and what requests to it say."""

    name: str
    argv: list[str]
    model: str  # the `model` field requests carry
    extra: dict = field(default_factory=dict)  # more body fields (the engine's decoding mode)


@dataclass
class Result:
    text: str
    ttft: float
    tokens: int
    error: str | None = None  # the request failed (connection dropped, HTTP error)


def export_for_mlx_lm(kit: me.ModelKit, out: Path) -> Path:
    """The kit's weights as mlx-lm loads them: float32 safetensors, config.json
    and the tokenizer (with its chat template)."""
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(kit.model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), {k: v.astype(mx.float32) for k, v in weights.items()})
    (out / "config.json").write_text(json.dumps(kit.config, indent=1))
    kit.tokenizer._tokenizer.save_pretrained(str(out))
    return out


def messages_for(workload: str, i: int) -> list[dict]:
    text = chat_prompts()[workload][1]
    return [
        {"role": "system", "content": f"Request {i}. You are a helpful assistant."},
        {"role": "user", "content": text},
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(served: Served, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(served.argv + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{served.name} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{served.name} did not start")


async def one_request(
    http: httpx.AsyncClient, url: str, served: Served, messages: list[dict], max_tokens: int
) -> Result:
    """One streamed request; a failure is recorded, not raised (a peer may drop connections under load)."""
    try:
        return await _stream(http, url, served, messages, max_tokens)
    except httpx.HTTPError as exc:
        logger.warning("%s: request failed: %r", served.name, exc)
        return Result("", float("nan"), 0, error=type(exc).__name__)


async def _stream(http: httpx.AsyncClient, url: str, served: Served, messages: list[dict], max_tokens: int) -> Result:
    body = {
        "model": served.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **served.extra,
    }
    t0, ttft, parts, tokens, chunks = time.perf_counter(), None, [], None, 0
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            for c in obj.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    parts.append(piece)
                    chunks += 1
    return Result("".join(parts), ttft or float("nan"), tokens if tokens is not None else chunks)


async def scenario(url: str, served: Served, workloads: list[str], clients: int, max_tokens: int, base: int):
    """``clients`` concurrent streams; with one client, one request per workload in turn."""
    jobs = (
        [(w, base + i) for i, w in enumerate(workloads)]
        if clients == 1
        else [(workloads[i % len(workloads)], base + i) for i in range(clients)]
    )
    async with httpx.AsyncClient(timeout=None) as http:
        t0 = time.perf_counter()
        if clients == 1:
            results = [await one_request(http, url, served, messages_for(w, i), max_tokens) for w, i in jobs]
        else:
            results = await asyncio.gather(
                *(one_request(http, url, served, messages_for(w, i), max_tokens) for w, i in jobs)
            )
        wall = time.perf_counter() - t0
    return jobs, results, wall


def summarise(jobs, results: list[Result], wall: float) -> dict:
    ttfts = sorted(r.ttft for r in results if r.error is None) or [float("nan")]
    pick = lambda q: ttfts[min(len(ttfts) - 1, int(round(q * (len(ttfts) - 1))))]  # noqa: E731
    tokens = sum(r.tokens for r in results)
    return {
        "requests": len(results),
        "failed": sum(r.error is not None for r in results),
        "tokens": tokens,
        "wall": wall,
        "agg_tps": tokens / wall,
        "ttft_p50": pick(0.5),
        "ttft_p95": pick(0.95),
        "texts": {f"{w}#{i}": r.text for (w, i), r in zip(jobs, results)},
    }


def sdk_alone(kit: me.ModelKit, workloads: list[str], max_tokens: int, base: int, **kw) -> dict:
    """The same requests through the SDK, one at a time (the 1-client reference)."""
    jobs, results = [(w, base + i) for i, w in enumerate(workloads)], []
    t0 = time.perf_counter()
    for w, i in jobs:
        prompt = me.apply_chat_template(kit, messages_for(w, i))
        t1, ttft, parts, n = time.perf_counter(), None, [], 0
        for r in me.create_generator(kit, prompt, max_tokens=max_tokens, **kw):
            if r.tokens and ttft is None:
                ttft = time.perf_counter() - t1
            parts.append(r.text)
            n += len(r.tokens)
        results.append(Result("".join(parts), ttft or float("nan"), n))
    return summarise(jobs, results, time.perf_counter() - t0)


def systems(model_dir: Path, draft: str, draft_dir: Path, py: str) -> list[tuple[Served, bool]]:
    """(server, runs the copy-heavy speculation set only). mlx-lm's server is
    started after ``import mlx_engine`` so it gets the same BLAS (see _blas.py)."""
    engine = [
        py,
        "-m",
        "mlx_engine.server",
        "--model",
        me.DEFAULT_MODEL,
        "--model-id",
        "smollm2",
        "--max-parallel",
        "4",
        "--queue",
        "64",
        "--log-level",
        "warning",
    ]
    mlx_lm = [
        py,
        "-c",
        "import sys, runpy, mlx_engine; runpy.run_module('mlx_lm.server', run_name='__main__', alter_sys=True)",
        "--model",
        str(model_dir),
        "--log-level",
        "WARNING",
    ]
    return [
        (Served("engine-plain", engine, "smollm2", {"mlx_engine": {"decoding": "plain"}}), False),
        (Served("engine-spec", engine + ["--draft", draft], "smollm2", {"mlx_engine": {"decoding": "auto"}}), True),
        (Served("mlx-lm", mlx_lm, str(model_dir)), False),
        (
            Served(
                "mlx-lm-spec",
                mlx_lm + ["--draft-model", str(draft_dir), "--num-draft-tokens", str(MLX_LM_DRAFT_TOKENS)],
                str(model_dir),
            ),
            True,
        ),
    ]


SETS = {"chat": ("summarise", "free-chat", "edit-param", "quote-doc"), "copy": COPY_HEAVY}


def run_all(args, kits, model_dir: Path, draft_dir: Path) -> list[dict]:
    """Every server up at once (idle ones cost no CPU); each scenario runs the
    systems back to back in a rotating order, so machine load hits them alike."""
    chosen = systems(model_dir, args.draft, draft_dir, sys.executable)
    procs, urls = [], {}
    try:
        for served, _ in chosen:
            port = free_port()
            key = tuple(served.argv)
            if key not in urls:
                procs.append(start(served, port))
                urls[key] = f"http://127.0.0.1:{port}"
            asyncio.run(scenario(urls[key], served, ["free-chat"], 1, 4, 10_000))  # warm-up (first-request costs)
        return _scenarios(args, kits, chosen, urls)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)


def _scenarios(args, kits: dict, chosen, urls) -> list[dict]:
    rows, base, turn = [], 0, 0
    for set_name, workloads in SETS.items():
        for clients in args.concurrency:
            base += 100
            entries = [(s.name, s) for s, spec_only in chosen if set_name == "copy" or not spec_only]
            if clients == 1:
                entries += [("sdk-plain", None)] + ([("sdk-spec", None)] if set_name == "copy" else [])
            turn += 1
            for name, served in entries[turn % len(entries) :] + entries[: turn % len(entries)]:
                if served is None:
                    kw = {"speculative_decoding_toggle": False} if name == "sdk-plain" else {"auto_speculative": True}
                    summary = sdk_alone(kits[name], list(workloads), args.max_tokens, base, **kw)
                else:
                    jobs, results, wall = asyncio.run(
                        scenario(urls[tuple(served.argv)], served, list(workloads), clients, args.max_tokens, base)
                    )
                    summary = summarise(jobs, results, wall)
                logger.info(
                    "%s %s c=%d: %.1f tok/s, ttft p50 %.2fs",
                    name,
                    set_name,
                    clients,
                    summary["agg_tps"],
                    summary["ttft_p50"],
                )
                rows.append({"system": name, "set": set_name, "clients": clients, "base": base, **summary})
    return rows


def render(rows: list[dict], max_tokens: int) -> str:
    lines = [
        f"SmolLM2-135M-Instruct (float32 on the CPU), greedy, up to {max_tokens} new tokens per request, "
        "streamed; one run. tok/s: completion tokens of all requests / wall time.",
        "",
        "| set | clients | system | requests (failed) | tokens | agg tok/s | TTFT p50 s | TTFT p95 s |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["set"], r["clients"], r["system"])):
        failed = f" ({r['failed']})" if r.get("failed") else ""
        lines.append(
            f"| {r['set']} | {r['clients']} | {r['system']} | {r['requests']}{failed} | {r['tokens']} | "
            f"{r['agg_tps']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} |"
        )
    lines += ["", "Ratios (same set and clients):", ""]
    index = {(r["system"], r["set"], r["clients"]): r for r in rows}
    pairs = [
        ("engine-plain", "mlx-lm"),
        ("engine-spec", "mlx-lm-spec"),
        ("engine-spec", "mlx-lm"),
        ("engine-plain", "sdk-plain"),
        ("engine-spec", "sdk-spec"),
    ]
    for a, b in pairs:
        for (s, st, c), r in sorted(index.items()):
            if s == a and (b, st, c) in index:
                lines.append(f"- {st}, {c} client(s): {a} / {b} = {r['agg_tps'] / index[(b, st, c)]['agg_tps']:.2f}")
    return "\n".join(lines) + "\n"


def exactness(rows: list[dict]) -> list[str]:
    """Greedy answers of the servers compared with the SDK's for the same requests."""
    notes = []
    index = {(r["system"], r["set"], r["clients"]): r for r in rows}
    pairs = [(s, "engine-" + s[4:]) for s, _, _ in index if s.startswith("sdk-")]
    pairs += [("engine-plain", "mlx-lm"), ("engine-spec", "engine-plain"), ("mlx-lm-spec", "mlx-lm")]
    for a, b in dict.fromkeys(pairs):
        for (s, st, c), r in sorted(index.items()):
            other = index.get((b, st, c))
            if s == a and other is not None:  # same set and clients: the same requests
                same = sum(other["texts"].get(k) == v for k, v in r["texts"].items())
                notes.append(f"{a} vs {b} ({st}, {c} clients): {same}/{len(r['texts'])} greedy answers identical")
    return notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("python -m bench.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kits = {"sdk-plain": me.load_model(me.DEFAULT_MODEL), "sdk-spec": me.load_model(me.DEFAULT_MODEL)}
    me.load_draft_model(kits["sdk-spec"], args.draft)
    draft_dir = me.catalog.lookup(args.draft)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = export_for_mlx_lm(kits["sdk-plain"], Path(tmp) / "smollm2-mlx")
        for name, kit in kits.items():  # warm-up, as each server gets (the router's one-off cost measurement)
            sdk_alone(kit, ["free-chat"], 4, 10_000, **({"auto_speculative": True} if name == "sdk-spec" else {}))
        rows = run_all(args, kits, model_dir, draft_dir)
    text = render(rows, args.max_tokens) + "\n" + "\n".join(f"- {n}" for n in exactness(rows)) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server.md").write_text(text)
    (args.out / "server.json").write_text(
        json.dumps({"machine": machine_info(), "cpus": os.cpu_count(), "rows": rows}, indent=1)
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
