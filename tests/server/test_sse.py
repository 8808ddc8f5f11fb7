"""SSE framing: one compact JSON per `data:` line, blank-line separated, [DONE] last."""

from __future__ import annotations

import json

import pytest

from asynchicache.server.openai import sse
from asynchicache.server.openai.schemas import CompletionChoice, CompletionResponse


def test_event_framing_round_trips() -> None:
    payloads = [{"text": "line one\nline two"}, {"text": "ünïcode ✓"}, {"usage": None}]
    stream = b"".join(sse.event(p) for p in payloads) + sse.DONE
    assert stream.count(b"\n\n") == len(payloads) + 1
    decoded = sse.parse(stream)
    assert decoded[-1] == "[DONE]"
    assert [json.loads(d) for d in decoded[:-1]] == payloads


def test_pydantic_models_are_serialised_with_null_usage() -> None:
    chunk = CompletionResponse(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(text="hi")]
    )
    line = sse.event(chunk)
    assert line.startswith(b"data: {") and line.endswith(b"}\n\n")
    body = json.loads(line[6:])
    assert body["usage"] is None and body["choices"][0]["text"] == "hi"


def test_raw_newlines_are_refused() -> None:
    class Weird(CompletionResponse):
        def model_dump_json(self, **_: object) -> str:  # type: ignore[override]
            return '{"a":\n1}'

    with pytest.raises(ValueError):
        sse.event(Weird(id="x", created=1, model="m", choices=[]))
