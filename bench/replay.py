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
proposals (bench/replay_real.py).

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
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from . import workloads as W  # noqa: E402
from .run import DEFAULT_DRAFT, DEFAULT_MODEL  # noqa: E402


def greedy(kit: me.ModelKit, prompt: list[int], n: int) -> list[int]:
    return [
        t.id
        for r in me.create_generator(kit, prompt, max_tokens=n, temp=0.0, speculative_decoding_toggle=False)
        for t in r.tokens
    ]


def accept_lengths(
    draft: mx.array, sequence: list[int], start: int, count: int, max_k: int = costs.MAX_MODEL_DRAFT
) -> list[int]:
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


def _parse_line(item: str) -> tuple[int | str, tuple[float, float]]:
    """'128=0.55+0.12k' -> (128, (0.55, 0.12)); with --lookup the key is 'toy' or 'chat'."""
    try:
        ctx, rest = item.split("=")
        jump, slope = rest.rstrip("k").split("+")
        return (int(ctx) if ctx.isdigit() else ctx), (float(jump), float(slope))
    except ValueError:
        raise SystemExit(f"--cost-lines: cannot read {item!r}; expected CTX=JUMP+SLOPEk, e.g. 128=0.55+0.12k")


class Fixed:
    def __init__(self, k: int):
        self.k = k

    def num_tokens(self, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, drafted: int, accepted: int, seconds: float | None) -> None:
        pass


# -- prompt lookup and the router ------------------------------------------------
def record_traces(path: Path, tokens: int, chat: bool, toy_model: str | Path) -> dict:
    """Greedy outputs of the bench workloads (``toy_model``'s ``bench.run``
    workloads, the default model unless told, and with ``chat`` SmolLM2's ``bench.chat`` ones; ``tokens`` long,
    replayed as far as each benchmark generates: 128 and 200), saved as JSON:
    ``name -> {"prompt": [...], "output": [...]}``. Greedy output does not
    depend on the decoding mode, so prompt lookup makes them faster."""
    traces: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}

    def add(kit: me.ModelKit, name: str, prompt: list[int]) -> None:
        if name in traces:
            return
        out = [
            t.id
            for r in me.create_generator(kit, prompt, max_tokens=tokens, temp=0.0, prompt_lookup_num_tokens=8)
            for t in r.tokens
        ]
        traces[name] = {"prompt": prompt, "output": out}
        path.write_text(json.dumps(traces))

    kit = me.load_model(toy_model)
    tokenize = lambda s: kit.tokenizer.encode(s)  # noqa: E731
    for w in W.build_workloads(
        tokenize, lambda p, n: greedy(kit, p, n), lengths=(128, 512, 1024), multi_turn_lengths=(512,)
    ):
        add(kit, f"toy/{w.name}", w.prompt)
    if chat:
        from . import chat as C

        kit = me.load_model(me.DEFAULT_MODEL)
        for w in C.build(kit):
            add(kit, f"chat/{w.name}", w.prompt)
    return traces


def replay_drafter(prompt: list[int], output: list[int], drafter, round_cost: list[float]) -> tuple[float, int]:
    """Run ``drafter`` (a PromptLookupDrafter or an AutoRouter without a draft
    model) over a greedy output: each round it proposes, the drafts matching the
    output are accepted, and the round costs ``round_cost[k]`` undrafted rounds.
    Each round's time is reported to the drafter, as the engine's loop does,
    so the router learns the round costs from a prior that may differ. Returns
    tokens per undrafted-round time (1.0: plain decoding) after the first round,
    as ``bench`` measures generation speed (the first round rides on the prompt's
    pass, in the time to first token), and rounds."""
    history, t, spent, rounds, first = list(prompt), 0, 0.0, 0, 0
    count = len(output)
    while t < count:
        limit = count - t - 1
        drafts = list(drafter.propose(history, limit))[:limit] if limit > 0 else []
        n = 0
        while n < len(drafts) and drafts[n] == output[t + n]:
            n += 1
        # Timed in undrafted-round units; the first round is not (the loop reads
        # it right after the prompt's pass).
        seconds = round_cost(len(drafts)) if callable(round_cost) else round_cost[len(drafts)]
        drafter.observe(len(drafts), n, seconds if rounds else None)
        spent += seconds if rounds else 0.0
        history.extend(output[t : t + n + 1])
        t += n + 1
        first = first or t  # tokens of the first round
        rounds += 1
    return (t - first) / spent if spent else 1.0, rounds


def lookup_main(args: argparse.Namespace) -> None:
    """Price fixed-length prompt lookup and the router (no draft model) on traces."""
    from mlx_engine.drafters.prompt_lookup import PromptLookupDrafter
    from mlx_engine.drafters.router import AutoRouter

    traces = record_traces(args.traces, 200, args.chat, args.toy_model)
    lines = dict(_parse_line(item) for item in args.cost_lines.split(",")) if args.cost_lines else {}
    priors = dict(_parse_line(item) for item in args.prior_lines.split(",")) if args.prior_lines else lines
    ks = (4, 8, 16, costs.MAX_DRAFT)
    names = [f"lookup k={k}" for k in ks] + ["auto"]
    print("| workload | " + " | ".join(names) + " | best | auto / best |")
    print("|---|" + "---:|" * (len(names) + 2))
    logs: dict[str, list[float]] = {n: [] for n in [*names, "best", "auto / best"]}
    for name, tr in traces.items():
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        jump, slope = lines.get("chat" if name.startswith("chat/") else "toy", (0.2, 0.1))
        line = (1.0,) + tuple(1.0 + jump + slope * k for k in range(1, costs.MAX_DRAFT + 1))
        jump, slope = priors.get("chat" if name.startswith("chat/") else "toy", (jump, slope))
        cm = costs.CostModel((1.0,) + tuple(1.0 + jump + slope * k for k in range(1, costs.MAX_DRAFT + 1)))
        prompt, output = tr["prompt"], tr["output"][: 200 if name.startswith("chat/") else args.tokens]
        row = {}
        for k in ks:
            row[f"lookup k={k}"] = replay_drafter(prompt, output, PromptLookupDrafter(k), list(line))[0]
        router = AutoRouter(prompt, cm, PromptLookupDrafter(args.auto_max))
        row["auto"], _ = replay_drafter(prompt, output, router, list(line))
        row["best"] = max([1.0] + [row[f"lookup k={k}"] for k in ks])
        row["auto / best"] = row["auto"] / row["best"]
        for n, v in row.items():
            logs[n].append(math.log(v))
        print(
            f"| {name} | "
            + " | ".join(f"{v:.2f}" for v in row.values())
            + f" | <!-- {router.decoding_mode} {len(router.mode_switches)} -->"
        )
    print("| geomean | " + " | ".join(f"{math.exp(sum(v) / len(v)):.3f}" for v in logs.values()) + " |")


class ReplayedDraft:
    """A draft model replayed from its accept lengths: at output position t it
    drafts ``lengths[t]`` right tokens then wrong ones (-1), its length chosen by
    the engine's own ``DraftLengthPolicy`` from the ``prior`` acceptance; each of
    its rounds also costs ``draft_step`` undrafted rounds per draft token plus
    one for catching up. As the engine's drafter, it scores the draft model on
    the positions it catches up on (a scoring round's pass costs
    ``SCORING_STEPS`` draft steps): its prediction at output position p was
    right when ``lengths[p] > 0``. Implements what the router reads of a
    ``DraftModelDrafter`` (``--draft-mix`` simulates the lengths, replay_real.py
    records a real draft's)."""

    #: A scoring pass (a few tokens through the draft model), in draft steps.
    SCORING_STEPS = 1.5

    def __init__(
        self,
        output: list[int],
        lengths: list[int],
        start: int,
        rounds: costs.RoundCosts,
        prior: float,
        draft_step: float,
        scores: bool = True,
    ):
        self.output, self.lengths, self.start, self.draft_step = output, lengths, start, draft_step
        self.policy = DraftLengthPolicy(None, rounds, prior_acceptance=prior, scores=scores)
        self.drafted_last = 0  # drafts of the last round this drafter made (0 if it made none)
        self.scored_last = False  # the last round was a scoring one
        self.fed = (
            start - 1
        )  # the draft model holds the true history up to here (a prefill stops before the last token)
        self._round: tuple[int, int] | None = None  # (history length, drafts) of the drafted round in flight
        self._predicted: list[bool] = []  # scored positions not yet observed
        self._proposed = False

    acceptance = property(lambda self: self.policy.acceptance)
    round_costs = property(lambda self: self.policy.round_costs)

    def time_undrafted(self, seconds: float | None) -> None:
        self.policy.time_undrafted(seconds)

    def plain_ahead(self, history: list[int]) -> bool:
        return False

    def propose(self, history: list[int], limit: int) -> list[int]:
        self._proposed = True
        t = len(history) - self.start
        k = self.policy.num_tokens(min(limit, len(self.output) - t))
        self.drafted_last = k
        if k == 0:
            if self.policy.score_now and len(history) - 1 - self.fed >= 2:
                self._score(len(history))
                self.fed, self.scored_last = len(history) - 1, True
            return []
        if len(history) - self.fed > self.policy.steady_catch_up:
            self._score(len(history))
        self._round = (len(history), k)
        right = min(k, self.lengths[t] if t < len(self.lengths) else 0)
        return self.output[t : t + right] + [-1] * (k - right)

    def _score(self, end: int) -> None:
        """The draft model's predictions at positions fed+1 .. end-1 (absolute)."""
        if self.policy.scores:
            self._predicted = [self.lengths[p - self.start] > 0 for p in range(self.fed + 1, end)]

    def observe(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        if not self._proposed:
            self.policy.skip()
        self._proposed = False
        if self._predicted:
            self.policy.observe_scored(self._predicted)
            self._predicted = []
        if self._round is not None:
            # Its cache keeps the accepted drafts it fed (all but its last draft).
            self.fed = self._round[0] + min(accepted, self._round[1] - 1)
            self._round = None
        self.policy.observe(drafted, accepted, seconds)

    def extra_cost(self) -> float:
        """The draft model's work in the round just made (0 when it made none)."""
        k, self.drafted_last = self.drafted_last, 0
        scored, self.scored_last = self.scored_last, False
        return (k + 1) * self.draft_step if k else self.SCORING_STEPS * self.draft_step if scored else 0.0


def simulated_lengths(output: list[int], rate: float) -> list[int]:
    """The accept lengths of a draft right at each output position with
    probability ``rate`` (a fixed pseudo-random draw per position, so every
    replay sees the same draft): at t, how many positions from t on it is right."""
    import random

    draw = random.Random(f"{rate}:{len(output)}")
    right = [draw.random() < rate for _ in output]
    lengths, run = [0] * len(output), 0
    for t in reversed(range(len(output))):
        run = run + 1 if right[t] else 0
        lengths[t] = run
    return lengths


def draft_mix_main(args: argparse.Namespace) -> None:
    """Replay the router with a simulated draft model of each ``--draft-mix``
    acceptance beside prompt lookup alone and the draft alone, on every trace in
    ``--traces`` (``--lookup --chat`` records them)."""
    from mlx_engine.drafters.prompt_lookup import PromptLookupDrafter
    from mlx_engine.drafters.router import AutoRouter

    traces = json.loads(args.traces.read_text())
    jump, slope = _parse_line(f"chat={args.chat_line}")[1]
    line = [1.0] + [1.0 + jump + slope * k for k in range(1, costs.MAX_DRAFT + 1)]
    cm = costs.CostModel(tuple(line))
    print("| workload | draft rate | lookup k=32 | auto, no draft | draft | auto | best | auto / best | final mode |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    ratios = []
    for rate in (float(r) for r in args.draft_mix.split(",")):
        for name, tr in traces.items():
            prompt, output = tr["prompt"], tr["output"][:200]

            def run(make_router: bool, prompt=prompt, output=output, rate=rate) -> tuple[float, str]:
                lengths = simulated_lengths(output, rate)
                sim = ReplayedDraft(
                    output, lengths, len(prompt), costs.RoundCosts(cm, args.draft_step), rate, args.draft_step
                )
                drafter = AutoRouter(prompt, cm, PromptLookupDrafter(costs.MAX_DRAFT), sim) if make_router else sim
                cost = lambda k: line[k] + sim.extra_cost()  # noqa: E731
                speed = replay_drafter(prompt, output, drafter, cost)[0]
                return speed, drafter.decoding_mode if make_router else ""

            lookup = replay_drafter(prompt, output, PromptLookupDrafter(costs.MAX_DRAFT), line)[0]
            alone = AutoRouter(prompt, cm, PromptLookupDrafter(costs.MAX_DRAFT))
            no_draft = replay_drafter(prompt, output, alone, line)[0]
            draft, _ = run(False)
            auto, mode = run(True)
            best = max(1.0, lookup, draft)
            ratios.append(auto / best)
            print(
                f"| {name} | {rate:.2f} | {lookup:.2f} | {no_draft:.2f} | {draft:.2f} | {auto:.2f} | {best:.2f} | {auto / best:.2f} | {mode} |"
            )
    print(
        f"| geomean auto / best | | | | | | | {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} | "
        f"worst {min(ratios):.2f} |"
    )


def main(argv: list[str] | None = None) -> None:
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
    args = p.parse_args(argv)
    if args.real_draft:
        from . import replay_real

        return replay_real.main(args)
    if args.draft_mix:
        return draft_mix_main(args)
    if args.lookup:
        args.traces.parent.mkdir(parents=True, exist_ok=True)
        return lookup_main(args)
    lines = dict(_parse_line(item) for item in args.cost_lines.split(",")) if args.cost_lines else None

    kit = me.load_model(args.model)
    me.load_draft_model(kit, args.draft)
    tokenize = lambda s: kit.tokenizer.encode(s)  # noqa: E731
    workloads = W.build_workloads(
        tokenize, lambda p, n: greedy(kit, p, n), lengths=(128, 512, 1024), multi_turn_lengths=(512,)
    )
    draft_step = costs.measure_draft_step_ratio(kit.model, kit.draft.model, kit.vocab_size) if lines is None else 0.0
    measured: dict[int, costs.CostModel] = {}
    policies = {f"k={k}": (lambda rounds, k=k: Fixed(k)) for k in (1, 2, 3, 4, 6, 8)}
    for decay in (float(d) for d in args.decays.split(",")):

        def adaptive(rounds: costs.RoundCosts, decay: float = decay) -> DraftLengthPolicy:
            return DraftLengthPolicy(None, rounds, decay=decay, scores=True)

        policies[f"adaptive d={decay:g}"] = adaptive
    policies["follow-the-leader"] = lambda rounds: FollowTheLeader([t / rounds.prior[0] for t in rounds.prior])
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
