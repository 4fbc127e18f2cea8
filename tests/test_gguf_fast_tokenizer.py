"""A GGUF file's tokenizer is a ``GGUFTokenizerFast`` (no deep copy of its
backend, the vocabulary cached: loading/gguf/fast_tokenizer.py); it must
tokenize, decode and name special tokens exactly as transformers' own
``PreTrainedTokenizerFast`` over the same backend did."""

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.loading.gguf import fast_tokenizer, reader, tokenizer
from mlx_engine.loading.gguf.fast_tokenizer import GGUFTokenizerFast

import pytest
from helpers import requires_default_model
from transformers import AddedToken, PreTrainedTokenizerFast

from fixtures.tiny_models import make_gguf

TEXTS = [
    "def add(a, b):\n    return a + b  # 12345",
    "<|im_start|>user\nhi<|im_end|>\n",
    "Grüße aus München 🙂 日本語",
    "   leading spaces and\ttabs\n\n\n",
    "",
]


def _both(path, monkeypatch):
    """The file's tokenizer as loaded now, and as transformers' class builds it."""
    header = reader.read_header(path)
    new = tokenizer.load_tokenizer(header)
    with monkeypatch.context() as m:
        m.setattr(
            fast_tokenizer,
            "GGUFTokenizerFast",
            lambda backend, **kw: PreTrainedTokenizerFast(tokenizer_object=backend, **kw),
        )
        old = tokenizer.load_tokenizer(header)
    assert isinstance(new._tokenizer, GGUFTokenizerFast) and not isinstance(old._tokenizer, GGUFTokenizerFast)
    return new, old


def _assert_same(new, old):
    for text in TEXTS:
        for special in (True, False):
            ids = new.encode(text, add_special_tokens=special)
            assert ids == old.encode(text, add_special_tokens=special), text
            assert new.decode(ids) == old.decode(ids)
            assert new.decode(ids, skip_special_tokens=True) == old.decode(ids, skip_special_tokens=True)
    assert new.get_vocab() == old.get_vocab()
    every = list(range(len(old._tokenizer)))
    assert new.convert_ids_to_tokens(every) == old.convert_ids_to_tokens(every)
    assert new.convert_ids_to_tokens(every, skip_special_tokens=True) == old.convert_ids_to_tokens(
        every, skip_special_tokens=True
    )
    assert new.convert_ids_to_tokens(5) == old.convert_ids_to_tokens(5)
    assert new.special_tokens_map == old.special_tokens_map
    assert new.all_special_ids == old.all_special_ids
    assert new.eos_token_ids == old.eos_token_ids
    assert new.chat_template == old.chat_template


@requires_default_model
def test_default_model_tokenizer_is_unchanged(monkeypatch):
    from mlx_engine.loading.model import resolve_model_path

    new, old = _both(resolve_model_path(me.DEFAULT_MODEL), monkeypatch)
    _assert_same(new, old)
    messages = [{"role": "user", "content": "hi"}]
    assert new.apply_chat_template(messages, tokenize=False) == old.apply_chat_template(messages, tokenize=False)
    detok_new, detok_old = new.detokenizer, old.detokenizer
    for i in new.encode(TEXTS[2] + TEXTS[0]):
        detok_new.add_token(i)
        detok_old.add_token(i)
    detok_new.finalize()
    detok_old.finalize()
    assert detok_new.text == detok_old.text


def test_fixture_gguf_tokenizer_is_unchanged(models_dir, llama_path, monkeypatch):
    path = make_gguf(llama_path, models_dir / "gguf-fast-tokenizer" / "tiny-llama.gguf", add_bos=True)
    _assert_same(*_both(path, monkeypatch))


def test_added_tokens_refresh_the_cached_vocabulary(models_dir, llama_path):
    path = make_gguf(llama_path, models_dir / "gguf-fast-tokenizer-added" / "tiny-llama.gguf")
    fast = tokenizer.load_tokenizer(reader.read_header(path))._tokenizer
    before = fast.get_vocab()
    fast.get_vocab()["changed by a caller"] = 0  # a copy each call: the cache stays as it was
    assert fast.get_vocab() == before
    assert fast.add_tokens([AddedToken("<brand-new>", special=True)]) == 1
    vocab = fast.get_vocab()
    assert vocab["<brand-new>"] == len(before)
    assert fast.convert_ids_to_tokens([vocab["<brand-new>"]]) == ["<brand-new>"]


def test_backend_is_taken_as_given_only():
    with pytest.raises(TypeError, match="backend"):
        GGUFTokenizerFast(None, tokenizer_object=None)
