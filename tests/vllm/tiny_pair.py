"""The two vLLM servers with our connector on the tiny model, shared by the session.

`a` and `b` each have their own disk folder and cache service, as two machines
would be, and one Redis between them. L2 is kept small (244 pages) so that a
few other prompts push a prompt out of it. A vLLM start is the expensive part
of these tests (~30 CPU-seconds): test_connector.py runs all its tests on one
pair, and test_restart.py takes `b` as the vLLM it restarts. Tests keep apart
by their prompts (their own seeds) and salts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from redis_server import RedisServer
from vllm_helpers import CONNECTOR, server, start_all

from asynchicache.bench.vllm_process import VllmFlags, VllmServer


@dataclass
class TinyPair:
    """Starts `a` and `b` when a test first asks for them; `stop` before starting others
    (at most two vLLM servers run at once)."""

    model: Path
    root: Path
    redis: RedisServer
    running: tuple[VllmServer, VllmServer] | None = field(default=None, init=False)
    starts: int = field(default=0, init=False)

    def flags(self, name: str) -> VllmFlags:
        extra = {
            "disk_cache_dir": str(self.disk(name)),
            "cache_service": self.socket(name),
            "remote_url": self.redis.url,
            "host_cache_gb": 4_000_000 / 2**30,
            # a loaded test machine must not turn hits into misses
            "lookup_timeout_s": 5.0,
            "prefetch_timeout_s": 30.0,
        }
        return VllmFlags(
            self.model, kv_cache_bytes=32 << 20, connector=CONNECTOR, extra_config=extra
        )

    def disk(self, name: str) -> Path:
        return self.root / name / "kv"

    def socket(self, name: str) -> str:
        return f"ipc://{self.root / name / 'run' / 'cache.sock'}"

    def servers(self) -> tuple[VllmServer, VllmServer]:
        """`a` and `b`, started side by side if they are not running."""
        if self.running is None:
            self.starts += 1
            made = tuple(
                server(self.flags(n), self.root / f"{n}-{self.starts}.log") for n in ("a", "b")
            )
            try:
                start_all(made)
            except BaseException:
                for s in made:
                    s.stop()
                raise
            self.running = (made[0], made[1])
        return self.running

    def stop(self) -> None:
        if self.running is not None:
            for s in self.running:
                s.stop()
            self.running = None
