"""Sharded kits: 1 rank against 2 ranks on this machine (loopback, ring backend).

    .venv/bin/python -m bench.distributed [--reps 2] [--max-tokens 128] [--quick] [--models-only]

Runs a random-weight pair written by fixtures/tiny_models.py (SHARDING_PAIR: a llama
target 384 wide, 8 layers, 6 heads, which shards over 2 ranks, as SmolLM2-135M's 9
heads do not; a 2-layer draft on its tokenizer) on an echo and an open-generation
prompt in every decoding mode, first in this process, then as a 2-rank job started
with mlx.launch (this file is also each rank's program). Reports generation tok/s,
the 2-rank / 1-rank ratio, tokens per target forward pass, and each kit's speed-up
of prompt lookup and the draft model over its own plain decoding (random weights:
the ratios measure the sharding's cost, not a draft's quality). Writes
bench/results/distributed.{md,json}; ``--models-only`` just writes the pair.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import mlx_engine as me  # noqa: E402

SHARDING_PAIR = ROOT / "bench" / "results" / "raw" / "sharding-pair"
TARGET, DRAFT = SHARDING_PAIR / "target", SHARDING_PAIR / "draft"
MODES = {
    "plain": {},
    "lookup": {"prompt_lookup_num_tokens": 8},
    "draft": {"draft": True},
    "auto": {"auto_speculative": True, "draft": True},
}
RESULTS = ROOT / "bench" / "results"


def make_models() -> None:
    """Write the random-weight pair (seeded: the same weights every time) unless present."""
    from fixtures.tiny_models import make_model

    if not (TARGET / "model.safetensors").exists():
        make_model(TARGET, "llama", hidden=384, layers=8, heads=6, kv_heads=6, scale=3.0, seed=11)
    if not (DRAFT / "model.safetensors").exists():
        make_model(DRAFT, "llama", hidden=128, layers=2, heads=4, kv_heads=2, scale=3.0, seed=12, tokenizer_from=TARGET)


def workloads(kit) -> dict[str, list[int]]:
    from bench.workloads import build_workloads

    built = build_workloads(
        lambda t: me.tokenize(kit, t),
        lambda p, n: [],
        lengths=(512,),
        multi_turn_lengths=(),
        kinds=("echo", "open-gen"),
    )
    return {w.name: w.prompt for w in built}


def run_once(kit, prompt: list[int], max_tokens: int, options: dict) -> dict:
    options = {k: v for k, v in options.items() if k != "draft"}
    final, ids = None, []
    for final in me.create_generator(kit, prompt, max_tokens=max_tokens, temp=0.0, **options):
        ids.extend(t.id for t in final.tokens)
    s = final.stats
    rounds = max(1, s.generated_tokens - s.accepted_tokens)  # each pass emits its accepted drafts + 1
    return {
        "tps": s.generation_tps,
        "tokens": s.generated_tokens,
        "accepted": s.accepted_tokens,
        "tokens_per_pass": s.generated_tokens / rounds,
        "mode": s.decoding_mode,
        "ids": ids,
    }


def measure(kit, reps: int, max_tokens: int) -> dict:
    """Every workload in every mode: one untimed warm-up (cost measurement, caches), then ``reps`` runs."""
    out: dict = {}
    for name, prompt in workloads(kit).items():
        for mode, options in MODES.items():
            if options.get("draft"):
                me.load_draft_model(kit, DRAFT)
            run_once(kit, prompt, max_tokens, options)
            runs = []
            passes0 = getattr(getattr(kit, "shard", None), "counter", None)
            before = passes0.passes if passes0 else 0
            for _ in range(reps):
                kit.cache.reset()  # every run prefills the same prompt
                runs.append(run_once(kit, prompt, max_tokens, options))
            mirrored = (passes0.passes - before) / reps if passes0 else None
            if options.get("draft"):
                me.unload_draft_model(kit)
            runs.sort(key=lambda r: r["tps"])
            out[f"{name}/{mode}"] = dict(runs[len(runs) // 2], mirrored_passes=mirrored)
            print(f"  {name}/{mode}: {out[f'{name}/{mode}']}", file=sys.stderr, flush=True)
    cm = kit.cost_model  # measured by the first draft or auto request, through the sharded model
    out["costs"] = {"step_ms": cm.step() * 1e3, "relative": {str(n): cm.relative(n) for n in (2, 5, 9, 17)}}
    return out


def rank_job(out: Path, reps: int, max_tokens: int) -> int:
    kit = me.load_sharded_model(TARGET)
    if isinstance(kit, me.Follower):
        return 0 if kit.serve().reason == "stopped" else 1
    result = measure(kit, reps, max_tokens)
    me.unload(kit)
    out.write_text(json.dumps(result))
    return 0


def launch_two_ranks(reps: int, max_tokens: int) -> dict:
    out = RESULTS / "raw" / "distributed-2ranks.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    launcher = Path(sys.executable).with_name("mlx.launch")
    cmd = [
        str(launcher),
        "-n",
        "2",
        "--backend",
        "ring",
        "--python",
        sys.executable,
        str(Path(__file__).resolve()),
        "--job",
        str(out),
        "--reps",
        str(reps),
        "--max-tokens",
        str(max_tokens),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )  # the ranks import bench/
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return json.loads(out.read_text())


def render(one: dict, two: dict, reps: int, max_tokens: int, load: str) -> str:
    lines = [
        f"Random-weight pair (target 8 layers / 384 wide / 6 heads, float32), {max_tokens} new tokens, greedy, median of {reps} "
        f"runs after a warm-up, {os.cpu_count()} CPU cores shared by both ranks; load average before/after: {load}.",
        "",
        "| workload / mode | 1 rank tok/s | 2 ranks tok/s | 2 / 1 | tokens per pass (1 rank / 2 ranks) | speed-up over own plain (1 rank / 2 ranks) | same tokens as 1 rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in (k for k in one if k != "costs"):
        name = key.split("/")[0]
        a, b = one[key], two[key]
        pa, pb = one[f"{name}/plain"]["tps"], two[f"{name}/plain"]["tps"]
        lines.append(
            f"| {key} ({b['mode']}) | {a['tps']:.1f} | {b['tps']:.1f} | {b['tps'] / a['tps']:.2f} | "
            f"{a['tokens_per_pass']:.2f} / {b['tokens_per_pass']:.2f} | {a['tps'] / pa:.2f} / {b['tps'] / pb:.2f} | "
            f"{'yes' if a['ids'] == b['ids'] else 'no'} |"
        )
    lines += [
        "",
        "Forward-pass costs the engine measured (what drives draft lengths and the router): "
        "a 1-token step, and an n-token verify pass in steps:",
        "",
        "| kit | step | 2 tokens | 5 tokens | 9 tokens | 17 tokens |",
        "|---|---|---|---|---|---|",
    ]
    for label, res in (("1 rank", one), ("2 ranks", two)):
        c = res["costs"]
        rel = " | ".join(f"{c['relative'][n]:.2f}" for n in ("2", "5", "9", "17"))
        lines.append(f"| {label} | {c['step_ms']:.1f} ms | {rel} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.distributed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="1 run, 64 tokens")
    ap.add_argument("--models-only", action="store_true", help=f"write the model pair to {SHARDING_PAIR} and stop")
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)  # set when running as a rank
    args = ap.parse_args(argv)
    reps, max_tokens = (1, 64) if args.quick else (args.reps, args.max_tokens)
    if args.job:
        return rank_job(args.job, reps, max_tokens)
    make_models()
    if args.models_only:
        print(f"{TARGET}\n{DRAFT}")
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    print("1 rank (this process)", file=sys.stderr)
    kit = me.load_model(TARGET)
    one = measure(kit, reps, max_tokens)
    me.unload(kit)
    print("2 ranks (mlx.launch -n 2 --backend ring)", file=sys.stderr)
    t0 = time.perf_counter()
    two = launch_two_ranks(reps, max_tokens)
    load = f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
    report = render(one, two, reps, max_tokens, load)
    (RESULTS / "distributed.md").write_text(report)
    (RESULTS / "distributed.json").write_text(json.dumps({"one_rank": one, "two_ranks": two, "load": load}, indent=1))
    print(report)
    print(f"(2-rank job: {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
