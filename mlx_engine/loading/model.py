"""Reading a model directory (validation with clear errors, offline only) and
readying its weights: the compute dtype, evaluation on the loading thread, a
one-token smoke test."""

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
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from ..errors import ModelLoadError
from . import catalog
from .checks import check_config_fields, check_model_files, check_weights_match_config
from .evaluation import eval_piecewise
from .gguf import families as gguf_models
from .gguf import reader as gguf
from .gguf import tokenizer as gguf_tokenizer
from .memory import physical_memory

logger = logging.getLogger(__name__)

QUANTIZED_LAYERS = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)  # the last: MoE experts
FLOAT32_MEMORY_SHARE = 0.25  # "auto" dequantizes on the CPU only while float32 weights fit in this share of RAM

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
    """A Hugging Face-layout model directory (config.json inside)."""
    path = _existing_path(model_path, what)
    if not path.is_dir():
        raise ModelLoadError(f"{what} {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{what} {str(path)!r} has no config.json; expected a Hugging Face model directory")
    return path


def resolve_model_path(model_path: str | os.PathLike, what: str = "model_path") -> Path:
    """Where a model's files are: a Hugging Face-layout directory, a ``.gguf``
    file, a directory holding one GGUF model (as LM Studio's folders do), or a
    catalog name such as ``"smollm2-135m-instruct"`` (catalog.py)."""
    if isinstance(model_path, str) and not Path(model_path).expanduser().exists():
        installed = catalog.lookup(model_path)
        if installed is not None:
            return installed
    path = _existing_path(model_path, what)
    if path.is_file():
        if not gguf.is_gguf(path):
            raise ModelLoadError(
                f"{what} {str(path)!r} is a file but not a .gguf model; pass a model directory or a .gguf file"
            )
        return path
    if (path / "config.json").is_file():
        return path
    found = gguf.find_gguf(path)
    if found is None:
        raise ModelLoadError(
            f"{what} {str(path)!r} has no config.json and no .gguf file; expected a Hugging Face model directory or a GGUF model"
        )
    return found


def _existing_path(model_path, what: str) -> Path:
    if not isinstance(model_path, (str, os.PathLike)):
        names = ", ".join(sorted(catalog.CATALOG))
        raise ValueError(
            f"{what} must be a local model directory, a .gguf file or a catalog name ({names}), got {model_path!r}"
        )
    if not str(model_path).strip():
        raise ValueError(f"{what} must not be empty (an empty path would mean the current directory)")
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{what} {str(path)!r} does not exist. The engine only loads local models (a Hugging Face-layout "
            f"directory, a .gguf file, or one of: {', '.join(sorted(catalog.CATALOG))}) and never downloads from a hub."
        )
    return path


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


class HFFiles:
    """A Hugging Face-layout directory: config.json, the tokenizer's files and
    ``model*.safetensors``, read by mlx-lm (offline, never running the folder's
    code unless trusted)."""

    def __init__(self, path: Path):
        self.path = path

    def config(self) -> dict:
        """config.json, checked (valid JSON, an object, a ``model_type``, sane fields)."""
        path = self.path
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

    def tokenizer(self, trust_remote_code: bool = False):
        """The tokenizer, never running code from the folder unless trust_remote_code
        (passed explicitly, so transformers never asks on stdin)."""
        from mlx_lm.utils import _load_tokenizer, _tokenizer_defaults

        try:
            with offline():
                return _load_tokenizer(
                    self.path, {"trust_remote_code": bool(trust_remote_code)}, defaults=_tokenizer_defaults(self.path)
                )
        except Exception as exc:
            raise ModelLoadError(f"could not load the tokenizer from {str(self.path)!r}: {exc}") from exc

    def weights(self, trust_remote_code: bool, lazy: bool = False) -> tuple[nn.Module, dict]:
        """The model and its config; ``lazy=True`` maps the safetensors without
        reading them (a sharded rank reads only its shard)."""
        from mlx_lm.utils import load_model as mlx_lm_load_model

        path = self.path
        files = sorted(glob.glob(str(path / "model*.safetensors")))
        if not files:
            raise ModelLoadError(f"no model*.safetensors weights in {str(path)!r}")
        check_weights_match_config(self.config(), path, [Path(f) for f in files])
        try:
            with offline():
                # lazy here, evaluated below in groups (evaluation.py) rather than by mlx-lm's single mx.eval
                model, config = mlx_lm_load_model(path, lazy=True, trust_remote_code=trust_remote_code)
            if not lazy:
                eval_piecewise(model.parameters())
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"could not load weights from {str(path)!r}: {type(exc).__name__}: {exc}") from exc
        model.eval()
        return model, config


class GGUFFiles:
    """A GGUF file: config, tokenizer and weights all built from its header
    (read once and cached, reader.py) by llama.cpp's own decoders (docs/gguf.md)."""

    def __init__(self, path: Path):
        self.path = path

    def config(self) -> dict:
        """The config mlx-lm's class for the family expects, from the metadata."""
        return gguf_models.config_from_header(gguf.read_header(self.path))

    def tokenizer(self, trust_remote_code: bool = False):
        """The tokenizer rebuilt from the metadata (no code runs: nothing to trust)."""
        return gguf_tokenizer.load_tokenizer(gguf.read_header(self.path))

    def weights(self, trust_remote_code: bool, lazy: bool = False) -> tuple[nn.Module, dict]:
        """The model and its config; a GGUF file is read whole (``lazy`` does not apply)."""
        header = gguf.read_header(self.path)
        config = gguf_models.config_from_header(header)
        return gguf_models.load_model(header, config), config


def model_files(path: Path) -> HFFiles | GGUFFiles:
    """The one place a model's format is chosen: a resolved path
    (``resolve_model_path``) is a GGUF file or a Hugging Face directory."""
    return GGUFFiles(path) if gguf.is_gguf(path) else HFFiles(path)


def read_config(path: Path) -> dict:
    """The model's config.json, or for a GGUF file the equivalent built from its metadata."""
    return model_files(path).config()


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The model's tokenizer (``HFFiles.tokenizer``, ``GGUFFiles.tokenizer``)."""
    return model_files(path).tokenizer(trust_remote_code)


def load_weights(path: Path, trust_remote_code: bool, lazy: bool = False) -> tuple[nn.Module, dict]:
    """The model and its config (``HFFiles.weights``, ``GGUFFiles.weights``)."""
    return model_files(path).weights(trust_remote_code, lazy)


def choose_compute_dtype(model: nn.Module, requested: str | None) -> mx.Dtype | None:
    """The dtype to compute in, or None to keep the weights as stored.

    On the CPU, half-precision and quantized matmuls bypass BLAS and are many
    times slower than float32 (docs/performance.md), so ``"auto"`` upcasts half
    weights and dequantizes quantized ones to float32 there, as long as the
    float32 weights take at most ``FLOAT32_MEMORY_SHARE`` of physical memory. On
    a GPU, ``"auto"`` keeps what is stored."""
    if requested not in (None, "auto", "float32", "float16", "bfloat16", "native"):
        raise ValueError(
            f"compute_dtype must be one of 'auto', 'native', 'float32', 'float16', 'bfloat16', got {requested!r}"
        )
    if requested == "native":
        return None
    if requested in ("float32", "float16", "bfloat16"):
        return getattr(mx, requested)
    if mx.default_device() != mx.cpu:
        return None
    quantized = any(isinstance(m, QUANTIZED_LAYERS) for m in model.modules())
    if quantized:
        needed, budget = 4 * float_param_count(model), FLOAT32_MEMORY_SHARE * physical_memory()
        if needed <= budget:
            return mx.float32
        logger.info(
            "keeping quantized weights: float32 would take %.1f GiB of %.1f GiB allowed", needed / 2**30, budget / 2**30
        )
        return None
    if any(v.dtype in (mx.float16, mx.bfloat16) for _, v in tree_flatten(model.parameters())):
        return mx.float32
    return None


def apply_compute_dtype(model: nn.Module, dtype: mx.Dtype | None, evaluate: bool = True) -> None:
    """Dequantize quantized layers (in float32, so the values are the ones the
    file encodes) and cast to ``dtype``; evaluated here so the weights exist
    before any other thread uses them, unless ``evaluate=False`` (a sharded
    model, whose shards are evaluated after sharding)."""
    if dtype is None:
        return
    from mlx_lm.utils import dequantize_model

    for module in model.modules():
        if isinstance(module, QUANTIZED_LAYERS) and getattr(module, "mode", "affine") == "affine":  # mxfp4: E8M0 bytes
            module.scales = module.scales.astype(mx.float32)
            if getattr(module, "biases", None) is not None:
                module.biases = module.biases.astype(mx.float32)
    dequantize_model(model)
    model.set_dtype(dtype)
    if evaluate:
        eval_piecewise(model.parameters())


def float_param_count(model: nn.Module) -> int:
    """Parameters counted as unquantized values (a 4-bit weight word holds 8)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QUANTIZED_LAYERS):
            total += module.weight.size * 32 // module.bits + sum(v.size for k, v in module.items() if k == "bias")
        elif not module.children():
            total += sum(v.size for _, v in tree_flatten(module.parameters()))
    return total


def prepare_weights(model: nn.Module, compute_dtype: str | None) -> mx.Dtype | None:
    """Apply the compute-dtype policy (choose_compute_dtype) and evaluate
    every array, so nothing is left lazy for another thread; returns the dtype."""
    dtype = choose_compute_dtype(model, compute_dtype)
    apply_compute_dtype(model, dtype)
    materialize(model)
    return dtype


def materialize(model: nn.Module) -> None:
    """Evaluate every array the model holds (parameters, and private arrays such
    as RoPE frequencies), so nothing computed at load is left lazy: MLX streams
    are per thread, and a lazy array cannot be evaluated on another thread."""
    arrays = []
    for module in model.modules():
        for value in list(module.values()) + list(vars(module).values()):
            if isinstance(value, mx.array):
                arrays.append(value)
    eval_piecewise(model.parameters(), arrays)


def smoke_test(model: nn.Module, path: Path) -> None:
    """Run one token through the model at load, so a config the architecture code
    cannot run (e.g. a ``rope_theta`` of the wrong type) or non-finite weights fail
    here with a ``ModelLoadError``, not in the host's first request."""
    from mlx_lm.models.cache import make_prompt_cache

    try:
        logits = model(mx.array([[0]], dtype=mx.uint32), cache=make_prompt_cache(model))
        finite = bool(mx.all(mx.isfinite(logits)).item())
    except Exception as exc:
        raise ModelLoadError(
            f"the model in {str(path)!r} cannot run with its config.json: {type(exc).__name__}: {exc}"
        ) from exc
    if not finite:
        raise ModelLoadError(
            f"the model in {str(path)!r} computes NaN or infinite logits: its weights hold NaN/inf values"
        )


def eos_token_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for tok in END_OF_TURN_TOKENS:
        if tok in vocab:
            ids.add(int(vocab[tok]))
    return ids


def attention_head_dim(config: dict) -> int | None:
    """The size of one attention head, from config.json (None if it does not say)."""
    cfg = config.get("text_config", config)
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return None


def embedding_rows(model: nn.Module) -> int | None:
    """The token ids a model's input embedding has rows for, found by its usual names."""
    for name in ("model", "language_model", "transformer"):
        inner = getattr(model, name, None)
        if inner is None:
            continue
        for emb_name in ("embed_tokens", "wte", "tok_embeddings"):
            emb = getattr(inner, emb_name, None)
            if emb is not None and hasattr(emb, "weight"):
                return emb.weight.shape[0]
        found = embedding_rows(inner)
        if found is not None:
            return found
    return None
