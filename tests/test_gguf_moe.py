"""GGUF mixture-of-experts families (qwen3moe, gpt-oss): tiny random-weight
models converted as llama.cpp's converter does (fixtures/gguf_families.py) load
as mlx-lm's classes, compute their source model's logits, keep their experts
quantized as stored, and decode as every other model does. Against llama.cpp
itself: tests/test_gguf_llamacpp.py."""

import mlx_engine as me

import mlx.core as mx
import numpy as np
import pytest
from helpers import FAMILY_PROMPT as PROMPT
from helpers import assert_batched_rows_equal_solo, generate_ids

from fixtures.gguf_families import arch_metadata, bpe_metadata, gguf_tensors, reference_model, write_gguf

MOE = {"qwen3moe": "mlx_lm.models.qwen3_moe", "gpt-oss": "mlx_lm.models.gpt_oss"}


def _rel(got, want) -> float:
    return (mx.sqrt(((got - want) ** 2).mean()) / mx.sqrt((want**2).mean())).item()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Per family: the tokenizer metadata, the source model, its config and
    its GGUF tensors (converted once for the module)."""
    cache = {}

    def get(family):
        if family not in cache:
            work = tmp_path_factory.mktemp(family)
            (work / "bpe").mkdir()
            tok = bpe_metadata(work / "bpe")
            model, config = reference_model(family, len(tok["tokenizer.ggml.tokens"]))
            cache[family] = (work, tok, model, config, gguf_tensors(model, config, family))
        return cache[family]

    return get


def _file(sources, family, name, qtype="F32", tensors=None, metadata=None, drop=()):
    work, tok, _, config, all_tensors = sources(family)
    meta = {**arch_metadata(family, config), **tok, **(metadata or {})}
    merged = {**all_tensors, **(tensors or {})}
    return write_gguf(work / f"{name}.gguf", family, {k: v for k, v in merged.items() if k not in drop},
                      {k: v for k, v in meta.items() if k not in drop}, qtype)  # fmt: skip


@pytest.mark.parametrize("family", list(MOE))
def test_moe_family_is_mlx_lms_class_and_computes_its_source(sources, family):
    """Stacked experts, router, q/k norms (qwen3moe); sinks, biases, YaRN and
    8-token sliding windows shorter than the prompt (gpt-oss): the float32
    file gives the source model's logits."""
    path = _file(sources, family, "f32")
    kit = me.load_model(path)
    assert type(kit.model).__module__ == MOE[family]
    ids = me.tokenize(kit, PROMPT)
    assert len(ids) > 16
    reference = sources(family)[2]
    assert _rel(kit.model(mx.array(ids)[None]), reference(mx.array(ids)[None])) <= 1e-4


@pytest.mark.parametrize(
    "family, qtype, bits, mode",
    [("qwen3moe", "Q5_0", 5, "affine"), ("qwen3moe", "Q4_1", 4, "affine"), ("gpt-oss", "MXFP4", 4, "mxfp4")],
)
def test_experts_stay_quantized_as_stored(sources, family, qtype, bits, mode):
    """Experts of a type MLX holds exactly are re-packed, not decoded (the
    other tensors F32 here): with ``compute_dtype="native"`` every expert layer
    is MLX-quantized at the type's width (MXFP4 in MLX's mxfp4 mode), and the
    logits are those of the file decoded to float32 (``"auto"`` on the CPU),
    up to float32 rounding."""
    import gguf
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    t = gguf.GGMLQuantizationType[qtype]
    experts = {k: (gguf.quants.quantize(v, t), qtype) for k, v in sources(family)[4].items() if "_exps.weight" in k}
    path = _file(sources, family, f"experts-{qtype}", tensors=experts)  # the rest F32
    kept, decoded = me.load_model(path, compute_dtype="native"), me.load_model(path)
    experts = [m for _, m in kept.model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert len(experts) == 3 * kept.config["num_hidden_layers"]
    assert {(m.bits, m.mode, m.group_size) for m in experts} == {(bits, mode, 32)}
    ids = mx.array(me.tokenize(kept, PROMPT))[None]
    assert _rel(kept.model(ids), decoded.model(ids)) <= 1e-5


def test_transcoded_blocks_dequantize_to_the_gguf_decoders_values():
    """Every type in ``TRANSCODED``, from random bytes (random codes, scales,
    mins): MLX's dequantization of the re-packed arrays equals llama.cpp's
    ``gguf.quants.dequantize`` of the bytes, exactly where the scale is the
    file's own float16, to float16 rounding of ``d * sc`` for Q4_K/Q5_K."""
    from mlx_engine.loading.gguf.transcode import TRANSCODED, transcode

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    shape = (3, 8, 512)  # experts, rows, columns
    for name, bits in TRANSCODED.items():
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        n = int(np.prod(shape)) // block
        raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
        if name == "MXFP4":
            raw[:, 0] = rng.integers(110, 135, n)  # exponents near 2**0
        else:  # float16 d (and m/dmin) in a sane range
            halves = 1 if name in ("Q8_0", "Q4_0", "Q5_0") else 2
            scales = rng.uniform(1e-3, 1e-2, n * halves).astype(np.float16)
            raw[:, : 2 * halves] = scales.view(np.uint8).reshape(n, 2 * halves)
        want = quants.dequantize(raw.reshape(shape[0] * shape[1], -1), GGMLQuantizationType[name]).reshape(shape)
        q = {k: mx.array(v) for k, v in transcode(name, raw.reshape(-1), shape).items()}
        mode = "mxfp4" if name == "MXFP4" else "affine"
        scales = q["scales"] if mode == "mxfp4" else q["scales"].astype(mx.float32)
        biases = q["biases"].astype(mx.float32) if "biases" in q else None
        got = np.array(
            mx.dequantize(q["weight"], scales, biases, group_size=32, bits=bits, mode=mode).astype(mx.float32)
        )
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= (2**-11 if name in ("Q4_K", "Q5_K") else 0.0), (name, err)


@pytest.fixture(scope="module")
def q8_files(sources):
    return {family: _file(sources, family, "q8", "Q8_0") for family in MOE}


@pytest.mark.parametrize("family", list(MOE))
def test_moe_speculates_exactly_and_the_next_turn_reuses_the_cache(q8_files, family):
    """Prompt lookup gives plain greedy's tokens (qwen3moe speculates; gpt-oss's
    sliding-window layers use rotating caches, so once the 8-token window is
    full the plan decodes plainly and says why), and the next turn reuses the
    cache and answers as a fresh kit does."""
    kit, fresh = me.load_model(q8_files[family]), me.load_model(q8_files[family])
    prompt = me.tokenize(kit, PROMPT * 2)
    plain, _ = generate_ids(fresh, prompt, max_tokens=10, temp=0.0)
    lookup, last = generate_ids(kit, prompt, max_tokens=10, temp=0.0, prompt_lookup_num_tokens=3)
    assert lookup == plain
    if family == "gpt-oss":
        assert "rotating KV cache" in last.stats.mode_reason, last.stats.mode_reason
    else:
        assert last.stats.decoding_mode == "prompt_lookup", last.stats.mode_reason
    turn = prompt + plain + me.tokenize(kit, " def add(a, b):")
    ids, last = generate_ids(kit, turn, max_tokens=6, temp=0.0)
    assert last.stats.cached_tokens > 0, last.stats
    fresh.replace_prompt_cache(fresh.new_cache(fresh.model))
    want, cold = generate_ids(fresh, turn, max_tokens=6, temp=0.0)
    assert cold.stats.cached_tokens == 0 and ids == want


@pytest.mark.parametrize("family", list(MOE))
def test_moe_parallel_requests_equal_their_solo_outputs(q8_files, family):
    """Batched rows route their own tokens to their own experts."""
    assert_batched_rows_equal_solo(q8_files[family], max_parallel=3, max_tokens=8)


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("qwen3moe", dict(drop=["blk.1.ffn_down_exps.weight"]), r"lacks 'blk\.1\.ffn_down_exps\.weight' \(the experts"),
        ("qwen3moe", dict(drop=["qwen3moe.expert_used_count"]), r"lacks the metadata field 'qwen3moe\.expert_used_count'"),
        ("qwen3moe", dict(metadata={"qwen3moe.expert_count": 8}), r"'blk\.0\.ffn_gate_exps\.weight' of shape \[256, 256, 4\]"),
        ("qwen3moe", dict(metadata={"qwen3moe.expert_used_count": 5}), r"'qwen3moe\.expert_used_count' must be an integer from 1 to 4"),
        ("qwen3moe", dict(metadata={"qwen3moe.expert_feed_forward_length": 128}), r"expert_feed_forward_length"),
        ("qwen3moe", dict(tensors={"blk.0.ffn_gate_inp_shexp.weight": np.zeros(256, np.float32)}), r"shared experts"),
        ("gpt-oss", dict(drop=["blk.1.attn_sinks.weight"]), r"lacks 'blk\.1\.attn_sinks\.weight'"),
        ("gpt-oss", dict(drop=["blk.0.ffn_up_exps.bias"]), r"lacks 'blk\.0\.ffn_up_exps\.bias'"),
        ("gpt-oss", dict(drop=["gpt-oss.attention.sliding_window"]), r"'gpt-oss\.attention\.sliding_window'"),
        ("gpt-oss", dict(metadata={"gpt-oss.attention.sliding_window_pattern": 3}), r"sliding-window pattern"),
        ("gpt-oss", dict(metadata={"gpt-oss.rope.scaling.type": "linear"}), r"'gpt-oss\.rope\.scaling\.type' must be 'yarn'"),
        ("gpt-oss", dict(drop=["gpt-oss.rope.scaling.original_context_length"]), r"original_context_length"),
    ],
)  # fmt: skip
def test_a_malformed_moe_file_is_refused_naming_it(sources, family, change, message):
    path = _file(sources, family, "bad", **change)
    with pytest.raises(me.ModelLoadError, match=message) as info:
        me.load_model(path)
    assert str(path) in str(info.value)
