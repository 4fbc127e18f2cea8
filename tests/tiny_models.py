"""Tiny random-weight models in the Hugging Face layout, built in seconds.

The tokenizer is a byte-level BPE trained on the fly on a small text, so every
fixture works offline."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

TRAIN_TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "for i in range(10):\n    print(i, i * i)\n\n"
    "Hello world! Bonjour le monde. Grüße aus München. 日本語のテキスト。 emoji 🙂 ok.\n"
    "The quick brown fox jumps over the lazy dog. " * 3
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out: Path, vocab_size: int = 400, extra_text: str = "") -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAIN_TEXT + extra_text] * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "model_max_length": 4096,
                "chat_template": template,
            }
        )
    )
    return tok.get_vocab_size()


ARCHS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    # Pipeline-parallel in mlx-lm (model.model.pipeline), for tests/test_distributed.py.
    "ministral3": dict(model_type="ministral3", architectures=["Ministral3ForCausalLM"],
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                        "original_max_position_embeddings": 4096}),
}


def make_model(
    out: Path,
    arch: str = "llama",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    scale: float = 1.0,
    vocab_pad: int = 0,
    tokenizer_from: Path | None = None,
    dtype: mx.Dtype = mx.float32,
) -> Path:
    """Write a random-weight model directory. ``scale`` multiplies the weights so
    logits are well separated (fewer near-ties); ``vocab_pad`` adds unused
    embedding rows, as real models often have."""
    from mlx_lm.utils import _get_classes

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).write_text((tokenizer_from / name).read_text())
        vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
        n_vocab = len(vocab) + len(SPECIALS)
    else:
        n_vocab = make_tokenizer(out)
    config = dict(
        ARCHS[arch],
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=hidden * 2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=n_vocab + vocab_pad,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=0,
        torch_dtype="float32",
    )
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    if scale != 1.0:
        model.update(nn.utils.tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


class MarkovLM(nn.Module):
    """A first-order Markov 'language model' with a real KV cache: logits depend
    only on the last token (``table[token]``). Verify passes and single steps
    give bit-identical logits, so exactness and distribution tests have no
    near-ties to excuse."""

    def __init__(self, table: mx.array, num_layers: int = 1):
        super().__init__()
        self.table = table
        self.layers = [nn.Identity() for _ in range(num_layers)]

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        b, n = inputs.shape
        kv = mx.zeros((b, 1, n, 1))
        for c in cache or []:
            c.update_and_fetch(kv, kv)
        return self.table[inputs]


def successor_table(vocab: int, sharpness: float = 8.0, seed: int = 0) -> mx.array:
    """Logits whose argmax after token t is t+1 (mod vocab), with random noise."""
    noise = mx.random.normal((vocab, vocab), key=mx.random.key(seed))
    target = mx.roll(mx.eye(vocab), 1, axis=1) * sharpness
    return target + noise


def _permute_for_gguf(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp's q/k row order (interleaved RoPE pairs), as its converter writes it."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_tensors(hf_dir: Path, config: dict) -> dict:
    """The HF-layout llama weights of ``hf_dir`` under GGUF names and layout."""
    weights = mx.load(str(hf_dir / "model.safetensors"))
    out = {}
    for name, w in weights.items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            out["output.weight"] = w
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            if config["model_type"] != "llama":
                pass  # llama.cpp permutes only llama's q/k rows
            elif module == "self_attn.q_proj":
                w = _permute_for_gguf(w, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                w = _permute_for_gguf(w, config["num_key_value_heads"])
            out[f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"] = w
    return out


def gguf_metadata(hf_dir: Path, config: dict, add_bos: bool = False) -> dict:
    """GGUF metadata (llama.cpp key names) for the llama or qwen2 fixture in ``hf_dir``."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    arch = config["model_type"]
    return {
        "general.architecture": arch,
        "general.name": f"tiny-{arch}",
        f"{arch}.block_count": u32(config["num_hidden_layers"]),
        f"{arch}.embedding_length": u32(config["hidden_size"]),
        f"{arch}.feed_forward_length": u32(config["intermediate_size"]),
        f"{arch}.attention.head_count": u32(config["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": u32(config["num_key_value_heads"]),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        f"{arch}.context_length": u32(config["max_position_embeddings"]),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in SPECIALS else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(vocab[tok_config["eos_token"]]),
        "tokenizer.ggml.padding_token_id": u32(vocab[tok_config["pad_token"]]),
        "tokenizer.chat_template": tok_config["chat_template"],
    } | ({"tokenizer.ggml.bos_token_id": u32(vocab[SPECIALS[1]]), "tokenizer.ggml.add_bos_token": mx.array(True)} if add_bos else {})


def make_gguf(
    hf_dir: Path, out: Path, *, metadata: dict | None = None, drop: tuple[str, ...] = (), add_bos: bool = False
) -> Path:
    """Write the llama or qwen2 fixture in ``hf_dir`` as a GGUF file (float32
    tensors; llama's q/k rows permuted as llama.cpp does). ``metadata`` replaces keys, ``drop`` removes
    them; ``add_bos`` declares a BOS (``<|im_start|>``) added to every text."""
    config = json.loads((hf_dir / "config.json").read_text())
    metadata = {**gguf_metadata(hf_dir, config, add_bos), **(metadata or {})}
    for key in drop:
        metadata.pop(key)
    out.parent.mkdir(parents=True, exist_ok=True)
    mx.save_gguf(str(out), gguf_tensors(hf_dir, config), metadata)
    return out
