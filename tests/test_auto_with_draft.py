"""Auto with a draft model loaded chooses per round between prompt lookup, the
draft model and plain decoding from what each has earned on the request
(issue 31, item 4): a draft that is good on free text but worse than lookup on a
copy gives way to lookup on the copy and is used again on the free text after it.

Deterministic: Markov models (logits from the last token alone) stand in for the
target and the draft, and the router is never shown a round's time, so it prices
rounds with the given costs only."""

from mlx_engine.caches.sequence import SequenceCache
from mlx_engine.decode.loop import decode as _decode
from mlx_engine.decode.sampling import SamplingParams, build_sampler
from mlx_engine.draft.model import DraftModel
from mlx_engine.drafters.draft_model import DraftModelDrafter
from mlx_engine.drafters.prompt_lookup import PromptLookupDrafter
from mlx_engine.drafters.router import AutoRouter, RouterSettings
from mlx_engine.pricing.costs import CostModel, RoundCosts

from itertools import pairwise

import mlx.core as mx
from helpers import run_alone

from fixtures.tiny_models import MarkovLM


def decode(*args, **kwargs):
    return run_alone(_decode(*args, **kwargs))


VOCAB = 320
# Verify costs shaped like the 2-core CPU's (1.27 + 0.07k single steps) and a
# draft step 1/16.5 of a target step, as measured for SmolLM2 and its draft.
CPU_COSTS = CostModel(tuple(0.01 * (1.0 if n == 1 else 1.27 + 0.07 * (n - 1)) for n in range(1, 34)))
DRAFT_STEP = 1 / 16.5

LEAD = list(range(10, 30))
PASSAGE = [100 + (7 * i) % 64 for i in range(64)]  # 64 distinct tokens in a scrambled order
FRESH_1 = list(range(200, 248))  # never in the prompt: lookup has nothing there
FRESH_2 = list(range(250, 298))
PROMPT = LEAD + PASSAGE + [30, 31, 199]
OUTPUT = FRESH_1 + PASSAGE + FRESH_2  # what greedy decoding continues PROMPT with


def _chain_table(successor: dict[int, int]) -> mx.array:
    """Logits whose argmax after token t is successor[t] (t+1 elsewhere), with noise."""
    nxt = [successor.get(t, (t + 1) % VOCAB) for t in range(VOCAB)]
    sharp = mx.zeros((VOCAB, VOCAB))
    sharp[mx.arange(VOCAB), mx.array(nxt)] = 12.0
    return sharp + mx.random.normal((VOCAB, VOCAB), key=mx.random.key(0))


def _successors() -> dict[int, int]:
    chain = [199, *OUTPUT]
    return dict(pairwise(chain))


def _draft_successors() -> dict[int, int]:
    """The target's chain, except: right on 60% of the passage's transitions and
    on 90% of the fresh text's."""
    wrong = {}
    for i, t in enumerate(PASSAGE[:-1]):
        if i % 5 in (1, 3):
            wrong[t] = 310
    for i, t in enumerate(FRESH_1 + FRESH_2):
        if i % 10 == 9:
            wrong[t] = 311
    return {**_successors(), **wrong}


class _Spy:
    """The router as the loop sees it, with every round's time withheld (the
    decisions then depend on the given costs alone) and each round's drafts
    logged with the position they start at and which drafter made them."""

    def __init__(self, router: AutoRouter):
        self.router, self.rounds = router, []
        self._draft_propose = router.draft_drafter.propose
        router.draft_drafter.propose = self._drafted
        self._by_draft = False

    def _drafted(self, history, limit):
        self._by_draft = True
        return self._draft_propose(history, limit)

    def plain_ahead(self, history) -> bool:
        return self.router.plain_ahead(history)

    def propose(self, history, limit):
        self._by_draft = False
        drafts = self.router.propose(history, limit)
        n = drafts.size if isinstance(drafts, mx.array) else len(drafts)
        self.rounds.append((len(history) - len(PROMPT), n, "draft" if self._by_draft else "lookup"))
        return drafts

    def observe(self, drafted, accepted, seconds=None):
        self.router.observe(drafted, accepted, None)


def _drafted_by(rounds, who: str, start: int, end: int) -> int:
    """Draft tokens ``who`` proposed in rounds starting at output positions [start, end)."""
    return sum(n for pos, n, by in rounds if by == who and start <= pos < end)


def test_auto_with_a_draft_drafts_from_lookup_on_a_copy_and_from_the_draft_on_free_text():
    target = MarkovLM(_chain_table(_successors()))
    draft_lm = MarkovLM(_chain_table(_draft_successors()))
    sampler = build_sampler(SamplingParams())
    n = len(OUTPUT)
    plain = [s.token for s in decode(SequenceCache(target), list(PROMPT), n, sampler, [], 4096, None)]
    assert plain == OUTPUT

    draft = DraftModelDrafter(
        DraftModel(None, draft_lm, SequenceCache(draft_lm), 0),
        None,
        RoundCosts(CPU_COSTS, draft_step=DRAFT_STEP),
        vocab_size=VOCAB,
    )
    router = AutoRouter(list(PROMPT), CPU_COSTS, PromptLookupDrafter(32), draft)
    spy = _Spy(router)
    out = [s.token for s in decode(SequenceCache(target), list(PROMPT), n, sampler, [], 4096, spy)]
    assert out == plain  # greedy output is the same whoever drafts

    copy_start, copy_end = len(FRESH_1), len(FRESH_1) + len(PASSAGE)
    # The free text before the copy: the draft model drafts it (lookup has nothing).
    assert _drafted_by(spy.rounds, "draft", 0, copy_start) >= len(FRESH_1) // 2
    # The copy: lookup drafts it, not the draft model that is right 60% of the time there.
    assert _drafted_by(spy.rounds, "lookup", copy_start, copy_end) >= len(PASSAGE) - 16
    assert _drafted_by(spy.rounds, "draft", copy_start + 8, copy_end) <= 4
    # The free text after the copy: the draft model's again, not plain rounds.
    assert _drafted_by(spy.rounds, "draft", copy_end + 4, n) >= len(FRESH_2) // 2


class _WrongDraft:
    """A scripted draft model that is always wrong, with a poor record: what
    the router reads of a DraftModelDrafter, and nothing else."""

    def __init__(self):
        from mlx_engine.drafters.policy import DraftLengthPolicy

        self.policy = DraftLengthPolicy(None, RoundCosts(CPU_COSTS, draft_step=DRAFT_STEP), prior_acceptance=0.1)
        self.acceptance, self.round_costs = self.policy.acceptance, self.policy.round_costs
        self.rounds = 0

    def plain_ahead(self, history) -> bool:
        return False

    def propose(self, history, limit):
        k = self.policy.num_tokens(limit)
        self.rounds += k > 0
        return [VOCAB - 1] * k

    def observe(self, drafted, accepted, seconds=None):
        self.policy.observe(drafted, accepted, None)

    def time_undrafted(self, seconds):
        self.policy.time_undrafted(seconds)


def test_a_probe_whose_long_draft_overran_a_copy_still_commits_to_lookup_over_a_worse_draft():
    """Copied segments of 8 tokens, each after a fresh token: the probe's
    first draft is accepted whole, its next one (32 tokens) runs past the
    segment's end, so fewer than 30% of its drafted tokens are accepted; yet
    every round's first drafts were, and the draft model's record is far
    worse: the probe commits to prompt lookup (issue 40)."""
    segments = [PASSAGE[8 * i : 8 * i + 8] for i in range(6)]
    output = [t for i, seg in enumerate(segments) for t in (200 + i, *seg)]
    router = AutoRouter(list(PROMPT), CPU_COSTS, PromptLookupDrafter(32), _WrongDraft())
    _drive(router, list(PROMPT), output, [], while_mode="probe")
    assert router.mode == "prompt_lookup", router.mode_switches
    # Its token rate (accepted of drafted) is under the commit rate: the positions past each first rejection.
    accepted, drafted = map(int, router.mode_switches[0].split("tried (")[1].split(" drafted")[0].split(" of "))
    assert accepted / drafted <= RouterSettings().commit_acceptance, router.mode_switches


def test_with_a_draft_loaded_the_probe_drafts_a_copys_whole_match_at_once():
    """Without a draft the probe's first lookup draft is short and grows while
    accepted whole; with one loaded it is lookup's whole match (issue 40)."""
    copied = list(range(50))
    history = list(range(100, 150)) + [7] + copied + [8] + copied[:3]
    alone = AutoRouter(list(history), CPU_COSTS, PromptLookupDrafter(32))
    beside = AutoRouter(list(history), CPU_COSTS, PromptLookupDrafter(32), _WrongDraft())
    assert beside.mode == alone.mode == "probe"
    first_alone, first_beside = alone.propose(list(history), 64), beside.propose(list(history), 64)
    assert first_beside == copied[3:35]
    assert len(first_alone) < len(first_beside)


def _drive(
    router: AutoRouter, history: list[int], output: list[int], modes: list[str], while_mode: str | None = None
) -> None:
    """Decode ``output`` after ``history`` under ``router`` (drafts checked
    against it, every round's time withheld), the mode after each round in
    ``modes``; stop early once the mode is not ``while_mode`` (if given)."""
    t = 0
    while t < len(output) and (while_mode is None or router.mode == while_mode):
        drafts = [] if router.plain_ahead(history) else list(router.propose(history, len(output) - t - 1))
        n = 0
        while n < len(drafts) and drafts[n] == output[t + n]:
            n += 1
        router.observe(len(drafts), n, None)
        history += output[t : t + n + 1]
        t += n + 1
        modes.append(str(router.mode))


def test_a_probe_that_drafted_nothing_does_not_commit_to_lookup_on_its_prior():
    """Fresh text from the first token: the probe finds nothing to draft, so
    with a draft model loaded it ends in the draft model's mode, not in prompt
    lookup's, where every round would be built after the previous one is read."""
    router = AutoRouter(list(PROMPT), CPU_COSTS, PromptLookupDrafter(32), _WrongDraft())
    modes: list[str] = []
    _drive(router, list(PROMPT), FRESH_1[:20], modes)
    assert modes[0] == "probe" and modes[-1] == "draft_model", router.mode_switches
    assert "prompt_lookup" not in modes, router.mode_switches


def test_lookup_that_finds_nothing_to_draft_gives_way_and_returns_on_the_next_copy():
    """A copy, then fresh text where lookup has no match: after
    idle_lookup_rounds rounds that drafted nothing the router leaves lookup for
    plain decoding (whose rounds are queued ahead), and the next copy brings it
    back."""
    router = AutoRouter(list(PROMPT), CPU_COSTS, PromptLookupDrafter(32))
    modes: list[str] = []
    _drive(router, list(PROMPT), [30, 31, 199, *PASSAGE[:40]], modes)
    assert modes[-1] == "prompt_lookup", router.mode_switches
    history = list(PROMPT) + [30, 31, 199, *PASSAGE[:40]]
    fresh: list[str] = []
    _drive(router, history, FRESH_1[:20], fresh)
    idle = RouterSettings().idle_lookup_rounds
    # The first fresh round still drafts the passage's continuation (rejected).
    assert fresh[:idle] == ["prompt_lookup"] * idle and fresh[idle] == "plain", router.mode_switches
    assert "nothing drafted in" in router.mode_switches[-1]
    assert router.plain_ahead(history)
    back: list[str] = []
    _drive(router, history, [199, *PASSAGE[:40]], back)
    assert back[-1] == "prompt_lookup", router.mode_switches
