"""Where a hosted model stands (``ModelState``) and the moves between states the
host makes (``TRANSITIONS``); ``ModelEntry`` refuses any other, so a new code
path that skips a step fails loudly instead of leaving an entry half-loaded."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .discovery import KnownModel
    from .options import LoadOptions


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


@dataclass
class ModelEntry:
    """One known model and where it stands."""

    model: KnownModel
    options: LoadOptions
    managed: bool = True  # False: a kit the embedding host holds; never loaded or unloaded here
    state: ModelState = NOT_LOADED
    service: object | None = None  # the app's Service while loaded
    task: asyncio.Future | None = None  # the load or unload under way
    active: int = 0  # requests between lookup and admission (inside kit_for)
    last_used: float = field(default_factory=time.monotonic)
    ttl: float | None = None  # None: the options' or the host's
    memory_bytes: int = 0
    last_error: str | None = None

    def __setattr__(self, name: str, value) -> None:
        # Every state change goes through the transitions table (hosting/model_state.py).
        if name == "state" and "state" in self.__dict__:
            value = check_transition(self.state, value)
        super().__setattr__(name, value)

    @property
    def busy(self) -> bool:
        """A request is in ``kit_for``, or generations run or wait for rows."""
        queue = getattr(self.service, "queue", None)
        return self.active > 0 or bool(queue and queue.busy)
