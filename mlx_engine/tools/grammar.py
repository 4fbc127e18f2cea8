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


def _args(tool: Tool) -> str:
    schema = tool.parameters if "x-guidance" in tool.parameters else {**tool.parameters, "x-guidance": dict(JSON_LAYOUT)}
    return "%json " + json.dumps(schema)


def _objects(spec: ToolSpec) -> list[str]:
    """Rules ``obj`` (one call object of any allowed tool) and each tool's arguments."""
    tools = spec.callable_tools
    lines = ["obj: " + " | ".join(f"obj_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        if spec.format.name == "mistral_v11":
            head = f"{tool.name}[ARGS]"
            lines.append(f"obj_{i}: {_lit(head)} args_{i}")
        else:
            head = f'{{"name": {json.dumps(tool.name)}, "{spec.format.args_key}": '
            lines.append(f'obj_{i}: {_lit(head)} args_{i} "}}"')
        lines.append(f"args_{i}: {_args(tool)}")
    return lines


def _body_and_repeat(spec: ToolSpec) -> tuple[str, str]:
    """What follows a call's opening text, and what may follow the first call."""
    name = spec.format.name
    if name in ("hermes", "default"):
        call = f'{_lit(spec.format.open)} body'
        return f'body: "\\n" obj "\\n" {_lit(spec.format.close)}', f'("\\n" {call})*'
    if name == "mistral":
        return ('body: "[" obj ("," " " obj)* "]"' if spec.parallel else 'body: "[" obj "]"'), ""
    if name == "mistral_v11":
        return "body: obj", f'({_lit(spec.format.open)} body)*'
    return 'body: obj', '("; " obj)*'  # llama3


def build_grammar(spec: ToolSpec) -> str | None:
    """The Lark grammar for ``spec`` (None for ``tool_choice="none"``)."""
    if spec.choice == "none":
        return None
    body, repeat = _body_and_repeat(spec)
    if not spec.parallel:
        repeat = ""
    fmt = spec.format
    lines = ["%llguidance {}"]
    if spec.choice == "auto" and fmt.open:
        lines += ["start: TEXT | trig body " + repeat, f"trig[lazy]: TEXT {_lit(fmt.open)}", f"TEXT: {FREE_TEXT}"]
    elif spec.choice == "auto":  # llama3: a message that starts with "{" is a call
        lines += ["start: FREE | body " + repeat, rf"FREE: {FREE_TEXT} & ~/[ \t\n]*\{{(.|\n)*/"]
    else:
        lines.append(f"start: {_lit(fmt.open)} body " + repeat if fmt.open else "start: body " + repeat)
    return "\n".join(lines + [body] + _objects(spec)) + "\n"
