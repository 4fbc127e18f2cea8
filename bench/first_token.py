"""The first request's time to first token in a new process (issue 55):
``python -m bench.first_token [--reps 3] [--stored]``.

Each run is a fresh process that loads the default model (and for the draft
systems its draft, ``smollm2-135m-draft``) and times one request, the
chat-templated "Write a short story about a fox.", 40 tokens, greedy. Its cost
folder (``MLX_ENGINE_COST_DIR``) is a new empty one, so a speculative request
starts from the estimate (``costs.estimate``) and times what that needs; with
``--stored`` each system's folder first gets a record from an earlier process
(one warm-up request, then the background measurement awaited), so the request
reads it instead. Systems run interleaved, ``--reps`` rounds. Reports each
run's time to first token and the part of it spent setting up forward costs
(``GenerationStats.setup_time``). Writes ``<out>/first_token.json``
(``first_token_stored.json`` with ``--stored``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("bench")

PROMPT = "Write a short story about a fox."
#: name: (decoding option, load the draft)
SYSTEMS = {
    "plain": ("plain", False),
    "auto": ("auto", False),
    "auto-draft": ("auto", True),
    "draft": ("draft", True),
}


def one_request(decoding: str, draft: bool, store: bool) -> dict:
    """Runs in the child: load, one request timed; with ``store`` the record is
    written first (a warm-up request, then the background measurement awaited)."""
    import mlx_engine as me

    kit = me.load_model("smollm2-135m-instruct")
    if draft:
        me.load_draft_model(kit, "smollm2-135m-draft")
    prompt = me.apply_chat_template(kit, [{"role": "user", "content": PROMPT}])
    if store:
        list(me.create_generator(kit, prompt, max_tokens=2, decoding=decoding))
        deadline = time.monotonic() + 300
        while kit.cost_source == "estimate" and time.monotonic() < deadline:
            time.sleep(0.2)
        return {"stored": kit.cost_source}
    t0 = time.perf_counter()
    first = None
    for result in me.create_generator(kit, prompt, max_tokens=40, temp=0.0, decoding=decoding):
        first = first if first is not None else time.perf_counter() - t0
    stats = result.stats
    return {
        "seen": round(first, 3),
        "ttft": round(stats.time_to_first_token, 3),
        "setup": round(stats.setup_time, 3),
        "mode": stats.decoding_mode,
        "cost_source": kit.cost_source,
        "load": round(os.getloadavg()[0], 2),
    }


def run_child(system: str, cost_dir: str, store: bool) -> dict:
    decoding, draft = SYSTEMS[system]
    code = (
        "import json, sys; from bench.first_token import one_request; "
        f"print(json.dumps(one_request({decoding!r}, {draft!r}, {store!r})))"
    )
    env = {**os.environ, "MLX_ENGINE_COST_DIR": cost_dir}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{system} run failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="of " + ", ".join(SYSTEMS))
    p.add_argument("--stored", action="store_true", help="a stored cost record, not a fresh folder")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; known: {list(SYSTEMS)}")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as root:
        for rep in range(args.reps):
            for system in systems:
                folder = Path(root) / f"{system}-{rep}"
                folder.mkdir()
                if args.stored:
                    run_child(system, str(folder), store=True)
                run = run_child(system, str(folder), store=False)
                runs[system].append(run)
                logger.info("%s: %s", system, run)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "first_token_stored.json" if args.stored else "first_token.json"
    (args.out / name).write_text(json.dumps({"stored": args.stored, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
