"""Processes of this host as the tests see them: alive, children, titles (from /proc)."""

from __future__ import annotations

from pathlib import Path

from asynchicache.common.liveness import ProcessIdentity


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs now; a zombie (exited, not yet reaped) counts as gone."""
    return ProcessIdentity.of(pid).alive()


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) pids whose parent is `pid`."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def proc_title(pid: int) -> str:
    """The command line (or the title a process set) of `pid`; "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
