"""Hybrid models (attention + recurrent state): every decoding mode equals plain
decoding and mlx-lm, rewinds of every length, turns that reuse the shared
prefix through recurrent-state checkpoints, and a hybrid draft model.

Tiny random models of nine hybrid families (fixtures/tiny_models.HYBRID_ARCHS)
plus the llama fixture as the attention-only control; all share one tokenizer."""

import mlx_engine
from mlx_engine.caches.prompt import PromptCache, branch, cache_bytes
from mlx_engine.caches.ragged import BATCHED_RECURRENT, RaggedBatch, can_batch
from mlx_engine.caches.sequence import SequenceCache, layer_rewind_reason
from mlx_engine.decode.loop import decode
from mlx_engine.decode.protocol import Launch, lazy_ids
from mlx_engine.decode.sampling import greedy_sampler

import threading

import mlx.core as mx
import pytest
from helpers import generate_ids, run_alone
from mlx_lm.generate import generate_step

from fixtures.tiny_models import HYBRID_ARCHS, make_model, perturbed_copy

FAMILIES = list(HYBRID_ARCHS)
PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def"
N = 20  # tokens per generation: enough for several rounds, short for CI


@pytest.fixture(scope="session")
def hybrid_paths(models_dir, llama_path):
    """Every family's tiny model (built once, ~0.1-0.5 s each), plus the llama control."""
    paths = {"llama": llama_path}
    for family in FAMILIES:
        paths[family] = make_model(
            models_dir / f"hybrid-{family}", family, scale=3.0, seed=1, tokenizer_from=llama_path
        )
    return paths


@pytest.fixture(scope="module")
def kits(hybrid_paths):
    """One kit per family, loaded on first use and shared by the module's tests."""
    loaded = {}

    def get(family):
        if family not in loaded:
            loaded[family] = mlx_engine.load_model(hybrid_paths[family])
        return loaded[family]

    yield get
    for kit in loaded.values():
        mlx_engine.unload(kit)


def mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(tok))
    return out


def until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """mlx-lm's stream cut where the engine stops (before the end token)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


@pytest.mark.parametrize("family", ["llama"] + FAMILIES)
def test_every_mode_equals_plain_and_mlx_lm(kits, family):
    kit = kits(family)
    prompt = mlx_engine.tokenize(kit, PROMPT)
    plain, last = generate_ids(kit, prompt, max_tokens=N, temp=0.0)
    assert last.stats.decoding_mode == "plain"
    assert plain == until_eos(mlx_lm_greedy(kit.model, prompt, N), kit.eos_token_ids)
    # Prompt lookup drafts the earlier answer from the suffix memory (the known answer);
    # auto routes; both speculate on the hybrid instead of falling back.
    for kw, mode in (({"prompt_lookup_num_tokens": 8}, "prompt_lookup"), ({"auto_speculative": True}, "auto:")):
        ids, last = generate_ids(kit, prompt, max_tokens=N, temp=0.0, **kw)
        assert ids == plain, kw
        assert last.stats.decoding_mode.startswith(mode), last.stats.mode_reason
        assert "fell back" not in last.stats.mode_reason
        assert last.stats.accepted_tokens > 0, kw


class ScriptedDrafter:
    """Drafts the known answer with the draft after ``j`` correct ones made
    wrong, ``j`` cycling through 0..k: rounds accept every count from none to
    all, so the cache is rewound by every length."""

    name = "scripted"

    def __init__(self, prompt_len: int, answer: list[int], k: int, vocab: int):
        self.prompt_len, self.answer, self.k, self.vocab = prompt_len, answer, k, vocab
        self.rounds = 0
        self.accepted: list[tuple[int, int]] = []

    def propose(self, history, limit):
        i = len(history) - self.prompt_len
        drafts = list(self.answer[i : i + min(limit, self.k)])
        wrong = self.rounds % (self.k + 1)
        self.rounds += 1
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % self.vocab
        return drafts

    def observe(self, drafted, accepted, seconds=None):
        if drafted:
            self.accepted.append((drafted, accepted))


@pytest.mark.parametrize("family", FAMILIES)
def test_rewinds_of_every_length(kits, family):
    kit, k = kits(family), 4
    prompt = mlx_engine.tokenize(kit, PROMPT)
    answer = mlx_lm_greedy(kit.model, prompt, 2 * N)
    drafter = ScriptedDrafter(len(prompt), answer, k, kit.vocab_size)
    cache = SequenceCache(kit.model)
    cache.prefill(prompt[:-1])
    steps = decode(cache, list(prompt), 2 * N, greedy_sampler, [], 4096, drafter)
    out = [s.token for s in run_alone(steps)]
    assert out == answer
    assert {a for d, a in drafter.accepted if d == k} == set(range(k + 1))


def run_batched(batch: RaggedBatch, loops: list) -> list[list[int]]:
    """Drive several ``decode`` loops as the scheduler does: each step, every
    loop's launch is one row of a single batched forward pass."""
    outs: list[list[int]] = [[] for _ in loops]
    sent: list = [None] * len(loops)
    live = set(range(len(loops)))
    while live:
        launches = {}
        for i in sorted(live):
            while True:
                try:
                    item = loops[i].send(sent[i])
                except StopIteration:
                    live.discard(i)
                    break
                sent[i] = None
                if isinstance(item, Launch):
                    launches[i] = item
                    break
                outs[i].append(item.token)
        for i, launch in launches.items():
            if launch.cache not in batch:
                batch.join(launch.cache)
        ids = [lazy_ids(launch) for launch in launches.values()]
        out = batch.feed([(l.cache, l.known, x) for l, x in zip(launches.values(), ids)])
        for (i, launch), (logits, start), x in zip(launches.items(), out, ids):
            sent[i] = launch.finish(logits, start, x)
    return outs


@pytest.mark.parametrize("family", sorted(BATCHED_RECURRENT))
def test_padded_rows_keep_their_state_exact(kits, family):
    """A row padded in one pass (3 tokens beside 1, then a row riding along on
    nothing) continues exactly as alone: padding never enters its recurrent
    state. (mlx-lm's nemotron_h and jamba fail this: their rows run alone.)"""
    kit = kits(family)
    rows = [SequenceCache(kit.model) for _ in range(3)]
    alone = [SequenceCache(kit.model) for _ in range(3)]
    starts = ([5, 6, 7, 8], [9, 10, 11], [12, 13])
    for cache, start in zip(rows + alone, starts + starts):
        cache.prefill(start)
    batch = RaggedBatch(kit.model, rows[0].layers)
    for cache in rows:
        batch.join(cache)
    passes = ([[20, 21, 22], [30], None], [[23], [31], [40]])
    for feeds in passes:
        out = batch.feed([(c, f, None) for c, f in zip(rows, feeds) if f is not None])
        want = [c.feed(f) for c, f in zip(alone, feeds) if f is not None]
        for (logits, _), w in zip(out, want):
            assert mx.allclose(logits, w, atol=1e-4).item()
    for cache in rows:
        batch.leave(cache)
    for cache, solo in zip(rows, alone):
        assert mx.allclose(cache.feed([50])[-1], solo.feed([50])[-1], atol=1e-4).item()


def test_families_that_pad_wrongly_run_alone(kits):
    for family in ("nemotron_h", "jamba"):
        assert not can_batch(SequenceCache(kits(family).model))
    assert can_batch(SequenceCache(kits("qwen3_next").model))


@pytest.mark.parametrize("family", sorted(BATCHED_RECURRENT))
def test_rewinds_of_every_length_inside_a_batch(kits, family):
    """Rows drafting 3 and 4 tokens (so the narrower is padded), each rewound
    by every length in turn inside the shared passes, give mlx-lm's output."""
    kit = kits(family)
    prompts = [mlx_engine.tokenize(kit, PROMPT), mlx_engine.tokenize(kit, "Hello world! Bonjour")]
    drafters, loops = [], []
    for prompt, k in zip(prompts, (3, 4)):
        answer = mlx_lm_greedy(kit.model, prompt, 2 * N)
        drafters.append((ScriptedDrafter(len(prompt), answer, k, kit.vocab_size), answer, k))
        cache = SequenceCache(kit.model)
        cache.prefill(prompt[:-1])
        loops.append(decode(cache, list(prompt), 2 * N, greedy_sampler, [], 4096, drafters[-1][0]))
    batch = RaggedBatch(kit.model, SequenceCache(kit.model).layers)
    outs = run_batched(batch, loops)
    for out, (drafter, answer, k) in zip(outs, drafters):
        assert out == answer
        assert {a for d, a in drafter.accepted if d == k} == set(range(k + 1))


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2", "falcon_h1"])
def test_cache_rewind_lands_on_a_kept_state_and_feeds_the_rest(kits, family):
    """rewind_to restores the state before the pass and reports where it landed;
    feeding the rest from there gives the logits of a cache fed straight."""
    kit = kits(family)
    tokens = mlx_engine.tokenize(kit, PROMPT)
    head, tail = tokens[:8], tokens[8:13]
    for j in range(len(tail) + 1):
        cache = SequenceCache(kit.model)
        cache.feed(head)
        cache.feed(tail)
        kept = cache.rewind_to(len(head) + j)
        assert kept == (len(head) + j if j == len(tail) else len(head))  # the state before the tail's pass
        logits = cache.feed(tokens[kept : len(head) + j + 1])[-1]
        want = SequenceCache(kit.model).feed(tokens[: len(head) + j + 1])[-1]
        assert mx.allclose(logits, want, atol=1e-4).item(), j


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "lfm2", "falcon_h1", "jamba"])
def test_next_turn_regenerate_and_edit_reuse_checkpoints(kits, hybrid_paths, family):
    kit = kits(family)
    kit.replace_prompt_cache(kit.new_cache(kit.model))
    a = mlx_engine.tokenize(kit, PROMPT)
    answer, first = generate_ids(kit, a, max_tokens=12, temp=0.0)
    turn = a + answer + mlx_engine.tokenize(kit, "\nfor i in range(10):")
    edit = a + answer + mlx_engine.tokenize(kit, "\nHello world!")
    fresh = mlx_engine.load_model(hybrid_paths[family])
    try:
        for prompt, least in ((turn, len(a) + len(answer) - 1), (a, len(a) - 1), (edit, len(a) + len(answer) - 1)):
            ids, last = generate_ids(kit, prompt, max_tokens=8, temp=0.0)
            assert last.stats.cached_tokens >= least, (last.stats.cached_tokens, least)
            fresh.replace_prompt_cache(fresh.new_cache(fresh.model))
            want, cold = generate_ids(fresh, prompt, max_tokens=8, temp=0.0)
            assert cold.stats.cached_tokens == 0
            assert ids == want
        assert generate_ids(kit, a, max_tokens=12, temp=0.0)[0] == answer  # regenerate: the same answer
    finally:
        mlx_engine.unload(fresh)


def test_branch_shares_the_checkpoint_and_memory_counts_it(kits):
    kit = kits("qwen3_next")
    tokens = mlx_engine.tokenize(kit, PROMPT)
    cache = SequenceCache(kit.model)
    cache.prefill(tokens[:10])
    cache.checkpoint()
    before = cache_bytes(cache)
    cache.feed(tokens[10:])
    assert cache_bytes(cache) > before  # the checkpoint's state and the current one both count
    out = branch(cache, 12, lambda: SequenceCache(kit.model))
    assert out.tokens == tokens[:10]  # the latest kept state at or before 12
    assert len(cache.tokens) == len(tokens)  # the original is intact
    want = SequenceCache(kit.model).feed(tokens[:11])[-1]
    assert mx.allclose(out.feed(tokens[10:11])[-1], want, atol=1e-4).item()


def test_layer_capability_check():
    class Opaque:
        def is_trimmable(self):
            return False

    assert layer_rewind_reason(Opaque()) == "Opaque layers cannot be rewound"
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

    assert layer_rewind_reason(CacheList(ArraysCache(2), KVCache())) is None
    assert layer_rewind_reason(CacheList(ArraysCache(2), Opaque())) == "Opaque layers cannot be rewound"


@pytest.fixture(scope="module")
def hybrid_draft(models_dir, hybrid_paths):
    """A hybrid draft for the qwen3_5 target: its weights with a little noise,
    so it agrees on about half the tokens (rounds of every kind)."""
    return perturbed_copy(hybrid_paths["qwen3_5"], models_dir / "hybrid-draft", noise=0.01)


def test_hybrid_draft_for_a_hybrid_target(kits, hybrid_draft):
    kit = kits("qwen3_5")
    report = mlx_engine.check_draft_model(kit, hybrid_draft)
    assert report.compatible, report.reasons
    prompt = mlx_engine.tokenize(kit, PROMPT)
    plain, _ = generate_ids(kit, prompt, max_tokens=2 * N, temp=0.0)
    mlx_engine.load_draft_model(kit, hybrid_draft)
    try:
        ids, last = generate_ids(kit, prompt, max_tokens=2 * N, temp=0.0, num_draft_tokens=4)
        assert ids == plain
        # Drafts both accepted and rejected: the draft's own recurrent state was rewound.
        assert 0 < last.stats.accepted_tokens < last.stats.drafted_tokens
        for kw in ({}, {"auto_speculative": True}):
            ids, last = generate_ids(kit, prompt, max_tokens=2 * N, temp=0.0, **kw)
            assert ids == plain, kw
            assert "fell back" not in last.stats.mode_reason
    finally:
        mlx_engine.unload_draft_model(kit)


@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid"])
def test_seeded_sampling_is_the_same_text_in_every_mode(kits, family):
    kit = kits(family)
    prompt = mlx_engine.tokenize(kit, PROMPT)
    kw = dict(max_tokens=N, temp=0.8, seed=3)
    plain, _ = generate_ids(kit, prompt, **kw)
    assert generate_ids(kit, prompt, prompt_lookup_num_tokens=8, **kw)[0] == plain
    assert generate_ids(kit, prompt, auto_speculative=True, **kw)[0] == plain


def test_structured_output_forced_spans_on_a_hybrid(kits):
    kit = kits("jamba")
    prompt = mlx_engine.tokenize(kit, PROMPT)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    kw = dict(max_tokens=N, temp=0.0, json_schema=schema)
    drafted, last = generate_ids(kit, prompt, **kw)
    assert last.stats.grammar_drafted_tokens > 0  # the grammar forced a span and it was verified
    assert generate_ids(kit, prompt, structured_drafting=False, **kw)[0] == drafted


@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_rows_with_speculation_equal_each_row_alone(hybrid_paths, family):
    """Three requests at once, prompt lookup drafting each one's known answer
    from the suffix memory, rows of different widths: each gives its solo
    output. The families whose recurrent layers honour per-row lengths run as
    one batch; nemotron_h and jamba run their rows alone."""
    kit = mlx_engine.load_model(hybrid_paths[family], max_parallel=3)
    try:
        texts = (PROMPT, "Hello world! Bonjour le monde.", "for i in range(10):\n    print(i")
        prompts = [mlx_engine.tokenize(kit, p) for p in texts]
        solo = [generate_ids(kit, p, max_tokens=N, temp=0.0)[0] for p in prompts]
        batched = family in BATCHED_RECURRENT
        assert (kit.batch is not None) == batched
        widest = []
        if batched:
            feed = kit.batch.feed

            def spy(inputs):
                widest.append(len(kit.batch.rows))
                return feed(inputs)

            kit.batch.feed = spy
        out: dict[int, list[int]] = {}
        ready = threading.Barrier(3)

        def run(i, kw):
            gen = mlx_engine.create_generator(kit, prompts[i], max_tokens=N, temp=0.0, **kw)
            ready.wait()
            out[i] = [t.id for r in gen for t in r.tokens]

        modes = ({"prompt_lookup_num_tokens": 8}, {"auto_speculative": True}, {})
        threads = [threading.Thread(target=run, args=(i, modes[i])) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [out[i] for i in range(3)] == solo
        if batched:
            assert max(widest) > 1  # the rows shared forward passes
    finally:
        mlx_engine.unload(kit)


def test_checkpoints_through_the_disk_tier(hybrid_paths, tmp_path):
    """An evicted hybrid entry is written with its recurrent state and read
    back for a prompt extending it; a corrupt one is refused, not used."""
    path = hybrid_paths["falcon_h1"]  # CacheList layers: a Mamba and an attention cache per block
    kit = mlx_engine.load_model(path, prompt_cache_dir=tmp_path)
    prompt = mlx_engine.tokenize(kit, PROMPT)
    answer, _ = generate_ids(kit, prompt, max_tokens=8, temp=0.0)
    mlx_engine.unload(kit)  # writes the entry
    entries = list(tmp_path.rglob("*.safetensors"))
    assert len(entries) == 1
    follow = prompt + answer + mlx_engine.tokenize(kit, " ok")
    cold = mlx_engine.load_model(path)
    want, _ = generate_ids(cold, follow, max_tokens=8, temp=0.0)
    mlx_engine.unload(cold)
    kit = mlx_engine.load_model(path, prompt_cache_dir=tmp_path)
    try:
        ids, last = generate_ids(kit, follow, max_tokens=8, temp=0.0)
        assert last.stats.cache_source == "disk"
        assert last.stats.cached_tokens >= len(prompt) + len(answer) - 1
        assert ids == want
    finally:
        mlx_engine.unload(kit)
    for entry in tmp_path.rglob("*.safetensors"):
        data = bytearray(entry.read_bytes())
        data[-5] ^= 0xFF  # inside the last tensor: only the checksum can tell
        entry.write_bytes(bytes(data))
    kit = mlx_engine.load_model(path, prompt_cache_dir=tmp_path)
    try:
        ids, last = generate_ids(kit, follow, max_tokens=8, temp=0.0)
        assert last.stats.cache_source == "none"  # refused (and deleted), not used
        assert ids == want
    finally:
        mlx_engine.unload(kit)


def test_a_cache_keeping_no_state_cannot_rewind_recurrent_layers(kits):
    """A sharded kit's caches keep no recurrent state (its followers only trim):
    speculation falls back and a rewind recomputes from the start."""
    kit = kits("lfm2")
    cache = SequenceCache(kit.model)
    cache.keep_rewind_points(0)
    assert "keep no earlier state" in cache.rewind_limit_reason()
    cache.feed([5, 6, 7])
    cache.checkpoint()
    assert cache.rewind_to(2) == 0 and cache.tokens == []


def test_a_batch_of_draft_lookup_and_plain_hybrid_rows(hybrid_paths, hybrid_draft):
    """A hybrid target and its hybrid draft, three rows at once (the draft
    model, prompt lookup, plain): both models batch their rows, each row gives
    its solo output."""
    kit = mlx_engine.load_model(hybrid_paths["qwen3_5"], max_parallel=3)
    try:
        mlx_engine.load_draft_model(kit, hybrid_draft)
        prompts = [mlx_engine.tokenize(kit, p) for p in (PROMPT, "Hello world! Bonjour le monde.", "for i in range")]
        solo = [generate_ids(kit, p, max_tokens=N, temp=0.0, speculative_decoding_toggle=False)[0] for p in prompts]
        out: dict[int, list[int]] = {}
        ready = threading.Barrier(3)
        modes = ({"num_draft_tokens": 4}, {"prompt_lookup_num_tokens": 8}, {"speculative_decoding_toggle": False})

        def run(i):
            gen = mlx_engine.create_generator(kit, prompts[i], max_tokens=N, temp=0.0, **modes[i])
            ready.wait()
            out[i] = [t.id for r in gen for t in r.tokens]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [out[i] for i in range(3)] == solo
        assert kit.batch is not None and kit.draft.batch is not None  # both models batched their rows
    finally:
        mlx_engine.unload(kit)


def test_release_keeps_an_idle_prefix_entry_whose_checkpoints_the_longer_one_lacks(kits):
    """A request's entry replaces the idle entries it extends only where it can
    resume everywhere they could: a hybrid entry computed afresh past another's
    prompt-end checkpoint does not make that entry redundant."""
    kit = kits("qwen3_next")
    tokens = mlx_engine.tokenize(kit, PROMPT)

    def made(checkpoint_at: list[int], upto: int) -> SequenceCache:
        cache, done = SequenceCache(kit.model), 0
        for n in [*checkpoint_at, upto]:
            cache.prefill(tokens[done:n])
            cache.checkpoint()
            done = n
        return cache

    for points, kept in (([], True), ([10, 12], False)):
        cache = PromptCache(lambda: SequenceCache(kit.model), budget_bytes=1 << 40)
        short = made([10], 12)  # a prompt of 10 and its answer
        longer = made(points, len(tokens) - 1)
        cache.replace_all(short)
        cache.entries.append(longer)
        cache.busy.append(longer)
        cache.release(longer)
        assert any(e is short for e in cache.entries) == kept


def test_a_disk_entry_keeps_its_checkpoints_so_a_regenerate_resumes_from_it(hybrid_paths, tmp_path):
    """The disk tier stores a hybrid entry's checkpoints too: after a restart,
    regenerating the answer resumes from the prompt-end checkpoint read from
    disk, and answers as a fresh kit does."""
    path = hybrid_paths["qwen3_next"]
    kit = mlx_engine.load_model(path, prompt_cache_dir=tmp_path)
    prompt = mlx_engine.tokenize(kit, PROMPT)
    answer, _ = generate_ids(kit, prompt, max_tokens=8, temp=0.0)
    mlx_engine.unload(kit)  # writes the entry: prompt + answer, a checkpoint at the prompt's end
    kit = mlx_engine.load_model(path, prompt_cache_dir=tmp_path)
    try:
        again, last = generate_ids(kit, prompt, max_tokens=8, temp=0.0)
        assert last.stats.cache_source == "disk"
        assert last.stats.cached_tokens == len(prompt) - 1
        assert again == answer
    finally:
        mlx_engine.unload(kit)
