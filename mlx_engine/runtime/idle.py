"""Calls the engine thread runs only while no generation is open on a kit:
``require_idle`` and the ``WhenIdle`` value a worker can inspect."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from ..errors import GenerationInProgressError


class Kit(Protocol):
    """What the idle check reads of a kit: its request registry (``kits/registry.Activity``)."""

    activity: Any


def require_idle(kit: Kit) -> None:
    """``GenerationInProgressError`` while a generation is open on ``kit``:
    created and not yet finished or closed, iterated or not (its plan may
    rely on the model and draft model as they were when it was created)."""
    open_ = sorted(kit.activity.known)
    if open_:
        names = ", ".join(repr(a) for a in open_)
        raise GenerationInProgressError(
            f"generation {names} is still open on this kit (created, not yet finished or closed); "
            "finish or close it first"
        )


class WhenIdle:
    """A call to run on the kit's engine thread (after any close queued before
    it) unless a generation is open: ``action(*args)`` after ``require_idle``.
    A value, so a worker can tell which action it carries (a sharded kit's
    worker runs its own release inline once a rank has failed)."""

    __slots__ = ("kit", "action", "args")

    def __init__(self, kit: Kit, action: Callable, *args):
        self.kit, self.action, self.args = kit, action, args

    def __call__(self) -> None:
        require_idle(self.kit)
        self.action(*self.args)
