"""Stored responses, for ``previous_response_id``: bounded by count and by bytes, the
oldest dropped first."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)


DEFAULT_STORE_SIZE = 256  # stored responses kept for previous_response_id; the oldest is dropped first
DEFAULT_STORE_BYTES = 64 * 1024 * 1024  # and at most this much of them (their JSON), the oldest dropped first


@dataclass
class Stored:
    response: dict
    conversation: list[dict]  # chat messages: the input history and this response's output
    size: int = 0  # bytes of both as JSON: what the store counts against its byte bound


class ResponseStore:
    """Stored responses by id, at most ``capacity`` of them and ``max_bytes``
    of their JSON (response and conversation), the oldest dropped first. A
    conversation continued from a stored one shares its messages, so the bytes
    counted are an upper bound of what is held."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE, max_bytes: int = DEFAULT_STORE_BYTES):
        self.capacity, self.max_bytes = capacity, max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, response: dict, conversation: list[dict]) -> bool:
        """Keep a response; False (logged) when it alone is over ``max_bytes``."""
        size = len(json.dumps(response, default=str)) + len(json.dumps(conversation, default=str))
        if size > self.max_bytes:
            logger.warning(
                "response %s (%d bytes) is larger than the store's %d bytes; not stored", rid, size, self.max_bytes
            )
            return False
        self.delete(rid)
        self._items[rid] = Stored(response, conversation, size)
        self.bytes += size
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self.bytes -= dropped.size
        return True

    def get(self, rid: str) -> Stored | None:
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        stored = self._items.pop(rid, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None
