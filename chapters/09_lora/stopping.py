"""Stop strings on a text stream: find them across delta boundaries, never emit what follows.

A stop string rarely arrives in one piece: "###" may come as "#" + "##", or inside a delta
that also holds text before it. So the matcher keeps a small buffer: the tail of the text that
could still turn out to be the start of a stop string is held back, everything before it is safe
to emit at once. With stops ["\\nUser:"], the stream "Hi!\\nUs" + "er: ..." emits "Hi!" first,
holds "\\nUs", then finds the stop and ends.

Which stop wins: the one that starts first in the text, so the result is the same however the
text is cut into deltas: it is always the text truncated before its first stop string. Among
stops that start at the same place the shortest wins (it is complete first; with
include_stop=True it decides what is appended). Because of that rule a stop that is found
may still have to wait: with stops ["abcd", "bc"], seeing "abc" is not enough, since "abcd"
would start earlier if a "d" follows. If the stream ends there, `flush` makes the cut at "bc"
(and sets `stopped`), so even that case gives the truncated text.
"""

from __future__ import annotations

# The longest stop string a request may set. The held-back tail is up to one character shorter
# than the longest stop, and each feed tests its suffixes against every stop: the work per token
# grows with the square of this length (a 1M-character stop stalled every stream for seconds).
MAX_STOP_CHARS = 256


class StopStringMatcher:
    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = sorted({s for s in stops if s}, key=len)  # "" would match everywhere: ignored
        self.include_stop = include_stop
        self.stopped = False
        self._held = ""  # text received but not emitted: the possible start of a stop string

    @property
    def held(self) -> str:
        """The text received but not emitted yet: a tail that could still be the start of a stop
        string. `flush` releases it at the end of the stream."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string has been found)."""
        if self.stopped:
            return "", True
        text = self._held + delta
        found, stop = self._first_complete(text)
        partial = self._first_partial(text)
        if found is not None and (partial is None or found <= partial):
            # No stop can start before this one any more: cut here.
            self.stopped = True
            self._held = ""
            return text[: found + len(stop)] if self.include_stop else text[:found], True
        safe = min(p for p in (found, partial, len(text)) if p is not None)
        self._held = text[safe:]
        return text[:safe], False

    def flush(self) -> str:
        """At the end of the stream (no stop found): release the held-back text.

        The held text can still contain a complete stop: one that was waiting for a longer stop
        starting earlier, which the end of the stream has now ruled out (stops ["abcd", "bc"],
        text "abc"). Then it is cut there as usual and `stopped` turns True."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        found, stop = self._first_complete(held)
        if found is None:
            return held
        self.stopped = True
        return held[: found + len(stop)] if self.include_stop else held[:found]

    def _first_complete(self, text: str) -> tuple[int | None, str]:
        """Where the first stop string starts in `text` (the shortest at that place), or None."""
        best, best_stop = None, ""
        for stop in self.stops:  # shortest first, so a tie keeps the shortest
            at = text.find(stop)
            if at != -1 and (best is None or at < best):
                best, best_stop = at, stop
        return best, best_stop

    def _first_partial(self, text: str) -> int | None:
        """The earliest i where text[i:] is a proper prefix of some stop string: the text from i
        on could still become a stop, so it must be held back. Only the last len(stop) - 1
        characters can be such a tail, so the cost does not grow with the text."""
        longest = self.stops[-1] if self.stops else ""
        for i in range(max(0, len(text) - len(longest) + 1), len(text)):
            tail = text[i:]
            if any(len(stop) > len(tail) and stop.startswith(tail) for stop in self.stops):
                return i
        return None
