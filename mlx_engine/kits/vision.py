"""VisionModelKit: a vision-language model (mlx-vlm) driven by the engine's own
cache and decoding loop.

Design (docs/vision.md); mlx-vlm's model and processor are loaded and adapted
in loading/vision.py (``VisionLanguageModel``: the VLM's language model as an
mlx-lm text model, with explicit M-RoPE positions).

- The M-RoPE shift (rope delta) belongs to the request's cached sequence
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

from ..errors import InvalidArgument
from ..loading import model as loading
from ..loading.memory import PREFILL_CHUNK
from ..loading.vision import (
    ImageEntry,
    VisionLanguageModel,
    check_vision_architecture,
    config_eos_ids,
    image_features,
    image_tokens,
    load_vlm,
    process_image,
)
from ..runtime.worker import MLXWorker
from .images import DEFAULT_MAX_IMAGE_PIXELS, DecodedImage, decode_images, validate_max_image_pixels
from .text import ExpandedPrompt, KitOptions, ModelKit

logger = logging.getLogger(__name__)

VISION_FEATURE_CACHE_SIZE = 16  # images whose features a kit keeps


@dataclass
class VisionExpandedPrompt(ExpandedPrompt):
    images: list[tuple[int, ImageEntry]] = field(default_factory=list)  # (start position, entry)


class VisionModelKit(ModelKit):
    """A vision-language model ready to generate, with the same surface as
    ``ModelKit``; ``create_generator(..., images_b64=[...])`` adds images.
    Create it with ``mlx_engine.load_model``."""

    def __init__(
        self,
        model_path: str | Path,
        options: KitOptions = KitOptions(),
        max_image_pixels: int | None = None,
        worker: MLXWorker | None = None,
    ):
        """Load the kit whole, as ``ModelKit`` does; ``max_image_pixels`` bounds a request's images."""
        if options.cache.kv_bits is not None:
            raise ValueError("kv_bits: a quantized KV cache is not supported for vision models yet")
        self.max_image_pixels = (
            DEFAULT_MAX_IMAGE_PIXELS if max_image_pixels is None else validate_max_image_pixels(max_image_pixels)
        )
        self.vlm: nn.Module | None = None
        self.processor = None
        self._images: OrderedDict[str, ImageEntry] = OrderedDict()
        super().__init__(model_path, options, worker)

    def _model_files(self, model_path: str | Path) -> loading.HFFiles:
        """mlx-vlm reads Hugging Face directories only."""
        return loading.HFFiles(loading.resolve_model_dir(model_path))

    def _init_files(self, files: loading.HFFiles, options: KitOptions) -> None:
        """A text kit's start, plus the config's end-of-sequence ids and the image tokens."""
        super()._init_files(files, options)
        self.eos_token_ids |= config_eos_ids(self.config)
        self.image_tokens = image_tokens(self.model_type, self.config, self.tokenizer.get_vocab())

    def _load_weights(self, files: loading.HFFiles, options: KitOptions) -> None:
        """mlx-vlm's model and processor (loading/vision.py), and what depends on them."""
        self.vlm, self.processor = load_vlm(self.model_path, options.trust_remote_code)
        self.compute_dtype = loading.prepare_weights(self.vlm, options.compute_dtype)
        self.model = VisionLanguageModel(self.vlm)
        self.num_params = loading.float_param_count(self.model)
        self.prompt_cache = self._make_prompt_cache(self.new_cache(self.model))
        self._fit_context()
        self._init_batching(options.max_parallel)
        logger.info(
            "loaded vision model %s (%s, compute dtype %s)",
            self.model_path,
            self.model_type,
            self.compute_dtype or "native",
        )

    @property
    def placeholder_token(self) -> str:
        """The token a prompt holds where an image goes (docs/vision.md)."""
        return self.image_tokens.placeholder

    @property
    def placeholder_id(self) -> int | None:
        return self.image_tokens.placeholder_id

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
        spans: list[tuple[int, ImageEntry]] = []
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
        needed: list[ImageEntry] = []
        n_rows = 0
        for img_start, entry in expanded.images:
            if img_start + entry.rows[-1] < start or img_start + entry.rows[0] >= end:
                continue
            needed.append(entry)
            for k, r in enumerate(entry.rows):
                row_of[img_start + r] = n_rows + k
            n_rows += len(entry.rows)
        feats = mx.concatenate([image_features(self.vlm, e) for e in needed], axis=0) if needed else None
        embed = self.model.embed_tokens

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
        grids = [e.extras["image_grid_thw"] for _, e in expanded.images if "image_grid_thw" in e.extras]
        positions, shift = self.model.rope_positions(expanded.ids, grids)
        cache.shift_positions(shift)
        return positions

    def _image_entry(self, img: DecodedImage) -> ImageEntry:
        """The image's entry, from the kit's cache of recent images or processed now."""
        entry = self._images.get(img.sha256)
        if entry is not None:
            self._images.move_to_end(img.sha256)
            return entry
        entry = process_image(self.processor, self.tokenizer, self.image_tokens, img.image)
        self._images[img.sha256] = entry
        while len(self._images) > VISION_FEATURE_CACHE_SIZE:
            self._images.popitem(last=False)
        return entry
