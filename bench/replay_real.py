"""Replay the router with a real draft model: ``python -m bench.replay --real-draft PATH``.

The greedy output of each ``bench.chat`` workload is recorded once, with the
real draft's accept length at every output position (how many of its greedy
tokens, rolled out from the true prefix, equal the output there: up to 16).
Greedy decoding is deterministic, so that is exactly what the draft model
would have had accepted in a round starting there, whatever the rounds before;
prompt lookup is replayed by running it. On these traces the engine's own
drafters are replayed: lookup 32 alone, the draft model alone (its
``DraftLengthPolicy``), auto without the draft and auto with it, every round
priced ``1 + JUMP + SLOPE*k`` undrafted steps plus ``(k + 1)`` draft steps for a
draft-model round. ``--rounds NAME`` prints auto's rounds on one workload: what
it chose, what lookup and the draft model would each have had accepted there,
and the round's cost; ``--timed`` runs the real engine (auto, the draft loaded)
on the same workloads and prints the same per-round table from the timed run,
so the replay and the timed run can be compared round by round.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.drafters.policy import DraftLengthPolicy  # noqa: E402
from mlx_engine.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from mlx_engine.drafters.router import AutoRouter  # noqa: E402
from mlx_engine.pricing import costs  # noqa: E402

import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

from .replay_core import ReplayedDraft, accept_lengths, replay_drafter  # noqa: E402


def record(path: Path, draft: str, tokens: int, only: list[str] | None) -> dict:
    """``name -> {prompt, output, draft_lengths}`` for bench.chat's workloads, saved as JSON."""
    from . import chat as C

    traces: dict = json.loads(path.read_text()) if path.exists() else {}
    kit = me.load_model(me.DEFAULT_MODEL, suffix_memory_tokens=0)
    me.load_draft_model(kit, draft)
    for w in C.build(kit):
        if w.name in traces or (only and w.name not in only):
            continue
        out = [
            t.id
            for r in me.create_generator(
                kit, w.prompt, max_tokens=tokens, temp=0.0, prompt_lookup_num_tokens=8, speculative_decoding_toggle=None
            )
            for t in r.tokens
        ]
        seq = w.prompt + out
        lengths = accept_lengths(kit.draft.model, seq, len(w.prompt), len(out))
        traces[w.name] = {"prompt": w.prompt, "output": out, "draft_lengths": lengths}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(traces))
    return traces


def lookup_accepts(history: list[int], output: list[int], t: int, k: int = costs.MAX_DRAFT) -> tuple[int, int]:
    """What lookup (32 tokens, fresh index) would draft at output position t, and how much of it is right."""
    drafts = PromptLookupDrafter(k).propose(history, k)
    n = 0
    while n < len(drafts) and t + n < len(output) and drafts[n] == output[t + n]:
        n += 1
    return len(drafts), n


class Recorder:
    """Wraps a drafter: notes each round's proposal, its maker and outcome."""

    def __init__(self, drafter, start: int):
        self.drafter, self.log, self.t = drafter, [], start

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def observe(self, drafted, accepted, seconds=None):
        by = getattr(self.drafter, "round_by", None)
        mode = getattr(self.drafter, "mode", "")
        self.log.append({"pos": self.t, "mode": str(mode), "by": by, "k": drafted, "acc": accepted, "s": seconds})
        self.t += accepted + 1
        self.drafter.observe(drafted, accepted, seconds)


def replay_one(prompt, output, lengths, line, cm, draft_step, prior, router: str) -> tuple[float, object, list]:
    """Replay one system on one trace; returns (speed, drafter, per-round cost log)."""
    sim = ReplayedDraft(output, lengths, len(prompt), costs.RoundCosts(cm, draft_step), prior, draft_step)
    if router == "lookup":
        drafter = PromptLookupDrafter(costs.MAX_DRAFT)
    elif router == "draft":
        drafter = sim
    elif router == "draft k=3":
        sim.policy = DraftLengthPolicy(3)
        drafter = sim
    elif router == "auto-nodraft":
        drafter = AutoRouter(prompt, cm, PromptLookupDrafter(costs.MAX_DRAFT))
    else:
        drafter = AutoRouter(prompt, cm, PromptLookupDrafter(costs.MAX_DRAFT), sim)
    spent: list[float] = []

    def cost(k: int) -> float:
        c = line[k] + sim.extra_cost()
        spent.append(c)
        return c

    rec = Recorder(drafter, len(prompt))
    speed = replay_drafter(prompt, output, rec, cost)[0]
    for entry, c in zip(rec.log, spent):
        entry["cost"] = c
    return speed, drafter, rec.log


def print_rounds(prompt, output, lengths, log) -> None:
    print("| round | pos | mode | by | drafted | accepted | lookup would draft/accept | draft L | cost |")
    print("|---:|---:|---|---|---:|---:|---|---:|---:|")
    for i, e in enumerate(log):
        t = e["pos"] - len(prompt)
        lk = lookup_accepts(prompt + output[:t], output, t)
        s = e.get("cost", e.get("s"))
        cost = f"{s:.3f}" if s is not None else "-"
        print(
            f"| {i} | {t} | {e['mode']} | {e['by'] or ''} | {e['k']} | {e['acc']} | {lk[0]}/{lk[1]} | "
            f"{lengths[t] if t < len(lengths) else '-'} | {cost} |"
        )


def timed(kit, traces: dict, only: list[str], system: str) -> None:
    """The real engine (``system``: auto with the draft loaded, or the draft
    model alone), round by round (seconds per round)."""
    import mlx_engine.request.drafters as D
    from mlx_engine.drafters.draft_model import DraftModelDrafter

    made: list[Recorder] = []
    original = D.AutoRouter
    draft_observe = DraftModelDrafter.observe

    def make(prompt, *a, **kw):
        made.append(Recorder(original(prompt, *a, **kw), len(prompt)))
        return made[-1]

    def observe(self, drafted, accepted, seconds=None):
        if system == "draft":
            rec = made[-1]
            rec.log.append({"pos": rec.t, "mode": "draft", "by": None, "k": drafted, "acc": accepted, "s": seconds})
            rec.t += accepted + 1
        draft_observe(self, drafted, accepted, seconds)

    D.AutoRouter, DraftModelDrafter.observe = make, observe
    options = {"auto_speculative": True} if system == "auto" else {"speculative_decoding_toggle": True}
    print(f"draft step / main step: {D.draft_step_cost(kit):.3f}")
    try:
        for name in only:
            tr = traces[name]
            for _ in range(2):  # the first warms the costs up
                made[:] = [Recorder(None, len(tr["prompt"]))]
                out = [
                    t.id
                    for r in me.create_generator(kit, tr["prompt"], max_tokens=len(tr["output"]), temp=0.0, **options)
                    for t in r.tokens
                ]
            print(f"\n### timed {system}: {name} (output {'same' if out == tr['output'] else 'DIFFERS'})\n")
            print_rounds(tr["prompt"], tr["output"], tr["draft_lengths"], made[-1].log)
    finally:
        D.AutoRouter, DraftModelDrafter.observe = original, draft_observe


def main(args) -> None:
    only = args.only.split(",") if args.only else None
    traces = record(args.real_traces, args.real_draft, 200, only)
    jump, slope = (float(x) for x in args.chat_line.rstrip("k").split("+"))
    line = [1.0] + [1.0 + jump + slope * k for k in range(1, costs.MAX_DRAFT + 1)]
    cm = costs.CostModel(tuple(line))
    names = ["lookup", "draft", "draft k=3", "auto-nodraft", "auto"]
    print("| workload | draft right (mean L>0) | " + " | ".join(names) + " | best | auto / best | auto mode |")
    print("|---|---:|" + "---:|" * (len(names) + 2) + "---|")
    ratios = []
    for name, tr in traces.items():
        if only and name not in only:
            continue
        prompt, output, lengths = tr["prompt"], tr["output"], tr["draft_lengths"]
        row = {n: replay_one(prompt, output, lengths, line, cm, args.draft_step, args.draft_prior, n) for n in names}
        best = max(1.0, row["lookup"][0], row["draft"][0])
        ratios.append(row["auto"][0] / best)
        right = sum(x > 0 for x in lengths) / max(1, len(lengths))
        print(
            f"| {name} | {right:.2f} | "
            + " | ".join(f"{row[n][0]:.2f}" for n in names)
            + f" | {best:.2f} | {row['auto'][0] / best:.2f} | {row['auto'][1].decoding_mode} |"
        )
        if args.rounds and name in args.rounds.split(","):
            print(f"\n### replayed: {name}\n")
            print_rounds(prompt, output, lengths, row["auto"][2])
            print()
    if ratios:
        print(f"geomean auto / best {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, worst {min(ratios):.2f}")
    if args.timed:
        kit = me.load_model(me.DEFAULT_MODEL, suffix_memory_tokens=0)
        me.load_draft_model(kit, args.real_draft)
        for system in args.timed_system.split(","):
            timed(kit, traces, args.timed.split(","), system)
