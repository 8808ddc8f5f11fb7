"""Server-sent events framing, as OpenAI streams it.

Each event is one `data: <json>` line followed by a blank line; the stream ends
with `data: [DONE]`. JSON never contains a raw newline (json escapes it), so a
payload always fits on one `data:` line.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# Proxies (nginx) buffer responses unless told otherwise; a buffered stream
# defeats the point of streaming.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: BaseModel | dict[str, Any]) -> bytes:
    """One SSE event carrying `payload` as compact JSON."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    if "\n" in body or "\r" in body:
        raise ValueError("an SSE data line must not contain a raw newline")
    return f"data: {body}\n\n".encode()


def parse(stream: bytes) -> list[str]:
    """The `data:` payloads of a complete SSE byte stream (for tests and clients)."""
    payloads = []
    for block in stream.decode().split("\n\n"):
        lines = [ln[5:].lstrip() for ln in block.split("\n") if ln.startswith("data:")]
        if lines:
            payloads.append("\n".join(lines))
    return payloads
