"""Stop strings over streamed text: cut before the first match, never split one across chunks.

`StopMatcher.push(text)` returns the text that is safe to give out now. Text that could be the
start of a stop string is held back until the next piece shows whether it is one; a stop
string found ends the choice (`stopped`) and neither it nor anything after it is given out.
`flush()` releases the held text when the stream ends without a match.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[:min(hits)]
        keep = self._partial_match_len(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest tail of `buf` that begins some stop string."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
