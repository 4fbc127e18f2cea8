"""Options declared once: a dataclass field carries its default, its one-line
doc and its check, and ``checked`` runs every field's check, so a group of
options (request/options.py, decode/sampling.py) is validated, documented and
turned into keyword parameters from the same declaration.

The number checks the groups share live here too: each raises ``InvalidArgument``
naming the argument, and refuses bools, NaN and infinities.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import MISSING, field, fields, replace
from typing import Any, Callable

from .errors import InvalidArgument

Check = Callable[..., Any]
"""``check(name, value, **context) -> value``: the value normalised, or
``InvalidArgument`` naming ``name``. ``context`` is what the group's validation
knows (``vocab_size`` for sampling); a check takes what it needs."""


def option(default: Any, doc: str, check: Check | None = None) -> Any:
    """A field of an option group: ``default``, ``doc`` (docs and help) and ``check``."""
    return field(default=default, metadata={"doc": doc, "check": check})


def checked(group, **context):
    """``group`` with every field's check applied (in declaration order)."""
    changes = {}
    for f in fields(group):
        check = f.metadata.get("check")
        if check is not None:
            changes[f.name] = check(f.name, getattr(group, f.name), **context)
    return replace(group, **changes)


def keyword_parameters(*groups: type) -> list[inspect.Parameter]:
    """The groups' fields as keyword-only parameters (a signature's tail)."""
    return [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=f.type,
            default=f.default if f.default is not MISSING else inspect.Parameter.empty,
        )
        for group in groups
        for f in fields(group)
    ]


def doc_of(group: type, name: str) -> str:
    """The declared one-line doc of ``group``'s field ``name``."""
    return next(f.metadata.get("doc", "") for f in fields(group) if f.name == name)


def invalid(name: str, template: str, **values: object) -> InvalidArgument:
    """``template`` said right after ``name``, the argument or a part of it
    (``logit_bias key``, ``logit_bias[5]``); ``values``: the caller's data."""
    field = name.split(" ")[0].split("[")[0]
    part = name[len(field) :].replace("{", "{{").replace("}", "}}")
    return InvalidArgument("{param}" + part + template, field, **values)


def number(name: str, value, *, integer: bool = False):
    """``value`` as a Python int or float; ``ValueError`` naming ``name`` unless it
    is a (finite) real number. numpy scalars are accepted; bools are not."""
    ok_types = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, ok_types):
        kind = "an integer" if integer else "a number"
        raise invalid(name, " must be {kind}, got {got}", kind=kind, got=repr(value))
    if integer:
        return int(value)
    value = float(value) if not isinstance(value, numbers.Integral) else int(value)
    if not math.isfinite(value):
        raise invalid(name, " must be a finite number, got {got}", got=repr(value))
    return value


def in_range(name: str, value, ok: Callable[[float], bool], allowed: str, integer: bool = False):
    """``value`` as a finite number (None stays None); ``ValueError`` saying
    "``name`` must be ``allowed``" unless ``ok`` holds for it."""
    if value is None:
        return None
    if not ok(num := number(name, value, integer=integer)):
        raise invalid(name, " must be {allowed}, got {got}", allowed=allowed, got=num)
    return num


def count(name: str, value, lo: int, hi: int, allowed: str) -> int | None:
    """``value`` as an integer in [lo, hi] (None stays None), else ``ValueError``."""
    return in_range(name, value, lambda x: lo <= x <= hi, allowed, integer=True)


def strict_int(lo: int, hi: int | None = None, *, optional: bool = False) -> Check:
    """A check for a Python int (bools refused) from ``lo`` to ``hi``, or None if
    ``optional``; the messages are the decoding arguments' own."""

    def check(name: str, value, **_):
        if value is None and optional:
            return None
        ok = not isinstance(value, bool) and isinstance(value, int) and value >= lo and (hi is None or value <= hi)
        if not ok:
            allowed = f"an integer from {lo} to {hi} or None" if hi is not None else "a positive integer"
            raise InvalidArgument("{param} must be {allowed}, got {got}", name, allowed=allowed, got=repr(value))
        return value

    return check


def one_of(*allowed, message: str) -> Check:
    """A check that ``value`` is one of ``allowed`` (compared with ``==``;
    ``message``: what it must be)."""

    def check(name: str, value, **_):
        if value not in allowed:
            raise InvalidArgument("{param} must be {allowed}, got {got}", name, allowed=message, got=repr(value))
        return value

    return check


def boolean(message: str = "True or False") -> Check:
    """A check that ``value`` is a bool (``message``: how the error says so)."""

    def check(name: str, value, **_):
        if not isinstance(value, bool):
            raise InvalidArgument("{param} must be {allowed}, got {got}", name, allowed=message, got=repr(value))
        return value

    return check
