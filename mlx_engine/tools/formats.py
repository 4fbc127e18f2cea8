"""Tool-call syntaxes of the model families, chosen from the chat template.

Each family writes a call its own way; ``ToolFormat`` holds what the grammar
(grammar.py) and the parser (parser.py) need to know about it:

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one tag per call.
- ``llama3`` (Llama 3.1+): the whole message is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``); several calls separated by ``; ``.
- ``mistral`` (``[TOOL_CALLS]`` templates up to v7): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
- ``mistral_v11`` (templates with ``[ARGS]``): ``[TOOL_CALLS]name[ARGS]{...}`` per call.
- ``default``: the Hermes syntax, taught by the default tool prompt (prompt.py)
  to models whose template knows no tools.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # text that opens a call ("" for llama3: a call is the whole message)
    close: str  # text that ends one call ("": the calls run to the end of the message)
    args_key: str  # the key of the arguments in a call object
    native: bool  # whether the chat template renders tools itself


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", True)
LLAMA3 = ToolFormat("llama3", "", "", "parameters", True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", True)
MISTRAL_V11 = ToolFormat("mistral_v11", "[TOOL_CALLS]", "", "arguments", True)
DEFAULT = ToolFormat("default", "<tool_call>", "</tool_call>", "arguments", False)
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, MISTRAL_V11, DEFAULT)}


def template_supports_tools(template: str | None) -> bool:
    """Whether a Jinja chat template reads the ``tools`` variable."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def detect_format(template: str | None) -> ToolFormat:
    """The tool-call format of a chat template: a known family's when the
    template renders tools in that family's syntax, else the default."""
    if not template_supports_tools(template):
        return DEFAULT
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL_V11 if "[ARGS]" in template else MISTRAL
    if PYTHON_TAG in template or "<|start_header_id|>" in template:
        return LLAMA3
    return DEFAULT  # a template with tools in a syntax we cannot parse: the default prompt teaches ours
