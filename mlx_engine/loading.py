"""Reading a model directory: validation with clear errors, offline only."""

from __future__ import annotations

import glob
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn

from .errors import ModelLoadError
from .model_checks import check_config_fields, check_model_files, check_weights_match_config

logger = logging.getLogger(__name__)

# Tokens that end a turn in common chat formats; added to the stop set when the
# vocabulary has them.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "<|endoftext|>",
    "</s>",
    "<|return|>",
)


@contextmanager
def offline() -> Iterator[None]:
    """Block Hugging Face hub access while reading a model: the engine only ever
    reads local files. Both the env vars and the already-imported constants are
    set, since the libraries read them at import time."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    patched: list[tuple[Any, str, Any]] = []
    for k in keys:
        os.environ[k] = "1"
    try:
        import huggingface_hub.constants as hf_constants

        patched.append((hf_constants, "HF_HUB_OFFLINE", hf_constants.HF_HUB_OFFLINE))
        hf_constants.HF_HUB_OFFLINE = True
    except Exception:  # pragma: no cover - hub not installed
        pass
    try:
        yield
    finally:
        for obj, name, value in patched:
            setattr(obj, name, value)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def resolve_model_dir(model_path: str | os.PathLike, what: str = "model_path") -> Path:
    if not isinstance(model_path, (str, os.PathLike)):
        raise ValueError(f"{what} must be a path to a local model directory, got {model_path!r}")
    if not str(model_path).strip():
        raise ValueError(f"{what} must not be empty (an empty path would mean the current directory)")
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{what} {str(path)!r} does not exist. The engine only loads local model "
            "directories (Hugging Face layout) and never downloads from a hub."
        )
    if not path.is_dir():
        raise ModelLoadError(f"{what} {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{what} {str(path)!r} has no config.json; expected a Hugging Face model directory")
    return path


def read_config(path: Path) -> dict:
    check_model_files(path)
    try:
        with open(path / "config.json", encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"config.json in {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"config.json in {str(path)!r} must hold a JSON object")
    if "model_type" not in config:
        raise ModelLoadError(f"config.json in {str(path)!r} has no 'model_type'")
    check_config_fields(config, path)
    return config


def is_vision_config(config: dict) -> bool:
    return "vision_config" in config


def check_architecture(config: dict, path: Path) -> None:
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except (ValueError, AttributeError, ImportError, TypeError) as exc:
        raise ModelLoadError(
            f"unsupported model type {config.get('model_type')!r} in {str(path)!r}: mlx-lm has no implementation for it"
        ) from exc


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The tokenizer, never running code from the folder unless trust_remote_code
    (passed explicitly, so transformers never asks on stdin)."""
    from mlx_lm.utils import _load_tokenizer, _tokenizer_defaults

    try:
        with offline():
            return _load_tokenizer(path, {"trust_remote_code": bool(trust_remote_code)}, defaults=_tokenizer_defaults(path))
    except Exception as exc:
        raise ModelLoadError(f"could not load the tokenizer from {str(path)!r}: {exc}") from exc


def load_weights(path: Path, trust_remote_code: bool) -> tuple[nn.Module, dict]:
    from mlx_lm.utils import load_model as mlx_lm_load_model

    files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise ModelLoadError(f"no model*.safetensors weights in {str(path)!r}")
    check_weights_match_config(read_config(path), path, [Path(f) for f in files])
    try:
        with offline():
            model, config = mlx_lm_load_model(path, lazy=False, trust_remote_code=trust_remote_code)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"could not load weights from {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    model.eval()
    return model, config


def choose_compute_dtype(model: nn.Module, requested: str | None) -> mx.Dtype | None:
    """On the CPU, half-precision matmuls bypass BLAS and are many times slower
    than float32, so unquantized half weights are upcast there by default."""
    if requested not in (None, "auto", "float32", "float16", "bfloat16", "native"):
        raise ValueError(f"compute_dtype must be one of 'auto', 'native', 'float32', 'float16', 'bfloat16', got {requested!r}")
    if requested == "native":
        return None
    if requested in ("float32", "float16", "bfloat16"):
        return getattr(mx, requested)
    if mx.default_device() != mx.cpu:
        return None
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    if any(k.endswith(".scales") for k, _ in params):
        return None  # quantized weights stay as they are
    if any(v.dtype in (mx.float16, mx.bfloat16) for _, v in params):
        return mx.float32
    return None


def eos_token_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for tok in END_OF_TURN_TOKENS:
        if tok in vocab:
            ids.add(int(vocab[tok]))
    return ids
