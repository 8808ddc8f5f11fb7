"""Stop strings on streamed text: trimmed at the stop, partial matches held back."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from asynchicache.server.openai.stop import StopChecker


def _feed(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    checker = StopChecker(stops)
    out = "".join(checker.push(p) for p in pieces)
    return out + checker.flush(), checker.stopped


def test_stop_inside_one_piece() -> None:
    assert _feed(["END"], ["abcENDxyz"]) == ("abc", True)


def test_stop_split_across_pieces_is_never_emitted() -> None:
    checker = StopChecker(["\n\nUser:"])
    emitted = [checker.push(p) for p in ["Hi", "\n", "\nUs", "er", ":", " more"]]
    assert emitted == ["Hi", "", "", "", "", ""]
    assert checker.stopped and checker.matched == "\n\nUser:"


def test_partial_match_that_does_not_complete_is_released() -> None:
    checker = StopChecker(["STOP"])
    assert checker.push("abST") == "ab"
    assert checker.push("Ox") == "STOx"
    assert checker.push("ST") == ""
    assert checker.flush() == "ST"
    assert not checker.stopped


def test_earliest_of_several_stops_wins() -> None:
    assert _feed(["bb", "a"], ["xxbbya"]) == ("xx", True)


def test_no_stops_passes_everything_through() -> None:
    checker = StopChecker([])
    assert checker.push("abc") == "abc" and checker.flush() == ""


@given(
    text=st.text(alphabet="abc", max_size=40),
    stop=st.text(alphabet="abc", min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_any_split_gives_the_same_answer_as_whole_text(
    text: str, stop: str, cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    idx = text.find(stop)
    expected = (text, False) if idx < 0 else (text[:idx], True)
    assert _feed([stop], pieces) == expected
