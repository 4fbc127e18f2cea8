"""Replay draft-length policies offline: ``python -m bench.replay``.

Greedy decoding is deterministic, so how many draft tokens would be accepted
at a position of the output does not depend on how earlier rounds were cut:
it is the number of the draft model's greedy tokens, rolled out from the true
prefix, that equal the target's greedy output there (``accept_lengths``). With
those sequences, any policy for choosing draft lengths can be replayed without
timing noise: a round of k drafts at a position with accept length L yields
min(k, L) + 1 tokens and costs T(k). ``T`` comes from the engine's own
measurement (``costs.measure`` at the workload's context, plus the chained draft
step), or, with ``--cost-lines``, from straight lines fitted to timed rounds (the
measurement misses each drafted round's fixed overheads), so results are tokens
per undrafted-round time: 1.0 is plain decoding. Measuring, run it on a quiet
machine: the cost measurement sees any other load.

The adaptive policy replayed is the engine's own ``DraftLengthPolicy``
(with fixed round costs: nothing is timed here) in its acceptance-by-position
mode, which chose the draft model's length until its confident mode did (the
traces hold accept lengths, not the draft's confidences that mode reads). Used
to choose the acceptance model's decay; see docs/decoding.md. Two references frame it: the best fixed
length in hindsight and the oracle (every round's length chosen knowing the
accept lengths), and one learner, ``FollowTheLeader``, shows what learning a
fixed length online costs even with full information.

``--lookup`` does the same for prompt lookup and the router without a draft
model: the greedy outputs of ``bench.run``'s workloads on the default model (the
retired toy pair's until it was deleted; and, with ``--chat``,
SmolLM2's ``bench.chat`` workloads) are recorded once to ``--traces``; then
fixed lookup lengths and the engine's own ``AutoRouter`` are replayed on them
(every proposal checked against the recorded output), priced with round costs
``1 + JUMP + SLOPE*k`` (``--cost-lines toy=...,chat=...``).

``--real-draft PATH`` does the same with a real draft model's recorded
proposals (bench/replay_real.py). ``--lookup`` and ``--draft-mix`` live in
bench/replay_lookup.py; what the replays share in bench/replay_core.py.

``--draft-mix 0.2,0.6`` replays the router with a draft model loaded on those
traces: a simulated draft right at that share of output positions (a fixed
pseudo-random draw per position), its lengths from the engine's
``DraftLengthPolicy``, each of its rounds also paying its draft steps
(``--draft-step``); beside lookup alone, the draft alone and auto without a draft.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.drafters.policy import DraftLengthPolicy  # noqa: E402
from mlx_engine.pricing import costs  # noqa: E402

import argparse  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

from . import workloads as W  # noqa: E402
from .replay_core import accept_lengths, greedy, parse_line  # noqa: E402
from .run import DEFAULT_DRAFT, DEFAULT_MODEL  # noqa: E402


def replay(lengths: list[int], round_cost: list[float], policy) -> float:
    """Tokens per undrafted-round time when ``policy.num_tokens`` picks each
    round's k. A policy that ``scores`` gets the draft model's predictions at
    the positions it catches up on, as the engine's drafter gives them
    (``observe_scored``; the scoring pass itself is not priced here)."""
    t, tokens, spent = 0, 0, 0.0
    fed = -1  # the last output position the draft model was fed (-1: the prompt's end)
    while t < len(lengths):
        if hasattr(policy, "reveal"):
            policy.reveal(lengths, t)
        k = policy.num_tokens(costs.MAX_MODEL_DRAFT)
        if getattr(policy, "scores", False) and (policy.score_now or (k and t - fed > policy.steady_catch_up)):
            policy.observe_scored([n > 0 for n in lengths[fed + 1 : t]])
            fed = t - 1
        accepted = min(k, lengths[t])
        if k:
            fed = t + min(accepted, k - 1)  # the accepted drafts it fed
        tokens += accepted + 1
        spent += round_cost[k]
        t += accepted + 1
        policy.observe(k, accepted, None)
    return tokens / spent


def oracle(lengths: list[int], round_cost: list[float]) -> float:
    """The best any policy can do: each round's k chosen knowing every accept
    length (by dynamic programming over positions, least time to the end)."""
    n = len(lengths)
    best = [0.0] * (n + 1)  # time from position t to the end
    for t in range(n - 1, -1, -1):
        best[t] = min(cost + best[min(n, t + min(k, lengths[t]) + 1)] for k, cost in enumerate(round_cost))
    return n / best[0]


class FollowTheLeader:
    """A full-information learner of a fixed length: every round it drafts the
    length in ``ks`` that would have done best on the output so far. It sees
    more than any real policy can (whether the draft model's next token was right
    at every position revealed so far, drafted or not) and starts at k=3, so it
    bounds what learning one length online buys over a fixed choice."""

    def __init__(self, round_cost: list[float], ks: range = range(0, 9), start: int = 3):
        self.round_cost = round_cost
        self.ks = ks
        self.k = start
        self.rate = {k: 0.0 for k in ks}

    def reveal(self, lengths: list[int], t: int) -> None:
        """Positions before ``t`` are known: replay every length on them."""
        hit = [n >= 1 for n in lengths[:t]]  # the draft model's next token was right there
        for k in self.ks:
            pos = tokens = 0
            spent = 0.0
            while pos < t:
                run = 0
                while run < k and pos + run < t and hit[pos + run]:
                    run += 1
                if run < k and pos + run == t:
                    break  # this round's outcome lies beyond what is known
                tokens += run + 1
                spent += self.round_cost[k]
                pos += run + 1
            self.rate[k] = tokens / spent if spent else 0.0
        if t and max(self.rate.values()) > 0:
            self.k = max(self.ks, key=lambda k: (self.rate[k], -k))

    def num_tokens(self, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, drafted: int, accepted: int, seconds: float | None) -> None:
        pass


class Fixed:
    def __init__(self, k: int):
        self.k = k

    def num_tokens(self, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, drafted: int, accepted: int, seconds: float | None) -> None:
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lookup", action="store_true", help="replay prompt lookup and the router (no draft model)")
    p.add_argument("--chat", action="store_true", help="with --lookup: also SmolLM2's bench.chat workloads")
    p.add_argument("--traces", type=Path, default=Path("bench/results/raw/lookup_traces.json"))
    p.add_argument(
        "--toy-model",
        default=DEFAULT_MODEL,
        help="with --lookup: the model whose bench.run workloads are replayed (the default model; "
        "the name is kept from the retired toy pair it once was)",
    )
    p.add_argument("--only", help="with --lookup: comma-separated substrings of workload names")
    p.add_argument(
        "--prior-lines",
        metavar="toy=JUMP+SLOPEk,chat=...",
        help="with --lookup: the verify-cost measurement the router starts from (default: --cost-lines); "
        "it learns the --cost-lines rounds as they are timed, as the engine does",
    )
    p.add_argument(
        "--auto-max", type=int, default=costs.MAX_DRAFT, help="with --lookup: the router's longest lookup draft"
    )
    p.add_argument(
        "--draft-mix",
        metavar="RATE,...",
        help="replay the router on the --traces with a simulated draft model right at this share of "
        "positions, beside lookup alone and the draft alone (deterministic)",
    )
    p.add_argument("--chat-line", default="0.27+0.07k", help="with --draft-mix: round costs 1 + JUMP + SLOPE*k")
    p.add_argument(
        "--draft-step", type=float, default=1 / 16.5, help="with --draft-mix: one draft-model step in undrafted rounds"
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="a model directory, .gguf file or catalog name")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="a draft directory or catalog name")
    p.add_argument("--tokens", type=int, default=128, help="generated tokens replayed per workload")
    p.add_argument("--decays", default="0.9,0.8", help="acceptance-model decays to replay")
    p.add_argument(
        "--cost-lines",
        metavar="CTX=JUMP+SLOPEk,...",
        help="replay with round costs T(k) = 1 + JUMP + SLOPE*k undrafted rounds for workloads at "
        "context CTX (128 or 1024) instead of measuring; e.g. '128=0.55+0.12k,1024=0.45+0.16k', "
        "the lines timed rounds fitted on the development machine. Deterministic.",
    )
    p.add_argument(
        "--real-draft",
        metavar="PATH",
        help="replay the router with this real draft model on bench.chat's workloads (bench/replay_real.py)",
    )
    p.add_argument("--real-traces", type=Path, default=Path("bench/results/raw/real_draft_traces.json"))
    p.add_argument("--draft-prior", type=float, default=0.6, help="with --real-draft: the draft's record on the kit")
    p.add_argument("--rounds", help="with --real-draft: workloads whose replayed rounds are printed")
    p.add_argument("--timed", help="with --real-draft: workloads run by the real engine, rounds printed")
    p.add_argument(
        "--timed-system", default="auto", help="with --timed: the modes run in turn (auto, draft), on one kit"
    )
    return p.parse_args(argv)


def _policies(decays: str) -> dict:
    """``name -> make(rounds)`` for every policy replayed: fixed lengths, the engine's, follow-the-leader."""
    policies = {f"k={k}": (lambda rounds, k=k: Fixed(k)) for k in (1, 2, 3, 4, 6, 8)}
    for decay in (float(d) for d in decays.split(",")):

        def adaptive(rounds: costs.RoundCosts, decay: float = decay) -> DraftLengthPolicy:
            return DraftLengthPolicy(None, rounds, decay=decay, scores=True)

        policies[f"adaptive d={decay:g}"] = adaptive
    policies["follow-the-leader"] = lambda rounds: FollowTheLeader([t / rounds.prior[0] for t in rounds.prior])
    return policies


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.real_draft:
        from . import replay_real

        return replay_real.main(args)
    if args.draft_mix:
        from .replay_lookup import draft_mix_main

        return draft_mix_main(args)
    if args.lookup:
        from .replay_lookup import lookup_main

        args.traces.parent.mkdir(parents=True, exist_ok=True)
        return lookup_main(args)
    return policies_main(args)


def policies_main(args: argparse.Namespace) -> None:
    """Replay draft-length policies on the draft model's accept lengths over ``bench.run``'s workloads."""
    lines = dict(parse_line(item) for item in args.cost_lines.split(",")) if args.cost_lines else None
    kit = me.load_model(args.model)
    me.load_draft_model(kit, args.draft)
    tokenize = lambda s: kit.tokenizer.encode(s)  # noqa: E731
    workloads = W.build_workloads(
        tokenize, lambda p, n: greedy(kit, p, n), lengths=(128, 512, 1024), multi_turn_lengths=(512,)
    )
    draft_step = costs.measure_draft_step_ratio(kit.model, kit.draft.model, kit.vocab_size) if lines is None else 0.0
    measured: dict[int, costs.CostModel] = {}
    policies = _policies(args.decays)
    extra = ["best fixed k", "oracle"]
    print("| workload | mean accept length | " + " | ".join([*policies, *extra]) + " |")
    print("|---|---:|" + "---:|" * (len(policies) + len(extra)))
    logs = {name: [] for name in [*policies, *extra]}
    for w in workloads:
        sequence = w.prompt + greedy(kit, w.prompt, args.tokens + costs.MAX_MODEL_DRAFT)
        lengths = accept_lengths(kit.draft.model, sequence, len(w.prompt), args.tokens)
        context = 1024 if len(w.prompt) > 768 else 128
        if lines is not None:
            jump, slope = lines[context]
            line = (1.0,) + tuple(1.0 + jump + slope * k for k in range(1, costs.MAX_DRAFT + 1))
            rounds = costs.RoundCosts(costs.CostModel(line))  # the line is the whole round: no draft steps on top
        else:
            if context not in measured:
                measured[context] = costs.measure(kit.model, kit.vocab_size, context=context)
            cm = measured[context]
            rounds = costs.RoundCosts(cm, draft_step)
        round_cost = [t / rounds.prior[0] for t in rounds.prior]
        row = {name: replay(lengths, round_cost, make(rounds)) for name, make in policies.items()}
        fixed = {k: replay(lengths, round_cost, Fixed(k)) for k in range(costs.MAX_MODEL_DRAFT + 1)}
        best_k = max(fixed, key=fixed.get)
        row["best fixed k"], row["oracle"] = fixed[best_k], oracle(lengths, round_cost)
        for name, v in row.items():
            logs[name].append(math.log(v))
        mean_length = sum(lengths) / len(lengths)
        cells = [f"{v:.2f}" for v in row.values()]
        cells[-2] += f" (k={best_k})"
        print(f"| {w.name} | {mean_length:.2f} | " + " | ".join(cells) + " |")
    print("| geomean | | " + " | ".join(f"{math.exp(sum(v) / len(v)):.3f}" for v in logs.values()) + " |")


if __name__ == "__main__":
    main()
