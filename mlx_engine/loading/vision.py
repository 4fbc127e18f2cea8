"""mlx-vlm's model and processor, loaded and adapted for the engine (docs/vision.md).

- ``load_vlm`` reads a vision-language model and its processor (offline);
  ``check_vision_architecture`` refuses a model type mlx-vlm cannot build.
- ``VisionLanguageModel`` makes the VLM's ``language_model`` look like an mlx-lm
  text model to ``SequenceCache`` (``model(inputs, cache=layers) -> logits``,
  ``.layers``, ``make_cache``). For M-RoPE models (Qwen2-VL family) it always
  passes explicit position ids, ``cache offset + position_shift``, so positions
  never depend on state that mlx-vlm keeps on the model between calls.
- ``process_image`` runs the processor on one image placeholder (the token ids
  it expands to, the pixel values); ``image_features`` runs the vision tower and
  projector once per image (``ImageEntry``). The kit (kits/vision.py) decides
  what is cached, how a prompt expands and how it is prefilled.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..errors import ModelLoadError
from .checks import check_weights_match_config
from .model import offline, read_config


def _to_engine_cache(c):
    """mlx-vlm's cache classes mirror mlx-lm's; the engine's cache logic (rewind
    limits, max_kv_size) recognises mlx-lm's, so plain ones are swapped."""
    name = type(c).__name__
    if name == "KVCache":
        return KVCache()
    if name == "RotatingKVCache" and hasattr(c, "max_size"):
        return RotatingKVCache(max_size=c.max_size, keep=getattr(c, "keep", 0))
    return c


class VisionLanguageModel(nn.Module):
    """The VLM's language model with the mlx-lm text-model interface."""

    def __init__(self, vlm: nn.Module):
        super().__init__()
        self.language_model = vlm.language_model
        self.mrope = hasattr(self.language_model, "get_rope_index")

    @property
    def layers(self):
        return self.language_model.layers

    def make_cache(self) -> list:
        lm = self.language_model
        caches = lm.make_cache() if hasattr(lm, "make_cache") else [KVCache() for _ in self.layers]
        return [_to_engine_cache(c) for c in caches]

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        inputs_embeds: mx.array | None = None,
        position_ids: mx.array | None = None,
        position_shift: int | mx.array = 0,
    ) -> mx.array:
        """Logits for ``inputs`` after ``cache``. M-RoPE text positions are the
        cache offset plus ``position_shift`` (an int, or one per row of a batch,
        shape (rows, 1), as is the batch's offset)."""
        kwargs = {}
        if self.mrope:
            if position_ids is None:
                b, n = inputs.shape
                offset = cache[0].offset if cache else 0
                if isinstance(offset, mx.array):
                    offset = offset.reshape(-1, 1)
                pos = (mx.arange(n, dtype=mx.int32)[None] + offset + position_shift).astype(mx.int32)
                position_ids = mx.broadcast_to(pos[None], (3, b, n))
            kwargs["position_ids"] = position_ids
        out = self.language_model(inputs, inputs_embeds=inputs_embeds, cache=cache, **kwargs)
        return getattr(out, "logits", out)

    def embed_tokens(self, ids: mx.array) -> mx.array:
        """The token embeddings of ``ids`` (the rows an image's features replace)."""
        return self.language_model.model.embed_tokens(ids)

    def rope_positions(self, ids: list[int], grids: list[mx.array]) -> tuple[mx.array | None, int]:
        """M-RoPE: the position ids (3, 1, L) of a whole sequence of token ``ids``
        holding images of these ``grids`` (image_grid_thw), and the shift (rope
        delta) of the positions after it; (None, 0) for a model without M-RoPE."""
        if not self.mrope:
            return None, 0
        grid = mx.concatenate(grids, axis=0) if grids else None
        positions, delta = self.language_model.get_rope_index(mx.array(ids)[None], grid, None, None)
        if positions.ndim == 2:
            positions = mx.broadcast_to(positions[None], (3,) + positions.shape)
        return positions.astype(mx.int32), int(mx.array(delta).reshape(-1)[0].item())


@dataclass(frozen=True)
class ImageTokens:
    """The tokens a vision model's prompts use for images: the placeholder a
    chat template puts in, and the token the processor expands it to, whose
    positions carry image features (ids None when the vocabulary lacks them)."""

    placeholder: str
    placeholder_id: int | None
    image: str
    image_id: int | None


@dataclass
class ImageEntry:
    """One image as the model sees it, kept per kit by content hash."""

    expansion: list[int]  # token ids that replace the image placeholder
    rows: list[int]  # positions within ``expansion`` that carry image features
    extras: dict  # per-image processor outputs (e.g. image_grid_thw)
    pixel_values: mx.array | None
    features: mx.array | None = None  # (len(rows), hidden) input embeddings


def process_image(processor, tokenizer, tokens: ImageTokens, image) -> ImageEntry:
    """Run the model's processor on the placeholder alone with this image (a
    PIL image): the token ids it expands to, and the pixel values."""
    try:
        out = processor(text=[tokens.placeholder], images=[image], add_special_tokens=False)
    except TypeError:
        # Some processors (mlx-vlm's LLaVA) hand every keyword to an image
        # processor that rejects it; strip the BOS the tokenizer adds instead.
        out = processor(text=[tokens.placeholder], images=[image])
    expansion = [int(t) for t in mx.array(out["input_ids"]).reshape(-1).tolist()]
    bos = tokenizer.bos_token_id
    if len(expansion) > 1 and bos is not None and expansion[0] == bos and tokens.placeholder_id != bos:
        expansion = expansion[1:]
    rows = [i for i, t in enumerate(expansion) if t == tokens.image_id]
    if not rows:
        raise ValueError(f"the processor produced no {tokens.image!r} tokens for an image")
    extras = {
        k: (v if isinstance(v, mx.array) else mx.array(v))
        for k, v in out.items()
        if k not in ("input_ids", "attention_mask", "pixel_values", "token_type_ids")
    }
    pixel_values = mx.array(out["pixel_values"])
    mx.eval(pixel_values, extras)  # nothing lazy is kept between requests (MLX streams are per thread)
    return ImageEntry(expansion, rows, extras, pixel_values)


def image_features(vlm: nn.Module, entry: ImageEntry) -> mx.array:
    """The input-embedding rows of an image (vision tower + projector),
    computed once per image: the model merges the image into its own
    expansion, and the image rows are kept (the pixels are dropped then)."""
    if entry.features is None:
        ids = mx.array(entry.expansion)[None]
        out = vlm.get_input_embeddings(ids, entry.pixel_values, mask=mx.ones(ids.shape, dtype=mx.int32), **entry.extras)
        emb = getattr(out, "inputs_embeds", out)
        entry.features = emb[0][mx.array(entry.rows)]
        mx.eval(entry.features)
        entry.pixel_values = None
    return entry.features


def check_vision_architecture(config: dict, path: Path) -> str:
    """The model type mlx-vlm builds for ``config``; ``ModelLoadError`` if none."""
    from mlx_vlm.utils import get_model_and_args

    try:
        _, model_type = get_model_and_args(config, path)
    except (ValueError, KeyError, ImportError, FileNotFoundError) as exc:
        raise ModelLoadError(
            f"unsupported vision model type {config.get('model_type')!r} in {str(path)!r}: mlx-vlm has no implementation for it"
        ) from exc
    return model_type


def load_vlm(path: Path, trust_remote_code: bool):
    """mlx-vlm's model (evaluated, in eval mode) and processor for ``path``."""
    from mlx_vlm.utils import load_model as vlm_load_model
    from mlx_vlm.utils import load_processor

    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {str(path)!r}")
    check_weights_match_config(read_config(path), path, [Path(f) for f in files])
    try:
        with offline():
            model = vlm_load_model(path, lazy=False, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"could not load weights from {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    try:
        with offline():
            processor = load_processor(path, add_detokenizer=False, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(
            f"could not load the image processor from {str(path)!r}: {type(exc).__name__}: {exc}"
        ) from exc
    model.eval()
    return model, processor


def image_tokens(model_type: str, config: dict, vocab: dict[str, int]) -> ImageTokens:
    """The placeholder token in prompts and the token that carries image features."""
    placeholder, image = _image_token_names(model_type, config, vocab)
    return ImageTokens(placeholder, vocab.get(placeholder), image, vocab.get(image))


def _image_token_names(model_type: str, config: dict, vocab: dict[str, int]) -> tuple[str, str]:
    if model_type.startswith("gemma3"):
        return "<start_of_image>", "<image_soft_token>"
    for placeholder in ("<|image_pad|>", "<image>", "<|image|>", "<image_soft_token>"):
        if placeholder in vocab:
            return placeholder, placeholder
    for key in ("image_token_id", "image_token_index"):
        tid = config.get(key)
        if isinstance(tid, int):
            for tok, i in vocab.items():
                if i == tid:
                    return tok, tok
    raise ModelLoadError(
        f"config.json has vision_config but no image placeholder token was found in the tokenizer of vision model "
        f"type {model_type!r} (looked for <|image_pad|>, <image>, <|image|> and config image_token_id)"
    )


def config_eos_ids(config: dict) -> set[int]:
    """The end-of-sequence ids config.json names (top level and ``text_config``)."""
    ids = set()
    for cfg in (config, config.get("text_config") or {}):
        eos = cfg.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos if isinstance(e, int))
    return ids
