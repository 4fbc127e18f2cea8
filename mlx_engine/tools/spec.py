"""Checking ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (OpenAI's shapes)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from .formats import ToolFormat

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # whole name: fullmatch (a "$" would allow a trailing newline)
CHOICES = ("auto", "none", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # the arguments' JSON schema

    def as_openai(self) -> dict:
        """The OpenAI tool definition chat templates expect."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools: what the grammar may produce and the parser accept."""

    tools: tuple[Tool, ...]
    choice: str  # auto | none | required | named
    name: str | None  # the tool a named choice forces
    parallel: bool
    format: ToolFormat

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    @property
    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools the grammar allows: all, or the named one."""
        return tuple(t for t in self.tools if self.name is None or t.name == self.name)


def validate_tools(tools: Any) -> tuple[Tool, ...]:
    """OpenAI tool definitions (``[{"type": "function", "function": {"name", "description",
    "parameters"}}]``) as ``Tool``s; ``ValueError`` naming the bad item."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise InvalidArgument(
            "{param} must be a non-empty list of tool definitions, got {got}", "tools", got=repr(tools)
        )
    out: list[Tool] = []
    for i, item in enumerate(tools):
        where = {"field": "tools", "index": i}  # the tool, for InvalidArgument
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict) or item.get("type", "function") != "function":
            raise InvalidArgument(
                '{param} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}', **where
            )
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidArgument(
                "{param} must be 1-64 letters, digits, '_', '.' or '-', got {got}",
                **where,
                keys=("function", "name"),
                got=repr(name),
            )
        if any(t.name == name for t in out):
            raise InvalidArgument("{param} {got} is declared twice", **where, keys=("function", "name"), got=repr(name))
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise InvalidArgument("{param} must be a string", **where, keys=("function", "description"))
        parameters = fn.get("parameters", EMPTY_PARAMETERS)
        parameters = json_value(parameters, **where, keys=("function", "parameters"))
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise InvalidArgument(
                "{param} must be a JSON schema of an object", **where, keys=("function", "parameters")
            )
        out.append(Tool(name, description, parameters))
    return tuple(out)


MAX_JSON_DEPTH = 200  # deeper JSON is refused: Python's json recursion limit is near 1000


def json_value(value: Any, field: str, index: int | None = None, keys: tuple[str, ...] = ()) -> Any:
    """``value`` (or JSON text) as a JSON value; ``InvalidArgument`` naming where
    it is (``field``, ``index``, ``keys``) for text that is not JSON or a value
    nested deeper than ``MAX_JSON_DEPTH``."""
    where = {"index": index, "keys": keys}
    if json_depth(value) > MAX_JSON_DEPTH:
        raise InvalidArgument("{param} is nested deeper than {most} levels", field, **where, most=MAX_JSON_DEPTH)
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidArgument("{param} is not valid JSON: {detail}", field, **where, detail=exc) from exc


def json_depth(value: Any) -> int:
    """How deeply a JSON value (or JSON text) nests, found without recursion."""
    return _text_depth(value) if isinstance(value, str) else _value_depth(value)


def _text_depth(text: str) -> int:
    """The deepest bracket nesting of JSON text (strings skipped)."""
    depth = deepest = 0
    in_string = escape = False
    for c in text:
        if in_string:
            escape, in_string = (False, in_string) if escape else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _value_depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value``, counted without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (list, tuple, dict)):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                break
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def validate_tool_choice(choice: Any, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    """``(choice, forced name)`` for ``"auto"``, ``"none"``, ``"required"`` or a
    named tool (``{"type": "function", "function": {"name": ...}}`` or ``{"name": ...}``)."""
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise InvalidArgument(
                "{param} must be one of {choices} or {{'name': ...}}, got {got}", "tool_choice", **_choices(choice)
            )
        return choice, None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if "function" in choice and not isinstance(fn, dict):
            raise InvalidArgument('{param}.function must be {{"name": ...}}, got {got}', "tool_choice", got=repr(fn))
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        if not isinstance(name, str):  # a list or an object is no name (and unhashable)
            raise InvalidArgument("{param} must name a tool with a string, got {got}", "tool_choice", got=repr(name))
        if name not in {t.name for t in tools}:
            raise InvalidArgument(
                "{param} names {got}, which is not one of the declared tools", "tool_choice", got=repr(name)
            )
        return "named", name
    raise InvalidArgument(
        "{param} must be one of {choices} or {{'name': ...}}, got {got}", "tool_choice", **_choices(choice)
    )


def _choices(choice: Any) -> dict[str, str]:
    """The values of the message refusing ``choice``."""
    return {"choices": ", ".join(CHOICES), "got": repr(choice)}


def validate_tool_request(tools: Any, choice: Any, parallel: Any, fmt: ToolFormat) -> ToolSpec | None:
    """The request's ``ToolSpec``, or None without tools."""
    if not isinstance(parallel, bool):
        raise InvalidArgument("{param} must be True or False, got {got}", "parallel_tool_calls", got=repr(parallel))
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise InvalidArgument("{param} was given without {tools}; pass {tools}=[...]", "tool_choice")
        return None
    checked = validate_tools(tools)
    kind, name = validate_tool_choice("auto" if choice is None else choice, checked)
    return ToolSpec(checked, kind, name, parallel, fmt)
