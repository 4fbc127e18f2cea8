"""GGUF quantized blocks rewritten as MLX quantized weights without decoding.

Most GGUF weight types are affine in groups of 32 values, ``w = scale * q +
bias`` with ``q`` an unsigned code: exactly MLX's affine format at group size
32 (``mx.quantize(..., group_size=32, bits=b)``). MXFP4 blocks (32 E2M1
values and one E8M0 exponent) are MLX's ``mxfp4`` mode byte for byte. So these
tensors are re-packed, not decoded and re-quantized:

=========  =============================  ========================================
GGUF type  MLX                            scale, bias per 32 values
=========  =============================  ========================================
Q8_0       affine 8-bit                   ``d``, ``-128 d``
Q4_0       affine 4-bit                   ``d``, ``-8 d``
Q4_1       affine 4-bit                   ``d``, ``m``
Q5_0       affine 5-bit                   ``d``, ``-16 d``
Q5_1       affine 5-bit                   ``d``, ``m``
Q4_K       affine 4-bit                   ``d sc_j``, ``-dmin m_j`` (sub-block j)
Q5_K       affine 5-bit                   ``d sc_j``, ``-dmin m_j``
MXFP4      mxfp4 (E2M1 codes, E8M0 byte)  the block's exponent byte
=========  =============================  ========================================

Scales and biases are float16 (the file's own ``d``, ``m`` are float16; the
K-quants' products ``d * sc_j`` are rounded to float16, a relative 2**-12 of a
weight, far below the 4-5 bit step). MLX has no group size 16, so Q6_K, Q3_K and
Q2_K (16-value sub-blocks) and the non-linear IQ4 types have no exact
equivalent; ``TRANSCODED`` lists the types that do.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
TRANSCODED = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "MXFP4": 4}


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: low nibbles are values 0-15, high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32-bit mask of fifth bits, value j at bit j."""
    bits = np.ascontiguousarray(qh).view("<u4")
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and mins (ggml's
    ``get_scale_min_k4``)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _codes_affine(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes, scales, biases)`` of ``blocks`` (one row of bytes per GGUF
    block): codes per value, scale and bias per 32 values."""
    n = blocks.shape[0]
    if type_name == "Q8_0":
        d = _f16(blocks[:, :2])
        return (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d
    if type_name in ("Q4_0", "Q5_0"):
        d = _f16(blocks[:, :2])
        if type_name == "Q4_0":
            return _nibbles_split(blocks[:, 2:]), d, -8 * d
        return _nibbles_split(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6]) << 4), d, -16 * d
    if type_name in ("Q4_1", "Q5_1"):
        d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        if type_name == "Q4_1":
            return _nibbles_split(blocks[:, 4:]), d, m
        return _nibbles_split(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8]) << 4), d, m
    # Q4_K / Q5_K: 256 values, 8 sub-blocks of 32 with 6-bit scales and mins
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    if type_name == "Q4_K":
        qs = blocks[:, 16:].reshape(n, 4, 32)  # per 64 values: 32 low nibbles, then 32 high
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, QK_K)
    else:
        qh, qs = blocks[:, 16:48], blocks[:, 48:].reshape(n, 4, 32)
        low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
        high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        codes = (low | (high << 4)).reshape(n, QK_K)
    return codes, (d * sc).reshape(-1), (-(dmin * mn)).reshape(-1)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes as MLX packs them: a little-endian bit stream in uint32 words."""
    rows = codes.shape[0]
    if bits in (4, 8):
        per_word = 32 // bits
        c = codes.reshape(rows, -1, per_word).astype(np.uint32)
        return (c << (np.arange(per_word, dtype=np.uint32) * bits)).sum(axis=-1, dtype=np.uint32)
    stream = ((codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(rows, -1)
    return np.packbits(stream, axis=-1, bitorder="little").view(np.uint32)


def transcode(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """``{"weight", "scales"[, "biases"]}`` in MLX's layout for a tensor of
    numpy ``shape`` (input dimension last) stored as ``raw`` GGUF bytes; the
    MLX mode is ``"mxfp4"`` for MXFP4, ``"affine"`` otherwise."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = np.asarray(raw).reshape(-1, block_bytes)
    out_shape, groups = shape[:-1], shape[-1] // 32
    if type_name == "MXFP4":  # byte 0 the E8M0 exponent, then ggml's split nibbles
        codes = _nibbles_split(blocks[:, 1:])
        weight = _pack(codes.reshape(-1, shape[-1]), 4)
        return {"weight": weight.reshape(*out_shape, -1), "scales": blocks[:, 0].reshape(*out_shape, groups)}
    codes, scales, biases = _codes_affine(type_name, blocks)
    weight = _pack(codes.reshape(-1, shape[-1]), TRANSCODED[type_name])
    return {
        "weight": weight.reshape(*out_shape, -1),
        "scales": scales.astype(np.float16).reshape(*out_shape, groups),
        "biases": biases.astype(np.float16).reshape(*out_shape, groups),
    }


# The block types ``transcode_native`` re-packs with byte operations alone, the
# same bytes ``mx.load`` makes of them (tests/test_gguf_native_read.py); F32
# and F16 are read as they are stored.
NATIVE_BLOCKS = frozenset({"Q4_0", "Q4_1", "Q8_0"})


_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_PAIRS = (
    (np.uint64(4), np.uint64(0x00FF00FF00FF00FF)),
    (np.uint64(8), np.uint64(0x0000FFFF0000FFFF)),
    (np.uint64(16), np.uint64(0x00000000FFFFFFFF)),
)


def _nibble_words(qs: np.ndarray) -> np.ndarray:
    """GGML's 16 bytes of 4-bit codes per block (low nibbles values 0-15, high
    nibbles 16-31) as MLX's 4 uint32 words (value j at bits 4j of its word):
    each half's 8 nibbles, one per byte, are squeezed together in 64-bit
    integers (three shift-or-mask steps), not one value at a time."""
    halves = qs.view("<u8")  # (blocks, 2): bytes 0-7 and 8-15
    words = np.empty((qs.shape[0], 4), dtype=np.uint64)
    words[:, :2], words[:, 2:] = halves & _NIBBLES, (halves >> np.uint64(4)) & _NIBBLES
    for shift, mask in _PAIRS:
        words |= words >> shift
        words &= mask
    return words.astype(np.uint32)


def transcode_native(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """``transcode`` for a ``NATIVE_BLOCKS`` type, bit for bit what MLX's own GGUF
    reader makes, in uint8 operations only (several times faster than the
    general path's per-value codes; numpy releases the GIL in them, which
    ``mx.load`` does not)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if type_name not in NATIVE_BLOCKS:
        raise ValueError(f"transcode_native handles {sorted(NATIVE_BLOCKS)}, not {type_name}")
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    blocks = np.asarray(raw).reshape(-1, block_bytes)
    out_shape, groups = shape[:-1], shape[-1] // 32
    d = _f16(blocks[:, :2])  # every block type starts with its float16 scale
    if type_name == "Q8_0":  # int8 code + 128 is the code with its top bit flipped; 4 codes a word
        weight, scales, biases = blocks[:, 2:] ^ np.uint8(0x80), d, -128 * d
    else:
        start = 2 if type_name == "Q4_0" else 4
        scales, biases = d, (-8 * d if type_name == "Q4_0" else _f16(blocks[:, 2:4]))
        weight = _nibble_words(np.ascontiguousarray(blocks[:, start:]))
    return {
        "weight": np.ascontiguousarray(weight).view(np.uint32).reshape(*out_shape, -1),
        "scales": scales.astype(np.float16).reshape(*out_shape, groups),
        "biases": biases.astype(np.float16).reshape(*out_shape, groups),
    }
