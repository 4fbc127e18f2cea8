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
(with fixed round costs: nothing is timed here). Used to choose the acceptance
model's decay; see docs/decoding.md. Two references frame it: the best fixed
length in hindsight and the oracle (every round's length chosen knowing the
accept lengths), and one learner, ``FollowTheLeader``, shows what learning a
fixed length online costs even with full information.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse  # noqa: E402
import math  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlx_engine.speculative import costs  # noqa: E402
from mlx_engine.speculative.policy import DraftLengthPolicy  # noqa: E402

from . import workloads as W  # noqa: E402
from .run import DEFAULT_DRAFT, DEFAULT_MODEL  # noqa: E402


def greedy(kit: me.ModelKit, prompt: list[int], n: int) -> list[int]:
    return [t.id for r in me.create_generator(kit, prompt, max_tokens=n, temp=0.0, speculative_decoding_toggle=False)
            for t in r.tokens]


def accept_lengths(draft: mx.array, sequence: list[int], start: int, count: int, max_k: int = costs.MAX_DRAFT) -> list[int]:
    """For each position t in [start, start + count): how many of the draft's
    greedy tokens from ``sequence[:t]`` equal ``sequence[t:]`` (up to max_k)."""
    cache = make_prompt_cache(draft)
    mx.eval(draft(mx.array(sequence[: start - 1])[None], cache=cache))
    out = []
    for t in range(start, start + count):
        y, matched, fed = mx.array([sequence[t - 1]]), 0, 0
        while matched < max_k:
            y = mx.argmax(draft(y[None], cache=cache)[0, -1:], axis=-1)
            fed += 1
            if t + matched < len(sequence) and y.item() == sequence[t + matched]:
                matched += 1
            else:
                break
        for c in cache:
            c.trim(fed)
        mx.eval(draft(mx.array([sequence[t - 1]])[None], cache=cache))
        out.append(matched)
    return out


def replay(lengths: list[int], round_cost: list[float], policy) -> float:
    """Tokens per undrafted-round time when ``policy.num_tokens`` picks each round's k."""
    t, tokens, spent = 0, 0, 0.0
    while t < len(lengths):
        if hasattr(policy, "reveal"):
            policy.reveal(lengths, t)
        k = policy.num_tokens(costs.MAX_DRAFT)
        accepted = min(k, lengths[t])
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


def _parse_line(item: str) -> tuple[int, tuple[float, float]]:
    """'128=0.55+0.12k' -> (128, (0.55, 0.12))."""
    try:
        ctx, rest = item.split("=")
        jump, slope = rest.rstrip("k").split("+")
        return int(ctx), (float(jump), float(slope))
    except ValueError:
        raise SystemExit(f"--cost-lines: cannot read {item!r}; expected CTX=JUMP+SLOPEk, e.g. 128=0.55+0.12k")


class Fixed:
    def __init__(self, k: int):
        self.k = k

    def num_tokens(self, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, drafted: int, accepted: int, seconds: float | None) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="a model directory, .gguf file or catalog name")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="a draft directory or catalog name")
    p.add_argument("--tokens", type=int, default=128, help="generated tokens replayed per workload")
    p.add_argument("--decays", default="0.9,0.8", help="acceptance-model decays to replay")
    p.add_argument("--cost-lines", metavar="CTX=JUMP+SLOPEk,...",
                   help="replay with round costs T(k) = 1 + JUMP + SLOPE*k undrafted rounds for workloads at "
                        "context CTX (128 or 1024) instead of measuring; e.g. '128=0.55+0.12k,1024=0.45+0.16k', "
                        "the lines timed rounds fitted on the development machine. Deterministic.")
    args = p.parse_args(argv)
    lines = dict(_parse_line(item) for item in args.cost_lines.split(",")) if args.cost_lines else None

    kit = me.load_model(args.model)
    me.load_draft_model(kit, args.draft)
    tokenize = lambda s: kit.tokenizer.encode(s)  # noqa: E731
    workloads = W.build_workloads(tokenize, lambda p, n: greedy(kit, p, n), lengths=(128, 512, 1024),
                                  multi_turn_lengths=(512,))
    draft_step = costs.measure_chained_step(kit.draft.model, kit.vocab_size) if lines is None else 0.0
    measured: dict[int, costs.CostModel] = {}
    policies = {f"k={k}": (lambda rounds, k=k: Fixed(k)) for k in (1, 2, 3, 4, 6, 8)}
    for decay in (float(d) for d in args.decays.split(",")):
        def adaptive(rounds: costs.RoundCosts, decay: float = decay) -> DraftLengthPolicy:
            return DraftLengthPolicy(None, rounds, decay=decay)
        policies[f"adaptive d={decay:g}"] = adaptive
    policies["follow-the-leader"] = lambda rounds: FollowTheLeader([t / rounds.prior[0] for t in rounds.prior])
    extra = ["best fixed k", "oracle"]
    print("| workload | mean accept length | " + " | ".join([*policies, *extra]) + " |")
    print("|---|---:|" + "---:|" * (len(policies) + len(extra)))
    logs = {name: [] for name in [*policies, *extra]}
    for w in workloads:
        sequence = w.prompt + greedy(kit, w.prompt, args.tokens + costs.MAX_DRAFT)
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
            rounds = costs.RoundCosts(cm, draft_step / cm.step())
        round_cost = [t / rounds.prior[0] for t in rounds.prior]
        row = {name: replay(lengths, round_cost, make(rounds)) for name, make in policies.items()}
        fixed = {k: replay(lengths, round_cost, Fixed(k)) for k in range(costs.MAX_DRAFT + 1)}
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
