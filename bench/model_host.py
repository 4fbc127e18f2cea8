"""Model-host benchmark: ``python -m bench.model_host [--max-tokens 32] [--cycles 20]``.

The server as a host of two models (docs/server.md, "Several models"): the
default model (SmolLM2-135M-Instruct, GGUF) as ``smollm2`` and its draft
(a 12M-parameter llama) as ``small``, found in a temporary ``--models-dir``,
served in this process (uvicorn in a thread). Measures:

- the time to first token of a request that triggers a load, against the SDK's
  own ``load_model`` time and against the same request once loaded;
- the longest gap between chunks of a stream of ``small`` while ``smollm2``
  loads, against that stream's median gap (a load should not stall it);
- aggregate tokens/s of two streams on each model alone and of all four at once;
- memory (RSS and MLX's active memory) after ``--cycles`` load/unload cycles
  against the first unloaded state.

Writes ``<out>/model_host.md`` and ``<out>/model_host.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.loading import catalog  # noqa: E402
from mlx_engine.server import (  # noqa: E402
    HostLimits,
    LoadOptions,
    ModelHost,
    create_app,  # noqa: E402
)

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import mlx.core as mx  # noqa: E402
import uvicorn  # noqa: E402

from .machine import machine_info  # noqa: E402


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def stream(url: str, model: str, max_tokens: int, text: str = "Tell me a story about a river.") -> dict:
    """One streamed greedy chat: when it started, each content chunk's arrival time, tokens."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "mlx_engine": {"decoding": "plain"},
    }
    start, times, tokens = time.perf_counter(), [], 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    return {"start": start, "times": times, "tokens": tokens, "ttft": times[0] - start if times else None}


def parallel(url: str, jobs: list[tuple[str, int]]) -> tuple[list[dict], float]:
    out: list[dict] = [{}] * len(jobs)

    def run(i, model, n):
        out[i] = stream(url, model, n, text=f"Request {i}: tell me a story about a river.")

    threads = [threading.Thread(target=run, args=(i, m, n)) for i, (m, n) in enumerate(jobs)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def unload(url: str, model: str) -> None:
    httpx.post(f"{url}/v1/mlx_engine/models/unload", json={"model": model}, timeout=120).raise_for_status()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()

    sdk_loads = []
    for _ in range(3):
        t0 = time.perf_counter()
        kit = me.load_model(me.DEFAULT_MODEL, max_parallel=2)
        sdk_loads.append(time.perf_counter() - t0)
        me.unload(kit)

    root = Path(tempfile.mkdtemp(prefix="bench-host-"))
    (root / "smollm2.gguf").symlink_to(catalog.lookup(me.DEFAULT_MODEL))
    small = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-draft"  # the repository's draft model
    (root / "small").symlink_to(small, target_is_directory=True)
    host = ModelHost(
        models_dirs=[root], catalog=False, defaults=LoadOptions(max_parallel=2, draft=None), limits=HostLimits(ttl=None)
    )
    server = uvicorn.Server(uvicorn.Config(create_app(host), host="127.0.0.1", port=_free_port(), log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.config.port}"
    report: dict = {"machine": machine_info(), "sdk_load_s": sdk_loads, "mlx_active_mib": {}}

    def snapshot(name: str) -> None:
        mx.clear_cache()
        report["mlx_active_mib"][name] = round(mx.get_active_memory() / 2**20, 1)

    snapshot("after the SDK loads")

    # Time to first token with a load, then loaded.
    cold, warm = [], []
    for _ in range(3):
        cold.append(stream(url, "smollm2", 4)["ttft"])
        warm.append(stream(url, "smollm2", 4)["ttft"])
        unload(url, "smollm2")
    report["ttft_with_load_s"], report["ttft_loaded_s"] = cold, warm
    snapshot("after the TTFT cycles")

    # A stream of `small` while smollm2 loads.
    stream(url, "small", 4)  # loaded first
    result: dict = {}
    long = threading.Thread(target=lambda: result.update(s=stream(url, "small", 400)))
    long.start()
    time.sleep(1.0)
    t_load = time.perf_counter()
    loaded = stream(url, "smollm2", 1)
    t_done = loaded["times"][0] if loaded["times"] else time.perf_counter()
    long.join()
    times = result["s"]["times"]
    gaps = [(b - a, a) for a, b in zip(times, times[1:])]
    during = [g for g, at in gaps if t_load <= at <= t_done]
    outside = [g for g, at in gaps if not t_load <= at <= t_done]
    report["stall"] = {
        "load_window_s": t_done - t_load,
        "max_gap_during_load_s": max(during) if during else None,
        "chunks_during_load": len(during),
        "median_gap_outside_s": statistics.median(outside) if outside else None,
        "max_gap_outside_s": max(outside) if outside else None,
    }

    # Aggregate throughput: two streams per model alone, then all four at once.
    n = args.max_tokens
    thr = {}
    for name, jobs in (
        ("smollm2 alone", [("smollm2", n)] * 2),
        ("small alone", [("small", n)] * 2),
        ("both at once", [("smollm2", n)] * 2 + [("small", n)] * 2),
    ):
        outs, wall = parallel(url, jobs)
        thr[name] = sum(o["tokens"] for o in outs) / wall
    report["tokens_per_s"] = thr
    snapshot("after the throughput runs")

    # Memory across load/unload cycles (smollm2; small stays loaded).
    unload(url, "smollm2")
    mx.clear_cache()
    base = {"rss": rss_bytes(), "mlx_active": mx.get_active_memory()}
    for _ in range(args.cycles):
        stream(url, "smollm2", 2)
        unload(url, "smollm2")
    mx.clear_cache()
    after = {"rss": rss_bytes(), "mlx_active": mx.get_active_memory()}
    report["memory"] = {"cycles": args.cycles, "before": base, "after": after}
    server.should_exit = True

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_host.json").write_text(json.dumps(report, indent=1))
    (out / "model_host.md").write_text(_markdown(report))
    print(_markdown(report))


def _markdown(r: dict) -> str:
    med = statistics.median
    s, m = r["stall"], r["memory"]
    mib = 2**20
    lines = [
        "# Model host benchmark",
        "",
        f"SDK `load_model` (smollm2, median of 3): {med(r['sdk_load_s']):.3f} s",
        f"TTFT of a request that loads smollm2 (median of 3): {med(r['ttft_with_load_s']):.3f} s; "
        f"once loaded: {med(r['ttft_loaded_s']):.3f} s",
        "",
        f"Stream of `small` while smollm2 loads ({s['load_window_s']:.3f} s): {s['chunks_during_load']} chunks, "
        f"longest gap {s['max_gap_during_load_s'] or 0:.3f} s; outside the load: median gap "
        f"{s['median_gap_outside_s'] or 0:.3f} s, longest {s['max_gap_outside_s'] or 0:.3f} s",
        "",
        "| streams | aggregate tokens/s |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" for k, v in r["tokens_per_s"].items()],
        "",
        f"Memory over {m['cycles']} load/unload cycles: RSS {m['before']['rss'] / mib:.1f} -> "
        f"{m['after']['rss'] / mib:.1f} MiB; MLX active {m['before']['mlx_active'] / mib:.1f} -> "
        f"{m['after']['mlx_active'] / mib:.1f} MiB",
        "",
        "MLX active memory (MiB) at each phase: " + ", ".join(f"{k}: {v}" for k, v in r["mlx_active_mib"].items()),
        "",
    ]
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
