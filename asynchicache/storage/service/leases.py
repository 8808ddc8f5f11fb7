"""Leases on the cache service: who keeps a service started for vLLM instances running.

A vLLM connector that uses a service leases it (`Lease`, renewed every second or so
as a heartbeat) and releases it when it stops (`Release`). A service started with
`--leased-by PID` (ServiceConfig.leased_by) runs while any lease is held, so it
outlives the instance that happened to start it, and stops once the last one is
gone, after its writes in flight finished (storage.service.server). A lease ends when:

* its client releases it;
* its holder process is gone (its pid, pinned by its start time: a SIGKILLed vLLM
  never releases), seen at the next sweep;
* it was not renewed within its `ttl_s` (a holder that hangs).

The starter holds the first lease from the service's start (it has not connected
yet) until it takes its own, for at most `first_lease_s` seconds.

A lease is granted only when the client's `ServiceSettings` equal the service's: an
instance that wants another disk folder, size, remote tier or admission than the
running service has would otherwise be served silently by settings it did not ask
for. The refusal names the fields (`LeaseReply.conflicts`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from asynchicache.common.liveness import ProcessIdentity
from asynchicache.storage.messages import Lease, LeaseReply, Release, ServiceSettings

log = logging.getLogger(__name__)

FIRST_LEASE_S = 120.0  # the starter's lease before it renews one itself
_STARTER = b""  # the starter's lease key (it has no socket identity yet)


@dataclass
class _Held:
    holder: ProcessIdentity
    expires: float  # time.monotonic()


class LeaseBook:
    """The leases one service holds, by client identity."""

    def __init__(self) -> None:
        self._held: dict[bytes, _Held] = {}
        self.granted = 0  # ever

    def __len__(self) -> int:
        return len(self._held)

    def start_with(self, starter: int, now: float, first_lease_s: float = FIRST_LEASE_S) -> None:
        """The process that started the service holds a lease until it takes its own."""
        self._held[_STARTER] = _Held(ProcessIdentity.of(starter), now + first_lease_s)

    def grant(self, client: bytes, holder: int, ttl_s: float, now: float) -> None:
        """Grant or renew `client`'s lease for process `holder` until `now + ttl_s`."""
        held = self._held.get(client)
        if held is None or held.holder.pid != holder:
            held = _Held(ProcessIdentity.of(holder), 0.0)
            self._held[client] = held
            self.granted += 1
        held.expires = now + ttl_s
        starter = self._held.get(_STARTER)
        if starter is not None and starter.holder.pid == holder:
            del self._held[_STARTER]

    def release(self, client: bytes) -> bool:
        return self._held.pop(client, None) is not None

    def sweep(self, now: float) -> list[int]:
        """End expired leases and those whose holder is gone; returns their holders' pids."""
        ended = [
            key for key, held in self._held.items() if now > held.expires or not held.holder.alive()
        ]
        return [self._held.pop(key).holder.pid for key in ended]


class LeaseDesk:
    """The service's answers to `Lease` and `Release`, and whether it should stop.

    `leased`: the service runs only while leases are held (started with --leased-by);
    otherwise leases are granted and counted, and the service runs until it is stopped.
    """

    def __init__(self, settings: ServiceSettings, leased_by: int | None, now: float) -> None:
        self.settings = settings
        self.leased = leased_by is not None
        self.book = LeaseBook()
        self.refused = 0
        if leased_by is not None:
            self.book.start_with(leased_by, now)

    def answer(self, client: bytes, msg: Lease | Release, now: float) -> LeaseReply:
        if isinstance(msg, Release):
            if self.book.release(client):
                log.info("cache service: a lease was released (%d held)", len(self.book))
            return self._reply(msg.req_id, False)
        conflicts = self.settings.differences(msg.settings) if msg.settings else ()
        if conflicts:
            self.refused += 1
            log.warning(
                "cache service: lease of pid %d refused, settings differ: %s",
                msg.holder,
                ", ".join(conflicts),
            )
            return self._reply(msg.req_id, False, conflicts)
        self.book.grant(client, msg.holder, msg.ttl_s, now)
        return self._reply(msg.req_id, True)

    def _reply(self, req_id: int, granted: bool, conflicts: tuple[str, ...] = ()) -> LeaseReply:
        return LeaseReply(req_id, granted, self.settings, conflicts, len(self.book), os.getpid())

    def unleased(self, now: float) -> bool:
        """End the leases that lapsed; True when a leased service holds none any more."""
        for pid in self.book.sweep(now):
            log.info("cache service: the lease of pid %d ended (%d held)", pid, len(self.book))
        return self.leased and len(self.book) == 0

    def stats(self) -> dict[str, float]:
        return {
            "leases": float(len(self.book)),
            "leases_granted": float(self.book.granted),
            "leases_refused": float(self.refused),
        }
