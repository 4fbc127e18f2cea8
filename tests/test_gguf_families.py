"""GGUF files of every mapped family and of the quantization types llama.cpp's
``gguf`` package writes: tiny random-weight models converted as llama.cpp's
converter does (fixtures/gguf_families.py) must compute what the mlx-lm model
they were made from computes, and SentencePiece files must tokenize exactly as
SentencePiece itself."""

import mlx_engine as me

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import FAMILY_PROMPT as PROMPT
from helpers import (
    assert_batched_rows_equal_solo,
    assert_lookup_exact_and_next_turn_cached,
    generate_ids,
)

from fixtures.gguf_families import (
    FAMILIES,
    arch_metadata,
    bpe_metadata,
    gguf_tensors,
    reference_model,
    spm_metadata,
    spm_model,
    write_gguf,
)


def _logits(model, ids):
    return model(mx.array(ids)[None]).astype(mx.float32)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_computes_what_its_source_model_computes(family_files, family):
    """Names, q/k permutation (llama), gemma's 1 + w norms, Llama 3 rope_freqs,
    gemma3's sliding window (8 tokens here, shorter than the prompt), phi3's
    fused projections: a float32 file gives the source model's logits."""
    path, reference, _ = family_files(family)
    kit = me.load_model(path)
    ids = me.tokenize(kit, PROMPT)
    assert len(ids) > 16
    expected = _logits(reference, ids)
    scale = mx.abs(expected).max().item()
    assert mx.abs(_logits(kit.model, ids) - expected).max().item() <= 1e-5 * max(scale, 1.0) * 10


# Relative RMS rounding error of one weight for each type, on Gaussian weights
# (block absmax ~ 2.5 sigma): b-bit symmetric blocks step absmax / 2**(b-1), a
# uniform rounding error has RMS step / sqrt(12); F16/BF16 keep 11/8 mantissa bits.
_STEP = {
    "F16": 2**-11,
    "BF16": 2**-8,
    "Q8_0": 2.5 / 128,
    "Q5_1": 5.0 / 31,
    "Q5_0": 2.5 / 16,
    "Q4_1": 5.0 / 15,
    "Q4_0": 2.5 / 8,
}


@pytest.mark.parametrize("qtype", list(_STEP))
def test_quantized_types_stay_within_their_precision(family_files, qtype):
    """Every matrix in ``qtype`` (vectors stay F32, as llama.cpp keeps them): the
    logits' relative RMS error is bounded by the per-weight error summed over the
    16 quantized matrices in quadrature, with a factor 2 of margin; a wrongly
    decoded tensor gives an error near 1.4 (an unrelated output)."""
    path, reference, _ = family_files("llama", qtype)
    kit = me.load_model(path)
    ids = me.tokenize(kit, PROMPT)
    expected, got = _logits(reference, ids), _logits(kit.model, ids)
    rel = (mx.sqrt(((got - expected) ** 2).mean()) / mx.sqrt((expected**2).mean())).item()
    bound = 2 * math.sqrt(16) * _STEP[qtype] / math.sqrt(12)
    assert rel <= bound, (qtype, rel, bound)


def test_sentencepiece_tokenizer_matches_sentencepiece(family_files):
    """Scores, byte fallback (characters outside the vocabulary), the space
    prefix, BOS, user-defined tokens kept whole, and decoding back."""
    import sentencepiece as spm

    path, _, model_file = family_files("mistral")
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    kit = me.load_model(path, vocab_only=True)
    texts = [
        "Hello world!",
        "Grüße aus München 🙂 日本語",
        "   leading spaces and\ttabs\n\n",
        "ǅ⌘ unseen Ωmega",
        "a  b   c",
    ]
    for text in texts:
        assert me.tokenize(kit, text) == [sp.bos_id(), *sp.encode(text)], text
        assert kit.tokenizer.decode(me.tokenize(kit, text), skip_special_tokens=True) == sp.decode(sp.encode(text))
    turn = kit.tokenizer.get_vocab()["<start_of_turn>"]
    assert turn in me.tokenize(kit, "x<start_of_turn>user")
    assert kit.tokenizer.bos_token_id == sp.bos_id() and sp.eos_id() in kit.eos_token_ids


@pytest.mark.parametrize("family", ["gemma3", "llama3"])
def test_greedy_output_identical_across_decoding_modes(family_files, family):
    """gemma3's sliding-window layers use rotating caches, which cannot be
    rewound once full: the plan falls back to plain decoding and says so; Llama
    3 (rope_freqs) speculates; both give the plain greedy tokens."""
    path, _, _ = family_files(family, "Q8_0")
    kit = me.load_model(path)
    prompt = me.tokenize(kit, PROMPT * 2)
    plain, _ = generate_ids(kit, prompt, max_tokens=12, temp=0.0)
    lookup, last = generate_ids(kit, prompt, max_tokens=12, temp=0.0, prompt_lookup_num_tokens=3)
    assert lookup == plain
    if family == "gemma3":  # the 8-token window is full: the plan says why it decodes plainly
        assert "rotating KV cache" in last.stats.mode_reason, last.stats.mode_reason
    else:
        assert last.stats.decoding_mode == "prompt_lookup"


def test_mixed_types_in_one_file(tmp_path):
    """Q4_K_M-style files mix types; here Q5_0, Q8_0, Q4_1, BF16 and F16 tensors
    in one file, read tensor by tensor."""
    import gguf

    (tmp_path / "bpe").mkdir()
    tok = bpe_metadata(tmp_path / "bpe")
    model, config = reference_model("qwen3", len(tok["tokenizer.ggml.tokens"]))
    tensors = gguf_tensors(model, config, "qwen3")
    types = ["Q5_0", "Q8_0", "Q4_1", "BF16", "F16"]
    path = tmp_path / "mixed.gguf"
    write_gguf(path, "qwen3", tensors, {**arch_metadata("qwen3", config), **tok}, qtype=types)
    header = gguf.GGUFReader(path)
    assert {t.tensor_type.name for t in header.tensors} >= set(types)
    kit = me.load_model(path)
    ids = me.tokenize(kit, PROMPT)
    expected, got = _logits(model, ids), _logits(kit.model, ids)
    rel = (mx.sqrt(((got - expected) ** 2).mean()) / mx.sqrt((expected**2).mean())).item()
    assert rel <= 2 * math.sqrt(16) * _STEP["Q4_1"] / math.sqrt(12)
    assert np.isfinite(np.array(got)).all()


def test_digit_splitting_pre_tokenizers_split_digits_one_by_one(tmp_path):
    """``tokenizer.ggml.pre = smollm`` (SmolLM, StarCoder) splits digits one by one
    before GPT-2's split, as those models' own tokenizer.json does. transformers'
    converter does not know the name and keeps digit runs whole, so a vocabulary
    with multi-digit merges tokenizes differently there (the engine replaces that
    part of the converter's tokenizer)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    (tmp_path / "bpe").mkdir()
    tok = bpe_metadata(tmp_path / "bpe", extra_text=" 123 456 12 34 1234 " * 20, pre="smollm")
    original = Tokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json"))
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    model, config = reference_model("llama", len(tok["tokenizer.ggml.tokens"]))
    path = write_gguf(
        tmp_path / "s.gguf", "llama", gguf_tensors(model, config, "llama"), {**arch_metadata("llama", config), **tok}
    )
    kit = me.load_model(path, vocab_only=True)
    text = "x = 1234 and 12, 34 then 123456"
    assert me.tokenize(kit, text) == original.encode(text).ids
    fields = {"tokenizer_type": "gpt2", "pre_tokenizer_type": "smollm", "tokens": tok["tokenizer.ggml.tokens"],
              "merges": tok["tokenizer.ggml.merges"], "token_type": tok["tokenizer.ggml.token_type"].tolist()}  # fmt: skip
    assert (
        convert_gguf_tokenizer("llama", fields)[0].encode(text).ids != original.encode(text).ids
    )  # the converter alone differs


@pytest.mark.parametrize("family", ["llama3", "gemma3", "granitehybrid-moe"])
def test_parallel_requests_equal_their_solo_outputs(family_files, family):
    """Batched rows carry their own RoPE offsets (an array): Llama 3's factored
    RoPE and gemma3's sliding-window caches must give each request what it gets
    alone; Granite 4.0-H with experts routes each row's tokens itself."""

    path, _, _ = family_files(family, "Q8_0")
    assert_batched_rows_equal_solo(path, max_parallel=4, max_tokens=10)


def _q4_k_exact(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w`` rounded to values Q4_K holds exactly, and those values' Q4_K bytes,
    written here from the format's layout (ggml-common.h ``block_q4_K``): every
    sub-block scale 1 and min 1, ``dmin = 8 d``, so a value is ``d * (q - 8)``."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // 256, 256)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / 7).astype(np.float16).astype(np.float32)
    q = np.clip(np.round(blocks / d) + 8, 0, 15).astype(np.uint8)
    exact = (d * (q.astype(np.float32) - 8)).reshape(rows, cols)
    head = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(rows, -1, 2),
                           (8 * d).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)], axis=-1)  # fmt: skip
    scales = np.broadcast_to(np.array([1] * 8 + [0x11] * 4, np.uint8), (rows, cols // 256, 12))
    chunks = q.reshape(rows, cols // 256, 4, 2, 32)  # per 64 values: 32 low nibbles, then 32 high
    qs = (chunks[:, :, :, 0] | (chunks[:, :, :, 1] << 4)).reshape(rows, cols // 256, 128)
    return exact, np.concatenate([head, scales, qs], axis=-1).reshape(rows, -1)


def test_q4_k_bytes_written_from_the_format_decode_exactly(tmp_path):
    """A K-quant tensor (256-value blocks) in a file of F32 ones: the decoded
    matrix is exactly the one its bytes encode, so the model computes what the
    source model with those weights computes (an encoder written from the
    format, not llama.cpp's, so the check is independent of the decoder)."""
    import gguf

    (tmp_path / "bpe").mkdir()
    tok = bpe_metadata(tmp_path / "bpe")
    model, config = reference_model("qwen3", len(tok["tokenizer.ggml.tokens"]))
    exact, raw = _q4_k_exact(np.array(model.model.layers[0].mlp.down_proj.weight))
    model.model.layers[0].mlp.down_proj.weight = mx.array(exact)
    tensors = gguf_tensors(model, config, "qwen3")
    tensors["blk.0.ffn_down.weight"] = (raw, "Q4_K")
    write_gguf(tmp_path / "k.gguf", "qwen3", tensors, {**arch_metadata("qwen3", config), **tok})
    assert {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "k.gguf").tensors} == {"F32", "Q4_K"}
    kit = me.load_model(tmp_path / "k.gguf")
    assert np.array_equal(np.array(kit.model.model.layers[0].mlp.down_proj.weight), exact)
    ids = me.tokenize(kit, PROMPT)
    assert mx.abs(_logits(kit.model, ids) - _logits(model, ids)).max().item() < 1e-4


@pytest.mark.parametrize("extra_rows", [16, -16])
def test_tokens_and_embedding_rows_must_agree(tmp_path, extra_rows):
    """A SentencePiece file whose token list is shorter than its embedding used to
    load, then fail with IndexError on a generated id past the tokenizer (a
    logit_bias forced it); llama.cpp refuses such a file too."""
    tok = spm_metadata(spm_model(tmp_path / "spm"))
    n = len(tok["tokenizer.ggml.tokens"])
    model, config = reference_model("llama", n + extra_rows)
    path = write_gguf(
        tmp_path / "m.gguf", "llama", gguf_tensors(model, config, "llama"), {**arch_metadata("llama", config), **tok}
    )
    with pytest.raises(me.ModelLoadError, match=rf"{n} tokens.*{n + extra_rows} rows"):
        me.load_model(path)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_derived_merges_are_the_converters(tmp_path, arch):
    from mlx_engine.loading.gguf.tokenizer import derived_merges

    from transformers.tokenization_utils_base import generate_merges

    tok = spm_metadata(spm_model(tmp_path / "spm"))
    tokens, scores = list(tok["tokenizer.ggml.tokens"]), [float(s) for s in tok["tokenizer.ggml.scores"]]
    tokens += ["\u2581" + "ab" * 300, "  "]  # a long token that splits, and gemma's spelling of spaces
    scores += [-1000.0, -1001.0]
    if arch == "gemma3":
        spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranking = {t: -i for i, t in enumerate(spelled)}
    else:
        spelled, ranking = tokens, dict(zip(tokens, scores))
    want = generate_merges({t: i for i, t in enumerate(spelled)}, ranking)
    assert derived_merges(arch, tokens, scores) == [f"{a} {b}" for a, b in want]


def test_a_very_long_sentencepiece_token_loads(tmp_path):
    """One 1M-character token made loading quadratic (over 300 s): the converter
    tried every split of it."""
    tok = spm_metadata(spm_model(tmp_path / "spm"))
    tok["tokenizer.ggml.tokens"] = list(tok["tokenizer.ggml.tokens"][:-1]) + ["\u2581" + "x" * 1_000_000]
    model, config = reference_model("llama", len(tok["tokenizer.ggml.tokens"]))
    path = write_gguf(
        tmp_path / "m.gguf", "llama", gguf_tensors(model, config, "llama"), {**arch_metadata("llama", config), **tok}
    )
    kit = me.load_model(path, vocab_only=True)
    assert me.tokenize(kit, "hello")


# -- recurrent families: lfm2 (short convolutions + attention), mamba2, granitehybrid --
RECURRENT = {
    "lfm2": "mlx_lm.models.lfm2",
    "mamba2": "mlx_lm.models.mamba2",
    "granitehybrid": "mlx_lm.models.granitemoehybrid",
    "granitehybrid-moe": "mlx_lm.models.granitemoehybrid",
}


@pytest.mark.parametrize("family", list(RECURRENT))
def test_recurrent_family_is_mlx_lms_class_and_computes_its_source(family_files, family):
    """The GGUF loads into mlx-lm's own class (recurrent state in
    ``ArraysCache`` layers, so the engine's rewinds, checkpoints and batching
    apply) and a float32 file gives the source model's logits: exactly for
    lfm2; for the Mamba-2 families to float32 rounding (A is stored as
    -exp(A_log)); granitehybrid's q/k rows, permuted by the converter, need no
    undoing without RoPE."""
    from mlx_engine.caches.ragged import can_batch
    from mlx_engine.caches.sequence import SequenceCache

    from mlx_lm.models.cache import ArraysCache

    path, reference, _ = family_files(family)
    kit = me.load_model(path)
    assert type(kit.model).__module__ == RECURRENT[family]
    assert ArraysCache in {type(c) for c in kit.model.make_cache()}
    assert can_batch(SequenceCache(kit.model))
    ids = me.tokenize(kit, PROMPT)
    got, want = _logits(kit.model, ids), _logits(reference, ids)
    assert mx.abs(got - want).max().item() <= (0.0 if family == "lfm2" else 1e-5 * mx.abs(want).max().item())


@pytest.mark.parametrize("family", list(RECURRENT))
def test_recurrent_family_speculates_exactly_and_the_next_turn_reuses_the_cache(family_files, family):
    """On a Q8_0 file: prompt lookup speculates (no fallback) and gives plain
    greedy's tokens; the next turn resumes from a checkpoint of the recurrent
    state (cached tokens) and answers as a fresh kit does."""
    path, _, _ = family_files(family, "Q8_0")
    assert_lookup_exact_and_next_turn_cached(path, PROMPT)


def _changed_file(tmp_path, arch, tensors=None, metadata=None, drop=()):
    """An F32 file of ``arch`` with ``tensors``/``metadata`` entries replaced and
    the names in ``drop`` left out (tensors or metadata keys)."""
    (tmp_path / "bpe").mkdir(exist_ok=True)
    tok = bpe_metadata(tmp_path / "bpe")
    model, config = reference_model(arch, len(tok["tokenizer.ggml.tokens"]))
    family, arch = arch, FAMILIES[arch][0]  # a fixture family (granitehybrid-moe) and its GGUF architecture
    all_tensors = {**gguf_tensors(model, config, arch), **(tensors or {})}
    meta = {**arch_metadata(arch, config), **tok, **(metadata or {})}
    path = tmp_path / f"bad-{family}.gguf"
    write_gguf(path, arch, {k: v for k, v in all_tensors.items() if k not in drop},
               {k: v for k, v in meta.items() if k not in drop})  # fmt: skip
    return path


@pytest.mark.parametrize(
    "family, change, message",
    [
        (
            "lfm2",
            dict(drop=["blk.2.shortconv.in_proj.weight"]),
            r"lacks 'blk\.2\.shortconv\.in_proj\.weight' \(layer 2, a conv",
        ),
        (
            "lfm2",
            dict(drop=["blk.1.attn_k_norm.weight"]),
            r"lacks 'blk\.1\.attn_k_norm\.weight' \(layer 1, a full_attention",
        ),
        ("lfm2", dict(drop=["token_embd_norm.weight"]), r"lacks 'token_embd_norm\.weight'"),
        ("lfm2", dict(drop=["lfm2.shortconv.l_cache"]), r"lacks the metadata field 'lfm2\.shortconv\.l_cache'"),
        (
            "lfm2",
            dict(metadata={"lfm2.shortconv.l_cache": 4}),
            r"'blk\.0\.shortconv\.conv\.weight' of shape \[3, 256\]",
        ),
        (
            "lfm2",
            dict(metadata={"lfm2.attention.head_count_kv": np.array([0, 1], np.int32)}),
            r"head_count_kv.*one per layer",
        ),
        (
            "lfm2",
            dict(metadata={"lfm2.attention.head_count_kv": np.array([1, 1, 1], np.int32)}),
            r"every layer 'full_attention'",
        ),
        ("lfm2", dict(tensors={"output.weight": np.zeros((400, 256), np.float32)}), r"untied output matrix"),
        ("lfm2", dict(metadata={"lfm2.attention.sliding_window": 64}), r"sliding-window"),
        ("lfm2", dict(metadata={"lfm2.attention.causal": False}), r"bidirectional"),
        ("lfm2", dict(metadata={"lfm2.rope.dimension_count": 64}), r"partial RoPE"),
        ("mamba2", dict(drop=["blk.1.ssm_a"]), r"lacks 'blk\.1\.ssm_a' \(Mamba-2 block 1\)"),
        ("mamba2", dict(drop=["blk.0.ssm_dt.bias"]), r"lacks 'blk\.0\.ssm_dt\.bias'"),
        ("mamba2", dict(drop=["mamba2.ssm.inner_size"]), r"lacks the metadata field 'mamba2\.ssm\.inner_size'"),
        ("mamba2", dict(metadata={"mamba2.ssm.state_size": 32}), r"'blk\.0\.ssm_in\.weight' of shape \[256, 1064\]"),
        ("mamba2", dict(metadata={"mamba2.ssm.group_count": 2}), r"mamba2 with 2 groups is not supported"),
        ("mamba2", dict(metadata={"mamba2.ssm.time_step_rank": 7}), r"time_step_rank.*divisor"),
        ("mamba2", dict(tensors={"blk.0.ssm_dt.weight": np.zeros((256, 8), np.float32)}), r"'blk\.0\.ssm_dt\.weight'"),
        ("mamba2", dict(tensors={"blk.1.ssm_a": np.full((8, 1), 0.5, np.float32)}), r"ssm_a\) holds A = -exp\(A_log\)"),
        ("granitehybrid", dict(drop=["blk.2.ssm_d"]), r"lacks 'blk\.2\.ssm_d' \(layer 2, mamba\)"),
        ("granitehybrid", dict(drop=["blk.1.attn_v.weight"]), r"lacks 'blk\.1\.attn_v\.weight' \(layer 1, attention\)"),
        ("granitehybrid", dict(drop=["granitehybrid.rope.scaling.finetuned"]), r"with RoPE \(Bamba\) is not mapped"),
        (  # a router without its experts' metadata
            "granitehybrid",
            dict(tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, 256), np.float32)}),
            r"lacks the metadata field 'granitehybrid\.expert_count'",
        ),
        (
            "granitehybrid-moe",
            dict(drop=["blk.2.ffn_up_shexp.weight"]),
            r"lacks 'blk\.2\.ffn_up_shexp\.weight' \(layer 2, mamba\)",
        ),
        (
            "granitehybrid",
            dict(metadata={"granitehybrid.ssm.group_count": 2}),
            r"granitehybrid with 2 groups is not supported",
        ),
    ],
)
def test_a_malformed_hybrid_file_is_refused_naming_it(tmp_path, family, change, message):
    path = _changed_file(tmp_path, family, **change)
    with pytest.raises(me.ModelLoadError, match=message) as info:
        me.load_model(path)
    assert str(path) in str(info.value)


def test_per_layer_zero_kv_heads_are_refused_outside_hybrid_families(tmp_path):
    """A 0 in ``head_count_kv`` marks a recurrent layer; an attention-only
    family has none, so such a file is malformed there."""
    (tmp_path / "bpe").mkdir()
    tok = bpe_metadata(tmp_path / "bpe")
    model, config = reference_model("qwen3", len(tok["tokenizer.ggml.tokens"]))
    meta = {**arch_metadata("qwen3", config), **tok, "qwen3.attention.head_count_kv": np.array([1, 0], np.int32)}
    path = write_gguf(tmp_path / "q.gguf", "qwen3", gguf_tensors(model, config, "qwen3"), meta)
    with pytest.raises(me.ModelLoadError, match=r"head_count_kv.*same count for every attention layer"):
        me.load_model(path)
    meta["qwen3.attention.head_count_kv"] = np.array([1, 1], np.int32)  # per layer, all equal: as a scalar
    path = write_gguf(tmp_path / "q2.gguf", "qwen3", gguf_tensors(model, config, "qwen3"), meta)
    assert me.load_model(path).config["num_key_value_heads"] == 1
