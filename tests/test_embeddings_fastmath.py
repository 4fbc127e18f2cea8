"""The encoder's vectorizable math (mlx_engine/embeddings/fastmath.py) against
MLX's own erf, exp and softmax, over wide ranges, extremes and masks; and
embed's length batching (kit.length_batches)."""

import mlx_engine  # noqa: F401  (first: loads the engine's BLAS before mlx.core)
from mlx_engine.embeddings import fastmath
from mlx_engine.embeddings.kit import PADDING_FLOOR, PADDING_SHARE, length_batches

import math

import mlx.core as mx
import numpy as np
import pytest


def exact_gelu(x: np.ndarray) -> np.ndarray:
    """The erf GELU in float64 (math.erf per value)."""
    erf = np.vectorize(math.erf)(x.astype(np.float64) / math.sqrt(2))
    return 0.5 * x.astype(np.float64) * (1 + erf)


def test_gelu_matches_the_erf_gelu_from_tiny_to_huge_values():
    x = np.concatenate([np.linspace(-12, 12, 200_001), [0.0, 1e-30, -1e-30, 5.6, -5.6, 1e4, -1e4, 3e38, -3e38]]).astype(
        np.float32
    )
    got = np.asarray(fastmath.gelu_erf(mx.array(x))).astype(np.float64)
    want = exact_gelu(x)
    # erf within 5e-7, so the GELU within |x| * 2.5e-7 plus float32 rounding
    assert np.all(np.abs(got - want) <= 3e-7 * np.abs(x) + 1e-7 * np.abs(want) + 1e-30)
    assert got[-4] == 1e4 and got[-3] == 0.0 and got[-2] == np.float32(3e38) and got[-1] == 0.0
    mlx = np.asarray(mx.erf(mx.array(x[:200_001]) / math.sqrt(2)))
    assert np.abs(got[:200_001] - 0.5 * x[:200_001] * (1 + mlx)).max() < 1e-5


def test_gelu_keeps_shape_and_works_on_batches():
    x = mx.random.normal((3, 5, 7), key=mx.random.key(0)) * 4
    got = fastmath.gelu_erf(x)
    assert got.shape == (3, 5, 7) and got.dtype == mx.float32
    assert np.allclose(np.asarray(got), exact_gelu(np.asarray(x)), atol=3e-6)


def test_exp_is_within_3e7_relative_down_to_minus_87():
    d = np.concatenate([np.linspace(-87, 0, 1_000_001), [-0.0, -1e-30, -1e-7]]).astype(np.float32)
    got = np.asarray(fastmath.exp_nonpositive(mx.array(d))).astype(np.float64)
    want = np.exp(d.astype(np.float64))
    assert (np.abs(got - want) / want).max() < 3e-7
    assert got[-3] == 1.0


def test_exp_of_minus_inf_and_huge_negatives_is_the_floor():
    d = mx.array([-mx.inf, -1e30, -1e9, -88.0, -200.0])
    got = np.asarray(fastmath.exp_nonpositive(d))
    assert np.all(got == got[0]) and abs(got[0] / math.exp(-87) - 1) < 3e-7


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4, 1e30])
def test_softmax_matches_mlx_softmax_at_any_magnitude(scale):
    x = mx.random.normal((16, 12, 40, 40), key=mx.random.key(1)) * scale
    got = np.asarray(fastmath.softmax(x))
    want = np.asarray(mx.softmax(x, axis=-1, precise=True))
    assert np.abs(got - want).max() < 1e-6
    assert np.abs(got.sum(-1) - 1).max() < 1e-6


def test_softmax_gives_masked_keys_no_weight():
    x = mx.random.normal((4, 2, 9, 9), key=mx.random.key(2)) * 5
    keep = np.arange(9) < 6
    mask = mx.array(np.where(keep, 0.0, -np.inf).astype(np.float32))
    got = np.asarray(fastmath.softmax(x + mask))
    want = np.asarray(mx.softmax(x[..., :6], axis=-1, precise=True))
    assert np.all(got[..., ~keep] < 1e-37)
    assert np.abs(got[..., keep] - want).max() < 1e-6


def test_softmax_over_another_axis():
    x = mx.random.normal((5, 6, 7), key=mx.random.key(3)) * 10
    got = np.asarray(fastmath.softmax(x, axis=1))
    assert np.abs(got - np.asarray(mx.softmax(x, axis=1, precise=True))).max() < 1e-6


def test_length_batches_cover_every_input_once_and_pad_little():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(3, 170, 1000)] + [256, 5]
    batches = length_batches(lengths, 32)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert 1 <= len(batch) <= 32
        width, sizes = max(lengths[i] for i in batch), [lengths[i] for i in batch]
        padding = width * len(batch) - sum(sizes)
        assert width - min(sizes) <= PADDING_FLOOR or padding <= PADDING_SHARE * width * len(batch)
    assert lengths[batches[0][0]] == 256 and len(batches[0]) < 5  # the outlier is not padded with 31 others
    firsts = [lengths[b[0]] for b in batches]
    assert firsts == sorted(firsts, reverse=True)


def test_length_batches_keep_like_lengths_together_up_to_the_batch_size():
    assert length_batches([10, 12, 11, 9, 10], 2) == [[1, 2], [0, 4], [3]]
    assert length_batches([4] * 5, 32) == [[0, 1, 2, 3, 4]]
    assert length_batches([100, 10, 10], 32) == [[0], [1, 2]]
