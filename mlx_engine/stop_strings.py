"""Stop strings over streamed text: text that might begin a stop string is held
back until it is known not to, so a stop string never reaches the caller."""

from __future__ import annotations

from typing import NamedTuple


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
            raise ValueError("stop_strings must be a list of strings")
        if any(s == "" for s in stop_strings):
            raise ValueError("stop_strings must not contain empty strings")
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
