"""OpenAI's Responses API (``POST /v1/responses``) as a wire format of the core.

A request's ``instructions``, stored history (``previous_response_id``) and
``input`` items become chat messages, its function tools and ``text.format``
the chat request's ``tools`` and ``response_format``; the core renders,
admits and generates (core/turns.py), and the results come back as Responses
output items: whole, or as the Responses event stream. Tool types other than
``function`` (``web_search``, ``namespace``, ...) are skipped with a log line:
this server runs no hosted tools.

Its body (body.py), translated in (translate.py), the answer built (answer.py),
stored responses (store.py) and the endpoints (routes.py).
"""

from .routes import responses_router
from .store import ResponseStore
from .translate import chat_tools, input_messages

__all__ = ["responses_router", "ResponseStore", "chat_tools", "input_messages"]
