"""Tool calls: tools in the prompt, calls parsed per model family, arguments
guaranteed by a grammar (docs/api.md, "Tool calls").

formats.py  the families' call syntaxes, chosen from the chat template
spec.py     checking tools / tool_choice / parallel_tool_calls
prompt.py   the messages and tools given to the chat template (or the default tool prompt)
grammar.py  the llguidance grammar that keeps calls valid
parser.py   calls out of the streamed text
"""

from __future__ import annotations

from ..errors import InvalidArgument
from ..structured import check_grammar, compile_constraint, tokenizer_for
from .formats import DEFAULT, FORMATS, ToolFormat, detect_format
from .grammar import build_grammar
from .parser import ToolCallStream, ToolText, parse_region, parse_tool_calls
from .prompt import DEFAULT_TOOL_PROMPT, default_tool_prompt, render_arguments
from .spec import Tool, ToolSpec, json_depth, validate_tool_request, validate_tools


def tool_format(kit) -> ToolFormat:
    """The tool-call format of the kit's chat template (the default one without a template)."""
    return detect_format(getattr(kit.tokenizer, "chat_template", None))


__all__ = [
    "DEFAULT",
    "DEFAULT_TOOL_PROMPT",
    "FORMATS",
    "Tool",
    "json_depth",
    "ToolCallStream",
    "ToolFormat",
    "ToolSpec",
    "ToolText",
    "build_grammar",
    "default_tool_prompt",
    "detect_format",
    "parse_region",
    "parse_tool_calls",
    "render_arguments",
    "tool_format",
    "validate_tool_request",
    "special_markers",
    "tool_constraint",
    "validate_tools",
]


def tool_constraint(kit, tools, tool_choice, parallel, constraint: tuple[str, str] | None):
    """``(ToolSpec or None, constraint)`` for a request: with tools (and a choice
    other than ``none``) the constraint is the tools' grammar, which cannot be
    combined with ``json_schema`` / ``regex`` / ``grammar``. ``ValueError``
    naming the bad argument or tool."""
    spec = validate_tool_request(tools, tool_choice, parallel, tool_format(kit))
    if spec is None or spec.choice == "none":
        return spec, constraint
    if constraint is not None:
        raise InvalidArgument(
            "{param} and {%s} were both given; a tool call's arguments follow the tool's "
            "own schema, so pass one of them (or {tool_choice}='none')" % constraint[0],
            "tools",
        )
    grammar = build_grammar(spec, special_markers(kit, spec.format))
    try:
        check_grammar(kit, "tools", grammar)
    except ValueError:
        for i, tool in enumerate(spec.tools):  # name the tool whose schema fails
            try:
                check_grammar(kit, *compile_constraint(json_schema=tool.parameters))
            except ValueError as exc:
                raise InvalidArgument(
                    "{param} ({name}) is not a usable JSON schema: {detail}",
                    "tools",
                    index=i,
                    keys=("function", "parameters"),
                    name=tool.name,
                    detail=exc,
                ) from exc
        raise
    return spec, ("tools", grammar)


def special_markers(kit, fmt: ToolFormat) -> dict[str, int]:
    """The format's markers the kit's tokenizer holds as one special token, by id."""
    llg = tokenizer_for(kit)
    found = {}
    for marker in {fmt.open, fmt.close, "[ARGS]"} - {""}:
        ids = kit.tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] < llg.vocab_size and llg.is_special_token(ids[0]):
            found[marker] = ids[0]
    return found
