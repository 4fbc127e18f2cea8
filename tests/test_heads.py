"""Hidden-state drafters (heads/): an EAGLE-3 head on a llama target. Loading,
checking and unloading; greedy and seeded output identical to plain decoding
in every mode and in a batch; proposals equal to mlx-vlm's drafter."""

import mlx_engine as me
from mlx_engine.decode import capture
from mlx_engine.drafters.head import HeadDrafter
from mlx_engine.errors import IncompatibleDraftModelError, ModelLoadError

import json
import shutil
from collections import Counter

import mlx.core as mx
import pytest
from helpers import assert_same_or_near_tie, generate_ids, round_robin

from fixtures.tiny_heads import make_eagle3_head, make_layer_mtp_head, make_qwen3_5_mtp_head
from fixtures.tiny_models import make_model

TEXT = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("heads") / "llama4", "llama", hidden=64, layers=4, scale=3.0, seed=1)


@pytest.fixture(scope="module")
def kit(target):
    k = me.load_model(target, max_parallel=1)
    yield k
    me.unload(k)


@pytest.fixture(scope="module")
def plain(kit):
    prompt = me.tokenize(kit, TEXT)
    return prompt, generate_ids(kit, prompt, max_tokens=40)[0]


@pytest.fixture(scope="module")
def random_head(target, tmp_path_factory):
    """A random head over a reduced vocabulary (every fourth id): its drafts are all rejected."""
    return make_eagle3_head(tmp_path_factory.mktemp("e3") / "random", target, draft_vocab=100, seed=2)


@pytest.fixture(scope="module")
def frequent_head(target, plain, tmp_path_factory):
    """A head whose vocabulary is the target's three most frequent output tokens, so some drafts are accepted."""
    common = [t for t, _ in Counter(plain[1]).most_common(3)]
    return make_eagle3_head(tmp_path_factory.mktemp("e3") / "frequent", target, target_ids=common, seed=3)


def test_check_says_kind_hidden_states_and_vocabulary(kit, random_head):
    report = me.check_draft_model(kit, random_head)
    assert report.compatible and report.kind == "eagle3"
    assert report.hidden_states == (0, 1, 3)  # aux ids 1, 2, 4: outputs of layers 0, 1, 3
    assert "100 of" in report.vocabulary and "d2t" in report.vocabulary
    assert me.is_draft_model_compatible(kit, random_head)


def test_head_for_another_model_is_refused_with_the_reason(kit, target, tmp_path):
    wide = make_model(tmp_path / "wide", "llama", hidden=96, layers=4, seed=5, tokenizer_from=target)
    head = make_eagle3_head(tmp_path / "wide_head", wide, draft_vocab=100)
    report = me.check_draft_model(kit, head)
    assert not report.compatible and any("width 96" in r for r in report.reasons)
    with pytest.raises(IncompatibleDraftModelError, match="width 96"):
        me.load_draft_model(kit, head)
    deep = make_eagle3_head(tmp_path / "deep", target, aux_ids=[1, 2, 9])
    assert "eagle_aux_hidden_state_layer_ids" in me.check_draft_model(kit, deep).reasons[0]


def _broken_copy(src, out, edit):
    shutil.copytree(src, out)
    weights = mx.load(str(out / "model.safetensors"))
    edit(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda w: w.pop("midlayer.self_attn.q_proj.weight"), "lacks tensor 'layers.0.self_attn.q_proj.weight'"),
        (
            lambda w: w.update({"fc.weight": mx.zeros((64, 100))}),
            r"model.safetensors.*'fc.weight' has shape \(64, 100\)",
        ),
        (lambda w: w.update({"d2t": mx.full((100,), 10_000, dtype=mx.int64)}), "'d2t' maps draft ids outside"),
        (lambda w: w.update({"extra.weight": mx.zeros((2,))}), "'extra.weight' is not part of an EAGLE-3 head"),
        (lambda w: w.pop("d2t"), "lacks tensor 'd2t'"),
    ],
)
def test_malformed_head_is_a_model_load_error_naming_the_tensor(kit, random_head, tmp_path, edit, match):
    broken = _broken_copy(random_head, tmp_path / "broken", edit)
    with pytest.raises(ModelLoadError, match=match):
        me.load_draft_model(kit, broken)
    assert kit.draft is None  # nothing half-loaded; the kit still generates
    assert generate_ids(kit, me.tokenize(kit, TEXT), max_tokens=3)[0]


@pytest.mark.parametrize("k", [None, 1, 3, 6])
def test_greedy_output_equals_plain_and_drafts_are_accepted(kit, plain, frequent_head, k):
    prompt, want = plain
    me.load_draft_model(kit, frequent_head)
    try:
        ids, final = generate_ids(kit, prompt, max_tokens=40, num_draft_tokens=k)
    finally:
        me.unload_draft_model(kit)
    assert_same_or_near_tie(kit, prompt, want, ids)
    s = final.stats
    assert s.decoding_mode == "draft_model" and s.drafted_tokens > 0
    if k is not None:
        assert s.accepted_tokens > 0  # the chained steps and their trims are exercised


def test_random_head_in_every_mode_equals_plain_and_unload_restores_the_target(kit, plain, random_head):
    prompt, want = plain
    me.load_draft_model(kit, random_head)
    try:
        for mode in ({"num_draft_tokens": 4}, {"auto_speculative": True}, {}):
            ids, final = generate_ids(kit, prompt, max_tokens=40, **mode)
            assert_same_or_near_tie(kit, prompt, want, ids)
        assert final.stats.decoding_mode == "draft_model" and final.stats.drafted_tokens > 0
    finally:
        me.unload_draft_model(kit)
    assert not any(type(layer).__name__.startswith("Captured") for layer in capture.text_model(kit.model).layers)
    assert generate_ids(kit, prompt, max_tokens=40)[0] == want


def test_seeded_sampling_is_identical_with_the_head(kit, frequent_head):
    prompt = me.tokenize(kit, TEXT)
    kw = dict(max_tokens=30, temp=0.9, seed=7)
    want = generate_ids(kit, prompt, **kw)[0]
    me.load_draft_model(kit, frequent_head)
    try:
        for k in (None, 3):
            assert generate_ids(kit, prompt, num_draft_tokens=k, **kw)[0] == want
    finally:
        me.unload_draft_model(kit)


def test_structured_output_with_the_head_equals_plain(kit, frequent_head):
    prompt = me.tokenize(kit, "Answer: ")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    kw = dict(max_tokens=20, json_schema=json.dumps(schema))
    want = generate_ids(kit, prompt, **kw)[0]
    me.load_draft_model(kit, frequent_head)
    try:
        assert generate_ids(kit, prompt, num_draft_tokens=3, **kw)[0] == want
    finally:
        me.unload_draft_model(kit)


@pytest.mark.parametrize("head_name", ["frequent_head", "mtp_head"])
def test_batch_of_mixed_rows_equals_each_row_alone(target, kit, request, head_name):
    """Rows drafting with the head (EAGLE-3, or a layer-N MTP head), prompt
    lookup, plain, default and structured output, batched: each equals its run alone."""
    head = request.getfixturevalue(head_name)
    batch_kit = me.load_model(target, max_parallel=5)
    me.load_draft_model(batch_kit, head)
    me.load_draft_model(kit, head)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    texts = [TEXT, "def f(a, b):\n    return a + b\n", TEXT + TEXT, "x = 1\ny = 2\n", "Answer: "]
    modes = [{"num_draft_tokens": 3}, {"prompt_lookup_num_tokens": 3}, {"speculative_decoding_toggle": False}, {}]
    modes.append({"num_draft_tokens": 3, "json_schema": json.dumps(schema)})
    lengths = (30, 17, 24, 21, 20)
    try:
        jobs = [(me.tokenize(kit, t), m, n) for t, m, n in zip(texts, modes, lengths)]
        want = [generate_ids(kit, p, max_tokens=n, **m)[0] for p, m, n in jobs]
        gens = [me.create_generator(batch_kit, p, max_tokens=n, **m) for p, m, n in jobs]
        got, finals = round_robin(gens)
    finally:
        me.unload_draft_model(kit)
        me.unload(batch_kit)
    for (p, _, _), w, ids in zip(jobs, want, got):
        assert_same_or_near_tie(kit, p, w, ids)
    modes = ["draft_model", "prompt_lookup", "plain", "draft_model", "draft_model"]
    assert [f.stats.decoding_mode for f in finals] == modes
    assert finals[0].stats.accepted_tokens > 0


def test_reload_and_replace(kit, random_head, frequent_head, mtp_head):
    without = me.memory_in_use(kit)
    me.load_draft_model(kit, mtp_head)
    assert kit.draft.description == "layer-N MTP head"
    me.unload_draft_model(kit)
    assert kit.draft is None
    me.load_draft_model(kit, random_head)
    me.load_draft_model(kit, frequent_head)  # replaces it; the capture points stay installed once
    assert kit.draft.path == frequent_head
    assert me.memory_in_use(kit) > without  # a host counts the head's weights
    me.unload_draft_model(kit)
    me.unload_draft_model(kit)  # a no-op
    assert kit.draft is None
    me.load_draft_model(kit, random_head)
    assert kit.draft.path == random_head
    me.unload_draft_model(kit)


@pytest.mark.parametrize("layout", ["speculators", "mlx-vlm"])
def test_proposals_equal_mlx_vlm_eagle3_drafter(kit, target, tmp_path, layout):
    """The same weights and target hidden states: the engine's chained drafts
    are mlx-vlm's ``prefill_from_target_hidden`` + ``draft_block``."""
    from mlx_engine.heads.eagle3 import eagle3_config, rename_weights

    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    head_dir = make_eagle3_head(tmp_path / "h", target, draft_vocab=100, seed=4, scale=4.0, layout=layout)
    me.load_draft_model(kit, head_dir)
    try:
        prompt = me.tokenize(kit, TEXT)
        bonus = 7
        spec = kit.draft.head.spec
        cache = kit.new_cache(kit.model)
        with capture.collecting(spec) as sink:
            kit.model(mx.array(prompt)[None], cache=cache.layers)
        hidden = capture.rows(sink, spec, 0, len(prompt))

        drafter = HeadDrafter(kit.draft, 5)
        drafter.take_hidden(0, hidden)
        ours = drafter.propose(prompt + [bonus], 5).tolist()

        config = json.loads((head_dir / "config.json").read_text())
        ref = Eagle3DraftModel(eagle3_config(config))
        ref.load_weights(
            list(ref.sanitize(rename_weights(mx.load(str(head_dir / "model.safetensors")))).items()), strict=False
        )
        ref.reset(kit.model)
        ref.prefill_from_target_hidden(mx.array(prompt)[None], hidden[None], bonus, None, mx.int32, greedy=True)
        theirs = ref.draft_block(bonus, hidden[None], None, 6, None, mx.int32, greedy=True)[0].tolist()
    finally:
        me.unload_draft_model(kit)
    assert ours == theirs and len(ours) == 5


@pytest.mark.parametrize("max_parallel", [1, 2])
def test_head_on_a_qwen3_5_hybrid_equals_plain_through_partial_rewinds(tmp_path_factory, max_parallel):
    """Recurrent layers rewind to the state before a pass and re-feed the
    accepted tokens: the head reads the newest pass's hidden state at each position."""
    root = tmp_path_factory.mktemp("hybrid")
    hybrid = make_model(root / "qwen3_5", "qwen3_5", hidden=64, scale=3.0, seed=6)
    kit = me.load_model(hybrid, max_parallel=max_parallel)
    try:
        prompt = me.tokenize(kit, TEXT)
        want = generate_ids(kit, prompt, max_tokens=40)[0]
        common = [t for t, _ in Counter(want).most_common(3)]
        head = make_eagle3_head(root / f"head{max_parallel}", hybrid, target_ids=common, seed=3)
        me.load_draft_model(kit, head)
        for k in (2, 5):
            ids, final = generate_ids(kit, prompt, max_tokens=40, num_draft_tokens=k)
            assert_same_or_near_tie(kit, prompt, want, ids)
            assert 0 < final.stats.accepted_tokens < final.stats.drafted_tokens  # partial rounds: rewinds
    finally:
        me.unload(kit)


# --- DeepSeek/GLM-style layer-N MTP heads on a llama target ---


@pytest.fixture(scope="module")
def mtp_head(target, plain, tmp_path_factory):
    common = [t for t, _ in Counter(plain[1]).most_common(3)]
    return make_layer_mtp_head(tmp_path_factory.mktemp("mtp") / "split", target, target_ids=common, seed=2, scale=3.0)


def test_layer_mtp_head_check_load_and_greedy_equal_plain(kit, plain, mtp_head):
    report = me.check_draft_model(kit, mtp_head)
    assert report.compatible and report.kind == "mtp" and report.hidden_states == (capture.FINAL,)
    assert report.vocabulary == "its own output layer"
    prompt, want = plain
    me.load_draft_model(kit, mtp_head)
    try:
        assert kit.draft.description == "layer-N MTP head"
        for k in (None, 2, 5):
            ids, final = generate_ids(kit, prompt, max_tokens=40, num_draft_tokens=k)
            assert_same_or_near_tie(kit, prompt, want, ids)
            assert final.stats.decoding_mode == "draft_model" and final.stats.drafted_tokens > 0
        ids, _ = generate_ids(kit, prompt, max_tokens=40, auto_speculative=True)
        assert_same_or_near_tie(kit, prompt, want, ids)
        kw = dict(max_tokens=30, temp=0.9, seed=11)
        seeded = generate_ids(kit, prompt, num_draft_tokens=3, **kw)[0]
    finally:
        me.unload_draft_model(kit)
    assert seeded == generate_ids(kit, prompt, **kw)[0]


def test_the_targets_own_mtp_weights_load_by_name(target, plain, tmp_path):
    own = tmp_path / "with_mtp"
    shutil.copytree(target, own)
    make_layer_mtp_head(own, target, seed=5, own_head=False, file_name="mtp.safetensors")
    k = me.load_model(own, max_parallel=1)
    try:
        assert not me.is_draft_model_compatible(me.load_model(target, max_parallel=1), "mtp")
        report = me.check_draft_model(k, "mtp")
        assert report.compatible and report.kind == "mtp" and report.vocabulary == "the target's output layer"
        me.load_draft_model(k, "mtp")
        prompt, want = plain
        ids, final = generate_ids(k, prompt, max_tokens=40, num_draft_tokens=3)
        assert_same_or_near_tie(k, prompt, want, ids)
        assert final.stats.drafted_tokens > 0
    finally:
        me.unload(k)


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (
            lambda w: w.pop("model.layers.4.self_attn.q_proj.weight"),
            ModelLoadError,
            "lacks tensor 'layers.4.self_attn.q_proj.weight'",
        ),
        (
            lambda w: w.update({"model.layers.4.mlp.up_proj.weight": mx.zeros((3, 64))}),
            ModelLoadError,
            r"'layers.4.mlp.up_proj.weight' has shape \(3, 64\)",
        ),
        (
            lambda w: w.update({"model.layers.4.eh_proj.weight": mx.zeros((64, 100))}),
            IncompatibleDraftModelError,
            "width 50",
        ),
        (
            lambda w: w.update({"model.layers.4.shared_head.head.weight": mx.zeros((500, 64))}),
            IncompatibleDraftModelError,
            "500 token ids",
        ),
    ],
)
def test_malformed_or_mismatched_mtp_head_is_refused(kit, mtp_head, tmp_path, edit, error, match):
    broken = _broken_copy(mtp_head, tmp_path / "broken", edit)
    with pytest.raises(error, match=match):
        me.load_draft_model(kit, broken)
    assert kit.draft is None


# --- Qwen3.5 MTP heads (mlx-vlm's split layout) on a qwen3_5 hybrid ---


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    root = tmp_path_factory.mktemp("q35")
    target = make_model(root / "qwen3_5", "qwen3_5", hidden=64, scale=3.0, seed=6)
    return target, make_qwen3_5_mtp_head(root / "mtp", target, seed=2, scale=2.0)


@pytest.mark.slow
def test_qwen3_5_mtp_split_head_equals_plain_with_rewinds_of_every_length(qwen35):
    target, head = qwen35
    kit = me.load_model(target, max_parallel=1)
    try:
        report = me.check_draft_model(kit, head)
        assert report.compatible and report.kind == "qwen3_5_mtp" and report.hidden_states == (capture.FINAL,)
        prompt = me.tokenize(kit, TEXT)
        want = generate_ids(kit, prompt, max_tokens=30)[0]
        kw = dict(max_tokens=24, temp=0.9, seed=5)
        seeded = generate_ids(kit, prompt, **kw)[0]
        me.load_draft_model(kit, head)
        for k in (1, 2, 3, 4, 5, None):  # a rejected round rewinds the recurrent layers by k
            ids, final = generate_ids(kit, prompt, max_tokens=30, num_draft_tokens=k)
            assert_same_or_near_tie(kit, prompt, want, ids)
            assert final.stats.drafted_tokens > 0
        assert generate_ids(kit, prompt, num_draft_tokens=3, **kw)[0] == seeded
    finally:
        me.unload(kit)


def test_qwen3_5_mtp_in_a_mixed_batch_equals_each_row_alone(qwen35):
    target, head = qwen35
    one, batch_kit = me.load_model(target, max_parallel=1), me.load_model(target, max_parallel=3)
    try:
        me.load_draft_model(one, head)
        me.load_draft_model(batch_kit, head)
        texts = [TEXT, "def f(a, b):\n    return a + b\n", "x = 1\ny = 2\n"]
        modes = [{"num_draft_tokens": 3}, {"prompt_lookup_num_tokens": 3}, {"auto_speculative": True}]
        jobs = [(me.tokenize(one, t), m, n) for t, m, n in zip(texts, modes, (20, 14, 17))]
        want = [generate_ids(one, p, max_tokens=n, **m)[0] for p, m, n in jobs]
        got, _ = round_robin([me.create_generator(batch_kit, p, max_tokens=n, **m) for p, m, n in jobs])
        for (p, _, _), w, ids in zip(jobs, want, got):
            assert_same_or_near_tie(one, p, w, ids)
    finally:
        me.unload(one)
        me.unload(batch_kit)


def test_qwen3_5_own_mtp_weights_load_by_name(qwen35, tmp_path):
    target, _ = qwen35
    own = tmp_path / "with_mtp"
    shutil.copytree(target, own)
    make_qwen3_5_mtp_head(own, target, seed=8, hf_layout=True)  # mtp.* tensors, zero-centred norms
    kit = me.load_model(own, max_parallel=1)
    try:
        report = me.check_draft_model(kit, "mtp")
        assert report.compatible and report.kind == "qwen3_5_mtp" and report.notes
        prompt = me.tokenize(kit, TEXT)
        want = generate_ids(kit, prompt, max_tokens=20)[0]
        me.load_draft_model(kit, "mtp")
        ids, final = generate_ids(kit, prompt, max_tokens=20, num_draft_tokens=2)
        assert_same_or_near_tie(kit, prompt, want, ids)
        assert final.stats.drafted_tokens > 0
    finally:
        me.unload(kit)


def test_qwen3_5_mtp_malformed_is_refused_naming_the_tensor(qwen35, tmp_path):
    target, head = qwen35
    kit = me.load_model(target, max_parallel=1)
    try:
        broken = _broken_copy(head, tmp_path / "broken", lambda w: w.pop("layers.0.self_attn.o_proj.weight"))
        with pytest.raises(ModelLoadError, match="lacks tensor 'layers.0.self_attn.o_proj.weight'"):
            me.load_draft_model(kit, broken)
    finally:
        me.unload(kit)


def test_qwen3_5_mtp_proposals_equal_mlx_vlm_drafter(qwen35):
    from mlx_engine.heads.qwen3_5_mtp import head_config

    from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel

    target, head = qwen35
    kit = me.load_model(target, max_parallel=1)
    try:
        me.load_draft_model(kit, head)
        prompt, bonus = me.tokenize(kit, TEXT), 9
        spec = kit.draft.head.spec
        with capture.collecting(spec) as sink:
            kit.model(mx.array(prompt)[None], cache=kit.new_cache(kit.model).layers)
        hidden = capture.rows(sink, spec, 0, len(prompt))
        drafter = HeadDrafter(kit.draft, 4)
        drafter.take_hidden(0, hidden)
        ours = drafter.propose(prompt + [bonus], 4).tolist()

        ref = Qwen3_5MTPDraftModel(head_config(json.loads((head / "config.json").read_text())))
        ref.load_weights(list(mx.load(str(head / "model.safetensors")).items()))
        ref.reset(kit.model)
        ref.prefill_from_target_hidden(mx.array(prompt)[None], hidden[None], bonus, None, mx.int32, greedy=True)
        theirs = ref.draft_block(bonus, hidden[None], None, 5, None, mx.int32, greedy=True)[0].tolist()
    finally:
        me.unload(kit)
    assert ours == theirs and len(ours) == 4


def test_the_server_takes_mtp_as_a_draft_name():
    from mlx_engine.server.hosting.drafts import resolve_draft

    assert resolve_draft(me.OWN_MTP, None) == "mtp"


def test_hidden_trail_reads_the_newest_pass_at_each_position():
    from mlx_engine.heads.model import HiddenTrail

    trail = HiddenTrail()
    trail.add(0, mx.arange(5)[:, None])  # positions 0-4
    trail.add(3, mx.arange(100, 104)[:, None])  # a later pass fed 3-6 again
    trail.add(8, mx.arange(200, 201)[:, None])  # position 7 never recorded
    assert trail.take(0, 7)[:, 0].tolist() == [0, 1, 2, 100, 101, 102, 103]
    assert trail.take(6, 9) is None and trail.covers(8) and not trail.covers(7)
    trail.drop_before(5)
    assert trail.first() == 3 and trail.take(5, 7)[:, 0].tolist() == [102, 103]


# --- MiMo's MTP head (model.mtp_layers.*) on a mimo target ---

MIMO_FUSION = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """A tiny mimo target whose own checkpoint holds its MTP head, the same head
    in the layer-N layout, and the target's plain greedy answer."""
    root = tmp_path_factory.mktemp("mimo")
    target = make_model(root / "mimo", "mimo", hidden=64, layers=2, scale=3.0, seed=3)
    make_layer_mtp_head(target, target, seed=4, scale=2.0, own_head=False, file_name="mtp.safetensors", mimo=True)
    layer_n = make_layer_mtp_head(root / "layer_n", target, seed=4, scale=2.0, own_head=False)
    k = me.load_model(target, max_parallel=1)
    prompt = me.tokenize(k, TEXT)
    yield k, target, layer_n, (prompt, generate_ids(k, prompt, max_tokens=40)[0])
    me.unload(k)


def _mimo_reference(kit, folder, tokens: mx.array, hidden: mx.array) -> mx.array:
    """HF's ``MiMoMTPLayers`` written out on the file's tensors: the logits after
    the target's final hidden states ``hidden`` for the next ids ``tokens``."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache
    from mlx_lm.utils import _get_classes

    w = {k.removeprefix("model.mtp_layers.0."): v for k, v in mx.load(str(folder / "mtp.safetensors")).items()}
    cfg = {**json.loads((folder / "config.json").read_text()), "num_hidden_layers": 1}
    model_cls, args_cls = _get_classes(cfg)
    block = model_cls(args_cls.from_dict(cfg)).model.layers[0]
    block.load_weights([(k, v) for k, v in w.items() if k.split(".")[0] not in MIMO_FUSION])
    eps, embed = cfg["rms_norm_eps"], kit.model.model.embed_tokens
    e = mx.fast.rms_norm(embed(tokens), w["token_layernorm.weight"], eps)
    h = mx.fast.rms_norm(hidden, w["hidden_layernorm.weight"], eps)
    x = mx.concatenate([h, e], axis=-1) @ w["input_proj.weight"].T  # MiMo: the hidden state first
    cache = KVCache()
    out = block(x, create_attention_mask(x, cache), cache)
    return embed.as_linear(mx.fast.rms_norm(out, w["final_layernorm.weight"], eps))


def test_mimo_own_mtp_head_loads_by_name_and_computes_mimos_formula(mimo):
    kit, target, _, (prompt, want) = mimo
    report = me.check_draft_model(kit, "mtp")
    assert report.compatible and report.kind == "mtp" and report.vocabulary == "the target's output layer"
    me.load_draft_model(kit, "mtp")
    try:
        head = kit.draft.head
        tokens = mx.array([[5, 9, 2]], dtype=mx.uint32)
        hidden = mx.random.normal((1, 3, 64), key=mx.random.key(0))
        got = head.logits(head.forward(head.new_cache(), tokens, hidden, 0))
        assert mx.allclose(got, _mimo_reference(kit, target, tokens, hidden), atol=1e-4).item()
        for k in (2, 4):
            ids, final = generate_ids(kit, prompt, max_tokens=40, num_draft_tokens=k)
            assert_same_or_near_tie(kit, prompt, want, ids)
            assert final.stats.decoding_mode == "draft_model" and final.stats.drafted_tokens > 0
    finally:
        me.unload_draft_model(kit)


def test_mimo_head_drafts_exactly_as_the_same_head_in_the_layer_n_layout(mimo, tmp_path):
    kit, target, layer_n, (prompt, _) = mimo
    split = tmp_path / "mimo_split"
    split.mkdir()
    shutil.copy(target / "mtp.safetensors", split / "model.safetensors")
    shutil.copy(target / "config.json", split / "config.json")
    runs = []
    for folder in (split, layer_n):
        me.load_draft_model(kit, folder)
        try:
            ids, final = generate_ids(kit, prompt, max_tokens=40, num_draft_tokens=3)
        finally:
            me.unload_draft_model(kit)
        runs.append((ids, final.stats.drafted_tokens, final.stats.accepted_tokens))
    assert runs[0] == runs[1] and runs[0][1] > 0


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda w: w.pop("model.mtp_layers.0.token_layernorm.weight"),
            "lacks tensor 'mtp_layers.0.token_layernorm.weight'",
        ),
        (
            lambda w: w.update({"model.mtp_layers.0.final_layernorm.weight": mx.ones((3,))}),
            r"'mtp_layers.0.final_layernorm.weight' has shape \(3,\)",
        ),
    ],
)
def test_malformed_mimo_head_names_its_tensor(mimo, tmp_path, edit, match):
    kit, target, _, _ = mimo
    broken = tmp_path / "broken"
    broken.mkdir()
    w = dict(mx.load(str(target / "mtp.safetensors")))
    edit(w)
    mx.save_safetensors(str(broken / "model.safetensors"), w)
    shutil.copy(target / "config.json", broken / "config.json")
    with pytest.raises(ModelLoadError, match=match):
        me.load_draft_model(kit, broken)
    assert kit.draft is None
