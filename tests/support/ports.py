"""A free loopback port for a test's server: the suite uses the benches' one definition."""

from __future__ import annotations

from asynchicache.bench.processes.server_process import free_port

__all__ = ["free_port"]
