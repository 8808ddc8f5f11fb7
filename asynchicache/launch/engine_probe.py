"""The engine watchdog's ping: a "health" call through the HTTP process's engine client.

The engine answers admin calls between two steps (engine/process.py drains its
socket before each), so a reply says its loop came round: a step that runs past
`--engine-step-timeout`, a deadlock or a SIGSTOP leaves the ping unanswered. The
supervisor (launch/supervisor.py) asks `silent_s()` every half second, as it asks
the cache service's probe, and kills a child silent past its limit; the launcher
then ends that engine's requests and restarts it.

A ping is in flight at a time, so a hung engine collects one call, not one per
question; pings go out even while the client is down (an engine restarting), as
`wait_healthy`'s do.
"""

from __future__ import annotations

import asyncio
import time

from asynchicache.server.engine_client import EngineClient, EngineUnavailable

PING_TIMEOUT_S = 5.0  # a ping unanswered this long is sent again (the old reply is dropped)


class EngineProbe:
    """`supervisor.Probe` of the engine; made (and used) inside the launcher's event loop."""

    def __init__(self, client: EngineClient, timeout_s: float = PING_TIMEOUT_S) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._since = time.monotonic()  # the last answer (or the start)
        self._ping: asyncio.Task[None] | None = None
        self.answered = False

    def silent_s(self) -> float:
        """Seconds since the engine last answered; sends the next ping when none is out."""
        if self._ping is None or self._ping.done():
            self._ping = asyncio.get_running_loop().create_task(self._ask())
        return time.monotonic() - self._since

    async def _ask(self) -> None:
        try:
            reply = await self._client.ping(self._timeout_s)
        except EngineUnavailable:
            return
        if reply.ok:
            self._since = time.monotonic()
            self.answered = True

    def close(self) -> None:
        if self._ping is not None:
            self._ping.cancel()
            self._ping = None
