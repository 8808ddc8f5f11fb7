"""Counting into a backend's `BackendStats` from several threads."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from asynchicache.storage.base import BackendStats


def add_counts(stats: BackendStats, lock: threading.Lock, deltas: Mapping[str, int]) -> None:
    """Add `deltas` to `stats` under `lock`: a named field when it has one, else `extra`."""
    with lock:
        for name, delta in deltas.items():
            if hasattr(stats, name):
                setattr(stats, name, getattr(stats, name) + delta)
            else:
                stats.extra[name] = stats.extra.get(name, 0.0) + delta
