"""Loaded weights are evaluated in groups of bounded bytes (loading/evaluation.py)."""

import mlx_engine  # noqa: F401 - first: loads OpenBLAS before mlx.core
from mlx_engine.loading.evaluation import eval_piecewise

import mlx.core as mx
import numpy as np
import pytest


def test_groups_are_bounded_in_bytes():
    arrays = [mx.ones((256,), dtype=mx.float32) * i for i in range(10)]  # 1 KiB each
    assert eval_piecewise(arrays, max_bytes=3 * 1024) == 4  # 3 + 3 + 3 + 1
    assert eval_piecewise(arrays, max_bytes=100) == 10  # one larger array alone is a group
    assert eval_piecewise(arrays) == 1
    for i, a in enumerate(arrays):
        assert np.array_equal(np.array(a), np.full(256, i, dtype=np.float32))


def test_trees_of_arrays_and_other_values():
    tree = {"a": [mx.arange(4) + 1, {"b": mx.zeros((2, 2)) + 2}], "n": 3, "s": "text"}
    extra = mx.array([5.0]) * 2
    assert eval_piecewise(tree, [extra], max_bytes=16) == 3
    assert np.array(tree["a"][0]).tolist() == [1, 2, 3, 4]
    assert np.array(tree["a"][1]["b"]).tolist() == [[2, 2], [2, 2]]
    assert np.array(extra).tolist() == [10.0]
    assert eval_piecewise({}, []) == 0


def test_max_bytes_must_be_positive():
    with pytest.raises(ValueError, match="max_bytes"):
        eval_piecewise([mx.zeros(1)], max_bytes=0)
