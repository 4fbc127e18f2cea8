"""A Responses request's body (pydantic) and the checks of what a response echoes back."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...core.schemas import EngineOptions
from ...web.errors import bad_request

# What a response echoes but no prompt holds (so no context check bounds it),
# bounded as OpenAI bounds it: metadata pairs and their lengths, format names.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_FORMAT_NAME, MAX_FORMAT_DESCRIPTION = 64, 4096
MAX_TOOLS = 128
MAX_HOSTED_TOOL_BYTES = 16 * 1024  # a tool this server skips (web_search, mcp, custom ...): its JSON


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    """The fields this server reads; others (``reasoning``, ``include``,
    ``prompt_cache_key``, ``truncation``, ``service_tier``, ``user``) are ignored."""

    model: str
    input: Any  # a string or a list of items, checked by input_messages (pydantic would name the union's member)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    mlx_engine: EngineOptions = EngineOptions()


# -- what is echoed, checked ------------------------------------------------------------------
def check_echoed(body: ResponsesRequest) -> None:
    """A 400 naming the field for what a response echoes but no prompt bounds:
    ``metadata`` past OpenAI's bounds, a format name or description too long,
    too many tools or a skipped (hosted) tool's body too large, and a non-finite
    number (``Infinity``, ``NaN``: not JSON, which the answer must be) anywhere
    in ``tools``, ``tool_choice`` or ``text.format.schema``."""
    meta = body.metadata or {}
    if len(meta) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata: at most {MAX_METADATA_PAIRS} key-value pairs, got {len(meta)}", "metadata")
    for key, value in meta.items():
        if len(key) > MAX_METADATA_KEY:
            raise bad_request(f"metadata: keys are at most {MAX_METADATA_KEY} characters, got {len(key)}", "metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise bad_request(
                f"metadata.{key[:64]}: values are at most {MAX_METADATA_VALUE} characters, got {len(value)}",
                f"metadata.{key[:64]}",
            )
    fmt = body.text.format if body.text else None
    for name, bound in (("name", MAX_FORMAT_NAME), ("description", MAX_FORMAT_DESCRIPTION)):
        value = getattr(fmt, name, None)
        if value is not None and len(value) > bound:
            raise bad_request(
                f"text.format.{name}: at most {bound} characters, got {len(value)}", f"text.format.{name}"
            )
    _check_tools(body.tools or [])
    for value, where in (
        (body.tools, "tools"),
        (body.tool_choice, "tool_choice"),
        (fmt and fmt.schema_, "text.format.schema"),
    ):
        bad = non_finite(value)
        if bad is not None:
            path = where + "".join(f".{p}" for p in bad)
            raise bad_request(f"{path}: numbers must be finite (Infinity and NaN are not JSON)", path)


def _check_tools(tools: list[dict]) -> None:
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    for i, tool in enumerate(tools):
        if tool.get("type") in ("function", "namespace"):
            continue  # declared in the prompt: the context bounds them
        size = len(json.dumps(tool, default=str))
        if size > MAX_HOSTED_TOOL_BYTES:
            raise bad_request(
                f"tools.{i}: a {tool.get('type')!r} tool (not served here) is at most {MAX_HOSTED_TOOL_BYTES} "
                f"bytes as JSON, got {size}",
                f"tools.{i}",
            )


def non_finite(value: Any) -> list | None:
    """The path (keys and indices) to the first non-finite float in ``value``
    (nested dicts and lists, walked without recursion); None when there is none."""
    stack: list[tuple[Any, list]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path
        if isinstance(item, dict):
            stack.extend((v, [*path, k]) for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((v, [*path, i]) for i, v in reversed(list(enumerate(item))))
    return None
