"""Whether a process of this host is still alive: its pid, pinned by its start time.

A storage client gives up on tickets while the cache service may still work
on them; the slots of those tickets are free for certain once the service
process is gone. A pid alone is not enough to tell: a dead process stays a
zombie until its parent reaps it (it can no longer touch memory, so it counts
as dead here), and a reaped pid can be reused by another process (its start
time then differs, so it counts as dead too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name, or None when it is gone/unreadable."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces or ")".
    return raw[raw.rfind(")") + 2 :].split()


@dataclass(frozen=True)
class ProcessIdentity:
    """A pid and the start time of the process that had it (clock ticks since boot)."""

    pid: int
    start_ticks: int | None  # None where /proc is not available

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity:
        """The process with `pid` now (call while it is known to be alive)."""
        fields = _stat_fields(pid)
        return cls(pid, int(fields[19]) if fields and len(fields) > 19 else None)

    def alive(self) -> bool:
        """False once the process exited (zombies included) or its pid was reused."""
        if self.pid == os.getpid():
            return True
        if self.start_ticks is None:
            return pid_alive(self.pid)
        fields = _stat_fields(self.pid)
        if fields is None or len(fields) <= 19:
            return False
        return fields[0] not in ("Z", "X", "x") and int(fields[19]) == self.start_ticks


def live_processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every live process of this host (zombies
    count as dead, as in `ProcessIdentity.alive`); {} where /proc is not available."""
    found: dict[int, tuple[int, int]] = {}
    for entry in _PROC.glob("[0-9]*"):
        fields = _stat_fields(int(entry.name))
        if fields is not None and len(fields) > 2 and fields[0] not in ("Z", "X", "x"):
            found[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return found


def pid_alive(pid: int) -> bool:
    """Whether a process with `pid` exists: signal 0 reaches it (a zombie, or a process we
    may not signal, counts as alive). `ProcessIdentity` tells zombies and reuse apart."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
