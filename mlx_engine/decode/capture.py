"""Hidden states out of the target's forward pass.

A loaded head names the hidden states it reads (``HiddenSpec``): the outputs of
some decoder layers (EAGLE-3) or of the text model, after its final norm, the
input of the output layer (MTP). ``install`` gives each of those modules a
subclass of its own class that records its output while a ``collecting`` block
is open, so the forward pass itself is the model's own, unchanged (any mlx-lm
architecture whose decoder layers are a list: attention and hybrid alike).
With no head loaded nothing is installed; with one loaded and no block open,
the added cost is one context-variable read per recorded module.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

FINAL = -1  # the text model's output (after its final norm): what the output layer reads

# The open collecting block's outputs, by capture point; None outside one.
_SINK: ContextVar[dict[int, mx.array] | None] = ContextVar("mlx_engine_hidden_sink", default=None)


@dataclass(frozen=True)
class HiddenSpec:
    """The hidden states a head reads, concatenated in this order on the last
    axis: decoder layer indices (0-based, the layer's output) or ``FINAL``."""

    points: tuple[int, ...]


def text_model(model: nn.Module) -> nn.Module:
    """The module holding the decoder layers (``embed_tokens``, ``layers``)."""
    for path in (("model",), ("language_model", "model"), ()):
        inner = model
        for name in path:
            inner = getattr(inner, name, None)
        if inner is not None and isinstance(getattr(inner, "layers", None), list) and hasattr(inner, "embed_tokens"):
            return inner
    raise ValueError(f"{type(model).__name__} has no decoder layer list to read hidden states from")


def num_layers(model: nn.Module) -> int:
    return len(text_model(model).layers)


class Installed:
    """Capture points installed on a model; ``remove`` gives the modules their classes back."""

    def __init__(self, modules: list[tuple[nn.Module, type]]):
        self._modules = modules

    def remove(self) -> None:
        for module, cls in self._modules:
            module.__class__ = cls
        self._modules = []


def install(model: nn.Module, spec: HiddenSpec) -> Installed:
    """Make the modules ``spec`` names record their outputs inside ``collecting``."""
    inner = text_model(model)
    done: list[tuple[nn.Module, type]] = []
    for point in spec.points:
        module = inner if point == FINAL else inner.layers[point]
        cls = type(module)
        if recording_point(module) is not None:
            continue  # already recording (a point named twice)
        module.__class__ = type(f"Captured{cls.__name__}", (cls,), {"_capture_point": point, "__call__": _call})
        done.append((module, cls))
    return Installed(done)


def recording_point(module: nn.Module) -> int | None:
    """The point ``module`` records (``install`` changed its class), or None."""
    return getattr(type(module), "_capture_point", None)


def _call(self, *args, **kwargs):
    out = super(type(self), self).__call__(*args, **kwargs)
    sink = _SINK.get()
    if sink is not None:
        sink[type(self)._capture_point] = out[0] if isinstance(out, tuple) else out
    return out


@contextlib.contextmanager
def collecting(spec: HiddenSpec | None) -> Iterator[dict[int, mx.array] | None]:
    """Record the outputs of ``spec``'s points during the forward passes run
    inside the block (the last pass's, by point); a no-op block for None."""
    if spec is None:
        yield None
        return
    sink: dict[int, mx.array] = {}
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def rows(sink: dict[int, mx.array], spec: HiddenSpec, row: int, n: int) -> mx.array:
    """Row ``row``'s first ``n`` positions of the recorded points, concatenated: (n, total width)."""
    missing = [p for p in spec.points if p not in sink]
    if missing:
        raise RuntimeError(f"the forward pass recorded no hidden state at {missing}")
    parts = [sink[p][row, :n] for p in spec.points]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def hidden_width(main: nn.Module, spec: HiddenSpec) -> int:
    """The width of the rows ``spec`` records on ``main`` (per point: the model's hidden size)."""
    return len(spec.points) * text_model(main).embed_tokens.weight.shape[-1]
