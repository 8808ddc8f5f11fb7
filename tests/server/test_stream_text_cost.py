"""Issue 39, findings 1 and 2: the text of a stream costs O(new text) per token.

* Stop strings: the longest stop list the edge takes, written so that every token leaves a
  long partial match, cost ~12 ms per token on 9f7c8b6 (`_held_suffix` sliced every prefix
  of every stop), on the HTTP event loop. Measured against the same checker with one short
  stop, on the same machine at the same moment: the ratio is ~1,000 on 9f7c8b6 and ~1 with
  an automaton (a generous 25 here).
* The incremental detokenizer held back text ending in U+FFFD by decoding ever longer
  windows: a stream of lone continuation bytes (which `logit_bias` can force) decoded
  N^2 / 2 ids for N tokens. Counted, not timed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from asynchicache.launch.frontend import Frontend
from asynchicache.model.tokenizer import IncrementalDecoder, Tokenizer
from asynchicache.server.openai.schemas import MAX_STOP_CHARS, MAX_STOP_TOTAL_CHARS
from asynchicache.server.openai.stop import StopChecker, StopMatcher


def _seconds_per_push(stops: Sequence[str], pieces: Sequence[str]) -> float:
    best = float("inf")
    for _ in range(3):  # the quickest of three: a busy machine only adds time
        checker = StopChecker(StopMatcher(stops))
        t = time.perf_counter()
        for piece in pieces:
            checker.push(piece)
        best = min(best, time.perf_counter() - t)
    assert not checker.stopped
    return best / len(pieces)


def test_stop_matching_costs_the_new_text_not_the_stop_list() -> None:
    # The last stop is "abab...z": the text "abab..." keeps ~1,000 characters held as its
    # partial match, and the others ("cabab...z", "dabab...z", ...) have a partial match
    # of no length of that, which 9f7c8b6 found by trying each length in turn.
    count = MAX_STOP_TOTAL_CHARS // MAX_STOP_CHARS
    body = ("ab" * MAX_STOP_CHARS)[: MAX_STOP_CHARS - 1] + "z"
    stops = [chr(ord("c") + i) + body[:-1] for i in range(count - 1)] + [body]
    pieces = ["abab"] * 600
    adversarial = _seconds_per_push(stops, pieces)
    baseline = _seconds_per_push(["zz"], pieces)
    assert adversarial < 25 * baseline + 20e-6, (adversarial, baseline)


def _reference(stops: list[str], text: str) -> tuple[str, bool]:
    """The text up to the first stop to complete (the longest of those ending there)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[: end - max(map(len, ending))], True
    return text, False


@given(
    text=st.text(alphabet="abc", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_several_stops_under_any_split(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    checker = StopChecker(StopMatcher(stops))
    out = "".join(checker.push(text[a:b]) for a, b in itertools.pairwise(bounds))
    assert (out + checker.flush(), checker.stopped) == _reference(stops, text)
    if checker.stopped:
        assert checker.matched in stops


class _Counting:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.decoded = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def _byte_token(tok: Tokenizer, byte: int) -> int:
    """The id of the byte-level token that stands for `byte` alone."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + extra.index(byte))
    tid = tok.token_id(char)
    assert tid is not None
    return tid


def test_lone_bytes_are_decoded_in_linear_time(frontend: Frontend) -> None:
    counting = _Counting(frontend.tokenizer)
    decoder = IncrementalDecoder(counting, skip_special_tokens=True)  # type: ignore[arg-type]
    lone = _byte_token(frontend.tokenizer, 0x80)
    n = 3000
    text = "".join(decoder.push([lone]) for _ in range(n)) + decoder.flush()
    assert text == "\ufffd" * n
    assert counting.decoded < 16 * n, counting.decoded  # 9f7c8b6: ~n^2 / 2 = 4.5 million


def test_a_character_after_lone_bytes_still_arrives_whole(frontend: Frontend) -> None:
    tok = frontend.tokenizer
    emoji = [_byte_token(tok, b) for b in "😀".encode()]
    lone = _byte_token(tok, 0x80)
    decoder = tok.incremental_decoder()
    ids = [lone] * 5 + emoji + [lone] * 2 + emoji
    text = "".join(decoder.push([i]) for i in ids) + decoder.flush()
    assert text == "\ufffd" * 5 + "😀" + "\ufffd" * 2 + "😀"
