"""VisionModelKit: a vision-language model (mlx-vlm) driven by the engine's own
cache and decoding loop.

Design (docs/vision.md):

- ``VisionLanguageModel`` makes the VLM's ``language_model`` look like an mlx-lm
  text model to ``SequenceCache`` (``model(inputs, cache=layers) -> logits``,
  ``.layers``, ``make_cache``). For M-RoPE models (Qwen2-VL family) it always
  passes explicit position ids, ``cache offset + position_shift``, so positions
  never depend on state that mlx-vlm keeps on the model between calls. The shift
  (M-RoPE's rope delta) belongs to the request's cached sequence
  (``SequenceCache.shift_positions``), so requests with different images can run
  as rows of one batch.
- A prompt is expanded once per request: each image placeholder token in
  ``prompt_tokens`` is replaced by the token ids the model's processor expands it
  to (e.g. ``<|image_pad|>`` x N), giving the real token ids, and the cache keys:
  the same ids, except that image-feature positions hold a negative key derived
  from the image's content hash. The cache's longest-common-prefix logic then
  reuses text and unchanged images and invalidates exactly from a changed image.
- The part of the prompt the cache lacks is prefilled in chunks with input
  embeddings: token embeddings, with the image rows replaced by the image's
  features (computed once per image and kept in a small per-kit cache keyed by
  hash). Decoding then feeds token ids through the adapter like any text model,
  so the verify/accept/rewind loop, sampling, stop strings and stats are shared.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..errors import InvalidArgument, ModelLoadError
from ..loading import model as loading
from ..loading.checks import check_weights_match_config
from ..loading.memory import PREFILL_CHUNK
from .images import DEFAULT_MAX_IMAGE_PIXELS, DecodedImage, decode_images, validate_max_image_pixels
from .text import ExpandedPrompt, KitOptions, ModelKit

logger = logging.getLogger(__name__)

VISION_FEATURE_CACHE_SIZE = 16  # images whose features a kit keeps


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


@dataclass
class _ImageEntry:
    """One image as the model sees it, kept per kit by content hash."""

    expansion: list[int]  # token ids that replace the image placeholder
    rows: list[int]  # positions within ``expansion`` that carry image features
    extras: dict  # per-image processor outputs (e.g. image_grid_thw)
    pixel_values: mx.array | None
    features: mx.array | None = None  # (len(rows), hidden) input embeddings


@dataclass
class VisionExpandedPrompt(ExpandedPrompt):
    images: list[tuple[int, _ImageEntry]] = field(default_factory=list)  # (start position, entry)


class VisionModelKit(ModelKit):
    """A vision-language model ready to generate, with the same surface as
    ``ModelKit``; ``create_generator(..., images_b64=[...])`` adds images.
    Create it with ``mlx_engine.load_model``."""

    def __init__(self, model_path: str | Path, options: KitOptions = KitOptions(), max_image_pixels: int | None = None):
        if options.cache.kv_bits is not None:
            raise ValueError("kv_bits: a quantized KV cache is not supported for vision models yet")
        self.max_image_pixels = (
            DEFAULT_MAX_IMAGE_PIXELS if max_image_pixels is None else validate_max_image_pixels(max_image_pixels)
        )
        self._init_files(loading.HFFiles(loading.resolve_model_dir(model_path)), options)
        self.eos_token_ids |= _config_eos_ids(self.config)
        self.vlm: nn.Module | None = None
        self.processor = None
        self._images: OrderedDict[str, _ImageEntry] = OrderedDict()
        vocab = self.tokenizer.get_vocab()
        self.placeholder_token, self.image_token = _image_tokens(self.model_type, self.config, vocab)
        self.placeholder_id = vocab.get(self.placeholder_token)
        self.image_token_id = vocab.get(self.image_token)
        if options.vocab_only:
            return
        self.vlm, self.processor = load_vlm(self.model_path, options.trust_remote_code)
        self.compute_dtype = loading.prepare_weights(self.vlm, options.compute_dtype)
        self.model = VisionLanguageModel(self.vlm)
        self.num_params = loading.float_param_count(self.model)
        self.replace_prompt_cache(self.new_cache(self.model))
        self._fit_context()
        self._init_batching(options.max_parallel)
        logger.info(
            "loaded vision model %s (%s, compute dtype %s)",
            self.model_path,
            self.model_type,
            self.compute_dtype or "native",
        )

    def check_architecture(self) -> None:
        self.model_type = check_vision_architecture(self.config, self.model_path)

    @property
    def vocab_size(self) -> int:
        if self.model is not None:
            emb = getattr(getattr(self.model.language_model, "model", None), "embed_tokens", None)
            if emb is not None and hasattr(emb, "weight"):
                return int(emb.weight.shape[0])
        return super().vocab_size

    def unload(self) -> None:
        self.vlm = None
        self.processor = None
        self._images.clear()
        super().unload()

    # -- requests -----------------------------------------------------------
    def decode_images(self, prompt: list[int], images_b64) -> list[DecodedImage]:
        """Decode and check the request's images against the prompt (eager)."""
        if images_b64 is None:
            images: list[DecodedImage] = []
        else:
            images = decode_images(images_b64, self.max_image_pixels)
        n_slots = prompt.count(self.placeholder_id) if self.placeholder_id is not None else 0
        if n_slots != len(images):
            raise InvalidArgument(
                "{param} has {images} image(s) but {prompt_tokens} has {slots} image placeholder(s) "
                "({token}, one per image; a chat template with {{'type': 'image'}} content entries inserts them)",
                "images_b64",
                images=len(images),
                slots=n_slots,
                token=repr(self.placeholder_token),
            )
        if images and prompt[-1] == self.placeholder_id:
            raise InvalidArgument(
                "{prompt_tokens} must not end with an image placeholder; put text after the image (chat templates do)",
                "images_b64",
            )
        for i, img in enumerate(images):
            # Run the model's image processor now, so an image it refuses (e.g. an
            # extreme aspect ratio) fails here, naming the item, not mid-request.
            try:
                self._image_entry(img)
            except Exception as exc:
                raise InvalidArgument(
                    "{param} was refused by the model's image processor: {detail}", "images_b64", index=i, detail=exc
                ) from exc
        return images

    def expand_prompt(self, prompt: list[int], images: list[DecodedImage] | None) -> VisionExpandedPrompt:
        if not images:
            return VisionExpandedPrompt(list(prompt), list(prompt))
        ids: list[int] = []
        keys: list[int] = []
        spans: list[tuple[int, _ImageEntry]] = []
        it = iter(images)
        for tok in prompt:
            if tok != self.placeholder_id:
                ids.append(tok)
                keys.append(tok)
                continue
            img = next(it)
            entry = self._image_entry(img)
            start = len(ids)
            rows = set(entry.rows)
            ids.extend(entry.expansion)
            keys.extend(img.key if i in rows else t for i, t in enumerate(entry.expansion))
            spans.append((start, entry))
        if keys[-1] < 0:
            raise ValueError("prompt_tokens must not end with an image; put text after the image (chat templates do)")
        return VisionExpandedPrompt(ids, keys, spans)

    def prefill_prompt(
        self, expanded: VisionExpandedPrompt, cache, todo: list[int], on_chunk=None, chunk_size: int = PREFILL_CHUNK
    ):
        """Bring ``cache`` to all but the last position of the ``expanded`` prompt
        (from ``expand_prompt``), feeding input embeddings so image positions get
        their features. ``todo`` are the real token ids of that part. Yields after
        each chunk, as a text kit does (the scheduler lets the other rows step);
        the images' features are computed before the first chunk."""
        start = len(cache.tokens)
        if cache.tokens != expanded.keys[:start] or expanded.ids[start:-1] != list(todo):
            raise RuntimeError("prefill_prompt does not follow expand_prompt for this cache")
        positions = self._positions(expanded, cache)
        end = len(expanded.ids) - 1
        if start >= end:
            return
        model_inputs = self._embedding_inputs(expanded, start, end, positions)
        for a in range(start, end, chunk_size):
            b = min(a + chunk_size, end)
            cache.prefill(
                expanded.ids[a:b],
                on_chunk,
                chunk_size,
                keys=expanded.keys[a:b],
                model_inputs=lambda i, j, a=a: model_inputs(a + i, a + j),
            )
            yield

    def _embedding_inputs(self, expanded: VisionExpandedPrompt, start: int, end: int, positions: mx.array | None):
        """``model_inputs(s, e)``: the input embeddings (token embeddings with the
        image rows put in place) and M-RoPE positions of prompt positions s..e,
        for the part ``start..end`` being prefilled."""
        # The image feature row (an index into the stacked features of the
        # images involved) that each position of the part takes, if any.
        row_of: dict[int, int] = {}
        needed: list[_ImageEntry] = []
        n_rows = 0
        for img_start, entry in expanded.images:
            if img_start + entry.rows[-1] < start or img_start + entry.rows[0] >= end:
                continue
            needed.append(entry)
            for k, r in enumerate(entry.rows):
                row_of[img_start + r] = n_rows + k
            n_rows += len(entry.rows)
        feats = mx.concatenate([self._features(e) for e in needed], axis=0) if needed else None
        embed = self.model.language_model.model.embed_tokens

        def model_inputs(s: int, e: int) -> dict:
            h = embed(mx.array(expanded.ids[s:e], dtype=mx.uint32)[None])[0]
            local = [(p - s, row_of[p]) for p in range(s, e) if p in row_of]
            if local:
                h[mx.array([i for i, _ in local])] = feats[mx.array([k for _, k in local])].astype(h.dtype)
            kw = {"inputs_embeds": h[None]}
            if positions is not None:
                kw["position_ids"] = positions[:, :, s:e]
            return kw

        return model_inputs

    # -- helpers --------------------------------------------------------------
    def _positions(self, expanded: VisionExpandedPrompt, cache) -> mx.array | None:
        """M-RoPE: the whole sequence's position ids (3, 1, L); the shift that
        decoding after it uses goes to the request's ``cache``."""
        if not self.model.mrope:
            return None
        lm = self.model.language_model
        grids = [e.extras["image_grid_thw"] for _, e in expanded.images if "image_grid_thw" in e.extras]
        grid = mx.concatenate(grids, axis=0) if grids else None
        ids = mx.array(expanded.ids)[None]
        positions, delta = lm.get_rope_index(ids, grid, None, None)
        if positions.ndim == 2:
            positions = mx.broadcast_to(positions[None], (3,) + positions.shape)
        cache.shift_positions(int(mx.array(delta).reshape(-1)[0].item()))
        return positions.astype(mx.int32)

    def _image_entry(self, img: DecodedImage) -> _ImageEntry:
        entry = self._images.get(img.sha256)
        if entry is not None:
            self._images.move_to_end(img.sha256)
            return entry
        entry = self._process_image(img)
        self._images[img.sha256] = entry
        while len(self._images) > VISION_FEATURE_CACHE_SIZE:
            self._images.popitem(last=False)
        return entry

    def _process_image(self, img: DecodedImage) -> _ImageEntry:
        """Run the model's processor on the placeholder alone with this image:
        the token ids it expands to, and the pixel values."""
        try:
            out = self.processor(text=[self.placeholder_token], images=[img.image], add_special_tokens=False)
        except TypeError:
            # Some processors (mlx-vlm's LLaVA) hand every keyword to an image
            # processor that rejects it; strip the BOS the tokenizer adds instead.
            out = self.processor(text=[self.placeholder_token], images=[img.image])
        expansion = [int(t) for t in mx.array(out["input_ids"]).reshape(-1).tolist()]
        bos = self.tokenizer.bos_token_id
        if len(expansion) > 1 and bos is not None and expansion[0] == bos and self.placeholder_id != bos:
            expansion = expansion[1:]
        rows = [i for i, t in enumerate(expansion) if t == self.image_token_id]
        if not rows:
            raise ValueError(f"the processor produced no {self.image_token!r} tokens for an image")
        extras = {
            k: (v if isinstance(v, mx.array) else mx.array(v))
            for k, v in out.items()
            if k not in ("input_ids", "attention_mask", "pixel_values", "token_type_ids")
        }
        pixel_values = mx.array(out["pixel_values"])
        mx.eval(pixel_values, extras)  # nothing lazy is kept between requests (MLX streams are per thread)
        return _ImageEntry(expansion, rows, extras, pixel_values)

    def _features(self, entry: _ImageEntry) -> mx.array:
        """The input-embedding rows of an image (vision tower + projector),
        computed once per image: the model merges the image into its own
        expansion, and the image rows are kept."""
        if entry.features is None:
            ids = mx.array(entry.expansion)[None]
            out = self.vlm.get_input_embeddings(
                ids, entry.pixel_values, mask=mx.ones(ids.shape, dtype=mx.int32), **entry.extras
            )
            emb = getattr(out, "inputs_embeds", out)
            entry.features = emb[0][mx.array(entry.rows)]
            mx.eval(entry.features)
            entry.pixel_values = None
        return entry.features


def check_vision_architecture(config: dict, path: Path) -> str:
    from mlx_vlm.utils import get_model_and_args

    try:
        _, model_type = get_model_and_args(config, path)
    except (ValueError, KeyError, ImportError, FileNotFoundError) as exc:
        raise ModelLoadError(
            f"unsupported vision model type {config.get('model_type')!r} in {str(path)!r}: mlx-vlm has no implementation for it"
        ) from exc
    return model_type


def load_vlm(path: Path, trust_remote_code: bool):
    import glob

    from mlx_vlm.utils import load_model as vlm_load_model
    from mlx_vlm.utils import load_processor

    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {str(path)!r}")
    check_weights_match_config(loading.read_config(path), path, [Path(f) for f in files])
    try:
        with loading.offline():
            model = vlm_load_model(path, lazy=False, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"could not load weights from {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    try:
        with loading.offline():
            processor = load_processor(path, add_detokenizer=False, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(
            f"could not load the image processor from {str(path)!r}: {type(exc).__name__}: {exc}"
        ) from exc
    model.eval()
    return model, processor


def _image_tokens(model_type: str, config: dict, vocab: dict[str, int]) -> tuple[str, str]:
    """(placeholder token in prompts, token that carries image features)."""
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


def _config_eos_ids(config: dict) -> set[int]:
    ids = set()
    for cfg in (config, config.get("text_config") or {}):
        eos = cfg.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos if isinstance(e, int))
    return ids
