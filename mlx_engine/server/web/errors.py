"""Error objects on the wire: OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` and, on Anthropic's routes (``/v1/messages``...), Anthropic's
``{"type": "error", "error": {"type", "message"}}``, with the HTTP status that
goes with each. Errors raised before a route runs (the body limit, the Host
check, 404/405, validation) take the shape of the path they answer
(``response_for``), so a client reads every error in its own API's shape."""

from __future__ import annotations

import mlx_engine as me

from functools import partial
from typing import Callable, Mapping, Sequence

from fastapi.responses import JSONResponse

# The engine's argument names, as the OpenAI field a client sent them in.
_ENGINE_FIELDS = {
    "temp": "temperature",
    "stop_strings": "stop",
    "json_schema": "response_format",
    "decoding": "mlx_engine.decoding",  # before the aliases that become mlx_engine.decoding
    "speculative_decoding_toggle": "mlx_engine.decoding",
    "auto_speculative": "mlx_engine.decoding",
    "num_draft_tokens": "mlx_engine.num_draft_tokens",
    "prompt_lookup_num_tokens": "mlx_engine.prompt_lookup_num_tokens",
    "prompt_lookup_min_ngram": "mlx_engine.prompt_lookup_min_ngram",
    "prompt_lookup_max_ngram": "mlx_engine.prompt_lookup_max_ngram",
    "repetition_penalty": "mlx_engine.repetition_penalty",
    "repetition_context_size": "mlx_engine.repetition_context_size",
    "regex": "mlx_engine.regex",
    "grammar": "mlx_engine.grammar",
    "structured_drafting": "mlx_engine.structured_drafting",
}


Where = tuple[str | int, ...]  # a request field as its parts: ("tools", 1, "function", "name")


class APIError(Exception):
    """An error the client gets as an OpenAI error object.

    ``where`` is ``param`` as its parts and ``wording`` the message said with a
    given ``param``: a wire format that built an internal request renames the
    field (``renamed``) and the message follows, with no parsing of either."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
        where: Where | None = None,
        wording: Callable[[str], str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}
        self.where, self.wording = where, wording

    def renamed(self, where: Where) -> "APIError":
        """This error naming the field ``where`` (its message too, when it has a ``wording``)."""
        self.where, self.param = where, ".".join(str(part) for part in where)
        if self.wording is not None:
            self.message = self.wording(self.param)
        return self

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


class AnthropicError(Exception):
    """An error the client gets in Anthropic's shape."""

    def __init__(self, status: int, message: str, kind: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        fallback = "invalid_request_error" if status < 500 else "api_error"
        self.kind = kind or _ANTHROPIC_TYPES.get(status, fallback)
        self.headers = headers or {}

    @classmethod
    def of(cls, err: APIError) -> "AnthropicError":
        """An OpenAI-shaped error in Anthropic's vocabulary (a server that is
        stopping or loading, 503, is ``overloaded_error``, 529)."""
        status = 529 if err.status == 503 else err.status
        return cls(status, err.message, headers=err.headers)

    def body(self) -> dict:
        return {"type": "error", "error": {"type": self.kind, "message": self.message}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is one of Anthropic's routes (``/v1/messages`` and below)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def response_for(err: APIError, path: str) -> JSONResponse:
    """``err`` in the shape of the API that serves ``path``."""
    return AnthropicError.of(err).response() if is_anthropic_path(path) else err.response()


def clipped(value, limit: int = 64) -> str:
    """``repr(value)`` cut to ``limit`` characters: client data in a log line
    (an unknown item type) cannot make that line as long as the body."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_failure(exc: BaseException, prompt_field: str = "messages") -> APIError:
    """A generation that failed while it ran: the request's fault (a ``ValueError``,
    e.g. a grammar that reached one of llguidance's limits past the positions
    checked up front) as a 400 naming the field, anything else a 500."""
    if isinstance(exc, ValueError):
        return from_engine(exc, prompt_field)
    return APIError(500, f"generation failed: {exc}", type="server_error")


def from_engine(exc: ValueError, prompt_field: str = "messages") -> APIError:
    """The engine's ``ValueError`` as a 400 naming the request field: an
    ``InvalidArgument``'s parts (the SDK's argument, its item, the keys inside:
    ``tools``, 1, ``function.name``) become the field (``tools.1.function.name``),
    and its message is said with the request's names. ``prompt_field``: where
    the prompt came from (``messages``, ``prompt`` or ``input``)."""
    if not isinstance(exc, me.InvalidArgument):
        return bad_request(str(exc))
    names = {**_ENGINE_FIELDS, "prompt_tokens": prompt_field, "images_b64": prompt_field}
    if exc.field == "images_b64" and exc.index is not None:
        # The images sit in the messages: their list is not the request's.
        return engine_error(exc, names, items=False, said=f"image {exc.index + 1} of the request")
    return engine_error(exc, names)


def engine_error(
    exc: me.InvalidArgument, names: Mapping[str, str], *, items: bool = True, said: str | None = None
) -> APIError:
    """``exc`` as a 400 naming the request field: its argument as ``names`` says,
    then its item (unless ``items`` is false: a list the request does not have)
    and keys. The message names every argument as ``names`` says, and the one at
    fault as the field, or as ``said``."""
    index = (exc.index,) if items and exc.index is not None else ()
    where = (names.get(exc.field, exc.field), *index, *exc.keys)
    wording = partial(_engine_words, exc, names, said)
    return _named(where, wording)


def _engine_words(exc: me.InvalidArgument, names: Mapping[str, str], said: str | None, param: str) -> str:
    return exc.render(names, said if said is not None else param)


def tool_renamed(err: APIError, sources: Sequence[int], keys: Mapping[str, str] | None = None) -> APIError:
    """``err`` of an internal request, its tool ``k`` (``tools.k.function.name``)
    named as the wire request's tool ``sources[k]`` (``tools.3.name``), the key
    inside ``function`` as ``keys`` says (Anthropic's ``input_schema``)."""
    where = err.where or ()
    if len(where) < 3 or where[0] != "tools" or not isinstance(where[1], int) or where[2] != "function":
        return err
    k, inside = where[1], list(where[3:])
    if inside and keys:
        inside[0] = keys.get(str(inside[0]), inside[0])
    return err.renamed(("tools", sources[k] if k < len(sources) else k, *inside))


def from_validation(errors: list[dict]) -> APIError:
    """pydantic's first error as a 400 naming the field (``messages.0.role``)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if param is None:
        return bad_request(msg)
    parts = tuple(p for p in first.get("loc", ()) if p != "body")
    return _named(parts, partial(_field_words, msg))


def _named(where: Where, wording: Callable[[str], str]) -> APIError:
    """A 400 naming the field ``where``, its message ``wording`` of it."""
    param = ".".join(str(part) for part in where)
    return APIError(400, wording(param), param=param, where=where, wording=wording)


def _field_words(msg: str, param: str) -> str:
    return f"{param}: {msg}"
