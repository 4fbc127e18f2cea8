"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``
with the HTTP status that goes with them."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

# The engine's argument names, as the OpenAI field a client sent them in.
_ENGINE_FIELDS = {
    "temp": "temperature",
    "stop_strings": "stop",
    "prompt_tokens": "messages",
    "images_b64": "messages",
    "json_schema": "response_format",
    "top_logprobs": "top_logprobs",
    "speculative_decoding_toggle": "mlx_engine.decoding",
    "num_draft_tokens": "mlx_engine.num_draft_tokens",
    "prompt_lookup_num_tokens": "mlx_engine.prompt_lookup_num_tokens",
    "prompt_lookup_min_ngram": "mlx_engine.prompt_lookup_min_ngram",
    "prompt_lookup_max_ngram": "mlx_engine.prompt_lookup_max_ngram",
    "repetition_penalty": "mlx_engine.repetition_penalty",
    "repetition_context_size": "mlx_engine.repetition_context_size",
    "regex": "mlx_engine.regex",
    "grammar": "mlx_engine.grammar",
    "messages": "messages",
}


class APIError(Exception):
    """An error the client gets as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_engine(exc: ValueError) -> APIError:
    """The engine's ``ValueError`` (it names the argument first) as a 400 naming
    the request field."""
    message = str(exc)
    match = re.match(r"([A-Za-z_]+)((?:\[\d+\]|\.[A-Za-z_]+)*)", message)
    if not match:
        return bad_request(message)
    name, path = match.groups()
    if name in _ENGINE_FIELDS:
        return bad_request(message, _ENGINE_FIELDS[name])
    # An item's path as pydantic writes it: ``tools[1].function.name`` -> ``tools.1.function.name``.
    return bad_request(message, name + re.sub(r"\[(\d+)\]", r".\1", path))


def from_validation(errors: list[dict]) -> APIError:
    """pydantic's first error as a 400 naming the field (``messages.0.role``)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{first.get('msg', 'invalid value')}", param)
