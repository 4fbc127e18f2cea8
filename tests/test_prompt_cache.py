"""The prompt cache: several cached sequences, branches (checkpoints), the memory
budget, and the disk tier. A cache hit must never change the output: every
output is compared with a fresh kit's."""

import mlx_engine as me

import json
import logging

import pytest
from helpers import generate_ids

A = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
B = "for i in range(10):\n    print(i, i * i)\n\nThe quick brown fox jumps over the lazy dog. "


def turn(kit, prompt, **kw):
    """One greedy request; ``prompt`` is text or token ids."""
    prompt = me.tokenize(kit, prompt) if isinstance(prompt, str) else prompt
    ids, last = generate_ids(kit, prompt, max_tokens=6, temp=0.0, **kw)
    return ids, last.stats


@pytest.fixture
def fresh(llama_path):
    """Output of a kit that has never cached anything."""

    def run(prompt, **kw):
        return turn(me.load_model(llama_path), prompt, **kw)[0]

    return run


def test_switching_between_two_chats_reuses_each(kit, fresh):
    a1, s = turn(kit, A)
    b1, _ = turn(kit, B)
    a2_prompt = me.tokenize(kit, A) + a1 + me.tokenize(kit, "\n# next\n")  # the next turn of chat A
    a2, s = turn(kit, a2_prompt)
    assert s.cache_source == "memory" and s.cached_tokens == len(me.tokenize(kit, A)) + len(a1) - 1
    assert s.cache_entries == 2
    assert a2 == fresh(a2_prompt)
    b2_prompt = me.tokenize(kit, B) + b1 + me.tokenize(kit, " again")
    b2, s = turn(kit, b2_prompt)
    assert s.cache_source == "memory" and s.cached_tokens == len(me.tokenize(kit, B)) + len(b1) - 1
    assert b2 == fresh(b2_prompt)


def test_regenerate_and_edit_branch_from_a_checkpoint(kit, fresh):
    prompt = me.tokenize(kit, A)
    first, _ = generate_ids(kit, prompt, max_tokens=8, temp=1.0, seed=1)
    again, last = generate_ids(kit, prompt, max_tokens=8, temp=1.0, seed=2)  # regenerate
    assert last.stats.cache_source == "branch" and last.stats.cached_tokens == len(prompt) - 1
    if again != first:
        # The first answer is still a checkpoint: continuing it reuses all of it.
        cont = prompt + first + me.tokenize(kit, "\n# more")
        _, last = generate_ids(kit, cont, max_tokens=4, temp=0.0)
        assert last.stats.cached_tokens >= len(prompt) + len(first) - 1
    edited = A.replace("return a + b", "return a - b")
    ids, s = turn(kit, edited)
    assert s.cache_source == "branch" and 0 < s.cached_tokens < len(me.tokenize(kit, edited))
    assert ids == fresh(edited)


def test_identical_regenerations_do_not_pile_up(kit):
    for _ in range(4):
        turn(kit, A)
    assert len(kit.prompt_cache.entries) == 1


def test_lru_eviction_under_a_byte_budget(llama_path, caplog):
    caplog.set_level(logging.DEBUG, logger="mlx_engine")
    kit = me.load_model(llama_path)
    turn(kit, A)
    per_entry = kit.prompt_cache.memory_bytes()
    kit = me.load_model(llama_path, prompt_cache_bytes=int(2.5 * per_entry))
    texts = [A, B, A + " # x", "class Stack:\n    pass\n" * 3]
    for t in texts:
        turn(kit, t)
        assert kit.prompt_cache.memory_bytes() <= kit.prompt_cache.budget_bytes or len(kit.prompt_cache.entries) == 1
    kept = [kit.tokenizer.decode(e.tokens[:5]) for e in kit.prompt_cache.entries]
    assert not any(k.startswith("for i") for k in kept)  # B, the least recently used, went first
    # Routine for a host: at DEBUG, never at INFO.
    evictions = [r for r in caplog.records if "evicted" in r.getMessage()]
    assert evictions and all(r.levelno == logging.DEBUG for r in evictions)


def test_disk_tier_survives_a_restart(llama_path, tmp_path, fresh):
    kit = me.load_model(llama_path, prompt_cache_dir=tmp_path, prompt_cache_bytes=0)  # every other entry spills
    a1, _ = turn(kit, A)
    turn(kit, B)  # A is evicted to disk
    me.unload(kit)  # B is flushed to disk
    restarted = me.load_model(llama_path, prompt_cache_dir=tmp_path)
    prompt = me.tokenize(restarted, A) + a1 + me.tokenize(restarted, "\n# next\n")
    ids, s = turn(restarted, prompt)
    assert s.cache_source == "disk" and s.cached_tokens == len(me.tokenize(restarted, A)) + len(a1) - 1
    assert ids == fresh(prompt)


def test_corrupt_disk_entries_are_ignored(llama_path, tmp_path, fresh, caplog):
    kit = me.load_model(llama_path, prompt_cache_dir=tmp_path)
    turn(kit, A)
    me.unload(kit)
    files = list(tmp_path.rglob("*.safetensors"))
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    restarted = me.load_model(llama_path, prompt_cache_dir=tmp_path)
    ids, s = turn(restarted, A)
    assert s.cache_source == "none" and s.cached_tokens == 0
    assert ids == fresh(A)
    assert "corrupt" in caplog.text
    assert not list(tmp_path.rglob("*.safetensors"))  # deleted, never loaded


def test_a_different_model_never_reads_the_entries(llama_path, qwen_path, tmp_path):
    kit = me.load_model(llama_path, prompt_cache_dir=tmp_path)
    turn(kit, A)
    me.unload(kit)
    other = me.load_model(qwen_path, prompt_cache_dir=tmp_path)
    _, s = turn(other, A)
    assert s.cache_source == "none"
    dtype = me.load_model(llama_path, prompt_cache_dir=tmp_path, compute_dtype="float16")
    _, s = turn(dtype, A)
    assert s.cache_source == "none"
    me.unload(other)
    me.unload(dtype)
    assert len({p.parent for p in tmp_path.rglob("*.json")}) == 3  # one folder per identity
    meta = json.loads(next(tmp_path.rglob("*.json")).read_text())
    assert set(meta) == {"tokens", "sha256", "bytes"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prompt_cache_bytes": -1}, "prompt_cache_bytes"),
        ({"prompt_cache_disk_bytes": "1GB"}, "prompt_cache_disk_bytes"),
        ({"prompt_cache_dir": ""}, "prompt_cache_dir"),
    ],
)
def test_bad_prompt_cache_options(llama_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        me.load_model(llama_path, **kwargs)


def test_auto_context_fits_memory_and_refuses_longer_prompts(llama_path, monkeypatch):
    from mlx_engine.loading import memory as context

    kit = me.load_model(llama_path, max_kv_size="auto")
    assert kit.context_length == 4096  # the fixture's trained context fits easily
    per_token = context.kv_bytes_per_token(kit.model)
    assert per_token == 2 * 2 * 2 * 16 * 4  # 2 layers x (keys, values) x 2 KV heads x 16 dims x float32
    monkeypatch.setattr(context, "available_memory", lambda: 2 * 64 * per_token)  # room for 64 tokens
    small = me.load_model(llama_path, max_kv_size="auto")
    assert small.context_length == 64
    with pytest.raises(ValueError, match="leave no room in this kit's context of 64 tokens"):
        me.create_generator(small, list(range(3, 70)), max_tokens=4)
    ids, last = generate_ids(small, list(range(3, 60)), max_tokens=50, temp=0.0)
    assert len(ids) == 64 - 57 and last.stop_condition.stop_reason == "token_limit"


def test_prefill_chunk_shrinks_when_memory_is_short(monkeypatch):
    from mlx_engine.loading import memory as context

    monkeypatch.setattr(context, "available_memory", lambda: 64 * 2**30)
    assert context.prefill_chunk(49152, 576) == 512
    monkeypatch.setattr(context, "available_memory", lambda: 200 * 2**20)  # a quarter: 50 MB; 128 tokens take 30
    assert context.prefill_chunk(49152, 576) == 128
    monkeypatch.setattr(context, "available_memory", lambda: 1)
    assert context.prefill_chunk(49152, 576) == context.MIN_PREFILL_CHUNK
