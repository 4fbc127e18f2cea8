"""How a model embeds, read from its own files: sentence-transformers'
``modules.json`` (Transformer, Pooling, Normalize), ``1_Pooling/config.json``
(which pooling) and ``sentence_bert_config.json`` (the longest input), with
explicit overrides for models that ship without them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

# sentence-transformers' Pooling flags, in the order it concatenates several of them.
POOLING_FLAGS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
POOLINGS = tuple(POOLING_FLAGS)
_UNSUPPORTED_FLAGS = ("pooling_mode_weightedmean_tokens",)
_ENCODER_TYPES = ("bert",)  # implemented here in MLX (bert.py)
# Decoder embedding families trained with Matryoshka representation learning, so
# a prefix of the vector is itself an embedding (Qwen3-Embedding: 32 dimensions up).
_MATRYOSHKA_TYPES = ("qwen3",)


@dataclass(frozen=True)
class EmbeddingConfig:
    """``pooling``: the pooling modes, concatenated in this order when several;
    ``normalize``: L2-normalize the pooled vector; ``max_length``: the most
    tokens one input may have; ``matryoshka``: whether a prefix of the vector
    (renormalized) is itself an embedding, so ``dimensions`` may shorten it."""

    pooling: tuple[str, ...]
    normalize: bool
    max_length: int
    matryoshka: bool


@dataclass(frozen=True)
class EmbeddingOverrides:
    """What a caller sets over the model's own files (``load_embedding_model``'s
    arguments of the same names); each None keeps what the files say."""

    pooling: str | None = None
    normalize: bool | None = None
    max_length: int | None = None
    matryoshka: bool | None = None


def is_embedding_model(path: Path) -> bool:
    """Whether ``path`` is a model directory in sentence-transformers' layout
    (``modules.json`` with a Pooling module)."""
    modules = path / "modules.json"
    if not (path.is_dir() and modules.is_file()):
        return False
    try:
        return any(str(m.get("type", "")).endswith(".Pooling") for m in _read_json(modules))
    except (ModelLoadError, AttributeError):
        return False


def is_encoder(config: dict) -> bool:
    """Whether the model is an encoder this package implements (bidirectional
    attention) rather than an mlx-lm decoder."""
    return config.get("model_type") in _ENCODER_TYPES


def read_embedding_config(
    path: Path, config: dict, overrides: EmbeddingOverrides = EmbeddingOverrides()
) -> EmbeddingConfig:
    """The model's own embedding configuration, each part overridden by the
    field of ``overrides`` of the same name when that is not None."""
    pooling, normalize, matryoshka = overrides.pooling, overrides.normalize, overrides.matryoshka
    modules = _read_json(path / "modules.json") if (path / "modules.json").is_file() else []
    if not isinstance(modules, list):
        raise ModelLoadError(f"modules.json in {str(path)!r} must hold a JSON list of modules")
    found_pooling, found_normalize = (
        _pooling_of(path, modules),
        any(str(m.get("type", "")).endswith(".Normalize") for m in modules if isinstance(m, dict)),
    )
    if pooling is not None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        found_pooling = (pooling,)
    if found_pooling is None:
        found_pooling = ("mean",) if is_encoder(config) else ("lasttoken",)
    if normalize is not None and not isinstance(normalize, bool):
        raise ValueError(f"normalize must be True, False or None, got {normalize!r}")
    if matryoshka is not None and not isinstance(matryoshka, bool):
        raise ValueError(f"matryoshka must be True, False or None, got {matryoshka!r}")
    return EmbeddingConfig(
        found_pooling,
        found_normalize if normalize is None else normalize,
        _max_length(path, config, overrides.max_length),
        config.get("model_type") in _MATRYOSHKA_TYPES if matryoshka is None else matryoshka,
    )


def _pooling_of(path: Path, modules: list) -> tuple[str, ...] | None:
    """The Pooling module's modes, None when the model has no Pooling module."""
    module = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    if module is None:
        return None
    file = path / str(module.get("path", "")) / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"modules.json in {str(path)!r} names a Pooling module but {str(file)!r} is missing")
    settings = _read_json(file)
    if not isinstance(settings, dict):
        raise ModelLoadError(f"{str(file)!r} must hold a JSON object")
    for flag in _UNSUPPORTED_FLAGS:
        if settings.get(flag):
            raise ModelLoadError(f"{str(file)!r} asks for {flag}, which mlx-engine does not implement")
    modes = tuple(mode for mode, flag in POOLING_FLAGS.items() if settings.get(flag))
    if not modes:
        raise ModelLoadError(f"{str(file)!r} turns on no pooling mode ({', '.join(POOLING_FLAGS.values())})")
    return modes


def _max_length(path: Path, config: dict, requested: int | None) -> int:
    """The most tokens per input: the argument, else sentence-transformers'
    ``max_seq_length``, else the tokenizer's ``model_max_length``, within the
    model's position table."""
    positions = config.get("max_position_embeddings")
    limit = positions if isinstance(positions, int) and positions > 0 else None
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"max_length must be a positive integer or None, got {requested!r}")
        if limit is not None and requested > limit:
            raise ValueError(
                f"max_length must be at most the model's max_position_embeddings ({limit}), got {requested}"
            )
        return requested
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        file = path / name
        value = _read_json(file).get(key) if file.is_file() else None
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 10**7:
            return min(value, limit) if limit is not None else value
    if limit is None:
        raise ModelLoadError(f"no input length limit in {str(path)!r}: pass max_length")
    return limit


def _read_json(file: Path):
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{str(file)!r} is not readable JSON: {exc}") from exc
