"""Parallel requests on one kit: continuous batching, speculation per request."""

import mlx_engine as me
from mlx_engine import CallbackError
from mlx_engine.caches.ragged import RaggedBatch
from mlx_engine.pricing.costs import CostModel
from mlx_engine.runtime.scheduler import MAX_BACKLOG

import threading
import time

import mlx.core as mx
import pytest
from helpers import assert_same_or_near_tie, generate_ids, markov_kit, round_robin

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n",
]
MODES = [
    {"speculative_decoding_toggle": False},
    {"prompt_lookup_num_tokens": 4},
    {"speculative_decoding_toggle": True},
    {"auto_speculative": True},
]


@pytest.fixture
def pkit(llama_path, draft_path):
    kit = me.load_model(llama_path)
    me.load_draft_model(kit, draft_path)
    return kit


def solo(kit, prompt, **kw):
    """The request's output on a kit of its own, serving one request at a time."""
    ids, final = generate_ids(kit, prompt, **kw)
    return ids


def drain(gen) -> tuple[list[int], object]:
    ids, last = [], None
    for r in gen:
        ids += [t.id for t in r.tokens]
        last = r
    return ids, last


def test_batched_rows_match_their_own_passes_and_rewind_alone(kit):
    """Rows of different lengths and input widths get the logits a pass over
    each alone gives; a row is rewound by shortening its token list."""
    prompts = [me.tokenize(kit, t) for t in TEXTS[:3]]
    inputs = [[5, 6, 7], [8], [9, 10]]
    alone, rows = [], []
    for p, extra in zip(prompts, inputs):
        c = kit.new_cache(kit.model)
        c.prefill(p)
        alone.append((c, c.feed(extra)))
        r = kit.new_cache(kit.model)
        r.prefill(p)
        rows.append(r)
    batch = RaggedBatch(kit.model, len(rows[0].layers))
    for r in rows:
        batch.join(r)
    out = batch.feed([(r, x, None) for r, x in zip(rows, inputs)])
    for (logits, _), (_, want) in zip(out, alone):
        assert logits.shape == want.shape
        assert mx.allclose(logits, want, atol=1e-4).item()
    del rows[0].tokens[-2:]  # row 0 rejected two drafts; the others keep theirs
    alone[0][0].rewind_to(len(alone[0][0].tokens) - 2)
    out = batch.feed([(rows[0], [11], None), (rows[2], [12], None)])  # row 1 rides along
    assert mx.allclose(out[0][0], alone[0][0].feed([11]), atol=1e-4).item()
    assert mx.allclose(out[1][0], alone[2][0].feed([12]), atol=1e-4).item()
    for r in list(rows):
        batch.leave(r)
    assert not batch.rows
    assert mx.allclose(rows[1].feed([13]), alone[1][0].feed([13]), atol=1e-4).item()


def test_rows_of_any_buffer_width_join_in_either_order(kit):
    """KV buffers of different widths (a branch holds a slice of its source's
    buffer, then grows by a step) join a batch whichever side is wider, and
    each row's logits equal its own pass."""
    from mlx_engine.caches.prompt import branch

    base = kit.new_cache(kit.model)
    base.prefill(me.tokenize(kit, TEXTS[1] * 3))
    branched = branch(base, 21, lambda: kit.new_cache(kit.model))
    branched.prefill([5, 6, 7])  # width 21 + 256, holding 24 positions
    plain = kit.new_cache(kit.model)
    plain.prefill(me.tokenize(kit, TEXTS[0]))  # width 256
    widths = {c.layers[0].keys.shape[2] for c in (branched, plain)}
    assert len(widths) == 2
    for order in ((plain, branched), (branched, plain)):
        want = []
        for c in order:
            alone = kit.new_cache(kit.model)
            alone.prefill(list(c.tokens))
            want.append(alone.feed([9, 10]))
        batch = RaggedBatch(kit.model, len(plain.layers))
        for c in order:
            batch.join(c)
        out = batch.feed([(c, [9, 10], None) for c in order])
        for (logits, _), w in zip(out, want):
            assert mx.allclose(logits, w, atol=1e-4).item()
        for c in order:
            batch.leave(c)
            c.rewind_to(len(c.tokens) - 2)


def test_concurrent_requests_equal_their_solo_outputs_in_every_mode(llama_path, draft_path, pkit):
    one = me.load_model(llama_path, max_parallel=1)
    me.load_draft_model(one, draft_path)
    jobs = [(me.tokenize(pkit, t), mode, n) for t, mode, n in zip(TEXTS, MODES, (24, 9, 17, 30))]
    want = [solo(one, p, max_tokens=n, **mode) for p, mode, n in jobs]
    gens = [me.create_generator(pkit, p, max_tokens=n, **mode) for p, mode, n in jobs]
    got, finals = round_robin(gens)
    for (p, mode, n), w, ids, final in zip(jobs, want, got, finals):
        assert_same_or_near_tie(pkit, p, w, ids)
        assert final.stats.generated_tokens == len(ids) <= n
    assert [f.stats.decoding_mode for f in finals[:3]] == ["plain", "prompt_lookup", "draft_model"]


def test_threads_consume_streams_concurrently_one_cancelled_halfway(pkit, llama_path):
    one = me.load_model(llama_path, max_parallel=1)
    prompts = [me.tokenize(pkit, t) for t in TEXTS]
    # r0 is long enough that the worker, at most MAX_BACKLOG results ahead of its
    # reader, is still generating it when the reader stops it at 10 tokens.
    lengths = [MAX_BACKLOG + 40, 20, 20, 20]
    want = [solo(one, p, max_tokens=n) for p, n in zip(prompts, lengths)]
    got, errors = [None] * 4, []

    def consume(i):
        try:
            gen = me.create_generator(pkit, prompts[i], max_tokens=lengths[i], request_id=f"r{i}")
            ids = []
            for r in gen:
                ids += [t.id for t in r.tokens]
                if i == 0 and len(ids) == 10:
                    assert me.stop_generation(pkit, "r0")
            got[i] = (ids, r.stop_condition.stop_reason)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert got[0][1] == "user_cancelled" and got[0][0] == want[0][: len(got[0][0])]
    for i in range(1, 4):
        assert got[i][1] == "token_limit"
        assert_same_or_near_tie(pkit, prompts[i], want[i], got[i][0])


def test_admitted_while_others_decode(pkit, llama_path):
    one = me.load_model(llama_path, max_parallel=1)
    prompts = [me.tokenize(pkit, t) for t in TEXTS]
    want = [solo(one, p, max_tokens=16) for p in prompts]
    first = [me.create_generator(pkit, p, max_tokens=16) for p in prompts[:3]]
    heads = [[t.id for _ in range(5) for t in next(g).tokens] for g in first]
    late = me.create_generator(pkit, prompts[3], max_tokens=16)  # joins three running rows
    outs = [h + drain(g)[0] for h, g in zip(heads, first)] + [drain(late)[0]]
    for p, w, ids in zip(prompts, want, outs):
        assert_same_or_near_tie(pkit, p, w, ids)


def test_a_failing_or_cancelled_request_leaves_the_others_alone(pkit, llama_path):
    one = me.load_model(llama_path, max_parallel=1)
    prompts = [me.tokenize(pkit, t) for t in TEXTS]
    want = [solo(one, p, max_tokens=14) for p in prompts]

    def boom(_):
        raise RuntimeError("host bug")

    good = [me.create_generator(pkit, prompts[i], max_tokens=14) for i in (0, 1)]
    heads = [[t.id for t in next(g).tokens] for g in good]
    bad_progress = me.create_generator(pkit, prompts[2], max_tokens=14, prompt_progress_callback=boom)
    with pytest.raises(CallbackError, match="host bug"):
        drain(bad_progress)
    with pytest.raises(ValueError, match="top_p"):
        me.create_generator(pkit, prompts[3], max_tokens=14, top_p=7)
    bad_stats = me.create_generator(pkit, prompts[3], max_tokens=14, stats_callback=boom)
    closed = me.create_generator(pkit, prompts[2], max_tokens=14)
    next(closed)
    closed.close()  # cancelled mid-round
    with pytest.raises(CallbackError, match="stats_callback"):
        drain(bad_stats)
    for i, (h, g) in enumerate(zip(heads, good)):
        assert_same_or_near_tie(pkit, prompts[i], want[i], h + drain(g)[0])
    assert not pkit.activity.known and not pkit.activity.active
    assert not pkit.batch.rows
    assert_same_or_near_tie(pkit, prompts[2], want[2], solo(pkit, prompts[2], max_tokens=14))


def test_each_request_reuses_a_cached_prefix(pkit):
    base = me.tokenize(pkit, TEXTS[1])
    ids = solo(pkit, base, max_tokens=6)
    gens = [me.create_generator(pkit, base + ids + me.tokenize(pkit, t), max_tokens=4) for t in ("x", "y")]
    for g in gens:
        next(g)  # both admitted: the second cannot share the first's busy sequence
    finals = [drain(g)[1] for g in gens]
    assert max(f.stats.cached_tokens for f in finals) >= len(base)
    assert all(f.stats.cache_source in ("memory", "branch", "none") for f in finals)


def test_max_parallel_is_checked(llama_path):
    for bad in (0, 65, 2.5, True, "4"):
        with pytest.raises(ValueError, match="max_parallel"):
            me.load_model(llama_path, max_parallel=bad)
    assert me.load_model(llama_path).max_parallel == 4


def test_a_stream_left_unread_is_paused_and_resumes(pkit, llama_path, monkeypatch):
    from mlx_engine.runtime import scheduler

    monkeypatch.setattr(scheduler, "MAX_BACKLOG", 4)
    one = me.load_model(llama_path, max_parallel=1)
    prompts = [me.tokenize(pkit, t) for t in TEXTS[:2]]
    want = [solo(one, p, max_tokens=30) for p in prompts]
    slow = me.create_generator(pkit, prompts[0], max_tokens=30)
    first = next(slow)  # admitted; then left unread while another request runs
    fast = drain(me.create_generator(pkit, prompts[1], max_tokens=30))[0]
    assert slow._live.backlog <= 4
    rest = drain(slow)[0]
    assert_same_or_near_tie(pkit, prompts[0], want[0], [t.id for t in first.tokens] + rest)
    assert_same_or_near_tie(pkit, prompts[1], want[1], fast)


def test_draft_model_rows_draft_in_one_batch(pkit, llama_path, draft_path):
    one = me.load_model(llama_path, max_parallel=1)
    me.load_draft_model(one, draft_path)
    prompts = [me.tokenize(pkit, t) for t in TEXTS[:3]]
    want = [solo(one, p, max_tokens=20, num_draft_tokens=3) for p in prompts]
    gens = [me.create_generator(pkit, p, max_tokens=20, num_draft_tokens=3) for p in prompts]
    heads = [[t.id for t in next(g).tokens] for g in gens]
    heads = [h + [t.id for t in next(g).tokens] for h, g in zip(heads, gens)]
    rows = pkit.worker.call(lambda: len(pkit.draft.batch.rows))
    assert rows == 3  # every request's draft cache is a row of the draft model's batch
    outs = [h + drain(g)[0] for h, g in zip(heads, gens)]
    for p, w, ids in zip(prompts, want, outs):
        assert_same_or_near_tie(pkit, p, w, ids)
    assert not pkit.worker.call(lambda: pkit.draft.batch.rows)


def test_a_dropped_kit_is_collected_and_its_engine_thread_reused(llama_path):
    from mlx_engine.runtime import worker

    import gc
    import weakref

    kit = me.load_model(llama_path)
    drain(me.create_generator(kit, me.tokenize(kit, TEXTS[0]), max_tokens=3))  # the scheduler is attached
    thread, ref = kit.worker, weakref.ref(kit)
    del kit
    gc.collect()
    assert ref() is None
    assert thread in worker._idle and thread.job is None


def test_seeded_sampled_requests_in_parallel_give_their_solo_text(pkit, llama_path, draft_path):
    one = me.load_model(llama_path, max_parallel=1)
    me.load_draft_model(one, draft_path)
    kw = dict(max_tokens=16, temp=0.8, top_p=0.95)
    jobs = [(me.tokenize(pkit, t), mode, seed) for t, mode, seed in zip(TEXTS, MODES, (1, 2, 3, 4))]
    want = [solo(one, p, seed=seed, **mode, **kw) for p, mode, seed in jobs]
    gens = [me.create_generator(pkit, p, seed=seed, **mode, **kw) for p, mode, seed in jobs]
    heads = [[t.id for t in next(g).tokens] for g in gens]  # all four admitted before any finishes
    assert [h + drain(g)[0] for h, g in zip(heads, gens)] == want


def test_a_long_prompt_prefills_between_the_others_steps(pkit, llama_path, monkeypatch):
    from mlx_engine.runtime import scheduler

    monkeypatch.setattr(scheduler, "MAX_BACKLOG", 2)  # the running request stays open (paused) meanwhile
    one = me.load_model(llama_path, max_parallel=1)
    short = me.tokenize(pkit, TEXTS[0])
    long = me.tokenize(pkit, TEXTS[3] * 24)
    assert len(long) > 600
    want = [solo(one, p, max_tokens=12) for p in (short, long)]
    running = me.create_generator(pkit, short, max_tokens=12)
    head = [t.id for t in next(running).tokens]
    seen = []
    late = me.create_generator(pkit, long, max_tokens=12, prompt_progress_callback=seen.append)
    late_ids = drain(late)[0]
    assert len([p for p in seen if 0 < p < 100]) >= 2  # chunks of 256 while another request is open
    assert_same_or_near_tie(pkit, short, want[0], head + drain(running)[0])
    assert_same_or_near_tie(pkit, long, want[1], late_ids)


SYSTEM = "You are a careful assistant. Answer briefly and stay polite. " * 2


def chat(kit, *turns: str) -> list[int]:
    """A conversation's prompt after the system prompt all chats share (turns
    alternate user and assistant)."""
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    return me.apply_chat_template(kit, messages)


def next_turn(kit, user: str) -> list[int]:
    """The tokens that close an answer and add the next user turn."""
    return me.tokenize(
        kit, f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )


@pytest.mark.parametrize("with_draft", [False, True])
def test_chats_branched_off_a_shared_system_prompt_join_the_batch(llama_path, draft_path, with_draft):
    """A chat branched off a cached system prompt has a KV buffer of another
    width (the slice's length plus a growth step) than a row already decoding
    (a chat continued in place); rows of any widths must join."""
    kit = me.load_model(llama_path, max_parallel=3)
    one = me.load_model(llama_path, max_parallel=1)
    if with_draft:
        me.load_draft_model(kit, draft_path)
        me.load_draft_model(one, draft_path)
    firsts = [chat(kit, q) for q in ("def add(a, b):", "import os")]
    answers = [solo(kit, p, max_tokens=8) for p in firsts]  # two chats cached, idle
    prompts = [
        firsts[0] + answers[0] + next_turn(kit, "for i in range(10):"),  # chat 1 goes on: its entry in place
        chat(kit, "class Point:"),  # a new chat: a branch of chat 2's system prompt
    ]
    want = [solo(one, p, max_tokens=12) for p in prompts]
    gens = [me.create_generator(kit, p, max_tokens=12) for p in prompts]
    heads = [[t.id for t in next(g).tokens] for g in gens]  # both rows joined before either ends
    finals = [drain(g) for g in gens]
    for p, w, h, (ids, final) in zip(prompts, want, heads, finals):
        assert final.stop_condition.stop_reason == "token_limit"
        assert_same_or_near_tie(kit, p, w, h + ids)
    assert [f.stats.cache_source for _, f in finals] == ["memory", "branch"]


def test_a_request_failing_at_run_time_fails_alone(pkit, llama_path, draft_path, monkeypatch):
    """A structured-output matcher failing mid-generation (in the request's own
    sampling, after the shared forward pass) fails its request only: the
    others go on, exact, and the kit stays usable."""
    from mlx_engine.structured import GrammarConstraint

    calls = [0]
    masks = GrammarConstraint.masks

    def failing_masks(self, drafts):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected matcher failure")
        return masks(self, drafts)

    one = me.load_model(llama_path, max_parallel=1)
    me.load_draft_model(one, draft_path)
    jobs = [(me.tokenize(pkit, t), mode) for t, mode in zip(TEXTS[:3], MODES[:3])]
    want = [solo(one, p, max_tokens=16, **mode) for p, mode in jobs]
    monkeypatch.setattr(GrammarConstraint, "masks", failing_masks)
    gens = [me.create_generator(pkit, p, max_tokens=16, **mode) for p, mode in jobs]
    failing = me.create_generator(
        pkit, me.tokenize(pkit, TEXTS[3]), max_tokens=16, regex=r"[a-z]{30}", structured_drafting=False
    )
    heads = [[t.id for t in next(g).tokens] for g in gens]  # the others are decoding when it joins
    with pytest.raises(RuntimeError, match="injected matcher failure"):
        drain(failing)
    for (p, _), w, h, g in zip(jobs, want, heads, gens):
        ids, final = drain(g)
        assert final.stop_condition.stop_reason == "token_limit"
        assert_same_or_near_tie(pkit, p, w, h + ids)
    assert not pkit.activity.known and not pkit.worker.call(lambda: pkit.batch.rows)
    monkeypatch.setattr(GrammarConstraint, "masks", masks)
    assert solo(pkit, jobs[0][0], max_tokens=16) == solo(one, jobs[0][0], max_tokens=16)


@pytest.mark.parametrize("shared", ["forward", "draft"])
def test_a_failed_shared_pass_is_retried_row_by_row(pkit, llama_path, draft_path, monkeypatch, shared):
    """A failure of a shared pass (the batch's forward pass, or the draft
    model's batched drafting) cannot be attributed to one request: every row
    is run again on its own, and every request completes exactly."""
    model = pkit.model if shared == "forward" else pkit.draft.model
    failures = [0]
    feed = RaggedBatch.feed

    def failing_feed(self, inputs):
        if self.model is model and len(inputs) >= 2 and failures[0] < 2:
            failures[0] += 1
            raise RuntimeError("injected shared-pass failure")
        return feed(self, inputs)

    one = me.load_model(llama_path, max_parallel=1)
    me.load_draft_model(one, draft_path)
    jobs = [(me.tokenize(pkit, t), {"num_draft_tokens": 3}) for t in TEXTS[:2]] + [
        (me.tokenize(pkit, TEXTS[2]), MODES[1])
    ]
    want = [solo(one, p, max_tokens=16, **mode) for p, mode in jobs]
    monkeypatch.setattr(RaggedBatch, "feed", failing_feed)
    gens = [me.create_generator(pkit, p, max_tokens=16, **mode) for p, mode in jobs]
    heads = [[t.id for t in next(g).tokens] for g in gens]
    for (p, _), w, h, g in zip(jobs, want, heads, gens):
        ids, final = drain(g)
        assert final.stop_condition.stop_reason == "token_limit"
        assert_same_or_near_tie(pkit, p, w, h + ids)
    assert failures[0] == 2
    assert not pkit.activity.known and not pkit.worker.call(lambda: pkit.batch.rows)


@pytest.mark.slow
def test_a_failing_clean_up_still_releases_the_request(llama_path, tmp_path, monkeypatch):
    """A parallel request whose clean-up fails (the prompt cache raising as the
    request returns its entry, e.g. writing evicted entries to a full disk)
    still ends: its answer is delivered, no open request is left behind,
    unload works and every max_parallel slot is usable."""
    from mlx_engine.caches.prompt import PromptCache

    release = PromptCache.release

    def failing_release(self, entry):
        release(self, entry)
        raise OSError(28, "No space left on device")

    kit = me.load_model(llama_path, max_parallel=2, prompt_cache_dir=tmp_path / "cache")
    prompts = [me.tokenize(kit, t) for t in TEXTS]
    want = [solo(me.load_model(llama_path, max_parallel=1), p, max_tokens=6) for p in prompts]
    monkeypatch.setattr(PromptCache, "release", failing_release)
    for i in range(0, 4, 2):
        gens = [me.create_generator(kit, prompts[j], max_tokens=6) for j in (i, i + 1)]
        heads = [[t.id for t in next(g).tokens] for g in gens]
        for j, h, g in zip((i, i + 1), heads, gens):
            assert h + drain(g)[0] == want[j]  # the failure is logged, not the request's
    assert not kit.activity.known
    gens = [me.create_generator(kit, p, max_tokens=6) for p in prompts[:2]]  # both slots
    heads = [[t.id for t in next(g).tokens] for g in gens]
    assert [h + drain(g)[0] for h, g in zip(heads, gens)] == want[:2]
    me.unload(kit)
    assert kit.model is None


def test_a_batch_that_cannot_release_its_rows_fails_them_and_recovers(pkit, llama_path, monkeypatch):
    """The last resort: a shared pass failed and the batch cannot even hand its
    rows back. Every request holding a row gets the error; their caches are
    reset, and the kit serves the next requests exactly."""
    one = me.load_model(llama_path, max_parallel=1)
    prompts = [me.tokenize(pkit, t) for t in TEXTS[:2]]
    want = [solo(one, p, max_tokens=8) for p in prompts]
    feed, leave = RaggedBatch.feed, RaggedBatch.leave
    broken = [True]

    def failing_feed(self, inputs):
        if broken[0] and len(self.rows) >= 2:
            raise RuntimeError("injected shared-pass failure")
        return feed(self, inputs)

    def failing_leave(self, cache):
        if broken[0]:
            broken[0] = False
            raise RuntimeError("injected broken batch")
        return leave(self, cache)

    monkeypatch.setattr(RaggedBatch, "feed", failing_feed)
    monkeypatch.setattr(RaggedBatch, "leave", failing_leave)
    gens = [me.create_generator(pkit, p, max_tokens=200, speculative_decoding_toggle=False) for p in prompts]
    next(gens[0])  # decoding alone (then paused, its row in the batch, once its consumer is 64 results behind)
    for g in reversed(gens):  # the second joins: their shared pass fails, and the batch cannot let them go
        with pytest.raises(RuntimeError, match="injected"):
            drain(g)
    assert not broken[0]
    assert not pkit.activity.known
    gens = [me.create_generator(pkit, p, max_tokens=8) for p in prompts]
    heads = [[t.id for t in next(g).tokens] for g in gens]
    for p, w, h, g in zip(prompts, want, heads, gens):
        assert_same_or_near_tie(pkit, p, w, h + drain(g)[0])


def test_rows_with_cache_buffers_of_other_widths_join_one_batch(llama_path):
    """Prompts sharing a prefix start from branches of the prompt cache, whose
    buffers are exact slices (any width); a row joining a batch whose buffers
    are narrower than its own once failed the batched pass (found by 16 server
    clients on 4 rows)."""
    kit = me.load_model(llama_path, max_parallel=4)
    prompts = [
        me.apply_chat_template(kit, [{"role": "user", "content": f"Question number {i}: what comes next?"}])
        for i in range(16)
    ]
    todo, live, got = list(enumerate(prompts)), {}, {}
    while todo or live:
        while todo and len(live) < 4:  # a new request joins as soon as one ends
            i, p = todo.pop(0)
            live[i] = (me.create_generator(kit, p, max_tokens=12, speculative_decoding_toggle=False), [])
        for i, (gen, ids) in list(live.items()):
            r = next(gen)
            ids += [t.id for t in r.tokens]
            if r.stop_condition is not None:
                got[i] = ids
                del live[i]
    one = me.load_model(llama_path, max_parallel=1)
    for i, p in enumerate(prompts):
        assert_same_or_near_tie(kit, p, solo(one, p, max_tokens=12, speculative_decoding_toggle=False), got[i])


class _StepLog:
    """Runs generations on a scheduler of its own, stepped one step at a time
    inside one call on the kit's engine thread (so nothing else steps it), and
    records per step which rows produced tokens and which prompt chunks each
    model prefilled (``prefills``: ("main" | "draft", tokens))."""

    def __init__(self, kit, monkeypatch):
        from mlx_engine.caches.sequence import SequenceCache

        self.kit, self.prefills, self.steps = kit, [], []
        prefill = SequenceCache.prefill

        def logged(cache, tokens, *a, **kw):
            self.prefills.append(("draft" if cache.model is kit.draft.model else "main", len(tokens)))
            return prefill(cache, tokens, *a, **kw)

        monkeypatch.setattr(SequenceCache, "prefill", logged)

    def start(self, sched, name: str, prompt, **kw):
        from mlx_engine.api import _start
        from mlx_engine.request.options import RequestOptions

        return sched.admit(_start(self.kit, prompt, RequestOptions.from_kwargs(dict(kw, request_id=name))), name)

    def step(self, sched, lives) -> dict:
        """One step: per row name, the token ids it produced; "prefills": the chunks."""
        del self.prefills[:]
        sched.step()
        out = {"prefills": list(self.prefills)}
        for live in lives:
            items = [live.out.popleft() for _ in range(len(live.out))]
            out[live.request_id] = [t.id for r in items if hasattr(r, "tokens") for t in r.tokens]
            out[live.request_id + " error"] = next((r for r in items if isinstance(r, BaseException)), None)
        self.steps.append(out)
        return out


def _draft_request_admitted_while_one_decodes(pkit, log, short, long, at_chunk=None, **late_kw):
    """On the engine thread: ``short`` decodes alone until it has 2 tokens, then a
    draft-model request "b" for ``long`` joins; steps until both end. With
    ``at_chunk=(n, act)``, ``act(scheduler, b)`` runs after the step in which the
    draft model prefilled its n-th chunk. Returns the two token lists and b's error."""
    from mlx_engine.runtime.scheduler import Scheduler

    def run():
        sched = Scheduler(pkit)
        a = log.start(sched, "a", short, max_tokens=40, speculative_decoding_toggle=False)
        ids, error = {"a": [], "b": []}, None
        while len(ids["a"]) < 2:  # decoding (its first rounds queue ahead before any token is read)
            ids["a"] += log.step(sched, [a])["a"]
        b = log.start(sched, "b", long, **late_kw)
        chunks, pending = 0, at_chunk
        while sched.live:
            s = log.step(sched, [a, b])
            ids["a"] += s["a"]
            ids["b"] += s["b"]
            error = error or s["b error"]
            chunks += sum(1 for m, _ in s["prefills"] if m == "draft")
            if pending is not None and chunks >= pending[0] and b in sched.live:
                pending[1](sched, b)
                pending = None
        return ids["a"], ids["b"], error

    return pkit.worker.call(run)


def _solo_kit(llama_path, draft_path):
    one = me.load_model(llama_path, max_parallel=1)
    me.load_draft_model(one, draft_path)
    one.eos_token_ids = set()
    return one


@pytest.mark.parametrize(
    "mode,main_cached",
    [({"num_draft_tokens": 3}, False), ({"auto_speculative": True}, False), ({"num_draft_tokens": 3}, True)],
)
def test_a_draft_model_request_prefills_its_draft_between_the_others_steps(
    pkit, llama_path, draft_path, monkeypatch, mode, main_cached
):
    """Admitting a draft-model (or auto) request with a long prompt: the draft
    model's prompt is prefilled one chunk per step, as the main model's is,
    while the running row decodes a token every step; outputs equal solo ones."""
    from mlx_engine.request import pipeline

    monkeypatch.setattr(pipeline, "INTERLEAVED_PREFILL_CHUNK", 64)
    pkit.eos_token_ids = set()  # the random model must not end early
    one = _solo_kit(llama_path, draft_path)
    short, long = me.tokenize(pkit, TEXTS[0]), me.tokenize(pkit, TEXTS[3] * 10)
    assert len(long) > 4 * 64
    log = _StepLog(pkit, monkeypatch)
    if main_cached:  # only the draft model has the prompt to prefill
        solo(pkit, long, max_tokens=1, speculative_decoding_toggle=False)
    a_ids, b_ids, _ = _draft_request_admitted_while_one_decodes(pkit, log, short, long, max_tokens=12, **mode)
    prefilling = [s for s in log.steps if any(m == "draft" for m, _ in s["prefills"])]
    assert len(prefilling) >= 4  # ceil((len(long) - 1) / 64) chunks, one per step
    assert sum(n for s in prefilling for m, n in s["prefills"] if m == "draft") == len(long) - 1
    for s in prefilling:
        assert [n for m, n in s["prefills"] if m == "draft"] in ([64], [(len(long) - 1) % 64 or 64])
        assert len(s["a"]) == 1, "\n".join(map(repr, log.steps))  # the running row decoded in every one of those steps
    assert_same_or_near_tie(pkit, short, solo(one, short, max_tokens=40), a_ids)
    assert_same_or_near_tie(pkit, long, solo(one, long, max_tokens=12, **mode), b_ids)


@pytest.mark.parametrize("how", ["close", "stop"])
def test_a_request_ended_mid_draft_prefill_leaves_a_reusable_draft_cache(
    pkit, llama_path, draft_path, monkeypatch, how
):
    """Closed or stopped between two draft prefill chunks: the draft cache goes
    back to the pool holding exactly the chunks prefilled (never lent out as if
    complete); the next request with that prompt prefills only the rest, and
    every output equals its solo output."""
    from mlx_engine.request import pipeline

    monkeypatch.setattr(pipeline, "INTERLEAVED_PREFILL_CHUNK", 64)
    pkit.eos_token_ids = set()
    one = _solo_kit(llama_path, draft_path)
    short, long = me.tokenize(pkit, TEXTS[0]), me.tokenize(pkit, TEXTS[3] * 10)
    log = _StepLog(pkit, monkeypatch)

    def end(sched, b):
        if how == "close":
            sched.close(b)
        else:
            me.stop_generation(pkit, "b")  # seen at the next chunk

    a_ids, b_ids, error = _draft_request_admitted_while_one_decodes(
        pkit, log, short, long, at_chunk=(2, end), max_tokens=12, num_draft_tokens=3
    )
    assert b_ids == [] and error is None
    assert_same_or_near_tie(pkit, short, solo(one, short, max_tokens=40), a_ids)
    draft = pkit.draft
    assert not draft.lent
    held = max([draft.first_cache, *draft.spare], key=len)
    assert held.tokens == long[: 2 * 64] and held.layers[0].offset == 2 * 64
    del log.prefills[:]
    ids = solo(pkit, long, max_tokens=12, num_draft_tokens=3)
    assert sum(n for m, n in log.prefills if m == "draft") == len(long) - 1 - 2 * 64  # only the rest
    assert_same_or_near_tie(pkit, long, solo(one, long, max_tokens=12, num_draft_tokens=3), ids)


def test_a_failing_draft_prefill_fails_its_request_alone(pkit, llama_path, draft_path, monkeypatch):
    """The draft model failing on a prompt chunk fails that request only: the
    running row decodes on, exact; the failed request's draft cache is reset
    (nothing half-computed is lent again) and the kit serves the prompt next."""
    from mlx_engine.caches.sequence import SequenceCache
    from mlx_engine.request import pipeline

    monkeypatch.setattr(pipeline, "INTERLEAVED_PREFILL_CHUNK", 64)
    pkit.eos_token_ids = set()
    one = _solo_kit(llama_path, draft_path)
    short, long = me.tokenize(pkit, TEXTS[0]), me.tokenize(pkit, TEXTS[3] * 10)
    log = _StepLog(pkit, monkeypatch)
    logged, calls = SequenceCache.prefill, [0]

    def failing(cache, tokens, *a, **kw):
        if cache.model is pkit.draft.model:
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected draft prefill failure")
        return logged(cache, tokens, *a, **kw)

    monkeypatch.setattr(SequenceCache, "prefill", failing)
    a_ids, b_ids, error = _draft_request_admitted_while_one_decodes(
        pkit, log, short, long, max_tokens=12, num_draft_tokens=3
    )
    assert isinstance(error, RuntimeError) and "injected" in str(error) and b_ids == []
    assert_same_or_near_tie(pkit, short, solo(one, short, max_tokens=40), a_ids)
    # Its draft cache (the pool's only one: the running row is plain) held two chunks; it was reset.
    assert not pkit.draft.lent and not pkit.draft.spare
    assert len(pkit.draft.first_cache) == 0 and pkit.draft.first_cache.layers[0].offset == 0
    monkeypatch.setattr(SequenceCache, "prefill", logged)
    ids = solo(pkit, long, max_tokens=12, num_draft_tokens=3)
    assert_same_or_near_tie(pkit, long, solo(one, long, max_tokens=12, num_draft_tokens=3), ids)


@pytest.mark.slow
def test_lookup_rows_draft_together_in_a_batch_and_stay_exact(llama_path, monkeypatch):
    """Four fixed-length lookup requests copying a passage of their prompt: at
    costs where one row's drafts never pay for a 4-row pass, the copying rows
    draft together (each prices its drafts with the others' posts on the kit's
    board), outputs equal their solo ones, and every post is gone at the end."""
    kit = markov_kit(llama_path)  # greedy continuation of t is t+1: each answer copies its passage
    # A pass costs a fixed part plus 10% of a step per token: alone in 4 rows a
    # 96% draft does not pay, four of them do (test_batch_costs).
    width_costs = CostModel(tuple(0.01 * (1 + 0.1 * (n - 1)) for n in range(1, 34)))
    monkeypatch.setattr(kit, "forward_costs", lambda: width_costs)
    # Priced as 4 rows to the end (rows that finish first would leave the last ones alone).
    monkeypatch.setattr(type(kit), "open_generations", property(lambda kit: 4))
    prompts = [list(range(b, b + 40)) + [5] + list(range(b, b + 3)) for b in (20, 80, 140, 200)]
    want = [solo(markov_kit(llama_path), p, max_tokens=36) for p in prompts]

    def run(board_on: bool):
        if not board_on:
            monkeypatch.setattr(kit.drafting_rows, "beside", lambda row, rows: [])
        gens = [me.create_generator(kit, p, max_tokens=36, prompt_lookup_num_tokens=8) for p in prompts]
        results = [[] for _ in gens]
        finals = [None] * len(gens)
        while any(f is None for f in finals):
            for i, g in enumerate(gens):
                if finals[i] is None:
                    r = next(g)
                    results[i] += [t.id for t in r.tokens]
                    finals[i] = r if r.stop_condition is not None else None
        return results, finals

    got, finals = run(board_on=True)
    assert got == want
    assert sum(f.stats.drafted_tokens for f in finals) > 0
    assert kit.drafting_rows.beside(None, 1) == []
    _, alone = run(board_on=False)  # each row priced alone: no draft pays for a 4-row batch
    assert sum(f.stats.drafted_tokens for f in alone) == 0


@pytest.mark.parametrize("max_parallel", [1, 2])
def test_admission_timeout_waits_for_a_slot_to_free(llama_path, max_parallel):
    """With every slot open, ``admission_timeout`` waits on the kit's own
    registry (woken when a generation ends) instead of refusing at once; without
    it, or when no slot frees in time, GenerationInProgressError as before."""
    kit = me.load_model(llama_path, max_parallel=max_parallel)
    prompt = me.tokenize(kit, "def add(a, b):\n")
    held = [me.create_generator(kit, prompt, max_tokens=4) for _ in range(max_parallel)]
    with pytest.raises(me.GenerationInProgressError):
        me.create_generator(kit, prompt, max_tokens=4)
    with pytest.raises(me.GenerationInProgressError):
        me.create_generator(kit, prompt, max_tokens=4, admission_timeout=0.2)
    got = []
    waiter = threading.Thread(
        target=lambda: got.append(me.create_generator(kit, prompt, max_tokens=4, admission_timeout=60))
    )
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not got  # still waiting: every slot is open
    held[0].close()
    waiter.join(30)
    assert not waiter.is_alive() and len(got) == 1
    for gen in held[1:] + got:
        gen.close()
    assert len(generate_ids(kit, prompt, max_tokens=4)[0]) == 4  # every slot free again


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "1", True])
def test_admission_timeout_is_checked(kit, bad):
    with pytest.raises(me.InvalidArgument, match="admission_timeout") as err:
        me.create_generator(kit, [1, 2], admission_timeout=bad)
    assert err.value.param == "admission_timeout"
