"""GGUF models: a tiny GGUF written by the tests (the llama fixture, converted as
llama.cpp does) must behave exactly like the same model in Hugging Face layout;
every malformed file gives a ModelLoadError; the real default model answers."""

import mlx_engine as me

import re
import struct

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers import generate_ids, requires_default_model

from fixtures.tiny_models import make_gguf

TEXTS = [
    "def add(a, b):\n    return a + b  # 12345",
    "<|im_start|>user\nhi<|im_end|>\n",
    "Grüße aus München 🙂 日本語",
    "   leading spaces and\ttabs\n\n\n",
]


@pytest.fixture(scope="module")
def gguf_path(models_dir, llama_path):
    return make_gguf(llama_path, models_dir / "gguf" / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def gguf_kit(gguf_path):
    kit = me.load_model(gguf_path)
    yield kit
    me.unload(kit)


def test_tokenizer_matches_hugging_face_layout(gguf_kit, llama_path):
    hf = me.load_model(llama_path, vocab_only=True)
    for text in TEXTS:
        assert me.tokenize(gguf_kit, text) == me.tokenize(hf, text), text
        ids = me.tokenize(gguf_kit, text)
        assert gguf_kit.tokenizer.decode(ids) == text
    assert gguf_kit.tokenizer.get_vocab() == hf.tokenizer.get_vocab()
    assert gguf_kit.eos_token_ids == hf.eos_token_ids
    im_start = hf.tokenizer.get_vocab()["<|im_start|>"]
    assert me.tokenize(gguf_kit, "<|im_start|>") == [im_start]  # control tokens encode whole
    messages = [{"role": "user", "content": "hello"}]
    assert me.apply_chat_template(gguf_kit, messages) == me.apply_chat_template(hf, messages)


def test_greedy_generation_matches_hugging_face_layout(gguf_kit, llama_path):
    """The q/k rows are stored permuted for interleaved RoPE; the loader must
    compute exactly what the unpermuted Hugging Face weights compute."""
    hf = me.load_model(llama_path)
    prompt = me.tokenize(hf, "def add(a, b):\n")
    hf_ids, _ = generate_ids(hf, prompt, max_tokens=24, temp=0.0)
    gguf_ids, last = generate_ids(gguf_kit, prompt, max_tokens=24, temp=0.0)
    assert gguf_ids == hf_ids
    assert last.stop_condition.stop_reason == "token_limit"
    logits_hf = hf.model(mx.array(prompt)[None])
    logits_gguf = gguf_kit.model(mx.array(prompt)[None])
    assert mx.allclose(logits_hf, logits_gguf, atol=1e-4).item()


def test_qwen2_gguf_matches_hugging_face_layout(models_dir, qwen_path):
    """qwen2 files keep the Hugging Face q/k order and carry q/k/v biases."""
    hf = me.load_model(qwen_path)
    kit = me.load_model(make_gguf(qwen_path, models_dir / "gguf-qwen2" / "tiny-qwen2.gguf"))
    prompt = me.tokenize(hf, "class Point:\n")
    assert me.tokenize(kit, "class Point:\n") == prompt
    assert generate_ids(kit, prompt, max_tokens=16, temp=0.0)[0] == generate_ids(hf, prompt, max_tokens=16, temp=0.0)[0]


def test_prompt_lookup_and_cache_reuse_work_on_gguf(gguf_kit):
    prompt = me.tokenize(gguf_kit, "for i in range(10):\n    print(i, i * i)\n" * 3)
    plain, _ = generate_ids(gguf_kit, prompt, max_tokens=16, temp=0.0)
    lookup, last = generate_ids(gguf_kit, prompt, max_tokens=16, temp=0.0, prompt_lookup_num_tokens=4)
    assert lookup == plain
    assert last.stats.cached_tokens > 0


def test_vocab_only_reads_metadata(gguf_path):
    kit = me.load_model(gguf_path, vocab_only=True)
    assert kit.model is None
    assert me.tokenize(kit, "hello") == me.tokenize(me.load_model(gguf_path, vocab_only=True), "hello")


def test_directory_with_one_gguf_loads(gguf_path):
    kit = me.load_model(gguf_path.parent, vocab_only=True)
    assert kit.model_path == gguf_path


def test_directory_with_two_ggufs_is_refused(tmp_path, llama_path):
    make_gguf(llama_path, tmp_path / "a.gguf")
    make_gguf(llama_path, tmp_path / "b.gguf")
    with pytest.raises(me.ModelLoadError, match="several GGUF files"):
        me.load_model(tmp_path)


def test_add_special_tokens(tmp_path, llama_path):
    kit = me.load_model(make_gguf(llama_path, tmp_path / "bos.gguf", add_bos=True), vocab_only=True)
    bos = kit.tokenizer.bos_token_id
    assert me.tokenize(kit, "hello")[0] == bos
    assert bos not in me.tokenize(kit, "hello", add_special_tokens=False)
    rendered = "<|im_start|>user\nhi<|im_end|>\n"
    assert me.tokenize(kit, rendered, add_special_tokens=False).count(bos) == 1  # one BOS, from the text
    with pytest.raises(ValueError, match="add_special_tokens"):
        me.tokenize(kit, "x", add_special_tokens="no")


def test_gguf_target_accepts_hugging_face_draft(gguf_kit, draft_path, llama_path):
    report = me.check_draft_model(gguf_kit, draft_path)
    assert report.compatible, report.reasons
    foreign = me.load_model(llama_path, vocab_only=True)
    assert me.is_draft_model_compatible(foreign, gguf_kit.model_path)
    prompt = me.tokenize(gguf_kit, "class Point:\n")
    plain, _ = generate_ids(gguf_kit, prompt, max_tokens=12, temp=0.0)
    me.load_draft_model(gguf_kit, draft_path)
    try:
        drafted, last = generate_ids(gguf_kit, prompt, max_tokens=12, temp=0.0, num_draft_tokens=2)
    finally:
        me.unload_draft_model(gguf_kit)
    assert drafted == plain
    assert last.stats.drafted_tokens > 0


def test_draft_report_explains_tokenizer_difference(tmp_path, llama_path, foreign_tokenizer_path):
    kit = me.load_model(make_gguf(llama_path, tmp_path / "t.gguf"), vocab_only=True)
    report = me.check_draft_model(kit, foreign_tokenizer_path)
    assert not report.compatible
    assert any("tokenizers differ" in r for r in report.reasons)


# -- malformed files ------------------------------------------------------------
def _patch_tensor_type(path, tensor: bytes, type_id: int) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(tensor) + len(tensor)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("type_id, type_name", [(16, "IQ2_XXS"), (34, "TQ1_0"), (40, "NVFP4"), (99, "unknown type 99")])
def test_unsupported_tensor_type_names_type_and_tensor(tmp_path, llama_path, type_id, type_name):
    path = make_gguf(llama_path, tmp_path / "k.gguf")
    _patch_tensor_type(path, b"blk.0.attn_q.weight", type_id)
    with pytest.raises(me.ModelLoadError, match=rf"'blk.0.attn_q.weight' has type {type_name}"):
        me.load_model(path)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.02])
def test_truncated_file(tmp_path, gguf_path, keep):
    data = gguf_path.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(me.ModelLoadError, match="truncated"):
        me.load_model(path)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"NOPE" + b"\0" * 100, b"GGUF" + struct.pack("<I", 7) + b"\0" * 40])
def test_not_a_gguf(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(me.ModelLoadError, match="bad.gguf"):
        me.load_model(path)


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.model"])
def test_missing_tokenizer_metadata(tmp_path, llama_path, key):
    path = make_gguf(llama_path, tmp_path / "notok.gguf", drop=(key,))
    with pytest.raises(me.ModelLoadError, match="tokenizer"):
        me.load_model(path)


def test_unsupported_architecture(tmp_path, llama_path):
    path = make_gguf(llama_path, tmp_path / "arch.gguf", metadata={"general.architecture": "mamba"})
    with pytest.raises(me.ModelLoadError, match="architecture 'mamba'"):
        me.load_model(path)


def test_declared_layers_must_match_tensors(tmp_path, llama_path):
    """A header claiming a million layers must be refused before anything is allocated."""
    path = make_gguf(
        llama_path, tmp_path / "bomb.gguf", metadata={"llama.block_count": mx.array(1_000_000, dtype=mx.uint32)}
    )
    with pytest.raises(me.ModelLoadError, match="declares 1000000 layers"):
        me.load_model(path)


def test_kit_shapes_must_match_file(tmp_path, llama_path):
    path = make_gguf(
        llama_path, tmp_path / "shape.gguf", metadata={"llama.embedding_length": mx.array(96, dtype=mx.uint32)}
    )
    with pytest.raises(me.ModelLoadError, match="does not match"):
        me.load_model(path)


# Every field the loader reads, each given values of the wrong type or out of range:
# each must be a ModelLoadError naming the file and the field (issue 26).
_U32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
_WRONG = {
    "a string": "abc",
    "strings": ["a", "b"],
    "an int array": _U32([1, 2]),
    "NaN": mx.array(float("nan")),
    "infinity": mx.array(float("inf")),
    "a negative int": mx.array(-3, dtype=mx.int32),
    "zero": _U32(0),
    "2**62": mx.array(2**62, dtype=mx.uint64),
}
_INT_FIELDS = [
    "llama.block_count",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.context_length",
    "llama.attention.key_length",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "general.alignment",
]
_FLOAT_FIELDS = ["llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"]
_CASES = (
    [(k, n) for k in _INT_FIELDS for n in _WRONG if not (k.startswith("tokenizer.ggml") and n == "zero")]
    + [
        (k, n)
        for k in _FLOAT_FIELDS
        for n in ("a string", "strings", "an int array", "NaN", "infinity", "a negative int", "zero")
    ]
    + [
        (k, n)
        for k in (
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.chat_template",
            "general.architecture",
            "llama.rope.scaling.type",
        )
        for n in ("strings", "an int array", "zero")
    ]
    + [
        (k, n)
        for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
        for n in ("a string", "an int array", "zero")
        if (k, n) != ("tokenizer.ggml.token_type", "an int array")
    ]
    + [("tokenizer.ggml.add_bos_token", "strings")]
)


@pytest.mark.parametrize("key, kind", _CASES)
def test_wrong_typed_metadata_names_file_and_field(tmp_path, llama_path, key, kind):
    path = make_gguf(llama_path, tmp_path / "typed.gguf", metadata={key: _WRONG[kind]})
    with pytest.raises(me.ModelLoadError, match=rf"typed\.gguf.*{re.escape(key.split('.', 1)[1])}"):
        me.load_model(path)


def test_linear_rope_scaling_needs_a_factor(tmp_path, llama_path):
    path = make_gguf(llama_path, tmp_path / "rope.gguf", metadata={"llama.rope.scaling.type": "linear"})
    with pytest.raises(me.ModelLoadError, match=r"rope\.gguf.*'llama.rope.scaling.factor'"):
        me.load_model(path)


def _patch_tensor_dim(path, tensor: bytes, axis: int, size: int) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(tensor) + len(tensor)
    struct.pack_into("<Q", data, at + 4 + 8 * axis, size)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("axis, size", [(1, 0), (0, 0), (1, 2**40)])
def test_zero_or_huge_tensor_dims(tmp_path, llama_path, axis, size):
    path = make_gguf(llama_path, tmp_path / "dims.gguf")
    _patch_tensor_dim(path, b"token_embd.weight", axis, size)
    with pytest.raises(me.ModelLoadError, match=r"dims\.gguf.*'token_embd.weight'"):
        me.load_model(path)


def _add_metadata(path, out, key: str, vtype: int, payload: bytes) -> None:
    """``path`` with one more metadata entry, padded to a multiple of the file's
    32-byte alignment so the tensor data stays aligned."""
    data = path.read_bytes()
    pad = -(8 + len(key) + 4 + len(payload)) % 32
    key_bytes = (key + "_" * pad).encode()
    entry = struct.pack("<Q", len(key_bytes)) + key_bytes + struct.pack("<I", vtype) + payload
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    out.write_bytes(data[:16] + struct.pack("<Q", n_kv + 1) + entry + data[24:])


def _string_array(strings: list[bytes]) -> bytes:
    return struct.pack("<IQ", 8, len(strings)) + b"".join(struct.pack("<Q", len(s)) + s for s in strings)


def test_extra_string_array_is_read(tmp_path, gguf_path):
    out = tmp_path / "extra.gguf"
    _add_metadata(gguf_path, out, "x.names", 9, _string_array([b"alpha", b"", "\u00fc".encode()]))
    from mlx_engine.loading.gguf import reader as gguf

    metadata = gguf.read_header(out).metadata
    assert next(v for k, v in metadata.items() if k.startswith("x.names")) == ["alpha", "", "\u00fc"]
    assert me.load_model(out, vocab_only=True).vocab_size == me.load_model(gguf_path, vocab_only=True).vocab_size


@pytest.mark.parametrize("what", ["strings", "bools", "huge count"])
def test_oversized_metadata_arrays_are_refused_from_their_counts(tmp_path, gguf_path, what):
    """A crafted array of millions of entries used to be decoded one element at a
    time for minutes; the declared count is checked before anything is read."""
    from mlx_engine.loading.gguf import reader as gguf

    n = gguf.MAX_ARRAY_ITEMS + 1
    if what == "strings":
        payload = struct.pack("<IQ", 8, n) + struct.pack("<Q", 0) * n
    elif what == "bools":
        payload = struct.pack("<IQ", 7, n) + b"\1" * n
    else:
        payload = struct.pack("<IQ", 8, 2**60)
    out = tmp_path / "big.gguf"
    _add_metadata(gguf_path, out, "x.junk", 9, payload)
    with pytest.raises(me.ModelLoadError, match=r"big\.gguf.*'x\.junk"):
        me.load_model(out, vocab_only=True)


def test_header_bytes_are_bounded(tmp_path, gguf_path):
    from mlx_engine.loading.gguf import reader as gguf

    out = tmp_path / "long.gguf"
    _add_metadata(gguf_path, out, "x.text", 8, struct.pack("<Q", 5000) + b"x" * 5000)
    with pytest.raises(me.ModelLoadError, match=r"long\.gguf.*'x\.text.*4096 bytes of header"):
        gguf.read_header(out, max_header_bytes=4096)
    metadata = gguf.read_header(out).metadata  # within the default bound
    assert next(v for k, v in metadata.items() if k.startswith("x.text")) == "x" * 5000


def test_empty_or_unknown_name(tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        me.load_model("")
    with pytest.raises(me.ModelLoadError, match="does not exist"):
        me.load_model("no-such-model-anywhere")


# -- the real default model ---------------------------------------------------------


@pytest.mark.slow
@requires_default_model
def test_smollm2_answers_under_chat_template(smollm):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    prompt = me.apply_chat_template(smollm, messages)
    assert smollm.tokenizer.decode(prompt).startswith("<|im_start|>system\n")
    assert smollm.tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    text, last = "", None
    for last in me.create_generator(smollm, prompt, max_tokens=40, temp=0.0):
        text += last.text
    assert "Paris" in text
    assert last.stop_condition.stop_reason == "eos_token"
    assert last.stop_condition.stop_tokens == [smollm.tokenizer.get_vocab()["<|im_end|>"]]
    assert "<|im_end|>" not in text
    assert smollm.compute_dtype == mx.float32  # the CPU fast path: dequantized


@requires_default_model
def test_smollm2_metadata(smollm):
    assert smollm.config["num_hidden_layers"] == 30 and smollm.config["num_key_value_heads"] == 3
    assert smollm.vocab_size == 49152
    assert 130e6 < smollm.num_params < 140e6
    assert me.tokenize(smollm, "12345") == [33, 34, 35, 36, 37]  # SmolLM2 splits digits one by one
    assert me.tokenize(smollm, "<|im_start|>")[0] == 1


# Ids the engine's own BPE rebuild gave before the tokenizer came from
# transformers' GGUF converter: the default model must tokenize exactly as before.
_SMOLLM2_TEXT = "<|im_start|>user\nGrüße aus München 🙂 日本語  —  x = 12345;\t\ttabs\n\n\n   spaces <|im_end|>\n<|endoftext|> ünïcödé ½ ℃ \u200b end"
_SMOLLM2_IDS = [
    1,
    4093,
    198,
    27302,
    7170,
    34878,
    85,
    253,
    376,
    30919,
    94,
    7554,
    47526,
    17097,
    241,
    115,
    40993,
    179,
    120,
    248,
    216,
    1841,
    216,
    1792,
    446,
    216,
    33,
    34,
    35,
    36,
    37,
    43,
    197,
    197,
    100,
    7366,
    1116,
    11181,
    5600,
    216,
    2,
    198,
    0,
    5549,
    137,
    94,
    25972,
    83,
    7466,
    84,
    2756,
    216,
    16738,
    4636,
    222,
    221,
    459,
    229,
    1112,
]


@requires_default_model
def test_smollm2_tokenizes_as_before(smollm):
    assert me.tokenize(smollm, _SMOLLM2_TEXT) == _SMOLLM2_IDS
    assert me.tokenize(smollm, _SMOLLM2_TEXT, add_special_tokens=False) == _SMOLLM2_IDS
    assert smollm.tokenizer.decode(_SMOLLM2_IDS) == _SMOLLM2_TEXT


@pytest.mark.slow
@requires_default_model
def test_smollm2_native_keeps_quantized_weights():
    kit = me.load_model(me.DEFAULT_MODEL, compute_dtype="native")
    assert any(isinstance(m, nn.QuantizedLinear) for m in kit.model.modules())
    prompt = me.apply_chat_template(kit, [{"role": "user", "content": "What is the capital of France?"}])
    text = "".join(r.text for r in me.create_generator(kit, prompt, max_tokens=12, temp=0.0))
    assert "Paris" in text
