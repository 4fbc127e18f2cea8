"""Tool calls out of generated text, per family, streamed.

``ToolCallStream`` takes the text as it is generated and returns the text safe
to show and the calls completed so far. Text that might open a call is held
back, as stop strings are (stop_strings.py); a call's markup never reaches the
text. A call is returned only whole and valid: a JSON object naming a declared
tool, with an object of arguments. Anything else that looked like a call (bad
JSON, an undeclared name, a call cut short by the token limit or
cancellation) is released as text, never as a broken call.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, NamedTuple

from ..results import ToolCall
from .formats import PYTHON_TAG, ToolFormat


class ToolText(NamedTuple):
    text: str  # safe to show now
    calls: list[ToolCall]  # completed now


def _call_object(obj: Any, names: set[str] | None) -> tuple[str, dict] | None:
    """``(name, arguments)`` of a call object, or None when it is not a valid call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _json_values(text: str) -> list[Any] | None:
    """The JSON values in ``text`` separated by whitespace, ``;`` or ``,``; None if any part is not JSON."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _mistral_v11(region: str, names) -> list[tuple[str, dict]] | None:
    """``name[ARGS]{...}`` calls, separated by ``[TOOL_CALLS]``."""
    calls = []
    for part in region.split("[TOOL_CALLS]"):
        if not part.strip():
            continue
        name, sep, args = part.partition("[ARGS]")
        values = _json_values(args) if sep else None
        call = _call_object({"name": name.strip(), "arguments": values[0]}, names) if values and len(values) == 1 else None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def parse_region(fmt: ToolFormat, region: str, names: set[str] | None) -> list[tuple[str, dict]] | None:
    """The calls in one call region (the text after the opening, without the
    closing text), or None when any part of it is not a valid call."""
    if fmt.name == "mistral_v11" and "[ARGS]" in region:
        return _mistral_v11(region, names)
    if fmt.name == "llama3":
        region = region.strip()
        region = region[len(PYTHON_TAG):] if region.startswith(PYTHON_TAG) else region
    values = _json_values(region)
    if values is not None and fmt.name.startswith("mistral") and len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    if not values or (fmt.close and len(values) != 1):
        return None
    calls = [_call_object(v, names) for v in values]
    return None if any(c is None for c in calls) else calls


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolCallStream:
    """Streamed text in, (text, completed calls) out, for one generation."""

    def __init__(self, fmt: ToolFormat, names: set[str] | None = None):
        self.fmt, self.names = fmt, names
        self._pending = ""  # text held back: it might open a call
        self._region: str | None = None  # inside a call: its text so far
        self._started = False  # llama3: whether the message has begun with something other than a call
        self._count = 0

    def feed(self, text: str) -> ToolText:
        """Add generated text; returns what may be shown and the calls completed."""
        self._pending += text
        out, calls = [], []
        while True:
            if self._region is None:
                shown, opened = self._scan_text()
                out.append(shown)
                if not opened:
                    break
            else:
                done = self._scan_region()
                if done is None:
                    break
                calls += done[0]
                out.append(done[1])
        return ToolText("".join(out), calls)

    def finish(self) -> ToolText:
        """End of generation: an unfinished or malformed call becomes text."""
        calls, text = [], ""
        if self._region is not None:
            region, self._region = self._region + self._pending, None
            parsed = None if self.fmt.close else parse_region(self.fmt, region, self.names)
            if parsed is None:
                text = self.fmt.open + region
            else:
                calls = self._made(parsed)
        elif self._count == 0 or self._pending.strip():
            text = self._pending  # whitespace after the last call is dropped
        self._pending = ""
        return ToolText(text, calls)

    def _scan_text(self) -> tuple[str, bool]:
        """Release text up to a call's opening; returns it and whether a call opened."""
        p, fmt = self._pending, self.fmt
        if not fmt.open:  # llama3: a call is the whole message
            if self._started:
                self._pending = ""
                return p, False
            head = p.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return "", False  # not decided yet
            self._started = True
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._region, self._pending = "", head
                return "", True
            self._pending = ""
            return p, False
        idx = p.find(fmt.open)
        if idx >= 0:
            self._region, self._pending = "", p[idx + len(fmt.open):]
            return self._unless_between_calls(p[:idx]), True
        cut = len(p) - _held_prefix(p, fmt.open)
        if self._count and not p[:cut].strip():
            return "", False  # whitespace between calls: shown only if text follows
        self._pending = p[cut:]
        return p[:cut], False

    def _unless_between_calls(self, text: str) -> str:
        return "" if self._count and not text.strip() else text

    def _scan_region(self) -> tuple[list[ToolCall], str] | None:
        """Inside a call: when its closing text arrived, the call (or, when it
        is malformed, its raw text); None while it is not closed."""
        self._region += self._pending
        self._pending = ""
        if not self.fmt.close:
            return None  # the calls run to the end of the message
        idx = self._region.find(self.fmt.close)
        if idx < 0:
            return None
        body, self._pending = self._region[:idx], self._region[idx + len(self.fmt.close):]
        self._region = None
        parsed = parse_region(self.fmt, body, self.names)
        if parsed is None:
            return [], self.fmt.open + body + self.fmt.close
        return self._made(parsed), ""

    def _made(self, parsed: list[tuple[str, dict]]) -> list[ToolCall]:
        calls = []
        for name, args in parsed:
            calls.append(ToolCall(self._count, f"call_{uuid.uuid4().hex[:24]}", name, args))
            self._count += 1
        return calls


def parse_tool_calls(fmt: ToolFormat, text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """A whole generated text split into its text and its valid calls."""
    stream = ToolCallStream(fmt, names)
    first, last = stream.feed(text), stream.finish()
    return first.text + last.text, first.calls + last.calls
