"""The two vLLM servers with our connector on the tiny model, shared by the session.

`a` and `b` each have their own disk folder and cache service, as two machines
would be, and one Redis between them. L2 is kept small (244 pages) so that a
few other prompts push a prompt out of it. A vLLM start is the expensive part
of these tests (~30 CPU-seconds: three processes import vLLM and torch), so
`b` goes on from test to test: test_connector.py runs all its tests on the
pair; test_restart.py stops it and starts a new `b` process over the same
folder (`new`), which test_shared_service.py then takes as the first of two
instances on one service. Tests keep apart by their prompts (their own seeds)
and salts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from redis_server import RedisServer
from shm_leftovers import snapshot
from vllm_helpers import CONNECTOR, connector_config, server, start_all

from asynchicache.bench.processes.vllm_process import VllmFlags, VllmServer

NAMES = ("a", "b")


@dataclass
class TinyPair:
    """Starts `a` and `b` when a test first asks for them; `stop` before starting others
    (at most two vLLM servers run at once)."""

    model: Path
    root: Path
    redis: RedisServer
    running: dict[str, VllmServer] = field(default_factory=dict, init=False)
    # /dev/shm as it was before each one's process was made: what it leaves is new
    shm_before: dict[str, set[str]] = field(default_factory=dict, init=False)
    starts: int = field(default=0, init=False)

    def flags(self, name: str) -> VllmFlags:
        # a tiny model recomputes faster than most loads pay: test the tiers' mechanics
        extra = connector_config(
            self.disk(name),
            self.socket(name),
            4_000_000 / 2**30,
            remote_url=self.redis.url,
            load_policy="always",
        )
        return VllmFlags(
            self.model, kv_cache_bytes=32 << 20, connector=CONNECTOR, extra_config=extra
        )

    def disk(self, name: str) -> Path:
        return self.root / name / "kv"

    def socket(self, name: str) -> str:
        return f"ipc://{self.root / name / 'run' / 'cache.sock'}"

    def servers(self) -> tuple[VllmServer, VllmServer]:
        """`a` and `b`, started side by side where they do not run."""
        missing = [n for n in NAMES if not self.runs(n)]
        if missing:
            try:
                start_all([self.new(n) for n in missing])
            except BaseException:
                self.stop(*missing)
                raise
        return self.running["a"], self.running["b"]

    def server(self, name: str) -> VllmServer:
        """`name` alone, started if it does not run."""
        if not self.runs(name):
            try:
                self.new(name).start()
            except BaseException:
                self.stop(name)
                raise
        return self.running[name]

    def new(self, name: str) -> VllmServer:
        """A new vLLM process for `name` (its flags, its folder), not started yet, in place
        of the one before (stopped first). The pair stops it with the others."""
        self.stop(name)
        self.starts += 1
        self.shm_before[name] = snapshot()
        made = server(self.flags(name), self.root / f"{name}-{self.starts}.log")
        self.running[name] = made
        return made

    def runs(self, name: str) -> bool:
        s = self.running.get(name)
        return s is not None and s.proc is not None and s.proc.poll() is None

    def stop(self, *names: str) -> None:
        """Stop `names` (every one when none is named)."""
        for name in names or tuple(self.running):
            s = self.running.pop(name, None)
            if s is not None:
                s.stop()
