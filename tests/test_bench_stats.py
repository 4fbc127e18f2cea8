"""The benchmark's paired comparison (bench/stats.py): what its verdicts claim."""

import math

import pytest

from bench.stats import MIN_ROUNDS, paired_ratio


def test_identical_rounds_are_level_with_a_point_interval():
    a = [100.0, 80.0, 120.0, 95.0]
    pr = paired_ratio(a, list(a))
    assert pr.ratio == pytest.approx(1.0)
    assert pr.low == pytest.approx(1.0) and pr.high == pytest.approx(1.0)
    assert pr.verdict == "level"


def test_pairing_cancels_drift_shared_by_a_round():
    # The machine's speed swings 2x between rounds, but a is 5% faster in every one:
    # ratios of the medians would be lost in the swing, the paired ratio is not.
    load = [1.0, 0.5, 0.9, 0.6, 1.0, 0.55]
    b = [100.0 * x for x in load]
    a = [105.0 * x for x in load]
    pr = paired_ratio(a, b)
    assert pr.ratio == pytest.approx(1.05)
    assert pr.verdict == "ahead"
    assert paired_ratio(b, a).verdict == "behind"


def test_mixed_rounds_straddling_one_are_level():
    a = [101.0, 97.0, 103.0, 99.0, 100.0, 98.0]
    b = [100.0] * 6
    pr = paired_ratio(a, b)
    assert pr.low < 1.0 < pr.high
    assert pr.verdict == "level"
    assert math.exp(sum(math.log(x / 100.0) for x in a) / 6) == pytest.approx(pr.ratio)


def test_too_few_rounds_give_no_interval_and_no_verdict():
    pr = paired_ratio([110.0] * (MIN_ROUNDS - 1), [100.0] * (MIN_ROUNDS - 1))
    assert pr.low is None and pr.high is None and pr.verdict == "?"
    assert pr.ratio == pytest.approx(1.1)


def test_same_runs_give_the_same_report():
    a, b = [101.0, 97.0, 108.0, 95.0, 104.0], [100.0, 99.0, 100.0, 98.0, 97.0]
    assert paired_ratio(a, b) == paired_ratio(a, b)


def test_unpaired_input_is_refused():
    with pytest.raises(ValueError, match="one value per round"):
        paired_ratio([1.0, 2.0], [1.0])


def test_replay_prices_lookup_and_the_router_on_a_recorded_output():
    """bench.replay --lookup: every proposal is checked against the recorded
    output, so the replayed tokens are the output, and a copied passage pays."""
    from mlx_engine.drafters.prompt_lookup import PromptLookupDrafter
    from mlx_engine.drafters.router import AutoRouter
    from mlx_engine.pricing import costs

    from bench.replay_core import replay_drafter

    passage = list(range(100, 160))
    prompt = list(range(1000, 1050)) + passage
    output = passage + list(range(2000, 2020))  # a copy, then fresh text
    line = [1.0] + [1.2 + 0.1 * k for k in range(1, costs.MAX_DRAFT + 1)]
    plain = replay_drafter(prompt, output, _NoDrafts(), line)
    assert plain == (1.0, len(output))
    fixed, rounds = replay_drafter(prompt, output, PromptLookupDrafter(8), line)
    assert fixed > 1.5 and rounds < len(output)
    router = AutoRouter(prompt, costs.CostModel(tuple(line)), PromptLookupDrafter(costs.MAX_DRAFT))
    auto, _ = replay_drafter(prompt, output, router, line)
    # Lookup on the copy; the fresh text after it drafts nothing, so the router leaves lookup there.
    assert auto > 1.5 and router.mode_switches[0].startswith("probe -> prompt_lookup"), router.mode_switches


class _NoDrafts:
    def propose(self, history, limit):
        return []

    def observe(self, drafted, accepted, seconds=None):
        pass
