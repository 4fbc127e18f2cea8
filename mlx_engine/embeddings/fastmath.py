"""Elementwise math for the encoder that MLX's CPU backend vectorizes.

MLX's CPU ``erf`` and ``exp`` compute one value at a time, and a compiled
(``mx.compile``) elementwise kernel is vectorized by the C++ compiler only when
its loop has no branches: ``maximum``/``minimum`` (which check for NaN) and
``where`` keep it scalar. So each function here is plain multiply-add and
divide inside ``mx.compile``, with the clamping done outside it by ``mx.clip``
(MLX's own vectorized kernel), and powers of two made from integer bits."""

from __future__ import annotations

import mlx.core as mx

# Eigen's rational approximation of erf on [-4, 4] (erf is +-1 in float32 beyond): odd
# numerator and even denominator coefficients, lowest power first. Within 5e-7 of erf.
_ERF_P = (-1.60960333262415e-02, -2.95459980854025e-03, -7.34990630326855e-04, -5.69250639462346e-05,
          -2.10102402082508e-06, 2.77068142495902e-08, -2.72614225801306e-10)  # fmt: skip
_ERF_Q = (-1.42647390514189e-02, -7.37332916720468e-03, -1.68282697438203e-03, -2.13374055278905e-04,
          -1.45660718464996e-05)  # fmt: skip

# exp(r) on [-ln2/2, ln2/2]: Taylor coefficients 1/k!, within 2 ulp of float32 exp there.
_EXP_C = (1.0, 1.0, 1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720, 1 / 5040)
_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693145751953125, 1.4286068203094173e-06  # ln 2 split so n * hi is exact
_ROUND = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds a float32 to an integer
_EXP_FLOOR = -87.0  # exp(-87) is a normal float32 (1.6e-38); below that counts as 0 in a softmax


@mx.compile
def _gelu_body(x: mx.array, z: mx.array) -> mx.array:
    # Estrin's scheme (t, t^2, t^4) keeps the dependency chain short.
    t = z * z
    t2 = t * t
    t4 = t2 * t2
    p = (_ERF_P[0] + _ERF_P[1] * t) + t2 * (_ERF_P[2] + _ERF_P[3] * t)
    p = p + t4 * ((_ERF_P[4] + _ERF_P[5] * t) + t2 * _ERF_P[6])
    q = (_ERF_Q[0] + _ERF_Q[1] * t) + t2 * (_ERF_Q[2] + _ERF_Q[3] * t) + t4 * _ERF_Q[4]
    return 0.5 * x * (1.0 + z * p / q)


def gelu_erf(x: mx.array) -> mx.array:
    """The exact (erf) GELU, ``x * (1 + erf(x / sqrt 2)) / 2``, erf within 5e-7."""
    return _gelu_body(x, mx.clip(x * 0.7071067811865476, -4.0, 4.0))


@mx.compile
def _exp_parts(d: mx.array) -> tuple[mx.array, mx.array]:
    # d <= 0 is clamped to [_EXP_FLOOR, 0]: n = round(d / ln 2) in [-126, 0], r = d - n ln 2.
    n = (d * _LOG2E + _ROUND) - _ROUND
    r = (d - n * _LN2_HI) - n * _LN2_LO
    r2 = r * r
    r4 = r2 * r2
    c = _EXP_C
    p = (c[0] + c[1] * r) + r2 * (c[2] + c[3] * r) + r4 * ((c[4] + c[5] * r) + r2 * (c[6] + c[7] * r))
    bits = mx.left_shift((n + 127.0).astype(mx.int32), 23)  # the float32 2**n, exponent field n + 127
    return p, bits


def exp_nonpositive(d: mx.array) -> mx.array:
    """``exp(d)`` for float32 ``d <= 0`` (``-inf`` included), within 3e-7 relative;
    below -87 it is exp(-87) = 1.6e-38 rather than smaller."""
    p, bits = _exp_parts(mx.clip(d, _EXP_FLOOR, 0.0))
    return bits.view(mx.float32) * p


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """``mx.softmax`` of float32 ``x`` over ``axis`` with the exp above: a row's
    ``-inf`` (masked) entries get ~1e-38 weight (at most 1e-38 relative), not 0."""
    e = exp_nonpositive(x - mx.max(x, axis=axis, keepdims=True))
    return e / mx.sum(e, axis=axis, keepdims=True)
