"""A GGUF file's tokenizer, rebuilt from its metadata by transformers' GGUF
tokenizer converter (``convert_gguf_tokenizer``): byte-level BPE
(``tokenizer.ggml.model = gpt2``) and SentencePiece (``llama``: scores, byte
fallback, the space-prefix flag). Only the converter is used, never
transformers' GGUF *reader*, which imports torch; the metadata comes from the
engine's own bounded header walk (gguf.py), each field type-checked here.

Own code remains where a test shows the converter differs from the model's own
tokenizer (tests/test_gguf_families.py, docs/gguf.md):

- ``tokenizer.ggml.pre`` values the converter does not know (``smollm``,
  ``starcoder``, ``refact``) split digits one by one before GPT-2's split, as
  those models' ``tokenizer.json`` do; the converter splits digit runs whole.
- SentencePiece vocabularies get llama.cpp's space prefix as the file's
  ``add_space_prefix`` flag says (absent: on, as llama.cpp): always one, even
  before leading spaces. The converter's Metaspace drops it when the text starts
  with a space, and its gemma builder ignores the flag.
- SentencePiece files without merges: the converter derives them from the
  vocabulary (``generate_merges``) by trying every split of every token, a
  slice and a lookup per position: quadratic in a token's length (one 250k-
  character token took 29 s, 1M over 300 s). ``derived_merges`` gives the same
  merges trying only the splits whose halves are no longer than the longest
  shorter token, and hands them to the converter.
- The converter builds no post-processor: BOS/EOS are added here from the
  ``add_bos_token``/``add_eos_token`` flags (SentencePiece files without the
  flag add BOS, as llama.cpp does).
"""

from __future__ import annotations

import logging

import numpy as np

from ...errors import ModelLoadError
from .reader import GGUFHeader, bad_field, meta_flag, meta_int, meta_str

logger = logging.getLogger(__name__)

TOKENIZER_MODELS = ("gpt2", "llama")
_DIGITS_FIRST = ("smollm", "starcoder", "refact")


def _token_list(h: GGUFHeader, key: str) -> list[str]:
    value = h.metadata.get(key)
    if value is None or (isinstance(value, list) and not value):
        raise ModelLoadError(f"GGUF file {str(h.path)!r} has no tokenizer: metadata {key!r} is missing or empty")
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise bad_field(h, key, value, "an array of strings")
    return value


def _per_token(h: GGUFHeader, key: str, n_tokens: int, kinds: str, default) -> list:
    value = h.metadata.get(key)
    if value is None:
        return [default] * n_tokens
    if not (isinstance(value, np.ndarray) and value.dtype.kind in kinds and len(value) == n_tokens):
        raise bad_field(h, key, value, f"an array of {n_tokens} numbers (one per token)")
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise bad_field(h, key, value, "finite numbers")
    return value.tolist()


def tokenizer_fields(h: GGUFHeader) -> dict:
    """The metadata transformers' converter reads, under its names, type-checked."""
    kind = meta_str(h, "tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise ModelLoadError(
            f"GGUF file {str(h.path)!r} has tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece)"
        )
    tokens = _token_list(h, "tokenizer.ggml.tokens")
    if len(set(tokens)) != len(tokens):
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: metadata 'tokenizer.ggml.tokens' holds a token twice")
    fields = {
        "tokenizer_type": kind,
        "pre_tokenizer_type": meta_str(h, "tokenizer.ggml.pre"),
        "tokens": tokens,
        "token_type": _per_token(h, "tokenizer.ggml.token_type", len(tokens), "iu", 1),
    }
    if kind == "gpt2":
        fields["merges"] = _token_list(h, "tokenizer.ggml.merges")
    else:
        if "tokenizer.ggml.scores" not in h.metadata:
            raise ModelLoadError(
                f"GGUF file {str(h.path)!r} has no tokenizer: metadata 'tokenizer.ggml.scores' is missing"
            )
        fields["scores"] = _per_token(h, "tokenizer.ggml.scores", len(tokens), "f", 0.0)
        if "tokenizer.ggml.merges" in h.metadata:
            fields["merges"] = _token_list(h, "tokenizer.ggml.merges")
    for name in ("bos", "eos", "unknown", "padding"):
        key = f"tokenizer.ggml.{name}_token_id"
        if key in h.metadata:
            fields[f"{name}_token_id"] = meta_int(h, key, lo=0, hi=len(tokens) - 1)
    return fields


def _backend(h: GGUFHeader, fields: dict):
    from tokenizers import pre_tokenizers

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as exc:  # transformers 4.x kept an older converter elsewhere, not tested here
        import transformers

        raise ModelLoadError(
            f"GGUF file {str(h.path)!r}: reading its tokenizer needs transformers' GGUF tokenizer converter "
            f"(transformers.integrations.gguf, transformers 5.x); installed: transformers {transformers.__version__}"
        ) from exc

    converter_fields = {k: v for k, v in fields.items() if v is not None}
    if fields["tokenizer_type"] == "llama" and "merges" not in fields:
        merges = derived_merges(h.architecture, fields["tokens"], fields["scores"])
        if merges is not None:
            converter_fields["merges"] = merges
    if "unknown_token_id" in fields:
        converter_fields["unk_token_id"] = fields["unknown_token_id"]
    if "padding_token_id" in fields:
        converter_fields["pad_token_id"] = fields["padding_token_id"]
    try:
        backend, _ = convert_gguf_tokenizer(h.architecture, converter_fields)
    except Exception as exc:  # noqa: BLE001 - the converter's own errors, named with the file
        raise ModelLoadError(f"GGUF file {str(h.path)!r}: could not build its tokenizer: {exc}") from exc
    if fields["tokenizer_type"] == "llama":
        has_flag = "tokenizer.ggml.add_space_prefix" in h.metadata
        _spm_space_prefix(backend, meta_flag(h, "tokenizer.ggml.add_space_prefix") if has_flag else True)
    if fields["tokenizer_type"] == "gpt2" and fields["pre_tokenizer_type"] in _DIGITS_FIRST:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return backend


GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")  # the converter's gemma builder: respelled, file order


def derived_merges(architecture: str, tokens: list[str], scores: list[float]) -> list[str] | None:
    """The merges transformers' converter derives for a SentencePiece file that
    lists none (``generate_merges``, with its token spelling and scores for this
    architecture), as "left right" strings, in linear time in a token's length:
    a split can only be a merge when both halves are tokens, and both are
    shorter than the token, so only splits with halves no longer than the longest
    shorter token are tried. None when a half holds a space (the converter's
    "left right" format cannot carry it): the converter then derives them itself."""
    if architecture in GEMMA_ARCHITECTURES:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranking = {t: -i for i, t in enumerate(tokens)}
    else:
        ranking = dict(zip(tokens, scores))
    vocab = {t: i for i, t in enumerate(tokens)}
    lengths = sorted({len(t) for t in vocab})
    longest_shorter, previous = {}, 0
    for n in lengths:
        longest_shorter[n], previous = previous, n
    merges = []
    for merge, score in ranking.items():
        size, limit = len(merge), longest_shorter[len(merge)]
        local = []
        for index in range(max(1, size - limit), min(size - 1, limit) + 1):
            left, right = merge[:index], merge[index:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    if any(" " in left or " " in right for left, right, _ in merges):
        return None
    return [f"{left} {right}" for left, right, _ in merges]


def _spm_space_prefix(backend, add_space_prefix: bool) -> None:
    """SentencePiece's dummy prefix, as llama.cpp adds it when the file asks:
    always one space before a text (and after each special token), even one
    that starts with spaces. The converter's ``Metaspace(prepend_scheme="first")``
    skips it when the text already starts with a space, so "   x" lost a token."""
    from tokenizers import normalizers

    replace = normalizers.Replace(pattern=" ", content="\u2581")
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(prepend="\u2581"), replace]) if add_space_prefix else replace
    )
    backend.pre_tokenizer = None


def _add_special(h: GGUFHeader, backend, fields: dict) -> None:
    from tokenizers import processors

    tokens = fields["tokens"]
    add_bos = (
        meta_flag(h, "tokenizer.ggml.add_bos_token")
        if "tokenizer.ggml.add_bos_token" in h.metadata
        else (fields["tokenizer_type"] == "llama")
    )
    add_eos = meta_flag(h, "tokenizer.ggml.add_eos_token")
    single, special = "$A", []
    if add_bos and "bos_token_id" in fields:
        bos = tokens[fields["bos_token_id"]]
        single, special = f"{bos} {single}", [(bos, fields["bos_token_id"])]
    if add_eos and "eos_token_id" in fields:
        eos = tokens[fields["eos_token_id"]]
        single = f"{single} {eos}"
        special = [*special, (eos, fields["eos_token_id"])] if eos not in dict(special) else special
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} {single.replace('$A', '$B')}", special_tokens=special
    )


def load_tokenizer(h: GGUFHeader):
    """The file's tokenizer as an mlx-lm ``TokenizerWrapper``: control tokens
    (type 3) are special and user-defined ones (type 4) are added tokens, so
    both encode whole; the chat template is the file's. The wrapped
    tokenizer is a ``GGUFTokenizerFast`` (fast_tokenizer.py: no copy of the
    backend, the vocabulary built once)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper

    from .fast_tokenizer import GGUFTokenizerFast

    fields = tokenizer_fields(h)
    backend = _backend(h, fields)
    _add_special(h, backend, fields)
    tokens = fields["tokens"]
    special = {
        name: tokens[fields[key]]
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
        if key in fields
    }  # fmt: skip
    fast = GGUFTokenizerFast(
        backend,
        chat_template=meta_str(h, "tokenizer.chat_template"),
        model_max_length=meta_int(h, f"{h.architecture}.context_length", 4096),
        **special,
    )
    eos = [fields["eos_token_id"]] if "eos_token_id" in fields else []
    detokenizer = BPEStreamingDetokenizer if fields["tokenizer_type"] == "gpt2" else SPMStreamingDetokenizer
    return TokenizerWrapper(fast, detokenizer, eos_token_ids=eos)
