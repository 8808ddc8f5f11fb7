"""Processes of this host as the tests see them: alive, children, titles (from /proc)."""

from __future__ import annotations

from pathlib import Path

from asynchicache.common.liveness import ProcessIdentity, live_processes


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs now; a zombie (exited, not yet reaped) counts as gone."""
    return ProcessIdentity.of(pid).alive()


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) pids whose parent is `pid`."""
    return [child for child, (parent, _) in live_processes().items() if parent == pid]


def proc_title(pid: int) -> str:
    """The command line (or the title a process set) of `pid`; "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
