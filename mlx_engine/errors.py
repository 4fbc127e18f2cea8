"""Exceptions raised by the engine. Bad arguments raise ``ValueError`` subclasses
that name the argument and what is allowed."""

from contextlib import contextmanager
from string import Formatter
from typing import Iterator, Mapping


class InvalidArgument(ValueError):
    """A ``create_generator`` (or ``embed``) argument is bad.

    The parts say which, so a host can say it in its own field names without
    reading the message: ``field`` is the argument (``tools``), ``index`` the item
    of a list argument it is about (``1``, or None) and ``keys`` where inside that
    item (``("function", "name")``); ``param`` joins them as the caller wrote them
    (``tools[1].function.name``). ``template`` is the message with every argument
    it names as a ``{placeholder}``: ``{param}`` for the one at fault, any other
    argument (or setting, ``{truncate=True}``) by its own name, and the caller's
    data or a parser's report as ``values`` (never part of the template, so
    braces in them stay text). ``str(exc)`` is ``render()``: every name as the
    SDK spells it."""

    def __init__(
        self, template: str, field: str, *, index: int | None = None, keys: tuple[str, ...] = (), **values: object
    ):
        self.template, self.field, self.index, self.keys = template, field, index, keys
        self.values = {name: str(value) for name, value in values.items()}
        super().__init__(self.render())

    @property
    def param(self) -> str:
        """The argument as the caller wrote it: ``tools[1].function.name``."""
        item = f"[{self.index}]" if self.index is not None else ""
        return self.field + item + "".join(f".{key}" for key in self.keys)

    def render(self, names: Mapping[str, str] | None = None, param: str | None = None) -> str:
        """The message with each argument it names said as ``names`` says (its
        own name where ``names`` has none) and the one at fault as ``param``."""
        names = names or {}
        out = []
        for literal, name, _, _ in Formatter().parse(self.template):
            out.append(literal)
            if name is None:
                continue
            if name == "param":
                out.append(self.param if param is None else param)
            elif name in self.values:
                out.append(self.values[name])
            else:
                out.append(names.get(name, name))
        return "".join(out)


@contextmanager
def argument(param: str) -> Iterator[None]:
    """Within the block, a plain ``ValueError`` becomes ``InvalidArgument(param)``
    whose message is the error's own text (one that already names its argument
    passes through)."""
    try:
        yield
    except InvalidArgument:
        raise
    except ValueError as exc:
        raise InvalidArgument("{detail}", param, detail=exc) from exc


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
