"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
as a wire format of the core.

``system`` and ``messages`` (text, base64 images, ``tool_use``, ``tool_result``)
become chat messages, ``tools`` (``input_schema``) and ``tool_choice`` the chat
request's tools, ``stop_sequences`` its stop strings; the core renders, admits
and generates (core/turns.py); the answer comes back as a Messages object or
Anthropic's event stream, errors as ``{"type": "error", "error": {...}}`` with
Anthropic's status codes. Keys come as ``x-api-key`` or a bearer token.

Claude Code starts its system prompt with a line ``x-anthropic-billing-header:
...`` that changes between requests; kept, it would make every prompt differ
from its first token and the prompt cache would reuse nothing. It is dropped
unless the operator keeps it (``keep_billing_header``).

Its body translated in (translate.py), the answer built (answer.py) and the
endpoints (routes.py).
"""

from .routes import messages_router
from .translate import MessagesRequest, internal

__all__ = ["messages_router", "MessagesRequest", "internal"]
