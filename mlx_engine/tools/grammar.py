"""The llguidance grammar that makes every tool call valid.

A call's name can only be a declared tool (the named one for a named
``tool_choice``) and its arguments are that tool's JSON schema, in the compact
layout structured output uses, so the markup, the name's key, the punctuation
and the argument keys are forced spans, drafted for free (structured.py).

``required`` and named choices start with a call. ``auto`` starts with free
text: a lazy lexeme (llguidance's ``[lazy]``: it ends at the first occurrence
of the call's opening text) matches any text up to the opening, and from there
on the grammar holds; text that never opens a call is unconstrained. For
``llama3``, whose call is the whole message, the first character decides: a
message starting with ``{`` is a call.
"""

from __future__ import annotations

import json

from ..structured import JSON_LAYOUT
from .spec import Tool, ToolSpec

FREE_TEXT = r"/(.|\n)*/"


def _lit(text: str) -> str:
    return json.dumps(text)


class _Markup:
    """Lark for the format's markup: a marker the tokenizer holds as one special
    token (``[TOOL_CALLS]`` in Mistral's) is that token (``<[id]>``), which the
    model writes natively and free text never contains; other text is a string."""

    def __init__(self, specials: dict[str, int]):
        self.specials = specials

    def __call__(self, text: str) -> str:
        return f"<[{self.specials[text]}]>" if text in self.specials else _lit(text)


def _args(tool: Tool) -> str:
    schema = tool.parameters
    if "x-guidance" not in schema:
        schema = {**schema, "x-guidance": dict(JSON_LAYOUT)}
    return "%json " + json.dumps(schema)


def _objects(spec: ToolSpec, markup: _Markup) -> list[str]:
    """Rules ``obj`` (one call object of any allowed tool) and each tool's arguments."""
    tools = spec.callable_tools
    lines = ["obj: " + " | ".join(f"obj_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        if spec.format.name == "mistral_v11":
            lines.append(f"obj_{i}: {_lit(tool.name)} {markup('[ARGS]')} args_{i}")
        else:
            head = f'{{"name": {json.dumps(tool.name)}, "{spec.format.args_key}": '
            lines.append(f'obj_{i}: {_lit(head)} args_{i} "}}"')
        lines.append(f"args_{i}: {_args(tool)}")
    return lines


def several_calls(spec: ToolSpec) -> bool:
    """Whether an answer may hold more than one call: a named choice is one call
    (OpenAI's meaning), as is any answer with ``parallel_tool_calls=False``."""
    return spec.parallel and spec.choice != "named"


def _body_and_repeat(spec: ToolSpec, markup: _Markup) -> tuple[str, str]:
    """What follows a call's opening, and what may follow the first call."""
    name, fmt = spec.format.name, spec.format
    if name in ("hermes", "default"):
        return f'body: "\\n" obj "\\n" {markup(fmt.close)}', f'("\\n" {markup(fmt.open)} body)*'
    if name == "mistral":
        return ('body: "[" obj ("," " " obj)* "]"' if several_calls(spec) else 'body: "[" obj "]"'), ""
    if name == "mistral_v11":
        return "body: obj", f"({markup(fmt.open)} body)*"
    return "body: obj", '("; " obj)*'  # llama3


def build_grammar(spec: ToolSpec, specials: dict[str, int] | None = None) -> str | None:
    """The Lark grammar for ``spec`` (None for ``tool_choice="none"``).
    ``specials``: the format's markers that are single special tokens, by id."""
    if spec.choice == "none":
        return None
    markup = _Markup(specials or {})
    body, repeat = _body_and_repeat(spec, markup)
    if not several_calls(spec):
        repeat = ""
    fmt = spec.format
    lines = ["%llguidance {}"]
    if spec.choice == "auto" and fmt.open in markup.specials:  # free text never holds a special token
        lines += [f"start: TEXT | TEXT {markup(fmt.open)} body {repeat}", f"TEXT: {FREE_TEXT}"]
    elif spec.choice == "auto" and fmt.open:
        lines += [f"start: TEXT | trig body {repeat}", f"trig[lazy]: TEXT {_lit(fmt.open)}", f"TEXT: {FREE_TEXT}"]
    elif spec.choice == "auto":  # llama3: a message that starts with "{" is a call
        lines += [f"start: FREE | body {repeat}", rf"FREE: {FREE_TEXT} & ~/[ \t\n]*\{{(.|\n)*/"]
    else:
        lines.append(f"start: {markup(fmt.open)} body {repeat}" if fmt.open else f"start: body {repeat}")
    return "\n".join(lines + [body] + _objects(spec, markup)) + "\n"
