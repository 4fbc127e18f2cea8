"""Speculation priced for the batch it runs in (costs.batch_round_table, rows=)."""

from mlx_engine.drafters.prompt_lookup import NGramIndex, PromptLookupDrafter
from mlx_engine.drafters.router import AutoRouter
from mlx_engine.drafters.suffix import SuffixMemory
from mlx_engine.pricing.batch_pricing import BatchPricing, DraftingRows
from mlx_engine.pricing.costs import CostModel, batch_round_table, pass_seconds
from mlx_engine.pricing.speedup import best_draft_length

import random

# A pass costs a fixed part plus 10% of a step per token: cheap drafts alone,
# dear ones in a wide batch (every row is padded to the drafting row's width).
WIDTH_COSTS = CostModel(tuple(0.01 * (1 + 0.1 * (n - 1)) for n in range(1, 34)))
# Nearly flat in width: drafting pays even in a big batch.
FLAT_COSTS = CostModel(tuple(0.01 * (1 + 0.001 * (n - 1)) for n in range(1, 34)))


class Kit:
    """A kit decoding ``rows()`` rows at ``costs`` (batch_pricing.BatchSource)."""

    def __init__(self, costs: CostModel, rows):
        self.costs, self.rows = costs, rows

    @property
    def open_generations(self) -> int:
        return self.rows()

    def forward_costs(self) -> CostModel:
        return self.costs


def alone_in(rows) -> BatchPricing:
    """A batch of ``rows()`` rows in which no other row drafts (no board)."""
    return BatchPricing(Kit(WIDTH_COSTS, rows))


def test_batch_table_prices_rows_times_tokens():
    assert pass_seconds(WIDTH_COSTS, 40) > pass_seconds(WIDTH_COSTS, 33)  # extrapolated beyond the measured widths
    table = batch_round_table(WIDTH_COSTS, 4)
    assert table[0] == pass_seconds(WIDTH_COSTS, 4) and table[2] == pass_seconds(WIDTH_COSTS, 12)
    scaled = batch_round_table(WIDTH_COSTS, 4, undrafted=2 * table[0])
    assert scaled[3] == 2 * table[3]


def test_bigger_batches_choose_shorter_drafts_or_none():
    lengths = []
    for rows in (1, 2, 8):
        k, speedup = best_draft_length(0.96, batch_round_table(WIDTH_COSTS, rows), 32, rows=rows)
        lengths.append(k)
        assert speedup >= 1.0
    assert lengths[0] > lengths[1] > 0 and lengths[2] == 0
    assert best_draft_length(0.96, batch_round_table(FLAT_COSTS, 8), 32, rows=8)[0] > 0
    # rows=1 is the one-row rule unchanged.
    assert best_draft_length(0.9, WIDTH_COSTS.seconds) == best_draft_length(0.9, WIDTH_COSTS.seconds, rows=1)


def test_fixed_lookup_cuts_its_drafts_to_what_pays_for_the_batch():
    history = list(range(40)) * 3  # a strong match: the cycle continues
    rows = [1]
    drafter = PromptLookupDrafter(8, batch_pricing=BatchPricing(Kit(WIDTH_COSTS, lambda: rows[0])))
    assert len(drafter.propose(history, 64)) == 8 and not drafter.plain_ahead(history)
    rows[0] = 8
    assert drafter.propose(history, 64) == []
    assert drafter.plain_ahead(history)  # nothing would pay: the loop queues plain rounds ahead
    drafter = PromptLookupDrafter(8, batch_pricing=BatchPricing(Kit(FLAT_COSTS, lambda: rows[0])))
    assert len(drafter.propose(history, 64)) == 8


def test_router_prices_lookup_rounds_for_the_batch():
    rows = [1]
    router = AutoRouter(list(range(50)) * 8, WIDTH_COSTS, PromptLookupDrafter(32), batch=alone_in(lambda: rows[0]))
    history = list(range(50)) * 8
    while router.mode == "probe":
        drafts = router.propose(history, 64)
        router.observe(len(drafts), len(drafts))
        for _ in range(len(drafts) + 1):
            history.append(history[-50])
    assert router.mode == "prompt_lookup"
    assert len(router.propose(history, 64)) > 8
    router.observe(0, 0)  # (the round's outcome does not matter here)
    assert not router.plain_ahead(history)
    rows[0] = 8
    assert router.propose(history, 64) == []  # no length pays for 8 rows at these costs
    # ... so its rounds are queued ahead like plain ones: a round built only after
    # the previous one is read would hold up every row of the batch's next step.
    assert router.mode == "prompt_lookup" and router.plain_ahead(history)
    rows[0] = 1
    assert not router.plain_ahead(history)


def test_router_probe_in_a_big_batch_drafts_only_what_pays():
    router = AutoRouter(list(range(50)) * 8, WIDTH_COSTS, PromptLookupDrafter(32), batch=alone_in(lambda: 8))
    assert router.mode == "probe"
    history = list(range(50)) * 8
    assert router.propose(history, 64) == []
    assert router.plain_ahead(history)
    cheap = AutoRouter(list(range(50)) * 8, FLAT_COSTS, PromptLookupDrafter(32), batch=alone_in(lambda: 8))
    assert 0 < len(cheap.propose(list(range(50)) * 8, 64)) <= 4


def test_rows_drafting_beside_each_other_share_the_pass_width():
    """Every row of a batch is padded to the widest, so drafts of one length
    made by every row pay where one row's alone do not (the docstring's example)."""
    table = batch_round_table(WIDTH_COSTS, 8)
    assert best_draft_length(0.96, table, 32, rows=8)[0] == 0
    k, speedup = best_draft_length(0.96, table, 32, rows=8, beside=[0.96] * 7)
    assert k > 0 and speedup > 1.0
    # Rows that draft nothing useful beside it (weak matches) do not make it pay.
    assert best_draft_length(0.96, table, 32, rows=8, beside=[0.0] * 7)[0] == 0


def test_fixed_lookup_rows_post_what_they_can_draft_and_draft_together():
    board = DraftingRows()
    history = list(range(40)) * 3  # every row copies: its next round can match strongly
    drafters = []
    for row in range(8):
        drafters.append(PromptLookupDrafter(8, batch_pricing=BatchPricing(Kit(WIDTH_COSTS, lambda: 8), board, row)))
    # The only row posting: alone in 8 rows nothing pays, so its rounds are queued ahead.
    assert drafters[0].plain_ahead(history) and drafters[0].propose(history, 64) == []
    for d in drafters[1:]:
        d.plain_ahead(history)
    assert len(board.beside(0, 8)) == 7
    assert not drafters[0].plain_ahead(history) and len(drafters[0].propose(history, 64)) > 0
    board.forget(1)
    assert len(board.beside(0, 8)) == 6
    for row in range(1, 6):
        board.forget(row)  # three copying rows of eight: not enough to pay for breaking the batch's pipelining
    assert board.beside(0, 8) == [] and drafters[0].propose(history, 64) == []


def test_next_strength_bound_holds_whatever_token_comes_next():
    """The bound the loop queues plain rounds ahead by: no lookup after one more
    token, any token, is stronger (own history, and the suffix memory)."""
    idx = NGramIndex(1, 3)
    idx.extend([1, 2, 3, 9, 1, 2])
    assert idx.next_strength_bound() == 3  # the docstring's example
    rng = random.Random(0)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        lo = rng.randint(1, 2)
        idx = NGramIndex(lo, rng.randint(lo, 4))
        idx.extend(toks)
        memory = SuffixMemory(key=rng.randint(1, 3), max_depth=rng.choice([4, 64]))
        memory.record("other", [rng.randrange(vocab) for _ in range(30)])
        memory.record("me", toks)
        bound, memory_bound = idx.next_strength_bound(), memory.next_match_bound(toks)
        for tok in range(vocab + 1):
            after = NGramIndex(idx.min_ngram, idx.max_ngram)
            after.extend(toks + [tok])
            assert after.lookup(8, rng.choice([1, 4])).strength <= bound
            memory.record("me", toks + [tok])
            assert memory.query(toks + [tok], 8).match_length <= memory_bound
