"""The processes of a running server and what they hold, sampled from /proc (Linux).

A server is found from its HTTP port (the process listening on it is the
launcher, `asynchicache: http`); its children are the engine and the cache
service. Each sample reads resident memory (split into private, file and
shared-memory pages), open descriptors and threads of every process, and the
`/dev/shm` segments those processes own. Nothing here talks to the server.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from asynchicache.common.liveness import live_processes
from asynchicache.common.shm import SHM_DIR, list_segments, owner_pid

TITLE_PREFIX = "asynchicache: "
_TCP_LISTEN = "0A"


@dataclass(frozen=True)
class ProcSample:
    """One process at one moment (bytes)."""

    pid: int
    role: str  # "http", "engine", "cache-service", or the command line of anything else
    rss: int
    anon: int  # private memory: what leaks show up in
    shmem: int  # touched pages of shared memory (the L2 pool): bounded by the pool size
    open_files: int
    threads: int


@dataclass(frozen=True)
class ServerSample:
    """Every process of one server, and its shared-memory segments, at time `t`."""

    t: float
    procs: tuple[ProcSample, ...]
    shm_segments: int
    shm_bytes: int

    def total(self, field: str) -> int:
        return sum(getattr(p, field) for p in self.procs)

    def by_role(self) -> dict[str, ProcSample]:
        return {p.role: p for p in self.procs}


def listening_pid(port: int) -> int | None:
    """The pid holding a listening TCP socket on `port` (any address), or None."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(proc.name)
        except OSError:  # gone, or not ours to read
            continue
    return None


def _listening_inodes(port: int) -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == _TCP_LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(inode)
    return found


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (children first found through /proc/*/stat)."""
    parent_of = {child: parent for child, (parent, _) in live_processes().items()}
    out, frontier = [pid], [pid]
    while frontier:
        kids = [c for c, p in parent_of.items() if p in frontier]
        out += kids
        frontier = kids
    return out


def role_of(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"
    if cmd.startswith(TITLE_PREFIX):
        return cmd[len(TITLE_PREFIX) :]
    if "multiprocessing.resource_tracker" in cmd:  # the spawn context's helper
        return "resource-tracker"
    return cmd[:60]


def sample_process(pid: int) -> ProcSample | None:
    """Memory, descriptors and threads of `pid`; None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        open_files = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    kb = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssShmem", "Threads"):
            kb[key] = int(value.split()[0])
    return ProcSample(
        pid,
        role_of(pid),
        kb.get("VmRSS", 0) * 1024,
        kb.get("RssAnon", 0) * 1024,
        kb.get("RssShmem", 0) * 1024,
        open_files,
        kb.get("Threads", 0),
    )


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds `pid` has used so far; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command: state is field 3 of proc(5), utime and stime are 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(root_pid: int) -> dict[str, float]:
    """CPU seconds used so far by every process of the tree at `root_pid`, by role."""
    out: dict[str, float] = {}
    for pid in descendants(root_pid):
        seconds = cpu_seconds(pid)
        if seconds is not None:
            role = role_of(pid)
            out[role] = out.get(role, 0.0) + seconds
    return out


def owned_segments(pids: set[int]) -> list[tuple[str, int]]:
    """(name, size) of the /dev/shm segments created by `pids`."""
    out = []
    for name in list_segments():
        if owner_pid(name) in pids:
            try:
                out.append((name, (Path(SHM_DIR) / name).stat().st_size))
            except OSError:
                continue
    return out


class ServerWatch:
    """Samples the processes of the server rooted at `root_pid` (re-found each time, so a
    restarted child is followed)."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid

    @classmethod
    def for_port(cls, port: int) -> ServerWatch:
        pid = listening_pid(port)
        if pid is None:
            raise LookupError(f"no process listens on port {port} (or it is not ours to see)")
        return cls(pid)

    def sample(self, t: float) -> ServerSample:
        pids = descendants(self.root_pid)
        procs = tuple(s for s in map(sample_process, pids) if s is not None)
        segments = owned_segments(set(pids))
        return ServerSample(t, procs, len(segments), sum(size for _, size in segments))
