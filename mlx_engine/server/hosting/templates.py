"""Chat templates the server gives a model: the operator's (``--chat-template
FILE``), or ChatML for a model whose files carry none (a base model's GGUF, as
llama.cpp's server does), with a warning in the log and in the model's listing.
"""

from __future__ import annotations

import mlx_engine as me

import logging
from pathlib import Path
from weakref import WeakKeyDictionary

logger = logging.getLogger(__name__)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] if message['content'] is string else '') "
    "+ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Kits given a template here, and what their listing says of it.
_NOTES: WeakKeyDictionary = WeakKeyDictionary()


def read_template(path: str | Path) -> str:
    """The text of a chat template file (``--chat-template``); ``ValueError``
    naming the file when it cannot be read or is empty."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template: {str(path)!r} cannot be read: {getattr(exc, 'strerror', None) or exc}")
    if not text.strip():
        raise ValueError(f"--chat-template: {str(path)!r} is empty")
    return text


def give_template(kit: me.ModelKit, model_id: str, template: str | None = None) -> str | None:
    """Give ``kit``'s tokenizer ``template`` (the operator's), or ChatML when it
    has none of its own; returns the note the model's listing shows (None when
    the model's own template is used)."""
    tok = kit.tokenizer
    if template is not None:
        tok.chat_template = template
        note = "the operator's --chat-template"
    elif getattr(tok, "chat_template", None):
        return None
    else:
        tok.chat_template = CHATML
        note = "ChatML (fallback: the model's files carry no chat template)"
        logger.warning("model %s has no chat template: chat requests use ChatML, as llama.cpp's server does", model_id)
    try:
        _NOTES[kit] = note
    except TypeError:  # a kit without weak references: the listing does not say it
        pass
    return note


def template_note(kit: me.ModelKit | None) -> str | None:
    """What ``give_template`` did to ``kit`` (None: the model's own template)."""
    try:
        return _NOTES.get(kit) if kit is not None else None
    except TypeError:
        return None
