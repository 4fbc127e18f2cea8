"""GGUF ``qwen35`` (Qwen3.5/3.6 dense): a tiny random-weight model converted as
llama.cpp's converter does (fixtures/gguf_families.py: value heads tiled,
-exp(A_log), squeezed conv kernels, one MTP block) loads as mlx-lm's
``qwen3_5``, computes its source model's logits, keeps its MTP head, and
decodes as every hybrid model does. Against llama.cpp: tests/test_gguf_llamacpp.py."""

import mlx_engine as me

import mlx.core as mx
import numpy as np
import pytest
from helpers import FAMILY_PROMPT as PROMPT
from helpers import (
    assert_batched_rows_equal_solo,
    assert_lookup_exact_and_next_turn_cached,
    assert_same_or_near_tie,
    generate_ids,
)
from mlx.utils import tree_flatten

from fixtures.gguf_families import arch_metadata, bpe_metadata, gguf_tensors, reference_model, write_gguf

FAMILIES = {
    "qwen35": "mlx_lm.models.qwen3_5",
    "qwen35moe": "mlx_lm.models.qwen3_5_moe",
    "qwen3next": "mlx_lm.models.qwen3_next",
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Per family: work folder, tokenizer metadata, source model, config and
    GGUF tensors (converted once for the module)."""
    cache = {}

    def get(family):
        if family not in cache:
            work = tmp_path_factory.mktemp(family)
            (work / "bpe").mkdir()
            tok = bpe_metadata(work / "bpe")
            model, config = reference_model(family, len(tok["tokenizer.ggml.tokens"]))
            cache[family] = (family, work, tok, model, config, gguf_tensors(model, config, family))
        return cache[family]

    return get


@pytest.fixture(scope="module")
def source(sources):
    return sources("qwen35")


def _file(source, name, qtype="F32", tensors=None, metadata=None, drop=()):
    family, work, tok, _, config, all_tensors = source
    meta = {**arch_metadata(family, config), **tok, **(metadata or {})}
    merged = {**all_tensors, **(tensors or {})}
    return write_gguf(work / f"{name}.gguf", family, {k: v for k, v in merged.items() if k not in drop},
                      {k: v for k, v in meta.items() if k not in drop}, qtype)  # fmt: skip


@pytest.fixture(scope="module")
def f32_kits(sources):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = me.load_model(_file(sources(family), "f32"))
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_qwen35_is_mlx_lms_class_and_computes_its_source(sources, f32_kits, family):
    """Linear-attention layers in ``ArraysCache`` (so rewinds, checkpoints and
    batching apply), the value heads back in grouped order, A_log, the conv
    kernel, the +1 norms used as stored: the F32 file gives the source's
    logits (measured 6.3e-7 relative RMS; qwen35moe, with its experts and
    gated shared expert, 6.6e-7)."""
    from mlx_engine.caches.ragged import can_batch
    from mlx_engine.caches.sequence import SequenceCache

    from mlx_lm.models.cache import ArraysCache

    kit = f32_kits(family)
    assert type(kit.model).__module__ == FAMILIES[family]
    assert [type(c) for c in kit.model.make_cache()][:2] == [ArraysCache, type(kit.model.make_cache()[1])]
    assert ArraysCache in {type(c) for c in kit.model.make_cache()} and can_batch(SequenceCache(kit.model))
    ids = mx.array(me.tokenize(kit, PROMPT))[None]
    got, want = kit.model(ids), sources(family)[3](ids)
    assert (mx.sqrt(((got - want) ** 2).mean()) / mx.sqrt((want**2).mean())).item() <= 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_mtp_head_is_kept_under_its_hugging_face_names(sources, f32_kits, family):
    """The ``nextn`` block (``nextn_predict_layers`` 1) is not dropped: it is
    ``model.mtp.weights``, not a model parameter, with the converter's names
    reversed and the values as stored."""
    kit = f32_kits(family)
    mtp = kit.model.mtp.weights
    n, tensors = sources(family)[4]["num_hidden_layers"], sources(family)[5]
    assert np.array_equal(np.array(mtp["mtp.fc.weight"]), tensors[f"blk.{n}.nextn.eh_proj.weight"])
    assert np.array_equal(np.array(mtp["mtp.pre_fc_norm_hidden.weight"]), tensors[f"blk.{n}.nextn.hnorm.weight"])
    assert np.array_equal(np.array(mtp["mtp.layers.0.self_attn.q_proj.weight"]), tensors[f"blk.{n}.attn_q.weight"])
    assert {"mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.self_attn.o_proj.weight"} <= set(mtp)
    assert not any("mtp" in k for k, _ in tree_flatten(kit.model.parameters()))
    if family == "qwen35moe":  # its MTP block has experts too: kept quantized as the model's
        assert "mtp.layers.0.mlp.switch_mlp.gate_proj.weight" in mtp


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_files_mtp_head_drafts_as_the_hugging_face_head_it_came_from(sources, f32_kits, family, tmp_path):
    """``load_draft_model(kit, "mtp")`` on a GGUF kit drafts with the ``nextn``
    block its load kept: greedy equals plain, and it drafts token for token as
    the Hugging Face ``mtp.*`` head the converter wrote it from (the converter
    adds 1 to every norm, ``enorm``/``hnorm`` included: the folder holds them without it)."""
    import json

    kit = f32_kits(family)
    report = me.check_draft_model(kit, "mtp")
    assert report.compatible and report.kind == "qwen3_5_mtp", report.reasons
    hf = tmp_path / "hf_mtp"
    hf.mkdir()
    norms = ("norm.weight", "norm_embedding.weight", "norm_hidden.weight")  # enorm/hnorm in the file's names
    weights = {k: v - 1.0 if k.endswith(norms) else v for k, v in kit.model.mtp.weights.items()}
    mx.save_safetensors(str(hf / "model.safetensors"), weights)
    text = {k: v for k, v in kit.config.items() if k != "quantization"}
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen3_5_mtp", "text_config": text}))
    prompt = me.tokenize(kit, PROMPT)
    plain, _ = generate_ids(kit, prompt, max_tokens=16, temp=0.0)
    tokens = mx.array([prompt[1:6]], dtype=mx.uint32)
    hidden = mx.random.normal((1, 5, kit.config["hidden_size"]), key=mx.random.key(1))
    runs, logits = [], []
    for draft in ("mtp", hf):
        me.load_draft_model(kit, draft)
        try:
            head = kit.draft.head
            logits.append(head.logits(head.forward(head.new_cache(), tokens, hidden, 0)))
            ids, final = generate_ids(kit, prompt, max_tokens=16, temp=0.0, num_draft_tokens=3)
        finally:
            me.unload_draft_model(kit)
        assert_same_or_near_tie(kit, prompt, plain, ids)
        runs.append((ids, final.stats.drafted_tokens, final.stats.accepted_tokens))
    assert mx.allclose(logits[0], logits[1], atol=1e-4).item()
    assert runs[0] == runs[1] and runs[0][1] > 0


@pytest.fixture(scope="module")
def q8_files(sources):
    return {family: _file(sources(family), "q8", "Q8_0") for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_qwen35_speculates_exactly_and_the_next_turn_reuses_the_cache(q8_files, family):
    """Prompt lookup speculates on the delta-net state (no fallback) and gives
    plain greedy's tokens; the next turn resumes from a checkpoint and answers
    as a fresh kit does."""
    assert_lookup_exact_and_next_turn_cached(q8_files[family], PROMPT, max_tokens=10, lookup_tokens=3, turn_tokens=6)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_qwen35_parallel_requests_equal_their_solo_outputs(q8_files, family):
    """Batched rows (the delta-net state per row, with its lengths) equal solo runs."""
    assert_batched_rows_equal_solo(q8_files[family], max_parallel=3, max_tokens=8)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(drop=["blk.0.ssm_a"]), r"lacks 'blk\.0\.ssm_a' \(layer 0, linear\)"),
        (dict(drop=["blk.1.attn_k_norm.weight"]), r"lacks 'blk\.1\.attn_k_norm\.weight' \(layer 1, attention\)"),
        (dict(drop=["qwen35.ssm.state_size"]), r"lacks the metadata field 'qwen35\.ssm\.state_size'"),
        (dict(metadata={"qwen35.ssm.inner_size": 128}), r"'qwen35\.ssm\.inner_size' must be state_size \* time_step_rank"),
        (dict(metadata={"qwen35.ssm.time_step_rank": 3}), r"'qwen35\.ssm\.time_step_rank' must be a multiple"),
        (dict(metadata={"qwen35.ssm.group_count": 1}), r"'blk\.0\.attn_qkv\.weight' of shape \[256, 512\]"),
        (dict(tensors={"blk.0.ssm_a": np.full(4, 0.5, np.float32)}), r"ssm_a\) holds A = -exp\(A_log\)"),
        (dict(metadata={"qwen35.nextn_predict_layers": 3}), r"'qwen35\.nextn_predict_layers' must be below"),
        (dict(metadata={"qwen35.attention.recurrent_layers": np.array([0, 1, 0], np.int32)}), r"recurrent_layers"),
        (dict(drop=["blk.2.nextn.eh_proj.weight"]), r"lacks 'blk\.2\.nextn\.eh_proj\.weight' \(the MTP block"),
    ],
)  # fmt: skip
def test_a_malformed_qwen35_file_is_refused_naming_it(source, change, message):
    path = _file(source, "bad", **change)
    with pytest.raises(me.ModelLoadError, match=message) as info:
        me.load_model(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(drop=["blk.1.ffn_up_shexp.weight"]), r"lacks 'blk\.1\.ffn_up_shexp\.weight' \(layer 1, attention\)"),
        (dict(drop=["blk.0.ffn_gate_exps.weight"]), r"lacks 'blk\.0\.ffn_gate_exps\.weight'"),
        (dict(metadata={"qwen35moe.expert_count": 8}), r"'blk\.0\.ffn_gate_exps\.weight' of shape \[256, 256, 4\]"),
        (dict(tensors={"blk.0.ffn_gate_up_exps.weight": np.zeros((4, 512, 256), np.float32)}), r"fused 'ffn_gate_up_exps'"),
    ],
)  # fmt: skip
def test_a_malformed_qwen35moe_file_is_refused_naming_it(sources, change, message):
    path = _file(sources("qwen35moe"), "bad", **change)
    with pytest.raises(me.ModelLoadError, match=message) as info:
        me.load_model(path)
    assert str(path) in str(info.value)


def test_qwen3next_refuses_the_older_fused_ssm_in(sources):
    """An older converter wrote Qwen3-Next's projection fused as ``ssm_in``;
    only the current split (attn_qkv + attn_gate) is mapped."""
    path = _file(sources("qwen3next"), "bad", tensors={"blk.0.ssm_in.weight": np.zeros((1024, 256), np.float32)})
    with pytest.raises(me.ModelLoadError, match=r"fused 'ssm_in'") as info:
        me.load_model(path)
    assert str(path) in str(info.value)
