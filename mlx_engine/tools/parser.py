"""Tool calls out of generated text, per family, streamed.

``ToolCallStream`` takes the text as it is generated and returns the text safe
to show and the calls completed so far. A call identical (name and arguments)
to one already made in the same answer is never useful, and small models repeat
a call until the token limit: it is dropped and reported (``repeated``) so the
answer ends there. Text that might open a call is held
back, as stop strings are (stop_strings.py); a call's markup never reaches the
text. A call is returned only whole and valid: a JSON object naming a declared
tool, with an object of arguments. Anything else that looked like a call (bad
JSON, an undeclared name, a call cut short by the token limit or
cancellation) is released as text, never as a broken call. Where a grammar
holds the calls (``create_generator`` with tools), each call also streams as
``ToolCallDelta``s: its name, then its arguments' text as it is generated.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, NamedTuple

from ..results import ToolCall, ToolCallDelta
from .formats import PYTHON_TAG, ToolFormat


class ToolText(NamedTuple):
    text: str  # safe to show now
    calls: list[ToolCall]  # completed now
    deltas: list[ToolCallDelta]  # pieces of calls sent now
    repeated: bool = False  # a call identical to an earlier one of the answer was completed: the answer is over


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
        call = None
        if values and len(values) == 1:
            call = _call_object({"name": name.strip(), "arguments": values[0]}, names)
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
        region = region[len(PYTHON_TAG) :] if region.startswith(PYTHON_TAG) else region
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


HEAD_JSON = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
HEAD_V11 = re.compile(r"\s*(?:\[TOOL_CALLS\]\s*)?([A-Za-z0-9_.\-]+)\[ARGS\]")


class _ArgumentScanner:
    """Each call's name and its arguments' text as a call region grows. Used
    where a grammar holds the calls, so every call has the grammar's layout:
    the name first, then the arguments, a JSON value scanned to its end."""

    def __init__(self, fmt: ToolFormat):
        self.head = HEAD_V11 if fmt.name == "mistral_v11" else HEAD_JSON
        self.v11 = fmt.name == "mistral_v11"
        self.reset()

    def reset(self) -> None:
        self.pos, self.depth, self.in_args, self.in_string, self.escape = 0, 0, False, False, False

    def scan(self, region: str) -> list[tuple[str | None, str]]:
        """``(name, "")`` where a call starts, ``(None, fragment)`` for argument text."""
        out: list[tuple[str | None, str]] = []
        while True:
            if not self.in_args:
                m = self.head.search(region, self.pos)
                if m is None:
                    return out
                out.append((m.group(1) if self.v11 else json.loads(f'"{m.group(1)}"'), ""))
                self.pos, self.in_args, self.depth = m.end(), True, 0
            while self.depth == 0 and self.pos < len(region) and region[self.pos].isspace():
                self.pos += 1  # the whitespace before the value is not part of it
            start = i = self.pos
            while i < len(region) and self.in_args:
                self._step(region[i])
                i += 1
            if i > start:
                out.append((None, region[start:i]))
            self.pos = i
            if self.in_args:
                return out

    def _step(self, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.in_args = self.depth > 0


class ToolCallStream:
    """Streamed text in; text to show, completed calls and call deltas out.

    ``streamed=True`` (a grammar holds the calls) sends each call's name and
    argument fragments as they are generated; a call cut short then ends with
    its deltas sent and no call. A call after the first is held back until it is
    complete (it may be a repeat of an earlier one, which ends the answer and is
    never sent). Otherwise a call is sent whole, in one delta, once it is known
    to be valid, and anything cut short is text."""

    def __init__(self, fmt: ToolFormat, names: set[str] | None = None, streamed: bool = False):
        self.fmt, self.names = fmt, names
        self._pending = ""  # text held back: it might open a call
        self._region: str | None = None  # inside a call: its text so far
        self._started = False  # llama3: whether the message has begun with something other than a call
        self._count = 0  # calls completed
        self._scanner = _ArgumentScanner(fmt) if streamed else None
        self._streamed: list[tuple[str, str]] = []  # (id, name) of each call whose deltas were sent
        self._deltas: list[ToolCallDelta] = []
        self._held: list[ToolCallDelta] = []  # deltas of a call after the first, until it is complete
        self._made_keys: set[tuple[str, str]] = set()  # (name, arguments) of the calls made
        self.repeated = False  # a repeat of an earlier call ended the answer: nothing more is read

    def feed(self, text: str) -> ToolText:
        """Add generated text; returns what may be shown and the calls completed."""
        if self.repeated:
            return self._emit("", [])
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
                if self.repeated:
                    self._pending, self._region = "", None
                    break
        return self._emit("".join(out), calls)

    def finish(self) -> ToolText:
        """End of generation: an unfinished or malformed call becomes text
        (with ``streamed``, an unfinished call's deltas were sent: nothing more)."""
        calls, text = [], ""
        if self.repeated:
            return self._emit("", [])
        if self._region is not None:
            region, self._region = self._region + self._pending, None
            self._stream(region)
            parsed = None if self.fmt.close else parse_region(self.fmt, region, self.names)
            if parsed is not None:
                calls = self._made(parsed)
            elif self._scanner is None:
                text = self.fmt.open + region
        else:
            # What was held back at the end is a call cut inside its opening
            # marker ("<", "<tool_call"): neither a call nor text.
            text = self._pending[: len(self._pending) - _held_prefix(self._pending, self.fmt.open or PYTHON_TAG)]
            if self._count and not text.strip():
                text = ""  # whitespace after the last call is dropped
        self._pending, self._held = "", []  # a call after the first that was cut short is never sent
        return self._emit(text, calls)

    def _emit(self, text: str, calls: list[ToolCall]) -> ToolText:
        deltas, self._deltas = self._deltas, []
        return ToolText(text, calls, deltas, self.repeated)

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
            self._region, self._pending = "", p[idx + len(fmt.open) :]
            return ("" if self._count and not p[:idx].strip() else p[:idx]), True
        cut = len(p) - _held_prefix(p, fmt.open)
        if self._count and not p[:cut].strip():
            return "", False  # whitespace between calls: shown only if text follows
        self._pending = p[cut:]
        return p[:cut], False

    def _scan_region(self) -> tuple[list[ToolCall], str] | None:
        """Inside a call: when its closing text arrived, the call (or, when it
        is malformed, its raw text); None while it is not closed."""
        self._region += self._pending
        self._pending = ""
        idx = self._region.find(self.fmt.close) if self.fmt.close else -1
        self._stream(self._region if idx < 0 else self._region[:idx])
        if idx < 0:
            return None  # not closed yet, or (no closing text) the calls run to the end of the message
        body, self._pending = self._region[:idx], self._region[idx + len(self.fmt.close) :]
        self._region = None
        if self._scanner is not None:
            self._scanner.reset()
        parsed = parse_region(self.fmt, body, self.names)
        if parsed is None:
            return [], ("" if self._scanner is not None else self.fmt.open + body + self.fmt.close)
        return self._made(parsed), ""

    def _stream(self, region: str) -> None:
        """Deltas for the call text the scanner has not seen yet."""
        if self._scanner is None:
            return
        for name, fragment in self._scanner.scan(region):
            if name is not None:
                self._streamed.append((f"call_{uuid.uuid4().hex[:24]}", name))
                delta = ToolCallDelta(len(self._streamed) - 1, self._streamed[-1][0], name, "")
            elif self._streamed:
                delta = ToolCallDelta(len(self._streamed) - 1, None, None, fragment)
            else:
                continue
            (self._held if delta.index > 0 else self._deltas).append(delta)

    def _made(self, parsed: list[tuple[str, dict]]) -> list[ToolCall]:
        calls = []
        for name, args in parsed:
            key = (name, json.dumps(args, sort_keys=True))
            if key in self._made_keys:
                self.repeated, self._held = True, []
                break
            self._made_keys.add(key)
            self._deltas += self._held
            self._held = []
            index = self._count
            if index < len(self._streamed) and self._streamed[index][1] == name:
                call_id = self._streamed[index][0]
            else:  # sent whole, in one delta
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                self._streamed.append((call_id, name))
                index = len(self._streamed) - 1
                self._deltas.append(ToolCallDelta(index, call_id, name, json.dumps(args, ensure_ascii=False)))
            calls.append(ToolCall(index, call_id, name, args))
            self._count += 1
        return calls


def parse_tool_calls(fmt: ToolFormat, text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """A whole generated text split into its text and its valid calls."""
    stream = ToolCallStream(fmt, names)
    first, last = stream.feed(text), stream.finish()
    return first.text + last.text, first.calls + last.calls
