"""A cheap burst of HTTP requests, as a process of its own (so the test's /health probe
does not share its interpreter):

    python burst_client.py PORT COUNT AT_ONCE BODY_JSON

sends COUNT POSTs of BODY_JSON to /v1/completions on 127.0.0.1:PORT, AT_ONCE connections
at a time (one request each, raw asyncio sockets: no client library per request), and
prints {"statuses": {status: count}, "no_retry_after": n429 without Retry-After,
"seconds": wall time} as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter


async def _one(port: int, request: bytes, gate: asyncio.Semaphore) -> tuple[int, bool]:
    async with gate:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
        finally:
            writer.close()
    status = int(head.split(b" ", 2)[1])
    return status, b"\r\nretry-after:" in head.lower()


async def main(port: int, count: int, at_once: int, body: bytes) -> dict[str, object]:
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        b"\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    gate = asyncio.Semaphore(at_once)
    t = time.monotonic()
    results = await asyncio.gather(*(_one(port, request, gate) for _ in range(count)))
    statuses = Counter(status for status, _ in results)
    missing = sum(1 for status, retry in results if status == 429 and not retry)
    return {"statuses": dict(statuses), "no_retry_after": missing,
            "seconds": time.monotonic() - t}  # fmt: skip


if __name__ == "__main__":
    port, count, at_once = (int(a) for a in sys.argv[1:4])
    print(json.dumps(asyncio.run(main(port, count, at_once, sys.argv[4].encode()))))
