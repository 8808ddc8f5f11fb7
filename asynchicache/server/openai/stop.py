"""Stop strings, checked on the decoded text in the HTTP process.

The engine sees token ids only; a stop string may span several tokens and be
split across decode steps, so text that could still turn into a stop string is
held back until the next tokens settle it. Text is never emitted past a stop.

The stops of a request are compiled once (`StopMatcher`, an Aho-Corasick automaton:
built off the event loop with the request's plan, shared by all its samples); each
sample then walks it one character at a time (`StopChecker`), so a token costs its
own text, whatever the stop list (issue 39: 64 stops of 1,024 characters cost ~10 ms
per token when every held length was tried against every stop). The automaton's state
is the longest suffix of the text seen that is a prefix of some stop: exactly the text
to hold back. A stop ends the text where it completes first; of several completing at
the same character, the longest (the one starting earliest) wins.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT = 0


class StopMatcher:
    """The automaton of one stop list (immutable once built).

    State 0 is the empty match; `_goto[s]` maps a character to the next state,
    `_fail[s]` is the state of the longest proper suffix of `s` that is also a
    state, `_depth[s]` its length, `_found[s]` the index of the longest stop that
    ends at `s` (itself or through its fail chain), or -1.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._found = [-1]
        for i, stop in enumerate(self.stops):
            self._add(i, stop)
        self._fail = [ROOT] * len(self._goto)
        self._link()

    def __bool__(self) -> bool:
        return bool(self.stops)

    def _add(self, index: int, stop: str) -> None:
        state = ROOT
        for char in stop:
            nxt = self._goto[state].get(char)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[state][char] = nxt
                self._goto.append({})
                self._depth.append(self._depth[state] + 1)
                self._found.append(-1)
            state = nxt
        self._found[state] = index

    def _link(self) -> None:
        """Fail links and inherited matches, breadth first (a state's fail is shallower)."""
        queue = list(self._goto[ROOT].values())
        for state in queue:  # grows while it is read: a breadth-first walk
            for char, nxt in self._goto[state].items():
                fail = self._fail[state]
                while fail != ROOT and char not in self._goto[fail]:
                    fail = self._fail[fail]
                target = self._goto[fail].get(char, ROOT)
                self._fail[nxt] = target if target != nxt else ROOT
                if self._found[nxt] < 0:
                    self._found[nxt] = self._found[self._fail[nxt]]
                queue.append(nxt)

    def step(self, state: int, char: str) -> int:
        """The state after `char` (amortized O(1): a fail is followed at most as often as
        a character deepened the state)."""
        goto, fail = self._goto, self._fail
        while char not in goto[state] and state != ROOT:
            state = fail[state]
        return goto[state].get(char, ROOT)

    def depth(self, state: int) -> int:
        return self._depth[state]

    def found(self, state: int) -> str | None:
        """The longest stop that ends at this state, if any."""
        index = self._found[state]
        return None if index < 0 else self.stops[index]


class StopChecker:
    """Feed decoded text with `push`; emit what it returns; `flush` at the end.

    Invariant: the held-back text is the longest suffix of the text seen so far
    that is a proper prefix of some stop string (the automaton's state), so any
    stop string that starts in already-emitted text would have been caught.
    """

    def __init__(self, stops: StopMatcher | Sequence[str]) -> None:
        self._matcher = stops if isinstance(stops, StopMatcher) else StopMatcher(stops)
        self._state = ROOT
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Text safe to emit now. After a stop, returns the text before it and then ''."""
        if self.stopped:
            return ""
        if not self._matcher:
            return text
        pending = self._pending + text
        base = len(self._pending)
        matcher, state = self._matcher, self._state
        for i, char in enumerate(text):
            state = matcher.step(state, char)
            stop = matcher.found(state)
            if stop is not None:
                self.stopped, self.matched, self._pending = True, stop, ""
                return pending[: base + i + 1 - len(stop)]
        self._state = state
        keep = matcher.depth(state)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """At the end of generation: the held-back text was not a stop after all."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        self._state = ROOT
        return out
