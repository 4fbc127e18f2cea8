"""Stop strings over streamed text: text that might begin a stop string is held
back until it is known not to, so a stop string never reaches the caller."""

from __future__ import annotations

from typing import NamedTuple

from ..errors import InvalidArgument


class StopScan(NamedTuple):
    emit: str  # text safe to hand out now
    stop_string: str | None  # the stop string found, if any


class StopStringMatcher:
    def __init__(self, stop_strings: list[str]):
        self.stop_strings = list(stop_strings)
        self._pending = ""

    @staticmethod
    def validate(stop_strings) -> list[str]:
        if stop_strings is None:
            return []
        if isinstance(stop_strings, str) or not all(isinstance(s, str) for s in stop_strings):
            raise InvalidArgument("{param} must be a list of strings", "stop_strings")
        if any(s == "" for s in stop_strings):
            raise InvalidArgument("{param} must not contain empty strings", "stop_strings")
        return list(stop_strings)

    def feed(self, text: str) -> StopScan:
        """Add newly decoded text; return what can be emitted and any stop found."""
        self._pending += text
        if not self.stop_strings:
            out, self._pending = self._pending, ""
            return StopScan(out, None)
        hits = [(self._pending.find(s), s) for s in self.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            idx, s = min(hits, key=lambda h: (h[0], -len(h[1])))
            out = self._pending[:idx]
            self._pending = ""
            return StopScan(out, s)
        hold = self._held_suffix_length()
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return StopScan(out, None)

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _held_suffix_length(self) -> int:
        """Longest suffix of the pending text that is a proper prefix of a stop string."""
        best = 0
        p = self._pending
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(p)), best, -1):
                if p.endswith(s[:n]):
                    best = n
                    break
        return best


class TextEvent(NamedTuple):
    text: str  # safe to emit now
    stop_string: str | None
    stop_tokens: list[int]  # tokens whose text completed the stop string


class TextStream:
    """Turns generated token ids into displayable text: whole UTF-8 characters
    (the tokenizer's streaming detokenizer) with stop strings held back and cut."""

    def __init__(self, detokenizer, stop_strings: list[str]):
        self.detok = detokenizer
        self.detok.reset()
        self.matcher = StopStringMatcher(stop_strings)
        self._emitted = 0  # characters handed out so far
        self._token_ends: list[tuple[int, int]] = []  # (token id, text length after it)

    def push(self, token: int, final: bool = False) -> TextEvent:
        """Add a generated token; ``final`` flushes everything held back."""
        self.detok.add_token(token)
        if final:
            self.detok.finalize()
        scan = self.matcher.feed(self.detok.last_segment)
        self._token_ends.append((token, self._emitted + len(scan.emit) + len(self.matcher._pending)))
        if scan.stop_string is not None:
            start = self._emitted + len(scan.emit)
            stop_tokens = [t for t, end in self._token_ends if end > start] or [token]
            return TextEvent(scan.emit, scan.stop_string, stop_tokens)
        text = scan.emit + (self.matcher.flush() if final else "")
        self._emitted += len(text)
        return TextEvent(text, None, [])

    def finish(self) -> TextEvent:
        """Flush at the end of generation (EOS, cancellation)."""
        self.detok.finalize()
        scan = self.matcher.feed(self.detok.last_segment)
        if scan.stop_string is not None:
            return TextEvent(scan.emit, scan.stop_string, [])
        return TextEvent(scan.emit + self.matcher.flush(), None, [])
