"""Request bodies as pydantic models: what the OpenAI API accepts, plus the
engine's namespaced extension (``mlx_engine``).

Types are strict (``"5"`` is not an integer, ``true`` is not a number) so a
wrong type is a 400 naming the field; unknown fields are ignored, as OpenAI's
clients send fields a server may not know.
"""

from __future__ import annotations

import mlx_engine as me

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

_CONFIG = ConfigDict(strict=True, extra="ignore")
# Every stop string is looked for after every token, on the thread all batched
# requests share: bounded so one request cannot slow the others down.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000


class _Body(BaseModel):
    model_config = _CONFIG


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    detail: str | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class CalledFunction(_Body):
    name: str = Field(min_length=1)
    # OpenAI sends JSON text; a dict is taken too (the chat template gets a dict either way).
    arguments: str | dict[str, Any] = "{}"


class AssistantToolCall(_Body):
    """A call an earlier assistant message made (OpenAI's ``message.tool_calls[i]``)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Body):
    """A chat message. ``developer`` is treated as ``system``. An assistant's
    ``tool_calls`` (content may be null) and a ``tool`` message's
    ``tool_call_id`` go to the chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    # ``schema`` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


Decoding = me.Decoding  # the engine's decoding choices


class EngineOptions(_Body):
    """The ``mlx_engine`` extension object: what OpenAI's API has no field for."""

    decoding: Decoding | None = None  # None: the server's default (--decoding)
    num_draft_tokens: int | None = Field(None, ge=1)
    prompt_lookup_num_tokens: int | None = Field(None, ge=1)
    # The defaults are the engine's own (its option groups), not copies.
    prompt_lookup_min_ngram: int = Field(me.GenerationOptions.prompt_lookup_min_ngram, ge=1)
    prompt_lookup_max_ngram: int = Field(me.GenerationOptions.prompt_lookup_max_ngram, ge=1)
    repetition_penalty: float | None = Field(None, gt=0)
    repetition_context_size: int = Field(me.GenerationOptions.repetition_context_size, ge=1)
    structured_drafting: bool = me.GenerationOptions.structured_drafting
    regex: str | None = None
    grammar: str | None = None  # Lark, llguidance's dialect


class _Sampling(_Body):
    """Fields shared by chat and completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: int = Field(1, ge=1)
    response_format: ResponseFormat | None = None
    user: str | None = None
    ttl: float | None = Field(None, gt=0)  # LM Studio's: idle seconds before this model is unloaded
    mlx_engine: EngineOptions = EngineOptions()

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(strings)}")
        if any(len(x) > MAX_STOP_CHARS for x in strings):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stop


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Tool definitions are checked by the SDK (mlx_engine.tools.validate_tools),
    # whose messages name the bad item (``tools[1].function.name ...``).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class DraftRequest(_Body):
    """Body of the draft endpoints: a catalog name, or a path inside --models-dir."""

    model: str = Field(min_length=1)
