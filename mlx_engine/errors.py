"""Exceptions raised by the engine. Bad arguments raise ``ValueError`` subclasses
that name the argument and what is allowed."""

from contextlib import contextmanager
from typing import Iterator


class InvalidArgument(ValueError):
    """A ``create_generator`` argument is bad.

    ``param`` names it as the caller passed it: the argument (``temp``), or an
    item inside it (``tools[1].function.name``), so a host can map it to its
    own field names without reading the message."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@contextmanager
def argument(param: str) -> Iterator[None]:
    """Within the block, a plain ``ValueError`` becomes ``InvalidArgument(param)``
    (one that already names its argument passes through)."""
    try:
        yield
    except InvalidArgument:
        raise
    except ValueError as exc:
        raise InvalidArgument(str(exc), param) from exc


class ModelLoadError(ValueError):
    """The model directory is missing, malformed or unsupported."""


class IncompatibleDraftModelError(ValueError):
    """A draft model cannot be used with this kit; ``reasons`` says why."""

    def __init__(self, message: str, reasons: list[str]):
        super().__init__(message)
        self.reasons = reasons


class GenerationInProgressError(RuntimeError):
    """A kit runs one generation at a time; another one is still active."""


class ChatTemplateLimitError(ValueError):
    """A chat template (code from the model files) needed more time or memory
    than rendering a prompt may (chat_template.py)."""


class CallbackError(RuntimeError):
    """A user callback raised; the original exception is the ``__cause__``."""


class DistributedConfigError(ModelLoadError):
    """A sharded kit cannot be built: one rank only, model files or settings that
    differ between ranks, or an architecture mlx-lm cannot shard (docs/distributed.md)."""


class ShardedKitError(RuntimeError):
    """A rank of a sharded kit died, hung or fell out of step; the kit is unusable
    until the job is relaunched and the model loaded again."""
