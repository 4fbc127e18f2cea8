"""Evaluating a loaded model's arrays in small groups, so that a load leaves
room for the other models' streams.

MLX lets a thread add work to its queues only while at most a fixed number of
tasks (``MAX_ACTIVE_TASKS``, 10) are in flight in the whole process. One
``mx.eval`` of every weight a load computes (a float32 cast of each tensor)
keeps that queue full until the whole model is done, so another thread's
decoding step, a few small evaluations, waited 0.4-1.0 s on 2 CPU cores.
Evaluated group by group (each group bounded in bytes), the queue drains
after every group and the other thread's tasks go in between.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

GROUP_BYTES = 16 * 2**20  # about 30 ms of float32 casting on one CPU core; a 135M model takes ~30 groups


def eval_piecewise(*trees, max_bytes: int = GROUP_BYTES) -> int:
    """Evaluate every ``mx.array`` in ``trees`` (arrays, or lists/dicts of them
    as ``mx.eval`` takes) in groups of at most ``max_bytes`` of results (one
    larger array alone is a group); returns the number of groups."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes!r}")
    group: list[mx.array] = []
    size = groups = 0
    for _, value in tree_flatten(list(trees)):
        if not isinstance(value, mx.array):
            continue
        if group and size + value.nbytes > max_bytes:
            mx.eval(group)
            group, size, groups = [], 0, groups + 1
        group.append(value)
        size += value.nbytes
    if group:
        mx.eval(group)
        groups += 1
    return groups
