"""Tiny random-weight vision-language models (mlx-vlm layout), built offline in
well under a second each once mlx_vlm is imported.

Recipe and pitfalls: shared/research/tiny-vlm.md. Architectures:

- ``qwen2_vl``: mlx-vlm's own numpy image processor, M-RoPE positions, plain
  (always trimmable) KV cache. A 64x64 image becomes 4 image tokens.
- ``gemma3``: transformers' Gemma3 image processor, SigLIP tower, a sliding
  window on every other layer (``RotatingKVCache``), 4 tokens per image.
- ``qwen2_5_vl`` (``make_qwen2_vl(model_type=...)``) and ``llava`` (CLIP + llama,
  16 tokens per image).

``make_text_draft`` writes a tiny mlx-lm text model sharing a VLM's tokenizer
(through ``tiny_models.make_model(..., tokenizer_from=...)``).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

CORPUS = [
    "What colour is this image? It is red, green or blue.",
    "Describe the picture in one sentence. The picture shows a small square.",
    "The quick brown fox jumps over the lazy dog. Hello world, how are you today?",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, i * i)\n",
    "Compare the two images. The first one is brighter than the second one.",
]

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

GEMMA_SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<start_of_image>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _tokenizer(out: Path, specials: list[str], template: str, **extra) -> dict[str, int]:
    """Train a byte-level BPE, save it with transformers; returns the vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **extra)
    hf.chat_template = template
    hf.save_pretrained(str(out))
    return tok.get_vocab()


def _save_weights(arch, config: dict, out: Path, seed: int, scale: float) -> None:
    from mlx_vlm.utils import update_module_configs

    cfg = json.loads(json.dumps(config))
    mc = update_module_configs(arch.ModelConfig.from_dict(cfg), arch, cfg, ["text", "vision"])
    mx.random.seed(seed)
    model = arch.Model(mc)
    proj = getattr(model, "multi_modal_projector", None)
    if proj is not None and hasattr(proj, "mm_input_projection_weight"):
        # gemma3 initialises this projection to ones, which maps every image token
        # to a constant vector whose sign flips with rounding noise; use a random
        # matrix so that image features are well-conditioned.
        w = proj.mm_input_projection_weight
        proj.mm_input_projection_weight = mx.random.normal(w.shape) / (w.shape[0] ** 0.5)
    if scale != 1.0:
        # Larger weights separate the logits (fewer near-ties, less degenerate
        # greedy output). Only the language model's matrices are scaled.
        lm = model.language_model
        lm.update(nn.utils.tree_map(lambda p: p * scale if p.ndim == 2 else p, lm.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1))


def make_qwen2_vl(out: Path, *, seed: int = 0, scale: float = 3.0, layers: int = 2, model_type: str = "qwen2_vl") -> Path:
    """A qwen2_vl model, or with ``model_type="qwen2_5_vl"`` its successor
    (same text side, windowed vision tower)."""
    import importlib

    arch = importlib.import_module(f"mlx_vlm.models.{model_type}")

    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(out, QWEN_SPECIALS, QWEN_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": 56 * 56,
                "max_pixels": 112 * 112,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2VLProcessor",
            }
        )
    )
    config = {
        "model_type": model_type,
        "architectures": ["Qwen2VLForConditionalGeneration" if model_type == "qwen2_vl" else "Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": len(vocab),
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": True,
        "image_token_id": vocab["<|image_pad|>"],
        "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
        "eos_token_id": vocab["<|im_end|>"],
        "bos_token_id": None,
        "torch_dtype": "float32",
        "vision_config": QWEN25_VISION if model_type == "qwen2_5_vl" else {
            "model_type": "qwen2_vl",
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }
    _save_weights(arch, config, out, seed, scale)
    return out


QWEN25_VISION = {
    "model_type": "qwen2_5_vl",
    "hidden_size": 32,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "depth": 2,
    "num_heads": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}


def make_gemma3(out: Path, *, seed: int = 1, scale: float = 1.0, sliding_window: int = 64, layers: int = 2) -> Path:
    from transformers.models.gemma3 import Gemma3ImageProcessorPil as ImageProcessor  # no torch needed

    from mlx_vlm.models import gemma3

    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(
        out,
        GEMMA_SPECIALS,
        GEMMA_TEMPLATE,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens={
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )
    ImageProcessor(
        size={"height": 56, "width": 56},
        do_pan_and_scan=False,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    ).save_pretrained(str(out))
    (out / "processor_config.json").write_text(json.dumps({"image_seq_length": 4, "processor_class": "Gemma3Processor"}))
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": sliding_window,
        "sliding_window_pattern": 2,
        "mm_tokens_per_image": 4,
        "vocab_size": len(vocab),
        "rms_norm_eps": 1e-6,
    }
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "hidden_size": 64,
        "mm_tokens_per_image": 4,
        "image_token_index": vocab["<image_soft_token>"],
        "boi_token_index": vocab["<start_of_image>"],
        "eoi_token_index": vocab["<end_of_image>"],
        "pad_token_id": vocab["<pad>"],
        "eos_token_id": [vocab["<eos>"], vocab["<end_of_turn>"]],
        "vocab_size": len(vocab),
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
        },
    }
    _save_weights(gemma3, config, out, seed, scale)
    return out


LLAVA_SPECIALS = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]
LLAVA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def make_llava(out: Path, *, seed: int = 0, scale: float = 3.0) -> Path:
    """LLaVA: a CLIP tower and a llama language model; 16 tokens per image."""
    from transformers.models.clip import CLIPImageProcessorPil as ImageProcessor

    from mlx_vlm.models import llava

    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(out, LLAVA_SPECIALS, LLAVA_TEMPLATE, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    ImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}).save_pretrained(str(out))
    (out / "processor_config.json").write_text(
        json.dumps({"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
                    "image_token": "<image>", "processor_class": "LlavaProcessor"})
    )
    config = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": vocab["<image>"],
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "projector_hidden_act": "gelu",
        "vocab_size": len(vocab),
        "pad_token_id": vocab["<pad>"],
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": len(vocab),
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "bos_token_id": vocab["<s>"],
            "eos_token_id": vocab["</s>"],
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
            "projection_dim": 32,
        },
    }
    _save_weights(llava, config, out, seed, scale)
    return out


def make_text_draft(out: Path, vlm_path: Path, *, seed: int = 5) -> Path:
    """A one-layer mlx-lm llama sharing the VLM's tokenizer files."""
    from tiny_models import make_model

    return make_model(out, "llama", hidden=32, layers=1, heads=2, kv_heads=1, scale=3.0, seed=seed, tokenizer_from=vlm_path)


def image_b64(color=(255, 0, 0), size=(64, 64), fmt: str = "PNG", pattern: bool = True) -> str:
    """A base64-encoded image: a solid colour, with a small gradient pattern
    so different colours give clearly different vision features."""
    from PIL import Image

    img = Image.new("RGB", size, color)
    if pattern:
        px = img.load()
        for x in range(0, size[0], 4):
            for y in range(0, size[1], 8):
                px[x, y] = ((x * 4) % 256, (y * 4) % 256, 128)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode("ascii")
