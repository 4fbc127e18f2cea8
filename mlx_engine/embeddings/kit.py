"""EmbeddingKit: a loaded embedding model (a BERT-family encoder, bert.py, or an
mlx-lm decoder pooled at its last token), its tokenizer and how it pools
(config.py); ``embed`` turns texts or token ids into vectors."""

from __future__ import annotations

import gc
import glob
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import InvalidArgument, ModelLoadError
from ..loading import model as loading
from ..runtime import worker as workers
from ..runtime.worker import MLXWorker
from .bert import BertConfig, BertModel
from .config import EmbeddingConfig, EmbeddingOverrides, is_encoder, read_embedding_config

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32  # sentence-transformers' default: inputs padded together per forward pass


@dataclass(frozen=True)
class Embeddings:
    """``embed``'s result: one row of ``vectors`` (float32) per input, in the
    inputs' order; ``token_counts``: the tokens each input was embedded from
    (after truncation); ``truncated``: which inputs were cut to the model's
    ``max_length``."""

    vectors: np.ndarray
    token_counts: tuple[int, ...]
    truncated: tuple[bool, ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)

    @property
    def dimensions(self) -> int:
        return int(self.vectors.shape[1])

    def tolist(self) -> list[list[float]]:
        return self.vectors.tolist()


class EmbeddingKit:
    """A loaded embedding model. ``dimensions``: the width of its vectors;
    ``max_length``: the most tokens one input may have; ``config``: its pooling,
    normalization and whether it allows shortened (Matryoshka) vectors. Its MLX
    work runs on its own engine thread, as a ``ModelKit``'s does."""

    max_parallel = 1  # one batch at a time on the engine thread; a server queues the rest
    draft = None  # a ModelKit's fields that hosts read (server/host.py): none here
    prompt_cache = None

    def __init__(
        self,
        path: Path,
        model: nn.Module,
        tokenizer,
        config: EmbeddingConfig,
        encoder: bool,
        width: int,
        worker: MLXWorker | None = None,
    ):
        """``worker``: the engine thread the kit was built on and runs on (None:
        a pool thread of its own, returned once the kit is gone, as for a ``ModelKit``)."""
        self.model_path = path
        self.model: nn.Module | None = model
        self.tokenizer = tokenizer
        # A fast tokenizer called with truncation changes its own settings: calls from
        # several threads at once could collide ("Already borrowed"), so they take turns.
        self.tokenizer_lock = threading.Lock()
        self.config = config
        self.encoder = encoder  # True: bidirectional BERT; False: a causal decoder's hidden states
        self.dimensions = width * len(config.pooling)
        self._worker = worker if worker is not None else workers.release_with(self, workers.acquire())

    @property
    def max_length(self) -> int:
        return self.config.max_length

    @property
    def context_length(self) -> int:
        return self.config.max_length

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def worker(self) -> MLXWorker:
        """The engine thread that runs this kit's MLX work (runtime/worker.py)."""
        return self._worker

    def unload(self) -> None:
        """Drop the weights (on the engine thread); the kit cannot embed afterwards."""
        self.model = None
        gc.collect()
        mx.clear_cache()

    def hidden_states(self, ids: mx.array, mask: mx.array) -> mx.array:
        """The last hidden states of a right-padded batch. A causal decoder's
        real tokens never see the padding after them, so no mask is needed there."""
        if self.encoder:
            return self.model(ids, mask)
        return self.model.model(ids)


# -- loading -------------------------------------------------------------------------------
def load_embedding_kit(
    path: Path,
    overrides: EmbeddingOverrides = EmbeddingOverrides(),
    *,
    compute_dtype: str | None = "auto",
    trust_remote_code: bool = False,
    worker: MLXWorker | None = None,
) -> EmbeddingKit:
    """The kit for the model directory ``path`` (on ``worker``, the engine thread
    that will run it): a BERT encoder built here, any other architecture through
    mlx-lm as a decoder."""
    config = loading.read_config(path)
    settings = read_embedding_config(path, config, overrides)
    if is_encoder(config):
        model, width = _load_bert(path, config), config["hidden_size"]
    else:
        model, width = _load_decoder(path, config, trust_remote_code), _decoder_width(config)
    loading.prepare_weights(model, compute_dtype)
    tokenizer = _load_tokenizer(path, trust_remote_code)
    kit = EmbeddingKit(path, model, tokenizer, settings, is_encoder(config), width, worker)
    logger.info(
        "loaded embedding model %s: %d dimensions, pooling %s, normalize %s, max_length %d",
        path,
        kit.dimensions,
        "+".join(settings.pooling),
        settings.normalize,
        settings.max_length,
    )
    return kit


def _safetensors(path: Path) -> dict[str, mx.array]:
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {str(path)!r}")
    weights = {}
    for file in files:
        try:
            weights.update(mx.load(file))
        except Exception as exc:
            raise ModelLoadError(f"could not read weights from {file!r}: {exc}") from exc
    return weights


def _load_bert(path: Path, config: dict) -> BertModel:
    model = BertModel(BertConfig.from_dict(config))
    try:
        model.load_weights(list(BertModel.sanitize(_safetensors(path)).items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"the BERT weights in {str(path)!r} do not match its config.json: {exc}") from exc
    model.eval()
    return model


def _decoder_width(config: dict) -> int:
    width = config.get("hidden_size") or config.get("text_config", {}).get("hidden_size")
    if not isinstance(width, int):
        raise ModelLoadError("config.json has no hidden_size")
    return width


def _load_decoder(path: Path, config: dict, trust_remote_code: bool) -> nn.Module:
    """An mlx-lm model whose inner ``model`` gives the hidden states. Weights
    saved from a base model (Qwen3-Embedding's: no ``model.`` prefix, no LM
    head) are accepted; every weight of the inner model must be present."""
    from mlx_lm.utils import _get_classes
    from mlx_lm.utils import load_model as mlx_lm_load_model

    def classes(config: dict):
        model_class, args_class = _get_classes(config)

        class Decoder(model_class):
            def sanitize(self, weights):
                if not any(k.startswith("model.") for k in weights):
                    weights = {f"model.{k}": v for k, v in weights.items()}
                if hasattr(model_class, "sanitize"):
                    weights = model_class.sanitize(self, weights)
                expected = {k for k, _ in tree_flatten(self.parameters()) if k.startswith("model.")}
                missing = sorted(expected - set(weights))
                if missing:
                    raise ModelLoadError(f"weights missing for {', '.join(missing[:5])}")
                return {k: v for k, v in weights.items() if k.startswith("model.")}

        return Decoder, args_class

    loading.check_architecture(config, path)
    try:
        with loading.offline():
            model, _ = mlx_lm_load_model(
                path, strict=False, get_model_classes=classes, trust_remote_code=trust_remote_code
            )
    except ModelLoadError as exc:
        raise ModelLoadError(f"could not load the decoder in {str(path)!r}: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(f"could not load weights from {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(getattr(model, "model", None), nn.Module):
        raise ModelLoadError(f"the {config.get('model_type')!r} model in {str(path)!r} has no inner model to pool")
    model.eval()
    return model


def _load_tokenizer(path: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        with loading.offline():
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(trust_remote_code))
    except Exception as exc:
        raise ModelLoadError(f"could not load the tokenizer from {str(path)!r}: {exc}") from exc


# -- embedding -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """Inputs as token ids, checked: ``ids[i]`` at most the model's max_length."""

    ids: list[list[int]]
    truncated: list[bool]


def tokenize_inputs(kit: EmbeddingKit, texts, truncate: bool) -> Batch:
    """``texts`` (a string, or a non-empty list of strings or token-id lists) as
    token ids; ``InvalidArgument`` naming ``texts[i]`` for a bad or too long one."""
    if not isinstance(truncate, bool):
        raise InvalidArgument("{param} must be True or False, got {got}", "truncate", got=repr(truncate))
    items = [texts] if isinstance(texts, str) else texts
    if not isinstance(items, (list, tuple)) or not items:
        raise InvalidArgument("{param} must be a string or a non-empty list of strings or token-id lists", "texts")
    strings = [i for i, t in enumerate(items) if isinstance(t, str)]
    encoded = _encode(kit, [items[i] for i in strings]) if strings else []
    ids: list[list[int] | None] = [None] * len(items)
    for i, row in zip(strings, encoded):
        ids[i] = row
    for i, item in enumerate(items):
        if ids[i] is None:
            ids[i] = _checked_ids(kit, item, i)
    out, cut, limit = [], [], kit.max_length
    for i, row in enumerate(ids):
        if not row:
            raise InvalidArgument("{param} has no tokens: nothing to embed", "texts", index=i)
        if len(row) > limit and not truncate:
            raise InvalidArgument(
                "{param} has {length} tokens, over the model's max_length of {limit}; "
                "shorten it or pass {truncate=True} to embed its first tokens",
                "texts",
                index=i,
                length=len(row),
                limit=limit,
            )
        if len(row) > limit:
            row = _encode(kit, [items[i]], limit)[0] if isinstance(items[i], str) else row[:limit]
        out.append(row)
        cut.append(len(ids[i]) > limit)
    return Batch(out, cut)


def _encode(kit: EmbeddingKit, strings: list[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids with the tokenizer's special tokens; cut to ``max_length`` by the
    tokenizer itself (which keeps the closing special tokens, as sentence-transformers does)."""
    for i, s in enumerate(strings):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(
                "{param} is not valid Unicode text: {detail}", "texts", index=i, detail=exc.reason
            ) from None
    kwargs = {"truncation": True, "max_length": max_length} if max_length else {"verbose": False}
    with kit.tokenizer_lock:
        encoded = kit.tokenizer(strings, add_special_tokens=True, **kwargs)["input_ids"]
    return [list(r) for r in encoded]


def _checked_ids(kit: EmbeddingKit, item, i: int) -> list[int]:
    vocab = kit.vocab_size
    if not isinstance(item, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in item
    ):
        raise InvalidArgument(
            "{param} must be a string or a list of token ids (integers from 0 to {most})",
            "texts",
            index=i,
            most=vocab - 1,
        )
    return list(item)


def check_dimensions(kit: EmbeddingKit, dimensions) -> int | None:
    """``dimensions`` checked: None, or 1 to the model's width on a model that
    allows shortened (Matryoshka) vectors."""
    if dimensions is None:
        return None
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= kit.dimensions:
        raise InvalidArgument(
            "{param} must be an integer from 1 to {most}, got {got}",
            "dimensions",
            most=kit.dimensions,
            got=repr(dimensions),
        )
    if dimensions != kit.dimensions and not kit.config.matryoshka:
        raise InvalidArgument(
            "{param}: this model was not trained for shortened embeddings (Matryoshka); it gives {most} dimensions only",
            "dimensions",
            most=kit.dimensions,
        )
    return dimensions


def check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 4096:
        raise InvalidArgument(
            "{param} must be an integer from 1 to 4096, got {got}", "batch_size", got=repr(batch_size)
        )
    return batch_size


# A batch is padded to its longest input. Sorted longest first, inputs join the current
# batch while the padding stays under PADDING_SHARE of its tokens, or the next one is
# within PADDING_FLOOR tokens of the longest (a smaller batch costs more than that padding).
PADDING_SHARE = 0.2
PADDING_FLOOR = 8


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into batches of at most ``batch_size``,
    longest first, each closed once adding the next would pad it too much."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    tokens = 0
    for i in order:
        current = batches[-1] if batches else None
        if current is not None and len(current) < batch_size:
            width = lengths[current[0]]
            padding = width * (len(current) + 1) - (tokens + lengths[i])
            if width - lengths[i] <= PADDING_FLOOR or padding <= PADDING_SHARE * width * (len(current) + 1):
                current.append(i)
                tokens += lengths[i]
                continue
        batches.append([i])
        tokens = lengths[i]
    return batches


def run_batches(kit: EmbeddingKit, ids: Sequence[list[int]], batch_size: int, dimensions: int | None) -> np.ndarray:
    """The vectors of ``ids`` (on the engine thread), in their order: batches of
    like length (``length_batches``), each padded to its longest input."""
    if kit.model is None:
        raise ValueError("kit: this embedding model was unloaded")
    out = np.empty((len(ids), dimensions or kit.dimensions), dtype=np.float32)
    for chosen in length_batches([len(r) for r in ids], batch_size):
        out[chosen] = np.asarray(_embed_batch(kit, [ids[i] for i in chosen], dimensions))
    return out


def _embed_batch(kit: EmbeddingKit, rows: list[list[int]], dimensions: int | None) -> mx.array:
    width = max(len(r) for r in rows)
    pad = kit.tokenizer.pad_token_id or 0
    ids = mx.array([r + [pad] * (width - len(r)) for r in rows], dtype=mx.int32)
    lengths = mx.array([len(r) for r in rows])
    mask = (mx.arange(width)[None, :] < lengths[:, None]).astype(mx.float32)
    hidden = kit.hidden_states(ids, mask).astype(mx.float32)
    vectors = mx.concatenate([_pool(mode, hidden, mask, lengths) for mode in kit.config.pooling], axis=-1)
    if dimensions is not None:
        vectors = vectors[:, :dimensions]  # Matryoshka: the leading dimensions, renormalized below
    if kit.config.normalize:
        # torch.nn.functional.normalize's eps, as sentence-transformers' Normalize module uses
        vectors = vectors / mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
    mx.eval(vectors)
    return vectors


def _pool(mode: str, hidden: mx.array, mask: mx.array, lengths: mx.array) -> mx.array:
    """One of sentence-transformers' pooling modes over the real tokens."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return hidden[mx.arange(hidden.shape[0]), lengths - 1]
    if mode == "max":
        return mx.where(mask[..., None] > 0, hidden, -1e9).max(axis=1)
    summed = (hidden * mask[..., None]).sum(axis=1)
    count = lengths[:, None].astype(mx.float32)
    return summed / (mx.sqrt(count) if mode == "mean_sqrt_len" else count)
