"""Where a hosted model stands (``ModelState``) and the moves between states the
host makes (``TRANSITIONS``); ``ModelEntry`` refuses any other, so a new code
path that skips a step fails loudly instead of leaving an entry half-loaded."""

from __future__ import annotations

from enum import Enum


class ModelState(str, Enum):
    """A model entry's state; its value is what ``/v1/models`` shows."""

    NOT_LOADED = "not_loaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"

    def __str__(self) -> str:
        return self.value


NOT_LOADED, LOADING, LOADED, UNLOADING = ModelState

TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    # a load starts, or the embedding host hands over a kit it loaded itself
    NOT_LOADED: frozenset({LOADING, LOADED}),
    # the loader returned a kit, or raised
    LOADING: frozenset({LOADED, NOT_LOADED}),
    # an unload starts, or the server stops (kits freed at exit)
    LOADED: frozenset({UNLOADING, NOT_LOADED}),
    # the kit was freed, or a generation still ending kept it
    UNLOADING: frozenset({NOT_LOADED, LOADED}),
}


class StateError(RuntimeError):
    """A move ``TRANSITIONS`` does not allow: a bug in the host, never a client's error."""


def check_transition(old: ModelState, new: ModelState) -> ModelState:
    """``new`` as a ``ModelState`` when ``old`` may move to it; else ``StateError``."""
    new = ModelState(new)
    if new not in TRANSITIONS[ModelState(old)]:
        raise StateError(f"a model entry cannot go from {old} to {new}")
    return new
