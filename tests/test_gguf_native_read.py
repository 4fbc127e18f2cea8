"""GGUF files of MLX-native types are read tensor by tensor in numpy
(reader.read_native, transcode.transcode_native), not by ``mx.load``, which
holds the GIL for the whole file; the arrays must be the very bytes
``mx.load`` gives."""

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.errors import ModelLoadError
from mlx_engine.loading.gguf import reader
from mlx_engine.loading.gguf.transcode import NATIVE_BLOCKS, transcode_native

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from helpers import requires_default_model

from fixtures.gguf_families import write_gguf


def assert_same_as_mx_load(path):
    """Every array ``read_native`` yields equals ``mx.load``'s under the same
    name, dtype, shape and bytes, and neither has a name the other lacks."""
    native = dict(reader.read_native(reader.read_header(path)))
    reference = mx.load(str(path))
    assert sorted(native) == sorted(reference)
    for name, expected in reference.items():
        got = native[name]
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), name
        assert np.array_equal(np.array(got).view(np.uint8), np.array(expected).view(np.uint8)), name
    return native


@requires_default_model
def test_default_model_reads_as_mx_load_does():
    from mlx_engine.loading.model import resolve_model_path

    path = resolve_model_path(me.DEFAULT_MODEL)
    types = {t.type_name for t in reader.read_header(path).tensors.values()}
    assert types & NATIVE_BLOCKS  # the quantized path is what is compared
    native = assert_same_as_mx_load(path)
    assert any(name.endswith(".scales") for name in native)


def test_written_file_of_every_native_type_reads_as_mx_load_does(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": rng.standard_normal((48, 64)).astype(np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((96, 64)).astype(np.float32),  # Q4_0
        "blk.0.attn_k.weight": (rng.standard_normal((32, 128)) * 40).astype(np.float32),  # Q4_1
        "blk.0.attn_v.weight": rng.standard_normal((32, 64)).astype(np.float32),  # Q8_0
        "blk.0.ffn_up.weight": rng.standard_normal((64, 32)).astype(np.float32),  # F16
        "blk.0.ffn_exps.weight": rng.standard_normal((3, 16, 64)).astype(np.float32),  # F32: three dimensions
        "blk.0.attn_norm.weight": rng.standard_normal(64).astype(np.float32),
    }
    path = write_gguf(tmp_path / "m.gguf", "llama", tensors, {}, ["F32", "Q4_0", "Q4_1", "Q8_0", "F16", "F32"])
    header = reader.read_header(path)
    assert [t.type_name for t in header.tensors.values()] == ["F32", "Q4_0", "Q4_1", "Q8_0", "F16", "F32", "F32"]
    assert reader.all_mlx_native(header)
    assert_same_as_mx_load(path)


def test_three_dimensional_quantized_tensor(tmp_path):
    w = np.random.default_rng(1).standard_normal((2, 8, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "e.gguf", "llama", {"blk.0.ffn_up_exps.weight": w}, {}, "Q4_1")
    native = assert_same_as_mx_load(path)
    assert native["blk.0.ffn_up_exps.scales"].shape == (2, 8, 2)


def test_other_types_are_refused_by_name(tmp_path):
    w = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "q5.gguf", "llama", {"a.weight": w, "b.weight": w}, {}, ["Q8_0", "Q5_0"])
    header = reader.read_header(path)
    assert not reader.all_mlx_native(header)  # such a file is decoded (read_decoded), never read here
    with pytest.raises(ModelLoadError, match="'b.weight' \\(Q5_0\\)"):
        dict(reader.read_native(header))


def test_transcode_native_refuses_other_types():
    with pytest.raises(ValueError, match="Q5_0"):
        transcode_native("Q5_0", np.zeros(22, dtype=np.uint8), (1, 32))


def test_native_tensor_of_impossible_shape_is_a_load_error(tmp_path):
    w = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "s.gguf", "llama", {"a.weight": w}, {}, "Q8_0")
    header = reader.read_header(path)
    wrong = dataclasses.replace(header.tensors["a.weight"], shape=(64, 3))  # 6 blocks declared, 8 stored
    broken = dataclasses.replace(header, tensors={"a.weight": wrong})
    with pytest.raises(ModelLoadError, match="a.weight"):
        dict(reader.read_native(broken))
