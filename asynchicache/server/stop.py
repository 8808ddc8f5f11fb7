"""Stop strings, checked on the decoded text in the HTTP process.

The engine sees token ids only; a stop string may span several tokens and be
split across decode steps, so text that could still turn into a stop string is
held back until the next tokens settle it. Text is never emitted past a stop.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Feed decoded text with `push`; emit what it returns; `flush` at the end.

    Invariant: the held-back text is the longest suffix of the text seen so far
    that is a proper prefix of some stop string, so any stop string that starts
    in already-emitted text would have been caught.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Text safe to emit now. After a stop, returns the text before it and then ''."""
        if self.stopped:
            return ""
        pending = self._pending + text
        hit = self._earliest_stop(pending)
        if hit is not None:
            idx, stop = hit
            self.stopped, self.matched, self._pending = True, stop, ""
            return pending[:idx]
        keep = self._held_suffix(pending)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """At the end of generation: the held-back text was not a stop after all."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _earliest_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            idx = text.find(stop)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
