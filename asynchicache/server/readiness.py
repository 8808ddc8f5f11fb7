"""`/ready`: whether this server can serve now, as a load balancer asks it.

`/health` is liveness (the HTTP process answers and the engine is alive);
`/ready` answers 200 only when the engine answers a health call and, when the
disk tier is on, the cache service answers a ping (storage.client.probe, from this
process): a server whose cache service is restarting or hung serves by
recompute, slowly, and a balancer should prefer another. 503 with the reason
otherwise: the engine restarting after a crash or a hang (the launcher's watchdog,
`--engine-step-timeout`), how long nothing was heard from an engine that does not
answer, the cache service silent. Public, like `/health`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from asynchicache.server.context import AppContext
from asynchicache.server.engine_client import EngineUnavailable

ENGINE_TIMEOUT_S = 2.0
SERVICE_TIMEOUT_S = 2.0
_PING_EVERY_S = 0.05


async def service_answers(ctx: AppContext, timeout_s: float = SERVICE_TIMEOUT_S) -> bool:
    """Whether the cache service answers a ping sent now (within `timeout_s`)."""
    probe = ctx.service_probe
    if probe is None:
        return True
    start = time.monotonic()
    asked_after = probe.last_ping  # an answer to an older ping may have waited in the queue
    while True:
        probe.silent_s()  # takes answers, sends the next ping
        if probe.last_answered > asked_after:
            return True  # the service answered a ping sent for this question
        if time.monotonic() - start > timeout_s:
            return False
        await asyncio.sleep(_PING_EVERY_S)


async def readiness(ctx: AppContext) -> tuple[bool, dict[str, Any]]:
    """(ready, the body of /ready)."""
    checks: dict[str, str] = {}
    try:
        reply = await ctx.client.admin("health", timeout_s=ENGINE_TIMEOUT_S)
        checks["engine"] = "ok" if reply.ok else f"unhealthy: {reply.error}"
    except EngineUnavailable as exc:
        checks["engine"] = f"unavailable: {exc}"
        silent = time.monotonic() - ctx.client.last_heard
        if ctx.client.down is None and silent > ENGINE_TIMEOUT_S:
            checks["engine"] += f" (nothing heard from it for {silent:.0f}s: a long step, or hung)"
    if ctx.service_probe is not None:
        up = await service_answers(ctx)
        checks["cache_service"] = "ok" if up else (
            f"no answer to a ping in {SERVICE_TIMEOUT_S:.0f}s")  # fmt: skip
    ready = all(v == "ok" for v in checks.values())
    body: dict[str, Any] = {"status": "ready" if ready else "unavailable", "checks": checks}
    if not ready:
        body["reason"] = "; ".join(f"{k}: {v}" for k, v in checks.items() if v != "ok")
    return ready, body
