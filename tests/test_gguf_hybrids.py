"""GGUF Mamba-2 hybrids, ``nemotron_h`` (Nemotron-H: Mamba-2, attention and
MLP layers) and ``falcon-h1`` (Falcon-H1: attention and Mamba-2 in parallel),
on tiny random-weight files written as llama.cpp's converter writes them
(fixtures/gguf_hybrids.py): mlx-lm's own classes, their sources' logits, the
engine's speculation and turn checkpoints, and malformed files refused.
Against llama.cpp itself: tests/test_gguf_llamacpp.py."""

import mlx_engine as me

import mlx.core as mx
import numpy as np
import pytest
from helpers import FAMILY_PROMPT as PROMPT
from helpers import (
    assert_batched_rows_equal_solo,
    assert_lookup_exact_and_next_turn_cached,
)

from fixtures.gguf_families import (
    FAMILIES,
    arch_metadata,
    bpe_metadata,
    gguf_tensors,
    reference_model,
    write_gguf,
)

CLASSES = {"nemotron_h": "mlx_lm.models.nemotron_h", "falcon-h1": "mlx_lm.models.falcon_h1"}


def _rel(got, want) -> float:
    return (mx.sqrt(((got - want) ** 2).mean()) / mx.sqrt((want**2).mean())).item()


def _logits(model, ids):
    return model(mx.array(ids)[None]).astype(mx.float32)


@pytest.mark.parametrize("family", list(CLASSES))
def test_hybrid_is_mlx_lms_class_and_computes_its_source(family_files, family):
    """A float32 file gives its source model's logits (measured 6e-7 relative
    RMS; A is stored as -exp(A_log)): nemotron_h's per-group norm (2 groups),
    its q/k rows permuted by the converter and used as stored (no RoPE), its
    layer kinds from two per-layer fields; falcon-h1's muP multipliers folded
    in by the converter, its suffix-less pre-FFN norm. The recurrent state is
    in ``ArraysCache`` layers; falcon-h1's are batchable, nemotron_h's not
    (caches/ragged.py ``BATCHED_RECURRENT``)."""
    from mlx_engine.caches.ragged import can_batch
    from mlx_engine.caches.sequence import SequenceCache

    from mlx_lm.models.cache import ArraysCache

    path, reference, _ = family_files(family)
    kit = me.load_model(path)
    assert type(kit.model).__module__ == CLASSES[family]
    caches = kit.model.make_cache()
    assert ArraysCache in {type(c) if not hasattr(c, "caches") else type(c.caches[0]) for c in caches}
    assert can_batch(SequenceCache(kit.model)) == (family == "falcon-h1")
    ids = me.tokenize(kit, PROMPT)
    assert _rel(_logits(kit.model, ids), _logits(reference, ids)) <= 1e-4


@pytest.mark.parametrize("family", list(CLASSES))
def test_a_tied_output_is_the_embedding(tmp_path, family):
    """Without ``output.weight`` llama.cpp multiplies by the stored embedding
    (falcon-h1's scaled by its embedding multiplier, as the file holds it);
    mlx-lm's nemotron_h always has an ``lm_head``, given the embedding."""
    path, model = _changed_file(tmp_path, family, drop=["output.weight"], keep_model=True)
    kit = me.load_model(path)
    embed = model.backbone.embeddings if family == "nemotron_h" else model.model.embed_tokens
    model.lm_head.weight = embed.weight
    ids = me.tokenize(kit, PROMPT)
    assert _rel(_logits(kit.model, ids), _logits(model, ids)) <= 1e-4


def test_falcon_h1_without_the_ssm_norm_takes_any_group_count(tmp_path, monkeypatch):
    """Without ``ssm_norm`` (``mamba_rms_norm`` false) the groups only share B
    and C, which mlx-lm's scan does per group as llama.cpp's: 2 groups load
    and give the source's logits (with the norm they are refused: mlx-lm
    normalizes all groups at once)."""
    arch, config, tok = FAMILIES["falcon-h1"]
    monkeypatch.setitem(FAMILIES, "falcon-h1", (arch, dict(config, mamba_rms_norm=False, mamba_n_groups=2), tok))
    path, model = _changed_file(tmp_path, "falcon-h1", keep_model=True)
    kit = me.load_model(path)
    assert kit.config["mamba_n_groups"] == 2 and not kit.config["mamba_rms_norm"]
    ids = me.tokenize(kit, PROMPT)
    assert _rel(_logits(kit.model, ids), _logits(model, ids)) <= 1e-4


@pytest.mark.parametrize("family", list(CLASSES))
def test_hybrid_speculates_exactly_and_the_next_turn_reuses_the_cache(family_files, family):
    """On a Q8_0 file: prompt lookup speculates (no fallback) and gives plain
    greedy's tokens; the next turn resumes from a checkpoint of the recurrent
    state (cached tokens) and answers as a fresh kit does."""
    path, _, _ = family_files(family, "Q8_0")
    assert_lookup_exact_and_next_turn_cached(path, PROMPT)


def test_falcon_h1_parallel_requests_equal_their_solo_outputs(family_files):
    """Falcon-H1's layers hold a Mamba-2 state and a KV cache each (a
    ``CacheList``); batched rows must each get what they get alone."""
    path, _, _ = family_files("falcon-h1", "Q8_0")
    assert_batched_rows_equal_solo(path, max_parallel=4, max_tokens=10)


def _changed_file(tmp_path, family, tensors=None, metadata=None, drop=(), keep_model=False):
    """An F32 file of ``family`` with ``tensors``/``metadata`` entries replaced
    and the names in ``drop`` left out (tensors or metadata keys)."""
    (tmp_path / "bpe").mkdir(exist_ok=True)
    tok = bpe_metadata(tmp_path / "bpe")
    model, config = reference_model(family, len(tok["tokenizer.ggml.tokens"]))
    arch = FAMILIES[family][0]
    all_tensors = {**gguf_tensors(model, config, arch), **(tensors or {})}
    meta = {**arch_metadata(arch, config), **tok, **(metadata or {})}
    path = tmp_path / f"bad-{family}.gguf"
    write_gguf(path, arch, {k: v for k, v in all_tensors.items() if k not in drop},
               {k: v for k, v in meta.items() if k not in drop})  # fmt: skip
    return (path, model) if keep_model else path


_NH, _FH = "nemotron_h", "falcon-h1"


@pytest.mark.parametrize(
    "family, change, message",
    [
        (_NH, dict(drop=["blk.3.ssm_a"]), r"lacks 'blk\.3\.ssm_a' \(layer 3, Mamba-2"),
        (_NH, dict(drop=["blk.1.attn_v.weight"]), r"lacks 'blk\.1\.attn_v\.weight' \(layer 1, attention"),
        (_NH, dict(drop=["blk.2.ffn_down.weight"]), r"lacks 'blk\.2\.ffn_down\.weight' \(layer 2, MLP"),
        (_NH, dict(drop=["nemotron_h.ssm.inner_size"]), r"lacks the metadata field 'nemotron_h\.ssm\.inner_size'"),
        (_NH, dict(metadata={"nemotron_h.feed_forward_length": np.array([0, 0, 256], np.int32)}),
         r"'nemotron_h\.feed_forward_length'.*one per layer"),
        (_NH, dict(metadata={"nemotron_h.feed_forward_length": np.array([0, 256, 256, 0], np.int32)}),
         r"'nemotron_h\.attention\.head_count_kv'.*0 on every feed-forward layer"),
        (_NH, dict(metadata={"nemotron_h.attention.head_count_kv": np.array([0, 0, 0, 0], np.int32)}),
         r"needs both Mamba-2 and attention layers"),
        (_NH, dict(metadata={"nemotron_h.ssm.state_size": 32}), r"'blk\.0\.ssm_in\.weight' of shape \[256, 1096\]"),
        (_NH, dict(metadata={"nemotron_h.ssm.group_count": 3}), r"group_count.*divisor"),
        (_NH, dict(metadata={"nemotron_h.attention.value_length": 64}), r"value_length.*one head size"),
        (_NH, dict(metadata={"nemotron_h.attention.scale": 0.5}), r"'nemotron_h\.attention\.scale'"),
        (_NH, dict(metadata={"nemotron_h.expert_count": 4}), r"nemotron_h with experts"),
        (_NH, dict(tensors={"blk.3.ssm_a": np.full((8, 1), 0.5, np.float32)}), r"ssm_a\) holds A = -exp\(A_log\)"),
        (_FH, dict(drop=["blk.1.ffn_norm"]), r"lacks 'blk\.1\.ffn_norm' \(layer 1's pre-FFN norm\)"),
        (_FH, dict(drop=["blk.0.ssm_out.weight"]), r"lacks 'blk\.0\.ssm_out\.weight' \(layer 0\)"),
        (_FH, dict(drop=["blk.1.ssm_norm.weight"]), r"'ssm_norm' in some layers only"),
        (_FH, dict(metadata={"falcon-h1.ssm.group_count": 2}), r"falcon-h1 with 2 groups is not supported"),
        (_FH, dict(metadata={"falcon-h1.ssm.inner_size": 512}), r"'blk\.0\.ssm_in\.weight' of shape"),
        (_FH, dict(metadata={"falcon-h1.attention.scale": 0.5}), r"'falcon-h1\.attention\.scale'"),
        (_FH, dict(metadata={"falcon-h1.attention.value_length": 64}), r"value_length.*one head size"),
        (_FH, dict(tensors={"blk.0.ssm_dt.weight": np.zeros((256, 4), np.float32)}), r"'blk\.0\.ssm_dt\.weight'"),
    ],
)  # fmt: skip
def test_a_malformed_hybrid_file_is_refused_naming_it(tmp_path, family, change, message):
    path = _changed_file(tmp_path, family, **change)
    with pytest.raises(me.ModelLoadError, match=message) as info:
        me.load_model(path)
    assert str(path) in str(info.value)
