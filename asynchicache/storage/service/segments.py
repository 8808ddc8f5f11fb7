"""`MappedSegments`: the clients' L2 segments the service maps, shared by name.

Two clients of one pool (vLLM's ranks, a restarted client) register the same
segment: it is mapped once and closed when its last user goes. A segment whose
owner died is unlinked once nobody maps it (a SIGKILLed vLLM engine core never
removes its own).
"""

from __future__ import annotations

from asynchicache.common.liveness import ProcessIdentity
from asynchicache.common.shm import SHM_DIR, SharedSegment, owner_pid


class MappedSegments:
    def __init__(self) -> None:
        self._mapped: dict[str, tuple[SharedSegment, int]] = {}

    def attach(self, name: str) -> SharedSegment:
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad segment name {name!r}")
        segment, users = self._mapped.get(name) or (SharedSegment.attach(name), 0)
        self._mapped[name] = (segment, users + 1)
        return segment

    def detach(self, name: str) -> None:
        """One user less; the last one closes it (running workers keep their views; the
        mapping goes with them) and unlinks it when its owner is gone."""
        segment, users = self._mapped[name]
        if users > 1:
            self._mapped[name] = (segment, users - 1)
            return
        del self._mapped[name]
        segment.close()
        pid = owner_pid(name)
        if pid is not None and not ProcessIdentity.of(pid).alive():  # a zombie is gone
            (SHM_DIR / name).unlink(missing_ok=True)
