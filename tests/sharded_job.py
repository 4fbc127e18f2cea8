"""One rank of a sharded job, for tests/test_distributed.py (run by mlx.launch or
by the test with MLX_RANK / MLX_HOSTFILE set).

Rank 0 loads the sharded kit, runs the requested scenario and writes JSON to
``--out``; the followers serve and write how they ended to ``--out.rank<N>``.

Scenarios:
  modes   greedy generation of the same prompts in every decoding mode
  wait    load, write "ready", then keep generating until a rank fails
"""

from __future__ import annotations

import mlx_engine as me

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

N_PROMPT, N_ECHO = 16, 24  # new tokens for the short prompt and the echo prompt
REGEX = r"(x|y)\.self = [0-9]{2,4}, and so on"
ECHO = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


def generate(kit, prompt, **kw) -> dict:
    ids, final = [], None
    for r in me.create_generator(kit, prompt, **kw):
        ids.extend(t.id for t in r.tokens)
        final = r
    s = final.stats
    return {
        "ids": ids,
        "mode": s.decoding_mode,
        "drafted": s.drafted_tokens,
        "accepted": s.accepted_tokens,
        "rounds": s.verify_rounds,
        "cached": s.cached_tokens,
        "stop": final.stop_condition.stop_reason,
    }


def run_modes(kit, draft: str | None) -> dict:
    prompt = me.tokenize(kit, ECHO)
    echo = me.tokenize(kit, ECHO * 8)  # long enough for the router to consider lookup
    passes0 = kit.shard.counter.passes
    out = {
        "plain": generate(kit, prompt, max_tokens=N_PROMPT, temp=0.0),
        "plain_again": generate(kit, prompt, max_tokens=N_PROMPT, temp=0.0),  # the prompt cache is reused
        "lookup": generate(kit, echo, max_tokens=N_ECHO, temp=0.0, prompt_lookup_num_tokens=6),
        "auto_lookup": generate(kit, echo, max_tokens=N_ECHO, temp=0.0, auto_speculative=True),
        # Structured output: masks on rank 0, forced spans drafted and verified by the sharded target.
        "regex": generate(kit, prompt, max_tokens=24, temp=0.0, regex=REGEX),
    }
    gen = me.create_generator(kit, prompt + [5], max_tokens=N_PROMPT, temp=0.0)
    for _ in range(5):  # a generation closed mid-way leaves a step queued ahead, unread
        next(gen)
    gen.close()
    out["after_cancel"] = generate(kit, prompt, max_tokens=N_PROMPT, temp=0.0)
    for _ in range(2):  # as after a failed request: each reset is a new cache, the old one freed
        kit.cache.reset()
        out["after_reset"] = generate(kit, prompt, max_tokens=4, temp=0.0)
    if draft:
        me.load_draft_model(kit, draft)
        out["draft"] = generate(kit, prompt, max_tokens=N_PROMPT, temp=0.0, num_draft_tokens=3)
        out["draft_adaptive"] = generate(kit, prompt, max_tokens=N_PROMPT, temp=0.0)
        out["auto_draft"] = generate(kit, echo, max_tokens=N_ECHO, temp=0.0, auto_speculative=True)
        me.unload_draft_model(kit)
    out["passes"] = kit.shard.counter.passes - passes0
    out["passes_total"] = kit.shard.counter.passes
    out["shard"] = {"size": kit.shard.size, "parallelism": kit.shard.parallelism}
    return out


def run_wait(kit, out: Path) -> dict:
    prompt = me.tokenize(kit, ECHO)
    out.with_suffix(".ready").write_text("ready")
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 120:
            generate(kit, prompt + [int(time.monotonic() * 1000) % 50], max_tokens=64, temp=0.0)
    except me.ShardedKitError as exc:
        failed_after = (
            time.monotonic() - float(out.with_suffix(".killed").read_text() or 0)
            if out.with_suffix(".killed").exists()
            else None
        )
        again = None
        try:
            me.create_generator(kit, prompt)
        except me.ShardedKitError as exc2:
            again = str(exc2)
        me.unload(kit)
        return {
            "error": str(exc),
            "type": type(exc).__name__,
            "usable": kit.usable,
            "again": again,
            "seconds_after_kill": failed_after,
        }
    return {"error": None}


def stall_at(where: str) -> None:
    """Make this rank stop itself (SIGSTOP; the test kills it) at one step of the load."""
    from mlx_engine.distributed import connect, sharding

    import os
    import signal

    def stop_then(fn):
        def wrapper(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGSTOP)
            return fn(*args, **kwargs)

        return wrapper

    if where == "before-control":
        connect._join_control = stop_then(connect._join_control)
    else:
        sharding.load_lazily = stop_then(sharding.load_lazily)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--scenario", default="modes")
    ap.add_argument("--parallelism", default="auto")
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0)
    ap.add_argument("--connect-timeout", type=float, default=60.0)
    ap.add_argument(
        "--stall-rank1",
        choices=("none", "before-control", "while-loading"),
        default="none",
        help="rank 1 stops itself (SIGSTOP) before the control channel or while it loads its shard",
    )
    ap.add_argument(
        "--no-socket-shutdown",
        action="store_true",
        help="as with a backend whose sockets the engine cannot shut down: only the grace timeout releases rank 0",
    )
    args = ap.parse_args()
    if args.no_socket_shutdown:
        from mlx_engine.distributed import health

        health.break_ring_sockets = lambda: 0
    out = Path(args.out)
    if args.stall_rank1 != "none" and __import__("os").environ.get("MLX_RANK") == "1":
        stall_at(args.stall_rank1)
    try:
        kit = me.load_sharded_model(
            args.model,
            parallelism=args.parallelism,
            heartbeat_timeout=args.heartbeat_timeout,
            connect_timeout=args.connect_timeout,
        )
    except Exception as exc:  # every rank reports the same configuration error
        rank = __import__("os").environ.get("MLX_RANK", "0")
        Path(f"{out}.rank{rank}.error").write_text(json.dumps({"type": type(exc).__name__, "error": str(exc)}))
        return 2
    if isinstance(kit, me.Follower):
        ended = kit.serve()
        Path(f"{out}.rank{kit.shard.rank}").write_text(
            json.dumps({"reason": ended.reason, "passes": ended.passes, "detail": ended.detail, "caches": ended.caches})
        )
        return 0
    try:
        result = run_modes(kit, args.draft) if args.scenario == "modes" else run_wait(kit, out)
        if kit.usable:
            me.unload(kit)
    except Exception:
        result = {"crash": traceback.format_exc()}
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
