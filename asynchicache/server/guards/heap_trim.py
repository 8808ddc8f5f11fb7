"""`HeapTrim`: give the heap a big request body left behind back to the system.

glibc's malloc keeps the pages of freed large objects (the body, its JSON, the prompt
text and token lists built from it) in its arenas, so one 8 MiB prompt can leave the
HTTP process hundreds of MiB larger for good. After a request whose body passed
`TRIM_AFTER_BYTES`, `malloc_trim(0)` returns the free pages; it runs in a worker
thread (it walks the arenas: milliseconds) so the event loop never waits on it, and
at most one runs at a time. Where libc has no `malloc_trim` (musl, macOS) it does
nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

TRIM_AFTER_BYTES = 1 << 20  # smaller bodies leave nothing worth a walk of the arenas


def _libc_trim() -> Callable[[], None] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def trim_all() -> None:
        trim(0)  # 0: keep no slack at the top of the heap

    return trim_all


class HeapTrim:
    def __init__(self) -> None:
        self._trim = _libc_trim()
        self._running = False

    async def after(self, body_bytes: int) -> None:
        """Trim once a request with a `body_bytes` body is done (no-op for small ones)."""
        if self._trim is None or body_bytes < TRIM_AFTER_BYTES or self._running:
            return
        self._running = True
        try:
            await asyncio.to_thread(self._trim)
        finally:
            self._running = False
