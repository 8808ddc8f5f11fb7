"""A free loopback port for a test's server (one definition for the suite)."""

from __future__ import annotations

import socket


def free_port(with_bus: bool = False) -> int:
    """A free loopback port (with `with_bus`, port + 10000 free too, for a cluster node's bus).

    Free when probed: a server started on it later may still lose a race for it.
    """
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 < 65536 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
