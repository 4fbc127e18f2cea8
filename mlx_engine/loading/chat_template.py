"""Bounded chat-template rendering.

A chat template is Jinja code that comes with the model files. transformers
renders it in Jinja's sandbox, which blocks file and attribute access but not
work: nested loops run for hours on the host thread and ``'x' * 3000000000``
allocates 3 GB. ``check_render`` renders a template first in a sandbox that is
bounded in time (``RENDER_SECONDS``, checked on every line of Python the render
runs) and in size (``MAX_CHARS`` for the output and for every string or list an
operator, filter or string method could build, checked *before* it is built).
Only a template that completes within the bounds is then rendered by
transformers, so the engine's prompt is exactly what transformers makes of it.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from datetime import datetime
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ChatTemplateLimitError

RENDER_SECONDS = 5.0  # real templates render a long conversation in milliseconds
MAX_CHARS = 1 << 24  # 16M characters: longer than any model's context as text


class _LimitExceeded(BaseException):
    """Raised inside the render: a BaseException, so no ``except Exception`` in
    Jinja's runtime or filters can swallow it; ``check_render`` turns it into a
    ``ChatTemplateLimitError``."""


def _too_big(what: str, size: int) -> _LimitExceeded:
    return _LimitExceeded(f"the chat template builds {what} of {size} items; templates may build at most {MAX_CHARS}")


def _length(value) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


def _check_binop(operator: str, left, right) -> None:
    """Refuse, before computing it, a ``*``/``+``/``**``/``%`` whose result
    would exceed the size bound."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if _length(seq) is not None and isinstance(n, int) and _length(seq) * n > MAX_CHARS:
                raise _too_big("a repetition", _length(seq) * n)
    elif operator == "+" and _length(left) is not None and _length(right) is not None:
        if _length(left) + _length(right) > MAX_CHARS:
            raise _too_big("a concatenation", _length(left) + _length(right))
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * math.log2(abs(left)) > 4 * MAX_CHARS:  # bits of the result
            raise _LimitExceeded(f"the chat template computes {left} ** {right}, a number too large to build")
    elif operator == "%" and isinstance(left, str):
        _check_format_widths(left)


_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")
_WIDTHS = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?|\{[^{}]*?:[^{}]*?(\d+)[^{}]*\}")


def _check_format_widths(fmt: str) -> None:
    """``'%*s'``-style or huge field widths would pad to any size: the widths a
    format string declares must sum within the bound."""
    if _NESTED_SPEC.search(fmt):
        raise _LimitExceeded(
            "the chat template formats with a width taken from an argument, which templates may not use"
        )
    total = len(fmt)
    for groups in _WIDTHS.findall(fmt):
        for g in groups:
            if g == "*":
                raise _LimitExceeded("the chat template formats with a '*' width, which templates may not use")
            total += int(g) if g else 0
    if total > MAX_CHARS:
        raise _too_big("formatted text", total)


def _check_call(obj, args: tuple, kwargs: dict) -> None:
    """Size checks for the string methods that pad or multiply."""
    # Jinja's sandbox hands templates str.format as a wrapper of the bound method.
    owner = getattr(obj, "__self__", getattr(getattr(obj, "__wrapped__", None), "__self__", None))
    name = getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int) and args[0] > MAX_CHARS:
        raise _too_big(f"a str.{name}", args[0])
    if name == "expandtabs":
        width = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(width, int) and width * max(1, owner.count("\t")) > MAX_CHARS:
            raise _too_big("a str.expandtabs", width * owner.count("\t"))
    if name == "replace" and len(args) >= 2 and isinstance(args[1], str):
        if (owner.count(args[0]) if args[0] else len(owner) + 1) * len(args[1]) + len(owner) > MAX_CHARS:
            raise _too_big("a str.replace", len(owner) * len(args[1]))
    if name == "join":
        items = list(args[0]) if args else []
        if sum(len(x) for x in items if isinstance(x, str)) + len(owner) * len(items) > MAX_CHARS:
            raise _too_big("a str.join", len(items))
    if name in ("format", "format_map"):
        _check_format_widths(owner)


def _bounded_filter(name: str, fn: Callable) -> Callable:
    """Jinja's padding and replacing filters, with the same checks as the str methods."""
    if name == "indent":

        def indent(value, width=4, *args, **kwargs):
            w = len(width) if isinstance(width, str) else width
            if isinstance(w, int) and w * (str(value).count("\n") + 1) > MAX_CHARS:
                raise _too_big("an indent", w)
            return fn(value, width, *args, **kwargs)

        return indent
    if name == "center":

        def center(value, width=80):
            _check_call(str(value).center, (width,), {})
            return fn(value, width)

        return center
    if name == "replace":

        def replace(eval_ctx, s, old, new, count=None):
            _check_call(str(s).replace, (str(old), str(new)), {})
            return fn(eval_ctx, s, old, new, count)

        return jinja2.pass_eval_context(replace)
    if name == "format":

        def format_(value, *args, **kwargs):
            _check_format_widths(str(value))
            return fn(value, *args, **kwargs)

        return format_
    return fn


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask
    tag) rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with size checks on operators, calls and filters."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
        for name in ("indent", "center", "replace", "format"):
            self.filters[name] = _bounded_filter(name, self.filters[name])
        # What transformers gives chat templates (utils/chat_template_utils.py).
        self.filters["tojson"] = _tojson
        self.globals.update(
            raise_exception=_raise_exception,
            strftime_now=lambda f: datetime.now().strftime(f),
            dict=dict,
            namespace=jinja2.utils.Namespace,
        )

    def call_binop(self, context, operator: str, left, right):
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _check_call(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    if isinstance(indent, int) and indent > 64:
        raise _LimitExceeded(f"the chat template indents JSON by {indent}; at most 64 is allowed")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


class _Deadline:
    """A trace function that raises once the render has run past its time:
    Python checks it on every line the render executes, template code and
    Jinja's runtime alike, so no loop escapes it."""

    def __init__(self, seconds: float):
        self.seconds, self.until, self.lines = seconds, time.monotonic() + seconds, 0

    def __call__(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if not self.lines & 63 and time.monotonic() > self.until:
                raise _LimitExceeded(
                    f"the chat template ran for more than {self.seconds:g} s without finishing (its render limit)"
                )
        return self


def check_render(template: str, variables: dict[str, Any]) -> int:
    """Render ``template`` with ``variables`` within the time and size bounds;
    returns the rendered length. ``ChatTemplateLimitError`` past a bound,
    Jinja's exceptions for a template that is broken or raises."""
    deadline, previous = _Deadline(RENDER_SECONDS), sys.gettrace()
    size = 0
    sys.settrace(deadline)
    try:
        # Compiling is bounded too: Jinja folds constant expressions (filters
        # included) while it compiles.
        compiled = BoundedSandbox().from_string(template)
        for chunk in compiled.generate(**variables):
            size += len(chunk)
            if size > MAX_CHARS:
                raise _too_big("a prompt", size)
    except _LimitExceeded as exc:
        raise ChatTemplateLimitError(str(exc)) from None
    finally:
        sys.settrace(previous)
    return size
