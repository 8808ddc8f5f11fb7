"""A live `asynchicache serve` for the fault, fuzz and security tests: its processes by
role, its stats and metrics, a kill of everything at once, a patient shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
from host_speed import scaled
from processes import children_of, pid_alive, proc_title
from serve_process import ServeProcess

from asynchicache.common.shm import remove_stale_segments

REPO = Path(__file__).resolve().parents[2]
ROLES = ("engine", "cache-service")


# Flags that size L2 (ours and the compat ones, launch/compat_flags.py).
L2_SIZE_FLAGS = frozenset(
    {"--host-cache-gb", "--no-host-cache", "--hiradix_cache_token_num", "--hicache-size",
     "--hicache-ratio", "--cpu_cache_storage_size"}
)  # fmt: skip


class LiveServer(ServeProcess):
    """`python -m asynchicache serve` as a subprocess on a free port, the way users run it.

    Small tiers by default (L1 1,024 tokens, L2 0.1 GB), so a rotating set of
    prompts keeps reading from and writing to the disk tier.
    """

    def __init__(
        self, disk_dir: Path | None, log_path: Path, *extra: str, api_key: str | None = None
    ) -> None:
        self.disk_dir = disk_dir
        self.api_key = api_key
        env = {"PYTHONPATH": str(REPO)}
        if api_key:
            env["ASYNCHICACHE_API_KEY"] = api_key
        disk = ["--disk-cache-dir", str(disk_dir)] if disk_dir else ["--no-disk-cache"]
        flags = [*disk, "--device-cache-tokens", "1024"]
        if not L2_SIZE_FLAGS & set(extra):  # the compat flags refuse a second L2 size
            flags += ["--host-cache-gb", "0.1"]
        super().__init__(log_path, *flags, "--log-level", "info", *extra, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pids(self) -> dict[str, int]:
        """role -> pid of the live children (by process title)."""
        out = {}
        for pid in children_of(self.pid):
            title = proc_title(pid)
            for role in ROLES:
                if title == f"asynchicache: {role}":
                    out[role] = pid
        return out

    def wait_role(self, role: str, not_pid: int | None, timeout_s: float = 60.0) -> int:
        """The pid of `role` once one other than `not_pid` runs (`timeout_s` scaled to this
        host)."""
        timeout_s = scaled(timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid = self.pids().get(role)
            if pid is not None and pid != not_pid:
                return pid
            time.sleep(0.1)
        raise AssertionError(f"no new {role} within {timeout_s}s:\n{self.log_tail()}")

    def client(self, timeout: float = 300.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=scaled(timeout), headers=self.headers)

    def stats(self, integrity: bool = False) -> dict:
        """`/cache/stats`; with `integrity`, waits out the scans' rate limit (429)."""
        for _ in range(60):
            r = httpx.get(
                self.url + "/cache/stats",
                params={"integrity": "true"} if integrity else None,
                headers=self.headers,
                timeout=scaled(30),
            )
            if r.status_code != 429:
                break
            time.sleep(float(r.headers.get("Retry-After", "1")))
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[str, float]:
        """The /metrics samples: 'name{labels}' -> value."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=scaled(30)).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def kill_all(self) -> list[int]:
        """kill -9 of every process of the server at once (frozen first: nobody cleans up)."""
        pids = [*self.pids().values(), self.pid]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(30)
        deadline = time.monotonic() + 30
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        return pids

    def shutdown(self) -> int | None:
        """SIGTERM and wait (SIGKILL if it hangs); the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        children = list(self.pids().values())
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.kill_all()
            code = None
        deadline = time.monotonic() + 30
        while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        remove_stale_segments()  # a segment of a killed engine (kill_all paths)
        return code


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """One sample of `metrics()`; 0 when absent (a counter not yet exported)."""
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return samples.get(key, 0.0)


def corrupt_detected(server: LiveServer) -> float:
    name = "asynchicache_storage_corrupt_pages_detected_total"
    return metric(server.metrics(), name, tier="disk")
