"""The context-overflow policy: what the server does with a prompt over the
model's context.

``error`` (the default) refuses it with each API's own error before any work.
``truncate-middle`` cuts the middle of the conversation instead: the system
and developer messages and the latest turn (the last user message and every
message after it, tool calls and results included) are kept whole; the oldest
turns between them are dropped, whole turns first (so a tool call never loses
its result); and when that is not enough, the middle of the longest remaining
message's text is cut. The prompt is cut to leave room for the answer: the
``max_tokens`` asked, at most a quarter of the context.

One implementation for the three wire formats: core.prepare calls ``fit``.
"""

from __future__ import annotations

import mlx_engine as me

import logging
from dataclasses import dataclass
from typing import Callable

from .params import Prompt
from .schemas import ChatCompletionRequest, Message, TextPart

logger = logging.getLogger(__name__)

POLICIES = ("error", "truncate-middle")
# Rounds of cutting the longest message: each re-measures what is still over.
MAX_CUTS = 6
CUT_MARK = "\n[... {} characters cut to fit the context ...]\n"
SYSTEM_ROLES = ("system", "developer")

Render = Callable[[ChatCompletionRequest], Prompt]


@dataclass
class Fitted:
    """A request cut to fit: its body, rendered prompt and the prompt tokens dropped."""

    body: ChatCompletionRequest
    prompt: Prompt
    dropped: int


def check_policy(policy: str) -> str:
    """``policy`` when it is one of ``POLICIES``; a ValueError naming them otherwise."""
    if policy not in POLICIES:
        raise ValueError(f"context_overflow must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def target(context: int, asked: int | None) -> int:
    """The prompt length to cut to: the context less room for the answer
    (``asked`` tokens, at most a quarter of the context, at least one)."""
    room = context // 4 if asked is None else min(asked, context // 4)
    return context - max(1, room)


def turns(messages: list[Message]) -> tuple[list[list[int]], list[int]]:
    """The droppable turns (index lists, oldest first, each from a user message
    to the next) and the kept tail (the last user message onwards), system and
    developer messages left out of both (they are always kept)."""
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages))
    groups: list[list[int]] = []
    for i, m in enumerate(messages[:last_user]):
        if m.role in SYSTEM_ROLES:
            continue
        if m.role == "user" or not groups:
            groups.append([])
        groups[-1].append(i)
    tail = [i for i in range(last_user, len(messages)) if messages[i].role not in SYSTEM_ROLES]
    return groups, tail


def without(body: ChatCompletionRequest, drop: set[int]) -> ChatCompletionRequest:
    return body.model_copy(update={"messages": [m for i, m in enumerate(body.messages) if i not in drop]})


def drop_turns(body: ChatCompletionRequest, limit: int, render: Render) -> tuple[ChatCompletionRequest, Prompt]:
    """``body`` with the fewest oldest turns dropped that brings its prompt to
    ``limit`` tokens (all of them when none does), found by bisection."""
    groups, _ = turns(body.messages)
    lo, hi = 1, len(groups)
    best: tuple[ChatCompletionRequest, Prompt] | None = None
    while lo <= hi:
        k = (lo + hi) // 2
        cut = without(body, {i for g in groups[:k] for i in g})
        prompt = render(cut)
        if len(prompt.tokens) <= limit:
            best, hi = (cut, prompt), k - 1
        else:
            lo = k + 1
    if best is not None:
        return best
    cut = without(body, {i for g in groups for i in g})
    return cut, render(cut)


def _texts(m: Message) -> list[str]:
    if isinstance(m.content, str):
        return [m.content]
    return [p.text for p in m.content or [] if isinstance(p, TextPart)]


def cut_middle(text: str, chars: int) -> str:
    """``text`` without ``chars`` characters from its middle, a marker in their place."""
    chars = min(len(text), chars)
    head = (len(text) - chars) // 2
    return text[:head] + CUT_MARK.format(chars) + text[head + chars :]


def shorten_longest(body: ChatCompletionRequest, kit: me.ModelKit, excess: int) -> ChatCompletionRequest | None:
    """``body`` with about ``excess`` tokens cut from the middle of its longest
    message text; None when no text is long enough to cut."""
    best = max(
        ((len(t), i, j) for i, m in enumerate(body.messages) for j, t in enumerate(_texts(m))),
        default=None,
    )
    if best is None or best[0] <= len(CUT_MARK) * 2:
        return None
    _, i, j = best
    m = body.messages[i]
    text = _texts(m)[j]
    per_token = len(text) / max(1, len(me.tokenize(kit, text, add_special_tokens=False)))
    # A little over the estimate (and the marker's own length), so a round rarely
    # falls short; the caller measures again and cuts more when it does.
    chars = int(excess * per_token * 1.02) + len(CUT_MARK) + 16
    return _replace_text(body, i, j, cut_middle(text, chars))


def fit(kit: me.ModelKit, body: ChatCompletionRequest, prompt: Prompt, render: Render) -> Fitted | None:
    """``body`` cut in the middle to fit the context (see the module's
    docstring); None when it cannot be made to fit (the tools alone, say)."""
    context = kit.context_length
    limit = target(context, body.max_completion_tokens or body.max_tokens)
    cut, short = drop_turns(body, limit, render)
    for _ in range(MAX_CUTS):
        if len(short.tokens) <= limit:
            break
        shorter = shorten_longest(cut, kit, len(short.tokens) - limit)
        if shorter is None:
            return None
        cut, short = shorter, render(shorter)
    if len(short.tokens) > limit:
        return None
    dropped = len(prompt.tokens) - len(short.tokens)
    logger.info(
        "context overflow: the prompt of %d tokens was cut in the middle to %d (%d tokens dropped, context %d)",
        len(prompt.tokens),
        len(short.tokens),
        dropped,
        context,
    )
    return Fitted(cut, short, dropped)


def pretrim(body: ChatCompletionRequest, max_chars: int) -> tuple[ChatCompletionRequest, int]:
    """``body`` cut, before any render, until the text every template renders
    whole is at most ``max_chars`` characters (a prompt beyond that bound cannot
    fit the context, so tokenizing it whole would be wasted work): the oldest
    droppable turns first, then the middle of the longest texts. Returns the
    body and the characters cut."""
    from .params import COUNTED_ROLES, counted_chars  # params imports this module's Prompt

    total = counted_chars(body)
    start = total
    groups, _ = turns(body.messages)
    dropped: set[int] = set()
    for group in groups:
        if total <= max_chars:
            break
        dropped |= set(group)
        total = counted_chars(without(body, dropped))
    body = without(body, dropped) if dropped else body
    for _ in range(len(body.messages) * 4):
        if total <= max_chars:
            break
        texts = [
            (len(t), i, j)
            for i, m in enumerate(body.messages)
            if m.role in COUNTED_ROLES
            for j, t in enumerate(_texts(m))
        ]
        length, i, j = max(texts, default=(0, 0, 0))
        if length <= len(CUT_MARK) * 2:
            break
        body = _replace_text(
            body, i, j, cut_middle(_texts(body.messages[i])[j], min(length, total - max_chars + len(CUT_MARK) + 16))
        )
        total = counted_chars(body)
    return body, start - total


def _replace_text(body: ChatCompletionRequest, i: int, j: int, text: str) -> ChatCompletionRequest:
    """``body`` with text ``j`` of message ``i`` replaced by ``text``."""
    m = body.messages[i]
    if isinstance(m.content, str):
        content = text
    else:
        parts = [p for p in m.content if isinstance(p, TextPart)]
        content = [p.model_copy(update={"text": text}) if p is parts[j] else p for p in m.content]
    messages = [*body.messages[:i], m.model_copy(update={"content": content}), *body.messages[i + 1 :]]
    return body.model_copy(update={"messages": messages})
